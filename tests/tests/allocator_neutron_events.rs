//! Port readiness from Neutron's own events, against the real parts: kube-apiserver, Keystone,
//! the real Neutron (API, RPC server, ML2/OVS agent on a private Open vSwitch) and the real
//! RabbitMQ they talk over; kuryr-watcher, kuryr-vif-allocator `--backend neutron` reading the
//! transport URL from a mounted-style neutron.conf and reaching RabbitMQ over TLS with the
//! services' credentials, and a kuryr-binder in the node's namespace. CNI through the shim.
//!
//! The allocator's reconciling read runs every 60 s here, far longer than the test waits for
//! ports: a pod that becomes ready before it did so through an event.
//!
//! One life, in phases:
//! 1. a burst of pods on a warm pool: every ADD returns with its port ACTIVE, every port learnt
//!    ACTIVE from a pushed event, no status read made;
//! 2. with the agent stopped (the port stays DOWN), pushes published into the real broker — a
//!    port that is not ours, an ACTIVE push older than the pod's port assignment, a newer ACTIVE
//!    naming another device, a duplicate, an undecodable message — change nothing: the VIF is
//!    not READY and ADD waits; the agent back, the real push makes it READY;
//! 3. RabbitMQ stopped in the middle of a burst: the allocator polls meanwhile, and once
//!    RabbitMQ is back every ADD returns with its port ACTIVE (none stuck, none early);
//! 4. after the restart the subscription is back: a last burst is again served by events.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use amqprs::BasicProperties;
use amqprs::channel::BasicPublishArguments;
use amqprs::connection::{Connection, OpenConnectionArguments};
use kube::api::{Api, PostParams};
use kuryr_proto::allocator::v1::pool_manager_client::PoolManagerClient;
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::{GetVifRequest, PoolKey, PopulatePoolRequest, VifState};
use kuryr_tests::binder::Binder;
use kuryr_tests::metrics::Scrape;
use kuryr_tests::netns::Netns;
use kuryr_tests::neutron::{AllocatorOptions, CniPod, NeutronCluster, Svc};
use kuryr_tests::services::wait_until;
use kuryr_tests::shim::ShimOutput;
use serde_json::json;

/// Bound on what goes through Neutron's agent (seconds unloaded, far more on a busy machine).
const SLOW: Duration = Duration::from_secs(240);
const QUICK: Duration = Duration::from_secs(60);
const NS: &str = "events";
/// The Port object version of the test Neutron (29.x).
const PORT_EXCHANGE: &str = "neutron-vo-Port-1.11_fanout";

/// A push of one port as Neutron sends it to its agents.
fn push(id: &str, status: &str, revision: u64, device_id: &str, owner: &str) -> Vec<u8> {
    let inner = json!({
        "method": "push",
        "args": {
            "resource_list": [{
                "versioned_object.name": "Port",
                "versioned_object.namespace": "versionedobjects",
                "versioned_object.version": "1.11",
                "versioned_object.data": {
                    "id": id, "status": status, "revision_number": revision, "device_id": device_id,
                    "device_owner": owner, "bindings": [{"versioned_object.data": {"host": "node-1"}}],
                },
            }],
            "event_type": "updated",
        },
        "version": "1.1",
        "namespace": "resources",
    });
    serde_json::to_vec(&json!({"oslo.version": "2.0", "oslo.message": inner.to_string()})).unwrap()
}

/// Publishes `bodies` to `exchange` through the broker of `url` (`rabbit://u:p@host:port/`).
async fn publish(url: &str, exchange: &str, bodies: &[Vec<u8>]) -> anyhow::Result<()> {
    let rest = url.strip_prefix("rabbit://").unwrap();
    let (creds, hostport) = rest.rsplit_once('@').unwrap();
    let (user, pass) = creds.split_once(':').unwrap();
    let (host, port) = hostport.trim_end_matches('/').rsplit_once(':').unwrap();
    let conn = Connection::open(&OpenConnectionArguments::new(host, port.parse()?, user, pass)).await?;
    let ch = conn.open_channel(None).await?;
    for b in bodies {
        ch.basic_publish(BasicProperties::default(), b.clone(), BasicPublishArguments::new(exchange, "")).await?;
    }
    ch.close().await?;
    conn.close().await?;
    Ok(())
}

