//! The incremental compiler: namespaces, pods and policies go in one change at a time; each
//! node's [`NodePolicy`](crate::state::NodePolicy) comes out, recomputed only where a change reached.
//!
//! What is kept, and what each change touches:
//!
//! - **Selectors.** Every pod peer selector of every policy is interned once
//!   ([`PeerSelector`], shared by policies that write the same one) with its member pods. A pod
//!   change re-evaluates it against each selector (a few label lookups each); a namespace label
//!   change, its pods against the selectors that select namespaces. A selector whose members
//!   (or a member's addresses or ports) changed marks the groups of the policies using it.
//! - **Groups.** A pod's group per direction is keyed by its namespace, the policies selecting
//!   it and (ingress) its resolution of their named ports ([`GroupId`]). Pods with equal keys
//!   share one [`Allowed`], computed once, lazily, and only again when marked. A pod's label or
//!   port change regroups that pod alone; a policy change regroups the pods of its namespace.
//! - **Nodes.** Every mark reaches the nodes of the group's members, which
//!   [`Compiler::take_changed_nodes`] hands out; [`Compiler::node_policy`] then assembles a
//!   node's state from its pods' groups (computing marked groups), in time proportional to its
//!   pods and the marked groups.
//!
//! Regrouping after a policy change is deferred to the next query, so a burst of policies
//! (a start, a resync) regroups each namespace once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;

use crate::allowed::Allowed;
use crate::compile::{self, Bindings, CompiledPolicy, NamespaceScope, PeerSelector, SelectorId};
use crate::model::{Labels, NAMESPACE_NAME_LABEL, Namespace, NetworkPolicy, Pod, PodKey, PolicyKey, PolicyType};
use crate::state::GroupId;

mod query;

pub use query::PolicyPeers;

/// What decides a pod's group in one direction.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct GroupKey {
    dir: PolicyType,
    namespace: String,
    /// Names of the policies selecting the pod, sorted.
    policies: Vec<String>,
    /// The pod's resolution of the port names the policies' ingress rules use.
    bindings: Bindings,
}

impl GroupKey {
    /// A stable text form: the input of the group id's hash.
    fn canonical(&self) -> String {
        let mut s = String::new();
        let _ = write!(s, "{:?}|{}|{}|", self.dir, self.namespace, self.policies.join(","));
        for (name, ports) in &self.bindings {
            let _ = write!(s, "{name}=");
            for (p, n) in ports {
                let _ = write!(s, "{p}:{n},");
            }
            s.push(';');
        }
        s
    }
}

/// FNV-1a, 64 bits: stable across processes and versions, unlike the std hasher.
fn fnv1a64(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

#[derive(Debug)]
struct Group {
    key: GroupKey,
    members: BTreeSet<PodKey>,
    /// Members per node.
    nodes: BTreeMap<String, usize>,
    /// `None` when a change reached it since it was last computed.
    allowed: Option<Arc<Allowed>>,
}

#[derive(Debug)]
struct Selector {
    sel: PeerSelector,
    members: BTreeSet<PodKey>,
    /// The policies whose rules use it.
    users: BTreeSet<PolicyKey>,
}

#[derive(Debug)]
struct PodEntry {
    pod: Pod,
    /// Its groups: ingress, egress.
    groups: [Option<GroupId>; 2],
}

fn slot(dir: PolicyType) -> usize {
    match dir {
        PolicyType::Ingress => 0,
        PolicyType::Egress => 1,
    }
}

/// The incremental NetworkPolicy compiler (module documentation).
#[derive(Debug, Default)]
pub struct Compiler {
    namespaces: HashMap<String, Labels>,
    pods: HashMap<PodKey, PodEntry>,
    pods_by_ns: HashMap<String, BTreeSet<PodKey>>,
    pods_by_node: HashMap<String, BTreeSet<PodKey>>,
    policies: HashMap<PolicyKey, CompiledPolicy>,
    policies_by_ns: HashMap<String, BTreeSet<String>>,
    selectors: HashMap<SelectorId, Selector>,
    selector_ids: HashMap<PeerSelector, SelectorId>,
    next_selector: SelectorId,
    groups: HashMap<GroupId, Group>,
    group_ids: HashMap<GroupKey, GroupId>,
    groups_by_policy: HashMap<PolicyKey, BTreeSet<GroupId>>,
    /// Policies whose egress named ports resolve against every pod.
    any_pod_policies: BTreeSet<PolicyKey>,
    /// Namespaces whose pods must be regrouped (a policy there changed).
    regroup: BTreeSet<String>,
    changed: BTreeSet<String>,
}

/// Where a policy takes effect, for its status: the pods it isolates (in a direction it
/// governs) and their nodes, and the ingress named ports some of those pods do not declare
/// (on such a pod that port rule allows nothing, as Kubernetes specifies).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyStatus {
    /// Pods the policy isolates.
    pub pods: usize,
    /// The nodes they are on: where it is enforced.
    pub nodes: BTreeSet<String>,
    /// Ingress named port → how many of the isolated pods do not declare it.
    pub unresolved_ports: BTreeMap<String, usize>,
}

