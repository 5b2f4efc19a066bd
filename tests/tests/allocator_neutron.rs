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
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_openstack::Filter;
use kuryr_openstack::neutron::{FixedIp, Port, PortCreate};
use kuryr_proto::allocator::v1::pool_manager_client::PoolManagerClient;
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::{
    FreePoolRequest, GetVifRequest, ListPoolsRequest, Pool, PoolKey, PopulatePoolRequest, VifState,
};
use kuryr_tests::binder::Binder;
use kuryr_tests::metrics::Scrape;
use kuryr_tests::netns::Netns;
use kuryr_tests::neutron::{self, AllocatorOptions, CniPod, NeutronCluster, SLOW, SYSTEM_NAMESPACE, Svc};
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use kuryr_tests::shim::ShimOutput;
use kuryr_tests::shim::result_ip;
use kuryr_vif_allocator::k8s::crd::PodVif;

/// Bound on a change inside the allocator.
const QUICK: Duration = Duration::from_secs(60);
const NS: &str = "neutron-pods";
const CLUSTER_TAG: &str = "kuryr.openstack.org/cluster=e2e";

/// The suite's cluster: [`NeutronCluster`] with the helpers this life uses.
struct World {
    c: NeutronCluster,
    /// The binder's token, bound to the node (the pool manager's calls are refused with it).
    binder_token_file: PathBuf,
}

impl std::ops::Deref for World {
    type Target = NeutronCluster;
    fn deref(&self) -> &NeutronCluster {
        &self.c
    }
}

async fn world() -> World {
    let t0 = Instant::now();
    let c = NeutronCluster::start(&[NS]).await.unwrap();
    eprintln!("keystone + neutron + kube-apiserver up in {:?}", t0.elapsed());
    let binder_token_file = c
        .kube
        .kuryr_token_file(SYSTEM_NAMESPACE, kuryr_tests::cluster::BINDER_ACCOUNT, Some(&c.node.host))
        .await
        .unwrap();
    World { c, binder_token_file }
}

impl World {
    fn allocator(&self, watcher: &Svc) -> Svc {
        let o = AllocatorOptions { status_poll_min: Some("200ms".into()), ..Default::default() };
        self.c.allocator(watcher, &o).unwrap()
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), NS)
    }

    async fn create_pod(&self, name: &str) -> String {
        self.pods().create(&PostParams::default(), &self.pod(name)).await.unwrap().metadata.uid.unwrap()
    }

    /// Every port of the pod network carrying the cluster's tag.
    async fn tagged_ports(&self) -> Vec<Port> {
        let f = Filter::new().network_id(&self.net.network_id).tags(&[CLUSTER_TAG]);
        self.neutron.list_ports(&f).await.unwrap()
    }
}

/// The value of a metric sample (`name{labels}` exactly as exposed); 0 when absent.
async fn metric(svc: &Svc, sample: &str) -> f64 {
    neutron::metric(&svc.metrics().await.unwrap(), sample)
}

async fn node_pool(svc: &Svc, node: &str) -> Option<Pool> {
    let mut c = PoolManagerClient::new(svc.channel().unwrap());
    let pools = c.list_pools(ListPoolsRequest {}).await.unwrap().into_inner().pools;
    pools.into_iter().find(|p| p.key.as_ref().is_some_and(|k| k.node_name == node))
}

/// Executes the shim for one pod as a runtime does; `prev` is the `prevResult` (CHECK).
fn cni_with(
    op: &str,
    binder: &Binder,
    name: &str,
    uid: &str,
    netns: &Arc<Netns>,
    prev: Option<&serde_json::Value>,
) -> ShimOutput {
    let pod = CniPod { namespace: NS.into(), name: name.into(), uid: uid.into(), netns: netns.clone() };
    pod.run(op, binder, prev, SLOW).unwrap()
}

fn cni(op: &str, binder: &Binder, name: &str, uid: &str, netns: &Arc<Netns>) -> ShimOutput {
    cni_with(op, binder, name, uid, netns, None)
}

