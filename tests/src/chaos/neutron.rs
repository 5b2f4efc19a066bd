//! Chaos with the Neutron backend (`CHAOS_BACKEND=neutron`): the real parts of
//! [`NeutronCluster`] (kube-apiserver, Keystone, Neutron API, RPC server and ML2/OVS agent on a
//! private Open vSwitch), kuryr-watcher, two replicas of kuryr-vif-allocator `--backend neutron`
//! sharded by Leases (the binder reaches each at the endpoint it advertises and both behind one
//! address, as a Service would) reaching Neutron only through a [`FaultProxy`] (its
//! `network_endpoint_override` in clouds.yaml: Keystone is reached directly, Neutron through the
//! proxy) and a kuryr-binder on the Neutron node.
//!
//! Pods are created in the API at a steady pace and their sandboxes set up (several at once, as
//! a kubelet does) and torn down through the real `kuryr-cni` shim (ADD retried as a runtime
//! retries a failed sandbox), a bounded live set, the oldest torn down and deleted for each new
//! one once its ADD has ended. Meanwhile the proxy injects 503s, 409s,
//! timeouts, slow answers and lost answers to POSTs, and every few seconds a process fault is
//! drawn: kill -9 of an allocator replica (started again at the same endpoints; the node's shard
//! and its pools go to the other meanwhile when it held them), kill -9 of the binder,
//! SIGSTOP/SIGCONT of an allocator replica or of the watcher; with `lbaas` replicas, kill -9 and
//! SIGSTOP of those too, their Octavia behind a proxy of its own and Services whose endpoints
//! are the live pods ([`super::octavia`]).
//!
//! The invariants are read from Neutron directly (not through the proxy), **continuously** during
//! the run and once more after a quiet period: a port tagged for the cluster whose `device_id`
//! names no pod of the API (a leak), two such ports for one pod (a duplicate) — during the run
//! only when they stay so for longer than a grace period, so work in flight is not flagged —
//! and at the end: every tagged port with no pod is in the replicas' pools (their gauges count
//! them), every live pod has exactly one port, matching its PodVif, and answers a ping
//! from another live pod.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kuryr_openstack::Filter;
use kuryr_openstack::neutron::Port;
use kuryr_vif_allocator::k8s::crd::PodVif;
use tokio::sync::Semaphore;
use tokio::task::{JoinError, JoinSet};

use super::Outcome;
use super::invariants::{Kind, Lasting};
use super::octavia::LbChaos;
use super::policy::{PolicyChaos, app_of};
use crate::binder::Binder;
use crate::faultproxy::{FaultProxy, FaultRates, FaultTiming};
use crate::forward::UnixForwarder;
use crate::netns::Netns;
use crate::neutron::{AllocatorOptions, CniPod, NeutronCluster, Svc, metric_sum, spawn, spawn_on};
use crate::shim::ShimOutput;
use crate::util::{free_port, tail};

/// The IPv4 addresses of the live pods that have their network.
fn addresses(live: &VecDeque<LivePod>) -> Vec<String> {
    live.iter().filter_map(|p| p.ipv4.clone()).collect()
}

/// The namespace of the churned pods.
pub const NAMESPACE: &str = "chaos";
/// The allocator's cluster id (its ports carry `kuryr.openstack.org/cluster=<id>`).
const CLUSTER_ID: &str = "chaos";
/// How long a port may look leaked or duplicated during the run before it counts.
const GRACE: Duration = Duration::from_secs(90);
/// How often the invariants are checked during the run.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// How to run.
#[derive(Clone, Debug)]
pub struct NeutronChaosOptions {
    /// Pods created over the run.
    pub pods: usize,
    /// How long pods are churned and faults injected.
    pub duration: Duration,
    /// The mean gap between process faults.
    pub fault_every: Duration,
    /// Live pods at most.
    pub live: usize,
    /// Sandboxes being set up at once (ADDs in flight).
    pub parallel: usize,
    /// kuryr-vif-allocator replicas (two or more: sharded by Leases, a kill hands the node's
    /// shard and its pools over).
    pub allocators: usize,
    /// kuryr-lbaas replicas on Octavia behind a fault proxy of its own ([`super::octavia`]); 0:
    /// no Octavia, no Services.
    pub lbaas: usize,
    /// Services whose endpoints are the live pods (with `lbaas`).
    pub services: usize,
    /// kuryr-policy `--backend neutron` through the proxy, with a NetworkPolicy on half the pods
    /// ([`super::policy`]).
    pub policy: bool,
    /// The fault proxy's rates.
    pub rates: FaultRates,
    /// Bound on converging after the last fault.
    pub quiet: Duration,
    pub seed: u64,
    pub verbose: bool,
}

