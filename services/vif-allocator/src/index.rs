//! The VIF index: every VIF handed out (by pod uid) and every node's routes, in a
//! [`kuryr_stream::Log`] whose history `WatchVifs` streams read ([`crate::grpc`], with the shared
//! core of [`kuryr_stream::feed`]), plus what the routes are derived from.
//!
//! Free of kube, tonic and protobuf: it holds the domain's [`Vif`]s and [`NodeRoutes`]; the
//! controller and the recovery feed it, the gRPC streams read it (and encode at their edge,
//! [`crate::grpc::convert`]), and tests apply changes directly.
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
//! - VIFs whose shard moved to another replica are dropped without deltas
//!   ([`VifIndex::forget_vifs`]); resume points from before that are refused.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::core::{NodeRoutes, Vif, VifState};
/// Locks a shared index (poison-tolerant: see the function).
pub use kuryr_stream::log::lock;
use kuryr_stream::log::{Delta, Lagged, Log};
use kuryr_stream::{Epoch, NotReady, Start};

/// Deltas kept for resuming: a binder that reconnects within this many changes gets only what
/// it missed. A delta is a few hundred bytes shared with the index, so 16k cost a few MB.
pub const DEFAULT_HISTORY: usize = kuryr_stream::log::DEFAULT_HISTORY;

/// What the log holds a value for. Ordered so that snapshots send a node's VIFs before the
/// other nodes' routes.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Key {
    /// A VIF, by its pod's uid.
    Vif(String),
    /// A node's routes, by node name.
    Routes(String),
}

/// A value of the log (behind `Arc`s of their own, so that lookups hand them out cheaply).
#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    /// A pod's VIF.
    Vif(Arc<Vif>),
    /// A node's pod address blocks and the addresses to reach them through.
    Routes(Arc<NodeRoutes>),
}

impl Item {
    /// Whether the stream of `node` carries it: its own VIFs, every other node's routes.
    pub fn concerns(&self, node: &str) -> bool {
        match self {
            Item::Vif(v) => vif_node(v) == node,
            Item::Routes(r) => r.node_name != node,
        }
    }
}

