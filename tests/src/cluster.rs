//! A whole cluster of the embedded backend on one machine, as a user would deploy it, for the
//! end-to-end tests and `kuryr-lab`:
//!
//! - the real Kubernetes API ([`KubeEnv`]) with the namespace `kuryr-system`, the CRDs of
//!   `deploy/crds/` (waited for until Established) and the RBAC of `deploy/rbac/`;
//! - `kuryr-watcher` and `kuryr-vif-allocator` as host processes, each authenticated as its own
//!   ServiceAccount (so RBAC is exercised exactly as deployed), listening on 127.0.0.1 TCP and on
//!   unix sockets in the cluster's directory;
//! - an underlay (`underlay`): a private network namespace with a bridge that every node's
//!   namespace is plugged into — the network between the nodes;
//! - N nodes, each a [`Node`] (containerd in the node's own network namespace, `kuryr-cni`
//!   installed with its conflist, `kuryr-binder` in that namespace following the allocator over
//!   its unix socket), registered as a Node object (InternalIP = its underlay addresses, Ready)
//!   and run by a [`Kubelet`].
//!
//! With [`ClusterOptions::services`], Services work too: the real `kube-controller-manager`
//! running its EndpointSlice controller ([`controllers`]), `kuryr-lbaas` (node backend) under its
//! ServiceAccount following the watcher, and every node's binder given `--lbaas`, so that it
//! programs the Service dataplane (nftables table `inet kuryr`) in the node's namespace. With
//! [`ClusterOptions::policy`], NetworkPolicy too: `kuryr-policy` under its ServiceAccount following
//! the watcher, and every node's binder given `--policy`.
//!
//! [`Cluster::shutdown`] stops everything by pid in dependency order and deletes every network
//! namespace and link it made; dropping a cluster does the same, best effort. What the cluster
//! made on the host is also written down as it goes ([`Manifest`]), so that another process can
//! remove it after this one died.

pub mod checks;
pub mod controllers;
mod manifest;
pub mod preflight;
pub mod reach;
mod register;
pub mod svc;
mod underlay;

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kube::api::{Api, PostParams};
use kuryr_proto::service_names;
use kuryr_vif_allocator::k8s::crd::{PodNetwork, PodNetworkSpec};

pub use manifest::{Manifest, NodeRecord, ProcessRecord};
pub use underlay::NODE_IFNAME;

use crate::cri::{Containerd, ContainerdOptions};
use crate::kube::KubeEnv;
use crate::kubelet::{Kubelet, KubeletOptions};
use crate::node::Node;
use crate::services::{ServiceProcess, bin_path, wait_until};
use crate::util::{free_port, repo_root};
use controllers::ControllerManager;
use register::register_node;
use underlay::Underlay;

/// The namespace of Kuryr's own objects and ServiceAccounts.
pub const SYSTEM_NAMESPACE: &str = "kuryr-system";
/// The watcher's ServiceAccount (`deploy/rbac/watcher.yaml`).
pub const WATCHER_ACCOUNT: &str = "kuryr-watcher";
/// The allocator's ServiceAccount (`deploy/rbac/vif-allocator.yaml`).
pub const ALLOCATOR_ACCOUNT: &str = "kuryr-vif-allocator";
/// kuryr-lbaas's ServiceAccount (`deploy/rbac/lbaas.yaml`).
pub const LBAAS_ACCOUNT: &str = "kuryr-lbaas";
/// kuryr-policy's ServiceAccount (`deploy/rbac/policy.yaml`).
pub const POLICY_ACCOUNT: &str = "kuryr-policy";
/// The binders' ServiceAccount (`deploy/rbac/binder.yaml`).
pub const BINDER_ACCOUNT: &str = "kuryr-binder";
/// The ServiceAccount whose tokens manage the allocator's port pools (`deploy/rbac/pool-manager.yaml`).
pub const POOL_MANAGER_ACCOUNT: &str = "kuryr-pool-manager";
/// Bound on a service turning SERVING after start.
const SERVE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a service gets to drain after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// Called after each start-up step (from several tasks at once while nodes start in parallel).
pub type ProgressFn = Arc<dyn Fn(&Step<'_>) + Send + Sync>;

/// One finished start-up step.
#[derive(Debug)]
pub struct Step<'a> {
    /// What is now up, e.g. "node-1: containerd".
    pub what: &'a str,
    /// How long the step took.
    pub took: Duration,
    /// Since [`Cluster::start`] began.
    pub elapsed: Duration,
    /// Everything created so far.
    pub manifest: &'a Manifest,
}

