//! The watch-fed index: the current reduced object per (kind, namespace, name), and a bounded
//! history of the deltas between them, numbered by a revision that only grows.
//!
//! Free of kube and tonic: the watch tasks ([`crate::k8s`]) feed it [`Update`]s holding objects
//! already reduced by [`crate::convert`], and the Subscribe streams ([`crate::grpc`]) read it. Tests
//! apply updates directly.
//!
//! - A delta is recorded only when the reduced object changed (resourceVersion aside): status
//!   heartbeats, managed-field churn and other fields no consumer reads cause no traffic.
//! - A re-list (initial, or after 410 Gone) is applied as it arrives, and at its end every object
//!   it did not mention is deleted, so a delete missed while disconnected still becomes DELETED.
//! - Nothing is recorded before every kind has finished its first list: nobody can subscribe
//!   before that (Subscribe is UNAVAILABLE), so the first resume point is `<epoch>-0`.
//! - Objects are held behind `Arc`, shared by the index, the history and in-flight snapshots.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use kuryr_proto::watcher::v1::{Kind, Object};
use kuryr_stream::Epoch;
use tokio::sync::watch;

use crate::selector::{KINDS, Selector, slot};

/// Deltas kept for resuming: at about 100 bytes of bookkeeping each plus the objects they share
/// with the index, 16k deltas cost a few MB, and cover minutes of churn in a large cluster.
pub const DEFAULT_HISTORY: usize = 16_384;

/// (namespace, name); the namespace is empty for cluster-scoped kinds.
type Key = (String, String);

/// What happened to an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Created or changed.
    Applied,
    /// Gone from the API.
    Deleted,
}

/// One recorded change.
#[derive(Debug)]
pub struct Delta {
    /// Its position in this process's history; the first delta is 1.
    pub revision: u64,
    /// Applied or deleted.
    pub change: Change,
    /// The new state, or for a deletion the last state seen.
    pub object: Arc<Object>,
}

/// What a watch reports, with its objects reduced. Mirrors kube-runtime's watcher events.
#[derive(Debug)]
pub enum Update {
    /// A (re-)list begins.
    Restarted,
    /// An object of the list.
    Listed(Object),
    /// The list is complete: what it did not name is gone.
    ListDone,
    /// An object was added or modified.
    Applied(Object),
    /// An object was deleted.
    Deleted(Object),
}

/// How a subscription begins.
#[derive(Debug)]
pub enum Start {
    /// Continue after `cursor`: the history holds every delta since.
    Resume {
        /// The last revision the subscriber handled.
        cursor: u64,
    },
    /// Send `objects`, then SNAPSHOT_COMPLETE at `cursor`, then the deltas after it.
    Snapshot {
        /// The subscriber asked to resume and cannot: send RESET first.
        reset: bool,
        /// The matching objects at `cursor`.
        objects: Vec<Arc<Object>>,
        /// The revision the snapshot reflects.
        cursor: u64,
    },
}

/// The caches have not finished their first list yet.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("the watcher has not synced with the Kubernetes API yet")]
pub struct NotSynced;

/// The history no longer holds the deltas after the cursor.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("revision {0} is no longer in the history")]
pub struct Lagged(pub u64);

#[derive(Debug, Default)]
struct KindIndex {
    objects: BTreeMap<Key, Arc<Object>>,
    /// During a (re-)list: the keys it has named so far.
    relisting: Option<HashSet<Key>>,
    /// The first list has completed.
    synced: bool,
}

/// The index. Shared as [`SharedIndex`]; every method is short and never awaits.
#[derive(Debug)]
pub struct Index {
    epoch: Epoch,
    kinds: [KindIndex; KINDS.len()],
    history: VecDeque<Arc<Delta>>,
    capacity: usize,
    /// The revision of the latest delta (0 before any).
    revision: u64,
    /// Every kind has synced; deltas are recorded from then on.
    recording: bool,
    /// Tells streams a new revision exists; sent under the index lock, so a stream that marks
    /// the value seen before reading the history cannot miss a delta.
    revision_tx: watch::Sender<u64>,
    /// Flips to true once every kind has synced.
    synced_tx: watch::Sender<bool>,
}

/// The index behind a mutex, as the watch tasks and streams share it.
pub type SharedIndex = Arc<Mutex<Index>>;

