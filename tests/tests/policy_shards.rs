//! Two kuryr-policy replicas splitting the nodes through Kubernetes Leases, as a Deployment of
//! two runs them: each under the `kuryr-policy` ServiceAccount with exactly the rights of
//! `deploy/rbac/policy.yaml` (its Role for Leases in kuryr-system), fed by a real kuryr-watcher,
//! against a real kube-apiserver. A short Lease duration (3 s, renewed every 0.6 s) keeps
//! takeover quick. The clients carry a binder's token, as kuryr-binder does.
//!
//! 1. Both replicas own shards (the Lease objects say so, with their endpoints). Eight nodes
//!    each run a pod isolated by a default-deny policy: for each node, GetNodePolicy from the
//!    replica that does not own it is refused with UNAVAILABLE and the owner's address in the
//!    `kuryr-shard-owner` trailer; the owner answers with the node's isolation. A WatchPolicies
//!    stream from the owner carries it too.
//! 2. kill -9 of one replica: the other holds every shard (read from the Leases) and answers for
//!    every node, with the same compiled state.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kuryr_proto::policy::v1::policies_client::PoliciesClient;
use kuryr_proto::policy::v1::{GetNodePolicyRequest, PolicyEventType, WatchPoliciesRequest};
use kuryr_proto::service_names::POLICIES;
use kuryr_tests::control::{ControlPlane, Served, shard_holders};
use kuryr_tests::services::wait_until;
use kuryr_tests::sut::{self, Sut};
use serde_json::json;

const NS: &str = "pshards";
const NODES: usize = 8;
const SHARDS: u32 = 8;
const PHASE_TIMEOUT: Duration = Duration::from_secs(90);
/// Lines of each replica's log in a failure message.
const LOG_LINES: usize = 200;
const OWNER_METADATA: &str = "kuryr-shard-owner";

fn node_name(i: usize) -> String {
    format!("node-{i}")
}

fn pod_ip(i: usize) -> String {
    format!("10.244.{i}.5")
}

