//! A naive reference for NetworkPolicy decisions, written from the API documentation's text and
//! sharing no code with the compiler: for one connection (source address, destination address,
//! protocol, port), decide whether the source pod's egress and the destination pod's ingress
//! allow it, by looking at every policy every time.
//!
//! The text it follows (networking.k8s.io/v1, kubernetes.io/docs/concepts/services-networking/
//! network-policies):
//! - a pod is isolated for ingress (egress) if any policy in its namespace selects it with
//!   Ingress (Egress) among its policyTypes; policyTypes defaults to Ingress, plus Egress when
//!   the policy has egress rules;
//! - an isolated pod accepts a connection only if some rule of some policy selecting it (in that
//!   direction) matches the peer and the port; policies add up;
//! - a rule with no from/to matches every peer; with no ports, every port and protocol;
//! - podSelector alone: pods of the policy's namespace; namespaceSelector alone: all pods of the
//!   matching namespaces; both: the matching pods in the matching namespaces;
//! - ipBlock: addresses in cidr and in no except entry;
//! - a port entry: its protocol, and the port (or port..=endPort, or every port when absent); a
//!   named port is the port of that name on the pod the traffic goes to;
//! - a pod may always reach itself; host-network pods are neither isolated nor selected.

use std::collections::BTreeMap;
use std::net::IpAddr;

use kuryr_policy_core::{
    LabelSelector, Labels, Namespace, NetworkPolicy, Operator, Peer, Pod, PolicyType, PortRef, PortRule, Rule, Traffic,
};

/// Everything the reference looks at.
#[derive(Clone, Debug, Default)]
pub struct World {
    pub namespaces: Vec<Namespace>,
    pub pods: Vec<Pod>,
    pub policies: Vec<NetworkPolicy>,
}

impl World {
    /// The pod owning `addr`, if a pod (with an address of its own) does.
    pub fn pod_at(&self, addr: &IpAddr) -> Option<&Pod> {
        self.pods.iter().find(|p| !p.host_network && p.ips.contains(addr))
    }

    fn ns_labels(&self, ns: &str) -> Labels {
        let mut l: Labels = self.namespaces.iter().find(|n| n.name == ns).map(|n| n.labels.clone()).unwrap_or_default();
        l.insert("kubernetes.io/metadata.name".into(), ns.into());
        l
    }
}

fn selector_matches(sel: &LabelSelector, labels: &Labels) -> bool {
    for (k, v) in &sel.match_labels {
        if labels.get(k) != Some(v) {
            return false;
        }
    }
    for e in &sel.match_expressions {
        let ok = match e.operator {
            Operator::In => matches!(labels.get(&e.key), Some(v) if e.values.contains(v)),
            Operator::NotIn => !matches!(labels.get(&e.key), Some(v) if e.values.contains(v)),
            Operator::Exists => labels.contains_key(&e.key),
            Operator::DoesNotExist => !labels.contains_key(&e.key),
        };
        if !ok {
            return false;
        }
    }
    true
}

fn types(p: &NetworkPolicy) -> Vec<PolicyType> {
    if !p.policy_types.is_empty() {
        return p.policy_types.clone();
    }
    let mut t = vec![PolicyType::Ingress];
    if !p.egress.is_empty() {
        t.push(PolicyType::Egress);
    }
    t
}

/// The policies that select `pod` in direction `dir`.
fn selecting<'a>(w: &'a World, pod: &Pod, dir: PolicyType) -> Vec<&'a NetworkPolicy> {
    if pod.host_network {
        return vec![];
    }
    w.policies
        .iter()
        .filter(|p| {
            p.namespace == pod.namespace && types(p).contains(&dir) && selector_matches(&p.pod_selector, &pod.labels)
        })
        .collect()
}

