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

use std::collections::BTreeSet;
use std::sync::Arc;

use kuryr_runtime::Shutdown;
use kuryr_shard::Ownership;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tonic::Status;

use crate::backend::{AnyBackend, VifBackend as _};
use crate::cluster::{Cluster, chain};
use crate::controller::{Controller, view_lock};
use crate::convert;
use crate::crd::VifState;
use crate::index::{SharedIndex, lock, vif_node};
use crate::k8s::{self, KubeCluster};
use crate::metrics::Metrics;
use crate::ready::{Condition, Readiness};

pub use kuryr_shard::OWNER_METADATA;

/// Refusals by method.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RedirectLabels {
    /// `WatchVifs`, `ReportPlugged` or `GetVif`.
    pub method: &'static str,
}

/// What this replica serves, shared by the controller, the gRPC service and the shard follower;
/// cheap to clone.
#[derive(Clone, Debug)]
pub struct Shards {
    ownership: watch::Receiver<Arc<Ownership>>,
    /// Owned shards whose VIFs are loaded: the ones served.
    loaded: Arc<watch::Sender<BTreeSet<u32>>>,
    redirects: Family<RedirectLabels, Counter>,
}

impl Shards {
    /// Serving every node: no sharding.
    pub fn all() -> Self {
        Self::new(kuryr_shard::ShardHandle::unsharded("all").ownership())
    }

    /// Following `ownership`; nothing is served until the follower loads a shard.
    pub fn new(ownership: watch::Receiver<Arc<Ownership>>) -> Self {
        Self { ownership, loaded: Arc::new(watch::Sender::new(BTreeSet::new())), redirects: Family::default() }
    }

    /// Registers `kuryr_allocator_redirects_total{method}`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kuryr_allocator_redirects",
            "Calls refused because another replica owns the node's shard, by method",
            self.redirects.clone(),
        );
    }

    /// The ownership, to wait on.
    pub fn ownership_receiver(&self) -> watch::Receiver<Arc<Ownership>> {
        self.ownership.clone()
    }

    /// The ownership now.
    pub fn ownership(&self) -> Arc<Ownership> {
        self.ownership.borrow().clone()
    }

    /// Whether this replica works on `node` now: its shard is owned and loaded.
    pub fn serves(&self, node: &str) -> bool {
        let own = self.ownership.borrow();
        match own.shard_of(node) {
            None => true,
            Some(i) => own.owned.contains(&i) && self.loaded.borrow().contains(&i),
        }
    }

    /// `Ok` when `node` is served here, else the UNAVAILABLE to answer `method` with.
    pub fn check(&self, node: &str, method: &'static str) -> Result<(), Status> {
        if self.serves(node) {
            return Ok(());
        }
        self.redirects.get_or_create(&RedirectLabels { method }).inc();
        Err(self.refusal(node))
    }

    /// The UNAVAILABLE telling a client that `node` is served elsewhere (and where, if known).
    pub fn refusal(&self, node: &str) -> Status {
        kuryr_shard::refusal(&self.ownership(), node, "kuryr-vif-allocator")
    }

    /// Resolves once `node` is no longer served here.
    pub async fn lost(&self, node: &str) {
        let mut own = self.ownership.clone();
        let mut loaded = self.loaded.subscribe();
        loop {
            own.borrow_and_update();
            loaded.borrow_and_update();
            if !self.serves(node) {
                return;
            }
            tokio::select! {
                r = own.changed() => if r.is_err() { std::future::pending::<()>().await },
                r = loaded.changed() => if r.is_err() { std::future::pending::<()>().await },
            }
        }
    }

    /// Sets the owned shards whose VIFs are loaded.
    pub fn set_loaded(&self, loaded: BTreeSet<u32>) {
        self.loaded.send_replace(loaded);
    }
}

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
        let mut rx = self.shards.ownership.clone();
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
        tracing::info!(shards = ?lost, vifs = dropped, "shards lost: their nodes are served elsewhere now");
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
        let mut vifs = 0;
        let mut unknown = Vec::new();
        {
            let mut idx = lock(&self.index);
            for f in found.iter().filter(|f| in_gained(&f.node)) {
                if let Some((record, state)) = &f.recorded {
                    idx.upsert_vif(convert::to_proto(&f.pod, &f.node, &self.network, record, *state));
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::BTreeSet;
    use std::time::Duration;

    use kuryr_shard::Owner;

    use super::*;

    fn ownership(owned: &[u32], owner: Option<&str>) -> Arc<Ownership> {
        let mut o = Ownership::pending("me", 4);
        o.ready = true;
        o.owned = owned.iter().copied().collect();
        for i in 0..4u32 {
            if !o.owned.contains(&i) {
                o.owners[i as usize] = owner.map(|e| Owner { identity: "other".into(), endpoint: Some(e.to_string()) });
            }
        }
        Arc::new(o)
    }

    #[tokio::test]
    async fn served_nodes_and_redirects() {
        let (tx, rx) = watch::channel(ownership(&[], Some("10.0.0.2:9610")));
        let shards = Shards::new(rx);
        let node = "node-1";
        let shard = kuryr_shard::shard_of(node, 4).unwrap();
        let err = shards.check(node, "WatchVifs").unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
        assert!(err.message().contains("10.0.0.2:9610") && err.message().contains("other"), "{}", err.message());
        assert_eq!(err.metadata().get(OWNER_METADATA).unwrap(), "10.0.0.2:9610");
        // Owned but not loaded yet: refused, without a redirect.
        tx.send_replace(ownership(&[shard], Some("10.0.0.2:9610")));
        let err = shards.check(node, "WatchVifs").unwrap_err();
        assert!(err.metadata().get(OWNER_METADATA).is_none(), "{err:?}");
        shards.set_loaded(BTreeSet::from([shard]));
        assert!(shards.check(node, "WatchVifs").is_ok());
        // Lost: `lost` resolves.
        let waiter = {
            let s = shards.clone();
            tokio::spawn(async move { s.lost(node).await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        tx.send_replace(ownership(&[], None));
        tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        let err = shards.check(node, "GetVif").unwrap_err();
        assert!(err.message().contains("no owner"), "{}", err.message());
        assert!(Shards::all().serves(node));
    }
}
