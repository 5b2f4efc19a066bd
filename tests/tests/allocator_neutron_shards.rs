//! Two kuryr-vif-allocator replicas with `--backend neutron` splitting the nodes, and with them
//! the nodes' port pools, through the allocator's Leases — against the real parts: a real
//! kube-apiserver and kuryr-watcher, Keystone, and Neutron (API, RPC server) with two nodes, each
//! a network namespace with its own Open vSwitch and ML2/OVS agent, so that ports bound to
//! either host bind. Two shards (`--shards 2`), so each replica owns exactly one; the second
//! node's name is picked so that the two nodes fall in different shards. Lease duration 3 s.
//!
//! 1. Each replica owns one shard; pods on both nodes get ports, each from the replica of its
//!    node; each replica lists only its own node's pools, and a PopulatePool for the other's
//!    node is refused with UNAVAILABLE naming the owner.
//! 2. A burst of pods on both nodes; while it is being allocated, kill -9 of the replica that
//!    owns the first node. The survivor holds both shards within the Lease duration and gives
//!    every pod a VIF. Then, in Neutron (counted by the cluster's tag): every live pod has
//!    exactly one port, with `device_id` = its uid and bound to its node; every PodVif names its
//!    pod's port; no port is named by two PodVifs.
//! 3. Every pod deleted: no port is held any more, every port of the cluster is in one of the
//!    survivor's pools (none leaked by the killed replica), and freeing the pools leaves zero
//!    ports of the cluster in Neutron.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_openstack::Filter;
use kuryr_openstack::neutron::Port;
use kuryr_proto::allocator::v1::pool_manager_client::PoolManagerClient;
use kuryr_proto::allocator::v1::{FreePoolRequest, ListPoolsRequest, PoolKey, PopulatePoolRequest};
use kuryr_proto::service_names::VIF_ALLOCATOR;
use kuryr_tests::control::shard_holders;
use kuryr_tests::neutron::{NeutronCluster, Svc, spawn};
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use kuryr_vif_allocator::k8s::crd::PodVif;

const NS: &str = "neutron-shards";
const CLUSTER_ID: &str = "e2e-shards";
const SHARDS: u32 = 2;
/// Bound on changes that go through Neutron and its agents on a loaded machine.
const SLOW: Duration = Duration::from_secs(240);
/// Pods in phase 1 and in the burst of phase 2, per node.
const FIRST: usize = 3;
const BURST: usize = 10;

/// The shard of a node: FNV-1a 64 of its name, modulo the shards, as kuryr-shard documents it.
fn shard_of(node: &str) -> u32 {
    let h = node.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    (h % u64::from(SHARDS)) as u32
}

fn pod(name: &str, node: &str) -> Pod {
    objects::pod(name).node(node).build()
}

/// A replica in a directory of its own (its unix socket and logs).
fn replica(c: &NeutronCluster, watcher: &Svc, id: &str, dir: PathBuf) -> Svc {
    std::fs::create_dir_all(&dir).unwrap();
    let mut args = c.allocator_base_args(watcher);
    let flags = [
        "--pod-network-id",
        &c.net.network_id,
        "--pod-subnet-ids",
        &format!("{},{}", c.net.subnet_v4_id, c.net.subnet_v6_id),
        "--cluster-id",
        CLUSTER_ID,
        "--pool-min",
        "2",
        "--pool-batch",
        "3",
        "--orphan-gc-interval",
        "3s",
        "--instance",
        id,
        "--replica-id",
        id,
        "--shards",
        &SHARDS.to_string(),
        "--lease-duration",
        "3s",
        "--log",
        "info,kuryr_vif_allocator=debug,kuryr_shard=debug",
    ];
    args.extend(flags.iter().map(ToString::to_string));
    Svc { token: c.pool_manager_token.clone(), ..spawn("kuryr-vif-allocator", args, &dir).unwrap() }
}

fn logs(c: &NeutronCluster, replicas: &[&Svc]) -> String {
    let mut out = String::new();
    for r in replicas {
        out.push_str(&format!("==== allocator {}\n{}\n", r.addr, r.proc.logs()));
    }
    out.push_str(&format!("==== neutron-api\n{}\n", c.os.log_tail("neutron-api", 40)));
    out
}

/// The cluster's ports in Neutron (by its tag).
async fn cluster_ports(c: &NeutronCluster) -> Vec<Port> {
    let tag = format!("kuryr.openstack.org/cluster={CLUSTER_ID}");
    c.neutron.list_ports(&Filter::new().tags(std::slice::from_ref(&tag))).await.unwrap()
}

