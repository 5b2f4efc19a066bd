//! A pod network as the IPAM sees it: up to one pool per family, each carved into equal blocks,
//! plus what every pod of the network gets besides its addresses (MTU, extra routes, bridge).

use std::net::IpAddr;

use ipnet::IpNet;

use super::PlanError;
use super::block::{Block, Family, from_bits, to_bits};

/// A route to install in the pod besides the default routes implied by the gateways.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// Destination CIDR.
    pub destination: IpNet,
    /// Next hop; in a built [`super::VifConfig`] always set (a spec route without one goes via the
    /// pod's gateway of that family, since nothing but the bridge is on-link for a pod).
    pub gateway: Option<IpAddr>,
}

/// Default IPv4 block: a /24 holds 253 pods, more than kubelet's default of 110 per node.
pub const DEFAULT_IPV4_BLOCK_PREFIX: u8 = 24;
/// Default IPv6 block: a /112 holds 65534 pods; small enough that a /64 gives 2^48 blocks.
pub const DEFAULT_IPV6_BLOCK_PREFIX: u8 = 112;
/// Default interface MTU: plain Ethernet, no encapsulation (traffic between nodes is routed).
pub const DEFAULT_MTU: u32 = 1500;
/// Default name of the per-node Linux bridge that pods are attached to.
pub const DEFAULT_BRIDGE: &str = "kuryr0";
/// The smallest MTU any IPv4 host must accept (RFC 791).
pub const MIN_MTU: u32 = 576;
/// The smallest link MTU IPv6 allows (RFC 8200).
pub const MIN_IPV6_MTU: u32 = 1280;
/// The largest MTU a Linux veth takes.
pub const MAX_MTU: u32 = 65535;

/// One family's address range of a network and the size of the blocks nodes claim from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool {
    cidr: IpNet,
    block_prefix: u8,
}

impl Pool {
    /// Validates a pool: `cidr` canonical, `block_prefix` inside it and a valid [`Block`] size.
    pub fn new(cidr: IpNet, block_prefix: u8) -> Result<Pool, PlanError> {
        if cidr.trunc() != cidr {
            return Err(PlanError::NotCanonical { cidr: cidr.to_string(), canonical: cidr.trunc().to_string() });
        }
        if block_prefix < cidr.prefix_len() || block_prefix > Family::of_net(&cidr).bits() {
            return Err(PlanError::BlockPrefix {
                cidr: cidr.to_string(),
                prefix: block_prefix,
                reason: "the block prefix must be at least the network's prefix length",
            });
        }
        // Checks the block size rules once, on the first block.
        let first = IpNet::new(cidr.network(), block_prefix).map_err(|_| PlanError::BlockPrefix {
            cidr: cidr.to_string(),
            prefix: block_prefix,
            reason: "not a prefix length of this family",
        })?;
        Block::new(first)?;
        Ok(Pool { cidr, block_prefix })
    }

    /// The network CIDR of this family.
    pub fn cidr(&self) -> IpNet {
        self.cidr
    }

    /// The prefix length of every block.
    pub fn block_prefix(&self) -> u8 {
        self.block_prefix
    }

    /// The pool's family.
    pub fn family(&self) -> Family {
        Family::of_net(&self.cidr)
    }

    /// How many blocks the pool is carved into (2^(block prefix - network prefix)).
    pub fn block_count(&self) -> u128 {
        1u128 << (self.block_prefix - self.cidr.prefix_len())
    }

    fn block_bits(&self) -> u8 {
        self.family().bits() - self.block_prefix
    }

    /// Block number `index` (0-based, in address order), or `None` past the end.
    pub fn nth_block(&self, index: u128) -> Option<Block> {
        if index >= self.block_count() {
            return None;
        }
        let base = to_bits(self.cidr.network()) + (index << self.block_bits());
        let net = IpNet::new(from_bits(self.family(), base), self.block_prefix).ok()?;
        Block::new(net).ok()
    }

    /// The index of `block` in this pool, or `None` when it is not one of the pool's blocks
    /// (another family, another range, or another block size, e.g. after the spec changed).
    pub fn block_index(&self, block: &Block) -> Option<u128> {
        let net = block.cidr();
        if net.prefix_len() != self.block_prefix || !self.cidr.contains(&net) {
            return None;
        }
        Some((to_bits(net.network()) - to_bits(self.cidr.network())) >> self.block_bits())
    }

