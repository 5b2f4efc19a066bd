//! The binder's view of its node's VIFs, fed by the allocator's `WatchVifs` stream.
//!
//! CNI ADD waits here — on the stream, never by polling — for the pod's VIF to appear and then to
//! become ready. The stream is followed by the one follower of [`kuryr_stream::follow`] with a
//! resume point, so that a reconnect does not replay everything; while it is down — broken, or
//! silent (not even a heartbeat) for longer than `--stream-idle-timeout`, as when the allocator is
//! stopped or partitioned away — the binder is NOT_SERVING, and ADD keeps waiting on what it has.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kuryr_proto::allocator::v1::{NodeRoutes, Vif, VifEventType, VifState, WatchVifsRequest, WatchVifsResponse};
use kuryr_runtime::follow::{Failed, next_message};
use kuryr_runtime::{Health, Shutdown};
use kuryr_stream::follow::{Failure, FollowConfig, Followed, Follower, Mark, Retry, Source};
use tokio::sync::watch;
use tonic::Streaming;

use crate::upstream::Allocator;

/// How many recently deleted pod UIDs are remembered, so that an ADD arriving just after its pod
/// was deleted is answered "unknown container" instead of waiting out its deadline.
const TOMBSTONES: usize = 4096;

/// Redirects followed at once (without backoff) before the stream was live again.
const FRESH_REDIRECTS: u32 = 2;

/// What a waiter learns.
#[derive(Debug)]
pub enum Wait {
    /// The VIF, matching what was asked for.
    Vif(Box<Vif>),
    /// The pod's VIF was released: the pod no longer exists.
    Gone,
    /// The deadline passed first.
    TimedOut(Option<Box<Vif>>),
}

#[derive(Debug, Default)]
struct State {
    vifs: HashMap<String, Vif>,
    node_routes: HashMap<String, NodeRoutes>,
    tombstones: VecDeque<String>,
    live: bool,
}

/// The VIF cache; cheap to clone.
#[derive(Clone, Debug)]
pub struct VifCache {
    state: Arc<Mutex<State>>,
    /// Bumped on every change; waiters re-check when it moves.
    changed: watch::Sender<u64>,
}

impl Default for VifCache {
    fn default() -> Self {
        Self { state: Arc::default(), changed: watch::channel(0).0 }
    }
}

impl VifCache {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the stream is connected and its snapshot complete.
    pub fn is_live(&self) -> bool {
        self.lock().live
    }

    /// The current VIF of a pod.
    pub fn get(&self, pod_uid: &str) -> Option<Vif> {
        self.lock().vifs.get(pod_uid).cloned()
    }

    /// What `f` makes of each VIF known, where it makes something: read in place, so that a
    /// question about a few fields does not copy every VIF.
    pub fn filter_map<T, B: FromIterator<T>>(&self, f: impl FnMut(&Vif) -> Option<T>) -> B {
        self.lock().vifs.values().filter_map(f).collect()
    }

    /// A receiver that sees a new value after every change of the cache.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Other nodes' pod address blocks.
    pub fn node_routes(&self) -> Vec<NodeRoutes> {
        self.lock().node_routes.values().cloned().collect()
    }

