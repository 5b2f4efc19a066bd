//! The compiler against a truth table computed independently of it (`support/reference.rs`):
//! for every pair of addresses (pods of three namespaces, on three nodes, and addresses that are
//! no pod's) and every probe (TCP/UDP/SCTP ports, and ICMP), the compiled node states must make
//! the reference's decision — per direction, on the node that judges it, and end to end.
//!
//! First the upstream Netpol suite's world (namespaces x, y, z with pods a, b, c) under policies
//! modelled on its cases, with a few decisions also spelled out by hand; then random worlds.
#![allow(clippy::unwrap_used)]

mod support;

use std::net::IpAddr;

use kuryr_policy_core::{
    ContainerPort, LabelSelector, Labels, Namespace, NetworkPolicy, Operator, Peer, Pod, PolicyType, PortRef, PortRule,
    Protocol, Requirement, Rule, Traffic,
};
use support::reference::{self, World};

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn sel(pairs: &[(&str, &str)]) -> LabelSelector {
    LabelSelector { match_labels: labels(pairs), match_expressions: vec![] }
}

fn expr(key: &str, operator: Operator, values: &[&str]) -> LabelSelector {
    LabelSelector {
        match_labels: Labels::new(),
        match_expressions: vec![Requirement {
            key: key.into(),
            operator,
            values: values.iter().map(|v| v.to_string()).collect(),
        }],
    }
}

fn tcp(port: u16) -> PortRule {
    PortRule { protocol: Protocol::Tcp, port: Some(PortRef::Number(port)), end_port: None }
}

fn named(protocol: Protocol, name: &str) -> PortRule {
    PortRule { protocol, port: Some(PortRef::Name(name.into())), end_port: None }
}

fn pods_peer(ns: Option<LabelSelector>, pods: Option<LabelSelector>) -> Peer {
    Peer::Pods { namespace_selector: ns, pod_selector: pods }
}

fn block(cidr: &str, except: &[&str]) -> Peer {
    Peer::IpBlock { cidr: cidr.parse().unwrap(), except: except.iter().map(|e| e.parse().unwrap()).collect() }
}

/// The upstream Netpol world: namespaces x, y, z (labelled ns=<name>), pods a, b, c (labelled
/// pod=<name>) serving TCP/UDP/SCTP 80 and 81 (named serve-80-tcp, ...), spread over two nodes.
fn netpol_world(policies: Vec<NetworkPolicy>) -> World {
    let mut pods = Vec::new();
    for (i, ns) in ["x", "y", "z"].iter().enumerate() {
        for (j, name) in ["a", "b", "c"].iter().enumerate() {
            let mut ports = Vec::new();
            for port in [80u16, 81] {
                for p in Protocol::ALL {
                    ports.push(ContainerPort { name: format!("serve-{port}-{p}"), protocol: p, port });
                }
            }
            pods.push(Pod {
                namespace: ns.to_string(),
                name: name.to_string(),
                labels: labels(&[("pod", name)]),
                node: if (i + j) % 2 == 0 { "n1" } else { "n2" }.into(),
                ips: vec![
                    format!("10.0.{}.{}", i + 1, j + 1).parse().unwrap(),
                    format!("fd00::{}:{}", i + 1, j + 1).parse().unwrap(),
                ],
                ports,
                host_network: false,
            });
        }
    }
    let namespaces =
        ["x", "y", "z"].iter().map(|n| Namespace { name: n.to_string(), labels: labels(&[("ns", n)]) }).collect();
    World { namespaces, pods, policies }
}

fn policy(ns: &str, name: &str, target: LabelSelector) -> NetworkPolicy {
    NetworkPolicy { namespace: ns.into(), name: name.into(), pod_selector: target, ..Default::default() }
}

fn ingress(mut p: NetworkPolicy, peers: Vec<Peer>, ports: Vec<PortRule>) -> NetworkPolicy {
    p.ingress.push(Rule { peers, ports });
    p
}

fn egress(mut p: NetworkPolicy, peers: Vec<Peer>, ports: Vec<PortRule>) -> NetworkPolicy {
    p.egress.push(Rule { peers, ports });
    p
}

