//! kuryr-watcher: the only reader of the Kubernetes API for the objects kuryr cares about.
//!
//! **Watches** ([`k8s`]) pods, services, endpointslices (discovery.k8s.io/v1), namespaces,
//! network policies (networking.k8s.io/v1) and nodes in all namespaces, with kube-runtime
//! watchers that re-list after 410 Gone and reconnect with backoff.
//!
//! **Owns** an in-memory [`index`] of each object reduced to what consumers read
//! ([`k8s::convert`]),
//! and a bounded history of the changes, numbered by revision. A change is recorded only when
//! the reduced object changed, so resourceVersion-only churn (node heartbeats, status details
//! nobody reads) costs the streams nothing.
//!
//! **Streams** it over `kuryr.watcher.v1.Watcher/Subscribe` ([`grpc`], with the shared core of
//! [`kuryr_stream::feed`]): a snapshot, then SNAPSHOT_COMPLETE, then deltas, each with a resume
//! point `"<epoch>-<revision>"` ([`kuryr_stream::epoch`]). Resuming with a point of this process
//! whose deltas are still in the history sends SNAPSHOT_COMPLETE and replays only what was
//! missed; anything else (another replica, a restart, a point too old) gets RESET and a fresh
//! snapshot; an empty `resume_from` gets a snapshot without the RESET. A stream with nothing to
//! say for `--stream-heartbeat` gets a HEARTBEAT. Replicas share nothing: each has its own epoch
//! and its own watches.
//!
//! Readiness: the Watcher service is NOT_SERVING until every kind has been listed once, and
//! while the Kubernetes API does not answer; Subscribe is UNAVAILABLE until that first sync.
//!
//! # Memory
//!
//! The target is ≤ 80 MB RSS with 10,000 pods. What is held: one reduced `Object` per
//! Kubernetes object (a pod is a few hundred bytes: names, labels, IPs, kuryr annotations only),
//! behind an `Arc` shared by the index, the history and snapshots being sent; and the history,
//! bounded by `--history` (default 16,384) deltas. The full objects from the API are converted
//! by value and dropped as they arrive; no kube `Store`/reflector keeps them, and list pages are
//! at most 500 objects. A stream holds a cursor into the history, not a queue of its own, and at
//! most 128 responses queued for its client; a snapshot in flight is a vector of `Arc`s.
//!
//! # Layers
//!
//! `k8s/` (the watches, and `k8s/convert.rs`: a Kubernetes object reduced to the wire's
//! `Object`), [`index`] and [`selector`] (the log of reduced objects and what a subscriber
//! asked for: pure, no Kubernetes client, no gRPC server), `grpc/` (the Subscribe service). The
//! index keeps the reduced objects in their wire form on purpose: a watcher's product is that
//! message, streamed to every subscriber as it is, so a domain type in between would only add a
//! conversion per object and subscriber.

pub mod grpc;
pub mod index;
pub mod k8s;
pub mod metrics;
pub mod selector;

use std::path::PathBuf;

use clap::Parser;
use kuryr_proto::service_names;
use kuryr_proto::watcher::v1::watcher_server::WatcherServer;
use kuryr_runtime::auth::{AccountRef, Rules};
use kuryr_runtime::follow::HeartbeatArgs;
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime, Services};

/// The largest request accepted: every request is a few names, ids and a resume point.
pub const MAX_REQUEST: usize = 64 * 1024;

/// Command-line configuration.
#[derive(Clone, Debug, Parser)]
#[command(name = "kuryr-watcher", version, about = "Streams Kubernetes objects to the other kuryr services.")]
pub struct Config {
    /// gRPC listen addresses, comma-separated or repeated: HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_WATCHER_LISTEN", value_delimiter = ',', default_value = "0.0.0.0:9600")]
    pub listen: Vec<ListenAddr>,

    /// HTTP address for Prometheus metrics (/metrics) and probes (/livez, /readyz).
    #[arg(long, env = "KURYR_WATCHER_METRICS_LISTEN", default_value = "0.0.0.0:9601")]
    pub metrics_listen: ListenAddr,

    /// Kubeconfig file; when unset, the in-cluster service account (or $KUBECONFIG) is used.
    #[arg(long, env = "KURYR_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Changes kept for resuming streams. A subscriber that reconnects within this many changes
    /// gets only what it missed; later, it gets RESET and a full snapshot.
    #[arg(long, env = "KURYR_WATCHER_HISTORY", default_value_t = index::DEFAULT_HISTORY,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000_000))]
    pub history: usize,

    /// The ServiceAccounts that may Subscribe (`namespace:name`, comma-separated): it serves
    /// every pod, Service, node and NetworkPolicy of the cluster, so only kuryr's own services.
    #[arg(
        long,
        env = "KURYR_SUBSCRIBER_ACCOUNTS",
        value_delimiter = ',',
        default_value = "kuryr-system:kuryr-vif-allocator,kuryr-system:kuryr-lbaas,kuryr-system:kuryr-policy"
    )]
    pub subscriber_accounts: Vec<AccountRef>,

    #[command(flatten)]
    pub heartbeat: HeartbeatArgs,

    #[command(flatten)]
    pub common: CommonArgs,
}

/// Who may call what: Subscribe, only the subscriber accounts.
pub fn rules(config: &Config) -> Rules {
    Rules::new().allow(service_names::WATCHER, &["Subscribe"], &config.subscriber_accounts)
}

/// Runs the watcher until SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let mut rt = Runtime::gated("kuryr-watcher", &config.common, config.kubeconfig.clone(), rules(&config))?;
    let metrics = metrics::Metrics::register(rt.registry());
    let index = index::Index::new(kuryr_stream::Epoch::random(), config.history);
    tracing::info!(epoch = %index.as_ref().epoch(), history = config.history, "starting");
    let index = index.shared();
    rt.health().register(service_names::WATCHER).await;
    k8s::spawn(config.kubeconfig.clone(), index.clone(), metrics.clone(), rt.health(), rt.shutdown());
    let service = grpc::WatcherService::new(index, metrics, rt.shutdown(), config.heartbeat.stream_heartbeat);
    // A Subscribe request is a few kinds, names and a resume point.
    let services = Services::default().with(WatcherServer::new(service).max_decoding_message_size(MAX_REQUEST));
    rt.serve(services, &config.listen, Some(&config.metrics_listen)).await
}
