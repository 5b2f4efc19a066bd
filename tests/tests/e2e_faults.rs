//! Faults in the middle of work, end to end with the embedded backend and every part real: the
//! API server, kuryr-watcher and kuryr-vif-allocator under their ServiceAccounts, two nodes
//! (containerd + kuryr-cni + kuryr-binder in their own network namespaces, joined by an underlay
//! bridge), each run by the test kubelet that drives pod sandboxes through CRI.
//!
//! - kill -9 of kuryr-vif-allocator while a burst of 40 pods is being allocated, pods created and
//!   deleted while it is down, then a restart;
//! - the same with kuryr-watcher: the allocator loses its subscription and picks up again when
//!   the watcher is back;
//! - kuryr-binder stopped with SIGTERM on one node and killed with SIGKILL on the other while pods
//!   run and new ones start, pods deleted while it is down and after it is back;
//! - kuryr-vif-allocator stopped with SIGSTOP (its connections stay open, it sends nothing) while
//!   pods run and new ones are created: the binders tell it from a quiet allocator by the missing
//!   heartbeats alone, are NOT_SERVING within their `--stream-idle-timeout`, and resume once it
//!   runs again (SIGCONT).
//!
//! Each converges to the same state (the checks of [`kuryr_tests::cluster::checks`]): every pod
//! Running with distinct addresses that are its PodVif's and allocated to it in a block of its
//! node, no allocation without a live PodVif, no PodVif without a pod, on each node exactly one
//! sandbox, veth and attachment record per pod; then deleting everything leaves nothing.
//!
//! The tests take turns, one cluster at a time: each runs dozens of sandboxes through containerd,
//! which on a small machine is load enough for one.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_tests::cluster::checks::{self, RunningPod};
use kuryr_tests::cluster::{Cluster, ClusterNode, ClusterOptions, ServiceKind, StreamTiming, run_scenario};
use kuryr_tests::kubelet::PodPhase;
use kuryr_tests::metrics::Scrape;
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use kuryr_vif_allocator::k8s::crd::PodVif;

const NAMESPACE: &str = "faults";
/// Pods created at once for the service crashes.
const BURST: usize = 40;
/// VIFs recorded (in their PodVifs) when the service is killed: the burst is under way, some
/// pods done, others part-way (finalizer only, PodVif without a VIF, addresses taken but not yet
/// recorded), others not yet seen.
const KILL_AFTER: usize = 5;
/// One pod of the burst created every this often (the burst takes 40 × 40 ms = 1.6 s).
const BURST_PACE: Duration = Duration::from_millis(40);
/// Pods created while a service is down.
const LATE: usize = 4;
/// How long a service stays down: long enough for the kubelets to try and fail.
const OUTAGE: Duration = Duration::from_secs(3);
/// Bound on everything Running again after a fault. A pod whose CNI ADD was waiting for its VIF
/// when the fault hit fails after the binder's `--vif-wait-timeout` (20 s) and is retried by the
/// kubelet with backoff (at most 8 s).
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(90);
/// Bound on the allocator's records agreeing with the pods once they run.
const CONSISTENT_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on everything being released after the pods are deleted.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(60);
/// Pods created in the API at once.
const CREATE_CONCURRENCY: usize = 8;
/// The services' `--stream-heartbeat` in the SIGSTOP scenario...
const HEARTBEAT: &str = "300ms";
/// ... and their readers' `--stream-idle-timeout` (the binders' too).
const IDLE_TIMEOUT: Duration = Duration::from_millis(1500);

