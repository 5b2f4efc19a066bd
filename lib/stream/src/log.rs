//! Keyed state and its history.
//!
//! The log holds the current value per key and a bounded history of the changes between them,
//! numbered by a revision that only grows. Streams read the history by revision (see
//! [`crate::feed`]): it is the one ordered log, so between snapshot and live nothing is lost or
//! duplicated (a snapshot and its cursor are taken under one lock).
//!
//! - A change is recorded only when the value differs from the one held: re-publishing the same
//!   value costs subscribers nothing.
//! - Nothing is recorded before [`Log::set_ready`]: nobody can subscribe before that
//!   ([`NotReady`]), so state loaded at start-up is part of the first snapshot, not a delta, and
//!   the first resume point is `<epoch>-0`.
//! - Values are held behind `Arc`, shared by the state, the history and in-flight snapshots.
//! - Values can also be dropped without a delta ([`Log::forget`], when another replica serves
//!   them from now on); resume points from before that are refused, so nobody resumes across
//!   the gap.
//!
//! The log is usually shared as [`SharedLog`]; a service whose index holds more than the log
//! (derived state, per-kind bookkeeping) keeps it inside that index, behind the index's own lock,
//! and streams it through [`LogHandle`].

use std::collections::{BTreeMap, VecDeque};
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::watch;

use crate::epoch::Epoch;

/// Deltas kept for resuming, when a service has no better figure: a delta is a few dozen bytes
/// of bookkeeping plus a value shared with the state, so 16k deltas cost a few MB and cover
/// minutes of churn.
pub const DEFAULT_HISTORY: usize = 16_384;

/// What happened to a key.
#[derive(Debug, PartialEq)]
pub enum Change<V> {
    /// The key's value was created or changed: the new value.
    Applied(Arc<V>),
    /// The key is gone: its last value.
    Deleted(Arc<V>),
}

impl<V> Change<V> {
    /// The value carried.
    pub fn value(&self) -> &Arc<V> {
        match self {
            Change::Applied(v) | Change::Deleted(v) => v,
        }
    }
}

impl<V> Clone for Change<V> {
    fn clone(&self) -> Self {
        match self {
            Change::Applied(v) => Change::Applied(v.clone()),
            Change::Deleted(v) => Change::Deleted(v.clone()),
        }
    }
}

/// One recorded change.
#[derive(Debug)]
pub struct Delta<K, V> {
    /// Its position in this process's history; the first delta is 1.
    pub revision: u64,
    /// The key that changed.
    pub key: K,
    /// What happened.
    pub change: Change<V>,
}

/// How a subscription begins.
#[derive(Debug)]
pub enum Start<K, V> {
    /// Continue after `cursor`: the history holds every delta since.
    Resume {
        /// The last revision the subscriber handled.
        cursor: u64,
    },
    /// Send `items`, then SNAPSHOT_COMPLETE at `cursor`, then the deltas after it.
    Snapshot {
        /// The subscriber asked to resume and cannot: send RESET first.
        reset: bool,
        /// The wanted items at `cursor`, in key order.
        items: Vec<(K, Arc<V>)>,
        /// The revision the snapshot reflects.
        cursor: u64,
    },
}

/// The log is not serving yet (its owner has not loaded its state).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("the state is not loaded yet")]
pub struct NotReady;

/// The history no longer holds the deltas after the cursor.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("revision {0} is no longer in the history")]
pub struct Lagged(pub u64);

/// The log. Shared as [`SharedLog`]; every method is short and never awaits.
#[derive(Debug)]
pub struct Log<K, V> {
    epoch: Epoch,
    items: BTreeMap<K, Arc<V>>,
    history: VecDeque<Arc<Delta<K, V>>>,
    capacity: usize,
    /// The revision of the latest delta (0 before any).
    revision: u64,
    /// Resume points before this revision are refused: values were dropped without deltas then.
    resume_floor: u64,
    ready: bool,
    /// Tells streams a new revision exists; sent under the lock, so a stream that marks the
    /// value seen before reading the history cannot miss a delta.
    revision_tx: watch::Sender<u64>,
    /// Flips to true at [`Log::set_ready`].
    ready_tx: watch::Sender<bool>,
}

/// The log behind a mutex, as its writers and the streams share it.
pub type SharedLog<K, V> = Arc<Mutex<Log<K, V>>>;

/// Locks a shared log, or a service's index that keeps its log: plain collections updated
/// without awaiting, so a panic while the lock was held cannot leave them inconsistent (at worst
/// stale, until the next reconcile or re-list repairs them); a poisoned lock is used anyway.
pub fn lock<T>(shared: &Mutex<T>) -> MutexGuard<'_, T> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where streams read a log from: a [`SharedLog`], or an index that keeps its log behind its
/// own lock (anything `Arc<Mutex<T>>` whose `T` is `AsRef<Log>`).
pub trait LogHandle<K, V>: Clone + Send + Sync + 'static {
    /// Runs `f` on the log under its lock. `f` must be short and never block.
    fn with_log<R>(&self, f: impl FnOnce(&Log<K, V>) -> R) -> R;
}

