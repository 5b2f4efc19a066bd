//! kuryr-vif-allocator: gives every scheduled pod that is not on the host network a VIF from its
//! backend ([`backend`]: the embedded IPAM, or Neutron ports with pools — [`neutron`]), records
//! pod → VIF in the Kubernetes API, and streams each node's VIFs to that node's binder.
//!
//! **Watches** pods and nodes through the watcher's Subscribe stream ([`follow`]), the network's
//! AddressBlocks (metadata only, for node routes) and nothing else.
//!
//! **Owns** per pod: the finalizer `kuryr.openstack.org/vif`, a PodVif (spec + status) and the
//! pod's addresses in the AddressBlocks ([`ipam`]). A keyed queue ([`WorkQueue`]) reconciles pods
//! one uid at a time, many uids at once ([`controller`]); every step is idempotent and recorded
//! before the VIF is handed out.
//!
//! **Streams** per node over `WatchVifs` ([`grpc`], with the shared core of
//! [`kuryr_stream::feed`]): the node's VIFs and the other nodes' routes, SNAPSHOT_COMPLETE, then
//! deltas, with resume points `"<epoch>-<revision>"` ([`index`]) and a HEARTBEAT whenever a
//! stream has been quiet for `--stream-heartbeat`.
//!
//! **Recovers** on start by loading every PodVif of the network into the index before serving
//! streams, so that binders get their VIFs at once after a restart (node routes follow as
//! deltas once the watcher's nodes and the address blocks are in); once the watcher's snapshot
//! is in, PodVifs whose pod no longer exists are cleaned up.
//!
//! With `--backend neutron`, recovery also rebuilds the port pools and who holds which port from
//! Neutron (the ports tagged for the cluster) before anything is served, VIFs recorded as
//! PLUGGED are watched for ACTIVE again, and ports held by pods that no longer exist are handed
//! to cleanup once the watcher's snapshot is in (and every `--orphan-gc-interval` after).
//!
//! Readiness ([`ready`]): NOT_SERVING until the pod network exists (the PodNetwork, or the
//! Neutron network), the PodVifs (and Neutron ports) were loaded and the watcher's stream is
//! live; and again whenever that stream is down or silent for longer than
//! `--stream-idle-timeout`.

pub mod backend;
pub mod cluster;
pub mod controller;
pub mod convert;
pub mod crd;
pub mod follow;
pub mod grpc;
pub mod index;
pub mod ipam;
pub mod k8s;
pub mod metrics;
pub mod neutron;
pub mod pods;
pub mod pool_api;
pub mod ready;
pub mod shards;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kuryr_proto::allocator::v1::pool_manager_server::PoolManagerServer;
use kuryr_proto::allocator::v1::vif_allocator_server::VifAllocatorServer;
use kuryr_proto::service_names;
use kuryr_runtime::auth::client::{PeerChannel, with_credentials};
use kuryr_runtime::auth::{AccountRef, Rules};
use kuryr_runtime::follow::{FollowArgs, HeartbeatArgs};
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime, Services, Shutdown};
use kuryr_stream::WorkQueue;
use tracing::Instrument as _;

use crate::backend::{AnyBackend, EmbeddedBackend, VifBackend as _};
use crate::controller::{Controller, SharedView, view_lock};
use crate::crd::{PodNetworkSpec, VifState};
use crate::grpc::{AllocatorService, ControllerCell};
use crate::index::{SharedIndex, VifIndex, lock};
use crate::ipam::store::IpamStore;
use crate::k8s::KubeCluster;
use crate::metrics::Metrics;
use crate::neutron::config::NeutronArgs;
use crate::neutron::metrics::NeutronMetrics;
use crate::neutron::namespaces::k8s::NamespaceKube;
use crate::neutron::{Channels, NeutronBackend};
use crate::pool_api::{BackendCell, PoolApi};
use crate::ready::{Condition, Readiness};
use crate::shards::Shards;

/// The largest request accepted: every request is a few names, ids and a resume point.
pub const MAX_REQUEST: usize = 64 * 1024;

