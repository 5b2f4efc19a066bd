//! `make bench-netpol-neutron`: kuryr-policy `--backend neutron` against the real Neutron (API,
//! RPC server, ML2/OVS agent with the `openvswitch` firewall driver) and Keystone; binaries from
//! `KURYR_BIN_DIR` (the harness is [`kuryr_tests::neutron`]).
//!
//! `BENCH_NP_TARGETS` target pods (default 6) and `BENCH_NP_CLIENTS` client pods (default 4) get
//! Neutron ports from the allocator; their addresses are reported in their status as a kubelet
//! would (no plugging: the backend works on the ports, the traffic is the `netpol_neutron`
//! suite's). Then, `BENCH_NP_ROUNDS` times (default 5), each change measured from the
//! Kubernetes write to kuryr-policy's `applied_generation` catching up, counting its Neutron
//! calls (`openstack_requests_total{service="network"}`):
//! - a new policy selecting the targets and allowing the clients in (2 rules per client:
//!   IPv4 and IPv6);
//! - the policy edited: one more `ipBlock`;
//! - a target relabelled out of the policy, and back;
//! - the policy deleted.
//!
//! Each line prints the mean calls, the converge time p50 and max, and beside it Kuryr's count
//! for the same change, estimated as one call per group, per rule and per port (derived, not
//! measured).
//!
//! Before that, the security-group arm ([`kuryr_tests::sg_strategies`]) drives Neutron directly,
//! without kuryr-policy, on `BENCH_SG_TARGETS` target pods (default 2) and peer pods plugged into
//! the node's `br-int` (the agent binds their ports): one policy over N peers for each N of
//! `BENCH_SG_PEERS` (default `4,20`), as remote IP prefixes and as a remote group, alternating,
//! `BENCH_SG_ROUNDS` times (default 3). Per (strategy, N, change) it prints the calls, the API time
//! p50 and the time until the OVS agent enforces it on the datapath (ICMP probes from a peer's
//! namespace) p50 and max, then a verdict line. `BENCH_NP_ARMS` (default `groups,policy`) chooses
//! the arms.
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::{GetVifRequest, Vif};
use kuryr_tests::neutron::{AllocatorOptions, NeutronCluster, PluggedPod, PolicyChange, Svc, measure_policy_change};
use kuryr_tests::services::wait_until;
use kuryr_tests::sg_strategies::{self as sg, Strategy};
use kuryr_tests::stats::Stats;
use serde_json::json;

const NS: &str = "bench-np";
const SG_NS: &str = "bench-sg";
const SLOW: Duration = Duration::from_secs(180);

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn load() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    load.split(' ').take(3).collect::<Vec<_>>().join(" ")
}

fn ms(d: &[std::time::Duration]) -> Option<Stats> {
    Stats::of(&d.iter().map(|d| d.as_secs_f64() * 1000.0).collect::<Vec<_>>())
}

/// Per change kind, the rounds' measurements.
type Runs = Vec<Vec<sg::Change>>;
/// Per strategy (prefixes, remote group): mean calls and enforced p50 (ms).
type Pair = [(f64, f64); 2];

