//! kuryr-lbaas: turns Kubernetes Services and their EndpointSlices into load balancers.
//!
//! **Watches** Services and EndpointSlices through the watcher's Subscribe stream
//! ([`grpc::follow`]) into a view ([`core::view`]); nothing else.
//!
//! **Owns** per Service (ClusterIP, NodePort and LoadBalancer types with cluster IPs): the finalizer
//! `kuryr.openstack.org/lbaas` and a ServiceLoadBalancer record ([`k8s::crd`]) whose spec is the
//! desired load balancer ([`core::spec`]) and whose status is what the backend observed. A keyed queue
//! reconciles Services one key at a time, many keys at once ([`controller`]). ExternalName
//! Services get an Event saying why they have no load balancer; headless ones are ignored.
//!
//! **Programs** through a [`backend::Backend`]. The node backend (the embedded default)
//! publishes each spec to `WatchLoadBalancers` ([`grpc`]), which every node's binder programs
//! into nftables: a snapshot, SNAPSHOT_COMPLETE, then deltas, with resume points
//! `"<epoch>-<revision>"` and heartbeats while quiet ([`kuryr_stream`]). Its status is `PROGRAMMED` at the generation
//! published. The spec's generation is the record's `metadata.generation`, so it only grows,
//! across restarts too.
//!
//! **Recovers** on start by loading every record before the first reconcile (the node backend
//! republishes them, so binders that reconnect get the last programmed state); at the watcher's
//! first complete snapshot every Service and every record is queued: records without a Service
//! are deleted, Services without a record get one.
//!
//! **Scales** through shards ([`shards`], `--shards`, Kubernetes Leases from [`kuryr_shard`]): a
//! Service is reconciled only by the replica owning the shard of its `namespace/name`; every
//! replica follows the records of the others' shards ([`mirror`]), so WatchLoadBalancers streams
//! every Service wherever a binder connects, and Get/List answer for all of them.
//!
//! Readiness ([`ready`]): NOT_SERVING until the records are loaded, the watcher's stream is live
//! (not down, not silent for longer than `--stream-idle-timeout`) and (sharded) the other
//! shards' records are followed. WatchLoadBalancers answers UNAVAILABLE
//! until the first complete view.
//!
//! **Layers** (each depends only on those above it):
//! - [`core`]: pure logic — the desired load balancer of a Service and the view it is computed
//!   from; no Kubernetes client, no gRPC server, no backend.
//! - [`k8s`]: what the controller needs of the Kubernetes API as a trait ([`k8s::Cluster`]),
//!   its implementation against the API server ([`k8s::api`]) and the record CRD ([`k8s::crd`]).
//! - [`backend`]: the [`backend::Backend`] trait, the node backend and Octavia.
//! - [`shards`]: which Services this replica serves.
//! - [`controller`]: the reconcile loop over the three above (unit-tested with an in-memory
//!   cluster and backend).
//! - the edges that drive it: [`grpc`] (the API served, and the watcher followed),
//!   [`handover`] (shards gained and lost), [`mirror`] (the other shards' records), [`ready`].

pub mod backend;
pub mod controller;
pub mod core;
pub mod grpc;
pub mod handover;
pub mod k8s;
pub mod metrics;
pub mod mirror;
pub mod ready;
pub mod shards;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;
use kuryr_proto::lbaas::v1::load_balancers_server::LoadBalancersServer;
use kuryr_proto::service_names;
use kuryr_runtime::auth::client::PeerChannel;
use kuryr_runtime::auth::{AccountRef, Rules};
use kuryr_runtime::follow::{FollowArgs, HeartbeatArgs};
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime, Services, Shutdown};
use kuryr_shard::Joining;
use kuryr_stream::{Epoch, Log};
use tokio::sync::watch;
use tracing::Instrument as _;

use crate::backend::octavia::OctaviaBackend;
use crate::backend::{Backend, LbLog, NodeBackend};
use crate::controller::Controller;
use crate::core::locked;
use crate::core::view::SharedView;
use crate::grpc::LbService;
use crate::k8s::Records;
use crate::k8s::api::Kube;
use crate::metrics::Metrics;
use crate::ready::{Condition, Readiness};
use crate::shards::Shards;

/// Deltas kept for resuming WatchLoadBalancers: a binder that reconnects within this many
/// changes gets only what it missed. A delta shares its spec with the state, so 16k cost a few MB.
pub const HISTORY: usize = kuryr_stream::log::DEFAULT_HISTORY;

/// The backends lbaas can program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The embedded node dataplane: specs streamed to every binder, programmed into nftables.
    Node,
    /// OpenStack Octavia: a load balancer per Service (the --os-cloud / --octavia-url flags).
    Octavia,
}

/// The largest request accepted: every request is a few names, ids and a resume point.
pub const MAX_REQUEST: usize = 64 * 1024;

