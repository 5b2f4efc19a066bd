//! kuryr-vif-allocator as users run it: its own process under the `kuryr-vif-allocator`
//! ServiceAccount with exactly the rights of `deploy/rbac/vif-allocator.yaml`, fed by a real
//! kuryr-watcher (under its own account), against a real kube-apiserver with the CRDs of
//! `deploy/crds/`. A tonic WatchVifs client plays the binder.
//!
//! 1. The life of a pod: finalizer, PodVif, address in its node's block, VIF_APPLIED on its
//!    node's stream with the other node's routes, READY after ReportPlugged, and on deletion
//!    VIF_DELETED, address released, PodVif gone, finalizer removed, pod gone; a finished pod
//!    loses its VIF; kill -9 and restart: the same VIFs without re-allocation, and pods created
//!    or deleted meanwhile are handled once it is back; a PodVif of the earlier shape (the VIF in
//!    its status) is read across the restart and takes state writes.
//! 2. Two unsharded allocators (`--shards 0`, both doing all the work) against the same API
//!    while 100 pods are created at once: no address twice. (Sharded replicas:
//!    `allocator_shards.rs`.)
//! 3. Records that must be kept or replaced: the VIF on record kept and a racing address given
//!    back; a PodVif of the earlier shape recording a VIF the backend does not hold, replaced.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use futures::future::join_all;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kuryr_proto::allocator::v1::pool_manager_client::PoolManagerClient;
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::{FreePoolRequest, PoolKey, PopulatePoolRequest};
use kuryr_proto::allocator::v1::{
    GetVifRequest, NodeRoutes, ReportPluggedRequest, Vif, VifEventType, VifState, WatchVifsRequest, WatchVifsResponse,
};
use kuryr_proto::service_names::VIF_ALLOCATOR;
use kuryr_runtime::auth::client::PeerChannel;
use kuryr_tests::control::{ControlPlane, Served, Watcher};
use kuryr_tests::kube::client_from_kubeconfig;
use kuryr_tests::metrics::wait_metric;
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use kuryr_tests::sut::Sut;
use kuryr_tests::watch::{End, next_event, until_end};
use kuryr_vif_allocator::backend::ipam::IpamStore;
use kuryr_vif_allocator::core::PodKey;
use kuryr_vif_allocator::k8s::crd::{
    AddressBlock, AddressBlockSpec, AddressBlockStatus, BlockAllocation, PodNetwork, PodNetworkSpec, PodVif,
    PodVifSpec, VifRecord, VifState as CrdState,
};
use serde_json::json;
use tonic::Streaming;

/// Bound on one expected change; a healthy allocator delivers in milliseconds.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);
/// Bound on becoming SERVING and on bulk phases.
const PHASE_TIMEOUT: Duration = Duration::from_secs(60);
const FINALIZER: &str = "kuryr.openstack.org/vif";
const NETWORK: &str = "pods";

/// The control plane for the allocator, with two Nodes.
struct Cluster(ControlPlane);

impl std::ops::Deref for Cluster {
    type Target = ControlPlane;

    fn deref(&self) -> &ControlPlane {
        &self.0
    }
}

async fn cluster(ns: &str) -> Cluster {
    let c = ControlPlane::start(Served::Allocator, ns).await.unwrap();
    let nodes: Api<Node> = Api::all(c.admin.clone());
    for (n, ip) in [("n1", "192.168.0.1"), ("n2", "192.168.0.2")] {
        let meta = ObjectMeta { name: Some(n.into()), ..Default::default() };
        nodes.create(&PostParams::default(), &Node { metadata: meta, ..Default::default() }).await.unwrap();
        let status = json!({"status": {"addresses": [{"type": "InternalIP", "address": ip}]}});
        nodes.patch_status(n, &PatchParams::default(), &Patch::Merge(status)).await.unwrap();
    }
    Cluster(c)
}

/// An allocator process ([`Sut`]) and what the test's calls send: a binder's token.
struct Svc {
    sut: Sut,
    token: String,
}

impl std::ops::Deref for Svc {
    type Target = Sut;

    fn deref(&self) -> &Sut {
        &self.sut
    }
}

impl std::ops::DerefMut for Svc {
    fn deref_mut(&mut self) -> &mut Sut {
        &mut self.sut
    }
}

impl Cluster {
    /// A watcher on `addr` (a free port when `None`).
    fn watcher(&self, addr: Option<&str>) -> Watcher {
        self.0.watcher(addr, &["--shutdown-grace", "3s"]).unwrap()
    }

    /// An allocator named `instance` (also its replica identity, as a pod name would be: a
    /// restart is the same replica and takes its shard Leases back at once).
    fn allocator(&self, watcher: &Watcher, instance: &str) -> Svc {
        self.allocator_with(watcher, instance, &[])
    }

    fn allocator_with(&self, watcher: &Watcher, instance: &str, extra: &[&str]) -> Svc {
        let mut args = self.allocator_args(watcher, NETWORK);
        let own = ["--instance", instance, "--replica-id", instance, "--log", "info,kuryr_vif_allocator=debug"];
        args.extend(own.iter().chain(extra).chain(&["--shutdown-grace", "3s"]).map(ToString::to_string));
        let sut = Sut::spawn("kuryr-vif-allocator", &args, self.dir.path(), instance).unwrap();
        Svc { sut, token: self.binder_token.clone() }
    }

