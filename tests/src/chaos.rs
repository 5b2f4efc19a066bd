//! Chaos on a whole embedded cluster ([`Cluster`], the harness of the end-to-end suites): pods
//! created and deleted continuously (a bounded live set, some of them the endpoints of a few
//! Services, so endpoints keep changing) while a fault is injected every few seconds, chosen at
//! random:
//!
//! - kill -9 of kuryr-watcher, of either of the two replicas of kuryr-vif-allocator and of
//!   kuryr-lbaas (sharded through Leases), or of a node's kuryr-binder, each started again after
//!   a short outage;
//! - the same while pods are being deleted (the binder during their CNI DEL, the allocator while
//!   it releases their VIFs);
//! - SIGSTOP/SIGCONT of kuryr-watcher, kuryr-vif-allocator or kuryr-lbaas (a silent partition);
//! - the Kubernetes API server stalled (SIGSTOP/SIGCONT).
//!
//! Between faults, every few seconds, the records are checked ([`invariants`]; a problem counts
//! once it has lasted over a grace period, so work in flight is not flagged). After the last
//! fault the cluster gets a quiet period to converge, then the invariants are checked once more: every live pod has exactly one VIF and is reachable from a pod on
//! every node, nothing is leaked or held twice, every Service answers from every node with
//! exactly its ready endpoints, nothing of a deleted pod is left on a node. [`Outcome::last_line`]
//! is the verdict line of `make chaos`.

pub mod invariants;
pub mod neutron;
pub mod octavia;
pub mod policy;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{Pod, PodTemplateSpec, Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kuryr_vif_allocator::k8s::crd::{AddressBlock, PodVif};

use crate::cluster::checks::{self, RunningPod};
use crate::cluster::{Cluster, ClusterOptions, ServiceKind, StreamTiming, reach, svc};
use crate::echo::{self, Proto};
use crate::kubelet::PodPhase;
use crate::metrics::Scrape;
use invariants::{Allocation, Findings, Kind, Lasting, LivePod, NodeHeld, Snapshot, VifRecord};

/// The namespace of the churned pods and Services.
pub const NAMESPACE: &str = "chaos";
/// The Services' port, and their backends' (where the checks start echo servers).
const SERVICE_PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
/// Pings in flight at once during the final check.
const PINGS_AT_ONCE: usize = 12;
/// How often the records are checked during the run, and how long a problem found then may last
/// (work in flight) before it counts.
const CHECK_EVERY: Duration = Duration::from_secs(5);
const GRACE: Duration = Duration::from_secs(90);
/// Replicas of a Deployment at most.
pub const DEPLOYMENT_MAX: i32 = 4;

/// How to run.
#[derive(Clone, Debug)]
pub struct ChaosOptions {
    /// Pods created over the run.
    pub pods: usize,
    /// How long pods are churned and faults injected.
    pub duration: Duration,
    /// The mean gap between faults (each gap drawn from half to one and a half of it).
    pub fault_every: Duration,
    /// Nodes.
    pub nodes: usize,
    /// Live pods at most: beyond it the oldest is deleted for each new one.
    pub live: usize,
    /// Services, each selecting every few pods.
    pub services: usize,
    /// A Deployment per node (its template names the node: there is no scheduler), scaled
    /// between 0 and [`DEPLOYMENT_MAX`] replicas at random about every `fault_every`; its pods
    /// are endpoints of the Services too. kube-controller-manager runs the deployment and
    /// replicaset controllers for them.
    pub deployments: bool,
    /// Bound on converging after the last fault.
    pub quiet: Duration,
    /// Seed of the fault and timing choices (the same seed, the same sequence of faults).
    pub seed: u64,
    /// Print progress on stderr.
    pub verbose: bool,
}

impl Default for ChaosOptions {
    fn default() -> Self {
        Self {
            pods: 1000,
            duration: Duration::from_secs(600),
            fault_every: Duration::from_secs(10),
            nodes: 2,
            live: 60,
            services: 3,
            deployments: true,
            quiet: Duration::from_secs(180),
            seed: 1,
            verbose: true,
        }
    }
}

/// What a run found.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Pods created.
    pub pods: usize,
    /// Faults injected.
    pub faults: usize,
    /// Leaks found at the end.
    pub leaked: usize,
    /// Duplicates found at the end.
    pub duplicate: usize,
    /// Live pods without exactly one VIF or not reachable from every node, plus Services not
    /// answered with exactly their ready endpoints from every node.
    pub unreachable: usize,
    /// Every problem, one line each.
    pub details: Vec<String>,
    /// The faults, in order.
    pub fault_log: Vec<String>,
    /// From the end of the last fault until the records were consistent and every live pod
    /// Running (`None`: not within the quiet period).
    pub converged_in: Option<Duration>,
    /// Pod start-up (the kubelet seeing the pod to its sandbox running with its network), over
    /// every pod started during the run: (p50, p99, max).
    pub startup: Option<(Duration, Duration, Duration)>,
    /// Pods whose sandbox was retried (RunPodSandbox called more than once).
    pub retried_starts: usize,
    /// Of `pods`, those the Deployments' ReplicaSets created (the kubelets saw them).
    pub by_deployments: usize,
    /// Deployments scaled during the run.
    pub scaled: usize,
    /// Live pods at the end, Services checked, pings answered.
    pub live_at_end: usize,
    pub services_checked: usize,
    pub pings: usize,
    /// The run's length, cluster start-up excluded.
    pub ran: Duration,
    /// Checks of the invariants made during the run (between faults).
    pub checked_during: usize,
    /// `kuryr_retries_total` at the end by component (summed over reasons and the processes
    /// scraped: the watcher, the first allocator and lbaas replicas, every binder; counted since
    /// each process's last start).
    pub retries: BTreeMap<String, f64>,
}

