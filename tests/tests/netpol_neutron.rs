//! kuryr-policy `--backend neutron` against the real parts: a real kube-apiserver, kuryr-watcher,
//! kuryr-vif-allocator and kuryr-policy under their service accounts, Keystone (both log in as
//! the `kuryr` user), the real Neutron API + RPC server + ML2/OVS agent with the `openvswitch`
//! firewall driver (security groups as OpenFlow rules and conntrack on the userspace datapath),
//! and a kuryr-binder plugging pods into that `br-int` through the `kuryr-cni` shim. Pods'
//! addresses are reported in their status as a kubelet would.
//!
//! The pods' ports are allocated with a "pods" group that admits the pod subnets (what an
//! operator gives `--security-groups` so that pods no policy selects accept any pod, as
//! Kubernetes wants), and traffic is real ICMP between the pods' namespaces:
//!
//! 1. no policy: client → server and other → server pass; the server's port has the pods group;
//! 2. a default deny of the server's ingress: its port gets the policy's group (no rule) and the
//!    shared open-egress group; client → server is dropped, server → client still passes;
//! 3. a policy allowing the client pods: client → server passes again, other → server does not;
//! 4. that policy edited to allow other's address too (an `ipBlock`): only rules change;
//! 5. the server relabelled out of both policies' selectors: its port is back in the pods group
//!    and every pod reaches it; relabelled back, the policies' groups return;
//! 6. a policy deleted: its group is deleted once no port uses it;
//! 7. a leftover group (tagged for the cluster, its policy gone) is removed by the garbage
//!    collection of a restarted kuryr-policy, and taken off the port that is no pod's and still
//!    held it (which kept Neutron from deleting it);
//! 8. the server pod deleted: its port goes back to the allocator's pool with the pods group.
//!
//! Every change is counted in Neutron calls (kuryr-policy's `openstack_requests_total`) and
//! timed to convergence, and printed beside Kuryr's count (a call per rule, plus the group and
//! each port).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kuryr_openstack::Filter;
use kuryr_openstack::neutron::{PortCreate, SecurityGroupCreate};
use kuryr_tests::binder::Binder;
use kuryr_tests::neutron::{
    AllocatorOptions, NeutronCluster, PluggedPod, SLOW, Svc, cluster_tag, measure_policy_change,
};
use kuryr_tests::services::wait_until;
use serde_json::json;

const NS: &str = "np";
const CLUSTER_ID: &str = "e2e-np";
const OWNER_TAG: &str = "kuryr.openstack.org/owner=kuryr-policy";

struct Suite {
    c: NeutronCluster,
    alloc: Svc,
    binder: Arc<Binder>,
    pods_group: String,
}

impl Suite {
    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.c.admin.clone(), NS)
    }

    /// Creates a pod labelled `app=<app>`, plugs it (CNI ADD) and reports its addresses in its
    /// status, as the kubelet does.
    async fn pod(&self, name: &str, app: &str) -> PluggedPod {
        self.c.plug_pod(&self.alloc, &self.binder, NS, name, &[("app", app)], SLOW).await.unwrap()
    }

    async fn port_groups(&self, port: &str) -> BTreeSet<String> {
        self.c.neutron.get_port(port).await.unwrap().security_groups.into_iter().collect()
    }

    /// The kuryr-policy groups of the cluster, by their policy tag's value (`open=...` for the
    /// shared ones).
    async fn owned_groups(&self) -> Vec<(String, String)> {
        let tags = [cluster_tag(CLUSTER_ID), OWNER_TAG.to_string()];
        let groups = self.c.neutron.list_security_groups(&Filter::new().tags(&tags)).await.unwrap();
        let mut out: Vec<(String, String)> = groups
            .into_iter()
            .map(|g| {
                let what = g
                    .tags
                    .iter()
                    .find_map(|t| {
                        t.strip_prefix("kuryr.openstack.org/networkpolicy=")
                            .or_else(|| t.strip_prefix("kuryr.openstack.org/"))
                            .filter(|_| {
                                !t.starts_with("kuryr.openstack.org/cluster=")
                                    && !t.starts_with("kuryr.openstack.org/owner=")
                            })
                    })
                    .unwrap_or_default()
                    .to_string();
                (what, g.id)
            })
            .collect();
        out.sort();
        out
    }

    async fn group_of(&self, what: &str) -> String {
        wait_until(&format!("the security group of {what}"), SLOW, || async {
            let groups = self.owned_groups().await;
            groups
                .iter()
                .find(|(w, _)| w == what)
                .map(|(_, id)| id.clone())
                .ok_or_else(|| anyhow::anyhow!("groups: {groups:?}"))
        })
        .await
        .unwrap()
    }

    async fn policy(&self, name: &str, spec: serde_json::Value) {
        let api: Api<NetworkPolicy> = Api::namespaced(self.c.admin.clone(), NS);
        let np: NetworkPolicy =
            serde_json::from_value(json!({"metadata": {"name": name, "namespace": NS}, "spec": spec})).unwrap();
        api.patch(name, &PatchParams::apply("netpol-neutron").force(), &Patch::Apply(&np)).await.unwrap();
    }

    async fn delete_policy(&self, name: &str) {
        let api: Api<NetworkPolicy> = Api::namespaced(self.c.admin.clone(), NS);
        api.delete(name, &DeleteParams::default()).await.unwrap();
    }

    async fn relabel(&self, pod: &str, app: &str) {
        let patch = json!({"metadata": {"labels": {"app": app}}});
        self.pods().patch(pod, &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
    }
}

