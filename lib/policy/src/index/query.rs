//! What the compiler answers: a node's desired state, a policy's status and peers, a group's
//! policies — each computing, lazily, the groups a change marked.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::{Compiler, PolicyStatus};
use crate::allowed::Allowed;
use crate::compile::{self, Bindings, SelectorId};
use crate::model::{Pod, PodKey, PolicyKey, PolicyType};
use crate::state::{GroupId, NodePolicy};

impl Compiler {
    /// The desired policy state of `node`.
    pub fn node_policy(&mut self, node: &str) -> NodePolicy {
        self.flush();
        let mut out = NodePolicy::default();
        let mut wanted = BTreeSet::new();
        // In key order, so that an address two pods claim (one leaving, one arriving) goes to
        // one of them deterministically; an isolated claim always beats an open one.
        for key in self.pods_by_node.get(node).into_iter().flatten() {
            let e = &self.pods[key];
            for (map, g) in [(&mut out.ingress, &e.groups[0]), (&mut out.egress, &e.groups[1])] {
                if let Some(g) = g {
                    for ip in &e.pod.ips {
                        map.entry(*ip).or_insert_with(|| g.clone());
                    }
                }
            }
        }
        wanted.extend(out.ingress.values().cloned());
        wanted.extend(out.egress.values().cloned());
        for id in wanted {
            let allowed = self.group_allowed(&id);
            out.groups.insert(id, allowed);
        }
        out
    }

    /// Where a policy takes effect ([`PolicyStatus`]); `None` for a policy it does not hold.
    pub fn policy_status(&mut self, key: &PolicyKey) -> Option<PolicyStatus> {
        self.flush();
        let compiled = self.policies.get(key)?;
        let mut status = PolicyStatus::default();
        let mut members = BTreeSet::new();
        for id in self.groups_by_policy.get(key).into_iter().flatten() {
            if let Some(g) = self.groups.get(id) {
                members.extend(g.members.iter());
                status.nodes.extend(g.nodes.keys().cloned());
            }
        }
        status.pods = members.len();
        for name in compiled.ingress_port_names() {
            let lacking = members
                .iter()
                .filter_map(|m| self.pods.get(*m))
                .filter(|e| !e.pod.ports.iter().any(|p| p.name == name))
                .count();
            if lacking > 0 {
                status.unresolved_ports.insert(name.to_string(), lacking);
            }
        }
        Some(status)
    }

    /// The policies whose rules make up a group (for display); empty for an unknown id.
    pub fn group_policies(&self, id: &GroupId) -> Vec<PolicyKey> {
        let Some(g) = self.groups.get(id) else { return vec![] };
        g.key.policies.iter().map(|name| PolicyKey { namespace: g.key.namespace.clone(), name: name.clone() }).collect()
    }

    /// A group's allowed peers, computed if a change reached it.
    fn group_allowed(&mut self, id: &GroupId) -> Arc<Allowed> {
        let g = &self.groups[id];
        if let Some(a) = &g.allowed {
            return a.clone();
        }
        let dir = g.key.dir;
        let rules = g.key.policies.iter().flat_map(|name| {
            let pk = PolicyKey { namespace: g.key.namespace.clone(), name: name.clone() };
            self.policies.get(&pk).and_then(|c| c.rules(dir)).unwrap_or_default()
        });
        let allowed = Arc::new(compile::allowed(dir, rules, &g.key.bindings, &View(self)));
        self.groups.get_mut(id).expect("just seen").allowed = Some(allowed.clone());
        allowed
    }
}

/// One policy on its own, for dataplanes that enforce each policy separately and let the union
/// happen there (Neutron security groups: a port with several groups allows what any allows).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyPeers {
    /// What the policy lets into the pods it selects; `None` when it does not isolate ingress.
    /// Named ports resolve against every selected pod at once (the union of their numbers).
    pub ingress: Option<Allowed>,
    /// What the policy lets the pods it selects reach; `None` when it does not isolate egress.
    pub egress: Option<Allowed>,
    /// The pods it selects: scheduled, with addresses of their own.
    pub pods: BTreeSet<PodKey>,
}

impl Compiler {
    /// Every policy.
    pub fn policy_keys(&self) -> Vec<PolicyKey> {
        let mut keys: Vec<PolicyKey> = self.policies.keys().cloned().collect();
        keys.sort();
        keys
    }

    /// Policy `key` on its own ([`PolicyPeers`]); `None` for an unknown policy. Computed on
    /// each call from the selectors' members (no cache: callers ask after changes only).
    pub fn policy_peers(&self, key: &PolicyKey) -> Option<PolicyPeers> {
        let c = self.policies.get(key)?;
        let pods: BTreeSet<PodKey> = self
            .pods_by_ns
            .get(&key.namespace)
            .into_iter()
            .flatten()
            .filter(|k| {
                let p = &self.pods[*k].pod;
                !p.node.is_empty() && p.has_own_addresses() && c.spec.pod_selector.matches(&p.labels)
            })
            .cloned()
            .collect();
        let names = c.ingress_port_names();
        let mut bindings = Bindings::new();
        for k in &pods {
            for (name, found) in compile::bindings(&self.pods[k].pod, &names) {
                bindings.entry(name).or_default().extend(found);
            }
        }
        let view = View(self);
        let ingress = c.rules(PolicyType::Ingress).map(|r| compile::allowed(PolicyType::Ingress, r, &bindings, &view));
        let egress =
            c.rules(PolicyType::Egress).map(|r| compile::allowed(PolicyType::Egress, r, &Bindings::new(), &view));
        Some(PolicyPeers { ingress, egress, pods })
    }
}

/// The compiler's pods, as group contents see them.
struct View<'a>(&'a Compiler);

impl compile::Peers for View<'_> {
    fn members(&self, id: SelectorId) -> Vec<&Pod> {
        let Some(s) = self.0.selectors.get(&id) else { return vec![] };
        s.members.iter().filter_map(|k| self.0.pods.get(k)).map(|e| &e.pod).collect()
    }

    fn all_pods(&self) -> Vec<&Pod> {
        self.0.pods.values().map(|e| &e.pod).filter(|p| p.has_own_addresses()).collect()
    }
}