impl<K, V, T> LogHandle<K, V> for Arc<Mutex<T>>
where
    T: AsRef<Log<K, V>> + Send + 'static,
{
    fn with_log<R>(&self, f: impl FnOnce(&Log<K, V>) -> R) -> R {
        // As in [`lock`]: the state is plain collections updated without awaiting.
        f(self.lock().unwrap_or_else(PoisonError::into_inner).as_ref())
    }
}

impl<K, V> AsRef<Log<K, V>> for Log<K, V> {
    fn as_ref(&self) -> &Log<K, V> {
        self
    }
}

impl<K: Ord + Clone, V: PartialEq> Log<K, V> {
    /// An empty log keeping up to `capacity` deltas (at least 1).
    pub fn new(epoch: Epoch, capacity: usize) -> Self {
        Self {
            epoch,
            items: BTreeMap::new(),
            history: VecDeque::new(),
            capacity: capacity.max(1),
            revision: 0,
            resume_floor: 0,
            ready: false,
            revision_tx: watch::Sender::new(0),
            ready_tx: watch::Sender::new(false),
        }
    }

    /// Wraps the log for sharing.
    pub fn shared(self) -> SharedLog<K, V> {
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

    /// Observes readiness.
    pub fn readiness(&self) -> watch::Receiver<bool> {
        self.ready_tx.subscribe()
    }

    /// Whether subscriptions are served.
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// The state is loaded: serve subscriptions and record deltas from now on.
    pub fn set_ready(&mut self) {
        self.ready = true;
        self.ready_tx.send_replace(true);
    }

    /// How many keys are held.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The value of `key`.
    pub fn get(&self, key: &K) -> Option<Arc<V>> {
        self.items.get(key).cloned()
    }

    /// Every key and value, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &Arc<V>)> {
        self.items.iter()
    }

    /// The keys and values in `range`, in key order.
    pub fn range<R: RangeBounds<K>>(&self, range: R) -> impl Iterator<Item = (&K, &Arc<V>)> {
        self.items.range(range)
    }

    /// Sets the value of `key`; returns whether anything changed (and was recorded).
    pub fn upsert(&mut self, key: K, value: V) -> bool {
        if self.items.get(&key).is_some_and(|old| **old == value) {
            return false;
        }
        let value = Arc::new(value);
        self.items.insert(key.clone(), value.clone());
        self.record(key, Change::Applied(value));
        true
    }

    /// Removes `key`, recording its deletion; returns its last value.
    pub fn remove(&mut self, key: &K) -> Option<Arc<V>> {
        let old = self.items.remove(key)?;
        self.record(key.clone(), Change::Deleted(old.clone()));
        Some(old)
    }

    /// Drops the values `which` selects without recording anything: their subscribers are served
    /// elsewhere from now on (their shard moved to another replica). Resume points from before
    /// are refused from now on (RESET and a snapshot), since the history after them does not
    /// tell everything. Returns how many were dropped.
    pub fn forget(&mut self, which: impl Fn(&K, &V) -> bool) -> usize {
        let before = self.items.len();
        self.items.retain(|k, v| !which(k, v));
        let dropped = before - self.items.len();
        if dropped > 0 {
            self.resume_floor = self.revision;
        }
        dropped
    }

