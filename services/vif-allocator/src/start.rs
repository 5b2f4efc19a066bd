//! The start-up sequence, in the background while the server already answers (NOT_SERVING):
//! the backend prepared (the PodNetwork, or the Neutron client, pools and ports), the PodVifs
//! loaded into the index, the controller built, the watcher followed, the shard set joined, and
//! the background tasks started.

use std::collections::HashMap;
use std::sync::Arc;

use kuryr_runtime::Shutdown;
use kuryr_runtime::auth::client::PeerChannel;
use kuryr_stream::WorkQueue;
use tracing::Instrument as _;

use crate::backend::VifBackend as _;
use crate::backend::any::AnyBackend;
use crate::backend::embedded::EmbeddedBackend;
use crate::backend::ipam::IpamStore;
use crate::backend::neutron;
use crate::backend::neutron::metrics::NeutronMetrics;
use crate::backend::neutron::namespaces::k8s::NamespaceKube;
use crate::backend::neutron::{Channels, NeutronBackend};
use crate::controller::{Controller, SharedView};
use crate::core::{Vif, VifState};
use crate::grpc::ControllerCell;
use crate::grpc::follow;
use crate::grpc::pool_api::BackendCell;
use crate::index::{SharedIndex, lock};
use crate::k8s::api::{self, KubeCluster};
use crate::k8s::blocks;
use crate::k8s::crd::PodNetworkSpec;
use crate::metrics::Metrics;
use crate::ready::{Condition, Readiness};
use crate::shards::Shards;
use crate::{Config, handover, tasks};

/// The start-up sequence, in the background while the server already answers (NOT_SERVING).
pub(crate) struct Start {
    pub(crate) config: Config,
    pub(crate) spec: Option<PodNetworkSpec>,
    pub(crate) watcher: PeerChannel,
    pub(crate) index: SharedIndex,
    pub(crate) readiness: Readiness,
    pub(crate) metrics: Metrics,
    pub(crate) cell: ControllerCell<KubeCluster>,
    /// The OpenStack client and the backend's metrics, with `--backend neutron`.
    pub(crate) neutron: Option<(kuryr_openstack::Client, NeutronMetrics)>,
    pub(crate) pools: BackendCell,
    /// What this replica serves.
    pub(crate) shards: Shards,
    /// The shard set to join once a Kubernetes client exists (what `shards` follows).
    pub(crate) joining: kuryr_shard::Joining,
}

/// What the backend-specific part of the start hands on.
struct Prepared {
    backend: AnyBackend,
    /// The network PodVifs name: the PodNetwork, or the Neutron network id.
    network: String,
    found: Vec<api::Found>,
    /// The embedded IPAM's store (node routes follow its blocks).
    store: Option<Arc<IpamStore>>,
    /// VIFs the Neutron backend found ACTIVE.
    ready: Option<tokio::sync::mpsc::UnboundedReceiver<neutron::ReadyVif>>,
    /// The shards whose Neutron ports were recovered (`None`: the embedded backend, whose
    /// recovery is the PodVifs alone).
    pooled: Option<std::collections::BTreeSet<u32>>,
}