    /// Waits until the pod's VIF satisfies `accept`, the pod's VIF is released, or `timeout`.
    pub async fn wait_for(&self, pod_uid: &str, timeout: Duration, accept: impl Fn(&Vif) -> bool) -> Wait {
        let mut rx = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            {
                let s = self.lock();
                match s.vifs.get(pod_uid) {
                    Some(v) if accept(v) => return Wait::Vif(Box::new(v.clone())),
                    None if s.tombstones.iter().any(|t| t == pod_uid) => return Wait::Gone,
                    _ => {}
                }
            }
            // Mark the current version seen; changes after this wake us.
            rx.borrow_and_update();
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Wait::TimedOut(self.get(pod_uid).map(Box::new)),
            }
        }
    }

    /// Applies one stream event.
    pub fn apply(&self, ev: &WatchVifsResponse) {
        {
            let mut s = self.lock();
            match ev.r#type() {
                VifEventType::Reset => {
                    s.vifs.clear();
                    s.node_routes.clear();
                    s.live = false;
                }
                VifEventType::SnapshotComplete => s.live = true,
                VifEventType::VifApplied => {
                    if let Some(v) = &ev.vif
                        && let Some(uid) = v.pod.as_ref().map(|p| p.uid.clone())
                    {
                        s.tombstones.retain(|t| *t != uid);
                        s.vifs.insert(uid, v.clone());
                    }
                }
                VifEventType::VifDeleted => {
                    if let Some(uid) = ev.vif.as_ref().and_then(|v| v.pod.as_ref()).map(|p| p.uid.clone()) {
                        s.vifs.remove(&uid);
                        s.tombstones.push_back(uid);
                        if s.tombstones.len() > TOMBSTONES {
                            s.tombstones.pop_front();
                        }
                    }
                }
                VifEventType::NodeRoutesApplied => {
                    if let Some(r) = &ev.node_routes {
                        s.node_routes.insert(r.node_name.clone(), r.clone());
                    }
                }
                VifEventType::NodeRoutesDeleted => {
                    if let Some(r) = &ev.node_routes {
                        s.node_routes.remove(&r.node_name);
                    }
                }
                VifEventType::Unspecified | VifEventType::Heartbeat => {}
            }
        }
        self.changed.send_modify(|n| *n += 1);
    }

    fn set_live(&self, live: bool) {
        self.lock().live = live;
        self.changed.send_modify(|n| *n += 1);
    }

    /// Follows the allocator's stream for its node until shutdown (see [`follower`]). Marks
    /// `service` SERVING while the stream is live, NOT_SERVING as soon as the follower reports it
    /// down.
    pub async fn follow(
        self,
        mut follower: Follower<VifSource>,
        health: Health,
        service: &'static str,
        shutdown: Shutdown,
    ) {
        health.register(service).await;
        loop {
            let Some(next) = follower.next_or(shutdown.clone().wait()).await else { return };
            match next {
                Followed::Event(ev) => {
                    let was_live = self.is_live();
                    self.apply(&ev);
                    if !was_live && self.is_live() {
                        let source = follower.source();
                        let from = source.allocator.owner().unwrap_or_else(|| "--allocator".into());
                        tracing::info!(node = source.node, allocator = from, "VIF stream live");
                        health.set_serving(service).await;
                    }
                }
                Followed::Down(_) => {
                    if self.is_live() {
                        tracing::warn!(node = follower.source().node, "VIF stream lost; not serving until it is back");
                    }
                    self.set_live(false);
                    health.set_not_serving(service).await;
                }
            }
        }
    }
}

/// A follower of the allocator's stream for `node`, starting with a full snapshot.
pub fn follower(allocator: Allocator, node: String, binder_id: String, config: FollowConfig) -> Follower<VifSource> {
    let source = VifSource { allocator, node, binder_id, hops: 0, owner_failures: 0 };
    Follower::new(source, "the VIF stream", config)
}

/// The node's `WatchVifs` stream, from the allocator replica that serves the node: a replica
/// that does not serve it names its owner, which is followed at once; an owner that cannot be
/// reached (or goes silent) twice in a row is given up for `--allocator`.
#[derive(Debug)]
pub struct VifSource {
    allocator: Allocator,
    node: String,
    binder_id: String,
    /// Redirects followed since the stream was last live.
    hops: u32,
    /// Failures of the owner followed, in a row.
    owner_failures: u32,
}

impl Source for VifSource {
    type Event = WatchVifsResponse;
    type Error = Failed;
    type Stream = Streaming<WatchVifsResponse>;

    async fn open(&mut self, resume_from: &str) -> Result<Self::Stream, Failed> {
        let req = WatchVifsRequest {
            node_name: self.node.clone(),
            resume_from: resume_from.to_string(),
            binder_id: self.binder_id.clone(),
        };
        Ok(self.allocator.client().watch_vifs(req).await.map_err(Failed)?.into_inner())
    }

    async fn next(stream: &mut Self::Stream) -> Result<Option<WatchVifsResponse>, Failed> {
        next_message(stream).await
    }

