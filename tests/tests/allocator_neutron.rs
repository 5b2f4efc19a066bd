//! kuryr-vif-allocator with `--backend neutron` against the real parts: a real kube-apiserver,
//! kuryr-watcher and kuryr-vif-allocator under their service accounts, a real Keystone (the
//! allocator authenticates with the `kuryr` user's password from clouds.yaml), the real Neutron
//! API + RPC server + ML2/OVS agent on a private userspace Open vSwitch, and a kuryr-binder
//! inside the Neutron node's network namespace plugging into that `br-int`. CNI is driven by
//! executing the `kuryr-cni` shim directly, as a runtime does (environment + stdin), into
//! network namespaces made for the pods.
//!
//! One life, in phases (the OpenStack services take minutes to start on a loaded machine):
//! 1. cold pool: the first pod's port is created on its allocation path, bound to node-1, with
//!    device_id = pod uid, the cluster tag, an IPv4 and an IPv6 address; the pool refills;
//! 2. warm pool: PopulatePool, then pods get pool ports — zero creations on the ADD path;
//! 3. CNI ADD returns only once the agent made the port ACTIVE, with the port's IPs and MAC;
//!    the pods ping each other through OVS over IPv4 and IPv6;
//! 4. allocator kill -9 and restart: same ports, same pools, no second port for any pod;
//! 5. the Neutron API stopped in the middle of a burst: the pods wait (an Event says why) and
//!    complete once it is back;
//! 6. a port tagged for the cluster whose pod never existed is collected;
//! 7. CNI DEL and pod deletion: ports back in the pool, nothing held, no PodVif, no finalizer.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Namespace, Node, Pod, PodSpec};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kuryr_openstack::config::{AuthConfig, Interface, TlsConfig};
use kuryr_openstack::neutron::{FixedIp, Neutron, Port, PortCreate};
use kuryr_openstack::{Client, ClientOptions, CloudConfig, Filter, ServiceType};
use kuryr_proto::allocator::v1::pool_manager_client::PoolManagerClient;
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::{
    FreePoolRequest, GetVifRequest, ListPoolsRequest, Pool, PoolKey, PopulatePoolRequest, Vif, VifState,
};
use kuryr_tests::binder::Binder;
use kuryr_tests::kube::KubeEnv;
use kuryr_tests::metrics::Scrape;
use kuryr_tests::netns::Netns;
use kuryr_tests::openstack::{NeutronNode, OpenStackEnv, PodNetwork, Service};
use kuryr_tests::services::{ServiceProcess, wait_until};
use kuryr_tests::shim::{ShimOutput, run_shim};
use kuryr_tests::util::{free_port, repo_root};
use kuryr_vif_allocator::crd::PodVif;
use serde_json::json;

/// Bound on changes that go through Neutron and its agent (ACTIVE takes 1–3 s unloaded, much
/// more on a machine busy building).
const SLOW: Duration = Duration::from_secs(180);
/// Bound on a change inside the allocator.
const QUICK: Duration = Duration::from_secs(60);
const NS: &str = "neutron-pods";
const CLUSTER_TAG: &str = "kuryr.openstack.org/cluster=e2e";

struct World {
    os: OpenStackEnv,
    _kube: KubeEnv,
    admin: kube::Client,
    dir: tempfile::TempDir,
    watcher_kubeconfig: PathBuf,
    allocator_kubeconfig: PathBuf,
    node: NeutronNode,
    net: PodNetwork,
    neutron: Neutron,
    /// The test's calls to the allocator (GetVif, PoolManager) go as the pool manager.
    pool_manager_token: String,
    /// The binder's token, bound to the node.
    binder_token_file: PathBuf,
}