/// Command-line configuration.
#[derive(Clone, Debug, Parser)]
#[command(name = "kuryr-lbaas", version, about = "Turns Kubernetes Services into load balancers.")]
pub struct Config {
    /// gRPC listen addresses, comma-separated or repeated: HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_LBAAS_LISTEN", value_delimiter = ',', default_value = "0.0.0.0:9620")]
    pub listen: Vec<ListenAddr>,

    /// HTTP address for Prometheus metrics (/metrics) and probes (/livez, /readyz).
    #[arg(long, env = "KURYR_LBAAS_METRICS_LISTEN", default_value = "0.0.0.0:9621")]
    pub metrics_listen: ListenAddr,

    /// The watcher to subscribe to: HOST:PORT, http://HOST:PORT, unix:/path, or
    /// k8s:[NAMESPACE/]SERVICE:PORT (the Service's ready endpoints, found through the Kubernetes
    /// API: no cluster DNS needed).
    #[arg(long, env = "KURYR_WATCHER", default_value = "127.0.0.1:9600")]
    pub watcher: String,

    /// Kubeconfig file; when unset, the in-cluster service account (or $KUBECONFIG) is used.
    #[arg(long, env = "KURYR_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// What programs the load balancers.
    #[arg(long, env = "KURYR_LBAAS_BACKEND", value_enum, default_value = "node")]
    pub backend: BackendKind,

    /// Which Services carry kuryr's finalizer (their deletion waits for the load balancer to
    /// go): `load-balancer` (type LoadBalancer only, as Kubernetes' own service controllers do;
    /// other Services are cleaned up through their ServiceLoadBalancer record), `all` (every
    /// load-balanced Service, as Kuryr did), `none`.
    #[arg(long, env = "KURYR_SERVICE_FINALIZER", value_enum, default_value = "load-balancer")]
    pub service_finalizer: controller::FinalizerPolicy,

    /// The load balancer class (`spec.loadBalancerClass`) whose `type: LoadBalancer` Services this
    /// lbaas provides load balancers for; unset: those that name no class. Services of another
    /// class get their cluster IP and node ports only (their load balancer is someone else's).
    #[arg(long, env = "KURYR_LOAD_BALANCER_CLASS")]
    pub load_balancer_class: Option<String>,

    /// Services reconciled in parallel (each Service is always reconciled by one worker at a time).
    #[arg(long, env = "KURYR_LBAAS_WORKERS", default_value_t = 8,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub workers: usize,

    /// This replica's name in Events and in the watcher's logs (the pod name in a Deployment);
    /// the host name when unset.
    #[arg(long, env = "KURYR_INSTANCE")]
    pub instance: Option<String>,

    /// The Octavia backend's settings (with --backend octavia).
    #[command(flatten)]
    pub octavia: backend::octavia::OctaviaArgs,

    /// How replicas split the Services (by `namespace/name`) between them.
    #[command(flatten)]
    pub shard: kuryr_shard::ShardArgs,

    /// The binders' ServiceAccounts (`namespace:name`, comma-separated): they alone may watch and
    /// read the load balancer specs.
    #[arg(long, env = "KURYR_BINDER_ACCOUNTS", value_delimiter = ',', default_value = "kuryr-system:kuryr-binder")]
    pub binder_accounts: Vec<AccountRef>,

    #[command(flatten)]
    pub heartbeat: HeartbeatArgs,

    #[command(flatten)]
    pub follow: FollowArgs,

    #[command(flatten)]
    pub common: CommonArgs,
}

/// Who may call what: every LoadBalancers method, the binders.
pub fn rules(config: &Config) -> Rules {
    let methods = ["WatchLoadBalancers", "GetLoadBalancer", "ListLoadBalancers"];
    Rules::new().allow(service_names::LOAD_BALANCERS, &methods, &config.binder_accounts)
}

impl Config {
    fn instance_name(&self) -> String {
        kuryr_runtime::config::instance_name(self.instance.as_deref(), "kuryr-lbaas")
    }
}

