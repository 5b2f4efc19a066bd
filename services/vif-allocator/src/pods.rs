//! The allocator's view of pods and nodes, fed by the watcher's Subscribe stream, and what each
//! pod should have.
//!
//! Free of kube, tonic and protobuf: it reads [`Watched`] events, which the follower
//! ([`crate::grpc::follow`]) makes of the watcher's `SubscribeResponse`s at its edge. Keyed by pod uid: a pod
//! deleted and re-created under the same name is two pods, each with its own VIF. A pod that
//! disappears stays in the view as a tombstone until its cleanup has run, so the worker knows
//! its namespace, name and node.
//!
//! A snapshot (the first one, or one after RESET) is a re-list: at SNAPSHOT_COMPLETE every pod
//! and node it did not name is gone, so a deletion missed while disconnected still releases.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use crate::core::PodKey;

/// The finalizer the allocator puts on every pod it gives a VIF: the pod cannot disappear before
/// its address is released.
pub const FINALIZER: &str = "kuryr.openstack.org/vif";

/// What the allocator reads of a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInfo {
    /// Namespace, name, uid.
    pub key: PodKey,
    /// spec.nodeName; empty while unscheduled.
    pub node: String,
    /// status.phase.
    pub phase: String,
    /// metadata.deletionTimestamp is set.
    pub deleting: bool,
    /// spec.hostNetwork (the subscription leaves these out; kept for safety).
    pub host_network: bool,
    /// Our finalizer is on the pod (as last seen).
    pub has_finalizer: bool,
    /// Every finalizer on the pod, in order (as last seen): enough to remove ours without
    /// reading the pod first.
    pub finalizers: Vec<String>,
    /// The `k8s.v1.cni.cncf.io/networks` annotation: further interfaces (see [`crate::core::attach`]).
    pub networks: Option<String>,
}

/// One event of the watcher's stream, as the view reads it. Events that concern neither a pod
/// nor a node (heartbeats, other kinds, objects without a body) are not made into one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Watched {
    /// RESET: a new snapshot follows.
    Reset,
    /// The snapshot is complete; live changes follow.
    SnapshotComplete,
    /// A pod appeared or changed.
    PodApplied(PodInfo),
    /// A pod was deleted: its uid, and the pod as the deletion carried it (if it did).
    PodDeleted(String, Option<PodInfo>),
    /// A node appeared or changed: its name and InternalIPs.
    NodeApplied(String, Vec<String>),
    /// A node was deleted.
    NodeDeleted(String),
}

/// What a pod should have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Desired {
    /// A VIF on this node.
    Vif {
        /// spec.nodeName.
        node: String,
    },
    /// No VIF: unscheduled, host network, finished, being deleted, or gone.
    NoVif,
}

impl PodInfo {
    /// What the pod should have while it exists.
    pub fn desired(&self) -> Desired {
        let finished = matches!(self.phase.as_str(), "Succeeded" | "Failed");
        if self.node.is_empty() || self.host_network || self.deleting || finished {
            Desired::NoVif
        } else {
            Desired::Vif { node: self.node.clone() }
        }
    }
}

/// One pod of the view.
#[derive(Clone, Debug)]
pub struct PodEntry {
    /// The pod as last seen.
    pub info: PodInfo,
    /// Gone from the API (or from the latest snapshot); removed once cleaned up.
    pub gone: bool,
    /// A PodVif may exist for it without our finalizer on the pod (found by recovery):
    /// cleanup must run in full even if nothing else says so.
    pub orphan: bool,
    /// When the pod was first seen scheduled, for the VIF latency metric.
    pub first_scheduled: Option<Instant>,
    /// The uid of the PodVif this process created or found for the pod: its cleanup deletes
    /// exactly that object without reading it first. `None` when not known here (after a
    /// restart, say): cleanup reads the PodVif then.
    pub pod_vif: Option<String>,
}

impl PodEntry {
    /// What the pod should have now.
    pub fn desired(&self) -> Desired {
        if self.gone { Desired::NoVif } else { self.info.desired() }
    }
}

/// What an event changed, for the caller to act on.
#[derive(Debug, PartialEq, Eq)]
pub enum Effect {
    /// Reconcile this pod uid.
    Pod(String),
    /// A node's InternalIPs (empty when the Node is gone).
    NodeIps(String, Vec<String>),
    /// The stream's snapshot is complete; it is live.
    Live,
    /// RESET: a new snapshot follows.
    Resync,
}

/// The view.
#[derive(Debug)]
pub struct PodView {
    pods: HashMap<String, PodEntry>,
    nodes: BTreeMap<String, Vec<String>>,
    /// While a snapshot is being received: the pod uids and node names it named.
    resync: Option<(HashSet<String>, HashSet<String>)>,
}