async fn world() -> World {
    let t0 = Instant::now();
    let (os, kube) = tokio::join!(OpenStackEnv::start(&[Service::Keystone, Service::Neutron]), KubeEnv::start());
    let (os, kube) = (os.unwrap(), kube.unwrap());
    eprintln!("keystone + neutron + kube-apiserver up in {:?}", t0.elapsed());
    let admin = kube.client().await.unwrap();
    let pp = PostParams::default();
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    for n in ["kuryr-system", NS] {
        let meta = ObjectMeta { name: Some(n.into()), ..Default::default() };
        namespaces.create(&pp, &Namespace { metadata: meta, ..Default::default() }).await.unwrap();
    }
    for entry in std::fs::read_dir(repo_root().join("deploy/crds")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("kuryr.openstack.org_") && name.ends_with(".yaml") {
            kube.apply_file(&path).await.unwrap();
        }
    }
    kube.apply_file(&repo_root().join("deploy/rbac/watcher.yaml")).await.unwrap();
    kube.apply_file(&repo_root().join("deploy/rbac/vif-allocator.yaml")).await.unwrap();
    let watcher_kubeconfig = kube.service_account_kubeconfig("kuryr-system", "kuryr-watcher").await.unwrap();
    let allocator_kubeconfig = kube.service_account_kubeconfig("kuryr-system", "kuryr-vif-allocator").await.unwrap();
    let node = os.neutron_node().unwrap();
    let nodes: Api<Node> = Api::all(admin.clone());
    let meta = ObjectMeta { name: Some(node.host.clone()), ..Default::default() };
    nodes.create(&pp, &Node { metadata: meta, ..Default::default() }).await.unwrap();
    let status = json!({"status": {"addresses": [{"type": "InternalIP", "address": "192.168.50.1"}]}});
    nodes.patch_status(&node.host, &PatchParams::default(), &Patch::Merge(status)).await.unwrap();
    let cloud = CloudConfig {
        origin: "test".into(),
        auth: AuthConfig::NoAuth { project_id: None },
        region_name: None,
        interface: Interface::default(),
        tls: TlsConfig::default(),
        endpoint_overrides: [(ServiceType::Network, os.neutron_url().unwrap().parse().unwrap())].into(),
    };
    let client =
        Client::new(&cloud, ClientOptions::default(), Arc::new(kuryr_openstack::Metrics::unregistered())).unwrap();
    let net = os.pod_network().unwrap();
    let pool_manager_token = kube.kuryr_token("kuryr-system", "kuryr-pool-manager", None).await.unwrap();
    let binder_token_file = kube.kuryr_token_file("kuryr-system", "kuryr-binder", Some(&node.host)).await.unwrap();
    World {
        pool_manager_token,
        binder_token_file,
        os,
        _kube: kube,
        admin,
        dir: tempfile::tempdir().unwrap(),
        watcher_kubeconfig,
        allocator_kubeconfig,
        node,
        net,
        neutron: client.network(),
    }
}

/// A service process with its addresses.
struct Svc {
    proc: ServiceProcess,
    /// `127.0.0.1:<port>`.
    addr: String,
    /// The unix socket (the binder in the node's namespace reaches the allocator through it).
    sock: PathBuf,
    metrics: String,
    /// What the test's calls send.
    token: String,
}

fn spawn(bin: &str, mut args: Vec<String>, dir: &Path) -> Svc {
    let (port, mport) = (free_port().unwrap(), free_port().unwrap());
    // The same path across restarts: the binder keeps dialling it.
    let sock = dir.join(format!("{bin}.sock"));
    let addr = format!("127.0.0.1:{port}");
    args.extend([
        "--listen".into(),
        format!("unix:{},{addr}", sock.display()),
        "--metrics-listen".into(),
        format!("127.0.0.1:{mport}"),
        "--shutdown-grace".into(),
        "3s".into(),
    ]);
    let proc = ServiceProcess::spawn(bin, &args, dir).unwrap();
    Svc { proc, addr, sock, metrics: format!("http://127.0.0.1:{mport}"), token: String::new() }
}

impl World {
    fn watcher(&self) -> Svc {
        let args = vec!["--kubeconfig".into(), self.watcher_kubeconfig.display().to_string()];
        spawn("kuryr-watcher", args, self.dir.path())
    }

