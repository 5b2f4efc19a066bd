//! A keyed work queue, as Kuryr's controller had and kube-runtime's controller has: work on one
//! key (an object's uid, or namespace/name) is serial, different keys run in parallel, and only the
//! latest state matters.
//!
//! The queue holds keys, not events: a worker reads the key's current state when it runs, so a
//! burst of updates to one object costs one run (or two, when one arrives mid-run). A key added
//! while it is running is run again afterwards, never concurrently. A failed run is retried after
//! a capped, jittered exponential backoff; adding the key meanwhile runs it at once (its new
//! state may have fixed the cause) without resetting the backoff, which only a success does.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tracing::Instrument as _;

/// Backoff of the first retry; it doubles per consecutive failure.
pub const RETRY_BASE: Duration = Duration::from_millis(250);
/// Longest backoff: a key that keeps failing (an exhausted network, say) is retried about twice
/// a minute, which notices a fix quickly without hammering the API server.
pub const RETRY_CAP: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
struct State {
    /// Keys waiting for a worker, oldest first; each at most once.
    ready: VecDeque<String>,
    queued: HashSet<String>,
    /// Keys a worker is running.
    active: HashSet<String>,
    /// Keys added while active: queued again when their run ends.
    dirty: HashSet<String>,
    /// Consecutive failures and the generation of the retry timer, by key.
    failures: HashMap<String, (u32, u64)>,
    next_generation: u64,
    closed: bool,
}

/// The queue; share it behind an `Arc`.
#[derive(Debug)]
pub struct WorkQueue {
    state: Mutex<State>,
    notify: Notify,
    base: Duration,
    cap: Duration,
    /// The component its retries are counted under in `kuryr_retries_total`.
    component: &'static str,
}

impl Default for WorkQueue {
    fn default() -> Self {
        Self::new(RETRY_BASE, RETRY_CAP)
    }
}

/// What a run of a key came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done; forget the key's failures.
    Done,
    /// Failed; retry after a backoff.
    Retry,
}

impl WorkQueue {
    /// A queue whose retries back off from `base`, doubling, up to `cap`.
    pub fn new(base: Duration, cap: Duration) -> Self {
        Self { state: Mutex::new(State::default()), notify: Notify::new(), base, cap, component: "workqueue" }
    }

