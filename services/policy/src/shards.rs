//! Sharding by node ([`kuryr_shard`], `--shards`): replicas split the nodes through Kubernetes
//! Leases, as the allocator's replicas do. Every replica follows the watcher and compiles the
//! whole cluster (a pod anywhere may be a peer of a pod on any node), but streams and answers
//! only for the nodes whose shard it owns.
//!
//! - WatchPolicies and GetNodePolicy for a node served by another replica fail with UNAVAILABLE
//!   naming the owner, with the trailer `kuryr-shard-owner: HOST:PORT` when its endpoint is
//!   known; binders follow it, and fall back to `--policy` when the owner cannot be reached.
//! - A node's streams end that way when its shard moves (a new replica took its fair share, or
//!   this one lost its Lease); the binder resumes from the new owner, which holds the same
//!   compiled state (its own log: the resume point of another replica is answered with a
//!   snapshot, and the binder programs only the difference).
//! - A replica killed: its Leases expire and the others take its shards within the Lease
//!   duration plus one renewal interval; the rules already programmed stay in force meanwhile.

pub use kuryr_shard::OWNER_METADATA;

/// The name refusals give this service.
pub const SERVICE: &str = "kuryr-policy";

/// The nodes this replica serves (those whose shard it owns: every replica compiles
/// everything, so there is nothing to load); cheap to clone.
pub type Shards = kuryr_shard::Served;
