//! The Service part of the nftables table `inet kuryr` ([`crate::table`] describes the table as
//! a whole), as text for one `nft -f` transaction.
//!
//! For each Service port and address family, the Service owns:
//!
//! - elements of the skeleton's maps: `VIP . protocol . port` in `services4`/`6` for each cluster
//!   IP and external address, `protocol . node port` in `nodeports4`/`6` (families of the cluster
//!   IPs), each `goto` one of the chains below; or, when the family has no member at all, the same
//!   keys in `noep4`/`6` and `noep_nodeports4`/`6`, rejected (kube-proxy does so too: the client
//!   is refused at once instead of timing out — TCP with a reset, because the kernel rate-limits
//!   ICMP errors per client, and a client retrying quickly would otherwise wait out a SYN
//!   retransmission for its answer);
//! - `svc/<ns>/<name>/<proto>/<port>/v4|v6`: spreads new connections evenly over every member
//!   with `numgen random mod N` and an anonymous verdict map, each member a chain
//!   `ep/.../<member>/<port>` doing the DNAT; with client-IP affinity, each member chain also
//!   records the client in a dynamic set with a timeout (`aff/...`), which the spreading chain
//!   consults first;
//! - `local/...`: the same over the members on this node, for the Local traffic policies; `drop`
//!   when there is none here (as kube-proxy: a Local Service with members elsewhere only);
//! - `ext/...`: the entry of external traffic (node ports, external IPs, load balancer
//!   addresses). `externalTrafficPolicy: Cluster`: marked for masquerading (replies must come
//!   back through this node), then `svc/`. `Local`: traffic from the node itself (masqueraded)
//!   and from its pods (`pod_ifaces`) goes to `svc/` like internal traffic; the rest goes to
//!   `local/`, its source address kept.
//!
//! Cluster IPs go to `svc/`, or to `local/` under `internalTrafficPolicy: Local`.
//!
//! A Service is rendered on its own ([`render`]) into the objects it owns; an update is the
//! difference between what a Service owned and what it owns now ([`delta`]), so its cost does not
//! grow with the number of other Services. [`full`] rebuilds the Service part of the table from
//! the desired Services in one transaction, removing whatever is there and no longer wanted:
//! packets see the old ruleset or the new one, never none.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use super::model::{Backend, Listener, Service};
pub use crate::table::{MASQUERADE_MARK, TABLE};
use crate::table::{SERVICE_MAPS, skeleton};

/// Chain and set name prefixes owned by Services; everything else in the table is the fixed
/// skeleton ([`crate::table`]) or host ports'.
const SERVICE_PREFIXES: [&str; 5] = ["svc/", "local/", "ext/", "ep/", "aff/"];

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
    /// `services4`, `noep6`, `nodeports4`, ...
    pub set: &'static str,
    /// `VIP . proto . port`, or `proto . port` for node ports.
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

/// The map or set of a family: `base` with `4` or `6`.
fn of_family(v4: bool, four: &'static str, six: &'static str) -> &'static str {
    if v4 { four } else { six }
}

/// Renders the objects of one Service.
pub fn render(svc: &Service) -> Rendered {
    let mut r = Rendered::default();
    let base = format!("{}/{}", svc.key.namespace, svc.key.name);
    for l in &svc.listeners {
        let lbase = format!("{base}/{}/{}", l.proto.as_str(), l.port);
        for v4 in [true, false] {
            let family = |ip: &&IpAddr| ip.is_ipv4() == v4;
            let vips: Vec<&IpAddr> = svc.vips.iter().filter(family).collect();
            let external: Vec<&IpAddr> = svc.external.iter().filter(family).collect();
            // Node ports are answered in the families the Service has cluster IPs in.
            let node_port = l.node_port.filter(|_| !vips.is_empty());
            if vips.is_empty() && external.is_empty() {
                continue;
            }
            let key = |ip: &IpAddr| format!("{ip} . {} . {}", l.proto.as_str(), l.port);
            let np_key = |np: u16| format!("{} . {np}", l.proto.as_str());
            let backends: Vec<&Backend> = l.backends.iter().filter(|b| b.addr.is_ipv4() == v4).collect();
            if backends.is_empty() {
                for ip in vips.iter().chain(&external) {
                    r.elements.push(Element { set: of_family(v4, "noep4", "noep6"), key: key(ip), verdict: None });
                }
                if let Some(np) = node_port {
                    let set = of_family(v4, "noep_nodeports4", "noep_nodeports6");
                    r.elements.push(Element { set, key: np_key(np), verdict: None });
                }
                continue;
            }
            let tag = if v4 { "v4" } else { "v6" };
            let cluster = format!("svc/{lbase}/{tag}");
            let local = format!("local/{lbase}/{tag}");
            let ext = format!("ext/{lbase}/{tag}");
            let has_external = node_port.is_some() || !external.is_empty();
            let internal = if svc.internal_local { &local } else { &cluster };
            let services = of_family(v4, "services4", "services6");
            for vip in &vips {
                r.elements.push(Element { set: services, key: key(vip), verdict: Some(format!("goto {internal}")) });
            }
            let mut wanted = BTreeSet::new();
            if !vips.is_empty() {
                wanted.insert(internal.clone());
            }
            if has_external {
                for ip in &external {
                    r.elements.push(Element { set: services, key: key(ip), verdict: Some(format!("goto {ext}")) });
                }
                if let Some(np) = node_port {
                    let set = of_family(v4, "nodeports4", "nodeports6");
                    r.elements.push(Element { set, key: np_key(np), verdict: Some(format!("goto {ext}")) });
                }
                let mark = format!("meta mark set meta mark | {MASQUERADE_MARK:#010x}");
                let rules = if svc.external_local {
                    wanted.insert(local.clone());
                    vec![
                        // From the node itself: any member, masqueraded (the member could not
                        // answer the node's own address otherwise when it sits elsewhere).
                        format!("fib saddr type local {mark} goto {cluster}"),
                        // From this node's pods: not external traffic.
                        format!("iifname @pod_ifaces goto {cluster}"),
                        format!("goto {local}"),
                    ]
                } else {
                    vec![format!("{mark} goto {cluster}")]
                };
                wanted.insert(cluster.clone());
                r.chains.insert(ext, rules);
            }
            if wanted.contains(&cluster) {
                let rules = spread(svc, l, &lbase, &backends, &mut r);
                r.chains.insert(cluster, rules);
            }
            if wanted.contains(&local) {
                let here: Vec<&Backend> = l.local.iter().filter(|b| b.addr.is_ipv4() == v4).collect();
                let rules =
                    if here.is_empty() { vec!["drop".to_string()] } else { spread(svc, l, &lbase, &here, &mut r) };
                r.chains.insert(local, rules);
            }
        }
    }
    r
}

/// The rules spreading a Service port's new connections over `backends` (one family), adding the
/// member chains and affinity sets they refer to.
fn spread(svc: &Service, l: &Listener, lbase: &str, backends: &[&Backend], r: &mut Rendered) -> Vec<String> {
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

/// Rebuilds the Service part of the table: the skeleton, every desired Service, and no other
/// Service object (host ports' are left alone). `existing` is what the table holds now (empty
/// when there is no table yet).
pub fn full(out: &mut String, existing: &Existing, desired: &[&Rendered]) {
    let t = format!("inet {TABLE}");
    skeleton(out);
    for (kind, s) in SERVICE_MAPS {
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
