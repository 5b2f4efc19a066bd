//! Shared by the policy compiler's integration tests: the reference, random worlds, and the
//! comparison of compiled node states with the reference over every probe.

#![allow(dead_code, clippy::unwrap_used)]

pub mod reference;
pub mod worlds;

use std::collections::BTreeMap;
use std::net::IpAddr;

use kuryr_policy_core::{Compiler, NodePolicy, Protocol, Traffic};
use reference::World;

/// Probes: each protocol on ports policies name, beside them, and a protocol without ports.
pub fn traffics() -> Vec<Traffic> {
    let mut out = vec![Traffic::Other];
    for (p, ports) in [
        (Protocol::Tcp, &[79u16, 80, 81, 85, 90, 91, 8080][..]),
        (Protocol::Udp, &[53, 80, 81][..]),
        (Protocol::Sctp, &[80, 9000][..]),
    ] {
        out.extend(ports.iter().map(|n| Traffic::Port(p, *n)));
    }
    out
}

/// Addresses that are no pod's: outside the pod ranges, and inside them but unassigned.
pub fn externals() -> Vec<IpAddr> {
    ["192.0.2.10", "10.0.1.200", "8.8.8.8", "2001:db8::10", "fd00::1:200"].iter().map(|s| s.parse().unwrap()).collect()
}

/// A compiler fed with the whole world.
pub fn compiler(w: &World) -> Compiler {
    let mut c = Compiler::new();
    for n in &w.namespaces {
        c.upsert_namespace(n.clone());
    }
    for p in &w.policies {
        c.upsert_policy(p.clone());
    }
    for p in &w.pods {
        c.upsert_pod(p.clone());
    }
    c
}

/// Every node's compiled state.
pub fn states(c: &mut Compiler, w: &World) -> BTreeMap<String, NodePolicy> {
    reference::nodes(w).into_keys().map(|n| (n.clone(), c.node_policy(&n))).collect()
}

/// Compares the compiled states of `w` with the reference for every pair of addresses (pods'
/// and external ones) and every probe: per direction on the node that judges it, and end to
/// end over all nodes. Returns the number of decisions compared; panics with the first
/// difference, naming `label`.
pub fn check(w: &World, label: &str) -> usize {
    let mut c = compiler(w);
    let states = states(&mut c, w);
    check_states(w, &states, label)
}

pub fn check_states(w: &World, states: &BTreeMap<String, NodePolicy>, label: &str) -> usize {
    let mut addrs: Vec<IpAddr> = w.pods.iter().flat_map(|p| p.ips.iter().copied()).collect();
    addrs.extend(externals());
    addrs.sort();
    addrs.dedup();
    // A node judges its own pods only.
    for (node, s) in states {
        for ip in s.ingress.keys().chain(s.egress.keys()) {
            let owner = w.pod_at(ip).map(|p| p.node.as_str());
            assert_eq!(owner, Some(node.as_str()), "{label}: {node} judges {ip}, a pod of {owner:?}");
        }
    }
    let none = NodePolicy::default();
    let on = |ip: &IpAddr| w.pod_at(ip).and_then(|p| states.get(&p.node)).unwrap_or(&none);
    let mut n = 0;
    let traffics = traffics();
    for src in &addrs {
        for dst in &addrs {
            if src == dst || src.is_ipv4() != dst.is_ipv4() {
                continue;
            }
            for &t in &traffics {
                let ctx = || format!("{label}: {src} → {dst} {t:?}\n{w:#?}");
                if let Some(sp) = w.pod_at(src) {
                    let want = reference::egress(w, sp, dst, t);
                    let got = on(src).egress_allows(src, dst, t);
                    assert_eq!(got, want, "egress of {}/{} differs: {}", sp.namespace, sp.name, ctx());
                    n += 1;
                }
                if let Some(dp) = w.pod_at(dst) {
                    let want = reference::ingress(w, src, dp, t);
                    let got = on(dst).ingress_allows(src, dst, t);
                    assert_eq!(got, want, "ingress of {}/{} differs: {}", dp.namespace, dp.name, ctx());
                    n += 1;
                }
                if w.pod_at(src).is_some() || w.pod_at(dst).is_some() {
                    let want = reference::connection(w, src, dst, t);
                    let got = states.values().all(|s| s.allows(src, dst, t));
                    assert_eq!(got, want, "the connection differs: {}", ctx());
                    n += 1;
                }
            }
        }
    }
    n
}