/// How to build a cluster.
#[derive(Clone)]
pub struct ClusterOptions {
    /// Nodes to run, named `<node_prefix>-1`, `-2`, ...
    pub nodes: usize,
    /// Node name prefix.
    pub node_prefix: String,
    /// The PodNetwork the allocator serves (its `--network`).
    pub network: String,
    /// The PodNetwork's CIDRs (one IPv4 and optionally one IPv6); created before the allocator
    /// starts, and passed as `--network-cidrs` too.
    pub network_cidrs: Vec<String>,
    /// The underlay subnets are `172.30.<id>.0/24` and `fd00:172:30:<id>::/64`.
    pub underlay_id: u8,
    /// Run a [`Kubelet`] per node.
    pub kubelet: bool,
    /// Let the kubelets run the pods' containers too (see [`KubeletOptions::containers`]).
    pub run_containers: bool,
    /// Services: kube-controller-manager (EndpointSlices), kuryr-lbaas, and `--lbaas` for the
    /// binders.
    pub services: bool,
    /// Deployments (with `services`): kube-controller-manager runs the deployment and
    /// replicaset controllers too. There is no scheduler: a Deployment's template names its node.
    pub workloads: bool,
    /// NetworkPolicy: kuryr-policy, and `--policy` for the binders.
    pub policy: bool,
    /// The PodNetwork's IPv4 block prefix (the allocator's default when unset); small blocks
    /// make a released address come back after a few pods.
    pub ipv4_block_prefix: Option<u8>,
    /// `--log` of the services.
    pub service_log: String,
    /// More flags for kuryr-watcher, kuryr-vif-allocator, kuryr-lbaas and kuryr-policy (flags they all take;
    /// stream timing goes in `stream_timing`).
    pub service_args: Vec<String>,
    /// More flags for every node's kuryr-binder.
    pub binder_args: Vec<String>,
    /// Start-up progress reports.
    pub progress: Option<ProgressFn>,
    /// The services' `--stream-heartbeat` and their followers' (the binders' too)
    /// `--stream-idle-timeout`; their defaults when `None`.
    pub stream_timing: Option<StreamTiming>,
    /// Replicas of kuryr-vif-allocator and (with `services`) kuryr-lbaas. With more than one,
    /// the replicas split their shards through Leases (4 s), and every node reaches them as a
    /// pod would: a forwarder in the node's namespace per allocator replica at the endpoint it
    /// advertises (its TCP address), and one per service at a Service-like address that reaches
    /// any replica (the binder's `--allocator` and `--lbaas`).
    pub replicas: usize,
}

/// How often the services' streams carry heartbeats, and how long their readers wait for one.
#[derive(Clone, Debug)]
pub struct StreamTiming {
    /// `--stream-heartbeat` of kuryr-watcher, kuryr-vif-allocator, kuryr-lbaas and kuryr-policy.
    pub heartbeat: String,
    /// `--stream-idle-timeout` of kuryr-vif-allocator, kuryr-lbaas, kuryr-policy and the binders.
    pub idle_timeout: String,
}

impl StreamTiming {
    fn heartbeat_args(timing: Option<&Self>) -> Vec<String> {
        timing.map(|t| vec!["--stream-heartbeat".to_string(), t.heartbeat.clone()]).unwrap_or_default()
    }

    fn idle_args(timing: Option<&Self>) -> Vec<String> {
        timing.map(|t| vec!["--stream-idle-timeout".to_string(), t.idle_timeout.clone()]).unwrap_or_default()
    }
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            nodes: 2,
            node_prefix: "node".into(),
            network: "default".into(),
            network_cidrs: vec!["10.244.0.0/16".into(), "fd00:10:244::/56".into()],
            underlay_id: u8::try_from(std::process::id() % 200 + 20).unwrap_or(20),
            kubelet: true,
            run_containers: false,
            services: false,
            workloads: false,
            policy: false,
            ipv4_block_prefix: None,
            service_log: "info".into(),
            service_args: Vec::new(),
            binder_args: Vec::new(),
            progress: None,
            stream_timing: None,
            replicas: 1,
        }
    }
}

impl fmt::Debug for ClusterOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterOptions")
            .field("nodes", &self.nodes)
            .field("network", &self.network)
            .field("network_cidrs", &self.network_cidrs)
            .field("underlay_id", &self.underlay_id)
            .field("kubelet", &self.kubelet)
            .field("run_containers", &self.run_containers)
            .field("services", &self.services)
            .field("workloads", &self.workloads)
            .field("stream_timing", &self.stream_timing)
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}

/// A service process with its addresses.
#[derive(Debug)]
pub struct Service {
    /// `127.0.0.1:<port>`.
    pub tcp: String,
    /// Its unix socket.
    pub socket: PathBuf,
    /// `127.0.0.1:<port>` of /metrics, /livez, /readyz.
    pub metrics: String,
    process: ServiceProcess,
    /// How it was started, to start it again after a crash ([`Cluster::restart_service`]).
    launch: Launch,
    /// What the processes it ran before a restart logged.
    earlier_logs: String,
}

/// A service's command line and where it logs.
#[derive(Debug, Clone)]
struct Launch {
    bin: String,
    args: Vec<String>,
    dir: PathBuf,
    /// The gRPC service whose health says it is up.
    service: String,
}

impl Service {
    /// The unix socket as a gRPC target (`unix:/path`).
    pub fn unix_target(&self) -> String {
        format!("unix:{}", self.socket.display())
    }

    /// What the service logged (across restarts).
    pub fn logs(&self) -> String {
        format!("{}{}", self.earlier_logs, self.process.logs())
    }

    /// Its pid.
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }
}

