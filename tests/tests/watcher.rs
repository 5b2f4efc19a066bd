//! kuryr-watcher as users run it: its own process, authenticated as the `kuryr-watcher`
//! ServiceAccount with exactly the rights of `deploy/rbac/watcher.yaml`, against a real
//! kube-apiserver. Snapshot, deltas (and the churn that must not cause any), filters, resume,
//! RESET after a restart, readiness while the API is unreachable, and shutdown of open streams.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kuryr_proto::service_names::WATCHER;
use kuryr_proto::watcher::v1::object::Body;
use kuryr_proto::watcher::v1::watcher_client::WatcherClient;
use kuryr_proto::watcher::v1::{EventType, Filter, Kind, Object, SubscribeRequest, SubscribeResponse};
use kuryr_runtime::auth::client::{Credentials, PeerChannel, with_credentials};
use kuryr_tests::kube::KubeEnv;
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use kuryr_tests::sut::Sut;
use kuryr_tests::util::{free_port, repo_root, unique_id};
use serde_json::json;
use tonic::Streaming;

/// Bound on one expected event; a healthy watcher delivers in milliseconds.
const EVENT_TIMEOUT: Duration = Duration::from_secs(15);
/// How long "nothing else arrives" is watched for.
const QUIET: Duration = Duration::from_millis(1500);
const ALL_KINDS: [Kind; 6] =
    [Kind::Pod, Kind::Service, Kind::EndpointSlice, Kind::Namespace, Kind::NetworkPolicy, Kind::Node];

/// A watcher process ([`Sut`]) and what the test's Subscribe calls send: a subscriber
/// account's token (or nothing).
struct Watcher {
    sut: Sut,
    token: Option<String>,
}

impl std::ops::Deref for Watcher {
    type Target = Sut;

    fn deref(&self) -> &Sut {
        &self.sut
    }
}

impl std::ops::DerefMut for Watcher {
    fn deref_mut(&mut self) -> &mut Sut {
        &mut self.sut
    }
}

fn start_watcher(kubeconfig: &Path, dir: &Path) -> Watcher {
    start_watcher_with(kubeconfig, dir, &[])
}

fn start_watcher_with(kubeconfig: &Path, dir: &Path, extra: &[&str]) -> Watcher {
    let args = ["--kubeconfig", &kubeconfig.display().to_string(), "--shutdown-grace", "3s"]
        .into_iter()
        .chain(["--log", "info,kuryr_watcher=debug"])
        .chain(extra.iter().copied())
        .map(ToString::to_string)
        .collect::<Vec<_>>();
    Watcher { sut: Sut::spawn("kuryr-watcher", &args, dir, "kuryr-watcher").unwrap(), token: None }
}

impl Watcher {
    fn client(&self) -> WatcherClient<PeerChannel> {
        let creds = match &self.token {
            Some(t) => Credentials::bearer(t).unwrap(),
            None => Credentials::None,
        };
        WatcherClient::new(with_credentials(kuryr_runtime::client::channel(&self.addr).unwrap(), creds))
    }

    async fn health(&self) -> anyhow::Result<()> {
        kuryr_runtime::client::check_serving(kuryr_runtime::client::channel(&self.addr)?, WATCHER).await
    }

    async fn wait_serving(&self) {
        self.sut.wait_serving(WATCHER, Duration::from_secs(30)).await.unwrap_or_else(|e| panic!("{e:#}"));
    }

    async fn metrics(&self) -> String {
        self.sut.metrics_text().await.unwrap()
    }

    async fn subscribe(
        &self,
        kinds: &[Kind],
        filter: Filter,
        resume_from: &str,
        name: &str,
    ) -> Result<Sub, tonic::Status> {
        let req = SubscribeRequest {
            kinds: kinds.iter().map(|k| *k as i32).collect(),
            filter: Some(filter),
            resume_from: resume_from.to_string(),
            subscriber: name.to_string(),
        };
        Ok(Sub { stream: self.client().subscribe(req).await?.into_inner() })
    }
}

