//! The watch-fed index: the current reduced object per (kind, namespace, name) and a bounded
//! history of the deltas between them — a [`kuryr_stream::Log`] keyed by [`Key`] — plus what the
//! watches need on top: which kinds have listed once, and what a re-list has named so far.
//!
//! Free of kube and tonic: the watch tasks ([`crate::k8s`]) feed it [`Update`]s holding objects
//! already reduced by [`crate::k8s::convert`], and the Subscribe streams ([`crate::grpc`]) read its log
//! through [`kuryr_stream::feed`]. Tests apply updates directly.
//!
//! - A delta is recorded only when the reduced object changed (resourceVersion aside): status
//!   heartbeats, managed-field churn and other fields no consumer reads cause no traffic.
//! - A re-list (initial, or after 410 Gone) is applied as it arrives, and at its end every object
//!   it did not mention is deleted, so a delete missed while disconnected still becomes DELETED.
//! - Nothing is recorded before every kind has finished its first list: nobody can subscribe
//!   before that (Subscribe is UNAVAILABLE), so the first resume point is `<epoch>-0`.
//! - Objects are held behind `Arc`, shared by the index, the history and in-flight snapshots.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use kuryr_proto::watcher::v1::{Kind, Object};
/// Locks a shared index (poison-tolerant: see the function).
pub use kuryr_stream::log::lock;
use kuryr_stream::log::{Delta, Lagged, Log};
use kuryr_stream::{Epoch, Start};
use tokio::sync::watch;

use crate::selector::{KINDS, Selector, slot};

/// Deltas kept for resuming: at about 100 bytes of bookkeeping each plus the objects they share
/// with the index, 16k deltas cost a few MB, and cover minutes of churn in a large cluster.
pub const DEFAULT_HISTORY: usize = kuryr_stream::log::DEFAULT_HISTORY;

/// (the kind's position in [`KINDS`], namespace, name); the namespace is empty for
/// cluster-scoped kinds. Ordered so that snapshots send kinds in the order of [`KINDS`].
pub type Key = (usize, String, String);

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

/// The caches have not finished their first list yet.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("the watcher has not synced with the Kubernetes API yet")]
pub struct NotSynced;

#[derive(Debug, Default)]
struct KindState {
    /// During a (re-)list: the (namespace, name) it has named so far.
    relisting: Option<HashSet<(String, String)>>,
    /// The first list has completed.
    synced: bool,
    /// Objects held.
    len: usize,
}

/// The index. Shared as [`SharedIndex`]; every method is short and never awaits.
#[derive(Debug)]
pub struct Index {
    log: Log<Key, Object>,
    kinds: [KindState; KINDS.len()],
}

impl AsRef<Log<Key, Object>> for Index {
    fn as_ref(&self) -> &Log<Key, Object> {
        &self.log
    }
}

/// The index behind a mutex, as the watch tasks and streams share it.
pub type SharedIndex = Arc<Mutex<Index>>;

fn key(i: usize, obj: &Object) -> Key {
    (i, obj.namespace.clone(), obj.name.clone())
}

impl Index {
    /// An empty index keeping up to `capacity` deltas (at least 1).
    pub fn new(epoch: Epoch, capacity: usize) -> Self {
        Self { log: Log::new(epoch, capacity), kinds: Default::default() }
    }

    /// Wraps the index for sharing.
    pub fn shared(self) -> SharedIndex {
        Arc::new(Mutex::new(self))
    }

    /// Whether every kind has finished its first list.
    pub fn is_synced(&self) -> bool {
        self.log.is_ready()
    }

    /// Observes whether the index has synced.
    pub fn synced(&self) -> watch::Receiver<bool> {
        self.log.readiness()
    }

    /// How many objects of `kind` are held.
    pub fn len(&self, kind: Kind) -> usize {
        slot(kind).map_or(0, |i| self.kinds[i].len)
    }

    /// The object of `kind` named `namespace/name`, if held.
    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Arc<Object>> {
        self.log.get(&(slot(kind)?, namespace.to_string(), name.to_string()))
    }

