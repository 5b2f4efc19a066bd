//! Shard hand-over: follows this replica's Lease ownership ([`crate::shards::Shards`]). On
//! **gaining** a shard its PodVifs are read from the API into the VIF index (another replica may
//! have written them since), PodVifs of pods that no longer exist are queued for cleanup, every
//! pod of its nodes is queued, and only then is the shard served. On **losing** one it stops
//! being served at once and its VIFs leave the index without a delta.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use kuryr_runtime::Shutdown;
use kuryr_shard::Ownership;

use crate::backend::VifBackend as _;
use crate::backend::any::AnyBackend;
use crate::cluster::Cluster;
use crate::controller::{Controller, view_lock};
use crate::core::{Vif, VifState};
use crate::error::chain;
use crate::index::{SharedIndex, lock, vif_node};
use crate::k8s::api::{self as k8s, KubeCluster};
use crate::metrics::Metrics;
use crate::ready::{Condition, Readiness};
use crate::shards::Shards;

/// What the shard follower works with.
pub struct Follower {
    /// The served set, updated here.
    pub shards: Shards,
    /// Queues the pods of gained shards.
    pub controller: Arc<Controller<KubeCluster>>,
    /// Reads PodVifs and pods.
    pub client: kube::Client,
    /// The network PodVifs name.
    pub network: String,
    /// Receives the VIFs of gained shards, loses those of lost ones.
    pub index: SharedIndex,
    /// Watches readiness of recovered PLUGGED VIFs (Neutron).
    pub backend: AnyBackend,
    /// The shards condition.
    pub readiness: Readiness,
    /// The VIF gauge.
    pub metrics: Metrics,
    /// The shards whose VIFs the start-up recovery loaded.
    pub recovered: BTreeSet<u32>,
}

impl std::fmt::Debug for Follower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Follower").field("network", &self.network).finish_non_exhaustive()
    }
}

impl Follower {
    /// Follows the ownership until shutdown.
    pub async fn run(self, shutdown: Shutdown) {
        let mut rx = self.shards.ownership_changes();
        let mut loaded = self.recovered.clone();
        self.shards.set_loaded(loaded.clone());
        loop {
            let own = rx.borrow_and_update().clone();
            if own.ready {
                self.readiness.set(Condition::Shards, true);
            }
            if own.sharded() {
                let lost: BTreeSet<u32> = loaded.difference(&own.owned).copied().collect();
                if !lost.is_empty() {
                    loaded.retain(|i| !lost.contains(i));
                    // Work stops first (streams end, reconciles skip), then the VIFs go.
                    self.shards.set_loaded(loaded.clone());
                    self.drop_shards(&own, &lost);
                }
                let gained: BTreeSet<u32> = own.owned.difference(&loaded).copied().collect();
                if !gained.is_empty() && self.load(&gained, &shutdown).await {
                    // Still owned? A shard lost meanwhile is dropped on the next pass.
                    loaded.extend(gained.iter().copied());
                    self.shards.set_loaded(loaded.clone());
                    self.queue_pods(&own, &gained);
                    continue;
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                () = shutdown.clone().wait() => return,
            }
        }
    }

    fn drop_shards(&self, own: &Ownership, lost: &BTreeSet<u32>) {
        let in_lost = |node: &str| own.shard_of(node).is_some_and(|i| lost.contains(&i));
        let dropped = {
            let mut idx = lock(&self.index);
            let dropped = idx.forget_vifs(|v| in_lost(vif_node(v)));
            self.metrics.vifs.set(i64::try_from(idx.len()).unwrap_or(i64::MAX));
            dropped
        };
        let ports = match &self.backend {
            AnyBackend::Neutron(b) => b.forget_nodes(&in_lost),
            AnyBackend::Embedded(_) => 0,
        };
        tracing::info!(shards = ?lost, vifs = dropped, ports, "shards lost: their nodes are served elsewhere now");
    }

    /// Loads the PodVifs of `gained` into the index and queues the cleanup of those whose pod
    /// is gone; false at shutdown.
    async fn load(&self, gained: &BTreeSet<u32>, shutdown: &Shutdown) -> bool {
        let Some(found) = kuryr_runtime::retry("loading the PodVifs of gained shards", shutdown, || {
            k8s::list_pod_vifs(&self.client, &self.network)
        })
        .await
        else {
            return false;
        };
        let own = self.shards.ownership();
        let in_gained = |node: &str| own.shard_of(node).is_some_and(|i| gained.contains(&i));
        // Neutron: the gained nodes' ports as Neutron has them now (the previous owner's pools,
        // and whatever it handed out), before any of their pods is served.
        if let AnyBackend::Neutron(b) = &self.backend {
            let recorded: HashMap<String, String> = found
                .iter()
                .filter_map(|f| f.recorded.as_ref().map(|(r, _)| (f.pod.uid.clone(), r.vif_id.clone())))
                .collect();
            let read = || async { Ok(b.load_nodes(&recorded, &in_gained).await?) };
            let Some(summary) =
                kuryr_runtime::retry("reading the ports of gained shards from Neutron", shutdown, read).await
            else {
                return false;
            };
            tracing::info!(shards = ?gained, in_use = summary.in_use, free = summary.free,
                recycling = summary.recycling, deleted = summary.deleted, "took over the gained nodes' Neutron ports");
        }
        let mut vifs = 0;
        let mut unknown = Vec::new();
        {
            let mut idx = lock(&self.index);
            for f in found.iter().filter(|f| in_gained(&f.node)) {
                if let Some((record, state)) = &f.recorded {
                    idx.upsert_vif(Vif::recorded(&f.pod, &f.node, &self.network, record.clone(), *state));
                    self.backend.expect_extras(&f.pod.uid, record);
                    vifs += 1;
                    if *state == VifState::Plugged && !self.backend.ready_when_plugged() {
                        self.backend.watch_ready(&f.pod.uid, &record.vif_id, true);
                    }
                }
                if view_lock(self.controller.view()).get(&f.pod.uid).is_none() {
                    unknown.push((f.pod.clone(), f.node.clone()));
                }
            }
            self.metrics.vifs.set(i64::try_from(idx.len()).unwrap_or(i64::MAX));
        }
        // A PodVif whose pod this replica has not seen: gone, or created so recently that the
        // watcher's event is still on its way. The API tells which.
        let mut orphans = 0;
        for (pod, node) in unknown {
            match self.controller.cluster().pod(&pod).await {
                Ok(None) => {
                    orphans += 1;
                    self.controller.adopt_orphan(pod, &node);
                }
                Ok(Some(_)) => {}
                Err(e) => tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), error = %chain(&e),
                    "could not tell whether the pod of a PodVif exists; left for its shard's next owner"),
            }
        }
        tracing::info!(shards = ?gained, vifs, orphans, "shards gained: their VIFs are loaded");
        true
    }

    fn queue_pods(&self, own: &Ownership, gained: &BTreeSet<u32>) {
        let uids = view_lock(self.controller.view())
            .uids_where(|node| own.shard_of(node).is_some_and(|i| gained.contains(&i)));
        let queued = uids.len();
        for uid in uids {
            self.controller.enqueue(&uid);
        }
        tracing::debug!(pods = queued, "queued the pods of the gained shards");
    }
}