/// Sizes, for metrics and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub pods: usize,
    pub policies: usize,
    pub selectors: usize,
    pub groups: usize,
}

impl Compiler {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn stats(&self) -> Stats {
        Stats {
            pods: self.pods.len(),
            policies: self.policies.len(),
            selectors: self.selectors.len(),
            groups: self.groups.len(),
        }
    }

    /// The labels of a namespace, with its name label even before the namespace is known.
    fn namespace_labels(&self, ns: &str) -> Labels {
        let mut l = self.namespaces.get(ns).cloned().unwrap_or_default();
        l.entry(NAMESPACE_NAME_LABEL.to_string()).or_insert_with(|| ns.to_string());
        l
    }

    fn selects(&self, sel: &PeerSelector, pod: &Pod) -> bool {
        if !pod.has_own_addresses() {
            return false;
        }
        let ns_ok = match &sel.namespaces {
            NamespaceScope::Own(ns) => *ns == pod.namespace,
            NamespaceScope::Matching(s) => s.matches(&self.namespace_labels(&pod.namespace)),
        };
        ns_ok && sel.pods.as_ref().is_none_or(|s| s.matches(&pod.labels))
    }

    /// Adds or replaces a namespace.
    pub fn upsert_namespace(&mut self, ns: Namespace) {
        if self.namespaces.get(&ns.name) == Some(&ns.labels) {
            return;
        }
        let name = ns.name.clone();
        self.namespaces.insert(ns.name, ns.labels);
        self.namespace_labels_changed(&name);
    }

    /// Forgets a namespace (its pods go with their own deletions).
    pub fn remove_namespace(&mut self, name: &str) {
        if self.namespaces.remove(name).is_some() {
            self.namespace_labels_changed(name);
        }
    }

    fn namespace_labels_changed(&mut self, ns: &str) {
        let pods: Vec<PodKey> = self.pods_by_ns.get(ns).into_iter().flatten().cloned().collect();
        let scoped: Vec<SelectorId> = self
            .selectors
            .iter()
            .filter(|(_, s)| matches!(s.sel.namespaces, NamespaceScope::Matching(_)))
            .map(|(id, _)| *id)
            .collect();
        let mut dirty = BTreeSet::new();
        for key in pods {
            let Some(pod) = self.pods.get(&key).map(|e| &e.pod) else { continue };
            for id in &scoped {
                let now = self.selects(&self.selectors[id].sel, pod);
                let s = self.selectors.get_mut(id).expect("scoped ids come from the map");
                let was = s.members.contains(&key);
                if was != now {
                    if now {
                        s.members.insert(key.clone());
                    } else {
                        s.members.remove(&key);
                    }
                    dirty.insert(*id);
                }
            }
        }
        self.selectors_changed(&dirty);
    }

