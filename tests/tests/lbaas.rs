//! kuryr-lbaas as users run it: its own process under the `kuryr-lbaas` ServiceAccount with
//! exactly the rights of `deploy/rbac/lbaas.yaml`, fed by a real kuryr-watcher (under its own
//! account), against a real kube-apiserver with the CRDs of `deploy/crds/`. A tonic
//! WatchLoadBalancers client plays a node's binder.
//!
//! The life of Services: a ClusterIP Service with IPv4 and IPv6 EndpointSlices becomes a spec
//! with its VIPs, a listener per port and the endpoints as members (named target ports resolved
//! per slice, conditions carried, dead endpoints left out), recorded in a ServiceLoadBalancer
//! (PROGRAMMED at its generation) with a finalizer on the Service; an endpoint change is a delta
//! with a higher generation; a reconnect resumes without a snapshot; NodePort is streamed with the
//! node ports the API server allocated, its external IPs and traffic policies; ExternalName gets
//! an Event and headless nothing; deleting a Service streams LB_DELETED, deletes the record and lets the
//! Service go; kill -9 and restart: the same load balancers at the same generations, Services
//! deleted or created meanwhile handled, records without a Service removed; bad requests are
//! INVALID_ARGUMENT. Heartbeats: a quiet watcher is not taken for dead, a stopped one (SIGSTOP)
//! is, after `--stream-idle-timeout`, and lbaas' own quiet stream carries heartbeats.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_lbaas::k8s::crd::{ServiceLoadBalancer, ServiceLoadBalancerSpec};
use kuryr_proto::lbaas::v1::load_balancers_client::LoadBalancersClient;
use kuryr_proto::lbaas::v1::{
    GetLoadBalancerRequest, LbEventType, ListLoadBalancersRequest, Listener, LoadBalancerSpec, Protocol, TrafficPolicy,
    WatchLoadBalancersRequest, WatchLoadBalancersResponse,
};
use kuryr_proto::service_names::LOAD_BALANCERS;
use kuryr_runtime::auth::client::{PeerChannel, with_credentials};
use kuryr_tests::control::{ControlPlane, Served, Watcher};
use kuryr_tests::kube::client_from_kubeconfig;
use kuryr_tests::services::wait_until;
use kuryr_tests::sut::{self, Sut};
use kuryr_tests::watch::{End, next_event, until_end};
use serde_json::json;
use tonic::Streaming;

/// Bound on one expected change; a healthy lbaas delivers in milliseconds.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);
/// Bound on becoming SERVING.
const PHASE_TIMEOUT: Duration = Duration::from_secs(60);
const FINALIZER: &str = "kuryr.openstack.org/lbaas";
const NS: &str = "lb";

async fn cluster() -> ControlPlane {
    ControlPlane::start(Served::Lbaas, NS).await.unwrap()
}

fn watcher(c: &ControlPlane) -> Watcher {
    c.watcher(None, &["--shutdown-grace", "3s"]).unwrap()
}

/// kuryr-lbaas with `extra` flags, stopping within 3 s when asked.
fn start_lbaas(c: &ControlPlane, watcher: &Watcher, extra: &[&str]) -> Sut {
    c.lbaas(watcher, "lb-1", &[&["--shutdown-grace", "3s"], extra].concat()).unwrap()
}

async fn wait_serving(lbaas: &Sut) {
    lbaas.wait_serving(LOAD_BALANCERS, PHASE_TIMEOUT).await.unwrap();
}

async fn metrics(lbaas: &Sut) -> String {
    lbaas.metrics_text().await.unwrap()
}

/// A client with a binder's token.
fn binder_client(lbaas: &Sut, c: &ControlPlane) -> LoadBalancersClient<PeerChannel> {
    LoadBalancersClient::new(kuryr_tests::auth::channel(&lbaas.addr, &c.binder_token).unwrap())
}

async fn watch(lbaas: &Sut, c: &ControlPlane, resume_from: &str) -> LbStream {
    let req = WatchLoadBalancersRequest { resume_from: resume_from.into(), subscriber: "test/n1".into() };
    let stream = wait_until("WatchLoadBalancers", PHASE_TIMEOUT, || async {
        Ok(binder_client(lbaas, c).watch_load_balancers(req.clone()).await?.into_inner())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.proc.logs()));
    LbStream::new(stream)
}

async fn create_service(c: &ControlPlane, name: &str, spec: serde_json::Value) -> Service {
    c.api::<Service>().create(&PostParams::default(), &sut::service(name, spec).unwrap()).await.unwrap()
}

async fn put_slice(
    c: &ControlPlane,
    name: &str,
    service: &str,
    family: &str,
    ports: serde_json::Value,
    eps: serde_json::Value,
) {
    sut::put_slice(&c.api(), sut::slice(name, service, family, ports, eps).unwrap()).await.unwrap();
}