/// The upstream-like cases, each with a name.
fn cases() -> Vec<(&'static str, Vec<NetworkPolicy>)> {
    let x = |name: &str, t: LabelSelector| policy("x", name, t);
    let everything = LabelSelector::everything;
    let mut egress_only = ingress(x("egress-only", everything()), vec![], vec![]);
    egress_only.policy_types = vec![PolicyType::Egress];
    let mut both_types_no_rules = x("deny-both", sel(&[("pod", "a")]));
    both_types_no_rules.policy_types = vec![PolicyType::Ingress, PolicyType::Egress];
    vec![
        ("default deny ingress", vec![x("deny", everything())]),
        ("allow all ingress (empty from, empty ports)", vec![ingress(x("all", everything()), vec![], vec![])]),
        (
            "allow from the same namespace",
            vec![ingress(x("same-ns", everything()), vec![pods_peer(None, Some(everything()))], vec![])],
        ),
        (
            "allow from every namespace",
            vec![ingress(x("all-ns", sel(&[("pod", "a")])), vec![pods_peer(Some(everything()), None)], vec![])],
        ),
        (
            "allow from namespace y by label",
            vec![ingress(x("ns-y", sel(&[("pod", "a")])), vec![pods_peer(Some(sel(&[("ns", "y")])), None)], vec![])],
        ),
        (
            "pod and namespace selector together",
            vec![ingress(
                x("both", sel(&[("pod", "a")])),
                vec![pods_peer(Some(expr("ns", Operator::NotIn, &["x"])), Some(sel(&[("pod", "b")])))],
                vec![],
            )],
        ),
        (
            "pod and namespace selector as two peers",
            vec![ingress(
                x("either", sel(&[("pod", "a")])),
                vec![pods_peer(Some(sel(&[("ns", "y")])), None), pods_peer(None, Some(sel(&[("pod", "b")])))],
                vec![],
            )],
        ),
        (
            "match expressions: In, Exists, DoesNotExist",
            vec![
                ingress(
                    x("in", expr("pod", Operator::In, &["a", "b"])),
                    vec![pods_peer(Some(expr("ns", Operator::Exists, &[])), Some(expr("pod", Operator::In, &["c"])))],
                    vec![tcp(80)],
                ),
                ingress(x("dne", expr("pod", Operator::DoesNotExist, &[])), vec![], vec![]),
            ],
        ),
        (
            "allow TCP 81 only",
            vec![ingress(x("port-81", sel(&[("pod", "a")])), vec![pods_peer(Some(everything()), None)], vec![tcp(81)])],
        ),
        (
            "named port on the protected pod",
            vec![ingress(x("named", everything()), vec![], vec![named(Protocol::Udp, "serve-81-udp")])],
        ),
        (
            "endPort range and a protocol without port",
            vec![ingress(
                x("range", sel(&[("pod", "a")])),
                vec![],
                vec![
                    PortRule { protocol: Protocol::Tcp, port: Some(PortRef::Number(80)), end_port: Some(81) },
                    PortRule { protocol: Protocol::Sctp, port: None, end_port: None },
                ],
            )],
        ),
        (
            "ipBlock with except (pod addresses count)",
            vec![ingress(
                x("block", sel(&[("pod", "a")])),
                vec![block("10.0.2.0/24", &["10.0.2.2/32"]), block("fd00::/64", &["fd00::2:0/112"])],
                vec![],
            )],
        ),
        ("egress deny all", vec![egress(x("egress-deny", everything()), vec![], vec![]).tap_types(PolicyType::Egress)]),
        (
            "egress to DNS only (UDP 53 anywhere) and to namespace y",
            vec![
                egress(
                    x("dns", everything()),
                    vec![],
                    vec![PortRule { protocol: Protocol::Udp, port: Some(PortRef::Number(53)), end_port: None }],
                ),
                egress(x("to-y", everything()), vec![pods_peer(Some(sel(&[("ns", "y")])), None)], vec![]),
            ],
        ),
        (
            "egress named port resolved on the destination",
            vec![egress(
                x("eg-named", sel(&[("pod", "a")])),
                vec![pods_peer(Some(everything()), Some(sel(&[("pod", "b")])))],
                vec![named(Protocol::Tcp, "serve-80-tcp")],
            )],
        ),
        (
            "egress named port to an ipBlock",
            vec![egress(
                x("eg-named-block", sel(&[("pod", "a")])),
                vec![block("10.0.0.0/16", &[])],
                vec![named(Protocol::Tcp, "serve-81-tcp")],
            )],
        ),
        ("policyTypes Egress ignores ingress rules", vec![egress_only]),
        ("both types, no rules", vec![both_types_no_rules]),
        (
            "several policies on one pod add up",
            vec![
                ingress(
                    x("p1", sel(&[("pod", "a")])),
                    vec![pods_peer(None, Some(sel(&[("pod", "b")])))],
                    vec![tcp(80)],
                ),
                ingress(
                    x("p2", sel(&[("pod", "a")])),
                    vec![pods_peer(None, Some(sel(&[("pod", "c")])))],
                    vec![tcp(81)],
                ),
                x("p3", everything()),
            ],
        ),
        (
            "policies in other namespaces do not apply here",
            vec![policy("y", "deny-y", everything()), ingress(x("x-open", sel(&[("pod", "zz")])), vec![], vec![])],
        ),
    ]
}