    /// Adds or replaces a pod.
    pub fn upsert_pod(&mut self, pod: Pod) {
        let key = pod.key();
        let old = self.pods.get(&key).map(|e| e.pod.clone());
        if old.as_ref() == Some(&pod) {
            return;
        }
        self.peer_changed(&key, old.as_ref(), Some(&pod));
        if let Some(o) = &old {
            if o.node != pod.node {
                // Groups count their members per node: leave from the old node, join again below.
                for dir in [PolicyType::Ingress, PolicyType::Egress] {
                    self.set_group(&key, dir, None);
                }
            }
            self.unindex(&key, o);
            if !o.node.is_empty() {
                self.changed.insert(o.node.clone());
            }
        }
        let groups = self.pods.remove(&key).map(|e| e.groups).unwrap_or_default();
        self.pods_by_ns.entry(pod.namespace.clone()).or_default().insert(key.clone());
        if !pod.node.is_empty() {
            self.pods_by_node.entry(pod.node.clone()).or_default().insert(key.clone());
            self.changed.insert(pod.node.clone());
        }
        self.pods.insert(key.clone(), PodEntry { pod, groups });
        self.regroup_pod(&key);
    }

    /// Forgets a pod.
    pub fn remove_pod(&mut self, key: &PodKey) {
        let Some(entry) = self.pods.get(key) else { return };
        let pod = entry.pod.clone();
        self.peer_changed(key, Some(&pod), None);
        for dir in [PolicyType::Ingress, PolicyType::Egress] {
            self.set_group(key, dir, None);
        }
        self.unindex(key, &pod);
        if !pod.node.is_empty() {
            self.changed.insert(pod.node.clone());
        }
        self.pods.remove(key);
    }

    fn unindex(&mut self, key: &PodKey, pod: &Pod) {
        if let Some(s) = self.pods_by_ns.get_mut(&pod.namespace) {
            s.remove(key);
            if s.is_empty() {
                self.pods_by_ns.remove(&pod.namespace);
            }
        }
        if let Some(s) = self.pods_by_node.get_mut(&pod.node) {
            s.remove(key);
            if s.is_empty() {
                self.pods_by_node.remove(&pod.node);
            }
        }
    }

    /// A pod as a peer changed from `old` to `new` (either absent): selector memberships, and
    /// the groups that see its addresses.
    fn peer_changed(&mut self, key: &PodKey, old: Option<&Pod>, new: Option<&Pod>) {
        let addresses = |p: Option<&Pod>| p.filter(|p| p.has_own_addresses()).map(|p| (p.ips.clone(), p.ports.clone()));
        let moved = addresses(old) != addresses(new);
        let mut dirty = BTreeSet::new();
        for (id, s) in &self.selectors {
            let was = s.members.contains(key);
            let now = new.is_some_and(|p| self.selects(&s.sel, p));
            if was != now || (now && moved) {
                dirty.insert(*id);
            }
        }
        for id in &dirty {
            let now = new.is_some_and(|p| self.selects(&self.selectors[id].sel, p));
            let s = self.selectors.get_mut(id).expect("dirty ids come from the map");
            if now {
                s.members.insert(key.clone());
            } else {
                s.members.remove(key);
            }
        }
        self.selectors_changed(&dirty);
        if moved {
            let any_pod: Vec<PolicyKey> = self.any_pod_policies.iter().cloned().collect();
            for p in any_pod {
                self.policy_groups_changed(&p);
            }
        }
    }

    fn selectors_changed(&mut self, ids: &BTreeSet<SelectorId>) {
        let users: BTreeSet<PolicyKey> =
            ids.iter().filter_map(|id| self.selectors.get(id)).flat_map(|s| s.users.iter().cloned()).collect();
        for p in users {
            self.policy_groups_changed(&p);
        }
    }

    /// Marks the groups a policy is part of.
    fn policy_groups_changed(&mut self, policy: &PolicyKey) {
        for id in self.groups_by_policy.get(policy).into_iter().flatten() {
            if let Some(g) = self.groups.get_mut(id) {
                g.allowed = None;
                self.changed.extend(g.nodes.keys().cloned());
            }
        }
    }

