//! Shard hand-over: follows this replica's Lease ownership ([`crate::shards::Shards`]) and,
//! on **gaining** a shard, reads its records again from the API (the previous owner wrote them
//! since this replica last looked), makes the backend forget what it remembered of them, marks
//! the shard served, queues its Services and records and wakes the backend's maintenance; on
//! **losing** one, stops serving it at once and makes the backend forget it. Nothing is deleted
//! on a loss: a Service of another shard is not gone.

use std::collections::BTreeSet;
use std::sync::Arc;

use kuryr_runtime::Shutdown;
use tokio::sync::{Notify, watch};

use crate::backend::Backend;
use crate::controller::Controller;
use crate::core::locked;
use crate::k8s::api::Kube;
use crate::shards::Shards;

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
        let mut rx = self.shards.ownership_changes();
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
                self.shards.count_gains(gained.len());
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
