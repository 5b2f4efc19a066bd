//! Two kuryr-vif-allocator replicas splitting the nodes through Kubernetes Leases, as a
//! Deployment of two runs them: each under the `kuryr-vif-allocator` ServiceAccount with exactly
//! the rights of `deploy/rbac/vif-allocator.yaml` (its Role for Leases in kuryr-system), fed by
//! a real kuryr-watcher, against a real kube-apiserver. A short Lease duration (3 s, renewed
//! every 0.6 s) keeps takeover quick. Tonic clients play the binders of eight nodes: they follow
//! the `kuryr-shard-owner` redirect, report every VIF plugged to whoever serves their node, and
//! fall back to the other replica when theirs is gone, as kuryr-binder does.
//!
//! 1. Both replicas own shards (the Lease objects say so, with their endpoints); a WatchVifs
//!    to the wrong replica is refused with UNAVAILABLE and the owner's address in the trailer,
//!    and a client following it gets the node's VIFs.
//! 2. A burst of 120 pods over 8 nodes; half-way, kill -9 of one replica. Its shards are held by
//!    the other within the Lease duration plus one renewal interval of the kill (read from the
//!    Leases); every pod gets exactly one VIF and is reported plugged (READY), no address is
//!    handed out twice, both replicas did part of the work.
//!    In the steady state the memberships keep the shards: two renewals of both membership
//!    Leases, and no shard Lease written meanwhile; the rounds read the Leases from a watch
//!    instead of listing them.
//! 3. Deleting every pod leaves no pod, PodVif, finalizer or allocation behind.
//! 4. A replica of an earlier version beside the survivor (a membership Lease without the
//!    renewal annotation, kept alive by this test, holding no shard): the survivor gives it its
//!    fair share and renews the shard Leases it keeps every round, as that version judges a
//!    shard Lease by its own renewals; once it is gone, the survivor holds everything again and
//!    writes no shard Lease.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::{ReportPluggedRequest, Vif, VifEventType, VifState, WatchVifsRequest};
use kuryr_proto::service_names::VIF_ALLOCATOR;
use kuryr_tests::cluster::SYSTEM_NAMESPACE;
use kuryr_tests::control::{ControlPlane, Served, lease_versions, shard_holders, wait_rewritten};
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use kuryr_tests::sut::{self, Sut};
use kuryr_vif_allocator::k8s::crd::{AddressBlock, PodVif, VifState as CrdState};
use serde_json::json;
use tokio::sync::watch;

const NS: &str = "shards";
const NETWORK: &str = "pods";
const NODES: usize = 8;
const PODS: usize = 120;
const SHARDS: u32 = 8;
const LEASE: Duration = Duration::from_secs(3);
/// A fifth of the Lease duration.
const TICK: Duration = Duration::from_millis(600);
const PHASE_TIMEOUT: Duration = Duration::from_secs(90);
const FINALIZER: &str = "kuryr.openstack.org/vif";
const OWNER_METADATA: &str = "kuryr-shard-owner";
const SET: &str = "kuryr-vif-allocator";

/// Lines of each replica's log in a failure message.
const LOG_LINES: usize = 200;

fn logs(a: &Sut, b: &Sut) -> String {
    sut::logs(&[a, b], LOG_LINES)
}

/// The value of one sample of `r`'s metrics (`name{labels}` exactly as exposed); 0 when absent.
async fn metric(r: &Sut, sample: &str) -> f64 {
    kuryr_tests::metrics::metric(&r.metrics_text().await.unwrap(), sample)
}

/// A channel to `addr` whose calls carry a binder's `token`.
fn channel(addr: &str, token: &str) -> kuryr_runtime::auth::client::PeerChannel {
    kuryr_tests::auth::channel(addr, token).unwrap()
}

fn node_name(i: usize) -> String {
    format!("node-{i}")
}

fn pod(name: &str, node: &str) -> Pod {
    objects::pod(name).node(node).build()
}

/// What the binder-like clients saw: by node, pod uid → VIF.
type Seen = Arc<Mutex<BTreeMap<String, BTreeMap<String, Vif>>>>;

