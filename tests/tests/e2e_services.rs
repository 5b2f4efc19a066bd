//! Services end to end on the embedded backend, everything real: the API server, the real
//! kube-controller-manager's EndpointSlice controller, kuryr-watcher, kuryr-vif-allocator,
//! kuryr-lbaas (node backend) under their ServiceAccounts, and two nodes whose binders follow
//! kuryr-lbaas and program nftables in the node's namespace. Backend pods run a busybox container
//! answering every TCP connection with its pod name; client pods on both nodes connect to the
//! Service's ClusterIP and port and the test looks at who answered:
//!
//! - both backends (one per node) answer clients on either node;
//! - a backend added or deleted shows in the rules of every node and in who answers;
//! - a binder stopped (SIGTERM) or killed (-9) leaves the rules answering, and after its restart
//!   it reconciles from the snapshot and applies later changes;
//! - kuryr-lbaas killed with -9 and restarted: every node's rules unchanged, later changes applied;
//! - deleting the Service removes its rules from every node, and connections fail;
//! - the metrics follow: kuryr-lbaas' reconciles by result, its queue drained, load balancers
//!   by state and stream subscribers; each binder's programming latency and transactions.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Pod, Service, ServiceAccount, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_tests::cluster::checks::{self, RunningPod};
use kuryr_tests::cluster::svc::{self, nft_table, table_has, wait_tables};
use kuryr_tests::cluster::{Cluster, ClusterOptions, ServiceKind, run_scenario};
use kuryr_tests::metrics::Scrape;
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;

const NAMESPACE: &str = "svc";
const SERVICE: &str = "echo";
const PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
/// Connections per check: with even spreading over 2–3 backends, each is missed by 16 in a row
/// with a probability below 0.2 %; a check repeats rounds until it sees everyone anyway.
const ROUND: usize = 16;
/// Bound on pods Running.
const RUNNING_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on a change reaching every node's rules and traffic.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn services_answer_from_both_nodes_follow_endpoints_and_survive_restarts() {
    let opts = ClusterOptions { nodes: 2, run_containers: true, services: true, ..ClusterOptions::default() };
    run_scenario("services", opts, async |c| scenario(c).await).await.unwrap_or_else(|e| panic!("{e:#}"));
}

/// The test's view of the workload: pods by name.
struct World {
    pods: Api<Pod>,
    vip: IpAddr,
    /// Running pods by name.
    running: BTreeMap<String, RunningPod>,
}

impl World {
    fn netns(&self, pod: &str) -> PathBuf {
        self.running[pod].netns.clone()
    }

    fn v4(&self, pod: &str) -> IpAddr {
        self.running[pod].ips.iter().copied().find(IpAddr::is_ipv4).unwrap()
    }

    async fn refresh(&mut self, c: &Cluster, expected: usize) -> Result<()> {
        let list = checks::wait_running(c, NAMESPACE, expected, RUNNING_TIMEOUT).await?;
        self.running = list.into_iter().map(|p| (p.name.clone(), p)).collect();
        Ok(())
    }

    /// Waits until clients `c1` (node-1) and `c2` (node-2) are each answered by exactly `want`.
    async fn expect_answers(&self, want: &[&str]) -> Result<()> {
        for client in ["c1", "c2"] {
            let got = svc::wait_answers(&self.netns(client), self.vip, PORT, ROUND, want, CONVERGE_TIMEOUT)
                .await
                .with_context(|| format!("from {client} ({})", self.running[client].node))?;
            eprintln!("  {client} ({}) → {}:{PORT}: {}", self.running[client].node, self.vip, svc::describe(&got));
        }
        Ok(())
    }

    /// Waits until every node's table has the VIP with the members `backends` (by their IPv4
    /// addresses) and none of the addresses `gone`; returns how long that took.
    async fn expect_members(&self, c: &Cluster, backends: &[&str], gone: &[IpAddr]) -> Result<Duration> {
        let t = Instant::now();
        let want: Vec<IpAddr> = backends.iter().map(|b| self.v4(b)).collect();
        let vip = self.vip;
        wait_tables(c.nodes(), &format!("members {backends:?} of {vip}"), CONVERGE_TIMEOUT, |table| {
            table_has(table, vip)
                && want.iter().all(|ip| table_has(table, *ip))
                && !gone.iter().any(|ip| table_has(table, *ip))
        })
        .await?;
        Ok(t.elapsed())
    }
}

