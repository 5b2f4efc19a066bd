//! From one NetworkPolicy to its compiled form, and from the compiled rules of a group of pods
//! to what the group may exchange traffic with ([`Allowed`]).
//!
//! Compiling a policy resolves what does not depend on other objects: `ipBlock`s become address
//! ranges, ports become ranges or names, selectors become handles on the compiler's selector
//! registry (their members are kept there, see [`crate::index`]). Invalid parts match nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::addr::{self, AddrRange, Family};
use crate::allowed::{Allowed, Builder, Ports};
use crate::model::{LabelSelector, NetworkPolicy, Peer, Pod, PolicyType, PortRef, PortRule, Protocol, Rule};

/// A pod peer selector in the context of its policy: which namespaces, which pods. Interned by
/// the compiler, which keeps each one's members.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerSelector {
    pub namespaces: NamespaceScope,
    /// The pod selector; `None` (absent) matches every pod of the namespaces, like `{}`.
    pub pods: Option<LabelSelector>,
}

/// The namespaces a pod peer selector looks in.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NamespaceScope {
    /// No namespace selector: the policy's own namespace.
    Own(String),
    /// The namespaces whose labels match.
    Matching(LabelSelector),
}

/// The compiler's handle on an interned [`PeerSelector`].
pub type SelectorId = u32;

/// Ports of a compiled rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RulePorts {
    /// No `ports`: every protocol and port.
    All,
    /// These (possibly none, when every entry was invalid).
    Some(Vec<PortMatch>),
}

/// One valid port entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortMatch {
    /// `first..=last` of a protocol (a port, a port with `endPort`, or every port).
    Numbers(Protocol, u16, u16),
    /// A named port, resolved against a pod.
    Named(Protocol, String),
}