/// The security-group arm: remote prefixes against a remote group, driven directly.
async fn groups_arm(c: &NeutronCluster, alloc: &Svc) -> Result<()> {
    let sizes: Vec<usize> = std::env::var("BENCH_SG_PEERS")
        .unwrap_or_else(|_| "4,20".into())
        .split(',')
        .map(|n| n.trim().parse().with_context(|| format!("BENCH_SG_PEERS: {n:?} is not a number")))
        .collect::<Result<_>>()?;
    anyhow::ensure!(sizes.iter().all(|n| *n > 0), "BENCH_SG_PEERS: sizes start at 1");
    let (n_targets, rounds) = (env("BENCH_SG_TARGETS", 2).max(1), env("BENCH_SG_ROUNDS", 3));
    let n_peers = sizes.iter().max().copied().unwrap_or(1) + 1;
    let binder = Arc::new(c.binder(alloc, SLOW, &[]).await?);
    let plug = |name: String, app: &'static str| {
        let binder = binder.clone();
        async move { c.plug_pod(alloc, &binder, SG_NS, &name, &[("app", app)], SLOW).await }
    };
    let targets: Vec<PluggedPod> = futures::stream::iter((0..n_targets).map(|i| plug(format!("t{i}"), "target")))
        .buffered(4)
        .try_collect()
        .await?;
    let peers: Vec<PluggedPod> =
        futures::stream::iter((0..n_peers).map(|i| plug(format!("p{i}"), "peer"))).buffered(4).try_collect().await?;
    let bench = sg::Bench::new(&c.neutron, &c.net.project_id, &targets, &peers, SLOW).await?;
    let strategies = [Strategy::Prefix, Strategy::RemoteGroup];
    // (strategy, size) -> per change kind, the rounds.
    let mut results: Vec<((Strategy, usize), Runs)> = Vec::new();
    for &n in &sizes {
        for s in strategies {
            results.push(((s, n), vec![Vec::new(); sg::KINDS.len()]));
        }
    }
    for r in 0..rounds {
        for &n in &sizes {
            // Alternate which strategy goes first, so that neither always meets a warmer agent.
            let order = if r % 2 == 0 { strategies } else { [strategies[1], strategies[0]] };
            for s in order {
                let tag = format!("{}-{n}-{r}", if s == Strategy::Prefix { "pfx" } else { "rg" });
                let changes = bench.round(s, n, &tag, SLOW).await.with_context(|| format!("{} {n} peers", s.name()))?;
                if let Some((_, runs)) = results.iter_mut().find(|(k, _)| *k == (s, n)) {
                    for (kind, ch) in runs.iter_mut().zip(changes) {
                        kind.push(ch);
                    }
                }
            }
        }
    }
    println!(
        "security groups driven directly: {n_targets} targets, peers {sizes:?}, {rounds} rounds; enforced = first \
         ICMP probe (peer netns -> target, IPv4, every {} ms, {} ms wait) with the new verdict (load {})",
        sg::PROBE_EVERY.as_millis(),
        sg::PROBE_WAIT.as_millis(),
        load()
    );
    // Per change kind at the largest size: (calls, enforced p50) of each strategy.
    let mut at_max: Vec<Pair> = vec![[(0.0, 0.0); 2]; sg::KINDS.len()];
    let largest = sizes.iter().max().copied().unwrap_or(0);
    for ((s, n), runs) in &results {
        for (k, (kind, runs)) in sg::KINDS.iter().zip(runs).enumerate() {
            let calls = runs.iter().map(|c| c.calls as f64).sum::<f64>() / runs.len().max(1) as f64;
            let api = runs.iter().map(|c| c.api).collect::<Vec<_>>();
            let enforced = runs.iter().map(|c| c.enforced).collect::<Vec<_>>();
            let (Some(api), Some(enf)) = (ms(&api), ms(&enforced)) else { continue };
            println!(
                "sg: {:<15} {n:>3} peers  {kind:<15} calls {calls:>5.1}  API p50 {:>5.0} ms  enforced p50 {:>5.0} ms, max {:>5.0} ms",
                s.name(),
                api.p50,
                enf.p50,
                enf.max
            );
            if *n == largest {
                at_max[k][usize::from(*s == Strategy::RemoteGroup)] = (calls, enf.p50);
            }
        }
    }
    let pick = |f: &dyn Fn(&Pair) -> bool| -> String {
        let kinds: Vec<&str> = sg::KINDS.iter().zip(&at_max).filter(|(_, v)| f(v)).map(|(k, _)| *k).collect();
        if kinds.is_empty() { "none".into() } else { kinds.join(", ") }
    };
    // Derived: enforcement counts as faster when the p50s are at least 20% apart.
    println!(
        "verdict ({largest} peers): fewer calls with a remote group: {}; with remote prefixes: {}; enforced faster \
         (p50, >=20% apart) with a remote group: {}; with remote prefixes: {}",
        pick(&|v| v[1].0 < v[0].0),
        pick(&|v| v[0].0 < v[1].0),
        pick(&|v| v[1].1 * 1.2 <= v[0].1),
        pick(&|v| v[0].1 * 1.2 <= v[1].1),
    );
    Ok(())
}

async fn vif(alloc: &Svc, uid: &str) -> Result<Vif> {
    let c = VifAllocatorClient::new(alloc.channel()?);
    wait_until(&format!("a VIF for pod {uid}"), SLOW, || {
        let mut c = c.clone();
        async move {
            let v = c.get_vif(GetVifRequest { pod_uid: uid.into() }).await?.into_inner();
            anyhow::ensure!(!v.ips.is_empty(), "no address yet");
            Ok(v)
        }
    })
    .await
}