impl Default for NeutronChaosOptions {
    fn default() -> Self {
        Self {
            pods: 200,
            duration: Duration::from_secs(400),
            fault_every: Duration::from_secs(10),
            live: 20,
            parallel: 8,
            allocators: 2,
            lbaas: 2,
            services: 3,
            policy: true,
            rates: FaultRates { server_error: 0.03, conflict: 0.02, timeout: 0.01, slow: 0.03, lost_answer: 0.05 },
            quiet: Duration::from_secs(180),
            seed: 1,
            verbose: true,
        }
    }
}

/// A pod with its sandbox.
struct LivePod {
    pod: CniPod,
    /// The IPv4 address ADD gave it (`None`: ADD has not succeeded yet).
    ipv4: Option<String>,
    /// Its ADD is still running.
    adding: bool,
}

/// The cluster under chaos.
struct World {
    c: NeutronCluster,
    proxy: FaultProxy,
    watcher: Svc,
    /// The allocator replicas (sharded by Leases when there are several).
    allocators: Vec<Svc>,
    binder: Binder,
    clouds: PathBuf,
    opts: AllocatorOptions,
    /// How the binder, in the node's namespace, reaches the replicas (sharded): each at the
    /// endpoint it advertises, all of them behind one address.
    _forwarders: Vec<UnixForwarder>,
    /// The load balancers, when the run has them.
    lb: Option<LbChaos>,
    /// kuryr-policy, when the run has it.
    policy: Option<PolicyChaos>,
}

impl World {
    /// Replica `i` of `replicas`: [`NeutronCluster::allocator`]'s flags with clouds.yaml replaced
    /// by `clouds` (whose `kuryr` cloud reaches Neutron through the proxy), sharded by Leases
    /// when `replicas > 1`, in a directory of its own; on `ports` when given (a restart at the
    /// endpoint it advertised).
    fn spawn_allocator(
        c: &NeutronCluster,
        watcher: &Svc,
        (clouds, o): (&Path, &AllocatorOptions),
        (i, replicas): (usize, usize),
        ports: Option<(u16, u16)>,
    ) -> Result<Svc> {
        let id = format!("{}-{i}", o.instance);
        let mut args = c.allocator_args(watcher, o);
        for (flag, value) in [("--clouds-yaml", clouds.display().to_string()), ("--instance", id.clone())] {
            let at = args.iter().position(|a| a == flag).with_context(|| format!("no {flag} among {args:?}"))?;
            args[at + 1] = value;
        }
        if replicas > 1 {
            args.extend(["--replica-id".into(), id, "--shards".into(), replicas.to_string()]);
            args.extend(["--lease-duration".into(), "3s".into()]);
        }
        let dir = c.dir.path().join(format!("allocator-{i}"));
        std::fs::create_dir_all(&dir)?;
        let svc = match ports {
            Some((port, mport)) => spawn_on("kuryr-vif-allocator", args, &dir, port, mport)?,
            None => spawn("kuryr-vif-allocator", args, &dir)?,
        };
        Ok(Svc { token: c.pool_manager_token.clone(), ..svc })
    }

    /// Replica `i` started again at its endpoints.
    fn restart_allocator(&mut self, i: usize) -> Result<()> {
        let ports = self.allocators[i].ports()?;
        let n = self.allocators.len();
        self.allocators[i] =
            Self::spawn_allocator(&self.c, &self.watcher, (&self.clouds, &self.opts), (i, n), Some(ports))?;
        Ok(())
    }

    async fn tagged_ports(&self) -> Result<Vec<Port>> {
        let tag = self.opts.cluster_tag();
        let filter = Filter::new().network_id(&self.c.net.network_id).tags(std::slice::from_ref(&tag));
        self.c.neutron.list_ports(&filter).await.context("listing the cluster's ports in Neutron")
    }

    /// Every replica's `/metrics` (a replica that does not answer contributes nothing).
    async fn allocator_metrics(&self) -> String {
        let mut out = String::new();
        for a in &self.allocators {
            out.push_str(&a.metrics().await.unwrap_or_default());
        }
        out
    }

    fn allocator_logs(&self) -> String {
        self.allocators.iter().map(|a| format!("==== allocator {}\n{}\n", a.addr, a.proc.logs())).collect()
    }
}

/// clouds.yaml with `network_endpoint_override` in the `kuryr` cloud.
fn clouds_through(original: &str, url: &str) -> Result<String> {
    let marker = "\n  kuryr:\n";
    let at = original.find(marker).context("no `kuryr` cloud in clouds.yaml")? + marker.len();
    Ok(format!("{}    network_endpoint_override: {url}\n{}", &original[..at], &original[at..]))
}