impl Default for PodView {
    fn default() -> Self {
        // The first snapshot is a re-list like any other.
        Self { pods: HashMap::new(), nodes: BTreeMap::new(), resync: Some(Default::default()) }
    }
}

impl PodView {
    /// The entry of a pod uid.
    pub fn get(&self, uid: &str) -> Option<&PodEntry> {
        self.pods.get(uid)
    }

    /// How many pods (tombstones included) are held.
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    /// Whether no pod is held.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Whether a Node of this name exists; `None` until the watcher's snapshot is complete.
    pub fn has_node(&self, name: &str) -> Option<bool> {
        self.resync.is_none().then(|| self.nodes.contains_key(name))
    }

    /// The uids of the pods (tombstones included) on nodes `which` selects.
    pub fn uids_where(&self, which: impl Fn(&str) -> bool) -> Vec<String> {
        self.pods.iter().filter(|(_, e)| which(&e.info.node)).map(|(uid, _)| uid.clone()).collect()
    }

    /// Remembers the uid of the pod's PodVif (see [`PodEntry::pod_vif`]); nothing when the pod
    /// is not held.
    pub fn set_pod_vif(&mut self, uid: &str, pod_vif: Option<String>) {
        if let Some(e) = self.pods.get_mut(uid) {
            e.pod_vif = pod_vif;
        }
    }

    /// Forgets a pod whose cleanup finished, if it is still gone.
    pub fn forget(&mut self, uid: &str) {
        if self.pods.get(uid).is_some_and(|e| e.gone) {
            self.pods.remove(uid);
        }
    }

    /// Records that a PodVif exists for `key` on `node` although the pod may not. Returns true
    /// when the pod is unknown (and so now a tombstone to clean up).
    pub fn adopt_orphan(&mut self, key: PodKey, node: &str) -> bool {
        if let Some(e) = self.pods.get_mut(&key.uid) {
            e.orphan = true;
            return false;
        }
        let info = PodInfo {
            key: key.clone(),
            node: node.to_string(),
            phase: String::new(),
            deleting: true,
            host_network: false,
            has_finalizer: false,
            finalizers: Vec::new(),
            networks: None,
        };
        let entry = PodEntry { info, gone: true, orphan: true, first_scheduled: None, pod_vif: None };
        self.pods.insert(key.uid, entry);
        true
    }

    /// Applies one event of the watcher's stream.
    pub fn apply(&mut self, ev: &Watched, now: Instant) -> Vec<Effect> {
        match ev {
            Watched::Reset => {
                self.resync = Some(Default::default());
                vec![Effect::Resync]
            }
            Watched::SnapshotComplete => {
                let mut effects = Vec::new();
                if let Some((pods, nodes)) = self.resync.take() {
                    for (uid, e) in &mut self.pods {
                        if !e.gone && !pods.contains(uid) {
                            e.gone = true;
                            effects.push(Effect::Pod(uid.clone()));
                        }
                    }
                    let gone: Vec<String> = self.nodes.keys().filter(|n| !nodes.contains(*n)).cloned().collect();
                    for n in gone {
                        self.nodes.remove(&n);
                        effects.push(Effect::NodeIps(n, Vec::new()));
                    }
                }
                effects.push(Effect::Live);
                effects
            }
            Watched::PodApplied(info) => self.pod_applied(info, now),
            Watched::PodDeleted(uid, info) => self.pod_deleted(uid, info.as_ref()),
            Watched::NodeApplied(name, ips) => self.node_applied(name, ips),
            Watched::NodeDeleted(name) => match self.nodes.remove(name) {
                Some(_) => vec![Effect::NodeIps(name.clone(), Vec::new())],
                None => Vec::new(),
            },
        }
    }

    fn pod_applied(&mut self, info: &PodInfo, now: Instant) -> Vec<Effect> {
        if let Some((pods, _)) = &mut self.resync {
            pods.insert(info.key.uid.clone());
        }
        let uid = info.key.uid.clone();
        let scheduled = (!info.node.is_empty()).then_some(now);
        match self.pods.get_mut(&uid) {
            Some(e) if !e.gone && e.info == *info => return Vec::new(),
            Some(e) => {
                e.first_scheduled = e.first_scheduled.or(scheduled);
                e.info = info.clone();
                e.gone = false;
            }
            None => {
                let entry = PodEntry {
                    info: info.clone(),
                    gone: false,
                    orphan: false,
                    first_scheduled: scheduled,
                    pod_vif: None,
                };
                self.pods.insert(uid.clone(), entry);
            }
        }
        vec![Effect::Pod(uid)]
    }

    fn pod_deleted(&mut self, uid: &str, info: Option<&PodInfo>) -> Vec<Effect> {
        let Some(e) = self.pods.get_mut(uid) else {
            return Vec::new();
        };
        if let Some(info) = info {
            e.info = info.clone();
        }
        e.gone = true;
        vec![Effect::Pod(uid.to_string())]
    }