/// GetNodePolicy from `addr`: the node's isolated addresses, or the refusal.
async fn isolated(addr: &str, token: &str, node: &str) -> Result<BTreeSet<String>, tonic::Status> {
    let mut client = PoliciesClient::new(kuryr_tests::auth::channel(addr, token).unwrap());
    let got = client.get_node_policy(GetNodePolicyRequest { node_name: node.into() }).await?.into_inner();
    Ok(got.isolations.into_iter().map(|i| i.address).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_split_the_nodes_and_take_over_from_a_killed_one() {
    let c = ControlPlane::start(Served::Policy, NS).await.unwrap();
    let (admin, kc, token) = (c.admin.clone(), &c.kubeconfig, c.binder_token.clone());
    let watcher = c.watcher(None, &[]).unwrap();
    // A pod per node (its address written into its status, as kubelet would) and a default deny.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    for i in 0..NODES {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("pod-{i}")},
            "spec": {"nodeName": node_name(i), "containers": [{"name": "main", "image": "busybox"}]}
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod).await.unwrap();
        let status = json!({"status": {"phase": "Running", "podIP": pod_ip(i), "podIPs": [{"ip": pod_ip(i)}]}});
        pods.patch_status(&format!("pod-{i}"), &PatchParams::default(), &Patch::Merge(status)).await.unwrap();
    }
    let deny: NetworkPolicy = serde_json::from_value(json!({
        "metadata": {"name": "deny"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}
    }))
    .unwrap();
    Api::<NetworkPolicy>::namespaced(admin.clone(), NS).create(&PostParams::default(), &deny).await.unwrap();

    let replica = |id: &str| {
        let mut args: Vec<String> =
            ["--kubeconfig", &kc.display().to_string(), "--watcher", &watcher.addr, "--log", "info,kuryr_shard=debug"]
                .iter()
                .map(ToString::to_string)
                .collect();
        args.extend(sut::replica_args(id, SHARDS, "3s"));
        Sut::spawn("kuryr-policy", &args, c.dir.path(), id).unwrap()
    };
    let a = replica("policy-a");
    let mut b = replica("policy-b");
    for r in [&a, &b] {
        r.wait_serving(POLICIES, PHASE_TIMEOUT).await.unwrap();
    }

    // 1. Both own shards, every shard is held, and the Leases carry the holders' endpoints.
    let holders = wait_until("every shard held, by both replicas", PHASE_TIMEOUT, || async {
        let h = shard_holders(&admin, "kuryr-policy").await?;
        let by: BTreeSet<&str> = h.values().map(|(id, _)| id.as_str()).collect();
        anyhow::ensure!(h.len() == SHARDS as usize && by.len() == 2, "{h:?}");
        Ok(h)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", sut::logs(&[&a, &b], LOG_LINES)));
    let addr_of = |id: &str| if id == a.id { a.addr.clone() } else { b.addr.clone() };
    for (i, (id, ep)) in &holders {
        assert_eq!(*ep, addr_of(id), "shard {i}: the Lease's endpoint");
    }
    let shard_of = |node: &str| {
        // FNV-1a 64, as kuryr-shard documents it.
        let h = node.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        (h % u64::from(SHARDS)) as u32
    };
    let mut served_by = BTreeMap::<String, usize>::new();
    for i in 0..NODES {
        let node = node_name(i);
        // The other replica learns who took a shard at its next Lease round; until then it
        // answers "no owner right now" (UNAVAILABLE too). Retry as a binder would, reading the
        // holder again each time (on a loaded machine a shard may still move).
        let (owner, refused) = wait_until(&format!("a refusal naming the owner of {node}"), PHASE_TIMEOUT, || async {
            let h = shard_holders(&admin, "kuryr-policy").await?;
            let owner = h.get(&shard_of(&node)).map(|(id, _)| id.clone()).unwrap_or_default();
            let other = if owner == a.id { &b } else { &a };
            let e = match isolated(&other.addr, &token, &node).await {
                Ok(_) => anyhow::bail!("{} answered for {node}: its shard moved; asking again", other.id),
                Err(e) => e,
            };
            anyhow::ensure!(e.code() == tonic::Code::Unavailable, "{e:?}");
            let named = e.metadata().get(OWNER_METADATA).and_then(|v| v.to_str().ok()).unwrap_or_default();
            anyhow::ensure!(named == addr_of(&owner), "not naming {owner} yet: {}", e.message());
            Ok((owner, e))
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", sut::logs(&[&a, &b], LOG_LINES)));
        *served_by.entry(owner.clone()).or_default() += 1;
        let named = refused.metadata().get(OWNER_METADATA).unwrap().to_str().unwrap().to_string();
        // Following redirects as a binder does (on a loaded machine a shard may move again).
        let target = std::sync::Mutex::new(named.clone());
        let got = wait_until(&format!("{node}'s isolation from its owner"), PHASE_TIMEOUT, || async {
            let to = target.lock().unwrap().clone();
            let got = match isolated(&to, &token, &node).await {
                Ok(got) => got,
                Err(e) => {
                    if let Some(owner) = e.metadata().get(OWNER_METADATA).and_then(|v| v.to_str().ok()) {
                        *target.lock().unwrap() = owner.to_string();
                    }
                    return Err(e.into());
                }
            };
            anyhow::ensure!(!got.is_empty(), "nothing isolated yet");
            Ok(got)
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", sut::logs(&[&a, &b], LOG_LINES)));
        assert_eq!(got, BTreeSet::from([pod_ip(i)]), "{node}");
    }
    // (Both replicas hold shards, checked above; which of them the eight nodes' shards fall to
    // varies with the Lease races, and each node was asked of both anyway.)
    eprintln!("nodes served: {served_by:?}");

    // A WatchPolicies stream from the owner of node-0 carries its isolation.
    let node = node_name(0);
    let owner = addr_of(&shard_holders(&admin, "kuryr-policy").await.unwrap()[&shard_of(&node)].0);
    let mut client = PoliciesClient::new(kuryr_tests::auth::channel(&owner, &token).unwrap());
    let req = WatchPoliciesRequest { node_name: node.clone(), resume_from: String::new(), subscriber: "test".into() };
    let mut stream = client.watch_policies(req).await.unwrap().into_inner();
    let mut seen = BTreeSet::new();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(20), stream.message()).await.unwrap().unwrap().unwrap();
        match ev.r#type() {
            PolicyEventType::IsolationApplied => {
                seen.insert(ev.isolation.unwrap().address);
            }
            PolicyEventType::SnapshotComplete => break,
            _ => {}
        }
    }
    assert_eq!(seen, BTreeSet::from([pod_ip(0)]));
    drop(stream);

    // 2. kill -9 of b: a takes every shard and answers for every node.
    let killed = Instant::now();
    b.proc.kill().await.unwrap();
    wait_until("every shard held by a", PHASE_TIMEOUT, || async {
        let h = shard_holders(&admin, "kuryr-policy").await?;
        anyhow::ensure!(h.len() == SHARDS as usize && h.values().all(|(id, _)| *id == a.id), "{h:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", sut::logs(&[&a, &b], LOG_LINES)));
    for i in 0..NODES {
        let node = node_name(i);
        let got = wait_until(&format!("a answering for {node}"), PHASE_TIMEOUT, || async {
            Ok(isolated(&a.addr, &token, &node).await?)
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", sut::logs(&[&a, &b], LOG_LINES)));
        assert_eq!(got, BTreeSet::from([pod_ip(i)]), "{node} after the takeover");
    }
    eprintln!("a serves every node {:?} after the kill", killed.elapsed());
    drop(watcher);
}
