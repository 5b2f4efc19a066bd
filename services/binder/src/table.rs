//! The node's nftables table `inet kuryr`: its fixed part (the skeleton), shared by the two
//! writers that fill it — the Service dataplane ([`crate::lb`]: cluster IPs, node ports, external
//! addresses) and host ports ([`crate::hostport`]). Each writer owns its own maps, sets and chains
//! and touches nothing else; both write the skeleton first in each full rebuild, idempotently, so
//! whichever comes first creates the table and the other finds it ready.
//!
//! What a packet meets, in hook order:
//!
//! - **filter prerouting / output (priority -110)**: packets to 127.0.0.0/8 that did not come in
//!   through `lo` are dropped (the kernel would treat them as martians, except on interfaces with
//!   `route_localnet`, which host ports on 127.0.0.1 need on the pods' bridge); Service
//!   destinations without any member are rejected here, before NAT, so that clients are refused
//!   at once (`noep4`/`noep6` by address, `noep_nodeports4`/`6` by node port).
//! - **nat prerouting / output (priority -100)**: `hostports` first (a pod's explicit host port:
//!   by host IP, `hostports4`/`6`, then on any local address, `hostports_any4`/`6`), then
//!   `services`: cluster IPs and external addresses by `address . protocol . port`
//!   (`services4`/`6`), then node ports on any local address but loopback by
//!   `protocol . port` (`nodeports4`/`6`). Each Service map element jumps to the Service port's
//!   chains; lookups are hash lookups, so the cost per packet does not grow with the Services.
//! - **filter forward (priority 0)**: a DNAT'd connection whose member is reached through the
//!   interface it came in on (a pod reaching itself or a neighbour through a Service on the same
//!   bridge) is marked for masquerading, so that the reply comes back through the node.
//! - **nat postrouting (priority 100)**: masquerade what is marked (hairpin, and external traffic
//!   under `externalTrafficPolicy: Cluster`), and DNAT'd connections from 127.0.0.0/8 (the node
//!   reaching a host port on localhost: the pod could not answer 127.0.0.1).
//!
//! `pod_ifaces` holds the interfaces the node's pods come in through (their bridges): traffic
//! from them to a node port or external address of a Service with `externalTrafficPolicy:
//! Local` is not "external" and may go to any member, as kube-proxy treats it.

use std::fmt::Write as _;

/// The table, family `inet`.
pub const TABLE: &str = "kuryr";

/// The packet mark bit that asks the NAT postrouting hook to masquerade.
pub const MASQUERADE_MARK: u32 = 0x0000_8000;

/// The maps and sets the Service dataplane fills (flushed and refilled by its full sync).
pub const SERVICE_MAPS: [(&str, &str); 8] = [
    ("map", "services4"),
    ("map", "services6"),
    ("set", "noep4"),
    ("set", "noep6"),
    ("map", "nodeports4"),
    ("map", "nodeports6"),
    ("set", "noep_nodeports4"),
    ("set", "noep_nodeports6"),
];

/// The maps and sets host ports fill.
pub const HOSTPORT_MAPS: [(&str, &str); 5] = [
    ("map", "hostports4"),
    ("map", "hostports6"),
    ("map", "hostports_any4"),
    ("map", "hostports_any6"),
    ("set", "pod_ifaces"),
];

