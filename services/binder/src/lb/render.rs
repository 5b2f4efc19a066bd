//! The nftables ruleset of the node dataplane, as text for one `nft -f` transaction.
//!
//! Everything lives in one table of its own, `inet kuryr`:
//!
//! - verdict maps `services4` / `services6` keyed by `VIP . protocol . port`, looked up from the
//!   NAT prerouting hook (pods) and the NAT output hook (the node itself), `goto` a chain per
//!   Service port and family, `svc/<ns>/<name>/<proto>/<port>/v4|v6`;
//! - that chain spreads new connections evenly over the members with `numgen random mod N` and
//!   an anonymous verdict map, each member a chain `ep/.../<member>/<port>` doing the DNAT;
//! - with client-IP affinity, each member chain also records the client in a dynamic set with a
//!   timeout (`aff/...`), which the Service chain consults before spreading;
//! - a Service port without members is in the sets `noep4` / `noep6`, rejected from the filter
//!   prerouting and output hooks (as kube-proxy does: the client gets "connection refused" at
//!   once instead of a timeout) — TCP with a reset, the rest with ICMP port unreachable. A reset
//!   because the kernel rate-limits ICMP errors per client: a client retrying quickly would
//!   otherwise wait out a SYN retransmission (a second) for its answer;
//! - hairpin: when the member chosen for a forwarded connection is reached through the very
//!   interface the client came in on (both on the node's bridge), the member's reply would go to
//!   the client straight over L2 and never be un-DNAT'd. The forward hook marks those
//!   connections (`fib daddr . iif oif exists`: the route to the member leaves through the
//!   input interface) and the NAT postrouting hook masquerades them, so the reply comes back
//!   through the node.
//!
//! A Service is rendered on its own ([`render`]) into the objects it owns; an update is the
//! difference between what a Service owned and what it owns now ([`delta`]), so its cost does not
//! grow with the number of other Services. [`full`] rebuilds the whole table from the desired
//! Services in one transaction, removing whatever is there and no longer wanted: packets see the
//! old ruleset or the new one, never none.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use super::model::{Backend, Listener, Service};

/// The table, family `inet`.
pub const TABLE: &str = "kuryr";

/// The packet mark bit that asks the NAT postrouting hook to masquerade (hairpin connections).
pub const MASQUERADE_MARK: u32 = 0x0000_8000;

/// Chain and set name prefixes owned by Services; everything else in the table is the fixed
/// skeleton written by [`skeleton`].
const SERVICE_PREFIXES: [&str; 3] = ["svc/", "ep/", "aff/"];

/// The longest name the kernel accepts (NFT_NAME_MAXLEN is 256 with the terminating NUL).
pub const MAX_NAME: usize = 255;

/// Whether a chain or set of the table belongs to a Service (and is rebuilt or removed by a full
/// sync), as opposed to the skeleton.
pub fn is_service_object(name: &str) -> bool {
    SERVICE_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// An element of one of the skeleton's maps or sets.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Element {
    /// `services4`, `services6`, `noep4` or `noep6`.
    pub set: &'static str,
    /// `VIP . proto . port`.
    pub key: String,
    /// The verdict, for the maps.
    pub verdict: Option<String>,
}

/// The objects one Service owns in the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rendered {
    /// Chains by name, with their rules.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Affinity sets by name.
    pub sets: BTreeMap<String, AffinitySet>,
    /// Elements of the skeleton's maps and sets.
    pub elements: Vec<Element>,
}

/// A dynamic set of clients recently sent to one member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AffinitySet {
    pub ipv6: bool,
    /// How long a client stays with the member after its last new connection, in seconds.
    pub timeout: u32,
}

impl std::fmt::Display for AffinitySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ty = if self.ipv6 { "ipv6_addr" } else { "ipv4_addr" };
        write!(f, "{{ type {ty}; flags dynamic,timeout; timeout {}s; }}", self.timeout)
    }
}

/// The Service objects found in the table: chain names, and affinity sets with their timeout.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Existing {
    pub chains: BTreeSet<String>,
    pub sets: BTreeMap<String, Option<u32>>,
}

fn family_tag(ip: &IpAddr) -> &'static str {
    if ip.is_ipv4() { "v4" } else { "v6" }
}

fn l3(ip: &IpAddr) -> &'static str {
    if ip.is_ipv4() { "ip" } else { "ip6" }
}

/// An address as part of an nftables identifier: IPv6 colons become dots.
fn addr_id(ip: &IpAddr) -> String {
    ip.to_string().replace(':', ".")
}

fn dnat_target(b: &Backend) -> String {
    match b.addr {
        IpAddr::V4(a) => format!("{a}:{}", b.port),
        IpAddr::V6(a) => format!("[{a}]:{}", b.port),
    }
}