async fn vif_state(alloc: &Svc, uid: &str) -> anyhow::Result<(String, VifState)> {
    let mut c = VifAllocatorClient::new(alloc.channel()?);
    let v = c.get_vif(GetVifRequest { pod_uid: uid.into() }).await?.into_inner();
    let state = v.state();
    Ok((v.vif_id, state))
}

struct Run {
    c: NeutronCluster,
    alloc: Svc,
    binder: Arc<Binder>,
    pods: Api<k8s_openapi::api::core::v1::Pod>,
}

impl Run {
    async fn create(&self, name: &str) -> CniPod {
        let made = self.pods.create(&PostParams::default(), &self.c.pod(name)).await.unwrap();
        CniPod {
            namespace: NS.into(),
            name: name.into(),
            uid: made.metadata.uid.unwrap(),
            netns: Arc::new(Netns::new("pev").unwrap()),
        }
    }

    fn add(&self, pod: &CniPod) -> tokio::task::JoinHandle<ShimOutput> {
        let (pod, binder) = (pod.clone(), self.binder.clone());
        tokio::task::spawn_blocking(move || pod.run("ADD", &binder, None, SLOW).unwrap())
    }

    /// Creates the pods `<prefix>-0`, … `<prefix>-<n-1>` one after the other and starts their ADDs
    /// (running together).
    async fn start_adds(&self, prefix: &str, n: usize) -> Vec<(CniPod, tokio::task::JoinHandle<ShimOutput>)> {
        let mut adds = Vec::new();
        for i in 0..n {
            let pod = self.create(&format!("{prefix}-{i}")).await;
            let add = self.add(&pod);
            adds.push((pod, add));
        }
        adds
    }

    /// Awaits the ADDs; each must succeed with its port ACTIVE in Neutron.
    async fn all_added(&self, adds: Vec<(CniPod, tokio::task::JoinHandle<ShimOutput>)>) {
        for (pod, add) in adds {
            let out = add.await.unwrap();
            assert_eq!(out.code, 0, "ADD {}: {} {}\n{}", pod.name, out.stdout, out.stderr, self.binder.logs());
            let (port, state) = vif_state(&self.alloc, &pod.uid).await.unwrap();
            assert_eq!(state, VifState::Ready, "{}", pod.name);
            let p = self.c.neutron.get_port(&port).await.unwrap();
            assert_eq!(p.status, "ACTIVE", "ADD of {} returned before its port {port} was ACTIVE", pod.name);
        }
    }

    async fn metrics(&self) -> Scrape {
        Scrape::http(&self.alloc.metrics_url).await.unwrap()
    }
}

