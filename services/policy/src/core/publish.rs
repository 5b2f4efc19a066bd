//! From the watcher's events to the streamed state: objects go into the compiler
//! ([`kuryr_policy_core::Compiler`]) one at a time; after each, the nodes the change reached get
//! their new [`NodePolicy`], whose difference from the published one is written to the log that
//! WatchPolicies streams ([`PolicyLog`]).
//!
//! The log is keyed by node, then item: a node's groups sort before its isolations, so that a
//! snapshot sends every group before the first isolation naming it; deltas keep that order too
//! (groups upserted first, isolations removed first).
//!
//! Nothing is published while a snapshot of the watcher is being received (the first one, or
//! the one after a RESET): a binder never sees a partial view in which a protected pod would be
//! open because its policy had not arrived yet. At the end of a RESET's snapshot, objects it did
//! not mention are removed, as a re-list does.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use kuryr_policy_core::{Allowed, Compiler, GroupId, NodePolicy, PodKey, PolicyKey};
use kuryr_stream::SharedLog;
use kuryr_stream::log::lock;

use super::status::{Report, Tracker};
use super::{Change, Enforcer, Kind, ObjKey, Object, VifAddresses, VifChange, WatchedPod};
use crate::metrics::Metrics;

/// An item of one node's state.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Item {
    /// A group of peers, by id. Sorts before isolations.
    Group(String),
    /// An isolated local pod address.
    Isolation(IpAddr),
}

/// A log key: the node, then the item.
pub type Key = (String, Item);

/// A value of the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A group's peers, and the policies they come from (`namespace/name`).
    Group { allowed: Arc<Allowed>, policies: Arc<Vec<String>> },
    /// The groups judging an address, and its pod (`namespace/name`).
    Isolation { ingress: Option<GroupId>, egress: Option<GroupId>, pod: String },
}

/// What WatchPolicies streams.
pub type PolicyLog = SharedLog<Key, Entry>;

/// What happened to the view, for the follower.
#[derive(Debug, PartialEq, Eq)]
pub enum Effect {
    /// Nothing the follower acts on.
    None,
    /// The watcher sent RESET: a new snapshot follows.
    Resync,
    /// A snapshot is complete: the state is published and the stream is live.
    Live,
}

/// The compiler, what was published per node, and the log.
#[derive(Debug)]
pub struct Publisher {
    compiler: Compiler,
    log: PolicyLog,
    metrics: Metrics,
    /// Each node's entries as last written to the log.
    published: HashMap<String, BTreeMap<Item, Entry>>,
    /// The objects in the compiler.
    known: HashSet<ObjKey>,
    /// Pod addresses, for naming the pod of an isolation.
    pod_ips: HashMap<PodKey, Vec<IpAddr>>,
    /// Every recorded VIF's addresses ([`VifChange`]).
    vifs: HashMap<PodKey, VifAddresses>,
    /// Pods as watched whose status has no addresses yet: they take their VIF's.
    addressless: HashMap<PodKey, WatchedPod>,
    owners: HashMap<IpAddr, PodKey>,
    /// Inside a snapshot: the objects it named so far (after a RESET), or an empty set (the
    /// first one). `None` when live.
    snapshot: Option<HashSet<ObjKey>>,
    /// Policies the compiler reported problems with, for the log (once per change).
    invalid: BTreeMap<PolicyKey, Vec<String>>,
    /// With `--backend neutron`: what enforces the compiled state besides the binders.
    enforcer: Option<Box<dyn Enforcer>>,
    /// Each policy's status as last reported ([`super::status`]).
    status: Tracker,
    /// Set and map elements of each node's published state.
    elements: HashMap<String, usize>,
}

impl Publisher {
    /// A publisher writing to `log`, which is made ready at the first complete snapshot.
    pub fn new(log: PolicyLog, metrics: Metrics) -> Self {
        Self {
            compiler: Compiler::new(),
            log,
            metrics,
            published: HashMap::new(),
            known: HashSet::new(),
            pod_ips: HashMap::new(),
            vifs: HashMap::new(),
            addressless: HashMap::new(),
            owners: HashMap::new(),
            snapshot: Some(HashSet::new()),
            invalid: BTreeMap::new(),
            enforcer: None,
            status: Tracker::default(),
            elements: HashMap::new(),
        }
    }

    /// Also hands the compiled state to `enforcer` after every change (the Neutron backend).
    pub fn with_enforcer(mut self, enforcer: Box<dyn Enforcer>) -> Self {
        self.enforcer = Some(enforcer);
        self
    }

    /// Hands the compiled state to the enforcer, if any.
    fn publish_neutron(&self) {
        if let Some(e) = &self.enforcer {
            e.compiled(&self.compiler);
        }
    }

