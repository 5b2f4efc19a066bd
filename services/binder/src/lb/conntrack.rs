//! Forgetting UDP flows that NAT would now send elsewhere.
//!
//! NAT happens on the first packet of a flow only; the conntrack entry then carries every later
//! packet the way that packet went. A UDP client (a DNS resolver) keeps its flow alive as long as
//! it sends, so:
//!
//! - after its member leaves, it would keep sending into the void until it paused for the UDP
//!   timeout: the entries to gone members are deleted, and its next packet chooses again;
//! - when a Service destination gets its first members, packets the client sent before (when no
//!   rule caught them: the Service did not exist yet) left an entry without NAT, which would keep
//!   it from the new rules: those entries are deleted too — only those, recognised by a reply
//!   coming from the destination itself (for node ports, its port: the node's address varies).
//!
//! TCP needs none of this: a connection to a gone member fails and the client reconnects, and one
//! refused before the Service existed is over.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use tokio::process::Command;

use super::model::{Backend, Proto, Service};

/// Where UDP flows went: an address and port (cluster IP, external address), or a node port on
/// any local address of a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dest {
    Addr(IpAddr, u16),
    NodePort { ipv4: bool, port: u16 },
}

impl Dest {
    fn ipv4(&self) -> bool {
        match self {
            Dest::Addr(ip, _) => ip.is_ipv4(),
            Dest::NodePort { ipv4, .. } => *ipv4,
        }
    }
}

/// UDP flows to delete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Flow {
    /// Flows to `dest` that NAT sent to `backend`, which is gone.
    ToMember { dest: Dest, backend: Backend },
    /// Flows to `dest` that were not NAT'd (they predate its first members).
    Untranslated(Dest),
}

/// Every UDP destination of a Service with the members its traffic may go to.
fn destinations(s: &Service) -> BTreeMap<Dest, BTreeSet<Backend>> {
    let mut out = BTreeMap::new();
    for l in s.listeners.iter().filter(|l| l.proto == Proto::Udp) {
        let mut dests: Vec<Dest> = s.vips.iter().chain(&s.external).map(|ip| Dest::Addr(*ip, l.port)).collect();
        if let Some(port) = l.node_port {
            for ipv4 in [true, false] {
                if s.vips.iter().any(|v| v.is_ipv4() == ipv4) {
                    dests.push(Dest::NodePort { ipv4, port });
                }
            }
        }
        for d in dests {
            let members = l.backends.iter().chain(&l.local).filter(|b| b.addr.is_ipv4() == d.ipv4()).copied();
            out.entry(d).or_insert_with(BTreeSet::new).extend(members);
        }
    }
    out
}

/// The UDP flows to delete when a Service goes from `old` to `new` (either may be absent: a new
/// or a deleted Service). `seen` says whether `old` is really what was programmed before: after
/// a process start nothing is known, and the flows of every Service would look untranslated.
pub fn stale_udp_flows(old: Option<&Service>, new: Option<&Service>, seen: bool) -> Vec<Flow> {
    let before = old.map(destinations).unwrap_or_default();
    let after = new.map(destinations).unwrap_or_default();
    let mut stale = Vec::new();
    for (dest, members) in &before {
        let keep = after.get(dest);
        for b in members.iter().filter(|b| !keep.is_some_and(|k| k.contains(b))) {
            stale.push(Flow::ToMember { dest: *dest, backend: *b });
        }
    }
    if seen {
        for (dest, members) in &after {
            if !members.is_empty() && before.get(dest).is_none_or(BTreeSet::is_empty) {
                stale.push(Flow::Untranslated(*dest));
            }
        }
    }
    stale.sort();
    stale
}

/// The `conntrack -D` arguments selecting a flow.
pub fn delete_args(f: &Flow) -> Vec<String> {
    let dest = match f {
        Flow::ToMember { dest, .. } | Flow::Untranslated(dest) => dest,
    };
    let family = if dest.ipv4() { "ipv4" } else { "ipv6" };
    let mut args: Vec<String> = vec!["-D".into(), "-f".into(), family.into(), "-p".into(), "udp".into()];
    match dest {
        Dest::Addr(ip, port) => {
            args.extend(["--orig-dst".into(), ip.to_string(), "--orig-port-dst".into(), port.to_string()])
        }
        Dest::NodePort { port, .. } => args.extend(["--orig-port-dst".into(), port.to_string()]),
    }
    match (f, dest) {
        (Flow::ToMember { backend, .. }, _) => args.extend([
            "--reply-src".into(),
            backend.addr.to_string(),
            "--reply-port-src".into(),
            backend.port.to_string(),
        ]),
        (Flow::Untranslated(_), Dest::Addr(ip, port)) => {
            args.extend(["--reply-src".into(), ip.to_string(), "--reply-port-src".into(), port.to_string()]);
        }
        (Flow::Untranslated(_), Dest::NodePort { port, .. }) => {
            args.extend(["--reply-port-src".into(), port.to_string()]);
        }
    }
    args
}

