//! Further interfaces per pod through the Network Plumbing Working Group annotation
//! `k8s.v1.cni.cncf.io/networks`, end to end with the embedded backend and everything real: the
//! API server (with the NetworkAttachmentDefinition CRD of `deploy/crds`), kuryr-watcher and
//! kuryr-vif-allocator under their ServiceAccounts, nodes running containerd + kuryr-cni +
//! kuryr-binder driven by the test kubelet.
//!
//! Two pods on two nodes ask for two further networks each — `blue` (a PodNetwork with an IPv4 CIDR) and
//! `green` (IPv6) — one in the annotation's short form, one in its JSON form. Each pod's
//! namespace has `eth0`, `net1` (blue) and `green0` (green) with the addresses their PodVif
//! records, the `k8s.v1.cni.cncf.io/network-status` annotation lists all three as Multus would,
//! and the pods reach each other across nodes over each further network through that network's
//! interface, also after the allocator and a binder were killed with -9 and restarted.
//! Pods naming an unknown NetworkAttachmentDefinition or a malformed annotation get a
//! `NetworkAttachmentFailed` Event and a CNI error carrying the reason, and hold no address of a
//! further network. Deleting the pods removes every interface and frees every address.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_tests::cluster::checks;
use kuryr_tests::cluster::reach;
use kuryr_tests::cluster::{Cluster, ClusterOptions, ServiceKind, run_scenario};
use kuryr_tests::node::netns_exec;
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use kuryr_tests::shim::run_shim;
use kuryr_vif_allocator::core::ipam::ipnet::IpNet;
use kuryr_vif_allocator::k8s::crd::{AddressBlock, PodNetwork, PodNetworkSpec, PodVif};
use kuryr_vif_allocator::k8s::crd::{NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec};
use serde_json::Value;

const NAMESPACE: &str = "mv";
const V4_CIDR: &str = "10.244.0.0/16";
const V6_CIDR: &str = "fd00:10:244::/56";
const BLUE_CIDR: &str = "10.123.0.0/16";
const GREEN_CIDR: &str = "fd00:123::/56";
const TIMEOUT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pods_get_further_interfaces_on_ipv4_and_ipv6_networks_and_lose_them_on_delete() {
    let opts =
        ClusterOptions { nodes: 2, network_cidrs: vec![V4_CIDR.into(), V6_CIDR.into()], ..ClusterOptions::default() };
    run_scenario("multi-vif", opts, async |c| scenario(c).await).await.unwrap_or_else(|e| panic!("{e:#}"));
}

fn pod(name: &str, node: &str, networks: &str) -> Pod {
    objects::pod(name).namespace(NAMESPACE).node(node).annotation("k8s.v1.cni.cncf.io/networks", networks).build()
}

fn nad(name: &str, config: &str) -> NetworkAttachmentDefinition {
    let mut n = NetworkAttachmentDefinition::new(name, NetworkAttachmentDefinitionSpec { config: Some(config.into()) });
    n.metadata.namespace = Some(NAMESPACE.into());
    n
}

/// An interface in a pod's namespace, as `ip -j addr` shows it.
#[derive(Debug)]
struct Link {
    mac: String,
    /// Global addresses with their prefix lengths.
    addresses: Vec<IpNet>,
}

async fn link(netns: &Path, ifname: &str) -> Result<Link> {
    let out = netns_exec(netns, &["ip", "-j", "addr", "show", "dev", ifname]).await?;
    let v: Value = serde_json::from_str(&out).with_context(|| format!("ip -j addr: {out}"))?;
    let l = v.get(0).with_context(|| format!("no {ifname} in {}", netns.display()))?;
    let mac = l["address"].as_str().unwrap_or_default().to_string();
    let mut addresses = Vec::new();
    for a in l["addr_info"].as_array().into_iter().flatten() {
        if a["scope"] == "global" {
            addresses.push(format!("{}/{}", a["local"].as_str().unwrap_or_default(), a["prefixlen"]).parse()?);
        }
    }
    Ok(Link { mac, addresses })
}

/// The device the pod in `netns` sends to `ip` through.
async fn route_dev(netns: &Path, ip: IpAddr) -> Result<String> {
    let out = netns_exec(netns, &["ip", "-j", "route", "get", &ip.to_string()]).await?;
    let v: Value = serde_json::from_str(&out)?;
    Ok(v[0]["dev"].as_str().unwrap_or_default().to_string())
}