/// One cluster at a time in this binary.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn allocator_killed_mid_burst_converges_without_leaks() {
    with_cluster("allocator kill -9", async |c: &mut Cluster| service_crash_mid_burst(c, ServiceKind::Allocator).await)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watcher_killed_mid_burst_converges_and_late_pods_get_networks() {
    with_cluster("watcher kill -9", async |c: &mut Cluster| service_crash_mid_burst(c, ServiceKind::Watcher).await)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn binder_restarts_keep_running_pods_and_start_new_ones() {
    with_cluster("binder restarts", binder_restarts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_allocator_is_told_from_a_quiet_one_by_its_heartbeats() {
    let timing = StreamTiming { heartbeat: HEARTBEAT.into(), idle_timeout: format!("{}ms", IDLE_TIMEOUT.as_millis()) };
    let opts = ClusterOptions { stream_timing: Some(timing), ..ClusterOptions::default() };
    with_cluster_options("allocator SIGSTOP", opts, allocator_stopped).await;
}

/// Starts a two-node cluster, runs `scenario` on it, shuts it down and checks that nothing of it
/// is left on the host; the services' logs are printed when the scenario fails.
async fn with_cluster(name: &str, scenario: impl AsyncFnOnce(&mut Cluster) -> Result<()>) {
    with_cluster_options(name, ClusterOptions::default(), scenario).await;
}

/// [`with_cluster`] with `opts`.
async fn with_cluster_options(
    name: &str,
    opts: ClusterOptions,
    scenario: impl AsyncFnOnce(&mut Cluster) -> Result<()>,
) {
    let _turn = ONE_AT_A_TIME.lock().await;
    run_scenario(name, opts, scenario).await.unwrap_or_else(|e| panic!("{e:#}"));
}

/// A burst of pods across both nodes; `kind` killed with SIGKILL once some of them have PodVifs;
/// pods created and deleted while it is down; restarted → everything converges.
async fn service_crash_mid_burst(cluster: &mut Cluster, kind: ServiceKind) -> Result<()> {
    let client = cluster.client();
    let pods = objects::namespace_with_pods(&client, NAMESPACE).await?;
    let vifs: Api<PodVif> = Api::namespaced(client.clone(), NAMESPACE);
    let burst = spread(cluster, "burst", BURST);

    let t = Instant::now();
    let created = Arc::new(AtomicUsize::new(0));
    // Paced, so that the burst is still under way when the first VIFs are recorded however fast
    // the allocator is (all at once, a quick allocator could record all of them between two
    // looks).
    let creating = tokio::spawn(create_paced(pods.clone(), burst.clone(), created.clone(), BURST_PACE));
    let with_vif = |list: &[PodVif]| list.iter().filter(|v| v.vif().is_some()).count();
    let before_kill = wait_until("the first VIFs of the burst", CONVERGE_TIMEOUT, || async {
        let list = vifs.list(&ListParams::default()).await?.items;
        ensure!(with_vif(&list) >= KILL_AFTER, "{} PodVifs, {} with a VIF", list.len(), with_vif(&list));
        Ok(list)
    })
    .await?;
    cluster.kill_service(kind).await?;
    let killed_after = t.elapsed();
    let pods_at_kill = created.load(Ordering::SeqCst);
    let recorded = with_vif(&before_kill);
    ensure!(recorded < BURST, "the burst was over ({recorded} VIFs recorded) before the kill");
    eprintln!(
        "{kind:?} killed {killed_after:?} into the burst: {pods_at_kill}/{BURST} pods created, {} PodVifs, \
         {recorded} with a VIF",
        before_kill.len()
    );
    creating.await??;

    // While it is down: more pods, and two pods of the burst deleted (whatever state they are
    // in; the allocator's finalizer holds them until it has released their VIFs).
    let late = spread(cluster, "late", LATE);
    create_pods(pods.clone(), late.clone(), Arc::default()).await?;
    let deleted = [burst[0].0.clone(), burst[1].0.clone()];
    for name in &deleted {
        pods.delete(name, &DeleteParams::default()).await?;
    }
    tokio::time::sleep(OUTAGE).await;
    let t = Instant::now();
    cluster.restart_service(kind).await?;
    eprintln!("{kind:?} serving again after {:?}", t.elapsed());

    let expected = BURST - deleted.len() + LATE;
    let running = checks::wait_running(cluster, NAMESPACE, expected, CONVERGE_TIMEOUT)
        .await
        .map_err(|e| e.context(kubelet_summary(cluster)))?;
    eprintln!("{expected} pods Running {:?} after the restart; {}", t.elapsed(), kubelet_summary(cluster));
    for name in &deleted {
        ensure!(!running.iter().any(|p| &p.name == name), "{name} was deleted but runs");
    }
    converged(cluster, &running).await?;
    // What was recorded before the crash was kept, not allocated again.
    for v in &before_kill {
        let (name, vif) = (v.metadata.name.as_deref().unwrap_or_default(), v.vif());
        let (Some(vif), Some(pod)) = (vif, running.iter().find(|p| p.name == name)) else { continue };
        let had: Vec<String> =
            vif.ips.iter().map(|i| i.address.split('/').next().unwrap_or_default().to_string()).collect();
        let has: Vec<String> = pod.ips.iter().map(ToString::to_string).collect();
        ensure!(had == has, "{name} had {had:?} before the kill and has {has:?} now");
    }
    if kind == ServiceKind::Watcher {
        // The allocator lost its subscription and made a new one.
        let reconnects =
            Scrape::http(&cluster.allocator().metrics).await?.value("kuryr_allocator_watcher_reconnects_total", &[])?;
        ensure!(reconnects >= 1.0, "the allocator never reconnected to the watcher ({reconnects})");
    }

    // Pods created while the service was down have working networks, within and across nodes.
    let late: Vec<RunningPod> = running.iter().filter(|p| p.name.starts_with("late")).cloned().collect();
    let probes = one_per_node(&running, "burst");
    let pings = checks::reachable(&late, &probes).await?;
    eprintln!("{pings} pings from the late pods answered");

    delete_all_and_check(cluster).await
}

/// Pods on both nodes; node-1's binder stopped with SIGTERM, then node-2's killed with SIGKILL,
/// each while new pods are starting; running pods keep their networks throughout; pods plumbed
/// before a restart are deleted while the binder is down and after it is back.
async fn binder_restarts(cluster: &mut Cluster) -> Result<()> {
    let client = cluster.client();
    let pods = objects::namespace_with_pods(&client, NAMESPACE).await?;
    let first = spread(cluster, "old", 10);
    create_pods(pods.clone(), first.clone(), Arc::default()).await?;
    let before = checks::wait_running(cluster, NAMESPACE, first.len(), CONVERGE_TIMEOUT).await?;
    checks::node_state(cluster, &before).await?;
    let pings = checks::reachable(&before, &before).await?;
    eprintln!("{} pods Running, {pings} pings answered", before.len());

    let mut deleted = Vec::new();
    let mut added = Vec::new();
    let nodes: Vec<String> = cluster.nodes().iter().map(|n| n.name.clone()).collect();
    for (round, (node, crash)) in [(&nodes[0], false), (&nodes[1], true)].into_iter().enumerate() {
        let how = if crash { "SIGKILL" } else { "SIGTERM" };
        // New pods on both nodes; the binder goes once this node's kubelet has begun starting one.
        let batch = spread(cluster, &format!("new{round}"), 4);
        let creating = tokio::spawn(create_pods(pods.clone(), batch.clone(), Arc::default()));
        let kubelet = cluster.kubelets().iter().find(|k| k.node() == node.as_str()).context("no kubelet")?;
        let prefix = format!("new{round}-");
        wait_until("a new pod's sandbox starting", CONVERGE_TIMEOUT, || async {
            let started = kubelet.pods().iter().any(|r| r.name.starts_with(&prefix) && r.attempts >= 1);
            ensure!(started, "not yet");
            Ok(())
        })
        .await?;
        let binder = &mut cluster.node_mut(node).context("no node")?.node.binder;
        if crash {
            binder.kill().await?;
        } else {
            binder.stop().await?;
        }
        creating.await??;
        added.extend(batch.into_iter().map(|(name, _)| name));

        // While it is down, the pods it plugged keep their networks.
        let here: Vec<RunningPod> =
            before.iter().filter(|p| &p.node == node && !deleted.contains(&p.name)).cloned().collect();
        let there: Vec<RunningPod> =
            before.iter().filter(|p| &p.node != node && !deleted.contains(&p.name)).take(1).cloned().collect();
        let pings = checks::reachable(&here[..2], &[&here[2..3], &there[..]].concat()).await?;
        eprintln!("{node}: binder stopped ({how}); {pings} pings from its pods answered while it is down");
        // A pod plugged before the restart deleted while the binder is away: the kubelet's CNI
        // DEL fails (try again later) and is retried until the binder is back.
        pods.delete(&here[0].name, &DeleteParams::default()).await?;
        deleted.push(here[0].name.clone());
        tokio::time::sleep(OUTAGE).await;

        let t = Instant::now();
        cluster.node_mut(node).context("no node")?.node.binder.restart().await?;
        eprintln!("{node}: binder serving again after {:?}", t.elapsed());
        // And one deleted once it is back.
        pods.delete(&here[1].name, &DeleteParams::default()).await?;
        deleted.push(here[1].name.clone());
        let gone = wait_until("the deleted pods gone", CONVERGE_TIMEOUT, || async {
            for name in &deleted {
                ensure!(pods.get_opt(name).await?.is_none(), "{name} still in the API");
            }
            Ok(t.elapsed())
        })
        .await
        .map_err(|e| e.context(kubelet_summary(cluster)))?;
        eprintln!("{node}: pods deleted around the restart gone {gone:?} after it");
        let pings = checks::reachable(&here[2..], &there).await?;
        eprintln!("{node}: {pings} pings from its remaining old pods answered after the restart");
    }

    let expected = before.len() - deleted.len() + added.len();
    let running = checks::wait_running(cluster, NAMESPACE, expected, CONVERGE_TIMEOUT)
        .await
        .map_err(|e| e.context(kubelet_summary(cluster)))?;
    eprintln!("{expected} pods Running; {}", kubelet_summary(cluster));
    // The old pods kept their sandboxes and addresses through both restarts.
    for p in running.iter().filter(|p| p.name.starts_with("old")) {
        let was = before.iter().find(|b| b.name == p.name).context("an unknown old pod")?;
        ensure!(p == was, "{} changed over the binder restarts: {was:?} → {p:?}", p.name);
    }
    converged(cluster, &running).await?;
    let pings = checks::reachable(&running, &running).await?;
    eprintln!("{pings} pings between all {} pods answered", running.len());

    delete_all_and_check(cluster).await
}

/// Pods run; the allocator is quiet for three idle timeouts (its heartbeats keep every binder's
/// VIF stream up), then stopped with SIGSTOP while new pods are created: each binder notices by
/// the silence alone and is NOT_SERVING within a few idle timeouts, the running pods keep their
/// networks; SIGCONT → the binders resume, the new pods get networks, everything converges.
async fn allocator_stopped(cluster: &mut Cluster) -> Result<()> {
    let client = cluster.client();
    let pods = objects::namespace_with_pods(&client, NAMESPACE).await?;
    let first = spread(cluster, "old", 4);
    create_pods(pods.clone(), first.clone(), Arc::default()).await?;
    let before = checks::wait_running(cluster, NAMESPACE, first.len(), CONVERGE_TIMEOUT).await?;

    tokio::time::sleep(3 * IDLE_TIMEOUT).await;
    for n in cluster.nodes() {
        binder_serving(n).await.with_context(|| format!("{}: a quiet allocator taken for dead", n.name))?;
        let logs = n.node.binder_logs();
        ensure!(!logs.contains("VIF stream lost"), "{}: a quiet allocator was taken for dead:\n{logs}", n.name);
    }

    let pid = cluster.allocator().pid().context("the allocator has no pid")?;
    signal(pid, "-STOP").await?;
    let stopped = Instant::now();
    let late = spread(cluster, "late", 2);
    let creating = tokio::spawn(create_pods(pods.clone(), late.clone(), Arc::default()));
    let outage = async {
        for n in cluster.nodes() {
            wait_until(&format!("{}: binder NOT_SERVING", n.name), 5 * IDLE_TIMEOUT, || async {
                ensure!(binder_serving(n).await.is_err(), "still SERVING");
                Ok(())
            })
            .await?;
        }
        let noticed = stopped.elapsed();
        eprintln!("allocator stopped (SIGSTOP): both binders NOT_SERVING after {noticed:?}");
        for n in cluster.nodes() {
            let logs = n.node.binder_logs();
            ensure!(logs.contains("not even a heartbeat"), "{}: not noticed by its silence:\n{logs}", n.name);
        }
        let pings = checks::reachable(&before, &before).await?;
        eprintln!("{pings} pings between the running pods answered while the allocator is stopped");
        tokio::time::sleep(OUTAGE).await;
        anyhow::Ok(())
    }
    .await;
    // Running again whatever happened, so that the cluster shuts down cleanly.
    signal(pid, "-CONT").await?;
    outage?;

    let t = Instant::now();
    for n in cluster.nodes() {
        wait_until(&format!("{}: binder SERVING again", n.name), CONVERGE_TIMEOUT, || binder_serving(n)).await?;
    }
    eprintln!("allocator running again (SIGCONT): both binders SERVING after {:?}", t.elapsed());
    creating.await??;
    let expected = first.len() + late.len();
    let running = checks::wait_running(cluster, NAMESPACE, expected, CONVERGE_TIMEOUT)
        .await
        .map_err(|e| e.context(kubelet_summary(cluster)))?;
    for p in running.iter().filter(|p| p.name.starts_with("old")) {
        let was = before.iter().find(|b| b.name == p.name).context("an unknown old pod")?;
        ensure!(p == was, "{} changed over the allocator's stop: {was:?} → {p:?}", p.name);
    }
    converged(cluster, &running).await?;
    delete_all_and_check(cluster).await
}

/// Whether the node's binder reports its CNI service SERVING (its VIF stream live).
async fn binder_serving(n: &ClusterNode) -> Result<()> {
    let channel = kuryr_runtime::client::channel(&n.node.binder.grpc_target())?;
    kuryr_runtime::client::check_serving(channel, kuryr_proto::service_names::CNI).await
}

/// Sends `sig` (`-STOP`, `-CONT`) to `pid`.
async fn signal(pid: u32, sig: &str) -> Result<()> {
    let status = tokio::process::Command::new("kill").args([sig, &pid.to_string()]).status().await?;
    ensure!(status.success(), "kill {sig} {pid}: {status}");
    Ok(())
}

/// The checks every scenario ends with while its pods run: the allocator's records agree with
/// the pods (waited for: releases of deleted pods may still be finishing), one address per family
/// per pod, and each node holds exactly its pods' sandboxes, veths and attachment records.
async fn converged(cluster: &Cluster, running: &[RunningPod]) -> Result<()> {
    let client = cluster.client();
    let summary = wait_until("the allocator's records to match the pods", CONSISTENT_TIMEOUT, || async {
        let s = checks::allocations(&client).await?;
        ensure!(s.pods == running.len() && s.pod_vifs == running.len(), "{s:?} for {} pods", running.len());
        Ok(s)
    })
    .await?;
    ensure!(summary.addresses == 2 * running.len(), "{summary:?}: want an IPv4 and an IPv6 address per pod");
    for p in running {
        ensure!(
            p.ips.len() == 2 && p.ips[0].is_ipv4() && p.ips[1].is_ipv6(),
            "{}: addresses {:?}, want IPv4 then IPv6",
            p.name,
            p.ips
        );
    }
    checks::node_state(cluster, running).await?;
    eprintln!("consistent: {summary:?}");
    Ok(())
}

/// Deletes every pod of the namespace and waits until nothing is left.
async fn delete_all_and_check(cluster: &Cluster) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), NAMESPACE);
    let t = Instant::now();
    for p in pods.list(&ListParams::default()).await?.items {
        pods.delete(&p.metadata.name.unwrap_or_default(), &DeleteParams::default()).await?;
    }
    checks::wait_released(cluster, RELEASE_TIMEOUT).await.map_err(|e| e.context(kubelet_summary(cluster)))?;
    eprintln!("everything released {:?} after deleting the pods", t.elapsed());
    Ok(())
}