/// One node of the cluster.
#[derive(Debug)]
pub struct ClusterNode {
    /// The Node object's name.
    pub name: String,
    /// Its underlay addresses (IPv4, IPv6), also its InternalIPs.
    pub ips: Vec<IpAddr>,
    /// containerd + kuryr-cni + kuryr-binder.
    pub node: Node,
}

/// A running cluster. Fields drop in declaration order: kubelets first, the API server last.
pub struct Cluster {
    kubelets: Vec<Kubelet>,
    nodes: Vec<ClusterNode>,
    lbaas: Option<Service>,
    policy: Option<Service>,
    allocator: Service,
    /// Replicas after the first ([`ClusterOptions::replicas`]).
    more_allocators: Vec<Service>,
    more_lbaas: Vec<Service>,
    /// The nodes' forwarders to the replicas.
    forwarders: Vec<crate::forward::UnixForwarder>,
    watcher: Service,
    controller_manager: Option<ControllerManager>,
    underlay: Underlay,
    client: kube::Client,
    manifest: Manifest,
    network: String,
    started_in: Duration,
    dir: tempfile::TempDir,
    kube: KubeEnv,
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster")
            .field("nodes", &self.nodes)
            .field("watcher", &self.watcher)
            .field("allocator", &self.allocator)
            .field("lbaas", &self.lbaas)
            .field("policy", &self.policy)
            .field("controller_manager", &self.controller_manager)
            .field("underlay", &self.underlay)
            .field("kube", &self.kube)
            .finish_non_exhaustive()
    }
}

/// Shared while starting: what has been made so far, and the progress callback.
struct Progress {
    t0: Instant,
    manifest: Mutex<Manifest>,
    report: Option<ProgressFn>,
}

impl Progress {
    fn record(&self, f: impl FnOnce(&mut Manifest)) {
        f(&mut self.manifest.lock().unwrap_or_else(PoisonError::into_inner));
    }

    fn step(&self, what: &str, since: Instant) {
        if let Some(report) = &self.report {
            let manifest = self.manifest.lock().unwrap_or_else(PoisonError::into_inner).clone();
            report(&Step { what, took: since.elapsed(), elapsed: self.t0.elapsed(), manifest: &manifest });
        }
    }
}

