//! The binder's view of its node's VIFs, fed by the allocator's `WatchVifs` stream.
//!
//! CNI ADD waits here — on the stream, never by polling — for the pod's VIF to appear and then to
//! become ready. The stream is followed with a resume point so that a reconnect does not replay
//! everything; while it is down the binder is NOT_SERVING, and ADD keeps waiting on what it has.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kuryr_proto::allocator::v1::{NodeRoutes, Vif, VifEventType, VifState, WatchVifsRequest, WatchVifsResponse};
use kuryr_runtime::{Health, Shutdown};
use tokio::sync::watch;

use crate::upstream::Allocator;

/// How many recently deleted pod UIDs are remembered, so that an ADD arriving just after its pod
/// was deleted is answered "unknown container" instead of waiting out its deadline.
const TOMBSTONES: usize = 4096;

/// Reconnect delays after the stream breaks.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

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
    resume: String,
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

    /// Every VIF known.
    pub fn all(&self) -> Vec<Vif> {
        self.lock().vifs.values().cloned().collect()
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
            if !ev.resume_point.is_empty() {
                s.resume = ev.resume_point.clone();
            }
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

    fn resume_point(&self) -> String {
        self.lock().resume.clone()
    }

    /// Follows the allocator's stream for `node` until shutdown, reconnecting with backoff and
    /// resuming where it left off. Marks `service` SERVING while the stream is live; a stream on
    /// which nothing, not even a heartbeat, arrives for `idle` is taken as dead (a stopped or
    /// partitioned allocator). A replica that does not serve the node names its owner, which is
    /// followed at once; an owner that cannot be reached twice in a row is given up for
    /// `--allocator`.
    #[allow(clippy::too_many_arguments)]
    pub async fn follow(
        self,
        allocator: Allocator,
        node: String,
        binder_id: String,
        health: Health,
        service: &'static str,
        idle: Duration,
        shutdown: Shutdown,
    ) {
        health.register(service).await;
        let mut delay = RETRY_MIN;
        // Redirects followed since the stream was last live, and failures of the owner followed.
        let (mut hops, mut owner_failures) = (0u32, 0u32);
        loop {
            let mut client = allocator.client();
            let req = WatchVifsRequest {
                node_name: node.clone(),
                resume_from: self.resume_point(),
                binder_id: binder_id.clone(),
            };
            let res = tokio::select! {
                r = client.watch_vifs(req) => r,
                () = shutdown.clone().wait() => return,
            };
            match res {
                Ok(resp) => {
                    let mut stream = resp.into_inner();
                    loop {
                        let msg = tokio::select! {
                            m = kuryr_runtime::streams::next_message(&mut stream, idle) => m,
                            () = shutdown.clone().wait() => return,
                        };
                        match msg {
                            Ok(Some(ev)) if ev.r#type() == VifEventType::Heartbeat => {}
                            Ok(Some(ev)) => {
                                let was_live = self.is_live();
                                self.apply(&ev);
                                if !was_live && self.is_live() {
                                    let from = allocator.owner().unwrap_or_else(|| "--allocator".into());
                                    tracing::info!(node, allocator = from, "VIF stream live");
                                    health.set_serving(service).await;
                                    delay = RETRY_MIN;
                                    (hops, owner_failures) = (0, 0);
                                }
                            }
                            Ok(None) => {
                                tracing::warn!(node, "VIF stream ended by the allocator; reconnecting");
                                break;
                            }
                            Err(e) => {
                                tracing::warn!(node, code = ?e.code(), error = e.message(), "VIF stream broke; reconnecting");
                                if let Some(owner) = allocator.redirect(&e) {
                                    tracing::info!(node, owner, "the node's allocator moved; following it");
                                    (hops, owner_failures) = (hops + 1, 0);
                                }
                                break;
                            }
                        }
                    }
                }
                Err(e) => {
                    if let Some(owner) = allocator.redirect(&e) {
                        tracing::info!(node, owner, error = e.message(), "redirected to the node's allocator");
                        (hops, owner_failures) = (hops + 1, 0);
                    } else if allocator.owner().is_some() {
                        owner_failures += 1;
                        if owner_failures >= 2 {
                            allocator.fall_back();
                            owner_failures = 0;
                            tracing::warn!(node, code = ?e.code(), error = e.message(),
                                "the node's allocator cannot be reached; back to --allocator");
                        }
                    } else {
                        tracing::warn!(node, code = ?e.code(), error = e.message(), "cannot open the VIF stream");
                    }
                }
            }
            self.set_live(false);
            health.set_not_serving(service).await;
            if hops > 0 && hops <= 2 && owner_failures == 0 {
                // A fresh redirect: straight to the owner.
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = shutdown.clone().wait() => return,
            }
            delay = (delay * 2).min(RETRY_MAX);
        }
    }
}

/// Whether a VIF can be plugged (allocated and not failed).
pub fn pluggable(v: &Vif) -> bool {
    matches!(v.state(), VifState::Allocated | VifState::Plugged | VifState::Ready)
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
        assert_eq!(cache.resume_point(), "r2");
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