    fn mark(event: &WatchVifsResponse) -> Mark {
        match event.r#type() {
            VifEventType::Reset => Mark::Reset,
            VifEventType::SnapshotComplete => Mark::SnapshotComplete,
            VifEventType::Heartbeat => Mark::Heartbeat,
            VifEventType::VifApplied
            | VifEventType::VifDeleted
            | VifEventType::NodeRoutesApplied
            | VifEventType::NodeRoutesDeleted
            | VifEventType::Unspecified => Mark::Change,
        }
    }

    fn resume_point(event: &WatchVifsResponse) -> &str {
        &event.resume_point
    }

    fn failed(&mut self, failure: Failure<'_, Failed>) -> Retry {
        if let Failure::Open(Failed(status)) | Failure::Broke(Failed(status)) = &failure
            && let Some(owner) = self.allocator.redirect(status)
        {
            tracing::info!(
                node = self.node,
                owner,
                error = status.message(),
                "the node's allocator moved; following it"
            );
            (self.hops, self.owner_failures) = (self.hops + 1, 0);
            return if self.hops <= FRESH_REDIRECTS { Retry::Now } else { Retry::Backoff };
        }
        let unreachable = matches!(failure, Failure::Open(_) | Failure::OpenSilent | Failure::Silent);
        if unreachable && self.allocator.owner().is_some() {
            self.owner_failures += 1;
            if self.owner_failures >= 2 {
                self.allocator.fall_back();
                self.owner_failures = 0;
                tracing::warn!(node = self.node, "the node's allocator cannot be reached; back to --allocator");
            }
        }
        Retry::Backoff
    }

    fn live(&mut self) {
        (self.hops, self.owner_failures) = (0, 0);
    }
}

/// Whether a VIF can be plugged (allocated and not failed).
pub fn pluggable(v: &Vif) -> bool {
    matches!(v.state(), VifState::Allocated | VifState::Plugged | VifState::Ready)
}

/// Whether the allocator failed the pod's VIF (`message` says why): ADD fails with the reason.
pub fn failed(v: &Vif) -> bool {
    v.state() == VifState::Failed
}

/// Whether a VIF is ready for ADD to return.
pub fn ready(v: &Vif) -> bool {
    v.state() == VifState::Ready
}

#[cfg(test)]
mod tests {
    use kuryr_proto::allocator::v1::PodRef;

    use super::*;

    fn vif(uid: &str, state: VifState) -> Vif {
        Vif { pod: Some(PodRef { uid: uid.into(), ..Default::default() }), state: state as i32, ..Default::default() }
    }

    fn ev(t: VifEventType, v: Option<Vif>, rp: &str) -> WatchVifsResponse {
        WatchVifsResponse { resume_point: rp.into(), r#type: t as i32, vif: v, node_routes: None }
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_wake_on_the_stream_not_by_polling() {
        let cache = VifCache::default();
        let c2 = cache.clone();
        let waiter = tokio::spawn(async move { c2.wait_for("u1", Duration::from_secs(60), ready).await });
        tokio::task::yield_now().await;
        cache.apply(&ev(VifEventType::VifApplied, Some(vif("u1", VifState::Allocated)), "r1"));
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "an allocated VIF is not ready");
        cache.apply(&ev(VifEventType::VifApplied, Some(vif("u1", VifState::Ready)), "r2"));
        match waiter.await.unwrap() {
            Wait::Vif(v) => assert_eq!(v.state(), VifState::Ready),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn deleted_pods_and_deadlines() {
        let cache = VifCache::default();
        cache.apply(&ev(VifEventType::VifApplied, Some(vif("u2", VifState::Allocated)), ""));
        let c2 = cache.clone();
        let waiter = tokio::spawn(async move { c2.wait_for("u2", Duration::from_secs(60), ready).await });
        tokio::task::yield_now().await;
        cache.apply(&ev(VifEventType::VifDeleted, Some(vif("u2", VifState::Allocated)), ""));
        assert!(matches!(waiter.await.unwrap(), Wait::Gone));
        // Later ADDs for the deleted pod are answered at once.
        assert!(matches!(cache.wait_for("u2", Duration::from_secs(60), pluggable).await, Wait::Gone));
        // A pod nobody knows waits out its deadline.
        match cache.wait_for("u3", Duration::from_secs(5), pluggable).await {
            Wait::TimedOut(None) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reset_forgets_and_snapshot_complete_makes_live() {
        let cache = VifCache::default();
        cache.apply(&ev(VifEventType::VifApplied, Some(vif("a", VifState::Ready)), ""));
        cache.apply(&ev(VifEventType::SnapshotComplete, None, ""));
        assert!(cache.is_live());
        cache.apply(&ev(VifEventType::Reset, None, ""));
        assert!(!cache.is_live());
        assert!(cache.get("a").is_none());
    }
}
