//! Address ranges: an `ipBlock` minus its `except` entries is a list of ranges, and so is the
//! union of several blocks. Arithmetic is on integers (`u128` for both families), so IPv4 and
//! IPv6 share one implementation; a range never mixes families.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// An address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: &IpAddr) -> Self {
        if ip.is_ipv4() { Family::V4 } else { Family::V6 }
    }

    /// The highest address of the family, as an integer.
    pub fn max(self) -> u128 {
        match self {
            Family::V4 => u128::from(u32::MAX),
            Family::V6 => u128::MAX,
        }
    }

    /// The address `v` of this family (`v` must not exceed [`Self::max`]; larger values are
    /// truncated to the family's width).
    pub fn addr(self, v: u128) -> IpAddr {
        match self {
            Family::V4 => IpAddr::V4(Ipv4Addr::from((v & u128::from(u32::MAX)) as u32)),
            Family::V6 => IpAddr::V6(Ipv6Addr::from(v)),
        }
    }
}

/// An address as an integer.
pub fn to_int(ip: &IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(*a)),
        IpAddr::V6(a) => u128::from(*a),
    }
}

/// An inclusive range of addresses of one family.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddrRange {
    pub family: Family,
    pub first: u128,
    pub last: u128,
}

impl AddrRange {
    /// The range holding one address.
    pub fn single(ip: IpAddr) -> Self {
        let v = to_int(&ip);
        Self { family: Family::of(&ip), first: v, last: v }
    }

    /// The addresses of a CIDR (host bits ignored, as `10.0.0.5/24` means `10.0.0.0/24`).
    pub fn of_net(net: &IpNet) -> Self {
        let net = net.trunc();
        Self { family: Family::of(&net.addr()), first: to_int(&net.network()), last: to_int(&net.broadcast()) }
    }

    /// The range from `first` to `last`, if both are of one family and in order.
    pub fn new(first: IpAddr, last: IpAddr) -> Option<Self> {
        let (f, l) = (to_int(&first), to_int(&last));
        (Family::of(&first) == Family::of(&last) && f <= l).then_some(Self {
            family: Family::of(&first),
            first: f,
            last: l,
        })
    }

    pub fn first_addr(&self) -> IpAddr {
        self.family.addr(self.first)
    }

    pub fn last_addr(&self) -> IpAddr {
        self.family.addr(self.last)
    }

    pub fn contains(&self, ip: &IpAddr) -> bool {
        Family::of(ip) == self.family && (self.first..=self.last).contains(&to_int(ip))
    }

    pub fn is_single(&self) -> bool {
        self.first == self.last
    }
}

impl fmt::Debug for AddrRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for AddrRange {
    /// `first-last`, as nftables writes an interval.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first_addr(), self.last_addr())
    }
}

/// The addresses of `cidr` that are in none of `except`: the meaning of an `ipBlock`. Entries
/// of `except` of another family, or outside `cidr`, take nothing away (the API refuses them).
pub fn block(cidr: &IpNet, except: &[IpNet]) -> Vec<AddrRange> {
    let whole = AddrRange::of_net(cidr);
    let mut holes: Vec<AddrRange> = except.iter().map(AddrRange::of_net).filter(|h| h.family == whole.family).collect();
    holes.sort();
    let mut out = Vec::new();
    let mut next = Some(whole.first);
    for h in holes {
        let Some(start) = next else { break };
        if h.last < start || h.first > whole.last {
            continue;
        }
        if h.first > start {
            out.push(AddrRange { family: whole.family, first: start, last: h.first - 1 });
        }
        next = h.last.checked_add(1).filter(|n| *n <= whole.last);
    }
    if let Some(start) = next.filter(|s| *s <= whole.last) {
        out.push(AddrRange { family: whole.family, first: start, last: whole.last });
    }
    out
}

/// The union of `ranges` as sorted, disjoint ranges, adjacent ones joined: the canonical form,
/// so that two equal unions compare equal.
pub fn union(mut ranges: Vec<AddrRange>) -> Vec<AddrRange> {
    ranges.sort();
    let mut out: Vec<AddrRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(prev) if prev.family == r.family && prev.last.checked_add(1).is_none_or(|n| n >= r.first) => {
                prev.last = prev.last.max(r.last);
            }
            _ => out.push(r),
        }
    }
    out
}

/// Whether sorted, disjoint `ranges` (as [`union`] makes them) hold `ip`.
pub fn covers(ranges: &[AddrRange], ip: &IpAddr) -> bool {
    let probe = AddrRange::single(*ip);
    // The last range starting at or before the address is the only candidate.
    let i = ranges.partition_point(|r| (r.family, r.first) <= (probe.family, probe.first));
    i > 0 && ranges[i - 1].contains(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn show(rs: &[AddrRange]) -> Vec<String> {
        rs.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_block_minus_its_exceptions() {
        assert_eq!(show(&block(&net("10.0.0.0/24"), &[])), ["10.0.0.0-10.0.0.255"]);
        assert_eq!(
            show(&block(&net("10.0.0.0/24"), &[net("10.0.0.128/25"), net("10.0.0.16/28"), net("10.0.0.20/30")])),
            ["10.0.0.0-10.0.0.15", "10.0.0.32-10.0.0.127"]
        );
        assert_eq!(show(&block(&net("10.0.0.0/24"), &[net("10.0.0.0/25")])), ["10.0.0.128-10.0.0.255"]);
        assert!(block(&net("10.0.0.0/24"), &[net("10.0.0.0/24")]).is_empty());
        assert_eq!(show(&block(&net("10.0.0.7/24"), &[net("fd00::/64")])), ["10.0.0.0-10.0.0.255"]);
        assert_eq!(
            show(&block(&net("::/0"), &[net("::/1")])),
            ["8000::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"],
            "the family's last address does not overflow"
        );
        assert!(block(&net("::/0"), &[net("8000::/1"), net("::/1")]).is_empty());
        assert_eq!(show(&block(&net("0.0.0.0/0"), &[net("255.255.255.255/32")])), ["0.0.0.0-255.255.255.254"]);
    }

    #[test]
    fn unions_are_canonical() {
        let a = AddrRange::of_net(&net("10.0.0.0/25"));
        let b = AddrRange::of_net(&net("10.0.0.128/25"));
        let c = AddrRange::of_net(&net("10.0.0.64/26"));
        let v6 = AddrRange::of_net(&net("fd00::/120"));
        assert_eq!(show(&union(vec![b, v6, c, a])), ["10.0.0.0-10.0.0.255", "fd00::-fd00::ff"]);
        let all = AddrRange::of_net(&net("::/0"));
        assert_eq!(union(vec![all, v6, all]), [all]);
        let u = union(vec![b, v6]);
        assert!(covers(&u, &"10.0.0.200".parse().unwrap()));
        assert!(!covers(&u, &"10.0.0.1".parse().unwrap()));
        assert!(covers(&u, &"fd00::ff".parse().unwrap()));
        assert!(!covers(&u, &"fd00::100".parse().unwrap()));
        assert!(!covers(&[], &"fd00::100".parse().unwrap()));
    }
}
