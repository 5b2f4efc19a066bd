//! `make bench-neutron`: kuryr-vif-allocator `--backend neutron` against the real Neutron (API,
//! RPC server, ML2/OVS agent on a userspace Open vSwitch) and Keystone, with a kuryr-binder on
//! the Neutron node's `br-int` and CNI through the kuryr-cni shim; optimised binaries from
//! `KURYR_BIN_DIR` (the harness is [`kuryr_tests::neutron`]).
//!
//! Pods are created through the API at a steady rate; right after each create the bench runs
//! CNI ADD for it (as a kubelet that saw the pod would), which returns once the port is plugged
//! and Neutron reports it ACTIVE. Four phases, each with a fresh allocator, in this order:
//! - **cold**: pools off (`--pool-batch 0`): every pod's port is created on its path;
//! - **warm**: the node's pool populated first through the PoolManager API with a port for every
//!   pod (plus the pool minimum, so no refill runs during the phase);
//!
//! each first with the allocator **polling** port status (no transport URL) and then with
//! **events** (Neutron's push of ports over the test RabbitMQ, `--neutron-transport-url`, the
//! reconciling read at its default period). The line `calls per pod, every call counted: <n>`
//! counts every Neutron call the allocator made for the phase's pods — assignments, creations,
//! look-ups, the status reads of the poller and the reconciling reads — plus, warm, each pod's
//! share of the pool's bulk creations.
//!
//! For each pod: pod created → ADD returned; pod created → its port turned ACTIVE; port ACTIVE
//! → ADD returned. "ACTIVE" is when the bench's own subscriber to Neutron's push of ports
//! (`neutron-vo-Port-1.11_fanout`, a queue of its own, in every phase, polling ones included)
//! receives the port with status ACTIVE after the pod was created — Neutron's announcement,
//! sent right after the status is committed. As a cross-check an outside poller lists the pod
//! network's ACTIVE ports every `BENCH_NEUTRON_POLL_MS` (default 100; 0: off) and notes the send
//! time of the first answer that has the port ACTIVE again; that figure is exact to about one
//! poll period (printed), and the poller loads Neutron's API. Pool ports turn ACTIVE once per
//! pod; each phase has its own cluster id, so none starts from another's pool. Neutron API calls
//! per pod come from the allocator's `openstack_requests_total` (by operation),
//! `kuryr_allocator_neutron_status_polls_total` and `_status_safety_reads_total`, as deltas
//! over each part.
//!
//! Environment: `BENCH_NEUTRON_PODS` (per phase, default 40), `BENCH_NEUTRON_RATE` (pods/s,
//! default 2), `BENCH_NEUTRON_POLL_MS` (default 100), `BENCH_NEUTRON_STATUS_POLL` (the
//! allocator's `--status-poll-min`, its default when unset).
#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kube::api::{Api, DeleteParams, PostParams};
use kuryr_proto::allocator::v1::pool_manager_client::PoolManagerClient;
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::{GetVifRequest, PoolKey, PopulatePoolRequest};
use kuryr_tests::binder::Binder;
use kuryr_tests::netns::Netns;
use kuryr_tests::neutron::{AllocatorOptions, CniPod, NeutronCluster, Svc, metric_sum};
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use kuryr_tests::stats::{Stats, ms, ms_between};
use kuryr_tests::util::env_or;
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

/// When ports turned ACTIVE, as one observer saw it: per port, every time it was seen ACTIVE
/// after having been seen otherwise (a recycled pool port turns ACTIVE once per pod).
#[derive(Debug, Default)]
struct Seen {
    active: std::collections::HashSet<String>,
    edges: HashMap<String, Vec<Instant>>,
    rounds: u64,
    /// Sum of the time between two consecutive requests (the outside poller).
    period_total: Duration,
}

impl Seen {
    /// Records the port's state at `at`.
    fn state(&mut self, id: &str, active: bool, at: Instant) {
        if active {
            if self.active.insert(id.to_string()) {
                self.edges.entry(id.to_string()).or_default().push(at);
            }
        } else {
            self.active.remove(id);
        }
    }

    /// The first time the port turned ACTIVE after `after`.
    fn active_after(&self, id: &str, after: Instant) -> Option<Instant> {
        self.edges.get(id)?.iter().copied().find(|t| *t >= after)
    }
}