/// Runs lbaas until SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let mut rt = Runtime::gated("kuryr-lbaas", &config.common, config.kubeconfig.clone(), rules(&config))?;
    let credentials = config.common.auth.credentials();
    let watcher = kuryr_runtime::discover::peer("watcher", &config.watcher, config.kubeconfig.clone(), credentials)?;
    let metrics = Metrics::register(rt.registry());
    let (joining, ownership) = Joining::new(config.shard.resolve("kuryr-lbaas", &config.listen)?, rt.registry());
    let shards = Shards::new(ownership);
    shards.register(rt.registry());
    let log: LbLog = Log::new(Epoch::random(), HISTORY).shared();
    tracing::info!(epoch = %kuryr_stream::log::lock(&log).epoch(), backend = ?config.backend,
        workers = config.workers, "starting");
    let records = Records::default();
    let recovered = Arc::new(AtomicBool::new(false));
    let readiness = Readiness::default();
    if !joining.sharded() {
        // Every record is this replica's own: none to follow.
        readiness.set(Condition::Mirror, true);
    }
    readiness.spawn_driver(rt.health(), ready::SERVICES, rt.shutdown());
    macro_rules! start {
        ($backend:expr) => {
            tokio::spawn(
                Start {
                    config: config.clone(),
                    watcher,
                    backend: $backend,
                    log: log.clone(),
                    records: records.clone(),
                    recovered: recovered.clone(),
                    readiness,
                    metrics: metrics.clone(),
                    shards: shards.clone(),
                    joining: joining.clone(),
                }
                .run(rt.shutdown())
                .instrument(tracing::info_span!("startup")),
            )
        };
    }
    match config.backend {
        BackendKind::Node => start!(NodeBackend::new(log.clone())),
        // Configuration errors end the process here, before any port is bound.
        BackendKind::Octavia => start!(OctaviaBackend::new(&config.octavia, rt.registry(), shards.clone())?),
    };
    let service = LbService::new(log, records, recovered, metrics, rt.shutdown())
        .with_heartbeat(config.heartbeat.stream_heartbeat);
    // Requests are a few names and a resume point.
    let served = Services::default().with(LoadBalancersServer::new(service).max_decoding_message_size(MAX_REQUEST));
    let served = rt.serve(served, &config.listen, Some(&config.metrics_listen)).await;
    // The shard Leases are released at shutdown, so the other replicas take over at once.
    joining.released().await;
    served
}

/// The start-up sequence, in the background while the server already answers (NOT_SERVING).
struct Start<B> {
    config: Config,
    watcher: PeerChannel,
    backend: B,
    log: LbLog,
    records: Records,
    recovered: Arc<AtomicBool>,
    readiness: Readiness,
    metrics: Metrics,
    /// What this replica reconciles.
    shards: Shards,
    /// The shard set to join once a Kubernetes client exists (what `shards` follows).
    joining: Joining,
}

impl<B: Backend> Start<B> {
    async fn run(self, shutdown: Shutdown) {
        let Start { config, watcher, backend, log, records, recovered, readiness, metrics, shards, joining } = self;
        let kubeconfig = config.kubeconfig.clone();
        let Some(client) = kuryr_runtime::retry("building a Kubernetes client", &shutdown, || {
            kuryr_runtime::kube_client(kubeconfig.as_deref())
        })
        .await
        else {
            return;
        };
        // The first round of Leases runs while the records are loaded.
        joining.join(client.clone(), shutdown.clone());
        let instance = config.instance_name();
        let kube = Kube::new(client.clone(), Some(instance.clone()));
        // Recovery: every record, of every shard, before any reconcile; the backend gets what
        // was programmed (the node backend streams every Service, whoever owns it).
        let Some(found) = kuryr_runtime::retry("loading ServiceLoadBalancers", &shutdown, || kube.list_records()).await
        else {
            return;
        };
        let specs = found
            .iter()
            .filter(|(_, r)| r.spec.backend == backend.name())
            .map(|(k, r)| {
                let (ns, name) = core::view::split(k);
                (k.clone(), r.spec.to_spec(ns, name, r.generation))
            })
            .collect();
        backend.recover(specs);
        let n = found.len();
        locked(&records).extend(found);
        recovered.store(true, Ordering::Release);
        readiness.set(Condition::Recovered, true);
        tracing::info!(records = n, "recovered the ServiceLoadBalancer records");

        let view = SharedView::default();
        let controller = Arc::new(
            Controller::new(kube.clone(), backend, view, records, metrics.clone())
                .with_shards(shards.clone())
                .with_finalizers(config.service_finalizer)
                .with_load_balancer_class(config.load_balancer_class.clone()),
        );
        controller.spawn_workers(config.workers, shutdown.clone());
        controller.start_maintenance(shutdown.clone());
        let (synced, synced_rx) = watch::channel(false);
        let shard_follower = handover::Follower {
            shards: shards.clone(),
            controller: controller.clone(),
            kube,
            synced: synced_rx,
            kick: controller.kick(),
        };
        tokio::spawn(shard_follower.run(shutdown.clone()).instrument(tracing::info_span!("shards")));
        if shards.sharded() {
            let mirror = mirror::Mirror {
                client,
                controller: controller.clone(),
                shards,
                readiness: readiness.clone(),
                metrics: metrics.clone(),
            };
            tokio::spawn(mirror.run(shutdown.clone()).instrument(tracing::info_span!("records")));
        }
        let follower = grpc::follow::Follower {
            channel: watcher,
            controller,
            log,
            readiness,
            metrics,
            subscriber: format!("kuryr-lbaas/{instance}"),
            synced,
            follow: config.follow.config(),
        };
        follower.run(shutdown).instrument(tracing::info_span!("watcher")).await;
    }
}