fn peer_matches(w: &World, policy_ns: &str, peer: &Peer, addr: &IpAddr) -> bool {
    match peer {
        Peer::IpBlock { cidr, except } => {
            let valid = except.iter().all(|e| cidr.contains(e) && e != cidr);
            valid && cidr.contains(addr) && !except.iter().any(|e| e.contains(addr))
        }
        Peer::Pods { namespace_selector, pod_selector } => {
            if namespace_selector.is_none() && pod_selector.is_none() {
                return false;
            }
            let Some(pod) = w.pod_at(addr) else { return false };
            let ns_ok = match namespace_selector {
                None => pod.namespace == policy_ns,
                Some(s) => selector_matches(s, &w.ns_labels(&pod.namespace)),
            };
            let pod_ok = match pod_selector {
                None => true,
                Some(s) => selector_matches(s, &pod.labels),
            };
            ns_ok && pod_ok
        }
    }
}

fn port_matches(ports: &[PortRule], traffic: Traffic, named_on: Option<&Pod>) -> bool {
    if ports.is_empty() {
        return true;
    }
    let Traffic::Port(proto, port) = traffic else { return false };
    ports.iter().any(|p| {
        if p.protocol != proto {
            return false;
        }
        match (&p.port, p.end_port) {
            (None, None) => true,
            (None, Some(_)) => false,
            (Some(PortRef::Number(n)), None) => *n != 0 && port == *n,
            (Some(PortRef::Number(n)), Some(e)) => *n != 0 && e >= *n && port >= *n && port <= e,
            (Some(PortRef::Name(_)), Some(_)) => false,
            (Some(PortRef::Name(name)), None) => named_on.is_some_and(|pod| {
                pod.ports.iter().any(|cp| cp.name == *name && cp.protocol == proto && cp.port == port)
            }),
        }
    })
}

fn rule_matches(w: &World, ns: &str, rule: &Rule, peer: &IpAddr, traffic: Traffic, named_on: Option<&Pod>) -> bool {
    let peer_ok = rule.peers.is_empty() || rule.peers.iter().any(|p| peer_matches(w, ns, p, peer));
    peer_ok && port_matches(&rule.ports, traffic, named_on)
}

/// Whether `dst`'s ingress allows a connection from `src_addr` (`None`: `dst` is not isolated).
pub fn ingress(w: &World, src_addr: &IpAddr, dst: &Pod, traffic: Traffic) -> Option<bool> {
    let policies = selecting(w, dst, PolicyType::Ingress);
    if policies.is_empty() {
        return None;
    }
    Some(
        policies
            .iter()
            .any(|p| p.ingress.iter().any(|r| rule_matches(w, &p.namespace, r, src_addr, traffic, Some(dst)))),
    )
}

/// Whether `src`'s egress allows a connection to `dst_addr` (`None`: `src` is not isolated).
pub fn egress(w: &World, src: &Pod, dst_addr: &IpAddr, traffic: Traffic) -> Option<bool> {
    let policies = selecting(w, src, PolicyType::Egress);
    if policies.is_empty() {
        return None;
    }
    let dst_pod = w.pod_at(dst_addr);
    Some(policies.iter().any(|p| p.egress.iter().any(|r| rule_matches(w, &p.namespace, r, dst_addr, traffic, dst_pod))))
}

/// Whether the connection is allowed end to end.
pub fn connection(w: &World, src: &IpAddr, dst: &IpAddr, traffic: Traffic) -> bool {
    let (sp, dp) = (w.pod_at(src), w.pod_at(dst));
    if let (Some(a), Some(b)) = (sp, dp)
        && a.namespace == b.namespace
        && a.name == b.name
    {
        return true;
    }
    let eg = sp.and_then(|p| egress(w, p, dst, traffic)).unwrap_or(true);
    let ing = dp.and_then(|p| ingress(w, src, p, traffic)).unwrap_or(true);
    eg && ing
}

/// Node names with their pods, for building per-node states.
pub fn nodes(w: &World) -> BTreeMap<String, Vec<&Pod>> {
    let mut out: BTreeMap<String, Vec<&Pod>> = BTreeMap::new();
    for p in &w.pods {
        if !p.node.is_empty() {
            out.entry(p.node.clone()).or_default().push(p);
        }
    }
    out
}