/// Subscribes to Neutron's push of ports (the same exchanges as the allocator, a queue of its
/// own) and records each port's turning ACTIVE at the push's arrival: Neutron's own
/// announcement, sent right after the status is committed.
async fn spawn_push_observer(c: &NeutronCluster, seen: Arc<Mutex<Seen>>) -> Result<tokio::task::JoinHandle<()>> {
    use amqprs::channel::{BasicConsumeArguments, ExchangeDeclareArguments, QueueBindArguments, QueueDeclareArguments};
    use amqprs::connection::{Connection, OpenConnectionArguments};
    let url = c.transport_url(false)?;
    let rest = url.strip_prefix("rabbit://").context("TRANSPORT_URL is not rabbit://")?;
    let (creds, hostport) = rest.rsplit_once('@').context("no credentials in TRANSPORT_URL")?;
    let (user, pass) = creds.split_once(':').context("no password in TRANSPORT_URL")?;
    let (host, port) = hostport.trim_end_matches('/').rsplit_once(':').context("no port in TRANSPORT_URL")?;
    let conn = Connection::open(&OpenConnectionArguments::new(host, port.parse()?, user, pass)).await?;
    let ch = conn.open_channel(None).await?;
    let (queue, _, _) =
        ch.queue_declare(QueueDeclareArguments::exclusive_server_named()).await?.context("no queue name")?;
    let mut x = ExchangeDeclareArguments::new("neutron-vo-Port-1.11_fanout", "fanout");
    x.auto_delete = true;
    ch.exchange_declare(x).await?;
    ch.queue_bind(QueueBindArguments::new(&queue, "neutron-vo-Port-1.11_fanout", "")).await?;
    let mut consume = BasicConsumeArguments::new(&queue, "");
    consume.no_ack = true;
    let (_, mut rx) = ch.basic_consume_rx(consume).await?;
    Ok(tokio::spawn(async move {
        let _keep = (conn, ch);
        while let Some(m) = rx.recv().await {
            let at = Instant::now();
            let Ok(ports) =
                kuryr_vif_allocator::backend::neutron::events::decode::decode(m.content.as_deref().unwrap_or_default())
            else {
                continue;
            };
            let mut s = lock(&seen);
            for p in ports {
                s.state(&p.id, p.is_active(), at);
            }
        }
    }))
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
                let listed: std::collections::HashSet<&str> =
                    body["ports"].as_array().into_iter().flatten().filter_map(|p| p["id"].as_str()).collect();
                let gone: Vec<String> = s.active.iter().filter(|id| !listed.contains(id.as_str())).cloned().collect();
                for id in gone {
                    s.state(&id, false, sent);
                }
                for id in listed {
                    s.state(id, true, sent);
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

/// Calls made between two scrapes: by operation, with the batched status reads (the poller's
/// and the reconciling ones) apart from the other `ports.list` calls (look-ups).
#[derive(Debug, Default, Clone)]
struct Calls {
    by_op: BTreeMap<String, f64>,
    status_reads: f64,
    safety_reads: f64,
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
        let safety = |t: &str| metric_sum(t, "kuryr_allocator_neutron_status_safety_reads_total", &[]);
        let safety_reads = safety(after) - safety(before);
        if let Some(list) = by_op.get_mut("ports.list") {
            *list -= status_reads + safety_reads;
            if *list <= 0.0 {
                by_op.remove("ports.list");
            }
        }
        Calls { by_op, status_reads, safety_reads }
    }

    /// Calls other than the batched status reads.
    fn port_calls(&self) -> f64 {
        self.by_op.values().sum()
    }

    /// Every call.
    fn all(&self) -> f64 {
        self.port_calls() + self.status_reads + self.safety_reads
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
    /// Readiness from events (else polling).
    events: bool,
    /// How the allocator learnt its ports ACTIVE: (event, poll, safety).
    sources: (f64, f64, f64),
    created_to_add: Vec<f64>,
    created_to_active: Vec<f64>,
    active_to_add: Vec<f64>,
    /// From the outside poller's first listing ACTIVE.
    polled_to_add: Vec<f64>,
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
    /// Neutron's push as the bench's own subscriber saw it.
    pushed: Arc<Mutex<Seen>>,
    /// Whether the outside poller runs.
    polling: bool,
}

/// A pod of a phase, through its ADD.
struct Done {
    pod: CniPod,
    created: Instant,
    added: Instant,
}

impl Bench {
    fn allocator(&self, phase: &str, pool_min: u32, pool_batch: u32, events: bool) -> Result<Svc> {
        // The warm pool is filled with one PopulatePool of the phase's pods: no cap.
        let mut extra = vec!["--pool-max".into(), "0".into()];
        if events {
            extra.extend(["--neutron-transport-url".into(), self.c.transport_url(false)?]);
        }
        let o = AllocatorOptions {
            // A cluster per phase: no phase starts from another's pool or recycled ports.
            cluster_id: format!("bench-{}", phase.replace(", ", "-")),
            pool_min,
            pool_batch,
            status_poll_min: self.status_poll.clone(),
            instance: "bench-neutron".into(),
            log: "info".into(),
            extra,
        };
        let alloc = self.c.allocator(&self.watcher, &o)?;
        Ok(alloc)
    }

    /// Waits for the allocator to serve and, with events, to consume them.
    async fn ready(alloc: &Svc, events: bool) -> Result<()> {
        alloc.wait_ready(SLOW).await?;
        if events {
            wait_until("the allocator to consume Neutron's port events", SLOW, || async {
                let connected = metric_sum(&alloc.metrics().await?, "kuryr_allocator_neutron_events_connected", &[]);
                ensure!(connected == 1.0, "not connected");
                Ok(())
            })
            .await
            .map_err(|e| anyhow::anyhow!("{e:#}\n{}", alloc.proc.logs()))?;
        }
        Ok(())
    }

    async fn phase(
        &self,
        name: &'static str,
        alloc: &Svc,
        binder: &Arc<Binder>,
        warm: bool,
        events: bool,
    ) -> Result<Phase> {
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
            let pod_name = format!("{}-{i}", name.replace(", ", "-"));
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
        let src = |s: &str| {
            let f = [format!("source=\"{s}\"")];
            let f: Vec<&str> = f.iter().map(String::as_str).collect();
            metric_sum(&after, "kuryr_allocator_neutron_ready_sources_total", &f)
                - metric_sum(&before, "kuryr_allocator_neutron_ready_sources_total", &f)
        };
        let sources = (src("event"), src("poll"), src("safety"));
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
        let mut polled_to_add = vec![];
        let (mut unseen, mut unpolled) = (0, 0);
        for d in &done {
            let vif = vifs.get_vif(GetVifRequest { pod_uid: d.pod.uid.clone() }).await?.into_inner();
            created_to_add.push(ms(d.added - d.created));
            match lock(&self.pushed).active_after(&vif.vif_id, d.created) {
                Some(at) => {
                    created_to_active.push(ms_between(d.created, at));
                    active_to_add.push(ms_between(at, d.added));
                }
                None => unseen += 1,
            }
            match lock(&self.seen).active_after(&vif.vif_id, d.created) {
                Some(at) => polled_to_add.push(ms_between(at, d.added)),
                None => unpolled += 1,
            }
        }
        if unseen > 0 {
            eprintln!("  {unseen} ports never pushed ACTIVE after their pod's creation");
        }
        if unpolled > 0 && self.polling {
            eprintln!("  {unpolled} ports never listed ACTIVE by the outside poller after their pod's creation");
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
        objects::wait_no_pods(&api, "the phase's pods to be gone", SLOW)
            .await
            .map_err(|e| anyhow::anyhow!("{e:#}\n{}", alloc.proc.logs()))?;
        let teardown = Calls::between(&before, &alloc.metrics().await?);
        Ok(Phase {
            name,
            events,
            sources,
            created_to_add,
            created_to_active,
            active_to_add,
            polled_to_add,
            add,
            teardown,
            populate,
            pods: done.len(),
            plug_to_active_seen_ms,
        })
    }
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
    let poll_ms: u64 = env_or("BENCH_NEUTRON_POLL_MS", 100)?;
    let status_poll = std::env::var("BENCH_NEUTRON_STATUS_POLL").ok().filter(|v| !v.trim().is_empty());
    ensure!(pods > 0 && rate > 0.0, "BENCH_NEUTRON_PODS and BENCH_NEUTRON_RATE must be positive");
    let t0 = Instant::now();
    let c = NeutronCluster::start(&[NS]).await?;
    eprintln!("# API server, Keystone and Neutron up in {:.1} s", t0.elapsed().as_secs_f64());
    let extensions = c.neutron_extensions().await?;
    let bulk_tags = extensions.iter().any(|e| e == "tag-ports-during-bulk-creation");
    let watcher = c.watcher()?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let pushed = Arc::new(Mutex::new(Seen::default()));
    let observer = spawn_push_observer(&c, pushed.clone()).await?;
    let poller = (poll_ms > 0).then(|| spawn_poller(&c, Duration::from_millis(poll_ms), seen.clone()));
    let bench = Bench { c, watcher, pods, rate, status_poll, seen: seen.clone(), pushed, polling: poller.is_some() };

    let mut binder: Option<Arc<Binder>> = None;
    let mut phases = Vec::new();
    for (name, warm, events) in [
        ("cold, polling", false, false),
        ("cold, events", false, true),
        ("warm, polling", true, false),
        ("warm, events", true, true),
    ] {
        let alloc = if warm {
            bench.allocator(name, WARM_POOL_MIN, WARM_POOL_BATCH, events)?
        } else {
            bench.allocator(name, 0, 0, events)?
        };
        Bench::ready(&alloc, events).await?;
        // The same socket every time: the binder follows each new allocator.
        let b = match &binder {
            Some(b) => b.clone(),
            None => {
                let b = Arc::new(bench.c.binder(&alloc, SLOW, &[]).await?);
                binder = Some(b.clone());
                b
            }
        };
        let phase = bench.phase(name, &alloc, &b, warm, events).await;
        let phase = phase.map_err(|e| anyhow::anyhow!("{e:#}\nallocator:\n{}", alloc.proc.logs()))?;
        let mut alloc = alloc;
        // Gone before the next one listens on the same socket.
        alloc.proc.terminate(Duration::from_secs(10)).await?;
        drop(alloc);
        print_phase(&phase, period_ms(&seen));
        phases.push(phase);
    }
    if let Some(p) = poller {
        p.abort();
    }
    observer.abort();

    println!();
    println!(
        "neutron-bench: {pods} pods per phase at {rate} pods/s; Neutron {} tag-ports-during-bulk-creation; \
         allocator --status-poll-min {}; outside poller period {:.0} ms (the resolution of 'ACTIVE')",
        if bulk_tags { "has" } else { "lacks" },
        bench.status_poll.as_deref().unwrap_or("(default)"),
        period_ms(&seen)
    );
    let mut verdicts = Vec::new();
    for p in &phases {
        let v = print_phase(p, period_ms(&seen));
        // The targets are the event mode's; polling is printed beside it for comparison.
        if p.events {
            verdicts.extend(v);
        }
    }
    println!();
    println!(
        "{:<16} {:>22} {:>22} {:>34}",
        "# side by side", "ACTIVE → ADD p50/p99", "status reads per pod", "calls per pod, every call counted"
    );
    for p in &phases {
        let n = p.pods as f64;
        let s = Stats::of(&p.active_to_add);
        let every = p.add.all() / n + p.populate.as_ref().map_or(0.0, |(c, ports)| c.all() / f64::from(*ports));
        println!(
            "{:<16} {:>22} {:>22.2} {:>34.2}",
            p.name,
            s.map_or("-".into(), |s| format!("{:.0} / {:.0} ms", s.p50, s.p99)),
            (p.add.status_reads + p.add.safety_reads) / n,
            every
        );
    }
    println!("targets (events): {}", if verdicts.iter().all(|v| *v) { "all met" } else { "some MISSED (see above)" });
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
    row("pod created → port ACTIVE (Neutron's push)", &p.created_to_active, "");
    let target = match Stats::of(&p.active_to_add) {
        Some(s) => {
            let ok = s.p50 <= TARGET_ACTIVE_TO_ADD_MS && s.p99 <= TARGET_ACTIVE_TO_ADD_MS;
            verdicts.push(ok);
            format!("target ≤ {TARGET_ACTIVE_TO_ADD_MS:.0}: {}", met(ok))
        }
        None => String::new(),
    };
    row("port ACTIVE (Neutron's push) → CNI ADD returned", &p.active_to_add, &target);
    row(
        "port listed ACTIVE (outside poller) → CNI ADD returned",
        &p.polled_to_add,
        &format!("(resolution ~{period_ms:.0})"),
    );
    {
        let n = p.pods as f64;
        println!(
            "  Neutron calls per pod on the way in, besides status reads: {:.2} ({})",
            p.add.port_calls() / n,
            p.add.describe(n)
        );
        println!(
            "  batched status reads: {:.0} by the poller, {:.0} reconciling, {:.2} per pod; allocator's plug report → \
             ACTIVE seen: mean {:.0} ms",
            p.add.status_reads,
            p.add.safety_reads,
            (p.add.status_reads + p.add.safety_reads) / n,
            p.plug_to_active_seen_ms
        );
        println!(
            "  ports learnt ACTIVE: {:.0} from events, {:.0} by the poller, {:.0} by the reconciling read",
            p.sources.0, p.sources.1, p.sources.2
        );
        let pool_share = p.populate.as_ref().map_or(0.0, |(c, ports)| c.all() / f64::from(*ports));
        let every = p.add.all() / n + pool_share;
        let target = if p.events && p.populate.is_some() {
            let ok = every <= TARGET_WARM_CALLS_PER_POD;
            verdicts.push(ok);
            format!(" (target ≤ {TARGET_WARM_CALLS_PER_POD}: {})", met(ok))
        } else {
            String::new()
        };
        println!("  calls per pod, every call counted: {every:.2}{target}");
        if let Some((calls, ports)) = &p.populate {
            let per_port = calls.port_calls() / f64::from(*ports);
            let total = p.add.port_calls() / n + per_port;
            println!(
                "  pool population: {ports} ports, {:.2} calls per port ({})",
                per_port,
                calls.describe(f64::from(*ports))
            );
            println!("  calls per pod with its port's creation, besides status reads: {total:.2}");
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
