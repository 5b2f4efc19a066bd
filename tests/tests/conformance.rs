//! kuryr judged by the upstream Kubernetes e2e tests on real nodes.
//!
//! A cluster of two real nodes (kubelet v1.34.4 on containerd, kube-scheduler, the full
//! kube-controller-manager, no kube-proxy) gets kuryr the way a user installs it —
//! `kubectl apply -k deploy/overlays/embedded`, its image imported into the nodes' runtimes, the
//! binder a DaemonSet, the watcher, allocator and lbaas Deployments — and CoreDNS as pods on kuryr's
//! network behind a kuryr Service. Then `e2e.test` (built from the same pinned Kubernetes module)
//! runs the `[sig-network]` Networking and Services conformance tests (21 in v1.34.4) against it.
//! The full 45 run with `make conformance`.
//!
//! The test fails on any failed spec, on fewer specs than expected (a focus that silently matches
//! nothing passes nothing), and on anything the cluster leaves behind.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use kuryr_tests::conformance::{self, NETWORKING_AND_SERVICES, Setup};
use kuryr_tests::util::repo_root;

/// The Networking and Services conformance specs of v1.34.4.
const EXPECTED_SPECS: u32 = 21;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_networking_and_services_conformance_pass_with_kuryr_installed_from_deploy() {
    let cluster = conformance::prepare(&Setup::default()).await.expect("a real-node cluster with kuryr");
    let prefix = cluster.nodes()[0].netns.trim_end_matches(char::is_numeric).trim_end_matches("-n").to_string();

    // kuryr runs as pods, not as host processes: every node has a Running binder pod.
    let binders = cluster
        .kubectl(&[
            "-n",
            "kuryr-system",
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=kuryr-binder",
            "-o",
            "jsonpath={range .items[*]}{.spec.nodeName} {.status.phase}{\"\\n\"}{end}",
        ])
        .await
        .unwrap();
    for node in cluster.nodes() {
        assert!(
            binders.lines().any(|l| l == format!("{} Running", node.name)),
            "no Running binder on {}:\n{binders}",
            node.name
        );
    }

    let report = repo_root().join("target/conformance").join(format!("make-test-{}", std::process::id()));
    let summary = conformance::run_e2e(&cluster, NETWORKING_AND_SERVICES, None, &report).await;
    let down = cluster.shutdown().await;
    let summary = summary.unwrap();
    println!("{}", summary.line);
    assert_eq!(
        summary.failed,
        0,
        "failed specs (log and JUnit in {}):\n{}",
        report.display(),
        summary.failures.join("\n")
    );
    assert!(
        summary.passed >= EXPECTED_SPECS,
        "only {} specs passed (want {EXPECTED_SPECS}): {}",
        summary.passed,
        summary.line
    );
    down.unwrap();

    // Nothing outlives the cluster: no namespace of its nodes or underlay.
    let left: Vec<String> = std::fs::read_dir("/var/run/netns")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .collect();
    assert!(left.is_empty(), "network namespaces left behind: {left:?}");
}
