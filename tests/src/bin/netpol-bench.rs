//! `make bench-netpol`: NetworkPolicy on the embedded dataplane, optimised binaries (point
//! `KURYR_BIN_DIR` at them), on the harness of `tests/tests/netpol.rs`: a two-node [`Cluster`]
//! with kuryr-policy and binders given `--policy`.
//!
//! What is real and what is a record: five pods are real (sandboxes through CRI on the two
//! nodes, each running `kuryr-test-echo`): `server-1` (node 1), `server-2` (node 2), `client-1`
//! (node 1), `client-2` (node 2) in `npb-real`, and `mover` (node 2) in `npb-toggle`. The 2,000
//! others are Pod objects in 20 namespaces bound to 20 nodes that do not run (`fake-node-NN`),
//! with an IPv4 address written into their status by the bench (`10.250.<ns>.<n>`): kuryr-policy
//! compiles them like any pod and the real nodes' sets hold their addresses as peers, but no
//! traffic reaches them. The 1,000 policies over them are the shapes of the compiler's own bench
//! (`cargo bench -p kuryr-policy-core`): per namespace a default deny, DNS egress, and per app
//! ingress from its caller on a named port, from its team's namespaces, from monitoring, egress
//! to the next app and to the Internet (`ipBlock` with `except`), and `matchExpressions`.
//! Four more select the real pods: the servers admit `client`s, apps 1 and 2 of every namespace
//! (400 peers) and whatever the bench toggles; the clients' egress is limited to the servers and
//! app 5.
//!
//! 1. **Connection set-up** from `client-1` to `server-2` (across nodes) and to `server-1`
//!    (same node): `kuryr-test-echo connect`, `BENCH_NETPOL_CONNECTIONS` TCP connections in a
//!    row (each judged as new by the forward hook), with the 2,000 pods and no policy, then with
//!    the 1,004 policies (the servers isolated for ingress, `client-1` for egress). p50 of
//!    `connect()` (SYN → SYN-ACK) and the ratio with / without (target ≤ 1.2).
//! 2. **Change → enforced on every node**, measured at the nftables level: `nft monitor` in each
//!    node's namespace stamps every committed transaction, the bench reads `nft list table inet
//!    kuryr` on each until the change shows (`mover`'s address entering or leaving the servers'
//!    peer sets, which exist on both nodes); the change counts from the API request to the
//!    commit on the last node ([`kuryr_tests::nftmon`]). Three kinds, `BENCH_NETPOL_CHANGES` each,
//!    alternately allowing and denying: `mover`'s label (`app=allowed`), `npb-toggle`'s label
//!    (`toggle=on`), and the policy `server-bench` edited (a peer added, removed). Every
//!    `BENCH_NETPOL_CONFIRM_EVERY`-th change is confirmed with a real connection from `mover`
//!    to `server-1` (answered, or rejected), outside the timing. Target p50 ≤ 50 ms, p99 ≤ 200 ms.
//!
//! The compile time of 1,000 policies × 2,000 pods is the compiler's own bench, which `make
//! bench-netpol` runs first. `BENCH_NETPOL_LOG` is the services' `--log` filter (default `info`).
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kuryr_tests::cluster::checks::{self, RunningPod};
use kuryr_tests::cluster::svc::table_has;
use kuryr_tests::cluster::{Cluster, ClusterOptions};
use kuryr_tests::echo::{self, EchoServer, Proto};
use kuryr_tests::metrics::Scrape;
use kuryr_tests::nftmon::{Monitor, baseline, wait_all};
use kuryr_tests::objects;
use kuryr_tests::services::{bin_path, wait_until};
use kuryr_tests::stats::{Stats, ms};
use kuryr_tests::util::{bin_dir, env_or, loadavg, tail};
use serde_json::{Value, json};

const REAL_NS: &str = "npb-real";
const TOGGLE_NS: &str = "npb-toggle";
/// Namespaces of record pods, pods in each, fake nodes they are bound to, apps among them.
const RECORD_NS: usize = 20;
const PODS_PER_NS: usize = 100;
const FAKE_NODES: usize = 20;
const APPS: usize = 10;
/// The echo port, allowed by the policies.
const PORT: u16 = 8080;
/// Requests in flight while loading pods and policies.
const CONCURRENCY: usize = 16;
/// Bound on one change reaching every node.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on loading pods or policies.
const LOAD_TIMEOUT: Duration = Duration::from_secs(600);
/// Targets: change → enforced on every node.
const TARGET_P50_MS: f64 = 50.0;
const TARGET_P99_MS: f64 = 200.0;
/// Target: connection set-up with 1,000 policies / without.
const TARGET_RATIO: f64 = 1.2;

