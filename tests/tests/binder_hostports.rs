//! Host ports through the real container runtime: containerd's CRI runs pod sandboxes whose
//! config carries port mappings (as kubelet makes them from `ports[].hostPort`), passes them to
//! `kuryr-cni` in `runtimeConfig.portMappings` (the conflist declares the capability), and the
//! binder programs them in the node's table `inet kuryr`. Each pod runs `kuryr-test-echo`, which
//! answers with its name and the client address it saw.
//!
//! The pods of the upstream conformance test "HostPort validates that there is no conflict
//! between pods with same hostPort but different hostIP and protocol" — 54321 on 127.0.0.1/TCP,
//! on the node's IP/TCP and on the node's IP/UDP — are reached from the node itself (as its
//! hostNetwork pod does), plus a pod with a host port on every address, from outside the node
//! (the client's address kept), from pods (hairpin) and from the node; DEL removes a pod's host
//! ports; a binder restarted after the table was lost restores them from its records.
#![allow(clippy::unwrap_used)]

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use k8s_cri::v1::{PortMapping, Protocol as CriProtocol};
use kuryr_tests::echo::{self, Answer, EchoServer, Proto};
use kuryr_tests::netns::Netns;
use kuryr_tests::node::Node;
use kuryr_tests::services::wait_until;
use kuryr_tests::vifserver::{ScriptedAllocator, bridge_vif};

const WAIT: Duration = Duration::from_secs(15);
/// The pods' echo port.
const POD_PORT: i32 = 8080;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn mapping(protocol: CriProtocol, host_port: i32, host_ip: &str) -> PortMapping {
    PortMapping { protocol: protocol as i32, container_port: POD_PORT, host_port, host_ip: host_ip.into() }
}

struct Pod {
    sandbox: String,
    netns: PathBuf,
    ip4: IpAddr,
    _echo: EchoServer,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_ports_by_host_ip_and_protocol_reach_the_right_pod_and_survive_a_binder_restart() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = ScriptedAllocator::new(true);
    let server = alloc.serve_unix(&dir.path().join("alloc.sock")).await.unwrap();
    let mut node = Node::start("node-h", &server.target, &[]).await.unwrap();
    // The node's address, on an uplink to a host outside it.
    let o = (std::process::id() * 7) % 200 + 20;
    let (node_ip, client_ip) = (format!("172.29.{o}.1"), format!("172.29.{o}.2"));
    let client = Netns::new("khc").unwrap();
    let up = format!("ip link add ul0 type veth peer name ul1 netns {}", client.name);
    let addr = format!("ip addr add {node_ip}/24 dev ul0");
    for cmd in [up.as_str(), addr.as_str(), "ip link set ul0 up"] {
        node.exec(&cmd.split(' ').collect::<Vec<_>>()).await.unwrap();
    }
    let caddr = format!("ip addr add {client_ip}/24 dev ul1");
    for cmd in [caddr.as_str(), "ip link set ul1 up"] {
        client.exec(&cmd.split(' ').collect::<Vec<_>>()).unwrap();
    }
    let (gw4, gw6) = (format!("10.78.{o}.1"), format!("fd00:78:{o:x}::1"));

    let cri = node.ctd.cri().clone();
    let mut pods = std::collections::BTreeMap::new();
    let specs: [(&str, Vec<PortMapping>); 4] = [
        ("p1", vec![mapping(CriProtocol::Tcp, 54321, "127.0.0.1")]),
        ("p2", vec![mapping(CriProtocol::Tcp, 54321, &node_ip)]),
        ("p3", vec![mapping(CriProtocol::Udp, 54321, &node_ip)]),
        ("p4", vec![mapping(CriProtocol::Tcp, 54322, ""), mapping(CriProtocol::Udp, 54322, "")]),
    ];
    for (i, (name, mappings)) in specs.into_iter().enumerate() {
        let uid = format!("uid-{name}-{}", std::process::id());
        let a4 = format!("10.78.{o}.{}/24", 10 + i);
        let a6 = format!("fd00:78:{o:x}::{}/64", 10 + i);
        alloc.upsert(bridge_vif("node-h", "default", name, &uid, (&a4, &gw4), Some((&a6, &gw6)), "kuryr0"));
        let mut config = cri.pod_sandbox_config(name, "default", &uid);
        config.port_mappings = mappings;
        let sandbox = cri
            .run_pod_sandbox_with(config)
            .await
            .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e:#}\n{}", node.binder_logs()));
        let status = cri.pod_sandbox_status(&sandbox).await.unwrap();
        let netns = status.netns_path.clone().unwrap();
        let echo = echo::serve(&netns, name, u16::try_from(POD_PORT).unwrap()).unwrap();
        pods.insert(name, Pod { sandbox, netns, ip4: status.ips[0], _echo: echo });
    }
    let node_ns = node.netns_path();
    let gateway = ip(&gw4);
    let any = |_: &Answer| true;

