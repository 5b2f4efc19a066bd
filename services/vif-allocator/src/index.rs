//! The VIF index: every VIF handed out (by pod uid), every node's routes, and a bounded history of
//! the changes between them, numbered by a revision that only grows. `WatchVifs` streams read it.
//!
//! Free of kube and tonic: the controller and the recovery feed it, the gRPC streams
//! ([`crate::grpc`]) read it, and tests apply changes directly.
//!
//! - A VIF enters the index only after it was recorded in its PodVif status (the controller's
//!   job), so a binder is never handed a VIF the API does not hold.
//! - A change is recorded only when something a binder reads changed; re-publishing the same VIF
//!   costs the streams nothing.
//! - Node routes are derived, not set: a node has routes when it owns at least one address block
//!   **and** has an InternalIP (a route needs both a destination and a next hop). Gaining a
//!   block or changing its IP re-sends them; losing either deletes them.
//! - Nothing is recorded before [`VifIndex::set_ready`] (recovery finished): nobody can subscribe
//!   before that, so the first resume point is `<epoch>-0`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use kuryr_proto::allocator::v1::{NodeRoutes, Vif, VifState};
use kuryr_stream::Epoch;
use tokio::sync::watch;

/// Deltas kept for resuming: a binder that reconnects within this many changes gets only what
/// it missed. A delta is a few hundred bytes shared with the index, so 16k cost a few MB.
pub const DEFAULT_HISTORY: usize = 16_384;

/// One change, as streamed.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// A VIF was handed out or changed state.
    VifApplied(Arc<Vif>),
    /// A VIF was released: its pod is gone (or finished).
    VifDeleted(Arc<Vif>),
    /// A node's routes appeared or changed.
    RoutesApplied(Arc<NodeRoutes>),
    /// A node no longer has routes.
    RoutesDeleted(Arc<NodeRoutes>),
}

impl Change {
    /// Whether the stream of `node` carries this change: its own VIFs, every other node's routes.
    pub fn concerns(&self, node: &str) -> bool {
        match self {
            Change::VifApplied(v) | Change::VifDeleted(v) => vif_node(v) == node,
            Change::RoutesApplied(r) | Change::RoutesDeleted(r) => r.node_name != node,
        }
    }
}

/// One recorded change.
#[derive(Debug)]
pub struct Delta {
    /// Its position in this process's history; the first delta is 1.
    pub revision: u64,
    /// What changed.
    pub change: Change,
}

/// How a stream begins.
#[derive(Debug)]
pub enum Start {
    /// Continue after `cursor`: the history holds every delta since.
    Resume {
        /// The last revision the binder handled.
        cursor: u64,
    },
    /// Send `items`, then SNAPSHOT_COMPLETE at `cursor`, then the deltas after it.
    Snapshot {
        /// The binder asked to resume and cannot: send RESET first.
        reset: bool,
        /// The node's VIFs and the other nodes' routes, as `*Applied` changes.
        items: Vec<Change>,
        /// The revision the snapshot reflects.
        cursor: u64,
    },
}

/// Recovery has not finished yet.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("the allocator has not recovered its VIFs from the Kubernetes API yet")]
pub struct NotReady;

/// The history no longer holds the deltas after the cursor.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("revision {0} is no longer in the history")]
pub struct Lagged(pub u64);

/// The index. Shared as [`SharedIndex`]; every method is short and never awaits.
#[derive(Debug)]
pub struct VifIndex {
    epoch: Epoch,
    /// By pod uid.
    vifs: HashMap<String, Arc<Vif>>,
    /// InternalIPs by node, from the watcher's Node objects (sorted).
    node_ips: BTreeMap<String, Vec<String>>,
    /// Address blocks by owning node, from the IPAM (sorted).
    blocks: BTreeMap<String, Vec<String>>,
    /// The routes published, by node.
    routes: BTreeMap<String, Arc<NodeRoutes>>,
    history: VecDeque<Arc<Delta>>,
    capacity: usize,
    revision: u64,
    ready: bool,
    /// Resume points before this revision are refused (RESET + snapshot): VIFs were dropped
    /// without deltas then (their shard went to another replica), so the history after such a
    /// point does not tell a binder everything.
    resume_floor: u64,
    /// Tells streams a new revision exists; sent under the index lock.
    revision_tx: watch::Sender<u64>,
}

