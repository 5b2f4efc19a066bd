//! kuryr-vif-allocator `--backend neutron --neutron-namespace-subnets` against the real parts: a
//! real kube-apiserver with kube-controller-manager's namespace controller (it empties a deleted
//! namespace and removes its `kubernetes` finalizer, as in a cluster), kuryr-watcher and
//! kuryr-vif-allocator under their service accounts, Keystone (the allocator logs in with the
//! `kuryr` user's password), the real Neutron API + RPC server + ML2/OVS agent on a private
//! userspace Open vSwitch, and a kuryr-binder on that `br-int`, CNI through the `kuryr-cni` shim.
//!
//! The test Neutron runs no L3 agent (tests/env/openstack starts the router service plugin, so
//! routers and their interfaces exist in the API, but nothing implements them in the datapath):
//! the router interfaces are asserted through the API, and pings go between pods of one
//! namespace, not across namespaces.
//!
//! 1. two namespaces with pods → two networks, each with an IPv4 and an IPv6 subnet from the
//!    subnet pools and the router's interfaces on them (read back from Neutron), tagged for the
//!    cluster and the namespace, recorded Ready in NamespaceNetworks, a finalizer on each
//!    namespace, an Event; pods get ports and addresses on their namespace's subnets, per-network
//!    pools; CNI ADD returns the addresses and two pods of one namespace ping each other;
//! 2. allocator kill -9 and restart: the same networks (no duplicate by tag, no second subnet or
//!    router interface), a new pod of a known namespace lands on the same network;
//! 3. a namespace deleted: its network stays while its pod holds a port (record Deleting); once
//!    the pod is gone, its pool ports, router interfaces, subnets and network are gone, no port
//!    is left on it, the record and the finalizer are removed and the namespace disappears; the
//!    other namespace's network is untouched.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_openstack::Filter;
use kuryr_openstack::neutron::{Port, RouterCreate, SubnetPoolCreate};
use kuryr_proto::allocator::v1::pool_manager_client::PoolManagerClient;
use kuryr_proto::allocator::v1::{ListPoolsRequest, PoolKey, PopulatePoolRequest};
use kuryr_tests::cluster::controllers::ControllerManager;
use kuryr_tests::metrics::wait_metric;
use kuryr_tests::netns::Netns;
use kuryr_tests::neutron::{CniPod, NeutronCluster, SLOW, Svc, cluster_tag, metric, spawn};
use kuryr_tests::services::wait_until;
use kuryr_tests::shim::result_ip;
use kuryr_vif_allocator::k8s::crd::{NamespaceNetwork, NamespaceNetworkPhase};

const CLUSTER_ID: &str = "e2e-ns";
const FINALIZER: &str = "kuryr.openstack.org/namespace-network";
const POOL_V4: &str = "10.60.0.0/16";
const POOL_V6: &str = "fd00:60::/48";

struct Fixture {
    c: NeutronCluster,
    pool_v4: String,
    pool_v6: String,
    router: String,
}

impl Fixture {
    fn allocator(&self, watcher: &Svc) -> Svc {
        let mut args = self.c.allocator_base_args(watcher);
        args.extend(
            [
                "--neutron-namespace-subnets",
                "--neutron-subnet-pool",
                &self.pool_v4,
                "--neutron-subnet-pool-v6",
                &self.pool_v6,
                "--neutron-router",
                &self.router,
                "--cluster-id",
                "e2e-ns",
                "--pool-min",
                "1",
                "--pool-batch",
                "2",
                "--orphan-gc-interval",
                "5s",
                "--status-poll-min",
                "200ms",
                "--instance",
                "alloc-ns",
                "--log",
                "info,kuryr_vif_allocator=debug",
            ]
            .iter()
            .map(ToString::to_string),
        );
        let svc = spawn("kuryr-vif-allocator", args, self.c.dir.path()).unwrap();
        Svc { token: self.c.pool_manager_token.clone(), ..svc }
    }

    async fn create_pod(&self, ns: &str, name: &str) -> String {
        let pods: Api<Pod> = Api::namespaced(self.c.admin.clone(), ns);
        pods.create(&PostParams::default(), &self.c.pod(name)).await.unwrap().metadata.uid.unwrap()
    }