    fn node_applied(&mut self, name: &str, ips: &[String]) -> Vec<Effect> {
        if let Some((_, nodes)) = &mut self.resync {
            nodes.insert(name.to_string());
        }
        let mut ips = ips.to_vec();
        ips.sort();
        if self.nodes.get(name) == Some(&ips) {
            return Vec::new();
        }
        self.nodes.insert(name.to_string(), ips.clone());
        vec![Effect::NodeIps(name.to_string(), ips)]
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn info(name: &str, node: &str, phase: &str) -> PodInfo {
        PodInfo {
            key: PodKey::new("ns", name, format!("uid-{name}")),
            node: node.into(),
            phase: phase.into(),
            deleting: false,
            host_network: false,
            has_finalizer: false,
            finalizers: Vec::new(),
            networks: None,
        }
    }

    fn applied(name: &str, node: &str, phase: &str) -> Watched {
        Watched::PodApplied(info(name, node, phase))
    }

    fn deleted(name: &str, node: &str, phase: &str) -> Watched {
        Watched::PodDeleted(format!("uid-{name}"), Some(info(name, node, phase)))
    }

    fn node(name: &str, ip: &str) -> Watched {
        Watched::NodeApplied(name.into(), vec![ip.into()])
    }

    #[test]
    fn what_a_pod_should_have() {
        let base = info("a", "n1", "Pending");
        assert_eq!(base.desired(), Desired::Vif { node: "n1".into() });
        for (change, why) in [
            (PodInfo { node: String::new(), ..base.clone() }, "unscheduled"),
            (PodInfo { phase: "Succeeded".into(), ..base.clone() }, "succeeded"),
            (PodInfo { phase: "Failed".into(), ..base.clone() }, "failed"),
            (PodInfo { deleting: true, ..base.clone() }, "deleting"),
            (PodInfo { host_network: true, ..base.clone() }, "host network"),
        ] {
            assert_eq!(change.desired(), Desired::NoVif, "{why}");
        }
        assert_eq!(PodInfo { phase: "Running".into(), ..base }.desired(), Desired::Vif { node: "n1".into() });
    }

    #[test]
    fn changes_reconcile_and_snapshots_relist() {
        let now = Instant::now();
        let mut v = PodView::default();
        assert_eq!(v.apply(&applied("a", "n1", "Pending"), now), [Effect::Pod("uid-a".into())]);
        assert_eq!(v.apply(&applied("b", "", "Pending"), now), [Effect::Pod("uid-b".into())]);
        assert_eq!(
            v.apply(&node("n1", "192.168.0.1"), now),
            [Effect::NodeIps("n1".into(), vec!["192.168.0.1".into()])]
        );
        assert_eq!(v.apply(&Watched::SnapshotComplete, now), [Effect::Live]);
        assert!(v.get("uid-a").unwrap().first_scheduled.is_some());
        assert!(v.get("uid-b").unwrap().first_scheduled.is_none());
        // The same content again is no work.
        assert!(v.apply(&applied("a", "n1", "Pending"), now).is_empty());
        assert_eq!(v.apply(&applied("a", "n1", "Running"), now), [Effect::Pod("uid-a".into())]);
        // Deletion keeps a tombstone until cleanup.
        assert_eq!(v.apply(&deleted("b", "", "Pending"), now), [Effect::Pod("uid-b".into())]);
        assert!(v.get("uid-b").unwrap().gone);
        v.forget("uid-b");
        v.forget("uid-a");
        assert!(v.get("uid-b").is_none());
        assert!(v.get("uid-a").is_some(), "only tombstones are forgotten");

        // RESET + a snapshot that no longer names a nor n1: both are gone.
        assert_eq!(v.apply(&Watched::Reset, now), [Effect::Resync]);
        v.apply(&applied("c", "n2", "Pending"), now);
        let effects = v.apply(&Watched::SnapshotComplete, now);
        assert_eq!(effects, [Effect::Pod("uid-a".into()), Effect::NodeIps("n1".into(), Vec::new()), Effect::Live]);
        assert_eq!(v.get("uid-a").unwrap().desired(), Desired::NoVif);
    }

    #[test]
    fn orphans_from_recovery() {
        let mut v = PodView::default();
        v.apply(&applied("a", "n1", "Pending"), Instant::now());
        assert!(!v.adopt_orphan(PodKey::new("ns", "a", "uid-a"), "n1"), "a exists");
        assert!(v.adopt_orphan(PodKey::new("ns", "old", "uid-old"), "n1"));
        let e = v.get("uid-old").unwrap();
        assert!(e.gone && e.orphan && e.desired() == Desired::NoVif);
        assert_eq!(e.info.node, "n1");
    }
}
