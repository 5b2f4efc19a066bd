//! The pure half of the Neutron backend: what a policy's security group must hold
//! ([`desired_rules`]), what a port's security groups must be ([`port_groups`]), and the fewest
//! changes that turn what Neutron has into that ([`diff`]).
//!
//! A rule is compared by its meaning ([`SgRule`]): direction, family, protocol, port range and
//! remote prefix, each canonical (`0.0.0.0/0` is no prefix, port range `1-65535` of a protocol
//! is no range, protocol numbers are names), so that Neutron's spelling of a rule it stored and
//! ours of the rule we want compare equal.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use kuryr_openstack::neutron::{SecurityGroupRule, SecurityGroupRuleCreate};
use kuryr_policy_core::addr::{self, AddrRange, Family};
use kuryr_policy_core::{Allowed, Protocol};

/// A rule's direction, as Neutron names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// One security group rule by meaning (module documentation).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SgRule {
    pub direction: Direction,
    pub family: Family,
    /// `None`: every protocol (ICMP included).
    pub protocol: Option<Protocol>,
    /// `None`: every port of the protocol.
    pub ports: Option<(u16, u16)>,
    /// `None`: every address of the family.
    pub remote: Option<IpNet>,
}

impl SgRule {
    /// The body that creates this rule in group `group`.
    pub fn create(&self, group: &str) -> SecurityGroupRuleCreate {
        SecurityGroupRuleCreate {
            security_group_id: group.to_string(),
            direction: self.direction.as_str().into(),
            ethertype: ethertype(self.family).into(),
            protocol: self.protocol.map(|p| p.as_str().to_string()),
            port_range_min: self.ports.map(|p| p.0),
            port_range_max: self.ports.map(|p| p.1),
            remote_ip_prefix: self.remote.map(|n| n.to_string()),
            remote_group_id: None,
            project_id: None,
        }
    }

    /// What a rule Neutron holds means, if it is one this backend could have written (a rule
    /// with a remote group or another protocol is not: `None`, and it is removed).
    pub fn from_neutron(r: &SecurityGroupRule) -> Option<SgRule> {
        if r.remote_group_id.is_some() {
            return None;
        }
        let direction = match r.direction.as_str() {
            "ingress" => Direction::Ingress,
            "egress" => Direction::Egress,
            _ => return None,
        };
        let family = match r.ethertype.as_str() {
            "IPv4" => Family::V4,
            "IPv6" => Family::V6,
            _ => return None,
        };
        let protocol = match r.protocol.as_deref() {
            None | Some("") | Some("any") => None,
            Some(p) => Some(Protocol::parse(p).or_else(|| p.parse::<u8>().ok().and_then(Protocol::from_number))?),
        };
        let ports = match (protocol, r.port_range_min, r.port_range_max) {
            (None, _, _) | (Some(_), None, None) => None,
            (Some(_), Some(a), Some(b)) => canonical_ports(a, b),
            (Some(_), Some(a), None) => canonical_ports(a, a),
            (Some(_), None, Some(b)) => canonical_ports(1, b),
        };
        let remote = match r.remote_ip_prefix.as_deref() {
            None | Some("") => None,
            Some(p) => {
                let net: IpNet = p.parse().ok()?;
                let net = net.trunc();
                (net.prefix_len() != 0).then_some(net)
            }
        };
        Some(SgRule { direction, family, protocol, ports, remote })
    }
}

/// Neutron's `ethertype` of a family.
pub fn ethertype(f: Family) -> &'static str {
    match f {
        Family::V4 => "IPv4",
        Family::V6 => "IPv6",
    }
}

/// A port range as a rule states it: `None` when it is every port.
fn canonical_ports(first: u16, last: u16) -> Option<(u16, u16)> {
    let first = first.max(1);
    (first > 1 || last < u16::MAX).then_some((first, last))
}

/// The fewest CIDRs covering exactly `r` (the whole family is one rule without a prefix).
pub fn range_cidrs(r: &AddrRange) -> Vec<Option<IpNet>> {
    if r.first == 0 && r.last == r.family.max() {
        return vec![None];
    }
    let bits: u32 = match r.family {
        Family::V4 => 32,
        Family::V6 => 128,
    };
    let mut out = Vec::new();
    let mut start = r.first;
    loop {
        // The largest aligned block at `start` that stays within the range.
        let align = if start == 0 { bits } else { start.trailing_zeros().min(bits) };
        let mut size = align;
        while size > 0 {
            let span = if size >= 128 { u128::MAX } else { (1u128 << size) - 1 };
            if start.checked_add(span).is_some_and(|end| end <= r.last) {
                break;
            }
            size -= 1;
        }
        let prefix = (bits - size) as u8;
        if let Ok(net) = IpNet::new(r.family.addr(start), prefix) {
            out.push(Some(net));
        }
        let span = if size >= 128 { u128::MAX } else { (1u128 << size) - 1 };
        match start.checked_add(span).and_then(|e| e.checked_add(1)) {
            Some(next) if next <= r.last => start = next,
            _ => break,
        }
    }
    out
}

