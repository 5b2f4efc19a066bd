//! One address block: a slice of a network's CIDR owned by one node and bridged there.
//!
//! Offsets inside a block, for both families:
//!
//! | offset | use |
//! |---|---|
//! | 0 | the block's network address (IPv6: the subnet-router anycast address), never handed out |
//! | 1 | the gateway: the node's address on its bridge |
//! | 2 ..= last | pod addresses |
//! | size - 1 | IPv4 only: the broadcast address, never handed out |

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use super::PlanError;

/// The address family of a network, block or address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// The family of an address.
    pub fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// The family of a CIDR.
    pub fn of_net(net: &IpNet) -> Family {
        Family::of(net.addr())
    }

    /// Bits in an address of this family.
    pub fn bits(self) -> u8 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// The smallest block has two host bits: IPv4 /30 (network, gateway, one pod, broadcast) and
/// IPv6 /126 (anycast, gateway, two pods). Anything smaller holds no pod at all.
pub const MIN_HOST_BITS: u8 = 2;

/// The largest IPv6 block is a /96. Pod MACs of IPv6-only networks are built from the low 32
/// bits of the address (see [`super::mac`]); with at most 32 host bits those bits differ for
/// every address of a block, so MACs never repeat on one node's bridge.
pub const MIN_IPV6_BLOCK_PREFIX: u8 = 96;

/// An address as an integer, for offset arithmetic in either family.
pub(crate) fn to_bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// The inverse of [`to_bits`]; IPv4 keeps the low 32 bits.
pub(crate) fn from_bits(family: Family, bits: u128) -> IpAddr {
    match family {
        // Truncation is the point: callers only pass values inside an IPv4 network.
        Family::V4 => IpAddr::V4(Ipv4Addr::from(bits as u32)),
        Family::V6 => IpAddr::V6(Ipv6Addr::from(bits)),
    }
}

/// A validated address block: canonical (host bits zero) and big enough to hold a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Block(IpNet);

impl Block {
    /// Validates `cidr` as a block.
    pub fn new(cidr: IpNet) -> Result<Block, PlanError> {
        if cidr.trunc() != cidr {
            return Err(PlanError::NotCanonical { cidr: cidr.to_string(), canonical: cidr.trunc().to_string() });
        }
        let family = Family::of_net(&cidr);
        let host_bits = family.bits() - cidr.prefix_len();
        if host_bits < MIN_HOST_BITS {
            return Err(PlanError::BlockPrefix {
                cidr: cidr.to_string(),
                prefix: cidr.prefix_len(),
                reason: "a block needs at least 2 host bits (IPv4 /30, IPv6 /126) to hold a pod",
            });
        }
        if family == Family::V6 && cidr.prefix_len() < MIN_IPV6_BLOCK_PREFIX {
            return Err(PlanError::BlockPrefix {
                cidr: cidr.to_string(),
                prefix: cidr.prefix_len(),
                reason: "an IPv6 block may be at most a /96 (pod MACs use the low 32 address bits)",
            });
        }
        Ok(Block(cidr))
    }

    /// Parses and validates a block CIDR such as `10.244.3.0/24`.
    pub fn parse(cidr: &str) -> Result<Block, PlanError> {
        let net: IpNet = cidr.parse().map_err(|source| PlanError::BadCidr { cidr: cidr.to_string(), source })?;
        Block::new(net)
    }

    /// The block's CIDR.
    pub fn cidr(&self) -> IpNet {
        self.0
    }

    /// The block's address family.
    pub fn family(&self) -> Family {
        Family::of_net(&self.0)
    }

    fn base(&self) -> u128 {
        to_bits(self.0.network())
    }

    fn size(&self) -> u128 {
        1u128 << (self.family().bits() - self.0.prefix_len())
    }

    fn addr(&self, offset: u128) -> IpAddr {
        from_bits(self.family(), self.base() + offset)
    }

    /// The first offset handed to a pod (after the network address and the gateway).
    const FIRST_POD: u128 = 2;

    /// The last offset handed to a pod: IPv4 keeps the broadcast address out.
    fn last_pod(&self) -> u128 {
        match self.family() {
            Family::V4 => self.size() - 2,
            Family::V6 => self.size() - 1,
        }
    }

    /// The gateway: the first usable address, which the owning node puts on its bridge.
    pub fn gateway(&self) -> IpAddr {
        self.addr(1)
    }

    /// How many pod addresses the block holds.
    pub fn capacity(&self) -> u128 {
        self.last_pod() - Self::FIRST_POD + 1
    }

