//! Pod MAC addresses, derived from the pod's address instead of drawn at random.
//!
//! The MAC is `0a:58` followed by four address bytes: the IPv4 address when the pod has one
//! (the convention kubenet and ovn-kubernetes use, so `0a:58:0a:f4:03:07` reads as 10.244.3.7),
//! otherwise the low four bytes of its IPv6 address. `0x0a` has the locally-administered bit set
//! and the multicast bit clear, so these never clash with vendor-assigned NICs.
//!
//! Why they cannot collide:
//! - IPv4: the mapping is injective and the IPAM never hands out one address twice in a network,
//!   so two pods of the network never share a MAC, on any node.
//! - IPv6-only: blocks are at most /96 (`block::MIN_IPV6_BLOCK_PREFIX`), so the low 32 bits
//!   differ for every address of a block. One node's blocks are distinct blocks of the same
//!   network, claimed lowest-first; their low 32 bits differ as long as the network holds fewer
//!   than 2^(32 - host bits) claimed blocks (65536 blocks of /112) or is itself a /96 or longer.
//!   MACs only need to be unique per L2 segment, and a segment is one node's bridge.
//! - Being a function of the address also makes allocation idempotent without storing anything
//!   more, and a re-created VIF with the same address keeps its MAC (neighbour caches stay right).

use std::fmt;
use std::net::IpAddr;

/// The first two bytes of every pod MAC: locally administered, unicast.
pub const MAC_PREFIX: [u8; 2] = [0x0a, 0x58];

/// A 48-bit MAC address; displays lower-case and colon-separated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// The MAC for one address (see the module docs).
    pub fn for_address(ip: IpAddr) -> MacAddr {
        let tail: [u8; 4] = match ip {
            IpAddr::V4(a) => a.octets(),
            IpAddr::V6(a) => {
                let o = a.octets();
                [o[12], o[13], o[14], o[15]]
            }
        };
        let [a, b] = MAC_PREFIX;
        MacAddr([a, b, tail[0], tail[1], tail[2], tail[3]])
    }

    /// The MAC for a pod with these addresses: from its IPv4 address if it has one, else from
    /// its first IPv6 address; `None` for no addresses.
    pub fn for_pod(addresses: &[IpAddr]) -> Option<MacAddr> {
        addresses.iter().find(|a| a.is_ipv4()).or_else(|| addresses.first()).map(|a| MacAddr::for_address(*a))
    }

    /// Locally administered (bit 1 of the first byte set).
    pub fn is_local(&self) -> bool {
        self.0[0] & 0x02 != 0
    }

    /// Unicast (bit 0 of the first byte clear).
    pub fn is_unicast(&self) -> bool {
        self.0[0] & 0x01 == 0
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::core::ipam::Block;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ipv4_macs_spell_the_address() {
        let mac = MacAddr::for_address(ip("10.244.3.7"));
        assert_eq!(mac.to_string(), "0a:58:0a:f4:03:07");
        assert!(mac.is_local() && mac.is_unicast());
    }

    #[test]
    fn dual_stack_pods_use_the_ipv4_address() {
        let mac = MacAddr::for_pod(&[ip("fd00::1:2"), ip("10.0.0.2")]).unwrap();
        assert_eq!(mac.to_string(), "0a:58:0a:00:00:02");
        let v6 = MacAddr::for_pod(&[ip("fd00::a:102")]).unwrap();
        assert_eq!(v6.to_string(), "0a:58:00:0a:01:02");
        assert_eq!(MacAddr::for_pod(&[]), None);
    }

    #[test]
    fn macs_are_distinct_across_a_nodes_ipv6_blocks() {
        // Two /112 blocks of one /64 on the same node: every pod address gets its own MAC.
        let mut macs = BTreeSet::new();
        for b in ["fd00::/112", "fd00::1:0/112"] {
            let b = Block::parse(b).unwrap();
            let base = u128::from(match b.cidr().network() {
                IpAddr::V6(a) => a,
                IpAddr::V4(_) => unreachable!(),
            });
            for off in (2..1000).chain(65000..65536) {
                let a = IpAddr::V6((base + off).into());
                assert!(macs.insert(MacAddr::for_address(a)), "{a} repeats a MAC");
            }
        }
    }
}