struct Config {
    changes: usize,
    connections: usize,
    confirm_every: usize,
}

fn main() -> Result<()> {
    let cfg = Config {
        changes: env_or("BENCH_NETPOL_CHANGES", 40)?,
        connections: env_or("BENCH_NETPOL_CONNECTIONS", 2000)?,
        confirm_every: env_or("BENCH_NETPOL_CONFIRM_EVERY", 10)?.max(1),
    };
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build()?.block_on(run(cfg))
}

async fn run(cfg: Config) -> Result<()> {
    let t = Instant::now();
    let load_before = loadavg();
    let service_log = std::env::var("BENCH_NETPOL_LOG").unwrap_or_else(|_| "info".into());
    let opts = ClusterOptions { nodes: 2, policy: true, service_log, ..ClusterOptions::default() };
    let cluster = Cluster::start(opts).await.context("starting the cluster")?;
    println!("netpol-bench: cluster up in {:.1} s (binaries from {})", cluster.started_in().as_secs_f64(), bin_dir());
    let mut world = World::default();
    let outcome = measure(&cluster, &mut world, &cfg).await;
    if outcome.is_err() {
        eprintln!("{}", tail(&cluster.logs(), 120));
    }
    drop(world);
    let shutdown = cluster.shutdown().await;
    let report = outcome?;
    shutdown?;
    report.print();
    println!("note: load average {load_before} at the start, {} at the end", loadavg());
    println!("(netpol bench took {:.0} s)", t.elapsed().as_secs_f64());
    Ok(())
}

#[derive(Default)]
struct World {
    pods: BTreeMap<String, RunningPod>,
    _servers: Vec<EchoServer>,
}

impl World {
    fn ip(&self, name: &str) -> Result<IpAddr> {
        self.pods
            .get(name)
            .and_then(|p| p.ips.iter().copied().find(IpAddr::is_ipv4))
            .with_context(|| format!("{name}: no IPv4 address"))
    }

    fn netns(&self, name: &str) -> Result<&Path> {
        Ok(&self.pods.get(name).with_context(|| format!("no pod {name}"))?.netns)
    }
}

#[derive(Default)]
struct Report {
    /// (label, connect() ms without, with).
    connect: Vec<(String, Stats, Stats)>,
    /// (kind, change → every node ms).
    changes: Vec<(String, Stats)>,
    all: Option<Stats>,
    confirmed: usize,
    facts: Vec<String>,
    polls: Option<Stats>,
}

impl Report {
    fn print(&self) {
        println!();
        for f in &self.facts {
            println!("{f}");
        }
        println!();
        println!(
            "{:<58} {:>5} {:>8} {:>8} {:>8} {:>8}  target",
            "# change → enforced on both nodes' nftables (ms)", "n", "p50", "p90", "p99", "max"
        );
        for (label, s) in self
            .changes
            .iter()
            .chain(self.all.iter().map(|s| (String::from("all changes"), *s)).collect::<Vec<_>>().iter())
        {
            let met = s.p50 <= TARGET_P50_MS && s.p99 <= TARGET_P99_MS;
            println!(
                "{label:<58} {:>5} {:>8.1} {:>8.1} {:>8.1} {:>8.1}  p50 ≤ {TARGET_P50_MS:.0}, p99 ≤ {TARGET_P99_MS:.0}: {}",
                s.n,
                s.p50,
                s.p90,
                s.p99,
                s.max,
                if met { "met" } else { "NOT met" }
            );
        }
        println!(
            "({} of the changes confirmed with a real connection: answered or rejected as expected)",
            self.confirmed
        );
        if let Some(p) = self.polls {
            println!(
                "note: confirming a change (`nft list table` after a transaction) took p50 {:.1} ms, p99 {:.1} ms; not in the figures",
                p.p50, p.p99
            );
        }
        println!();
        println!(
            "{:<58} {:>6} {:>9} {:>9} {:>9} {:>9}  ratio (p50 with / without)",
            "# TCP connection set-up, connect() (ms)", "n", "p50 w/o", "p99 w/o", "p50 with", "p99 with"
        );
        for (label, without, with) in &self.connect {
            let ratio = with.p50 / without.p50;
            println!(
                "{label:<58} {:>6} {:>9.3} {:>9.3} {:>9.3} {:>9.3}  {ratio:.2} (derived; target ≤ {TARGET_RATIO}: {})",
                with.n,
                without.p50,
                without.p99,
                with.p50,
                with.p99,
                if ratio <= TARGET_RATIO { "met" } else { "NOT met" }
            );
        }
    }
}

