//! `make bench-svc` (run by `make bench`): endpoint change → Service rules programmed on every
//! node, on the embedded backend with optimised binaries (point `KURYR_BIN_DIR` at them).
//!
//! A two-node [`Cluster`] with Services (kube-controller-manager's EndpointSlice controller,
//! kuryr-lbaas, binders with `--lbaas`). Each node's namespace runs `nft monitor`, which prints
//! a `# new generation` line as each nftables transaction commits; after a change the bench reads
//! `nft list table inet kuryr` on every new generation until the table shows the change, and the
//! change counts as programmed on that node at the first transaction committed after the change
//! was written; on every node = the latest of those. Two parts:
//!
//! 1. **EndpointSlice written → every node.** A Service without a selector whose EndpointSlice
//!    the bench manages itself (as any controller other than the built-in one may): each change
//!    adds or removes one ready endpoint, timed from the write request to the last node's table
//!    showing it (watcher → kuryr-lbaas → both binders → nftables).
//! 2. **Pod deleted → every node.** A Service selecting real pods (sandboxes through CRI, Ready
//!    in their status); each round creates a pod and waits for it in every node's rules (timed
//!    from the create request, sandbox start included), then deletes it, timed from the delete
//!    request until its address has left every node's rules (the EndpointSlice controller marks
//!    it terminating at once, kuryr-lbaas drops it from the ready members; a second pod that
//!    stays throughout keeps a ready member, so a terminating one is not used as a fallback).
//!
//! Environment: `BENCH_SVC_CHANGES` (default 50), `BENCH_SVC_POD_ROUNDS` (default 20); `0` skips a
//! part. `BENCH_SVC_LOG` is the services' `--log` filter (default `info`).
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{Pod, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kuryr_tests::cluster::svc::table_has;
use kuryr_tests::cluster::{Cluster, ClusterOptions};
use kuryr_tests::nftmon::{Monitor, baseline, wait_all};
use kuryr_tests::objects;
use kuryr_tests::stats::{Stats, ms};
use kuryr_tests::util::{bin_dir, env_or, loadavg, tail};

const NAMESPACE: &str = "bench-svc";
/// The Service whose EndpointSlice the bench writes.
const MANUAL: &str = "manual";
/// The Service selecting the bench's pods.
const SELECTED: &str = "selected";
const PORT: i32 = 80;
const TARGET_PORT: i32 = 8080;
/// The bench's own EndpointSlice controller name (the built-in one leaves such slices alone).
const MANAGED_BY: &str = "bench.kuryr.openstack.org";
/// Bound on one change reaching every node.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Target for endpoint change → rules programmed on every node.
const TARGET_MS: f64 = 100.0;

fn main() -> Result<()> {
    let changes = env_or("BENCH_SVC_CHANGES", 50)?;
    let rounds = env_or("BENCH_SVC_POD_ROUNDS", 20)?;
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build()?.block_on(run(changes, rounds))
}

async fn run(changes: usize, rounds: usize) -> Result<()> {
    let t = Instant::now();
    let load_before = loadavg();
    let service_log = std::env::var("BENCH_SVC_LOG").unwrap_or_else(|_| "info".into());
    let opts = ClusterOptions { nodes: 2, services: true, service_log, ..ClusterOptions::default() };
    let cluster = Cluster::start(opts).await.context("starting the cluster")?;
    println!("svc-bench: cluster up in {:.1} s (binaries from {})", cluster.started_in().as_secs_f64(), bin_dir());
    let outcome = measure(&cluster, changes, rounds).await;
    if outcome.is_err() {
        eprintln!("{}", tail(&cluster.logs(), 80));
    }
    let shutdown = cluster.shutdown().await;
    let rows = outcome?;
    shutdown?;
    println!();
    println!(
        "{:<62} {:>5} {:>8} {:>8} {:>8} {:>8}  target",
        "# endpoint change → rules on every node (ms)", "n", "p50", "p90", "p99", "max"
    );
    for (label, s, target) in &rows {
        println!("{label:<62} {:>5} {:>8.1} {:>8.1} {:>8.1} {:>8.1}  {target}", s.n, s.p50, s.p90, s.p99, s.max);
    }
    println!("note: load average {load_before} at the start, {} at the end", loadavg());
    println!("(svc bench took {:.0} s)", t.elapsed().as_secs_f64());
    Ok(())
}

type Row = (String, Stats, String);

async fn measure(cluster: &Cluster, changes: usize, rounds: usize) -> Result<Vec<Row>> {
    let client = cluster.client();
    kuryr_tests::objects::create_namespace(&client, NAMESPACE).await?;
    let mut rows = Vec::new();
    let poll = PollCost::default();
    let mut monitors = Vec::new();
    for n in cluster.nodes() {
        monitors.push(Monitor::start(n).await?);
    }
    let monitors = &monitors;
    if changes > 0 {
        let (all, polls) = slice_changes(cluster, monitors, changes).await?;
        let s = Stats::of(&all).context("no sample")?;
        rows.push((format!("EndpointSlice written → programmed on both nodes ({changes} changes)"), s, target(&s)));
        poll.note(&polls);
    }
    if rounds > 0 {
        let (created, deleted, polls) = pod_rounds(cluster, monitors, rounds).await?;
        let c = Stats::of(&created).context("no sample")?;
        let d = Stats::of(&deleted).context("no sample")?;
        rows.push((format!("pod deleted → out of both nodes' rules ({rounds} pods)"), d, target(&d)));
        rows.push((format!("pod created → in both nodes' rules (incl. sandbox, {rounds} pods)"), c, "-".into()));
        poll.note(&polls);
    }
    if let Some(p) = poll.stats() {
        println!(
            "note: confirming a change (`nft list table` after a transaction) took p50 {:.1} ms, p99 {:.1} ms; not in the figures",
            p.p50, p.p99
        );
    }
    Ok(rows)
}

fn target(s: &Stats) -> String {
    let met = s.p50 <= TARGET_MS && s.p99 <= TARGET_MS;
    format!("≤ {TARGET_MS:.0} ms: {}", if met { "met" } else { "NOT met" })
}

/// Part 1: the bench writes the EndpointSlice of a selector-less Service.
async fn slice_changes(cluster: &Cluster, monitors: &[Monitor], changes: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let client = cluster.client();
    let services: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NAMESPACE);
    services.create(&PostParams::default(), &service(MANUAL, None)).await?;
    let vip = cluster_ip(&services, MANUAL).await?;
    // One endpoint stays throughout; the changes add and remove a second one.
    let base: IpAddr = Ipv4Addr::new(10, 99, 0, 1).into();
    let b = baseline(monitors);
    slices.create(&PostParams::default(), &slice(&[base])).await?;
    wait_all(cluster.nodes(), monitors, &b, CHANGE_TIMEOUT, |t| table_has(t, vip) && table_has(t, base))
        .await
        .context("the first endpoint")?;
    let mut samples = Vec::new();
    let mut polls = Vec::new();
    for i in 0..changes {
        let extra: IpAddr = Ipv4Addr::new(10, 99, 1 + (i / 500) as u8, 1 + ((i / 2) % 250) as u8).into();
        let add = i % 2 == 0;
        let addresses = if add { vec![base, extra] } else { vec![base] };
        let patch = serde_json::json!({ "endpoints": endpoints(&addresses) });
        let b = baseline(monitors);
        let start = Instant::now();
        slices.patch(MANUAL, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        let (done, p) = wait_all(cluster.nodes(), monitors, &b, CHANGE_TIMEOUT, |t| table_has(t, extra) == add)
            .await
            .with_context(|| format!("change {i}: {extra} {}", if add { "added" } else { "removed" }))?;
        samples.push(ms(done.duration_since(start)));
        polls.extend(p);
    }
    services.delete(MANUAL, &DeleteParams::default()).await?;
    Ok((samples, polls))
}

/// Part 2: pods selected by a Service, created and deleted one at a time.
async fn pod_rounds(cluster: &Cluster, monitors: &[Monitor], rounds: usize) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let client = cluster.client();
    let services: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    services.create(&PostParams::default(), &service(SELECTED, Some("bench-backend"))).await?;
    let vip = cluster_ip(&services, SELECTED).await?;
    // A backend that stays: the pods deleted below are never the only (fallback) member.
    let b = baseline(monitors);
    pods.create(&PostParams::default(), &pod("backend-stays", &cluster.nodes()[0].name)).await?;
    let stays = wait_pod_ip(&pods, "backend-stays").await?;
    wait_all(cluster.nodes(), monitors, &b, CHANGE_TIMEOUT, |t| table_has(t, vip) && table_has(t, stays)).await?;
    let (mut created, mut deleted, mut polls) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        let node = &cluster.nodes()[i % cluster.nodes().len()].name;
        let name = format!("backend-{i}");
        let b = baseline(monitors);
        let start = Instant::now();
        pods.create(&PostParams::default(), &pod(&name, node)).await?;
        let ip = wait_pod_ip(&pods, &name).await?;
        let (done, p) =
            wait_all(cluster.nodes(), monitors, &b, CHANGE_TIMEOUT, |t| table_has(t, vip) && table_has(t, ip))
                .await
                .with_context(|| format!("{name} ({ip}) into the rules"))?;
        created.push(ms(done.duration_since(start)));
        polls.extend(p);
        let b = baseline(monitors);
        let start = Instant::now();
        pods.delete(&name, &DeleteParams::default()).await?;
        let (done, p) = wait_all(cluster.nodes(), monitors, &b, CHANGE_TIMEOUT, |t| !table_has(t, ip))
            .await
            .with_context(|| format!("{name} ({ip}) out of the rules"))?;
        deleted.push(ms(done.duration_since(start)));
        polls.extend(p);
        // The next pod may get the same address: wait until this one is gone from the API.
        let until = Instant::now() + CHANGE_TIMEOUT;
        while pods.get_opt(&name).await?.is_some() {
            ensure!(Instant::now() < until, "{name} still in the API after {CHANGE_TIMEOUT:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    services.delete(SELECTED, &DeleteParams::default()).await?;
    Ok((created, deleted, polls))
}

async fn wait_pod_ip(pods: &Api<Pod>, name: &str) -> Result<IpAddr> {
    let until = Instant::now() + CHANGE_TIMEOUT;
    loop {
        let p = pods.get(name).await?;
        let status = p.status.unwrap_or_default();
        let ready = status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
        if let Some(ip) =
            status.pod_ips.iter().flatten().filter_map(|i| i.ip.parse::<IpAddr>().ok()).find(IpAddr::is_ipv4)
            && ready
        {
            return Ok(ip);
        }
        ensure!(Instant::now() < until, "{name} not Ready with an IPv4 address after {CHANGE_TIMEOUT:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn cluster_ip(services: &Api<Service>, name: &str) -> Result<IpAddr> {
    let svc = services.get(name).await?;
    let ip = svc.spec.and_then(|s| s.cluster_ip).context("no ClusterIP")?;
    ip.parse().with_context(|| format!("ClusterIP {ip:?}"))
}

fn service(name: &str, selector: Option<&str>) -> Service {
    Service {
        metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() },
        spec: Some(ServiceSpec {
            selector: selector.map(|app| BTreeMap::from([("app".to_string(), app.to_string())])),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                protocol: Some("TCP".into()),
                port: PORT,
                target_port: Some(IntOrString::Int(TARGET_PORT)),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn endpoints(addresses: &[IpAddr]) -> Vec<Endpoint> {
    addresses
        .iter()
        .map(|a| Endpoint {
            addresses: vec![a.to_string()],
            conditions: Some(EndpointConditions { ready: Some(true), serving: Some(true), terminating: Some(false) }),
            ..Endpoint::default()
        })
        .collect()
}

fn slice(addresses: &[IpAddr]) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(MANUAL.into()),
            labels: Some(BTreeMap::from([
                ("kubernetes.io/service-name".to_string(), MANUAL.to_string()),
                ("endpointslice.kubernetes.io/managed-by".to_string(), MANAGED_BY.to_string()),
            ])),
            ..ObjectMeta::default()
        },
        address_type: "IPv4".into(),
        endpoints: endpoints(addresses),
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(TARGET_PORT),
            protocol: Some("TCP".into()),
            ..EndpointPort::default()
        }]),
    }
}

fn pod(name: &str, node: &str) -> Pod {
    objects::pod(name).node(node).label("app", "bench-backend").grace(0).build()
}

/// Durations of the `nft list table` polls, kept for the resolution note.
#[derive(Default)]
struct PollCost(std::sync::Mutex<Vec<f64>>);

impl PollCost {
    fn note(&self, polls: &[f64]) {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(polls);
    }
    fn stats(&self) -> Option<Stats> {
        Stats::of(&self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}
