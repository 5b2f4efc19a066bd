//! Callers on a unix socket, admitted by the credentials the kernel took when they connected
//! (`SO_PEERCRED`: the uid, gid and pid of the connecting process), not by anything they send.
//! The socket's file mode is a first fence; this check holds even when the mode is loosened by a
//! mistake (a hostPath shared with pods, a `chmod`), and names the refused process in the log.

use std::sync::Arc;

use futures::future::BoxFuture;
use tonic::Status;

use super::{Call, Caller, Gate, Peer};

/// Admits root and the configured uids and gids on unix sockets; TCP calls go to `remote`, or
/// are refused when there is none.
#[derive(Debug, Clone)]
pub struct LocalCallers {
    uids: Vec<u32>,
    gids: Vec<u32>,
    remote: Option<Arc<dyn Gate>>,
}

impl LocalCallers {
    /// Root, plus the processes running as one of `uids` or with the primary group one of `gids`.
    pub fn new(uids: Vec<u32>, gids: Vec<u32>) -> Self {
        Self { uids, gids, remote: None }
    }

    /// Calls over TCP are decided by `gate` instead of being refused.
    #[must_use]
    pub fn with_remote(mut self, gate: Arc<dyn Gate>) -> Self {
        self.remote = Some(gate);
        self
    }

    fn decide(&self, call: &Call) -> Result<Caller, Status> {
        match &call.peer {
            Peer::Unix(Some(c)) => {
                if c.uid == 0 || self.uids.contains(&c.uid) || self.gids.contains(&c.gid) {
                    Ok(Caller::Local { uid: c.uid, gid: c.gid, pid: c.pid })
                } else {
                    let pid = c.pid.map(|p| format!(" (pid {p})")).unwrap_or_default();
                    tracing::warn!(uid = c.uid, gid = c.gid, pid = c.pid, path = call.path, "refused a local caller");
                    Err(Status::permission_denied(format!(
                        "uid {} gid {}{pid} may not call {}: only root and the configured uids and gids may",
                        c.uid, c.gid, call.path
                    )))
                }
            }
            Peer::Unix(None) => {
                Err(Status::permission_denied("the caller's credentials could not be read from the socket"))
            }
            Peer::Tcp(_) | Peer::Other => Err(Status::permission_denied(format!(
                "{}: served to local callers on the unix socket only",
                call.path
            ))),
        }
    }
}

impl Gate for LocalCallers {
    fn admit(&self, call: Call) -> BoxFuture<'static, Result<Caller, Status>> {
        if let (Peer::Tcp(_), Some(remote)) = (&call.peer, &self.remote) {
            return remote.admit(call);
        }
        let decided = self.decide(&call);
        Box::pin(async move { decided })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::{Insecure, LocalCred};
    use super::*;

    fn unix(uid: u32, gid: u32) -> Call {
        Call {
            path: "/kuryr.binder.v1.Cni/Add".into(),
            authorization: None,
            peer: Peer::Unix(Some(LocalCred { uid, gid, pid: Some(7) })),
        }
    }

    #[tokio::test]
    async fn root_and_configured_ids_only() {
        let g = LocalCallers::new(vec![1000], vec![2000]);
        assert_eq!(g.admit(unix(0, 0)).await.unwrap(), Caller::Local { uid: 0, gid: 0, pid: Some(7) });
        assert!(g.admit(unix(1000, 5)).await.is_ok());
        assert!(g.admit(unix(5, 2000)).await.is_ok());
        let e = g.admit(unix(65534, 65534)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("uid 65534 gid 65534 (pid 7)"), "{}", e.message());
        let no_cred = Call { peer: Peer::Unix(None), ..unix(0, 0) };
        assert_eq!(g.admit(no_cred).await.unwrap_err().code(), tonic::Code::PermissionDenied);
    }

    #[tokio::test]
    async fn tcp_is_refused_unless_a_remote_gate_decides() {
        let tcp = Call { peer: Peer::Tcp(None), ..unix(0, 0) };
        let g = LocalCallers::new(vec![], vec![]);
        assert_eq!(g.admit(tcp.clone()).await.unwrap_err().code(), tonic::Code::PermissionDenied);
        let g = g.with_remote(Arc::new(Insecure));
        assert_eq!(g.admit(tcp).await.unwrap(), Caller::Unchecked);
    }
}