    fn pods(&self, ns: &str) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), ns)
    }

    /// Creates the pod `name` of namespace `ns` on `node`; its uid.
    async fn create_pod(&self, ns: &str, name: &str, node: &str) -> String {
        let made = self.pods(ns).create(&PostParams::default(), &pod(name, Some(node), false)).await.unwrap();
        made.metadata.uid.unwrap()
    }

    /// Every allocation in the network's blocks, address → pod uid; panics on any duplicate.
    async fn recorded(&self) -> BTreeMap<IpAddr, String> {
        self.try_recorded().await.unwrap()
    }

    /// [`Self::recorded`], failing instead of panicking.
    async fn try_recorded(&self) -> anyhow::Result<BTreeMap<IpAddr, String>> {
        let blocks = Api::<AddressBlock>::all(self.admin.clone()).list(&ListParams::default()).await?;
        let mut by_ip = BTreeMap::new();
        let mut uids = BTreeSet::new();
        for b in blocks.items.into_iter().filter(|b| b.spec.network == NETWORK) {
            let status = b.status.unwrap_or_default();
            anyhow::ensure!(status.used as usize == status.allocations.len(), "used is off in {}", b.spec.cidr);
            for (ip, holder) in status.allocations {
                anyhow::ensure!(uids.insert(holder.uid.clone()), "{} holds two addresses", holder.uid);
                anyhow::ensure!(by_ip.insert(ip.parse()?, holder.uid).is_none(), "{ip} recorded twice");
            }
        }
        Ok(by_ip)
    }

    /// The network's blocks by node.
    async fn blocks(&self) -> BTreeMap<String, Vec<String>> {
        let blocks = Api::<AddressBlock>::all(self.admin.clone()).list(&ListParams::default()).await.unwrap();
        let mut by_node: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for b in blocks.items.into_iter().filter(|b| b.spec.network == NETWORK) {
            by_node.entry(b.spec.node).or_default().push(b.spec.cidr);
        }
        by_node.values_mut().for_each(|v| v.sort());
        by_node
    }
}

impl Svc {
    fn client(&self) -> VifAllocatorClient<PeerChannel> {
        VifAllocatorClient::new(kuryr_tests::auth::channel(&self.addr, &self.token).unwrap())
    }

    async fn wait_serving(&self, service: &str) {
        self.sut.wait_serving(service, PHASE_TIMEOUT).await.unwrap_or_else(|e| panic!("{e:#}"));
    }

    async fn metrics(&self) -> String {
        self.sut.metrics_text().await.unwrap()
    }

    async fn watch(&self, node: &str, resume_from: &str) -> NodeStream {
        let req = WatchVifsRequest {
            node_name: node.into(),
            resume_from: resume_from.into(),
            binder_id: format!("test/{node}"),
        };
        let stream = self
            .client()
            .watch_vifs(req)
            .await
            .unwrap_or_else(|s| panic!("WatchVifs({node}): {s}\n{}", self.proc.logs()))
            .into_inner();
        NodeStream::new(stream)
    }
}

/// A node's stream, applied the way the binder applies it.
struct NodeStream {
    stream: Streaming<WatchVifsResponse>,
    /// By pod name.
    vifs: BTreeMap<String, Vif>,
    routes: BTreeMap<String, NodeRoutes>,
    /// Pod names whose VIF was deleted.
    deleted: BTreeSet<String>,
    resets: usize,
    live: bool,
    last: String,
}

impl NodeStream {
    fn new(stream: Streaming<WatchVifsResponse>) -> Self {
        Self {
            stream,
            vifs: BTreeMap::new(),
            routes: BTreeMap::new(),
            deleted: BTreeSet::new(),
            resets: 0,
            live: false,
            last: String::new(),
        }
    }

    async fn next(&mut self) -> Result<WatchVifsResponse, End> {
        let ev = next_event(&mut self.stream, EVENT_TIMEOUT, |ev| ev.r#type() == VifEventType::Heartbeat).await?;
        self.last.clone_from(&ev.resume_point);
        let name =
            |v: &Option<Vif>| v.as_ref().and_then(|v| v.pod.as_ref()).map(|p| p.name.clone()).unwrap_or_default();
        match ev.r#type() {
            VifEventType::Reset => {
                self.resets += 1;
                self.live = false;
                self.vifs.clear();
                self.routes.clear();
            }
            VifEventType::SnapshotComplete => self.live = true,
            VifEventType::VifApplied => {
                self.deleted.remove(&name(&ev.vif));
                self.vifs.insert(name(&ev.vif), ev.vif.clone().unwrap());
            }
            VifEventType::VifDeleted => {
                self.vifs.remove(&name(&ev.vif));
                self.deleted.insert(name(&ev.vif));
            }
            VifEventType::NodeRoutesApplied => {
                let r = ev.node_routes.clone().unwrap();
                self.routes.insert(r.node_name.clone(), r);
            }
            VifEventType::NodeRoutesDeleted => {
                self.routes.remove(&ev.node_routes.as_ref().unwrap().node_name);
            }
            VifEventType::Unspecified | VifEventType::Heartbeat => panic!("unexpected event {ev:?}"),
        }
        Ok(ev)
    }

    /// Reads events until the stream ends (or fails); panics when it stays open.
    async fn end(&mut self) -> End {
        until_end(async || self.next().await).await
    }

    /// Reads events until `pred` holds.
    async fn until(&mut self, what: &str, pred: impl Fn(&NodeStream) -> bool) {
        while !pred(self) {
            if let Err(e) = self.next().await {
                panic!(
                    "waiting for {what}: {e:?}; have vifs {:?}, routes {:?}, deleted {:?}",
                    self.vifs.keys().collect::<Vec<_>>(),
                    self.routes,
                    self.deleted
                );
            }
        }
    }

    fn vif(&self, pod: &str) -> &Vif {
        self.vifs.get(pod).unwrap_or_else(|| panic!("no VIF for {pod}"))
    }
}

