//! `make bench-kuryr`: Kuryr-Kubernetes 10.0.0 itself (its controller from the venv built by
//! `tests/env/openstack/setup.sh kuryr`, [`kuryr_tests::kuryr_controller`]) and then kuryr-rs
//! (watcher, vif-allocator `--backend neutron`, lbaas `--backend octavia`, a binder on the
//! Neutron node's `br-int` with CNI through the kuryr-cni shim; optimised binaries from
//! `KURYR_BIN_DIR`), the same workload one after the other in one run on the same services: the
//! real kube-apiserver, Keystone, Neutron (API, RPC, ML2/OVS agent) and Octavia as the suites run
//! them ([`NeutronCluster::start_with_octavia`]).
//!
//! Kuryr runs with its documented configuration (`neutron-vif`, handlers `vif,kuryrport,service,
//! endpoints,kuryrloadbalancer`, `[octavia_defaults] member_mode = L2`), logging at INFO; kuryr-rs
//! with Neutron's port events. Four pod phases per system, each with a fresh controller (Kuryr) or
//! allocator (kuryr-rs) and a primer pod first (not measured), `BENCH_KURYR_PODS` pods (default
//! 100) created through the API at a steady rate:
//! - **cold** at 2 and at 10 pods/s: a port created on each pod's path (Kuryr `vif_pool_driver =
//!   noop`; kuryr-rs `--pool-batch 0`);
//! - **warm** at 2 and at 10 pods/s: a pool with a port for every pod made first (Kuryr: its pool
//!   driver's bulk creation, triggered by the primer, `ports_pool_batch` = pods + 3; kuryr-rs:
//!   PopulatePool with pods + 5, at most 100: its bound).
//!
//! The comparable point is the controller's: **pod created → its port handed to the node** —
//! Kuryr: its KuryrPort's `status.vifs.eth0` written (what Kuryr's CNI daemon waits for);
//! kuryr-rs: the PodVif's VIF written (`spec.vif`, by its create: what the binder plugs). Both seen through a
//! Kubernetes watch. For kuryr-rs the bench also runs CNI ADD through the shim right after each
//! create (as a kubelet would) and reports pod created → ADD returned (port plugged and ACTIVE in
//! Neutron). Kuryr's CNI cannot plug a port on these machines (README, "Migrating from Kuryr"):
//! that row is reported as its failure, and Kuryr's ports stay DOWN, so its VIFs never turn
//! active (counted).
//!
//! **Neutron calls per pod** come, for both, from the Neutron API's own request log
//! (`logs/neutron-api.log`, uWSGI, one line per request) between two offsets: from the phase's
//! first create until every pod's port is handed out (kuryr-rs: and every ADD returned), every
//! request counted, plus, warm, each pod's share of the pool's creation (its calls over the ports
//! it made). Nothing else calls Neutron's API meanwhile (the bench does not).
//!
//! **Services**: with the last phase's pods, a Service with one TCP port and `BENCH_KURYR_MEMBERS`
//! (default 10) endpoints (Endpoints for Kuryr, EndpointSlice for kuryr-rs, both written as the
//! endpoint controllers would, with the pods' `status.podIP` that Kuryr looks members up by):
//! Service created → Octavia's load balancer ACTIVE with every member ACTIVE; then
//! `BENCH_KURYR_CHANGES` (default 3) endpoint changes (one endpoint out, another in) → Octavia's
//! members the new set, all ACTIVE. Octavia's API is polled every 100 ms for both. Octavia's no-op
//! network driver makes no VIP port and Kuryr needs one: the bench makes it, as the migration
//! suite does.
//!
//! **Memory**: PSS (`/proc/<pid>/smaps_rollup`) of every process of each system (and its
//! descendants), idle (primer done, 5 s later) and the peak sampled every 500 ms under load.
//! **CPU**: utime + stime (`/proc/<pid>/stat`) of each system's processes over the four phases'
//! way in, per 100 pods.
#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Endpoints, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event, watcher};
use kuryr_openstack::Filter;
use kuryr_openstack::neutron::{FixedIp, PortCreate};
use kuryr_proto::allocator::v1::pool_manager_client::PoolManagerClient;
use kuryr_proto::allocator::v1::{PoolKey, PopulatePoolRequest};
use kuryr_proto::service_names::LOAD_BALANCERS;
use kuryr_tests::binder::Binder;
use kuryr_tests::kuryr_controller::{self as kuryr, KuryrConfig, KuryrController};
use kuryr_tests::netns::Netns;
use kuryr_tests::neutron::{AllocatorOptions, CniPod, NeutronCluster, Svc};
use kuryr_tests::objects;
use kuryr_tests::openstack::OctaviaLbaas;
use kuryr_tests::procstat::{clock_ticks, cpu_ticks};
use kuryr_tests::services::wait_until;
use kuryr_tests::stats::{Stats, ms};
use kuryr_tests::sut::{self, Sut};
use kuryr_tests::topology;
use kuryr_tests::util::{env_or, loadavg};
use kuryr_vif_allocator::k8s::crd::{PodVif, VifState};
use serde_json::{Value, json};

const NS_KURYR: &str = "bench-kuryr";
const NS_RS: &str = "bench-kuryr-rs";
/// Bound on a phase's pods, a teardown, a load balancer (a loaded machine).
const SLOW: Duration = Duration::from_secs(300);
const SVC: &str = "web";
/// The Services' cluster IPs, in the API server's Service range: one per system.
const KURYR_VIP: &str = "10.96.30.10";
const RS_VIP: &str = "10.96.30.11";
const TARGET_PORT: u16 = 8080;
const RATES: [f64; 2] = [2.0, 10.0];
/// The reason Kuryr's CNI ADD fails here (README, "Migrating from Kuryr").
const KURYR_CNI_FAILS: &str = "fails: os-vif re-declares br-int with datapath_type=system (no OVS kernel \
                               module here); ADD returns CNI code 100 after 2 min 8 s";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---- processes: PSS and CPU time from /proc ----

/// `pid` and its descendants (by parent pid).
fn with_descendants(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
            let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok());
            if let Some(pp) = ppid {
                parents.push((p, pp));
            }
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let cur = out[i];
        out.extend(parents.iter().filter(|(_, pp)| *pp == cur).map(|(p, _)| *p));
        i += 1;
    }
    out
}

