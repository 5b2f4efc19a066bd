//! Further interfaces per pod on Neutron networks (the `k8s.v1.cni.cncf.io/networks`
//! annotation, NetworkAttachmentDefinitions naming Neutron networks) against the real parts: a
//! real kube-apiserver with the NetworkAttachmentDefinition CRD of `deploy/crds`, kuryr-watcher
//! and kuryr-vif-allocator `--backend neutron` under their service accounts, Keystone, the real
//! Neutron API + RPC server and its ML2/OVS agent on a userspace Open vSwitch, and a
//! kuryr-binder in the Neutron node's namespace plugging into its `br-int`.
//!
//! The test makes two Neutron networks in the pods' project: `red` with an IPv4 subnet (named by
//! its NetworkAttachmentDefinition by name) and `blue` with an IPv6 subnet (named by id, the
//! subnet listed).
//! 1. two pods ask for both (one in the short form, one in the JSON form): each gets two more
//!    Neutron ports (`device_owner` `compute:kuryr-attach`, its uid as `device_id`, bound to the
//!    node, the cluster's tag), recorded in its VIF's attachments; CNI ADD returns once all three
//!    ports are ACTIVE and its result lists the three interfaces with their addresses; the
//!    `k8s.v1.cni.cncf.io/network-status` annotation lists them as Multus writes it;
//! 2. the pods ping each other over each further network (IPv4 on `red`, IPv6 on `blue`);
//! 3. the allocator killed (-9) as soon as a third pod's further ports exist in Neutron, that pod
//!    deleted while no allocator runs, a further port left by a pod that never existed: after the
//!    restart the first pods keep their ports and none of the others is left;
//! 4. CNI DEL and pod deletion: every port of the pods deleted, nothing left in Neutron or on
//!    `br-int`.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_openstack::Filter;
use kuryr_openstack::neutron::{FixedIp, NetworkCreate, Port, PortCreate};
use kuryr_proto::allocator::v1::{BindingDriver, Vif};
use kuryr_tests::nested::vsctl;
use kuryr_tests::netns::Netns;
use kuryr_tests::neutron::{AllocatorOptions, CniPod, NeutronCluster, SLOW, Svc, cluster_tag};
use kuryr_tests::services::wait_until;
use kuryr_tests::topology;
use kuryr_tests::util::repo_root;
use kuryr_vif_allocator::backend::neutron::attach::ATTACH_OWNER;
use kuryr_vif_allocator::k8s::crd::{NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec};
use serde_json::Value;

const NS: &str = "mvn";
const CLUSTER_ID: &str = "e2e-mvif";

fn nad(name: &str, kuryr: Value) -> NetworkAttachmentDefinition {
    let config = serde_json::json!({"cniVersion": "1.1.0", "name": name, "type": "kuryr", "kuryr": kuryr});
    let mut n =
        NetworkAttachmentDefinition::new(name, NetworkAttachmentDefinitionSpec { config: Some(config.to_string()) });
    n.metadata.namespace = Some(NS.into());
    n
}

async fn vif(alloc: &Svc, uid: &str) -> Vif {
    let both = |v: &Vif| {
        anyhow::ensure!(v.attachments.len() == 2, "{} attachments: {}", v.attachments.len(), v.message);
        Ok(())
    };
    alloc.wait_vif_where(uid, SLOW, both).await.unwrap()
}

/// The pod's further ports in Neutron.
async fn extra_ports(c: &NeutronCluster, uid: &str) -> Vec<Port> {
    c.neutron.list_ports(&Filter::new().device_id(uid).device_owner(ATTACH_OWNER)).await.unwrap()
}