/// Command-line configuration.
#[derive(Clone, Debug, Parser)]
#[command(name = "kuryr-vif-allocator", version, about = "Allocates pod VIFs and streams them to binders.")]
pub struct Config {
    /// gRPC listen addresses, comma-separated or repeated: HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_ALLOCATOR_LISTEN", value_delimiter = ',', default_value = "0.0.0.0:9610")]
    pub listen: Vec<ListenAddr>,

    /// HTTP address for Prometheus metrics (/metrics) and probes (/livez, /readyz).
    #[arg(long, env = "KURYR_ALLOCATOR_METRICS_LISTEN", default_value = "0.0.0.0:9611")]
    pub metrics_listen: ListenAddr,

    /// The watcher to subscribe to: HOST:PORT, http://HOST:PORT, unix:/path, or
    /// k8s:[NAMESPACE/]SERVICE:PORT (the Service's ready endpoints, found through the Kubernetes
    /// API: no cluster DNS needed).
    #[arg(long, env = "KURYR_WATCHER", default_value = "127.0.0.1:9600")]
    pub watcher: String,

    /// Kubeconfig file; when unset, the in-cluster service account (or $KUBECONFIG) is used.
    #[arg(long, env = "KURYR_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Where VIFs come from: `embedded` (the IPAM in CRDs) or `neutron` (a Neutron port per
    /// pod, from port pools; see the --os-cloud, --pod-network-id and --pool-* flags).
    #[arg(long, env = "KURYR_BACKEND", value_enum, default_value_t = BackendKind::Embedded)]
    pub backend: BackendKind,

    /// The PodNetwork (embedded IPAM) pods get their addresses from.
    #[arg(long, env = "KURYR_NETWORK", default_value = "default")]
    pub network: String,

    /// Creates the PodNetwork with these CIDRs (at most one IPv4 and one IPv6, comma-separated,
    /// e.g. `10.244.0.0/16,fd00:10:244::/56`) when it does not exist. An existing PodNetwork is
    /// never changed. Without this flag the allocator waits until the PodNetwork exists.
    #[arg(long, env = "KURYR_NETWORK_CIDRS", value_delimiter = ',')]
    pub network_cidrs: Vec<String>,

    /// Prefix length of the IPv4 blocks nodes claim, for a network created by --network-cidrs.
    #[arg(long, env = "KURYR_IPV4_BLOCK_PREFIX", default_value_t = ipam::DEFAULT_IPV4_BLOCK_PREFIX)]
    pub ipv4_block_prefix: u8,

    /// Prefix length of the IPv6 blocks nodes claim, for a network created by --network-cidrs.
    #[arg(long, env = "KURYR_IPV6_BLOCK_PREFIX", default_value_t = ipam::DEFAULT_IPV6_BLOCK_PREFIX)]
    pub ipv6_block_prefix: u8,

    /// The pods' MTU, for a network created by --network-cidrs.
    #[arg(long, env = "KURYR_MTU", default_value_t = ipam::DEFAULT_MTU)]
    pub mtu: u32,

    /// The node bridge pods attach to, for a network created by --network-cidrs.
    #[arg(long, env = "KURYR_BRIDGE", default_value = ipam::DEFAULT_BRIDGE)]
    pub bridge: String,

    /// Pods reconciled in parallel (each pod is always reconciled by one worker at a time).
    /// A reconcile mostly waits on API round trips, and concurrent allocations for one node
    /// share their address block writes, so more workers mean more pods per second until the
    /// API server is the limit (a 200-pod burst measured 73/s with 16, ~100/s with 64).
    #[arg(long, env = "KURYR_ALLOCATOR_WORKERS", default_value_t = 64,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub workers: usize,

    /// This replica's name in Events and in the watcher's logs (the pod name in a Deployment);
    /// the host name when unset.
    #[arg(long, env = "KURYR_INSTANCE")]
    pub instance: Option<String>,

    /// With `--backend neutron`: how often ports held by pods that no longer exist are looked
    /// for (also once as soon as the watcher's snapshot is in).
    #[arg(long, env = "KURYR_ORPHAN_GC_INTERVAL", default_value = "60s", value_parser = kuryr_runtime::config::parse_duration)]
    pub orphan_gc_interval: Duration,