/// One Subscribe stream, read with deadlines.
struct Sub {
    stream: Streaming<SubscribeResponse>,
}

impl Sub {
    /// The next event but heartbeats.
    async fn next(&mut self) -> SubscribeResponse {
        loop {
            match tokio::time::timeout(EVENT_TIMEOUT, self.stream.message()).await {
                Ok(Ok(Some(r))) if r.r#type() == EventType::Heartbeat => continue,
                Ok(Ok(Some(r))) => return r,
                Ok(Ok(None)) => panic!("the stream ended"),
                Ok(Err(s)) => panic!("the stream failed: {s}"),
                Err(_) => panic!("no event within {EVENT_TIMEOUT:?}"),
            }
        }
    }

    /// Reads a snapshot up to SNAPSHOT_COMPLETE; returns its objects and the completion's point.
    async fn snapshot(&mut self) -> (Vec<Object>, String) {
        let mut objects = Vec::new();
        loop {
            let ev = self.next().await;
            match ev.r#type() {
                EventType::Applied => objects.push(ev.object.unwrap()),
                EventType::SnapshotComplete => return (objects, ev.resume_point),
                other => panic!("unexpected {other:?} inside a snapshot: {ev:?}"),
            }
        }
    }

    /// The next event about `kind` `name`, skipping events about other objects.
    async fn next_for(&mut self, kind: Kind, name: &str) -> SubscribeResponse {
        loop {
            let ev = self.next().await;
            if let Some(o) = &ev.object
                && o.kind == kind as i32
                && o.name == name
            {
                return ev;
            }
        }
    }

    /// Asserts that nothing but heartbeats arrives for a while.
    async fn assert_quiet(&mut self) {
        let until = tokio::time::Instant::now() + QUIET;
        while let Ok(ev) = tokio::time::timeout_at(until, self.stream.message()).await {
            // Heartbeats say only that the watcher is there.
            if !matches!(&ev, Ok(Some(r)) if r.r#type() == EventType::Heartbeat) {
                panic!("expected no event, got {ev:?}");
            }
        }
    }
}

fn meta(ns: Option<&str>, name: &str) -> ObjectMeta {
    ObjectMeta { namespace: ns.map(Into::into), name: Some(name.into()), ..Default::default() }
}

fn pod(name: &str, node: &str, host_network: bool) -> Pod {
    objects::pod(name).node(node).host_network(host_network).build()
}

fn node(name: &str) -> Node {
    let mut n = Node { metadata: meta(None, name), ..Default::default() };
    n.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
        pod_cidrs: Some(vec!["10.244.9.0/24".into()]),
        ..Default::default()
    });
    n
}

/// A node status with a Ready condition last heard from at `heartbeat`.
fn node_status(ip: &str, ready: &str, heartbeat: &str) -> serde_json::Value {
    json!({"status": {
        "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": "h"}],
        "conditions": [{"type": "Ready", "status": ready, "reason": "KubeletReady", "message": "ok",
                        "lastHeartbeatTime": heartbeat, "lastTransitionTime": "2025-01-01T00:00:00Z"}],
    }})
}

fn body(ev: &SubscribeResponse) -> &Body {
    ev.object.as_ref().and_then(|o| o.body.as_ref()).unwrap_or_else(|| panic!("no body: {ev:?}"))
}

fn names(objects: &[Object]) -> BTreeSet<(i32, String)> {
    objects.iter().map(|o| (o.kind, o.name.clone())).collect()
}

