//! Sharding by Service ([`kuryr_shard`]): a Service `namespace/name` belongs to shard
//! `fnv1a64(key) % --shards`, and only the replica owning that shard reconciles it (finalizer,
//! record, backend, status, Events). Every replica still follows every Service and every
//! record, so that the node backend's stream stays complete wherever a binder connects
//! ([`crate::mirror`]).
//!
//! - **Gaining** a shard: once the watcher's view is complete, the shard's records are read
//!   again from the API (the previous owner wrote them since this replica last looked), the
//!   backend forgets what it remembered of them (Octavia adopts by tags again), the shard is
//!   *served*, then every Service and record of it is queued — a record without a Service is
//!   deleted as at start — and the backend's maintenance runs for it (Octavia: orphans).
//! - **Losing** one: it stops being served at once: reconciles of its Services are skipped, an
//!   Octavia change in flight stops before its next call ([`kuryr_shard::Served::serves`] is checked before
//!   each), and its records are from then on followed from the API like any other shard's.
//!   Nothing is deleted: a Service of another shard is not gone.
//! - **Unsharded** (`--shards 0`): everything is served from the start.

use std::collections::BTreeSet;
use std::ops::Deref;
use std::sync::Arc;

use kuryr_shard::{Ownership, Served};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

/// The name refusals give this service.
pub const SERVICE: &str = "kuryr-lbaas";

/// What this replica serves ([`Served`]: Services whose shard is owned and whose records are
/// loaded), with the hand-over's gauges; shared by the controller, the backend, the records
/// mirror and the shard follower; cheap to clone.
#[derive(Clone, Debug)]
pub struct Shards {
    served: Served,
    /// Shards served now.
    served_now: Gauge,
    /// Shards gained (loaded and queued).
    gains: Counter,
}

impl Deref for Shards {
    type Target = Served;
    fn deref(&self) -> &Served {
        &self.served
    }
}

impl Shards {
    /// Serving every Service: no sharding.
    pub fn all() -> Self {
        Self::serving(Served::all(SERVICE))
    }

    /// Following `ownership`; a sharded replica serves nothing until the follower loads a shard.
    pub fn new(ownership: watch::Receiver<Arc<Ownership>>) -> Self {
        Self::serving(Served::after_loading(SERVICE, ownership))
    }

    fn serving(served: Served) -> Self {
        Self { served, served_now: Gauge::default(), gains: Counter::default() }
    }

    /// Registers `kuryr_lbaas_shards_served` and `kuryr_lbaas_shard_gains_total`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kuryr_lbaas_shards_served",
            "Shards whose Services this replica reconciles (owned and loaded)",
            self.served_now.clone(),
        );
        registry.register(
            "kuryr_lbaas_shard_gains",
            "Shards taken over: their records read again and their Services queued",
            self.gains.clone(),
        );
    }

    /// Marks `loaded` as the served shards ([`crate::handover`] does, once their records are read).
    pub(crate) fn set_loaded(&self, loaded: BTreeSet<u32>) {
        self.served_now.set(i64::try_from(loaded.len()).unwrap_or(i64::MAX));
        self.served.set_loaded(loaded);
    }

    /// Counts `n` shards gained.
    pub(crate) fn count_gains(&self, n: usize) {
        self.gains.inc_by(u64::try_from(n).unwrap_or(u64::MAX));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_shard::Owner;

    use super::*;

    fn ownership(owned: &[u32]) -> Arc<Ownership> {
        let mut o = Ownership::pending("me", 4);
        o.ready = true;
        o.owned = owned.iter().copied().collect();
        for i in 0..4u32 {
            if !o.owned.contains(&i) {
                o.owners[i as usize] = Some(Owner { identity: "other".into(), endpoint: None });
            }
        }
        Arc::new(o)
    }

    #[test]
    fn served_only_once_owned_and_loaded() {
        let (tx, rx) = watch::channel(ownership(&[]));
        let shards = Shards::new(rx);
        let key = "ns/web";
        let i = kuryr_shard::shard_of(key, 4).unwrap();
        assert!(!shards.serves(key));
        tx.send_replace(ownership(&[i]));
        assert!(!shards.serves(key), "owned but its records not loaded yet");
        shards.set_loaded(BTreeSet::from([i]));
        assert!(shards.serves(key));
        assert!(shards.in_shards(key, &BTreeSet::from([i])));
        assert!(!shards.in_shards(key, &BTreeSet::from([(i + 1) % 4])));
        tx.send_replace(ownership(&[]));
        assert!(!shards.serves(key), "lost: not served even before the follower notices");
        assert!(Shards::all().serves(key) && !Shards::all().sharded());
    }
}