    #[command(flatten)]
    pub neutron: NeutronArgs,

    /// Sharding by node between replicas (Kubernetes Leases).
    #[command(flatten)]
    pub shard: kuryr_shard::ShardArgs,

    /// The binders' ServiceAccounts (`namespace:name`, comma-separated): they alone may watch
    /// VIFs, read one and report them plugged — each only for its own node when its token is
    /// bound to one (the DaemonSet's projected tokens are).
    #[arg(long, env = "KURYR_BINDER_ACCOUNTS", value_delimiter = ',', default_value = "kuryr-system:kuryr-binder")]
    pub binder_accounts: Vec<AccountRef>,

    /// The ServiceAccounts whose tokens may manage the port pools (PoolManager) and read VIFs:
    /// operators run `kubectl -n kuryr-system create token kuryr-pool-manager --audience kuryr`.
    #[arg(
        long,
        env = "KURYR_POOL_MANAGER_ACCOUNTS",
        value_delimiter = ',',
        default_value = "kuryr-system:kuryr-pool-manager"
    )]
    pub pool_manager_accounts: Vec<AccountRef>,

    #[command(flatten)]
    pub heartbeat: HeartbeatArgs,

    #[command(flatten)]
    pub follow: FollowArgs,

    #[command(flatten)]
    pub common: CommonArgs,
}

/// Who may call what: the VIF methods the binders (GetVif also the pool managers), the pool
/// methods the pool managers.
pub fn rules(config: &Config) -> Rules {
    let (binders, managers) = (&config.binder_accounts, &config.pool_manager_accounts);
    Rules::new()
        .allow(service_names::VIF_ALLOCATOR, &["WatchVifs", "ReportPlugged", "GetVif"], binders)
        .allow(service_names::VIF_ALLOCATOR, &["GetVif"], managers)
        .allow(service_names::POOL_MANAGER, &["ListPools", "ShowPool", "PopulatePool", "FreePool"], managers)
}

/// The VIF backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The embedded IPAM: addresses kept in CRDs, a Linux bridge per node.
    Embedded,
    /// Neutron ports, plugged into Open vSwitch.
    Neutron,
}

impl Config {
    /// The PodNetwork to create when absent, validated; `None` without --network-cidrs.
    pub fn network_spec(&self) -> anyhow::Result<Option<PodNetworkSpec>> {
        anyhow::ensure!(
            !self.network.is_empty()
                && self.network.len() <= ipam::store::MAX_NETWORK_NAME
                && self.network.split('.').all(|l| {
                    !l.is_empty()
                        && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                        && !l.starts_with('-')
                        && !l.ends_with('-')
                }),
            "--network {:?}: not a valid object name (lower-case DNS subdomain of at most {} characters)",
            self.network,
            ipam::store::MAX_NETWORK_NAME
        );
        if self.network_cidrs.is_empty() {
            return Ok(None);
        }
        let spec = PodNetworkSpec {
            cidrs: self.network_cidrs.iter().map(|c| c.trim().to_string()).collect(),
            ipv4_block_prefix: self.ipv4_block_prefix,
            ipv6_block_prefix: self.ipv6_block_prefix,
            mtu: self.mtu,
            routes: Vec::new(),
            bridge: self.bridge.clone(),
        };
        spec.plan().map_err(|e| anyhow::anyhow!("--network-cidrs and its flags: {e}"))?;
        Ok(Some(spec))
    }

    fn instance_name(&self) -> String {
        kuryr_runtime::config::instance_name(self.instance.as_deref(), "kuryr-vif-allocator")
    }
}