async fn scenario(cluster: &mut Cluster) -> Result<()> {
    let client = cluster.client();
    let node1 = cluster.nodes()[0].name.clone();
    let node2 = cluster.nodes()[1].name.clone();
    objects::create_namespace(&client, NAMESPACE).await?;

    // Two further networks: blue (IPv4) and green (IPv6), each on its own node bridge.
    let networks: Api<PodNetwork> = Api::all(client.clone());
    for (name, cidr, bridge) in [("blue", BLUE_CIDR, "kuryrblue"), ("green", GREEN_CIDR, "kuryrgreen")] {
        let mut spec = PodNetworkSpec::new([cidr]);
        spec.bridge = bridge.into();
        networks.create(&PostParams::default(), &PodNetwork::new(name, spec)).await?;
    }
    let nads: Api<NetworkAttachmentDefinition> = Api::namespaced(client.clone(), NAMESPACE);
    for name in ["blue", "green"] {
        let config =
            format!(r#"{{"cniVersion":"1.1.0","name":"{name}","type":"kuryr","kuryr":{{"podNetwork":"{name}"}}}}"#);
        nads.create(&PostParams::default(), &nad(name, &config)).await?;
    }
    nads.create(&PostParams::default(), &nad("macvlan", r#"{"cniVersion":"1.1.0","type":"macvlan"}"#)).await?;

    // The two forms of the annotation, asking for the same interfaces.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    pods.create(&PostParams::default(), &pod("a", &node1, "blue, mv/green@green0")).await?;
    let json_form = r#"[{"name":"blue"},{"name":"green","namespace":"mv","interface":"green0"}]"#;
    pods.create(&PostParams::default(), &pod("b", &node2, json_form)).await?;
    let running = checks::wait_running(cluster, NAMESPACE, 2, TIMEOUT).await?;

    let (blue, green): (IpNet, IpNet) = (BLUE_CIDR.parse()?, GREEN_CIDR.parse()?);
    let vifs: Api<PodVif> = Api::namespaced(client.clone(), NAMESPACE);
    let mut further: BTreeMap<String, (IpAddr, IpAddr)> = BTreeMap::new();
    for p in &running {
        let eth0 = link(&p.netns, "eth0").await?;
        let net1 = link(&p.netns, "net1").await?;
        let green0 = link(&p.netns, "green0").await?;
        let eth0_ips: Vec<IpAddr> = eth0.addresses.iter().map(IpNet::addr).collect();
        ensure!(eth0_ips == p.ips, "{}: eth0 has {eth0_ips:?}, podIPs {:?}", p.name, p.ips);
        ensure!(
            net1.addresses.len() == 1 && blue.contains(&net1.addresses[0].addr()),
            "{}: net1 has {:?}, want one address of {BLUE_CIDR}",
            p.name,
            net1.addresses
        );
        ensure!(
            green0.addresses.len() == 1 && green.contains(&green0.addresses[0].addr()),
            "{}: green0 has {:?}, want one address of {GREEN_CIDR}",
            p.name,
            green0.addresses
        );
        let (b, g) = (net1.addresses[0].addr(), green0.addresses[0].addr());
        further.insert(p.name.clone(), (b, g));

        // The default routes stay on eth0.
        let default = netns_exec(&p.netns, &["ip", "-j", "route", "show", "default"]).await?;
        let default: Value = serde_json::from_str(&default)?;
        ensure!(default.as_array().is_some_and(|d| d.iter().all(|r| r["dev"] == "eth0")), "{}: {default}", p.name);

        // The network-status annotation, as Multus writes it.
        let pod = pods.get(&p.name).await?;
        let status = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("k8s.v1.cni.cncf.io/network-status"))
            .with_context(|| format!("{}: no network-status annotation", p.name))?;
        let status: Value = serde_json::from_str(status)?;
        let entry = |name: &str, ifname: &str, l: &Link, default: bool| {
            let ips: Vec<String> = l.addresses.iter().map(|a| a.addr().to_string()).collect();
            let mut e = serde_json::json!({"name": name, "interface": ifname, "ips": ips, "mac": l.mac, "dns": {}});
            if default {
                e["default"] = Value::Bool(true);
            }
            e
        };
        let want = Value::Array(vec![
            entry("kuryr", "eth0", &eth0, true),
            entry("mv/blue", "net1", &net1, false),
            entry("mv/green", "green0", &green0, false),
        ]);
        ensure!(status == want, "{}: network-status {status}\nwant {want}", p.name);

        // The PodVif records the same.
        let vif = vifs.get(&p.name).await?.spec.vif.context("PodVif without a VIF")?;
        let recorded: Vec<(String, String, String)> = vif
            .attachments
            .iter()
            .map(|a| (a.attachment.clone(), a.ifname.clone(), a.ips.iter().map(|i| i.address.clone()).collect()))
            .collect();
        let want = vec![
            ("mv/blue".to_string(), "net1".to_string(), net1.addresses[0].to_string()),
            ("mv/green".to_string(), "green0".to_string(), green0.addresses[0].to_string()),
        ];
        ensure!(recorded == want, "{}: PodVif attachments {recorded:?}, want {want:?}", p.name);
        eprintln!("{}: eth0 {eth0_ips:?}, net1 {b}, green0 {g}", p.name);
    }
    for node in [&node1, &node2] {
        let veths = checks::host_veths(cluster, node).await?;
        ensure!(veths.len() == 3, "{node}: {} host veths for a pod of 3 interfaces: {veths:?}", veths.len());
    }

    // Traffic between the pods (on two nodes) over each further network, through that network's
    // interface: the further networks' address blocks are routed between nodes like the primary's.
    let (a, b) = (&running[0], &running[1]);
    for (from, to) in [(a, b), (b, a)] {
        let (blue_ip, green_ip) = further[&to.name];
        for (ip, dev) in [(blue_ip, "net1"), (green_ip, "green0")] {
            let via = route_dev(&from.netns, ip).await?;
            ensure!(via == dev, "{} reaches {ip} through {via}, want {dev}", from.name);
            let (mut ok, mut out) = reach::ping(&from.netns, ip).await;
            if !ok {
                (ok, out) = reach::ping(&from.netns, ip).await;
            }
            ensure!(ok, "{} → {} at {ip} ({dev}): {out}", from.name, to.name);
        }
    }
    // The check can fail: an address of blue that no pod holds does not answer.
    let (answered, _) = reach::ping(&a.netns, "10.123.255.254".parse()?).await;
    ensure!(!answered, "an unallocated address of blue answered");
    eprintln!("a ({node1}) ↔ b ({node2}) over blue (IPv4) and green (IPv6): ok");

    // Crashes: the allocator (kill -9, restarted: it recovers the further interfaces from the
    // PodVifs) and pod a's binder (kill -9, restarted: it reloads their attachment records). The
    // pods keep their further networks, a repeated ADD still lists them and, below, DEL and the
    // release still remove and free all of them.
    cluster.restart_service(ServiceKind::Allocator).await?;
    let binder = &mut cluster.node_mut(&a.node).context("node")?.node.binder;
    binder.kill().await?;
    binder.restart().await?;
    ensure!(
        binder.attachment_records() == 3,
        "{}: {} attachment records after a restart, want 3",
        a.node,
        binder.attachment_records()
    );
    for (from, to) in [(a, b), (b, a)] {
        let (blue_ip, green_ip) = further[&to.name];
        for ip in [blue_ip, green_ip] {
            let (mut ok, mut out) = reach::ping(&from.netns, ip).await;
            if !ok {
                (ok, out) = reach::ping(&from.netns, ip).await;
            }
            ensure!(ok, "after the crashes: {} → {} at {ip}: {out}", from.name, to.name);
        }
    }
    cni_result_lists_every_interface(cluster, a, &further).await?;
    bad_input(cluster, &pods).await?;

    // DEL removes every interface and frees every address.
    for p in &running {
        pods.delete(&p.name, &DeleteParams::default()).await?;
    }
    checks::wait_released(cluster, TIMEOUT).await?;
    let blocks: Api<AddressBlock> = Api::all(client.clone());
    let mut networks_seen: Vec<String> =
        blocks.list(&ListParams::default()).await?.items.into_iter().map(|b| b.spec.network).collect();
    networks_seen.sort();
    networks_seen.dedup();
    ensure!(
        networks_seen.contains(&"blue".to_string()) && networks_seen.contains(&"green".to_string()),
        "blocks of the further networks were never claimed: {networks_seen:?}"
    );
    eprintln!("deleted: every interface gone, every address of {networks_seen:?} free");
    Ok(())
}

/// The CNI result lists every interface with its addresses tied to it by index: asked through
/// the shim as the runtime does (a repeated ADD of the live sandbox, which the binder answers from
/// what it plugged, as the first ADD did).
async fn cni_result_lists_every_interface(
    cluster: &Cluster,
    p: &checks::RunningPod,
    further: &BTreeMap<String, (IpAddr, IpAddr)>,
) -> Result<()> {
    let node = cluster.node(&p.node).context("node")?;
    let kubelet = cluster.kubelets().iter().find(|k| k.node() == p.node).context("kubelet")?;
    let sandbox = kubelet.pod(NAMESPACE, &p.name).and_then(|r| r.sandbox_id).context("no sandbox id")?;
    let conf = serde_json::json!({
        "cniVersion": "1.1.0", "name": "kuryr", "type": "kuryr-cni", "binderSocket": node.node.binder.socket,
    });
    let netns = p.netns.display().to_string();
    let args = format!("K8S_POD_NAMESPACE={NAMESPACE};K8S_POD_NAME={};K8S_POD_UID={}", p.name, p.uid);
    let env = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", sandbox.as_str()),
        ("CNI_NETNS", netns.as_str()),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
        ("CNI_ARGS", args.as_str()),
    ];
    let out = run_shim(&env, conf.to_string().as_bytes())?;
    ensure!(out.code == 0, "repeated ADD of {}: {} {}", p.name, out.stdout, out.stderr);
    let result = out.json()?;
    let interfaces = result["interfaces"].as_array().context("no interfaces")?;
    let in_pod: Vec<&str> = interfaces
        .iter()
        .filter(|i| i["sandbox"].as_str().is_some_and(|s| s == netns))
        .filter_map(|i| i["name"].as_str())
        .collect();
    ensure!(in_pod == ["eth0", "net1", "green0"], "{}: pod interfaces in the result {in_pod:?}: {result}", p.name);
    ensure!(interfaces.len() == 6, "{}: want a host and a pod end per interface: {result}", p.name);
    let (blue, green) = further[&p.name];
    let mut by_ifname: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    for ip in result["ips"].as_array().context("no ips")? {
        let i = usize::try_from(ip["interface"].as_u64().context("an address without its interface")?)?;
        let name = interfaces.get(i).and_then(|x| x["name"].as_str()).context("interface index out of range")?;
        let addr: IpNet = ip["address"].as_str().context("address")?.parse()?;
        by_ifname.entry(name.to_string()).or_default().push(addr.addr());
    }
    let want: BTreeMap<String, Vec<IpAddr>> =
        [("eth0".to_string(), p.ips.clone()), ("green0".to_string(), vec![green]), ("net1".to_string(), vec![blue])]
            .into();
    ensure!(by_ifname == want, "{}: addresses by interface {by_ifname:?}, want {want:?}", p.name);
    eprintln!("{}: the CNI result lists {in_pod:?} with their addresses", p.name);
    Ok(())
}

/// Pods whose request cannot be honoured: the reason as a pod Event from the allocator and in
/// the CNI error the kubelet reports, and no address of a further network held.
async fn bad_input(cluster: &Cluster, pods: &Api<Pod>) -> Result<()> {
    let node1 = cluster.nodes()[0].name.clone();
    let client = cluster.client();
    let cases = [
        ("unknown", "blue, nosuch", "NetworkAttachmentDefinition mv/nosuch does not exist"),
        ("malformed", "blue@bad/name", "not a valid Linux interface name"),
        ("json", r#"[{"name":"blue","ips":["10.123.9.9/16"]}]"#, "asks for \"ips\""),
        ("foreign", "macvlan", "kuryr attaches only type \"kuryr\""),
    ];
    let events: Api<Event> = Api::namespaced(client.clone(), NAMESPACE);
    for (name, annotation, _) in &cases {
        pods.create(&PostParams::default(), &pod(name, &node1, annotation)).await?;
    }
    for (name, _, want) in &cases {
        let fields = format!("involvedObject.name={name}");
        let (allocator, kubelet) = wait_until(&format!("{name}: the reason in Events"), TIMEOUT, || async {
            let list = events.list(&ListParams::default().fields(&fields)).await?.items;
            let find = |reason: &str| {
                list.iter()
                    .find(|e| {
                        e.reason.as_deref() == Some(reason) && e.message.as_deref().unwrap_or_default().contains(want)
                    })
                    .map(|e| e.message.clone().unwrap_or_default())
            };
            match (find("NetworkAttachmentFailed"), find("FailedCreatePodSandBox")) {
                (Some(a), Some(k)) => Ok((a, k)),
                (a, k) => bail!(
                    "not yet: allocator {a:?}, kubelet {k:?}; events {:?}",
                    list.iter().map(|e| (&e.reason, &e.message)).collect::<Vec<_>>()
                ),
            }
        })
        .await?;
        eprintln!("{name}: allocator: {allocator:?}\n  kubelet: {kubelet:?}");
        let p = pods.get(name).await?;
        ensure!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running"),
            "{name} is Running without its interfaces"
        );
        // No address of a further network is held for it (its primary one stays until deletion).
        let uid = p.metadata.uid.clone().unwrap_or_default();
        let blocks: Api<AddressBlock> = Api::all(client.clone());
        for b in blocks.list(&ListParams::default()).await?.items {
            if b.spec.network == "blue" || b.spec.network == "green" {
                let held = b.status.iter().flat_map(|s| s.allocations.iter()).filter(|(_, a)| a.uid == uid).count();
                ensure!(held == 0, "{name} holds {held} address(es) of {} ({})", b.spec.network, b.spec.cidr);
            }
        }
    }
    for (name, _, _) in &cases {
        pods.delete(name, &DeleteParams::default()).await?;
    }
    wait_until("the bad pods gone", TIMEOUT, || async {
        let left: Vec<String> = pods
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .filter(|n| cases.iter().any(|(c, _, _)| c == n))
            .collect();
        ensure!(left.is_empty(), "still there: {left:?}");
        Ok(())
    })
    .await?;
    Ok(())
}