    /// The lowest block that overlaps none of `taken`, or `None` when there is none. `taken`
    /// may hold blocks of any size (a network whose block prefix was changed keeps its old
    /// blocks): any overlap disqualifies a candidate, so no address is ever in two blocks.
    /// Lowest-first keeps the used part of a huge IPv6 pool compact (and its pod MACs distinct,
    /// see `mac`).
    ///
    /// Costs O(n log n) in the number of taken blocks, however large the pool is.
    pub fn first_free_block<'a>(&self, taken: impl IntoIterator<Item = &'a Block>) -> Option<Block> {
        let base = to_bits(self.cidr.network());
        let last = to_bits(self.cidr.broadcast());
        let bits = self.block_bits();
        let mut ranges: Vec<(u128, u128)> = taken
            .into_iter()
            .filter(|b| b.family() == self.family())
            .filter_map(|b| {
                let lo = to_bits(b.cidr().network()).max(base);
                let hi = to_bits(b.cidr().broadcast()).min(last);
                (lo <= hi).then(|| ((lo - base) >> bits, (hi - base) >> bits))
            })
            .collect();
        ranges.sort_unstable();
        let mut next = 0u128;
        for (lo, hi) in ranges {
            if lo > next {
                break;
            }
            next = next.max(hi + 1);
        }
        self.nth_block(next)
    }
}

/// A validated pod network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkPlan {
    v4: Option<Pool>,
    v6: Option<Pool>,
    mtu: u32,
    routes: Vec<Route>,
    bridge: String,
}

impl NetworkPlan {
    /// Validates the CIDRs (at least one; at most one per family) and the block sizes. MTU,
    /// routes and bridge start at their defaults; see the `with_*` methods.
    pub fn new(cidrs: &[String], ipv4_block_prefix: u8, ipv6_block_prefix: u8) -> Result<NetworkPlan, PlanError> {
        let mut plan = NetworkPlan {
            v4: None,
            v6: None,
            mtu: DEFAULT_MTU,
            routes: Vec::new(),
            bridge: DEFAULT_BRIDGE.to_string(),
        };
        for cidr in cidrs {
            let net: IpNet = cidr.parse().map_err(|source| PlanError::BadCidr { cidr: cidr.clone(), source })?;
            let family = Family::of_net(&net);
            let (slot, prefix) = match family {
                Family::V4 => (&mut plan.v4, ipv4_block_prefix),
                Family::V6 => (&mut plan.v6, ipv6_block_prefix),
            };
            if slot.is_some() {
                return Err(PlanError::DuplicateFamily { family });
            }
            *slot = Some(Pool::new(net, prefix)?);
        }
        if plan.v4.is_none() && plan.v6.is_none() {
            return Err(PlanError::NoCidr);
        }
        Ok(plan)
    }

    /// Sets the pods' MTU; IPv6 needs at least 1280.
    pub fn with_mtu(mut self, mtu: u32) -> Result<NetworkPlan, PlanError> {
        let min = if self.v6.is_some() { MIN_IPV6_MTU } else { MIN_MTU };
        if !(min..=MAX_MTU).contains(&mtu) {
            return Err(PlanError::Mtu { mtu, min, max: MAX_MTU });
        }
        self.mtu = mtu;
        Ok(self)
    }

    /// Sets the extra routes pods get, as (destination CIDR, optional next hop). A route
    /// without a next hop goes via the pod's gateway of its family; every route must belong to
    /// a family the network has.
    pub fn with_routes<'a>(
        mut self,
        routes: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
    ) -> Result<NetworkPlan, PlanError> {
        let mut parsed = Vec::new();
        for (dst, gw) in routes {
            let bad = |reason: String| PlanError::Route { destination: dst.to_string(), reason };
            let destination: IpNet = dst.parse().map_err(|e| bad(format!("not a CIDR: {e}")))?;
            let family = Family::of_net(&destination);
            if self.pool(family).is_none() {
                return Err(bad(format!("the network has no {family} CIDR")));
            }
            let gateway = match gw {
                None => None,
                Some(g) => {
                    let g: IpAddr = g.parse().map_err(|e| bad(format!("gateway {g:?} is not an address: {e}")))?;
                    if Family::of(g) != family {
                        return Err(bad(format!("gateway {g} is not {family}")));
                    }
                    Some(g)
                }
            };
            parsed.push(Route { destination: destination.trunc(), gateway });
        }
        self.routes = parsed;
        Ok(self)
    }

    /// Sets the bridge name; it must be a valid Linux interface name.
    pub fn with_bridge(mut self, bridge: &str) -> Result<NetworkPlan, PlanError> {
        let reason = if bridge.is_empty() || bridge.len() > 15 {
            Some("must be 1 to 15 bytes long")
        } else if bridge == "." || bridge == ".." {
            Some("must not be . or ..")
        } else if bridge.chars().any(|c| c == '/' || c == ':' || c.is_whitespace()) {
            Some("must not contain '/', ':' or whitespace")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(PlanError::Bridge { bridge: bridge.to_string(), reason });
        }
        self.bridge = bridge.to_string();
        Ok(self)
    }

    /// The pool of one family, if the network has that family.
    pub fn pool(&self, family: Family) -> Option<&Pool> {
        match family {
            Family::V4 => self.v4.as_ref(),
            Family::V6 => self.v6.as_ref(),
        }
    }

    /// The pools, IPv4 first: a dual-stack pod's MAC comes from its IPv4 address.
    pub fn pools(&self) -> impl Iterator<Item = &Pool> {
        self.v4.iter().chain(self.v6.iter())
    }

    /// The pool a block belongs to, if it is one of this network's blocks.
    pub fn pool_of(&self, block: &Block) -> Option<&Pool> {
        self.pool(block.family()).filter(|p| p.block_index(block).is_some())
    }

    /// The pods' MTU.
    pub fn mtu(&self) -> u32 {
        self.mtu
    }

    /// Extra routes for pods.
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// The per-node bridge pods are attached to.
    pub fn bridge(&self) -> &str {
        &self.bridge
    }
}