    fn allocator(&self, watcher: &Svc) -> Svc {
        let args = [
            "--kubeconfig",
            &self.allocator_kubeconfig.display().to_string(),
            "--watcher",
            &watcher.addr,
            "--backend",
            "neutron",
            "--clouds-yaml",
            &self.os.clouds_yaml().display().to_string(),
            "--os-cloud",
            "kuryr",
            "--pod-network-id",
            &self.net.network_id,
            "--pod-subnet-ids",
            &format!("{},{}", self.net.subnet_v4_id, self.net.subnet_v6_id),
            "--cluster-id",
            "e2e",
            "--pool-min",
            "3",
            "--pool-batch",
            "4",
            "--orphan-gc-interval",
            "3s",
            "--status-poll-min",
            "200ms",
            "--instance",
            "alloc-neutron",
            "--log",
            "info,kuryr_vif_allocator=debug",
        ];
        let svc = spawn("kuryr-vif-allocator", args.iter().map(ToString::to_string).collect(), self.dir.path());
        Svc { token: self.pool_manager_token.clone(), ..svc }
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), NS)
    }

    async fn create_pod(&self, name: &str) -> String {
        let pod = Pod {
            metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
            spec: Some(PodSpec {
                node_name: Some(self.node.host.clone()),
                containers: vec![Container {
                    name: "main".into(),
                    image: Some("busybox".into()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        self.pods().create(&PostParams::default(), &pod).await.unwrap().metadata.uid.unwrap()
    }

    /// Every port of the pod network carrying the cluster's tag.
    async fn tagged_ports(&self) -> Vec<Port> {
        let f = Filter::new().network_id(&self.net.network_id).tags(&[CLUSTER_TAG]);
        self.neutron.list_ports(&f).await.unwrap()
    }
}

async fn get(url: &str) -> anyhow::Result<(u16, String)> {
    let resp = reqwest::get(url).await?;
    Ok((resp.status().as_u16(), resp.text().await?))
}

/// The value of a metric sample (`name{labels}` exactly as exposed); 0 when absent.
async fn metric(svc: &Svc, sample: &str) -> f64 {
    let (_, text) = get(&format!("{}/metrics", svc.metrics)).await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|rest| rest.strip_prefix(' ')))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

async fn wait_serving(svc: &Svc) {
    wait_until("the allocator to be ready", SLOW, || async {
        let (code, body) = get(&format!("{}/readyz", svc.metrics)).await?;
        anyhow::ensure!(code == 200, "{code} {body}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", svc.proc.logs()));
}

async fn channel(svc: &Svc) -> kuryr_runtime::auth::client::PeerChannel {
    kuryr_tests::auth::channel(&svc.addr, &svc.token).unwrap()
}

async fn vif(svc: &Svc, uid: &str, timeout: Duration) -> Vif {
    let mut c = VifAllocatorClient::new(channel(svc).await);
    wait_until(&format!("a VIF for pod {uid}"), timeout, || {
        let mut c = c.clone();
        async move { Ok(c.get_vif(GetVifRequest { pod_uid: uid.into() }).await?.into_inner()) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", svc.proc.logs()));
    c.get_vif(GetVifRequest { pod_uid: uid.into() }).await.unwrap().into_inner()
}

async fn node_pool(svc: &Svc, node: &str) -> Option<Pool> {
    let mut c = PoolManagerClient::new(channel(svc).await);
    let pools = c.list_pools(ListPoolsRequest {}).await.unwrap().into_inner().pools;
    pools.into_iter().find(|p| p.key.as_ref().is_some_and(|k| k.node_name == node))
}

/// Executes the shim for one pod as a runtime does.
fn cni(op: &str, binder: &Binder, ns: &str, name: &str, uid: &str, netns: &Netns) -> ShimOutput {
    cni_with(op, binder, ns, name, uid, netns, None)
}

/// [`cni`] with a `prevResult` (CHECK).
fn cni_with(
    op: &str,
    binder: &Binder,
    ns: &str,
    name: &str,
    uid: &str,
    netns: &Netns,
    prev: Option<&serde_json::Value>,
) -> ShimOutput {
    let container = format!("c-{uid}");
    let args = format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID={container};K8S_POD_UID={uid}"
    );
    let netns_path = netns.path().display().to_string();
    let env = [
        ("CNI_COMMAND", op),
        ("CNI_CONTAINERID", container.as_str()),
        ("CNI_NETNS", netns_path.as_str()),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
        ("CNI_ARGS", args.as_str()),
    ];
    let mut conf = json!({
        "cniVersion": "1.1.0", "name": "kuryr", "type": "kuryr-cni",
        "binderSocket": binder.socket, "timeoutSeconds": SLOW.as_secs(),
    });
    if let Some(prev) = prev {
        conf["prevResult"] = prev.clone();
    }
    run_shim(&env, conf.to_string().as_bytes()).unwrap()
}

/// Runs ADD for several pods at once; returns each result with how long it took.
async fn add_all(binder: &Arc<Binder>, pods: &[(String, String, Arc<Netns>)]) -> Vec<(serde_json::Value, Duration)> {
    let tasks: Vec<_> = pods
        .iter()
        .cloned()
        .map(|(name, uid, netns)| {
            let b = binder.clone();
            tokio::task::spawn_blocking(move || {
                let out = cni("ADD", &b, NS, &name, &uid, &netns);
                assert_eq!(out.code, 0, "ADD {name}: {} {}\n{}", out.stdout, out.stderr, b.logs());
                (out.json().unwrap(), out.took)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn ip_of(result: &serde_json::Value, v6: bool) -> String {
    let ips = result["ips"].as_array().unwrap();
    let a = ips.iter().map(|i| i["address"].as_str().unwrap()).find(|a| a.contains(':') == v6).unwrap();
    a.split('/').next().unwrap().to_string()
}

async fn ping(from: &Netns, to: &str) {
    let fam = if to.contains(':') { "-6" } else { "-4" };
    // IPv6 addresses are usable once duplicate address detection is done: retry a little.
    wait_until(&format!("{} to reach {to}", from.name), QUICK, || async {
        from.exec(&["ping", fam, "-n", "-c", "1", "-W", "2", to]).map(drop)
    })
    .await
    .unwrap();
}

fn fixed_addrs(p: &Port) -> BTreeSet<String> {
    p.fixed_ips.iter().filter_map(|f| f.ip_address.clone()).collect()
}

/// After two pods (one from a cold pool, one from a populated one) were plugged and ACTIVE: the
/// pool gauges agree with ShowPool, port creations and Neutron calls moved, and both pods'
/// network-ready latencies were recorded by the allocator (scheduled → READY) and the binder
/// (plugged → ready, which for Neutron is the port ACTIVE).
async fn pool_and_latency_metrics(
    w: &World,
    alloc: &Svc,
    before: &Scrape,
    binder_before: &Scrape,
) -> anyhow::Result<()> {
    let host = w.node.host.as_str();
    let m = wait_until("the pool gauges to match ShowPool", SLOW, || async {
        let m = Scrape::http(&alloc.metrics).await?;
        let pool = node_pool(alloc, host).await.ok_or_else(|| anyhow::anyhow!("no pool"))?;
        let gauge = |state| m.sum("kuryr_allocator_neutron_pool_ports", &[("node", host), ("state", state)]);
        anyhow::ensure!(gauge("in_use") == 2.0, "in_use {} (ShowPool: {})", gauge("in_use"), pool.in_use);
        let free = pool.free_port_ids.len() as f64;
        anyhow::ensure!(gauge("free") == free && free >= 3.0, "free {} (ShowPool: {free})", gauge("free"));
        Ok(m)
    })
    .await?;
    m.moved(before, "kuryr_allocator_neutron_port_creations_total", &[("path", "add")]).exactly(1.0)?;
    m.moved(before, "kuryr_allocator_neutron_port_creations_total", &[("path", "pool")]).at_least(4.0)?;
    let network = [("service", "network")];
    m.moved(before, "openstack_requests_total", &[("service", "network"), ("code", "201")]).at_least(2.0)?;
    m.moved_count(before, "openstack_request_duration_seconds", &network).at_least(4.0)?;
    m.moved_count(before, "kuryr_allocator_neutron_active_seconds", &[]).at_least(2.0)?;
    m.moved(before, "kuryr_allocator_neutron_status_polls_total", &[]).at_least(1.0)?;
    m.moved_count(before, "kuryr_allocator_vif_ready_seconds", &[]).exactly(2.0)?;
    m.moved_count(before, "kuryr_allocator_pod_ready_seconds", &[]).exactly(2.0)?;
    let b = Scrape::in_netns(&w.node.netns_path(), "127.0.0.1:9631").await?;
    let add_ok = [("op", "ADD"), ("code", "0")];
    b.moved(binder_before, "kuryr_cni_requests_total", &add_ok).exactly(2.0)?;
    b.moved_count(binder_before, "kuryr_cni_request_duration_seconds", &add_ok).exactly(2.0)?;
    b.moved_count(binder_before, "kuryr_cni_add_ready_wait_seconds", &[]).exactly(2.0)?;
    let waited = b.hist_sum("kuryr_cni_add_ready_wait_seconds", &[])
        - binder_before.hist_sum("kuryr_cni_add_ready_wait_seconds", &[]);
    eprintln!("ADD waited {:.0} ms in total for the two ports to turn ACTIVE", waited * 1e3);
    Ok(())
}

#[tokio::test]
async fn neutron_ports_for_pods_from_pools_through_ovs_surviving_restarts_and_outages() {
    let w = world().await;
    let pods = w.pods();
    let grace0 = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    let watcher = w.watcher();
    let mut alloc = w.allocator(&watcher);
    wait_serving(&alloc).await;
    let binder = Arc::new(
        Binder::start(
            &w.node.host,
            &w.node.netns_path(),
            &format!("unix:{}", alloc.sock.display()),
            &[
                "--ovs-db".into(),
                w.node.ovsdb(),
                "--vif-wait-timeout".into(),
                format!("{}s", SLOW.as_secs()),
                "--auth-token-file".into(),
                w.binder_token_file.display().to_string(),
            ],
        )
        .await
        .unwrap(),
    );
    let alloc_before = Scrape::http(&alloc.metrics).await.unwrap();
    let binder_before = Scrape::in_netns(&w.node.netns_path(), "127.0.0.1:9631").await.unwrap();

    // 1. Cold pool: the first pod's port is created on its path.
    let t = Instant::now();
    let uid_a = w.create_pod("a").await;
    let va = vif(&alloc, &uid_a, SLOW).await;
    let cold = t.elapsed();
    let pa = w.neutron.get_port(&va.vif_id).await.unwrap();
    assert_eq!(pa.device_id, uid_a);
    assert_eq!(pa.device_owner, "compute:kuryr");
    assert_eq!(pa.binding_host_id.as_deref(), Some(w.node.host.as_str()));
    assert_eq!(pa.binding_vif_type.as_deref(), Some("ovs"), "bound by the node's agent");
    assert_eq!(pa.project_id.as_deref(), Some(w.net.project_id.as_str()), "owned by the token's project");
    assert!(pa.tags.iter().any(|t| t == CLUSTER_TAG), "tags {:?}", pa.tags);
    assert_eq!(pa.name, format!("{NS}/a"));
    assert_eq!(pa.fixed_ips.len(), 2, "an IPv4 and an IPv6 address: {:?}", pa.fixed_ips);
    assert_eq!(va.mac, pa.mac_address);
    assert_eq!(va.backend, "neutron");
    assert_eq!(va.state(), VifState::Allocated);
    let b = va.binding.clone().unwrap();
    assert_eq!((b.driver(), b.bridge.as_str()), (kuryr_proto::allocator::v1::BindingDriver::Ovs, "br-int"));
    assert_eq!(metric(&alloc, r#"kuryr_allocator_neutron_port_creations_total{path="add"}"#).await, 1.0);
    // The pool refills in the background (min 3, batch 4).
    wait_until("node-1's pool to refill", SLOW, || async {
        let p = node_pool(&alloc, &w.node.host).await.ok_or_else(|| anyhow::anyhow!("no pool"))?;
        anyhow::ensure!(p.free_port_ids.len() >= 3, "{p:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));

    // 2. Warm pool: PopulatePool, then pods take pool ports.
    let mut pm = PoolManagerClient::new(channel(&alloc).await);
    let key = PoolKey { node_name: w.node.host.clone(), ..Default::default() };
    let pool = pm.populate_pool(PopulatePoolRequest { key: Some(key.clone()), count: 6 }).await.unwrap().into_inner();
    assert!(pool.free_port_ids.len() >= 6, "{pool:?}");
    assert_eq!(pool.in_use, 1);
    let bad = pm.populate_pool(PopulatePoolRequest { key: Some(key.clone()), count: 0 }).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
    let bad = pm.populate_pool(PopulatePoolRequest { key: None, count: 1 }).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
    // Bounded: at most 100 ports a call, only for nodes that exist.
    let bad = pm.populate_pool(PopulatePoolRequest { key: Some(key.clone()), count: 1000 }).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
    let nowhere = PoolKey { node_name: "no-such-node".into(), ..Default::default() };
    let bad = pm.populate_pool(PopulatePoolRequest { key: Some(nowhere), count: 1 }).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
    assert!(bad.message().contains("no-such-node"), "{bad}");
    // Only the pool manager's account: a binder's token may not, and no token is no call.
    let binder_token = std::fs::read_to_string(&w.binder_token_file).unwrap();
    let mut as_binder = PoolManagerClient::new(kuryr_tests::auth::channel(&alloc.addr, &binder_token).unwrap());
    let denied = as_binder.free_pool(FreePoolRequest { key: None }).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied}");
    let denied = as_binder.populate_pool(PopulatePoolRequest { key: Some(key.clone()), count: 1 }).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied}");
    let mut anonymous = PoolManagerClient::new(kuryr_tests::auth::channel(&alloc.addr, "").unwrap());
    let denied = anonymous.free_pool(FreePoolRequest { key: None }).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::Unauthenticated, "{denied}");
    let t = Instant::now();
    let uid_b = w.create_pod("b").await;
    let vb = vif(&alloc, &uid_b, SLOW).await;
    let warm = t.elapsed();
    assert!(pool.free_port_ids.contains(&vb.vif_id), "{} not from the pool {:?}", vb.vif_id, pool.free_port_ids);
    assert_eq!(w.neutron.get_port(&vb.vif_id).await.unwrap().device_id, uid_b);
    assert_eq!(metric(&alloc, r#"kuryr_allocator_neutron_port_creations_total{path="add"}"#).await, 1.0);
    assert_eq!(metric(&alloc, r#"kuryr_allocator_neutron_vif_sources_total{path="pool"}"#).await, 1.0);
    eprintln!("pod created → VIF: cold pool {cold:?}, warm pool {warm:?}");

    // 3. CNI ADD waits for ACTIVE and returns the port's addresses and MAC; pods ping.
    let na = Arc::new(Netns::new("pna").unwrap());
    let nb = Arc::new(Netns::new("pnb").unwrap());
    let both = [("a".to_string(), uid_a.clone(), na.clone()), ("b".to_string(), uid_b.clone(), nb.clone())];
    let results = add_all(&binder, &both).await;
    for ((res, took), (uid, vif)) in results.iter().zip([(&uid_a, &va), (&uid_b, &vb)]) {
        let port = w.neutron.get_port(&vif.vif_id).await.unwrap();
        assert_eq!(port.status, "ACTIVE", "ADD of {uid} returned before the port was ACTIVE");
        let got: BTreeSet<String> = res["ips"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["address"].as_str().unwrap().split('/').next().unwrap().to_string())
            .collect();
        assert_eq!(got, fixed_addrs(&port), "{res}");
        let eth0 = res["interfaces"].as_array().unwrap().iter().find(|i| i["name"] == "eth0").unwrap();
        assert_eq!(eth0["mac"].as_str().unwrap(), port.mac_address, "{res}");
        eprintln!("ADD of {uid} took {took:?}");
    }
    let ready = vif(&alloc, &uid_a, QUICK).await;
    assert_eq!(ready.state(), VifState::Ready);
    let (a4, b4, b6) = (ip_of(&results[0].0, false), ip_of(&results[1].0, false), ip_of(&results[1].0, true));
    ping(&na, &b4).await;
    ping(&na, &b6).await;
    ping(&nb, &a4).await;
    let active = metric(&alloc, "kuryr_allocator_neutron_active_seconds_sum").await;
    eprintln!("plug report → ACTIVE seen: {:.2} s summed over 2 ports", active);
    pool_and_latency_metrics(&w, &alloc, &alloc_before, &binder_before).await.unwrap_or_else(|e| panic!("{e:#}"));

    // 4. kill -9 and restart: the same ports, pools recovered, no second port for a pod.
    let before = node_pool(&alloc, &w.node.host).await.unwrap();
    alloc.proc.kill().await.unwrap();
    let old_metrics = alloc.metrics.clone();
    drop(alloc);
    let mut alloc = w.allocator(&watcher);
    assert_ne!(alloc.metrics, old_metrics);
    wait_serving(&alloc).await;
    assert_eq!(vif(&alloc, &uid_a, QUICK).await.vif_id, va.vif_id);
    assert_eq!(vif(&alloc, &uid_b, QUICK).await.vif_id, vb.vif_id);
    let after = node_pool(&alloc, &w.node.host).await.unwrap();
    assert_eq!(after.in_use, 2, "{after:?}");
    let ids = |p: &Pool| p.free_port_ids.iter().cloned().collect::<BTreeSet<_>>();
    assert_eq!(ids(&after), ids(&before), "the free ports recovered from Neutron");
    for uid in [&uid_a, &uid_b] {
        let mine = w.neutron.list_ports(&Filter::new().device_id(uid.as_str())).await.unwrap();
        assert_eq!(mine.len(), 1, "pod {uid} holds {} ports", mine.len());
    }
    // The binder follows the new allocator: its pods are still served.
    let check = tokio::task::spawn_blocking({
        let (b, na, uid, prev) = (binder.clone(), na.clone(), uid_a.clone(), results[0].0.clone());
        move || cni_with("CHECK", &b, NS, "a", &uid, &na, Some(&prev))
    })
    .await
    .unwrap();
    assert_eq!(check.code, 0, "CHECK a after the restart: {} {}", check.stdout, check.stderr);

    // 5. Neutron API stopped in the middle of a burst: pods wait, then complete.
    w.os.stop_process("neutron-api").await.unwrap();
    let uid_c = w.create_pod("c").await;
    let uid_d = w.create_pod("d").await;
    let events: Api<Event> = Api::namespaced(w.admin.clone(), NS);
    wait_until("an Event telling that Neutron is unavailable", SLOW, || async {
        let list = events.list(&ListParams::default()).await?;
        anyhow::ensure!(
            list.items.iter().any(|e| e.reason.as_deref() == Some("NeutronUnavailable")),
            "reasons {:?}",
            list.items.iter().map(|e| e.reason.clone()).collect::<Vec<_>>()
        );
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    let mut c = VifAllocatorClient::new(channel(&alloc).await);
    let none = c.get_vif(GetVifRequest { pod_uid: uid_c.clone() }).await.unwrap_err();
    assert_eq!(none.code(), tonic::Code::NotFound, "no VIF while Neutron is down");
    let nc = Arc::new(Netns::new("pnc").unwrap());
    let add_c = tokio::task::spawn_blocking({
        let (b, nc, uid) = (binder.clone(), nc.clone(), uid_c.clone());
        move || cni("ADD", &b, NS, "c", &uid, &nc)
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    w.os.start_process("neutron-api").await.unwrap();
    let vc = vif(&alloc, &uid_c, SLOW).await;
    let vd = vif(&alloc, &uid_d, SLOW).await;
    assert_ne!(vc.vif_id, vd.vif_id);
    let out = add_c.await.unwrap();
    assert_eq!(out.code, 0, "ADD c once Neutron is back: {} {}\n{}", out.stdout, out.stderr, binder.logs());
    assert_eq!(ip_of(&out.json().unwrap(), false), vc.ips[0].address.split('/').next().unwrap());
    ping(&nc, &a4).await;
    for uid in [&uid_c, &uid_d] {
        let mine = w.neutron.list_ports(&Filter::new().device_id(uid.as_str())).await.unwrap();
        assert_eq!(mine.len(), 1, "pod {uid} holds {} ports after the outage", mine.len());
    }

    // 6. A port tagged for the cluster whose pod does not exist is collected.
    let ghost = w
        .neutron
        .create_port(PortCreate {
            network_id: w.net.network_id.clone(),
            name: Some(format!("{NS}/ghost")),
            project_id: Some(w.net.project_id.clone()),
            fixed_ips: Some(vec![FixedIp { subnet_id: Some(w.net.subnet_v4_id.clone()), ip_address: None }]),
            device_id: Some("00000000-0000-4000-8000-00000000dead".into()),
            device_owner: Some("compute:kuryr".into()),
            binding_host_id: Some(w.node.host.clone()),
            tags: Some(vec![CLUSTER_TAG.into()]),
            ..Default::default()
        })
        .await
        .unwrap();
    // Only a restart (recovery) learns of ports made behind the allocator's back.
    alloc.proc.kill().await.unwrap();
    drop(alloc);
    let alloc = w.allocator(&watcher);
    wait_serving(&alloc).await;
    wait_until("the orphaned port to be released", SLOW, || async {
        let p = w.neutron.get_port(&ghost.id).await;
        match p {
            Ok(p) => anyhow::ensure!(p.device_id.is_empty(), "device_id still {}", p.device_id),
            Err(e) => anyhow::ensure!(e.is_not_found(), "{e}"),
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));

    // 7. Teardown: DEL, pods deleted → ports back in the pool, nothing held.
    for (name, uid, netns) in [("a", &uid_a, &na), ("b", &uid_b, &nb), ("c", &uid_c, &nc)] {
        let (b, netns, uid, name) = (binder.clone(), netns.clone(), uid.clone(), name.to_string());
        let out = tokio::task::spawn_blocking(move || cni("DEL", &b, NS, &name, &uid, &netns)).await.unwrap();
        assert_eq!(out.code, 0, "DEL: {} {}", out.stdout, out.stderr);
    }
    for name in ["a", "b", "c", "d"] {
        pods.delete(name, &grace0).await.unwrap();
    }
    wait_until("the pods to be gone", SLOW, || async {
        let left = pods.list(&ListParams::default()).await?.items.len();
        anyhow::ensure!(left == 0, "{left} pods left");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    let podvifs: Api<PodVif> = Api::namespaced(w.admin.clone(), NS);
    assert!(podvifs.list(&ListParams::default()).await.unwrap().items.is_empty(), "PodVifs left behind");
    wait_until("every port back in the pool, free", SLOW, || async {
        let ports = w.tagged_ports().await;
        let held: Vec<&Port> = ports.iter().filter(|p| !p.device_id.is_empty()).collect();
        anyhow::ensure!(
            held.is_empty(),
            "ports still held: {:?}",
            held.iter().map(|p| &p.device_id).collect::<Vec<_>>()
        );
        let pool = node_pool(&alloc, &w.node.host).await.ok_or_else(|| anyhow::anyhow!("no pool"))?;
        anyhow::ensure!(pool.in_use == 0, "{pool:?}");
        anyhow::ensure!(
            pool.free_port_ids.len() == ports.len(),
            "{} free of {} ports: {pool:?}",
            pool.free_port_ids.len(),
            ports.len()
        );
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    assert_eq!(binder.attachment_records(), 0, "attachment records left");
    let calls = metric_sum(&alloc, r#"openstack_requests_total{service="network""#).await;
    let recycled = metric(&alloc, "kuryr_allocator_neutron_port_recycles_total").await;
    eprintln!("last allocator run: {calls} Neutron calls (recovery, GC, 4 releases), {recycled} ports recycled");
}

/// The sum of every sample whose name and labels start with `prefix`.
async fn metric_sum(svc: &Svc, prefix: &str) -> f64 {
    let (_, text) = get(&format!("{}/metrics", svc.metrics)).await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.trim().parse::<f64>().ok()))
        .sum()
}