    /// Whether `ip` lies in the block (any offset).
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.contains(&ip)
    }

    /// Whether `ip` is one the block hands to pods (not network, gateway or broadcast).
    pub fn is_pod_address(&self, ip: IpAddr) -> bool {
        self.contains(ip) && (Self::FIRST_POD..=self.last_pod()).contains(&(to_bits(ip) - self.base()))
    }

    /// A pod address with the block's prefix length, as the pod's interface carries it.
    pub fn pod_address(&self, ip: IpAddr) -> IpNet {
        // The prefix length comes from a valid IpNet of the same family, so it always fits.
        IpNet::new(ip, self.0.prefix_len()).unwrap_or(self.0)
    }

    /// The next free pod address, searching upwards from just after `after` (the block's last
    /// allocation) and wrapping around, the way host-local does: a released address is reused
    /// only once the rest of the block has been used, so stale ARP/neighbour entries and
    /// conntrack state of a deleted pod do not hit its successor at once. `None` when full.
    ///
    /// Costs at most `used.len() + 1` probes: every probe that fails hits a distinct used address.
    pub fn next_free(&self, used: &BTreeSet<IpAddr>, after: Option<IpAddr>) -> Option<IpAddr> {
        let taken = used.iter().filter(|ip| self.is_pod_address(**ip)).count() as u128;
        if taken >= self.capacity() {
            return None;
        }
        let n = self.capacity();
        let start = match after {
            Some(ip) if self.is_pod_address(ip) => (to_bits(ip) - self.base() - Self::FIRST_POD + 1) % n,
            _ => 0,
        };
        (0..n).map(|i| self.addr(Self::FIRST_POD + (start + i) % n)).find(|ip| !used.contains(ip))
    }
}

impl fmt::Display for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn set(ips: &[&str]) -> BTreeSet<IpAddr> {
        ips.iter().map(|s| ip(s)).collect()
    }

    #[test]
    fn ipv4_reserves_network_gateway_and_broadcast() {
        let b = Block::parse("10.0.0.8/29").unwrap();
        assert_eq!(b.gateway(), ip("10.0.0.9"));
        assert_eq!(b.capacity(), 5);
        assert!(!b.is_pod_address(ip("10.0.0.8")));
        assert!(!b.is_pod_address(ip("10.0.0.9")));
        assert!(b.is_pod_address(ip("10.0.0.10")));
        assert!(b.is_pod_address(ip("10.0.0.14")));
        assert!(!b.is_pod_address(ip("10.0.0.15")));
        assert!(!b.is_pod_address(ip("10.0.0.16")));
        assert_eq!(b.pod_address(ip("10.0.0.10")).to_string(), "10.0.0.10/29");
    }

    #[test]
    fn ipv6_reserves_anycast_and_gateway_only() {
        let b = Block::parse("fd00:10::/126").unwrap();
        assert_eq!(b.gateway(), ip("fd00:10::1"));
        assert_eq!(b.capacity(), 2);
        assert!(b.is_pod_address(ip("fd00:10::3")));
        let full = set(&["fd00:10::2", "fd00:10::3"]);
        assert_eq!(b.next_free(&full, None), None);
        assert_eq!(Block::parse("fd00::/112").unwrap().capacity(), 65534);
    }

    #[test]
    fn next_free_walks_on_from_the_last_allocation_and_wraps() {
        let b = Block::parse("10.0.0.0/29").unwrap();
        let mut used = BTreeSet::new();
        assert_eq!(b.next_free(&used, None), Some(ip("10.0.0.2")));
        used.insert(ip("10.0.0.2"));
        assert_eq!(b.next_free(&used, Some(ip("10.0.0.2"))), Some(ip("10.0.0.3")));
        // .3 was released again, but the search goes on after the last allocation.
        used.insert(ip("10.0.0.4"));
        assert_eq!(b.next_free(&used, Some(ip("10.0.0.4"))), Some(ip("10.0.0.5")));
        // From the top it wraps around to the lowest free address, never the broadcast.
        let used = set(&["10.0.0.2", "10.0.0.4", "10.0.0.6"]);
        assert_eq!(b.next_free(&used, Some(ip("10.0.0.6"))), Some(ip("10.0.0.3")));
        let full = set(&["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]);
        assert_eq!(b.next_free(&full, Some(ip("10.0.0.3"))), None);
        // Addresses outside the block (or reserved ones) do not count as used pod addresses.
        let odd = set(&["10.0.0.0", "10.0.0.1", "10.0.0.7", "192.168.0.1"]);
        assert_eq!(b.next_free(&odd, Some(ip("192.168.0.1"))), Some(ip("10.0.0.2")));
    }

    #[test]
    fn rejects_blocks_that_cannot_hold_a_pod_or_are_not_canonical() {
        assert!(matches!(Block::parse("10.0.0.0/31"), Err(PlanError::BlockPrefix { .. })));
        assert!(matches!(Block::parse("10.0.0.0/32"), Err(PlanError::BlockPrefix { .. })));
        assert!(Block::parse("10.0.0.0/30").is_ok());
        assert!(matches!(Block::parse("fd00::/127"), Err(PlanError::BlockPrefix { .. })));
        assert!(matches!(Block::parse("fd00::/64"), Err(PlanError::BlockPrefix { .. })));
        assert!(matches!(Block::parse("10.0.0.1/24"), Err(PlanError::NotCanonical { .. })));
        assert!(matches!(Block::parse("nonsense"), Err(PlanError::BadCidr { .. })));
    }
}
