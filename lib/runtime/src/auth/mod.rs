//! Who may call what.
//!
//! Every gRPC call but health and reflection passes a [`Gate`] before it reaches the service: the
//! gate looks at how the caller came in ([`Peer`]: a unix socket with the kernel's `SO_PEERCRED`
//! credentials, or TCP) and at its `authorization` header, and either names the [`Caller`] —
//! put into the request's extensions, where handlers find it with [`caller`] — or refuses the
//! call with UNAUTHENTICATED (no or bad credentials) or PERMISSION_DENIED (a known caller without
//! the right). Health and reflection stay open so that probes and grpcurl keep working.
//!
//! - [`local`]: callers on a unix socket, checked by their uid/gid (the binder's CNI socket).
//! - [`rules`]: which ServiceAccounts may call which methods.
//! - `token` (feature `kube`): ServiceAccount tokens checked with TokenReview, cached.
//! - [`client`]: the other side: a token read from a (projected) file, sent with every call.

pub mod client;
pub mod local;
pub mod rules;
#[cfg(feature = "kube")]
pub mod token;

use std::fmt;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tonic::Status;
use tonic::transport::server::{TcpConnectInfo, UdsConnectInfo};

pub use rules::{AccountRef, Rules};

/// The gRPC services every server keeps open: health checks (probes, grpcurl) and reflection
/// (grpcurl's `list` and `describe`). They reveal the contracts, never data.
pub const OPEN_SERVICES: &[&str] =
    &["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"];

/// Whether `path` (`/package.Service/Method`) belongs to an [open service](OPEN_SERVICES).
pub fn is_open(path: &str) -> bool {
    let service = path.trim_start_matches('/').split('/').next().unwrap_or_default();
    OPEN_SERVICES.contains(&service)
}

/// A Kubernetes ServiceAccount a token was issued to, as the API server's TokenReview named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    pub namespace: String,
    pub name: String,
    /// The node of the pod (or the Node) the token is bound to, when it is bound to one
    /// (`authentication.kubernetes.io/node-name`).
    pub node: Option<String>,
    /// The pod the token is bound to, if any (`authentication.kubernetes.io/pod-name`).
    pub pod: Option<String>,
}

impl fmt::Display for Account {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "system:serviceaccount:{}:{}", self.namespace, self.name)?;
        if let Some(n) = &self.node {
            write!(f, " (node {n})")?;
        }
        Ok(())
    }
}

/// Who a call comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// A process on this host, by the credentials the kernel reports for its unix socket.
    Local { uid: u32, gid: u32, pid: Option<i32> },
    /// A ServiceAccount, by a token the API server vouched for.
    Account(Account),
    /// Nobody was checked (`--auth=none`, for development only).
    Unchecked,
}

impl Caller {
    /// The node the caller is bound to, if its credentials name one. `None` also for callers
    /// that are not bound (an operator's token) or not checked.
    pub fn node(&self) -> Option<&str> {
        match self {
            Self::Account(a) => a.node.as_deref(),
            _ => None,
        }
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local { uid, gid, pid } => {
                write!(f, "uid {uid} gid {gid}")?;
                if let Some(p) = pid {
                    write!(f, " pid {p}")?;
                }
                Ok(())
            }
            Self::Account(a) => a.fmt(f),
            Self::Unchecked => f.write_str("an unchecked caller (--auth=none)"),
        }
    }
}

/// The credentials of the process at the other end of a unix socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalCred {
    pub uid: u32,
    pub gid: u32,
    pub pid: Option<i32>,
}

/// How the caller reached the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peer {
    /// A unix socket; `None` when the kernel could not tell the credentials.
    Unix(Option<LocalCred>),
    /// TCP, from this address.
    Tcp(Option<SocketAddr>),
    /// Anything else (in-memory transports in tests).
    Other,
}

/// What a gate gets to decide on.
#[derive(Clone, Debug)]
pub struct Call {
    /// `/package.Service/Method`.
    pub path: String,
    /// The `authorization` header, if sent.
    pub authorization: Option<http::HeaderValue>,
    pub peer: Peer,
}

