//! The calling side: every call to another kuryr service carries `authorization: Bearer
//! <token>`, the token read from a file — in a cluster a projected ServiceAccount token with
//! the kuryr audience, which the kubelet rotates in place. The file is read again every
//! [`RELOAD`], so a rotated token is picked up without a restart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// How often the token file is read again. The kubelet replaces a projected token when 80% of
/// its lifetime (at least 10 minutes) has passed, so a token read this long ago is still valid.
pub const RELOAD: Duration = Duration::from_secs(30);

/// A channel whose calls carry the caller's credentials.
pub type PeerChannel = InterceptedService<Channel, Credentials>;

#[derive(Debug, Default)]
struct Cached {
    header: Option<MetadataValue<Ascii>>,
    read_at: Option<Instant>,
    /// The last problem logged, so that it is logged once, not per call.
    problem: Option<String>,
}

/// A token in a file, read again every [`RELOAD`].
#[derive(Clone, Debug)]
pub struct TokenFile {
    path: PathBuf,
    cached: Arc<Mutex<Cached>>,
}

impl TokenFile {
    /// The token in `path`; not read until first needed.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into(), cached: Arc::default() }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `Bearer <token>`, or `None` while the file is missing, empty or not a token (logged
    /// once: the server then answers UNAUTHENTICATED, which says the rest).
    pub fn header(&self) -> Option<MetadataValue<Ascii>> {
        let mut c = self.cached.lock().unwrap_or_else(PoisonError::into_inner);
        if c.read_at.is_some_and(|t| t.elapsed() < RELOAD) {
            return c.header.clone();
        }
        c.read_at = Some(Instant::now());
        let read = std::fs::read_to_string(&self.path)
            .map_err(|e| format!("cannot read the token file {}: {e}", self.path.display()))
            .and_then(|t| {
                let t = t.trim();
                if t.is_empty() {
                    return Err(format!("the token file {} is empty", self.path.display()));
                }
                MetadataValue::try_from(format!("Bearer {t}"))
                    .map_err(|_| format!("the token file {} does not hold a token", self.path.display()))
            });
        match read {
            Ok(h) => {
                if c.problem.take().is_some() {
                    tracing::info!(file = %self.path.display(), "token file readable again");
                }
                c.header = Some(h);
            }
            Err(problem) => {
                if c.problem.as_deref() != Some(problem.as_str()) {
                    tracing::warn!(error = problem, "calls to other kuryr services go without a token");
                }
                c.problem = Some(problem);
                c.header = None;
            }
        }
        c.header.clone()
    }
}

/// What a client sends to prove who it is.
#[derive(Clone, Debug)]
pub enum Credentials {
    /// Nothing (`--auth=none`, or talking to something that does not check).
    None,
    /// A ServiceAccount token from a file.
    Token(TokenFile),
    /// A fixed `Bearer <token>` (tools and tests with a token in hand).
    Bearer(MetadataValue<Ascii>),
}

impl Credentials {
    /// A fixed token; an error for one that cannot be a header value.
    pub fn bearer(token: &str) -> anyhow::Result<Self> {
        let v = MetadataValue::try_from(format!("Bearer {}", token.trim()))
            .map_err(|_| anyhow::anyhow!("the token cannot be sent as a header"))?;
        Ok(Self::Bearer(v))
    }
}

impl Interceptor for Credentials {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let header = match self {
            Self::Token(f) => f.header(),
            Self::Bearer(h) => Some(h.clone()),
            Self::None => None,
        };
        if let Some(h) = header {
            req.metadata_mut().insert("authorization", h);
        }
        Ok(req)
    }
}

/// `channel` with every call carrying `credentials`.
pub fn with_credentials(channel: Channel, credentials: Credentials) -> PeerChannel {
    InterceptedService::new(channel, credentials)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn reads_trims_and_reports_missing_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let f = TokenFile::new(&path);
        assert_eq!(f.header(), None);
        std::fs::write(&path, "abc.def.ghi\n").unwrap();
        // Cached until RELOAD passes.
        assert_eq!(f.header(), None);
        let f = TokenFile::new(&path);
        assert_eq!(f.header().unwrap(), "Bearer abc.def.ghi");
        let mut c = Credentials::Token(f);
        let req = c.call(tonic::Request::new(())).unwrap();
        assert_eq!(req.metadata().get("authorization").unwrap(), "Bearer abc.def.ghi");
        let req = Credentials::None.call(tonic::Request::new(())).unwrap();
        assert!(req.metadata().get("authorization").is_none());
    }
}