async fn measure(cluster: &Cluster, w: &mut World, cfg: &Config) -> Result<Report> {
    let client = cluster.client();
    let mut report = Report::default();
    let (node1, node2) = (cluster.nodes()[0].name.clone(), cluster.nodes()[1].name.clone());
    for (name, labels) in [(REAL_NS.to_string(), json!({})), (TOGGLE_NS.to_string(), json!({}))]
        .into_iter()
        .chain((0..RECORD_NS).map(|i| (record_ns(i), record_ns_labels(i))))
    {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}}))?;
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await?;
    }
    // The real pods.
    let real: Api<Pod> = Api::namespaced(client.clone(), REAL_NS);
    for (name, node, app) in [
        ("server-1", &node1, "server"),
        ("server-2", &node2, "server"),
        ("client-1", &node1, "client"),
        ("client-2", &node2, "client"),
    ] {
        real.create(&PostParams::default(), &real_pod(name, node, app)).await?;
    }
    let toggle: Api<Pod> = Api::namespaced(client.clone(), TOGGLE_NS);
    toggle.create(&PostParams::default(), &real_pod("mover", &node2, "mover")).await?;
    for (ns, n) in [(REAL_NS, 4), (TOGGLE_NS, 1)] {
        for p in checks::wait_running(cluster, ns, n, Duration::from_secs(180)).await? {
            w._servers.push(echo::serve(&p.netns, &p.name, PORT)?);
            w.pods.insert(p.name.clone(), p);
        }
    }
    // The records.
    let t = Instant::now();
    load_records(&client).await?;
    let policy_svc = cluster.policy().context("kuryr-policy")?;
    let real_pods = (4 + 1) as f64;
    let total_pods = (RECORD_NS * PODS_PER_NS) as f64 + real_pods;
    wait_until("kuryr-policy to hold every pod", LOAD_TIMEOUT, || async {
        let held = Scrape::http(&policy_svc.metrics).await?.value("kuryr_policy_pods", &[])?;
        ensure!(held >= total_pods, "{held} of {total_pods}");
        Ok(())
    })
    .await?;
    report.facts.push(format!(
        "{} record pods (Pod objects on {FAKE_NODES} fake nodes, status addresses written by the bench) and {} real pods (CRI sandboxes) in {:.1} s",
        RECORD_NS * PODS_PER_NS,
        real_pods,
        t.elapsed().as_secs_f64()
    ));
    for p in w.pods.values() {
        echo::wait_answers(&p.netns, (Proto::Tcp, w.ip("server-2")?, PORT), 1, &["server-2"], |_| true, CHANGE_TIMEOUT)
            .await
            .with_context(|| format!("{} → server-2 with no policy", p.name))?;
    }

    // 1. Connection set-up without policies.
    let pairs = [("client-1 → server-2 (across nodes)", "server-2"), ("client-1 → server-1 (same node)", "server-1")];
    let mut without = Vec::new();
    for (_, to) in pairs {
        without.push(connect_times(w.netns("client-1")?, w.ip(to)?, cfg.connections).await?);
    }

    // The policies.
    let t = Instant::now();
    let count = load_policies(&client).await?;
    wait_until("kuryr-policy to hold every policy", LOAD_TIMEOUT, || async {
        let held = Scrape::http(&policy_svc.metrics).await?.value("kuryr_policy_policies", &[])?;
        ensure!(held >= count as f64, "{held} of {count}");
        Ok(())
    })
    .await?;
    // In force on both nodes: a peer of the servers (app-1 of the last record namespace).
    let peer: IpAddr = record_ip(RECORD_NS - 1, 1).parse()?;
    let mover = w.ip("mover")?;
    wait_until("both nodes to program the policies", LOAD_TIMEOUT, || async {
        for n in cluster.nodes() {
            let table = kuryr_tests::cluster::svc::nft_table(n).await;
            ensure!(table_has(&table, peer), "{}: {peer} not programmed yet", n.name);
        }
        Ok(())
    })
    .await?;
    report.facts.push(format!(
        "{count} NetworkPolicies created and programmed on both nodes in {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    // They are in force on traffic: mover is no server's peer; client-1 reaches the other server.
    expect(w.netns("mover")?, w.ip("server-1")?, false).await.context("mover → server-1 under the policies")?;
    expect(w.netns("client-1")?, w.ip("server-2")?, true).await.context("client-1 → server-2 under the policies")?;
    for n in cluster.nodes() {
        let m = Scrape::in_netns(&n.node.netns_path(), "127.0.0.1:9631").await?;
        report.facts.push(format!(
            "{}: {} set and map elements, {} groups programmed",
            n.name,
            m.value("kuryr_binder_policy_elements", &[])?,
            m.value("kuryr_binder_policy_groups", &[])?
        ));
    }
    let p = Scrape::http(&policy_svc.metrics).await?;
    report.facts.push(format!(
        "kuryr-policy: {} pods, {} policies, {} selectors, {} groups; {} publications, mean {:.2} ms compile + publish each",
        p.value("kuryr_policy_pods", &[])?,
        p.value("kuryr_policy_policies", &[])?,
        p.value("kuryr_policy_selectors", &[])?,
        p.value("kuryr_policy_groups", &[])?,
        p.count("kuryr_policy_publish_seconds", &[]),
        p.hist_sum("kuryr_policy_publish_seconds", &[]) / p.count("kuryr_policy_publish_seconds", &[]).max(1.0) * 1e3
    ));

    // 1. Connection set-up with them.
    for ((label, to), before) in pairs.iter().zip(without) {
        let with = connect_times(w.netns("client-1")?, w.ip(to)?, cfg.connections).await?;
        report.connect.push((label.to_string(), before, with));
    }

    // 2. Changes.
    let mut monitors = Vec::new();
    for n in cluster.nodes() {
        monitors.push(Monitor::start(n).await?);
    }
    for n in cluster.nodes() {
        let table = kuryr_tests::cluster::svc::nft_table(n).await;
        ensure!(
            !table_has(&table, mover),
            "{}: mover's address {mover} is in the table before the changes:\n{table}",
            n.name
        );
    }
    let (mut all, mut polls) = (Vec::new(), Vec::new());
    let pods_toggle: Api<Pod> = Api::namespaced(client.clone(), TOGGLE_NS);
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), REAL_NS);
    let kinds = [
        "pod label changed (mover app=allowed ↔ app=mover)",
        "namespace label changed (npb-toggle toggle=on ↔ off)",
        "policy edited (server-bench: a peer added ↔ removed)",
    ];
    let mut k = 0usize;
    for (kind, label) in kinds.iter().enumerate() {
        let mut samples = Vec::new();
        for i in 0..cfg.changes {
            let allow = i.is_multiple_of(2);
            let b = baseline(&monitors);
            let start = Instant::now();
            match kind {
                0 => {
                    let app = if allow { "allowed" } else { "mover" };
                    let patch = json!({"metadata": {"labels": {"app": app}}});
                    pods_toggle.patch("mover", &PatchParams::default(), &Patch::Merge(&patch)).await?;
                }
                1 => {
                    let patch = json!({"metadata": {"labels": {"toggle": if allow { "on" } else { "off" }}}});
                    namespaces.patch(TOGGLE_NS, &PatchParams::default(), &Patch::Merge(&patch)).await?;
                }
                _ => {
                    let pp = PatchParams::apply("netpol-bench").force();
                    policies.patch("server-bench", &pp, &Patch::Apply(&server_bench(allow))).await?;
                }
            }
            let (done, p) = wait_all(cluster.nodes(), &monitors, &b, CHANGE_TIMEOUT, |t| table_has(t, mover) == allow)
                .await
                .with_context(|| format!("{label}, change {i}"))?;
            samples.push(ms(done.duration_since(start)));
            polls.extend(p);
            if k.is_multiple_of(cfg.confirm_every) {
                expect(w.netns("mover")?, w.ip("server-1")?, allow)
                    .await
                    .with_context(|| format!("{label}, change {i}: mover → server-1 on traffic"))?;
                report.confirmed += 1;
            }
            k += 1;
        }
        all.extend_from_slice(&samples);
        report.changes.push((format!("{label} ×{}", cfg.changes), Stats::of(&samples).context("no sample")?));
    }
    report.all = Stats::of(&all);
    report.polls = Stats::of(&polls);
    Ok(report)
}

