//! `make bench`, end to end: the embedded system measured as a user meets it, with optimised
//! binaries (point `KURYR_BIN_DIR` at them).
//!
//! 1. **Pod created → network ready.** A two-node cluster ([`Cluster`]: real API server, watcher,
//!    allocator, per-node containerd + kuryr-cni + kuryr-binder, the test kubelet driving CRI).
//!    Pods are created through the API at a steady rate, alternating between the nodes; for each
//!    one the time from the create request to RunPodSandbox returning in its node's kubelet
//!    (CNI ADD done, sandbox up). Where the time goes comes from timestamps already there: the
//!    kubelet's records, the allocator's "VIF handed out" and the binder's "ADD done" log lines
//!    (with the binder's own per-ADD fields), and the allocator's metrics.
//! 0. **The reference arm** of part 1: the same pods at the same rate on the same harness (a
//!    fresh API server, two containerd instances driven by the test kubelet) with the reference
//!    `bridge` + `host-local` plugins and no kuryr service; part 1's created → RunPodSandbox
//!    returned is printed as a ratio kuryr/reference.
//! 2. **Allocations per second.** A burst of pods created at once, bound to node names that no
//!    kubelet runs (so no CRI work competes); a watch on PodVifs marks each one allocated when
//!    it records addresses. The API server's `apiserver_request_total`, read before the
//!    first create and after the last allocation, gives the API requests per pod by verb and
//!    resource (every client's, the bench's own creates excluded), and `/proc` the CPU each
//!    process spent meanwhile. A baseline runs first: the same creates on a fresh API server with
//!    no kuryr service, so that the API server's and etcd's CPU per pod with kuryr is printed
//!    beside what the creates alone cost them.
//! 3. **Watcher memory.** A fresh API server holding many pods (bound to fake nodes, no
//!    sandboxes) in two namespaces, and `kuryr-watcher` alone (no allocator) with one subscriber:
//!    its RSS idle and once its index holds every pod.
//!
//! Environment: `BENCH_E2E_PODS` (default 500), `BENCH_E2E_RATE` (pods/s, default 20),
//! `BENCH_E2E_BURST` (default 200), `BENCH_E2E_RSS_PODS` (default 10000); `0` skips a part;
//! `BENCH_E2E_REFERENCE=0` skips the reference arm.
//! `BENCH_E2E_LOG` is the services' `--log` filter (default `info`; the breakdown needs `info`).
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use kuryr_proto::service_names;
use kuryr_proto::watcher::v1::watcher_client::WatcherClient;
use kuryr_proto::watcher::v1::{EventType, Filter, Kind, SubscribeRequest};
use kuryr_tests::apirequests::{Requests, apiserver_requests, requests_between};
use kuryr_tests::cluster::{ALLOCATOR_ACCOUNT, Cluster, ClusterOptions, SYSTEM_NAMESPACE, WATCHER_ACCOUNT};
use kuryr_tests::cri::{Containerd, ContainerdOptions};
use kuryr_tests::kube::KubeEnv;
use kuryr_tests::kubelet::{Kubelet, KubeletOptions, PodRecord};
use kuryr_tests::objects;
use kuryr_tests::procstat::CpuSnapshot;
use kuryr_tests::services::{ServiceProcess, wait_until};
use kuryr_tests::stats::{Stats, ms, ms_between};
use kuryr_tests::util::{bin_dir, env_or, free_port, loadavg, repo_root, tail};
use kuryr_vif_allocator::k8s::crd::PodVif;

/// Namespace of the steady-rate pods.
const LATENCY_NS: &str = "bench-latency";
/// Namespace of the burst.
const BURST_NS: &str = "bench-burst";
/// Node names of the burst pods: no kubelet runs them.
const BURST_NODES: [&str; 2] = ["burst-a", "burst-b"];
/// Namespaces of the pods held by the watcher in part 3.
const RSS_NS: [&str; 2] = ["bench-rss-a", "bench-rss-b"];
/// Fake nodes the part-3 pods are bound to.
const RSS_NODES: usize = 100;
/// Concurrent create requests for bulk creation.
const CREATE_CONCURRENCY: usize = 64;
/// The reference CNI plugins (`bridge`, `host-local`).
const REFERENCE_CNI: &str = "/usr/lib/cni";

/// Targets the figures are held against.
const TARGET_P50_MS: f64 = 50.0;
const TARGET_P99_MS: f64 = 150.0;
const TARGET_WATCHER_RSS_MIB: f64 = 80.0;
const TARGET_ALLOCATIONS_PER_S: f64 = 300.0;
const TARGET_REQUESTS_PER_POD: f64 = 3.0;
const TARGET_RATIO: f64 = 1.1;

#[derive(Debug, Clone, Copy)]
struct Config {
    pods: usize,
    rate: f64,
    burst: usize,
    rss_pods: usize,
    /// Run the reference arm (bridge + host-local) of the steady-rate part.
    reference: bool,
}

impl Config {
    fn from_env() -> Result<Config> {
        let c = Config {
            pods: env_or("BENCH_E2E_PODS", 500)?,
            rate: env_or("BENCH_E2E_RATE", 20.0)?,
            burst: env_or("BENCH_E2E_BURST", 200)?,
            rss_pods: env_or("BENCH_E2E_RSS_PODS", 10_000)?,
            reference: env_or::<u8>("BENCH_E2E_REFERENCE", 1)? != 0,
        };
        ensure!(c.rate.is_finite() && c.rate > 0.0, "BENCH_E2E_RATE must be a positive number of pods per second");
        ensure!(c.pods <= 5_000, "BENCH_E2E_PODS={} is more than this machine-local cluster can hold", c.pods);
        Ok(c)
    }
}

fn main() -> Result<()> {
    let cfg = Config::from_env()?;
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build()?.block_on(run(cfg))
}