impl Start {
    /// Runs the start-up sequence until everything is served, or until `shutdown`.
    pub(crate) async fn run(self, shutdown: Shutdown) {
        let kubeconfig = self.config.kubeconfig.clone();
        let Some(client) = kuryr_runtime::retry("building a Kubernetes client", &shutdown, || {
            kuryr_runtime::kube_client(kubeconfig.as_deref())
        })
        .await
        else {
            return;
        };
        // The first round of Leases runs while the network is prepared.
        self.joining.join(client.clone(), shutdown.clone());
        let prepared = match self.neutron.clone() {
            None => self.prepare_embedded(&client, &shutdown).await,
            Some((os, nm)) => self.prepare_neutron(&client, os, nm, &shutdown).await,
        };
        let Some(Prepared { backend, network, found, store, ready, pooled }) = prepared else { return };
        let Start { config, watcher, index, readiness, metrics, cell, shards, .. } = self;

        // Which shards are this replica's, before anything is loaded.
        let mut ownership = shards.ownership_changes();
        let own = tokio::select! {
            o = ownership.wait_for(|o| o.ready) => match o { Ok(o) => o.clone(), Err(_) => return },
            () = shutdown.clone().wait() => return,
        };
        // With Neutron, only the shards whose ports were read count as recovered; the shard
        // follower loads any other owned one (its ports read again) before serving it.
        let recovered = match &pooled {
            Some(p) => own.owned.intersection(p).copied().collect(),
            None => own.owned.clone(),
        };
        // Recovery: every recorded VIF of this replica's nodes into the index before any stream
        // is served.
        let held = {
            let mut idx = lock(&index);
            for f in found.iter().filter(|f| own.owns(&f.node)) {
                if let Some((record, state)) = &f.recorded {
                    idx.upsert_vif(Vif::recorded(&f.pod, &f.node, &network, record.clone(), *state));
                    backend.expect_extras(&f.pod.uid, record);
                }
            }
            idx.set_ready();
            metrics.vifs.set(i64::try_from(idx.len()).unwrap_or(i64::MAX));
            idx.len()
        };
        if !backend.ready_when_plugged() {
            // Plugged before the restart and not yet confirmed: watch them again.
            for f in found.iter().filter(|f| own.owns(&f.node)) {
                if let Some((record, VifState::Plugged)) = &f.recorded {
                    backend.watch_ready(&f.pod.uid, &record.vif_id, true);
                }
            }
        }
        shards.set_loaded(recovered.clone());
        tracing::info!(podvifs = found.len(), vifs = held, "recovered the recorded VIFs; serving WatchVifs");
        readiness.set(Condition::Recovered, true);

        let instance = config.instance_name();
        let cluster = KubeCluster::new(client.clone(), backend.clone(), &network, Some(instance.clone()));
        let queue = Arc::new(WorkQueue::default());
        let view = SharedView::default();
        let controller = Arc::new(
            Controller::new(cluster, &network, view, index.clone(), queue, metrics.clone()).with_shards(shards.clone()),
        );
        let _ = cell.set(controller.clone());
        controller.spawn_workers(config.workers, shutdown.clone());
        let follower = handover::Follower {
            shards: shards.clone(),
            controller: controller.clone(),
            client: client.clone(),
            network: network.clone(),
            index: index.clone(),
            backend: backend.clone(),
            readiness: readiness.clone(),
            metrics: metrics.clone(),
            recovered,
        };
        tokio::spawn(follower.run(shutdown.clone()).instrument(tracing::info_span!("shards")));
        if store.is_some() {
            let blocks = blocks::follow_blocks(client, index.clone(), shutdown.clone());
            tokio::spawn(blocks.instrument(tracing::info_span!("address-blocks")));
        }
        if let (AnyBackend::Neutron(b), Some(rx)) = (&backend, ready) {
            let ready = tasks::mark_ready(controller.clone(), b.clone(), rx, shutdown.clone());
            tokio::spawn(ready.instrument(tracing::info_span!("ready")));
            let gc = tasks::collect_orphans(
                controller.clone(),
                b.clone(),
                readiness.clone(),
                config.orphan_gc_interval,
                shutdown.clone(),
            );
            tokio::spawn(gc.instrument(tracing::info_span!("orphans")));
            if b.namespace_networks().is_some() {
                let subscriber = format!("kuryr-vif-allocator/{instance}/namespaces");
                let follow = config.follow.config();
                let ns =
                    neutron::namespaces::follow::run(b.clone(), watcher.clone(), subscriber, follow, shutdown.clone());
                tokio::spawn(ns.instrument(tracing::info_span!("namespaces")));
            }
        }
        let follower = follow::Follower {
            channel: watcher,
            controller,
            index,
            recovered: found.into_iter().map(|f| (f.pod, f.node)).collect(),
            readiness,
            metrics,
            subscriber: format!("kuryr-vif-allocator/{instance}"),
            follow: config.follow.config(),
        };
        follower.run(shutdown).instrument(tracing::info_span!("watcher")).await;
    }