fn host(addr: std::net::IpAddr) -> Option<IpNet> {
    Some(IpNet::from(addr))
}

/// The rules of one direction that allow exactly `allowed` (the compiler's canonical sets,
/// [`Allowed`]): an address or range on every port is a rule without protocol; an address and
/// port, or a range and port range, a rule of that protocol.
pub fn rules_for(direction: Direction, allowed: &Allowed) -> BTreeSet<SgRule> {
    let mut out = BTreeSet::new();
    let rule = |family, protocol, ports, remote| SgRule { direction, family, protocol, ports, remote };
    for a in &allowed.any {
        out.insert(rule(Family::of(a), None, None, host(*a)));
    }
    for r in &allowed.nets {
        for net in range_cidrs(r) {
            out.insert(rule(r.family, None, None, net));
        }
    }
    for p in &allowed.ports {
        out.insert(rule(Family::of(&p.addr), Some(p.protocol), canonical_ports(p.port, p.port), host(p.addr)));
    }
    // The compiler cuts boxes so that no two overlap (as nftables interval sets need); rules
    // may overlap, so boxes of one protocol and port range are joined again before they become
    // CIDRs.
    let mut by_ports: BTreeMap<(Protocol, u16, u16), Vec<AddrRange>> = BTreeMap::new();
    for b in &allowed.ranges {
        by_ports.entry((b.protocol, b.first_port, b.last_port)).or_default().push(b.addrs);
    }
    for ((protocol, first, last), ranges) in by_ports {
        for r in addr::union(ranges) {
            for net in range_cidrs(&r) {
                out.insert(rule(r.family, Some(protocol), canonical_ports(first, last), net));
            }
        }
    }
    out
}

/// The rules of a policy's security group: its ingress rules if it isolates ingress, its egress
/// rules if it isolates egress, nothing for a direction it leaves open (another group opens
/// that: see [`port_groups`]). No rules in an isolated direction is a default deny.
pub fn desired_rules(ingress: Option<&Allowed>, egress: Option<&Allowed>) -> BTreeSet<SgRule> {
    let mut out = BTreeSet::new();
    if let Some(a) = ingress {
        out.extend(rules_for(Direction::Ingress, a));
    }
    if let Some(a) = egress {
        out.extend(rules_for(Direction::Egress, a));
    }
    out
}

/// Every address, every protocol, one direction: the rules of the shared "open" groups.
pub fn open_rules(direction: Direction) -> BTreeSet<SgRule> {
    [Family::V4, Family::V6]
        .into_iter()
        .map(|family| SgRule { direction, family, protocol: None, ports: None, remote: None })
        .collect()
}

/// What turns a group's rules (`actual`: Neutron's rule id → rule) into `desired`: the rules to
/// create (one bulk call) and the ids to delete (one call each). Rules that stay are untouched;
/// duplicates and rules this backend cannot have written go.
pub fn diff(desired: &BTreeSet<SgRule>, actual: &BTreeMap<String, Option<SgRule>>) -> (Vec<SgRule>, Vec<String>) {
    let mut kept: BTreeSet<&SgRule> = BTreeSet::new();
    let mut delete = Vec::new();
    for (id, rule) in actual {
        match rule {
            Some(r) if desired.contains(r) && kept.insert(r) => {}
            _ => delete.push(id.clone()),
        }
    }
    let create = desired.iter().filter(|r| !kept.contains(r)).cloned().collect();
    (create, delete)
}

/// How policies select one pod: per selecting policy, its group and whether it isolates ingress
/// and egress.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    pub groups: Vec<String>,
    pub ingress: bool,
    pub egress: bool,
}