#[tokio::test]
async fn port_readiness_from_neutrons_push_through_forged_events_and_a_broker_restart() {
    let c = NeutronCluster::start(&[NS]).await.unwrap();
    let conf = c.events_config(true).unwrap();
    let watcher = c.watcher().unwrap();
    let o = AllocatorOptions {
        cluster_id: "events".into(),
        pool_min: 2,
        pool_batch: 10,
        instance: "alloc-events".into(),
        extra: vec![
            "--neutron-config-files".into(),
            conf.display().to_string(),
            "--neutron-events-resync-interval".into(),
            "60s".into(),
            // Each orphan round also audits this replica's ports with one port list: none may
            // fall in the burst whose list calls are counted below.
            "--orphan-gc-interval".into(),
            "600s".into(),
        ],
        ..AllocatorOptions::default()
    };
    let alloc = c.allocator(&watcher, &o).unwrap();
    alloc.wait_ready(SLOW).await.unwrap();
    let binder = Arc::new(c.binder(&alloc, SLOW, &[]).await.unwrap());
    let pods = Api::namespaced(c.admin.clone(), NS);
    let r = Run { c, alloc, binder, pods };
    wait_until("the allocator to consume Neutron's port events over TLS", QUICK, || async {
        let m = Scrape::http(&r.alloc.metrics_url).await?;
        anyhow::ensure!(m.sum("kuryr_allocator_neutron_events_connected", &[]) == 1.0, "not connected");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", r.alloc.proc.logs()));
    let mut pm = PoolManagerClient::new(r.alloc.channel().unwrap());
    let key = PoolKey { node_name: r.c.node.host.clone(), ..Default::default() };
    pm.populate_pool(PopulatePoolRequest { key: Some(key), count: 16 }).await.unwrap();

    // 1. A burst on the warm pool: ready from events alone.
    let before = r.metrics().await;
    let adds = r.start_adds("burst", 6).await;
    r.all_added(adds).await;
    let m = r.metrics().await;
    let ev = |res| [("result", res)];
    m.moved(&before, "kuryr_allocator_neutron_ready_sources_total", &[("source", "event")]).exactly(6.0).unwrap();
    m.moved(&before, "kuryr_allocator_neutron_events_ports_total", &ev("ready")).exactly(6.0).unwrap();
    m.moved(&before, "kuryr_allocator_neutron_status_polls_total", &[]).exactly(0.0).unwrap();
    m.moved(&before, "kuryr_allocator_neutron_status_safety_reads_total", &[]).exactly(0.0).unwrap();
    let status_reads = m.sum("openstack_requests_total", &[("operation", "ports.list")])
        - before.sum("openstack_requests_total", &[("operation", "ports.list")]);
    assert_eq!(status_reads, 0.0, "no port list call at all during the burst");

    // 2. Forged, foreign, duplicated and undecodable pushes while the port cannot turn ACTIVE.
    r.c.os.stop_process("neutron-agent").await.unwrap();
    let pod = r.create("held").await;
    let add = r.add(&pod);
    let (port, _) = wait_until("the pod's VIF to be plugged and waited for", SLOW, || async {
        let (port, state) = vif_state(&r.alloc, &pod.uid).await?;
        anyhow::ensure!(state == VifState::Plugged, "{state:?}");
        Ok((port, state))
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", r.alloc.proc.logs()));
    let before = r.metrics().await;
    let url = r.c.transport_url(false).unwrap();
    let bodies = vec![
        push("6d1d1c55-0000-4000-8000-000000000001", "ACTIVE", 3, "a-vm", "compute:nova"),
        push(&port, "ACTIVE", 1, &pod.uid, "compute:kuryr"),
        push(&port, "ACTIVE", 10_000, "the-previous-pod", "compute:kuryr"),
        push(&port, "ACTIVE", 10_000, "the-previous-pod", "compute:kuryr"),
        b"{not json".to_vec(),
    ];
    publish(&url, PORT_EXCHANGE, &bodies).await.unwrap();
    wait_until("the allocator to have consumed the published pushes", QUICK, || async {
        let m = Scrape::http(&r.alloc.metrics_url).await?;
        m.moved(&before, "kuryr_allocator_neutron_events_messages_total", &[("result", "undecodable")])
            .at_least(1.0)?;
        Ok(())
    })
    .await
    .unwrap();
    let m = r.metrics().await;
    m.moved(&before, "kuryr_allocator_neutron_events_ports_total", &ev("foreign")).at_least(1.0).unwrap();
    m.moved(&before, "kuryr_allocator_neutron_events_ports_total", &ev("stale")).at_least(3.0).unwrap();
    m.moved(&before, "kuryr_allocator_neutron_events_ports_total", &ev("ready")).exactly(0.0).unwrap();
    assert_eq!(vif_state(&r.alloc, &pod.uid).await.unwrap().1, VifState::Plugged, "marked READY by a bad push");
    assert!(!add.is_finished(), "ADD returned while the port was DOWN");
    assert_eq!(r.c.neutron.get_port(&port).await.unwrap().status, "DOWN");
    r.c.os.start_process("neutron-agent").await.unwrap();
    r.all_added(vec![(pod, add)]).await;
    let m = r.metrics().await;
    m.moved(&before, "kuryr_allocator_neutron_ready_sources_total", &[("source", "event")]).exactly(1.0).unwrap();

    // 3. RabbitMQ stopped in the middle of a burst, started again: nothing stuck. The agent is
    // held back at first so that the burst's first pods are surely plugged and waiting when the
    // broker goes.
    let before = r.metrics().await;
    r.c.os.stop_process("neutron-agent").await.unwrap();
    let mut adds = r.start_adds("outage", 3).await;
    for (pod, _) in &adds {
        wait_until("the first pods to be plugged", SLOW, || async {
            let (_, state) = vif_state(&r.alloc, &pod.uid).await?;
            anyhow::ensure!(state == VifState::Plugged, "{state:?}");
            Ok(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", r.alloc.proc.logs()));
    }
    r.c.os.stop_process("rabbitmq").await.unwrap();
    wait_until("the allocator to see RabbitMQ gone", QUICK, || async {
        let m = Scrape::http(&r.alloc.metrics_url).await?;
        anyhow::ensure!(m.sum("kuryr_allocator_neutron_events_connected", &[]) == 0.0, "still connected");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", r.alloc.proc.logs()));
    for i in 3..8 {
        let pod = r.create(&format!("outage-{i}")).await;
        let add = r.add(&pod);
        adds.push((pod, add));
    }
    wait_until("the allocator to poll port status while RabbitMQ is away", QUICK, || async {
        let m = Scrape::http(&r.alloc.metrics_url).await?;
        m.moved(&before, "kuryr_allocator_neutron_status_polls_total", &[]).at_least(1.0)?;
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", r.alloc.proc.logs()));
    for (pod, add) in &adds {
        assert!(!add.is_finished(), "ADD of {} returned while the agent and RabbitMQ were down", pod.name);
    }
    r.c.os.start_process("rabbitmq").await.unwrap();
    r.c.os.start_process("neutron-agent").await.unwrap();
    r.all_added(adds).await;
    wait_until("the allocator to consume events again", SLOW, || async {
        let m = Scrape::http(&r.alloc.metrics_url).await?;
        anyhow::ensure!(m.sum("kuryr_allocator_neutron_events_connected", &[]) == 1.0, "not connected");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", r.alloc.proc.logs()));
    let m = r.metrics().await;
    m.moved(&before, "kuryr_allocator_neutron_events_connections_total", &[("result", "ok")]).at_least(1.0).unwrap();
    let d = |name: &str, f: &[(&str, &str)]| m.sum(name, f) - before.sum(name, f);
    eprintln!(
        "outage: {:.0} polls, {:.0} reconnecting reads; ports ACTIVE by event {:.0}, by poll {:.0}, by reconciling read {:.0}",
        d("kuryr_allocator_neutron_status_polls_total", &[]),
        d("kuryr_allocator_neutron_status_safety_reads_total", &[("source", "reconnect")]),
        d("kuryr_allocator_neutron_ready_sources_total", &[("source", "event")]),
        d("kuryr_allocator_neutron_ready_sources_total", &[("source", "poll")]),
        d("kuryr_allocator_neutron_ready_sources_total", &[("source", "safety")]),
    );
    let ready = d("kuryr_allocator_neutron_ready_sources_total", &[]);
    assert_eq!(ready, 8.0, "every pod of the burst learnt ACTIVE exactly once");

    // 4. The subscription survived the restart: events again.
    let before = r.metrics().await;
    let adds = r.start_adds("after", 3).await;
    r.all_added(adds).await;
    let m = r.metrics().await;
    m.moved(&before, "kuryr_allocator_neutron_ready_sources_total", &[("source", "event")]).exactly(3.0).unwrap();
    m.moved(&before, "kuryr_allocator_neutron_status_polls_total", &[]).exactly(0.0).unwrap();
}