impl Cluster {
    /// Brings the whole cluster up; see the module documentation for what that is.
    pub async fn start(opts: ClusterOptions) -> Result<Cluster> {
        let progress = Progress {
            t0: Instant::now(),
            manifest: Mutex::new(Manifest { owner_pid: std::process::id(), ..Manifest::default() }),
            report: opts.progress.clone(),
        };
        let dir = tempfile::Builder::new().prefix("kuryr-cluster-").tempdir_in("/tmp")?;
        progress.record(|m| m.dir = Some(dir.path().to_path_buf()));

        let t = Instant::now();
        let kube = KubeEnv::start().await?;
        progress.record(|m| m.kube_state_dir = Some(kube.state_dir().to_path_buf()));
        progress.step(&format!("Kubernetes API server at {}", kube.apiserver_url()), t);

        let t = Instant::now();
        let client = kube.client().await?;
        install_manifests(&kube).await?;
        progress.step("namespace kuryr-system, CRDs (Established), RBAC", t);

        let controller_manager = if opts.services {
            let t = Instant::now();
            let controllers = if opts.workloads { controllers::WORKLOAD_CONTROLLERS } else { controllers::CONTROLLERS };
            let kcm = ControllerManager::start_with(&kube, dir.path(), controllers).await?;
            if let Some(pid) = kcm.pid() {
                let exe = kcm.exe().to_path_buf();
                progress.record(|m| m.processes.push(ProcessRecord { name: controllers::BINARY.into(), pid, exe }));
            }
            progress.step(&format!("kube-controller-manager ({controllers}) healthy"), t);
            Some(kcm)
        } else {
            None
        };

        let t = Instant::now();
        let networks: Api<PodNetwork> = Api::all(client.clone());
        let mut spec = PodNetworkSpec::new(opts.network_cidrs.clone());
        if let Some(prefix) = opts.ipv4_block_prefix {
            spec.ipv4_block_prefix = prefix;
        }
        let network = PodNetwork::new(&opts.network, spec);
        networks.create(&PostParams::default(), &network).await.context("creating the PodNetwork")?;
        progress.step(&format!("PodNetwork {} ({})", opts.network, opts.network_cidrs.join(", ")), t);

        let t = Instant::now();
        let watcher_config = kube.service_account_kubeconfig(SYSTEM_NAMESPACE, WATCHER_ACCOUNT).await?;
        let timing = opts.stream_timing.as_ref();
        let mut watcher_args = vec!["--kubeconfig".into(), watcher_config.display().to_string()];
        watcher_args.extend(StreamTiming::heartbeat_args(timing));
        let watcher = start_service(
            "kuryr-watcher",
            dir.path(),
            &[&watcher_args[..], &opts.service_args].concat(),
            &opts.service_log,
            service_names::WATCHER,
            &progress,
            0,
        )
        .await?;
        progress.step(&format!("kuryr-watcher serving on {} and {}", watcher.tcp, watcher.socket.display()), t);

        let t = Instant::now();
        let allocator_config = kube.service_account_kubeconfig(SYSTEM_NAMESPACE, ALLOCATOR_ACCOUNT).await?;
        let mut allocator_args = vec![
            "--kubeconfig".into(),
            allocator_config.display().to_string(),
            "--watcher".into(),
            watcher.unix_target(),
            "--network".into(),
            opts.network.clone(),
            "--network-cidrs".into(),
            opts.network_cidrs.join(","),
            // As a pod name would be: a restart is the same replica, and takes its shard Leases
            // back at once instead of waiting for them to expire.
            "--replica-id".into(),
            "kuryr-vif-allocator-0".into(),
        ];
        allocator_args.extend(StreamTiming::heartbeat_args(timing));
        allocator_args.extend(StreamTiming::idle_args(timing));
        allocator_args
            .extend(opts.ipv4_block_prefix.iter().flat_map(|p| ["--ipv4-block-prefix".to_string(), p.to_string()]));
        let replicated = opts.replicas > 1;
        if replicated {
            allocator_args.extend(["--lease-duration".to_string(), "4s".to_string()]);
        }
        let mut allocators = Vec::new();
        for i in 0..opts.replicas.max(1) {
            let mut args = allocator_args.clone();
            if let Some(id) = args.iter_mut().find(|a| a.as_str() == "kuryr-vif-allocator-0") {
                *id = format!("kuryr-vif-allocator-{i}");
            }
            allocators.push(
                start_service(
                    "kuryr-vif-allocator",
                    dir.path(),
                    &[&args[..], &opts.service_args].concat(),
                    &opts.service_log,
                    service_names::VIF_ALLOCATOR,
                    &progress,
                    i,
                )
                .await?,
            );
        }
        let allocator = allocators.remove(0);
        progress
            .step(&format!("kuryr-vif-allocator serving on {} and {}", allocator.tcp, allocator.socket.display()), t);

        let mut more_lbaas = Vec::new();
        let lbaas = if opts.services {
            let t = Instant::now();
            let lbaas_config = kube.service_account_kubeconfig(SYSTEM_NAMESPACE, LBAAS_ACCOUNT).await?;
            let mut lbaas_args = vec![
                "--kubeconfig".into(),
                lbaas_config.display().to_string(),
                "--watcher".into(),
                watcher.unix_target(),
                "--backend".into(),
                "node".into(),
                // As a pod name would be: a restart is the same replica and takes its shard
                // Leases back at once instead of waiting for them to expire.
                "--replica-id".into(),
                "kuryr-lbaas-0".into(),
            ];
            lbaas_args.extend(StreamTiming::heartbeat_args(timing));
            lbaas_args.extend(StreamTiming::idle_args(timing));
            if replicated {
                lbaas_args.extend(["--lease-duration".to_string(), "4s".to_string()]);
            }
            let mut replicas = Vec::new();
            for i in 0..opts.replicas.max(1) {
                let mut args = lbaas_args.clone();
                if let Some(id) = args.iter_mut().find(|a| a.as_str() == "kuryr-lbaas-0") {
                    *id = format!("kuryr-lbaas-{i}");
                }
                replicas.push(
                    start_service(
                        "kuryr-lbaas",
                        dir.path(),
                        &[&args[..], &opts.service_args].concat(),
                        &opts.service_log,
                        service_names::LOAD_BALANCERS,
                        &progress,
                        i,
                    )
                    .await?,
                );
            }
            let lbaas = replicas.remove(0);
            more_lbaas = replicas;
            progress.step(&format!("kuryr-lbaas serving on {} and {}", lbaas.tcp, lbaas.socket.display()), t);
            Some(lbaas)
        } else {
            None
        };

        let policy = if opts.policy {
            let t = Instant::now();
            let policy_config = kube.service_account_kubeconfig(SYSTEM_NAMESPACE, POLICY_ACCOUNT).await?;
            let mut policy_args = vec![
                "--kubeconfig".into(),
                policy_config.display().to_string(),
                "--watcher".into(),
                watcher.unix_target(),
                "--instance".into(),
                "kuryr-policy-0".into(),
                // As a pod name would be: a restart is the same replica and takes its shard
                // Leases back at once instead of waiting for them to expire.
                "--replica-id".into(),
                "kuryr-policy-0".into(),
            ];
            policy_args.extend(StreamTiming::heartbeat_args(timing));
            policy_args.extend(StreamTiming::idle_args(timing));
            let policy = start_service(
                "kuryr-policy",
                dir.path(),
                &[&policy_args[..], &opts.service_args].concat(),
                &opts.service_log,
                service_names::POLICIES,
                &progress,
                0,
            )
            .await?;
            progress.step(&format!("kuryr-policy serving on {} and {}", policy.tcp, policy.socket.display()), t);
            Some(policy)
        } else {
            None
        };

        let t = Instant::now();
        let underlay = Underlay::new(opts.underlay_id)?;
        progress.record(|m| m.underlay_netns = Some(underlay.netns_name().to_string()));
        progress.step(&format!("underlay network namespace {} (bridge)", underlay.netns_name()), t);

        let all_allocators: Vec<&Service> = [&allocator].into_iter().chain(&allocators).collect();
        let all_lbaas: Vec<&Service> = lbaas.iter().chain(&more_lbaas).collect();
        let vips = (free_port()?, free_port()?);
        let starts = (0..opts.nodes).map(|i| {
            let name = format!("{}-{}", opts.node_prefix, i + 1);
            let upstream = Upstream {
                allocators: &all_allocators,
                lbaas: &all_lbaas,
                policy: policy.as_ref(),
                vips: replicated.then_some(vips),
            };
            start_node(name, i, &kube, &client, &underlay, upstream, &opts, &progress)
        });
        let started: Vec<(ClusterNode, Vec<crate::forward::UnixForwarder>)> =
            futures::future::try_join_all(starts).await?;
        let mut forwarders = Vec::new();
        let mut nodes = Vec::new();
        for (n, f) in started {
            nodes.push(n);
            forwarders.extend(f);
        }

        let kubelets = if opts.kubelet {
            nodes
                .iter()
                .map(|n| {
                    let containers = opts.run_containers.then(|| n.node.ctd.env().get("BUSYBOX_IMAGE").cloned());
                    Kubelet::start(
                        client.clone(),
                        n.node.ctd.cri().clone(),
                        KubeletOptions {
                            node_name: n.name.clone(),
                            host_ips: n.ips.clone(),
                            containers: containers.flatten(),
                        },
                    )
                })
                .collect()
        } else {
            Vec::new()
        };
        let manifest = progress.manifest.lock().unwrap_or_else(PoisonError::into_inner).clone();
        Ok(Cluster {
            kubelets,
            nodes,
            lbaas,
            policy,
            allocator,
            more_allocators: allocators,
            more_lbaas,
            forwarders,
            watcher,
            controller_manager,
            underlay,
            client,
            manifest,
            network: opts.network,
            started_in: progress.t0.elapsed(),
            dir,
            kube,
        })
    }