async fn finalizers(c: &ControlPlane, name: &str) -> Vec<String> {
    c.api::<Service>().get(name).await.unwrap().metadata.finalizers.unwrap_or_default()
}

async fn events_about(c: &ControlPlane, name: &str) -> Vec<Event> {
    let all = c.api::<Event>().list(&ListParams::default()).await.unwrap().items;
    // kuryr-lbaas' only: the API server's own controllers may have their say about a Service
    // too (ClusterIPNotAllocated from its IP repair loop, for one).
    all.into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .filter(|e| e.reporting_controller.as_deref() == Some("kuryr-lbaas"))
        .collect()
}

/// The endpoints of a slice, each (address, ready, serving, terminating, pod) on node n1.
fn endpoints(list: &[(&str, bool, bool, bool, &str)]) -> serde_json::Value {
    sut::pod_endpoints(NS, "n1", list)
}

/// A node's view of the stream, applied the way a binder applies it.
struct LbStream {
    stream: Streaming<WatchLoadBalancersResponse>,
    /// By namespace/name.
    specs: BTreeMap<String, LoadBalancerSpec>,
    /// Keys whose LB was deleted.
    deleted: BTreeSet<String>,
    /// Every key ever applied.
    ever: BTreeSet<String>,
    /// Event types in order.
    types: Vec<LbEventType>,
    resets: usize,
    live: bool,
    last: String,
}

impl LbStream {
    fn new(stream: Streaming<WatchLoadBalancersResponse>) -> Self {
        Self {
            stream,
            specs: BTreeMap::new(),
            deleted: BTreeSet::new(),
            ever: BTreeSet::new(),
            types: Vec::new(),
            resets: 0,
            live: false,
            last: String::new(),
        }
    }

