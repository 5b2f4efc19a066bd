//! Random worlds: three namespaces of pods with random labels, nodes, address families, named
//! ports and host networking, and a few random policies drawn from everything the API allows
//! (selectors with every operator, empty and absent parts, ipBlocks with except, numeric,
//! named and ranged ports of three protocols). Deterministic per seed.

use std::collections::BTreeSet;
use std::net::IpAddr;

use kuryr_policy_core::{
    ContainerPort, LabelSelector, Labels, Namespace, NetworkPolicy, Operator, Peer, Pod, PolicyType, PortRef, PortRule,
    Protocol, Requirement, Rule,
};

use super::reference::World;

/// splitmix64: small, fast, and good enough to explore.
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

pub const NAMESPACES: [&str; 3] = ["x", "y", "z"];
pub const NODES: [&str; 3] = ["n1", "n2", "n3"];

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn req(key: &str, operator: Operator, values: &[&str]) -> Requirement {
    Requirement { key: key.into(), operator, values: values.iter().map(|v| v.to_string()).collect::<BTreeSet<_>>() }
}

pub fn random_pod_labels(r: &mut Rng) -> Labels {
    let mut l = Labels::new();
    if r.chance(85) {
        l.insert("app".into(), r.pick(&["web", "db", "api"]).to_string());
    }
    if r.chance(50) {
        l.insert("tier".into(), r.pick(&["front", "back"]).to_string());
    }
    l
}

pub fn random_ns_labels(r: &mut Rng) -> Labels {
    let mut l = Labels::new();
    if r.chance(70) {
        l.insert("team".into(), r.pick(&["a", "b"]).to_string());
    }
    if r.chance(50) {
        l.insert("env".into(), r.pick(&["prod", "dev"]).to_string());
    }
    l
}

fn random_ports(r: &mut Rng) -> Vec<ContainerPort> {
    let options = [
        ("http", Protocol::Tcp, 80),
        ("http", Protocol::Tcp, 8080),
        ("dns", Protocol::Udp, 53),
        ("sig", Protocol::Sctp, 9000),
        ("alt", Protocol::Tcp, 81),
    ];
    let mut out: Vec<ContainerPort> = Vec::new();
    for (name, protocol, port) in options {
        if r.chance(35) && !out.iter().any(|p| p.name == name) {
            out.push(ContainerPort { name: name.into(), protocol, port });
        }
    }
    out
}

/// A pod of namespace index `ns`, number `i`.
pub fn random_pod(r: &mut Rng, ns: usize, i: usize) -> Pod {
    let node = *r.pick(&NODES);
    let v4: IpAddr = format!("10.0.{}.{}", ns + 1, i + 1).parse().unwrap();
    let v6: IpAddr = format!("fd00::{}:{}", ns + 1, i + 1).parse().unwrap();
    let mut pod = Pod {
        namespace: NAMESPACES[ns].into(),
        name: format!("p{i}"),
        labels: random_pod_labels(r),
        node: node.into(),
        ips: match r.below(10) {
            0 | 1 => vec![v4],
            2 => vec![v6],
            _ => vec![v4, v6],
        },
        ports: random_ports(r),
        host_network: false,
    };
    match r.below(20) {
        0 => {
            // Host network: the node's address.
            pod.host_network = true;
            let n = NODES.iter().position(|x| *x == node).unwrap_or(0) + 1;
            pod.ips = vec![format!("172.16.0.{n}").parse().unwrap()];
        }
        1 => {
            pod.node.clear();
            pod.ips.clear();
        }
        _ => {}
    }
    pod
}

pub fn random_pod_selector(r: &mut Rng) -> LabelSelector {
    let mut s = LabelSelector::default();
    match r.below(10) {
        0..=2 => {}
        3..=5 => {
            s.match_labels = labels(&[("app", *r.pick(&["web", "db", "api"]))]);
        }
        6 => s.match_expressions = vec![req("app", Operator::In, &["web", "api"])],
        7 => s.match_expressions = vec![req("app", Operator::NotIn, &["db"])],
        8 => s.match_expressions = vec![req("tier", Operator::Exists, &[])],
        _ => {
            s.match_labels = labels(&[("app", *r.pick(&["web", "db"]))]);
            s.match_expressions = vec![req("tier", Operator::DoesNotExist, &[])];
        }
    }
    s
}