    async fn prepare_embedded(&self, client: &kube::Client, shutdown: &Shutdown) -> Option<Prepared> {
        let network = self.config.network.clone();
        let store = Arc::new(IpamStore::new(client.clone()).with_metrics(self.metrics.ipam.clone()));
        kuryr_runtime::retry("looking up the PodNetwork", shutdown, || {
            api::ensure_network(client, &store, &network, self.spec.as_ref())
        })
        .await?;
        self.readiness.set(Condition::Network, true);
        let found = kuryr_runtime::retry("loading PodVifs", shutdown, || api::list_pod_vifs(client, &network)).await?;
        let backend = AnyBackend::Embedded(EmbeddedBackend::new(store.clone(), &network));
        Some(Prepared { backend, network, found, store: Some(store), ready: None, pooled: None })
    }

    async fn prepare_neutron(
        &self,
        client: &kube::Client,
        os: kuryr_openstack::Client,
        nm: NeutronMetrics,
        shutdown: &Shutdown,
    ) -> Option<Prepared> {
        let args = &self.config.neutron;
        let ns_kube = NamespaceKube::new(client.clone(), Some(self.config.instance_name()));
        let instance = self.config.instance_name();
        let (backend, Channels { ready, refill }) =
            kuryr_runtime::retry("reading the pod network from Neutron", shutdown, || {
                NeutronBackend::connect(args, os.clone(), nm.clone(), ns_kube.clone(), &instance)
            })
            .await?;
        let backend = Arc::new(backend);
        if let Some(n) = backend.nested() {
            let index = self.index.clone();
            n.set_node_ips(Arc::new(move || lock(&index).node_ips().clone()));
        }
        if let Some(nn) = backend.namespace_networks() {
            let loaded =
                kuryr_runtime::retry("loading the namespace networks", shutdown, || async { Ok(nn.load().await?) })
                    .await?;
            tracing::info!(loaded, "namespace networks loaded");
        }
        self.readiness.set(Condition::Network, true);
        let network = backend.network_id().to_string();
        let found = kuryr_runtime::retry("loading PodVifs", shutdown, || api::list_pod_vifs(client, &network)).await?;
        let recorded: HashMap<String, String> = found
            .iter()
            .filter_map(|f| f.recorded.as_ref().map(|(r, _)| (f.pod.uid.clone(), r.vif_id.clone())))
            .collect();
        // Only the ports of this replica's nodes ([`backend::neutron::shards`]): its shards first.
        backend.follow_shards(self.shards.ownership_changes());
        let mut ownership = self.shards.ownership_changes();
        let own = tokio::select! {
            o = ownership.wait_for(|o| o.ready) => o.ok()?.clone(),
            () = shutdown.clone().wait() => return None,
        };
        let owns = |node: &str| own.owns(node);
        let summary = kuryr_runtime::retry("recovering the cluster's Neutron ports", shutdown, || async {
            Ok(backend.recover(&recorded, &owns).await?)
        })
        .await?;
        tracing::info!(
            in_use = summary.in_use,
            free = summary.free,
            recycling = summary.recycling,
            deleted = summary.deleted,
            shards = ?own.owned,
            "recovered the Neutron ports and pools of this replica's nodes"
        );
        backend.spawn(refill, shutdown.clone());
        let _ = self.pools.set(backend.clone());
        Some(Prepared {
            backend: AnyBackend::Neutron(backend),
            network,
            found,
            store: None,
            ready: Some(ready),
            pooled: Some(own.owned.clone()),
        })
    }
}
