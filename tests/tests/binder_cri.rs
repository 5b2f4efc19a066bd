//! The node data path through the real container runtime: containerd's CRI runs pod sandboxes,
//! calls `kuryr-cni`, which calls `kuryr-binder`, which waits for the pod's VIF on the (scripted)
//! allocator's stream and plugs it into a Linux bridge — as kubelet would drive it.
#![allow(clippy::unwrap_used)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use kuryr_proto::allocator::v1::VifState;
use kuryr_tests::cri::Cri;
use kuryr_tests::node::Node;
use kuryr_tests::vifserver::{ScriptedAllocator, bridge_vif};

/// A /24 per test process, so that concurrent runs are told apart in failures.
fn octet(test: u32) -> u32 {
    (std::process::id() * 3 + test) % 200 + 20
}

/// What `argv` printed, run in the network namespace of the sandbox `id`.
async fn sandbox_output(cri: &Cri, id: &str, argv: &[&str]) -> String {
    String::from_utf8(cri.exec_in_sandbox_netns(id, argv, Duration::from_secs(10)).await.unwrap().stdout).unwrap()
}

async fn host_links(node: &Node) -> Vec<String> {
    let out = node.exec(&["ip", "-o", "link", "show"]).await.unwrap();
    out.lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap().to_string())
        .filter(|n| n.starts_with("kv"))
        .collect()
}

#[tokio::test]
async fn cri_pods_get_their_vif_reach_each_other_and_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = ScriptedAllocator::new(true);
    let server = alloc.serve_unix(&dir.path().join("alloc.sock")).await.unwrap();
    let node = Node::start("node-a", &server.target, &[]).await.unwrap();
    let o = octet(0);
    let gw4 = format!("10.77.{o}.1");
    let gw6 = format!("fd00:77:{o:x}::1");
    let mut vifs = Vec::new();
    for (i, name) in ["p1", "p2"].iter().enumerate() {
        let uid = format!("uid-{name}-{}", std::process::id());
        let a4 = format!("10.77.{o}.{}/24", 10 + i);
        let a6 = format!("fd00:77:{o:x}::{}/64", 10 + i);
        let vif = bridge_vif("node-a", "default", name, &uid, (&a4, &gw4), Some((&a6, &gw6)), "kuryr0");
        alloc.upsert(vif.clone());
        vifs.push(vif);
    }

    let cri = node.ctd.cri();
    let mut sandboxes = Vec::new();
    for v in &vifs {
        let p = v.pod.as_ref().unwrap();
        let t = Instant::now();
        let id = cri
            .run_pod_sandbox(&p.name, &p.namespace, &p.uid)
            .await
            .unwrap_or_else(|e| panic!("RunPodSandbox {}: {e:#}\n{}", p.name, node.binder_logs()));
        eprintln!("RunPodSandbox {} took {:?}", p.name, t.elapsed());
        sandboxes.push(id);
    }

    // PodSandboxStatus reports the VIF's addresses.
    for (id, v) in sandboxes.iter().zip(&vifs) {
        let st = cri.pod_sandbox_status(id).await.unwrap();
        let want: IpAddr = v.ips[0].address.split('/').next().unwrap().parse().unwrap();
        assert_eq!(st.ips.first(), Some(&want), "sandbox IPs {:?}", st.ips);
        // eth0 has the VIF's MAC, MTU, addresses and routes.
        let link = sandbox_output(cri, id, &["ip", "-o", "link", "show", "eth0"]).await;
        assert!(link.contains(&v.mac), "MAC {} not on eth0: {link}", v.mac);
        assert!(link.contains("mtu 1400"), "MTU: {link}");
        let addrs = sandbox_output(cri, id, &["ip", "-o", "addr", "show", "eth0"]).await;
        for ip in &v.ips {
            assert!(addrs.contains(&ip.address), "{} missing: {addrs}", ip.address);
        }
        let routes = sandbox_output(cri, id, &["ip", "route", "show"]).await;
        assert!(routes.contains(&format!("default via {gw4} dev eth0")), "{routes}");
        assert!(routes.contains(&format!("198.18.0.0/15 via {gw4} dev eth0")), "{routes}");
        let routes6 = sandbox_output(cri, id, &["ip", "-6", "route", "show"]).await;
        assert!(routes6.contains(&format!("default via {gw6} dev eth0")), "{routes6}");
    }
    // The binder reported each VIF plugged, and the allocator made them ready.
    let reports = alloc.reports();
    for v in &vifs {
        let uid = &v.pod.as_ref().unwrap().uid;
        assert!(reports.iter().any(|r| &r.pod_uid == uid && r.plugged && r.vif_id == v.vif_id), "{reports:?}");
        assert_eq!(alloc.state_of(uid), Some(VifState::Ready));
    }
    // The second pod reaches the first through the bridge, over IPv4 and IPv6.
    let p1_ip: IpAddr = vifs[0].ips[0].address.split('/').next().unwrap().parse().unwrap();
    assert!(cri.ping_from_sandbox(&sandboxes[1], p1_ip, 3).await.unwrap(), "p2 cannot ping p1");
    let p1_ip6 = vifs[0].ips[1].address.split('/').next().unwrap().to_string();
    let out = cri
        .exec_in_sandbox_netns(
            &sandboxes[1],
            &["ping", "-6", "-n", "-c", "2", "-W", "2", &p1_ip6],
            Duration::from_secs(20),
        )
        .await
        .unwrap();
    assert!(out.status.success(), "p2 cannot ping p1 over IPv6: {}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(host_links(&node).await.len(), 2);

    // StopPodSandbox (DEL with the netns) then RemovePodSandbox (DEL without): nothing left.
    for id in &sandboxes {
        cri.stop_pod_sandbox(id).await.unwrap_or_else(|e| panic!("stop: {e:#}\n{}", node.binder_logs()));
        cri.remove_pod_sandbox(id).await.unwrap_or_else(|e| panic!("remove: {e:#}\n{}", node.binder_logs()));
    }
    assert!(host_links(&node).await.is_empty(), "host veths left: {:?}", host_links(&node).await);
    let records: Vec<_> = std::fs::read_dir(node.binder.state_dir.join("attachments")).unwrap().collect();
    assert!(records.is_empty(), "attachment records left: {records:?}");
    assert!(cri.list_pod_sandboxes().await.unwrap().is_empty());
}