pub fn random_ns_selector(r: &mut Rng) -> LabelSelector {
    let mut s = LabelSelector::default();
    match r.below(6) {
        0 => {}
        1 => s.match_labels = labels(&[("team", *r.pick(&["a", "b"]))]),
        2 => s.match_expressions = vec![req("env", Operator::NotIn, &["prod"])],
        3 => s.match_labels = labels(&[("kubernetes.io/metadata.name", *r.pick(&NAMESPACES))]),
        4 => s.match_expressions = vec![req("team", Operator::Exists, &[])],
        _ => s.match_expressions = vec![req("env", Operator::In, &["dev"]), req("team", Operator::DoesNotExist, &[])],
    }
    s
}

fn random_peer(r: &mut Rng) -> Peer {
    let k = r.below(10);
    if k < 7 {
        let (ns, pods) = match k {
            0..=2 => (None, Some(random_pod_selector(r))),
            3 | 4 => (Some(random_ns_selector(r)), None),
            _ => (Some(random_ns_selector(r)), Some(random_pod_selector(r))),
        };
        return Peer::Pods { namespace_selector: ns, pod_selector: pods };
    }
    let ns = r.below(3) + 1;
    let host = r.below(4) + 1;
    let (cidr, except): (String, Vec<String>) = match r.below(6) {
        0 => (format!("10.0.{ns}.0/24"), vec![format!("10.0.{ns}.{host}/32")]),
        1 => ("10.0.0.0/16".into(), vec![]),
        2 => (format!("fd00::{ns}:0/112"), vec![format!("fd00::{ns}:{host}/128")]),
        3 => ("0.0.0.0/0".into(), vec!["10.0.0.0/8".into()]),
        4 => ("192.0.2.0/24".into(), vec![]),
        _ => ("::/0".into(), vec![format!("fd00::{ns}:0/112")]),
    };
    Peer::IpBlock { cidr: cidr.parse().unwrap(), except: except.iter().map(|e| e.parse().unwrap()).collect() }
}

fn random_port_rule(r: &mut Rng) -> PortRule {
    let (protocol, port, end_port) = match r.below(10) {
        0 => (Protocol::Tcp, Some(PortRef::Number(80)), None),
        1 => (Protocol::Tcp, Some(PortRef::Number(80)), Some(90)),
        2 => (Protocol::Udp, Some(PortRef::Number(53)), None),
        3 => (Protocol::Sctp, Some(PortRef::Number(9000)), None),
        4 => (Protocol::Tcp, Some(PortRef::Name("http".into())), None),
        5 => (Protocol::Udp, Some(PortRef::Name("dns".into())), None),
        6 => (Protocol::Sctp, Some(PortRef::Name("sig".into())), None),
        7 => (Protocol::Tcp, None, None),
        8 => (Protocol::Udp, Some(PortRef::Name("http".into())), None),
        _ => (Protocol::Tcp, Some(PortRef::Number(81)), Some(85)),
    };
    PortRule { protocol, port, end_port }
}

fn random_rule(r: &mut Rng) -> Rule {
    let peers = if r.chance(25) { vec![] } else { (0..r.below(2) + 1).map(|_| random_peer(r)).collect() };
    let ports = if r.chance(35) { vec![] } else { (0..r.below(2) + 1).map(|_| random_port_rule(r)).collect() };
    Rule { peers, ports }
}

pub fn random_policy(r: &mut Rng, name: &str) -> NetworkPolicy {
    let policy_types = match r.below(4) {
        0 | 1 => vec![],
        2 => vec![r.pick(&[PolicyType::Ingress, PolicyType::Egress]).to_owned()],
        _ => vec![PolicyType::Ingress, PolicyType::Egress],
    };
    let rules = |r: &mut Rng| -> Vec<Rule> {
        if r.chance(20) { vec![] } else { (0..r.below(2) + 1).map(|_| random_rule(r)).collect() }
    };
    NetworkPolicy {
        namespace: r.pick(&NAMESPACES).to_string(),
        name: name.into(),
        pod_selector: random_pod_selector(r),
        policy_types,
        ingress: rules(r),
        egress: rules(r),
    }
}

/// A random world.
pub fn world(seed: u64) -> World {
    let mut r = Rng::new(seed);
    let namespaces =
        NAMESPACES.iter().map(|n| Namespace { name: (*n).into(), labels: random_ns_labels(&mut r) }).collect();
    let mut pods = Vec::new();
    for ns in 0..NAMESPACES.len() {
        for i in 0..r.below(3) + 2 {
            pods.push(random_pod(&mut r, ns, i));
        }
    }
    let policies = (0..r.below(4) + 1).map(|i| random_policy(&mut r, &format!("pol{i}"))).collect();
    World { namespaces, pods, policies }
}
