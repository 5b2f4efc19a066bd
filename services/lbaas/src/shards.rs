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
//!   Octavia change in flight stops before its next call ([`Shards::serves`] is checked before
//!   each), and its records are from then on followed from the API like any other shard's.
//!   Nothing is deleted: a Service of another shard is not gone.
//! - **Unsharded** (`--shards 0`): everything is served from the start.

use std::collections::BTreeSet;
use std::sync::Arc;

use kuryr_runtime::Shutdown;
use kuryr_shard::Ownership;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{Notify, watch};

use crate::backend::Backend;
use crate::controller::{Controller, locked};
use crate::k8s::Kube;

/// What this replica serves; shared by the controller, the backend, the records mirror and the
/// shard follower; cheap to clone.
#[derive(Clone, Debug)]
pub struct Shards {
    ownership: watch::Receiver<Arc<Ownership>>,
    /// Owned shards whose records were loaded after gaining them: the ones served.
    loaded: Arc<watch::Sender<BTreeSet<u32>>>,
    /// Shards served now.
    served: Gauge,
    /// Shards gained (loaded and queued).
    gains: Counter,
}

impl Shards {
    /// Serving every Service: no sharding.
    pub fn all() -> Self {
        Self::new(kuryr_shard::ShardHandle::unsharded("all").ownership())
    }

    /// Following `ownership`; a sharded replica serves nothing until the follower loads a shard.
    pub fn new(ownership: watch::Receiver<Arc<Ownership>>) -> Self {
        Self {
            ownership,
            loaded: Arc::new(watch::Sender::new(BTreeSet::new())),
            served: Gauge::default(),
            gains: Counter::default(),
        }
    }

    /// Registers `kuryr_lbaas_shards_served` and `kuryr_lbaas_shard_gains_total`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kuryr_lbaas_shards_served",
            "Shards whose Services this replica reconciles (owned and loaded)",
            self.served.clone(),
        );
        registry.register(
            "kuryr_lbaas_shard_gains",
            "Shards taken over: their records read again and their Services queued",
            self.gains.clone(),
        );
    }

    /// The ownership now.
    pub fn ownership(&self) -> Arc<Ownership> {
        self.ownership.borrow().clone()
    }

    /// Whether the replica is sharded at all.
    pub fn sharded(&self) -> bool {
        self.ownership.borrow().sharded()
    }

    /// Whether this replica reconciles the Service `key` now: its shard is owned and loaded.
    pub fn serves(&self, key: &str) -> bool {
        let own = self.ownership.borrow();
        match own.shard_of(key) {
            None => true,
            Some(i) => own.owned.contains(&i) && self.loaded.borrow().contains(&i),
        }
    }

    /// Whether `key` is in one of `shards`.
    pub fn in_shards(&self, key: &str, shards: &BTreeSet<u32>) -> bool {
        self.ownership.borrow().shard_of(key).is_some_and(|i| shards.contains(&i))
    }

    fn set_loaded(&self, loaded: BTreeSet<u32>) {
        self.served.set(i64::try_from(loaded.len()).unwrap_or(i64::MAX));
        self.loaded.send_replace(loaded);
    }
}

/// What the shard follower works with.
pub struct Follower<B> {
    /// The served set, updated here.
    pub shards: Shards,
    /// Queues the Services of gained shards.
    pub controller: Arc<Controller<B>>,
    /// Reads the records of gained shards.
    pub kube: Kube,
    /// Set once the watcher's first snapshot is complete: before, the view is partial and a
    /// record whose Service it does not hold yet must not be taken for an orphan.
    pub synced: watch::Receiver<bool>,
    /// Wakes the backend's maintenance for the gained shards.
    pub kick: Arc<Notify>,
}

impl<B> std::fmt::Debug for Follower<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Follower").finish_non_exhaustive()
    }
}

impl<B: Backend> Follower<B> {
    /// Follows the ownership until shutdown.
    pub async fn run(mut self, shutdown: Shutdown) {
        if !self.shards.sharded() {
            self.shards.set_loaded(BTreeSet::new());
            return;
        }
        let mut rx = self.shards.ownership.clone();
        let mut loaded: BTreeSet<u32> = BTreeSet::new();
        loop {
            let own = rx.borrow_and_update().clone();
            let lost: BTreeSet<u32> = loaded.difference(&own.owned).copied().collect();
            if !lost.is_empty() {
                loaded.retain(|i| !lost.contains(i));
                // Work stops first; what the backend remembers of them is stale from now on.
                self.shards.set_loaded(loaded.clone());
                self.controller.backend().forget(&|key| self.shards.in_shards(key, &lost));
                tracing::info!(shards = ?lost, served = ?loaded, "shards lost: their Services are reconciled elsewhere now");
            }
            let gained: BTreeSet<u32> = own.owned.difference(&loaded).copied().collect();
            if !gained.is_empty() {
                if !self.wait_synced(&shutdown).await || !self.load(&gained, &shutdown).await {
                    return;
                }
                // Still owned? One lost meanwhile is dropped on the next pass.
                loaded.extend(gained.iter().copied());
                self.shards.set_loaded(loaded.clone());
                self.shards.gains.inc_by(gained.len() as u64);
                let queued = self.controller.enqueue_where(|key| self.shards.in_shards(key, &gained));
                self.kick.notify_one();
                tracing::info!(shards = ?gained, served = ?loaded, queued, "shards gained: their Services are queued");
                continue;
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                () = shutdown.clone().wait() => return,
            }
        }
    }

    async fn wait_synced(&mut self, shutdown: &Shutdown) -> bool {
        tokio::select! {
            r = self.synced.wait_for(|s| *s) => r.is_ok(),
            () = shutdown.clone().wait() => false,
        }
    }

    /// Replaces what is known of the records of `gained` by what the API holds; false at
    /// shutdown.
    async fn load(&self, gained: &BTreeSet<u32>, shutdown: &Shutdown) -> bool {
        let Some(found) = kuryr_runtime::retry("loading the ServiceLoadBalancers of gained shards", shutdown, || {
            self.kube.list_records()
        })
        .await
        else {
            return false;
        };
        self.controller.backend().forget(&|key| self.shards.in_shards(key, gained));
        let in_gained = |key: &str| self.shards.in_shards(key, gained);
        let mut n = 0;
        {
            let mut records = locked(self.controller.records());
            records.retain(|k, _| !in_gained(k));
            for (k, r) in found.into_iter().filter(|(k, _)| in_gained(k)) {
                records.insert(k, r);
                n += 1;
            }
        }
        tracing::debug!(shards = ?gained, records = n, "read the records of the gained shards");
        true
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
