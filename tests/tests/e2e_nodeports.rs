//! Services beyond cluster IPs, end to end on the embedded backend with no kube-proxy: the real
//! API server (which allocates node ports), the real kube-controller-manager's EndpointSlice
//! controller (which names each endpoint's node), kuryr-watcher, kuryr-vif-allocator, kuryr-lbaas
//! (node backend) and two nodes whose binders program nftables. Backends run `kuryr-test-echo`
//! in their pod's network namespace, answering TCP and UDP with their name and the client address
//! they saw; clients are the nodes themselves (as hostNetwork pods are) and pods.
//!
//! - a NodePort Service with TCP and UDP on the same port answers on every node's address, from
//!   the other node, from a pod, from the node itself and from a host outside the cluster, the
//!   clients masqueraded (`externalTrafficPolicy: Cluster`); an external IP routed to a node
//!   answers too;
//! - `externalTrafficPolicy: Local`: each node sends outside traffic to its own backend only, the
//!   client's address kept;
//! - `sessionAffinity: ClientIP` holds through the node port;
//! - type changes as the conformance tests make them: NodePort → ClusterIP (the node port stops
//!   answering, the cluster IP goes on), → ExternalName (rules gone), → NodePort again; then
//!   LoadBalancer, whose status' ingress address (as a provider would set it) answers too;
//! - a pod's `hostPort` (created through the API, run by the node's kubelet through CRI) answers on
//!   its node's addresses and on 127.0.0.1 there, and is gone with the pod.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kuryr_tests::cluster::checks::{self, RunningPod};
use kuryr_tests::cluster::svc::{table_has, wait_tables};
use kuryr_tests::cluster::{Cluster, ClusterOptions, run_scenario};
use kuryr_tests::echo::{self, Answer, EchoServer, Proto};
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use serde_json::json;

const NAMESPACE: &str = "np";
const SERVICE: &str = "web";
const PORT: u16 = 80;
const TARGET_PORT: u16 = 9090;
const HOST_PORT: u16 = 31999;
const EXTERNAL_IP: &str = "192.0.2.50";
/// The address a load balancer provider would write into the Service's status.
const INGRESS_IP: &str = "192.0.2.60";
const RUNNING_TIMEOUT: Duration = Duration::from_secs(120);
const CONVERGE: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_ports_traffic_policies_type_changes_and_host_ports_without_kube_proxy() {
    let opts = ClusterOptions { nodes: 2, run_containers: true, services: true, ..ClusterOptions::default() };
    let run = async |c: &mut Cluster| {
        let mut servers = Vec::new();
        scenario(c, &mut servers).await
    };
    run_scenario("node ports", opts, run).await.unwrap_or_else(|e| panic!("{e:#}"));
}

fn v4(ips: &[IpAddr]) -> IpAddr {
    ips.iter().copied().find(IpAddr::is_ipv4).unwrap()
}

fn pod(name: &str, node: &str, app: &str, host_port: Option<u16>) -> Pod {
    let mut p = objects::pod(name).node(node).label("app", app).grace(1).sleeping();
    if let Some(hp) = host_port {
        p = p.port(None, "TCP", TARGET_PORT, Some(hp)).port(None, "UDP", TARGET_PORT, Some(hp));
    }
    p.build()
}

/// The node ports of the Service, by protocol.
async fn node_ports(services: &Api<Service>) -> Result<BTreeMap<String, u16>> {
    let svc = services.get(SERVICE).await?;
    let mut out = BTreeMap::new();
    for p in svc.spec.and_then(|s| s.ports).unwrap_or_default() {
        if let Some(np) = p.node_port {
            out.insert(p.protocol.unwrap_or_default(), u16::try_from(np)?);
        }
    }
    Ok(out)
}