/// Runs ADD for several pods at once; returns each result with how long it took.
async fn add_all(binder: &Arc<Binder>, pods: &[(String, String, Arc<Netns>)]) -> Vec<(serde_json::Value, Duration)> {
    let tasks: Vec<_> = pods
        .iter()
        .cloned()
        .map(|(name, uid, netns)| {
            let b = binder.clone();
            tokio::task::spawn_blocking(move || {
                let out = cni("ADD", &b, &name, &uid, &netns);
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
    result_ip(result, v6).unwrap_or_else(|| panic!("no {} address in {result}", if v6 { "IPv6" } else { "IPv4" }))
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
        let m = Scrape::http(&alloc.metrics_url).await?;
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
    let watcher = w.watcher().unwrap();
    let mut alloc = w.allocator(&watcher);
    alloc.wait_ready(SLOW).await.unwrap();
    let binder = Arc::new(
        w.binder(&alloc, SLOW, &[]).await.unwrap_or_else(|e| panic!("{e:#}\nthe allocator:\n{}", alloc.proc.logs())),
    );
    let alloc_before = Scrape::http(&alloc.metrics_url).await.unwrap();
    let binder_before = Scrape::in_netns(&w.node.netns_path(), "127.0.0.1:9631").await.unwrap();

    // 1. Cold pool: the first pod's port is created on its path.
    let t = Instant::now();
    let uid_a = w.create_pod("a").await;
    let va = alloc.wait_vif(&uid_a, SLOW).await.unwrap();
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
    let mut pm = PoolManagerClient::new(alloc.channel().unwrap());
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
    let vb = alloc.wait_vif(&uid_b, SLOW).await.unwrap();
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
    let ready = alloc.wait_vif(&uid_a, QUICK).await.unwrap();
    assert_eq!(ready.state(), VifState::Ready);
    let (a4, b4, b6) = (ip_of(&results[0].0, false), ip_of(&results[1].0, false), ip_of(&results[1].0, true));
    na.wait_ping(&b4, QUICK).await.unwrap();
    na.wait_ping(&b6, QUICK).await.unwrap();
    nb.wait_ping(&a4, QUICK).await.unwrap();
    let active = metric(&alloc, "kuryr_allocator_neutron_active_seconds_sum").await;
    eprintln!("plug report → ACTIVE seen: {:.2} s summed over 2 ports", active);
    pool_and_latency_metrics(&w, &alloc, &alloc_before, &binder_before).await.unwrap_or_else(|e| panic!("{e:#}"));

    // 4. kill -9 and restart: the same ports, pools recovered, no second port for a pod.
    let before = node_pool(&alloc, &w.node.host).await.unwrap();
    alloc.proc.kill().await.unwrap();
    let old_metrics = alloc.metrics_url.clone();
    drop(alloc);
    let mut alloc = w.allocator(&watcher);
    assert_ne!(alloc.metrics_url, old_metrics);
    alloc.wait_ready(SLOW).await.unwrap();
    assert_eq!(alloc.wait_vif(&uid_a, QUICK).await.unwrap().vif_id, va.vif_id);
    assert_eq!(alloc.wait_vif(&uid_b, QUICK).await.unwrap().vif_id, vb.vif_id);
    let after = node_pool(&alloc, &w.node.host).await.unwrap();
    assert_eq!(after.in_use, 2, "{after:?}");
    let ids = |p: &Pool| p.free_port_ids.iter().cloned().collect::<BTreeSet<_>>();
    if ids(&after) != ids(&before) {
        // What Neutron says of the ports that moved, to tell a recovery bug from a port that changed.
        let mut seen = Vec::new();
        for id in ids(&before).symmetric_difference(&ids(&after)) {
            seen.push(match w.neutron.get_port(id).await {
                Ok(p) => {
                    format!("{id}: status {} device_id {:?} vif_type {:?}", p.status, p.device_id, p.binding_vif_type)
                }
                Err(e) => format!("{id}: {e}"),
            });
        }
        panic!(
            "the free ports recovered from Neutron differ: before {before:?}\nafter {after:?}\n{seen:#?}\n{}",
            alloc.proc.logs()
        );
    }
    for uid in [&uid_a, &uid_b] {
        let mine = w.neutron.list_ports(&Filter::new().device_id(uid.as_str())).await.unwrap();
        assert_eq!(mine.len(), 1, "pod {uid} holds {} ports", mine.len());
    }
    // The binder follows the new allocator: its pods are still served.
    let check = tokio::task::spawn_blocking({
        let (b, na, uid, prev) = (binder.clone(), na.clone(), uid_a.clone(), results[0].0.clone());
        move || cni_with("CHECK", &b, "a", &uid, &na, Some(&prev))
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
    let mut c = VifAllocatorClient::new(alloc.channel().unwrap());
    let none = c.get_vif(GetVifRequest { pod_uid: uid_c.clone() }).await.unwrap_err();
    assert_eq!(none.code(), tonic::Code::NotFound, "no VIF while Neutron is down");
    let nc = Arc::new(Netns::new("pnc").unwrap());
    let add_c = tokio::task::spawn_blocking({
        let (b, nc, uid) = (binder.clone(), nc.clone(), uid_c.clone());
        move || cni("ADD", &b, "c", &uid, &nc)
    });
    // Neutron comes back only once the binder holds c's ADD, waiting for its VIF.
    wait_until("c's ADD waiting for its VIF in the binder", SLOW, || async {
        let waiting = binder.scrape().await?.value("kuryr_cni_adds_waiting", &[("stage", "vif")])?;
        anyhow::ensure!(waiting >= 1.0, "{waiting} ADDs waiting");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", binder.logs()));
    w.os.start_process("neutron-api").await.unwrap();
    let vc = alloc.wait_vif(&uid_c, SLOW).await.unwrap();
    let vd = alloc.wait_vif(&uid_d, SLOW).await.unwrap();
    assert_ne!(vc.vif_id, vd.vif_id);
    let out = add_c.await.unwrap();
    assert_eq!(out.code, 0, "ADD c once Neutron is back: {} {}\n{}", out.stdout, out.stderr, binder.logs());
    assert_eq!(ip_of(&out.json().unwrap(), false), vc.ips[0].address.split('/').next().unwrap());
    nc.wait_ping(&a4, QUICK).await.unwrap();
    // A create Neutron carried out while its answer was lost (the API stopped or too slow to
    // answer in time) leaves the pod a second port for a moment: the allocator's audit deletes
    // it when two rounds in a row see it (3 s each here). What stays is the VIF's port.
    for (uid, vif) in [(&uid_c, &vc), (&uid_d, &vd)] {
        wait_until(&format!("pod {uid} to hold exactly its VIF's port"), SLOW, || async {
            let mine = w.neutron.list_ports(&Filter::new().device_id(uid.as_str())).await?;
            let ids: Vec<&str> = mine.iter().map(|p| p.id.as_str()).collect();
            anyhow::ensure!(ids == [vif.vif_id.as_str()], "ports {ids:?}, VIF {}", vif.vif_id);
            Ok(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
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
    alloc.wait_ready(SLOW).await.unwrap();
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
        let out = tokio::task::spawn_blocking(move || cni("DEL", &b, &name, &uid, &netns)).await.unwrap();
        assert_eq!(out.code, 0, "DEL: {} {}", out.stdout, out.stderr);
    }
    for name in ["a", "b", "c", "d"] {
        pods.delete(name, &grace0).await.unwrap();
    }
    objects::wait_no_pods(&pods, "the pods to be gone", SLOW)
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
    let text = alloc.metrics().await.unwrap();
    let calls = neutron::metric_sum(&text, "openstack_requests_total", &[r#"service="network""#]);
    let recycled = metric(&alloc, "kuryr_allocator_neutron_port_recycles_total").await;
    eprintln!("last allocator run: {calls} Neutron calls (recovery, GC, 4 releases), {recycled} ports recycled");
}
