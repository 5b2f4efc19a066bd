//! kuryr-policy: NetworkPolicy compiled per node and streamed to the binders.
//!
//! **Watches** pods, namespaces and NetworkPolicies through the watcher's Subscribe stream
//! ([`grpc::follow`], the one follower of [`kuryr_stream::follow`]), nothing else; it reads the
//! Kubernetes API only to find a `k8s:` watcher target and to review callers' tokens.
//!
//! **Compiles** them with [`kuryr_policy_core`] (pure, incremental) into each node's state: the
//! local pod addresses some policy isolates and the groups of peers they may talk with
//! ([`core::publish`]). The watcher's objects are converted at the edge ([`grpc::convert`]);
//! parts it cannot read match nothing.
//!
//! **Streams** each node's state over `WatchPolicies(node)` ([`grpc`]): a snapshot,
//! SNAPSHOT_COMPLETE, then deltas, with resume points `"<epoch>-<revision>"`
//! and heartbeats while quiet ([`kuryr_stream`]), exactly as WatchVifs and WatchLoadBalancers
//! do. Every node's binder follows its stream and programs nftables. `GetNodePolicy` answers the
//! same state at once, for grpcurl.
//!
//! **Who may call**: both methods, the binders' ServiceAccount (`--binder-accounts`); a token
//! bound to a node reads that node's policy only. kuryr-policy authenticates to the watcher with
//! its own token (`--auth-token-file`).
//!
//! **Neutron** (`--backend neutron`): besides the stream, NetworkPolicies are enforced by
//! Neutron security groups on the pods' ports, one group per policy ([`backend::neutron`]).
//!
//! Readiness: NOT_SERVING until the watcher's first snapshot is compiled, and while its stream
//! is down or silent for longer than `--stream-idle-timeout` (the state already streamed stays
//! in force on the nodes).
//!
//! **Scales** through shards ([`shards`], `--shards`, Kubernetes Leases from [`kuryr_shard`]):
//! replicas split the nodes, each streaming only its nodes' policy and redirecting binders of
//! the others to their owner, as the allocator does.

pub mod backend;
pub mod core;
pub mod grpc;
pub mod k8s;
pub mod metrics;
pub mod shards;

use std::path::PathBuf;

use clap::Parser;
use kuryr_proto::policy::v1::policies_server::PoliciesServer;
use kuryr_proto::service_names;
use kuryr_runtime::auth::{AccountRef, Rules};
use kuryr_runtime::follow::{FollowArgs, HeartbeatArgs};
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime, Services};
use kuryr_shard::Joining;
use kuryr_stream::{Epoch, Log};
use tracing::Instrument as _;

use crate::backend::neutron;
use crate::core::publish::{PolicyLog, Publisher};
use crate::grpc::PolicyService;
use crate::grpc::follow::{self, Readiness};
use crate::k8s::podvifs;
use crate::metrics::Metrics;
use crate::shards::Shards;

/// Deltas kept for resuming WatchPolicies: a binder that reconnects within this many changes
/// (over every node) gets only what it missed.
pub const HISTORY: usize = kuryr_stream::log::DEFAULT_HISTORY;

/// The largest request accepted: every request is a node name, a resume point and a name.
pub const MAX_REQUEST: usize = 64 * 1024;

/// Command-line configuration.
#[derive(Clone, Debug, Parser)]
#[command(name = "kuryr-policy", version, about = "Compiles NetworkPolicies per node and streams them to the binders.")]
pub struct Config {
    /// gRPC listen addresses, comma-separated or repeated: HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_POLICY_LISTEN", value_delimiter = ',', default_value = "0.0.0.0:9640")]
    pub listen: Vec<ListenAddr>,

    /// HTTP address for Prometheus metrics (/metrics) and probes (/livez, /readyz).
    #[arg(long, env = "KURYR_POLICY_METRICS_LISTEN", default_value = "0.0.0.0:9641")]
    pub metrics_listen: ListenAddr,

    /// The watcher to subscribe to: HOST:PORT, http://HOST:PORT, unix:/path, or
    /// k8s:[NAMESPACE/]SERVICE:PORT (the Service's ready endpoints, found through the Kubernetes
    /// API: no cluster DNS needed).
    #[arg(long, env = "KURYR_WATCHER", default_value = "127.0.0.1:9600")]
    pub watcher: String,

