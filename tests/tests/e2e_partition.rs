//! Silent faults, end to end with the embedded backend and every part real (API server, watcher,
//! allocator, lbaas under their ServiceAccounts, a node with containerd + kuryr-cni + binder run
//! by the test kubelet). A stopped process (SIGSTOP) is what a silent partition looks like from
//! the other side: its sockets stay open, the kernel keeps acknowledging, nothing answers.
//!
//! - the allocator stopped: the binder turns NOT_SERVING within its stream idle timeout (no
//!   heartbeat arrives), and a pod deleted meanwhile still gets its CNI DEL through (its plug
//!   report to the frozen allocator is bounded); once thawed, everything carries on;
//! - the watcher stopped: the allocator and lbaas turn NOT_SERVING within their idle timeout;
//! - the API server stopped for a minute, then resumed: the allocator and lbaas (same
//!   processes, no restart) serve new pods and Services again.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{Pod, Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, PostParams};
use kuryr_proto::service_names;
use kuryr_tests::cluster::checks;
use kuryr_tests::cluster::{Cluster, ClusterOptions, ServiceKind, StreamTiming, run_scenario, signal, svc};
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const NAMESPACE: &str = "partition";
/// What the services are told (`--stream-heartbeat`) and what their readers, the binder too, wait
/// before taking a stream for dead (`--stream-idle-timeout`), through `ClusterOptions::stream_timing`.
const HEARTBEAT: &str = "1s";
const IDLE_TIMEOUT: Duration = Duration::from_secs(3);
/// Slack on top of the idle timeout for noticing: the reconnect attempt, the health poll.
const NOTICE_SLACK: Duration = Duration::from_secs(3);
/// How long the API server stays stopped.
const API_OUTAGE: Duration = Duration::from_secs(60);
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(90);

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn options(services: bool) -> ClusterOptions {
    let timing = StreamTiming { heartbeat: HEARTBEAT.into(), idle_timeout: format!("{}s", IDLE_TIMEOUT.as_secs()) };
    ClusterOptions { nodes: 1, services, stream_timing: Some(timing), ..ClusterOptions::default() }
}

async fn with_cluster(name: &str, services: bool, scenario: impl AsyncFnOnce(&mut Cluster) -> Result<()>) {
    let _turn = ONE_AT_A_TIME.lock().await;
    run_scenario(name, options(services), scenario).await.unwrap_or_else(|e| panic!("{e:#}"));
}

/// The health of `service` at `target` (`HOST:PORT` or `unix:/path`): serving or not.
async fn serving(target: &str, service: &str) -> Result<bool> {
    let channel = kuryr_runtime::client::channel(target)?;
    let req = HealthCheckRequest { service: service.into() };
    let status = HealthClient::new(channel).check(req).await?.into_inner().status();
    Ok(status == ServingStatus::Serving)
}

/// Waits until `service` at `target` is (or is not) serving; returns how long that took.
async fn wait_health(target: &str, service: &str, want: bool, timeout: Duration) -> Result<Duration> {
    let t = Instant::now();
    wait_until(&format!("{service} at {target} serving={want}"), timeout, || async {
        ensure!(serving(target, service).await? == want, "not yet");
        Ok(t.elapsed())
    })
    .await
}

fn binder_target(cluster: &Cluster) -> String {
    format!("unix:{}", cluster.nodes()[0].node.binder.socket.display())
}