/// A pod labelled `app=<app>` with a Neutron port, its addresses in its status.
async fn pod(c: &NeutronCluster, alloc: &Svc, name: &str, app: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(c.admin.clone(), NS);
    let mut p = c.pod(name);
    p.metadata.labels = Some([("app".to_string(), app.to_string())].into());
    let uid = pods.create(&PostParams::default(), &p).await?.metadata.uid.context("no uid")?;
    let v = vif(alloc, &uid).await?;
    let ips: Vec<String> = v.ips.iter().map(|i| i.address.split('/').next().unwrap_or_default().to_string()).collect();
    let status = json!({"status": {"phase": "Running", "podIP": ips[0],
                                   "podIPs": ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(status)).await?;
    Ok(())
}

async fn apply(c: &NeutronCluster, name: &str, spec: serde_json::Value) -> Result<()> {
    let api: Api<NetworkPolicy> = Api::namespaced(c.admin.clone(), NS);
    let np: NetworkPolicy = serde_json::from_value(json!({"metadata": {"name": name, "namespace": NS}, "spec": spec}))?;
    api.patch(name, &PatchParams::apply("netpol-neutron-bench").force(), &Patch::Apply(&np)).await?;
    Ok(())
}

async fn relabel(c: &NeutronCluster, pod: &str, app: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(c.admin.clone(), NS);
    pods.patch(pod, &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"app": app}}}))).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let arms = std::env::var("BENCH_NP_ARMS").unwrap_or_else(|_| "groups,policy".into());
    let arms: Vec<&str> = arms.split(',').map(str::trim).collect();
    if let Some(bad) = arms.iter().find(|a| !["groups", "policy"].contains(a)) {
        anyhow::bail!("BENCH_NP_ARMS: unknown arm {bad:?} (groups, policy)");
    }
    let c = NeutronCluster::start_with_firewall(&[NS, SG_NS]).await?;
    let pods_group = c.pods_security_group().await?;
    let watcher = c.watcher()?;
    let opts = AllocatorOptions {
        cluster_id: "bench-np".into(),
        pool_min: 1,
        pool_batch: 10,
        instance: "alloc-bench-np".into(),
        log: "info".into(),
        extra: vec!["--security-groups".into(), pods_group.clone()],
        ..Default::default()
    };
    let alloc = c.allocator(&watcher, &opts)?;
    alloc.wait_ready(SLOW).await?;
    if arms.contains(&"groups") {
        groups_arm(&c, &alloc).await?;
    }
    if arms.contains(&"policy") {
        policy_arm(&c, &alloc, &watcher).await?;
    }
    Ok(())
}

/// The kuryr-policy arm: calls and time to converge per policy change.
async fn policy_arm(c: &NeutronCluster, alloc: &Svc, watcher: &Svc) -> Result<()> {
    let (targets, clients, rounds) =
        (env("BENCH_NP_TARGETS", 6), env("BENCH_NP_CLIENTS", 4), env("BENCH_NP_ROUNDS", 5));
    let args: Vec<String> = ["--cluster-id", "bench-np", "--instance", "policy-bench-np", "--log", "info"]
        .iter()
        .map(ToString::to_string)
        .collect();
    let policy = Arc::new(c.policy(watcher, &args).await?);
    policy.wait_ready(SLOW).await?;
    for i in 0..targets {
        pod(c, alloc, &format!("t{i}"), "target").await?;
    }
    for i in 0..clients {
        pod(c, alloc, &format!("c{i}"), "client").await?;
    }
    // Let the backend settle on the pods (no policy yet: nothing to do but read their ports).
    tokio::time::sleep(Duration::from_secs(2)).await;

    let base = json!({"podSelector": {"matchLabels": {"app": "target"}},
                      "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}]}]});
    let edited = json!({"podSelector": {"matchLabels": {"app": "target"}},
                        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}},
                                              {"ipBlock": {"cidr": "192.0.2.0/24"}}]}]});
    let kinds = [
        "new policy",
        "policy edited (+1 ipBlock)",
        "target relabelled out",
        "target relabelled back",
        "policy deleted",
    ];
    let kuryr = [1 + 2 * clients + targets, 1, 1, 1, 1 + targets];
    let mut results: Vec<Vec<PolicyChange>> = vec![Vec::new(); kinds.len()];
    for r in 0..rounds {
        let name = format!("allow-{r}");
        results[0].push(measure_policy_change(&policy, SLOW, apply(c, &name, base.clone())).await?);
        results[1].push(measure_policy_change(&policy, SLOW, apply(c, &name, edited.clone())).await?);
        results[2].push(measure_policy_change(&policy, SLOW, relabel(c, "t0", "other")).await?);
        results[3].push(measure_policy_change(&policy, SLOW, relabel(c, "t0", "target")).await?);
        let api: Api<NetworkPolicy> = Api::namespaced(c.admin.clone(), NS);
        let del = async {
            api.delete(&name, &DeleteParams::default()).await?;
            Ok(())
        };
        results[4].push(measure_policy_change(&policy, SLOW, del).await?);
    }
    println!(
        "kuryr-policy --backend neutron: {targets} target pods, {clients} client pods, {rounds} rounds (load {})",
        load()
    );
    for ((kind, runs), kuryr) in kinds.iter().zip(&results).zip(kuryr) {
        let calls = runs.iter().map(|m| m.calls).sum::<f64>() / runs.len().max(1) as f64;
        let ms: Vec<f64> = runs.iter().map(|m| m.took.as_secs_f64() * 1000.0).collect();
        let Some(t) = Stats::of(&ms) else { continue };
        println!(
            "neutron: {kind:<28} calls {calls:>5.1} (Kuryr, estimated 1 per group/rule/port: {kuryr:>3}), converged p50 {:>5.0} ms, max {:>5.0} ms",
            t.p50, t.max
        );
    }
    Ok(())
}
