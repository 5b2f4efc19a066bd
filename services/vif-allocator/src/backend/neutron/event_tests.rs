//! The backend's handling of Neutron's port pushes: readiness, further ports, recycling.
#![allow(clippy::unwrap_used)]

use kuryr_openstack::config::{AuthConfig, Interface, TlsConfig};
use kuryr_openstack::{CloudConfig, ServiceType};

use super::events::ResultLabels;
use super::*;

const OWNER: &str = "compute:kuryr";

/// A backend with events whose Neutron is never called here.
fn backend() -> (NeutronBackend, mpsc::UnboundedReceiver<ReadyVif>, tokio::sync::watch::Sender<Link>) {
    let cloud = CloudConfig {
        origin: "test".into(),
        auth: AuthConfig::NoAuth { project_id: Some("p".into()) },
        region_name: None,
        interface: Interface::default(),
        tls: TlsConfig::default(),
        endpoint_overrides: [(ServiceType::Network, "http://127.0.0.1:9".parse().unwrap())].into(),
    };
    let client = Client::new(
        &cloud,
        kuryr_openstack::ClientOptions::default(),
        Arc::new(kuryr_openstack::Metrics::unregistered()),
    )
    .unwrap();
    let (ready_tx, ready) = mpsc::unbounded_channel();
    let (refill_tx, _) = mpsc::unbounded_channel();
    let link = tokio::sync::watch::Sender::new(Link { connected: true, epoch: 1 });
    let metrics = NeutronMetrics::default();
    let b = NeutronBackend {
        neutron: client.network(),
        networks: Networks::Fixed(VifShape {
            network_id: "net".into(),
            subnets: Vec::new(),
            mtu: 1500,
            bridge: "br-int".into(),
        }),
        project: "p".into(),
        security_groups: Vec::new(),
        reset_groups: Vec::new(),
        tag: "t".into(),
        device_owner: OWNER.into(),
        limits: Limits { min: 0, batch: 0, max: 0 },
        poll: (Duration::from_millis(100), Duration::from_secs(2)),
        inv: Mutex::default(),
        watched: Mutex::default(),
        wake: Notify::new(),
        ready_tx,
        refill_tx,
        filling: Mutex::default(),
        bulk: Semaphore::new(1),
        recovered: AtomicBool::new(true),
        events: Some(EventSide {
            link: link.subscribe(),
            resync: Duration::from_secs(10),
            metrics: metrics.events.clone(),
            state: Mutex::default(),
            consumer: Mutex::new(None),
        }),
        metrics,
        shards: shards::ShardState::default(),
        nested: None,
        attached: attach::AttachState::default(),
    };
    (b, ready, link)
}

#[test]
fn a_pod_with_further_ports_waits_for_them_once_its_own_port_is_active() {
    let (b, mut ready, _link) = backend();
    let key = PoolKey::new("node-1", "p", "net", Vec::new());
    guard(&b.inv).assign("uid-1", &key, port("p1", 5));
    guard(&b.inv).assign("uid-2", &key, port("p2", 5));
    b.expect_extras("uid-1", vec!["x1".into(), "x2".into()]);
    b.watch_ready("uid-1", "p1", true);
    b.watch_ready("uid-2", "p2", true);
    b.on_port_event(&ev("p1", "ACTIVE", 6, "uid-1"));
    b.on_port_event(&ev("p2", "ACTIVE", 6, "uid-2"));
    assert_eq!(
        ready.try_recv().unwrap(),
        ReadyVif { pod_uid: "uid-2".into(), vif_id: "p2".into() },
        "a pod without further ports is ready at once"
    );
    assert!(ready.try_recv().is_err(), "the pod with further ports waits for them");
    assert!(b.hold_for_extras("uid-1", "p1"));
    b.unhold("p1");
    assert!(!b.hold_for_extras("uid-2", "p2"));
}

fn port(id: &str, revision: u64) -> Port {
    Port { id: id.into(), revision_number: Some(revision), device_owner: OWNER.into(), ..Port::default() }
}

fn ev(id: &str, status: &str, revision: u64, device_id: &str) -> PortEvent {
    PortEvent {
        id: id.into(),
        status: Some(status.into()),
        revision: Some(revision),
        device_id: Some(device_id.into()),
        device_owner: Some(OWNER.into()),
        hosts: vec!["node-1".into()],
        deleted: false,
    }
}

fn count(b: &NeutronBackend, result: &'static str) -> u64 {
    b.metrics.events.ports.get_or_create(&ResultLabels { result }).get()
}