    /// Applies one event of the watcher's stream.
    pub fn apply(&mut self, ev: Change) -> Effect {
        match ev {
            Change::Reset => {
                self.snapshot = Some(HashSet::new());
                Effect::Resync
            }
            Change::SnapshotComplete => {
                if let Some(seen) = self.snapshot.take() {
                    let gone: Vec<ObjKey> = self.known.iter().filter(|k| !seen.contains(*k)).cloned().collect();
                    for key in gone {
                        self.remove(&key);
                    }
                    self.publish();
                    self.publish_neutron();
                    let mut log = lock(&self.log);
                    if !log.is_ready() {
                        log.set_ready();
                    }
                }
                Effect::Live
            }
            Change::Applied(key, o) => {
                if let Some(seen) = &mut self.snapshot {
                    seen.insert(key.clone());
                }
                self.upsert(&key, o);
                self.changed(&key);
                Effect::None
            }
            Change::Deleted(key) => {
                self.remove(&key);
                self.changed(&key);
                Effect::None
            }
            // The follower keeps heartbeats to itself; nothing to compile in one anyway.
            Change::None => Effect::None,
        }
    }

    /// After a change to `key` while live: publishes, and hands the state to the enforcer when
    /// any node's state or a policy changed.
    fn changed(&mut self, key: &ObjKey) {
        if self.snapshot.is_none() && (self.publish() || key.kind == Kind::NetworkPolicy) {
            self.publish_neutron();
        }
    }

    fn upsert(&mut self, key: &ObjKey, o: Object) {
        match (key.kind, o) {
            (Kind::Pod, Object::Pod(watched)) => {
                let pod = self.with_vif_addresses(watched);
                self.set_pod_ips(pod.key(), pod.ips.clone());
                self.compiler.upsert_pod(pod);
            }
            (Kind::Namespace, Object::Namespace(ns)) => self.compiler.upsert_namespace(ns),
            (Kind::NetworkPolicy, Object::NetworkPolicy { uid, policy }) => match policy {
                Ok(p) => {
                    let problems = p.validate();
                    let pk = p.key();
                    self.status.seen(pk.clone(), uid);
                    if problems.is_empty() {
                        self.invalid.remove(&pk);
                    } else if self.invalid.get(&pk) != Some(&problems) {
                        self.metrics.invalid_policies.inc();
                        tracing::warn!(policy = %pk, ?problems, "NetworkPolicy has parts that match nothing");
                        self.invalid.insert(pk, problems);
                    }
                    self.compiler.upsert_policy(p);
                }
                Err(e) => {
                    // Kept as it was: the API server only stores valid JSON, so this is a bug
                    // somewhere between it and here, and dropping the policy would open its pods.
                    self.metrics.invalid_policies.inc();
                    tracing::error!(error = %e, "NetworkPolicy ignored; its previous version (if any) stays");
                    return;
                }
            },
            _ => return,
        }
        self.known.insert(key.clone());
    }

    fn remove(&mut self, obj: &ObjKey) {
        if !self.known.remove(obj) {
            return;
        }
        let (namespace, name) = (obj.namespace.as_str(), obj.name.as_str());
        match obj.kind {
            Kind::Pod => {
                let key = PodKey { namespace: namespace.into(), name: name.into() };
                self.set_pod_ips(key.clone(), Vec::new());
                self.pod_ips.remove(&key);
                self.addressless.remove(&key);
                self.compiler.remove_pod(&key);
            }
            Kind::Namespace => self.compiler.remove_namespace(name),
            Kind::NetworkPolicy => {
                let key = PolicyKey { namespace: namespace.into(), name: name.into() };
                self.invalid.remove(&key);
                self.status.forget(&key);
                self.compiler.remove_policy(&key);
            }
            Kind::Other(_) => {}
        }
    }

    /// The pod the compiler gets: as watched, or, while its status has no addresses, with its
    /// VIF's (a VIF recorded for this very pod, by uid). Finished and host-network pods get none.
    fn with_vif_addresses(&mut self, watched: WatchedPod) -> kuryr_policy_core::Pod {
        let key = watched.pod.key();
        if !watched.pod.ips.is_empty() || watched.finished || watched.pod.host_network {
            self.addressless.remove(&key);
            return watched.pod;
        }
        let mut pod = watched.pod.clone();
        if let Some(vif) = self.vifs.get(&key).filter(|v| v.uid == watched.uid) {
            pod.ips.clone_from(&vif.ips);
        }
        self.addressless.insert(key, watched);
        pod
    }