async fn run(cfg: Config) -> Result<()> {
    let t = Instant::now();
    let mut report = Report::default();
    report.notes.push(format!("load average at the start: {}", loadavg()));
    if cfg.pods > 0 && cfg.reference {
        report.reference = Some(reference_arm(cfg, &mut report).await.context("the reference arm")?);
    }
    if cfg.burst > 0 {
        burst_baseline(cfg.burst, &mut report).await.context("the burst's baseline")?;
    }
    if cfg.pods > 0 || cfg.burst > 0 {
        cluster_parts(cfg, &mut report).await?;
    }
    if cfg.rss_pods > 0 {
        watcher_memory(cfg.rss_pods, &mut report).await?;
    }
    report.notes.push(format!("load average at the end: {} ({} CPUs)", loadavg(), num_cpus()));
    report.print();
    println!("(e2e bench took {:.0} s)", t.elapsed().as_secs_f64());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Figures

/// Everything measured, printed at the end as tables.
#[derive(Debug, Default)]
struct Report {
    /// Headline latency rows: (label, stats, target).
    latency: Vec<(String, Stats, String)>,
    /// Where the time goes: (label, stats).
    breakdown: Vec<(String, Stats)>,
    /// Free-form figures: (label, value, target).
    figures: Vec<(String, String, String)>,
    /// Notes under the tables.
    notes: Vec<String>,
    /// The steady-rate part, created → RunPodSandbox returned: the reference arm and kuryr's.
    reference: Option<Stats>,
    kuryr: Option<Stats>,
    /// API requests per burst pod, by (verb, resource), and the whole.
    requests: Vec<(String, f64)>,
    /// API requests per steady-rate pod, by (verb, resource), until every sandbox was up.
    steady_requests: Vec<(String, f64)>,
    requests_per_pod: Option<f64>,
    /// CPU seconds by process during the burst, the largest first.
    burst_cpu: Vec<(String, f64)>,
    /// CPU seconds of kube-apiserver and etcd for the burst's creates alone (no kuryr).
    baseline_cpu: Option<f64>,
    /// The burst's allocations per second, with its label.
    allocations: Option<(String, f64)>,
}

impl Report {
    fn figure(&mut self, label: impl Into<String>, value: impl Into<String>, target: impl Into<String>) {
        let (label, value, target) = (label.into(), value.into(), target.into());
        eprintln!("  {label}: {value}");
        self.figures.push((label, value, target));
    }

    fn print(&self) {
        let header = |first: &str| {
            println!("{first:<58} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8}", "n", "mean", "p50", "p90", "p99", "max");
        };
        let row = |label: &str, s: &Stats| {
            print!(
                "{label:<58} {:>5} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
                s.n, s.mean, s.p50, s.p90, s.p99, s.max
            );
        };
        if !self.latency.is_empty() {
            println!();
            header("# pod created in the API → network ready (ms)");
            for (label, s, target) in &self.latency {
                row(label, s);
                println!("  {target}");
            }
        }
        if !self.breakdown.is_empty() {
            println!();
            header("# where the time goes (ms, each pod's own timeline)");
            for (label, s) in &self.breakdown {
                row(label, s);
                println!();
            }
        }
        if !self.figures.is_empty() {
            println!();
            println!("{:<58} {:>22}  target", "# throughput and memory", "value");
            for (label, value, target) in &self.figures {
                println!("{label:<58} {value:>22}  {target}");
            }
        }
        if !self.steady_requests.is_empty() {
            println!();
            println!("{:<58} {:>22}", "# API requests per pod at the steady rate, by verb and resource", "per pod");
            for (what, per_pod) in &self.steady_requests {
                println!("{what:<58} {per_pod:>22.2}");
            }
        }
        if !self.requests.is_empty() {
            println!();
            println!("{:<58} {:>22}", "# API requests per pod in the burst, by verb and resource", "per pod");
            for (what, per_pod) in &self.requests {
                println!("{what:<58} {per_pod:>22.2}");
            }
        }
        if !self.burst_cpu.is_empty() {
            println!();
            println!("{:<58} {:>22}", "# CPU seconds during the burst, by process", "seconds");
            for (what, seconds) in &self.burst_cpu {
                println!("{what:<58} {seconds:>22.2}");
            }
        }
        for n in &self.notes {
            println!("note: {n}");
        }
        // The headline lines, last.
        println!();
        if let (Some(r), Some(k)) = (&self.reference, &self.kuryr) {
            let (r50, r99) = (k.p50 / r.p50, k.p99 / r.p99);
            println!(
                "created → RunPodSandbox returned, kuryr p50 {:.0} ms p99 {:.0} ms, reference p50 {:.0} ms p99 {:.0} ms",
                k.p50, k.p99, r.p50, r.p99
            );
            println!(
                "ratio kuryr/reference (steady rate): p50 {r50:.2}x  p99 {r99:.2}x   (goal ≤ {TARGET_RATIO}x: {})",
                if r50.max(r99) <= TARGET_RATIO { "met" } else { "MISSED" }
            );
        }
        if let Some((label, per_s)) = &self.allocations {
            println!("{label}: {per_s:.0} /s");
        }
        if let Some(n) = self.requests_per_pod {
            println!("API requests per pod: {n:.2}");
        }
    }
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Maps this process's monotonic instants onto the wall clock that log timestamps use.
#[derive(Debug, Clone, Copy)]
struct Clock {
    instant: Instant,
    wall_us: i64,
}

impl Clock {
    fn now() -> Clock {
        Clock { instant: Instant::now(), wall_us: Timestamp::now().as_microsecond() }
    }

    fn wall_us(&self, at: Instant) -> i64 {
        let delta = ms_between(self.instant, at) * 1e3;
        self.wall_us + delta as i64
    }
}

// ---------------------------------------------------------------------------------------------
// Processes and metrics

/// (VmRSS, VmHWM) of a process, in MiB.
fn rss_mib(pid: u32) -> Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).with_context(|| format!("pid {pid}"))?;
    let field = |name: &str| -> Result<f64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map(|kib| kib / 1024.0)
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

fn mib(v: f64) -> String {
    format!("{v:.1} MiB")
}

/// The Prometheus text of a service's `/metrics`.
async fn scrape(addr: &str) -> Result<String> {
    let url = format!("http://{addr}/metrics");
    let out = tokio::process::Command::new("curl").args(["-sf", "--max-time", "10", &url]).output().await?;
    ensure!(out.status.success(), "GET {url} failed");
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The value of one series (`name` or `name{labels}` exactly as exposed).
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

// ---------------------------------------------------------------------------------------------
// Log lines

/// One log event: its wall-clock time and its fields.
#[derive(Debug, Clone)]
struct LogLine {
    wall_us: i64,
    fields: HashMap<String, String>,
}

impl LogLine {
    fn ms(&self, name: &str) -> Option<f64> {
        self.fields.get(name)?.parse().ok()
    }
}

/// The events whose message is `message`, by their `pod` field. Lines look like
/// `2025-01-01T00:00:00.123456Z  INFO span{..}: target: message key=value key="value"`.
fn log_events(logs: &str, message: &str) -> HashMap<String, LogLine> {
    let mut out = HashMap::new();
    for line in logs.lines() {
        let Some((ts, rest)) = line.split_once(' ') else { continue };
        let Ok(ts) = ts.parse::<Timestamp>() else { continue };
        let Some(pos) = rest.find(&format!(": {message} ")).or_else(|| rest.ends_with(message).then_some(0)) else {
            continue;
        };
        let fields = parse_fields(&rest[pos + message.len() + 2..]);
        if let Some(pod) = fields.get("pod") {
            out.insert(pod.clone(), LogLine { wall_us: ts.as_microsecond(), fields });
        }
    }
    out
}

/// `key=value key="quoted value" key=[a, b]` → map (quotes removed).
fn parse_fields(text: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut rest = text.trim();
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().to_string();
        let after = &rest[eq + 1..];
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"').unwrap_or(q.len());
            (&q[..end], q.get(end + 1..).unwrap_or(""))
        } else if after.starts_with('[') {
            let end = after.find(']').map_or(after.len(), |e| e + 1);
            (&after[..end], &after[end..])
        } else {
            let end = after.find(' ').unwrap_or(after.len());
            (&after[..end], &after[end..])
        };
        out.insert(key, value.to_string());
        rest = next.trim_start();
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Pods

fn pod(namespace: &str, name: &str, node: &str) -> Pod {
    objects::pod(name).namespace(namespace).node(node).label("app", "bench").sleeping().build()
}

/// Creates `pods` with at most [`CREATE_CONCURRENCY`] requests in flight; returns how long it took.
async fn create_all(client: &kube::Client, pods: Vec<Pod>) -> Result<Duration> {
    let t = Instant::now();
    futures::stream::iter(pods)
        .map(|p| {
            let api: Api<Pod> = Api::namespaced(client.clone(), p.metadata.namespace.as_deref().unwrap_or("default"));
            async move {
                let name = p.metadata.name.clone().unwrap_or_default();
                api.create(&PostParams::default(), &p).await.with_context(|| format!("creating pod {name}"))
            }
        })
        .buffer_unordered(CREATE_CONCURRENCY)
        .try_for_each(|_| async { Ok(()) })
        .await?;
    Ok(t.elapsed())
}

/// Polls `f` every 200 ms until it succeeds, printing its progress message when it changes.
async fn wait_progress<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_print = Instant::now();
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e.context(format!("timed out waiting for {what}"))),
            Err(e) => {
                if last_print.elapsed() > Duration::from_secs(5) {
                    eprintln!("  waiting for {what}: {e:#}");
                    last_print = Instant::now();
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Parts 1 and 2: the two-node cluster

async fn cluster_parts(cfg: Config, report: &mut Report) -> Result<()> {
    eprintln!("# starting a two-node cluster (release binaries from {})", bin_dir());
    let service_log = std::env::var("BENCH_E2E_LOG").unwrap_or_else(|_| "info".into());
    let opts = ClusterOptions { nodes: 2, service_log, ..ClusterOptions::default() };
    let cluster = Cluster::start(opts).await.context("starting the cluster")?;
    eprintln!("  up in {:.1} s", cluster.started_in().as_secs_f64());
    let outcome = cluster_scenario(&cluster, cfg, report).await;
    if let Err(e) = &outcome {
        eprintln!("{e:#}\n{}", tail(&cluster.logs(), 200));
    }
    let t = Instant::now();
    let down = cluster.shutdown().await;
    eprintln!("  cluster down in {:.1} s", t.elapsed().as_secs_f64());
    outcome?;
    down.map(drop)
}

async fn cluster_scenario(cluster: &Cluster, cfg: Config, report: &mut Report) -> Result<()> {
    // Idle memory: services up, no pods yet.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let watcher_pid = cluster.watcher().pid().context("watcher pid")?;
    let allocator_pid = cluster.allocator().pid().context("allocator pid")?;
    report.figure("kuryr-watcher RSS, idle (2 nodes, no pods)", mib(rss_mib(watcher_pid)?.0), "");
    report.figure("kuryr-vif-allocator RSS, idle", mib(rss_mib(allocator_pid)?.0), "");
    for n in cluster.nodes() {
        if let Some(pid) = n.node.binder.pid() {
            report.figure(format!("kuryr-binder {} RSS, idle", n.name), mib(rss_mib(pid)?.0), "");
        }
    }
    if cfg.pods > 0 {
        latency(cluster, cfg, report).await?;
    }
    if cfg.burst > 0 {
        burst(cluster, cfg.burst, report).await?;
    }
    Ok(())
}

/// What the bench knows of one steady-rate pod.
#[derive(Debug)]
struct Created {
    name: String,
    node: String,
    /// The create request was sent.
    sent: Instant,
    /// Its response arrived.
    answered: Instant,
}

async fn latency(cluster: &Cluster, cfg: Config, report: &mut Report) -> Result<()> {
    let client = cluster.client();
    kuryr_tests::objects::create_namespace(&client, LATENCY_NS).await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), LATENCY_NS);
    let nodes: Vec<String> = cluster.nodes().iter().map(|n| n.name.clone()).collect();
    let clock = Clock::now();
    let allocs_before = allocator_counter(cluster).await?;
    eprintln!("# part 1: {} pods at {} pods/s over {} nodes", cfg.pods, cfg.rate, nodes.len());
    let requests_before = apiserver_requests(&client).await?;

    let (created, start, sending) = create_steady(&api, LATENCY_NS, &nodes, cfg).await?;
    // Every pod's sandbox up, as its kubelet records it.
    let records = wait_sandboxes(&created, || kubelet_records(cluster.kubelets(), LATENCY_NS)).await?;
    let all_up = start.elapsed();
    let (rows, total) = per_pod_requests(&requests_before, &apiserver_requests(&client).await?, created.len());
    report.steady_requests = rows;
    report.figure(
        format!("API requests per pod at {}/s (every client's, the bench's creates excluded)", cfg.rate),
        format!("{:.2}", total / created.len().max(1) as f64),
        "",
    );
    eprintln!("  all sandboxes up {:.1} s after the first create", all_up.as_secs_f64());

    let allocator_metrics = scrape(&cluster.allocator().metrics).await?;
    let handed = log_events(&cluster.allocator().logs(), "VIF handed out");
    let mut adds: HashMap<String, LogLine> = HashMap::new();
    for n in cluster.nodes() {
        adds.extend(log_events(&n.node.binder_logs(), "ADD done"));
    }

    // Each pod's timeline, in ms since its create request was sent.
    let mut s = Series::default();
    let mut retried = 0;
    for c in &created {
        let r = &records[&c.name];
        let key = format!("{LATENCY_NS}/{}", c.name);
        let (Some(network_ready), Some(call)) = (r.network_ready, r.sandbox_call) else { continue };
        let sent_us = clock.wall_us(c.sent);
        let since = |wall_us: i64| (wall_us - sent_us) as f64 / 1e3;
        let returned = r.first_seen + network_ready;
        let rps_start = returned - call;
        if r.attempts > 1 {
            retried += 1;
        }
        s.push("e2e", ms_between(c.sent, returned));
        s.push("create", ms_between(c.sent, c.answered));
        s.push("seen", ms_between(c.sent, r.first_seen));
        s.push("kubelet", ms_between(r.first_seen, rps_start));
        s.push("rps", ms(call));
        if let Some(h) = handed.get(&key) {
            s.push("handed", since(h.wall_us));
        }
        if let Some(a) = adds.get(&key) {
            let (took, wait, plug) = (a.ms("took_ms"), a.ms("vif_wait_ms"), a.ms("plug_ms"));
            s.push("add_done", since(a.wall_us));
            if let Some(took) = took {
                let add_start = since(a.wall_us) - took;
                s.push("add", took);
                s.push("pre_cni", add_start - ms_between(c.sent, rps_start));
                s.push("post_cni", ms_between(c.sent, returned) - since(a.wall_us));
                if let (Some(wait), Some(plug)) = (wait, plug) {
                    s.push("vif_wait", wait);
                    s.push("plug", plug);
                    s.push("ready_wait", took - wait - plug);
                }
            }
            if let Some(h) = handed.get(&key) {
                s.push("handed_to_add", since(a.wall_us) - since(h.wall_us));
            }
        }
    }
    let e2e = s.stats("e2e").context("no pod measured")?;
    report.kuryr = Some(e2e);
    let verdict = |v: f64, target: f64| if v <= target { "met" } else { "MISSED" };
    // The target is on the ADD (what the network plugin controls); RunPodSandbox adds the
    // runtime's own sandbox work before and after it.
    let target = |st: &Stats| {
        format!(
            "target p50 ≤ {TARGET_P50_MS} ({}), p99 ≤ {TARGET_P99_MS} ({})",
            verdict(st.p50, TARGET_P50_MS),
            verdict(st.p99, TARGET_P99_MS)
        )
    };
    let add = s.stats("add_done");
    report.latency.push((
        format!("created → RunPodSandbox returned ({} pods, {}/s)", cfg.pods, cfg.rate),
        e2e,
        if add.is_some() { String::new() } else { target(&e2e) },
    ));
    if let Some(add) = add {
        report.latency.push(("created → CNI ADD returned (binder's ADD done)".into(), add, target(&add)));
    }
    for (key, label) in [
        ("create", "API create request round trip"),
        ("seen", "created → kubelet's watch delivers the pod"),
        ("handed", "created → allocator: VIF handed out (PodVif recorded)"),
        ("kubelet", "kubelet: seen → last RunPodSandbox sent (+ failed tries)"),
        ("pre_cni", "containerd: RunPodSandbox → kuryr-cni ADD reaches binder"),
        ("vif_wait", "binder: ADD waiting for the VIF on WatchVifs"),
        ("plug", "binder: plugging (netlink)"),
        ("ready_wait", "binder: ReportPlugged → VIF READY"),
        ("add", "binder: ADD total"),
        ("handed_to_add", "VIF handed out → binder's ADD done"),
        ("post_cni", "containerd: ADD done → RunPodSandbox returned"),
        ("rps", "RunPodSandbox call as a whole (the successful one)"),
    ] {
        if let Some(st) = s.stats(key) {
            report.breakdown.push((label.to_string(), st));
        }
    }
    if let (Some(sum), Some(count)) = (
        metric(&allocator_metrics, "kuryr_allocator_vif_ready_seconds_sum"),
        metric(&allocator_metrics, "kuryr_allocator_vif_ready_seconds_count"),
    ) && count > 0.0
    {
        report.notes.push(format!(
            "allocator's own view (kuryr_allocator_vif_ready_seconds): first seen → VIF published, mean {:.1} ms over {count} VIFs",
            sum / count * 1e3
        ));
    }
    if handed.len() < created.len() || adds.len() < created.len() {
        report.notes.push(format!(
            "log timestamps found for {} of {} pods (allocator) and {} (binders)",
            handed.iter().filter(|(k, _)| k.starts_with(LATENCY_NS)).count(),
            created.len(),
            adds.len()
        ));
    }
    if retried > 0 {
        // By CNI code, with one message as an example.
        let mut failures: HashMap<String, (usize, String)> = HashMap::new();
        for n in cluster.nodes() {
            for line in n.node.binder_logs().lines().filter(|l| l.contains("CNI operation failed")) {
                let f = parse_fields(line.split_once("CNI operation failed").map_or("", |(_, r)| r));
                let code = f.get("code").cloned().unwrap_or_else(|| "?".into());
                let e = failures.entry(code).or_insert_with(|| (0, f.get("error").cloned().unwrap_or_default()));
                e.0 += 1;
            }
        }
        let failures: Vec<String> =
            failures.iter().map(|(code, (n, example))| format!("{n}× code {code} (e.g. {example:?})")).collect();
        report.notes.push(format!(
            "{retried} pods needed more than one RunPodSandbox attempt (the kubelet retries with backoff); \
             CNI failures in the binders' logs: {}",
            if failures.is_empty() { "none".to_string() } else { failures.join(", ") }
        ));
    }
    let allocs = allocator_counter(cluster).await? - allocs_before;
    report.figure(
        format!("steady rate: all {} sandboxes up after", cfg.pods),
        format!("{:.1} s", all_up.as_secs_f64()),
        format!("(creates sent over {:.1} s; {allocs:.0} VIFs allocated)", sending.as_secs_f64()),
    );
    report.figure(
        format!("kuryr-watcher RSS with {} pods", cfg.pods),
        mib(rss_mib(cluster.watcher().pid().context("watcher pid")?)?.0),
        "",
    );
    report.figure(
        format!("kuryr-vif-allocator RSS with {} pods", cfg.pods),
        mib(rss_mib(cluster.allocator().pid().context("allocator pid")?)?.0),
        "",
    );
    for n in cluster.nodes() {
        if let Some(pid) = n.node.binder.pid() {
            let count = created.iter().filter(|c| c.node == n.name).count();
            report.figure(format!("kuryr-binder {} RSS with {count} pods", n.name), mib(rss_mib(pid)?.0), "");
        }
    }

    // Tear down through the API, as users would: kubelets run CNI DEL, the allocator releases.
    let t = Instant::now();
    delete_all(&api, &created).await?;
    report.figure(
        format!("teardown: {} pods deleted → gone (CNI DEL, release)", cfg.pods),
        format!("{:.1} s", t.elapsed().as_secs_f64()),
        "",
    );
    Ok(())
}

/// Creates `cfg.pods` pods in `ns` at `cfg.rate` pods/s, alternating between `nodes`: pod i is
/// sent at start + i/rate whatever the earlier requests are doing. Returns the pods, the start
/// and how long sending took.
async fn create_steady(
    api: &Api<Pod>,
    ns: &str,
    nodes: &[String],
    cfg: Config,
) -> Result<(Vec<Created>, tokio::time::Instant, Duration)> {
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    let period = Duration::from_secs_f64(1.0 / cfg.rate);
    let mut handles = Vec::with_capacity(cfg.pods);
    for i in 0..cfg.pods {
        tokio::time::sleep_until(start + period.mul_f64(i as f64)).await;
        let (name, node) = (format!("lat-{i:04}"), nodes[i % nodes.len()].clone());
        let (api, ns) = (api.clone(), ns.to_string());
        handles.push(tokio::spawn(async move {
            let body = pod(&ns, &name, &node);
            let sent = Instant::now();
            api.create(&PostParams::default(), &body).await.with_context(|| format!("creating pod {name}"))?;
            anyhow::Ok(Created { name, node, sent, answered: Instant::now() })
        }));
    }
    let sending = start.elapsed();
    let mut created = Vec::with_capacity(cfg.pods);
    for h in handles {
        created.push(h.await??);
    }
    eprintln!(
        "  {} creates sent in {:.1} s ({:.1}/s)",
        created.len(),
        sending.as_secs_f64(),
        created.len() as f64 / sending.as_secs_f64()
    );
    Ok((created, start, sending))
}

/// Waits until every pod of `created` has its sandbox up, as its kubelet records it; returns
/// the records by pod name.
async fn wait_sandboxes(
    created: &[Created],
    records: impl Fn() -> HashMap<String, PodRecord>,
) -> Result<HashMap<String, PodRecord>> {
    wait_progress("every sandbox running", Duration::from_secs(180), || async {
        let records = records();
        let ready = created.iter().filter(|c| records.get(&c.name).is_some_and(|r| r.network_ready.is_some())).count();
        ensure!(ready == created.len(), "{ready}/{} sandboxes up", created.len());
        Ok(records)
    })
    .await
}

/// Each pod's time from its create request to RunPodSandbox returning in its kubelet.
fn created_to_sandbox(created: &[Created], records: &HashMap<String, PodRecord>) -> Vec<f64> {
    created
        .iter()
        .filter_map(|c| {
            let r = records.get(&c.name)?;
            Some(ms_between(c.sent, r.first_seen + r.network_ready?))
        })
        .collect()
}

/// Deletes `created` through the API (kubelets run CNI DEL) and waits until every pod is gone.
async fn delete_all(api: &Api<Pod>, created: &[Created]) -> Result<()> {
    let dp = DeleteParams::default();
    futures::stream::iter(created.iter())
        .map(|c| {
            let api = api.clone();
            let dp = dp.clone();
            async move { api.delete(&c.name, &dp).await.map(drop).with_context(|| format!("deleting {}", c.name)) }
        })
        .buffer_unordered(CREATE_CONCURRENCY)
        .try_for_each(|()| async { Ok(()) })
        .await?;
    wait_progress("every pod gone", Duration::from_secs(240), || async {
        let left = api.list(&ListParams::default()).await?.items.len();
        ensure!(left == 0, "{left} pods left");
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// The reference arm: the same steady-rate workload with bridge + host-local

/// Part 0: the steady-rate workload of part 1 on the same harness — a fresh API server, two
/// containerd instances driven by the test kubelet — with the reference `bridge` + `host-local`
/// plugins as the nodes' network instead of kuryr (and no kuryr service running). Returns each
/// pod's created → RunPodSandbox returned.
async fn reference_arm(cfg: Config, report: &mut Report) -> Result<Stats> {
    eprintln!("# part 0: reference arm, {} pods at {} pods/s over 2 nodes (bridge + host-local)", cfg.pods, cfg.rate);
    let kube = KubeEnv::start().await?;
    let client = kube.client().await?;
    let mut nodes = Vec::new();
    let mut kubelets = Vec::new();
    let outcome = async {
        for i in 0..2u8 {
            let ctd = Containerd::start(ContainerdOptions::default()).await?;
            reference_conflist(&ctd, i)?;
            ctd.cri().wait_network_ready().await?;
            let name = format!("ref-{}", i + 1);
            let host_ips = vec![IpAddr::from([192, 0, 2, i + 1])];
            kubelets.push(Kubelet::start(
                client.clone(),
                ctd.cri().clone(),
                KubeletOptions { node_name: name.clone(), host_ips, containers: None },
            ));
            nodes.push((name, ctd));
        }
        kuryr_tests::objects::create_namespace(&client, LATENCY_NS).await?;
        let api: Api<Pod> = Api::namespaced(client.clone(), LATENCY_NS);
        let names: Vec<String> = nodes.iter().map(|(n, _)| n.clone()).collect();
        let (created, start, _) = create_steady(&api, LATENCY_NS, &names, cfg).await?;
        let records = wait_sandboxes(&created, || kubelet_records(&kubelets, LATENCY_NS)).await?;
        eprintln!("  all sandboxes up {:.1} s after the first create", start.elapsed().as_secs_f64());
        let e2e = Stats::of(&created_to_sandbox(&created, &records)).context("no reference pod measured")?;
        let retried = records.values().filter(|r| r.attempts > 1).count();
        if retried > 0 {
            report.notes.push(format!("reference arm: {retried} pods needed more than one RunPodSandbox attempt"));
        }
        delete_all(&api, &created).await?;
        anyhow::Ok(e2e)
    }
    .await;
    drop(kubelets);
    let mut down = Ok(());
    for (name, ctd) in nodes {
        if let Err(e) = ctd.shutdown().await {
            down = Err(e.context(format!("stopping containerd of {name}")));
        }
    }
    drop(kube);
    let e2e = outcome?;
    down?;
    report.latency.push((
        format!("reference bridge+host-local: created → RunPodSandbox returned ({} pods, {}/s)", cfg.pods, cfg.rate),
        e2e,
        String::new(),
    ));
    Ok(e2e)
}

/// The reference plugins as one node's network: `bridge` (gateway on the bridge) with
/// `host-local` keeping its leases in the instance's own directory, one /16 per node.
fn reference_conflist(ctd: &Containerd, node: u8) -> Result<()> {
    for plugin in ["bridge", "host-local"] {
        std::os::unix::fs::symlink(Path::new(REFERENCE_CNI).join(plugin), ctd.cni_bin_dir().join(plugin))
            .with_context(|| format!("installing {REFERENCE_CNI}/{plugin}"))?;
    }
    let conflist = serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "bench-reference",
        "plugins": [{
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": true,
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{ "subnet": format!("10.{}.0.0/16", 98 + node) }]],
                "routes": [{ "dst": "0.0.0.0/0" }],
                "dataDir": ctd.scratch_dir().join("host-local"),
            }
        }]
    });
    std::fs::write(ctd.cni_conf_dir().join("10-bridge.conflist"), serde_json::to_vec_pretty(&conflist)?)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// API requests, from the API server's own counters

