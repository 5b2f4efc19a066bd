//! Cross-node reachability for the embedded backend: the binder programs routes to other nodes'
//! pod blocks (via each node's address) from the NODE_ROUTES events of its VIF stream, removes
//! them when withdrawn, and cleans up stale ones after a restart.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kuryr_proto::allocator::v1::NodeRoutes;
use kuryr_tests::binder::Binder;
use kuryr_tests::netns::Netns;
use kuryr_tests::services::wait_until;
use kuryr_tests::vifserver::ScriptedAllocator;

fn kuryr_routes(ns: &Netns) -> String {
    let mut s = ns.exec(&["ip", "route", "show", "proto", "75"]).unwrap();
    s.push_str(&ns.exec(&["ip", "-6", "route", "show", "proto", "75"]).unwrap());
    s
}

async fn wait_routes(ns: &Netns, what: &str, pred: impl Fn(&str) -> bool) {
    wait_until(what, Duration::from_secs(10), || async {
        let r = kuryr_routes(ns);
        anyhow::ensure!(pred(&r), "routes now: {r}");
        Ok(())
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_follow_node_routes_events() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = ScriptedAllocator::new(true);
    let server = alloc.serve_unix(&dir.path().join("alloc.sock")).await.unwrap();
    let node = Netns::new("krn").unwrap();
    // The network between nodes: one link with an address in the other nodes' subnet.
    node.exec(&["ip", "link", "add", "ul0", "type", "veth", "peer", "name", "ul1"]).unwrap();
    node.exec(&["ip", "addr", "add", "172.30.9.1/24", "dev", "ul0"]).unwrap();
    node.exec(&["ip", "-6", "addr", "add", "fd00:30:9::1/64", "dev", "ul0", "nodad"]).unwrap();
    node.exec(&["ip", "link", "set", "ul0", "up"]).unwrap();
    node.exec(&["ip", "link", "set", "ul1", "up"]).unwrap();
    // A route of someone else's that must survive everything.
    node.exec(&["ip", "route", "add", "192.0.2.0/24", "via", "172.30.9.200"]).unwrap();

    alloc.upsert_node_routes(NodeRoutes {
        node_name: "node-x".into(),
        node_ips: vec!["172.30.9.9".into(), "fd00:30:9::9".into()],
        cidrs: vec!["10.250.0.0/24".into(), "fd00:10:250::/120".into()],
    });
    // The node's own blocks are never routed via itself.
    alloc.upsert_node_routes(NodeRoutes {
        node_name: "node-r".into(),
        node_ips: vec!["172.30.9.1".into()],
        cidrs: vec!["10.250.9.0/24".into()],
    });
    let mut binder = Binder::start("node-r", &node.path(), &server.target, &[]).await.unwrap();
    wait_routes(&node, "routes to node-x", |r| {
        r.contains("10.250.0.0/24 via 172.30.9.9")
            && r.contains("fd00:10:250::/120 via fd00:30:9::9")
            && !r.contains("10.250.9.0")
    })
    .await;
    assert_eq!(node.exec(&["cat", "/proc/sys/net/ipv4/ip_forward"]).unwrap().trim(), "1");

    // A block moves to a new node address; another node appears.
    alloc.upsert_node_routes(NodeRoutes {
        node_name: "node-x".into(),
        node_ips: vec!["172.30.9.10".into()],
        cidrs: vec!["10.250.0.0/24".into()],
    });
    alloc.upsert_node_routes(NodeRoutes {
        node_name: "node-y".into(),
        node_ips: vec!["172.30.9.11".into()],
        cidrs: vec!["10.250.1.0/24".into()],
    });
    wait_routes(&node, "updated routes", |r| {
        r.contains("10.250.0.0/24 via 172.30.9.10")
            && r.contains("10.250.1.0/24 via 172.30.9.11")
            && !r.contains("fd00:10:250")
    })
    .await;

    // Withdrawn while the binder is down: the restarted binder removes the stale route.
    binder.stop().await.unwrap();
    alloc.delete_node_routes("node-y");
    binder.restart().await.unwrap();
    wait_routes(&node, "stale route removed", |r| {
        r.contains("10.250.0.0/24 via 172.30.9.10") && !r.contains("10.250.1.0")
    })
    .await;

    alloc.delete_node_routes("node-x");
    wait_routes(&node, "all routes withdrawn", |r| r.trim().is_empty()).await;
    let all = node.exec(&["ip", "route", "show"]).unwrap();
    assert!(all.contains("192.0.2.0/24 via 172.30.9.200"), "another owner's route was touched: {all}");
}