#[tokio::test]
async fn watcher_streams_snapshot_deltas_filters_and_resumes() {
    let env = KubeEnv::start().await.unwrap();
    let admin = env.client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ns = format!("wt-{}", unique_id());
    let pp = PostParams::default();
    let grace0 = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };

    // The watcher's namespace, account and rights, from the deploy manifest.
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    for n in ["kuryr-system", ns.as_str()] {
        namespaces.create(&pp, &Namespace { metadata: meta(None, n), ..Default::default() }).await.unwrap();
    }
    env.apply_file(&repo_root().join("deploy/rbac/watcher.yaml")).await.unwrap();
    let kubeconfig = env.service_account_kubeconfig("kuryr-system", "kuryr-watcher").await.unwrap();

    // Objects that exist before the watcher starts.
    let nodes: Api<Node> = Api::all(admin.clone());
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let services: Api<Service> = Api::namespaced(admin.clone(), &ns);
    let slices: Api<EndpointSlice> = Api::namespaced(admin.clone(), &ns);
    for n in ["node-a", "node-b"] {
        nodes.create(&pp, &node(n)).await.unwrap();
        nodes
            .patch_status(
                n,
                &PatchParams::default(),
                &Patch::Merge(node_status("192.168.0.1", "True", "2025-01-01T00:00:00Z")),
            )
            .await
            .unwrap();
    }
    pods.create(&pp, &pod("pre", "node-a", false)).await.unwrap();
    let svc = |name: &str| Service {
        metadata: meta(None, name),
        spec: Some(ServiceSpec {
            selector: Some([("app".to_string(), name.to_string())].into()),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                target_port: Some(IntOrString::Int(8080)),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    services.create(&pp, &svc("pre-svc")).await.unwrap();

    let mut w = start_watcher(&kubeconfig, dir.path());
    w.wait_serving().await;

    // Subscribe is for kuryr's own services, by their ServiceAccount tokens (audience kuryr),
    // checked with TokenReview: no token, a token of another audience (the watcher's own, for
    // the Kubernetes API) and one of an account that is not a subscriber are refused.
    let e =
        w.subscribe(&[Kind::Pod], Filter::default(), "", "test/auth").await.err().expect("Subscribe without a token");
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    let api_token = std::fs::read_to_string(&kubeconfig).unwrap();
    let api_token = api_token.lines().find_map(|l| l.trim().strip_prefix("token: ")).unwrap().to_string();
    w.token = Some(api_token);
    let e = w
        .subscribe(&[Kind::Pod], Filter::default(), "", "test/auth")
        .await
        .err()
        .expect("Subscribe with a token for the API server");
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    w.token = Some(env.kuryr_token("kuryr-system", "kuryr-binder", None).await.unwrap());
    let e = w.subscribe(&[Kind::Pod], Filter::default(), "", "test/auth").await.err().expect("Subscribe as the binder");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    assert!(e.message().contains("kuryr-binder"), "{e}");
    // kuryr-policy is a subscriber, as the allocator and lbaas are.
    w.token = Some(env.kuryr_token("kuryr-system", "kuryr-policy", None).await.unwrap());
    let mut as_policy = w.subscribe(&[Kind::Namespace], Filter::default(), "", "test/policy").await.unwrap();
    as_policy.next().await;
    drop(as_policy);
    w.token = Some(env.kuryr_token("kuryr-system", "kuryr-vif-allocator", None).await.unwrap());

    // The account it runs as reads those kinds and can do nothing else.
    let sa = kuryr_tests::kube::client_from_kubeconfig(&kubeconfig).await.unwrap();
    let forbidden = |r: Result<(), kube::Error>| matches!(r, Err(kube::Error::Api(s)) if s.code == 403);
    let sa_pods: Api<Pod> = Api::namespaced(sa.clone(), &ns);
    assert!(forbidden(sa_pods.create(&pp, &pod("nope", "node-a", false)).await.map(drop)));
    assert!(forbidden(sa_pods.delete("pre", &grace0).await.map(drop)));
    let sa_secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::all(sa);
    assert!(forbidden(sa_secrets.list(&Default::default()).await.map(drop)));

    // (a) Snapshot: what existed, then SNAPSHOT_COMPLETE; the namespace filter keeps other
    // namespaces' objects (the `kubernetes` Service in default) out, not cluster-scoped ones.
    let filter = Filter { namespace: ns.clone(), ..Default::default() };
    let mut all = w.subscribe(&ALL_KINDS, filter.clone(), "", "test/all").await.unwrap();
    let (snap, point) = all.snapshot().await;
    let got = names(&snap);
    for want in [
        (Kind::Pod, "pre"),
        (Kind::Service, "pre-svc"),
        (Kind::Node, "node-a"),
        (Kind::Node, "node-b"),
        (Kind::Namespace, ns.as_str()),
        (Kind::Namespace, "kuryr-system"),
        (Kind::Namespace, "default"),
    ] {
        assert!(got.contains(&(want.0 as i32, want.1.to_string())), "{want:?} missing from the snapshot {got:?}");
    }
    assert!(!got.contains(&(Kind::Service as i32, "kubernetes".to_string())), "namespace filter ignored: {got:?}");
    let epoch = point.rsplit_once('-').unwrap().0.to_string();
    assert!(point.rsplit_once('-').unwrap().1.parse::<u64>().is_ok(), "{point}");
    let pre = snap.iter().find(|o| o.name == "pre").unwrap();
    let Some(Body::Pod(p)) = &pre.body else { panic!("{pre:?}") };
    assert_eq!((p.node_name.as_str(), p.host_network, p.phase.as_str()), ("node-a", false, "Pending"));
    let a = snap.iter().find(|o| o.name == "node-a").unwrap();
    let Some(Body::Node(n)) = &a.body else { panic!("{a:?}") };
    assert_eq!(
        (n.internal_ips.as_slice(), n.pod_cidrs.as_slice(), n.ready),
        (&["192.168.0.1".to_string()][..], &["10.244.9.0/24".to_string()][..], true)
    );

    // (b) Pod deltas in order; an annotation no consumer reads changes nothing on the stream.
    pods.create(&pp, &pod("p1", "node-a", false)).await.unwrap();
    let ev = all.next_for(Kind::Pod, "p1").await;
    assert_eq!(ev.r#type(), EventType::Applied, "{ev:?}");
    let Body::Pod(p) = body(&ev) else { panic!("{ev:?}") };
    assert!(p.annotations.is_empty() && p.node_name == "node-a", "{ev:?}");
    let pp_merge = PatchParams::default();
    pods.patch("p1", &pp_merge, &Patch::Merge(json!({"metadata": {"annotations": {"example.com/note": "x"}}})))
        .await
        .unwrap();
    pods.patch("p1", &pp_merge, &Patch::Merge(json!({"metadata": {"annotations": {"openstack.org/kuryr-vif": "v1"}}})))
        .await
        .unwrap();
    let ev = all.next_for(Kind::Pod, "p1").await;
    assert_eq!(ev.r#type(), EventType::Applied, "{ev:?}");
    let Body::Pod(p) = body(&ev) else { panic!("{ev:?}") };
    assert_eq!(
        p.annotations.get("openstack.org/kuryr-vif").map(String::as_str),
        Some("v1"),
        "the note-only update leaked: {ev:?}"
    );
    // Deleting a pod bound to a node first marks it (deletionTimestamp; with grace 0 the API
    // removes it at once after): consumers see `deleting`, then DELETED.
    pods.delete("p1", &grace0).await.unwrap();
    let ev = all.next_for(Kind::Pod, "p1").await;
    assert!(ev.r#type() == EventType::Applied && ev.object.as_ref().unwrap().deleting, "{ev:?}");
    let ev = all.next_for(Kind::Pod, "p1").await;
    assert_eq!(ev.r#type(), EventType::Deleted, "{ev:?}");

    // A Service and its EndpointSlice (conditions unset: ready, per the API docs).
    services.create(&pp, &svc("svc1")).await.unwrap();
    let ev = all.next_for(Kind::Service, "svc1").await;
    let Body::Service(s) = body(&ev) else { panic!("{ev:?}") };
    assert!(!s.cluster_ips.is_empty() && s.r#type == "ClusterIP", "{ev:?}");
    assert_eq!((s.ports[0].port, s.ports[0].target_port.as_str(), s.ports[0].protocol.as_str()), (80, "8080", "TCP"));
    let slice = EndpointSlice {
        metadata: ObjectMeta {
            name: Some("svc1-x1".into()),
            labels: Some([("kubernetes.io/service-name".to_string(), "svc1".to_string())].into()),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: vec![Endpoint {
            addresses: vec!["10.244.9.5".into()],
            node_name: Some("node-a".into()),
            target_ref: Some(ObjectReference {
                kind: Some("Pod".into()),
                namespace: Some(ns.clone()),
                name: Some("pre".into()),
                ..Default::default()
            }),
            ..Default::default()
        }],
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(8080),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
    };
    slices.create(&pp, &slice).await.unwrap();
    let ev = all.next_for(Kind::EndpointSlice, "svc1-x1").await;
    let Body::EndpointSlice(s) = body(&ev) else { panic!("{ev:?}") };
    assert_eq!(s.service_name, "svc1");
    assert!(s.endpoints[0].ready && s.endpoints[0].serving && !s.endpoints[0].terminating, "{ev:?}");
    assert_eq!(s.endpoints[0].target_pod, format!("{ns}/pre"));

    // A Node: heartbeats (status churn that changes no reduced field) are not streamed.
    nodes.create(&pp, &node("node-c")).await.unwrap();
    let ev = all.next_for(Kind::Node, "node-c").await;
    let Body::Node(n) = body(&ev) else { panic!("{ev:?}") };
    assert!(!n.ready && n.internal_ips.is_empty(), "{ev:?}");
    nodes
        .patch_status("node-c", &pp_merge, &Patch::Merge(node_status("192.168.0.3", "True", "2025-01-01T00:00:01Z")))
        .await
        .unwrap();
    let ev = all.next_for(Kind::Node, "node-c").await;
    let Body::Node(n) = body(&ev) else { panic!("{ev:?}") };
    assert!(n.ready && n.internal_ips == ["192.168.0.3"], "{ev:?}");
    nodes
        .patch_status("node-c", &pp_merge, &Patch::Merge(node_status("192.168.0.3", "True", "2025-01-01T00:00:11Z")))
        .await
        .unwrap();
    nodes.patch("node-c", &pp_merge, &Patch::Merge(json!({"metadata": {"labels": {"zone": "z1"}}}))).await.unwrap();
    let ev = all.next_for(Kind::Node, "node-c").await;
    assert_eq!(
        ev.object.as_ref().unwrap().labels.get("zone").map(String::as_str),
        Some("z1"),
        "a heartbeat leaked: {ev:?}"
    );
    nodes.delete("node-c", &DeleteParams::default()).await.unwrap();
    assert_eq!(all.next_for(Kind::Node, "node-c").await.r#type(), EventType::Deleted);

    // (c) A node's view: its pods (not host-network ones) and its Node object, nothing else.
    let node_filter = Filter { node_name: "node-a".into(), exclude_host_network: true, ..Default::default() };
    let mut mine = w.subscribe(&[Kind::Pod, Kind::Node], node_filter, "", "binder/node-a").await.unwrap();
    let (snap, _) = mine.snapshot().await;
    let want: BTreeSet<_> = [(Kind::Node as i32, "node-a".to_string()), (Kind::Pod as i32, "pre".to_string())].into();
    assert_eq!(names(&snap), want);
    pods.create(&pp, &pod("elsewhere", "node-b", false)).await.unwrap();
    pods.create(&pp, &pod("hostnet", "node-a", true)).await.unwrap();
    nodes.patch("node-b", &pp_merge, &Patch::Merge(json!({"metadata": {"labels": {"zone": "z2"}}}))).await.unwrap();
    pods.create(&pp, &pod("mine", "node-a", false)).await.unwrap();
    // One pod watch delivers in order: had the first two been sent, they would come first.
    let ev = mine.next().await;
    assert_eq!((ev.r#type(), ev.object.as_ref().unwrap().name.as_str()), (EventType::Applied, "mine"), "{ev:?}");
    mine.assert_quiet().await;
    drop(mine);

    // (d) Resume: only what was missed while away, no snapshot (a SNAPSHOT_COMPLETE marker at the
    // resume point says that the subscriber is caught up).
    let mut s3 = w.subscribe(&[Kind::Pod], filter.clone(), "", "test/resume").await.unwrap();
    s3.snapshot().await;
    pods.create(&pp, &pod("r1", "node-b", false)).await.unwrap();
    let ev = s3.next_for(Kind::Pod, "r1").await;
    let last = ev.resume_point.clone();
    assert!(last.starts_with(&format!("{epoch}-")), "{last} is not of epoch {epoch}");
    drop(s3);
    pods.create(&pp, &pod("r2", "node-b", false)).await.unwrap();
    pods.patch("r1", &pp_merge, &Patch::Merge(json!({"metadata": {"finalizers": ["kuryr.openstack.org/vif"]}})))
        .await
        .unwrap();
    pods.delete("mine", &grace0).await.unwrap();
    let mut s3 = w.subscribe(&[Kind::Pod], filter.clone(), &last, "test/resume").await.unwrap();
    // Caught up as of the resume point: SNAPSHOT_COMPLETE there, then only what was missed.
    let ev = s3.next().await;
    assert_eq!(
        (ev.r#type(), ev.resume_point.as_str(), ev.object.is_none()),
        (EventType::SnapshotComplete, last.as_str(), true)
    );
    let mut seen = Vec::new();
    for _ in 0..4 {
        let ev = s3.next().await;
        let o = ev.object.clone().unwrap_or_default();
        seen.push((ev.r#type(), o.name, o.deleting));
    }
    let want = [
        (EventType::Applied, "r2", false),
        (EventType::Applied, "r1", false),
        (EventType::Applied, "mine", true),
        (EventType::Deleted, "mine", true),
    ];
    assert_eq!(seen, want.map(|(t, n, d)| (t, n.to_string(), d)));
    s3.assert_quiet().await;
    drop(s3);

    // A point this watcher never handed out (garbage, or a revision it has not reached): RESET.
    let expected: BTreeSet<_> =
        ["pre", "elsewhere", "hostnet", "r1", "r2"].iter().map(|n| (Kind::Pod as i32, n.to_string())).collect();
    for bogus in ["bogus", &format!("{epoch}-999999")] {
        let mut s = w.subscribe(&[Kind::Pod], filter.clone(), bogus, "test/bogus").await.unwrap();
        assert_eq!(s.next().await.r#type(), EventType::Reset, "{bogus}");
        let (snap, _) = s.snapshot().await;
        assert_eq!(names(&snap), expected, "{bogus}");
    }

    // Metrics: objects per kind and open streams. The watcher counts a stream closed when it
    // notices that its client went away, a moment after the drop: wait for the gauge.
    let want = [
        "kuryr_watcher_objects{kind=\"node\"} 2",
        "kuryr_watcher_subscribers 1",
        "kuryr_watcher_subscriptions_total{start=\"resume\"} 1",
    ];
    wait_until("the watcher's metrics", Duration::from_secs(10), || async {
        let m = w.metrics().await;
        match want.iter().find(|line| !m.contains(**line)) {
            Some(line) => anyhow::bail!("metrics lack `{line}`:\n{m}"),
            None => Ok(()),
        }
    })
    .await
    .unwrap();
    drop(all);

    // Replicas share nothing: a client switching to another one gets RESET + snapshot.
    let mut other = start_watcher(&kubeconfig, dir.path());
    other.token.clone_from(&w.token);
    other.wait_serving().await;
    let mut s = other.subscribe(&[Kind::Pod], filter.clone(), &last, "test/other-replica").await.unwrap();
    assert_eq!(s.next().await.r#type(), EventType::Reset);
    assert_eq!(names(&s.snapshot().await.0), expected);
    drop(s);
    other.proc.kill().await.unwrap();

    // (f) A restarted watcher is a new epoch: the old point gets RESET + snapshot.
    w.proc.kill().await.unwrap();
    let token = w.token.take();
    let mut w = start_watcher(&kubeconfig, dir.path());
    w.token = token;
    w.wait_serving().await;
    let mut s = w.subscribe(&[Kind::Pod], filter.clone(), &last, "test/after-restart").await.unwrap();
    assert_eq!(s.next().await.r#type(), EventType::Reset);
    let (snap, point) = s.snapshot().await;
    assert_eq!(names(&snap), expected);
    assert!(!point.starts_with(&format!("{epoch}-")), "a restart kept epoch {epoch}: {point}");

    // Open streams end promptly, with UNAVAILABLE, when the watcher is told to stop.
    let took = w.proc.terminate(Duration::from_secs(10)).await.unwrap();
    assert!(took < Duration::from_secs(5), "took {took:?} to stop");
    loop {
        match tokio::time::timeout(EVENT_TIMEOUT, s.stream.message()).await.unwrap() {
            Err(status) => break assert_eq!(status.code(), tonic::Code::Unavailable, "{status}"),
            Ok(Some(r)) if r.r#type() == EventType::Heartbeat => {}
            Ok(other) => panic!("expected UNAVAILABLE at shutdown, got {other:?}"),
        }
    }
}

/// (e) Started while the API is unreachable: inspectable, NOT_SERVING, Subscribe UNAVAILABLE, and
/// the failing watches are counted. Tokens cannot be checked without the API either (a token
/// refused as UNAVAILABLE, not as UNAUTHENTICATED); what the service itself does is seen with
/// `--auth=none`.
#[tokio::test]
async fn watcher_without_an_api_is_not_serving_and_refuses_subscribers() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("dead.kubeconfig");
    let dead = free_port().unwrap();
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: dead\n  cluster:\n    server: https://127.0.0.1:{dead}\n    insecure-skip-tls-verify: true\n\
             users:\n- name: u\n  user:\n    token: not-a-token\ncontexts:\n- name: c\n  context:\n    cluster: dead\n    user: u\ncurrent-context: c\n"
        ),
    )
    .unwrap();
    let checked = start_watcher(&kubeconfig, dir.path());
    wait_until("the token check to fail as UNAVAILABLE", Duration::from_secs(20), || async {
        let mut c = WatcherClient::new(with_credentials(
            kuryr_runtime::client::channel(&checked.addr)?,
            Credentials::bearer("e30.eyJleHAiOjk5OTk5OTk5OTk5fQ.c2ln")?,
        ));
        let req = SubscribeRequest { kinds: vec![Kind::Pod as i32], ..Default::default() };
        let e = c.subscribe(req).await.err().ok_or_else(|| anyhow::anyhow!("accepted"))?;
        anyhow::ensure!(e.code() == tonic::Code::Unavailable, "{e}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", checked.proc.logs()));
    drop(checked);
    let w = start_watcher_with(&kubeconfig, dir.path(), &["--auth=none"]);
    // Answers health (so it is up), and says NOT_SERVING.
    let status = wait_until("kuryr-watcher to answer health checks", Duration::from_secs(20), || async {
        match w.health().await {
            Ok(()) => Ok("SERVING".to_string()),
            Err(e) if e.to_string().contains("NOT_SERVING") => Ok(e.to_string()),
            Err(e) => Err(e),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", w.proc.logs()));
    assert!(status.contains("NOT_SERVING"), "{status}");

    let err = w.subscribe(&[Kind::Pod], Filter::default(), "", "test/early").await.err().expect("Subscribe must fail");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    let err = w.subscribe(&[], Filter::default(), "", "test/early").await.err().expect("Subscribe must fail");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "validation comes first: {err}");

    wait_until("watch errors to be counted", Duration::from_secs(20), || async {
        let m = w.metrics().await;
        anyhow::ensure!(m.contains("kuryr_watcher_watch_errors_total{kind=\"pod\"}"), "{m}");
        Ok(())
    })
    .await
    .unwrap();
    // Still not serving.
    assert!(w.health().await.unwrap_err().to_string().contains("NOT_SERVING"));
}
