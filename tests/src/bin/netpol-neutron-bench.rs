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
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kuryr_openstack::neutron::{SecurityGroupCreate, SecurityGroupRuleCreate};
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::{GetVifRequest, Vif};
use kuryr_tests::neutron::{AllocatorOptions, NeutronCluster, PolicyChange, Svc, measure_policy_change};
use kuryr_tests::services::wait_until;
use kuryr_tests::stats::Stats;
use serde_json::json;

const NS: &str = "bench-np";
const SLOW: Duration = Duration::from_secs(180);

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
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
    let (targets, clients, rounds) =
        (env("BENCH_NP_TARGETS", 6), env("BENCH_NP_CLIENTS", 4), env("BENCH_NP_ROUNDS", 5));
    let c = NeutronCluster::start_with_firewall(&[NS]).await?;
    let project = c.net.project_id.clone();
    let pods_group = c
        .neutron
        .create_security_group(SecurityGroupCreate {
            name: "pods".into(),
            project_id: Some(project.clone()),
            ..Default::default()
        })
        .await?
        .id;
    let rule = |prefix: &str, eth: &str| SecurityGroupRuleCreate {
        security_group_id: pods_group.clone(),
        direction: "ingress".into(),
        ethertype: eth.into(),
        remote_ip_prefix: Some(prefix.into()),
        project_id: Some(project.clone()),
        ..Default::default()
    };
    c.neutron
        .create_security_group_rules(vec![rule(&c.net.subnet_v4_cidr, "IPv4"), rule(&c.net.subnet_v6_cidr, "IPv6")])
        .await?;
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
    let args: Vec<String> = ["--cluster-id", "bench-np", "--instance", "policy-bench-np", "--log", "info"]
        .iter()
        .map(ToString::to_string)
        .collect();
    let policy = Arc::new(c.policy(&watcher, &args).await?);
    policy.wait_ready(SLOW).await?;
    for i in 0..targets {
        pod(&c, &alloc, &format!("t{i}"), "target").await?;
    }
    for i in 0..clients {
        pod(&c, &alloc, &format!("c{i}"), "client").await?;
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
        results[0].push(measure_policy_change(&policy, SLOW, apply(&c, &name, base.clone())).await?);
        results[1].push(measure_policy_change(&policy, SLOW, apply(&c, &name, edited.clone())).await?);
        results[2].push(measure_policy_change(&policy, SLOW, relabel(&c, "t0", "other")).await?);
        results[3].push(measure_policy_change(&policy, SLOW, relabel(&c, "t0", "target")).await?);
        let api: Api<NetworkPolicy> = Api::namespaced(c.admin.clone(), NS);
        let del = async {
            api.delete(&name, &DeleteParams::default()).await?;
            Ok(())
        };
        results[4].push(measure_policy_change(&policy, SLOW, del).await?);
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "kuryr-policy --backend neutron: {targets} target pods, {clients} client pods, {rounds} rounds (load {})",
        load.split(' ').take(3).collect::<Vec<_>>().join(" ")
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