/// PSS of one process, KiB.
fn pss_kib(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A system's processes by name, each with its descendants; `node` marks node-side ones (the
/// binder) apart from the controller side.
#[derive(Clone, Debug, Default)]
struct Procs(Vec<(String, u32, bool)>);

impl Procs {
    /// PSS per process name, KiB.
    fn pss(&self) -> Vec<(String, bool, u64)> {
        self.0
            .iter()
            .map(|(n, pid, node)| (n.clone(), *node, with_descendants(*pid).into_iter().map(pss_kib).sum()))
            .collect()
    }

    /// CPU seconds so far: (controller side, node side).
    fn cpu(&self, tck: f64) -> (f64, f64) {
        let (mut c, mut n) = (0u64, 0u64);
        for (_, pid, node) in &self.0 {
            let t: u64 = with_descendants(*pid).into_iter().map(cpu_ticks).sum();
            if *node {
                n += t;
            } else {
                c += t;
            }
        }
        (c as f64 / tck, n as f64 / tck)
    }
}

/// Peak PSS under load (sampled), KiB: (controller side, node side, per process name).
#[derive(Debug, Default)]
struct Peak {
    /// Sampling starts once the idle figure is taken.
    armed: bool,
    controller: u64,
    node: u64,
    by_name: BTreeMap<String, u64>,
}

fn spawn_sampler(procs: Arc<Mutex<Procs>>, peak: Arc<Mutex<Peak>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if !lock(&peak).armed {
                continue;
            }
            let p = lock(&procs).clone();
            let snap = tokio::task::spawn_blocking(move || p.pss()).await.unwrap_or_default();
            let mut pk = lock(&peak);
            let (c, n) = snap.iter().fold((0, 0), |(c, n), (_, node, k)| if *node { (c, n + k) } else { (c + k, n) });
            pk.controller = pk.controller.max(c);
            pk.node = pk.node.max(n);
            for (name, _, k) in snap {
                let e = pk.by_name.entry(name).or_default();
                *e = (*e).max(k);
            }
        }
    })
}

// ---- Neutron's request log ----

/// The Neutron API's request log, read between byte offsets.
struct ApiLog(PathBuf);

impl ApiLog {
    fn offset(&self) -> u64 {
        std::fs::metadata(&self.0).map(|m| m.len()).unwrap_or(0)
    }

    /// Requests logged between two offsets, by operation (`METHOD /path`, ids as `{id}`).
    fn calls(&self, from: u64, to: u64) -> Result<BTreeMap<String, usize>> {
        let bytes = std::fs::read(&self.0).with_context(|| format!("reading {}", self.0.display()))?;
        let from = usize::try_from(from)?.min(bytes.len());
        let to = usize::try_from(to)?.min(bytes.len());
        let mut out = BTreeMap::new();
        for l in String::from_utf8_lossy(&bytes[from..to]).lines() {
            if let Some(op) = operation(l) {
                *out.entry(op).or_default() += 1;
            }
        }
        Ok(out)
    }
}

/// `GET /v2.0/ports/{id}` from a uWSGI request line (`... [date] GET /v2.0/ports/<uuid>?x => ...`).
fn operation(line: &str) -> Option<String> {
    const METHODS: [&str; 5] = ["GET ", "POST ", "PUT ", "DELETE ", "PATCH "];
    let req = line.split("] ").find(|p| METHODS.iter().any(|m| p.starts_with(m)))?;
    let (method, rest) = req.split_once(' ')?;
    let path = rest.split(" => ").next()?.split('?').next()?;
    let path: Vec<&str> =
        path.split('/').map(|s| if s.len() == 36 && s.matches('-').count() == 4 { "{id}" } else { s }).collect();
    Some(format!("{method} {}", path.join("/")))
}

fn total(calls: &BTreeMap<String, usize>) -> usize {
    calls.values().sum()
}

fn describe(calls: &BTreeMap<String, usize>, per: f64) -> String {
    let mut v: Vec<(&String, &usize)> = calls.iter().collect();
    v.sort_by(|a, b| b.1.cmp(a.1));
    let parts: Vec<String> = v.iter().map(|(op, n)| format!("{op} {:.2}", **n as f64 / per)).collect();
    if parts.is_empty() { "none".into() } else { parts.join(", ") }
}

// ---- Octavia, read as an operator would ----

struct Octavia {
    http: reqwest::Client,
    base: String,
    project: String,
}

impl Octavia {
    async fn list(&self, what: &str, query: &str) -> Result<Vec<Value>> {
        let resp = self
            .http
            .get(format!("{}/v2/lbaas/{what}?{query}", self.base))
            .header("X-Project-Id", &self.project)
            .send()
            .await?;
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        ensure!(status.is_success(), "GET {what}?{query}: {status} {body}");
        let key = what.rsplit('/').next().unwrap_or(what);
        Ok(body[key].as_array().cloned().unwrap_or_default())
    }

    /// Whether the load balancer on `vip` is ACTIVE with exactly `members` (addresses), each
    /// ACTIVE.
    async fn converged(&self, vip: &str, members: &BTreeSet<String>) -> Result<bool> {
        let lbs = self.list("loadbalancers", &format!("vip_address={vip}")).await?;
        let Some(lb) = lbs.iter().find(|l| l["provisioning_status"] != "DELETED") else { return Ok(false) };
        if lb["provisioning_status"] != "ACTIVE" {
            return Ok(false);
        }
        let id = lb["id"].as_str().unwrap_or_default();
        let mut have = BTreeSet::new();
        for l in self.list("listeners", &format!("loadbalancer_id={id}")).await? {
            let Some(pid) = l["default_pool_id"].as_str() else { return Ok(false) };
            for m in self.list(&format!("pools/{pid}/members"), "").await? {
                if m["provisioning_status"] != "ACTIVE" {
                    return Ok(false);
                }
                have.insert(m["address"].as_str().unwrap_or_default().to_string());
            }
        }
        Ok(&have == members)
    }