    /// Applies a change of the recorded VIFs: the pods without addresses in their status that
    /// it concerns are compiled again (and published, when live).
    pub fn vif(&mut self, change: VifChange) {
        let affected: Vec<PodKey> = match change {
            VifChange::Listed(all) => {
                self.vifs = all;
                self.addressless.keys().cloned().collect()
            }
            VifChange::Set(key, vif) => {
                if self.vifs.get(&key) == Some(&vif) {
                    return;
                }
                self.vifs.insert(key.clone(), vif);
                vec![key]
            }
            VifChange::Gone(key) => {
                if self.vifs.remove(&key).is_none() {
                    return;
                }
                vec![key]
            }
        };
        for key in affected {
            let Some(watched) = self.addressless.get(&key).cloned() else { continue };
            let pod = self.with_vif_addresses(watched);
            if self.pod_ips.get(&key) == Some(&pod.ips) {
                continue;
            }
            self.set_pod_ips(key.clone(), pod.ips.clone());
            self.compiler.upsert_pod(pod);
            let obj = ObjKey { kind: Kind::Pod, namespace: key.namespace, name: key.name };
            self.changed(&obj);
        }
    }

    fn set_pod_ips(&mut self, key: PodKey, ips: Vec<IpAddr>) {
        if let Some(old) = self.pod_ips.get(&key) {
            for ip in old {
                if self.owners.get(ip) == Some(&key) {
                    self.owners.remove(ip);
                }
            }
        }
        for ip in &ips {
            self.owners.insert(*ip, key.clone());
        }
        self.pod_ips.insert(key, ips);
    }

    /// Writes the state of every node the compiler says changed; whether any did.
    fn publish(&mut self) -> bool {
        let started = Instant::now();
        self.status.mark();
        let nodes = self.compiler.take_changed_nodes();
        if nodes.is_empty() {
            return false;
        }
        let mut changes = 0;
        for node in nodes {
            if node.is_empty() {
                continue;
            }
            let state = self.compiler.node_policy(&node);
            self.elements.insert(node.clone(), state.elements());
            let entries = self.entries(&state);
            changes += self.write(&node, entries);
        }
        let stats = self.compiler.stats();
        self.elements.retain(|_, n| *n > 0);
        self.metrics.elements.set(i64::try_from(self.elements.values().sum::<usize>()).unwrap_or(i64::MAX));
        self.metrics.observe_publish(started.elapsed(), changes, stats, lock(&self.log).len());
        true
    }

    /// A node's entries.
    fn entries(&self, state: &NodePolicy) -> BTreeMap<Item, Entry> {
        let mut out = BTreeMap::new();
        for (id, allowed) in &state.groups {
            let policies = self.compiler.group_policies(id).iter().map(ToString::to_string).collect();
            out.insert(
                Item::Group(id.0.clone()),
                Entry::Group { allowed: allowed.clone(), policies: Arc::new(policies) },
            );
        }
        for ip in state.isolated_addresses() {
            let pod = self.owners.get(&ip).map(ToString::to_string).unwrap_or_default();
            out.insert(
                Item::Isolation(ip),
                Entry::Isolation {
                    ingress: state.ingress.get(&ip).cloned(),
                    egress: state.egress.get(&ip).cloned(),
                    pod,
                },
            );
        }
        out
    }

    /// Writes the difference between a node's published entries and `entries`; returns how
    /// many log changes it made.
    fn write(&mut self, node: &str, entries: BTreeMap<Item, Entry>) -> usize {
        let old = self.published.remove(node).unwrap_or_default();
        let mut log = lock(&self.log);
        let mut n = 0;
        let gone: BTreeSet<&Item> = old.keys().filter(|k| !entries.contains_key(*k)).collect();
        // Groups (sorted first) before isolations on the way in; isolations first on the way out.
        for (item, entry) in &entries {
            if old.get(item) != Some(entry) && log.upsert((node.to_string(), item.clone()), entry.clone()) {
                n += 1;
            }
        }
        for item in gone.iter().rev() {
            if log.remove(&(node.to_string(), (*item).clone())).is_some() {
                n += 1;
            }
        }
        drop(log);
        if !entries.is_empty() {
            self.published.insert(node.to_string(), entries);
        }
        n
    }

    /// The policies whose status changed since last asked (nothing inside a watcher snapshot:
    /// only a complete view is reported).
    pub fn status_reports(&mut self) -> Vec<Report> {
        if self.snapshot.is_some() {
            return Vec::new();
        }
        self.status.reports(&mut self.compiler, &self.invalid)
    }

    /// The compiler's sizes.
    pub fn stats(&self) -> kuryr_policy_core::Stats {
        self.compiler.stats()
    }
}

#[cfg(test)]
#[path = "publish_tests.rs"]
mod tests;