/// Plays a node's binder: follows WatchVifs from `replicas[0]`, moving to the owner named in a
/// refusal's trailer, or to the next replica when the current one cannot be reached; reports
/// every ALLOCATED VIF plugged to the replica it streams from.
async fn binder(
    node: String,
    replicas: Vec<String>,
    seen: Seen,
    redirects: Arc<Mutex<usize>>,
    stop: watch::Receiver<bool>,
    token: String,
) {
    let mut target = replicas[0].clone();
    let mut next = 1;
    while !*stop.borrow() {
        let mut client = VifAllocatorClient::new(channel(&target, &token));
        let req =
            WatchVifsRequest { node_name: node.clone(), resume_from: String::new(), binder_id: format!("test/{node}") };
        let failed = match client.watch_vifs(req).await {
            Ok(resp) => {
                let mut stream = resp.into_inner();
                let mut vifs = BTreeMap::new();
                loop {
                    let msg = tokio::select! {
                        m = stream.message() => m,
                        () = async { let mut s = stop.clone(); let _ = s.wait_for(|s| *s).await; } => return,
                    };
                    match msg {
                        Ok(Some(ev)) => match ev.r#type() {
                            VifEventType::Reset => vifs.clear(),
                            VifEventType::VifApplied => {
                                let v = ev.vif.unwrap();
                                let uid = v.pod.as_ref().unwrap().uid.clone();
                                if v.state() == VifState::Allocated {
                                    let r = ReportPluggedRequest {
                                        pod_uid: uid.clone(),
                                        vif_id: v.vif_id.clone(),
                                        node_name: node.clone(),
                                        plugged: true,
                                        host_ifname: "veth-test".into(),
                                    };
                                    // A refusal (the shard just moved) ends the stream too; the
                                    // report is repeated from the next stream's snapshot.
                                    let _ = client.report_plugged(r).await;
                                }
                                vifs.insert(uid, v);
                                seen.lock().unwrap().insert(node.clone(), vifs.clone());
                            }
                            VifEventType::VifDeleted => {
                                vifs.remove(&ev.vif.unwrap().pod.unwrap().uid);
                                seen.lock().unwrap().insert(node.clone(), vifs.clone());
                            }
                            _ => {}
                        },
                        Ok(None) => break None,
                        Err(s) => break Some(s),
                    }
                }
            }
            Err(s) => Some(s),
        };
        match failed.as_ref().and_then(|s| s.metadata().get(OWNER_METADATA)).and_then(|v| v.to_str().ok()) {
            Some(owner) => {
                *redirects.lock().unwrap() += 1;
                target = owner.to_string();
            }
            None => {
                // Unreachable (or ended without an owner): the next replica, as a Service would.
                if failed.as_ref().is_some_and(|s| s.code() == tonic::Code::Unavailable) {
                    target = replicas[next % replicas.len()].clone();
                    next += 1;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_split_the_nodes_and_take_over_from_a_killed_one() {
    let c = ControlPlane::start(Served::Allocator, NS).await.unwrap();
    let admin = c.admin.clone();
    let pp = PostParams::default();
    let nodes: Api<Node> = Api::all(admin.clone());
    for i in 0..NODES {
        let meta = ObjectMeta { name: Some(node_name(i)), ..Default::default() };
        nodes.create(&pp, &Node { metadata: meta, ..Default::default() }).await.unwrap();
        let status =
            json!({"status": {"addresses": [{"type": "InternalIP", "address": format!("192.168.0.{}", i + 1)}]}});
        nodes.patch_status(&node_name(i), &PatchParams::default(), &Patch::Merge(status)).await.unwrap();
    }
    let watcher = c.watcher(None, &[]).unwrap();
    let replica = |id: &str| {
        let mut args = c.allocator_args(&watcher, NETWORK);
        args.extend(["--log".into(), "info,kuryr_vif_allocator=debug,kuryr_shard=debug".into()]);
        args.extend(sut::replica_args(id, SHARDS, "3s"));
        Sut::spawn("kuryr-vif-allocator", &args, c.dir.path(), id).unwrap()
    };
    let a = replica("alloc-a");
    let mut b = replica("alloc-b");
    for r in [&a, &b] {
        r.wait_serving(VIF_ALLOCATOR, PHASE_TIMEOUT).await.unwrap();
    }

    // 1. Both own shards, every shard is held, and the Leases carry the holders' endpoints.
    let holders = wait_until("every shard held, by both replicas", PHASE_TIMEOUT, || async {
        let h = shard_holders(&admin, "kuryr-vif-allocator").await?;
        let by: BTreeSet<&str> = h.values().map(|(id, _)| id.as_str()).collect();
        anyhow::ensure!(h.len() == SHARDS as usize && by.len() == 2, "{h:?}");
        // Both may hold some before the second takes its fair share: wait for the split to settle.
        let most = by.iter().map(|id| h.values().filter(|(h, _)| h == id).count()).max().unwrap_or(0);
        anyhow::ensure!(most == SHARDS as usize / 2, "not split evenly yet: {h:?}");
        Ok(h)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    let (a_id, b_id, a_addr, b_addr) = (a.id.clone(), b.id.clone(), a.addr.clone(), b.addr.clone());
    let endpoint = |id: &str| if id == a_id { a_addr.clone() } else { b_addr.clone() };
    for (i, (id, ep)) in &holders {
        assert_eq!(*ep, endpoint(id), "shard {i}: the Lease's endpoint");
    }
    let count = |id: &str| holders.values().filter(|(h, _)| h == id).count();
    assert_eq!((count(&a_id), count(&b_id)), (4, 4), "fair shares of 8 shards: {holders:?}");
    // A Lease is written a moment before its owner publishes the ownership: wait for the metric.
    for r in [&a, &b] {
        wait_until(&format!("{} owning 4 shards", r.id), PHASE_TIMEOUT, || async {
            let n = metric(r, "kuryr_shards_owned").await;
            anyhow::ensure!(n == 4.0, "{n}");
            Ok(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    }
    // The steady state: both memberships renewed twice — the second write in a round begun after
    // the first round's writes were done — and not one shard Lease written meanwhile; the rounds
    // read the Leases from their watch (a round may list when the watch has not shown its last
    // write yet, so one list each is let pass: listing every round would be two or more).
    const LISTS: &str = "kuryr_shard_lease_lists_total";
    let lists_before = [metric(&a, LISTS).await, metric(&b, LISTS).await];
    let before = lease_versions(&admin, SET).await.unwrap();
    let members: Vec<String> = before.keys().filter(|n| n.contains("-member-")).cloned().collect();
    assert_eq!(members.len(), 2, "{before:?}");
    let after = wait_rewritten(&admin, SET, &members, &before, 2, PHASE_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    assert_eq!(shard_versions(&after), shard_versions(&before), "shard Leases written in the steady state");
    for (r, was) in [&a, &b].into_iter().zip(lists_before) {
        let text = r.metrics_text().await.unwrap();
        assert!(text.lines().any(|l| l.starts_with(LISTS)), "{}: no {LISTS} among its metrics", r.id);
        let lists = metric(r, LISTS).await - was;
        assert!(lists <= 1.0, "{}: {lists} Lease lists in two rounds of the steady state\n{}", r.id, logs(&a, &b));
    }

    let shard_of = |node: &str| {
        // FNV-1a 64, as kuryr-shard documents it.
        let h = node.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        (h % u64::from(SHARDS)) as u32
    };
    let owner_of = |node: &str| holders[&shard_of(node)].0.clone();
    let on_b: Vec<String> = (0..NODES).map(node_name).filter(|n| owner_of(n) == b_id).collect();
    assert!(!on_b.is_empty(), "b serves no node: {holders:?}");

    // Binders for every node, starting at replica a.
    let seen: Seen = Arc::default();
    let redirects = Arc::new(Mutex::new(0usize));
    let (stop_tx, stop) = watch::channel(false);
    let binders: Vec<_> = (0..NODES)
        .map(|i| {
            tokio::spawn(binder(
                node_name(i),
                vec![a.addr.clone(), b.addr.clone()],
                seen.clone(),
                redirects.clone(),
                stop.clone(),
                c.binder_token.clone(),
            ))
        })
        .collect();

    // 2. The burst, first half.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let create =
        |range: std::ops::Range<usize>| {
            let pods = pods.clone();
            async move {
                join_all(range.map(|i| {
                    let pods = pods.clone();
                    async move {
                        pods.create(&PostParams::default(), &pod(&format!("pod-{i}"), &node_name(i % NODES))).await
                    }
                }))
                .await
                .into_iter()
                .map(|r| r.unwrap().metadata.uid.unwrap())
                .collect::<Vec<_>>()
            }
        };
    let mut uids = create(0..PODS / 2).await;
    let pod_vifs: Api<PodVif> = Api::namespaced(admin.clone(), NS);
    let with_vif = || async {
        let list = pod_vifs.list(&ListParams::default()).await.unwrap();
        list.items.into_iter().filter(|p| p.vif().is_some()).collect::<Vec<_>>()
    };
    wait_until("b handing out VIFs", PHASE_TIMEOUT, || async {
        let n = metric(&b, "kuryr_allocator_allocations_total").await;
        anyhow::ensure!(n >= 5.0, "{n}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));

    // A WatchVifs to the wrong replica: refused, naming the owner; following it gets the VIFs.
    let node = &on_b[0];
    let on_node = (0..PODS / 2).filter(|i| node_name(i % NODES) == *node).count();
    wait_until(&format!("the VIFs of {node}'s pods"), PHASE_TIMEOUT, || async {
        let n = with_vif().await.iter().filter(|p| p.spec.node_name == *node).count();
        anyhow::ensure!(n == on_node, "{n} of {on_node}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    let req =
        || WatchVifsRequest { node_name: node.clone(), resume_from: String::new(), binder_id: "test/redirect".into() };
    // `a` learns who took a shard at its next Lease round; until then it answers "no owner right
    // now" (also UNAVAILABLE, for the client to retry). Retry as a client would until it names one.
    let refused = wait_until("a refusal naming the owner", PHASE_TIMEOUT, || async {
        let refused =
            VifAllocatorClient::new(channel(&a.addr, &c.binder_token)).watch_vifs(req()).await.map(drop).unwrap_err();
        anyhow::ensure!(refused.code() == tonic::Code::Unavailable, "{refused:?}");
        anyhow::ensure!(refused.metadata().get(OWNER_METADATA).is_some(), "no owner named yet: {}", refused.message());
        Ok(refused)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    assert!(refused.message().contains(&b.id), "{}", refused.message());
    let owner = refused.metadata().get(OWNER_METADATA).unwrap().to_str().unwrap().to_string();
    assert_eq!(owner, b.addr);
    let mut stream =
        VifAllocatorClient::new(channel(&owner, &c.binder_token)).watch_vifs(req()).await.unwrap().into_inner();
    let mut got = 0;
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(20), stream.message()).await.unwrap().unwrap().unwrap();
        match ev.r#type() {
            VifEventType::Heartbeat => {}
            VifEventType::VifApplied => {
                assert_eq!(ev.vif.unwrap().pod.unwrap().node_name, *node);
                got += 1;
            }
            VifEventType::SnapshotComplete => break,
            _ => {}
        }
    }
    drop(stream);
    assert_eq!(got, on_node, "the owner's snapshot of {node}");
    let half = with_vif().await.len();
    eprintln!("redirected WatchVifs for {node} got {got} VIFs; {half} PodVifs with a VIF at the kill");
    let b_allocations = metric(&b, "kuryr_allocator_allocations_total").await;
    assert!(b_allocations > 0.0);

    // kill -9 of b mid-burst; the second half is created at once.
    b.proc.kill().await.unwrap();
    let killed = Instant::now();
    uids.extend(create(PODS / 2..PODS).await);
    let took = wait_until("a holding every shard", PHASE_TIMEOUT, || async {
        let h = shard_holders(&admin, "kuryr-vif-allocator").await?;
        anyhow::ensure!(h.len() == SHARDS as usize && h.values().all(|(id, _)| *id == a.id), "{h:?}");
        Ok(killed.elapsed())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    eprintln!(
        "takeover: every shard held by {} {took:?} after the kill (Lease {LEASE:?}, renewal every {TICK:?})",
        a.id
    );
    // The Lease duration plus one renewal interval, and the few API round trips of the round
    // and of this test's polling.
    assert!(took <= LEASE + TICK + Duration::from_millis(800), "takeover took {took:?}\n{}", logs(&a, &b));

    // Every pod: exactly one VIF, recorded, READY (reported by its node's binder through
    // whichever replica served it), each address once, in a block of its node.
    let all = wait_until("every pod's VIF READY", PHASE_TIMEOUT, || async {
        let list = pod_vifs.list(&ListParams::default()).await?;
        let ready = list.items.iter().filter(|p| p.state() == CrdState::Ready).count();
        anyhow::ensure!(ready == PODS, "{ready} of {PODS} READY ({} PodVifs)", list.items.len());
        Ok(list.items)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    let uid_set: BTreeSet<&String> = uids.iter().collect();
    let mut by_ip: HashMap<IpAddr, String> = HashMap::new();
    for pv in &all {
        assert!(uid_set.contains(&pv.spec.pod_uid), "a PodVif for an unknown pod: {pv:?}");
        let vif = pv.vif().unwrap();
        let ip: IpAddr = vif.ips[0].address.split('/').next().unwrap().parse().unwrap();
        assert!(by_ip.insert(ip, pv.spec.pod_uid.clone()).is_none(), "{ip} handed out twice");
    }
    let blocks = Api::<AddressBlock>::all(admin.clone()).list(&ListParams::default()).await.unwrap();
    let mut recorded: HashMap<IpAddr, String> = HashMap::new();
    for blk in blocks.items.iter().filter(|blk| blk.spec.network == NETWORK) {
        for (ip, holder) in blk.status.clone().unwrap_or_default().allocations {
            assert!(recorded.insert(ip.parse().unwrap(), holder.uid).is_none(), "{ip} recorded twice");
        }
    }
    assert_eq!(recorded, by_ip, "the blocks record other allocations than the PodVifs");
    // The binders hold every pod's VIF, READY, each on its own node.
    wait_until("every binder holding its node's VIFs", PHASE_TIMEOUT, || async {
        let seen = seen.lock().unwrap().clone();
        let total: usize = seen.values().map(BTreeMap::len).sum();
        let ready = seen.values().flat_map(BTreeMap::values).filter(|v| v.state() == VifState::Ready).count();
        anyhow::ensure!(total == PODS && ready == PODS, "{total} VIFs, {ready} READY");
        for (node, vifs) in &seen {
            anyhow::ensure!(vifs.values().all(|v| v.pod.as_ref().unwrap().node_name == *node), "{node}");
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    let a_allocations = metric(&a, "kuryr_allocator_allocations_total").await;
    eprintln!(
        "allocations: {} {a_allocations}, {} {b_allocations} (before its kill); binder redirects {}",
        a.id,
        b.id,
        redirects.lock().unwrap()
    );
    assert!(a_allocations > 0.0 && b_allocations > 0.0, "both replicas did work");
    assert!(*redirects.lock().unwrap() > 0, "no binder was ever redirected");
    assert!(metric(&a, "kuryr_allocator_redirects_total{method=\"WatchVifs\"}").await > 0.0);
    assert_eq!(metric(&a, "kuryr_shards_owned").await, f64::from(SHARDS));
    assert!(metric(&a, "kuryr_shard_acquisitions_total").await >= 8.0);

    // 3. Deleting everything leaves nothing.
    objects::delete_pods_now(&pods, (0..PODS).map(|i| format!("pod-{i}"))).await.unwrap();
    wait_until("no pod, PodVif or allocation left", PHASE_TIMEOUT, || async {
        let left = pods.list(&ListParams::default()).await?.items;
        let with_finalizer =
            left.iter().filter(|p| p.metadata.finalizers.iter().flatten().any(|f| f == FINALIZER)).count();
        anyhow::ensure!(left.is_empty(), "{} pods left, {with_finalizer} with the finalizer", left.len());
        let pvs = pod_vifs.list(&ListParams::default()).await?.items.len();
        anyhow::ensure!(pvs == 0, "{pvs} PodVifs left");
        let held: usize = Api::<AddressBlock>::all(admin.clone())
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .map(|b| b.status.as_ref().map_or(0, |s| s.allocations.len()))
            .sum();
        anyhow::ensure!(held == 0, "{held} addresses held");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    stop_tx.send_replace(true);
    for b in binders {
        let _ = tokio::time::timeout(Duration::from_secs(5), b).await;
    }

    // 4. A replica of an earlier version joins: a membership Lease without the renewal
    // annotation, renewed by this test every 0.5 s.
    let leases: Api<Lease> = Api::namespaced(admin.clone(), SYSTEM_NAMESPACE);
    let earlier = format!("{SET}-member-earlier");
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(earlier.clone()),
            labels: Some(BTreeMap::from([
                ("kuryr.openstack.org/shard-set".to_string(), SET.to_string()),
                ("kuryr.openstack.org/shard-role".to_string(), "member".to_string()),
            ])),
            annotations: Some(BTreeMap::from([(
                "kuryr.openstack.org/endpoint".to_string(),
                "127.0.0.1:1".to_string(),
            )])),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("earlier".into()),
            lease_duration_seconds: Some(LEASE.as_secs() as i32),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..Default::default()
        }),
    };
    leases.create(&pp, &lease).await.unwrap();
    let (renewing_tx, mut renewing) = watch::channel(true);
    let renewer = tokio::spawn({
        let (leases, earlier) = (leases.clone(), earlier.clone());
        async move {
            while *renewing.borrow() {
                let mut l = leases.get(&earlier).await.unwrap();
                l.spec.get_or_insert_with(Default::default).renew_time = Some(MicroTime(Timestamp::now()));
                leases.replace(&earlier, &PostParams::default(), &l).await.unwrap();
                let _ = tokio::time::timeout(Duration::from_millis(500), renewing.changed()).await;
            }
        }
    });
    let mine = |a_id: String| {
        let admin = admin.clone();
        async move {
            let h = shard_holders(&admin, SET).await?;
            Ok::<_, anyhow::Error>(h.into_iter().filter(|(_, (id, _))| *id == a_id).map(|(i, _)| i).collect::<Vec<_>>())
        }
    };
    wait_until("a giving the earlier replica its fair share", PHASE_TIMEOUT, || async {
        let n = metric(&a, "kuryr_shards_owned").await;
        anyhow::ensure!(n == f64::from(SHARDS / 2), "{n}");
        anyhow::ensure!(mine(a.id.clone()).await?.len() == SHARDS as usize / 2, "Leases not released yet");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    // Every shard Lease a keeps is written in each round now.
    let kept: Vec<String> = mine(a.id.clone()).await.unwrap().into_iter().map(|i| format!("{SET}-shard-{i}")).collect();
    let a_member = vec![format!("{SET}-member-{}", a.id)];
    let before = lease_versions(&admin, SET).await.unwrap();
    wait_rewritten(&admin, SET, &kept, &before, 2, PHASE_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    eprintln!(
        "with a replica of an earlier version about, {} renews its {} shard Leases every round",
        a.id,
        kept.len()
    );

    // It goes: a holds every shard again, and writes no shard Lease once it does.
    renewing_tx.send_replace(false);
    renewer.await.unwrap();
    leases.delete(&earlier, &DeleteParams::default()).await.unwrap();
    wait_until("a holding every shard again", PHASE_TIMEOUT, || async {
        let n = metric(&a, "kuryr_shards_owned").await;
        anyhow::ensure!(n == f64::from(SHARDS), "{n}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    let before = lease_versions(&admin, SET).await.unwrap();
    let after = wait_rewritten(&admin, SET, &a_member, &before, 2, PHASE_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&a, &b)));
    assert_eq!(shard_versions(&after), shard_versions(&before), "shard Leases written with no earlier version about");
}

/// The shard Leases' entries of a [`lease_versions`] read.
fn shard_versions(versions: &BTreeMap<String, String>) -> BTreeMap<&String, &String> {
    versions.iter().filter(|(n, _)| n.contains("-shard-")).collect()
}