async fn scenario(cluster: &mut Cluster) -> Result<()> {
    let client = cluster.client();
    let pods = objects::namespace_with_pods(&client, NAMESPACE).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
    let (node1, node2) = (cluster.nodes()[0].name.clone(), cluster.nodes()[1].name.clone());

    // A backend on each node, a client on each node, and the Service in front of the backends.
    for (name, node, backend) in
        [("b1", &node1, true), ("b2", &node2, true), ("c1", &node1, false), ("c2", &node2, false)]
    {
        pods.create(&PostParams::default(), &pod(name, node, backend)).await?;
    }
    let metrics_before = ServiceMetrics::scrape(cluster).await?;
    let t_service = Instant::now();
    services.create(&PostParams::default(), &service()).await?;
    let (vip, ports) = svc::cluster_ip(&client, NAMESPACE, SERVICE).await?;
    ensure!(ports == [PORT], "Service ports {ports:?}");
    let mut w = World { pods, vip, running: BTreeMap::new() };
    w.refresh(cluster, 4).await?;
    eprintln!("pods Running: {:?}", w.running.values().map(|p| (&p.name, &p.node, &p.ips)).collect::<Vec<_>>());

    // The real EndpointSlice controller lists both backends as ready, by their pod addresses.
    let want_eps = {
        let mut v = vec![(w.v4("b1"), "b1".to_string()), (w.v4("b2"), "b2".to_string())];
        v.sort();
        v
    };
    wait_until("the EndpointSlice to list b1 and b2 as ready", CONVERGE_TIMEOUT, || async {
        let eps = svc::ready_endpoints(&client, NAMESPACE, SERVICE).await?;
        ensure!(eps == want_eps, "ready endpoints {eps:?}, want {want_eps:?}");
        Ok(())
    })
    .await?;

    // Written by the built-in controller, acting as its own ServiceAccount.
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={SERVICE}")))
        .await?
        .items;
    for s in &slices {
        let by = s.metadata.labels.as_ref().and_then(|l| l.get("endpointslice.kubernetes.io/managed-by"));
        ensure!(by.map(String::as_str) == Some("endpointslice-controller.k8s.io"), "slice managed by {by:?}");
    }
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "kube-system");
    ensure!(
        accounts.get_opt("endpointslice-controller").await?.is_some(),
        "no ServiceAccount kube-system/endpointslice-controller: the controller does not use its own credentials"
    );

    eprintln!("1. both backends answer clients on both nodes ({vip}:{PORT})");
    w.expect_members(cluster, &["b1", "b2"], &[]).await?;
    w.expect_answers(&["b1", "b2"]).await?;
    eprintln!("  Service created → answered by both from both nodes in {:?}", t_service.elapsed());
    for n in cluster.nodes() {
        let table = nft_table(n).await;
        ensure!(
            table.contains(&format!("{vip} . tcp . {PORT}")),
            "{}: no map entry for {vip} . tcp . {PORT}:\n{table}",
            n.name
        );
        ensure!(table.contains(&format!("{}:{TARGET_PORT}", w.v4("b1"))), "{}: no DNAT to b1:\n{table}", n.name);
    }

    eprintln!("2. scaling: b3 added on {node1}, then b1 deleted");
    let t = Instant::now();
    w.pods.create(&PostParams::default(), &pod("b3", &node1, true)).await?;
    w.refresh(cluster, 5).await?;
    let programmed = w.expect_members(cluster, &["b1", "b2", "b3"], &[]).await?;
    eprintln!("  b3 created → in every node's rules after {:?} ({programmed:?} after Running)", t.elapsed());
    w.expect_answers(&["b1", "b2", "b3"]).await?;
    let b1 = w.v4("b1");
    let t = Instant::now();
    w.pods.delete("b1", &DeleteParams::default()).await?;
    w.expect_members(cluster, &["b2", "b3"], &[b1]).await?;
    eprintln!("  b1 deleted → out of every node's rules after {:?}", t.elapsed());
    w.refresh(cluster, 4).await?;
    w.expect_answers(&["b2", "b3"]).await?;
    // Created, then two endpoint changes: reconciled, streamed and programmed on every node.
    let metrics = wait_until("the Service metrics to settle", CONVERGE_TIMEOUT, || async {
        let m = ServiceMetrics::scrape(cluster).await?;
        m.check_programmed(&metrics_before, 3.0)?;
        Ok(m)
    })
    .await?;
    eprintln!(
        "  metrics: {} applied reconciles, {} node programmings",
        metrics.lbaas.moved_count(&metrics_before.lbaas, RECONCILE, APPLIED).delta(),
        metrics.binders.values().map(|b| b.count(PROGRAM, &[])).sum::<f64>()
    );

    eprintln!("3. binder restarts: {node2}'s stopped (SIGTERM), {node1}'s killed (-9)");
    let before = tables(cluster).await;
    stop_binder(cluster, &node2, false).await?;
    eprintln!("  {node2}'s binder down; its rules still answer:");
    w.expect_answers(&["b2", "b3"]).await?;
    restart_binder(cluster, &node2).await?;
    wait_synced(cluster).await?;
    ensure_same_tables(&before, &tables(cluster).await, "after the binder restart on node-2")?;
    w.expect_answers(&["b2", "b3"]).await?;
    stop_binder(cluster, &node1, true).await?;
    w.expect_answers(&["b2", "b3"]).await?;
    restart_binder(cluster, &node1).await?;
    wait_synced(cluster).await?;
    ensure_same_tables(&before, &tables(cluster).await, "after the binder kill -9 and restart on node-1")?;
    // A change after the restarts reaches both restarted binders.
    w.pods.create(&PostParams::default(), &pod("b4", &node2, true)).await?;
    w.refresh(cluster, 5).await?;
    w.expect_members(cluster, &["b2", "b3", "b4"], &[b1]).await?;
    w.expect_answers(&["b2", "b3", "b4"]).await?;

    eprintln!("4. kuryr-lbaas killed (-9) and restarted");
    let before = tables(cluster).await;
    let snapshots_before = snapshots(cluster).await?;
    cluster.kill_service(ServiceKind::Lbaas).await?;
    w.expect_answers(&["b2", "b3", "b4"]).await?;
    cluster.restart_service(ServiceKind::Lbaas).await?;
    // The later event: every binder took in a complete snapshot of the new process and is in sync.
    wait_until("every binder's snapshot of the new kuryr-lbaas", CONVERGE_TIMEOUT, || async {
        let now = snapshots(cluster).await?;
        for (node, was) in &snapshots_before {
            ensure!(now.get(node).is_some_and(|n| n > was), "{node}: no new snapshot ({was} before, {now:?})");
        }
        Ok(())
    })
    .await?;
    wait_synced(cluster).await?;
    // The binders resynced from the new process's snapshot: nothing changed in the rules.
    ensure_same_tables(&before, &tables(cluster).await, "after kuryr-lbaas kill -9 and restart")?;
    w.expect_answers(&["b2", "b3", "b4"]).await?;
    let b2 = w.v4("b2");
    let t = Instant::now();
    w.pods.delete("b2", &DeleteParams::default()).await?;
    w.expect_members(cluster, &["b3", "b4"], &[b1, b2]).await?;
    eprintln!("  b2 deleted after the restart → out of every node's rules after {:?}", t.elapsed());
    w.refresh(cluster, 4).await?;
    w.expect_answers(&["b3", "b4"]).await?;

    eprintln!("5. Service deleted");
    let metrics_before = ServiceMetrics::scrape(cluster).await?;
    let t = Instant::now();
    services.delete(SERVICE, &DeleteParams::default()).await?;
    wait_tables(cluster.nodes(), &format!("{vip} gone"), CONVERGE_TIMEOUT, |t| !table_has(t, vip)).await?;
    eprintln!("  Service deleted → its rules gone from every node after {:?}", t.elapsed());
    for client in ["c1", "c2"] {
        match svc::connect(&w.netns(client), vip, PORT).await {
            Ok(who) => bail!("{client} still reaches {vip}:{PORT} (answered by {who}) after the Service was deleted"),
            Err(e) => eprintln!("  {client} → {vip}:{PORT}: {e:#}"),
        }
    }
    wait_until("the Service gone from the API (kuryr-lbaas removed its finalizer)", CONVERGE_TIMEOUT, || async {
        match services.get_opt(SERVICE).await? {
            None => Ok(()),
            Some(s) => bail!("still there, finalizers {:?}", s.metadata.finalizers),
        }
    })
    .await?;
    wait_until("the deletion in the metrics", CONVERGE_TIMEOUT, || async {
        let m = ServiceMetrics::scrape(cluster).await?;
        m.lbaas.moved_count(&metrics_before.lbaas, RECONCILE, &[("result", "deleted")]).at_least(1.0)?;
        m.lbaas.moved(&metrics_before.lbaas, "kuryr_lbaas_load_balancers", &[]).exactly(-1.0)?;
        ensure!(m.lbaas.value("kuryr_lbaas_queue_depth", &[])? == 0.0, "lbaas queue not drained");
        for (node, b) in &m.binders {
            b.moved(&metrics_before.binders[node], "kuryr_binder_lb_services", &[])
                .exactly(-1.0)
                .with_context(|| node.clone())?;
            b.moved(&metrics_before.binders[node], "kuryr_binder_lb_transactions_total", &[("result", "ok")])
                .at_least(1.0)
                .with_context(|| node.clone())?;
        }
        Ok(())
    })
    .await?;
    Ok(())
}

