//! kuryr-vif-allocator: gives every scheduled pod that is not on the host network a VIF from the
//! embedded IPAM, records pod → VIF in the Kubernetes API, and streams each node's VIFs to that
//! node's binder.
//!
//! **Watches** pods and nodes through the watcher's Subscribe stream ([`follow`]), the network's
//! AddressBlocks (metadata only, for node routes) and nothing else.
//!
//! **Owns** per pod: the finalizer `kuryr.openstack.org/vif`, a PodVif (spec + status) and the
//! pod's addresses in the AddressBlocks ([`ipam`]). A keyed queue ([`queue`]) reconciles pods one
//! uid at a time, many uids at once ([`controller`]); every step is idempotent and recorded
//! before the VIF is handed out.
//!
//! **Streams** per node over `WatchVifs` ([`grpc`]): the node's VIFs and the other nodes' routes,
//! SNAPSHOT_COMPLETE, then deltas, with resume points `"<epoch>-<revision>"` ([`index`]).
//!
//! **Recovers** on start by loading every PodVif of the network into the index before serving
//! streams, so that binders get their VIFs at once after a restart (node routes follow as
//! deltas once the watcher's nodes and the address blocks are in); once the watcher's snapshot
//! is in, PodVifs whose pod no longer exists are cleaned up.
//!
//! Readiness ([`ready`]): NOT_SERVING until the PodNetwork exists, the PodVifs were loaded and
//! the watcher's stream is live.

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
pub mod pods;
pub mod queue;
pub mod ready;

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use kuryr_proto::allocator::v1::pool_manager_server::PoolManagerServer;
use kuryr_proto::allocator::v1::vif_allocator_server::VifAllocatorServer;
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime, Shutdown};
use tracing::Instrument as _;

use crate::controller::{Controller, SharedView};
use crate::crd::PodNetworkSpec;
use crate::grpc::{AllocatorService, ControllerCell, Pools};
use crate::index::{SharedIndex, VifIndex, lock};
use crate::ipam::store::IpamStore;
use crate::k8s::KubeCluster;
use crate::metrics::Metrics;
use crate::queue::WorkQueue;
use crate::ready::Readiness;

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

    /// The watcher to subscribe to: HOST:PORT, http://HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_WATCHER", default_value = "127.0.0.1:9600")]
    pub watcher: String,

    /// Kubeconfig file; when unset, the in-cluster service account (or $KUBECONFIG) is used.
    #[arg(long, env = "KURYR_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

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
    #[arg(long, env = "KURYR_ALLOCATOR_WORKERS", default_value_t = 16,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub workers: usize,

    /// This replica's name in Events and in the watcher's logs (the pod name in a Deployment);
    /// the host name when unset.
    #[arg(long, env = "KURYR_INSTANCE")]
    pub instance: Option<String>,

    #[command(flatten)]
    pub common: CommonArgs,
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
        self.instance
            .clone()
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string()))
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "kuryr-vif-allocator".to_string())
    }
}

/// Runs the allocator until SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let spec = config.network_spec()?;
    let mut rt = Runtime::new("kuryr-vif-allocator", &config.common)?;
    let watcher = kuryr_runtime::client::channel(&config.watcher)?;
    let metrics = Metrics::register(rt.registry());
    let index = VifIndex::new(index::Epoch::random(), index::DEFAULT_HISTORY);
    tracing::info!(epoch = %index.epoch(), network = config.network, workers = config.workers, "starting");
    let index = index.shared();
    let readiness = Readiness::default();
    readiness.spawn_driver(rt.health(), rt.shutdown());
    let cell: ControllerCell<KubeCluster> = Arc::default();
    let start = Start {
        config: config.clone(),
        spec,
        watcher,
        index: index.clone(),
        readiness,
        metrics: metrics.clone(),
        cell: cell.clone(),
    };
    tokio::spawn(start.run(rt.shutdown()).instrument(tracing::info_span!("startup")));
    let service = AllocatorService::new(index, cell, metrics, rt.shutdown());
    let routes =
        tonic::service::Routes::new(VifAllocatorServer::new(service)).add_service(PoolManagerServer::new(Pools));
    rt.serve(routes, &config.listen, Some(&config.metrics_listen)).await
}

/// The start-up sequence, in the background while the server already answers (NOT_SERVING).
struct Start {
    config: Config,
    spec: Option<PodNetworkSpec>,
    watcher: tonic::transport::Channel,
    index: SharedIndex,
    readiness: Readiness,
    metrics: Metrics,
    cell: ControllerCell<KubeCluster>,
}

impl Start {
    async fn run(self, shutdown: Shutdown) {
        let Start { config, spec, watcher, index, readiness, metrics, cell } = self;
        let network = config.network.clone();
        let kubeconfig = config.kubeconfig.clone();
        let Some(client) =
            k8s::retry("building a Kubernetes client", &shutdown, || k8s::kube_client(kubeconfig.as_deref())).await
        else {
            return;
        };
        let store = Arc::new(IpamStore::new(client.clone()));
        let ensured = k8s::retry("looking up the PodNetwork", &shutdown, || {
            k8s::ensure_network(&client, &store, &network, spec.as_ref())
        })
        .await;
        if ensured.is_none() {
            return;
        }
        readiness.set_network();

        // Recovery: every recorded VIF into the index before any stream is served.
        let Some(found) = k8s::retry("loading PodVifs", &shutdown, || k8s::list_pod_vifs(&client, &network)).await
        else {
            return;
        };
        let held = {
            let mut idx = lock(&index);
            for f in &found {
                if let Some((record, state)) = &f.recorded {
                    idx.upsert_vif(convert::to_proto(&f.pod, &f.node, &network, record, *state));
                }
            }
            idx.set_ready();
            idx.len()
        };
        metrics.vifs.set(i64::try_from(held).unwrap_or(i64::MAX));
        tracing::info!(podvifs = found.len(), vifs = held, "recovered the recorded VIFs; serving WatchVifs");
        readiness.set_recovered();

        let instance = config.instance_name();
        let cluster = KubeCluster::new(client.clone(), store.clone(), &network, Some(instance.clone()));
        let queue = Arc::new(WorkQueue::default());
        let view = SharedView::default();
        let controller = Arc::new(Controller::new(cluster, &network, view, index.clone(), queue, metrics.clone()));
        let _ = cell.set(controller.clone());
        controller.spawn_workers(config.workers, shutdown.clone());
        let blocks = k8s::follow_blocks(client, store, network, index.clone(), shutdown.clone());
        tokio::spawn(blocks.instrument(tracing::info_span!("address-blocks")));
        let follower = follow::Follower {
            channel: watcher,
            controller,
            index,
            recovered: found.into_iter().map(|f| (f.pod, f.node)).collect(),
            readiness,
            metrics,
            subscriber: format!("kuryr-vif-allocator/{instance}"),
        };
        follower.run(shutdown).instrument(tracing::info_span!("watcher")).await;
    }
}