fn alive(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stopped_allocator_and_watcher_are_noticed_and_del_still_completes() {
    with_cluster("SIGSTOP allocator, watcher", false, stopped_peers).await;
}

async fn stopped_peers(cluster: &mut Cluster) -> Result<()> {
    let client = cluster.client();
    let pods = objects::namespace_with_pods(&client, NAMESPACE).await?;
    let node = cluster.nodes()[0].name.clone();
    pods.create(&PostParams::default(), &pod("before", &node)).await?;
    checks::wait_running(cluster, NAMESPACE, 1, CONVERGE_TIMEOUT).await?;
    let binder = binder_target(cluster);
    ensure!(serving(&binder, service_names::CNI).await?, "the binder does not serve before the fault");

    // The allocator frozen: the binder's VIF stream falls silent and it stops serving.
    cluster.stop_service(ServiceKind::Allocator).await?;
    let noticed = wait_health(&binder, service_names::CNI, false, IDLE_TIMEOUT + NOTICE_SLACK).await?;
    eprintln!("allocator stopped: binder NOT_SERVING after {noticed:?} (idle timeout {IDLE_TIMEOUT:?})");
    ensure!(noticed + Duration::from_millis(200) >= IDLE_TIMEOUT / 2, "noticed implausibly early: {noticed:?}");

    // A pod deleted meanwhile: the kubelet's CNI DEL goes through although the allocator cannot
    // hear the unplug report.
    let t = Instant::now();
    pods.delete("before", &DeleteParams::default()).await?;
    wait_until("the deleted pod's network gone on the node", Duration::from_secs(30), || async {
        let veths = checks::host_veths(cluster, &node).await?;
        let records = cluster.nodes()[0].node.binder.attachment_records();
        let sandboxes = cluster.nodes()[0].node.ctd.cri().list_pod_sandboxes().await?.len();
        ensure!(
            veths.is_empty() && records == 0 && sandboxes == 0,
            "veths {veths:?}, {records} records, {sandboxes} sandboxes"
        );
        Ok(())
    })
    .await?;
    eprintln!("DEL with the allocator stopped done {:?} after the deletion", t.elapsed());

    // Thawed: the binder follows again and the pod's deletion completes (finalizer released).
    cluster.continue_service(ServiceKind::Allocator).await?;
    let back = wait_health(&binder, service_names::CNI, true, CONVERGE_TIMEOUT).await?;
    eprintln!("allocator continued: binder SERVING after {back:?}");
    wait_until("the deleted pod gone from the API", CONVERGE_TIMEOUT, || async {
        ensure!(pods.get_opt("before").await?.is_none(), "still there");
        Ok(())
    })
    .await?;

    // The watcher frozen: the allocator's subscription falls silent and it stops serving.
    let allocator = cluster.allocator().tcp.clone();
    cluster.stop_service(ServiceKind::Watcher).await?;
    let noticed = wait_health(&allocator, service_names::VIF_ALLOCATOR, false, IDLE_TIMEOUT + NOTICE_SLACK).await?;
    eprintln!("watcher stopped: allocator NOT_SERVING after {noticed:?}");
    cluster.continue_service(ServiceKind::Watcher).await?;
    let back = wait_health(&allocator, service_names::VIF_ALLOCATOR, true, CONVERGE_TIMEOUT).await?;
    eprintln!("watcher continued: allocator SERVING after {back:?}");

    // Everything works again.
    pods.create(&PostParams::default(), &pod("after", &node)).await?;
    let running = checks::wait_running(cluster, NAMESPACE, 1, CONVERGE_TIMEOUT).await?;
    checks::node_state(cluster, &running).await?;
    pods.delete("after", &DeleteParams::default()).await?;
    checks::wait_released(cluster, CONVERGE_TIMEOUT).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_server_stopped_for_a_minute_then_resumed_needs_no_restart() {
    with_cluster("SIGSTOP kube-apiserver", true, stopped_api_server).await;
}

async fn stopped_api_server(cluster: &mut Cluster) -> Result<()> {
    let client = cluster.client();
    let pods = objects::namespace_with_pods(&client, NAMESPACE).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
    let node = cluster.nodes()[0].name.clone();
    pods.create(&PostParams::default(), &pod("a", &node)).await?;
    services.create(&PostParams::default(), &service("first")).await?;
    checks::wait_running(cluster, NAMESPACE, 1, CONVERGE_TIMEOUT).await?;
    let (first_ip, _) = svc::cluster_ip(&client, NAMESPACE, "first").await?;
    svc::wait_tables(cluster.nodes(), "the first Service", CONVERGE_TIMEOUT, |t| svc::table_has(t, first_ip)).await?;
    let pids = [
        ("watcher", cluster.watcher().pid().context("watcher pid")?),
        ("allocator", cluster.allocator().pid().context("allocator pid")?),
        ("lbaas", cluster.lbaas().context("lbaas")?.pid().context("lbaas pid")?),
    ];

    let api: u32 = cluster.kube().env_value("APISERVER_PID").context("APISERVER_PID")?.parse()?;
    signal(api, "STOP")?;
    eprintln!("kube-apiserver stopped for {API_OUTAGE:?}");
    // The fault lasts this long by design; nothing is waited for.
    tokio::time::sleep(API_OUTAGE).await;
    signal(api, "CONT")?;
    let t = Instant::now();

    for (name, pid) in pids {
        ensure!(alive(pid), "{name} (pid {pid}) is gone: it did not survive the API server's outage");
    }
    let allocator = cluster.allocator().tcp.clone();
    let lbaas = cluster.lbaas().context("lbaas")?.tcp.clone();
    wait_health(&allocator, service_names::VIF_ALLOCATOR, true, CONVERGE_TIMEOUT).await?;
    wait_health(&lbaas, service_names::LOAD_BALANCERS, true, CONVERGE_TIMEOUT).await?;
    eprintln!("allocator and lbaas SERVING {:?} after the API server resumed", t.elapsed());

    // New work is done by the same processes: a pod gets its network, a Service its rules.
    pods.create(&PostParams::default(), &pod("b", &node)).await?;
    services.create(&PostParams::default(), &service("second")).await?;
    let running = checks::wait_running(cluster, NAMESPACE, 2, CONVERGE_TIMEOUT).await?;
    checks::node_state(cluster, &running).await?;
    let (second_ip, _) = svc::cluster_ip(&client, NAMESPACE, "second").await?;
    svc::wait_tables(cluster.nodes(), "the second Service", CONVERGE_TIMEOUT, |t| svc::table_has(t, second_ip)).await?;
    eprintln!("a new pod Running and a new Service programmed {:?} after the API server resumed", t.elapsed());
    for (name, pid) in pids {
        ensure!(alive(pid), "{name} (pid {pid}) restarted");
    }

    services.delete("first", &DeleteParams::default()).await?;
    services.delete("second", &DeleteParams::default()).await?;
    for p in ["a", "b"] {
        pods.delete(p, &DeleteParams::default()).await?;
    }
    checks::wait_released(cluster, CONVERGE_TIMEOUT).await
}

fn pod(name: &str, node: &str) -> Pod {
    objects::pod(name).namespace(NAMESPACE).node(node).label("app", "partition").grace(1).build()
}

fn service(name: &str) -> Service {
    Service {
        metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() },
        spec: Some(ServiceSpec {
            selector: Some([("app".to_string(), "partition".to_string())].into()),
            ports: Some(vec![ServicePort {
                name: Some("tcp".into()),
                protocol: Some("TCP".into()),
                port: 80,
                target_port: Some(IntOrString::Int(8080)),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}