    /// Waits until converged; returns when it was first seen so.
    async fn wait(&self, vip: &str, members: &BTreeSet<String>, logs: impl Fn() -> String) -> Result<Instant> {
        let deadline = Instant::now() + SLOW;
        loop {
            if self.converged(vip, members).await? {
                return Ok(Instant::now());
            }
            if Instant::now() > deadline {
                bail!("load balancer on {vip} not converged to {members:?} within {SLOW:?}\n{}", logs());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until no load balancer is left on `vip`.
    async fn wait_gone(&self, vip: &str) -> Result<()> {
        wait_until(&format!("the load balancer on {vip} to go"), SLOW, || async {
            let lbs = self.list("loadbalancers", &format!("vip_address={vip}")).await?;
            let left = lbs.iter().filter(|l| l["provisioning_status"] != "DELETED").count();
            ensure!(left == 0, "{left} left");
            Ok(())
        })
        .await
    }
}

// ---- the workload ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sys {
    Kuryr,
    Rs,
}

impl Sys {
    fn ns(self) -> &'static str {
        match self {
            Sys::Kuryr => NS_KURYR,
            Sys::Rs => NS_RS,
        }
    }
}

/// When each pod's port was handed out and (kuryr-rs) turned READY / (Kuryr) active, by pod
/// name, as the bench's watch saw it.
#[derive(Debug, Default)]
struct Seen {
    handed: HashMap<String, Instant>,
    ready: HashMap<String, Instant>,
}

fn kuryr_vif(kp: &DynamicObject) -> Option<(bool, Option<String>)> {
    let vif = &kp.data["status"]["vifs"]["eth0"]["vif"]["versioned_object.data"];
    vif["id"].as_str()?;
    let active = vif["active"].as_bool().unwrap_or(false);
    let subnets = vif["network"]["versioned_object.data"]["subnets"]["versioned_object.data"]["objects"].as_array();
    let ip = subnets.into_iter().flatten().find_map(|s| {
        let ips = s["versioned_object.data"]["ips"]["versioned_object.data"]["objects"].as_array()?;
        ips.iter()
            .filter_map(|i| i["versioned_object.data"]["address"].as_str())
            .find(|a| !a.contains(':'))
            .map(str::to_string)
    });
    Some((active, ip))
}

/// Watches the system's records (KuryrPorts or PodVifs) in its namespace into `seen`.
fn spawn_watch(sys: Sys, client: kube::Client, seen: Arc<Mutex<Seen>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        match sys {
            Sys::Kuryr => {
                let api: Api<DynamicObject> =
                    Api::namespaced_with(client, NS_KURYR, &kuryr::resource("KuryrPort", "kuryrports"));
                let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
                while let Some(ev) = events.next().await {
                    let now = Instant::now();
                    let Ok(Event::Apply(o) | Event::InitApply(o)) = ev else { continue };
                    let (Some(name), Some((active, _))) = (o.metadata.name.clone(), kuryr_vif(&o)) else { continue };
                    let mut s = lock(&seen);
                    s.handed.entry(name.clone()).or_insert(now);
                    if active {
                        s.ready.entry(name).or_insert(now);
                    }
                }
            }
            Sys::Rs => {
                let api: Api<PodVif> = Api::namespaced(client, NS_RS);
                let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
                while let Some(ev) = events.next().await {
                    let now = Instant::now();
                    let Ok(Event::Apply(o) | Event::InitApply(o)) = ev else { continue };
                    let Some(name) = o.metadata.name.clone() else { continue };
                    // The allocator's create carries the VIF (`spec.vif`); the status only the
                    // state plug reports change.
                    if o.vif().is_none() {
                        continue;
                    }
                    let mut s = lock(&seen);
                    s.handed.entry(name.clone()).or_insert(now);
                    if o.status.as_ref().and_then(|st| st.state) == Some(VifState::Ready) {
                        s.ready.entry(name).or_insert(now);
                    }
                }
            }
        }
    })
}

/// One phase's figures.
#[derive(Debug, Default)]
struct Phase {
    name: String,
    pods: usize,
    /// Pod created → port handed out, ms.
    handed: Vec<f64>,
    /// kuryr-rs: pod created → CNI ADD returned, ms.
    added: Vec<f64>,
    /// Pods whose port turned READY (kuryr-rs) / active (Kuryr) by the phase's end.
    ready: usize,
    /// Neutron calls of the phase's way in, and of the pool's creation with the ports it made.
    calls: BTreeMap<String, usize>,
    populate: Option<(BTreeMap<String, usize>, usize)>,
    /// CPU seconds of the way in: (controller side, node side).
    cpu: (f64, f64),
}

impl Phase {
    fn calls_per_pod(&self) -> f64 {
        total(&self.calls) as f64 / self.pods as f64
            + self.populate.as_ref().map_or(0.0, |(c, ports)| total(c) as f64 / *ports as f64)
    }
}

/// Service figures: created → converged (ms); each endpoint change → converged (ms).
#[derive(Debug, Default)]
struct SvcFigures {
    create: f64,
    changes: Vec<f64>,
}

/// One system's results.
#[derive(Debug, Default)]
struct Results {
    phases: Vec<Phase>,
    svc: SvcFigures,
    /// Idle PSS per process, KiB.
    idle: Vec<(String, bool, u64)>,
    peak: Peak,
}

struct Bench {
    c: NeutronCluster,
    pods: usize,
    members: usize,
    changes: usize,
    tck: f64,
    log: ApiLog,
    octavia: Octavia,
    svc_subnet: String,
}

/// The running parts of one system during a phase.
enum Running {
    Kuryr(KuryrController),
    Rs { alloc: Box<Svc> },
}

impl Bench {
    fn pod_spec(&self, name: &str, app: bool) -> Pod {
        let mut p = self.c.pod(name);
        if app {
            p.metadata.labels = Some([("app".to_string(), SVC.to_string())].into());
        }
        p
    }

    fn kuryr_config(&self, warm: bool) -> KuryrConfig {
        KuryrConfig {
            handlers: "vif,kuryrport,service,endpoints,kuryrloadbalancer".into(),
            service_subnet: Some(self.svc_subnet.clone()),
            extra: "[octavia_defaults]\nmember_mode = L2\nenforce_sg_rules = false\n".into(),
            vif_pool_driver: if warm { "neutron" } else { "noop" }.into(),
            pool_min: 2,
            pool_batch: if warm { u32::try_from(self.pods).unwrap_or(u32::MAX).saturating_add(3) } else { 3 },
            debug: false,
        }
    }

