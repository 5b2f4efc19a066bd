//! A short chaos run ([`kuryr_tests::chaos`]) on the embedded backend: 60 pods created and
//! deleted over two and a half minutes on two nodes (at most 20 live, a third of them endpoints
//! of two Services), a random fault every ~5 s (kill -9 of the watcher, the allocator, lbaas or a
//! binder, also during DEL and GC; SIGSTOP of a service; the API server stalled). The assertion
//! is the invariants after the quiet period: nothing leaked, nothing duplicated, every live pod
//! with exactly one VIF and reachable from every node, every Service answered by exactly its
//! ready endpoints from every node, nothing of a deleted pod left on a node.
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
    assert_eq!(outcome.pods, 60, "every pod created");
    assert!(outcome.faults >= 10, "only {} faults injected", outcome.faults);
    assert!(outcome.converged_in.is_some(), "not converged: {:#?}", outcome.details);
    assert!(outcome.services_checked == 2 && outcome.pings > 0, "{outcome:?}");
    assert!(outcome.ok(), "{}\n{}", outcome.last_line(), outcome.details.join("\n"));
}
