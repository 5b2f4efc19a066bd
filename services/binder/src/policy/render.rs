//! The NetworkPolicy part of the node's table `inet kuryr`, as text for one `nft -f` transaction.
//!
//! ```text
//! chain pol_forward { type filter hook forward priority 5; policy accept;
//!     ct state established,related accept          # replies of allowed connections
//!     icmpv6 type { nd-neighbor-solicit, ... } accept  # IPv6 neighbour discovery
//!     ip saddr . ip daddr @pol_self4 accept         # an isolated pod reaching itself (hairpin)
//!     ip saddr vmap @pol_egress4                    # isolated source → jump pol/<egress group>
//!     ip daddr vmap @pol_ingress4                   # isolated destination → jump pol/<ingress group>
//!     (the same for IPv6) }
//! chain pol/<group> {
//!     ip daddr @pol/<group>/a4 return               # a peer allowed on every port
//!     ip daddr @pol/<group>/n4 return               # a range of peers allowed on every port
//!     ip daddr . meta l4proto . th dport @pol/<group>/p4 return
//!     ip daddr . meta l4proto . th dport @pol/<group>/r4 return   # ranges × port ranges
//!     (the same for IPv6)
//!     reject with icmpx admin-prohibited }
//! ```
//!
//! (`saddr` in ingress groups, whose peer is the source.) A group's chain returns when its sets
//! allow the connection, so that egress of the source and ingress of the destination are both
//! judged, and rejects otherwise. Every lookup is a hash or interval lookup: the cost per packet
//! is at most two map lookups and eight set lookups however many policies and peers there are.
//!
//! The forward hook sees traffic between pods of different nodes, and between pods of one node's
//! bridge too (`br_netfilter` passes bridged IP traffic through it), after the Service DNAT of
//! prerouting: a connection to a cluster IP is judged by the pod it reaches. Traffic from the
//! node itself (kubelet probes) leaves through output, and traffic to it arrives through input:
//! neither meets these rules, as Kubernetes requires.
//!
//! A group's chain and sets are named after its id and do not change with its peers: a change of
//! peers is set elements, a pod moving between groups is one map element. [`diff`] writes the
//! difference between two renderings; [`replace`] rewrites the policy part from scratch, each set
//! flushed and refilled in the same transaction (packets see the old elements or the new ones).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use kuryr_proto::policy::v1::{AddressRange, PeerGroup, Protocol};

use super::state::Desired;
use crate::table::TABLE;

/// The base chain.
pub const BASE_CHAIN: &str = "pol_forward";
/// Prefix of every other chain and set the policy part owns.
pub const PREFIX: &str = "pol/";

/// The fixed maps and sets, with their types.
const FIXED_SETS: [(&str, &str); 6] = [
    ("pol_self4", "type ipv4_addr . ipv4_addr;"),
    ("pol_self6", "type ipv6_addr . ipv6_addr;"),
    ("pol_egress4", "type ipv4_addr : verdict;"),
    ("pol_egress6", "type ipv6_addr : verdict;"),
    ("pol_ingress4", "type ipv4_addr : verdict;"),
    ("pol_ingress6", "type ipv6_addr : verdict;"),
];

/// Whether a chain or set belongs to the policy part.
pub fn is_policy_object(name: &str) -> bool {
    name.starts_with(PREFIX) || name == BASE_CHAIN || FIXED_SETS.iter().any(|(n, _)| *n == name)
}

/// The policy part of the table: sets (declaration, elements) and group chains (rules).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rendered {
    pub sets: BTreeMap<String, (String, BTreeSet<String>)>,
    pub chains: BTreeMap<String, Vec<String>>,
}

impl Rendered {
    /// The number of set and map elements.
    pub fn elements(&self) -> usize {
        self.sets.values().map(|(_, e)| e.len()).sum()
    }

    /// The number of rules in the group chains (the base chain's fixed rules not counted).
    pub fn rules(&self) -> usize {
        self.chains.values().map(Vec::len).sum()
    }
}

