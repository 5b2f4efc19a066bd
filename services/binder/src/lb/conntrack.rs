//! Forgetting UDP flows to members that are gone.
//!
//! NAT happens on the first packet of a flow only; the conntrack entry then carries every later
//! packet to the member chosen then. A UDP client (a DNS resolver) keeps its flow alive as long
//! as it sends, so after its member leaves it would keep sending into the void until it paused
//! for the UDP timeout. Deleting those entries makes its next packet choose again. TCP needs
//! none of this: the connection to a gone member fails and the client reconnects.

use std::net::IpAddr;

use tokio::process::Command;

use super::model::{Backend, Proto, Service};

/// A UDP flow from a VIP and port to a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Flow {
    pub vip: IpAddr,
    pub port: u16,
    pub backend: Backend,
}

/// The UDP flows `old` had that `new` (None: deleted) no longer has.
pub fn stale_udp_flows(old: Option<&Service>, new: Option<&Service>) -> Vec<Flow> {
    let flows = |s: Option<&Service>| -> Vec<Flow> {
        let Some(s) = s else { return Vec::new() };
        let mut out = Vec::new();
        for l in s.listeners.iter().filter(|l| l.proto == Proto::Udp) {
            for vip in &s.vips {
                for b in l.backends.iter().filter(|b| b.addr.is_ipv4() == vip.is_ipv4()) {
                    out.push(Flow { vip: *vip, port: l.port, backend: *b });
                }
            }
        }
        out
    };
    let keep = flows(new);
    let mut stale: Vec<Flow> = flows(old).into_iter().filter(|f| !keep.contains(f)).collect();
    stale.sort();
    stale
}

/// Deletes the conntrack entries of `flows` with the `conntrack` tool; failures are logged.
pub async fn clear(flows: Vec<Flow>) {
    for f in flows {
        let family = if f.vip.is_ipv4() { "ipv4" } else { "ipv6" };
        let args = [
            "-D".to_string(),
            "-f".into(),
            family.into(),
            "-p".into(),
            "udp".into(),
            "--orig-dst".into(),
            f.vip.to_string(),
            "--orig-port-dst".into(),
            f.port.to_string(),
            "--reply-src".into(),
            f.backend.addr.to_string(),
            "--reply-port-src".into(),
            f.backend.port.to_string(),
        ];
        match Command::new("conntrack").args(&args).output().await {
            // Exit status 1 with "0 flow entries" just means there were none.
            Ok(out) => {
                let text = String::from_utf8_lossy(&out.stderr);
                if !out.status.success() && !text.contains("0 flow entries") {
                    tracing::warn!(vip = %f.vip, port = f.port, member = %f.backend.addr, error = %text.trim(), "clearing UDP flows failed");
                } else {
                    tracing::debug!(vip = %f.vip, port = f.port, member = %f.backend.addr, "UDP flows to a gone member cleared");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot run conntrack; UDP flows to gone members stay until they time out")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::model::{Listener, ServiceKey};
    use super::*;

    fn svc(udp: &[&str], tcp: &[&str]) -> Service {
        let b = |a: &&str| Backend { addr: a.parse().unwrap(), port: 53 };
        Service {
            key: ServiceKey { namespace: "kube-system".into(), name: "dns".into() },
            uid: String::new(),
            generation: 1,
            vips: vec!["10.96.0.10".parse().unwrap(), "fd00::10".parse().unwrap()],
            listeners: vec![
                Listener { proto: Proto::Udp, port: 53, backends: udp.iter().map(b).collect() },
                Listener { proto: Proto::Tcp, port: 53, backends: tcp.iter().map(b).collect() },
            ],
            affinity: None,
        }
    }

    #[test]
    fn only_udp_flows_to_members_that_left_are_stale() {
        let old = svc(&["10.0.0.1", "10.0.0.2", "fd00::1"], &["10.0.0.1", "10.0.0.2"]);
        let new = svc(&["10.0.0.2"], &["10.0.0.2"]);
        let stale = stale_udp_flows(Some(&old), Some(&new));
        let got: Vec<(String, String)> =
            stale.iter().map(|f| (f.vip.to_string(), f.backend.addr.to_string())).collect();
        assert_eq!(got, [("10.96.0.10".to_string(), "10.0.0.1".to_string()), ("fd00::10".into(), "fd00::1".into())]);
        assert_eq!(stale_udp_flows(Some(&old), None).len(), 3, "a deleted Service: all its UDP flows");
        assert!(stale_udp_flows(None, Some(&new)).is_empty());
        assert!(stale_udp_flows(Some(&new), Some(&old)).is_empty(), "members added: nothing stale");
    }
}