impl Outcome {
    /// `chaos: N pods, K faults, L leaked, D duplicate, U unreachable`.
    pub fn last_line(&self) -> String {
        format!(
            "chaos: {} pods, {} faults, {} leaked, {} duplicate, {} unreachable",
            self.pods, self.faults, self.leaked, self.duplicate, self.unreachable
        )
    }

    /// Counts one problem and keeps its line.
    pub fn count(&mut self, kind: Kind, line: impl std::fmt::Display) {
        let (n, what) = match kind {
            Kind::Leak => (&mut self.leaked, "leaked"),
            Kind::Duplicate => (&mut self.duplicate, "duplicate"),
            Kind::Unreachable => (&mut self.unreachable, "unreachable"),
        };
        *n += 1;
        self.details.push(format!("{what}: {line}"));
    }

    /// No leak, no duplicate, nothing unreachable.
    pub fn ok(&self) -> bool {
        self.leaked == 0 && self.duplicate == 0 && self.unreachable == 0
    }
}

/// The faults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Kill(ServiceKind),
    KillBinder(usize),
    /// Pods of a node deleted, then its binder killed while their DELs run.
    KillBinderDuringDel(usize),
    /// Pods deleted, then an allocator replica killed while it releases their VIFs.
    KillAllocatorDuringGc(ServiceKind),
    Stop(ServiceKind),
    StallApiServer,
}

fn draw(rng: &mut fastrand::Rng, nodes: usize) -> Fault {
    let allocator = [ServiceKind::Allocator, ServiceKind::SecondAllocator][rng.usize(0..2)];
    let lbaas = [ServiceKind::Lbaas, ServiceKind::SecondLbaas][rng.usize(0..2)];
    match rng.usize(0..9) {
        0 => Fault::Kill(ServiceKind::Watcher),
        1 => Fault::Kill(allocator),
        2 => Fault::Kill(lbaas),
        3 => Fault::KillBinder(rng.usize(0..nodes)),
        4 => Fault::KillBinderDuringDel(rng.usize(0..nodes)),
        5 => Fault::KillAllocatorDuringGc(allocator),
        6 => Fault::Stop([ServiceKind::Watcher, allocator, lbaas][rng.usize(0..3)]),
        7 => Fault::StallApiServer,
        _ => Fault::Stop(allocator),
    }
}