    /// Kubeconfig file, read to find a k8s: watcher target and to check callers' tokens
    /// (TokenReview); when unset, the in-cluster service account (or $KUBECONFIG) is used.
    #[arg(long, env = "KURYR_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// This replica's name in the watcher's logs (the pod name in a Deployment); the host name
    /// when unset.
    #[arg(long, env = "KURYR_INSTANCE")]
    pub instance: Option<String>,

    /// The binders' ServiceAccounts (`namespace:name`, comma-separated): they alone may watch and
    /// read the compiled policies, each (with a node-bound token) its own node's only.
    #[arg(long, env = "KURYR_BINDER_ACCOUNTS", value_delimiter = ',', default_value = "kuryr-system:kuryr-binder")]
    pub binder_accounts: Vec<AccountRef>,

    /// Where policies are enforced besides the binders' nftables: `embedded` (only there) or
    /// `neutron` (also Neutron security groups on the pods' ports; see the --os-cloud,
    /// --cluster-id and --neutron-* flags).
    #[arg(long, env = "KURYR_POLICY_BACKEND", value_enum, default_value_t = BackendKind::Embedded)]
    pub backend: BackendKind,

    #[command(flatten)]
    pub neutron: neutron::NeutronArgs,
    /// Report each NetworkPolicy's status (compiled, the nodes enforcing it, errors) as
    /// Kubernetes Events on it; needs `create` and `patch` on events.k8s.io events.
    #[arg(long, env = "KURYR_POLICY_STATUS_EVENTS", default_value_t = true, action = clap::ArgAction::Set)]
    pub status_events: bool,

    /// Take a pod's addresses from its PodVif (the VIF the allocator recorded, before the binder
    /// plugs it) while its status has none, so that a pod a policy selects is isolated once its
    /// VIF is recorded, not only after the kubelet's later status report; needs `list` and `watch` on
    /// podvifs (kuryr.openstack.org).
    #[arg(long, env = "KURYR_POLICY_VIF_ADDRESSES", default_value_t = true, action = clap::ArgAction::Set)]
    pub vif_addresses: bool,

    #[command(flatten)]
    pub shard: kuryr_shard::ShardArgs,

    #[command(flatten)]
    pub heartbeat: HeartbeatArgs,

    #[command(flatten)]
    pub follow: FollowArgs,

    #[command(flatten)]
    pub common: CommonArgs,
}

/// Where policies are enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The binders' nftables, from the WatchPolicies stream.
    Embedded,
    /// Neutron security groups too.
    Neutron,
}

/// Who may call what: every Policies method, the binders.
pub fn rules(config: &Config) -> Rules {
    Rules::new().allow(service_names::POLICIES, &["WatchPolicies", "GetNodePolicy"], &config.binder_accounts)
}

impl Config {
    fn instance_name(&self) -> String {
        kuryr_runtime::config::instance_name(self.instance.as_deref(), "kuryr-policy")
    }
}