/// The security groups of a pod's port, sorted: those of the policies selecting it plus the
/// shared open group of each direction no policy isolates; a pod no policy selects keeps its
/// groups from allocation (`default`).
pub fn port_groups(sel: Option<&Selection>, open_ingress: &str, open_egress: &str, default: &[String]) -> Vec<String> {
    let mut out: Vec<String> = match sel {
        Some(s) if !s.groups.is_empty() => {
            let mut g = s.groups.clone();
            if !s.ingress {
                g.push(open_ingress.to_string());
            }
            if !s.egress {
                g.push(open_egress.to_string());
            }
            g
        }
        _ => default.to_vec(),
    };
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::net::IpAddr;

    use kuryr_policy_core::allowed::{Builder, Ports};

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn show(rules: &BTreeSet<SgRule>) -> Vec<String> {
        rules
            .iter()
            .map(|r| {
                let proto = r.protocol.map_or("any".to_string(), |p| p.to_string());
                let ports = r.ports.map_or("*".to_string(), |(a, b)| format!("{a}-{b}"));
                let remote = r.remote.map_or("*".to_string(), |n| n.to_string());
                format!("{} {} {proto} {ports} {remote}", r.direction.as_str(), ethertype(r.family))
            })
            .collect()
    }

    #[test]
    fn ranges_become_the_fewest_cidrs() {
        let cidrs = |a: &str, b: &str| -> Vec<String> {
            range_cidrs(&AddrRange::new(ip(a), ip(b)).unwrap())
                .into_iter()
                .map(|n| n.map_or("*".into(), |n| n.to_string()))
                .collect()
        };
        assert_eq!(cidrs("10.0.0.0", "10.0.0.255"), ["10.0.0.0/24"]);
        // 10.0.0.0/24 except 10.0.0.128/25 and 10.0.0.16/28.
        assert_eq!(cidrs("10.0.0.0", "10.0.0.15"), ["10.0.0.0/28"]);
        assert_eq!(cidrs("10.0.0.32", "10.0.0.127"), ["10.0.0.32/27", "10.0.0.64/26"]);
        assert_eq!(cidrs("10.0.0.1", "10.0.0.6"), ["10.0.0.1/32", "10.0.0.2/31", "10.0.0.4/31", "10.0.0.6/32"]);
        assert_eq!(cidrs("0.0.0.0", "255.255.255.255"), ["*"]);
        assert_eq!(cidrs("0.0.0.0", "255.255.255.254").len(), 32);
        assert_eq!(cidrs("::", "7fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), ["::/1"]);
        assert_eq!(cidrs("8000::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), ["8000::/1"]);
        assert_eq!(cidrs("fd00::5", "fd00::5"), ["fd00::5/128"]);
    }

    #[test]
    fn allowed_sets_become_rules_per_direction() {
        let mut b = Builder::default();
        b.address(ip("10.0.0.5"), Ports::All);
        b.address(ip("10.0.0.6"), Ports::Range(Protocol::Tcp, 80, 80));
        b.address(ip("fd00::6"), Ports::Range(Protocol::Udp, 53, 53));
        b.range(AddrRange::new(ip("192.168.0.0"), ip("192.168.1.255")).unwrap(), Ports::All);
        b.range(
            AddrRange::new(ip("172.16.0.0"), ip("172.16.0.255")).unwrap(),
            Ports::Range(Protocol::Sctp, 1000, 2000),
        );
        b.range(
            AddrRange::new(ip("0.0.0.0"), ip("255.255.255.255")).unwrap(),
            Ports::Range(Protocol::Tcp, 0, u16::MAX),
        );
        let allowed = b.build();
        let rules = desired_rules(Some(&allowed), Some(&Allowed::default()));
        assert_eq!(
            show(&rules),
            [
                "ingress IPv4 any * 10.0.0.5/32",
                "ingress IPv4 any * 192.168.0.0/23",
                "ingress IPv4 tcp * *",
                "ingress IPv4 tcp 80-80 10.0.0.6/32",
                "ingress IPv4 sctp 1000-2000 172.16.0.0/24",
                "ingress IPv6 udp 53-53 fd00::6/128",
            ],
            "an isolated egress with nothing allowed is no rule at all: a deny"
        );
        assert!(desired_rules(None, None).is_empty());
    }

    fn neutron_rule(
        id: &str,
        dir: &str,
        eth: &str,
        proto: Option<&str>,
        ports: Option<(u16, u16)>,
        prefix: Option<&str>,
    ) -> SecurityGroupRule {
        SecurityGroupRule {
            id: id.into(),
            security_group_id: "sg".into(),
            direction: dir.into(),
            ethertype: eth.into(),
            protocol: proto.map(Into::into),
            port_range_min: ports.map(|p| p.0),
            port_range_max: ports.map(|p| p.1),
            remote_ip_prefix: prefix.map(Into::into),
            ..Default::default()
        }
    }

    #[test]
    fn neutrons_spelling_reads_as_ours() {
        let ours = SgRule {
            direction: Direction::Ingress,
            family: Family::V4,
            protocol: Some(Protocol::Tcp),
            ports: Some((80, 80)),
            remote: Some("10.0.0.0/24".parse().unwrap()),
        };
        let body = ours.create("sg-1");
        assert_eq!((body.protocol.as_deref(), body.remote_ip_prefix.as_deref()), (Some("tcp"), Some("10.0.0.0/24")));
        let back = neutron_rule("r", "ingress", "IPv4", Some("6"), Some((80, 80)), Some("10.0.0.7/24"));
        assert_eq!(SgRule::from_neutron(&back), Some(ours), "number for name, host bits ignored");
        let all = neutron_rule("r", "egress", "IPv6", Some("udp"), Some((1, 65535)), Some("::/0"));
        assert_eq!(
            SgRule::from_neutron(&all),
            Some(SgRule {
                direction: Direction::Egress,
                family: Family::V6,
                protocol: Some(Protocol::Udp),
                ports: None,
                remote: None
            })
        );
        let icmp = neutron_rule("r", "ingress", "IPv4", Some("icmp"), None, None);
        assert_eq!(SgRule::from_neutron(&icmp), None, "not a rule this backend writes");
        let group = SecurityGroupRule {
            remote_group_id: Some("g".into()),
            ..neutron_rule("r", "ingress", "IPv4", None, None, None)
        };
        assert_eq!(SgRule::from_neutron(&group), None);
    }

    #[test]
    fn the_diff_keeps_what_stays_and_touches_only_the_changes() {
        let desired = desired_rules(
            Some(&{
                let mut b = Builder::default();
                b.address(ip("10.0.0.1"), Ports::Range(Protocol::Tcp, 80, 80));
                b.address(ip("10.0.0.2"), Ports::Range(Protocol::Tcp, 80, 80));
                b.build()
            }),
            None,
        );
        // Neutron holds .1 (stays), .3 (went), its default egress rules, and a duplicate of .1.
        let actual: BTreeMap<String, Option<SgRule>> = [
            neutron_rule("keep", "ingress", "IPv4", Some("tcp"), Some((80, 80)), Some("10.0.0.1/32")),
            neutron_rule("dup", "ingress", "IPv4", Some("tcp"), Some((80, 80)), Some("10.0.0.1/32")),
            neutron_rule("old", "ingress", "IPv4", Some("tcp"), Some((80, 80)), Some("10.0.0.3/32")),
            neutron_rule("def4", "egress", "IPv4", None, None, None),
            neutron_rule("def6", "egress", "IPv6", None, None, None),
        ]
        .iter()
        .map(|r| (r.id.clone(), SgRule::from_neutron(r)))
        .collect();
        let (create, delete) = diff(&desired, &actual);
        assert_eq!(create.len(), 1);
        assert_eq!(create[0].remote, Some("10.0.0.2/32".parse().unwrap()));
        // One of the two copies of .1 stays (either), everything else not desired goes.
        assert_eq!(delete.len(), 4, "{delete:?}");
        for id in ["def4", "def6", "old"] {
            assert!(delete.contains(&id.to_string()), "{id} in {delete:?}");
        }
        assert!(delete.contains(&"dup".to_string()) != delete.contains(&"keep".to_string()));
        let after: BTreeMap<String, Option<SgRule>> =
            desired.iter().enumerate().map(|(i, r)| (format!("n{i}"), Some(r.clone()))).collect();
        assert_eq!(diff(&desired, &after), (vec![], vec![]), "converged: no call");
    }

    #[test]
    fn ports_get_their_policies_groups_and_open_the_other_direction() {
        let default = vec!["default".to_string()];
        assert_eq!(port_groups(None, "open-in", "open-out", &default), ["default"], "no policy: as allocated");
        let ingress_only = Selection { groups: vec!["np-b".into(), "np-a".into()], ingress: true, egress: false };
        assert_eq!(port_groups(Some(&ingress_only), "open-in", "open-out", &default), ["np-a", "np-b", "open-out"]);
        let egress_only = Selection { groups: vec!["np-c".into()], ingress: false, egress: true };
        assert_eq!(port_groups(Some(&egress_only), "open-in", "open-out", &default), ["np-c", "open-in"]);
        let both = Selection { groups: vec!["np-a".into(), "np-c".into()], ingress: true, egress: true };
        assert_eq!(port_groups(Some(&both), "open-in", "open-out", &default), ["np-a", "np-c"]);
    }
}