impl Call {
    /// The bearer token of the `authorization` header: `None` when there is no header,
    /// UNAUTHENTICATED when there is one of another form.
    pub fn bearer(&self) -> Result<Option<&str>, Status> {
        let Some(v) = &self.authorization else { return Ok(None) };
        let v = v.to_str().map_err(|_| Status::unauthenticated("authorization: not valid text"))?;
        let (scheme, token) = v.split_once(' ').unwrap_or((v, ""));
        if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
            return Err(Status::unauthenticated("authorization: expected `Bearer <ServiceAccount token>`"));
        }
        Ok(Some(token.trim()))
    }
}

/// Decides whether a call may proceed, and who makes it.
pub trait Gate: Send + Sync + fmt::Debug + 'static {
    /// Admits `call` as a [`Caller`], or refuses it with UNAUTHENTICATED or PERMISSION_DENIED.
    fn admit(&self, call: Call) -> BoxFuture<'static, Result<Caller, Status>>;
}

/// Refuses every call (but the open services): what a server has until it is told who may call.
#[derive(Debug, Default)]
pub struct DenyAll;

impl Gate for DenyAll {
    fn admit(&self, call: Call) -> BoxFuture<'static, Result<Caller, Status>> {
        Box::pin(async move { Err(Status::permission_denied(format!("{}: no caller may use this method", call.path))) })
    }
}

/// Admits everyone unchecked: `--auth=none`, for development only.
#[derive(Debug, Default)]
pub struct Insecure;

impl Gate for Insecure {
    fn admit(&self, _: Call) -> BoxFuture<'static, Result<Caller, Status>> {
        Box::pin(async { Ok(Caller::Unchecked) })
    }
}

/// The caller of a request the [`AuthLayer`] admitted; `None` outside such a server.
pub fn caller<T>(req: &tonic::Request<T>) -> Option<&Caller> {
    req.extensions().get::<Caller>()
}

/// A tower layer that puts every call but the open ones through a [`Gate`].
#[derive(Clone, Debug)]
pub struct AuthLayer(pub Arc<dyn Gate>);

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthService { inner, gate: self.0.clone() }
    }
}

/// See [`AuthLayer`].
#[derive(Clone, Debug)]
pub struct AuthService<S> {
    inner: S,
    gate: Arc<dyn Gate>,
}

fn peer_of<B>(req: &http::Request<B>) -> Peer {
    if let Some(u) = req.extensions().get::<UdsConnectInfo>() {
        return Peer::Unix(u.peer_cred.map(|c| LocalCred { uid: c.uid(), gid: c.gid(), pid: c.pid() }));
    }
    if let Some(t) = req.extensions().get::<TcpConnectInfo>() {
        return Peer::Tcp(t.remote_addr());
    }
    Peer::Other
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for AuthService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Default,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<ReqBody>) -> Self::Future {
        if is_open(req.uri().path()) {
            return Box::pin(self.inner.call(req));
        }
        // The clone that was polled ready serves this call; the fresh one waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let call = Call {
            path: req.uri().path().to_string(),
            authorization: req.headers().get(http::header::AUTHORIZATION).cloned(),
            peer: peer_of(&req),
        };
        let admitted = self.gate.admit(call);
        Box::pin(async move {
            match admitted.await {
                Ok(caller) => {
                    req.extensions_mut().insert(caller);
                    inner.call(req).await
                }
                Err(status) => Ok(status.into_http()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn open_paths() {
        assert!(is_open("/grpc.health.v1.Health/Check"));
        assert!(is_open("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"));
        assert!(!is_open("/kuryr.binder.v1.Cni/Add"));
        assert!(!is_open("/grpc.health.v1.HealthX/Check"));
        assert!(!is_open(""));
    }

    #[test]
    fn bearer_tokens() {
        let call = |h: Option<&str>| Call {
            path: "/x/y".into(),
            authorization: h.map(|h| http::HeaderValue::from_str(h).unwrap()),
            peer: Peer::Other,
        };
        assert_eq!(call(None).bearer().unwrap(), None);
        assert_eq!(call(Some("Bearer abc")).bearer().unwrap(), Some("abc"));
        assert_eq!(call(Some("bearer  abc ")).bearer().unwrap(), Some("abc"));
        for bad in ["Basic abc", "Bearer", "Bearer   ", "abc"] {
            assert_eq!(call(Some(bad)).bearer().unwrap_err().code(), tonic::Code::Unauthenticated, "{bad}");
        }
    }
}