/// Renders the objects of one Service.
pub fn render(svc: &Service) -> Rendered {
    let mut r = Rendered::default();
    let base = format!("{}/{}", svc.key.namespace, svc.key.name);
    for l in &svc.listeners {
        let lbase = format!("{base}/{}/{}", l.proto.as_str(), l.port);
        for vip in &svc.vips {
            let backends: Vec<&Backend> = l.backends.iter().filter(|b| b.addr.is_ipv4() == vip.is_ipv4()).collect();
            let key = format!("{vip} . {} . {}", l.proto.as_str(), l.port);
            let v4 = vip.is_ipv4();
            if backends.is_empty() {
                r.elements.push(Element { set: if v4 { "noep4" } else { "noep6" }, key, verdict: None });
                continue;
            }
            let chain = format!("svc/{lbase}/{}", family_tag(vip));
            r.elements.push(Element {
                set: if v4 { "services4" } else { "services6" },
                key,
                verdict: Some(format!("goto {chain}")),
            });
            if !r.chains.contains_key(&chain) {
                let rules = service_chain(svc, l, &lbase, &backends, &mut r);
                r.chains.insert(chain, rules);
            }
        }
    }
    r
}

/// The rules of a Service port's chain for one family, adding the member chains and affinity
/// sets it refers to.
fn service_chain(svc: &Service, l: &Listener, lbase: &str, backends: &[&Backend], r: &mut Rendered) -> Vec<String> {
    let mut rules = Vec::new();
    let mut targets = Vec::new();
    for b in backends {
        let id = format!("{lbase}/{}/{}", addr_id(&b.addr), b.port);
        let ep = format!("ep/{id}");
        let mut ep_rules = Vec::new();
        if let Some(timeout) = svc.affinity {
            let set = format!("aff/{id}");
            r.sets.insert(set.clone(), AffinitySet { ipv6: b.addr.is_ipv6(), timeout });
            rules.push(format!("{} saddr @{set} goto {ep}", l3(&b.addr)));
            ep_rules.push(format!("update @{set} {{ {} saddr }}", l3(&b.addr)));
        }
        ep_rules.push(format!("meta l4proto {} dnat {} to {}", l.proto.as_str(), l3(&b.addr), dnat_target(b)));
        r.chains.insert(ep.clone(), ep_rules);
        targets.push(ep);
    }
    if let [only] = targets.as_slice() {
        rules.push(format!("goto {only}"));
    } else {
        let arms: Vec<String> = targets.iter().enumerate().map(|(i, t)| format!("{i} : goto {t}")).collect();
        rules.push(format!("numgen random mod {} vmap {{ {} }}", targets.len(), arms.join(", ")));
    }
    rules
}

/// The fixed part of the table: created if missing, its base chains rewritten (so an upgrade
/// changes them too). Idempotent.
pub fn skeleton(out: &mut String) {
    let t = format!("inet {TABLE}");
    let _ = writeln!(out, "add table {t}");
    for (name, ty) in [
        ("services4", "ipv4_addr . inet_proto . inet_service : verdict"),
        ("services6", "ipv6_addr . inet_proto . inet_service : verdict"),
    ] {
        let _ = writeln!(out, "add map {t} {name} {{ type {ty}; }}");
    }
    for (name, ty) in
        [("noep4", "ipv4_addr . inet_proto . inet_service"), ("noep6", "ipv6_addr . inet_proto . inet_service")]
    {
        let _ = writeln!(out, "add set {t} {name} {{ type {ty}; }}");
    }
    // Priorities: DNAT at the usual dstnat priority (-100); the reject of Service ports without
    // members before it (-110), so nothing else gets to see those packets first.
    let hooks = [
        ("nat_prerouting", "type nat hook prerouting priority -100; policy accept;"),
        ("nat_output", "type nat hook output priority -100; policy accept;"),
        ("nat_postrouting", "type nat hook postrouting priority 100; policy accept;"),
        ("filter_prerouting", "type filter hook prerouting priority -110; policy accept;"),
        ("filter_output", "type filter hook output priority -110; policy accept;"),
        ("filter_forward", "type filter hook forward priority 0; policy accept;"),
    ];
    for (name, spec) in hooks {
        let _ = writeln!(out, "add chain {t} {name} {{ {spec} }}");
    }
    for name in ["services", "no_endpoints"] {
        let _ = writeln!(out, "add chain {t} {name}");
    }
    for name in hooks.iter().map(|(n, _)| *n).chain(["services", "no_endpoints"]) {
        let _ = writeln!(out, "flush chain {t} {name}");
    }
    let rules = [
        ("nat_prerouting", "jump services".to_string()),
        ("nat_output", "jump services".to_string()),
        ("services", "ip daddr . meta l4proto . th dport vmap @services4".to_string()),
        ("services", "ip6 daddr . meta l4proto . th dport vmap @services6".to_string()),
        ("filter_prerouting", "ip daddr . meta l4proto . th dport @noep4 goto no_endpoints".to_string()),
        ("filter_prerouting", "ip6 daddr . meta l4proto . th dport @noep6 goto no_endpoints".to_string()),
        ("filter_output", "ip daddr . meta l4proto . th dport @noep4 goto no_endpoints".to_string()),
        ("filter_output", "ip6 daddr . meta l4proto . th dport @noep6 goto no_endpoints".to_string()),
        ("no_endpoints", "meta l4proto tcp reject with tcp reset".to_string()),
        ("no_endpoints", "reject".to_string()),
        (
            "filter_forward",
            format!(
                "ct state new ct status dnat fib daddr . iif oif exists meta mark set meta mark | {MASQUERADE_MARK:#010x}"
            ),
        ),
        ("nat_postrouting", format!("meta mark & {MASQUERADE_MARK:#010x} == {MASQUERADE_MARK:#010x} masquerade")),
    ];
    for (chain, rule) in rules {
        let _ = writeln!(out, "add rule {t} {chain} {rule}");
    }
}