/// Writes the fixed part of the table: created if missing, maps and sets declared (their
/// elements kept), base and dispatch chains rewritten (so that an upgrade changes them too).
/// Idempotent; part of a transaction, so packets see the old rules or the new ones.
pub fn skeleton(out: &mut String) {
    let t = format!("inet {TABLE}");
    let _ = writeln!(out, "add table {t}");
    let declarations = [
        ("map", "services4", "ipv4_addr . inet_proto . inet_service : verdict"),
        ("map", "services6", "ipv6_addr . inet_proto . inet_service : verdict"),
        ("set", "noep4", "ipv4_addr . inet_proto . inet_service"),
        ("set", "noep6", "ipv6_addr . inet_proto . inet_service"),
        ("map", "nodeports4", "inet_proto . inet_service : verdict"),
        ("map", "nodeports6", "inet_proto . inet_service : verdict"),
        ("set", "noep_nodeports4", "inet_proto . inet_service"),
        ("set", "noep_nodeports6", "inet_proto . inet_service"),
        ("map", "hostports4", "ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service"),
        ("map", "hostports6", "ipv6_addr . inet_proto . inet_service : ipv6_addr . inet_service"),
        ("map", "hostports_any4", "inet_proto . inet_service : ipv4_addr . inet_service"),
        ("map", "hostports_any6", "inet_proto . inet_service : ipv6_addr . inet_service"),
        ("set", "pod_ifaces", "ifname"),
    ];
    for (kind, name, ty) in declarations {
        let _ = writeln!(out, "add {kind} {t} {name} {{ type {ty}; }}");
    }
    // Priorities: DNAT at the usual dstnat priority (-100); the filtering of what has no member
    // (and of martian loopback traffic) before it (-110), so nothing else gets to see those
    // packets first.
    let hooks = [
        ("nat_prerouting", "type nat hook prerouting priority -100; policy accept;"),
        ("nat_output", "type nat hook output priority -100; policy accept;"),
        ("nat_postrouting", "type nat hook postrouting priority 100; policy accept;"),
        ("filter_prerouting", "type filter hook prerouting priority -110; policy accept;"),
        ("filter_output", "type filter hook output priority -110; policy accept;"),
        ("filter_forward", "type filter hook forward priority 0; policy accept;"),
    ];
    let regular = ["hostports", "services", "no_endpoints"];
    for (name, spec) in hooks {
        let _ = writeln!(out, "add chain {t} {name} {{ {spec} }}");
    }
    for name in regular {
        let _ = writeln!(out, "add chain {t} {name}");
    }
    for name in hooks.iter().map(|(n, _)| *n).chain(regular) {
        let _ = writeln!(out, "flush chain {t} {name}");
    }
    let mark = format!("{MASQUERADE_MARK:#010x}");
    let node_port4 = "fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport";
    let node_port6 = "fib daddr type local ip6 daddr != ::1 meta l4proto . th dport";
    // Filter hooks see every packet, not only a connection's first: the set lookup comes first,
    // so that only packets to a node port without members pay for a FIB lookup.
    let noep = [
        "ip daddr . meta l4proto . th dport @noep4 goto no_endpoints".to_string(),
        "ip6 daddr . meta l4proto . th dport @noep6 goto no_endpoints".to_string(),
        "meta l4proto . th dport @noep_nodeports4 ip daddr != 127.0.0.0/8 fib daddr type local goto no_endpoints"
            .to_string(),
        "meta l4proto . th dport @noep_nodeports6 ip6 daddr != ::1 fib daddr type local goto no_endpoints".to_string(),
    ];
    let mut rules: Vec<(&str, String)> = vec![
        ("nat_prerouting", "jump hostports".into()),
        ("nat_prerouting", "jump services".into()),
        ("nat_output", "jump hostports".into()),
        ("nat_output", "jump services".into()),
        ("hostports", "dnat ip to ip daddr . meta l4proto . th dport map @hostports4".into()),
        ("hostports", "dnat ip6 to ip6 daddr . meta l4proto . th dport map @hostports6".into()),
        (
            "hostports",
            "meta nfproto ipv4 fib daddr type local dnat ip to meta l4proto . th dport map @hostports_any4".into(),
        ),
        // The node's ::1 cannot be translated to a pod address (IPv6 has no route_localnet).
        (
            "hostports",
            "fib daddr type local ip6 daddr != ::1 dnat ip6 to meta l4proto . th dport map @hostports_any6".into(),
        ),
        ("services", "ip daddr . meta l4proto . th dport vmap @services4".into()),
        ("services", "ip6 daddr . meta l4proto . th dport vmap @services6".into()),
        ("services", format!("{node_port4} vmap @nodeports4")),
        ("services", format!("{node_port6} vmap @nodeports6")),
        ("filter_prerouting", "iifname != \"lo\" ip daddr 127.0.0.0/8 drop".into()),
    ];
    for r in &noep {
        rules.push(("filter_prerouting", r.clone()));
    }
    for r in &noep {
        rules.push(("filter_output", r.clone()));
    }
    rules.extend([
        ("no_endpoints", "meta l4proto tcp reject with tcp reset".into()),
        ("no_endpoints", "reject".into()),
        (
            "filter_forward",
            format!("ct state new ct status dnat fib daddr . iif oif exists meta mark set meta mark | {mark}"),
        ),
        ("nat_postrouting", format!("meta mark & {mark} == {mark} masquerade")),
        ("nat_postrouting", "ct status dnat ip saddr 127.0.0.0/8 masquerade".into()),
    ]);
    for (chain, rule) in rules {
        let _ = writeln!(out, "add rule {t} {chain} {rule}");
    }
}