/// The index behind a mutex, as the controller, recovery and streams share it.
pub type SharedIndex = Arc<Mutex<VifIndex>>;

/// Locks a shared index. A panic while it was held cannot leave it worse than a stale entry,
/// which the next reconcile repairs, so a poisoned lock is used anyway.
pub fn lock(index: &SharedIndex) -> MutexGuard<'_, VifIndex> {
    index.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The node a VIF is on.
pub fn vif_node(v: &Vif) -> &str {
    v.pod.as_ref().map_or("", |p| p.node_name.as_str())
}

/// The pod uid a VIF belongs to.
pub fn vif_uid(v: &Vif) -> &str {
    v.pod.as_ref().map_or("", |p| p.uid.as_str())
}

impl VifIndex {
    /// An empty index keeping up to `capacity` deltas (at least 1).
    pub fn new(epoch: Epoch, capacity: usize) -> Self {
        Self {
            epoch,
            vifs: HashMap::new(),
            node_ips: BTreeMap::new(),
            blocks: BTreeMap::new(),
            routes: BTreeMap::new(),
            history: VecDeque::new(),
            capacity: capacity.max(1),
            revision: 0,
            ready: false,
            resume_floor: 0,
            revision_tx: watch::Sender::new(0),
        }
    }

    /// Wraps the index for sharing.
    pub fn shared(self) -> SharedIndex {
        Arc::new(Mutex::new(self))
    }

    /// This process's epoch.
    pub fn epoch(&self) -> &Epoch {
        &self.epoch
    }

    /// The latest revision.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Observes the latest revision.
    pub fn revisions(&self) -> watch::Receiver<u64> {
        self.revision_tx.subscribe()
    }

    /// Whether recovery has finished and streams are served.
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// Recovery has finished: serve streams and record deltas from now on.
    pub fn set_ready(&mut self) {
        self.ready = true;
    }

    /// How many VIFs are held.
    pub fn len(&self) -> usize {
        self.vifs.len()
    }

    /// Whether no VIF is held.
    pub fn is_empty(&self) -> bool {
        self.vifs.is_empty()
    }

    /// The VIF of a pod.
    pub fn get(&self, pod_uid: &str) -> Option<Arc<Vif>> {
        self.vifs.get(pod_uid).cloned()
    }

    /// Every VIF held.
    pub fn vifs(&self) -> Vec<Arc<Vif>> {
        self.vifs.values().cloned().collect()
    }

    /// The routes currently published for `node`.
    pub fn routes(&self, node: &str) -> Option<Arc<NodeRoutes>> {
        self.routes.get(node).cloned()
    }

    /// Adds or replaces a VIF (keyed by its pod's uid); returns whether anything changed.
    pub fn upsert_vif(&mut self, vif: Vif) -> bool {
        let uid = vif_uid(&vif).to_string();
        if uid.is_empty() {
            return false;
        }
        if self.vifs.get(&uid).is_some_and(|old| **old == vif) {
            return false;
        }
        let vif = Arc::new(vif);
        if let Some(old) = self.vifs.insert(uid, vif.clone())
            && vif_node(&old) != vif_node(&vif)
        {
            // Never expected (a pod's node is fixed), but the old node's binder must hear of it.
            self.record(Change::VifDeleted(old));
        }
        self.record(Change::VifApplied(vif));
        true
    }

    /// Changes the state of a pod's VIF if it is still `vif_id`; returns the VIF after.
    pub fn set_state(&mut self, pod_uid: &str, vif_id: &str, state: VifState) -> Option<Arc<Vif>> {
        let old = self.vifs.get(pod_uid)?;
        if old.vif_id != vif_id {
            return None;
        }
        if old.state() == state {
            return Some(old.clone());
        }
        let mut vif = Vif::clone(old);
        vif.set_state(state);
        self.upsert_vif(vif);
        self.vifs.get(pod_uid).cloned()
    }

