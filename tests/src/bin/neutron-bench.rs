//! `make bench-neutron`: kuryr-vif-allocator `--backend neutron` against the real Neutron (API,
//! RPC server, ML2/OVS agent on a userspace Open vSwitch) and Keystone, with a kuryr-binder on
//! the Neutron node's `br-int` and CNI through the kuryr-cni shim; optimised binaries from
//! `KURYR_BIN_DIR` (the harness is [`kuryr_tests::neutron`]).
//!
//! Pods are created through the API at a steady rate; right after each create the bench runs
//! CNI ADD for it (as a kubelet that saw the pod would), which returns once the port is plugged
//! and Neutron reports it ACTIVE. Two phases, each with a fresh allocator:
//! - **cold**: pools off (`--pool-batch 0`): every pod's port is created on its path;
//! - **warm**: the node's pool populated first through the PoolManager API with a port for every
//!   pod (plus the pool minimum, so no refill runs during the phase).
//!
//! For each pod: pod created → ADD returned; pod created → port first seen ACTIVE; port first
//! seen ACTIVE → ADD returned. "First seen ACTIVE" comes from an outside poller listing the pod
//! network's ACTIVE ports every `BENCH_NEUTRON_POLL_MS` (default 15) and noting, per port, the
//! send time of the first answer that has it, so the figure is exact to about one poll period
//! (printed). Neutron API calls per pod come from the allocator's `openstack_requests_total`
//! (by operation) and `kuryr_allocator_neutron_status_polls_total`, as deltas over each part.
//!
//! Environment: `BENCH_NEUTRON_PODS` (per phase, default 40), `BENCH_NEUTRON_RATE` (pods/s,
//! default 2), `BENCH_NEUTRON_POLL_MS` (default 15), `BENCH_NEUTRON_STATUS_POLL` (the
//! allocator's `--status-poll-min`, its default when unset).
#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_proto::allocator::v1::pool_manager_client::PoolManagerClient;
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::{GetVifRequest, PoolKey, PopulatePoolRequest};
use kuryr_tests::binder::Binder;
use kuryr_tests::netns::Netns;
use kuryr_tests::neutron::{AllocatorOptions, CniPod, NeutronCluster, Svc, metric_sum};
use kuryr_tests::services::wait_until;
use kuryr_tests::stats::Stats;
use serde_json::Value;

const NS: &str = "bench-neutron";
/// Bound on one ADD and on a phase's teardown (Neutron and its agent are slow when loaded).
const SLOW: Duration = Duration::from_secs(180);
/// Pool minimum of the warm phase.
const WARM_POOL_MIN: u32 = 5;
/// Ports per bulk create in the warm phase.
const WARM_POOL_BATCH: u32 = 10;

/// Targets.
const TARGET_ACTIVE_TO_ADD_MS: f64 = 200.0;
const TARGET_WARM_CALLS_PER_POD: f64 = 1.2;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => {
            v.trim().parse().map_err(|e| anyhow::anyhow!("{name}={v:?} is not a valid value: {e}"))
        }
        _ => Ok(default),
    }
}