/// Deletes the conntrack entries of `flows` with the `conntrack` tool; failures are logged.
pub async fn clear(flows: Vec<Flow>) {
    for f in flows {
        let args = delete_args(&f);
        match Command::new("conntrack").args(&args).output().await {
            // Exit status 1 with "0 flow entries" just means there were none.
            Ok(out) => {
                let text = String::from_utf8_lossy(&out.stderr);
                if !out.status.success() && !text.contains("0 flow entries") {
                    tracing::warn!(flow = ?f, error = %text.trim(), "clearing UDP flows failed");
                } else {
                    tracing::debug!(flow = ?f, "stale UDP flows cleared");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot run conntrack; stale UDP flows stay until they time out")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::model::{Listener, ServiceKey};
    use super::*;

    fn b(a: &str) -> Backend {
        Backend { addr: a.parse().unwrap(), port: 53 }
    }

    fn svc(udp: &[&str], tcp: &[&str]) -> Service {
        let mut dns = Listener::new(Proto::Udp, 53, udp.iter().map(|a| b(a)).collect());
        dns.node_port = Some(30053);
        Service::cluster_ip(
            ServiceKey { namespace: "kube-system".into(), name: "dns".into() },
            vec!["10.96.0.10".parse().unwrap(), "fd00::10".parse().unwrap()],
            vec![dns, Listener::new(Proto::Tcp, 53, tcp.iter().map(|a| b(a)).collect())],
            None,
        )
    }

    fn shown(flows: &[Flow]) -> Vec<String> {
        flows.iter().map(|f| delete_args(f)[2..].join(" ")).collect()
    }

    #[test]
    fn only_udp_flows_to_members_that_left_are_stale() {
        let old = svc(&["10.0.0.1", "10.0.0.2", "fd00::1"], &["10.0.0.1", "10.0.0.2"]);
        let new = svc(&["10.0.0.2"], &["10.0.0.2"]);
        let stale = stale_udp_flows(Some(&old), Some(&new), true);
        assert_eq!(
            shown(&stale),
            [
                "ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53 --reply-src 10.0.0.1 --reply-port-src 53",
                "ipv6 -p udp --orig-dst fd00::10 --orig-port-dst 53 --reply-src fd00::1 --reply-port-src 53",
                "ipv6 -p udp --orig-port-dst 30053 --reply-src fd00::1 --reply-port-src 53",
                "ipv4 -p udp --orig-port-dst 30053 --reply-src 10.0.0.1 --reply-port-src 53",
            ]
        );
        assert_eq!(stale_udp_flows(Some(&old), None, true).len(), 6, "a deleted Service: all its UDP flows");
        let fewer = svc(&["10.0.0.2", "fd00::1"], &[]);
        assert!(stale_udp_flows(Some(&fewer), Some(&old), true).is_empty(), "members added: nothing stale");
    }

    #[test]
    fn first_members_clear_untranslated_flows_once_the_old_state_is_known() {
        let empty = svc(&[], &[]);
        let one = svc(&["10.0.0.1"], &[]);
        let want = [
            "ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53 --reply-src 10.96.0.10 --reply-port-src 53",
            "ipv4 -p udp --orig-port-dst 30053 --reply-port-src 30053",
        ];
        assert_eq!(shown(&stale_udp_flows(Some(&empty), Some(&one), true)), want);
        assert_eq!(shown(&stale_udp_flows(None, Some(&one), true)), want, "a new Service");
        assert!(stale_udp_flows(None, Some(&one), false).is_empty(), "after a restart nothing is known");
        assert!(stale_udp_flows(Some(&one), Some(&svc(&["10.0.0.1", "10.0.0.2"], &[])), true).is_empty());
    }
}
