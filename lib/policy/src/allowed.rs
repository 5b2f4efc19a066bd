//! What one group of pods may exchange traffic with, in one direction: the union of its
//! policies' rules, flattened into four sets whose shapes match the nftables set types the
//! binder declares for them (see the crate documentation for why four):
//!
//! | set | element | nftables type | lookup |
//! |---|---|---|---|
//! | `any` | a peer address, every protocol and port | `ipv4_addr` (hash) | O(1) |
//! | `nets` | a peer address range, every protocol and port | `ipv4_addr`, `flags interval` | O(log n) |
//! | `ports` | a peer address, protocol and port | `ipv4_addr . inet_proto . inet_service` (hash) | O(1) |
//! | `ranges` | a box: address range × protocol × port range | the same, `flags interval` | bitmap scan |
//!
//! The form is canonical — equal unions give equal values — so that a change is a difference of
//! elements, and the interval sets' elements are disjoint (the kernel refuses overlapping
//! intervals in one set). Pod peers land in the hash sets unless their ports form a range;
//! `ipBlock`s and port ranges land in the interval sets.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::addr::{self, AddrRange, Family};
use crate::model::Protocol;

/// A peer address with one port of one protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddrPort {
    pub addr: IpAddr,
    pub protocol: Protocol,
    pub port: u16,
}

/// A box of traffic: addresses × one protocol × a port range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortBox {
    pub addrs: AddrRange,
    pub protocol: Protocol,
    pub first_port: u16,
    pub last_port: u16,
}

/// What a packet offers to a policy decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Traffic {
    /// TCP, UDP or SCTP to a port (the destination port: of the protected pod for ingress, of
    /// the peer for egress).
    Port(Protocol, u16),
    /// Any other protocol (ICMP, ...): only rules without ports allow it.
    Other,
}

/// The peers one group may talk with, in canonical form (module documentation).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allowed {
    pub any: BTreeSet<IpAddr>,
    pub nets: BTreeSet<AddrRange>,
    pub ports: BTreeSet<AddrPort>,
    pub ranges: BTreeSet<PortBox>,
}

impl Allowed {
    /// Whether traffic with the peer `peer` is allowed.
    pub fn allows(&self, peer: &IpAddr, traffic: Traffic) -> bool {
        if self.any.contains(peer) || self.nets.iter().any(|r| r.contains(peer)) {
            return true;
        }
        let Traffic::Port(protocol, port) = traffic else { return false };
        self.ports.contains(&AddrPort { addr: *peer, protocol, port })
            || self.ranges.iter().any(|b| {
                b.protocol == protocol && b.addrs.contains(peer) && (b.first_port..=b.last_port).contains(&port)
            })
    }

    /// The number of elements (all four sets).
    pub fn len(&self) -> usize {
        self.any.len() + self.nets.len() + self.ports.len() + self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements of `self` that `other` lacks.
    pub fn minus(&self, other: &Allowed) -> Allowed {
        Allowed {
            any: self.any.difference(&other.any).copied().collect(),
            nets: self.nets.difference(&other.nets).copied().collect(),
            ports: self.ports.difference(&other.ports).copied().collect(),
            ranges: self.ranges.difference(&other.ranges).copied().collect(),
        }
    }
}

/// Which ports a contribution allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Ports {
    /// Every protocol, every port.
    All,
    /// One protocol, `first..=last`.
    Range(Protocol, u16, u16),
}

/// Collects (addresses × ports) contributions of rules and turns them into the canonical
/// [`Allowed`].
#[derive(Debug, Default)]
pub struct Builder {
    singles: BTreeSet<(IpAddr, Ports)>,
    ranges: Vec<(AddrRange, Ports)>,
}

impl Builder {
    /// Allows `ports` with the single address `addr`.
    pub fn address(&mut self, addr: IpAddr, ports: Ports) {
        self.singles.insert((addr, ports));
    }

    /// Allows `ports` with every address of `range`.
    pub fn range(&mut self, range: AddrRange, ports: Ports) {
        if range.is_single() {
            self.address(range.first_addr(), ports);
        } else {
            self.ranges.push((range, ports));
        }
    }

    /// The canonical form. Elements a wider one already allows are left out where that is cheap
    /// to tell (an address of `any` or `nets` needs no port element).
    pub fn build(self) -> Allowed {
        let mut out = Allowed::default();
        let mut wide = Vec::new();
        let mut nets = Vec::new();
        for (r, p) in self.ranges {
            match p {
                Ports::All => nets.push(r),
                Ports::Range(..) => wide.push((r, p)),
            }
        }
        let nets = addr::union(nets);
        for (a, p) in &self.singles {
            if *p == Ports::All && !addr::covers(&nets, a) {
                out.any.insert(*a);
            }
        }
        for (a, p) in self.singles {
            if out.any.contains(&a) || addr::covers(&nets, &a) {
                continue;
            }
            match p {
                Ports::All => {}
                Ports::Range(protocol, first, last) if first == last => {
                    out.ports.insert(AddrPort { addr: a, protocol, port: first });
                }
                Ports::Range(..) => wide.push((AddrRange::single(a), p)),
            }
        }
        out.nets = nets.into_iter().collect();
        out.ranges = disjoint_boxes(wide);
        out
    }
}