/// Runs the allocator until SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let spec = config.network_spec()?;
    let mut rt = Runtime::new("kuryr-vif-allocator", &config.common)?;
    let gate = config.common.auth.gate(config.kubeconfig.clone(), rules(&config), rt.registry());
    rt.set_gate(gate);
    let watcher = kuryr_runtime::discover::channel(&config.watcher, config.kubeconfig.clone())
        .map_err(|e| anyhow::anyhow!("--watcher: {e}"))?;
    let watcher = with_credentials(watcher, config.common.auth.credentials());
    let metrics = Metrics::register(rt.registry());
    let shard_config = config.shard.resolve("kuryr-vif-allocator", &config.listen)?;
    let shard_metrics = kuryr_shard::ShardMetrics::register(rt.registry());
    let (ownership_tx, ownership) = tokio::sync::watch::channel(Arc::new(if shard_config.shards == 0 {
        kuryr_shard::Ownership::everything(&shard_config.identity)
    } else {
        kuryr_shard::Ownership::pending(&shard_config.identity, shard_config.shards)
    }));
    let shards = Shards::new(ownership);
    shards.register(rt.registry());
    let shard_handle = Arc::new(std::sync::OnceLock::new());
    // The Neutron side is checked before any port is bound: a bad flag fails the start.
    let neutron = match config.backend {
        BackendKind::Embedded => None,
        BackendKind::Neutron => {
            config.neutron.validate()?;
            let os_metrics = kuryr_openstack::Metrics::register(rt.registry());
            let client = config.neutron.client(os_metrics)?;
            Some((client, NeutronMetrics::register(rt.registry())))
        }
    };
    let index = VifIndex::new(kuryr_stream::Epoch::random(), index::DEFAULT_HISTORY);
    tracing::info!(epoch = %index.epoch(), backend = ?config.backend, network = config.network, workers = config.workers, "starting");
    let index = index.shared();
    let readiness = Readiness::default();
    readiness.spawn_driver(rt.health(), ready::SERVICES, rt.shutdown());
    let cell: ControllerCell<KubeCluster> = Arc::default();
    let pools = BackendCell::default();
    let pool_api = if neutron.is_some() {
        let c = cell.clone();
        let nodes: pool_api::NodeCheck =
            Arc::new(move |n: &str| c.get().and_then(|ctl| controller::view_lock(ctl.view()).has_node(n)));
        PoolApi::neutron(pools.clone(), nodes)
    } else {
        PoolApi::embedded()
    };
    let start = Start {
        config: config.clone(),
        spec,
        watcher,
        index: index.clone(),
        readiness,
        metrics: metrics.clone(),
        cell: cell.clone(),
        neutron,
        pools,
        shards: shards.clone(),
        shard_config,
        shard_metrics,
        ownership_tx,
        shard_handle: shard_handle.clone(),
    };
    tokio::spawn(start.run(rt.shutdown()).instrument(tracing::info_span!("startup")));
    let service = AllocatorService::new(index, cell, metrics, rt.shutdown())
        .with_shards(shards)
        .with_heartbeat(config.heartbeat.stream_heartbeat);
    let services = Services::new(VifAllocatorServer::new(service).max_decoding_message_size(MAX_REQUEST))
        .with(PoolManagerServer::new(pool_api).max_decoding_message_size(MAX_REQUEST));
    let served = rt.serve(services, &config.listen, Some(&config.metrics_listen)).await;
    // The shard Leases are released at shutdown, so the other replicas take over at once.
    if let Some(h) = shard_handle.get() {
        let _ = tokio::time::timeout(Duration::from_secs(6), kuryr_shard::ShardHandle::stopped(h)).await;
    }
    served
}

/// Copies the shard set's ownership into the channel the server was built with.
async fn forward(
    mut from: tokio::sync::watch::Receiver<Arc<kuryr_shard::Ownership>>,
    to: tokio::sync::watch::Sender<Arc<kuryr_shard::Ownership>>,
) {
    loop {
        to.send_replace(from.borrow_and_update().clone());
        if from.changed().await.is_err() {
            return;
        }
    }
}