fn proto(p: i32) -> Option<&'static str> {
    match Protocol::try_from(p).ok()? {
        Protocol::Tcp => Some("tcp"),
        Protocol::Udp => Some("udp"),
        Protocol::Sctp => Some("sctp"),
        Protocol::Unspecified => None,
    }
}

fn parse_range(r: &AddressRange) -> Option<(IpAddr, IpAddr)> {
    let (a, b) = (r.first.parse::<IpAddr>().ok()?, r.last.parse::<IpAddr>().ok()?);
    (a.is_ipv4() == b.is_ipv4() && a <= b).then_some((a, b))
}

fn port(p: u32) -> Option<u32> {
    (1..=65535).contains(&p).then_some(p)
}

/// A bound of a port range: 0 included, as "every port of a protocol" is 0-65535.
fn range_port(p: u32) -> Option<u32> {
    (p <= 65535).then_some(p)
}

/// Sets and chain of one group; what cannot be read is left out (it allows nothing) and named in
/// `warnings`.
fn group(id: &str, g: &PeerGroup, out: &mut Rendered, warnings: &mut Vec<String>) {
    let ingress = id.starts_with('i');
    let dir = if ingress { "saddr" } else { "daddr" };
    let name = |kind: &str, v4: bool| format!("{PREFIX}{id}/{kind}{}", if v4 { 4 } else { 6 });
    let mut sets: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for v4 in [true, false] {
        for k in ["a", "n", "p", "r"] {
            sets.insert(name(k, v4), BTreeSet::new());
        }
    }
    let v4 = |ip: &IpAddr| ip.is_ipv4();
    for a in &g.addresses {
        match a.parse::<IpAddr>() {
            Ok(ip) => sets.get_mut(&name("a", v4(&ip))).map(|s| s.insert(ip.to_string())),
            Err(_) => {
                warnings.push(format!("group {id}: address `{a}` left out"));
                None
            }
        };
    }
    for r in &g.ranges {
        match parse_range(r) {
            Some((a, b)) => sets.get_mut(&name("n", v4(&a))).map(|s| s.insert(format!("{a}-{b}"))),
            None => {
                warnings.push(format!("group {id}: range {}-{} left out", r.first, r.last));
                None
            }
        };
    }
    for p in &g.ports {
        match (p.address.parse::<IpAddr>(), proto(p.protocol), port(p.port)) {
            (Ok(ip), Some(pr), Some(n)) => {
                sets.get_mut(&name("p", v4(&ip))).map(|s| s.insert(format!("{ip} . {pr} . {n}")))
            }
            _ => {
                warnings.push(format!("group {id}: port {}:{} left out", p.address, p.port));
                None
            }
        };
    }
    for b in &g.boxes {
        let range = b.addresses.as_ref().and_then(parse_range);
        match (range, proto(b.protocol), range_port(b.first_port), range_port(b.last_port)) {
            (Some((a, z)), Some(pr), Some(f), Some(l)) if f <= l => {
                sets.get_mut(&name("r", v4(&a))).map(|s| s.insert(format!("{a}-{z} . {pr} . {f}-{l}")))
            }
            _ => {
                warnings.push(format!("group {id}: port range {}-{} left out", b.first_port, b.last_port));
                None
            }
        };
    }
    for (set, elements) in sets {
        let v4 = set.ends_with('4');
        let addr = if v4 { "ipv4_addr" } else { "ipv6_addr" };
        let decl = match &set[set.len() - 2..set.len() - 1] {
            "a" => format!("type {addr};"),
            "n" => format!("type {addr}; flags interval;"),
            "p" => format!("type {addr} . inet_proto . inet_service;"),
            _ => format!("type {addr} . inet_proto . inet_service; flags interval;"),
        };
        out.sets.insert(set, (decl, elements));
    }
    let mut rules = Vec::new();
    for v4 in [true, false] {
        let l3 = if v4 { "ip" } else { "ip6" };
        rules.push(format!("{l3} {dir} @{} return", name("a", v4)));
        rules.push(format!("{l3} {dir} @{} return", name("n", v4)));
        rules.push(format!("{l3} {dir} . meta l4proto . th dport @{} return", name("p", v4)));
        rules.push(format!("{l3} {dir} . meta l4proto . th dport @{} return", name("r", v4)));
    }
    rules.push("reject with icmpx admin-prohibited".into());
    out.chains.insert(format!("{PREFIX}{id}"), rules);
}