    /// The API server environment (admin kubeconfig, kubectl).
    pub fn kube(&self) -> &KubeEnv {
        &self.kube
    }

    /// An admin client.
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The admin kubeconfig.
    pub fn kubeconfig(&self) -> &Path {
        self.kube.kubeconfig_path()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[ClusterNode] {
        &self.nodes
    }

    /// The node named `name`.
    pub fn node(&self, name: &str) -> Option<&ClusterNode> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The node named `name`, to stop or restart its binder.
    pub fn node_mut(&mut self, name: &str) -> Option<&mut ClusterNode> {
        self.nodes.iter_mut().find(|n| n.name == name)
    }

    /// The kubelets (one per node, same order; empty without [`ClusterOptions::kubelet`]).
    pub fn kubelets(&self) -> &[Kubelet] {
        &self.kubelets
    }

    /// The watcher.
    pub fn watcher(&self) -> &Service {
        &self.watcher
    }

    /// The allocator.
    pub fn allocator(&self) -> &Service {
        &self.allocator
    }

    /// kuryr-lbaas (with [`ClusterOptions::services`]).
    pub fn lbaas(&self) -> Option<&Service> {
        self.lbaas.as_ref()
    }

    /// kuryr-policy (with [`ClusterOptions::policy`]).
    pub fn policy(&self) -> Option<&Service> {
        self.policy.as_ref()
    }

    /// kube-controller-manager (with [`ClusterOptions::services`]).
    pub fn controller_manager(&self) -> Option<&ControllerManager> {
        self.controller_manager.as_ref()
    }

    /// The PodNetwork's name.
    pub fn network(&self) -> &str {
        &self.network
    }

    /// The underlay's network namespace.
    pub fn underlay_netns(&self) -> &str {
        self.underlay.netns_name()
    }

    /// The cluster's directory (service sockets and logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What the cluster made on the host.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// How long [`Cluster::start`] took.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// Every service's log, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = format!(
            "==== kuryr-watcher\n{}\n==== kuryr-vif-allocator\n{}\n",
            self.watcher.logs(),
            self.allocator.logs()
        );
        for (i, a) in self.more_allocators.iter().enumerate() {
            out.push_str(&format!("==== kuryr-vif-allocator replica {}\n{}\n", i + 1, a.logs()));
        }
        if let Some(l) = &self.lbaas {
            out.push_str(&format!("==== kuryr-lbaas\n{}\n", l.logs()));
        }
        for (i, l) in self.more_lbaas.iter().enumerate() {
            out.push_str(&format!("==== kuryr-lbaas replica {}\n{}\n", i + 1, l.logs()));
        }
        if let Some(p) = &self.policy {
            out.push_str(&format!("==== kuryr-policy\n{}\n", p.logs()));
        }
        for n in &self.nodes {
            out.push_str(&format!("==== kuryr-binder {}\n{}\n", n.name, n.node.binder_logs()));
        }
        out
    }

    /// What to print when a scenario failed: every service's log, the last lines of
    /// kube-controller-manager's (when it runs) and each node's nftables table `inet kuryr`.
    pub async fn diagnostics(&self) -> String {
        let mut out = self.logs();
        if let Some(kcm) = self.controller_manager() {
            let logs = kcm.logs();
            let tail: Vec<&str> = logs.lines().rev().take(80).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            out.push_str(&format!("==== kube-controller-manager (last lines)\n{}\n", tail.join("\n")));
        }
        for n in &self.nodes {
            out.push_str(&format!("==== table inet kuryr on {}\n{}\n", n.name, svc::nft_table(n).await));
        }
        out
    }

    /// Stops everything in dependency order — kubelets; each node (sandboxes removed through CRI
    /// while its binder still answers, then the binder, then containerd and the node's
    /// namespace); the allocator; the watcher; the underlay namespace; the API server — and
    /// returns how long it took. Every step runs even if one fails; the errors are combined.
    pub async fn shutdown(self) -> Result<Duration> {
        let t = Instant::now();
        let Cluster {
            kubelets,
            nodes,
            lbaas,
            policy,
            allocator,
            more_allocators,
            more_lbaas,
            forwarders,
            watcher,
            controller_manager,
            underlay,
            dir,
            kube,
            ..
        } = self;
        drop(kubelets);
        let mut errors = Vec::new();
        let results = futures::future::join_all(nodes.into_iter().map(|n| async move {
            let name = n.name.clone();
            n.node.shutdown().await.with_context(|| format!("stopping node {name}"))
        }))
        .await;
        errors.extend(results.into_iter().filter_map(Result::err));
        drop(forwarders);
        for s in lbaas.into_iter().chain(more_lbaas).chain(policy).chain(more_allocators).chain([allocator, watcher]) {
            let mut s = s;
            if let Err(e) = s.process.terminate(STOP_TIMEOUT).await {
                errors.push(e);
            }
        }
        if let Some(mut kcm) = controller_manager
            && let Err(e) = kcm.stop(STOP_TIMEOUT).await
        {
            errors.push(e);
        }
        drop(underlay);
        drop(kube);
        if std::env::var_os("KURYR_KEEP_STATE").is_some_and(|v| v == "1") {
            eprintln!("KURYR_KEEP_STATE=1: keeping {}", dir.keep().display());
        } else if let Err(e) = dir.close() {
            errors.push(anyhow::Error::new(e).context("removing the cluster directory"));
        }
        match errors.len() {
            0 => Ok(t.elapsed()),
            _ => Err(anyhow::anyhow!(
                "shutting the cluster down: {}",
                errors.iter().map(|e| format!("{e:#}")).collect::<Vec<_>>().join("; ")
            )),
        }
    }
}