/// The start-up sequence, in the background while the server already answers (NOT_SERVING).
struct Start {
    config: Config,
    spec: Option<PodNetworkSpec>,
    watcher: PeerChannel,
    index: SharedIndex,
    readiness: Readiness,
    metrics: Metrics,
    cell: ControllerCell<KubeCluster>,
    /// The OpenStack client and the backend's metrics, with `--backend neutron`.
    neutron: Option<(kuryr_openstack::Client, NeutronMetrics)>,
    pools: BackendCell,
    /// What this replica serves.
    shards: Shards,
    shard_config: kuryr_shard::ShardConfig,
    shard_metrics: kuryr_shard::ShardMetrics,
    /// Where the shard set's ownership is copied to (what `shards` follows).
    ownership_tx: tokio::sync::watch::Sender<Arc<kuryr_shard::Ownership>>,
    /// The running shard set, for the release at shutdown.
    shard_handle: Arc<std::sync::OnceLock<kuryr_shard::ShardHandle>>,
}

/// What the backend-specific part of the start hands on.
struct Prepared {
    backend: AnyBackend,
    /// The network PodVifs name: the PodNetwork, or the Neutron network id.
    network: String,
    found: Vec<k8s::Found>,
    /// The embedded IPAM's store (node routes follow its blocks).
    store: Option<Arc<IpamStore>>,
    /// VIFs the Neutron backend found ACTIVE.
    ready: Option<tokio::sync::mpsc::UnboundedReceiver<neutron::ReadyVif>>,
}