#[test]
fn a_watched_port_is_ready_only_on_a_newer_active_push_naming_its_pod() {
    let (b, mut ready, _link) = backend();
    let key = PoolKey::new("node-1", "p", "net", Vec::new());
    guard(&b.inv).assign("uid-1", &key, port("p1", 5));
    b.watch_ready("uid-1", "p1", true);

    let mut foreign = ev("vm-port", "ACTIVE", 1, "server-1");
    foreign.device_owner = Some("compute:nova".into());
    b.on_port_event(&foreign);
    b.on_port_event(&ev("other-kuryr-port", "ACTIVE", 3, "x"));
    assert_eq!(count(&b, "foreign"), 2);

    b.on_port_event(&ev("p1", "ACTIVE", 5, "uid-1"));
    b.on_port_event(&ev("p1", "ACTIVE", 4, "old-pod"));
    assert_eq!(count(&b, "stale"), 2, "revisions up to the assignment's say nothing of this plug");
    b.on_port_event(&ev("p1", "ACTIVE", 10_000, "old-pod"));
    assert_eq!(count(&b, "stale"), 3, "another pod's port state");
    b.on_port_event(&ev("p1", "DOWN", 7, "uid-1"));
    b.on_port_event(&ev("p1", "DOWN", 7, "uid-1"));
    b.on_port_event(&ev("p1", "ACTIVE", 6, "uid-1"));
    assert_eq!((count(&b, "pending"), count(&b, "stale")), (1, 5), "a repeat and an older push are stale");
    assert!(ready.try_recv().is_err(), "nothing marked ready so far");
    assert!(guard(&b.watched).contains_key("p1"));

    b.on_port_event(&ev("p1", "ACTIVE", 8, "uid-1"));
    assert_eq!(ready.try_recv().unwrap(), ReadyVif { pod_uid: "uid-1".into(), vif_id: "p1".into() });
    assert!(!guard(&b.watched).contains_key("p1"));
    b.on_port_event(&ev("p1", "ACTIVE", 8, "uid-1"));
    assert!(ready.try_recv().is_err(), "a duplicate marks nothing twice");
    assert_eq!(b.metrics.ready_sources.get_or_create(&metrics::SourceLabels { source: "event" }).get(), 1);
}

#[test]
fn active_before_the_plug_report_counts_unless_a_newer_push_took_it_back() {
    let (b, mut ready, _link) = backend();
    let key = PoolKey::new("node-1", "p", "net", Vec::new());
    guard(&b.inv).assign("uid-4", &key, port("p4", 3));
    guard(&b.inv).assign("uid-5", &key, port("p5", 3));
    // p4: ACTIVE then DOWN, delivered out of order.
    b.on_port_event(&ev("p4", "DOWN", 5, "uid-4"));
    b.on_port_event(&ev("p4", "ACTIVE", 4, "uid-4"));
    // p5: ACTIVE.
    b.on_port_event(&ev("p5", "ACTIVE", 4, "uid-5"));
    assert_eq!(count(&b, "early"), 1);
    b.watch_ready("uid-4", "p4", true);
    assert!(ready.try_recv().is_err(), "p4 was last seen DOWN");
    b.watch_ready("uid-5", "p5", true);
    assert_eq!(ready.try_recv().unwrap(), ReadyVif { pod_uid: "uid-5".into(), vif_id: "p5".into() });
    assert!(guard(&b.watched).contains_key("p4") && !guard(&b.watched).contains_key("p5"));
}

#[test]
fn released_ports_are_free_again_when_pushed_unplugged_and_deletions_stop_the_wait() {
    let (b, mut ready, _link) = backend();
    let key = PoolKey::new("node-1", "p", "net", Vec::new());
    guard(&b.inv).put_recycling(&key, port("p2", 9), Instant::now());
    b.on_port_event(&ev("p2", "DOWN", 8, ""));
    assert_eq!(guard(&b.inv).recycling().len(), 1, "a push older than the release");
    b.on_port_event(&ev("p2", "ACTIVE", 10, ""));
    assert_eq!(guard(&b.inv).recycling().len(), 1, "still plugged");
    b.on_port_event(&ev("p2", "DOWN", 11, ""));
    assert!(guard(&b.inv).recycling().is_empty());
    assert_eq!(guard(&b.inv).view(&key).unwrap().free, ["p2"]);
    assert_eq!(count(&b, "recycled"), 1);
    b.on_port_event(&ev("p2", "DOWN", 12, ""));
    assert_eq!(count(&b, "idle"), 1, "a free port's push changes nothing");

    guard(&b.inv).assign("uid-3", &key, port("p3", 2));
    b.watch_ready("uid-3", "p3", true);
    let mut gone = ev("p3", "DOWN", 3, "uid-3");
    gone.status = None;
    gone.deleted = true;
    b.on_port_event(&gone);
    assert!(!guard(&b.watched).contains_key("p3"));
    assert!(ready.try_recv().is_err());
    assert_eq!(count(&b, "gone"), 1);
}