const RECONCILE: &str = "kuryr_lbaas_reconcile_seconds";
const APPLIED: &[(&str, &str)] = &[("result", "applied")];
const PROGRAM: &str = "kuryr_binder_lb_program_seconds";

/// What kuryr-lbaas and each node's binder expose at one moment.
struct ServiceMetrics {
    lbaas: Scrape,
    /// By node name.
    binders: BTreeMap<String, Scrape>,
}

impl ServiceMetrics {
    async fn scrape(cluster: &Cluster) -> Result<ServiceMetrics> {
        let lbaas = cluster.lbaas().context("the cluster runs no kuryr-lbaas")?;
        let mut binders = BTreeMap::new();
        for n in cluster.nodes() {
            binders.insert(n.name.clone(), Scrape::in_netns(&n.node.netns_path(), "127.0.0.1:9631").await?);
        }
        Ok(ServiceMetrics { lbaas: Scrape::http(&lbaas.metrics).await?, binders })
    }

    /// One Service created and `changes` - 1 endpoint changes since `before`, all done.
    fn check_programmed(&self, before: &ServiceMetrics, changes: f64) -> Result<()> {
        let (b, a) = (&before.lbaas, &self.lbaas);
        a.moved_count(b, RECONCILE, APPLIED).at_least(changes)?;
        ensure!(a.sum(RECONCILE, &[("result", "error")]) == 0.0, "lbaas reconciles failed");
        ensure!(a.value("kuryr_lbaas_queue_depth", &[])? == 0.0, "lbaas queue not drained");
        ensure!(a.value("kuryr_lbaas_queue_failing", &[])? == 0.0, "lbaas reconciles failing");
        // One more than before: the API server's own default/kubernetes Service has one too.
        a.moved(b, "kuryr_lbaas_load_balancers", &[("state", "PROGRAMMED")]).exactly(1.0)?;
        ensure!(a.sum("kuryr_lbaas_load_balancers", &[("state", "PENDING")]) == 0.0, "load balancers PENDING");
        let subscribers = a.value("kuryr_lbaas_watch_subscribers", &[])?;
        ensure!(subscribers >= before.binders.len() as f64, "{subscribers} WatchLoadBalancers streams");
        for (node, after) in &self.binders {
            let b = before.binders.get(node).context("node")?;
            let ctx = || format!("binder of {node}");
            // Each change is one delta transaction, timed from its arrival to the kernel.
            after.moved_count(b, PROGRAM, &[("kind", "delta")]).at_least(changes).with_context(ctx)?;
            after
                .moved(b, "kuryr_binder_lb_transactions_total", &[("kind", "delta"), ("result", "ok")])
                .at_least(changes)
                .with_context(ctx)?;
            ensure!(after.sum("kuryr_binder_lb_transactions_total", &[("result", "error")]) == 0.0, "{node}: failed");
            after.moved(b, "kuryr_binder_lb_services", &[]).exactly(1.0).with_context(ctx)?;
            ensure!(after.value("kuryr_binder_lb_synced", &[])? == 1.0, "{node}: not in sync");
        }
        Ok(())
    }
}