/// The cluster-wide services, for fault injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServiceKind {
    /// `kuryr-watcher`.
    Watcher,
    /// `kuryr-vif-allocator`.
    Allocator,
    /// `kuryr-lbaas` (with [`ClusterOptions::services`]).
    Lbaas,
    /// `kuryr-policy` (with [`ClusterOptions::policy`]).
    Policy,
    /// The second replica of `kuryr-vif-allocator` (with [`ClusterOptions::replicas`] > 1).
    SecondAllocator,
    /// The second replica of `kuryr-lbaas`.
    SecondLbaas,
}

impl Cluster {
    fn service_mut(&mut self, kind: ServiceKind) -> Result<&mut Service> {
        match kind {
            ServiceKind::Watcher => Ok(&mut self.watcher),
            ServiceKind::Allocator => Ok(&mut self.allocator),
            ServiceKind::Lbaas => self.lbaas.as_mut().context("this cluster runs no kuryr-lbaas (services: false)"),
            ServiceKind::Policy => self.policy.as_mut().context("this cluster runs no kuryr-policy (policy: false)"),
            ServiceKind::SecondAllocator => {
                self.more_allocators.first_mut().context("this cluster runs one kuryr-vif-allocator (replicas: 1)")
            }
            ServiceKind::SecondLbaas => self
                .more_lbaas
                .first_mut()
                .context("this cluster runs one kuryr-lbaas (replicas: 1, or services: false)"),
        }
    }

    /// Kills a service with SIGKILL, as a crash or an OOM kill would: no drain, no cleanup.
    pub async fn kill_service(&mut self, kind: ServiceKind) -> Result<()> {
        self.service_mut(kind)?.process.kill().await
    }

    /// Freezes a service with SIGSTOP: its sockets stay open and the kernel still accepts and
    /// acknowledges, but nothing answers — as a silent partition looks from the other side.
    /// [`Cluster::continue_service`] thaws it.
    pub async fn stop_service(&mut self, kind: ServiceKind) -> Result<()> {
        let pid = self.service_mut(kind)?.pid().context("the service is not running")?;
        signal(pid, "STOP")
    }

    /// Thaws a service frozen by [`Cluster::stop_service`] (SIGCONT).
    pub async fn continue_service(&mut self, kind: ServiceKind) -> Result<()> {
        let pid = self.service_mut(kind)?.pid().context("the service is not running")?;
        signal(pid, "CONT")
    }