/// Starts a cluster, runs the chaos, checks, shuts the cluster down. On a failed check the
/// services' logs are written to a file named in the details.
pub async fn run(opts: &ChaosOptions) -> Result<Outcome> {
    let cluster_opts = ClusterOptions {
        nodes: opts.nodes,
        services: true,
        node_prefix: "chaos".into(),
        replicas: 2,
        workloads: opts.deployments,
        // Partitions (SIGSTOP) are told from quiet streams within a few seconds.
        stream_timing: Some(StreamTiming { heartbeat: "1s".into(), idle_timeout: "4s".into() }),
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(cluster_opts).await.context("starting the cluster")?;
    if opts.verbose {
        eprintln!("chaos: cluster of {} nodes up in {:?}", opts.nodes, cluster.started_in());
    }
    let result = drive(&mut cluster, opts).await;
    let mut outcome = match result {
        Ok(o) => o,
        Err(e) => {
            let path = save_logs(&cluster);
            let _ = cluster.shutdown().await;
            return Err(e.context(format!("services' logs in {}", path.display())));
        }
    };
    if !outcome.ok() {
        let path = save_logs(&cluster);
        outcome.details.push(format!("services' logs in {}", path.display()));
    }
    if let Err(e) = cluster.shutdown().await {
        outcome.details.push(format!("shutting the cluster down: {e:#}"));
    }
    Ok(outcome)
}

fn save_logs(cluster: &Cluster) -> PathBuf {
    let path = std::env::temp_dir().join(format!("kuryr-chaos-{}.log", std::process::id()));
    let _ = std::fs::write(&path, cluster.logs());
    path
}

/// The churn's shared state.
#[derive(Default)]
struct Churn {
    created: AtomicUsize,
    deleted: AtomicUsize,
    errors: AtomicUsize,
    stop: AtomicBool,
    /// Live pods by creation order (name, node index).
    live: Mutex<VecDeque<(String, usize)>>,
    /// Deployments scaled.
    scaled: AtomicUsize,
}

impl Churn {
    fn live(&self) -> std::sync::MutexGuard<'_, VecDeque<(String, usize)>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

async fn drive(cluster: &mut Cluster, opts: &ChaosOptions) -> Result<Outcome> {
    let client = cluster.client();
    crate::objects::create_namespace(&client, NAMESPACE).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
    for i in 0..opts.services {
        services.create(&PostParams::default(), &service(i)).await.with_context(|| format!("creating Service s{i}"))?;
    }
    let node_names: Vec<String> = cluster.nodes().iter().map(|n| n.name.clone()).collect();
    let churn = Arc::new(Churn::default());
    let started = Instant::now();
    let churner = tokio::spawn(churn_pods(client.clone(), node_names.clone(), opts.clone(), churn.clone()));
    let scaler = if opts.deployments {
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
        for (k, node) in node_names.iter().enumerate() {
            let d = deployment(k, node, opts.services);
            deployments
                .create(&PostParams::default(), &d)
                .await
                .with_context(|| format!("creating Deployment d{k}"))?;
        }
        Some(tokio::spawn(scale_deployments(deployments, node_names.len(), opts.clone(), churn.clone())))
    } else {
        None
    };

    let mut rng = fastrand::Rng::with_seed(opts.seed);
    let mut startup: HashMap<String, (Duration, u32)> = HashMap::new();
    let mut fault_log = Vec::new();
    let mut last_fault_end = Instant::now();
    let mut last_fault_start = Instant::now();
    let mut watch = Lasting::default();
    let mut next_check = Instant::now();
    while started.elapsed() < opts.duration {
        // Gaps from the start of one fault to the start of the next.
        let gap = opts.fault_every.mul_f64(0.5 + rng.f64()).saturating_sub(last_fault_start.elapsed());
        tokio::time::sleep(gap.min(opts.duration.saturating_sub(started.elapsed()))).await;
        if started.elapsed() >= opts.duration {
            break;
        }
        let fault = draw(&mut rng, node_names.len());
        let t = Instant::now();
        last_fault_start = t;
        let res = inject(cluster, fault, &mut rng, &client, &churn).await;
        last_fault_end = Instant::now();
        let line = format!(
            "{:>6.1}s {fault:?} ({:.1}s){}",
            started.elapsed().as_secs_f64(),
            t.elapsed().as_secs_f64(),
            res.as_ref().err().map(|e| format!(": FAILED: {e:#}")).unwrap_or_default()
        );
        if opts.verbose {
            eprintln!(
                "chaos: {line}; {} pods created, {} deleted, {} live",
                churn.created.load(Ordering::Relaxed),
                churn.deleted.load(Ordering::Relaxed),
                churn.live().len()
            );
        }
        fault_log.push(line);
        res?;
        collect_startup(cluster, &mut startup);
        // The invariants, continuously (between faults).
        if Instant::now() >= next_check {
            let found = invariants::check(&snapshot(cluster).await?);
            watch.observe(found.problems().map(|(k, l)| (l.clone(), k, l.clone())), Instant::now(), GRACE);
            next_check = Instant::now() + CHECK_EVERY;
        }
    }
    churn.stop.store(true, Ordering::Relaxed);
    churner.await.context("the churn task")??;
    if let Some(scaler) = scaler {
        scaler.await.context("the scaling task")?;
    }
    let ran = started.elapsed();
    let replicas = deployment_replicas(&client).await?;
    let expected = churn.live().len() + replicas;
    if opts.verbose {
        eprintln!("chaos: churn stopped after {ran:?}; converging ({expected} live pods)");
    }

    // Quiet period: wait until every live pod Runs and the records are consistent.
    let deadline = last_fault_end + opts.quiet;
    let mut converged_in = None;
    let mut last = String::new();
    while Instant::now() < deadline {
        match converged(cluster, expected).await {
            Ok(()) => {
                converged_in = Some(last_fault_end.elapsed());
                break;
            }
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    if opts.verbose {
        match converged_in {
            Some(d) => eprintln!("chaos: converged {d:?} after the last fault"),
            None => eprintln!("chaos: not converged within {:?} of the last fault: {last}", opts.quiet),
        }
    }
    collect_startup(cluster, &mut startup);

    let by_deployments = startup_names(cluster).iter().filter(|n| n.starts_with("d")).count();
    let mut outcome = Outcome {
        pods: churn.created.load(Ordering::Relaxed) + by_deployments,
        by_deployments,
        scaled: churn.scaled.load(Ordering::Relaxed),
        faults: fault_log.len(),
        fault_log,
        converged_in,
        ran,
        live_at_end: expected,
        ..Outcome::default()
    };
    outcome.checked_during = watch.checks;
    outcome.fault_log.push(format!("invariants checked {} times during the run", watch.checks));
    for (kind, line) in watch.counted() {
        outcome.count(kind, format!("during the run: {line}"));
    }
    if converged_in.is_none() {
        outcome.details.push(format!("not converged within {:?} of the last fault: {last}", opts.quiet));
    }
    let mut starts: Vec<Duration> = startup.values().map(|v| v.0).collect();
    starts.sort_unstable();
    if !starts.is_empty() {
        let at = |q: f64| starts[((starts.len() as f64 * q).ceil() as usize).clamp(1, starts.len()) - 1];
        outcome.startup = Some((at(0.50), at(0.99), starts[starts.len() - 1]));
    }
    outcome.retried_starts = startup.values().filter(|v| v.1 > 1).count();

    final_checks(cluster, &mut outcome).await?;
    outcome.retries = retries(cluster).await;
    Ok(outcome)
}

/// Pods created at the pace that spreads `opts.pods` over the run, the oldest deleted beyond
/// `opts.live`; a third of them are endpoints of a Service.
async fn churn_pods(client: kube::Client, nodes: Vec<String>, opts: ChaosOptions, churn: Arc<Churn>) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client, NAMESPACE);
    let pace = opts.duration.div_f64(opts.pods.max(1) as f64);
    let start = tokio::time::Instant::now();
    let mut deletions = tokio::task::JoinSet::new();
    for i in 0..opts.pods {
        tokio::time::sleep_until(start + pace.mul_f64(i as f64)).await;
        while deletions.try_join_next().is_some() {}
        if churn.stop.load(Ordering::Relaxed) {
            break;
        }
        let name = format!("p{i}");
        let node = i % nodes.len();
        let service = (i % 3 == 0 && opts.services > 0).then(|| (i / 3) % opts.services);
        // Created through API stalls: the request is retried until it succeeds or the run ends.
        loop {
            match tokio::time::timeout(
                Duration::from_secs(10),
                pods.create(&PostParams::default(), &pod(&name, &nodes[node], service)),
            )
            .await
            {
                Ok(Ok(_)) => break,
                Ok(Err(kube::Error::Api(e))) if e.code == 409 => break,
                _ => {
                    churn.errors.fetch_add(1, Ordering::Relaxed);
                    if churn.stop.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        churn.created.fetch_add(1, Ordering::Relaxed);
        let victim = {
            let mut live = churn.live();
            live.push_back((name, node));
            (live.len() > opts.live).then(|| live.pop_front()).flatten()
        };
        if let Some((victim, _)) = victim {
            let (pods, churn) = (pods.clone(), churn.clone());
            deletions.spawn(async move {
                delete_pod(&pods, &victim, &churn).await;
            });
        }
    }
    while deletions.join_next().await.is_some() {}
    Ok(())
}

async fn delete_pod(pods: &Api<Pod>, name: &str, churn: &Churn) {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), pods.delete(name, &DeleteParams::default())).await {
            Ok(Ok(_)) => break,
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => break,
            _ => {
                churn.errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    churn.deleted.fetch_add(1, Ordering::Relaxed);
}

/// Deletes up to `n` live pods (of `node`, if given) without waiting for them to go.
async fn delete_some(client: &kube::Client, churn: &Churn, node: Option<usize>, n: usize) -> usize {
    let victims: Vec<String> = {
        let mut live = churn.live();
        let picked: Vec<usize> = live
            .iter()
            .enumerate()
            .filter(|(_, (_, nd))| node.is_none_or(|x| x == *nd))
            .map(|(i, _)| i)
            .take(n)
            .collect();
        picked.into_iter().rev().filter_map(|i| live.remove(i)).map(|(name, _)| name).collect()
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    for v in &victims {
        delete_pod(&pods, v, churn).await;
    }
    victims.len()
}

async fn inject(
    cluster: &mut Cluster,
    fault: Fault,
    rng: &mut fastrand::Rng,
    client: &kube::Client,
    churn: &Churn,
) -> Result<()> {
    let outage = Duration::from_millis(rng.u64(1000..5000));
    match fault {
        Fault::Kill(kind) => {
            cluster.kill_service(kind).await?;
            tokio::time::sleep(outage).await;
            cluster.restart_service(kind).await
        }
        Fault::KillBinder(i) | Fault::KillBinderDuringDel(i) => {
            if fault == Fault::KillBinderDuringDel(i) {
                delete_some(client, churn, Some(i), 4).await;
                // The kubelet's DELs start as soon as it sees the deletions.
                tokio::time::sleep(Duration::from_millis(rng.u64(50..400))).await;
            }
            let name = cluster.nodes()[i].name.clone();
            let binder = &mut cluster.node_mut(&name).context("no such node")?.node.binder;
            binder.kill().await?;
            tokio::time::sleep(outage).await;
            binder.restart().await
        }
        Fault::KillAllocatorDuringGc(kind) => {
            delete_some(client, churn, None, 6).await;
            tokio::time::sleep(Duration::from_millis(rng.u64(50..600))).await;
            cluster.kill_service(kind).await?;
            tokio::time::sleep(outage).await;
            cluster.restart_service(kind).await
        }
        Fault::Stop(kind) => {
            cluster.stop_service(kind).await?;
            tokio::time::sleep(outage + Duration::from_secs(2)).await;
            cluster.continue_service(kind).await
        }
        Fault::StallApiServer => {
            let pid_file = cluster.kube().state_dir().join("pids/kube-apiserver.pid");
            let pid: u32 = std::fs::read_to_string(&pid_file)
                .with_context(|| format!("reading {}", pid_file.display()))?
                .trim()
                .parse()
                .context("the API server's pid")?;
            crate::cluster::signal(pid, "STOP")?;
            tokio::time::sleep(outage).await;
            crate::cluster::signal(pid, "CONT")
        }
    }
}

/// Start-up of every pod the kubelets started (network-ready, RunPodSandbox attempts), by uid.
fn collect_startup(cluster: &Cluster, into: &mut HashMap<String, (Duration, u32)>) {
    for k in cluster.kubelets() {
        for r in k.pods() {
            if let Some(d) = r.network_ready {
                into.insert(r.uid.clone(), (d, r.attempts));
            }
        }
    }
}

/// Every live pod Running and the records consistent.
async fn converged(cluster: &Cluster, expected: usize) -> Result<()> {
    checks::wait_running(cluster, NAMESPACE, expected, Duration::from_millis(1)).await?;
    let findings = invariants::check(&snapshot(cluster).await?);
    anyhow::ensure!(findings.clean(), "{}", findings.summary());
    Ok(())
}

/// The records of the API and of every node.
pub async fn snapshot(cluster: &Cluster) -> Result<Snapshot> {
    let client = cluster.client();
    let pods = Api::<Pod>::all(client.clone()).list(&ListParams::default()).await?.items;
    let vifs = Api::<PodVif>::all(client.clone()).list(&ListParams::default()).await?.items;
    let blocks = Api::<AddressBlock>::all(client.clone()).list(&ListParams::default()).await?.items;
    let key = |ns: &Option<String>, name: &Option<String>| {
        format!("{}/{}", ns.as_deref().unwrap_or_default(), name.as_deref().unwrap_or_default())
    };
    let mut s = Snapshot::default();
    for p in &pods {
        let status = p.status.as_ref();
        let ips: Vec<String> = status.iter().flat_map(|s| s.pod_ips.iter().flatten()).map(|i| i.ip.clone()).collect();
        let running = status.and_then(|s| s.phase.as_deref()) == Some("Running")
            && !ips.is_empty()
            && p.metadata.deletion_timestamp.is_none();
        s.pods.push(LivePod {
            key: key(&p.metadata.namespace, &p.metadata.name),
            uid: p.metadata.uid.clone().unwrap_or_default(),
            node: p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default(),
            ips,
            running,
        });
    }
    for v in &vifs {
        let vif = v.vif();
        s.vifs.push(VifRecord {
            key: key(&v.metadata.namespace, &v.metadata.name),
            pod_uid: v.spec.pod_uid.clone(),
            mac: vif.map(|v| v.mac.clone()).unwrap_or_default(),
            ips: vif
                .map(|v| v.ips.iter().map(|i| i.address.split('/').next().unwrap_or_default().to_string()).collect())
                .unwrap_or_default(),
        });
    }
    for b in &blocks {
        for (ip, a) in b.status.iter().flat_map(|s| &s.allocations) {
            s.allocations.push(Allocation {
                ip: ip.clone(),
                node: b.spec.node.clone(),
                key: format!("{}/{}", a.namespace, a.name),
                uid: a.uid.clone(),
                mac: a.mac.clone(),
            });
        }
    }
    let live_ips: BTreeSet<IpAddr> = s.pods.iter().flat_map(|p| &p.ips).filter_map(|i| i.parse().ok()).collect();
    for (n, k) in cluster.nodes().iter().zip(cluster.kubelets()) {
        let records = k.pods();
        let gone: Vec<_> = records.iter().filter(|r| r.phase == PodPhase::Gone).collect();
        let table = svc::nft_table(n).await;
        let mut stale_nft: BTreeSet<String> = BTreeSet::new();
        for ip in gone.iter().flat_map(|r| &r.ips).filter(|ip| !live_ips.contains(ip)) {
            if svc::table_has(&table, *ip) {
                stale_nft.insert(ip.to_string());
            }
        }
        let stale_netns = gone
            .iter()
            .filter_map(|r| r.netns.as_ref())
            .filter(|p| p.exists())
            .map(|p| p.display().to_string())
            .collect();
        s.nodes.push(NodeHeld {
            node: n.name.clone(),
            veths: checks::host_veths(cluster, &n.name).await?.len(),
            attachments: n.node.binder.attachment_records(),
            sandboxes: n.node.ctd.cri().list_pod_sandboxes().await?.len(),
            stale_nft: stale_nft.into_iter().collect(),
            stale_netns,
        });
    }
    Ok(s)
}

/// The end checks: records, reachability, Services.
async fn final_checks(cluster: &Cluster, outcome: &mut Outcome) -> Result<()> {
    let findings: Findings = invariants::check(&snapshot(cluster).await?);
    for (kind, line) in findings.problems() {
        outcome.count(kind, line);
    }

    // Reachability: every live Running pod from one pod on every node.
    let running = running_pods(cluster).await?;
    let mut sources: Vec<&RunningPod> = Vec::new();
    for n in cluster.nodes() {
        match running.iter().find(|p| p.node == n.name) {
            Some(p) => sources.push(p),
            None => {
                outcome.count(Kind::Unreachable, format!("no Running pod on {} to ping from", n.name));
            }
        }
    }
    let jobs: Vec<(&RunningPod, &RunningPod, IpAddr)> = sources
        .iter()
        .flat_map(|a| {
            running.iter().filter(move |b| b.uid != a.uid).flat_map(move |b| b.ips.iter().map(move |ip| (*a, b, *ip)))
        })
        .collect();
    let results: Vec<_> = futures::stream::iter(jobs)
        .map(|(a, b, ip)| async move {
            let (mut ok, mut out) = reach::ping(&a.netns, ip).await;
            if !ok {
                tokio::time::sleep(Duration::from_millis(500)).await;
                (ok, out) = reach::ping(&a.netns, ip).await;
            }
            (a, b, ip, ok, out)
        })
        .buffer_unordered(PINGS_AT_ONCE)
        .collect()
        .await;
    outcome.pings = results.iter().filter(|r| r.3).count();
    let mut unreachable: BTreeMap<String, String> = BTreeMap::new();
    for (a, b, ip, ok, out) in &results {
        if !ok {
            unreachable
                .entry(b.name.clone())
                .or_insert_with(|| format!("{} ({}) → {} ({}) at {ip}: {out}", a.name, a.node, b.name, b.node));
        }
    }
    outcome.unreachable += unreachable.len();
    outcome.details.extend(unreachable.values().map(|l| format!("unreachable: {l}")));

    // Services: from a pod on every node, answered by exactly the ready endpoints.
    let client = cluster.client();
    let by_name: HashMap<&str, &RunningPod> = running.iter().map(|p| (p.name.as_str(), p)).collect();
    let names: Vec<String> = Api::<Service>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|s| s.metadata.name)
        .collect();
    for name in names {
        outcome.services_checked += 1;
        let (vip, _) = svc::cluster_ip(&client, NAMESPACE, &name).await?;
        let endpoints = svc::ready_endpoints(&client, NAMESPACE, &name).await?;
        let want: BTreeSet<String> = endpoints.iter().map(|(_, p)| p.clone()).collect();
        let mut servers = Vec::new();
        for p in &want {
            match by_name.get(p.as_str()) {
                Some(rp) => servers.push(echo::serve(&rp.netns, p, TARGET_PORT)?),
                None => {
                    outcome.count(Kind::Unreachable, format!("Service {name}: endpoint {p} is not a Running pod"));
                }
            }
        }
        if want.is_empty() {
            continue;
        }
        let want_refs: Vec<&str> = want.iter().map(String::as_str).collect();
        for src in &sources {
            let got = echo::wait_answers(
                &src.netns,
                (Proto::Tcp, vip, SERVICE_PORT),
                (want.len() * 6).max(12),
                &want_refs,
                |_| true,
                Duration::from_secs(30),
            )
            .await;
            if let Err(e) = got {
                outcome.count(Kind::Unreachable, format!("Service {name} from {} ({}): {e:#}", src.name, src.node));
            }
        }
        drop(servers);
    }
    Ok(())
}

/// `kuryr_retries_total` by component, over the services and binders that answer a scrape.
async fn retries(cluster: &Cluster) -> BTreeMap<String, f64> {
    let mut scrapes = Vec::new();
    for s in [Some(cluster.watcher()), Some(cluster.allocator()), cluster.lbaas()].into_iter().flatten() {
        scrapes.push(Scrape::http(&s.metrics).await);
    }
    for n in cluster.nodes() {
        scrapes.push(Scrape::in_netns(&n.node.netns_path(), "127.0.0.1:9631").await);
    }
    let mut out = BTreeMap::new();
    for s in scrapes.into_iter().flatten() {
        for series in s.select("kuryr_retries_total", &[]) {
            let component = series.labels.get("component").cloned().unwrap_or_default();
            *out.entry(component).or_insert(0.0) += series.value;
        }
    }
    out
}

/// The Running pods of the namespace (those not Running are counted by the records check).
async fn running_pods(cluster: &Cluster) -> Result<Vec<RunningPod>> {
    let list = Api::<Pod>::namespaced(cluster.client(), NAMESPACE).list(&ListParams::default()).await?.items;
    let n = list
        .iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .count();
    checks::wait_running(cluster, NAMESPACE, n, Duration::from_secs(10)).await
}

/// Every ~`fault_every` one Deployment set to a random number of replicas (0 to
/// [`DEPLOYMENT_MAX`]), until the churn stops; a request the API server does not answer (stalled)
/// is given up for the next.
async fn scale_deployments(deployments: Api<Deployment>, n: usize, opts: ChaosOptions, churn: Arc<Churn>) {
    let mut rng = fastrand::Rng::with_seed(opts.seed ^ 0x5ca1e);
    while !churn.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(opts.fault_every.mul_f64(0.5 + rng.f64())).await;
        let (k, replicas) = (rng.usize(0..n), rng.i32(0..=DEPLOYMENT_MAX));
        let patch = serde_json::json!({ "spec": { "replicas": replicas } });
        let (name, params, patch) = (format!("d{k}"), PatchParams::default(), Patch::Merge(&patch));
        match tokio::time::timeout(Duration::from_secs(10), deployments.patch(&name, &params, &patch)).await {
            Ok(Ok(_)) => {
                churn.scaled.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                churn.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The Deployments' replicas as they stand.
async fn deployment_replicas(client: &kube::Client) -> Result<usize> {
    let list = Api::<Deployment>::namespaced(client.clone(), NAMESPACE).list(&ListParams::default()).await?.items;
    let n: i32 = list.iter().map(|d| d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1)).sum();
    Ok(usize::try_from(n).unwrap_or_default())
}

/// The names of the pods the kubelets have started.
fn startup_names(cluster: &Cluster) -> BTreeSet<String> {
    cluster.kubelets().iter().flat_map(|k| k.pods()).filter(|r| r.network_ready.is_some()).map(|r| r.name).collect()
}

/// Deployment `d<k>`: its pods on `node`, endpoints of Service `s<k % services>` when there are
/// Services.
fn deployment(k: usize, node: &str, services: usize) -> Deployment {
    let mut labels: BTreeMap<String, String> = [("app".to_string(), format!("d{k}"))].into();
    if services > 0 {
        labels.insert("svc".into(), format!("s{}", k % services));
    }
    let mut template = pod("", node, None);
    template.metadata = ObjectMeta { labels: Some(labels), ..ObjectMeta::default() };
    Deployment {
        metadata: ObjectMeta {
            name: Some(format!("d{k}")),
            namespace: Some(NAMESPACE.into()),
            ..ObjectMeta::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some([("app".to_string(), format!("d{k}"))].into()),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec { metadata: Some(template.metadata), spec: template.spec },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

fn service(i: usize) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(format!("s{i}")),
            namespace: Some(NAMESPACE.into()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            selector: Some([("svc".to_string(), format!("s{i}"))].into()),
            ports: Some(vec![ServicePort {
                port: i32::from(SERVICE_PORT),
                target_port: Some(IntOrString::Int(i32::from(TARGET_PORT))),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn pod(name: &str, node: &str, service: Option<usize>) -> Pod {
    let p = crate::objects::pod(name).namespace(NAMESPACE).node(node);
    match service {
        Some(s) => p.label("svc", &format!("s{s}")).build(),
        None => p.build(),
    }
}