/// Every node's table, by node.
async fn tables(cluster: &Cluster) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for n in cluster.nodes() {
        out.insert(n.name.clone(), nft_table(n).await);
    }
    out
}

/// The tables' rules, compared as sorted lines (a rebuild may list elements in another order).
fn ensure_same_tables(before: &BTreeMap<String, String>, after: &BTreeMap<String, String>, when: &str) -> Result<()> {
    let norm = |t: &str| {
        let mut v: Vec<String> = t.lines().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect();
        v.sort();
        v
    };
    for (node, b) in before {
        let a = after.get(node).map(String::as_str).unwrap_or_default();
        ensure!(!b.is_empty(), "{node}: no table before ({when})");
        ensure!(norm(b) == norm(a), "{node}: the rules changed {when}:\n---- before\n{b}\n---- after\n{a}");
    }
    Ok(())
}

/// The binders' `kuryr_binder_lb_synced` is 1 on every node.
async fn wait_synced(cluster: &Cluster) -> Result<()> {
    wait_until("every binder's Service rules in sync with kuryr-lbaas", CONVERGE_TIMEOUT, || async {
        for n in cluster.nodes() {
            let metrics = n.node.exec(&["curl", "-s", "http://127.0.0.1:9631/metrics"]).await?;
            let synced = metrics
                .lines()
                .find(|l| l.starts_with("kuryr_binder_lb_synced"))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok());
            ensure!(synced == Some(1.0), "{}: kuryr_binder_lb_synced {synced:?}", n.name);
        }
        Ok(())
    })
    .await
}