fn ping(from: &PluggedPod, to: &str) -> anyhow::Result<()> {
    from.ping(to)
}

async fn reaches(from: &PluggedPod, to: &str) {
    wait_until(&format!("{} to reach {to}", from.name), SLOW, || async { ping(from, to) }).await.unwrap();
}

async fn dropped(from: &PluggedPod, to: &str) {
    wait_until(&format!("{} → {to} to be dropped", from.name), SLOW, || async {
        match ping(from, to) {
            Ok(()) => anyhow::bail!("still passes"),
            Err(_) => Ok(()),
        }
    })
    .await
    .unwrap();
}

/// One measured change, with Kuryr's count estimated for it.
struct Measured {
    what: &'static str,
    calls: f64,
    took: Duration,
    kuryr: usize,
}

async fn measure<F: Future<Output = ()>>(policy: &Svc, what: &'static str, kuryr: usize, change: F) -> Measured {
    let m = measure_policy_change(policy, SLOW, async {
        change.await;
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{what}: {e:#}"));
    Measured { what, calls: m.calls, took: m.took, kuryr }
}

#[tokio::test]
async fn security_groups_per_policy_enforced_by_the_ovs_firewall() {
    let c = NeutronCluster::start_with_firewall(&[NS]).await.unwrap();
    // The pods group: every pod subnet address may come in, everything may go out.
    let pods_group = c.pods_security_group().await.unwrap();
    let watcher = c.watcher().unwrap();
    let opts = AllocatorOptions {
        cluster_id: CLUSTER_ID.into(),
        pool_min: 1,
        pool_batch: 2,
        instance: "alloc-np".into(),
        extra: vec!["--security-groups".into(), pods_group.clone()],
        ..Default::default()
    };
    let alloc = c.allocator(&watcher, &opts).unwrap();
    alloc.wait_ready(SLOW).await.unwrap();
    let binder = Arc::new(c.binder(&alloc, SLOW, &[]).await.unwrap());
    let policy_args: Vec<String> =
        ["--cluster-id", CLUSTER_ID, "--instance", "policy-np", "--log", "info,kuryr_policy=debug"]
            .iter()
            .map(ToString::to_string)
            .collect();
    let mut policy = c.policy(&watcher, &policy_args).await.unwrap();
    policy.wait_ready(SLOW).await.unwrap();
    let s = Suite { c, alloc, binder, pods_group };

    // 1. No policy: everything passes; the server's port has the pods group.
    let client = s.pod("client", "client").await;
    let server = s.pod("server", "server").await;
    let other = s.pod("other", "other").await;
    reaches(&client, &server.v4).await;
    reaches(&client, &server.v6).await;
    reaches(&other, &server.v4).await;
    assert_eq!(s.port_groups(&server.port).await, [s.pods_group.clone()].into());
    let mut figures = Vec::new();

    // 2. Default deny of the server's ingress.
    let m = measure(
        &policy,
        "default deny (new policy, no rule)",
        2,
        s.policy("deny", json!({"podSelector": {"matchLabels": {"app": "server"}}, "policyTypes": ["Ingress"]})),
    )
    .await;
    figures.push(m);
    let deny = s.group_of("np/deny").await;
    let open_egress = s.group_of("open=egress").await;
    assert_eq!(s.port_groups(&server.port).await, [deny.clone(), open_egress.clone()].into());
    let deny_rules = s.c.neutron.get_security_group(&deny).await.unwrap().security_group_rules;
    assert!(deny_rules.is_empty(), "a default deny is a group without rules: {deny_rules:?}");
    dropped(&client, &server.v4).await;
    dropped(&client, &server.v6).await;
    reaches(&server, &client.v4).await;
    assert_eq!(s.port_groups(&client.port).await, [s.pods_group.clone()].into(), "client: no policy");

    // 3. Allow the client pods in.
    let m = measure(
        &policy,
        "allow from pods (new policy, 2 rules)",
        4,
        s.policy(
            "allow-client",
            json!({"podSelector": {"matchLabels": {"app": "server"}},
               "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}]}]}),
        ),
    )
    .await;
    figures.push(m);
    let allow = s.group_of("np/allow-client").await;
    let rules = s.c.neutron.get_security_group(&allow).await.unwrap().security_group_rules;
    let prefixes: BTreeSet<String> = rules.iter().filter_map(|r| r.remote_ip_prefix.clone()).collect();
    assert_eq!(prefixes, [format!("{}/32", client.v4), format!("{}/128", client.v6)].into(), "{rules:?}");
    assert_eq!(s.port_groups(&server.port).await, [deny.clone(), allow.clone(), open_egress.clone()].into());
    reaches(&client, &server.v4).await;
    reaches(&client, &server.v6).await;
    assert!(ping(&other, &server.v4).is_err(), "other is still denied");

    // 4. Edit: other's address allowed through an ipBlock: one bulk rule call, no port update.
    let m = measure(
        &policy,
        "edit policy (+1 ipBlock rule)",
        1,
        s.policy(
            "allow-client",
            json!({"podSelector": {"matchLabels": {"app": "server"}},
               "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}},
                                     {"ipBlock": {"cidr": format!("{}/32", other.v4)}}]}]}),
        ),
    )
    .await;
    assert!(m.calls <= 2.0, "an edit of one rule costs at most the bulk call (and a re-read): {}", m.calls);
    figures.push(m);
    reaches(&other, &server.v4).await;
    assert!(ping(&other, &server.v6).is_err(), "the ipBlock is IPv4 only");

    // 5. The server leaves both selectors: back to the pods group; and back in.
    let m = measure(&policy, "pod label change (out of 2 policies)", 1, s.relabel("server", "public")).await;
    figures.push(m);
    assert_eq!(s.port_groups(&server.port).await, [s.pods_group.clone()].into());
    reaches(&other, &server.v6).await;
    s.relabel("server", "server").await;
    wait_until("the server's port back in its policies' groups", SLOW, || async {
        let have = s.port_groups(&server.port).await;
        let want: BTreeSet<String> = [deny.clone(), allow.clone(), open_egress.clone()].into();
        anyhow::ensure!(have == want, "{have:?}");
        Ok(())
    })
    .await
    .unwrap();
    dropped(&other, &server.v6).await;

    // 6. A policy deleted: its group goes once the port left it.
    let m = measure(&policy, "delete policy", 2, s.delete_policy("allow-client")).await;
    figures.push(m);
    assert_eq!(s.port_groups(&server.port).await, [deny.clone(), open_egress.clone()].into());
    assert!(s.owned_groups().await.iter().all(|(w, _)| w != "np/allow-client"), "{:?}", s.owned_groups().await);
    assert!(s.c.neutron.get_security_group(&allow).await.unwrap_err().is_not_found());
    dropped(&client, &server.v4).await;

    // 7. A leftover group of a policy that no longer exists: removed by a restarted kuryr-policy.
    let ghost =
        s.c.neutron
            .create_security_group(SecurityGroupCreate {
                name: "kuryr-np-np-ghost".into(),
                project_id: Some(s.c.net.project_id.clone()),
                tags: Some(vec![
                    cluster_tag(CLUSTER_ID),
                    OWNER_TAG.into(),
                    "kuryr.openstack.org/networkpolicy=np/ghost".into(),
                ]),
                ..Default::default()
            })
            .await
            .unwrap()
            .id;
    // And what a pass cut short between a group's creation and its tagging leaves (Neutron 29
    // takes no tags in a security group's creation): the group as created, untagged, found by
    // the description every group is created with. Another cluster's such group is not touched.
    let untagged = |cluster: String, policy: &str| {
        let neutron = s.c.neutron.clone();
        let project = s.c.net.project_id.clone();
        let policy = policy.to_string();
        async move {
            neutron
                .create_security_group(SecurityGroupCreate {
                    name: format!("kuryr-np-{}", policy.replace('/', "-")),
                    description: Some(format!("kuryr-policy[{cluster}] NetworkPolicy {policy}")),
                    project_id: Some(project),
                    tags: None,
                })
                .await
                .unwrap()
                .id
        }
    };
    // The leftover group still on a port that is no pod's (a pod released to the pool while a
    // policy change was applied): Neutron refuses to delete a group in use, so kuryr-policy takes
    // it off that port first, and only its own groups.
    let holder =
        s.c.neutron
            .create_port(PortCreate {
                network_id: s.c.net.network_id.clone(),
                project_id: Some(s.c.net.project_id.clone()),
                security_groups: Some(vec![ghost.clone(), s.pods_group.clone()]),
                ..Default::default()
            })
            .await
            .unwrap()
            .id;
    let cut_short = untagged(cluster_tag(CLUSTER_ID), "np/deny").await;
    let foreign = untagged(format!("{}-other", cluster_tag(CLUSTER_ID)), "np/deny").await;
    policy.proc.terminate(Duration::from_secs(10)).await.unwrap();
    policy = s.c.policy(&watcher, &policy_args).await.unwrap();
    policy.wait_ready(SLOW).await.unwrap();
    for (what, id) in [("the leftover group", &ghost), ("the untagged group", &cut_short)] {
        wait_until(&format!("{what} to be collected"), SLOW, || async {
            match s.c.neutron.get_security_group(id).await {
                Err(e) if e.is_not_found() => Ok(()),
                other => anyhow::bail!("{other:?}"),
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", policy.proc.logs()));
    }
    assert_eq!(s.port_groups(&holder).await, [s.pods_group.clone()].into(), "the port that held the leftover group");
    s.c.neutron.delete_port(&holder).await.unwrap();
    assert!(s.c.neutron.get_security_group(&foreign).await.is_ok(), "another cluster's group was deleted");
    s.c.neutron.delete_security_group(&foreign).await.unwrap();
    assert_eq!(s.group_of("np/deny").await, deny, "the live policy's group is kept across the restart");
    assert_eq!(s.port_groups(&server.port).await, [deny.clone(), open_egress.clone()].into());

    // 8. The server pod deleted: its port returns to the pool with the pods group.
    let (p, b) = (server.cni.clone(), s.binder.clone());
    let out = tokio::task::spawn_blocking(move || p.run("DEL", &b, None, SLOW).unwrap()).await.unwrap();
    assert_eq!(out.code, 0, "DEL: {} {}", out.stdout, out.stderr);
    s.pods().delete("server", &DeleteParams::default().grace_period(0)).await.unwrap();
    wait_until("the server's port back in the pool with the pods group", SLOW, || async {
        let p = s.c.neutron.get_port(&server.port).await?;
        anyhow::ensure!(p.device_id.is_empty(), "still held by {}", p.device_id);
        anyhow::ensure!(p.security_groups == [s.pods_group.clone()], "{:?}", p.security_groups);
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", s.alloc.proc.logs()));

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "neutron security groups, calls per policy change (load {}):",
        load.split(' ').take(3).collect::<Vec<_>>().join(" ")
    );
    for m in &figures {
        println!(
            "neutron: {:<40} {:>3} calls (Kuryr, estimated as 1 per group + 1 per rule + 1 per port: {:>2}), converged in {:>5} ms",
            m.what,
            m.calls,
            m.kuryr,
            m.took.as_millis()
        );
    }
    drop(policy);
}