    /// Adds or replaces a policy.
    pub fn upsert_policy(&mut self, policy: NetworkPolicy) {
        let key = policy.key();
        if self.policies.get(&key).is_some_and(|c| c.spec == policy) {
            return;
        }
        self.drop_policy(&key);
        let mut intern = |sel: PeerSelector| self.intern(sel, &key);
        let compiled = CompiledPolicy::new(policy, &mut intern);
        if compiled.egress_names_any_pod() {
            self.any_pod_policies.insert(key.clone());
        }
        self.policies_by_ns.entry(key.namespace.clone()).or_default().insert(key.name.clone());
        self.regroup.insert(key.namespace.clone());
        self.policies.insert(key.clone(), compiled);
        self.policy_groups_changed(&key);
    }

    /// Forgets a policy.
    pub fn remove_policy(&mut self, key: &PolicyKey) {
        if self.policies.contains_key(key) {
            self.drop_policy(key);
            self.regroup.insert(key.namespace.clone());
        }
    }

    fn drop_policy(&mut self, key: &PolicyKey) {
        let Some(old) = self.policies.remove(key) else { return };
        self.policy_groups_changed(key);
        for id in old.selectors() {
            if let Some(s) = self.selectors.get_mut(&id) {
                s.users.remove(key);
                if s.users.is_empty() {
                    let s = self.selectors.remove(&id).expect("just seen");
                    self.selector_ids.remove(&s.sel);
                }
            }
        }
        self.any_pod_policies.remove(key);
        if let Some(names) = self.policies_by_ns.get_mut(&key.namespace) {
            names.remove(&key.name);
            if names.is_empty() {
                self.policies_by_ns.remove(&key.namespace);
            }
        }
    }

    fn intern(&mut self, sel: PeerSelector, user: &PolicyKey) -> SelectorId {
        if let Some(id) = self.selector_ids.get(&sel) {
            let s = self.selectors.get_mut(id).expect("ids and selectors are kept together");
            s.users.insert(user.clone());
            return *id;
        }
        let id = self.next_selector;
        self.next_selector = self.next_selector.wrapping_add(1);
        let candidates: Vec<&PodKey> = match &sel.namespaces {
            NamespaceScope::Own(ns) => self.pods_by_ns.get(ns).into_iter().flatten().collect(),
            NamespaceScope::Matching(_) => self.pods.keys().collect(),
        };
        let members = candidates.into_iter().filter(|k| self.selects(&sel, &self.pods[*k].pod)).cloned().collect();
        self.selector_ids.insert(sel.clone(), id);
        self.selectors.insert(id, Selector { sel, members, users: [user.clone()].into() });
        id
    }

    /// The group key of a pod in one direction: `None` when no policy isolates it there (or it
    /// cannot be isolated: no node, no addresses of its own).
    fn group_key(&self, pod: &Pod, dir: PolicyType) -> Option<GroupKey> {
        if pod.node.is_empty() || !pod.has_own_addresses() {
            return None;
        }
        let mut policies = Vec::new();
        let mut names = BTreeSet::new();
        for name in self.policies_by_ns.get(&pod.namespace).into_iter().flatten() {
            let key = PolicyKey { namespace: pod.namespace.clone(), name: name.clone() };
            let c = &self.policies[&key];
            if c.rules(dir).is_some() && c.spec.pod_selector.matches(&pod.labels) {
                policies.push(name.clone());
                if dir == PolicyType::Ingress {
                    names.extend(c.ingress_port_names());
                }
            }
        }
        if policies.is_empty() {
            return None;
        }
        let bindings = compile::bindings(pod, &names);
        Some(GroupKey { dir, namespace: pod.namespace.clone(), policies, bindings })
    }

