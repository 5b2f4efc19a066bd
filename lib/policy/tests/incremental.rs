//! The incremental compiler against itself from scratch: random sequences of changes (labels,
//! pods coming and going with addresses reused, ports, namespaces, policies added, edited and
//! removed) are fed one by one; after each, every node whose state changed must have been
//! reported changed, and at the end every node's state must equal that of a compiler fed the
//! final world at once — and the reference's decisions.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeMap;

use kuryr_policy_core::{Compiler, Namespace, NodePolicy, PodKey, PolicyKey};
use support::reference::World;
use support::worlds::{self, NAMESPACES, NODES, Rng};

/// One random change to `w`, applied to `c` too.
fn mutate(r: &mut Rng, w: &mut World, c: &mut Compiler, serial: &mut usize) -> String {
    *serial += 1;
    match r.below(9) {
        0 | 1 if !w.pods.is_empty() => {
            let i = r.below(w.pods.len());
            w.pods[i].labels = worlds::random_pod_labels(r);
            c.upsert_pod(w.pods[i].clone());
            format!("relabel pod {}/{}", w.pods[i].namespace, w.pods[i].name)
        }
        2 if !w.pods.is_empty() => {
            let i = r.below(w.pods.len());
            let p = w.pods.remove(i);
            c.remove_pod(&PodKey { namespace: p.namespace.clone(), name: p.name.clone() });
            // Its addresses go to a new pod, maybe of another namespace.
            let ns = r.below(NAMESPACES.len());
            let mut n = worlds::random_pod(r, ns, 100 + *serial);
            if !p.host_network && !p.ips.is_empty() && !n.host_network && !n.ips.is_empty() {
                n.ips = p.ips.clone();
            }
            w.pods.push(n.clone());
            c.upsert_pod(n);
            format!("delete pod {}/{}, its addresses reused", p.namespace, p.name)
        }
        3 => {
            let ns = r.below(NAMESPACES.len());
            let p = worlds::random_pod(r, ns, 200 + *serial);
            let addr_taken = p.ips.iter().any(|ip| w.pods.iter().any(|o| o.ips.contains(ip)));
            if addr_taken {
                return "no-op".into();
            }
            w.pods.push(p.clone());
            c.upsert_pod(p);
            "add pod".into()
        }
        4 if !w.pods.is_empty() => {
            let i = r.below(w.pods.len());
            let fresh = worlds::random_pod(r, 0, 0);
            w.pods[i].ports = fresh.ports;
            c.upsert_pod(w.pods[i].clone());
            "change a pod's ports".into()
        }
        5 => {
            let ns = *r.pick(&NAMESPACES);
            let labels = worlds::random_ns_labels(r);
            match w.namespaces.iter_mut().find(|n| n.name == ns) {
                Some(n) => n.labels = labels.clone(),
                None => w.namespaces.push(Namespace { name: ns.into(), labels: labels.clone() }),
            }
            c.upsert_namespace(Namespace { name: ns.into(), labels });
            format!("relabel namespace {ns}")
        }
        6 => {
            let p = worlds::random_policy(r, &format!("new{serial}"));
            w.policies.push(p.clone());
            c.upsert_policy(p);
            "add policy".into()
        }
        7 if !w.policies.is_empty() => {
            let i = r.below(w.policies.len());
            let mut p = worlds::random_policy(r, &w.policies[i].name);
            p.namespace = w.policies[i].namespace.clone();
            w.policies[i] = p.clone();
            c.upsert_policy(p);
            "edit policy".into()
        }
        8 if !w.policies.is_empty() => {
            let i = r.below(w.policies.len());
            let p = w.policies.remove(i);
            c.remove_policy(&PolicyKey { namespace: p.namespace.clone(), name: p.name.clone() });
            "remove policy".into()
        }
        _ => "no-op".into(),
    }
}

#[test]
fn incremental_changes_equal_a_fresh_compile_and_report_every_changed_node() {
    let mut decisions = 0;
    for seed in 0..120 {
        let mut w = worlds::world(seed);
        let mut c = support::compiler(&w);
        let mut r = Rng::new(seed ^ 0x5eed);
        let mut last: BTreeMap<&str, NodePolicy> = NODES.iter().map(|n| (*n, c.node_policy(n))).collect();
        c.take_changed_nodes();
        let mut serial = 0;
        let mut log = Vec::new();
        for _ in 0..25 {
            log.push(mutate(&mut r, &mut w, &mut c, &mut serial));
            let changed = c.take_changed_nodes();
            for n in NODES {
                let now = c.node_policy(n);
                if now != last[n] {
                    assert!(changed.contains(n), "seed {seed}: {n} changed unreported after {log:?}");
                }
                last.insert(n, now);
            }
        }
        let mut fresh = support::compiler(&w);
        for n in NODES {
            assert_eq!(c.node_policy(n), fresh.node_policy(n), "seed {seed}: {n} after {log:?}");
        }
        assert_eq!(c.stats(), fresh.stats(), "seed {seed}: nothing left behind after {log:?}");
        let states = last.into_iter().map(|(n, s)| (n.to_string(), s)).collect();
        decisions += support::check_states(&w, &states, &format!("seed {seed} after {log:?}"));
    }
    assert!(decisions > 100_000, "{decisions}");
}