    // From the node itself, as the conformance test's hostNetwork pod: each address and protocol
    // reaches its own pod. 127.0.0.1 is masqueraded (the pod cannot answer it).
    let (n4, c4) = (ip(&node_ip), ip(&client_ip));
    // (The node's own bridge address is one of its addresses too.)
    let from_node = [
        (Proto::Tcp, ip("127.0.0.1"), 54321, "p1"),
        (Proto::Tcp, n4, 54321, "p2"),
        (Proto::Udp, n4, 54321, "p3"),
        (Proto::Tcp, ip("127.0.0.1"), 54322, "p4"),
        (Proto::Udp, ip("127.0.0.1"), 54322, "p4"),
        (Proto::Tcp, n4, 54322, "p4"),
        (Proto::Tcp, gateway, 54322, "p4"),
    ];
    for (proto, to, port, who) in from_node {
        let got = echo::wait_answers(&node_ns, (proto, to, port), 3, &[who], any, WAIT)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}\n{}", table_now(&node), node.binder_logs()));
        eprintln!("node → {proto:?} {to}:{port}: {}", got[0]);
        if to.is_loopback() {
            assert_eq!(got[0].peer, gateway, "127.0.0.1 masqueraded to the bridge's address");
        }
    }
    // One element per mapping and pod address family: p1, p2 and p3 one each (IPv4 host IPs), p4
    // four (TCP and UDP, on both families).
    let metrics = node.exec(&["curl", "-s", "http://127.0.0.1:9631/metrics"]).await.unwrap();
    assert!(metrics.lines().any(|l| l == "kuryr_binder_hostports 7"), "{metrics}");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kuryr_binder_hostport_transactions_total{kind=\"delta\",result=\"ok\"}")),
        "{metrics}"
    );
    let localnet = node.exec(&["sysctl", "-n", "net.ipv4.conf.kuryr0.route_localnet"]).await.unwrap();
    assert_eq!(localnet.trim(), "1", "route_localnet on the pods' bridge");

    // From outside: the node's address (the client's address kept), never 127.0.0.1.
    let kept = move |a: &Answer| a.peer == c4;
    for (proto, port, who) in [(Proto::Tcp, 54321, "p2"), (Proto::Udp, 54321, "p3"), (Proto::Tcp, 54322, "p4")] {
        let got = echo::wait_answers(&client.path(), (proto, n4, port), 3, &[who], kept, WAIT)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", table_now(&node)));
        eprintln!("outside → {proto:?} {n4}:{port}: {}", got[0]);
    }
    // From pods, to another pod's host port and to its own (hairpin): masqueraded through the node.
    let masq = move |a: &Answer| a.peer == gateway;
    echo::wait_answers(&pods["p2"].netns, (Proto::Tcp, n4, 54322), 3, &["p4"], masq, WAIT).await.unwrap();
    echo::wait_answers(&pods["p4"].netns, (Proto::Tcp, n4, 54322), 3, &["p4"], masq, WAIT).await.unwrap();
    echo::wait_answers(&pods["p4"].netns, (Proto::Tcp, n4, 54321), 3, &["p2"], masq, WAIT).await.unwrap();
    assert_eq!(pods["p4"].ip4, ip(&format!("10.78.{o}.13")));

    // StopPodSandbox (CNI DEL): p2's host port is gone; the others stay.
    cri.stop_pod_sandbox(&pods["p2"].sandbox).await.unwrap();
    echo::wait_failing(&node_ns, Proto::Tcp, n4, 54321, "refused", WAIT).await.unwrap();
    echo::wait_answers(&node_ns, (Proto::Udp, n4, 54321), 3, &["p3"], any, WAIT).await.unwrap();
    echo::wait_answers(&node_ns, (Proto::Tcp, ip("127.0.0.1"), 54321), 3, &["p1"], any, WAIT).await.unwrap();

    // The binder restarts after the table was lost: its records bring the host ports back.
    node.binder.kill().await.unwrap();
    node.exec(&["nft", "delete", "table", "inet", "kuryr"]).await.unwrap();
    echo::wait_failing(&node_ns, Proto::Tcp, n4, 54322, "refused", WAIT).await.unwrap();
    node.binder.restart().await.unwrap();
    for (proto, to, port, who) in
        [(Proto::Tcp, ip("127.0.0.1"), 54321, "p1"), (Proto::Udp, n4, 54321, "p3"), (Proto::Tcp, n4, 54322, "p4")]
    {
        echo::wait_answers(&node_ns, (proto, to, port), 3, &[who], any, WAIT)
            .await
            .unwrap_or_else(|e| panic!("after the restart: {e:#}\n{}\n{}", table_now(&node), node.binder_logs()));
    }
    let t = table(&node).await;
    assert!(!t.contains(&format!("{} . 8080", ip(&format!("10.78.{o}.11")))), "p2's host port came back:\n{t}");

    // Every sandbox removed: no host port left.
    cri.remove_all().await.unwrap();
    wait_until("the host port maps empty", WAIT, || async {
        let t = table(&node).await;
        anyhow::ensure!(!t.contains(" . 8080"), "{t}");
        Ok(())
    })
    .await
    .unwrap();
    node.shutdown().await.unwrap();
}

/// The node's table, read synchronously (for failure messages inside closures).
fn table_now(node: &Node) -> String {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={}", node.netns_path().display()))
        .args(["--", "nft", "list", "table", "inet", "kuryr"])
        .output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
}

async fn table(node: &Node) -> String {
    table_now(node)
}