/// How many complete snapshots of kuryr-lbaas each binder has taken in, by node.
async fn snapshots(cluster: &Cluster) -> Result<BTreeMap<String, f64>> {
    let mut seen = BTreeMap::new();
    for n in cluster.nodes() {
        let scrape = Scrape::in_netns(&n.node.netns_path(), "127.0.0.1:9631").await?;
        let complete = [("type", "LB_EVENT_TYPE_SNAPSHOT_COMPLETE")];
        seen.insert(n.name.clone(), scrape.sum("kuryr_binder_lb_events_total", &complete));
    }
    Ok(seen)
}

async fn stop_binder(cluster: &Cluster, node: &str, kill: bool) -> Result<()> {
    // Binder::stop/kill need the node mutably; the cluster is shared here, so signal by pid.
    let n = cluster.node(node).context("node")?;
    let pid = n.node.binder.pid().context("binder not running")?;
    let signal = if kill { "-KILL" } else { "-TERM" };
    let status = std::process::Command::new("kill").args([signal, &pid.to_string()]).status()?;
    ensure!(status.success(), "kill {signal} {pid}");
    wait_until(&format!("{node}'s binder (pid {pid}) to exit"), Duration::from_secs(15), || async {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let alive = stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'));
        ensure!(!alive, "still running");
        Ok(())
    })
    .await
}

/// Starts the node's binder again (same state directory, socket and flags) once it has exited.
async fn restart_binder(cluster: &mut Cluster, node: &str) -> Result<()> {
    let n = cluster.node_mut(node).context("node")?;
    // Reaps the exited process.
    n.node.binder.kill().await?;
    n.node.binder.restart().await
}

fn pod(name: &str, node: &str, backend: bool) -> Pod {
    let p = objects::pod(name).node(node).grace(1);
    if backend {
        p.label("app", "echo").command(svc::echo_command(TARGET_PORT))
    } else {
        p.label("app", "client").sleeping()
    }
    .build()
}

fn service() -> Service {
    Service {
        metadata: ObjectMeta { name: Some(SERVICE.into()), ..ObjectMeta::default() },
        spec: Some(ServiceSpec {
            selector: Some([("app".to_string(), "echo".to_string())].into()),
            ports: Some(vec![ServicePort {
                name: Some("tcp".into()),
                protocol: Some("TCP".into()),
                port: i32::from(PORT),
                target_port: Some(IntOrString::Int(i32::from(TARGET_PORT))),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}
