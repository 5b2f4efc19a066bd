//! Readiness: lbaas is SERVING only when (a) the records were loaded from the API (recovery),
//! (b) the watcher's stream is live (its snapshot complete, and not silent for longer than
//! `--stream-idle-timeout`) and (c) with sharding, the watch on the records of the other
//! replicas' shards has listed them once ([`crate::mirror`]). The driver
//! ([`kuryr_runtime::readiness`]) logs each change once, naming what is missing.

use kuryr_proto::service_names;
use kuryr_runtime::readiness::Conditions;

/// The conditions of readiness.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    /// The records were loaded.
    Recovered,
    /// The watcher's stream is live.
    Watcher,
    /// The records of every shard are followed (at once without sharding).
    Mirror,
}

impl Conditions for Condition {
    const ALL: &'static [Self] = &[Condition::Recovered, Condition::Watcher, Condition::Mirror];

    fn describe(self) -> &'static str {
        match self {
            Condition::Recovered => "recovery of the ServiceLoadBalancer records",
            Condition::Watcher => "a live watcher stream",
            Condition::Mirror => "the first list of the other shards' records",
        }
    }
}

/// lbaas' readiness; cheap to clone.
pub type Readiness = kuryr_runtime::readiness::Readiness<Condition>;

/// The services whose health follows the conditions.
pub const SERVICES: &[&str] = &[service_names::LOAD_BALANCERS];