    fn record(&mut self, key: K, change: Change<V>) {
        if !self.ready {
            return;
        }
        self.revision += 1;
        self.history.push_back(Arc::new(Delta { revision: self.revision, key, change }));
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
    pub fn can_resume(&self, cursor: u64) -> bool {
        cursor <= self.revision && cursor + 1 >= self.oldest()
    }

    /// How a subscription that passes `resume_from` and wants what `wants` accepts begins.
    pub fn start(&self, resume_from: &str, wants: impl Fn(&K, &V) -> bool) -> Result<Start<K, V>, NotReady> {
        if !self.ready {
            return Err(NotReady);
        }
        if resume_from.is_empty() {
            let (items, cursor) = self.snapshot(wants);
            return Ok(Start::Snapshot { reset: false, items, cursor });
        }
        match self.epoch.revision_of(resume_from) {
            Some(cursor) if cursor >= self.resume_floor && self.can_resume(cursor) => Ok(Start::Resume { cursor }),
            _ => {
                let (items, cursor) = self.snapshot(wants);
                Ok(Start::Snapshot { reset: true, items, cursor })
            }
        }
    }

    /// Every item `wants` accepts, in key order, and the revision they reflect.
    pub fn snapshot(&self, wants: impl Fn(&K, &V) -> bool) -> (Vec<(K, Arc<V>)>, u64) {
        let items = self.items.iter().filter(|(k, v)| wants(k, v)).map(|(k, v)| (k.clone(), v.clone())).collect();
        (items, self.revision)
    }

    /// Up to `max` deltas after `cursor`, oldest first (empty when there are none yet).
    pub fn since(&self, cursor: u64, max: usize) -> Result<Vec<Arc<Delta<K, V>>>, Lagged> {
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

    use super::*;

    fn ready(capacity: usize) -> Log<String, u32> {
        let mut log = Log::new(Epoch::fixed("e"), capacity);
        log.set_ready();
        log
    }

    fn shown(deltas: &[Arc<Delta<String, u32>>]) -> Vec<String> {
        deltas
            .iter()
            .map(|d| match &d.change {
                Change::Applied(v) => format!("{} {}={v}", d.revision, d.key),
                Change::Deleted(v) => format!("{} -{}({v})", d.revision, d.key),
            })
            .collect()
    }

    #[test]
    fn only_real_changes_are_recorded_in_order() {
        let mut log = ready(16);
        assert!(log.upsert("a".into(), 1));
        assert!(!log.upsert("a".into(), 1), "same value: no delta");
        assert!(log.upsert("b".into(), 2));
        assert!(log.upsert("a".into(), 3));
        assert_eq!(log.remove(&"b".into()).as_deref(), Some(&2));
        assert_eq!(log.remove(&"b".into()), None, "removing twice records nothing");
        assert_eq!(log.revision(), 4);
        assert_eq!(shown(&log.since(0, 100).unwrap()), ["1 a=1", "2 b=2", "3 a=3", "4 -b(2)"]);
        assert_eq!(shown(&log.since(2, 1).unwrap()), ["3 a=3"], "at most max, after the cursor");
        assert!(log.since(4, 10).unwrap().is_empty());
        assert_eq!(log.get(&"a".into()).as_deref(), Some(&3));
        assert_eq!(log.len(), 1);
    }

    #[test]
    fn state_loaded_before_ready_is_snapshot_not_history() {
        let mut log: Log<String, u32> = Log::new(Epoch::fixed("e"), 16);
        log.upsert("x".into(), 1);
        assert_eq!(log.start("", |_, _| true).unwrap_err(), NotReady);
        let mut ready_rx = log.readiness();
        log.set_ready();
        assert!(*ready_rx.borrow_and_update());
        assert_eq!(log.revision(), 0);
        let Ok(Start::Snapshot { reset: false, items, cursor: 0 }) = log.start("", |_, _| true) else { panic!() };
        assert_eq!(items, [("x".to_string(), Arc::new(1))]);
    }

    #[test]
    fn snapshots_are_filtered_and_in_key_order() {
        let mut log = ready(16);
        for (k, v) in [("c", 3), ("a", 1), ("b", 2), ("d", 4)] {
            log.upsert(k.into(), v);
        }
        let (items, cursor) = log.snapshot(|_, v| v.is_multiple_of(2));
        let keys: Vec<&str> = items.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!((keys, cursor), (vec!["b", "d"], 4));
    }

    #[test]
    fn resume_within_the_history_and_reset_outside_it() {
        let mut log = ready(3);
        for i in 0..5 {
            log.upsert(format!("k{i}"), i);
        }
        // The history holds revisions 3..=5: a cursor of 2 still has everything after it.
        assert!(matches!(log.start("e-2", |_, _| true), Ok(Start::Resume { cursor: 2 })));
        assert!(matches!(log.start("e-5", |_, _| true), Ok(Start::Resume { cursor: 5 })));
        assert_eq!(log.since(1, 10).unwrap_err(), Lagged(1));
        for bad in ["e-1", "e-6", "other-3", "e-snapshot", "junk"] {
            let Ok(Start::Snapshot { reset, items, cursor }) = log.start(bad, |_, _| true) else { panic!("{bad}") };
            assert!(reset, "{bad}");
            assert_eq!((items.len(), cursor), (5, 5), "{bad}");
        }
    }

    #[test]
    fn forgotten_values_leave_no_delta_and_no_resume_across_the_gap() {
        let mut log = ready(16);
        for (k, v) in [("a", 1), ("b", 2), ("c", 3)] {
            log.upsert(k.into(), v);
        }
        assert_eq!(log.forget(|_, v| *v >= 2), 2);
        assert_eq!((log.revision(), log.len()), (3, 1), "dropped silently");
        assert_eq!(log.range("a".to_string()..).count(), 1);
        assert!(matches!(log.start("e-2", |_, _| true), Ok(Start::Snapshot { reset: true, .. })));
        assert!(matches!(log.start("e-3", |_, _| true), Ok(Start::Resume { cursor: 3 })));
        assert_eq!(log.forget(|_, _| false), 0);
        log.upsert("d".into(), 4);
        assert!(matches!(log.start("e-3", |_, _| true), Ok(Start::Resume { cursor: 3 })), "nothing dropped since");
    }

    #[test]
    fn revisions_are_announced() {
        let mut log = ready(4);
        let mut rx = log.revisions();
        rx.borrow_and_update();
        log.upsert("a".into(), 1);
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), 1);
        log.upsert("a".into(), 1);
        assert!(!rx.has_changed().unwrap(), "no change, no announcement");
    }
}