    async fn next(&mut self) -> Result<WatchLoadBalancersResponse, End> {
        let ev = next_event(&mut self.stream, EVENT_TIMEOUT, |ev| ev.r#type() == LbEventType::Heartbeat).await?;
        self.last.clone_from(&ev.resume_point);
        self.types.push(ev.r#type());
        let key = ev.spec.as_ref().map(|s| format!("{}/{}", s.namespace, s.name)).unwrap_or_default();
        match ev.r#type() {
            LbEventType::Reset => {
                self.resets += 1;
                self.live = false;
                self.specs.clear();
            }
            LbEventType::SnapshotComplete => self.live = true,
            LbEventType::LbApplied => {
                self.deleted.remove(&key);
                self.ever.insert(key.clone());
                self.specs.insert(key, ev.spec.clone().unwrap());
            }
            LbEventType::LbDeleted => {
                self.specs.remove(&key);
                self.deleted.insert(key);
            }
            LbEventType::Unspecified | LbEventType::Heartbeat => panic!("unexpected event {ev:?}"),
        }
        Ok(ev)
    }

    async fn until(&mut self, what: &str, pred: impl Fn(&LbStream) -> bool) {
        while !pred(self) {
            if let Err(e) = self.next().await {
                panic!("waiting for {what}: {e:?}; have {:?}, deleted {:?}", self.specs.keys(), self.deleted);
            }
        }
    }

    async fn end(&mut self) -> End {
        until_end(async || self.next().await).await
    }

    fn spec(&self, name: &str) -> &LoadBalancerSpec {
        self.specs.get(&format!("{NS}/{name}")).unwrap_or_else(|| panic!("no spec for {name}"))
    }
}

/// A listener's members as `address:port flags`.
fn members(l: &Listener) -> Vec<String> {
    let mut out: Vec<String> = l
        .pool
        .as_ref()
        .unwrap()
        .members
        .iter()
        .map(|m| {
            let flags: String = [(m.ready, 'r'), (m.serving, 's'), (m.terminating, 't')]
                .iter()
                .filter(|(b, _)| *b)
                .map(|(_, c)| *c)
                .collect();
            format!("{}:{} {flags}", m.address, m.port)
        })
        .collect();
    out.sort();
    out
}

fn key(name: &str) -> String {
    format!("{NS}/{name}")
}

#[tokio::test]
async fn services_become_load_balancers_that_survive_restarts() {
    let c = cluster().await;
    let watcher = watcher(&c);
    let mut lbaas = start_lbaas(&c, &watcher, &["--service-finalizer", "all"]);
    wait_serving(&lbaas).await;

    // Its account edits Services' finalizers and nothing else: no listing Services or slices.
    let sa = client_from_kubeconfig(&c.kubeconfig).await.unwrap();
    let forbidden = |r: Result<(), kube::Error>| matches!(r, Err(kube::Error::Api(s)) if s.code == 403);
    assert!(forbidden(Api::<Service>::all(sa.clone()).list(&ListParams::default()).await.map(drop)));
    assert!(forbidden(Api::<EndpointSlice>::all(sa.clone()).list(&ListParams::default()).await.map(drop)));
    assert!(forbidden(Api::<Secret>::all(sa.clone()).list(&ListParams::default()).await.map(drop)));
    assert!(forbidden(Api::<Service>::namespaced(sa, NS).delete("x", &DeleteParams::default()).await.map(drop)));

    // Only the binders' account reads the specs: no token is UNAUTHENTICATED, another account's
    // PERMISSION_DENIED, on every method.
    let anonymous = LoadBalancersClient::new(with_credentials(
        kuryr_runtime::client::channel(&lbaas.addr).unwrap(),
        kuryr_runtime::auth::client::Credentials::None,
    ));
    let other = c.env.kuryr_token("kuryr-system", "kuryr-vif-allocator", None).await.unwrap();
    let other = LoadBalancersClient::new(kuryr_tests::auth::channel(&lbaas.addr, &other).unwrap());
    for (who, mut client, code) in [
        ("anonymous", anonymous, tonic::Code::Unauthenticated),
        ("the allocator", other, tonic::Code::PermissionDenied),
    ] {
        let watch = WatchLoadBalancersRequest { resume_from: String::new(), subscriber: String::new() };
        let e = client.watch_load_balancers(watch).await.unwrap_err();
        assert_eq!(e.code(), code, "{who}: {e}");
        let e = client.list_load_balancers(ListLoadBalancersRequest::default()).await.unwrap_err();
        assert_eq!(e.code(), code, "{who}: {e}");
    }

    // Bad requests name the field; unknown Services are NOT_FOUND.
    let mut client = binder_client(&lbaas, &c);
    for (ns, name, field) in [("", "web", "namespace"), (NS, "", "name"), (NS, "Web", "name")] {
        let err = client
            .get_load_balancer(GetLoadBalancerRequest { namespace: ns.into(), name: name.into() })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{ns}/{name}: {err}");
        assert!(err.message().starts_with(field), "{err}");
    }
    let err = client.list_load_balancers(ListLoadBalancersRequest { namespace: "a_b".into() }).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    let long = WatchLoadBalancersRequest { resume_from: "x".repeat(500), subscriber: String::new() };
    let err = client.watch_load_balancers(long).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    let err = client
        .get_load_balancer(GetLoadBalancerRequest { namespace: NS.into(), name: "nope".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");

    let mut w = watch(&lbaas, &c, "").await;
    w.until("the first snapshot", |s| s.live).await;

    // A Service with a named target port, UDP too, client affinity; IPv4 and IPv6 slices.
    let web = create_service(
        &c,
        "web",
        json!({
            "ports": [
                {"name": "http", "port": 80, "targetPort": "web"},
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353},
            ],
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
        }),
    )
    .await;
    let web_uid = web.metadata.uid.clone().unwrap();
    let vips = web.spec.as_ref().unwrap().cluster_ips.clone().unwrap();
    let v4_ports =
        json!([{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "dns", "port": 5353, "protocol": "UDP"}]);
    // The IPv4 slice: a ready, b terminating but serving, and a third endpoint that changes below.
    let put_web_v4 = async |third| {
        let eps = endpoints(&[("10.244.0.5", true, true, false, "a"), ("10.244.0.6", false, true, true, "b"), third]);
        put_slice(&c, "web-v4", "web", "IPv4", v4_ports.clone(), eps).await;
    };
    put_web_v4(("10.244.0.7", false, false, false, "dead")).await;
    // These pods serve "web" on another port: resolved per slice.
    put_slice(
        &c,
        "web-v6",
        "web",
        "IPv6",
        json!([{"name": "http", "port": 8081, "protocol": "TCP"}]),
        endpoints(&[("fd00:10:244::5", true, true, false, "a")]),
    )
    .await;
    w.until("web with both slices", |s| {
        s.specs.get(&key("web")).is_some_and(|spec| spec.listeners.first().is_some_and(|l| members(l).len() == 3))
    })
    .await;
    let spec = w.spec("web").clone();
    assert_eq!((spec.uid.as_str(), spec.service_type.as_str()), (web_uid.as_str(), "ClusterIP"));
    assert_eq!(spec.vips, vips);
    assert_eq!(spec.listeners.len(), 2);
    let (http, dns) = (&spec.listeners[0], &spec.listeners[1]);
    assert_eq!((http.protocol(), http.port, http.name.as_str()), (Protocol::Tcp, 80, "http"));
    assert_eq!(members(http), ["10.244.0.5:8080 rs", "10.244.0.6:8080 st", "fd00:10:244::5:8081 rs"]);
    assert_eq!((dns.protocol(), dns.port), (Protocol::Udp, 53));
    assert_eq!(members(dns), ["10.244.0.5:5353 rs", "10.244.0.6:5353 st"]);
    let m = &http.pool.as_ref().unwrap().members[0];
    assert_eq!((m.node_name.as_str(), m.target_pod.as_str()), ("n1", "lb/a"));
    let affinity = spec.session_affinity.unwrap();
    assert_eq!((affinity.client_ip, affinity.timeout_seconds), (true, 600));

    // Recorded: finalizer on the Service, the record PROGRAMMED at the streamed generation.
    assert!(finalizers(&c, "web").await.iter().any(|f| f == FINALIZER));
    let record = wait_until("web's record PROGRAMMED", EVENT_TIMEOUT, || async {
        let r = c.api::<ServiceLoadBalancer>().get("web").await?;
        let st = r.status.clone().unwrap_or_default();
        anyhow::ensure!(
            st.provisioning_status.as_deref() == Some("PROGRAMMED")
                && st.observed_generation == r.metadata.generation
                && r.metadata.generation == i64::try_from(w.spec("web").generation).ok(),
            "{:?} at generation {:?}",
            st,
            r.metadata.generation
        );
        Ok(r)
    })
    .await
    .unwrap();
    assert_eq!(record.spec, ServiceLoadBalancerSpec::from_spec(&w.spec("web").into(), "node"));
    assert_eq!(record.metadata.owner_references.unwrap()[0].uid, web_uid);
    let got = client
        .get_load_balancer(GetLoadBalancerRequest { namespace: NS.into(), name: "web".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (got.backend.as_str(), got.provisioning_status.as_str(), got.observed_generation),
        ("node", "PROGRAMMED", w.spec("web").generation)
    );
    assert_eq!(got.spec.as_ref(), Some(w.spec("web")));

    // An endpoint change: a delta with a higher generation.
    let before = w.spec("web").generation;
    let changed = std::time::Instant::now();
    put_web_v4(("10.244.0.8", true, true, false, "c")).await;
    w.until("web with 10.244.0.8", |s| members(&s.spec("web").listeners[0]).iter().any(|m| m.contains("10.244.0.8")))
        .await;
    eprintln!("endpoint change written → LB_APPLIED received: {:?}", changed.elapsed());
    assert!(w.spec("web").generation > before, "{} after {before}", w.spec("web").generation);
    assert_eq!(w.types.last(), Some(&LbEventType::LbApplied));

    // A reconnect resumes: SNAPSHOT_COMPLETE (caught up as of the point), then only what changed
    // meanwhile, no snapshot.
    let resume = w.last.clone();
    let at = w.spec("web").generation;
    drop(w);
    put_slice(
        &c,
        "web-v4",
        "web",
        "IPv4",
        v4_ports,
        endpoints(&[("10.244.0.6", false, true, true, "b"), ("10.244.0.8", true, true, false, "c")]),
    )
    .await;
    wait_until("the scale-down recorded", EVENT_TIMEOUT, || async {
        let g = c.api::<ServiceLoadBalancer>().get("web").await?.metadata.generation.unwrap_or(0);
        anyhow::ensure!(g > i64::try_from(at)?, "generation {g}");
        Ok(())
    })
    .await
    .unwrap();
    let mut w = watch(&lbaas, &c, &resume).await;
    let ev = w.next().await.unwrap();
    assert_eq!((ev.r#type(), ev.resume_point.as_str()), (LbEventType::SnapshotComplete, resume.as_str()), "{ev:?}");
    let ev = w.next().await.unwrap();
    assert_eq!(ev.r#type(), LbEventType::LbApplied, "{ev:?}");
    let spec = ev.spec.unwrap();
    assert!(spec.generation > at);
    assert_eq!(members(&spec.listeners[0]), ["10.244.0.6:8080 st", "10.244.0.8:8080 rs", "fd00:10:244::5:8081 rs"]);
    assert_eq!(w.resets, 0);

    // NodePort: a load balancer with the node port the API server allocated, the external IPs
    // and the traffic policies; ExternalName: an Event and nothing else; headless: nothing at
    // all. A Service created after them marks when lbaas has seen them.
    create_service(&c,
        "np",
        json!({"type": "NodePort", "externalTrafficPolicy": "Local", "externalIPs": ["192.0.2.40"],
               "ports": [{"port": 80, "protocol": "TCP", "name": "tcp"}, {"port": 80, "protocol": "UDP", "name": "udp"}]}),
    )
    .await;
    create_service(&c, "en", json!({"type": "ExternalName", "externalName": "example.com"})).await;
    create_service(&c, "hl", json!({"clusterIP": "None", "ports": [{"port": 80}]})).await;
    create_service(&c, "keep", json!({"ports": [{"port": 443, "targetPort": 8443}]})).await;
    put_slice(&c, "keep-1", "keep", "IPv4", json!([]), endpoints(&[("10.244.1.9", true, true, false, "k")])).await;
    w.until("keep with its member", |s| {
        s.specs.get(&key("keep")).is_some_and(|spec| members(&spec.listeners[0]) == ["10.244.1.9:8443 rs"])
    })
    .await;
    w.until("np with its node ports", |s| {
        s.specs
            .get(&key("np"))
            .is_some_and(|spec| spec.listeners.iter().all(|l| (30000..=32767).contains(&l.node_port)))
    })
    .await;
    let np = w.spec("np").clone();
    let api_np = c.api::<Service>().get("np").await.unwrap();
    let api_ports: Vec<u32> =
        api_np.spec.unwrap().ports.unwrap().iter().map(|p| u32::try_from(p.node_port.unwrap()).unwrap()).collect();
    assert_eq!(np.listeners.iter().map(|l| l.node_port).collect::<Vec<_>>(), api_ports, "{np:?}");
    assert_eq!(np.listeners.iter().map(Listener::protocol).collect::<Vec<_>>(), [Protocol::Tcp, Protocol::Udp]);
    assert_eq!((np.service_type.as_str(), np.external_ips.as_slice()), ("NodePort", &["192.0.2.40".to_string()][..]));
    assert_eq!(np.external_traffic_policy(), TrafficPolicy::Local);
    assert_eq!(np.internal_traffic_policy(), TrafficPolicy::Cluster, "the API server's default");
    let record = c.api::<ServiceLoadBalancer>().get("np").await.unwrap();
    assert_eq!(record.spec.listeners[0].node_port, api_ports[0]);
    assert_eq!(record.spec.external_traffic_policy, "Local");
    let skipped = wait_until("en's Event", EVENT_TIMEOUT, || async {
        let e = events_about(&c, "en").await;
        anyhow::ensure!(!e.is_empty(), "none yet");
        Ok(e)
    })
    .await
    .unwrap();
    assert_eq!(
        (skipped[0].reason.as_deref(), skipped[0].type_.as_deref(), skipped[0].reporting_controller.as_deref()),
        (Some("LoadBalancerSkipped"), Some("Normal"), Some("kuryr-lbaas"))
    );
    assert!(skipped[0].note.as_deref().unwrap_or_default().contains("ExternalName"), "{skipped:?}");
    assert!(events_about(&c, "hl").await.is_empty());
    assert!(events_about(&c, "np").await.is_empty(), "NodePort is not skipped");
    for name in ["en", "hl"] {
        assert!(!w.ever.contains(&key(name)), "{name} was streamed");
        assert!(c.api::<ServiceLoadBalancer>().get_opt(name).await.unwrap().is_none(), "{name} has a record");
        assert!(finalizers(&c, name).await.is_empty(), "{name} got a finalizer");
    }

    // Deleting a Service: LB_DELETED, record gone, finalizer removed, Service gone.
    c.api::<Service>().delete("web", &DeleteParams::default()).await.unwrap();
    w.until("web deleted", |s| s.deleted.contains(&key("web"))).await;
    wait_until("web and its record gone", EVENT_TIMEOUT, || async {
        anyhow::ensure!(c.api::<Service>().get_opt("web").await?.is_none(), "Service still there");
        anyhow::ensure!(c.api::<ServiceLoadBalancer>().get_opt("web").await?.is_none(), "record still there");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.proc.logs()));

    // The Service's deletion reaches lbaas through the watcher after the test saw it gone, and
    // queues web once more: wait for the queue to drain rather than reading it once.
    let want = [
        r#"kuryr_lbaas_load_balancers{state="PROGRAMMED"}"#,
        r#"kuryr_lbaas_reconcile_seconds_count{result="applied"}"#,
        r#"kuryr_lbaas_reconcile_seconds_count{result="skipped"}"#,
        r#"kuryr_lbaas_watch_subscriptions_total{start="resume"} 1"#,
        "kuryr_lbaas_watch_subscribers 1",
        "kuryr_lbaas_queue_depth 0",
    ];
    wait_until("lbaas' metrics", EVENT_TIMEOUT, || async {
        let m = lbaas.metrics_text().await?;
        match want.iter().find(|w| !m.contains(**w)) {
            Some(w) => anyhow::bail!("metrics lack `{w}`:\n{m}"),
            None => Ok(()),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.proc.logs()));

    // kill -9. Meanwhile: "mark" (with a load balancer) is deleted — its finalizer holds it —,
    // "late" is created, and a record appears whose Service does not exist.
    create_service(&c, "mark", json!({"ports": [{"port": 80}]})).await;
    w.until("mark", |s| s.specs.contains_key(&key("mark"))).await;
    wait_until("mark's finalizer", EVENT_TIMEOUT, || async {
        anyhow::ensure!(finalizers(&c, "mark").await.iter().any(|f| f == FINALIZER), "not yet");
        Ok(())
    })
    .await
    .unwrap();
    let keep_generation = w.spec("keep").generation;
    let last = w.last.clone();
    lbaas.proc.kill().await.unwrap();
    assert!(matches!(w.end().await, End::Failed(_)), "the stream outlived lbaas");
    c.api::<Service>().delete("mark", &DeleteParams::default()).await.unwrap();
    assert!(c.api::<Service>().get("mark").await.unwrap().metadata.deletion_timestamp.is_some());
    create_service(&c, "late", json!({"ports": [{"port": 8080}]})).await;
    let mut ghost = ServiceLoadBalancer::new(
        "ghost",
        ServiceLoadBalancerSpec {
            service_uid: "gone".into(),
            service_type: "ClusterIP".into(),
            vips: vec!["10.96.99.99".into()],
            listeners: vec![],
            session_affinity: Default::default(),
            backend: "node".into(),
            external_ips: vec![],
            ingress_ips: vec![],
            external_traffic_policy: String::new(),
            internal_traffic_policy: String::new(),
        },
    );
    ghost.metadata.namespace = Some(NS.into());
    c.api::<ServiceLoadBalancer>().create(&PostParams::default(), &ghost).await.unwrap();

    let lbaas = start_lbaas(&c, &watcher, &["--service-finalizer", "all"]);
    // The binder reconnects with its resume point: a new epoch, so RESET and a snapshot; the
    // records are reconciled: mark and ghost go, late comes, keep and np stay as they were.
    let mut w = watch(&lbaas, &c, &last).await;
    w.until("the state after the restart", |s| {
        s.live
            && s.specs.contains_key(&key("late"))
            && s.specs.contains_key(&key("keep"))
            && !s.specs.contains_key(&key("mark"))
            && !s.specs.contains_key(&key("ghost"))
    })
    .await;
    assert_eq!(w.resets, 1, "a restarted lbaas must RESET a binder resuming from its old epoch");
    assert_eq!(w.spec("keep").generation, keep_generation, "keep's spec changed over the restart");
    wait_serving(&lbaas).await;
    wait_until("mark gone, ghost's record gone, one record each", EVENT_TIMEOUT, || async {
        anyhow::ensure!(c.api::<Service>().get_opt("mark").await?.is_none(), "mark still there");
        let names: BTreeSet<String> = c
            .api::<ServiceLoadBalancer>()
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter_map(|r| r.metadata.name)
            .collect();
        let want = BTreeSet::from(["keep".to_string(), "late".to_string(), "np".to_string()]);
        anyhow::ensure!(names == want, "records {names:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.proc.logs()));
    let listed = binder_client(&lbaas, &c)
        .list_load_balancers(ListLoadBalancersRequest { namespace: NS.into() })
        .await
        .unwrap()
        .into_inner()
        .load_balancers;
    let names: Vec<&str> = listed.iter().map(|l| l.spec.as_ref().unwrap().name.as_str()).collect();
    assert_eq!(names, ["keep", "late", "np"]);

    // SIGTERM ends open streams with UNAVAILABLE, promptly.
    let mut lbaas = lbaas;
    let took = lbaas.proc.terminate(Duration::from_secs(10)).await.unwrap();
    assert!(took < Duration::from_secs(5), "took {took:?} to stop");
    match w.end().await {
        End::Failed(s) => assert_eq!(s.code(), tonic::Code::Unavailable, "{s}"),
        other => panic!("expected UNAVAILABLE at shutdown, got {other:?}"),
    }
}

/// The default finalizer policy (`load-balancer`): only `type: LoadBalancer` Services carry the
/// finalizer. Deleting any other Service is immediate, as Kubernetes clients expect (the upstream
/// conformance test "should delete a collection of services" lists them right after a
/// DeleteCollection); their load balancer still goes, through the ServiceLoadBalancer record —
/// also when the Service was deleted while kuryr-lbaas was down.
#[tokio::test]
async fn only_load_balancer_services_wait_for_their_load_balancer_and_the_rest_are_cleaned_up_by_their_record() {
    let c = cluster().await;
    let watcher = watcher(&c);
    let mut lbaas = start_lbaas(&c, &watcher, &[]);
    wait_serving(&lbaas).await;
    let ports = json!([{"name": "http", "port": 8080, "protocol": "TCP"}]);
    let mut specs = json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080}]});
    for name in ["plain", "ghost"] {
        create_service(&c, name, specs.clone()).await;
        put_slice(
            &c,
            &format!("{name}-a"),
            name,
            "IPv4",
            ports.clone(),
            endpoints(&[("10.244.1.5", true, true, false, "p1")]),
        )
        .await;
    }
    specs["type"] = json!("LoadBalancer");
    create_service(&c, "lb", specs).await;
    put_slice(&c, "lb-a", "lb", "IPv4", ports.clone(), endpoints(&[("10.244.1.6", true, true, false, "p2")])).await;
    let mut stream = watch(&lbaas, &c, "").await;
    stream
        .until("plain, ghost and lb applied", |s| {
            ["plain", "ghost", "lb"].iter().all(|n| s.specs.contains_key(&format!("{NS}/{n}")))
        })
        .await;
    for name in ["plain", "ghost", "lb"] {
        wait_until(&format!("{name}'s record"), EVENT_TIMEOUT, || async {
            anyhow::ensure!(c.api::<ServiceLoadBalancer>().get_opt(name).await?.is_some(), "no record yet");
            Ok(())
        })
        .await
        .unwrap();
    }
    wait_until("lb's finalizer", EVENT_TIMEOUT, || async {
        anyhow::ensure!(finalizers(&c, "lb").await.iter().any(|f| f == FINALIZER), "not yet");
        Ok(())
    })
    .await
    .unwrap();
    // lb's finalizer is there, so plain's and ghost's would be by now under the old rule.
    assert!(finalizers(&c, "plain").await.is_empty(), "a ClusterIP Service got {:?}", finalizers(&c, "plain").await);
    assert!(finalizers(&c, "ghost").await.is_empty());

    // DeleteCollection-style: the Service is gone the moment the delete returns.
    c.api::<Service>().delete("plain", &DeleteParams::default()).await.unwrap();
    assert!(c.api::<Service>().get_opt("plain").await.unwrap().is_none(), "plain lingers after its delete returned");
    stream.until("plain's LB_DELETED", |s| s.deleted.contains(&format!("{NS}/plain"))).await;
    wait_until("plain's record to go", EVENT_TIMEOUT, || async {
        anyhow::ensure!(c.api::<ServiceLoadBalancer>().get_opt("plain").await?.is_none(), "still there");
        Ok(())
    })
    .await
    .unwrap();

    // Deleted while kuryr-lbaas is down: the record outlives the Service and goes after the restart.
    lbaas.proc.kill().await.unwrap();
    c.api::<Service>().delete("ghost", &DeleteParams::default()).await.unwrap();
    assert!(c.api::<Service>().get_opt("ghost").await.unwrap().is_none());
    assert!(
        c.api::<ServiceLoadBalancer>().get_opt("ghost").await.unwrap().is_some(),
        "the record went without kuryr-lbaas"
    );
    let lbaas = start_lbaas(&c, &watcher, &[]);
    wait_serving(&lbaas).await;
    wait_until("ghost's record to go after the restart", EVENT_TIMEOUT, || async {
        anyhow::ensure!(c.api::<ServiceLoadBalancer>().get_opt("ghost").await?.is_none(), "still there");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.proc.logs()));
    let mut stream = watch(&lbaas, &c, "").await;
    stream.until("the snapshot after the restart", |s| s.live).await;
    assert!(!stream.specs.contains_key(&format!("{NS}/ghost")), "ghost is still streamed");
    assert!(stream.specs.contains_key(&format!("{NS}/lb")));

    // The LoadBalancer Service waits for its load balancer, then goes.
    c.api::<Service>().delete("lb", &DeleteParams::default()).await.unwrap();
    stream.until("lb's LB_DELETED", |s| s.deleted.contains(&format!("{NS}/lb"))).await;
    wait_until("lb to be gone", EVENT_TIMEOUT, || async {
        anyhow::ensure!(c.api::<Service>().get_opt("lb").await?.is_none(), "still there");
        anyhow::ensure!(c.api::<ServiceLoadBalancer>().get_opt("lb").await?.is_none(), "its record is still there");
        Ok(())
    })
    .await
    .unwrap();
}

/// The one number of `metric` (no labels) in a Prometheus exposition.
fn metric_value(exposition: &str, metric: &str) -> f64 {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(metric).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {metric} in:\n{exposition}"))
}

/// Heartbeats tell a quiet stream from a dead one. A quiet but healthy watcher keeps lbaas
/// SERVING well past lbaas' `--stream-idle-timeout`, because its heartbeats keep coming; a
/// stopped watcher (SIGSTOP: its connections stay open, nothing is sent) is noticed by its
/// silence alone — lbaas drops the stream and is NOT_SERVING until the watcher runs again, then
/// resumes. lbaas' own quiet WatchLoadBalancers carries heartbeats with no resume point, and
/// keeps doing so while its watcher is away.
#[tokio::test]
async fn heartbeats_tell_a_quiet_watcher_from_a_stopped_one() {
    const HEARTBEAT: &str = "300ms";
    const IDLE: Duration = Duration::from_millis(1500);
    let c = cluster().await;
    let watcher = c.watcher(None, &["--shutdown-grace", "3s", "--stream-heartbeat", HEARTBEAT]).unwrap();
    let idle = format!("{}ms", IDLE.as_millis());
    let lbaas = start_lbaas(
        &c,
        &watcher,
        &["--service-finalizer", "all", "--stream-heartbeat", HEARTBEAT, "--stream-idle-timeout", &idle],
    );
    wait_serving(&lbaas).await;
    let mut w = watch(&lbaas, &c, "").await;
    w.until("the snapshot", |s| s.live).await;
    let reconnects = |m: &str| metric_value(m, "kuryr_lbaas_watcher_reconnects_total");
    let before = reconnects(&metrics(&lbaas).await);

    // Nothing changes for three idle timeouts: heartbeats only, on both streams. (What the API
    // server itself still settles — the `kubernetes` Service's slice — restarts the count.)
    let mut quiet_since = tokio::time::Instant::now();
    let mut beats = 0;
    while quiet_since.elapsed() < 3 * IDLE {
        let ev = tokio::time::timeout(EVENT_TIMEOUT, w.stream.message()).await.unwrap().unwrap().unwrap();
        if ev.r#type() != LbEventType::Heartbeat {
            assert_eq!(ev.r#type(), LbEventType::LbApplied, "{ev:?}");
            assert!(quiet_since.elapsed() < EVENT_TIMEOUT, "never quiet");
            (quiet_since, beats) = (tokio::time::Instant::now(), 0);
            continue;
        }
        assert_eq!((ev.resume_point.as_str(), ev.spec.is_none()), ("", true), "{ev:?}");
        beats += 1;
    }
    // One every 300 ms; the default interval (5 s) would have sent none.
    assert!(beats >= 5, "{beats} heartbeats in {:?}", quiet_since.elapsed());
    kuryr_runtime::client::check_serving(kuryr_runtime::client::channel(&lbaas.addr).unwrap(), LOAD_BALANCERS)
        .await
        .unwrap_or_else(|e| panic!("a quiet watcher was taken for dead: {e:#}\n{}", lbaas.proc.logs()));
    assert_eq!(reconnects(&metrics(&lbaas).await), before, "a quiet watcher was taken for dead");

    // Stopped: the connection stays open, and only the silence tells.
    let pid = watcher.proc.pid().unwrap().to_string();
    let signal = |sig: &'static str| {
        let pid = pid.clone();
        async move {
            let ok = tokio::process::Command::new("kill").args([sig, &pid]).status().await.unwrap().success();
            assert!(ok, "kill {sig} {pid}");
        }
    };
    signal("-STOP").await;
    let stopped = tokio::time::Instant::now();
    wait_until("kuryr-lbaas NOT_SERVING", PHASE_TIMEOUT, || async {
        let serving =
            kuryr_runtime::client::check_serving(kuryr_runtime::client::channel(&lbaas.addr)?, LOAD_BALANCERS).await;
        anyhow::ensure!(serving.is_err(), "still SERVING");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.proc.logs()));
    let noticed = stopped.elapsed();
    // The idle timer runs from the last heartbeat, up to one interval before the stop.
    assert!(noticed >= IDLE / 2, "NOT_SERVING after {noticed:?}, long before the idle timeout: something else broke");
    assert!(noticed < 5 * IDLE, "NOT_SERVING only after {noticed:?}: --stream-idle-timeout was not applied");
    assert!(reconnects(&metrics(&lbaas).await) > before);
    // lbaas still serves what it has, and says it is alive.
    let ev = tokio::time::timeout(EVENT_TIMEOUT, w.stream.message()).await.unwrap().unwrap().unwrap();
    assert_eq!(ev.r#type(), LbEventType::Heartbeat);

    // Running again: the follower reconnects and lbaas is SERVING again.
    signal("-CONT").await;
    wait_serving(&lbaas).await;
    assert!(lbaas.proc.logs().contains("not even a heartbeat"), "{}", lbaas.proc.logs());
    create_service(&c, "after", json!({"ports": [{"port": 80}]})).await;
    w.until("after", |s| s.specs.contains_key(&key("after"))).await;
}