    fn regroup_pod(&mut self, key: &PodKey) {
        let Some(pod) = self.pods.get(key).map(|e| &e.pod) else { return };
        let keys = [self.group_key(pod, PolicyType::Ingress), self.group_key(pod, PolicyType::Egress)];
        for (dir, gk) in [PolicyType::Ingress, PolicyType::Egress].into_iter().zip(keys) {
            self.set_group(key, dir, gk);
        }
    }

    /// Moves a pod into the group of key `gk` (or out of any), creating and deleting groups.
    fn set_group(&mut self, pod_key: &PodKey, dir: PolicyType, gk: Option<GroupKey>) {
        let Some(entry) = self.pods.get(pod_key) else { return };
        let node = entry.pod.node.clone();
        let current = entry.groups[slot(dir)].clone();
        let wanted = gk.as_ref().map(|k| self.group_ids.get(k).cloned());
        if let (Some(cur), Some(Some(want))) = (&current, &wanted)
            && cur == want
        {
            return;
        }
        if current.is_none() && gk.is_none() {
            return;
        }
        if !node.is_empty() {
            self.changed.insert(node.clone());
        }
        if let Some(cur) = current {
            self.leave_group(&cur, pod_key, &node);
        }
        let new_id = gk.map(|k| self.join_group(k, pod_key, &node));
        if let Some(e) = self.pods.get_mut(pod_key) {
            e.groups[slot(dir)] = new_id;
        }
    }

    fn leave_group(&mut self, id: &GroupId, pod: &PodKey, node: &str) {
        let Some(g) = self.groups.get_mut(id) else { return };
        g.members.remove(pod);
        if let Some(n) = g.nodes.get_mut(node) {
            *n -= 1;
            if *n == 0 {
                g.nodes.remove(node);
            }
        }
        if g.members.is_empty() {
            let g = self.groups.remove(id).expect("just seen");
            self.group_ids.remove(&g.key);
            for p in &g.key.policies {
                let pk = PolicyKey { namespace: g.key.namespace.clone(), name: p.clone() };
                if let Some(s) = self.groups_by_policy.get_mut(&pk) {
                    s.remove(id);
                    if s.is_empty() {
                        self.groups_by_policy.remove(&pk);
                    }
                }
            }
        }
    }

    fn join_group(&mut self, key: GroupKey, pod: &PodKey, node: &str) -> GroupId {
        let id = match self.group_ids.get(&key) {
            Some(id) => id.clone(),
            None => {
                let prefix = if key.dir == PolicyType::Ingress { 'i' } else { 'e' };
                let base = format!("{prefix}{:016x}", fnv1a64(&key.canonical()));
                // Two keys with one hash: the later one gets a suffix (stable while both live).
                let mut id = GroupId(base.clone());
                let mut n = 2;
                while self.groups.contains_key(&id) {
                    id = GroupId(format!("{base}-{n}"));
                    n += 1;
                }
                for p in &key.policies {
                    let pk = PolicyKey { namespace: key.namespace.clone(), name: p.clone() };
                    self.groups_by_policy.entry(pk).or_default().insert(id.clone());
                }
                self.group_ids.insert(key.clone(), id.clone());
                let g = Group { key, members: BTreeSet::new(), nodes: BTreeMap::new(), allowed: None };
                self.groups.insert(id.clone(), g);
                id
            }
        };
        let g = self.groups.get_mut(&id).expect("present or just made");
        g.members.insert(pod.clone());
        *g.nodes.entry(node.to_string()).or_default() += 1;
        id
    }

    /// Regroups the pods of namespaces whose policies changed.
    fn flush(&mut self) {
        for ns in std::mem::take(&mut self.regroup) {
            let pods: Vec<PodKey> = self.pods_by_ns.get(&ns).into_iter().flatten().cloned().collect();
            for p in pods {
                self.regroup_pod(&p);
            }
        }
    }

    /// The nodes whose state may have changed since the last call.
    pub fn take_changed_nodes(&mut self) -> BTreeSet<String> {
        self.flush();
        std::mem::take(&mut self.changed)
    }
}

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;