/// Peers of a compiled rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RulePeers {
    /// No `from`/`to`: every address.
    All,
    Some(Vec<CompiledPeer>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompiledPeer {
    Pods(SelectorId),
    /// The addresses of an `ipBlock` (minus `except`), disjoint.
    Block(Vec<AddrRange>),
    /// An invalid peer: matches nothing.
    Nothing,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompiledRule {
    pub peers: RulePeers,
    pub ports: RulePorts,
}

/// A policy with its rules compiled; `None` for a direction the policy does not isolate.
#[derive(Clone, Debug)]
pub struct CompiledPolicy {
    pub spec: NetworkPolicy,
    pub ingress: Option<Vec<CompiledRule>>,
    pub egress: Option<Vec<CompiledRule>>,
}

impl CompiledPolicy {
    /// Compiles `spec`, interning its pod peer selectors through `intern`.
    pub fn new(spec: NetworkPolicy, intern: &mut impl FnMut(PeerSelector) -> SelectorId) -> Self {
        let (ing, eg) = spec.effective_types();
        let mut rules = |rules: &[Rule]| -> Vec<CompiledRule> {
            rules.iter().map(|r| compile_rule(&spec.namespace, r, intern)).collect()
        };
        let ingress = ing.then(|| rules(&spec.ingress));
        let egress = eg.then(|| rules(&spec.egress));
        Self { spec, ingress, egress }
    }

    pub fn rules(&self, dir: PolicyType) -> Option<&[CompiledRule]> {
        match dir {
            PolicyType::Ingress => self.ingress.as_deref(),
            PolicyType::Egress => self.egress.as_deref(),
        }
    }

    /// The selectors the policy's rules refer to.
    pub fn selectors(&self) -> BTreeSet<SelectorId> {
        let mut out = BTreeSet::new();
        for r in self.ingress.iter().chain(&self.egress).flatten() {
            if let RulePeers::Some(peers) = &r.peers {
                out.extend(peers.iter().filter_map(|p| match p {
                    CompiledPeer::Pods(id) => Some(*id),
                    _ => None,
                }));
            }
        }
        out
    }

    /// The port names its ingress rules use: a protected pod's own resolution of them is part
    /// of its group.
    pub fn ingress_port_names(&self) -> BTreeSet<&str> {
        let mut out = BTreeSet::new();
        for r in self.ingress.iter().flatten() {
            if let RulePorts::Some(ports) = &r.ports {
                out.extend(ports.iter().filter_map(|p| match p {
                    PortMatch::Named(_, n) => Some(n.as_str()),
                    PortMatch::Numbers(..) => None,
                }));
            }
        }
        out
    }

    /// Whether an egress rule resolves a named port against every pod rather than against the
    /// members of selectors: a rule with no `to`, or with an `ipBlock`. Such a policy's groups
    /// depend on every pod's addresses and ports.
    pub fn egress_names_any_pod(&self) -> bool {
        self.egress.iter().flatten().any(|r| {
            let named = matches!(&r.ports, RulePorts::Some(p) if p.iter().any(|m| matches!(m, PortMatch::Named(..))));
            named
                && match &r.peers {
                    RulePeers::All => true,
                    RulePeers::Some(peers) => peers.iter().any(|p| matches!(p, CompiledPeer::Block(_))),
                }
        })
    }
}

fn compile_rule(namespace: &str, rule: &Rule, intern: &mut impl FnMut(PeerSelector) -> SelectorId) -> CompiledRule {
    let peers = if rule.peers.is_empty() {
        RulePeers::All
    } else {
        RulePeers::Some(rule.peers.iter().map(|p| compile_peer(namespace, p, intern)).collect())
    };
    let ports = if rule.ports.is_empty() {
        RulePorts::All
    } else {
        RulePorts::Some(rule.ports.iter().filter_map(compile_port).collect())
    };
    CompiledRule { peers, ports }
}

fn compile_peer(namespace: &str, peer: &Peer, intern: &mut impl FnMut(PeerSelector) -> SelectorId) -> CompiledPeer {
    match peer {
        Peer::Pods { namespace_selector: None, pod_selector: None } => CompiledPeer::Nothing,
        Peer::Pods { namespace_selector, pod_selector } => {
            let namespaces = match namespace_selector {
                None => NamespaceScope::Own(namespace.to_string()),
                Some(s) => NamespaceScope::Matching(s.clone()),
            };
            CompiledPeer::Pods(intern(PeerSelector { namespaces, pods: pod_selector.clone() }))
        }
        Peer::IpBlock { cidr, except } => {
            let valid = except.iter().all(|e| cidr.contains(e) && e != cidr);
            if valid { CompiledPeer::Block(addr::block(cidr, except)) } else { CompiledPeer::Nothing }
        }
    }
}

fn compile_port(p: &PortRule) -> Option<PortMatch> {
    match (&p.port, p.end_port) {
        (None, None) => Some(PortMatch::Numbers(p.protocol, 0, u16::MAX)),
        (Some(PortRef::Number(n)), None) if *n > 0 => Some(PortMatch::Numbers(p.protocol, *n, *n)),
        (Some(PortRef::Number(n)), Some(e)) if *n > 0 && e >= *n => Some(PortMatch::Numbers(p.protocol, *n, e)),
        (Some(PortRef::Name(name)), None) if !name.is_empty() => Some(PortMatch::Named(p.protocol, name.clone())),
        _ => None,
    }
}

/// A pod's resolution of port names: name → (protocol, number) of its containers' ports.
pub type Bindings = BTreeMap<String, BTreeSet<(Protocol, u16)>>;

/// The resolution of `names` on `pod` (names it lacks resolve to nothing).
pub fn bindings(pod: &Pod, names: &BTreeSet<&str>) -> Bindings {
    names
        .iter()
        .map(|n| {
            let found = pod.ports.iter().filter(|p| p.name == *n).map(|p| (p.protocol, p.port)).collect();
            (n.to_string(), found)
        })
        .collect()
}

/// What group contents need to know about the cluster.
pub trait Peers {
    /// The pods a selector matches (only pods with addresses of their own).
    fn members(&self, id: SelectorId) -> Vec<&Pod>;
    /// Every pod with addresses of its own.
    fn all_pods(&self) -> Vec<&Pod>;
}

/// What a group may exchange traffic with in direction `dir`: the union of `rules` (of the
/// group's policies). `bindings` are the protected pods' resolution of named ports (ingress);
/// for egress, names resolve against each destination pod.
pub fn allowed<'a>(
    dir: PolicyType,
    rules: impl IntoIterator<Item = &'a CompiledRule>,
    bindings: &Bindings,
    peers: &impl Peers,
) -> Allowed {
    let mut b = Builder::default();
    for rule in rules {
        // Ports that do not depend on the peer, and names to resolve per peer pod.
        let mut fixed: Vec<Ports> = Vec::new();
        let mut names: Vec<(Protocol, &str)> = Vec::new();
        match &rule.ports {
            RulePorts::All => fixed.push(Ports::All),
            RulePorts::Some(list) => {
                for m in list {
                    match (m, dir) {
                        (PortMatch::Numbers(p, f, l), _) => fixed.push(Ports::Range(*p, *f, *l)),
                        (PortMatch::Named(p, n), PolicyType::Ingress) => {
                            let found = bindings.get(n).into_iter().flatten();
                            fixed.extend(
                                found.filter(|(bp, _)| bp == p).map(|(bp, port)| Ports::Range(*bp, *port, *port)),
                            );
                        }
                        (PortMatch::Named(p, n), PolicyType::Egress) => names.push((*p, n)),
                    }
                }
            }
        }
        if fixed.is_empty() && names.is_empty() {
            continue;
        }
        let named_on = |b: &mut Builder, pod: &Pod, only: &dyn Fn(&IpAddr) -> bool| {
            for (proto, name) in &names {
                for cp in pod.ports.iter().filter(|cp| cp.name == *name && cp.protocol == *proto) {
                    for ip in pod.ips.iter().filter(|ip| only(ip)) {
                        b.address(*ip, Ports::Range(*proto, cp.port, cp.port));
                    }
                }
            }
        };
        match &rule.peers {
            RulePeers::All => {
                for family in [Family::V4, Family::V6] {
                    let whole = AddrRange { family, first: 0, last: family.max() };
                    for p in &fixed {
                        b.range(whole, *p);
                    }
                }
                if !names.is_empty() {
                    for pod in peers.all_pods() {
                        named_on(&mut b, pod, &|_| true);
                    }
                }
            }
            RulePeers::Some(list) => {
                for peer in list {
                    match peer {
                        CompiledPeer::Nothing => {}
                        CompiledPeer::Pods(id) => {
                            for pod in peers.members(*id) {
                                for ip in &pod.ips {
                                    for p in &fixed {
                                        b.address(*ip, *p);
                                    }
                                }
                                named_on(&mut b, pod, &|_| true);
                            }
                        }
                        CompiledPeer::Block(ranges) => {
                            for r in ranges {
                                for p in &fixed {
                                    b.range(*r, *p);
                                }
                            }
                            if !names.is_empty() {
                                for pod in peers.all_pods() {
                                    named_on(&mut b, pod, &|ip| ranges.iter().any(|r| r.contains(ip)));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    b.build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ContainerPort;

    struct NoPeers;
    impl Peers for NoPeers {
        fn members(&self, _: SelectorId) -> Vec<&Pod> {
            vec![]
        }
        fn all_pods(&self) -> Vec<&Pod> {
            vec![]
        }
    }

    #[test]
    fn invalid_ports_and_peers_match_nothing() {
        let rule = Rule {
            peers: vec![
                Peer::Pods { namespace_selector: None, pod_selector: None },
                Peer::IpBlock { cidr: "10.0.0.0/24".parse().unwrap(), except: vec!["10.1.0.0/24".parse().unwrap()] },
            ],
            ports: vec![PortRule { protocol: Protocol::Tcp, port: Some(PortRef::Number(80)), end_port: Some(70) }],
        };
        let c = compile_rule("ns", &rule, &mut |_| 0);
        assert_eq!(c.peers, RulePeers::Some(vec![CompiledPeer::Nothing, CompiledPeer::Nothing]));
        assert_eq!(c.ports, RulePorts::Some(vec![]), "not `All`: a rule whose every port is invalid allows nothing");
        assert!(allowed(PolicyType::Ingress, [&c], &Bindings::new(), &NoPeers).is_empty());
    }

    #[test]
    fn named_ports_resolve_on_the_protected_pod_for_ingress() {
        let pod = Pod {
            ports: vec![
                ContainerPort { name: "web".into(), protocol: Protocol::Tcp, port: 8080 },
                ContainerPort { name: "dns".into(), protocol: Protocol::Udp, port: 53 },
            ],
            ..Default::default()
        };
        let rule = Rule {
            peers: vec![Peer::IpBlock { cidr: "10.0.0.0/8".parse().unwrap(), except: vec![] }],
            ports: vec![
                PortRule { protocol: Protocol::Tcp, port: Some(PortRef::Name("web".into())), end_port: None },
                // The pod's "dns" is UDP: a TCP "dns" resolves to nothing.
                PortRule { protocol: Protocol::Tcp, port: Some(PortRef::Name("dns".into())), end_port: None },
            ],
        };
        let c = compile_rule("ns", &rule, &mut |_| 0);
        let names = ["web", "dns"].into_iter().collect();
        let a = allowed(PolicyType::Ingress, [&c], &bindings(&pod, &names), &NoPeers);
        assert_eq!(a.ranges.len(), 1, "{a:?}");
        let b = a.ranges.iter().next().unwrap();
        assert_eq!((b.protocol, b.first_port, b.last_port), (Protocol::Tcp, 8080, 8080));
    }
}