/// What the outside poller saw: the first time each port was listed ACTIVE.
#[derive(Debug, Default)]
struct Seen {
    first_active: HashMap<String, Instant>,
    rounds: u64,
    /// Sum of the time between two consecutive requests.
    period_total: Duration,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Lists the pod network's ACTIVE ports every `every`, until aborted.
fn spawn_poller(c: &NeutronCluster, every: Duration, seen: Arc<Mutex<Seen>>) -> tokio::task::JoinHandle<()> {
    let url = format!("{}/v2.0/ports?network_id={}&status=ACTIVE&fields=id", c.neutron_url, c.net.network_id);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap_or_default();
    tokio::spawn(async move {
        let mut last: Option<Instant> = None;
        loop {
            let sent = Instant::now();
            if let Ok(resp) = http.get(&url).send().await
                && let Ok(body) = resp.json::<Value>().await
            {
                let mut s = lock(&seen);
                for p in body["ports"].as_array().into_iter().flatten() {
                    if let Some(id) = p["id"].as_str() {
                        s.first_active.entry(id.to_string()).or_insert(sent);
                    }
                }
                if let Some(l) = last {
                    s.rounds += 1;
                    s.period_total += sent.duration_since(l);
                }
                last = Some(sent);
            }
            tokio::time::sleep(every).await;
        }
    })
}

/// Network calls by operation (`openstack_requests_total{service="network"}`).
fn network_calls(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for l in text.lines().filter(|l| l.starts_with("openstack_requests_total{") && l.contains(r#"service="network""#)) {
        let Some(op) = l.split("operation=\"").nth(1).and_then(|r| r.split('"').next()) else { continue };
        let Some(v) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        *out.entry(op.to_string()).or_default() += v;
    }
    out
}

/// Calls made between two scrapes: by operation, with the batched status reads apart from the
/// other `ports.list` calls (look-ups).
#[derive(Debug, Default, Clone)]
struct Calls {
    by_op: BTreeMap<String, f64>,
    status_reads: f64,
}

impl Calls {
    fn between(before: &str, after: &str) -> Calls {
        let (b, a) = (network_calls(before), network_calls(after));
        let mut by_op = BTreeMap::new();
        for (op, v) in &a {
            let d = v - b.get(op).copied().unwrap_or(0.0);
            if d > 0.0 {
                by_op.insert(op.clone(), d);
            }
        }
        let polls = |t: &str| metric_sum(t, "kuryr_allocator_neutron_status_polls_total", &[]);
        let status_reads = polls(after) - polls(before);
        if let Some(list) = by_op.get_mut("ports.list") {
            *list -= status_reads;
            if *list <= 0.0 {
                by_op.remove("ports.list");
            }
        }
        Calls { by_op, status_reads }
    }

    /// Calls other than the batched status reads.
    fn port_calls(&self) -> f64 {
        self.by_op.values().sum()
    }

    fn describe(&self, per: f64) -> String {
        let mut parts: Vec<String> = self.by_op.iter().map(|(op, v)| format!("{op} {:.2}", v / per)).collect();
        if parts.is_empty() {
            parts.push("none".into());
        }
        parts.join(", ")
    }
}

/// One phase's figures.
#[derive(Debug)]
struct Phase {
    name: &'static str,
    created_to_add: Vec<f64>,
    created_to_active: Vec<f64>,
    active_to_add: Vec<f64>,
    /// Calls while the pods were created and ADDed.
    add: Calls,
    /// Calls while they were DELeted and deleted.
    teardown: Calls,
    /// Calls of the pre-population (warm), with the ports it created.
    populate: Option<(Calls, u32)>,
    pods: usize,
    /// Mean of the allocator's own plug report → ACTIVE seen, ms.
    plug_to_active_seen_ms: f64,
}

struct Bench {
    c: NeutronCluster,
    watcher: Svc,
    pods: usize,
    rate: f64,
    status_poll: Option<String>,
    seen: Arc<Mutex<Seen>>,
}

/// A pod of a phase, through its ADD.
struct Done {
    pod: CniPod,
    created: Instant,
    added: Instant,
}

impl Bench {
    fn allocator(&self, pool_min: u32, pool_batch: u32) -> Result<Svc> {
        let o = AllocatorOptions {
            cluster_id: "bench".into(),
            pool_min,
            pool_batch,
            status_poll_min: self.status_poll.clone(),
            instance: "bench-neutron".into(),
            log: "info".into(),
            // The warm pool is filled with one PopulatePool of the phase's pods: no cap.
            extra: vec!["--pool-max".into(), "0".into()],
        };
        self.c.allocator(&self.watcher, &o)
    }

    async fn phase(&self, name: &'static str, alloc: &Svc, binder: &Arc<Binder>, warm: bool) -> Result<Phase> {
        eprintln!("# {name}: {} pods at {} pods/s", self.pods, self.rate);
        let populate = if warm {
            let before = alloc.metrics().await?;
            let mut pm = PoolManagerClient::new(alloc.channel()?);
            let key = PoolKey { node_name: self.c.node.host.clone(), ..Default::default() };
            let count = u32::try_from(self.pods)? + WARM_POOL_MIN;
            let t = Instant::now();
            let pool = pm.populate_pool(PopulatePoolRequest { key: Some(key), count }).await?.into_inner();
            ensure!(pool.free_port_ids.len() >= self.pods, "populated pool too small: {pool:?}");
            eprintln!("  pool populated with {} ports in {:.1} s", pool.free_port_ids.len(), t.elapsed().as_secs_f64());
            let calls = Calls::between(&before, &alloc.metrics().await?);
            Some((calls, u32::try_from(pool.free_port_ids.len())?))
        } else {
            None
        };
        let before = alloc.metrics().await?;
        let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(self.c.admin.clone(), NS);
        let start = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..self.pods {
            let at = start + Duration::from_secs_f64(i as f64 / self.rate);
            tokio::time::sleep_until(at.into()).await;
            let pod_name = format!("{name}-{i}");
            let spec = self.c.pod(&pod_name);
            let netns = Arc::new(Netns::new("nb")?);
            let (api, binder) = (api.clone(), binder.clone());
            tasks.push(tokio::spawn(async move {
                let created = Instant::now();
                let made = api.create(&PostParams::default(), &spec).await?;
                let uid = made.metadata.uid.context("no uid")?;
                let pod = CniPod { namespace: NS.into(), name: pod_name, uid, netns };
                let out = tokio::task::spawn_blocking({
                    let (pod, binder) = (pod.clone(), binder.clone());
                    move || pod.run("ADD", &binder, None, SLOW)
                })
                .await??;
                let added = Instant::now();
                if out.code != 0 {
                    bail!("ADD {}: {} {}", pod.name, out.stdout, out.stderr);
                }
                Ok(Done { pod, created, added })
            }));
        }
        let mut done = Vec::new();
        for t in tasks {
            done.push(t.await?.map_err(|e| anyhow::anyhow!("{e:#}\n{}", binder.logs()))?);
        }
        eprintln!("  {} ADDs done {:.1} s after the first create", done.len(), start.elapsed().as_secs_f64());
        // The outside poller may not have listed the last ports yet.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let after = alloc.metrics().await?;
        let add = Calls::between(&before, &after);
        let plug_to_active_seen_ms = {
            let s = |t: &str, n: &str| metric_sum(t, n, &[]);
            let sum = s(&after, "kuryr_allocator_neutron_active_seconds_sum")
                - s(&before, "kuryr_allocator_neutron_active_seconds_sum");
            let n = s(&after, "kuryr_allocator_neutron_active_seconds_count")
                - s(&before, "kuryr_allocator_neutron_active_seconds_count");
            1e3 * sum / n.max(1.0)
        };

        let mut vifs = VifAllocatorClient::new(alloc.channel()?);
        let (mut created_to_add, mut created_to_active, mut active_to_add) = (vec![], vec![], vec![]);
        let mut unseen = 0;
        for d in &done {
            let vif = vifs.get_vif(GetVifRequest { pod_uid: d.pod.uid.clone() }).await?.into_inner();
            created_to_add.push(ms(d.added - d.created));
            match lock(&self.seen).first_active.get(&vif.vif_id) {
                Some(&at) => {
                    created_to_active.push(ms_between(d.created, at));
                    active_to_add.push(ms_between(at, d.added));
                }
                None => unseen += 1,
            }
        }
        if unseen > 0 {
            eprintln!("  {unseen} ports never listed ACTIVE by the outside poller");
        }

        // Teardown: DEL, then the pods deleted; released once their finalizers are gone.
        let before = alloc.metrics().await?;
        let dels: Vec<_> = done
            .iter()
            .map(|d| {
                let (pod, binder) = (d.pod.clone(), binder.clone());
                tokio::task::spawn_blocking(move || pod.run("DEL", &binder, None, SLOW))
            })
            .collect();
        for (d, t) in done.iter().zip(dels) {
            let out = t.await??;
            ensure!(out.code == 0, "DEL {}: {} {}", d.pod.name, out.stdout, out.stderr);
        }
        let grace0 = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
        for d in &done {
            api.delete(&d.pod.name, &grace0).await?;
        }
        wait_until("the phase's pods to be gone", SLOW, || async {
            let left = api.list(&ListParams::default()).await?.items.len();
            ensure!(left == 0, "{left} pods left");
            Ok(())
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\n{}", alloc.proc.logs()))?;
        let teardown = Calls::between(&before, &alloc.metrics().await?);
        Ok(Phase {
            name,
            created_to_add,
            created_to_active,
            active_to_add,
            add,
            teardown,
            populate,
            pods: done.len(),
            plug_to_active_seen_ms,
        })
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `b − a` in ms, negative when `b` is earlier.
fn ms_between(a: Instant, b: Instant) -> f64 {
    if b >= a { ms(b - a) } else { -ms(a - b) }
}

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

fn main() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build()?;
    rt.block_on(run())
}

async fn run() -> Result<()> {
    let pods: usize = env_or("BENCH_NEUTRON_PODS", 40)?;
    let rate: f64 = env_or("BENCH_NEUTRON_RATE", 2.0)?;
    let poll_ms: u64 = env_or("BENCH_NEUTRON_POLL_MS", 15)?;
    let status_poll = std::env::var("BENCH_NEUTRON_STATUS_POLL").ok().filter(|v| !v.trim().is_empty());
    ensure!(pods > 0 && rate > 0.0, "BENCH_NEUTRON_PODS and BENCH_NEUTRON_RATE must be positive");
    let t0 = Instant::now();
    let c = NeutronCluster::start(&[NS]).await?;
    eprintln!("# API server, Keystone and Neutron up in {:.1} s", t0.elapsed().as_secs_f64());
    let extensions = c.neutron_extensions().await?;
    let bulk_tags = extensions.iter().any(|e| e == "tag-ports-during-bulk-creation");
    let watcher = c.watcher()?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let poller = spawn_poller(&c, Duration::from_millis(poll_ms), seen.clone());
    let bench = Bench { c, watcher, pods, rate, status_poll, seen: seen.clone() };

    let cold_alloc = bench.allocator(0, 0)?;
    cold_alloc.wait_ready(SLOW).await?;
    let binder = Arc::new(bench.c.binder(&cold_alloc, SLOW, &[]).await?);
    let cold = bench.phase("cold", &cold_alloc, &binder, false).await;
    let cold = cold.map_err(|e| anyhow::anyhow!("{e:#}\nallocator:\n{}", cold_alloc.proc.logs()))?;
    let mut cold_alloc = cold_alloc;
    // Gone before the next one listens on the same socket.
    cold_alloc.proc.terminate(Duration::from_secs(10)).await?;
    drop(cold_alloc);
    print_phase(&cold, period_ms(&seen));

    // The same socket: the binder follows the new allocator.
    let warm_alloc = bench.allocator(WARM_POOL_MIN, WARM_POOL_BATCH)?;
    warm_alloc.wait_ready(SLOW).await?;
    let warm = bench.phase("warm", &warm_alloc, &binder, true).await;
    let warm = warm.map_err(|e| anyhow::anyhow!("{e:#}\nallocator:\n{}", warm_alloc.proc.logs()))?;
    poller.abort();
    print_phase(&warm, period_ms(&seen));

    println!();
    println!(
        "neutron-bench: {pods} pods per phase at {rate} pods/s; Neutron {} tag-ports-during-bulk-creation; \
         allocator --status-poll-min {}; outside poller period {:.0} ms (the resolution of 'ACTIVE')",
        if bulk_tags { "has" } else { "lacks" },
        bench.status_poll.as_deref().unwrap_or("(default)"),
        period_ms(&seen)
    );
    let mut verdicts = Vec::new();
    for p in [&cold, &warm] {
        verdicts.extend(print_phase(p, period_ms(&seen)));
    }
    println!("targets: {}", if verdicts.iter().all(|v| *v) { "all met" } else { "some MISSED (see above)" });
    Ok(())
}

/// The outside poller's mean period, ms.
fn period_ms(seen: &Mutex<Seen>) -> f64 {
    let s = lock(seen);
    ms(s.period_total) / s.rounds.max(1) as f64
}

/// Prints one phase's figures; returns whether each of its targets was met.
fn print_phase(p: &Phase, period_ms: f64) -> Vec<bool> {
    println!();
    println!(
        "{:<52} {:>4} {:>8} {:>8} {:>8} {:>8} {:>8}",
        format!("# {} ({} pods), ms", p.name, p.pods),
        "n",
        "mean",
        "p50",
        "p90",
        "p99",
        "max"
    );
    let row = |label: &str, v: &[f64], target: &str| {
        if let Some(s) = Stats::of(v) {
            println!(
                "{label:<52} {:>4} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>8.0}  {target}",
                s.n, s.mean, s.p50, s.p90, s.p99, s.max
            );
        } else {
            println!("{label:<52} (no sample)");
        }
    };
    let mut verdicts = Vec::new();
    row("pod created → CNI ADD returned", &p.created_to_add, "");
    row("pod created → port ACTIVE in Neutron", &p.created_to_active, "");
    let target = match Stats::of(&p.active_to_add) {
        Some(s) => {
            let ok = s.p50 <= TARGET_ACTIVE_TO_ADD_MS && s.p99 <= TARGET_ACTIVE_TO_ADD_MS;
            verdicts.push(ok);
            format!("target ≤ {TARGET_ACTIVE_TO_ADD_MS:.0} (±{period_ms:.0}): {}", met(ok))
        }
        None => String::new(),
    };
    row("port ACTIVE → CNI ADD returned", &p.active_to_add, &target);
    {
        let n = p.pods as f64;
        println!(
            "  Neutron calls per pod on the way in, besides status reads: {:.2} ({})",
            p.add.port_calls() / n,
            p.add.describe(n)
        );
        println!(
            "  batched status reads: {:.0} in all, {:.2} per pod; allocator's plug report → ACTIVE seen: mean {:.0} ms",
            p.add.status_reads,
            p.add.status_reads / n,
            p.plug_to_active_seen_ms
        );
        if let Some((calls, ports)) = &p.populate {
            let per_port = calls.port_calls() / f64::from(*ports);
            let total = p.add.port_calls() / n + per_port;
            let ok = total <= TARGET_WARM_CALLS_PER_POD;
            verdicts.push(ok);
            println!(
                "  pool population: {ports} ports, {:.2} calls per port ({})",
                per_port,
                calls.describe(f64::from(*ports))
            );
            println!(
                "  calls per pod with its port's creation: {total:.2} (target ≤ {TARGET_WARM_CALLS_PER_POD}: {})",
                met(ok)
            );
        }
        println!(
            "  on the way out (DEL + pod deleted): {:.2} per pod ({}), status reads {:.0}",
            p.teardown.port_calls() / n,
            p.teardown.describe(n),
            p.teardown.status_reads
        );
    }
    verdicts
}