/// `n` timed connections from `netns` to `addr`: connect() times in ms.
async fn connect_times(netns: &Path, addr: IpAddr, n: usize) -> Result<Stats> {
    let out = tokio::process::Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg("--")
        .arg(bin_path("kuryr-test-echo")?)
        .args(["connect", &addr.to_string(), &PORT.to_string(), &n.to_string()])
        .stdin(Stdio::null())
        .output()
        .await?;
    ensure!(out.status.success(), "connect to {addr}: {}", String::from_utf8_lossy(&out.stderr).trim());
    let times: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .map(|us| us / 1e3)
        .collect();
    ensure!(times.len() == n, "connect to {addr}: {} of {n} timings", times.len());
    Stats::of(&times).context("no timings")
}

/// Waits until a TCP connection from `netns` to `addr` is answered (`allowed`) or rejected.
async fn expect(netns: &Path, addr: IpAddr, allowed: bool) -> Result<()> {
    let until = Instant::now() + CHANGE_TIMEOUT;
    loop {
        let got = echo::ask(netns, Proto::Tcp, addr, PORT).await;
        let ok = match &got {
            Ok(_) => allowed,
            Err(e) => !allowed && (e.contains("unreachable") || e.contains("prohibited")),
        };
        if ok {
            return Ok(());
        }
        if Instant::now() > until {
            bail!("want {}, still {got:?}", if allowed { "answered" } else { "rejected" });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn record_ns(i: usize) -> String {
    format!("npb-{i:02}")
}

fn record_ns_labels(i: usize) -> Value {
    let mut l = json!({"team": format!("team-{}", i % 5), "env": if i.is_multiple_of(2) { "prod" } else { "dev" }});
    if i == 1 {
        l["purpose"] = json!("monitoring");
    }
    l
}

fn record_ip(ns: usize, i: usize) -> String {
    format!("10.250.{ns}.{}", i + 1)
}

fn real_pod(name: &str, node: &str, app: &str) -> Pod {
    objects::pod(name).node(node).label("app", app).grace(0).port(Some("http"), "TCP", PORT, None).build()
}

/// The 2,000 record pods: created, then their address written into their status.
async fn load_records(client: &kube::Client) -> Result<()> {
    let work: Vec<(usize, usize)> = (0..RECORD_NS).flat_map(|ns| (0..PODS_PER_NS).map(move |i| (ns, i))).collect();
    let results: Vec<Result<()>> = futures::stream::iter(work)
        .map(|(ns, i)| {
            let client = client.clone();
            async move {
                let api: Api<Pod> = Api::namespaced(client, &record_ns(ns));
                let name = format!("pod-{i:03}");
                let app = i % APPS;
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": name, "labels": {
                        "app": format!("app-{app}"),
                        "tier": if app < APPS / 2 { "front" } else { "back" },
                        "version": format!("v{}", i % 2 + 1)
                    }},
                    "spec": {
                        "nodeName": format!("fake-node-{:02}", (ns * PODS_PER_NS + i) % FAKE_NODES),
                        "containers": [{"name": "main", "image": "busybox", "ports": [
                            {"name": "http", "containerPort": 8080},
                            {"name": "metrics", "containerPort": 9090}
                        ]}]
                    }
                }))?;
                api.create(&PostParams::default(), &pod).await.with_context(|| format!("creating {name}"))?;
                let ip = record_ip(ns, i);
                let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
                api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                    .await
                    .with_context(|| format!("status of {name}"))?;
                Ok(())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    results.into_iter().collect()
}

/// Creates every policy; returns how many.
async fn load_policies(client: &kube::Client) -> Result<usize> {
    let mut all: Vec<(String, Value)> = Vec::new();
    for ns in 0..RECORD_NS {
        all.extend(record_policies().into_iter().map(|p| (record_ns(ns), p)));
    }
    for p in real_policies() {
        all.push((REAL_NS.to_string(), p));
    }
    let n = all.len();
    let results: Vec<Result<()>> = futures::stream::iter(all)
        .map(|(ns, p)| {
            let client = client.clone();
            async move {
                let np: NetworkPolicy = serde_json::from_value(p)?;
                Api::<NetworkPolicy>::namespaced(client, &ns).create(&PostParams::default(), &np).await?;
                Ok(())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    results.into_iter().collect::<Result<()>>()?;
    Ok(n)
}

fn np(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name}, "spec": spec})
}

fn app(a: usize) -> Value {
    json!({"matchLabels": {"app": format!("app-{}", a % APPS)}})
}

/// 50 policies of one record namespace (the compiler bench's shapes).
fn record_policies() -> Vec<Value> {
    let mut out = vec![
        np("default-deny", json!({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})),
        np(
            "dns",
            json!({"podSelector": {}, "policyTypes": ["Egress"], "egress": [{
                "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": record_ns(0)}}}],
                "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
            }]}),
        ),
    ];
    for a in 0..APPS {
        out.push(np(
            &format!("app-{a}-from-caller"),
            json!({"podSelector": app(a), "ingress": [{"from": [{"podSelector": app(a + APPS - 1)}], "ports": [{"port": "http"}]}]}),
        ));
        out.push(np(
            &format!("app-{a}-from-team"),
            json!({"podSelector": app(a), "ingress": [{
                "from": [{"namespaceSelector": {"matchLabels": {"team": format!("team-{}", a % 5)}}, "podSelector": app(a)}],
                "ports": [{"protocol": "TCP", "port": 8080}]
            }]}),
        ));
        out.push(np(
            &format!("app-{a}-monitoring"),
            json!({"podSelector": app(a), "ingress": [{
                "from": [{"namespaceSelector": {"matchLabels": {"purpose": "monitoring"}}}],
                "ports": [{"port": "metrics"}]
            }]}),
        ));
        out.push(np(
            &format!("app-{a}-egress"),
            json!({"podSelector": app(a), "policyTypes": ["Egress"], "egress": [
                {"to": [{"podSelector": app(a + 1)}], "ports": [{"port": "http"}]},
                {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8", "192.168.0.0/16"]}}], "ports": [{"protocol": "TCP", "port": 443}]}
            ]}),
        ));
    }
    for k in 0..8 {
        out.push(np(
            &format!("expr-{k}"),
            json!({
                "podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": [format!("app-{k}"), format!("app-{}", k + 1)]}]},
                "ingress": [{
                    "from": [
                        {"namespaceSelector": {"matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["prod"]}]},
                         "podSelector": {"matchLabels": {"tier": "front"}}},
                        {"ipBlock": {"cidr": format!("172.{}.0.0/16", 16 + k)}}
                    ],
                    "ports": [{"protocol": "TCP", "port": 8000, "endPort": 8100}]
                }]
            }),
        ));
    }
    out
}