async fn scenario(cluster: &mut Cluster, servers: &mut Vec<EchoServer>) -> Result<()> {
    let client = cluster.client();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let services: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
    let (node1, node2) = (cluster.nodes()[0].name.clone(), cluster.nodes()[1].name.clone());
    let (n1, n2) = (v4(&cluster.nodes()[0].ips), v4(&cluster.nodes()[1].ips));
    let (ns1, ns2) = (cluster.nodes()[0].node.netns_path(), cluster.nodes()[1].node.netns_path());

    for (name, node, app) in [("b1", &node1, "web"), ("b2", &node2, "web"), ("c1", &node1, "client")] {
        pods.create(&PostParams::default(), &pod(name, node, app, None)).await?;
    }
    let running: BTreeMap<String, RunningPod> = checks::wait_running(cluster, NAMESPACE, 3, RUNNING_TIMEOUT)
        .await?
        .into_iter()
        .map(|p| (p.name.clone(), p))
        .collect();
    for b in ["b1", "b2"] {
        servers.push(echo::serve(&running[b].netns, b, TARGET_PORT)?);
    }
    let c1 = running["c1"].netns.clone();

    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": SERVICE},
        "spec": {
            "type": "NodePort",
            "selector": {"app": "web"},
            "externalIPs": [EXTERNAL_IP],
            "ports": [
                {"name": "tcp", "protocol": "TCP", "port": PORT, "targetPort": TARGET_PORT},
                {"name": "udp", "protocol": "UDP", "port": PORT, "targetPort": TARGET_PORT},
            ],
        },
    }))?;
    services.create(&PostParams::default(), &svc).await?;
    let np = node_ports(&services).await?;
    let (tcp_np, udp_np) = (np["TCP"], np["UDP"]);
    eprintln!("node ports allocated by the API server: TCP {tcp_np}, UDP {udp_np}");
    wait_tables(cluster.nodes(), "the node ports", CONVERGE, |t| {
        t.contains(&format!("tcp . {tcp_np} : goto ext/")) && t.contains(&format!("udp . {udp_np} : goto ext/"))
    })
    .await?;

    eprintln!("1. externalTrafficPolicy Cluster: every node's address, from the other node, a pod and itself");
    let not_from = |ip: IpAddr| move |a: &Answer| a.peer != ip;
    let any = |_: &Answer| true;
    for (proto, port) in [(Proto::Tcp, tcp_np), (Proto::Udp, udp_np)] {
        let got = echo::wait_answers(&ns2, (proto, n1, port), 16, &["b1", "b2"], not_from(n2), CONVERGE)
            .await
            .context("node-2 → node-1's node port (masqueraded)")?;
        eprintln!("  {node2} → {n1}:{port}/{proto:?}: {}", describe(&got));
        echo::wait_answers(&c1, (proto, n2, port), 16, &["b1", "b2"], any, CONVERGE).await.context("c1 → node-2")?;
        echo::wait_answers(&ns1, (proto, n1, port), 16, &["b1", "b2"], any, CONVERGE)
            .await
            .context("node-1 → itself")?;
    }
    // A host outside the cluster on the nodes' network (an address on the underlay's bridge),
    // routing the external IP to node-1 as a router in front of a cluster would. (A node sending
    // to an external IP answers it itself, as kube-proxy does.)
    let outside_ip: IpAddr = match n1 {
        IpAddr::V4(a) => IpAddr::V4(std::net::Ipv4Addr::new(a.octets()[0], a.octets()[1], a.octets()[2], 1)),
        IpAddr::V6(_) => unreachable!(),
    };
    let outside = std::path::PathBuf::from("/var/run/netns").join(cluster.underlay_netns());
    for cmd in [
        vec!["ip".to_string(), "addr".into(), "add".into(), format!("{outside_ip}/24"), "dev".into(), "br0".into()],
        vec!["ip".into(), "route".into(), "add".into(), format!("{EXTERNAL_IP}/32"), "via".into(), n1.to_string()],
    ] {
        let argv: Vec<&str> = cmd.iter().map(String::as_str).collect();
        kuryr_tests::node::netns_exec(&outside, &argv).await?;
    }
    let external: IpAddr = EXTERNAL_IP.parse()?;
    for (proto, to, port) in [(Proto::Tcp, external, PORT), (Proto::Udp, external, PORT), (Proto::Tcp, n2, tcp_np)] {
        let got = echo::wait_answers(&outside, (proto, to, port), 16, &["b1", "b2"], not_from(outside_ip), CONVERGE)
            .await
            .with_context(|| format!("outside → {to}:{port}/{proto:?}"))?;
        eprintln!("  outside ({outside_ip}) → {to}:{port}/{proto:?}: {}", describe(&got));
    }

    eprintln!("2. sessionAffinity ClientIP through the node port");
    services
        .patch(SERVICE, &PatchParams::default(), &Patch::Merge(json!({"spec": {"sessionAffinity": "ClientIP"}})))
        .await?;
    wait_tables(cluster.nodes(), "affinity sets", CONVERGE, |t| t.contains("aff/np/web/tcp/80/")).await?;
    let seen = echo::answers(&ns2, Proto::Tcp, n1, tcp_np, 12).await;
    ensure!(seen.len() == 1, "one client, one backend through the node port: {seen:?}");
    services
        .patch(SERVICE, &PatchParams::default(), &Patch::Merge(json!({"spec": {"sessionAffinity": "None"}})))
        .await?;

    eprintln!("3. externalTrafficPolicy Local: the node's own backend, the client's address kept");
    let patch = json!({"spec": {"externalTrafficPolicy": "Local"}});
    services.patch(SERVICE, &PatchParams::default(), &Patch::Merge(patch)).await?;
    for (from, to, client_ip, who) in [(&ns2, n1, n2, "b1"), (&ns1, n2, n1, "b2"), (&outside, n1, outside_ip, "b1")] {
        for (proto, port) in [(Proto::Tcp, tcp_np), (Proto::Udp, udp_np)] {
            let got = echo::wait_answers(from, (proto, to, port), 12, &[who], move |a| a.peer == client_ip, CONVERGE)
                .await
                .with_context(|| format!("{client_ip} → {to}:{port}/{proto:?} under Local"))?;
            eprintln!("  {client_ip} → {to}:{port}/{proto:?}: {}", describe(&got));
        }
    }
    let got =
        echo::wait_answers(&outside, (Proto::Tcp, external, PORT), 8, &["b1"], move |a| a.peer == outside_ip, CONVERGE)
            .await
            .context("outside → the external IP under Local")?;
    eprintln!("  outside → {external}:{PORT}/Tcp: {}", describe(&got));
    // A pod is not outside: it reaches every backend.
    echo::wait_answers(&c1, (Proto::Tcp, n1, tcp_np), 16, &["b1", "b2"], any, CONVERGE)
        .await
        .context("c1 under Local")?;

    eprintln!("4. type changes: NodePort → ClusterIP → ExternalName → NodePort");
    let vip: IpAddr = services.get(SERVICE).await?.spec.and_then(|s| s.cluster_ip).context("no cluster IP")?.parse()?;
    let to_cluster_ip = json!({"spec": {"type": "ClusterIP", "externalTrafficPolicy": null, "externalIPs": null,
        "ports": [{"name": "tcp", "protocol": "TCP", "port": PORT, "targetPort": TARGET_PORT},
                  {"name": "udp", "protocol": "UDP", "port": PORT, "targetPort": TARGET_PORT}]}});
    services.patch(SERVICE, &PatchParams::default(), &Patch::Merge(to_cluster_ip)).await?;
    ensure!(node_ports(&services).await?.is_empty(), "the API server kept node ports for a ClusterIP Service");
    echo::wait_failing(&ns2, Proto::Tcp, n1, tcp_np, "refused", CONVERGE).await.context("node port after ClusterIP")?;
    echo::wait_answers(&c1, (Proto::Tcp, vip, PORT), 16, &["b1", "b2"], any, CONVERGE).await.context("ClusterIP")?;
    let to_external_name = json!({"spec": {"type": "ExternalName", "externalName": "example.com",
        "clusterIP": null, "clusterIPs": null, "selector": null}});
    services.patch(SERVICE, &PatchParams::default(), &Patch::Merge(to_external_name)).await?;
    wait_tables(cluster.nodes(), "the cluster IP gone", CONVERGE, |t| !table_has(t, vip)).await?;
    let to_node_port = json!({"spec": {"type": "NodePort", "externalName": null, "selector": {"app": "web"}}});
    services.patch(SERVICE, &PatchParams::default(), &Patch::Merge(to_node_port)).await?;
    let np = node_ports(&services).await?;
    for (proto, port) in [(Proto::Tcp, np["TCP"]), (Proto::Udp, np["UDP"])] {
        echo::wait_answers(&ns2, (proto, n1, port), 16, &["b1", "b2"], any, CONVERGE)
            .await
            .with_context(|| format!("node port {port}/{proto:?} after ExternalName → NodePort"))?;
    }

    eprintln!("4b. type LoadBalancer: its node ports, and the ingress address of its status");
    let to_lb = json!({"spec": {"type": "LoadBalancer"}});
    services.patch(SERVICE, &PatchParams::default(), &Patch::Merge(to_lb)).await?;
    let ingress = json!({"status": {"loadBalancer": {"ingress": [{"ip": INGRESS_IP}]}}});
    services.patch_status(SERVICE, &PatchParams::default(), &Patch::Merge(ingress)).await?;
    let route = ["ip", "route", "add", &format!("{INGRESS_IP}/32"), "via", &n2.to_string()].map(String::from);
    kuryr_tests::node::netns_exec(&outside, &route.iter().map(String::as_str).collect::<Vec<_>>()).await?;
    let ingress_ip: IpAddr = INGRESS_IP.parse()?;
    let np = node_ports(&services).await?;
    for (to, port) in [(ingress_ip, PORT), (n1, np["TCP"])] {
        echo::wait_answers(&outside, (Proto::Tcp, to, port), 16, &["b1", "b2"], not_from(outside_ip), CONVERGE)
            .await
            .with_context(|| format!("outside → {to}:{port} of the LoadBalancer Service"))?;
    }

    eprintln!("5. hostPort {HOST_PORT} (TCP and UDP) through the API and the kubelet");
    pods.create(&PostParams::default(), &pod("hp", &node1, "hostport", Some(HOST_PORT))).await?;
    let hp = checks::wait_running(cluster, NAMESPACE, 4, RUNNING_TIMEOUT).await?.into_iter().find(|p| p.name == "hp");
    let hp = hp.context("hp not running")?;
    servers.push(echo::serve(&hp.netns, "hp", TARGET_PORT)?);
    for proto in [Proto::Tcp, Proto::Udp] {
        echo::wait_answers(&ns2, (proto, n1, HOST_PORT), 3, &["hp"], move |a| a.peer == n2, CONVERGE)
            .await
            .with_context(|| format!("node-2 → node-1:{HOST_PORT}/{proto:?}"))?;
        echo::wait_answers(&ns1, (proto, "127.0.0.1".parse()?, HOST_PORT), 3, &["hp"], any, CONVERGE)
            .await
            .with_context(|| format!("node-1 → 127.0.0.1:{HOST_PORT}/{proto:?}"))?;
    }
    echo::wait_failing(&ns1, Proto::Tcp, n2, HOST_PORT, "refused", CONVERGE).await.context("not on node-2")?;
    pods.delete("hp", &DeleteParams::default()).await?;
    echo::wait_failing(&ns2, Proto::Tcp, n1, HOST_PORT, "refused", CONVERGE).await.context("hp deleted")?;
    wait_until("hp's host port out of node-1's table", CONVERGE, || async {
        let t = cluster.nodes()[0].node.exec(&["nft", "list", "map", "inet", "kuryr", "hostports_any4"]).await?;
        ensure!(!t.contains(&HOST_PORT.to_string()), "{t}");
        Ok(())
    })
    .await?;
    Ok(())
}

fn describe(answers: &[Answer]) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for a in answers {
        *counts.entry(a.to_string()).or_insert(0) += 1;
    }
    counts.iter().map(|(who, n)| format!("{who} ×{n}")).collect::<Vec<_>>().join(", ")
}