impl Start {
    async fn run(self, shutdown: Shutdown) {
        let kubeconfig = self.config.kubeconfig.clone();
        let Some(client) = kuryr_runtime::retry("building a Kubernetes client", &shutdown, || {
            kuryr_runtime::kube_client(kubeconfig.as_deref())
        })
        .await
        else {
            return;
        };
        // The first round of Leases runs while the network is prepared.
        if self.shard_config.shards > 0 {
            let handle = kuryr_shard::start(
                client.clone(),
                self.shard_config.clone(),
                self.shard_metrics.clone(),
                shutdown.clone(),
            );
            tokio::spawn(forward(handle.ownership(), self.ownership_tx.clone()));
            let _ = self.shard_handle.set(handle);
        }
        let prepared = match self.neutron.clone() {
            None => self.prepare_embedded(&client, &shutdown).await,
            Some((os, nm)) => self.prepare_neutron(&client, os, nm, &shutdown).await,
        };
        let Some(Prepared { backend, network, found, store, ready }) = prepared else { return };
        let Start { config, watcher, index, readiness, metrics, cell, shards, .. } = self;

        // Which shards are this replica's, before anything is loaded.
        let mut ownership = shards.ownership_receiver();
        let own = tokio::select! {
            o = ownership.wait_for(|o| o.ready) => match o { Ok(o) => o.clone(), Err(_) => return },
            () = shutdown.clone().wait() => return,
        };
        // Recovery: every recorded VIF of this replica's nodes into the index before any stream
        // is served.
        let held = {
            let mut idx = lock(&index);
            for f in found.iter().filter(|f| own.owns(&f.node)) {
                if let Some((record, state)) = &f.recorded {
                    idx.upsert_vif(convert::to_proto(&f.pod, &f.node, &network, record, *state));
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
        shards.set_loaded(own.owned.clone());
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
        let follower = shards::Follower {
            shards: shards.clone(),
            controller: controller.clone(),
            client: client.clone(),
            network: network.clone(),
            index: index.clone(),
            backend: backend.clone(),
            readiness: readiness.clone(),
            metrics: metrics.clone(),
            recovered: own.owned.clone(),
        };
        tokio::spawn(follower.run(shutdown.clone()).instrument(tracing::info_span!("shards")));
        if let Some(store) = store {
            let blocks = k8s::follow_blocks(client, store, network, index.clone(), shutdown.clone());
            tokio::spawn(blocks.instrument(tracing::info_span!("address-blocks")));
        }
        if let (AnyBackend::Neutron(b), Some(rx)) = (&backend, ready) {
            let ready = mark_ready(controller.clone(), b.clone(), rx, shutdown.clone());
            tokio::spawn(ready.instrument(tracing::info_span!("ready")));
            let gc = collect_orphans(
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
            k8s::ensure_network(client, &store, &network, self.spec.as_ref())
        })
        .await?;
        self.readiness.set(Condition::Network, true);
        let found = kuryr_runtime::retry("loading PodVifs", shutdown, || k8s::list_pod_vifs(client, &network)).await?;
        let backend = AnyBackend::Embedded(EmbeddedBackend::new(store.clone(), &network));
        Some(Prepared { backend, network, found, store: Some(store), ready: None })
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
        if let Some(nn) = backend.namespace_networks() {
            let loaded =
                kuryr_runtime::retry("loading the namespace networks", shutdown, || async { Ok(nn.load().await?) })
                    .await?;
            tracing::info!(loaded, "namespace networks loaded");
        }
        self.readiness.set(Condition::Network, true);
        let network = backend.network_id().to_string();
        let found = kuryr_runtime::retry("loading PodVifs", shutdown, || k8s::list_pod_vifs(client, &network)).await?;
        let recorded: HashMap<String, String> = found
            .iter()
            .filter_map(|f| f.recorded.as_ref().map(|(r, _)| (f.pod.uid.clone(), r.vif_id.clone())))
            .collect();
        let summary = kuryr_runtime::retry("recovering the cluster's Neutron ports", shutdown, || async {
            Ok(backend.recover(&recorded).await?)
        })
        .await?;
        tracing::info!(
            in_use = summary.in_use,
            free = summary.free,
            recycling = summary.recycling,
            deleted = summary.deleted,
            "recovered the Neutron ports and pools"
        );
        backend.spawn(refill, shutdown.clone());
        let _ = self.pools.set(backend.clone());
        Some(Prepared { backend: AnyBackend::Neutron(backend), network, found, store: None, ready: Some(ready) })
    }
}

/// Marks VIFs READY as the status poller finds their ports ACTIVE; a VIF whose state could not
/// be recorded is watched again (and so retried).
async fn mark_ready(
    controller: Arc<Controller<KubeCluster>>,
    backend: Arc<NeutronBackend>,
    mut ready: tokio::sync::mpsc::UnboundedReceiver<neutron::ReadyVif>,
    shutdown: Shutdown,
) {
    loop {
        let r = tokio::select! {
            r = ready.recv() => match r { Some(r) => r, None => return },
            () = shutdown.clone().wait() => return,
        };
        let (ctl, b) = (controller.clone(), backend.clone());
        tokio::spawn(async move {
            if let Err(e) = ctl.mark_ready(&r.pod_uid, &r.vif_id).await {
                tracing::warn!(uid = %r.pod_uid, vif = %r.vif_id, error = %cluster::chain(&e),
                    "could not record READY; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                b.watch_ready(&r.pod_uid, &r.vif_id, true);
            }
        });
    }
}

/// Hands ports held by pods the allocator does not know (deleted while no allocator ran, or
/// before their PodVif existed) to the controller's cleanup, once the watcher's snapshot is in
/// and then every `interval`.
async fn collect_orphans(
    controller: Arc<Controller<KubeCluster>>,
    backend: Arc<NeutronBackend>,
    readiness: Readiness,
    interval: Duration,
    shutdown: Shutdown,
) {
    let mut ran_once = false;
    loop {
        let wait = if ran_once { interval } else { Duration::from_secs(1) };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shutdown.clone().wait() => return,
        }
        if !readiness.holds(Condition::Watcher) {
            continue;
        }
        ran_once = true;
        let orphans: Vec<_> = {
            let holders = backend.holders();
            let view = view_lock(controller.view());
            // Only on this replica's nodes: the others' owners collect theirs.
            holders.into_iter().filter(|(k, node)| view.get(&k.uid).is_none() && controller.serves(node)).collect()
        };
        for (key, node) in orphans {
            tracing::info!(uid = %key.uid, pod = %format!("{}/{}", key.namespace, key.name), node,
                "port held by a pod that no longer exists; cleaning up");
            if key.name.is_empty() {
                if let Err(e) = backend.release(&key, &node).await {
                    tracing::warn!(uid = %key.uid, error = %cluster::chain(&e), "releasing an orphaned port failed");
                }
            } else {
                controller.adopt_orphan(key, &node);
            }
        }
    }
}