/// The policy the bench edits: with `mover_ns`, every pod of npb-toggle is a peer.
fn server_bench(mover_ns: bool) -> Value {
    let mut from = vec![
        json!({"namespaceSelector": {"matchLabels": {"toggle": "on"}}}),
        json!({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": TOGGLE_NS}}, "podSelector": {"matchLabels": {"app": "allowed"}}}),
    ];
    if mover_ns {
        from.push(json!({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": TOGGLE_NS}}, "podSelector": {}}));
    }
    np(
        "server-bench",
        json!({"podSelector": {"matchLabels": {"app": "server"}}, "ingress": [{"from": from, "ports": [{"protocol": "TCP", "port": PORT}]}]}),
    )
}

/// The policies over the real pods.
fn real_policies() -> Vec<Value> {
    let server = json!({"matchLabels": {"app": "server"}});
    vec![
        np(
            "server-from-client",
            json!({"podSelector": server, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}], "ports": [{"protocol": "TCP", "port": PORT}]}]}),
        ),
        np(
            "server-from-apps",
            json!({"podSelector": server, "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {
                "matchExpressions": [{"key": "app", "operator": "In", "values": ["app-1", "app-2"]}]
            }}], "ports": [{"protocol": "TCP", "port": PORT}]}]}),
        ),
        server_bench(false),
        np(
            "client-egress",
            json!({"podSelector": {"matchLabels": {"app": "client"}}, "policyTypes": ["Egress"], "egress": [
                {"to": [{"podSelector": server}], "ports": [{"protocol": "TCP", "port": PORT}]},
                {"to": [{"namespaceSelector": {}, "podSelector": app(5)}], "ports": [{"protocol": "TCP", "port": PORT}]}
            ]}),
        ),
    ]
}