/// Starts everything, runs the chaos, checks.
pub async fn run(o: &NeutronChaosOptions) -> Result<Outcome> {
    let started = Instant::now();
    let c = if o.lbaas > 0 {
        NeutronCluster::start_with_octavia(&[NAMESPACE]).await
    } else {
        NeutronCluster::start(&[NAMESPACE]).await
    }
    .context("starting Keystone, Neutron (and Octavia) and the API server")?;
    let timing = FaultTiming::default();
    let proxy = FaultProxy::start(&c.neutron_url, FaultRates::NONE, timing, o.seed).await?;
    let clouds = c.dir.path().join("clouds-chaos.yaml");
    let text = std::fs::read_to_string(c.os.clouds_yaml())?;
    std::fs::write(&clouds, clouds_through(&text, proxy.url())?)?;
    let watcher = c.watcher()?;
    let opts = AllocatorOptions { cluster_id: CLUSTER_ID.into(), instance: "alloc-chaos".into(), ..Default::default() };
    let n = o.allocators.max(1);
    let mut allocators = Vec::new();
    for i in 0..n {
        // One after the other: a replica's ports are bound before the next picks free ones.
        let a = World::spawn_allocator(&c, &watcher, (&clouds, &opts), (i, n), None)?;
        a.wait_ready(Duration::from_secs(180)).await.with_context(|| format!("allocator replica {i}"))?;
        allocators.push(a);
    }
    let mut forwarders = Vec::new();
    let target = if n == 1 {
        format!("unix:{}", allocators[0].sock.display())
    } else {
        let netns = c.node.netns_path();
        for a in &allocators {
            forwarders.push(UnixForwarder::start(&netns, a.ports()?.0, vec![a.sock.clone()]).await?);
        }
        let vip = free_port()?;
        forwarders.push(UnixForwarder::start(&netns, vip, allocators.iter().map(|a| a.sock.clone()).collect()).await?);
        format!("127.0.0.1:{vip}")
    };
    let binder = c.binder_to(&target, Duration::from_secs(60), &[]).await?;
    let lb = if o.lbaas > 0 {
        let lb = LbChaos::start(&c, &watcher, (o.lbaas, o.services), NAMESPACE, o.seed.wrapping_add(1)).await;
        Some(lb.context("starting kuryr-lbaas on Octavia")?)
    } else {
        None
    };
    let policy = if o.policy {
        let p = PolicyChaos::start(&c, &watcher, &clouds, CLUSTER_ID, NAMESPACE).await;
        Some(p.context("starting kuryr-policy on Neutron")?)
    } else {
        None
    };
    let mut w = World { c, proxy, watcher, allocators, binder, clouds, opts, _forwarders: forwarders, lb, policy };
    if o.verbose {
        eprintln!(
            "chaos: Neutron cluster up in {:?}; proxy {} → {}",
            started.elapsed(),
            w.proxy.url(),
            w.proxy.upstream()
        );
    }
    let res = drive(&mut w, o).await;
    match res {
        Ok(mut out) => {
            if !out.ok() {
                let path = std::env::temp_dir().join(format!("kuryr-chaos-neutron-{}.log", std::process::id()));
                let mut lbaas = w.lb.as_ref().map(LbChaos::logs).unwrap_or_default();
                if let Some(p) = &w.policy {
                    lbaas.push_str(&format!("\n==== kuryr-policy\n{}", p.svc.proc.logs()));
                }
                let _ = std::fs::write(&path, format!("{}\n{}\n{lbaas}", w.allocator_logs(), w.binder.logs()));
                out.details.push(format!("the allocators', binder's and lbaas' logs in {}", path.display()));
            }
            Ok(out)
        }
        Err(e) => Err(e.context(format!("the allocators' logs:\n{}", tail(&w.allocator_logs(), 120)))),
    }
}

/// What the tagged `ports` show wrong now, for [`Lasting`]: `live` are the uids of the pods in
/// the API.
fn port_problems(ports: &[Port], live: &HashSet<String>) -> Vec<(String, Kind, String)> {
    let mut out = Vec::new();
    let mut by_pod: HashMap<&str, Vec<&Port>> = HashMap::new();
    for p in ports.iter().filter(|p| !p.device_id.is_empty()) {
        by_pod.entry(p.device_id.as_str()).or_default().push(p);
        if !live.contains(&p.device_id) {
            out.push((
                format!("leak:{}", p.id),
                Kind::Leak,
                format!("port {} ({}) held by pod uid {} that no longer exists", p.id, p.name, p.device_id),
            ));
        }
    }
    for (uid, ps) in by_pod.iter().filter(|(_, ps)| ps.len() > 1) {
        let ids: Vec<&str> = ps.iter().map(|p| p.id.as_str()).collect();
        out.push((format!("dup:{uid}"), Kind::Duplicate, format!("pod uid {uid} holds {} ports {ids:?}", ids.len())));
    }
    out
}