    /// Starts a service again with the command line it had (same addresses, same unix socket,
    /// left stale by a crash) and waits until it serves its API; its new pid joins the manifest.
    /// A service still running is killed first.
    pub async fn restart_service(&mut self, kind: ServiceKind) -> Result<()> {
        let s = self.service_mut(kind)?;
        s.process.kill().await?;
        s.earlier_logs.push_str(&format!("{}---- restarted ----\n", s.process.logs()));
        let Launch { bin, args, dir, service } = s.launch.clone();
        s.process = ServiceProcess::spawn(&bin, &args, &dir)?;
        let pid = s.process.pid();
        let channel = kuryr_runtime::client::channel(&s.tcp)?;
        let s = &*s;
        wait_until(&format!("{bin} to serve {service} again"), SERVE_TIMEOUT, || {
            kuryr_runtime::client::check_serving(channel.clone(), &service)
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\n---- {bin} log ----\n{}", s.logs()))?;
        if let Some(pid) = pid {
            self.manifest.processes.push(ProcessRecord { name: bin.clone(), pid, exe: bin_path(&bin)? });
        }
        Ok(())
    }
}

/// Sends `SIG<name>` to `pid`.
pub fn signal(pid: u32, name: &str) -> Result<()> {
    let status = std::process::Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).status()?;
    anyhow::ensure!(status.success(), "kill -{name} {pid} failed");
    Ok(())
}

/// The namespace, the CRDs (until Established) and the RBAC manifests.
async fn install_manifests(kube: &KubeEnv) -> Result<()> {
    let deploy = repo_root().join("deploy");
    kube.apply_yaml(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {SYSTEM_NAMESPACE}\n  labels:\n    app.kubernetes.io/part-of: kuryr\n"
    ))
    .await?;
    // Both directories are kustomizations (their kustomization.yaml lists the manifests).
    let (crds, rbac) = (deploy.join("crds"), deploy.join("rbac"));
    let (crds, rbac) = (crds.to_str().context("path is not UTF-8")?, rbac.to_str().context("path is not UTF-8")?);
    kube.kubectl(&["apply", "-k", crds]).await?;
    // The CRDs the kustomization renders, waited for by name.
    let rendered = kube.kubectl(&["kustomize", crds]).await?;
    let crd_names: Vec<String> = rendered
        .split("\n---")
        .filter(|doc| doc.contains("kind: CustomResourceDefinition"))
        .filter_map(|doc| {
            let meta = doc.split("\nmetadata:").nth(1)?;
            meta.lines().find_map(|l| l.strip_prefix("  name: ")).map(|n| format!("crd/{}", n.trim()))
        })
        .collect();
    anyhow::ensure!(!crd_names.is_empty(), "{crds} renders no CustomResourceDefinition");
    let mut wait = vec!["wait", "--for=condition=Established", "--timeout=60s"];
    wait.extend(crd_names.iter().map(String::as_str));
    kube.kubectl(&wait).await?;
    kube.kubectl(&["apply", "-k", rbac]).await?;
    Ok(())
}

/// Starts a service on a free loopback port and a unix socket in `dir`; waits until `service`
/// is SERVING on its health endpoint.
async fn start_service(
    bin: &str,
    dir: &Path,
    args: &[String],
    log: &str,
    service: &str,
    progress: &Progress,
    replica: usize,
) -> Result<Service> {
    let short = bin.trim_start_matches("kuryr-").trim_start_matches("vif-");
    let socket = match replica {
        0 => dir.join(format!("{short}.sock")),
        i => dir.join(format!("{short}-{i}.sock")),
    };
    let (port, mport) = (free_port()?, free_port()?);
    let tcp = format!("127.0.0.1:{port}");
    let metrics = format!("127.0.0.1:{mport}");
    let mut all = vec![
        "--listen".to_string(),
        format!("{tcp},unix:{}", socket.display()),
        "--metrics-listen".into(),
        metrics.clone(),
        "--log".into(),
        log.into(),
        "--shutdown-grace".into(),
        "5s".into(),
    ];
    all.extend(args.iter().cloned());
    let process = ServiceProcess::spawn(bin, &all, dir)?;
    if let Some(pid) = process.pid() {
        let exe = bin_path(bin)?;
        progress.record(|m| m.processes.push(ProcessRecord { name: bin.into(), pid, exe }));
    }
    let launch = Launch { bin: bin.into(), args: all.clone(), dir: dir.to_path_buf(), service: service.into() };
    let s = Service { tcp, socket, metrics, process, launch, earlier_logs: String::new() };
    let channel = kuryr_runtime::client::channel(&s.tcp)?;
    wait_until(&format!("{bin} to serve {service}"), SERVE_TIMEOUT, || {
        kuryr_runtime::client::check_serving(channel.clone(), service)
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e:#}\n---- {bin} log ----\n{}", s.logs()))?;
    Ok(s)
}

/// The services a node's binder follows.
#[derive(Clone, Copy)]
struct Upstream<'a> {
    /// Every replica, the first first.
    allocators: &'a [&'a Service],
    lbaas: &'a [&'a Service],
    policy: Option<&'a Service>,
    /// With replicas: the node-local ports that reach any allocator / lbaas replica.
    vips: Option<(u16, u16)>,
}