    fn cni_pod(&self, ns: &str, name: &str, uid: &str) -> CniPod {
        let netns = Arc::new(Netns::new(&format!("p{}", &uid[..6])).unwrap());
        CniPod { namespace: ns.into(), name: name.into(), uid: uid.into(), netns }
    }

    async fn record(&self, ns: &str) -> Option<NamespaceNetwork> {
        let api: Api<NamespaceNetwork> = Api::all(self.c.admin.clone());
        api.get_opt(ns).await.unwrap()
    }

    /// The Ready record of a namespace, waited for.
    async fn ready_record(&self, ns: &str, alloc: &Svc) -> NamespaceNetwork {
        wait_until(&format!("NamespaceNetwork {ns} Ready"), SLOW, || async {
            let r = self.record(ns).await.ok_or_else(|| anyhow::anyhow!("no record"))?;
            let phase = r.status.as_ref().and_then(|s| s.phase);
            anyhow::ensure!(phase == Some(NamespaceNetworkPhase::Ready), "{:?}", r.status);
            Ok(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
        self.record(ns).await.unwrap()
    }

    /// Networks tagged for the cluster and the namespace.
    async fn tagged_networks(&self, ns: &str) -> Vec<String> {
        let tags = [cluster_tag(CLUSTER_ID), format!("kuryr.openstack.org/namespace={ns}")];
        let nets = self.c.neutron.list_networks(&Filter::new().tags(&tags)).await.unwrap();
        nets.into_iter().map(|n| n.id).collect()
    }

    async fn ports_on(&self, network: &str) -> Vec<Port> {
        self.c.neutron.list_ports(&Filter::new().network_id(network)).await.unwrap()
    }

    async fn namespace_finalizers(&self, ns: &str) -> Option<Vec<String>> {
        let api: Api<Namespace> = Api::all(self.c.admin.clone());
        api.get_opt(ns).await.unwrap().map(|n| n.metadata.finalizers.unwrap_or_default())
    }
}

/// A CIDR as (network bits, prefix length, IPv6).
fn cidr(s: &str) -> (u128, u8, bool) {
    let (addr, len) = s.split_once('/').unwrap_or((s, if s.contains(':') { "128" } else { "32" }));
    let ip: IpAddr = addr.parse().unwrap();
    let bits = match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    };
    (bits, len.parse().unwrap(), ip.is_ipv6())
}

/// Whether `inner` (an address or CIDR) lies within `outer`.
fn within(inner: &str, outer: &str) -> bool {
    let ((a, alen, a6), (b, blen, b6)) = (cidr(inner), cidr(outer));
    let width = if b6 { 128 } else { 32 };
    let shift = width - u32::from(blen);
    a6 == b6 && alen >= blen && (shift >= 128 || (a >> shift) == (b >> shift))
}

fn in_subnets(addr: &str, cidrs: &[String]) -> bool {
    cidrs.iter().any(|c| within(addr, c))
}

fn ip_of(result: &serde_json::Value, v6: bool) -> String {
    result_ip(result, v6).unwrap_or_else(|| panic!("no {} address in {result}", if v6 { "IPv6" } else { "IPv4" }))
}

#[tokio::test]
async fn a_network_per_namespace_made_found_again_and_removed_with_the_namespace() {
    let c = NeutronCluster::start(&["team-a", "team-b"]).await.unwrap();
    let kcm = ControllerManager::start_with(&c.kube, c.dir.path(), "namespace-controller").await.unwrap();
    let project = c.net.project_id.clone();
    let pool = |name: &str, prefix: &str, len: u8| SubnetPoolCreate {
        name: name.into(),
        prefixes: vec![prefix.into()],
        default_prefixlen: Some(len),
        project_id: Some(project.clone()),
        shared: None,
    };
    let pool_v4 = c.neutron.create_subnetpool(pool("kuryr-ns-v4", POOL_V4, 24)).await.unwrap().id;
    let pool_v6 = c.neutron.create_subnetpool(pool("kuryr-ns-v6", POOL_V6, 64)).await.unwrap().id;
    let router = c
        .neutron
        .create_router(RouterCreate {
            name: Some("kuryr-ns".into()),
            project_id: Some(project.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    let f = Fixture { c, pool_v4, pool_v6, router };
    let watcher = f.c.watcher().unwrap();
    let mut alloc = f.allocator(&watcher);
    alloc.wait_ready(SLOW).await.unwrap();
    let binder = Arc::new(f.c.binder(&alloc, SLOW, &[]).await.unwrap());

    // 1. Two namespaces with pods: two networks, subnets from the pools, router interfaces.
    let uid_a1 = f.create_pod("team-a", "a1").await;
    let uid_b1 = f.create_pod("team-b", "b1").await;
    let (va1, vb1) = (alloc.wait_vif(&uid_a1, SLOW).await.unwrap(), alloc.wait_vif(&uid_b1, SLOW).await.unwrap());
    let mut nets = Vec::new();
    for (ns, v) in [("team-a", &va1), ("team-b", &vb1)] {
        let rec = f.ready_record(ns, &alloc).await;
        let st = rec.status.clone().unwrap();
        let net = st.network_id.clone().unwrap();
        assert_eq!(rec.spec.namespace, ns);
        assert_eq!(st.router_id.as_deref(), Some(f.router.as_str()));
        assert_eq!(f.tagged_networks(ns).await, std::slice::from_ref(&net), "one network tagged for {ns}");
        let network = f.c.neutron.get_network(&net).await.unwrap();
        assert_eq!(network.project_id.as_deref(), Some(project.as_str()));
        assert_eq!(st.subnets.len(), 2, "{st:?}");
        let mut cidrs = Vec::new();
        for s in &st.subnets {
            let subnet = f.c.neutron.get_subnet(&s.id).await.unwrap();
            assert_eq!(subnet.network_id, net);
            assert_eq!(subnet.cidr, s.cidr);
            let (pool, prefix, len) =
                if subnet.ip_version == 4 { (&f.pool_v4, POOL_V4, 24) } else { (&f.pool_v6, POOL_V6, 64) };
            assert_eq!(subnet.subnetpool_id.as_deref(), Some(pool.as_str()));
            assert_eq!(cidr(&subnet.cidr).1, len, "{}", subnet.cidr);
            assert!(within(&subnet.cidr, prefix), "{} outside {prefix}", subnet.cidr);
            assert!(subnet.tags.contains(&cluster_tag(CLUSTER_ID)), "{:?}", subnet.tags);
            // The router's interface on the subnet holds its gateway address.
            let rports: Vec<Port> = f
                .ports_on(&net)
                .await
                .into_iter()
                .filter(|p| p.device_id == f.router && p.device_owner == "network:router_interface")
                .collect();
            let on: Vec<&Port> = rports
                .iter()
                .filter(|p| p.fixed_ips.iter().any(|x| x.subnet_id.as_deref() == Some(subnet.id.as_str())))
                .collect();
            assert_eq!(on.len(), 1, "router ports on {}: {rports:?}", subnet.id);
            assert_eq!(s.router_port_id.as_deref(), Some(on[0].id.as_str()));
            let gw = on[0].fixed_ips.iter().find(|x| x.subnet_id.as_deref() == Some(subnet.id.as_str())).unwrap();
            assert_eq!(gw.ip_address, subnet.gateway_ip, "the interface is the subnet's gateway");
            cidrs.push(subnet.cidr.clone());
        }
        // The pod's port is on its namespace's network, its addresses on its subnets.
        assert_eq!(v.network_id, net);
        let port = f.c.neutron.get_port(&v.vif_id).await.unwrap();
        assert_eq!(port.network_id, net);
        assert_eq!(v.ips.len(), 2, "{:?}", v.ips);
        for ip in &v.ips {
            assert!(in_subnets(&ip.address, &cidrs), "{} not in {cidrs:?}", ip.address);
        }
        let fins = f.namespace_finalizers(ns).await.unwrap();
        assert!(fins.iter().any(|x| x == FINALIZER), "{ns} finalizers {fins:?}");
        nets.push((net, cidrs));
    }
    assert_ne!(nets[0].0, nets[1].0);
    let (net_a, cidrs_a) = nets[0].clone();
    let (net_b, _) = nets[1].clone();
    let events: Api<Event> = Api::namespaced(f.c.admin.clone(), "default");
    let ready_events = events.list(&ListParams::default()).await.unwrap().items;
    assert!(
        ready_events.iter().any(|e| e.reason.as_deref() == Some("NamespaceNetworkReady")
            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("team-a")),
        "no NamespaceNetworkReady Event for team-a"
    );
    // Pools are per namespace network.
    let pm = PoolManagerClient::new(alloc.channel().unwrap());
    wait_until("a pool on each namespace network", SLOW, || {
        let mut pm = pm.clone();
        let want: BTreeSet<String> = [net_a.clone(), net_b.clone()].into();
        async move {
            let pools = pm.list_pools(ListPoolsRequest {}).await?.into_inner().pools;
            let have: BTreeSet<String> =
                pools.iter().filter_map(|p| p.key.as_ref().map(|k| k.network_id.clone())).collect();
            anyhow::ensure!(have == want, "pools on {have:?}");
            Ok(())
        }
    })
    .await
    .unwrap();
    // PopulatePool names the namespace's network; without one there is no pool to fill.
    let mut pmc = pm.clone();
    let key =
        |network: &str| PoolKey { node_name: f.c.node.host.clone(), network_id: network.into(), ..Default::default() };
    let bad = pmc.populate_pool(PopulatePoolRequest { key: Some(key("")), count: 1 }).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad}");
    assert!(bad.message().contains("namespace networks"), "{bad}");
    pmc.populate_pool(PopulatePoolRequest { key: Some(key(&net_a)), count: 3 }).await.unwrap();
    let free_a = wait_until("team-a's pool to hold 3 free ports", SLOW, || {
        let mut pmc = pmc.clone();
        let net_a = net_a.clone();
        async move {
            let pools = pmc.list_pools(ListPoolsRequest {}).await?.into_inner().pools;
            let p = pools.into_iter().find(|p| p.key.as_ref().is_some_and(|k| k.network_id == net_a));
            let free = p.map(|p| p.free_port_ids).unwrap_or_default();
            anyhow::ensure!(free.len() >= 3, "free {free:?}");
            Ok(free)
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    for id in &free_a {
        assert_eq!(f.c.neutron.get_port(id).await.unwrap().network_id, net_a);
    }
    assert_eq!(
        metric(&alloc.metrics().await.unwrap(), r#"kuryr_allocator_namespace_network_operations_total{op="create"}"#),
        2.0
    );

    // CNI ADD: addresses from the namespace's subnets; two pods of team-a ping each other.
    let uid_a2 = f.create_pod("team-a", "a2").await;
    let va2 = alloc.wait_vif(&uid_a2, SLOW).await.unwrap();
    assert_eq!(va2.network_id, net_a);
    let (pa1, pa2, pb1) =
        (f.cni_pod("team-a", "a1", &uid_a1), f.cni_pod("team-a", "a2", &uid_a2), f.cni_pod("team-b", "b1", &uid_b1));
    let mut results = Vec::new();
    for p in [&pa1, &pa2, &pb1] {
        let (p, b) = (p.clone(), binder.clone());
        let out = tokio::task::spawn_blocking(move || p.run("ADD", &b, None, SLOW).unwrap()).await.unwrap();
        assert_eq!(out.code, 0, "ADD: {} {}\n{}", out.stdout, out.stderr, binder.logs());
        results.push(out.json().unwrap());
    }
    assert!(in_subnets(&format!("{}/32", ip_of(&results[0], false)), &cidrs_a));
    pa1.netns.wait_ping(&ip_of(&results[1], false), Duration::from_secs(60)).await.unwrap();
    pa2.netns.wait_ping(&ip_of(&results[0], true), Duration::from_secs(60)).await.unwrap();

    // 2. kill -9 and restart: the same networks, nothing made twice.
    alloc.proc.kill().await.unwrap();
    drop(alloc);
    let alloc = f.allocator(&watcher);
    alloc.wait_ready(SLOW).await.unwrap();
    assert_eq!(alloc.wait_vif(&uid_a1, SLOW).await.unwrap().vif_id, va1.vif_id);
    let uid_a3 = f.create_pod("team-a", "a3").await;
    let va3 = alloc.wait_vif(&uid_a3, SLOW).await.unwrap();
    assert_eq!(va3.network_id, net_a, "a known namespace's pod lands on its network");
    for (ns, net) in [("team-a", &net_a), ("team-b", &net_b)] {
        assert_eq!(f.tagged_networks(ns).await, std::slice::from_ref(net), "no second network for {ns}");
        let subnets = f.c.neutron.list_subnets(&Filter::new().network_id(net.as_str())).await.unwrap();
        assert_eq!(subnets.len(), 2, "no second subnet on {net}");
        let rports = f.ports_on(net).await.into_iter().filter(|p| p.device_owner == "network:router_interface").count();
        assert!((1..=2).contains(&rports), "{rports} router ports on {net}");
    }
    assert_eq!(
        metric(&alloc.metrics().await.unwrap(), "kuryr_allocator_namespace_network_networks"),
        2.0,
        "both networks loaded at start"
    );

    // 3. team-b deleted: the network waits for the pod, then everything goes.
    let namespaces: Api<Namespace> = Api::all(f.c.admin.clone());
    namespaces.delete("team-b", &DeleteParams::default()).await.unwrap();
    wait_until("team-b's record to say it waits for its pod", SLOW, || async {
        let st = f.record("team-b").await.and_then(|r| r.status).unwrap_or_default();
        anyhow::ensure!(st.phase == Some(NamespaceNetworkPhase::Deleting), "{st:?}");
        anyhow::ensure!(st.message.as_deref().is_some_and(|m| m.contains("waiting")), "{st:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    f.c.neutron.get_network(&net_b).await.expect("the network stays while a pod holds a port on it");
    // The runtime tears the pod down and the kubelet confirms its deletion.
    let (p, b) = (pb1.clone(), binder.clone());
    let out = tokio::task::spawn_blocking(move || p.run("DEL", &b, None, SLOW).unwrap()).await.unwrap();
    assert_eq!(out.code, 0, "DEL b1: {} {}", out.stdout, out.stderr);
    let pods_b: Api<Pod> = Api::namespaced(f.c.admin.clone(), "team-b");
    let grace0 = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    let _ = pods_b.delete("b1", &grace0).await;
    wait_until("team-b to be gone", SLOW, || async {
        anyhow::ensure!(namespaces.get_opt("team-b").await?.is_none(), "team-b still exists");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}\n---- kcm ----\n{}", alloc.proc.logs(), kcm.logs()));
    assert!(f.record("team-b").await.is_none(), "team-b's record left");
    assert!(f.c.neutron.get_network(&net_b).await.unwrap_err().is_not_found(), "team-b's network left");
    assert!(f.tagged_networks("team-b").await.is_empty());
    assert!(f.ports_on(&net_b).await.is_empty(), "ports left on team-b's network");
    let subnets_b = f.c.neutron.list_subnets(&Filter::new().network_id(net_b.as_str())).await.unwrap();
    assert!(subnets_b.is_empty(), "subnets left: {subnets_b:?}");
    let router_ports = f.c.neutron.list_ports(&Filter::new().device_id(f.router.as_str())).await.unwrap();
    assert!(router_ports.iter().all(|p| p.network_id != net_b), "router interface left on team-b's network");
    let tagged = f.c.neutron.list_ports(&Filter::new().tags(&[cluster_tag(CLUSTER_ID)])).await.unwrap();
    assert!(tagged.iter().all(|p| p.network_id == net_a), "a cluster port off team-a's network: {tagged:?}");
    let mut pm = PoolManagerClient::new(alloc.channel().unwrap());
    let pools = pm.list_pools(ListPoolsRequest {}).await.unwrap().into_inner().pools;
    assert!(
        pools.iter().all(|p| p.key.as_ref().is_some_and(|k| k.network_id != net_b) || p.free_port_ids.is_empty()),
        "free pool ports left on team-b's network: {pools:?}"
    );
    // Counted after the finalizer's removal (which let the namespace go).
    let m = wait_metric(r#"kuryr_allocator_namespace_network_operations_total{op="delete"}"#, 1.0, SLOW, || {
        alloc.metrics()
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(metric(&m, "kuryr_allocator_namespace_network_networks"), 1.0);
    // team-a is untouched.
    let rec_a = f.ready_record("team-a", &alloc).await;
    assert_eq!(rec_a.status.unwrap().network_id.as_deref(), Some(net_a.as_str()));
    assert!(f.namespace_finalizers("team-a").await.unwrap().iter().any(|x| x == FINALIZER));
    assert_eq!(alloc.wait_vif(&uid_a1, SLOW).await.unwrap().vif_id, va1.vif_id);
    pa1.netns.wait_ping(&ip_of(&results[1], false), Duration::from_secs(60)).await.unwrap();
}
