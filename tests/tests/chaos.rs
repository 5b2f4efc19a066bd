//! Short chaos runs: on the embedded backend ([`kuryr_tests::chaos`]), 60 pods created and
//! deleted over two and a half minutes on two nodes (at most 20 live, a third of them endpoints
//! of two Services), a random fault every ~5 s (kill -9 of the watcher, the allocator, lbaas or a
//! binder, also during DEL and GC; SIGSTOP of a service; the API server stalled). The assertion
//! is the invariants after the quiet period: nothing leaked, nothing duplicated, every live pod
//! with exactly one VIF and reachable from every node, every Service answered by exactly its
//! ready endpoints from every node, nothing of a deleted pod left on a node.
//!
//! And on the Neutron backend ([`kuryr_tests::chaos::neutron`]), 30 pods behind the fault proxy.
//!
//! The checker itself is tested on constructed state here too (and in the library's unit
//! tests): a leak it cannot see would make the run pass for nothing.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kuryr_tests::chaos::invariants::{self, Allocation, LivePod, NodeHeld, Snapshot, VifRecord};
use kuryr_tests::chaos::{self, ChaosOptions};

#[test]
fn the_checker_sees_a_leaked_address_and_a_duplicate() {
    let pod = LivePod {
        key: "chaos/a".into(),
        uid: "u1".into(),
        node: "n1".into(),
        ips: vec!["10.0.0.2".into()],
        running: true,
    };
    let vif = VifRecord { key: "chaos/a".into(), pod_uid: "u1".into(), mac: "m1".into(), ips: vec!["10.0.0.2".into()] };
    let alloc = |ip: &str, key: &str, uid: &str| Allocation {
        ip: ip.into(),
        node: "n1".into(),
        key: key.into(),
        uid: uid.into(),
        mac: String::new(),
    };
    let node = NodeHeld { node: "n1".into(), veths: 1, attachments: 1, sandboxes: 1, ..NodeHeld::default() };
    let mut s = Snapshot {
        pods: vec![pod],
        vifs: vec![vif],
        allocations: vec![alloc("10.0.0.2", "chaos/a", "u1")],
        nodes: vec![node],
    };
    assert!(invariants::check(&s).clean(), "{}", invariants::check(&s).summary());
    // A deleted pod's address still allocated.
    s.allocations.push(alloc("10.0.0.3", "chaos/gone", "u2"));
    let f = invariants::check(&s);
    assert_eq!((f.leaked.len(), f.duplicate.len()), (1, 0), "{}", f.summary());
    // The live pod's address allocated a second time.
    s.allocations.push(alloc("10.0.0.2", "chaos/gone", "u2"));
    let f = invariants::check(&s);
    assert_eq!(f.duplicate.len(), 1, "{}", f.summary());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_pods_of_churn_under_random_faults_leave_nothing_leaked_duplicated_or_unreachable() {
    let seed = std::env::var("CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7);
    let opts = ChaosOptions {
        pods: 60,
        duration: Duration::from_secs(150),
        fault_every: Duration::from_secs(5),
        nodes: 2,
        live: 20,
        services: 2,
        deployments: true,
        quiet: Duration::from_secs(150),
        seed,
        verbose: true,
    };
    let outcome = chaos::run(&opts).await.unwrap_or_else(|e| panic!("the chaos run failed: {e:#}"));
    eprintln!("faults:\n  {}", outcome.fault_log.join("\n  "));
    eprintln!(
        "converged after the last fault in {:?}; start-up (p50, p99, max) {:?}",
        outcome.converged_in, outcome.startup
    );
    eprintln!("kuryr_retries_total by component at the end: {:?}", outcome.retries);
    eprintln!("{}", outcome.last_line());
    assert_eq!(
        outcome.pods - outcome.by_deployments,
        60,
        "every pod created (beside the Deployments' {})",
        outcome.by_deployments
    );
    assert!(outcome.faults >= 10, "only {} faults injected", outcome.faults);
    assert!(outcome.checked_during >= 5, "the invariants checked only {} times during the run", outcome.checked_during);
    assert!(outcome.converged_in.is_some(), "not converged: {:#?}", outcome.details);
    assert!(outcome.services_checked == 2 && outcome.pings > 0, "{outcome:?}");
    assert!(
        outcome.scaled >= 5 && outcome.by_deployments > 0,
        "Deployments scaled {} times, {} pods",
        outcome.scaled,
        outcome.by_deployments
    );
    assert!(outcome.ok(), "{}\n{}", outcome.last_line(), outcome.details.join("\n"));
}

/// The Neutron backend, small: 30 pods through the CNI shim on the Neutron node (at most 8
/// live) over two minutes, the allocator reaching Neutron through the fault proxy (503, 409,
/// slow answers and lost POST answers at 5 % each, timeouts at 1 %), a process fault every ~10 s
/// (kill -9 of one of the two allocator replicas or the binder, SIGSTOP of a replica or the
/// watcher, kill -9 or SIGSTOP of one of the two kuryr-lbaas replicas), with two Services whose
/// endpoints are the live pods load-balanced by Octavia (behind a fault proxy of its own) and one
/// of them replaced by another at every other fault, kuryr-policy enforcing a NetworkPolicy on half
/// the pods with security groups (killed and stopped too; the policy replaced at every other
/// fault). Ports are checked in Neutron during the run
/// and after it: none without a live pod or the allocator's pools, none twice, every live pod
/// with its one port and reachable; load balancers in Octavia: none without its Service, none
/// twice, and at the end each Service's one ACTIVE with exactly its endpoints as members; security
/// groups: none without its policy, none twice, and at the end on exactly the selected pods' ports.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn neutron_thirty_pods_through_a_fault_proxy_leave_no_port_or_load_balancer_leaked_or_duplicated() {
    use kuryr_tests::chaos::neutron::{self, NeutronChaosOptions};
    use kuryr_tests::faultproxy::FaultRates;
    let opts = NeutronChaosOptions {
        pods: 30,
        duration: Duration::from_secs(120),
        fault_every: Duration::from_secs(10),
        live: 8,
        parallel: 4,
        allocators: 2,
        lbaas: 2,
        services: 2,
        policy: true,
        rates: FaultRates { server_error: 0.05, conflict: 0.05, timeout: 0.01, slow: 0.05, lost_answer: 0.05 },
        quiet: Duration::from_secs(120),
        seed: 7,
        verbose: true,
    };
    let outcome = neutron::run(&opts).await.unwrap_or_else(|e| panic!("the chaos run failed: {e:#}"));
    eprintln!("faults:\n  {}", outcome.fault_log.join("\n  "));
    eprintln!("{}", outcome.last_line());
    assert_eq!(outcome.pods, 30, "every pod created");
    assert!(outcome.faults >= 5, "only {} faults injected", outcome.faults);
    assert!(
        outcome.checked_during >= 10,
        "the invariants checked only {} times during the run",
        outcome.checked_during
    );
    assert!(outcome.converged_in.is_some(), "not converged: {:#?}", outcome.details);
    assert!(outcome.ok(), "{}\n{}", outcome.last_line(), outcome.details.join("\n"));
}