/// `count` pod names `<prefix>-<i>`, spread over the nodes in turn.
fn spread(cluster: &Cluster, prefix: &str, count: usize) -> Vec<(String, String)> {
    let nodes = cluster.nodes();
    (0..count).map(|i| (format!("{prefix}-{i}"), nodes[i % nodes.len()].name.clone())).collect()
}

/// Creates the pods, [`CREATE_CONCURRENCY`] at a time, counting them in `created`.
/// Creates `which` one after another, starting one every `pace`.
async fn create_paced(
    pods: Api<Pod>,
    which: Vec<(String, String)>,
    created: Arc<AtomicUsize>,
    pace: Duration,
) -> Result<()> {
    let start = tokio::time::Instant::now();
    for (i, (name, node)) in which.into_iter().enumerate() {
        tokio::time::sleep_until(start + pace.saturating_mul(u32::try_from(i).unwrap_or(u32::MAX))).await;
        pods.create(&PostParams::default(), &pod(&name, &node)).await.with_context(|| format!("creating {name}"))?;
        created.fetch_add(1, Ordering::SeqCst);
    }
    Ok(())
}

async fn create_pods(pods: Api<Pod>, which: Vec<(String, String)>, created: Arc<AtomicUsize>) -> Result<()> {
    let results: Vec<Result<()>> = futures::stream::iter(which)
        .map(|(name, node)| {
            let (pods, created) = (pods.clone(), created.clone());
            async move {
                pods.create(&PostParams::default(), &pod(&name, &node))
                    .await
                    .with_context(|| format!("creating {name}"))?;
                created.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        })
        .buffer_unordered(CREATE_CONCURRENCY)
        .collect()
        .await;
    results.into_iter().collect()
}

/// The first running pod named `<prefix>…` on each node.
fn one_per_node(running: &[RunningPod], prefix: &str) -> Vec<RunningPod> {
    let mut out: Vec<RunningPod> = Vec::new();
    for p in running.iter().filter(|p| p.name.starts_with(prefix)) {
        if !out.iter().any(|o| o.node == p.node) {
            out.push(p.clone());
        }
    }
    out
}

/// How the kubelets fared: pods by phase, RunPodSandbox attempts, the slowest network-ready.
fn kubelet_summary(cluster: &Cluster) -> String {
    let mut out = Vec::new();
    for k in cluster.kubelets() {
        let recs = k.pods();
        let running = recs.iter().filter(|r| r.phase == PodPhase::Running).count();
        let starting: Vec<String> = recs
            .iter()
            .filter(|r| r.phase == PodPhase::Starting)
            .map(|r| format!("{} ({} attempts: {})", r.name, r.attempts, r.last_error.as_deref().unwrap_or("-")))
            .collect();
        let retried = recs.iter().filter(|r| r.attempts > 1).count();
        let slowest = recs.iter().filter_map(|r| r.network_ready).max().unwrap_or_default();
        out.push(format!(
            "{}: {running} running, {retried} retried, slowest network-ready {slowest:?}, starting {starting:?}",
            k.node()
        ));
    }
    out.join("; ")
}

fn pod(name: &str, node: &str) -> Pod {
    objects::pod(name).namespace(NAMESPACE).node(node).build()
}