/// Renders a node's desired policy. Isolations naming a group the state lacks are rendered with
/// an empty group (nothing allowed: a pod is never opened by a missing group).
pub fn render(d: &Desired) -> (Rendered, Vec<String>) {
    let mut out = Rendered::default();
    let mut warnings = Vec::new();
    for (name, decl) in FIXED_SETS {
        out.sets.insert(name.into(), (decl.into(), BTreeSet::new()));
    }
    let valid_id = |id: &str| {
        id.len() <= 64
            && (id.starts_with('i') || id.starts_with('e'))
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    for (id, g) in &d.groups {
        if valid_id(id) {
            group(id, g, &mut out, &mut warnings);
        } else {
            warnings.push(format!("group id `{id}` left out"));
        }
    }
    for (ip, iso) in &d.isolations {
        let fam = if ip.is_ipv4() { 4 } else { 6 };
        let mut isolated = false;
        for (gid, map, want) in [(&iso.ingress, "pol_ingress", 'i'), (&iso.egress, "pol_egress", 'e')] {
            let Some(gid) = gid else { continue };
            isolated = true;
            let gid = if valid_id(gid) && gid.starts_with(want) { gid.clone() } else { format!("{want}-invalid") };
            if !out.chains.contains_key(&format!("{PREFIX}{gid}")) {
                warnings.push(format!("{ip}: group {gid} not received; nothing allowed"));
                group(&gid, &PeerGroup::default(), &mut out, &mut warnings);
            }
            if let Some((_, e)) = out.sets.get_mut(&format!("{map}{fam}")) {
                e.insert(format!("{ip} : jump {PREFIX}{gid}"));
            }
        }
        if isolated && let Some((_, e)) = out.sets.get_mut(&format!("pol_self{fam}")) {
            e.insert(format!("{ip} . {ip}"));
        }
    }
    (out, warnings)
}

fn t() -> String {
    format!("inet {TABLE}")
}

/// The fixed part: the table, the fixed sets, the base chain with its rules (rewritten, so that
/// an upgrade changes them too).
fn base(out: &mut String) {
    let t = t();
    let _ = writeln!(out, "add table {t}");
    for (name, decl) in FIXED_SETS {
        let kind = if decl.contains(':') { "map" } else { "set" };
        let _ = writeln!(out, "add {kind} {t} {name} {{ {decl} }}");
    }
    let _ = writeln!(out, "add chain {t} {BASE_CHAIN} {{ type filter hook forward priority 5; policy accept; }}");
    let _ = writeln!(out, "flush chain {t} {BASE_CHAIN}");
    for rule in [
        "ct state established,related accept",
        // Neighbour and router discovery are IPv6's ARP: judged as traffic, an isolated pod's
        // solicitations (to multicast addresses no policy names) would cut it off its
        // neighbours and its gateway.
        "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit, nd-router-advert, nd-redirect } accept",
        "ip saddr . ip daddr @pol_self4 accept",
        "ip6 saddr . ip6 daddr @pol_self6 accept",
        "ip saddr vmap @pol_egress4",
        "ip6 saddr vmap @pol_egress6",
        "ip daddr vmap @pol_ingress4",
        "ip6 daddr vmap @pol_ingress6",
    ] {
        let _ = writeln!(out, "add rule {t} {BASE_CHAIN} {rule}");
    }
}

fn kind_of(decl: &str) -> &'static str {
    if decl.contains(':') { "map" } else { "set" }
}

fn elements(out: &mut String, verb: &str, set: &str, elems: &BTreeSet<String>) {
    if elems.is_empty() {
        return;
    }
    // Chunks keep each command line reasonable for sets of thousands of elements.
    let v: Vec<&String> = elems.iter().collect();
    for chunk in v.chunks(512) {
        let list = chunk.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
        let _ = writeln!(out, "{verb} element {} {set} {{ {list} }}", t());
    }
}