    /// Waits until `name`'s port is handed out (the watch saw it).
    async fn wait_handed(seen: &Mutex<Seen>, names: &[String], logs: impl Fn() -> String) -> Result<()> {
        let deadline = Instant::now() + SLOW;
        loop {
            let missing = names.iter().filter(|n| !lock(seen).handed.contains_key(*n)).count();
            if missing == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{missing} of {} pods without a port after {SLOW:?}\n{}", names.len(), logs());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Creates the primer pod and waits for its port; for a warm Kuryr also the pool's
    /// creation (returns its calls and the free ports made).
    async fn primer(
        &self,
        sys: Sys,
        phase: &str,
        seen: &Mutex<Seen>,
        binder: Option<&Arc<Binder>>,
        logs: &dyn Fn() -> String,
    ) -> Result<CniPod> {
        let api: Api<Pod> = Api::namespaced(self.c.admin.clone(), sys.ns());
        let name = format!("{phase}-primer");
        let made = api.create(&PostParams::default(), &self.pod_spec(&name, false)).await?;
        let pod = CniPod {
            namespace: sys.ns().into(),
            name: name.clone(),
            uid: made.metadata.uid.context("no uid")?,
            netns: Arc::new(Netns::new("kbp")?),
        };
        Self::wait_handed(seen, std::slice::from_ref(&name), logs).await?;
        if let Some(b) = binder {
            let (p, b) = (pod.clone(), b.clone());
            let out = tokio::task::spawn_blocking(move || p.run("ADD", &b, None, SLOW)).await??;
            ensure!(out.code == 0, "ADD of the primer: {} {}", out.stdout, out.stderr);
        }
        Ok(pod)
    }

    /// Kuryr's free pool ports on the pod network.
    async fn kuryr_free_ports(&self) -> Result<Vec<String>> {
        let f = Filter::new().network_id(&self.c.net.network_id).device_owner("compute:kuryr");
        let ports = self.c.neutron.list_ports(&f).await?;
        Ok(ports.into_iter().filter(|p| p.device_id.is_empty() && p.name == "kuryr-pool-port").map(|p| p.id).collect())
    }

    /// After Kuryr stopped: its pods and KuryrPorts without finalizers, deleted; its ports on the
    /// pod network deleted.
    async fn kuryr_cleanup(&self, pods: &Api<Pod>) -> Result<()> {
        let kps: Api<DynamicObject> =
            Api::namespaced_with(self.c.admin.clone(), NS_KURYR, &kuryr::resource("KuryrPort", "kuryrports"));
        let unfinalize = Patch::Merge(json!({"metadata": {"finalizers": null}}));
        let grace0 = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
        for p in pods.list(&ListParams::default()).await? {
            let name = p.metadata.name.unwrap_or_default();
            pods.patch(&name, &PatchParams::default(), &unfinalize).await?;
        }
        pods.delete_collection(&grace0, &ListParams::default()).await?;
        for kp in kps.list(&ListParams::default()).await? {
            let name = kp.metadata.name.unwrap_or_default();
            kps.patch(&name, &PatchParams::default(), &unfinalize).await?;
        }
        kps.delete_collection(&DeleteParams::default(), &ListParams::default()).await?;
        wait_until("Kuryr's pods and KuryrPorts to be gone", SLOW, || async {
            let left = pods.list(&ListParams::default()).await?.items.len()
                + kps.list(&ListParams::default()).await?.items.len();
            ensure!(left == 0, "{left} left");
            Ok(())
        })
        .await?;
        let f = Filter::new().network_id(&self.c.net.network_id).device_owner("compute:kuryr");
        for p in self.c.neutron.list_ports(&f).await? {
            self.c.neutron.delete_port(&p.id).await?;
        }
        Ok(())
    }

    /// One pod phase of one system; `last` runs the Service stage before the teardown.
    #[allow(clippy::too_many_arguments)]
    async fn phase(
        &self,
        sys: Sys,
        name: &str,
        warm: bool,
        rate: f64,
        seen: &Arc<Mutex<Seen>>,
        procs: &Arc<Mutex<Procs>>,
        base: &Procs,
        watcher: Option<&Svc>,
        binder: &mut Option<Arc<Binder>>,
        idle: Option<&mut Vec<(String, bool, u64)>>,
        svc: Option<&mut SvcFigures>,
        peak: &Mutex<Peak>,
    ) -> Result<Phase> {
        eprintln!("# {sys:?} {name}: {} pods at {rate} pods/s", self.pods);
        let tag = name.replace([',', ' ', '/'], "-").replace("--", "-");
        let mut ph = Phase { name: name.into(), ..Default::default() };
        // Start the controller (Kuryr) or allocator (kuryr-rs) of the phase.
        let mut running = match sys {
            Sys::Kuryr => {
                let dir = self.c.dir.path().join(format!("kuryr-{tag}"));
                Running::Kuryr(KuryrController::start(&self.c, &dir, &self.kuryr_config(warm)).await?)
            }
            Sys::Rs => {
                let w = watcher.context("no watcher")?;
                let o = AllocatorOptions {
                    cluster_id: format!("bench-kuryr-{tag}"),
                    pool_min: if warm { 5 } else { 0 },
                    pool_batch: if warm { 10 } else { 0 },
                    status_poll_min: None,
                    instance: "bench-kuryr".into(),
                    log: "info".into(),
                    extra: vec![
                        "--pool-max".into(),
                        "0".into(),
                        "--neutron-transport-url".into(),
                        self.c.transport_url(false)?,
                    ],
                };
                let alloc = self.c.allocator(w, &o)?;
                alloc.wait_ready(SLOW).await?;
                wait_until("the allocator to consume Neutron's port events", SLOW, || async {
                    let m = alloc.metrics().await?;
                    ensure!(
                        kuryr_tests::neutron::metric_sum(&m, "kuryr_allocator_neutron_events_connected", &[]) == 1.0
                    );
                    Ok(())
                })
                .await?;
                if binder.is_none() {
                    *binder = Some(Arc::new(self.c.binder(&alloc, SLOW, &[]).await?));
                }
                Running::Rs { alloc: Box::new(alloc) }
            }
        };
        let logs = |r: &Running| match r {
            Running::Kuryr(k) => format!("Kuryr's log:\n{}", k.log_tail()),
            Running::Rs { alloc } => format!("allocator:\n{}", alloc.proc.logs()),
        };
        let mut p = base.clone();
        match &running {
            Running::Kuryr(k) => p.0.push(("kuryr-k8s-controller".into(), k.pid(), false)),
            Running::Rs { alloc } => {
                p.0.push(("kuryr-vif-allocator".into(), alloc.proc.pid().context("allocator pid")?, false));
                let b = binder.as_ref().context("no binder")?;
                p.0.push(("kuryr-binder".into(), b.pid().context("binder pid")?, true));
            }
        }
        *lock(procs) = p.clone();
        // Warm, Kuryr's pool is made on the primer's request.
        let pool_from = self.log.offset();
        let b = binder.clone();
        let primer = {
            let r = &running;
            self.primer(sys, &tag, seen, b.as_ref(), &|| logs(r)).await?
        };
        let pool_to = self.log.offset();
        if let Some(idle) = idle {
            tokio::time::sleep(Duration::from_secs(5)).await;
            *idle = p.pss();
        }
        lock(peak).armed = true;
        // The warm pool.
        match (&running, warm) {
            (Running::Kuryr(_), true) => {
                // The primer's request made the pool (ports_pool_batch = pods + 3).
                let free = self.kuryr_free_ports().await?;
                ensure!(free.len() >= self.pods, "Kuryr's pool has {} free ports, not {}", free.len(), self.pods);
                ph.populate = Some((self.log.calls(pool_from, pool_to)?, free.len() + 1));
                eprintln!("  Kuryr's pool: {} free ports", free.len());
            }
            (Running::Rs { alloc }, true) => {
                let from = self.log.offset();
                let mut pm = PoolManagerClient::new(alloc.channel()?);
                let key = PoolKey { node_name: self.c.node.host.clone(), ..Default::default() };
                // The phase's pods and the pool minimum, within PopulatePool's bound (100).
                let count = (u32::try_from(self.pods)? + 5).min(100);
                // A refill of the pool in flight (the primer took a port) can answer first with
                // fewer ports than asked: asked again until the pool holds them.
                let mut pool =
                    pm.populate_pool(PopulatePoolRequest { key: Some(key.clone()), count }).await?.into_inner();
                for _ in 0..10 {
                    if pool.free_port_ids.len() >= self.pods {
                        break;
                    }
                    eprintln!("  PopulatePool answered with {} free ports; asking again", pool.free_port_ids.len());
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    pool = pm.populate_pool(PopulatePoolRequest { key: Some(key.clone()), count }).await?.into_inner();
                }
                ensure!(pool.free_port_ids.len() >= self.pods, "populated pool too small: {pool:?}");
                ph.populate = Some((self.log.calls(from, self.log.offset())?, pool.free_port_ids.len()));
                eprintln!("  pool populated: {} free ports", pool.free_port_ids.len());
            }
            _ => {}
        }

        // The measured pods.
        let api: Api<Pod> = Api::namespaced(self.c.admin.clone(), sys.ns());
        let cpu0 = p.cpu(self.tck);
        let from = self.log.offset();
        let start = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..self.pods {
            tokio::time::sleep_until((start + Duration::from_secs_f64(i as f64 / rate)).into()).await;
            let pod_name = format!("{tag}-{i}");
            let spec = self.pod_spec(&pod_name, true);
            let netns = if sys == Sys::Rs { Some(Arc::new(Netns::new("kb")?)) } else { None };
            let (api, b) = (api.clone(), binder.clone());
            tasks.push(tokio::spawn(async move {
                let created = Instant::now();
                let made = api.create(&PostParams::default(), &spec).await?;
                let uid = made.metadata.uid.context("no uid")?;
                let (Some(netns), Some(b)) = (netns, b) else {
                    return Ok::<_, anyhow::Error>((pod_name, created, None));
                };
                let pod = CniPod { namespace: NS_RS.into(), name: pod_name.clone(), uid, netns };
                let out = tokio::task::spawn_blocking({
                    let pod = pod.clone();
                    move || pod.run("ADD", &b, None, SLOW)
                })
                .await??;
                ensure!(out.code == 0, "ADD {pod_name}: {} {}", out.stdout, out.stderr);
                Ok((pod_name, created, Some((pod, Instant::now()))))
            }));
        }
        let mut done = Vec::new();
        for t in tasks {
            done.push(t.await?.map_err(|e| anyhow::anyhow!("{e:#}\n{}", logs(&running)))?);
        }
        let names: Vec<String> = done.iter().map(|d| d.0.clone()).collect();
        Self::wait_handed(seen, &names, || logs(&running)).await?;
        ph.calls = self.log.calls(from, self.log.offset())?;
        let cpu1 = p.cpu(self.tck);
        ph.cpu = (cpu1.0 - cpu0.0, cpu1.1 - cpu0.1);
        eprintln!(
            "  all {} ports handed out {:.1} s after the first create",
            done.len(),
            start.elapsed().as_secs_f64()
        );
        {
            let s = lock(seen);
            for (n, created, added) in &done {
                if let Some(at) = s.handed.get(n) {
                    ph.handed.push(ms(at.saturating_duration_since(*created)));
                }
                if let Some((_, at)) = added {
                    ph.added.push(ms(at.saturating_duration_since(*created)));
                }
                if s.ready.contains_key(n) {
                    ph.ready += 1;
                }
            }
        }
        ph.pods = done.len();

        if let Some(svc) = svc {
            *svc = self.service_stage(sys, &names, &|| logs(&running)).await?;
        }

        // Teardown: DEL (kuryr-rs), pods deleted, their ports released by the system.
        let grace0 = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
        let mut cni: Vec<CniPod> = done.into_iter().filter_map(|d| d.2.map(|a| a.0)).collect();
        if sys == Sys::Rs {
            cni.push(primer.clone());
        }
        match &mut running {
            Running::Kuryr(k) => {
                // Kuryr releases a port only once its activation (polling the port, which no CNI
                // plugs here) has given up: stopped instead, its finalizers removed and its
                // ports deleted by the bench, so that every phase starts from none.
                k.stop();
                self.kuryr_cleanup(&api).await?;
            }
            Running::Rs { alloc } => {
                let dels: Vec<_> = cni
                    .iter()
                    .map(|pod| {
                        let (pod, b) = (pod.clone(), binder.clone());
                        tokio::task::spawn_blocking(move || match b {
                            Some(b) => pod.run("DEL", &b, None, SLOW).map(|o| o.code),
                            None => Ok(0),
                        })
                    })
                    .collect();
                for t in dels {
                    ensure!(t.await?? == 0, "DEL failed");
                }
                api.delete_collection(&grace0, &ListParams::default()).await?;
                objects::wait_no_pods(&api, "the phase's pods to be gone", SLOW)
                    .await
                    .map_err(|e| anyhow::anyhow!("{e:#}\n{}", alloc.proc.logs()))?;
                alloc.proc.terminate(Duration::from_secs(10)).await?;
            }
        }
        Ok(ph)
    }

    /// The Service stage on the phase's pods `names` (their addresses from the watch).
    async fn service_stage(&self, sys: Sys, names: &[String], logs: &dyn Fn() -> String) -> Result<SvcFigures> {
        let ns = sys.ns();
        let vip = if sys == Sys::Kuryr { KURYR_VIP } else { RS_VIP };
        let pods: Api<Pod> = Api::namespaced(self.c.admin.clone(), ns);
        let mut backends: Vec<(String, String, String)> = Vec::new();
        for n in names.iter().take(self.members + self.changes) {
            let pod = pods.get(n).await?;
            backends.push((n.clone(), pod.metadata.uid.unwrap_or_default(), String::new()));
        }
        let ips = self.ips(sys, names).await?;
        for b in &mut backends {
            b.2 = ips.get(&b.0).cloned().with_context(|| format!("no address of {}", b.0))?;
        }
        if sys == Sys::Kuryr {
            // What kubelet reports once the sandbox runs: Kuryr finds a member's pod by it.
            for (n, _, ip) in &backends {
                let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
                pods.patch_status(n, &PatchParams::default(), &Patch::Merge(status)).await?;
            }
        }
        let vip_port = if sys == Sys::Kuryr {
            let ks = self.c.os.keystone().context("no Keystone")?;
            let net = self.c.neutron.get_subnet(&self.svc_subnet).await?.network_id;
            Some(
                self.c
                    .neutron
                    .create_port(PortCreate {
                        network_id: net,
                        name: Some("octavia-lb-vip".into()),
                        project_id: Some(ks.project_id.clone()),
                        fixed_ips: Some(vec![FixedIp {
                            subnet_id: Some(self.svc_subnet.clone()),
                            ip_address: Some(vip.into()),
                        }]),
                        device_owner: Some("Octavia".into()),
                        ..Default::default()
                    })
                    .await?,
            )
        } else {
            None
        };
        let services: Api<Service> = Api::namespaced(self.c.admin.clone(), ns);
        let eps: Api<Endpoints> = Api::namespaced(self.c.admin.clone(), ns);
        let slices: Api<EndpointSlice> = Api::namespaced(self.c.admin.clone(), ns);
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": SVC},
            "spec": {"clusterIP": vip, "selector": {"app": SVC},
                     "ports": [{"name": "http", "port": 80, "targetPort": TARGET_PORT, "protocol": "TCP"}]},
        }))?;
        let set = |from: usize| -> (Vec<(String, String, String)>, BTreeSet<String>) {
            let v: Vec<_> = backends[from..from + self.members].to_vec();
            let s = v.iter().map(|b| b.2.clone()).collect();
            (v, s)
        };
        let write = |v: Vec<(String, String, String)>| {
            let (eps, slices) = (eps.clone(), slices.clone());
            async move {
                let e = endpoints(ns, &v)?;
                match eps.get_opt(SVC).await? {
                    None => drop(eps.create(&PostParams::default(), &e).await?),
                    Some(old) => {
                        let mut e = e;
                        e.metadata.resource_version = old.metadata.resource_version;
                        eps.replace(SVC, &PostParams::default(), &e).await?;
                    }
                }
                sut::put_slice(&slices, slice(ns, &v)?).await
            }
        };
        let (first, want) = set(0);
        let created = Instant::now();
        services.create(&PostParams::default(), &svc).await?;
        write(first).await?;
        let at = self.octavia.wait(vip, &want, logs).await?;
        let mut fig = SvcFigures { create: ms(at - created), changes: Vec::new() };
        eprintln!(
            "  Service with {} endpoints → load balancer ACTIVE with members: {:.0} ms",
            self.members, fig.create
        );
        for j in 1..=self.changes {
            let (v, want) = set(j);
            let t = Instant::now();
            write(v).await?;
            let at = self.octavia.wait(vip, &want, logs).await?;
            fig.changes.push(ms(at - t));
        }
        eprintln!("  endpoint changes → converged: {:?} ms", fig.changes.iter().map(|v| v.round()).collect::<Vec<_>>());
        // Removed while the system runs (its finalizers); then the VIP port.
        services.delete(SVC, &DeleteParams::default()).await?;
        // Either may be gone already with the Service.
        let dp = DeleteParams::default();
        if eps.get_opt(SVC).await?.is_some() {
            eps.delete(SVC, &dp).await?;
        }
        if slices.get_opt(&format!("{SVC}-1")).await?.is_some() {
            slices.delete(&format!("{SVC}-1"), &dp).await?;
        }
        wait_until("the Service to be gone", SLOW, || async {
            ensure!(services.get_opt(SVC).await?.is_none(), "still there (finalizer)");
            Ok(())
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\n{}", logs()))?;
        self.octavia.wait_gone(vip).await?;
        if let Some(p) = vip_port {
            self.c.neutron.delete_port(&p.id).await?;
        }
        Ok(fig)
    }

    /// The pods' IPv4 addresses from the system's records.
    async fn ips(&self, sys: Sys, names: &[String]) -> Result<HashMap<String, String>> {
        let mut out = HashMap::new();
        match sys {
            Sys::Kuryr => {
                let kps: Api<DynamicObject> =
                    Api::namespaced_with(self.c.admin.clone(), NS_KURYR, &kuryr::resource("KuryrPort", "kuryrports"));
                for n in names {
                    if let Some((_, Some(ip))) = kps.get_opt(n).await?.as_ref().and_then(kuryr_vif) {
                        out.insert(n.clone(), ip);
                    }
                }
            }
            Sys::Rs => {
                let vifs: Api<PodVif> = Api::namespaced(self.c.admin.clone(), NS_RS);
                for n in names {
                    let v = vifs.get_opt(n).await?.and_then(|v| v.vif().cloned());
                    if let Some(ip) = v.and_then(|v| {
                        v.ips
                            .iter()
                            .map(|i| i.address.split('/').next().unwrap_or_default().to_string())
                            .find(|a| !a.contains(':'))
                    }) {
                        out.insert(n.clone(), ip);
                    }
                }
            }
        }
        Ok(out)
    }
}

fn endpoints(ns: &str, pods: &[(String, String, String)]) -> Result<Endpoints> {
    let addresses: Vec<Value> = pods
        .iter()
        .map(|(name, uid, ip)| json!({"ip": ip, "targetRef": {"kind": "Pod", "namespace": ns, "name": name, "uid": uid}}))
        .collect();
    Ok(serde_json::from_value(json!({
        "metadata": {"name": SVC, "namespace": ns},
        "subsets": [{"addresses": addresses, "ports": [{"name": "http", "port": TARGET_PORT, "protocol": "TCP"}]}],
    }))?)
}

fn slice(ns: &str, pods: &[(String, String, String)]) -> Result<EndpointSlice> {
    let eps: Vec<Value> = pods
        .iter()
        .map(|(name, uid, ip)| {
            let mut e = sut::ready_endpoint(ip);
            e["targetRef"] = json!({"kind": "Pod", "namespace": ns, "name": name, "uid": uid});
            e
        })
        .collect();
    sut::slice(
        &format!("{SVC}-1"),
        SVC,
        "IPv4",
        json!([{"name": "http", "port": TARGET_PORT, "protocol": "TCP"}]),
        Value::Array(eps),
    )
}

fn main() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build()?;
    let result = rt.block_on(run());
    // A shim call still running after a failure is not waited for.
    rt.shutdown_timeout(Duration::from_secs(5));
    result
}

