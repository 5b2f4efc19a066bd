//! The incremental compiler's bookkeeping: what a change marks, and that the state follows.
//! (What the states mean is checked against an independent reference in `tests/`.)

use std::net::IpAddr;

use super::*;
use crate::allowed::Traffic;
use crate::model::{ContainerPort, LabelSelector, Peer, PortRef, PortRule, Protocol, Rule};
use crate::state::NodePolicy;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn pod(ns: &str, name: &str, node: &str, ip: &str, l: &[(&str, &str)]) -> Pod {
    Pod {
        namespace: ns.into(),
        name: name.into(),
        labels: labels(l),
        node: node.into(),
        ips: vec![ip.parse().unwrap()],
        ..Default::default()
    }
}

fn select(l: &[(&str, &str)]) -> LabelSelector {
    LabelSelector { match_labels: labels(l), match_expressions: vec![] }
}

/// A policy in `ns` on pods `target`, allowing ingress on TCP `port` from pods of its
/// namespace labelled `from`.
fn allow_from(ns: &str, name: &str, target: &[(&str, &str)], from: &[(&str, &str)], port: u16) -> NetworkPolicy {
    NetworkPolicy {
        namespace: ns.into(),
        name: name.into(),
        pod_selector: select(target),
        ingress: vec![Rule {
            peers: vec![Peer::Pods { namespace_selector: None, pod_selector: Some(select(from)) }],
            ports: vec![PortRule { protocol: Protocol::Tcp, port: Some(PortRef::Number(port)), end_port: None }],
        }],
        ..Default::default()
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn key(ns: &str, name: &str) -> PodKey {
    PodKey { namespace: ns.into(), name: name.into() }
}

fn nodes(c: &mut Compiler) -> Vec<String> {
    c.take_changed_nodes().into_iter().collect()
}

/// Two nodes: db-1 on n1, db-2 and web on n2, other on n3 (namespace other).
fn world() -> Compiler {
    let mut c = Compiler::new();
    c.upsert_pod(pod("shop", "db-1", "n1", "10.0.1.1", &[("app", "db")]));
    c.upsert_pod(pod("shop", "db-2", "n2", "10.0.2.1", &[("app", "db")]));
    c.upsert_pod(pod("shop", "web", "n2", "10.0.2.2", &[("app", "web")]));
    c.upsert_pod(pod("other", "x", "n3", "10.0.3.1", &[("app", "web")]));
    c.upsert_policy(allow_from("shop", "db", &[("app", "db")], &[("app", "web")], 5432));
    c.take_changed_nodes();
    c
}

#[test]
fn pods_selected_alike_share_one_group_on_every_node() {
    let mut c = world();
    let (n1, n2) = (c.node_policy("n1"), c.node_policy("n2"));
    let g = &n1.ingress[&ip("10.0.1.1")];
    assert_eq!(&n2.ingress[&ip("10.0.2.1")], g);
    assert_eq!(g.direction(), PolicyType::Ingress);
    assert!(!n2.ingress.contains_key(&ip("10.0.2.2")), "web is not selected: open");
    assert!(n1.egress.is_empty(), "an ingress policy does not isolate egress");
    let tcp = |p| Traffic::Port(Protocol::Tcp, p);
    assert!(n1.allows(&ip("10.0.2.2"), &ip("10.0.1.1"), tcp(5432)));
    assert!(!n1.allows(&ip("10.0.2.2"), &ip("10.0.1.1"), tcp(80)));
    assert!(!n1.allows(&ip("10.0.3.1"), &ip("10.0.1.1"), tcp(5432)), "a web pod of another namespace");
    assert_eq!(c.node_policy("n3"), NodePolicy::default());
    assert_eq!(c.stats(), Stats { pods: 4, policies: 1, selectors: 1, groups: 1 });
}

#[test]
fn a_peer_joining_a_selector_is_one_element_on_the_nodes_that_use_it() {
    let mut c = world();
    let before = c.node_policy("n1");
    c.upsert_pod(pod("shop", "web-2", "n3", "10.0.3.2", &[("app", "web")]));
    assert_eq!(nodes(&mut c), ["n1", "n2", "n3"], "n3 hosts the new pod; n1 and n2 host its group's pods");
    let d = before.diff(&c.node_policy("n1"));
    assert_eq!(d.element_changes(), 1, "{d:?}");
    let added = &d.groups_changed.values().next().unwrap().added;
    assert_eq!(added.ports.iter().map(|p| (p.addr, p.port)).collect::<Vec<_>>(), [(ip("10.0.3.2"), 5432)]);

    // A pod the selector does not match changes nothing but its own node.
    c.upsert_pod(pod("shop", "cache", "n3", "10.0.3.3", &[("app", "cache")]));
    assert_eq!(nodes(&mut c), ["n3"]);
    // Its labels changing so that it matches: the group's nodes again.
    c.upsert_pod(pod("shop", "cache", "n3", "10.0.3.3", &[("app", "web")]));
    assert_eq!(nodes(&mut c), ["n1", "n2", "n3"]);
}

#[test]
fn a_protected_pod_changing_labels_moves_between_groups() {
    let mut c = world();
    let before = c.node_policy("n1");
    c.upsert_pod(pod("shop", "db-1", "n1", "10.0.1.1", &[("app", "web")]));
    assert_eq!(nodes(&mut c), ["n1", "n2"], "n1 hosts it; it is a web peer for db-2 on n2 now");
    let after = c.node_policy("n1");
    assert!(after.ingress.is_empty() && after.groups.is_empty(), "no longer selected: open, and its group unused here");
    let d = before.diff(&after);
    assert_eq!((d.ingress_removed.len(), d.groups_removed.len()), (1, 1));
    // The group lives on for db-2.
    assert_eq!(c.node_policy("n2").ingress.len(), 1);
    assert_eq!(c.stats().groups, 1);
}

#[test]
fn namespace_labels_move_peers_in_and_out() {
    let mut c = Compiler::new();
    c.upsert_pod(pod("shop", "db", "n1", "10.0.1.1", &[("app", "db")]));
    c.upsert_pod(pod("ops", "probe", "n2", "10.0.2.1", &[]));
    let mut p = allow_from("shop", "db", &[("app", "db")], &[], 5432);
    p.ingress[0].peers = vec![Peer::Pods { namespace_selector: Some(select(&[("team", "ops")])), pod_selector: None }];
    c.upsert_policy(p);
    let g = |c: &mut Compiler| c.node_policy("n1").groups.values().next().unwrap().len();
    assert_eq!(g(&mut c), 0, "ops has no labels yet");
    c.take_changed_nodes();
    c.upsert_namespace(Namespace { name: "ops".into(), labels: labels(&[("team", "ops")]) });
    assert_eq!(nodes(&mut c), ["n1"], "only the protected pod's node");
    assert_eq!(g(&mut c), 1);
    c.upsert_namespace(Namespace { name: "ops".into(), labels: labels(&[("team", "dev")]) });
    assert_eq!(g(&mut c), 0);
    // Selecting namespaces by name works before the namespace is known.
    let mut p = allow_from("shop", "db", &[("app", "db")], &[], 5432);
    p.ingress[0].peers = vec![Peer::Pods {
        namespace_selector: Some(select(&[(crate::model::NAMESPACE_NAME_LABEL, "late")])),
        pod_selector: None,
    }];
    c.upsert_policy(p);
    c.upsert_pod(pod("late", "l", "n2", "10.0.2.9", &[]));
    assert_eq!(g(&mut c), 1);
}

#[test]
fn named_ports_split_groups_by_their_numbers() {
    let mut c = Compiler::new();
    let with_port = |name: &str, ip: &str, port: u16| {
        let mut p = pod("shop", name, "n1", ip, &[("app", "web")]);
        p.ports = vec![ContainerPort { name: "http".into(), protocol: Protocol::Tcp, port }];
        p
    };
    c.upsert_pod(with_port("a", "10.0.1.1", 8080));
    c.upsert_pod(with_port("b", "10.0.1.2", 8080));
    c.upsert_pod(with_port("c", "10.0.1.3", 9090));
    let mut p = allow_from("shop", "web", &[("app", "web")], &[], 0);
    p.ingress[0].peers = vec![];
    p.ingress[0].ports[0].port = Some(PortRef::Name("http".into()));
    c.upsert_policy(p);
    let s = c.node_policy("n1");
    assert_eq!(s.ingress[&ip("10.0.1.1")], s.ingress[&ip("10.0.1.2")]);
    assert_ne!(s.ingress[&ip("10.0.1.1")], s.ingress[&ip("10.0.1.3")]);
    let tcp = |p| Traffic::Port(Protocol::Tcp, p);
    assert!(s.allows(&ip("192.0.2.1"), &ip("10.0.1.3"), tcp(9090)));
    assert!(!s.allows(&ip("192.0.2.1"), &ip("10.0.1.3"), tcp(8080)));
    // The port renumbered: c joins a and b.
    c.upsert_pod(with_port("c", "10.0.1.3", 8080));
    let s = c.node_policy("n1");
    assert_eq!(s.groups.len(), 1);
}

#[test]
fn deleted_pods_leave_and_a_reused_address_belongs_to_the_new_pod() {
    let mut c = world();
    c.remove_pod(&key("shop", "web"));
    let n1 = c.node_policy("n1");
    assert!(n1.groups.values().all(|g| g.is_empty()), "the only web peer is gone");
    // Its address goes to a pod of another namespace: not a peer.
    c.upsert_pod(pod("other", "y", "n2", "10.0.2.2", &[("app", "web")]));
    let tcp = Traffic::Port(Protocol::Tcp, 5432);
    assert!(!c.node_policy("n1").allows(&ip("10.0.2.2"), &ip("10.0.1.1"), tcp));
    // Deleting the protected pods leaves no group.
    c.remove_pod(&key("shop", "db-1"));
    c.remove_pod(&key("shop", "db-2"));
    assert_eq!(c.stats().groups, 0);
    assert_eq!(c.node_policy("n1"), NodePolicy::default());
}

#[test]
fn policies_removed_and_edited_regroup_their_namespace() {
    let mut c = world();
    c.remove_policy(&PolicyKey { namespace: "shop".into(), name: "db".into() });
    assert_eq!(nodes(&mut c), ["n1", "n2"]);
    assert_eq!(c.stats(), Stats { pods: 4, policies: 0, selectors: 0, groups: 0 });
    c.upsert_policy(allow_from("shop", "db", &[("app", "db")], &[("app", "web")], 5432));
    let g1 = c.node_policy("n1").ingress[&ip("10.0.1.1")].clone();
    // An edit of the rules keeps the group (same policies), changing its elements only.
    c.upsert_policy(allow_from("shop", "db", &[("app", "db")], &[("app", "web")], 5433));
    let s = c.node_policy("n1");
    assert_eq!(s.ingress[&ip("10.0.1.1")], g1);
    assert!(s.allows(&ip("10.0.2.2"), &ip("10.0.1.1"), Traffic::Port(Protocol::Tcp, 5433)));
    // The same spec again changes nothing.
    c.take_changed_nodes();
    c.upsert_policy(allow_from("shop", "db", &[("app", "db")], &[("app", "web")], 5433));
    assert!(nodes(&mut c).is_empty());
}

#[test]
fn host_network_and_unscheduled_pods_are_neither_isolated_nor_peers() {
    let mut c = world();
    let mut h = pod("shop", "host", "n1", "192.168.0.1", &[("app", "web")]);
    h.host_network = true;
    c.upsert_pod(h);
    let mut h = pod("shop", "hostdb", "n1", "192.168.0.1", &[("app", "db")]);
    h.host_network = true;
    c.upsert_pod(h);
    let s = c.node_policy("n1");
    assert!(!s.ingress.contains_key(&ip("192.168.0.1")));
    assert!(!s.allows(&ip("192.168.0.1"), &ip("10.0.1.1"), Traffic::Port(Protocol::Tcp, 5432)));
    let mut pending = pod("shop", "pending", "", "10.0.9.9", &[("app", "db")]);
    pending.ips.clear();
    c.upsert_pod(pending);
    assert_eq!(c.stats().groups, 1);
}

#[test]
fn a_pod_moving_node_is_counted_on_the_new_one() {
    let mut c = world();
    c.upsert_pod(pod("shop", "db-1", "n3", "10.0.3.7", &[("app", "db")]));
    assert_eq!(nodes(&mut c), ["n1", "n3"]);
    assert!(c.node_policy("n1").ingress.is_empty());
    assert_eq!(c.node_policy("n3").ingress.keys().collect::<Vec<_>>(), [&ip("10.0.3.7")]);
    c.remove_pod(&key("shop", "db-1"));
    c.remove_pod(&key("shop", "db-2"));
    assert_eq!(c.stats().groups, 0, "member counts per node went back to zero");
}

#[test]
fn a_policy_on_its_own_names_its_pods_and_peers() {
    let mut c = world();
    let pk = PolicyKey { namespace: "shop".into(), name: "db".into() };
    let p = c.policy_peers(&pk).unwrap();
    assert_eq!(p.pods, [key("shop", "db-1"), key("shop", "db-2")].into());
    assert!(p.egress.is_none(), "an ingress policy");
    let ing = p.ingress.unwrap();
    assert!(ing.allows(&ip("10.0.2.2"), Traffic::Port(Protocol::Tcp, 5432)));
    assert!(!ing.allows(&ip("10.0.3.1"), Traffic::Port(Protocol::Tcp, 5432)));
    // web's label changes: it is no peer any more.
    c.upsert_pod(pod("shop", "web", "n2", "10.0.2.2", &[("app", "api")]));
    let ing = c.policy_peers(&pk).unwrap().ingress.unwrap();
    assert!(ing.is_empty(), "{ing:?}");
    assert_eq!(c.policy_keys(), std::slice::from_ref(&pk));
    c.remove_policy(&pk);
    assert!(c.policy_peers(&pk).is_none());
}

#[test]
fn a_policy_status_names_its_pods_nodes_and_unresolved_named_ports() {
    let mut c = world();
    let db = PolicyKey { namespace: "shop".into(), name: "db".into() };
    let s = c.policy_status(&db).unwrap();
    assert_eq!((s.pods, s.nodes.iter().map(String::as_str).collect::<Vec<_>>()), (2, vec!["n1", "n2"]));
    assert!(s.unresolved_ports.is_empty());
    // A named port one of the two db pods declares.
    let mut named = allow_from("shop", "named", &[("app", "db")], &[("app", "web")], 1);
    named.ingress[0].ports[0].port = Some(PortRef::Name("pg".into()));
    c.upsert_policy(named);
    let mut db1 = pod("shop", "db-1", "n1", "10.0.1.1", &[("app", "db")]);
    db1.ports = vec![ContainerPort { name: "pg".into(), protocol: Protocol::Tcp, port: 5432 }];
    c.upsert_pod(db1);
    let named = PolicyKey { namespace: "shop".into(), name: "named".into() };
    let s = c.policy_status(&named).unwrap();
    assert_eq!(s.unresolved_ports, [("pg".to_string(), 1)].into());
    // Its pods gone from n2: enforced on n1 only; a policy selecting nothing is enforced nowhere.
    c.remove_pod(&key("shop", "db-2"));
    assert_eq!(c.policy_status(&db).unwrap().nodes.into_iter().collect::<Vec<_>>(), ["n1"]);
    c.upsert_policy(allow_from("shop", "none", &[("app", "nothing")], &[], 80));
    let none = c.policy_status(&PolicyKey { namespace: "shop".into(), name: "none".into() }).unwrap();
    assert_eq!((none.pods, none.nodes.len()), (0, 0));
    assert!(c.policy_status(&PolicyKey { namespace: "shop".into(), name: "gone".into() }).is_none());
    assert_eq!(c.policy_keys().len(), 3);
}
