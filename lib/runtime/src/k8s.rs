//! Connecting to the Kubernetes API (with the `kube` feature).
//!
//! Every call has a deadline: a stalled or stopped API server (or a silent partition) makes calls
//! fail after [`READ_TIMEOUT`] instead of holding a worker forever; the callers retry as for any
//! other failure. Watches are ended by the API server after [`WATCH_TIMEOUT_SECS`] and reopened,
//! so a healthy but quiet watch never runs into the read timeout.

use std::path::Path;
use std::time::Duration;

/// Connecting to the API server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest silence while an answer is due: from a request sent to the first byte of the
/// answer, and between bytes after that.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Sending a request.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the API server keeps one watch call open (its `timeoutSeconds`); below
/// [`READ_TIMEOUT`], so that a watch with nothing to report ends (and is reopened) before the read
/// timeout would take it for a dead server.
pub const WATCH_TIMEOUT_SECS: u32 = 25;

/// Builds a Kubernetes client from a kubeconfig file, or from the environment (in-cluster
/// service account, then `$KUBECONFIG`) when none is given, with the timeouts above.
pub async fn kube_client(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
    // kube's rustls needs a process-wide crypto provider; installing twice is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("reading kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    config.read_timeout = Some(READ_TIMEOUT);
    config.write_timeout = Some(WRITE_TIMEOUT);
    // Count the read timeout from the request, not from when a pooled connection went idle.
    config.reset_reader_on_write = true;
    Ok(kube::Client::try_from(config)?)
}

/// The watcher configuration every kuryr watch starts from: watch calls of
/// [`WATCH_TIMEOUT_SECS`].
pub fn watch_config() -> kube::runtime::watcher::Config {
    kube::runtime::watcher::Config::default().timeout(WATCH_TIMEOUT_SECS)
}

/// How a controller reads a failed API call.
#[derive(Debug)]
pub enum ApiFailure {
    /// 404: the object does not exist. Holds "`action`: not found".
    NotFound(String),
    /// 409, changed since read; or 422 from a JSON patch, a `test` failed. Holds "`action`: why".
    Conflict(String),
    /// Anything else, with what was being done.
    Other {
        /// What was being done.
        action: String,
        /// The client's error.
        source: kube::Error,
    },
}

/// Implements `From<ApiFailure>` for a service's error enum that has the variants
/// `NotFound(String)`, `Conflict(String)` and
/// `Api { action: String, source: Box<dyn Error + Send + Sync> }`: how a controller's cluster
/// layer keeps the sorting of failed API calls.
#[macro_export]
macro_rules! from_api_failure {
    ($error:ty) => {
        impl From<$crate::k8s::ApiFailure> for $error {
            fn from(f: $crate::k8s::ApiFailure) -> Self {
                match f {
                    $crate::k8s::ApiFailure::NotFound(m) => Self::NotFound(m),
                    $crate::k8s::ApiFailure::Conflict(m) => Self::Conflict(m),
                    $crate::k8s::ApiFailure::Other { action, source } => Self::Api { action, source: Box::new(source) },
                }
            }
        }
    };
}

impl ApiFailure {
    /// Sorts `e`, the failure of `action`.
    #[must_use]
    pub fn of(action: String, e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) if s.is_not_found() => ApiFailure::NotFound(format!("{action}: not found")),
            kube::Error::Api(s) if s.is_conflict() || s.code == 422 => {
                ApiFailure::Conflict(format!("{action}: {}", s.message))
            }
            source => ApiFailure::Other { action, source },
        }
    }
}