async fn run() -> Result<()> {
    let pods: usize = env_or("BENCH_KURYR_PODS", 100)?;
    let members: usize = env_or("BENCH_KURYR_MEMBERS", 10)?;
    let changes: usize = env_or("BENCH_KURYR_CHANGES", 3)?;
    ensure!(
        members > 0 && pods >= members + changes,
        "BENCH_KURYR_PODS must be at least BENCH_KURYR_MEMBERS + BENCH_KURYR_CHANGES"
    );
    let load_start = loadavg();
    kuryr::setup()?;
    let t0 = Instant::now();
    let c = NeutronCluster::start_with_octavia(&[NS_KURYR, NS_RS]).await?;
    eprintln!("# API server, Keystone, Neutron and Octavia up in {:.1} s", t0.elapsed().as_secs_f64());
    kuryr::apply_crds(&c).await?;
    let ks = c.os.keystone().context("no Keystone")?;
    let octavia = Octavia {
        http: reqwest::Client::new(),
        base: c.os.octavia_url().context("no Octavia")?.to_string(),
        project: ks.project_id.clone(),
    };
    // The Service subnet: the API server's Service range, in Kuryr's project.
    let (_, svc_sub) = topology::service_network(&c.neutron, Some(&ks.project_id)).await?;
    let log = ApiLog(c.os.state_dir().join("logs/neutron-api.log"));
    let bench = Bench { c, pods, members, changes, tck: clock_ticks(), log, octavia, svc_subnet: svc_sub.id.clone() };

    let phases: Vec<(String, bool, f64)> = [false, true]
        .iter()
        .flat_map(|warm| {
            RATES.iter().map(move |r| (format!("{}, {r} pods/s", if *warm { "warm" } else { "cold" }), *warm, *r))
        })
        .collect();
    let only = std::env::var("BENCH_KURYR_ONLY").unwrap_or_default();
    let systems: Vec<Sys> = match only.as_str() {
        "" => vec![Sys::Kuryr, Sys::Rs],
        "kuryr" => vec![Sys::Kuryr],
        "kuryr-rs" => vec![Sys::Rs],
        other => bail!("BENCH_KURYR_ONLY={other:?}: kuryr or kuryr-rs"),
    };
    let mut results: Vec<(Sys, Results)> = Vec::new();
    for sys in systems {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let watch = spawn_watch(sys, bench.c.admin.clone(), seen.clone());
        let procs = Arc::new(Mutex::new(Procs::default()));
        let mut base = Procs::default();
        // kuryr-rs' long-lived parts: the watcher and lbaas (started now: idle when measured).
        let mut keep: (Option<Svc>, Option<Sut>) = (None, None);
        if sys == Sys::Rs {
            let watcher = bench.c.watcher()?;
            let o = OctaviaLbaas {
                url: bench.octavia.base.clone(),
                project: bench.octavia.project.clone(),
                vip_subnet: Some(svc_sub.id.clone()),
                cluster_name: "bench-kuryr".into(),
                drift_interval: "60s".into(),
                active_timeout: "120s".into(),
            };
            let lbaas = bench.c.lbaas(&watcher, &o, &[]).await?;
            lbaas.wait_serving(LOAD_BALANCERS, SLOW).await?;
            base.0.push(("kuryr-watcher".into(), watcher.proc.pid().context("watcher pid")?, false));
            base.0.push(("kuryr-lbaas".into(), lbaas.proc.pid().context("lbaas pid")?, false));
            keep = (Some(watcher), Some(lbaas));
        }
        let peak = Arc::new(Mutex::new(Peak::default()));
        let mut binder: Option<Arc<Binder>> = None;
        let mut res = Results::default();
        let sampler = spawn_sampler(procs.clone(), peak.clone());
        for (i, (name, warm, rate)) in phases.iter().enumerate() {
            let idle = (i == 0).then_some(&mut res.idle);
            let svc = (i + 1 == phases.len()).then_some(&mut res.svc);
            let p = bench
                .phase(sys, name, *warm, *rate, &seen, &procs, &base, keep.0.as_ref(), &mut binder, idle, svc, &peak)
                .await;
            res.phases.push(p.map_err(|e| anyhow::anyhow!("{sys:?} {name}: {e:#}"))?);
        }
        sampler.abort();
        watch.abort();
        res.peak = std::mem::take(&mut *lock(&peak));
        res.peak.armed = false;
        if let Some(mut b) = binder.and_then(|b| Arc::try_unwrap(b).ok()) {
            b.stop().await?;
        }
        drop(keep);
        results.push((sys, res));
    }
    report(&bench, &results, &load_start);
    Ok(())
}