/// Locks a shared index. A panic while it was held cannot leave it worse than a missed event,
/// which the next re-list repairs, so a poisoned lock is used anyway.
pub fn lock(index: &SharedIndex) -> MutexGuard<'_, Index> {
    index.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Index {
    /// An empty index keeping up to `capacity` deltas (at least 1).
    pub fn new(epoch: Epoch, capacity: usize) -> Self {
        Self {
            epoch,
            kinds: Default::default(),
            history: VecDeque::new(),
            capacity: capacity.max(1),
            revision: 0,
            recording: false,
            revision_tx: watch::Sender::new(0),
            synced_tx: watch::Sender::new(false),
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

    /// Whether every kind has finished its first list.
    pub fn is_synced(&self) -> bool {
        self.recording
    }

    /// Observes the latest revision.
    pub fn revisions(&self) -> watch::Receiver<u64> {
        self.revision_tx.subscribe()
    }

    /// Observes whether the index has synced.
    pub fn synced(&self) -> watch::Receiver<bool> {
        self.synced_tx.subscribe()
    }

    /// How many objects of `kind` are held.
    pub fn len(&self, kind: Kind) -> usize {
        slot(kind).map_or(0, |i| self.kinds[i].objects.len())
    }

    /// The object of `kind` named `namespace/name`, if held.
    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Arc<Object>> {
        let i = slot(kind)?;
        self.kinds[i].objects.get(&(namespace.to_string(), name.to_string())).cloned()
    }

    /// Applies what a watch of `kind` reported; returns how many deltas were recorded.
    pub fn apply(&mut self, kind: Kind, update: Update) -> usize {
        let Some(i) = slot(kind) else { return 0 };
        let before = self.revision;
        match update {
            Update::Restarted => self.kinds[i].relisting = Some(HashSet::new()),
            Update::Listed(obj) => {
                if let Some(seen) = &mut self.kinds[i].relisting {
                    seen.insert((obj.namespace.clone(), obj.name.clone()));
                }
                self.upsert(i, obj);
            }
            Update::ListDone => {
                let seen = self.kinds[i].relisting.take().unwrap_or_default();
                let gone: Vec<Key> = self.kinds[i].objects.keys().filter(|k| !seen.contains(*k)).cloned().collect();
                for key in gone {
                    if let Some(old) = self.kinds[i].objects.remove(&key) {
                        self.record(Change::Deleted, old);
                    }
                }
                self.kinds[i].synced = true;
                if !self.recording && self.kinds.iter().all(|k| k.synced) {
                    self.recording = true;
                    self.synced_tx.send_replace(true);
                }
            }
            Update::Applied(obj) => self.upsert(i, obj),
            Update::Deleted(obj) => {
                let key = (obj.namespace.clone(), obj.name.clone());
                if self.kinds[i].objects.remove(&key).is_some() {
                    self.record(Change::Deleted, Arc::new(obj));
                }
            }
        }
        (self.revision - before) as usize
    }

    fn upsert(&mut self, i: usize, mut obj: Object) {
        let key = (obj.namespace.clone(), obj.name.clone());
        if let Some(old) = self.kinds[i].objects.get(&key) {
            if same_content(old, &mut obj) {
                return;
            }
            // The name was reused by a new object (the delete was missed, or came after the
            // create in a re-list): consumers keyed by uid must hear that the old one is gone.
            if !old.uid.is_empty() && old.uid != obj.uid {
                let old = old.clone();
                self.record(Change::Deleted, old);
            }
        }
        let obj = Arc::new(obj);
        self.kinds[i].objects.insert(key, obj.clone());
        self.record(Change::Applied, obj);
    }

    fn record(&mut self, change: Change, object: Arc<Object>) {
        if !self.recording {
            return;
        }
        self.revision += 1;
        self.history.push_back(Arc::new(Delta { revision: self.revision, change, object }));
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

    /// How a subscription with `selector` that passes `resume_from` begins.
    pub fn start(&self, selector: &Selector, resume_from: &str) -> Result<Start, NotSynced> {
        if !self.recording {
            return Err(NotSynced);
        }
        if resume_from.is_empty() {
            let (objects, cursor) = self.snapshot(selector);
            return Ok(Start::Snapshot { reset: false, objects, cursor });
        }
        match self.epoch.revision_of(resume_from) {
            Some(cursor) if self.can_resume(cursor) => Ok(Start::Resume { cursor }),
            _ => {
                let (objects, cursor) = self.snapshot(selector);
                Ok(Start::Snapshot { reset: true, objects, cursor })
            }
        }
    }

    /// Every object `selector` matches, in snapshot order, and the revision they reflect.
    pub fn snapshot(&self, selector: &Selector) -> (Vec<Arc<Object>>, u64) {
        let mut objects = Vec::new();
        for kind in selector.kinds() {
            if let Some(i) = slot(kind) {
                objects.extend(self.kinds[i].objects.values().filter(|o| selector.matches(o)).cloned());
            }
        }
        (objects, self.revision)
    }

    /// Up to `max` deltas after `cursor`, oldest first (empty when there are none yet).
    pub fn since(&self, cursor: u64, max: usize) -> Result<Vec<Arc<Delta>>, Lagged> {
        if !self.can_resume(cursor) {
            return Err(Lagged(cursor));
        }
        let skip = (cursor + 1 - self.oldest()) as usize;
        Ok(self.history.iter().skip(skip).take(max).cloned().collect())
    }
}

/// Whether `new` carries the same content as `old`, resourceVersion aside.
fn same_content(old: &Object, new: &mut Object) -> bool {
    if old.uid != new.uid {
        return false;
    }
    let rv = std::mem::replace(&mut new.resource_version, old.resource_version.clone());
    let same = *old == *new;
    new.resource_version = rv;
    same
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_proto::watcher::v1::object::Body;
    use kuryr_proto::watcher::v1::{Node, Pod};

    use super::*;

    pub(crate) fn pod(name: &str, node: &str, rv: &str) -> Object {
        Object {
            kind: Kind::Pod as i32,
            namespace: "ns".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            resource_version: rv.into(),
            body: Some(Body::Pod(Pod { node_name: node.into(), phase: "Pending".into(), ..Default::default() })),
            ..Default::default()
        }
    }

    fn node(name: &str, ready: bool, rv: &str) -> Object {
        Object {
            kind: Kind::Node as i32,
            name: name.into(),
            uid: format!("uid-{name}"),
            resource_version: rv.into(),
            body: Some(Body::Node(Node { ready, ..Default::default() })),
            ..Default::default()
        }
    }

    /// An index whose every kind has listed what `initial` holds of it.
    pub(crate) fn synced(capacity: usize, initial: Vec<Object>) -> Index {
        let mut idx = Index::new(Epoch::fixed("e"), capacity);
        for kind in KINDS {
            idx.apply(kind, Update::Restarted);
            for o in initial.iter().filter(|o| o.kind == kind as i32) {
                idx.apply(kind, Update::Listed(o.clone()));
            }
            idx.apply(kind, Update::ListDone);
        }
        idx
    }

    fn changes(idx: &Index, cursor: u64) -> Vec<(u64, Change, String)> {
        idx.since(cursor, usize::MAX).unwrap().iter().map(|d| (d.revision, d.change, d.object.name.clone())).collect()
    }

    #[test]
    fn nothing_is_served_or_recorded_before_every_kind_synced() {
        let mut idx = Index::new(Epoch::fixed("e"), 16);
        let synced = idx.synced();
        let all = Selector::new(KINDS);
        for kind in &KINDS[..KINDS.len() - 1] {
            idx.apply(*kind, Update::Restarted);
            idx.apply(*kind, Update::ListDone);
        }
        assert_eq!(idx.apply(Kind::Pod, Update::Applied(pod("early", "n1", "1"))), 0);
        assert!(matches!(idx.start(&all, ""), Err(NotSynced)));
        assert!(!*synced.borrow());
        idx.apply(Kind::NetworkPolicy, Update::Restarted);
        idx.apply(Kind::NetworkPolicy, Update::ListDone);
        assert!(*synced.borrow());
        assert_eq!(idx.revision(), 0, "pre-sync changes are in the snapshot, not the history");
        let Ok(Start::Snapshot { reset: false, objects, cursor: 0 }) = idx.start(&all, "") else { panic!() };
        assert_eq!(objects.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(), ["early"]);
    }

    #[test]
    fn only_real_changes_become_deltas() {
        let mut idx = synced(16, vec![]);
        assert_eq!(idx.apply(Kind::Node, Update::Applied(node("n1", true, "1"))), 1, "created");
        // A heartbeat: new resourceVersion, same reduced object.
        assert_eq!(idx.apply(Kind::Node, Update::Applied(node("n1", true, "2"))), 0);
        assert_eq!(idx.get(Kind::Node, "", "n1").unwrap().resource_version, "1", "kept as last sent");
        assert_eq!(idx.apply(Kind::Node, Update::Applied(node("n1", false, "3"))), 1);
        assert_eq!(idx.get(Kind::Node, "", "n1").unwrap().resource_version, "3");
        // Deleting what is not there records nothing; deleting what is, does.
        assert_eq!(idx.apply(Kind::Node, Update::Deleted(node("n2", false, "4"))), 0);
        assert_eq!(idx.apply(Kind::Node, Update::Deleted(node("n1", false, "5"))), 1);
        assert_eq!(
            changes(&idx, 0),
            [(1, Change::Applied, "n1".into()), (2, Change::Applied, "n1".into()), (3, Change::Deleted, "n1".into())]
        );
        assert_eq!(idx.len(Kind::Node), 0);
    }

    #[test]
    fn a_relist_deletes_what_it_no_longer_names() {
        let mut idx = synced(16, vec![pod("a", "n1", "1"), pod("b", "n1", "2")]);
        let revisions = idx.revisions();
        // After 410 Gone: a is unchanged, b vanished while disconnected, c is new.
        idx.apply(Kind::Pod, Update::Restarted);
        idx.apply(Kind::Pod, Update::Listed(pod("a", "n1", "9")));
        idx.apply(Kind::Pod, Update::Listed(pod("c", "n2", "9")));
        idx.apply(Kind::Pod, Update::ListDone);
        assert_eq!(changes(&idx, 0), [(1, Change::Applied, "c".into()), (2, Change::Deleted, "b".into())]);
        assert_eq!(*revisions.borrow(), 2);
        assert_eq!(idx.len(Kind::Pod), 2);
    }

    #[test]
    fn a_reused_name_deletes_the_old_object_first() {
        let mut idx = synced(16, vec![pod("a", "n1", "1")]);
        let mut again = pod("a", "n1", "5");
        again.uid = "uid-new".into();
        assert_eq!(idx.apply(Kind::Pod, Update::Applied(again)), 2);
        let d = idx.since(0, 10).unwrap();
        assert_eq!((d[0].change, d[0].object.uid.as_str()), (Change::Deleted, "uid-a"));
        assert_eq!((d[1].change, d[1].object.uid.as_str()), (Change::Applied, "uid-new"));
    }

    #[test]
    fn resume_within_the_history_and_reset_outside_it() {
        let mut idx = synced(3, vec![]);
        let pods = Selector::new([Kind::Pod]);
        for (i, rv) in ["1", "2", "3", "4", "5"].iter().enumerate() {
            idx.apply(Kind::Pod, Update::Applied(pod(&format!("p{i}"), "n1", rv)));
        }
        // Revisions 3, 4, 5 are kept: resuming after 2..=5 works, after 1 does not.
        assert!(matches!(idx.start(&pods, "e-2"), Ok(Start::Resume { cursor: 2 })));
        assert!(matches!(idx.start(&pods, "e-5"), Ok(Start::Resume { cursor: 5 })));
        assert_eq!(changes(&idx, 2).len(), 3);
        assert!(idx.since(5, 10).unwrap().is_empty());
        assert_eq!(idx.since(1, 10).unwrap_err(), Lagged(1));
        for bad in ["e-1", "e-6", "other-3", "e-snapshot", "junk"] {
            let Ok(Start::Snapshot { reset, objects, cursor }) = idx.start(&pods, bad) else { panic!("{bad}") };
            assert!(reset, "{bad}");
            assert_eq!((objects.len(), cursor), (5, 5), "{bad}");
        }
        assert!(matches!(idx.start(&pods, ""), Ok(Start::Snapshot { reset: false, .. })));
    }

    #[test]
    fn snapshots_follow_the_selector() {
        let idx = synced(16, vec![pod("a", "n1", "1"), pod("b", "n2", "1")]);
        let mut s = Selector::new([Kind::Pod, Kind::Node]);
        s.node_name = Some("n2".into());
        let (objects, _) = idx.snapshot(&s);
        assert_eq!(objects.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(), ["b"]);
    }
}