    /// Removes a pod's VIF, streaming VIF_DELETED; returns it.
    pub fn remove_vif(&mut self, pod_uid: &str) -> Option<Arc<Vif>> {
        let old = self.vifs.remove(pod_uid)?;
        self.record(Change::VifDeleted(old.clone()));
        Some(old)
    }

    /// Drops the VIFs `which` selects without streaming anything: their nodes' streams are ended
    /// and served by another replica from now on (their shard moved). Binders resuming from
    /// before this get RESET and a snapshot. Returns how many were dropped.
    pub fn forget_vifs(&mut self, which: impl Fn(&Vif) -> bool) -> usize {
        let before = self.vifs.len();
        self.vifs.retain(|_, v| !which(v));
        let dropped = before - self.vifs.len();
        if dropped > 0 {
            self.resume_floor = self.revision;
        }
        dropped
    }

    /// Sets a node's InternalIPs (empty: unknown, or the Node is gone).
    pub fn set_node_ips(&mut self, node: &str, mut ips: Vec<String>) {
        ips.sort();
        ips.dedup();
        let changed = if ips.is_empty() {
            self.node_ips.remove(node).is_some()
        } else {
            self.node_ips.insert(node.to_string(), ips.clone()) != Some(ips)
        };
        if changed {
            self.refresh_routes(node);
        }
    }

    /// Replaces the whole map of address blocks by owning node.
    pub fn set_blocks(&mut self, blocks: BTreeMap<String, Vec<String>>) {
        let mut blocks: BTreeMap<String, Vec<String>> = blocks
            .into_iter()
            .filter(|(_, b)| !b.is_empty())
            .map(|(n, mut b)| {
                b.sort();
                b.dedup();
                (n, b)
            })
            .collect();
        let mut touched: Vec<String> = self.blocks.keys().chain(blocks.keys()).cloned().collect();
        touched.sort();
        touched.dedup();
        std::mem::swap(&mut self.blocks, &mut blocks);
        for node in touched {
            self.refresh_routes(&node);
        }
    }

    /// Recomputes one node's routes and records the difference.
    fn refresh_routes(&mut self, node: &str) {
        let want = match (self.node_ips.get(node), self.blocks.get(node)) {
            (Some(ips), Some(cidrs)) => {
                Some(NodeRoutes { node_name: node.to_string(), node_ips: ips.clone(), cidrs: cidrs.clone() })
            }
            _ => None,
        };
        match want {
            Some(r) if self.routes.get(node).is_some_and(|old| **old == r) => {}
            Some(r) => {
                let r = Arc::new(r);
                self.routes.insert(node.to_string(), r.clone());
                self.record(Change::RoutesApplied(r));
            }
            None => {
                if let Some(old) = self.routes.remove(node) {
                    self.record(Change::RoutesDeleted(old));
                }
            }
        }
    }

    fn record(&mut self, change: Change) {
        if !self.ready {
            return;
        }
        self.revision += 1;
        self.history.push_back(Arc::new(Delta { revision: self.revision, change }));
        while self.history.len() > self.capacity {
            self.history.pop_front();
        }
        self.revision_tx.send_replace(self.revision);
    }

    /// The oldest revision the history still holds (or the next one, when it holds none).
    fn oldest(&self) -> u64 {
        self.history.front().map_or(self.revision + 1, |d| d.revision)
    }

    /// Whether every delta after `cursor` is in the history.
    fn can_resume(&self, cursor: u64) -> bool {
        cursor <= self.revision && cursor + 1 >= self.oldest()
    }

    /// How the stream of `node` that passes `resume_from` begins.
    pub fn start(&self, node: &str, resume_from: &str) -> Result<Start, NotReady> {
        if !self.ready {
            return Err(NotReady);
        }
        if resume_from.is_empty() {
            let (items, cursor) = self.snapshot(node);
            return Ok(Start::Snapshot { reset: false, items, cursor });
        }
        match self.epoch.revision_of(resume_from) {
            Some(cursor) if cursor >= self.resume_floor && self.can_resume(cursor) => Ok(Start::Resume { cursor }),
            _ => {
                let (items, cursor) = self.snapshot(node);
                Ok(Start::Snapshot { reset: true, items, cursor })
            }
        }
    }