fn fmt_ms(s: Option<Stats>, p99: bool) -> String {
    s.map_or("-".into(), |s| format!("{:.0} ms", if p99 { s.p99 } else { s.p50 }))
}

fn ratio(rs: f64, k: f64) -> String {
    if k > 0.0 && rs.is_finite() { format!("{:.2}", rs / k) } else { "-".into() }
}

fn report(bench: &Bench, results: &[(Sys, Results)], load_start: &str) {
    println!();
    println!(
        "kuryr-bench: Kuryr-Kubernetes 10.0.0 (kuryr-k8s-controller) then kuryr-rs, {} pods per phase, {} endpoints, {} changes; \
         kuryr-rs {} build; load average {load_start} at the start, {} at the end",
        bench.pods,
        bench.members,
        bench.changes,
        if cfg!(debug_assertions) { "debug" } else { "release" },
        loadavg()
    );
    for (sys, res) in results {
        println!();
        println!("# {sys:?}");
        for p in &res.phases {
            let h = Stats::of(&p.handed);
            println!(
                "  {:<18} created → port handed out: n {} p50 {} p99 {} max {}",
                p.name,
                h.map_or(0, |s| s.n),
                fmt_ms(h, false),
                fmt_ms(h, true),
                h.map_or("-".into(), |s| format!("{:.0} ms", s.max))
            );
            if let Some(a) = Stats::of(&p.added) {
                println!("  {:<18} created → CNI ADD returned: p50 {:.0} ms p99 {:.0} ms", "", a.p50, a.p99);
            }
            println!(
                "  {:<18} ports turned {} by the end: {} of {}",
                "",
                if *sys == Sys::Kuryr { "active (KuryrPort)" } else { "READY (PodVif)" },
                p.ready,
                p.pods
            );
            println!(
                "  {:<18} Neutron calls per pod {:.2}: {}",
                "",
                p.calls_per_pod(),
                describe(&p.calls, p.pods as f64)
            );
            if let Some((c, ports)) = &p.populate {
                println!("  {:<18} pool creation: {ports} ports, {} calls ({})", "", total(c), describe(c, 1.0));
            }
            println!("  {:<18} CPU s: controller side {:.2}, node side {:.2}", "", p.cpu.0, p.cpu.1);
        }
        let idle: Vec<String> = res.idle.iter().map(|(n, _, k)| format!("{n} {:.1} MiB", *k as f64 / 1024.0)).collect();
        let peak: Vec<String> =
            res.peak.by_name.iter().map(|(n, k)| format!("{n} {:.1} MiB", *k as f64 / 1024.0)).collect();
        println!("  PSS idle: {}; peak under load: {}", idle.join(", "), peak.join(", "));
    }

    let (Some((_, k)), Some((_, r))) =
        (results.iter().find(|x| x.0 == Sys::Kuryr), results.iter().find(|x| x.0 == Sys::Rs))
    else {
        println!("(one system only: no side-by-side table)");
        return;
    };
    println!();
    println!("{:<52} {:>22} {:>22} {:>12}", "# side by side", "Kuryr", "kuryr-rs", "rs/Kuryr");
    let row = |label: &str, kv: String, rv: String, rt: String| println!("{label:<52} {kv:>22} {rv:>22} {rt:>12}");
    for (pk, pr) in k.phases.iter().zip(&r.phases) {
        let (sk, sr) = (Stats::of(&pk.handed), Stats::of(&pr.handed));
        for (label, p99) in [("p50", false), ("p99", true)] {
            let v = |s: Option<Stats>| s.map_or(f64::NAN, |s| if p99 { s.p99 } else { s.p50 });
            row(
                &format!("created → port handed out, {}, {label}", pk.name),
                fmt_ms(sk, p99),
                fmt_ms(sr, p99),
                ratio(v(sr), v(sk)),
            );
        }
    }
    for pr in &r.phases {
        let a = Stats::of(&pr.added);
        row(
            &format!("created → CNI ADD returned, {}, p50/p99", pr.name),
            "fails (below)".into(),
            a.map_or("-".into(), |a| format!("{:.0}/{:.0} ms", a.p50, a.p99)),
            "-".into(),
        );
    }
    for (pk, pr) in k.phases.iter().zip(&r.phases) {
        row(
            &format!("Neutron calls per pod, {}", pk.name),
            format!("{:.2}", pk.calls_per_pod()),
            format!("{:.2}", pr.calls_per_pod()),
            ratio(pr.calls_per_pod(), pk.calls_per_pod()),
        );
    }
    row(
        &format!("Service, {} endpoints → LB ACTIVE with members", bench.members),
        format!("{:.0} ms", k.svc.create),
        format!("{:.0} ms", r.svc.create),
        ratio(r.svc.create, k.svc.create),
    );
    let (ck, cr) = (Stats::of(&k.svc.changes), Stats::of(&r.svc.changes));
    row(
        "endpoint change → Octavia converged, p50",
        fmt_ms(ck, false),
        fmt_ms(cr, false),
        ratio(cr.map_or(f64::NAN, |s| s.p50), ck.map_or(f64::NAN, |s| s.p50)),
    );
    let mib = |v: u64| v as f64 / 1024.0;
    let idle = |res: &Results, node: Option<bool>| -> f64 {
        mib(res.idle.iter().filter(|(_, n, _)| node.is_none_or(|x| x == *n)).map(|(_, _, k)| k).sum())
    };
    row(
        "memory PSS idle, every process",
        format!("{:.1} MiB", idle(k, None)),
        format!("{:.1} MiB", idle(r, None)),
        ratio(idle(r, None), idle(k, None)),
    );
    row(
        "memory PSS idle, controller side",
        format!("{:.1} MiB", idle(k, Some(false))),
        format!("{:.1} MiB", idle(r, Some(false))),
        ratio(idle(r, Some(false)), idle(k, Some(false))),
    );
    let (pk, pr) = (mib(k.peak.controller + k.peak.node), mib(r.peak.controller + r.peak.node));
    row("memory PSS peak under load, every process", format!("{pk:.1} MiB"), format!("{pr:.1} MiB"), ratio(pr, pk));
    let (pk, pr) = (mib(k.peak.controller), mib(r.peak.controller));
    row("memory PSS peak under load, controller side", format!("{pk:.1} MiB"), format!("{pr:.1} MiB"), ratio(pr, pk));
    let cpu = |res: &Results, node: bool| -> f64 {
        let pods: usize = res.phases.iter().map(|p| p.pods).sum();
        let s: f64 = res.phases.iter().map(|p| p.cpu.0 + if node { p.cpu.1 } else { 0.0 }).sum();
        100.0 * s / pods.max(1) as f64
    };
    row(
        "CPU s per 100 pods (derived), every process",
        format!("{:.2}", cpu(k, true)),
        format!("{:.2}", cpu(r, true)),
        ratio(cpu(r, true), cpu(k, true)),
    );
    row(
        "CPU s per 100 pods (derived), controller side",
        format!("{:.2}", cpu(k, false)),
        format!("{:.2}", cpu(r, false)),
        ratio(cpu(r, false), cpu(k, false)),
    );
    println!("Kuryr's CNI ADD: {KURYR_CNI_FAILS}");
    println!(
        "port handed out: Kuryr = KuryrPort status.vifs.eth0 written; kuryr-rs = PodVif spec.vif written (its create). \
         Controller side: Kuryr = kuryr-k8s-controller; kuryr-rs = watcher + vif-allocator + lbaas (node side: binder). \
         Ratios and per-100-pod figures are derived."
    );
}