trait TapTypes {
    fn tap_types(self, t: PolicyType) -> Self;
}

impl TapTypes for NetworkPolicy {
    fn tap_types(mut self, t: PolicyType) -> Self {
        self.policy_types = vec![t];
        self
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn upstream_like_cases_match_the_reference() {
    let mut total = 0;
    for (name, policies) in cases() {
        total += support::check(&netpol_world(policies), name);
    }
    assert!(total > 100_000, "{total} decisions compared");
}

/// A few decisions spelled out by hand, so that the reference itself is held to the text.
#[test]
fn the_reference_says_what_the_documentation_says() {
    let case = |n: &str| cases().into_iter().find(|(name, _)| *name == n).unwrap().1;
    let t80 = Traffic::Port(Protocol::Tcp, 80);
    let (xa, xb, ya, yb, zb) = (ip("10.0.1.1"), ip("10.0.1.2"), ip("10.0.2.1"), ip("10.0.2.2"), ip("10.0.3.2"));

    let w = netpol_world(case("default deny ingress"));
    assert!(!reference::connection(&w, &xb, &xa, t80));
    assert!(reference::connection(&w, &xa, &ya, t80), "egress stays open");
    assert!(reference::connection(&w, &xa, &xa, t80), "a pod reaches itself");

    let w = netpol_world(case("pod and namespace selector together"));
    assert!(reference::connection(&w, &yb, &xa, t80));
    assert!(!reference::connection(&w, &ya, &xa, t80), "pod a of y is not b");
    assert!(!reference::connection(&w, &xb, &xa, t80), "b of x is in x");

    let w = netpol_world(case("pod and namespace selector as two peers"));
    assert!(reference::connection(&w, &ya, &xa, t80) && reference::connection(&w, &xb, &xa, t80));
    assert!(!reference::connection(&w, &zb, &xa, t80));

    let w = netpol_world(case("ipBlock with except (pod addresses count)"));
    assert!(reference::connection(&w, &ya, &xa, Traffic::Other));
    assert!(!reference::connection(&w, &yb, &xa, Traffic::Other), "excepted");
    assert!(!reference::connection(&w, &ip("fd00::2:1"), &ip("fd00::1:1"), t80), "excepted in IPv6");
    assert!(reference::connection(&w, &ip("fd00::3:1"), &ip("fd00::1:1"), t80));

    let w = netpol_world(case("named port on the protected pod"));
    assert!(reference::connection(&w, &ya, &xb, Traffic::Port(Protocol::Udp, 81)));
    assert!(!reference::connection(&w, &ya, &xb, Traffic::Port(Protocol::Tcp, 81)));
    assert!(!reference::connection(&w, &ya, &xb, Traffic::Other), "ports given: ICMP is not allowed");

    let w = netpol_world(case("egress named port to an ipBlock"));
    assert!(reference::connection(&w, &xa, &yb, Traffic::Port(Protocol::Tcp, 81)));
    assert!(!reference::connection(&w, &xa, &ip("10.0.1.200"), Traffic::Port(Protocol::Tcp, 81)), "no pod: no name");

    let w = netpol_world(case("policyTypes Egress ignores ingress rules"));
    assert!(!reference::connection(&w, &xa, &ya, t80));
    assert!(reference::connection(&w, &ya, &xa, t80));
}

#[test]
fn random_worlds_match_the_reference() {
    let mut total = 0;
    for seed in 0..300 {
        total += support::check(&support::worlds::world(seed), &format!("seed {seed}"));
    }
    assert!(total > 1_000_000, "{total} decisions compared");
}