#[tokio::test]
async fn add_answers_unknown_pods_and_survives_binder_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = ScriptedAllocator::new(true);
    let server = alloc.serve_unix(&dir.path().join("alloc.sock")).await.unwrap();
    let mut node = Node::start("node-b", &server.target, &["--vif-wait-timeout".into(), "2s".into()]).await.unwrap();
    let o = octet(1);
    let gw = format!("10.78.{o}.1");

    // A pod whose VIF was released (the pod was deleted) is an unknown container: CNI code 3.
    let gone = bridge_vif("node-b", "default", "gone", "uid-gone", (&format!("10.78.{o}.9/24"), &gw), None, "kuryr0");
    alloc.upsert(gone);
    alloc.delete("uid-gone");
    let err = node.ctd.cri().run_pod_sandbox("gone", "default", "uid-gone").await.unwrap_err();
    assert!(format!("{err:#}").contains("no longer exists"), "{err:#}");

    // A pod without a VIF waits out the deadline and is told to try again later.
    let t = Instant::now();
    let err = node.ctd.cri().run_pod_sandbox("novif", "default", "uid-novif").await.unwrap_err();
    assert!(format!("{err:#}").contains("no VIF for pod"), "{err:#}");
    assert!(t.elapsed() < Duration::from_secs(15), "took {:?}", t.elapsed());

    // A running pod survives a binder restart; later DEL works from the reloaded records.
    let vif = bridge_vif("node-b", "default", "keep", "uid-keep", (&format!("10.78.{o}.10/24"), &gw), None, "kuryr0");
    alloc.upsert(vif);
    let id = node.ctd.cri().run_pod_sandbox("keep", "default", "uid-keep").await.unwrap();
    node.binder.stop().await.unwrap();

    // While the binder is down, a CNI call fails fast instead of hanging.
    alloc.upsert(bridge_vif(
        "node-b",
        "default",
        "late",
        "uid-late",
        (&format!("10.78.{o}.11/24"), &gw),
        None,
        "kuryr0",
    ));
    let t = Instant::now();
    let err = node.ctd.cri().run_pod_sandbox("late", "default", "uid-late").await.unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}: {err:#}", t.elapsed());
    assert!(format!("{err:#}").contains("not reachable"), "{err:#}");

    node.binder.restart().await.unwrap();
    assert_eq!(host_links(&node).await.len(), 1, "the running pod's veth survives");
    // As kubelet does after a failed RunPodSandbox: stop and remove what is left of it (its DEL
    // failed while the binder was down), then try again.
    for sb in node.ctd.cri().list_pod_sandboxes().await.unwrap() {
        if sb.metadata.as_ref().is_some_and(|m| m.name == "late") {
            node.ctd.cri().stop_pod_sandbox(&sb.id).await.unwrap();
            node.ctd.cri().remove_pod_sandbox(&sb.id).await.unwrap();
        }
    }
    let late = node
        .ctd
        .cri()
        .run_pod_sandbox("late", "default", "uid-late")
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", node.binder_logs()));
    for id in [id, late] {
        node.ctd.cri().stop_pod_sandbox(&id).await.unwrap();
        node.ctd.cri().remove_pod_sandbox(&id).await.unwrap();
    }
    assert!(host_links(&node).await.is_empty(), "{:?}", host_links(&node).await);
}