/// Turns overlapping (addresses × ports) items into disjoint boxes covering exactly their union.
///
/// A sweep over the address line: every item's first address and the address after its last
/// cut the line into elementary intervals, over each of which the same items are active. The
/// union of their port ranges, per protocol, is computed once per interval; neighbouring
/// intervals with the same union are joined. Cost: O(n log n) for the sort plus, per elementary
/// interval, the items active over it.
fn disjoint_boxes(items: Vec<(AddrRange, Ports)>) -> BTreeSet<PortBox> {
    let mut out = BTreeSet::new();
    for family in [Family::V4, Family::V6] {
        // (address, +1 starts / -1 ends after, item index)
        let mut cuts: Vec<(u128, bool, usize)> = Vec::new();
        let fam: Vec<&(AddrRange, Ports)> = items.iter().filter(|(r, _)| r.family == family).collect();
        for (i, (r, _)) in fam.iter().enumerate() {
            cuts.push((r.first, true, i));
            if let Some(after) = r.last.checked_add(1).filter(|a| *a <= family.max()) {
                cuts.push((after, false, i));
            }
        }
        cuts.sort_unstable();
        let mut active: BTreeMap<usize, ()> = BTreeMap::new();
        // The current run: where it started and its port union.
        let mut run: Option<(u128, PortUnion)> = None;
        let mut k = 0;
        while k < cuts.len() {
            let at = cuts[k].0;
            while k < cuts.len() && cuts[k].0 == at {
                let (_, start, i) = cuts[k];
                if start {
                    active.insert(i, ());
                } else {
                    active.remove(&i);
                }
                k += 1;
            }
            let union = PortUnion::of(active.keys().map(|i| &fam[*i].1));
            if run.as_ref().is_some_and(|(_, u)| *u == union) {
                continue;
            }
            if let Some((start, u)) = run.take() {
                u.emit(AddrRange { family, first: start, last: at - 1 }, &mut out);
            }
            run = Some((at, union));
        }
        if let Some((start, u)) = run {
            u.emit(AddrRange { family, first: start, last: family.max() }, &mut out);
        }
    }
    out
}

/// The union of port ranges, per protocol, as sorted disjoint ranges (adjacent ones joined).
#[derive(Debug, Default, PartialEq, Eq)]
struct PortUnion(BTreeMap<Protocol, Vec<(u16, u16)>>);