/// The address (no prefix) of `result` on the interface named `ifname`.
fn address_on(result: &Value, ifname: &str) -> String {
    let ifaces = result["interfaces"].as_array().unwrap();
    let index = ifaces
        .iter()
        .position(|i| i["name"] == ifname && i["sandbox"].as_str().is_some_and(|s| !s.is_empty()))
        .unwrap_or_else(|| panic!("no interface {ifname} in the pod: {result}"));
    let ip = result["ips"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["interface"].as_u64() == Some(index as u64))
        .unwrap_or_else(|| panic!("no address on {ifname}: {result}"));
    ip["address"].as_str().unwrap().split('/').next().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn neutron_pods_get_a_port_per_attachment_network_and_leak_none() {
    let c = NeutronCluster::start(&[NS]).await.unwrap();
    c.kube
        .apply_file(&repo_root().join("deploy/crds/k8s.cni.cncf.io_network-attachment-definitions.yaml"))
        .await
        .unwrap();
    let project = c.net.project_id.clone();

    // Two networks of the pods' project: red (IPv4) and blue (IPv6).
    let mk_net = |name: &str| NetworkCreate { admin_state_up: Some(true), ..topology::network(name, Some(&project)) };
    let red = c.neutron.create_network(mk_net("mvn-red")).await.unwrap();
    let blue = c.neutron.create_network(mk_net("mvn-blue")).await.unwrap();
    let red_v4 = c.neutron.create_subnet(topology::subnet(&red.id, 4, "10.77.0.0/24", Some(&project))).await.unwrap();
    let blue_v6 = c.neutron.create_subnet(topology::subnet(&blue.id, 6, "fd77:77::/64", Some(&project))).await.unwrap();
    let nads: Api<NetworkAttachmentDefinition> = Api::namespaced(c.admin.clone(), NS);
    let pp = PostParams::default();
    nads.create(&pp, &nad("red", serde_json::json!({"neutronNetwork": "mvn-red"}))).await.unwrap();
    nads.create(&pp, &nad("blue", serde_json::json!({"neutronNetwork": blue.id, "neutronSubnets": [blue_v6.id]})))
        .await
        .unwrap();

    let watcher = c.watcher().unwrap();
    let opts = AllocatorOptions {
        cluster_id: CLUSTER_ID.into(),
        pool_batch: 0,
        pool_min: 0,
        instance: "alloc-mvif".into(),
        status_poll_min: Some("200ms".into()),
        ..AllocatorOptions::default()
    };
    let mut alloc = c.allocator(&watcher, &opts).unwrap();
    alloc.wait_ready(SLOW).await.unwrap();
    let binder = Arc::new(c.binder(&alloc, SLOW - Duration::from_secs(10), &[]).await.unwrap());
    let pods: Api<Pod> = Api::namespaced(c.admin.clone(), NS);
    let create = |name: &'static str, networks: &'static str| {
        let mut p = c.pod(name);
        p.metadata.annotations = Some([("k8s.v1.cni.cncf.io/networks".to_string(), networks.to_string())].into());
        let pods = pods.clone();
        async move { pods.create(&PostParams::default(), &p).await.unwrap().metadata.uid.unwrap() }
    };

    // 1. Two pods, three interfaces each.
    let uid_a = create("a", "red, blue@v6net").await;
    let uid_b = create("b", r#"[{"name": "red"}, {"name": "blue", "interface": "v6net"}]"#).await;
    let mut results = Vec::new();
    let mut cnis = Vec::new();
    for (name, uid) in [("a", &uid_a), ("b", &uid_b)] {
        let v = vif(&alloc, uid).await;
        let names: Vec<(&str, &str)> =
            v.attachments.iter().map(|a| (a.attachment.as_str(), a.ifname.as_str())).collect();
        assert_eq!(names, [("mvn/red", "net1"), ("mvn/blue", "v6net")]);
        let ports = extra_ports(&c, uid).await;
        assert_eq!(ports.len(), 2, "{ports:?}");
        for (a, net, subnet) in [(&v.attachments[0], &red.id, &red_v4.id), (&v.attachments[1], &blue.id, &blue_v6.id)] {
            let inner = a.vif.clone().unwrap();
            let port = ports.iter().find(|p| p.id == inner.vif_id).unwrap_or_else(|| panic!("{inner:?} {ports:?}"));
            assert_eq!(&port.network_id, net);
            assert_eq!(port.fixed_ips.len(), 1);
            assert_eq!(port.fixed_ips[0].subnet_id.as_ref(), Some(subnet));
            assert_eq!(port.binding_host_id.as_deref(), Some(c.node.host.as_str()));
            assert!(port.tags.contains(&cluster_tag(CLUSTER_ID)), "{port:?}");
            assert_eq!(port.mac_address.to_ascii_lowercase(), inner.mac);
            assert_eq!(inner.binding.clone().unwrap().driver(), BindingDriver::Ovs);
        }
        let netns = Arc::new(Netns::new(&format!("mv{name}")).unwrap());
        let cni = CniPod { namespace: NS.into(), name: name.into(), uid: uid.clone(), netns };
        let (p, bd) = (cni.clone(), binder.clone());
        let out = tokio::task::spawn_blocking(move || p.run("ADD", &bd, None, SLOW).unwrap()).await.unwrap();
        assert_eq!(out.code, 0, "ADD {name}: {} {}\n{}\n{}", out.stdout, out.stderr, binder.logs(), alloc.proc.logs());
        let result = out.json().unwrap();
        // ADD returns once every port of the pod is ACTIVE.
        let own = c.neutron.get_port(&v.vif_id).await.unwrap();
        assert_eq!(own.status, "ACTIVE");
        for p in extra_ports(&c, uid).await {
            assert_eq!(p.status, "ACTIVE", "ADD returned before further port {} was ACTIVE", p.id);
        }
        let ifnames: BTreeSet<&str> = result["interfaces"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["sandbox"].as_str().is_some_and(|s| !s.is_empty()))
            .map(|i| i["name"].as_str().unwrap())
            .collect();
        assert_eq!(ifnames, BTreeSet::from(["eth0", "net1", "v6net"]), "{result}");
        let v4 = address_on(&result, "net1");
        let v6 = address_on(&result, "v6net");
        assert!(v4.starts_with("10.77.0."), "{v4}");
        assert!(v6.starts_with("fd77:77::"), "{v6}");
        let shown = cni.netns.exec(&["ip", "-o", "addr", "show", "dev", "v6net"]).unwrap();
        assert!(shown.contains(&v6), "{shown}");
        // network-status, as Multus writes it.
        let status = wait_until("the network-status annotation", SLOW, || {
            let pods = pods.clone();
            async move {
                let p = pods.get(name).await?;
                let s = p.metadata.annotations.unwrap_or_default().get("k8s.v1.cni.cncf.io/network-status").cloned();
                s.ok_or_else(|| anyhow::anyhow!("not written yet"))
            }
        })
        .await
        .unwrap();
        let status: Value = serde_json::from_str(&status).unwrap();
        let list = status.as_array().unwrap();
        assert_eq!(list.len(), 3, "{status}");
        assert_eq!((list[0]["name"].as_str(), list[0]["default"].as_bool()), (Some("kuryr"), Some(true)));
        assert_eq!((list[1]["name"].as_str(), list[1]["interface"].as_str()), (Some("mvn/red"), Some("net1")));
        assert_eq!(list[1]["ips"], serde_json::json!([v4]));
        assert_eq!((list[2]["name"].as_str(), list[2]["interface"].as_str()), (Some("mvn/blue"), Some("v6net")));
        assert_eq!(list[2]["ips"], serde_json::json!([v6]));
        results.push((v4, v6, v));
        cnis.push(cni);
    }

    // 2. Traffic over each further network.
    cnis[0].netns.wait_ping(&results[1].0, Duration::from_secs(60)).await.unwrap();
    cnis[1].netns.wait_ping(&results[0].0, Duration::from_secs(60)).await.unwrap();
    cnis[0].netns.wait_ping(&results[1].1, Duration::from_secs(60)).await.unwrap();
    cnis[1].netns.wait_ping(&results[0].1, Duration::from_secs(60)).await.unwrap();
    eprintln!("pods a and b reach each other over red ({}) and blue ({})", results[1].0, results[1].1);

    // 3. kill -9 right after a pod's further ports were made; that pod deleted meanwhile; a
    //    further port whose pod never existed.
    let uid_c = create("c", "red, blue").await;
    wait_until("pod c's further ports in Neutron", SLOW, || async {
        let n = extra_ports(&c, &uid_c).await.len();
        anyhow::ensure!(n > 0, "none yet");
        Ok(())
    })
    .await
    .unwrap();
    alloc.proc.kill().await.unwrap();
    drop(alloc);
    let left_c = extra_ports(&c, &uid_c).await.len();
    pods.delete("c", &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() }).await.unwrap();
    let stray = c
        .neutron
        .create_port(PortCreate {
            network_id: red.id.clone(),
            name: Some(format!("{NS}/never")),
            project_id: Some(project.clone()),
            fixed_ips: Some(vec![FixedIp { subnet_id: Some(red_v4.id.clone()), ip_address: None }]),
            device_id: Some("00000000-0000-4000-8000-00000000dead".into()),
            device_owner: Some(ATTACH_OWNER.into()),
            binding_host_id: Some(c.node.host.clone()),
            tags: Some(vec![cluster_tag(CLUSTER_ID)]),
            ..PortCreate::default()
        })
        .await
        .unwrap();
    let alloc = c.allocator(&watcher, &opts).unwrap();
    alloc.wait_ready(SLOW).await.unwrap();
    wait_until("pod c and every port of it gone, the stray further port deleted", SLOW, || async {
        anyhow::ensure!(pods.get_opt("c").await?.is_none(), "pod c still there");
        let held = c.neutron.list_ports(&Filter::new().device_id(&uid_c)).await?;
        anyhow::ensure!(held.is_empty(), "pod c still holds {held:?}");
        let stray_left = c.neutron.list_ports(&Filter::new().device_owner(ATTACH_OWNER)).await?;
        anyhow::ensure!(stray_left.iter().all(|p| p.id != stray.id), "the stray further port is still there");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    for (uid, (_, _, before)) in [&uid_a, &uid_b].into_iter().zip(&results) {
        let after = vif(&alloc, uid).await;
        let ids = |v: &Vif| -> Vec<String> {
            std::iter::once(v.vif_id.clone())
                .chain(v.attachments.iter().map(|a| a.vif.clone().unwrap().vif_id))
                .collect()
        };
        assert_eq!(ids(&after), ids(before), "pod {uid}'s ports changed across the restart");
        assert_eq!(extra_ports(&c, uid).await.len(), 2);
    }
    cnis[0].netns.wait_ping(&results[1].0, Duration::from_secs(60)).await.unwrap();
    eprintln!("after kill -9: pod c ({left_c} further port(s) made before the kill) and the stray port collected");

    // 4. DEL and deletion: nothing left.
    for cni in &cnis {
        let (p, bd) = (cni.clone(), binder.clone());
        let out = tokio::task::spawn_blocking(move || p.run("DEL", &bd, None, SLOW).unwrap()).await.unwrap();
        assert_eq!(out.code, 0, "DEL {}: {} {}", cni.name, out.stdout, out.stderr);
        let links = cni.netns.exec(&["ip", "-o", "link", "show"]).unwrap();
        assert!(!links.contains("net1") && !links.contains("v6net"), "{links}");
    }
    let grace0 = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    for p in pods.list(&ListParams::default()).await.unwrap().items {
        pods.delete(&p.metadata.name.unwrap(), &grace0).await.unwrap();
    }
    wait_until("every port of the pods deleted", SLOW, || async {
        let tagged: Vec<String> = c
            .neutron
            .list_ports(&Filter::new().tags(&[cluster_tag(CLUSTER_ID)]))
            .await?
            .into_iter()
            .map(|p| p.id)
            .collect();
        anyhow::ensure!(tagged.is_empty(), "ports left: {tagged:?}");
        let extras = c.neutron.list_ports(&Filter::new().device_owner(ATTACH_OWNER)).await?;
        anyhow::ensure!(extras.is_empty(), "further ports left: {extras:?}");
        let n = pods.list(&ListParams::default()).await?.items.len();
        anyhow::ensure!(n == 0, "{n} pods left");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    let left = vsctl(&c.node.ovsdb(), &["list-ports", "br-int"]).unwrap();
    for (_, _, v) in &results {
        for a in &v.attachments {
            let id = a.vif.clone().unwrap().vif_id;
            let ifaces = vsctl(
                &c.node.ovsdb(),
                &["--columns=name", "find", "Interface", &format!("external_ids:iface-id={id}")],
            )
            .unwrap();
            assert!(ifaces.trim().is_empty(), "port {id} still plugged on br-int: {ifaces} ({left})");
        }
    }
}