    /// Counts its retries under `component` (reason `reconcile`) instead of `workqueue`.
    #[must_use]
    pub fn counted_as(mut self, component: &'static str) -> Self {
        self.component = component;
        self
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Plain collections; a panic elsewhere cannot leave them inconsistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `key` to run as soon as a worker is free (and it is not running).
    pub fn add(&self, key: &str) {
        let mut s = self.lock();
        if s.closed {
            return;
        }
        if s.active.contains(key) {
            s.dirty.insert(key.to_string());
        } else if s.queued.insert(key.to_string()) {
            s.ready.push_back(key.to_string());
            drop(s);
            self.notify.notify_one();
        }
    }

    /// The next key to run, marked active; `None` once the queue is closed.
    pub async fn next(&self) -> Option<String> {
        loop {
            let notified = self.notify.notified();
            {
                let mut s = self.lock();
                if s.closed {
                    return None;
                }
                if let Some(key) = s.ready.pop_front() {
                    s.queued.remove(&key);
                    s.active.insert(key.clone());
                    let more = !s.ready.is_empty();
                    drop(s);
                    if more {
                        // Another worker may be waiting; pass the wake-up on.
                        self.notify.notify_one();
                    }
                    return Some(key);
                }
            }
            notified.await;
        }
    }

    /// Ends the run of `key` (from [`next`](Self::next)). On [`Outcome::Retry`] returns the
    /// backoff after which it runs again.
    pub fn done(self: &Arc<Self>, key: &str, outcome: Outcome) -> Option<Duration> {
        let mut s = self.lock();
        s.active.remove(key);
        let rerun = s.dirty.remove(key);
        let delay = match outcome {
            Outcome::Done => {
                s.failures.remove(key);
                None
            }
            Outcome::Retry => {
                s.next_generation += 1;
                let generation = s.next_generation;
                let failures = s.failures.get(key).map_or(0, |f| f.0) + 1;
                s.failures.insert(key.to_string(), (failures, generation));
                let delay = crate::backoff::delay(self.component, "reconcile", failures, self.base, self.cap);
                let queue = Arc::downgrade(self);
                let key = key.to_string();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    if let Some(q) = queue.upgrade() {
                        q.retry(&key, generation);
                    }
                });
                Some(delay)
            }
        };
        drop(s);
        if rerun {
            self.add(key);
        }
        delay
    }

    /// A retry timer fired: run the key unless it succeeded (or failed again) since.
    fn retry(&self, key: &str, generation: u64) {
        let due = self.lock().failures.get(key).is_some_and(|f| f.1 == generation);
        if due {
            self.add(key);
        }
    }

    /// Keys waiting for a worker.
    pub fn depth(&self) -> usize {
        self.lock().ready.len()
    }

    /// Keys whose last run failed (waiting for a retry or running again).
    pub fn failing(&self) -> usize {
        self.lock().failures.len()
    }

    /// Stops handing out keys; waiting workers get `None`.
    pub fn close(&self) {
        self.lock().closed = true;
        self.notify.notify_waiters();
    }

    /// Spawns `workers` (at least one) tasks made by `work`, each in a `worker` span that carries
    /// its number, and closes the queue once `stop` completes, so that every worker's
    /// [`Self::next`] ends with `None`.
    pub fn run_workers<W, F>(self: &Arc<Self>, workers: usize, stop: impl Future<Output = ()> + Send + 'static, work: W)
    where
        W: Fn() -> F,
        F: Future<Output = ()> + Send + 'static,
    {
        for i in 0..workers.max(1) {
            tokio::spawn(work().instrument(tracing::info_span!("worker", id = i)));
        }
        let queue = self.clone();
        tokio::spawn(async move {
            stop.await;
            queue.close();
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn workers_run_the_keys_and_end_when_stopped() {
        let q = Arc::new(WorkQueue::default());
        let (ran, ended) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel::<String>();
        q.run_workers(3, async move { stopped.await.unwrap_or_default() }, || {
            let (q, ran, ended, done_tx) = (q.clone(), ran.clone(), ended.clone(), done_tx.clone());
            async move {
                while let Some(key) = q.next().await {
                    ran.fetch_add(1, Ordering::SeqCst);
                    q.done(&key, Outcome::Done);
                    let _ = done_tx.send(key);
                }
                ended.fetch_add(1, Ordering::SeqCst);
                let _ = done_tx.send("ended".into());
            }
        });
        for k in ["a", "b", "c", "d"] {
            q.add(k);
        }
        let mut keys: Vec<String> = Vec::new();
        while keys.len() < 4 {
            keys.push(done.recv().await.unwrap());
        }
        keys.sort();
        assert_eq!(keys, ["a", "b", "c", "d"]);
        stop.send(()).unwrap();
        for _ in 0..3 {
            assert_eq!(done.recv().await.unwrap(), "ended");
        }
        assert_eq!((ran.load(Ordering::SeqCst), ended.load(Ordering::SeqCst)), (4, 3));
    }

    #[tokio::test(start_paused = true)]
    async fn one_key_is_serial_and_coalesced_while_keys_run_in_parallel() {
        let q = Arc::new(WorkQueue::default());
        q.add("a");
        q.add("a");
        q.add("b");
        assert_eq!(q.depth(), 2, "a queued once");
        let a = q.next().await.unwrap();
        let b = q.next().await.unwrap();
        assert_eq!((a.as_str(), b.as_str()), ("a", "b"), "different keys run at once");
        // Updates to a running key wait for its run to end, however many there are.
        q.add("a");
        q.add("a");
        assert_eq!(q.depth(), 0);
        let waiter = {
            let q = q.clone();
            tokio::spawn(async move { q.next().await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "a must not run twice at once");
        assert_eq!(q.done("a", Outcome::Done), None);
        assert_eq!(waiter.await.unwrap().as_deref(), Some("a"), "run again once, after the first run");
        assert_eq!(q.depth(), 0);
        q.done("a", Outcome::Done);
        q.done("b", Outcome::Done);
        q.close();
        assert_eq!(q.next().await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_are_retried_with_growing_capped_backoff() {
        let q = Arc::new(WorkQueue::new(Duration::from_millis(100), Duration::from_millis(800)));
        let runs = Arc::new(AtomicUsize::new(0));
        let mut delays = Vec::new();
        q.add("k");
        for _ in 0..6 {
            let key = q.next().await.unwrap();
            runs.fetch_add(1, Ordering::Relaxed);
            delays.push(q.done(&key, Outcome::Retry).unwrap());
            assert_eq!(q.failing(), 1);
        }
        for (i, d) in delays.iter().enumerate() {
            let ceiling = Duration::from_millis(100 * (1 << i)).min(Duration::from_millis(800));
            assert!(*d <= ceiling, "retry {i}: {d:?} vs ceiling {ceiling:?}");
        }
        assert_eq!(runs.load(Ordering::Relaxed), 6);
        // An add runs it before the last timer fires; a success forgets the failures, and the
        // pending timer then does nothing.
        q.add("k");
        let key = q.next().await.unwrap();
        assert_eq!(q.done(&key, Outcome::Done), None);
        assert_eq!(q.failing(), 0);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(q.depth(), 0, "a stale retry timer queued the key again");
    }

    #[tokio::test(start_paused = true)]
    async fn an_add_runs_a_failing_key_at_once() {
        let q = Arc::new(WorkQueue::new(Duration::from_secs(10), Duration::from_secs(10)));
        q.add("k");
        let key = q.next().await.unwrap();
        q.done(&key, Outcome::Retry);
        q.add("k");
        let started = tokio::time::Instant::now();
        assert_eq!(q.next().await.as_deref(), Some("k"));
        assert!(started.elapsed() < Duration::from_millis(1));
    }
}