/// The deterministic object name of a network's block: `<network>-<cidr>` with `.`, `:` and `/`
/// turned into `-` (`pods-10-244-3-0-24`, `pods-fd00--1-0-112`). Every allocator derives the
/// same name for the same block, so claiming a block is a plain create and `AlreadyExists`
/// means another allocator claimed it first.
pub fn block_name(network: &str, block: &Block) -> String {
    let cidr: String =
        block.cidr().to_string().chars().map(|c| if matches!(c, '.' | ':' | '/') { '-' } else { c }).collect();
    format!("{network}-{cidr}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidrs(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn block(s: &str) -> Block {
        Block::parse(s).unwrap()
    }

    #[test]
    fn carves_ipv4_networks_into_blocks() {
        let plan = NetworkPlan::new(&cidrs(&["10.244.0.0/16"]), 24, 112).unwrap();
        let pool = plan.pool(Family::V4).unwrap();
        assert!(plan.pool(Family::V6).is_none());
        assert_eq!(pool.block_count(), 256);
        assert_eq!(pool.nth_block(0).unwrap(), block("10.244.0.0/24"));
        assert_eq!(pool.nth_block(255).unwrap(), block("10.244.255.0/24"));
        assert_eq!(pool.nth_block(256), None);
        assert_eq!(pool.block_index(&block("10.244.7.0/24")), Some(7));
        assert_eq!(pool.block_index(&block("10.245.0.0/24")), None);
        assert_eq!(pool.block_index(&block("10.244.0.0/25")), None);
    }

    #[test]
    fn first_free_block_fills_gaps_lowest_first() {
        let plan = NetworkPlan::new(&cidrs(&["10.0.0.0/28"]), 29, 112).unwrap();
        let pool = plan.pool(Family::V4).unwrap();
        assert_eq!(pool.first_free_block([]), Some(block("10.0.0.0/29")));
        let taken = [block("10.0.0.0/29")];
        assert_eq!(pool.first_free_block(&taken), Some(block("10.0.0.8/29")));
        let taken = [block("10.0.0.8/29")];
        assert_eq!(pool.first_free_block(&taken), Some(block("10.0.0.0/29")));
        // Blocks of other networks or families take nothing from this pool.
        let taken = [block("10.0.0.8/29"), block("192.168.0.0/29"), block("fd00::/120")];
        assert_eq!(pool.first_free_block(&taken), Some(block("10.0.0.0/29")));
        // A block of another size (left from an older block prefix) takes every block it overlaps.
        let taken = [block("10.0.0.4/30")];
        assert_eq!(pool.first_free_block(&taken), Some(block("10.0.0.8/29")));
        let taken = [block("10.0.0.0/28")];
        assert_eq!(pool.first_free_block(&taken), None);
        let taken = [block("10.0.0.8/29"), block("10.0.0.0/29")];
        assert_eq!(pool.first_free_block(&taken), None);
    }

    #[test]
    fn carves_huge_ipv6_networks_without_enumerating_them() {
        let plan = NetworkPlan::new(&cidrs(&["fd00:10::/64"]), 24, 112).unwrap();
        let pool = plan.pool(Family::V6).unwrap();
        assert_eq!(pool.block_count(), 1 << 48);
        assert_eq!(pool.nth_block(0).unwrap(), block("fd00:10::/112"));
        assert_eq!(pool.nth_block(1).unwrap(), block("fd00:10::1:0/112"));
        assert_eq!(pool.nth_block((1 << 48) - 1).unwrap(), block("fd00:10::ffff:ffff:ffff:0/112"));
        let taken = [block("fd00:10::/112"), block("fd00:10::2:0/112")];
        assert_eq!(pool.first_free_block(&taken), Some(block("fd00:10::1:0/112")));
        assert_eq!(pool.block_index(&block("fd00:10::2:0/112")), Some(2));
    }

    #[test]
    fn dual_stack_has_one_pool_per_family_ipv4_first() {
        let plan = NetworkPlan::new(&cidrs(&["fd00::/48", "10.1.0.0/16"]), 26, 120).unwrap();
        let families: Vec<_> = plan.pools().map(|p| (p.family(), p.block_prefix())).collect();
        assert_eq!(families, [(Family::V4, 26), (Family::V6, 120)]);
        assert_eq!(plan.pool_of(&block("fd00::100/120")).map(|p| p.family()), Some(Family::V6));
        assert_eq!(plan.pool_of(&block("fd01::/120")), None);
    }

    #[test]
    fn rejects_bad_networks() {
        let err = |list: &[&str], v4: u8, v6: u8| NetworkPlan::new(&cidrs(list), v4, v6).unwrap_err();
        assert!(matches!(err(&[], 24, 112), PlanError::NoCidr));
        assert!(matches!(err(&["10.0.0.0/16", "10.1.0.0/16"], 24, 112), PlanError::DuplicateFamily { .. }));
        assert!(matches!(err(&["10.0.0.0/24"], 16, 112), PlanError::BlockPrefix { .. }));
        assert!(matches!(err(&["10.0.0.0/24"], 31, 112), PlanError::BlockPrefix { .. }));
        assert!(matches!(err(&["10.0.0.0/24"], 33, 112), PlanError::BlockPrefix { .. }));
        assert!(matches!(err(&["fd00::/64"], 24, 80), PlanError::BlockPrefix { .. }));
        assert!(matches!(err(&["10.0.0.1/24"], 24, 112), PlanError::NotCanonical { .. }));
        assert!(matches!(err(&["10.0.0.0"], 24, 112), PlanError::BadCidr { .. }));
        // The whole network as one block is fine.
        assert!(NetworkPlan::new(&cidrs(&["10.0.0.0/24"]), 24, 112).is_ok());
    }

    #[test]
    fn validates_mtu_routes_and_bridge() {
        let v4 = NetworkPlan::new(&cidrs(&["10.0.0.0/16"]), 24, 112).unwrap();
        let dual = NetworkPlan::new(&cidrs(&["10.0.0.0/16", "fd00::/64"]), 24, 112).unwrap();
        assert_eq!(v4.clone().with_mtu(1000).unwrap().mtu(), 1000);
        assert!(matches!(dual.clone().with_mtu(1000), Err(PlanError::Mtu { min: 1280, .. })));
        assert!(matches!(v4.clone().with_mtu(70000), Err(PlanError::Mtu { .. })));

        let routed = dual.clone().with_routes([("10.96.0.0/12", None), ("fd10::/108", Some("fd00::1"))]).unwrap();
        assert_eq!(routed.routes().len(), 2);
        assert_eq!(routed.routes()[1].gateway, Some("fd00::1".parse().unwrap()));
        assert!(matches!(v4.clone().with_routes([("fd10::/108", None)]), Err(PlanError::Route { .. })));
        assert!(matches!(v4.clone().with_routes([("10.96.0.0/12", Some("fd00::1"))]), Err(PlanError::Route { .. })));
        assert!(matches!(v4.clone().with_routes([("10.96.0.0", None)]), Err(PlanError::Route { .. })));

        assert_eq!(v4.clone().with_bridge("br-pods").unwrap().bridge(), "br-pods");
        for bad in ["", "a-name-longer-than-15", "a/b", "a b", "..", "eth0:1"] {
            assert!(matches!(v4.clone().with_bridge(bad), Err(PlanError::Bridge { .. })), "{bad:?}");
        }
    }

    #[test]
    fn block_names_are_valid_object_names_and_distinct() {
        assert_eq!(block_name("pods", &block("10.244.3.0/24")), "pods-10-244-3-0-24");
        assert_eq!(block_name("pods", &block("fd00:10::1:0/112")), "pods-fd00-10--1-0-112");
        assert_eq!(block_name("pods", &block("fd00:10::/112")), "pods-fd00-10---112");
        assert_ne!(block_name("pods", &block("fd00:10::1:0/112")), block_name("pods", &block("fd00:10:0:1::/112")));
    }
}