impl PortUnion {
    fn of<'a>(ports: impl Iterator<Item = &'a Ports>) -> Self {
        let mut by_proto: BTreeMap<Protocol, Vec<(u16, u16)>> = BTreeMap::new();
        for p in ports {
            if let Ports::Range(proto, first, last) = p {
                by_proto.entry(*proto).or_default().push((*first, *last));
            }
        }
        for ranges in by_proto.values_mut() {
            ranges.sort_unstable();
            let mut joined: Vec<(u16, u16)> = Vec::with_capacity(ranges.len());
            for &(f, l) in ranges.iter() {
                match joined.last_mut() {
                    Some(prev) if u32::from(prev.1) + 1 >= u32::from(f) => prev.1 = prev.1.max(l),
                    _ => joined.push((f, l)),
                }
            }
            *ranges = joined;
        }
        Self(by_proto)
    }

    fn emit(&self, addrs: AddrRange, out: &mut BTreeSet<PortBox>) {
        for (protocol, ranges) in &self.0 {
            for &(first_port, last_port) in ranges {
                out.insert(PortBox { addrs, protocol: *protocol, first_port, last_port });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn range(a: &str, b: &str) -> AddrRange {
        AddrRange::new(ip(a), ip(b)).unwrap()
    }

    fn show(a: &Allowed) -> Vec<String> {
        let mut out: Vec<String> = a.any.iter().map(|a| format!("any {a}")).collect();
        out.extend(a.nets.iter().map(|r| format!("net {r}")));
        out.extend(a.ports.iter().map(|p| format!("port {} {} {}", p.addr, p.protocol, p.port)));
        out.extend(a.ranges.iter().map(|b| format!("box {} {} {}-{}", b.addrs, b.protocol, b.first_port, b.last_port)));
        out
    }

    #[test]
    fn contributions_land_in_the_set_of_their_shape() {
        let mut b = Builder::default();
        b.address(ip("10.0.0.1"), Ports::All);
        b.address(ip("10.0.0.1"), Ports::Range(Protocol::Tcp, 80, 80)); // covered by any
        b.address(ip("10.0.0.2"), Ports::Range(Protocol::Tcp, 80, 80));
        b.address(ip("10.0.0.2"), Ports::Range(Protocol::Udp, 53, 53));
        b.address(ip("fd00::2"), Ports::Range(Protocol::Sctp, 1000, 2000));
        b.range(range("10.1.0.0", "10.1.0.255"), Ports::All);
        b.address(ip("10.1.0.7"), Ports::Range(Protocol::Tcp, 80, 80)); // covered by the net
        b.range(range("10.2.0.0", "10.2.0.255"), Ports::Range(Protocol::Tcp, 443, 443));
        b.range(range("10.3.0.1", "10.3.0.1"), Ports::All); // a single address is an address
        assert_eq!(
            show(&b.build()),
            [
                "any 10.0.0.1",
                "any 10.3.0.1",
                "net 10.1.0.0-10.1.0.255",
                "port 10.0.0.2 tcp 80",
                "port 10.0.0.2 udp 53",
                "box 10.2.0.0-10.2.0.255 tcp 443-443",
                "box fd00::2-fd00::2 sctp 1000-2000",
            ]
        );
    }

    #[test]
    fn overlapping_boxes_become_disjoint_and_canonical() {
        let mut b = Builder::default();
        b.range(range("10.0.0.0", "10.0.0.255"), Ports::Range(Protocol::Tcp, 80, 90));
        b.range(range("10.0.0.128", "10.0.1.255"), Ports::Range(Protocol::Tcp, 85, 100));
        b.range(range("10.0.1.0", "10.0.1.255"), Ports::Range(Protocol::Udp, 53, 53));
        let got = b.build();
        assert_eq!(
            show(&got),
            [
                "box 10.0.0.0-10.0.0.127 tcp 80-90",
                "box 10.0.0.128-10.0.0.255 tcp 80-100",
                "box 10.0.1.0-10.0.1.255 tcp 85-100",
                "box 10.0.1.0-10.0.1.255 udp 53-53",
            ]
        );
        // The same union given differently gives the same value.
        let mut b = Builder::default();
        b.range(range("10.0.1.0", "10.0.1.255"), Ports::Range(Protocol::Udp, 53, 53));
        b.range(range("10.0.0.128", "10.0.0.255"), Ports::Range(Protocol::Tcp, 80, 100));
        b.range(range("10.0.0.0", "10.0.0.127"), Ports::Range(Protocol::Tcp, 80, 90));
        b.range(range("10.0.1.0", "10.0.1.255"), Ports::Range(Protocol::Tcp, 85, 86));
        b.range(range("10.0.1.0", "10.0.1.255"), Ports::Range(Protocol::Tcp, 87, 100));
        assert_eq!(b.build(), got);
    }

    #[test]
    fn boxes_reach_the_end_of_the_address_space() {
        let mut b = Builder::default();
        b.range(AddrRange::of_net(&"::/0".parse().unwrap()), Ports::Range(Protocol::Tcp, 1, 65535));
        b.range(AddrRange::of_net(&"0.0.0.0/0".parse().unwrap()), Ports::Range(Protocol::Udp, 7, 7));
        assert_eq!(
            show(&b.build()),
            ["box 0.0.0.0-255.255.255.255 udp 7-7", "box ::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff tcp 1-65535"]
        );
    }

    #[test]
    fn allows_reads_every_set() {
        let mut b = Builder::default();
        b.address(ip("10.0.0.1"), Ports::All);
        b.address(ip("10.0.0.2"), Ports::Range(Protocol::Tcp, 80, 80));
        b.range(range("10.1.0.0", "10.1.0.255"), Ports::All);
        b.range(range("10.2.0.0", "10.2.0.255"), Ports::Range(Protocol::Udp, 1000, 2000));
        let a = b.build();
        assert!(a.allows(&ip("10.0.0.1"), Traffic::Other));
        assert!(a.allows(&ip("10.1.0.9"), Traffic::Port(Protocol::Sctp, 9)));
        assert!(a.allows(&ip("10.0.0.2"), Traffic::Port(Protocol::Tcp, 80)));
        assert!(!a.allows(&ip("10.0.0.2"), Traffic::Port(Protocol::Udp, 80)));
        assert!(!a.allows(&ip("10.0.0.2"), Traffic::Other));
        assert!(a.allows(&ip("10.2.0.9"), Traffic::Port(Protocol::Udp, 2000)));
        assert!(!a.allows(&ip("10.2.0.9"), Traffic::Port(Protocol::Udp, 2001)));
        assert!(!a.allows(&ip("10.3.0.1"), Traffic::Port(Protocol::Udp, 1500)));
        assert_eq!(a.len(), 4);
        let removed = a.minus(&Allowed::default());
        assert_eq!(removed, a);
        assert!(a.minus(&a).is_empty());
    }
}