fn add_element(out: &mut String, e: &Element) {
    match &e.verdict {
        Some(v) => writeln!(out, "add element inet {TABLE} {} {{ {} : {v} }}", e.set, e.key),
        None => writeln!(out, "add element inet {TABLE} {} {{ {} }}", e.set, e.key),
    }
    .unwrap_or(());
}

fn delete_element(out: &mut String, e: &Element) {
    let _ = writeln!(out, "delete element inet {TABLE} {} {{ {} }}", e.set, e.key);
}

/// What a Service changes from `old` (what it owns in the kernel) to `new`; either may be empty
/// (a new or a deleted Service). Order matters in a transaction: references are dropped
/// (elements deleted, chains flushed) before anything they referred to is deleted, and chains
/// and sets exist before the rules that name them.
pub fn delta(out: &mut String, changes: &[(&Rendered, &Rendered)]) {
    let t = format!("inet {TABLE}");
    for (old, _) in changes {
        for e in &old.elements {
            delete_element(out, e);
        }
    }
    for (old, _) in changes {
        for c in old.chains.keys() {
            let _ = writeln!(out, "flush chain {t} {c}");
        }
    }
    // A set whose declaration changed (another timeout) is replaced.
    for (old, new) in changes {
        for (s, decl) in &old.sets {
            if new.sets.get(s).is_some_and(|d| d != decl) {
                let _ = writeln!(out, "delete set {t} {s}");
            }
        }
    }
    for (_, new) in changes {
        add_objects(out, new);
    }
    for (_, new) in changes {
        add_rules_and_elements(out, new);
    }
    for (old, new) in changes {
        for c in old.chains.keys().filter(|c| !new.chains.contains_key(*c)) {
            let _ = writeln!(out, "delete chain {t} {c}");
        }
        for s in old.sets.keys().filter(|s| !new.sets.contains_key(*s)) {
            let _ = writeln!(out, "delete set {t} {s}");
        }
    }
}

fn add_objects(out: &mut String, r: &Rendered) {
    for c in r.chains.keys() {
        let _ = writeln!(out, "add chain inet {TABLE} {c}");
    }
    for (s, decl) in &r.sets {
        let _ = writeln!(out, "add set inet {TABLE} {s} {decl}");
    }
}

fn add_rules_and_elements(out: &mut String, r: &Rendered) {
    for (c, rules) in &r.chains {
        for rule in rules {
            let _ = writeln!(out, "add rule inet {TABLE} {c} {rule}");
        }
    }
    for e in &r.elements {
        add_element(out, e);
    }
}

/// Rebuilds the table: the skeleton, every desired Service, and nothing else. `existing` is what
/// the table holds now (empty when there is no table yet).
pub fn full(out: &mut String, existing: &Existing, desired: &[&Rendered]) {
    let t = format!("inet {TABLE}");
    skeleton(out);
    for s in ["services4", "services6", "noep4", "noep6"] {
        let kind = if s.starts_with("services") { "map" } else { "set" };
        let _ = writeln!(out, "flush {kind} {t} {s}");
    }
    let mut wanted_chains = BTreeSet::new();
    let mut wanted_sets = BTreeMap::new();
    for r in desired {
        wanted_chains.extend(r.chains.keys().cloned());
        wanted_sets.extend(r.sets.iter().map(|(k, v)| (k.clone(), *v)));
    }
    // Every Service chain is emptied first: the wanted ones are refilled below, and the others
    // no longer refer to anything when they are deleted.
    let chains: Vec<&String> = existing.chains.iter().filter(|n| is_service_object(n)).collect();
    for c in &chains {
        let _ = writeln!(out, "flush chain {t} {c}");
    }
    for (s, timeout) in &existing.sets {
        if let Some(want) = wanted_sets.get(s)
            && *timeout != Some(want.timeout)
        {
            let _ = writeln!(out, "delete set {t} {s}");
        }
    }
    for r in desired {
        add_objects(out, r);
    }
    for r in desired {
        add_rules_and_elements(out, r);
    }
    for c in chains.into_iter().filter(|c| !wanted_chains.contains(*c)) {
        let _ = writeln!(out, "delete chain {t} {c}");
    }
    for s in existing.sets.keys().filter(|n| is_service_object(n) && !wanted_sets.contains_key(*n)) {
        let _ = writeln!(out, "delete set {t} {s}");
    }
}

#[cfg(test)]
#[path = "render_tests.rs"]
mod tests;