/// One change, as streamed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Change<'a> {
    /// A VIF was handed out or changed state.
    VifApplied(&'a Vif),
    /// A VIF was released: its pod is gone (or finished).
    VifDeleted(&'a Vif),
    /// A node's routes appeared or changed.
    RoutesApplied(&'a NodeRoutes),
    /// A node no longer has routes.
    RoutesDeleted(&'a NodeRoutes),
}

impl<'a> Change<'a> {
    /// The change a log entry records.
    pub fn of(change: &'a kuryr_stream::Change<Item>) -> Self {
        match change {
            kuryr_stream::Change::Applied(i) => Self::applied(i),
            kuryr_stream::Change::Deleted(i) => Self::deleted(i),
        }
    }

    /// `item` is new or changed.
    pub fn applied(item: &'a Item) -> Self {
        match item {
            Item::Vif(v) => Change::VifApplied(v.as_ref()),
            Item::Routes(r) => Change::RoutesApplied(r.as_ref()),
        }
    }

    /// `item` is gone.
    pub fn deleted(item: &'a Item) -> Self {
        match item {
            Item::Vif(v) => Change::VifDeleted(v.as_ref()),
            Item::Routes(r) => Change::RoutesDeleted(r.as_ref()),
        }
    }
}

/// The index. Shared as [`SharedIndex`]; every method is short and never awaits.
#[derive(Debug)]
pub struct VifIndex {
    log: Log<Key, Item>,
    /// VIFs held.
    vifs: usize,
    /// InternalIPs by node, from the watcher's Node objects (sorted).
    node_ips: BTreeMap<String, Vec<String>>,
    /// Address blocks by owning node, from the IPAM (sorted).
    blocks: BTreeMap<String, Vec<String>>,
}

impl AsRef<Log<Key, Item>> for VifIndex {
    fn as_ref(&self) -> &Log<Key, Item> {
        &self.log
    }
}

/// The index behind a mutex, as the controller, recovery and streams share it.
pub type SharedIndex = Arc<Mutex<VifIndex>>;

/// The node a VIF is on.
pub fn vif_node(v: &Vif) -> &str {
    &v.node
}

/// The pod uid a VIF belongs to.
pub fn vif_uid(v: &Vif) -> &str {
    &v.pod.uid
}

impl VifIndex {
    /// An empty index keeping up to `capacity` deltas (at least 1).
    pub fn new(epoch: Epoch, capacity: usize) -> Self {
        Self { log: Log::new(epoch, capacity), vifs: 0, node_ips: BTreeMap::new(), blocks: BTreeMap::new() }
    }

    /// Wraps the index for sharing.
    pub fn shared(self) -> SharedIndex {
        Arc::new(Mutex::new(self))
    }

    /// Whether recovery has finished and streams are served.
    pub fn is_ready(&self) -> bool {
        self.log.is_ready()
    }

    /// Recovery has finished: serve streams and record deltas from now on.
    pub fn set_ready(&mut self) {
        self.log.set_ready();
    }

    /// How many VIFs are held.
    pub fn len(&self) -> usize {
        self.vifs
    }

    /// Whether no VIF is held.
    pub fn is_empty(&self) -> bool {
        self.vifs == 0
    }

    /// The VIF of a pod.
    pub fn get(&self, pod_uid: &str) -> Option<Arc<Vif>> {
        match self.log.get(&Key::Vif(pod_uid.to_string())).as_deref() {
            Some(Item::Vif(v)) => Some(v.clone()),
            _ => None,
        }
    }

    /// Every VIF held.
    pub fn vifs(&self) -> Vec<Arc<Vif>> {
        self.log
            .iter()
            .filter_map(|(_, i)| match i.as_ref() {
                Item::Vif(v) => Some(v.clone()),
                Item::Routes(_) => None,
            })
            .collect()
    }

    /// The routes currently published for `node`.
    pub fn routes(&self, node: &str) -> Option<Arc<NodeRoutes>> {
        match self.log.get(&Key::Routes(node.to_string())).as_deref() {
            Some(Item::Routes(r)) => Some(r.clone()),
            _ => None,
        }
    }

    /// Adds or replaces a VIF (keyed by its pod's uid); returns whether anything changed.
    pub fn upsert_vif(&mut self, vif: Vif) -> bool {
        let uid = vif_uid(&vif).to_string();
        if uid.is_empty() {
            return false;
        }
        let key = Key::Vif(uid);
        match self.log.get(&key).as_deref() {
            Some(Item::Vif(old)) if **old == vif => return false,
            // Never expected (a pod's node is fixed), but the old node's binder must hear of it.
            Some(Item::Vif(old)) if vif_node(old) != vif_node(&vif) => {
                self.log.remove(&key);
                self.vifs -= 1;
            }
            _ => {}
        }
        if self.log.get(&key).is_none() {
            self.vifs += 1;
        }
        self.log.upsert(key, Item::Vif(Arc::new(vif)))
    }

    /// Changes the state of a pod's VIF if it is still `vif_id`; returns the VIF after.
    pub fn set_state(&mut self, pod_uid: &str, vif_id: &str, state: VifState) -> Option<Arc<Vif>> {
        let old = self.get(pod_uid)?;
        if old.vif_id() != vif_id {
            return None;
        }
        if old.state == state {
            return Some(old);
        }
        let mut vif = Vif::clone(&old);
        vif.state = state;
        self.upsert_vif(vif);
        self.get(pod_uid)
    }

    /// Removes a pod's VIF, streaming VIF_DELETED; returns it.
    pub fn remove_vif(&mut self, pod_uid: &str) -> Option<Arc<Vif>> {
        match self.log.remove(&Key::Vif(pod_uid.to_string())).as_deref() {
            Some(Item::Vif(v)) => {
                self.vifs -= 1;
                Some(v.clone())
            }
            _ => None,
        }
    }

    /// Drops the VIFs `which` selects without streaming anything: their nodes' streams are ended
    /// and served by another replica from now on (their shard moved). Binders resuming from
    /// before this get RESET and a snapshot. Returns how many were dropped.
    pub fn forget_vifs(&mut self, which: impl Fn(&Vif) -> bool) -> usize {
        let dropped = self.log.forget(|_, i| matches!(i, Item::Vif(v) if which(v)));
        self.vifs -= dropped;
        dropped
    }

    /// Sets a node's InternalIPs (empty: unknown, or the Node is gone).
    /// The InternalIPs of every node, as the watcher sent them.
    pub fn node_ips(&self) -> &BTreeMap<String, Vec<String>> {
        &self.node_ips
    }

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

    /// Recomputes one node's routes; the log records the difference.
    fn refresh_routes(&mut self, node: &str) {
        let key = Key::Routes(node.to_string());
        match (self.node_ips.get(node), self.blocks.get(node)) {
            (Some(ips), Some(cidrs)) => {
                let r = NodeRoutes { node_name: node.to_string(), node_ips: ips.clone(), cidrs: cidrs.clone() };
                self.log.upsert(key, Item::Routes(Arc::new(r)));
            }
            _ => {
                self.log.remove(&key);
            }
        }
    }

    /// How the stream of `node` that passes `resume_from` begins.
    pub fn start(&self, node: &str, resume_from: &str) -> Result<Start<Key, Item>, NotReady> {
        self.log.start(resume_from, |_, i| i.concerns(node))
    }

    /// The VIFs of `node` and every other node's routes, and the revision they reflect.
    pub fn snapshot(&self, node: &str) -> (Vec<(Key, Arc<Item>)>, u64) {
        self.log.snapshot(|_, i| i.concerns(node))
    }

    /// Up to `max` deltas after `cursor`, oldest first (empty when there are none yet).
    pub fn since(&self, cursor: u64, max: usize) -> Result<Vec<Arc<Delta<Key, Item>>>, Lagged> {
        self.log.since(cursor, max)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::core::{PodKey, VifRecord};

    pub(crate) fn vif(uid: &str, node: &str, state: VifState) -> Vif {
        let record = VifRecord { vif_id: format!("net/{uid}"), ..VifRecord::default() };
        Vif::recorded(&PodKey::new("ns", format!("p-{uid}"), uid), node, "net", record, state)
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
            .map(|d| match Change::of(&d.change) {
                Change::VifApplied(v) => format!("+vif {} {:?}", vif_uid(v), v.state),
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
        assert!(idx.start("n1", "").is_err());
        idx.set_ready();
        assert_eq!(idx.as_ref().revision(), 0, "recovered VIFs are in the snapshot, not the history");
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
        assert_eq!(idx.set_state("a", "net/a", VifState::Ready).unwrap().state, VifState::Ready);
        assert!(idx.remove_vif("a").is_some());
        assert!(idx.remove_vif("a").is_none());
        assert_eq!(kinds(&idx, 0), ["+vif a Allocated", "+vif a Ready", "-vif a"]);
    }

    #[test]
    fn routes_need_blocks_and_an_address_and_follow_both() {
        let mut idx = ready();
        idx.set_node_ips("n2", vec!["192.168.0.2".into()]);
        assert_eq!(idx.as_ref().revision(), 0, "no blocks yet: no routes");
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
        assert_eq!(cursor, idx.as_ref().revision());
        let shown: Vec<String> = items
            .iter()
            .map(|(_, i)| match i.as_ref() {
                Item::Vif(v) => vif_uid(v).to_string(),
                Item::Routes(r) => format!("routes {}", r.node_name),
            })
            .collect();
        assert_eq!(shown, ["a", "b", "routes n2"]);
        let n2_only: Vec<bool> = idx.since(0, 100).unwrap().iter().map(|d| d.change.value().concerns("n2")).collect();
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
        assert!(idx.get("p0").is_none() && idx.as_ref().revision() == 5, "dropped silently");
    }
}