/// Named samples in ms.
#[derive(Debug, Default)]
struct Series(HashMap<&'static str, Vec<f64>>);

impl Series {
    fn push(&mut self, key: &'static str, v: f64) {
        self.0.entry(key).or_default().push(v);
    }

    fn stats(&self, key: &str) -> Option<Stats> {
        Stats::of(self.0.get(key)?)
    }
}

/// Every kubelet's records of `namespace`'s pods, by pod name (the bench's pod names are unique
/// only within a namespace).
fn kubelet_records(kubelets: &[Kubelet], namespace: &str) -> HashMap<String, PodRecord> {
    kubelets.iter().flat_map(|k| k.pods()).filter(|r| r.namespace == namespace).map(|r| (r.name.clone(), r)).collect()
}

async fn allocator_counter(cluster: &Cluster) -> Result<f64> {
    let text = scrape(&cluster.allocator().metrics).await?;
    metric(&text, "kuryr_allocator_allocations_total").context("no kuryr_allocator_allocations_total")
}

/// Part 2: `n` pods created at once; time until each PodVif has addresses.
async fn burst(cluster: &Cluster, n: usize, report: &mut Report) -> Result<()> {
    eprintln!("# part 2: a burst of {n} pods (no sandboxes)");
    let client = cluster.client();
    kuryr_tests::objects::create_namespace(&client, BURST_NS).await?;
    let allocated: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let vifs: Api<PodVif> = Api::namespaced(client.clone(), BURST_NS);
    let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
    let watch = {
        let allocated = allocated.clone();
        tokio::spawn(async move {
            let mut synced = Some(synced_tx);
            let mut stream = std::pin::pin!(watcher(vifs, watcher::Config::default()));
            while let Some(ev) = stream.next().await {
                let vif = match ev {
                    Ok(watcher::Event::Apply(v) | watcher::Event::InitApply(v)) => v,
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = synced.take() {
                            let _ = tx.send(());
                        }
                        continue;
                    }
                    Ok(_) => continue,
                    Err(e) => {
                        eprintln!("  PodVif watch: {e} (retrying)");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                let has_ips = vif.vif().is_some_and(|v| !v.ips.is_empty());
                if has_ips && let Some(name) = vif.metadata.name {
                    allocated.lock().unwrap_or_else(PoisonError::into_inner).entry(name).or_insert_with(Instant::now);
                }
            }
        })
    };
    tokio::time::timeout(Duration::from_secs(30), synced_rx).await.context("PodVif watch not synced")??;
    let before = allocator_counter(cluster).await?;
    let requests_before = apiserver_requests(&client).await?;
    let cpu_before = CpuSnapshot::take();

    let pods = burst_pods(n);
    let t0 = Instant::now();
    let created_in = create_all(&client, pods).await?;
    let done = wait_progress("every burst PodVif allocated", Duration::from_secs(300), || async {
        let map = allocated.lock().unwrap_or_else(PoisonError::into_inner);
        ensure!(map.len() >= n, "{}/{n} allocated", map.len());
        Ok(map.values().copied().max().unwrap_or(t0))
    })
    .await?;
    let cpu = cpu_before.since(&CpuSnapshot::take(), cpu_group);
    // Before the watch ends: a watch is counted when it ends.
    let requests_after = apiserver_requests(&client).await?;
    watch.abort();
    let took = done.duration_since(t0);
    let after = allocator_counter(cluster).await?;
    let lat: Vec<f64> =
        allocated.lock().unwrap_or_else(PoisonError::into_inner).values().map(|t| ms_between(t0, *t)).collect();
    if let Some(st) = Stats::of(&lat) {
        report.latency.push((format!("burst of {n}: first create sent → PodVif has addresses"), st, String::new()));
    }
    let label = format!("allocations/s (burst of {n} at once, API server + allocator)");
    let per_s = n as f64 / took.as_secs_f64();
    report.allocations = Some((label.clone(), per_s));
    report.figure(
        label,
        format!("{per_s:.0} /s"),
        format!(
            "(all {n} in {:.2} s; creates took {:.2} s; allocator counted {:.0})",
            took.as_secs_f64(),
            created_in.as_secs_f64(),
            after - before
        ),
    );
    ensure!(after - before >= n as f64, "the allocator counted {} allocations for {n} pods", after - before);
    report.notes.push(format!(
        "allocations/s target ≥ {TARGET_ALLOCATIONS_PER_S} /s ({})",
        if per_s >= TARGET_ALLOCATIONS_PER_S { "met" } else { "MISSED" }
    ));
    burst_requests(&requests_before, &requests_after, n, report);
    let server = |cpu: &std::collections::BTreeMap<String, f64>| {
        ["kube-apiserver", "etcd"].iter().filter_map(|c| cpu.get(*c)).sum::<f64>()
    };
    if let Some(alone) = report.baseline_cpu {
        let with = server(&cpu);
        let per_pod = |s: f64| s * 1000.0 / n as f64;
        report.figure(
            "burst: kube-apiserver + etcd CPU per pod, with kuryr",
            format!("{:.2} ms", per_pod(with)),
            format!("(creates alone {:.2} ms; kuryr's share {:.2} ms, derived)", per_pod(alone), per_pod(with - alone)),
        );
    }
    let mut cpu: Vec<(String, f64)> = cpu.into_iter().filter(|(_, s)| *s >= 0.01).collect();
    cpu.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    report.burst_cpu = cpu;
    let held = metric(&scrape(&cluster.allocator().metrics).await?, "kuryr_allocator_vifs").unwrap_or(0.0);
    report.figure(
        format!("kuryr-vif-allocator RSS holding {held} VIFs"),
        mib(rss_mib(cluster.allocator().pid().context("allocator pid")?)?.0),
        "",
    );
    Ok(())
}

/// The burst's pods, alternating between the two burst nodes.
fn burst_pods(n: usize) -> Vec<Pod> {
    (0..n).map(|i| pod(BURST_NS, &format!("burst-{i:04}"), BURST_NODES[i % 2])).collect()
}

/// Part 2's baseline: the burst's creates alone, on a fresh API server with no kuryr service
/// (nobody watches or writes the pods): how fast this machine creates them, and the CPU the API
/// server and etcd spend on the creates themselves, so that the burst's figures show what kuryr
/// adds.
async fn burst_baseline(n: usize, report: &mut Report) -> Result<()> {
    eprintln!("# part 2, baseline: the burst's {n} creates on a fresh API server, no network plugin");
    let kube = KubeEnv::start().await?;
    let client = kube.client().await?;
    kuryr_tests::objects::create_namespace(&client, BURST_NS).await?;
    let before = CpuSnapshot::take();
    let took = create_all(&client, burst_pods(n)).await?;
    let cpu = before.since(&CpuSnapshot::take(), cpu_group);
    drop(kube);
    let (apiserver, etcd) =
        (cpu.get("kube-apiserver").copied().unwrap_or(0.0), cpu.get("etcd").copied().unwrap_or(0.0));
    report.baseline_cpu = Some(apiserver + etcd);
    report.figure(
        format!("burst of {n}: the creates alone, no network plugin"),
        format!("{:.0} /s", n as f64 / took.as_secs_f64()),
        format!("(in {:.2} s; kube-apiserver {apiserver:.2} + etcd {etcd:.2} CPU s)", took.as_secs_f64()),
    );
    Ok(())
}

/// The group a process's CPU counts in during the burst, by its command name.
fn cpu_group(comm: &str) -> String {
    match comm {
        c if c.starts_with("kuryr-") || c.starts_with("containerd") || c == "kube-apiserver" || c == "etcd" => {
            c.to_string()
        }
        c if c.starts_with("e2e-bench") => "this benchmark".into(),
        // Kernel threads and the rest of the machine.
        _ => "other".into(),
    }
}

/// The API requests the burst cost per pod, from the API server's counters read before the
/// first create and once every PodVif had its addresses: everything every client sent (the
/// allocator, the watcher, the idle kubelets and binders of the cluster's own nodes) except the
/// bench's own `n` pod creates.
fn burst_requests(before: &Requests, after: &Requests, n: usize, report: &mut Report) {
    let (rows, total) = per_pod_requests(before, after, n);
    report.requests = rows;
    let per_pod = total / n as f64;
    report.requests_per_pod = Some(per_pod);
    report.figure(
        format!("API requests per pod (burst of {n}, the bench's creates excluded)"),
        format!("{per_pod:.2}"),
        format!(
            "target ≤ {TARGET_REQUESTS_PER_POD} ({}; {total:.0} requests)",
            if per_pod <= TARGET_REQUESTS_PER_POD { "met" } else { "MISSED" }
        ),
    );
}

/// The API requests served between `before` and `after` per pod of `n`, by (verb, resource),
/// the bench's own `n` pod creates excluded; and their total.
fn per_pod_requests(before: &Requests, after: &Requests, n: usize) -> (Vec<(String, f64)>, f64) {
    let mut rows = Vec::new();
    let mut total = 0.0;
    for ((verb, resource), count) in requests_between(before, after) {
        let count = if verb == "POST" && resource == "pods" { count - n as f64 } else { count };
        if count <= 0.0 {
            continue;
        }
        total += count;
        rows.push((format!("{verb} {resource}"), count / n as f64));
    }
    (rows, total)
}

// ---------------------------------------------------------------------------------------------
// Part 3: the watcher's memory with many pods

async fn watcher_memory(n: usize, report: &mut Report) -> Result<()> {
    eprintln!("# part 3: kuryr-watcher with {n} pods in the API");
    let kube = KubeEnv::start().await?;
    let client = kube.client().await?;
    kube.apply_yaml(&format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {SYSTEM_NAMESPACE}\n")).await?;
    kube.apply_file(&repo_root().join("deploy/rbac")).await?;
    let kubeconfig = kube.service_account_kubeconfig(SYSTEM_NAMESPACE, WATCHER_ACCOUNT).await?;
    let dir = tempfile::Builder::new().prefix("kuryr-e2e-bench-").tempdir_in("/tmp")?;
    let (port, mport) = (free_port()?, free_port()?);
    let (addr, metrics_addr) = (format!("127.0.0.1:{port}"), format!("127.0.0.1:{mport}"));
    let args: Vec<String> = [
        "--listen",
        &addr,
        "--metrics-listen",
        &metrics_addr,
        "--kubeconfig",
        &kubeconfig.display().to_string(),
        "--log",
        "info",
        "--shutdown-grace",
        "2s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut process = ServiceProcess::spawn("kuryr-watcher", &args, dir.path())?;
    // The subscriber below plays the allocator, with its account's token.
    let token = kube.kuryr_token(SYSTEM_NAMESPACE, ALLOCATOR_ACCOUNT, None).await?;
    let outcome = watcher_memory_run(&client, n, &addr, &metrics_addr, &process, &token, report).await;
    if outcome.is_err() {
        eprintln!("{}", tail(&process.logs(), 100));
    }
    process.terminate(Duration::from_secs(10)).await?;
    drop(kube);
    outcome
}

async fn watcher_memory_run(
    client: &kube::Client,
    n: usize,
    addr: &str,
    metrics_addr: &str,
    process: &ServiceProcess,
    token: &str,
    report: &mut Report,
) -> Result<()> {
    let channel = kuryr_runtime::client::channel(addr)?;
    wait_until("kuryr-watcher SERVING", Duration::from_secs(60), || {
        kuryr_runtime::client::check_serving(channel.clone(), service_names::WATCHER)
    })
    .await?;
    let pid = process.pid().context("watcher pid")?;

    // One subscriber for pods, as the allocator is: it must receive every pod.
    let received: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
    let req = SubscribeRequest {
        kinds: vec![Kind::Pod as i32],
        filter: Some(Filter { exclude_host_network: true, ..Filter::default() }),
        resume_from: String::new(),
        subscriber: "e2e-bench".into(),
    };
    let mut stream = WatcherClient::new(kuryr_tests::auth::channel(addr, token)?).subscribe(req).await?.into_inner();
    let sub = {
        let received = received.clone();
        tokio::spawn(async move {
            while let Ok(Some(ev)) = stream.message().await {
                if ev.r#type() == EventType::Applied
                    && let Some(o) = ev.object
                {
                    received.lock().unwrap_or_else(PoisonError::into_inner).insert(o.uid);
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    report.figure("kuryr-watcher RSS, idle (empty cluster, 1 subscriber)", mib(rss_mib(pid)?.0), "");

    for ns in RSS_NS {
        kuryr_tests::objects::create_namespace(client, ns).await?;
    }
    let pods: Vec<Pod> = (0..n)
        .map(|i| pod(RSS_NS[i % RSS_NS.len()], &format!("p-{i:05}"), &format!("fake-node-{}", i % RSS_NODES)))
        .collect();
    eprintln!("  creating {n} pods ({CREATE_CONCURRENCY} requests in flight)");
    let t0 = Instant::now();
    let created_in = create_all(client, pods).await?;
    eprintln!("  created in {:.1} s ({:.0}/s)", created_in.as_secs_f64(), n as f64 / created_in.as_secs_f64());
    let series = r#"kuryr_watcher_objects{kind="pod"}"#;
    wait_progress("the watcher's index and its subscriber to hold every pod", Duration::from_secs(300), || async {
        let text = scrape(metrics_addr).await?;
        let held = metric(&text, series).unwrap_or(0.0);
        let got = received.lock().unwrap_or_else(PoisonError::into_inner).len();
        ensure!(held as usize >= n && got >= n, "index holds {held}, subscriber received {got} of {n}");
        Ok(())
    })
    .await?;
    let indexed = t0.elapsed();
    // Let allocations made while catching up settle before reading memory.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (rss, hwm) = rss_mib(pid)?;
    sub.abort();
    report.figure(
        format!("kuryr-watcher RSS with {n} pods indexed, 1 subscriber"),
        mib(rss),
        format!(
            "target ≤ {TARGET_WATCHER_RSS_MIB} MB ({})",
            if rss <= TARGET_WATCHER_RSS_MIB { "met" } else { "MISSED" }
        ),
    );
    report.figure("kuryr-watcher peak RSS (VmHWM) during that", mib(hwm), "");
    report.figure(
        format!("{n} pods created → all in the watcher's index and stream"),
        format!("{:.1} s", indexed.as_secs_f64()),
        format!("(API creates alone {:.1} s)", created_in.as_secs_f64()),
    );
    if !Path::new(&format!("/proc/{pid}")).exists() {
        bail!("the watcher exited");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_fields_are_parsed_with_quotes_and_lists() {
        let line = "2025-01-02T03:04:05.678901Z  INFO cni: kuryr_binder::cni: ADD done pod=\"ns/p-1\" container=abc took_ms=12.5 vif_wait_ms=3 plug_ms=4.25";
        let events = log_events(line, "ADD done");
        let e = &events["ns/p-1"];
        assert_eq!(e.ms("took_ms"), Some(12.5));
        assert_eq!(e.ms("plug_ms"), Some(4.25));
        assert_eq!(e.wall_us, "2025-01-02T03:04:05.678901Z".parse::<Timestamp>().unwrap().as_microsecond());
        let f = parse_fields("pod=ns/a ips=[\"10.0.0.1/24\", \"fd00::1/64\"] node=n1");
        assert_eq!(f["pod"], "ns/a");
        assert_eq!(f["node"], "n1");
        assert!(log_events("garbage line", "ADD done").is_empty());
    }

    #[test]
    fn percentiles_of_a_known_sample() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Stats::of(&v).unwrap();
        assert_eq!((s.n, s.p50, s.p99, s.max), (100, 51.0, 99.0, 100.0));
        assert!(Stats::of(&[]).is_none());
    }

    #[test]
    fn metrics_series_are_found_exactly() {
        let text =
            "# HELP x\nkuryr_watcher_objects{kind=\"pod\"} 42\nkuryr_watcher_objects{kind=\"node\"} 2\nfoo_total 7\n";
        assert_eq!(metric(text, r#"kuryr_watcher_objects{kind="pod"}"#), Some(42.0));
        assert_eq!(metric(text, "foo_total"), Some(7.0));
        assert_eq!(metric(text, "foo"), None);
    }
}
