//! Readiness: the allocator is SERVING only when (a) the watcher's stream is live (its snapshot
//! complete, and not silent for longer than `--stream-idle-timeout`), (b) the VIFs recorded in
//! PodVifs were loaded (recovery), (c) the PodNetwork exists, and (d) its first round of shard
//! Leases is done (it may own no shard: it then serves by redirecting binders to the owners).
//! The driver ([`kuryr_runtime::readiness`]) logs each change once, naming what is missing.
//!
//! WatchVifs itself serves from (b) on, even while the watcher is away: binders then keep the
//! VIFs they have (and get those recovered after a restart at once), which beats refusing them.

use kuryr_proto::service_names;
use kuryr_runtime::readiness::Conditions;

/// The conditions of readiness.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    /// The PodNetwork (or the Neutron network) exists.
    Network,
    /// The recorded VIFs were loaded.
    Recovered,
    /// The watcher's stream is live.
    Watcher,
    /// The first round of shard Leases is done (at once without sharding).
    Shards,
}

impl Conditions for Condition {
    const ALL: &'static [Self] = &[Condition::Network, Condition::Recovered, Condition::Watcher, Condition::Shards];

    fn describe(self) -> &'static str {
        match self {
            Condition::Network => "the PodNetwork",
            Condition::Recovered => "recovery of the recorded VIFs",
            Condition::Watcher => "a live watcher stream",
            Condition::Shards => "the first round of shard Leases",
        }
    }
}

/// The allocator's readiness; cheap to clone.
pub type Readiness = kuryr_runtime::readiness::Readiness<Condition>;

/// The services whose health follows the conditions. PoolManager answers UNIMPLEMENTED with the
/// embedded backend; it follows along so that the overall status means "the allocator works".
pub const SERVICES: &[&str] = &[service_names::VIF_ALLOCATOR, service_names::POOL_MANAGER];
