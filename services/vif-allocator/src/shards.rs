//! Sharding by node ([`kuryr_shard`]): every replica follows every pod (the watcher's view
//! stays complete), but reconciles, streams and answers only for the nodes whose shard it owns.
//!
//! - **Gaining** a shard: its PodVifs are read from the API into the VIF index (another replica
//!   may have written them since this one started), PodVifs of pods that no longer exist are
//!   queued for cleanup, then every pod of the shard's nodes is queued. Only then is the shard
//!   *served* (streams, ReportPlugged).
//! - **Losing** one: it stops being served at once (reconciles of its pods are skipped, its
//!   nodes' WatchVifs streams end), then its VIFs leave the index without a delta.
//! - **Elsewhere**: WatchVifs, ReportPlugged and GetVif for a node served by another replica
//!   fail with UNAVAILABLE naming the owner, and the trailer `kuryr-shard-owner: HOST:PORT`
//!   when its endpoint is known; binders follow it.

pub use kuryr_shard::OWNER_METADATA;

/// The name refusals give this service.
pub const SERVICE: &str = "kuryr-vif-allocator";

/// What this replica serves (nodes whose shard is owned and whose VIFs are loaded), shared by
/// the controller, the gRPC service and the shard follower; cheap to clone.
pub type Shards = kuryr_shard::Served;