    /// Applies what a watch of `kind` reported; returns how many deltas were recorded.
    pub fn apply(&mut self, kind: Kind, update: Update) -> usize {
        let Some(i) = slot(kind) else { return 0 };
        let before = self.log.revision();
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
                let all = (i, String::new(), String::new())..(i + 1, String::new(), String::new());
                let gone: Vec<Key> = self
                    .log
                    .range(all)
                    .map(|(k, _)| k)
                    .filter(|(_, ns, name)| !seen.contains(&(ns.clone(), name.clone())))
                    .cloned()
                    .collect();
                for key in gone {
                    self.remove(&key);
                }
                self.kinds[i].synced = true;
                if !self.log.is_ready() && self.kinds.iter().all(|k| k.synced) {
                    self.log.set_ready();
                }
            }
            Update::Applied(obj) => self.upsert(i, obj),
            Update::Deleted(obj) => self.remove(&key(i, &obj)),
        }
        usize::try_from(self.log.revision() - before).unwrap_or(usize::MAX)
    }

    fn upsert(&mut self, i: usize, mut obj: Object) {
        let key = key(i, &obj);
        if let Some(old) = self.log.get(&key) {
            if same_content(&old, &mut obj) {
                return;
            }
            // The name was reused by a new object (the delete was missed, or came after the
            // create in a re-list): consumers keyed by uid must hear that the old one is gone.
            if !old.uid.is_empty() && old.uid != obj.uid {
                self.remove(&key);
            }
        }
        if self.log.get(&key).is_none() {
            self.kinds[i].len += 1;
        }
        self.log.upsert(key, obj);
    }

    fn remove(&mut self, key: &Key) {
        if self.log.remove(key).is_some() {
            self.kinds[key.0].len -= 1;
        }
    }

    /// How a subscription with `selector` that passes `resume_from` begins.
    pub fn start(&self, selector: &Selector, resume_from: &str) -> Result<Start<Key, Object>, NotSynced> {
        self.log.start(resume_from, |_, o| selector.matches(o)).map_err(|_| NotSynced)
    }

    /// Every object `selector` matches, in snapshot order, and the revision they reflect.
    pub fn snapshot(&self, selector: &Selector) -> (Vec<Arc<Object>>, u64) {
        let (items, cursor) = self.log.snapshot(|_, o| selector.matches(o));
        (items.into_iter().map(|(_, o)| o).collect(), cursor)
    }

    /// Up to `max` deltas after `cursor`, oldest first (empty when there are none yet).
    pub fn since(&self, cursor: u64, max: usize) -> Result<Vec<Arc<Delta<Key, Object>>>, Lagged> {
        self.log.since(cursor, max)
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

    /// What happened to an object, for assertions.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Change {
        Applied,
        Deleted,
    }

    fn what(d: &Delta<Key, Object>) -> (Change, &Object) {
        match &d.change {
            kuryr_stream::Change::Applied(o) => (Change::Applied, o),
            kuryr_stream::Change::Deleted(o) => (Change::Deleted, o),
        }
    }

    fn changes(idx: &Index, cursor: u64) -> Vec<(u64, Change, String)> {
        idx.since(cursor, usize::MAX)
            .unwrap()
            .iter()
            .map(|d| {
                let (c, o) = what(d);
                (d.revision, c, o.name.clone())
            })
            .collect()
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
        assert_eq!(idx.as_ref().revision(), 0, "pre-sync changes are in the snapshot, not the history");
        let Ok(Start::Snapshot { reset: false, items, cursor: 0 }) = idx.start(&all, "") else { panic!() };
        assert_eq!(items.iter().map(|(_, o)| o.name.as_str()).collect::<Vec<_>>(), ["early"]);
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
        let revisions = idx.as_ref().revisions();
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
        let (c0, o0) = what(&d[0]);
        let (c1, o1) = what(&d[1]);
        assert_eq!((c0, o0.uid.as_str()), (Change::Deleted, "uid-a"));
        assert_eq!((c1, o1.uid.as_str()), (Change::Applied, "uid-new"));
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
            let Ok(Start::Snapshot { reset, items, cursor }) = idx.start(&pods, bad) else { panic!("{bad}") };
            assert!(reset, "{bad}");
            assert_eq!((items.len(), cursor), (5, 5), "{bad}");
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