/// Pod uid → (node, port id) of every PodVif with a VIF.
async fn recorded(admin: &kube::Client) -> BTreeMap<String, (String, String)> {
    let api: Api<PodVif> = Api::namespaced(admin.clone(), NS);
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| {
            let vif = p.vif()?.vif_id.clone();
            Some((p.spec.pod_uid.clone(), (p.spec.node_name.clone(), vif)))
        })
        .collect()
}

/// The node names of the pools a replica lists.
async fn pool_nodes(r: &Svc) -> anyhow::Result<BTreeSet<String>> {
    let mut pm = PoolManagerClient::new(r.channel()?);
    let pools = pm.list_pools(ListPoolsRequest {}).await?.into_inner().pools;
    Ok(pools.into_iter().filter_map(|p| p.key.map(|k| k.node_name)).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_split_the_pools_and_a_killed_ones_go_to_the_survivor() {
    // The second node: the first name whose shard differs from the agent host's.
    let first = "node-1";
    let second = (2..100).map(|i| format!("node-{i}")).find(|n| shard_of(n) != shard_of(first)).unwrap();
    let c = NeutronCluster::start_with_nodes(&[NS], &[&second]).await.unwrap();
    assert_eq!(c.node.host, first, "the agent host of up.sh");
    let nodes = [first.to_string(), second.clone()];
    let watcher = c.watcher().unwrap();
    watcher.wait_ready(Duration::from_secs(120)).await.unwrap();
    let a = replica(&c, &watcher, "alloc-a", c.dir.path().join("a"));
    let b = replica(&c, &watcher, "alloc-b", c.dir.path().join("b"));
    let mut replicas = vec![a, b];

    // 1. One shard each.
    let holders = wait_until("each replica holding one shard", SLOW, || async {
        let h = shard_holders(&c.admin, "kuryr-vif-allocator").await?;
        let by: BTreeSet<&str> = h.values().map(|(id, _)| id.as_str()).collect();
        anyhow::ensure!(h.len() == SHARDS as usize && by.len() == 2, "{h:?}");
        Ok(h)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&c, &replicas.iter().collect::<Vec<_>>())));
    let owner_id = |node: &str| holders[&shard_of(node)].0.clone();
    let by_id = |id: &str| if id == "alloc-a" { 0 } else { 1 };
    for r in &replicas {
        wait_until("replica SERVING", SLOW, || async {
            kuryr_runtime::client::check_serving(kuryr_runtime::client::channel(&r.addr)?, VIF_ALLOCATOR).await
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", r.proc.logs()));
    }

    let pods: Api<Pod> = Api::namespaced(c.admin.clone(), NS);
    let create = |names: Vec<(String, String)>| {
        let pods = pods.clone();
        async move {
            join_all(names.into_iter().map(|(name, node)| {
                let pods = pods.clone();
                async move { pods.create(&PostParams::default(), &pod(&name, &node)).await.unwrap() }
            }))
            .await
            .into_iter()
            .map(|p| p.metadata.uid.unwrap())
            .collect::<Vec<_>>()
        }
    };
    let batch = |prefix: &str, per_node: usize| {
        nodes
            .iter()
            .flat_map(|n| (0..per_node).map(move |i| (format!("{prefix}-{n}-{i}"), n.clone())))
            .collect::<Vec<_>>()
    };
    let mut uids = create(batch("first", FIRST)).await;
    let all_recorded = |want: usize| {
        let admin = c.admin.clone();
        async move {
            let r = recorded(&admin).await;
            anyhow::ensure!(r.len() == want, "{} of {want} pods have a VIF", r.len());
            Ok(r)
        }
    };
    wait_until("the first pods' VIFs", SLOW, || all_recorded(uids.len()))
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&c, &replicas.iter().collect::<Vec<_>>())));

    // Each replica's pools are its own node's; the other's node is refused with its owner.
    for node in &nodes {
        let mine = &replicas[by_id(&owner_id(node))];
        let other = &replicas[1 - by_id(&owner_id(node))];
        wait_until(&format!("{node}'s pool listed by its owner only"), SLOW, || async {
            let (m, o) = (pool_nodes(mine).await?, pool_nodes(other).await?);
            anyhow::ensure!(m.contains(node) && !o.contains(node), "owner lists {m:?}, the other {o:?}");
            Ok(())
        })
        .await
        .unwrap();
        let mut pm = PoolManagerClient::new(other.channel().unwrap());
        let key = PoolKey { node_name: node.clone(), ..Default::default() };
        let err = pm.populate_pool(PopulatePoolRequest { key: Some(key), count: 1 }).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        let trailer = err.metadata().get("kuryr-shard-owner").and_then(|v| v.to_str().ok()).map(str::to_string);
        assert_eq!(trailer.as_deref(), Some(mine.addr.as_str()), "{err:?}");
    }

    // 2. The burst; kill -9 of the first node's replica while it is being allocated.
    let victim = by_id(&owner_id(first));
    let burst = tokio::spawn(create(batch("burst", BURST)));
    wait_until("some of the burst allocated", SLOW, || async {
        let n = recorded(&c.admin).await.len();
        anyhow::ensure!(n >= uids.len() + 3, "{n}");
        Ok(())
    })
    .await
    .unwrap();
    replicas[victim].proc.kill().await.unwrap();
    uids.extend(burst.await.unwrap());
    let survivor = &replicas[1 - victim];
    let survivor_id = if victim == 0 { "alloc-b" } else { "alloc-a" };
    wait_until("the survivor holding both shards", SLOW, || async {
        let h = shard_holders(&c.admin, "kuryr-vif-allocator").await?;
        anyhow::ensure!(h.len() == 2 && h.values().all(|(id, _)| id == survivor_id), "{h:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", survivor.proc.logs()));
    let vifs = wait_until("every pod's VIF", SLOW, || all_recorded(uids.len()))
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&c, &replicas.iter().collect::<Vec<_>>())));

    // One port per live pod, bound to its node, the one its PodVif names; none named twice.
    let live: BTreeSet<String> = uids.iter().cloned().collect();
    let check = || async {
        let ports = cluster_ports(&c).await;
        let mut by_pod: HashMap<String, Vec<&Port>> = HashMap::new();
        for p in ports.iter().filter(|p| !p.device_id.is_empty()) {
            by_pod.entry(p.device_id.clone()).or_default().push(p);
        }
        for (uid, held) in &by_pod {
            anyhow::ensure!(live.contains(uid), "port {} held by {uid}, which is no pod", held[0].id);
        }
        for uid in &live {
            let held = by_pod.get(uid).map(Vec::as_slice).unwrap_or_default();
            anyhow::ensure!(held.len() == 1, "pod {uid} holds {} ports: {held:?}", held.len());
            let (node, vif) = &vifs[uid];
            anyhow::ensure!(held[0].id == *vif, "pod {uid}: PodVif names {vif}, Neutron has {}", held[0].id);
            anyhow::ensure!(held[0].binding_host_id.as_deref() == Some(node.as_str()), "{:?}", held[0]);
            anyhow::ensure!(!held[0].binding_failed(), "{:?}", held[0]);
        }
        Ok(ports.len())
    };
    // A duplicate made in the kill's window is cleaned up by the survivor: wait for it.
    let total = wait_until("one port per pod in Neutron", SLOW, check)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", survivor.proc.logs()));
    let named: BTreeSet<&String> = vifs.values().map(|(_, v)| v).collect();
    assert_eq!(named.len(), vifs.len(), "a port named by two PodVifs: {vifs:?}");
    eprintln!("{} pods, {} ports of the cluster in Neutron after the takeover", live.len(), total);

    // 3. Every pod deleted: nothing held; every port in the survivor's pools; none after FreePool.
    let names: Vec<String> =
        pods.list(&ListParams::default()).await.unwrap().items.into_iter().filter_map(|p| p.metadata.name).collect();
    // No kubelet confirms the deletion: at once.
    let grace0 = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    for n in &names {
        pods.delete(n, &grace0).await.unwrap();
    }
    objects::wait_no_pods(&pods, "every pod gone (finalizers released)", SLOW)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", survivor.proc.logs()));
    wait_until("every port of the cluster free in one of the survivor's pools", SLOW, || async {
        let ports = cluster_ports(&c).await;
        let held: Vec<&Port> = ports.iter().filter(|p| !p.device_id.is_empty()).collect();
        anyhow::ensure!(held.is_empty(), "ports still held: {held:?}");
        let mut pm = PoolManagerClient::new(survivor.channel()?);
        let pools = pm.list_pools(ListPoolsRequest {}).await?.into_inner().pools;
        let pooled: BTreeSet<String> = pools.into_iter().flat_map(|p| p.free_port_ids).collect();
        let in_neutron: BTreeSet<String> = ports.into_iter().map(|p| p.id).collect();
        anyhow::ensure!(pooled == in_neutron, "Neutron has {in_neutron:?}, the pools {pooled:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", survivor.proc.logs()));
    let mut pm = PoolManagerClient::new(survivor.channel().unwrap());
    let deleted = pm.free_pool(FreePoolRequest { key: None }).await.unwrap().into_inner().deleted;
    let left = cluster_ports(&c).await;
    assert!(left.is_empty(), "ports of the cluster left after FreePool: {left:?}");
    eprintln!("FreePool deleted {deleted} ports; none of the cluster's left in Neutron");
    for r in &mut replicas {
        let _ = r.proc.terminate(Duration::from_secs(10)).await;
    }
}
