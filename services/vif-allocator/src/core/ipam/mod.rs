//! The pure part of the embedded IPAM (pod addresses kept in Kubernetes custom resources, for
//! clusters without Neutron).
//!
//! A [`PodNetwork`](crate::k8s::crd::PodNetwork) has up to one CIDR per family. Each CIDR is carved
//! into equal blocks ([`Pool`]); a node claims whole blocks (an
//! [`AddressBlock`](crate::k8s::crd::AddressBlock) object each) and its pods get addresses from its
//! own blocks only, so each node routes a few aggregated prefixes instead of one route per pod.
//! A block's first usable address is the gateway on the node's bridge ([`Block::gateway`]), and
//! pods carry the block's prefix length (the reasoning is in [`vif`]). MACs are derived from the
//! addresses ([`mac`]).
//!
//! The parts here (carving, address choice, MACs, VIF shape) need no API server. The store
//! ([`crate::backend::ipam`]) puts them on the Kubernetes API, where safety under concurrent allocators comes from
//! optimistic concurrency: every allocation is a status write that carries the resourceVersion it
//! was computed from.

mod block;
pub mod mac;
mod plan;
pub mod vif;

pub use block::{Block, Family, MIN_HOST_BITS, MIN_IPV6_BLOCK_PREFIX};
pub use mac::MacAddr;
pub use plan::Route;
pub use plan::{
    DEFAULT_BRIDGE, DEFAULT_IPV4_BLOCK_PREFIX, DEFAULT_IPV6_BLOCK_PREFIX, DEFAULT_MTU, MAX_MTU, MIN_IPV6_MTU, MIN_MTU,
    NetworkPlan, Pool, block_name,
};
pub use vif::{IpConfig, VifConfig};

/// Re-exported so that callers name CIDRs with the same type.
pub use ipnet;

/// Why a network (or block) definition is unusable.
#[derive(Clone, Debug, thiserror::Error)]
pub enum PlanError {
    /// The network lists no CIDR.
    #[error("the network has no CIDR")]
    NoCidr,
    /// A CIDR does not parse.
    #[error("{cidr:?} is not a CIDR")]
    BadCidr {
        /// As written.
        cidr: String,
        /// The parser's complaint.
        #[source]
        source: ipnet::AddrParseError,
    },
    /// A CIDR has host bits set, which leaves its meaning ambiguous.
    #[error("{cidr} has host bits set; write {canonical}")]
    NotCanonical {
        /// As written.
        cidr: String,
        /// The same prefix with the host bits cleared.
        canonical: String,
    },
    /// Two CIDRs of one family.
    #[error("the network has more than one {family} CIDR")]
    DuplicateFamily {
        /// The repeated family.
        family: Family,
    },
    /// A block size that does not fit the network or cannot hold a pod.
    #[error("block prefix /{prefix} for {cidr}: {reason}")]
    BlockPrefix {
        /// The network or block CIDR.
        cidr: String,
        /// The offending prefix length.
        prefix: u8,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// An MTU out of range.
    #[error("MTU {mtu} is outside {min}..={max}")]
    Mtu {
        /// As given.
        mtu: u32,
        /// The least allowed (1280 when the network has IPv6).
        min: u32,
        /// The most allowed.
        max: u32,
    },
    /// A route that cannot be installed.
    #[error("route to {destination:?}: {reason}")]
    Route {
        /// As written.
        destination: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A bridge name Linux would refuse.
    #[error("bridge name {bridge:?} {reason}")]
    Bridge {
        /// As written.
        bridge: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
}