/// One node: containerd in a fresh namespace, plugged into the underlay, registered in the API,
/// then the shim, its conflist and the binder.
#[allow(clippy::too_many_arguments)]
async fn start_node(
    name: String,
    index: usize,
    kube: &KubeEnv,
    client: &kube::Client,
    underlay: &Underlay,
    Upstream { allocators, lbaas, policy, vips }: Upstream<'_>,
    opts: &ClusterOptions,
    progress: &Progress,
) -> Result<(ClusterNode, Vec<crate::forward::UnixForwarder>)> {
    let t = Instant::now();
    let ctd = Containerd::start(ContainerdOptions::default()).await.with_context(|| format!("{name}: containerd"))?;
    progress.record(|m| {
        let r = m.node_mut(&name);
        r.netns = Some(ctd.netns().to_string());
        r.containerd_dir = Some(ctd.scratch_dir().to_path_buf());
    });
    let ips = underlay.attach(index, &ctd.netns_path()).await.with_context(|| format!("{name}: underlay"))?;
    progress.step(&format!("{name}: containerd in netns {}, {NODE_IFNAME} {}", ctd.netns(), join(&ips)), t);

    let t = Instant::now();
    register_node(client, &name, &ips).await.with_context(|| format!("{name}: registering the Node"))?;
    progress.step(&format!("{name}: Node object registered (Ready, InternalIP {})", join(&ips)), t);

    let t = Instant::now();
    // The binder authenticates to the allocator and lbaas as its ServiceAccount, with a token
    // bound to its Node (a DaemonSet pod's projected token names its node the same way).
    let token = kube.kuryr_token_file(SYSTEM_NAMESPACE, BINDER_ACCOUNT, Some(&name)).await?;
    let mut binder_args =
        vec!["--log".to_string(), opts.service_log.clone(), "--auth-token-file".into(), token.display().to_string()];
    binder_args.extend(StreamTiming::idle_args(opts.stream_timing.as_ref()));
    binder_args.extend(opts.binder_args.iter().cloned());
    let mut forwarders = Vec::new();
    let (allocator_target, lbaas_target) = match vips {
        None => (allocators[0].unix_target(), lbaas.first().map(|l| l.unix_target())),
        Some((allocator_vip, lbaas_vip)) => {
            let netns = ctd.netns_path();
            crate::node::netns_exec(&netns, &["ip", "link", "set", "lo", "up"]).await?;
            // Each allocator replica at the endpoint it advertises (its TCP address), for the
            // redirects to a node's shard owner; and either service's replicas behind one port.
            for a in allocators {
                let port: u16 = a.tcp.rsplit(':').next().unwrap_or_default().parse()?;
                forwarders.push(crate::forward::UnixForwarder::start(&netns, port, vec![a.socket.clone()]).await?);
            }
            let sockets = allocators.iter().map(|a| a.socket.clone()).collect();
            forwarders.push(crate::forward::UnixForwarder::start(&netns, allocator_vip, sockets).await?);
            let lbaas_target = if lbaas.is_empty() {
                None
            } else {
                let sockets = lbaas.iter().map(|l| l.socket.clone()).collect();
                forwarders.push(crate::forward::UnixForwarder::start(&netns, lbaas_vip, sockets).await?);
                Some(format!("127.0.0.1:{lbaas_vip}"))
            };
            (format!("127.0.0.1:{allocator_vip}"), lbaas_target)
        }
    };
    if let Some(lbaas) = lbaas_target {
        binder_args.extend(["--lbaas".to_string(), lbaas]);
    }
    if let Some(policy) = policy {
        binder_args.extend(["--policy".to_string(), policy.unix_target()]);
    }
    let node = Node::with_containerd(ctd, &name, &allocator_target, &binder_args)
        .await
        .with_context(|| format!("{name}: kuryr-binder"))?;
    progress.record(|m| {
        if let (Some(pid), Ok(exe)) = (node.binder.pid(), bin_path("kuryr-binder")) {
            m.processes.push(ProcessRecord { name: format!("kuryr-binder {name}"), pid, exe });
        }
        m.node_mut(&name).binder_dir = node.binder.state_dir.parent().map(Path::to_path_buf);
    });
    progress.step(&format!("{name}: kuryr-binder serving on {}, CRI NetworkReady", node.binder.socket.display()), t);
    Ok((ClusterNode { name, ips, node }, forwarders))
}

fn join(ips: &[IpAddr]) -> String {
    ips.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// The frame of the end-to-end suites: starts a cluster with `opts`, runs `scenario` on it,
/// prints [`Cluster::diagnostics`] when it fails, shuts the cluster down and fails on anything of
/// it left on the host (processes, namespaces, mounts, links). `name` labels the messages.
pub async fn run_scenario(
    name: &str,
    opts: ClusterOptions,
    scenario: impl AsyncFnOnce(&mut Cluster) -> Result<()>,
) -> Result<()> {
    let t = Instant::now();
    let mut cluster = Cluster::start(opts).await.context("starting the cluster")?;
    eprintln!("{name}: cluster up in {:?}", cluster.started_in());
    let outcome = scenario(&mut cluster).await;
    if outcome.is_err() {
        eprintln!("{}", cluster.diagnostics().await);
    }
    let manifest = cluster.manifest().clone();
    let shutdown = cluster.shutdown().await;
    outcome.with_context(|| name.to_string())?;
    let took = shutdown.context("shutting the cluster down")?;
    let left = manifest.leftovers();
    anyhow::ensure!(left.is_empty(), "left behind after shutdown: {left:?}");
    eprintln!("{name}: cluster down in {took:?}; {:?} in all", t.elapsed());
    Ok(())
}