    /// The VIFs of `node` (by namespace/name) and every other node's routes, and the revision
    /// they reflect.
    pub fn snapshot(&self, node: &str) -> (Vec<Change>, u64) {
        let mut vifs: Vec<&Arc<Vif>> = self.vifs.values().filter(|v| vif_node(v) == node).collect();
        vifs.sort_by(|a, b| {
            let key = |v: &Vif| v.pod.as_ref().map(|p| (p.namespace.clone(), p.name.clone(), p.uid.clone()));
            key(a).cmp(&key(b))
        });
        let mut items: Vec<Change> = vifs.into_iter().map(|v| Change::VifApplied(v.clone())).collect();
        items.extend(self.routes.values().filter(|r| r.node_name != node).map(|r| Change::RoutesApplied(r.clone())));
        (items, self.revision)
    }

    /// Up to `max` deltas after `cursor`, oldest first (empty when there are none yet).
    pub fn since(&self, cursor: u64, max: usize) -> Result<Vec<Arc<Delta>>, Lagged> {
        if !self.can_resume(cursor) {
            return Err(Lagged(cursor));
        }
        let skip = usize::try_from(cursor + 1 - self.oldest()).unwrap_or(usize::MAX);
        Ok(self.history.iter().skip(skip).take(max).cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_proto::allocator::v1::PodRef;

    use super::*;

    pub(crate) fn vif(uid: &str, node: &str, state: VifState) -> Vif {
        Vif {
            pod: Some(PodRef {
                namespace: "ns".into(),
                name: format!("p-{uid}"),
                uid: uid.into(),
                node_name: node.into(),
            }),
            vif_id: format!("net/{uid}"),
            state: state as i32,
            ..Default::default()
        }
    }

    fn ready() -> VifIndex {
        let mut idx = VifIndex::new(Epoch::fixed("e"), 16);
        idx.set_ready();
        idx
    }

    fn kinds(idx: &VifIndex, cursor: u64) -> Vec<String> {
        idx.since(cursor, usize::MAX)
            .unwrap()
            .iter()
            .map(|d| match &d.change {
                Change::VifApplied(v) => format!("+vif {} {:?}", vif_uid(v), v.state()),
                Change::VifDeleted(v) => format!("-vif {}", vif_uid(v)),
                Change::RoutesApplied(r) => format!("+routes {} {:?} {:?}", r.node_name, r.node_ips, r.cidrs),
                Change::RoutesDeleted(r) => format!("-routes {}", r.node_name),
            })
            .collect()
    }

    #[test]
    fn nothing_is_served_or_recorded_before_recovery() {
        let mut idx = VifIndex::new(Epoch::fixed("e"), 16);
        idx.upsert_vif(vif("a", "n1", VifState::Ready));
        assert_eq!(idx.start("n1", "").unwrap_err(), NotReady);
        idx.set_ready();
        assert_eq!(idx.revision(), 0, "recovered VIFs are in the snapshot, not the history");
        let Ok(Start::Snapshot { reset: false, items, cursor: 0 }) = idx.start("n1", "") else { panic!() };
        assert_eq!(items.len(), 1);
    }

    #[test]
    fn only_real_changes_become_deltas() {
        let mut idx = ready();
        assert!(idx.upsert_vif(vif("a", "n1", VifState::Allocated)));
        assert!(!idx.upsert_vif(vif("a", "n1", VifState::Allocated)), "same VIF again");
        assert!(idx.set_state("a", "net/a", VifState::Ready).is_some());
        assert!(idx.set_state("a", "net/other", VifState::Allocated).is_none(), "another VIF id");
        assert_eq!(idx.set_state("a", "net/a", VifState::Ready).unwrap().state(), VifState::Ready);
        assert!(idx.remove_vif("a").is_some());
        assert!(idx.remove_vif("a").is_none());
        assert_eq!(kinds(&idx, 0), ["+vif a Allocated", "+vif a Ready", "-vif a"]);
    }

    #[test]
    fn routes_need_blocks_and_an_address_and_follow_both() {
        let mut idx = ready();
        idx.set_node_ips("n2", vec!["192.168.0.2".into()]);
        assert_eq!(idx.revision(), 0, "no blocks yet: no routes");
        idx.set_blocks([("n2".to_string(), vec!["10.244.1.0/24".to_string()])].into());
        idx.set_blocks([("n2".to_string(), vec!["10.244.1.0/24".to_string()])].into());
        idx.set_node_ips("n2", vec!["192.168.0.2".into()]);
        idx.set_blocks([("n2".to_string(), vec!["10.244.3.0/24".to_string(), "10.244.1.0/24".to_string()])].into());
        idx.set_node_ips("n2", vec!["192.168.0.22".into()]);
        idx.set_node_ips("n2", vec![]);
        assert_eq!(
            kinds(&idx, 0),
            [
                r#"+routes n2 ["192.168.0.2"] ["10.244.1.0/24"]"#,
                r#"+routes n2 ["192.168.0.2"] ["10.244.1.0/24", "10.244.3.0/24"]"#,
                r#"+routes n2 ["192.168.0.22"] ["10.244.1.0/24", "10.244.3.0/24"]"#,
                "-routes n2",
            ]
        );
    }

    #[test]
    fn a_node_sees_its_vifs_and_the_other_nodes_routes() {
        let mut idx = ready();
        idx.upsert_vif(vif("b", "n1", VifState::Allocated));
        idx.upsert_vif(vif("a", "n1", VifState::Ready));
        idx.upsert_vif(vif("c", "n2", VifState::Allocated));
        for n in ["n1", "n2"] {
            idx.set_node_ips(n, vec![format!("192.168.0.{}", &n[1..])]);
        }
        idx.set_blocks(
            [("n1".to_string(), vec!["10.244.0.0/24".to_string()]), ("n2".to_string(), vec!["10.244.1.0/24".into()])]
                .into(),
        );
        let (items, cursor) = idx.snapshot("n1");
        assert_eq!(cursor, idx.revision());
        let shown: Vec<String> = items
            .iter()
            .map(|c| match c {
                Change::VifApplied(v) => vif_uid(v).to_string(),
                Change::RoutesApplied(r) => format!("routes {}", r.node_name),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(shown, ["a", "b", "routes n2"]);
        let n2_only: Vec<bool> = idx.since(0, 100).unwrap().iter().map(|d| d.change.concerns("n2")).collect();
        // b, a (n1's), c (n2's), routes of n1 (for n2), routes of n2 (not for n2).
        assert_eq!(n2_only, [false, false, true, true, false]);
    }

    #[test]
    fn resume_within_the_history_and_reset_outside_it() {
        let mut idx = VifIndex::new(Epoch::fixed("e"), 3);
        idx.set_ready();
        for i in 0..5 {
            idx.upsert_vif(vif(&format!("p{i}"), "n1", VifState::Allocated));
        }
        assert!(matches!(idx.start("n1", "e-2"), Ok(Start::Resume { cursor: 2 })));
        assert!(matches!(idx.start("n1", "e-5"), Ok(Start::Resume { cursor: 5 })));
        assert_eq!(idx.since(1, 10).unwrap_err(), Lagged(1));
        for bad in ["e-1", "e-6", "other-3", "e-snapshot", "junk"] {
            let Ok(Start::Snapshot { reset, items, cursor }) = idx.start("n1", bad) else { panic!("{bad}") };
            assert!(reset, "{bad}");
            assert_eq!((items.len(), cursor), (5, 5), "{bad}");
        }
        // VIFs dropped without deltas: points from before are not resumable any more.
        assert_eq!(idx.forget_vifs(|v| vif_uid(v) == "p0"), 1);
        assert!(matches!(idx.start("n1", "e-4"), Ok(Start::Snapshot { reset: true, .. })));
        assert!(matches!(idx.start("n1", "e-5"), Ok(Start::Resume { cursor: 5 })));
        assert!(idx.get("p0").is_none() && idx.revision() == 5, "dropped silently");
    }
}