fn pod(name: &str, node: Option<&str>, host_network: bool) -> Pod {
    let p = objects::pod(name).host_network(host_network);
    match node {
        Some(n) => p.node(n).build(),
        None => p.build(),
    }
}

fn ipv4(v: &Vif) -> (IpAddr, &str) {
    let c = &v.ips[0];
    (c.address.split('/').next().unwrap().parse().unwrap(), c.gateway.as_str())
}

fn in_cidr(ip: IpAddr, cidr: &str) -> bool {
    let (net, len) = cidr.split_once('/').unwrap();
    let (IpAddr::V4(ip), IpAddr::V4(net)) = (ip, net.parse::<IpAddr>().unwrap()) else { return false };
    let mask = u32::MAX << (32 - len.parse::<u32>().unwrap());
    u32::from(ip) & mask == u32::from(net)
}

async fn uid(pods: &Api<Pod>, name: &str) -> String {
    pods.get(name).await.unwrap().metadata.uid.unwrap()
}

#[tokio::test]
async fn pods_get_vifs_that_survive_restarts_and_are_released_on_deletion() {
    let ns = "alloc";
    let c = cluster(ns).await;
    let pods = c.pods(ns);
    let pod_vifs: Api<PodVif> = Api::namespaced(c.admin.clone(), ns);
    let pp = PostParams::default();
    let grace0 = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };

    let watcher = c.watcher(None);
    let mut alloc = c.allocator(&watcher, "a1");
    alloc.wait_serving(VIF_ALLOCATOR).await;
    // --network-cidrs created the network.
    let net = Api::<PodNetwork>::all(c.admin.clone()).get(NETWORK).await.unwrap();
    assert_eq!((net.spec.cidrs.as_slice(), net.spec.ipv4_block_prefix), (&["10.244.0.0/16".to_string()][..], 26));

    // Its account edits pods' finalizers and nothing else: no listing pods, no secrets.
    let sa = client_from_kubeconfig(&c.kubeconfig).await.unwrap();
    let forbidden = |r: Result<(), kube::Error>| matches!(r, Err(kube::Error::Api(s)) if s.code == 403);
    assert!(forbidden(Api::<Pod>::all(sa.clone()).list(&ListParams::default()).await.map(drop)));
    assert!(forbidden(Api::<Pod>::namespaced(sa.clone(), ns).create(&pp, &pod("nope", None, false)).await.map(drop)));
    assert!(forbidden(Api::<Secret>::all(sa.clone()).list(&ListParams::default()).await.map(drop)));
    assert!(forbidden(Api::<Node>::all(sa).list(&ListParams::default()).await.map(drop)));

    // Pods on both nodes, one on the host network, one unscheduled.
    for (name, node, hostnet) in [
        ("p1", Some("n1"), false),
        ("p2", Some("n1"), false),
        ("q1", Some("n2"), false),
        ("h1", Some("n1"), true),
        ("u1", None, false),
    ] {
        pods.create(&pp, &pod(name, node, hostnet)).await.unwrap();
    }
    let mut n1 = alloc.watch("n1", "").await;
    n1.until("p1, p2 and n2's routes", |s| {
        s.live && s.vifs.contains_key("p1") && s.vifs.contains_key("p2") && s.routes.contains_key("n2")
    })
    .await;
    let blocks = c.blocks().await;
    assert_eq!(blocks.keys().collect::<Vec<_>>(), ["n1", "n2"], "{blocks:?}");
    let n1_block = &blocks["n1"][0];
    let (a1, gw1) = ipv4(n1.vif("p1"));
    let (a2, gw2) = ipv4(n1.vif("p2"));
    assert_ne!(a1, a2);
    for a in [a1, a2] {
        assert!(in_cidr(a, n1_block), "{a} is not in n1's block {n1_block}");
    }
    // The gateway is the block's first usable address.
    let net: std::net::Ipv4Addr = n1_block.split_once('/').unwrap().0.parse().unwrap();
    let gateway = std::net::Ipv4Addr::from(u32::from(net) + 1).to_string();
    assert_eq!((gw1, gw2), (gateway.as_str(), gateway.as_str()));
    let v1 = n1.vif("p1").clone();
    assert_eq!(
        (v1.state(), v1.mtu, v1.backend.as_str(), v1.network_id.as_str()),
        (VifState::Allocated, 1500, "embedded", NETWORK)
    );
    assert_eq!(v1.binding.as_ref().unwrap().bridge, "kuryr0");
    assert!(v1.mac.starts_with("0a:58:"), "{}", v1.mac);
    assert_eq!(v1.pod.as_ref().unwrap().uid, uid(&pods, "p1").await);
    let r2 = &n1.routes["n2"];
    assert_eq!(
        (r2.node_ips.as_slice(), r2.cidrs.as_slice()),
        (&["192.168.0.2".to_string()][..], blocks["n2"].as_slice())
    );
    assert!(!n1.routes.contains_key("n1"), "a node is not sent its own routes");

    // Recorded: finalizer on the pod, PodVif owned by the pod with the VIF in its status.
    let p1 = pods.get("p1").await.unwrap();
    assert!(p1.metadata.finalizers.unwrap_or_default().iter().any(|f| f == FINALIZER));
    let pv = pod_vifs.get("p1").await.unwrap();
    assert_eq!(
        (pv.spec.pod_uid.as_str(), pv.spec.node_name.as_str(), pv.spec.network.as_str()),
        (v1.pod.as_ref().unwrap().uid.as_str(), "n1", NETWORK)
    );
    assert_eq!(pv.metadata.owner_references.as_ref().unwrap()[0].uid, pv.spec.pod_uid);
    // The create recorded the VIF (in the spec); no status until the state moves.
    assert!(pv.status.is_none(), "a status was written: {:?}", pv.status);
    assert_eq!(pv.state(), CrdState::Allocated);
    let rec = pv.spec.vif.as_ref().unwrap();
    assert_eq!((rec.vif_id.as_str(), rec.ips[0].address.as_str()), (v1.vif_id.as_str(), v1.ips[0].address.as_str()));
    // Host-network and unscheduled pods get nothing.
    for name in ["h1", "u1"] {
        assert!(pod_vifs.get_opt(name).await.unwrap().is_none(), "{name} got a PodVif");
        assert!(pods.get(name).await.unwrap().metadata.finalizers.is_none(), "{name} got a finalizer");
    }

    // A PodVif left by an earlier pod of the same name (its cleanup never ran): the new pod's
    // allocation fails, which its users see as an Event, until the stale PodVif is cleaned up.
    let stale = PodVif::new(
        "stale",
        PodVifSpec {
            pod_uid: "earlier-uid".into(),
            pod_name: "stale".into(),
            node_name: "n1".into(),
            network: NETWORK.into(),
            vif: None,
        },
    );
    pod_vifs.create(&pp, &stale).await.unwrap();
    pods.create(&pp, &pod("stale", Some("n1"), false)).await.unwrap();
    n1.until("the VIF of the pod named like a stale PodVif", |s| s.vifs.contains_key("stale")).await;
    assert_eq!(pod_vifs.get("stale").await.unwrap().spec.pod_uid, uid(&pods, "stale").await);
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(c.admin.clone(), ns);
    let events = events.list(&ListParams::default()).await.unwrap().items;
    let warned = events.iter().find(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("stale"));
    let warned = warned.unwrap_or_else(|| panic!("no Event about pod stale: {events:#?}"));
    assert_eq!((warned.reason.as_deref(), warned.type_.as_deref()), (Some("VifAllocationFailed"), Some("Warning")));
    assert!(warned.note.as_deref().unwrap_or_default().contains("earlier pod"), "{warned:?}");
    assert_eq!(warned.reporting_controller.as_deref(), Some("kuryr-vif-allocator"));

    // Only the binders' account may watch VIFs and report them plugged, and a binder whose token
    // is bound to a node only for that node; without a token nothing at all.
    let watch_n1 = || WatchVifsRequest { node_name: "n1".into(), resume_from: String::new(), binder_id: "t".into() };
    let anonymous = VifAllocatorClient::new(kuryr_runtime::client::channel(&alloc.addr).unwrap());
    let e = anonymous.clone().watch_vifs(watch_n1()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    let as_account = |sa: &'static str, node: Option<&'static str>| {
        let (env, addr) = (&c.env, alloc.addr.clone());
        async move {
            let token = env.kuryr_token("kuryr-system", sa, node).await.unwrap();
            VifAllocatorClient::new(kuryr_tests::auth::channel(&addr, &token).unwrap())
        }
    };
    let e = as_account("kuryr-lbaas", None).await.watch_vifs(watch_n1()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    let mut n2_binder = as_account("kuryr-binder", Some("n2")).await;
    let e = n2_binder.watch_vifs(watch_n1()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    assert!(e.message().contains("(n2)"), "{e}");
    let forged = ReportPluggedRequest {
        pod_uid: v1.pod.as_ref().unwrap().uid.clone(),
        vif_id: v1.vif_id.clone(),
        node_name: "n1".into(),
        plugged: true,
        host_ifname: "x".into(),
    };
    let e = n2_binder.report_plugged(forged.clone()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "n2's binder reported for n1: {e}");
    let e = anonymous.clone().report_plugged(forged).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    assert!(n2_binder.watch_vifs(WatchVifsRequest { node_name: "n2".into(), ..watch_n1() }).await.is_ok());
    assert_eq!(n1.vif("p1").state(), VifState::Allocated, "a refused report changed the VIF");
    // The pool methods are the pool manager's: refused to others before anything else (the
    // embedded backend then answers UNIMPLEMENTED: it has no pools).
    let pm = |t: Option<String>| {
        let ch = kuryr_runtime::client::channel(&alloc.addr).unwrap();
        let creds = match t {
            Some(t) => kuryr_runtime::auth::client::Credentials::bearer(&t).unwrap(),
            None => kuryr_runtime::auth::client::Credentials::None,
        };
        PoolManagerClient::new(kuryr_runtime::auth::client::with_credentials(ch, creds))
    };
    let populate =
        || PopulatePoolRequest { key: Some(PoolKey { node_name: "n1".into(), ..Default::default() }), count: 1 };
    let manager = c.env.kuryr_token("kuryr-system", "kuryr-pool-manager", None).await.unwrap();
    for (who, token, code) in [
        ("anonymous", None, tonic::Code::Unauthenticated),
        ("a binder", Some(alloc.token.clone()), tonic::Code::PermissionDenied),
        ("the pool manager", Some(manager), tonic::Code::Unimplemented),
    ] {
        let e = pm(token.clone()).populate_pool(populate()).await.unwrap_err();
        assert_eq!(e.code(), code, "PopulatePool as {who}: {e}");
        let e = pm(token).free_pool(FreePoolRequest { key: None }).await.unwrap_err();
        assert_eq!(e.code(), code, "FreePool as {who}: {e}");
    }

    // ReportPlugged: checked, recorded, streamed.
    let mut client = alloc.client();
    let report = |uid: &str, vif_id: &str, plugged: bool| ReportPluggedRequest {
        pod_uid: uid.into(),
        vif_id: vif_id.into(),
        node_name: "n1".into(),
        plugged,
        host_ifname: "veth0".into(),
    };
    let p1_uid = v1.pod.as_ref().unwrap().uid.clone();
    let err = client.report_plugged(report("no-such-uid", &v1.vif_id, true)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    let err = client.report_plugged(report(&p1_uid, "pods/10.0.0.1", true)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    let resp = client.report_plugged(report(&p1_uid, &v1.vif_id, true)).await.unwrap().into_inner();
    assert_eq!(resp.vif.unwrap().state(), VifState::Ready);
    n1.until("p1 READY", |s| s.vif("p1").state() == VifState::Ready).await;
    assert_eq!(pod_vifs.get("p1").await.unwrap().state(), CrdState::Ready);
    // A binder whose stream broke resumes from its last point with the same allocator: no RESET,
    // no snapshot; SNAPSHOT_COMPLETE first (it is live again), then only what it missed.
    let point = n1.last.clone();
    let resumed = alloc.watch("n1", &point).await;
    n1.stream = resumed.stream;
    n1.live = false;
    client.report_plugged(report(&p1_uid, &v1.vif_id, false)).await.unwrap();
    let first = n1.next().await.unwrap_or_else(|e| panic!("resumed stream: {e:?}"));
    assert_eq!(first.r#type(), VifEventType::SnapshotComplete, "first event after a resume: {first:?}");
    n1.until("p1 unplugged, on the resumed stream", |s| s.vif("p1").state() == VifState::Allocated).await;
    assert_eq!((n1.resets, n1.live), (0, true));
    client.report_plugged(report(&p1_uid, &v1.vif_id, true)).await.unwrap();
    n1.until("p1 READY again", |s| s.vif("p1").state() == VifState::Ready).await;
    let got = client.get_vif(GetVifRequest { pod_uid: p1_uid.clone() }).await.unwrap().into_inner();
    assert_eq!((got.state(), got.vif_id.as_str()), (VifState::Ready, v1.vif_id.as_str()));

    // Deleting a pod: VIF_DELETED, address released, PodVif gone, finalizer off, pod gone.
    let p2_uid = uid(&pods, "p2").await;
    pods.delete("p2", &grace0).await.unwrap();
    n1.until("p2 deleted", |s| s.deleted.contains("p2")).await;
    wait_until("p2 gone from the API", EVENT_TIMEOUT, || async {
        anyhow::ensure!(pods.get_opt("p2").await?.is_none(), "still there");
        anyhow::ensure!(pod_vifs.get_opt("p2").await?.is_none(), "PodVif still there");
        Ok(())
    })
    .await
    .unwrap();
    let recorded = c.recorded().await;
    assert!(!recorded.values().any(|u| *u == p2_uid), "p2's address was not released: {recorded:?}");
    assert_eq!(recorded.get(&a1), Some(&p1_uid));

    // A finished pod loses its VIF and the finalizer, and stays.
    pods.create(&pp, &pod("done", Some("n1"), false)).await.unwrap();
    n1.until("done's VIF", |s| s.vifs.contains_key("done")).await;
    pods.patch_status("done", &PatchParams::default(), &Patch::Merge(json!({"status": {"phase": "Succeeded"}})))
        .await
        .unwrap();
    n1.until("done deleted", |s| s.deleted.contains("done")).await;
    wait_until("done's finalizer removed", EVENT_TIMEOUT, || async {
        let p = pods.get("done").await?;
        anyhow::ensure!(p.metadata.finalizers.unwrap_or_default().is_empty(), "finalizers left");
        Ok(())
    })
    .await
    .unwrap();

    let m = alloc.metrics().await;
    for line in [
        "kuryr_allocator_allocations_total 5",
        "kuryr_allocator_watchvifs_subscribers 1",
        "kuryr_allocator_vif_ready_seconds_count 5",
    ] {
        assert!(m.contains(line), "metrics lack `{line}`:\n{m}");
    }

    // kill -9. Meanwhile a pod is created on n1 and q1 is deleted: its finalizer holds it.
    let before = c.recorded().await;
    let last = n1.last.clone();
    alloc.proc.kill().await.unwrap();
    assert!(matches!(n1.end().await, End::Failed(_)), "the stream outlived the allocator");
    pods.create(&pp, &pod("p3", Some("n1"), false)).await.unwrap();
    let q1_uid = uid(&pods, "q1").await;
    pods.delete("q1", &grace0).await.unwrap();
    assert!(pods.get("q1").await.unwrap().metadata.deletion_timestamp.is_some(), "the finalizer should hold q1");
    // Meanwhile p1's PodVif takes the shape earlier versions wrote: the VIF in its status, none in
    // its spec. The restarted allocator must read it as it is.
    let rec = pod_vifs.get("p1").await.unwrap().spec.vif.unwrap();
    pod_vifs.patch("p1", &PatchParams::default(), &Patch::Merge(json!({"spec": {"vif": null}}))).await.unwrap();
    let earlier = json!({"status": {"vif": rec, "state": "Ready"}});
    pod_vifs.patch_status("p1", &PatchParams::default(), &Patch::Merge(earlier)).await.unwrap();

    let alloc = c.allocator(&watcher, "a1");
    // The binder reconnects with its resume point: a new epoch, so RESET and a snapshot holding
    // the recorded VIFs at once (recovery), READY state included, then p3's new VIF.
    let mut n1 = wait_until("WatchVifs after the restart", PHASE_TIMEOUT, || async {
        let req = WatchVifsRequest { node_name: "n1".into(), resume_from: last.clone(), binder_id: "test/n1".into() };
        Ok(alloc.client().watch_vifs(req).await?.into_inner())
    })
    .await
    .map(NodeStream::new)
    .unwrap();
    n1.until("the snapshot", |s| s.live).await;
    assert_eq!(n1.resets, 1, "a restarted allocator must RESET a binder resuming from its old epoch");
    let v1_again = n1.vif("p1");
    assert_eq!((v1_again.vif_id.as_str(), v1_again.state()), (v1.vif_id.as_str(), VifState::Ready));
    assert_eq!(v1_again.ips, v1.ips, "p1 was re-allocated");
    // A state change on the PodVif of the earlier shape lands in its status, the VIF left there.
    let mut client = alloc.client();
    client.report_plugged(report(&p1_uid, &v1.vif_id, false)).await.unwrap();
    let pv = pod_vifs.get("p1").await.unwrap();
    assert_eq!((pv.spec.vif.is_none(), pv.state()), (true, CrdState::Allocated), "{pv:?}");
    assert_eq!(pv.vif().map(|r| r.vif_id.as_str()), Some(v1.vif_id.as_str()));
    client.report_plugged(report(&p1_uid, &v1.vif_id, true)).await.unwrap();
    assert_eq!(pod_vifs.get("p1").await.unwrap().state(), CrdState::Ready);
    // Routes need the watcher's nodes and the blocks: they follow as soon as both are in.
    n1.until("n2's routes", |s| s.routes.get("n2").is_some_and(|r| r.cidrs == blocks["n2"])).await;
    n1.until("p3's VIF", |s| s.vifs.contains_key("p3")).await;
    alloc.wait_serving(VIF_ALLOCATOR).await;
    // q1, deleted while no allocator ran, is released and goes.
    wait_until("q1 released and gone", PHASE_TIMEOUT, || async {
        anyhow::ensure!(pods.get_opt("q1").await?.is_none(), "q1 still there");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    let after = c.recorded().await;
    assert!(!after.values().any(|u| *u == q1_uid), "q1's address was not released: {after:?}");
    // Nothing recorded before the crash was re-allocated.
    for (ip, holder) in before.iter().filter(|(_, u)| **u != q1_uid) {
        assert_eq!(after.get(ip), Some(holder), "{ip} changed hands over the restart");
    }
    assert_eq!(after.len(), 3, "p1, stale and p3: {after:?}");
    assert!(!n1.vifs.contains_key("h1") && !n1.deleted.contains("h1"), "the host-network pod got a VIF");

    // Losing the watcher: NOT_SERVING (streams go on); it comes back as a new epoch, so the
    // allocator re-lists from its RESET snapshot, and a pod created meanwhile gets its VIF.
    let mut watcher = watcher;
    watcher.proc.kill().await.unwrap();
    wait_until("allocator NOT_SERVING without its watcher", EVENT_TIMEOUT, || async {
        let h = kuryr_runtime::client::check_serving(kuryr_runtime::client::channel(&alloc.addr)?, VIF_ALLOCATOR).await;
        anyhow::ensure!(h.as_ref().is_err_and(|e| e.to_string().contains("NOT_SERVING")), "{h:?}");
        Ok(())
    })
    .await
    .unwrap();
    pods.create(&pp, &pod("p4", Some("n1"), false)).await.unwrap();
    let watcher = c.watcher(Some(&watcher.addr));
    alloc.wait_serving(VIF_ALLOCATOR).await;
    n1.until("p4's VIF", |s| s.vifs.contains_key("p4")).await;
    assert_eq!(n1.vif("p1").ips, v1.ips);
    assert!(alloc.proc.logs().contains("RESET"), "the allocator did not re-list:\n{}", alloc.proc.logs());
    drop(watcher);

    // SIGTERM ends open streams with UNAVAILABLE, promptly.
    let mut alloc = alloc;
    let took = alloc.proc.terminate(Duration::from_secs(10)).await.unwrap();
    assert!(took < Duration::from_secs(5), "took {took:?} to stop");
    match n1.end().await {
        End::Failed(s) => assert_eq!(s.code(), tonic::Code::Unavailable, "{s}"),
        other => panic!("expected UNAVAILABLE at shutdown, got {other:?}"),
    }
}

#[tokio::test]
async fn two_allocators_never_hand_out_an_address_twice() {
    const PODS: usize = 100;
    const ON_N1: usize = 30;
    let ns = "race";
    let c = cluster(ns).await;
    let pods = c.pods(ns);
    let watcher = c.watcher(None);
    // Unsharded, both do everything: the IPAM's optimistic concurrency alone keeps them apart.
    let a = c.allocator_with(&watcher, "a", &["--shards", "0"]);
    let b = c.allocator_with(&watcher, "b", &["--shards", "0"]);
    a.wait_serving(VIF_ALLOCATOR).await;
    b.wait_serving(VIF_ALLOCATOR).await;

    let node = |i: usize| if i < ON_N1 { "n1" } else { "n2" };
    let started = Instant::now();
    let created = join_all((0..PODS).map(|i| {
        let pods = pods.clone();
        async move { pods.create(&PostParams::default(), &pod(&format!("pod-{i}"), Some(node(i)), false)).await }
    }))
    .await;
    let uids: HashMap<String, usize> =
        created.into_iter().enumerate().map(|(i, p)| (p.unwrap().metadata.uid.unwrap(), i)).collect();

    // Every pod gets a recorded VIF.
    let pod_vifs: Api<PodVif> = Api::namespaced(c.admin.clone(), ns);
    let statuses = wait_until("100 PodVifs with a VIF", PHASE_TIMEOUT, || async {
        let list = pod_vifs.list(&ListParams::default()).await?;
        let done: Vec<PodVif> = list.items.into_iter().filter(|p| p.vif().is_some()).collect();
        anyhow::ensure!(done.len() == PODS, "{} of {PODS}", done.len());
        Ok(done)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\nallocator a:\n{}\nallocator b:\n{}", a.proc.logs(), b.proc.logs()));
    let took = started.elapsed();

    // Distinct addresses, each in a block of the pod's node, exactly what the blocks record.
    let blocks = c.blocks().await;
    let mut by_pod = HashMap::new();
    for pv in &statuses {
        let vif = pv.vif().unwrap();
        let ip: IpAddr = vif.ips[0].address.split('/').next().unwrap().parse().unwrap();
        let i = uids[&pv.spec.pod_uid];
        assert!(blocks[node(i)].iter().any(|b| in_cidr(ip, b)), "{ip} of pod-{i} is not in a block of {}", node(i));
        assert!(by_pod.insert(ip, pv.spec.pod_uid.clone()).is_none(), "{ip} handed out twice");
    }
    let by_pod: BTreeMap<IpAddr, String> = by_pod.into_iter().collect();
    // Both replicas allocate for every pod. Where both got an address for one pod (near a block
    // boundary, each from its own copy of the blocks), only one records it in the PodVif; the
    // other replica keeps the recorded VIF and gives its own address back, so the blocks settle
    // on exactly the PodVifs' addresses.
    let recorded = wait_until("the blocks record exactly the PodVifs' addresses", PHASE_TIMEOUT, || async {
        let recorded = c.try_recorded().await?;
        if recorded != by_pod {
            let extra: Vec<_> = recorded.iter().filter(|(ip, _)| !by_pod.contains_key(ip)).collect();
            let missing: Vec<_> = by_pod.iter().filter(|(ip, _)| !recorded.contains_key(ip)).collect();
            anyhow::bail!("not in a PodVif: {extra:?}; not in the blocks: {missing:?}");
        }
        Ok(recorded)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\nallocator a:\n{}\nallocator b:\n{}", a.proc.logs(), b.proc.logs()));
    // 30 pods on n1 need one /26 block, 70 on n2 two. Unsharded, both replicas allocate for the
    // same pods, and one may claim a block while the other's addresses for those pods are not
    // written yet: at most one block more per node, never an address twice (checked above).
    let (n1b, n2b) = (blocks["n1"].len(), blocks["n2"].len());
    assert!((1..=2).contains(&n1b) && (2..=3).contains(&n2b), "{blocks:?}");
    let mut failures = Vec::new();
    for svc in [&a, &b] {
        let m = svc.metrics().await;
        failures.extend(
            m.lines()
                .filter(|l| {
                    l.starts_with("kuryr_allocator_failures_total")
                        || l.starts_with("kuryr_allocator_allocations_total")
                        || l.starts_with("kuryr_allocator_lost_races_total")
                })
                .map(String::from),
        );
    }
    eprintln!("{PODS} pods by two allocators in {took:?}; {failures:#?}");

    // Both replicas stream the same VIFs, and n2's routes carry all of its blocks.
    for svc in [&a, &b] {
        let mut s = svc.watch("n1", "").await;
        s.until("n1's 30 VIFs and all of n2's blocks", |s| {
            s.vifs.len() == ON_N1 && s.routes.get("n2").is_some_and(|r| r.cidrs.len() == n2b)
        })
        .await;
        for v in s.vifs.values() {
            let (ip, _) = ipv4(v);
            assert_eq!(recorded.get(&ip), Some(&v.pod.as_ref().unwrap().uid));
        }
        assert_eq!(s.routes["n2"].cidrs, blocks["n2"]);
    }

    // Deleting them all releases everything, and every pod goes.
    objects::delete_pods_now(&pods, (0..PODS).map(|i| format!("pod-{i}"))).await.unwrap();
    wait_until("every pod gone and every address free", PHASE_TIMEOUT, || async {
        let left = pods.list(&ListParams::default()).await?.items.len();
        anyhow::ensure!(left == 0, "{left} pods left");
        let held = c.recorded().await.len();
        anyhow::ensure!(held == 0, "{held} addresses held");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\nallocator a:\n{}", a.proc.logs()));
}

/// What two allocators racing for one pod leave behind: the PodVif records the VIF of one (an
/// address in the node's second block), while the pod also holds the address the other took in
/// the first block. The allocator keeps the recorded VIF, streams it, and gives the other
/// address back, so the pod holds one address.
#[tokio::test]
async fn the_vif_on_record_stays_and_a_racing_address_is_given_back() {
    let ns = "settle";
    let c = cluster(ns).await;
    let uid = c.create_pod(ns, "p", "n1").await;
    let pp = PostParams::default();

    // The first allocator's address, through the IPAM as any allocator uses it: the first block.
    let store = IpamStore::new(c.admin.clone());
    let spec = PodNetworkSpec { ipv4_block_prefix: 26, ..PodNetworkSpec::new(["10.244.0.0/16"]) };
    store.ensure_network(NETWORK, &spec).await.unwrap();
    let key = PodKey::new(ns, "p", uid.as_str());
    let first = store.allocate(NETWORK, "n1", &key).await.unwrap();
    let racing = first.addresses[0].address;
    assert!(in_cidr(racing, "10.244.0.0/26"), "{racing}");

    // The second allocator's: the node's second block, recorded in the PodVif.
    let blocks: Api<AddressBlock> = Api::all(c.admin.clone());
    let second = AddressBlock::new(
        "pods-10-244-0-64-26",
        AddressBlockSpec { network: NETWORK.into(), cidr: "10.244.0.64/26".into(), node: "n1".into() },
    );
    blocks.create(&pp, &second).await.unwrap();
    let mut second = blocks.get_status("pods-10-244-0-64-26").await.unwrap();
    let holder =
        BlockAllocation { namespace: ns.into(), name: "p".into(), uid: uid.clone(), mac: "0a:58:0a:f4:00:46".into() };
    second.status = Some(AddressBlockStatus {
        allocations: [("10.244.0.70".to_string(), holder)].into(),
        used: 1,
        last_allocated: Some("10.244.0.70".into()),
    });
    blocks.replace_status("pods-10-244-0-64-26", &pp, &second).await.unwrap();
    let mut recorded = VifRecord::from_config(first.vif_id.clone(), &first.vif);
    recorded.vif_id = format!("{NETWORK}/10.244.0.70");
    recorded.mac = "0a:58:0a:f4:00:46".into();
    let prefix = recorded.ips[0].address.split('/').nth(1).unwrap().to_string();
    recorded.ips[0].address = format!("10.244.0.70/{prefix}");
    recorded.ips[0].gateway = Some("10.244.0.65".into());
    let pod_vifs: Api<PodVif> = Api::namespaced(c.admin.clone(), ns);
    let pv = PodVif::new(
        "p",
        PodVifSpec {
            pod_uid: uid.clone(),
            pod_name: "p".into(),
            node_name: "n1".into(),
            network: NETWORK.into(),
            vif: Some(recorded.clone()),
        },
    );
    pod_vifs.create(&pp, &pv).await.unwrap();
    let status = json!({"status": {"state": CrdState::Plugged}});
    pod_vifs.patch_status("p", &PatchParams::default(), &Patch::Merge(status)).await.unwrap();

    let watcher = c.watcher(None);
    let alloc = c.allocator(&watcher, "a1");
    alloc.wait_serving(VIF_ALLOCATOR).await;
    let mut n1 = alloc.watch("n1", "").await;
    n1.until("the pod's VIF", |s| s.vifs.contains_key("p")).await;
    let vif = n1.vifs["p"].clone();
    assert_eq!(vif.vif_id, recorded.vif_id, "the recorded VIF is the one streamed");
    assert_eq!(ipv4(&vif).0, "10.244.0.70".parse::<IpAddr>().unwrap());
    let held = wait_until("the racing address given back", PHASE_TIMEOUT, || async {
        let held: Vec<IpAddr> =
            c.try_recorded().await?.into_iter().filter(|(_, u)| *u == uid).map(|(ip, _)| ip).collect();
        anyhow::ensure!(!held.contains(&racing), "the pod still holds {held:?}");
        Ok(held)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    assert_eq!(held, ["10.244.0.70".parse::<IpAddr>().unwrap()]);
    let after = pod_vifs.get("p").await.unwrap();
    assert_eq!(after.spec.vif.unwrap().vif_id, recorded.vif_id, "the record was not overwritten");
    // The race is counted once the give-back's write is answered, which may be after the test
    // saw it land.
    wait_metric("kuryr_allocator_lost_races_total", 1.0, PHASE_TIMEOUT, || alloc.metrics_text())
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
}

/// A PodVif as an earlier version wrote it (the VIF in its status), recording a VIF the backend
/// does not hold, READY: recovery loads it as it is, and the pod's reconcile replaces it with
/// the pod's own allocation — the status cleared first (state ALLOCATED, the earlier VIF gone),
/// then the VIF written into the spec, both over the version read.
#[tokio::test]
async fn a_record_the_backend_does_not_hold_is_replaced_in_a_pod_vif_of_the_earlier_shape() {
    let ns = "replace";
    let c = cluster(ns).await;
    let uid = c.create_pod(ns, "p", "n1").await;
    let pp = PostParams::default();
    let pod_vifs: Api<PodVif> = Api::namespaced(c.admin.clone(), ns);
    let spec = PodVifSpec {
        pod_uid: uid.clone(),
        pod_name: "p".into(),
        node_name: "n1".into(),
        network: NETWORK.into(),
        vif: None,
    };
    pod_vifs.create(&pp, &PodVif::new("p", spec)).await.unwrap();
    let gone = VifRecord {
        vif_id: format!("{NETWORK}/10.244.200.9"),
        mac: "0a:58:0a:f4:c8:09".into(),
        mtu: 1500,
        ips: vec![kuryr_vif_allocator::k8s::crd::VifIp {
            address: "10.244.200.9/26".into(),
            gateway: Some("10.244.200.1".into()),
        }],
        bridge: "kuryr0".into(),
        ..VifRecord::default()
    };
    let earlier = json!({"status": {"vif": gone, "state": CrdState::Ready}});
    pod_vifs.patch_status("p", &PatchParams::default(), &Patch::Merge(earlier)).await.unwrap();

    let watcher = c.watcher(None);
    let alloc = c.allocator(&watcher, "a1");
    alloc.wait_serving(VIF_ALLOCATOR).await;
    let mut n1 = alloc.watch("n1", "").await;
    n1.until("the pod's own VIF", |s| s.vifs.get("p").is_some_and(|v| v.vif_id != gone.vif_id)).await;
    let vif = n1.vifs["p"].clone();
    assert_eq!(vif.state(), VifState::Allocated, "the earlier record's READY was kept: {vif:?}");
    let pv = pod_vifs.get("p").await.unwrap();
    let rec = pv.spec.vif.clone().unwrap_or_else(|| panic!("no VIF in the spec: {pv:?}\n{}", alloc.proc.logs()));
    assert_eq!((rec.vif_id.as_str(), pv.state()), (vif.vif_id.as_str(), CrdState::Allocated), "{pv:?}");
    assert!(!pv.vif_in_status(), "the earlier VIF is still in the status: {pv:?}");
    let held: Vec<IpAddr> = c.recorded().await.into_iter().filter(|(_, u)| *u == uid).map(|(ip, _)| ip).collect();
    assert_eq!(held, [ipv4(&vif).0], "the blocks hold other addresses for the pod than its record");
}