/// Turns what `old` programmed into `new`: new sets and chains, element deletions then additions
/// (a pod moving between groups is one map key deleted and added), then the chains and sets no
/// longer wanted. `with_base` rewrites the fixed part first (the first transaction of a process).
pub fn diff(out: &mut String, old: &Rendered, new: &Rendered, with_base: bool) {
    let t = t();
    if with_base {
        base(out);
    }
    for (s, (decl, _)) in &new.sets {
        match old.sets.get(s) {
            Some((d, _)) if d == decl => {}
            Some(_) => {
                let _ = writeln!(out, "delete {} {t} {s}", kind_of(decl));
                let _ = writeln!(out, "add {} {t} {s} {{ {decl} }}", kind_of(decl));
            }
            None => {
                let _ = writeln!(out, "add {} {t} {s} {{ {decl} }}", kind_of(decl));
            }
        }
    }
    for (c, rules) in &new.chains {
        if old.chains.get(c) != Some(rules) {
            let _ = writeln!(out, "add chain {t} {c}");
            let _ = writeln!(out, "flush chain {t} {c}");
            for r in rules {
                let _ = writeln!(out, "add rule {t} {c} {r}");
            }
        }
    }
    let empty = BTreeSet::new();
    for (s, (decl, elems)) in &new.sets {
        let before = match old.sets.get(s) {
            Some((d, e)) if d == decl => e,
            _ => &empty,
        };
        elements(out, "delete", s, &before.difference(elems).cloned().collect());
    }
    for (s, (decl, elems)) in &new.sets {
        let before = match old.sets.get(s) {
            Some((d, e)) if d == decl => e,
            _ => &empty,
        };
        elements(out, "add", s, &elems.difference(before).cloned().collect());
    }
    for c in old.chains.keys().filter(|c| !new.chains.contains_key(*c)) {
        let _ = writeln!(out, "flush chain {t} {c}");
        let _ = writeln!(out, "delete chain {t} {c}");
    }
    for (s, (decl, _)) in old.sets.iter().filter(|(s, _)| !new.sets.contains_key(*s)) {
        let _ = writeln!(out, "delete {} {t} {s}", kind_of(decl));
    }
}

/// Rewrites the policy part without knowing what it holds: every wanted set and map is declared,
/// flushed and refilled, every wanted chain rewritten, and the policy objects in `existing_chains`
/// / `existing_sets` that are not wanted are deleted — all in one transaction, so packets meet
/// the old rules or the new ones, never none.
pub fn replace(
    out: &mut String,
    new: &Rendered,
    existing_chains: &BTreeSet<String>,
    existing_sets: &BTreeMap<String, Option<u32>>,
) {
    let t = t();
    base(out);
    for (s, (decl, _)) in &new.sets {
        let _ = writeln!(out, "add {} {t} {s} {{ {decl} }}", kind_of(decl));
        let _ = writeln!(out, "flush {} {t} {s}", kind_of(decl));
    }
    for (c, rules) in &new.chains {
        let _ = writeln!(out, "add chain {t} {c}");
        let _ = writeln!(out, "flush chain {t} {c}");
        for r in rules {
            let _ = writeln!(out, "add rule {t} {c} {r}");
        }
    }
    for (s, (_, elems)) in &new.sets {
        elements(out, "add", s, elems);
    }
    let stale_chains: Vec<&String> =
        existing_chains.iter().filter(|c| c.starts_with(PREFIX) && !new.chains.contains_key(*c)).collect();
    for c in &stale_chains {
        let _ = writeln!(out, "flush chain {t} {c}");
    }
    for c in stale_chains {
        let _ = writeln!(out, "delete chain {t} {c}");
    }
    for s in existing_sets.keys().filter(|s| s.starts_with(PREFIX) && !new.sets.contains_key(*s)) {
        // Group sets are sets, never maps.
        let _ = writeln!(out, "delete set {t} {s}");
    }
}

#[cfg(test)]
#[path = "render_tests.rs"]
mod tests;
