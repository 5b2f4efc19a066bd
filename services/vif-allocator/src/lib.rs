//! kuryr-vif-allocator: gives every scheduled pod that is not on the host network a VIF from its
//! backend ([`backend`]: the embedded IPAM, or Neutron ports with pools — [`backend::neutron`]), records
//! pod → VIF in the Kubernetes API, and streams each node's VIFs to that node's binder.
//!
//! **Watches** pods and nodes through the watcher's Subscribe stream ([`grpc::follow`]), the network's
//! AddressBlocks (metadata only, for node routes) and nothing else.
//!
//! **Owns** per pod: the finalizer `kuryr.openstack.org/vif`, a PodVif (spec + status) and the
//! pod's addresses in the AddressBlocks ([`backend::ipam`]). A keyed queue ([`kuryr_stream::WorkQueue`]) reconciles pods
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
//! to cleanup once the watcher's snapshot is in (and every `--orphan-gc-interval` after). With
//! several replicas, each does this for the nodes of its shards only, and reads a gained shard's
//! ports from Neutron before serving it ([`backend::neutron::shards`]).
//!
//! Readiness ([`ready`]): NOT_SERVING until the pod network exists (the PodNetwork, or the
//! Neutron network), the PodVifs (and Neutron ports) were loaded and the watcher's stream is
//! live; and again whenever that stream is down or silent for longer than
//! `--stream-idle-timeout`.
//!
//! **Layers** (each depends only on those above it):
//! - [`core`]: pure domain types and logic — a pod and its VIF ([`core::VifRecord`],
//!   [`core::VifState`], [`core::PodKey`]; [`core::Vif`] and [`core::NodeRoutes`] as the index
//!   holds and streams them), the IPAM's carving and address choice ([`core::ipam`]), the
//!   attachment annotations ([`core::attach`]); no Kubernetes client, no gRPC, no protobuf.
//! - [`error`]: why a cluster, backend, reconcile or plug operation failed.
//! - [`backend`]: the [`backend::VifBackend`] trait and its implementations: the embedded IPAM
//!   ([`backend::embedded`] over the AddressBlock store [`backend::ipam`]) and Neutron
//!   ([`backend::neutron`]); [`backend::any`] is the one an allocator runs with.
//! - [`k8s`]: the custom resources ([`k8s::crd`]; a PodVif stores the core's
//!   [`core::VifRecord`] as it is), the [`cluster::Cluster`] against the API server ([`k8s::api`]) and the
//!   NetworkAttachmentDefinitions of further interfaces ([`k8s::attach`]).
//! - [`cluster`]: what the controller needs of the API, as a trait; its backend is reached
//!   directly through [`cluster::Cluster::backend`].
//! - [`pods`], [`index`], [`shards`]: the view of pods and nodes (fed [`pods::Watched`] events),
//!   the per-node VIF streams' index (of [`core::Vif`]s), which nodes this replica serves; none
//!   of them sees a protobuf message.
//! - [`controller`]: the reconcile loop (unit-tested with an in-memory cluster that is its own
//!   backend).
//! - the edges that drive it: [`grpc`] (the API served, conversion to `kuryr.allocator.v1`
//!   ([`grpc::convert`]) as each response is sent, the pool API ([`grpc::pool_api`]) and the
//!   watcher followed ([`grpc::follow`], which makes its events [`pods::Watched`])),
//!   [`handover`] (shards gained and lost), [`ready`], and the start-up sequence that wires them
//!   (`start.rs`).

pub mod backend;
pub mod cluster;
pub mod controller;
pub mod core;
pub mod error;
pub mod grpc;
pub mod handover;
pub mod index;
pub mod k8s;
pub mod metrics;
pub mod pods;
pub mod ready;
pub mod shards;
mod start;
mod tasks;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kuryr_proto::allocator::v1::pool_manager_server::PoolManagerServer;
use kuryr_proto::allocator::v1::vif_allocator_server::VifAllocatorServer;
use kuryr_proto::service_names;
use kuryr_runtime::auth::{AccountRef, Rules};
use kuryr_runtime::follow::{FollowArgs, HeartbeatArgs};
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime, Services};
use tracing::Instrument as _;

use crate::backend::neutron::config::NeutronArgs;
use crate::backend::neutron::metrics::NeutronMetrics;
use crate::core::ipam;
use crate::grpc::pool_api::{self, BackendCell, PoolApi};
use crate::grpc::{AllocatorService, ControllerCell};
use crate::index::VifIndex;
use crate::k8s::api::KubeCluster;
use crate::k8s::crd::PodNetworkSpec;
use crate::metrics::Metrics;
use crate::ready::Readiness;
use crate::shards::Shards;
use crate::start::Start;

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
                && self.network.len() <= crate::backend::ipam::MAX_NETWORK_NAME
                && self.network.split('.').all(|l| {
                    !l.is_empty()
                        && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                        && !l.starts_with('-')
                        && !l.ends_with('-')
                }),
            "--network {:?}: not a valid object name (lower-case DNS subdomain of at most {} characters)",
            self.network,
            crate::backend::ipam::MAX_NETWORK_NAME
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
    let mut rt = Runtime::gated("kuryr-vif-allocator", &config.common, config.kubeconfig.clone(), rules(&config))?;
    let credentials = config.common.auth.credentials();
    let watcher = kuryr_runtime::discover::peer("watcher", &config.watcher, config.kubeconfig.clone(), credentials)?;
    let metrics = Metrics::register(rt.registry());
    let shard_config = config.shard.resolve("kuryr-vif-allocator", &config.listen)?;
    let (joining, ownership) = kuryr_shard::Joining::new(shard_config, rt.registry());
    let shards = Shards::after_loading(crate::shards::SERVICE, ownership);
    shards.register_redirects(rt.registry(), "kuryr_allocator_redirects");
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
    tracing::info!(epoch = %index.as_ref().epoch(), backend = ?config.backend, network = config.network, workers = config.workers, "starting");
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
        joining: joining.clone(),
    };
    tokio::spawn(start.run(rt.shutdown()).instrument(tracing::info_span!("startup")));
    let service = AllocatorService::new(index, cell, metrics, rt.shutdown())
        .with_shards(shards)
        .with_heartbeat(config.heartbeat.stream_heartbeat);
    let services = Services::default()
        .with(VifAllocatorServer::new(service).max_decoding_message_size(MAX_REQUEST))
        .with(PoolManagerServer::new(pool_api).max_decoding_message_size(MAX_REQUEST));
    let served = rt.serve(services, &config.listen, Some(&config.metrics_listen)).await;
    // The shard Leases are released at shutdown, so the other replicas take over at once.
    joining.released().await;
    served
}