async fn live_uids(pods: &Api<Pod>) -> Result<HashSet<String>> {
    Ok(pods.list(&ListParams::default()).await?.items.into_iter().filter_map(|p| p.metadata.uid).collect())
}

/// One call of the shim for `pod` on its own thread (the driver keeps running meanwhile).
async fn shim(socket: &Path, pod: &CniPod, op: &'static str) -> Result<ShimOutput> {
    let (pod, socket) = (pod.clone(), socket.to_path_buf());
    tokio::task::spawn_blocking(move || pod.run_at(op, &socket, None, Duration::from_secs(60)))
        .await
        .context("the shim's thread")?
}

/// ADD through the shim, retried like a runtime retries a sandbox (DEL first).
async fn add(socket: &Path, pod: &CniPod, deadline: Duration) -> Result<String> {
    let t = Instant::now();
    let mut last = String::new();
    while t.elapsed() < deadline {
        match shim(socket, pod, "ADD").await {
            Ok(o) if o.code == 0 => {
                let v = o.json().context("ADD's result")?;
                return crate::shim::result_ip(&v, false).context("no IPv4 address in ADD's result");
            }
            Ok(o) => last = format!("exit {}: {} {}", o.code, o.stdout.trim(), o.stderr.trim()),
            Err(e) => last = format!("{e:#}"),
        }
        let _ = shim(socket, pod, "DEL").await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    anyhow::bail!("ADD of {} failed for {deadline:?}: {last}", pod.name)
}

async fn del(socket: &Path, pod: &CniPod, deadline: Duration) -> Result<()> {
    let t = Instant::now();
    let mut last = String::new();
    while t.elapsed() < deadline {
        match shim(socket, pod, "DEL").await {
            Ok(o) if o.code == 0 => return Ok(()),
            Ok(o) => last = format!("exit {}: {} {}", o.code, o.stdout.trim(), o.stderr.trim()),
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    anyhow::bail!("DEL of {} failed for {deadline:?}: {last}", pod.name)
}

/// ADDs running at once: each ends with its pod's name and the address it got.
type Adds = JoinSet<(String, Result<String>)>;

/// Records a finished ADD on its pod.
/// ADD, then the address in the pod's status as its kubelet would report it (policies select
/// pods that have addresses).
async fn add_and_report(pods: &Api<Pod>, socket: &Path, cni: &CniPod) -> Result<String> {
    let ip = add(socket, cni, Duration::from_secs(120)).await?;
    let status = serde_json::json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
    pods.patch_status(&cni.name, &PatchParams::default(), &Patch::Merge(status))
        .await
        .with_context(|| format!("reporting the address of {}", cni.name))?;
    Ok(ip)
}

fn added(live: &mut VecDeque<LivePod>, errors: &mut Vec<String>, done: Result<(String, Result<String>), JoinError>) {
    match done {
        Ok((name, res)) => {
            let Some(p) = live.iter_mut().find(|p| p.pod.name == name) else { return };
            p.adding = false;
            match res {
                Ok(ip) => p.ipv4 = Some(ip),
                Err(e) => errors.push(format!("{e:#}")),
            }
        }
        Err(e) => errors.push(format!("an ADD task ended abnormally: {e}")),
    }
}

#[derive(Clone, Copy, Debug)]
enum ProcFault {
    KillAllocator,
    KillBinder,
    StopAllocator,
    StopWatcher,
    KillLbaas,
    StopLbaas,
    KillPolicy,
    StopPolicy,
}

async fn inject(w: &mut World, f: ProcFault, rng: &mut fastrand::Rng) -> Result<String> {
    let replica = rng.usize(0..w.allocators.len());
    match f {
        ProcFault::KillPolicy => {
            let p = w.policy.as_mut().context("no kuryr-policy in this run")?;
            p.kill(&w.c).await?;
            Ok(String::new())
        }
        ProcFault::StopPolicy => {
            let p = w.policy.as_ref().context("no kuryr-policy in this run")?;
            let pid = p.svc.proc.pid().context("not running")?;
            crate::cluster::signal(pid, "STOP")?;
            tokio::time::sleep(Duration::from_secs(5)).await;
            crate::cluster::signal(pid, "CONT")?;
            Ok(String::new())
        }
        ProcFault::KillLbaas | ProcFault::StopLbaas => {
            let lb = w.lb.as_mut().context("no lbaas in this run")?;
            let i = rng.usize(0..lb.replicas.len());
            if matches!(f, ProcFault::KillLbaas) {
                lb.kill(&w.c, &w.watcher, i).await?;
            } else {
                let pid = lb.replicas[i].proc.pid().context("not running")?;
                crate::cluster::signal(pid, "STOP")?;
                tokio::time::sleep(Duration::from_secs(5)).await;
                crate::cluster::signal(pid, "CONT")?;
            }
            Ok(format!("replica {i}"))
        }
        ProcFault::KillAllocator => {
            w.allocators[replica].proc.kill().await?;
            tokio::time::sleep(Duration::from_secs(2)).await;
            w.restart_allocator(replica)?;
            Ok(format!("replica {replica}"))
        }
        ProcFault::KillBinder => {
            w.binder.kill().await?;
            tokio::time::sleep(Duration::from_secs(1)).await;
            w.binder.restart().await?;
            Ok(String::new())
        }
        ProcFault::StopAllocator | ProcFault::StopWatcher => {
            let (s, what) = if matches!(f, ProcFault::StopAllocator) {
                (&w.allocators[replica], format!("replica {replica}"))
            } else {
                (&w.watcher, String::new())
            };
            let pid = s.proc.pid().context("not running")?;
            crate::cluster::signal(pid, "STOP")?;
            tokio::time::sleep(Duration::from_secs(5)).await;
            crate::cluster::signal(pid, "CONT")?;
            Ok(what)
        }
    }
}

async fn drive(w: &mut World, o: &NeutronChaosOptions) -> Result<Outcome> {
    let pods: Api<Pod> = Api::namespaced(w.c.admin.clone(), NAMESPACE);
    let mut rng = fastrand::Rng::with_seed(o.seed);
    let mut live: VecDeque<LivePod> = VecDeque::new();
    let mut watch = Lasting::default();
    let mut fault_log = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    let pace = o.duration.div_f64(o.pods.max(1) as f64);
    let started = Instant::now();
    let mut next_fault = started + o.fault_every.mul_f64(0.5 + rng.f64());
    let mut next_check = started;
    let mut last_fault_end = Instant::now();
    w.proxy.set_rates(o.rates);
    if let Some(lb) = &w.lb {
        lb.proxy.set_rates(o.rates);
    }
    let mut created = 0;
    let socket = w.binder.socket.clone();
    let gate = Arc::new(Semaphore::new(o.parallel.max(1)));
    let mut adds = Adds::new();
    for i in 0..o.pods {
        // One pod: created in the API, its sandbox set up (up to `parallel` at once).
        let name = format!("p{i}");
        let mut pod = w.c.pod(&name);
        pod.metadata.labels = Some([("app".to_string(), app_of(&name).to_string())].into());
        let made = pods.create(&PostParams::default(), &pod).await.with_context(|| format!("creating pod {name}"))?;
        let uid = made.metadata.uid.context("no uid")?;
        let netns = Arc::new(Netns::new("chaosn")?);
        let cni = CniPod { namespace: NAMESPACE.into(), name: name.clone(), uid, netns };
        created += 1;
        live.push_back(LivePod { pod: cni.clone(), ipv4: None, adding: true });
        let (turns, at) = (gate.clone(), socket.clone());
        let api = pods.clone();
        adds.spawn(async move {
            let _turn = turns.acquire_owned().await;
            let res = add_and_report(&api, &at, &cni).await;
            (cni.name, res)
        });
        while let Some(done) = adds.try_join_next() {
            added(&mut live, &mut errors, done);
        }
        // The oldest torn down and deleted, once its ADD has ended.
        while live.len() > o.live {
            while live.front().is_some_and(|p| p.adding) {
                let Some(done) = adds.join_next().await else { break };
                added(&mut live, &mut errors, done);
            }
            let Some(old) = live.pop_front() else { break };
            if let Err(e) = del(&socket, &old.pod, Duration::from_secs(120)).await {
                errors.push(format!("{e:#}"));
            }
            pods.delete(&old.pod.name, &DeleteParams::default()).await?;
        }
        // A process fault when due.
        if Instant::now() >= next_fault {
            let mut kinds =
                vec![ProcFault::KillAllocator, ProcFault::KillBinder, ProcFault::StopAllocator, ProcFault::StopWatcher];
            if w.lb.is_some() {
                kinds.extend([ProcFault::KillLbaas, ProcFault::StopLbaas]);
            }
            if w.policy.is_some() {
                kinds.extend([ProcFault::KillPolicy, ProcFault::StopPolicy]);
            }
            let f = kinds[rng.usize(0..kinds.len())];
            let t = Instant::now();
            let res = inject(w, f, &mut rng).await;
            last_fault_end = Instant::now();
            let line = format!(
                "{:>6.1}s {f:?}{} ({:.1}s){}",
                started.elapsed().as_secs_f64(),
                res.as_ref().ok().filter(|w| !w.is_empty()).map(|w| format!(" of {w}")).unwrap_or_default(),
                t.elapsed().as_secs_f64(),
                res.as_ref().err().map(|e| format!(": FAILED: {e:#}")).unwrap_or_default()
            );
            if o.verbose {
                eprintln!("chaos: {line}; {created} pods created, {} live; proxy: {}", live.len(), w.proxy.counts());
            }
            fault_log.push(line);
            res?;
            // A Service deleted and another created, at every other fault.
            if let Some(lb) = w.lb.as_mut().filter(|_| rng.bool()) {
                let moved = lb.rotate(&w.c.admin).await?;
                fault_log.push(format!("{:>6.1}s Service {moved}", started.elapsed().as_secs_f64()));
            }
            // The NetworkPolicy replaced by another, at every other fault.
            if let Some(p) = w.policy.as_mut().filter(|_| rng.bool()) {
                let moved = p.rotate(&w.c.admin).await?;
                fault_log.push(format!("{:>6.1}s NetworkPolicy {moved}", started.elapsed().as_secs_f64()));
            }
            next_fault = Instant::now() + o.fault_every.mul_f64(0.5 + rng.f64());
        }
        // The invariants, continuously.
        if Instant::now() >= next_check {
            let ports = w.tagged_ports().await?;
            let mut problems = port_problems(&ports, &live_uids(&pods).await?);
            if let Some(lb) = w.lb.as_mut() {
                lb.follow_pods(&w.c.admin, &addresses(&live)).await?;
                problems.extend(lb.problems(&w.c.admin).await?);
            }
            if let Some(p) = &w.policy {
                problems.extend(p.problems(&w.c).await?);
            }
            watch.observe(problems, Instant::now(), GRACE);
            next_check = Instant::now() + CHECK_EVERY;
        }
        let due = started + pace.mul_f64((i + 1) as f64);
        tokio::time::sleep_until(due.into()).await;
    }
    while let Some(done) = adds.join_next().await {
        added(&mut live, &mut errors, done);
    }
    let proxy_counts = w.proxy.counts();
    w.proxy.set_rates(FaultRates::NONE);
    let lb_counts = w.lb.as_ref().map(|lb| lb.proxy.counts());
    if let Some(lb) = &w.lb {
        lb.proxy.set_rates(FaultRates::NONE);
    }
    let ran = started.elapsed();
    if o.verbose {
        eprintln!("chaos: churn done in {ran:?}; proxy: {proxy_counts}; quiet period");
    }
    // Pods whose ADD never succeeded get one more chance, now that the faults are over.
    for p in live.iter_mut().filter(|p| p.ipv4.is_none()) {
        match add_and_report(&pods, &socket, &p.pod).await {
            Ok(ip) => p.ipv4 = Some(ip),
            Err(e) => errors.push(format!("after the faults: {e:#}")),
        }
    }
    if let Some(lb) = w.lb.as_mut() {
        lb.follow_pods(&w.c.admin, &addresses(&live)).await?;
    }

    // Quiet: the ports settle (orphans collected, pools refilled).
    let deadline = last_fault_end.max(Instant::now()) + o.quiet;
    let mut converged_in = None;
    let mut last = Vec::new();
    while Instant::now() < deadline {
        last = final_problems(w, &pods, &live).await?;
        if last.is_empty() {
            converged_in = Some(last_fault_end.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let mut out = Outcome {
        pods: created,
        faults: fault_log.len() + (proxy_counts.faults() + lb_counts.map_or(0, |c| c.faults())) as usize,
        fault_log,
        converged_in,
        ran,
        live_at_end: live.len(),
        ..Outcome::default()
    };
    out.fault_log.push(format!("fault proxy in front of Neutron: {proxy_counts}"));
    if let Some(counts) = lb_counts {
        out.fault_log.push(format!("fault proxy in front of Octavia: {counts}"));
    }
    out.checked_during = watch.checks;
    out.fault_log.push(format!("invariants checked {} times during the run", watch.checks));
    for (kind, line) in watch.counted() {
        out.count(kind, format!("during the run: {line}"));
    }
    for (kind, line) in last {
        out.count(kind, line);
    }
    for e in &errors {
        out.details.push(format!("during the run (retried): {e}"));
    }
    // Reachability: every live pod from the first live pod (both on the Neutron node's OVS).
    let addressed: Vec<&LivePod> = live.iter().filter(|p| p.ipv4.is_some()).collect();
    for p in live.iter().filter(|p| p.ipv4.is_none()) {
        out.count(Kind::Unreachable, format!("{} never got its network", p.pod.name));
    }
    if let Some((src, rest)) = addressed.split_first() {
        for p in rest {
            let ip = p.ipv4.as_deref().unwrap_or_default();
            let mut ok = false;
            for _ in 0..5 {
                if src.pod.netns.exec(&["ping", "-4", "-n", "-c", "1", "-W", "2", ip]).is_ok() {
                    ok = true;
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            if ok {
                out.pings += 1;
            } else {
                out.count(Kind::Unreachable, format!("{} → {} at {ip}", src.pod.name, p.pod.name));
            }
        }
    }
    out.retries = retries_by_component("allocator", &w.allocator_metrics().await);
    if let Some(lb) = &w.lb {
        out.retries.extend(retries_by_component("lbaas", &lb.metrics().await));
    }
    Ok(out)
}

/// A service's `kuryr_retries_total` (`text`), summed per `component` over its reasons, keyed
/// `<service> <component>`.
fn retries_by_component(service: &str, text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("kuryr_retries_total{")) {
        let Some((labels, value)) = line.rsplit_once(' ') else { continue };
        let Some(component) = labels.split("component=\"").nth(1).and_then(|r| r.split('"').next()) else { continue };
        *out.entry(format!("{service} {component}")).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
    }
    out
}

/// The end state: every tagged port either a live pod's (one each, the one its PodVif names) or
/// in the allocator's pools (as many as its gauge counts).
async fn final_problems(w: &World, pods: &Api<Pod>, live: &VecDeque<LivePod>) -> Result<Vec<(Kind, String)>> {
    let ports = w.tagged_ports().await?;
    let uids = live_uids(pods).await?;
    let mut out = Vec::new();
    let mut by_pod: HashMap<&str, Vec<&Port>> = HashMap::new();
    let mut unheld = 0usize;
    for p in &ports {
        if p.device_id.is_empty() {
            unheld += 1;
        } else if uids.contains(&p.device_id) {
            by_pod.entry(p.device_id.as_str()).or_default().push(p);
        } else {
            out.push((
                Kind::Leak,
                format!("port {} ({}) held by pod uid {} that no longer exists", p.id, p.name, p.device_id),
            ));
        }
    }
    let metrics = w.allocator_metrics().await;
    let pooled = metric_sum(&metrics, "kuryr_allocator_neutron_pool_ports", &[r#"state="free""#])
        + metric_sum(&metrics, "kuryr_allocator_neutron_pool_ports", &[r#"state="recycling""#]);
    if unheld as f64 > pooled {
        out.push((
            Kind::Leak,
            format!("{unheld} tagged ports without a pod in Neutron, {pooled} in the allocators' pools"),
        ));
    }
    let vifs: Api<PodVif> = Api::namespaced(w.c.admin.clone(), NAMESPACE);
    let recorded: HashMap<String, String> = vifs
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|v| Some((v.spec.pod_uid.clone(), v.vif()?.vif_id.clone())))
        .collect();
    for p in live {
        match by_pod.get(p.pod.uid.as_str()).map(Vec::as_slice) {
            Some([one]) => {
                if p.ipv4.is_some() && recorded.get(&p.pod.uid) != Some(&one.id) {
                    out.push((
                        Kind::Duplicate,
                        format!(
                            "{}: port {} in Neutron, {:?} in its PodVif",
                            p.pod.name,
                            one.id,
                            recorded.get(&p.pod.uid)
                        ),
                    ));
                }
            }
            Some(many) => {
                let ids: Vec<&str> = many.iter().map(|p| p.id.as_str()).collect();
                out.push((Kind::Duplicate, format!("{} holds {} ports {ids:?}", p.pod.name, ids.len())));
            }
            None => out.push((Kind::Unreachable, format!("{} has no port in Neutron", p.pod.name))),
        }
    }
    out.extend(node_problems(w, &uids)?);
    if let Some(lb) = &w.lb {
        out.extend(lb.final_problems(&w.c.admin).await?);
    }
    if let Some(policy) = &w.policy {
        let held: Vec<(String, &Port)> = live
            .iter()
            .filter(|p| p.ipv4.is_some())
            .filter_map(|p| match by_pod.get(p.pod.uid.as_str()).map(Vec::as_slice) {
                Some([one]) => Some((p.pod.name.clone(), *one)),
                _ => None,
            })
            .collect();
        out.extend(policy.final_problems(&w.c, &held).await?);
    }
    Ok(out)
}

/// What the Neutron node still holds for pods: the OVS interfaces the binder plugged (their
/// `external_ids:vm-uuid` is the pod's uid) and the binder's attachment records. One for a pod
/// that is gone is a leak, two for one pod a duplicate.
fn node_problems(w: &World, live: &HashSet<String>) -> Result<Vec<(Kind, String)>> {
    let mut out = Vec::new();
    let mut held: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let text = crate::nested::vsctl(
        &w.c.node.ovsdb(),
        &["--format=json", "--columns=name,external_ids", "list", "Interface"],
    )?;
    let table: serde_json::Value = serde_json::from_str(&text).context("ovs-vsctl's JSON")?;
    for row in table["data"].as_array().into_iter().flatten() {
        let name = row[0].as_str().unwrap_or_default().to_string();
        // ["map", [[key, value], ...]]
        let ids = row[1][1].as_array().cloned().unwrap_or_default();
        let get = |k: &str| ids.iter().find(|kv| kv[0] == k).and_then(|kv| kv[1].as_str()).map(str::to_string);
        // Only the pods' interfaces: those tagged with a port of the cluster's pods.
        if let (Some(uid), Some(_)) = (get("vm-uuid"), get("iface-id")) {
            held.entry(uid).or_default().push(name);
        }
    }
    for (uid, names) in &held {
        if !live.contains(uid) {
            out.push((Kind::Leak, format!("OVS interfaces {names:?} of pod uid {uid}, which no longer exists")));
        } else if names.len() > 1 {
            out.push((Kind::Duplicate, format!("pod uid {uid} has OVS interfaces {names:?}")));
        }
    }
    let dir = w.binder.state_dir.join("attachments");
    let mut records: BTreeMap<String, usize> = BTreeMap::new();
    for e in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?.flatten() {
        if e.path().extension().is_none_or(|x| x != "json") {
            continue;
        }
        let text = std::fs::read_to_string(e.path())?;
        let rec: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}", e.path().display()))?;
        *records.entry(rec["pod_uid"].as_str().unwrap_or_default().to_string()).or_default() += 1;
    }
    for (uid, n) in records {
        if !live.contains(&uid) {
            out.push((
                Kind::Leak,
                format!("{n} attachment records of the binder for pod uid {uid}, which no longer exists"),
            ));
        } else if n > 1 {
            out.push((Kind::Duplicate, format!("pod uid {uid} has {n} attachment records")));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_summed_per_component() {
        let text = "# TYPE kuryr_retries_total counter\n\
                    kuryr_retries_total{component=\"neutron\",reason=\"unavailable\"} 3\n\
                    kuryr_retries_total{component=\"neutron\",reason=\"timeout\"} 2\n\
                    kuryr_retries_total{component=\"watcher\",reason=\"stream\"} 1\n\
                    openstack_requests_total{service=\"network\"} 40\n";
        let got = retries_by_component("allocator", text);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got["allocator neutron"], 5.0);
        assert_eq!(got["allocator watcher"], 1.0);
    }

    fn port(id: &str, device: &str) -> Port {
        Port { id: id.into(), device_id: device.into(), ..Port::default() }
    }

    #[test]
    fn clouds_yaml_gets_the_override_in_the_kuryr_cloud_only() {
        let text = "clouds:\n  admin:\n    auth_type: password\n  kuryr:\n    auth_type: password\n  kuryr-appcred:\n    x: 1\n";
        let out = clouds_through(text, "http://127.0.0.1:9").unwrap();
        assert_eq!(
            out,
            "clouds:\n  admin:\n    auth_type: password\n  kuryr:\n    network_endpoint_override: http://127.0.0.1:9\n    auth_type: password\n  kuryr-appcred:\n    x: 1\n"
        );
        assert!(clouds_through("clouds:\n  admin: {}\n", "u").is_err());
    }

    #[test]
    fn stray_and_doubled_ports_are_problems() {
        let live: HashSet<String> = ["u1".to_string()].into();
        let ports = vec![port("a", "u1"), port("b", "gone"), port("c", ""), port("d", "u1")];
        let mut found = port_problems(&ports, &live);
        found.sort();
        let kinds: Vec<(&str, Kind)> = found.iter().map(|(k, kind, _)| (k.as_str(), *kind)).collect();
        assert_eq!(kinds, vec![("dup:u1", Kind::Duplicate), ("leak:b", Kind::Leak)]);
        assert!(port_problems(&[port("a", "u1"), port("c", "")], &live).is_empty());
    }
}