/// Runs kuryr-policy until SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let mut rt = Runtime::gated("kuryr-policy", &config.common, config.kubeconfig.clone(), rules(&config))?;
    let credentials = config.common.auth.credentials();
    let watcher = kuryr_runtime::discover::peer("watcher", &config.watcher, config.kubeconfig.clone(), credentials)?;
    let metrics = Metrics::register(rt.registry());
    let log: PolicyLog = Log::new(Epoch::random(), HISTORY).shared();
    tracing::info!(epoch = %kuryr_stream::log::lock(&log).epoch(), watcher = config.watcher, "starting");
    let readiness = Readiness::default();
    readiness.spawn_driver(rt.health(), follow::SERVICES, rt.shutdown());
    let (shards, joining) = start_shards(&config, &mut rt)?;
    let mut publisher = Publisher::new(log.clone(), metrics.clone());
    // One PodVif watch: the addresses of pods whose status has none yet, and the Neutron ports.
    let mut sinks: Vec<Box<dyn podvifs::Sink>> = Vec::new();
    if config.backend == BackendKind::Neutron {
        let (enforcer, ports) = neutron::start(&config, &mut rt, shards.ownership_changes())?;
        publisher = publisher.with_enforcer(Box::new(enforcer));
        sinks.push(Box::new(ports));
    }
    let vifs = config.vif_addresses.then(|| {
        let (sink, rx) = podvifs::AddressSink::new();
        sinks.push(Box::new(sink));
        rx
    });
    if !sinks.is_empty() {
        watch_pod_vifs(&config, &metrics, &rt, sinks);
    }
    let status = config.status_events.then(|| status_events(&config, &metrics, &rt));
    let follower = follow::Follower {
        channel: watcher,
        publisher,
        readiness,
        metrics: metrics.clone(),
        subscriber: format!("kuryr-policy/{}", config.instance_name()),
        follow: config.follow.config(),
        status,
        vifs,
    };
    tokio::spawn(follower.run(rt.shutdown()).instrument(tracing::info_span!("watcher")));
    let service = PolicyService::new(log, metrics, rt.shutdown())
        .with_heartbeat(config.heartbeat.stream_heartbeat)
        .with_shards(shards);
    // Requests are a node name and a resume point.
    let served = Services::default().with(PoliciesServer::new(service).max_decoding_message_size(MAX_REQUEST));
    let served = rt.serve(served, &config.listen, Some(&config.metrics_listen)).await;
    // The shard Leases are released at shutdown, so the other replicas take over at once.
    joining.released().await;
    served
}

/// The nodes this replica serves: all of them with `--shards 0`, else those of the shards its
/// Leases hold (taken in the background, with a Kubernetes client built with retries).
fn start_shards(config: &Config, rt: &mut Runtime) -> anyhow::Result<(Shards, Joining)> {
    let (joining, ownership) = Joining::new(config.shard.resolve("kuryr-policy", &config.listen)?, rt.registry());
    let shards = Shards::at_once(crate::shards::SERVICE, ownership);
    if !joining.sharded() {
        return Ok((shards, joining));
    }
    shards.register_redirects(rt.registry(), "kuryr_policy_redirects");
    let (kubeconfig, shutdown, to_join) = (config.kubeconfig.clone(), rt.shutdown(), joining.clone());
    tokio::spawn(async move {
        let client =
            kuryr_runtime::retry::retry("building the Kubernetes client for the shard Leases", &shutdown, || {
                kuryr_runtime::k8s::kube_client(kubeconfig.as_deref())
            })
            .await;
        if let Some(client) = client {
            to_join.join(client, shutdown);
        }
    });
    Ok((shards, joining))
}

/// Starts the PodVif watch into `sinks` (its Kubernetes client built with retries).
fn watch_pod_vifs(config: &Config, metrics: &Metrics, rt: &Runtime, sinks: Vec<Box<dyn podvifs::Sink>>) {
    let (kubeconfig, errors, shutdown) =
        (config.kubeconfig.clone(), metrics.podvif_watch_errors.clone(), rt.shutdown());
    tokio::spawn(async move {
        let client =
            kuryr_runtime::retry::retry("building the Kubernetes client for the PodVif watch", &shutdown, || {
                kuryr_runtime::k8s::kube_client(kubeconfig.as_deref())
            })
            .await;
        if let Some(client) = client {
            podvifs::follow(client, sinks, errors, shutdown).await;
        }
    });
}

/// Starts the task writing the policies' status Events (its Kubernetes client built with
/// retries); returns where to send them.
fn status_events(config: &Config, metrics: &Metrics, rt: &Runtime) -> k8s::ReportSender {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let (kubeconfig, instance, metrics, shutdown) =
        (config.kubeconfig.clone(), config.instance_name(), metrics.clone(), rt.shutdown());
    tokio::spawn(async move {
        let client = kuryr_runtime::retry::retry("building the Kubernetes client for status Events", &shutdown, || {
            kuryr_runtime::k8s::kube_client(kubeconfig.as_deref())
        })
        .await;
        if let Some(client) = client {
            k8s::EventSink::new(client, instance, metrics).run(rx).await;
        }
    });
    tx
}
