//! The reconcile loop: per pod uid, serially (the [`WorkQueue`]), bring the cluster and the VIF
//! index in line with what the pod should have ([`Desired`]), reading the pod's latest state
//! from the [`PodView`] when the run starts.
//!
//! **Apply** (scheduled, not host network, not deleting, not finished), each step idempotent:
//! 1. our finalizer on the pod, first — from then on the pod cannot disappear before cleanup,
//!    so whatever the next steps leave behind (a kill -9 between any two) is released by it;
//! 2. the addresses from the backend (idempotent per pod uid) and the further networks';
//! 3. the PodVif (named after the pod, owned by it) created with the VIF in its spec: the record,
//!    in one request, and atomic — of two allocators racing for a pod exactly one creates it.
//!    When it exists already (a retry, a race, a PodVif of an earlier version), a VIF on record
//!    that the backend still holds is kept and ours given back; any other record is replaced,
//!    only over the PodVif's version as read;
//! 4. only then the VIF into the index, which streams VIF_APPLIED to the pod's node.
//!
//! Per new pod that is three API writes: the finalizer, the AddressBlock status (shared by the
//! pods of a node's batch, [`crate::backend::ipam`]) and the PodVif create. The status
//! subresource is written only when the state moves (plug reports, readiness).
//!
//! **Cleanup** (being deleted, gone, or finished), tolerating any step never having run:
//! VIF_DELETED to the node, release the addresses, delete the PodVif, then remove the finalizer.
//! Neither the PodVif nor the pod is read first when this process knows them (the PodVif's uid
//! from its creation, the pod's finalizers from the watcher): the writes carry preconditions
//! instead, and only a failed precondition costs a read.
//!
//! Failures are retried by the queue with capped exponential backoff, and each is logged once,
//! counted in `kuryr_allocator_failures_total{op,reason}` and told to the pod's users as a
//! Warning Event (`VifAllocationFailed` / `VifReleaseFailed`).
//!
//! ReportPlugged changes a VIF's state under the same per-pod lock as reconciles: persisted to
//! the PodVif status first, then streamed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kuryr_runtime::Shutdown;
use kuryr_stream::{Outcome, WorkQueue};
use tokio::sync::OwnedMutexGuard;
use tracing::Instrument as _;

use crate::backend::VifBackend as _;
use crate::cluster::Cluster;
use crate::core::{PodKey, Vif, VifState};
use crate::error::{ClusterError, PlugError, ReconcileError, chain};
use crate::index::{SharedIndex, lock, vif_node};
use crate::metrics::Metrics;
use crate::pods::{Desired, FINALIZER, PodEntry, PodView};
use crate::shards::Shards;

pub use crate::cluster::{REASON_ALLOCATION_FAILED, REASON_RELEASE_FAILED};

/// Reads and patches of the finalizer before a conflict counts as a failure.
const FINALIZER_ATTEMPTS: u32 = 3;

/// The view shared by the watcher follower and the workers.
pub type SharedView = Arc<Mutex<PodView>>;

/// Locks the pod view; it holds plain collections, so a poisoned lock is still consistent.
pub fn view_lock(view: &SharedView) -> MutexGuard<'_, PodView> {
    view.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Per pod uid async locks, dropped when nobody holds or waits for them.
#[derive(Debug, Default)]
struct PodLocks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

struct PodLockGuard<'a> {
    locks: &'a PodLocks,
    key: String,
    guard: Option<OwnedMutexGuard<()>>,
}

impl PodLocks {
    async fn lock(&self, key: &str) -> PodLockGuard<'_> {
        let m = self.0.lock().unwrap_or_else(PoisonError::into_inner).entry(key.to_string()).or_default().clone();
        PodLockGuard { locks: self, key: key.to_string(), guard: Some(m.lock_owned().await) }
    }
}

impl Drop for PodLockGuard<'_> {
    fn drop(&mut self) {
        self.guard.take();
        let mut map = self.locks.0.lock().unwrap_or_else(PoisonError::into_inner);
        if map.get(&self.key).is_some_and(|m| Arc::strong_count(m) == 1) {
            map.remove(&self.key);
        }
    }
}

/// The controller.
#[derive(Debug)]
pub struct Controller<C> {
    cluster: C,
    network: String,
    view: SharedView,
    index: SharedIndex,
    queue: Arc<WorkQueue>,
    locks: PodLocks,
    metrics: Metrics,
    /// The nodes this replica works on.
    shards: Shards,
    /// Per pod uid, further networks whose addresses a failed cleanup still has to give back
    /// (the VIF that listed them is out of the index by then; after a restart its PodVif, deleted
    /// only once they are back, lists them again).
    detaching: Mutex<HashMap<String, Vec<String>>>,
}

impl<C: Cluster> Controller<C> {
    /// A controller for `network`, working through `cluster`.
    pub fn new(
        cluster: C,
        network: &str,
        view: SharedView,
        index: SharedIndex,
        queue: Arc<WorkQueue>,
        metrics: Metrics,
    ) -> Self {
        let locks = PodLocks::default();
        Self {
            cluster,
            network: network.to_string(),
            view,
            index,
            queue,
            locks,
            metrics,
            shards: Shards::all(crate::shards::SERVICE),
            detaching: Mutex::default(),
        }
    }

    /// Works only on the nodes `shards` serves (every node by default).
    #[must_use]
    pub fn with_shards(mut self, shards: Shards) -> Self {
        self.shards = shards;
        self
    }

    /// Whether this replica works on `node` (its shard is owned and loaded here).
    pub fn serves(&self, node: &str) -> bool {
        self.shards.serves(node)
    }

    /// The cluster it works through.
    pub fn cluster(&self) -> &C {
        &self.cluster
    }

    /// The pod view.
    pub fn view(&self) -> &SharedView {
        &self.view
    }

    /// Queues a pod uid for reconciling.
    pub fn enqueue(&self, uid: &str) {
        self.queue.add(uid);
        self.gauge_queue();
    }

    fn gauge_queue(&self) {
        self.metrics.queue_depth.set(i64::try_from(self.queue.depth()).unwrap_or(i64::MAX));
        self.metrics.queue_failing.set(i64::try_from(self.queue.failing()).unwrap_or(i64::MAX));
    }

    /// Recovery found a PodVif for `key` on `node`: if the pod is unknown once the watcher's
    /// snapshot is in, it is gone, and its cleanup is queued.
    pub fn adopt_orphan(&self, key: PodKey, node: &str) {
        let uid = key.uid.clone();
        if view_lock(&self.view).adopt_orphan(key, node) {
            self.enqueue(&uid);
        }
    }

    /// Runs `workers` workers until shutdown.
    pub fn spawn_workers(self: &Arc<Self>, workers: usize, shutdown: Shutdown) {
        self.queue.run_workers(workers, async move { shutdown.wait().await }, || {
            let this = self.clone();
            async move { this.work().await }
        });
    }

    async fn work(&self) {
        while let Some(uid) = self.queue.next().await {
            self.gauge_queue();
            let span = self.reconcile_span(&uid);
            let outcome = match self.reconcile(&uid).instrument(span).await {
                Ok(()) => Outcome::Done,
                Err(e) => {
                    self.report(&e).await;
                    Outcome::Retry
                }
            };
            self.queue.done(&uid, outcome);
            self.gauge_queue();
        }
    }

    /// The span of one reconcile: every line logged under it, the backend's included, names the
    /// pod.
    fn reconcile_span(&self, uid: &str) -> tracing::Span {
        let pod = view_lock(&self.view)
            .get(uid)
            .map(|e| format!("{}/{}", e.info.key.namespace, e.info.key.name))
            .unwrap_or_default();
        tracing::info_span!("reconcile", pod = %pod, uid)
    }

    async fn report(&self, e: &ReconcileError) {
        let reason = e.source.reason();
        self.metrics.failed(e.op, reason);
        let error = chain(e);
        tracing::warn!(pod = %format!("{}/{}", e.pod.namespace, e.pod.name), uid = %e.pod.uid, op = e.op, reason,
            error, "reconcile failed; retrying with backoff");
        if !e.gone {
            let generic = if e.op == "apply" { REASON_ALLOCATION_FAILED } else { REASON_RELEASE_FAILED };
            let why = e.source.event_reason().unwrap_or(generic);
            self.cluster.warn(&e.pod, why, error).await;
        }
    }

    /// Brings one pod uid in line with its latest state.
    pub async fn reconcile(&self, uid: &str) -> Result<(), ReconcileError> {
        let _guard = self.locks.lock(uid).await;
        let Some(entry) = view_lock(&self.view).get(uid).cloned() else {
            return Ok(());
        };
        if !self.shards.serves(&entry.info.node) {
            // Another replica's node: its owner does the work. A tombstone is not kept: should
            // the shard come here, its PodVifs are read again and orphans found then.
            if entry.gone {
                view_lock(&self.view).forget(uid);
            }
            return Ok(());
        }
        match entry.desired() {
            Desired::Vif { node } => self.apply(&entry, &node).await,
            Desired::NoVif => self.cleanup(&entry).await,
        }
    }

    async fn apply(&self, entry: &PodEntry, node: &str) -> Result<(), ReconcileError> {
        let key = &entry.info.key;
        let fail = |step: &'static str| {
            move |source| ReconcileError { op: "apply", step, pod: key.clone(), gone: false, source }
        };
        let current = lock(&self.index).get(&key.uid);
        let failed = current.as_ref().is_some_and(|v| v.state == VifState::Failed);
        if entry.info.has_finalizer && !failed && current.as_ref().is_some_and(|v| vif_node(v) == node) {
            return Ok(());
        }
        if !entry.info.has_finalizer && !self.ensure_finalizer(key).await.map_err(fail("adding the finalizer"))? {
            return Ok(());
        }
        // The addresses first, then the PodVif created with them in its spec: one request records
        // the VIF (a status could not be written by the create). The finalizer already guarantees
        // that the addresses are released whatever happens next.
        let mut mine = self.cluster.backend().allocate(key, node).await.map_err(fail("allocating addresses"))?;
        if let Some(networks) = entry.info.networks.as_deref() {
            match self.cluster.attach(key, node, networks).await {
                Ok(attached) => mine.attachments = attached,
                Err(e) => {
                    // The binder fails the pod's CNI ADD with the reason instead of waiting.
                    self.publish_failed(key, node, &chain(&e));
                    return Err(fail("attaching further networks")(e));
                }
            }
        }
        let ensured = match self.cluster.ensure_pod_vif(key, node, &mine).await {
            Err(ClusterError::StalePodVif { namespace, name, other_uid, node: other_node }) => {
                // Clean the earlier pod's up first; this pod is retried after.
                let stale = PodKey::new(&namespace, &name, &other_uid);
                self.adopt_orphan(stale, &other_node);
                let source = ClusterError::StalePodVif { namespace, name, other_uid, node: other_node };
                return Err(fail("creating the PodVif")(source));
            }
            other => other.map_err(fail("creating the PodVif"))?,
        };
        if entry.pod_vif.as_deref() != Some(ensured.uid.as_str()) {
            view_lock(&self.view).set_pod_vif(&key.uid, Some(ensured.uid.clone()));
        }
        // The VIF on record stays while the backend still holds it: another allocator (unsharded
        // replicas, a shard handover) may have recorded its own for the pod since or while this
        // one allocated. Ours is given back then. (The same allocation with other details, an
        // MTU or routes changed since, is simply recorded anew.)
        let record = match &ensured.recorded {
            Some((r, _))
                if (r.vif_id != mine.vif_id || r.ips != mine.ips)
                    && self
                        .cluster
                        .backend()
                        .holds(key, node, r)
                        .await
                        .map_err(fail("checking the VIF on record"))? =>
            {
                self.cluster
                    .backend()
                    .discard(key, node, &mine, r)
                    .await
                    .map_err(fail("giving back a VIF that lost"))?;
                self.metrics.lost_races.inc();
                tracing::info!(pod = %format!("{}/{}", key.namespace, key.name), uid = %key.uid, kept = %r.vif_id,
                    discarded = %mine.vif_id, "the PodVif records another VIF of the pod; keeping that one");
                r.clone()
            }
            _ => mine,
        };
        // The state on record stands for the VIF it was written with; a new record (or one on
        // record as FAILED) starts ALLOCATED.
        let state = match &ensured.recorded {
            Some((r, s)) if *r == record && *s != VifState::Failed => *s,
            _ => VifState::Allocated,
        };
        let recording = ensured.recorded.as_ref().is_none_or(|(r, s)| *r != record || *s != state);
        if recording {
            // Over the version read only: of two allocators racing for the pod, exactly one
            // records its VIF; the other sees a conflict and, retried, keeps the one on record.
            self.cluster.record_vif(key, &record, &ensured).await.map_err(fail("recording the VIF"))?;
        }
        if entry.info.networks.is_some() && (recording || current.is_none() || failed) {
            // Before the index: should this fail, the retry (the VIF not in the index yet) writes it.
            let status = crate::core::attach::network_status(crate::core::attach::PRIMARY_NAME, &record);
            self.cluster.network_status(key, &status).await.map_err(fail("writing the network-status annotation"))?;
        }
        let vif = Vif::recorded(key, node, &self.network, record.clone(), state);
        let fresh = {
            let mut idx = lock(&self.index);
            let fresh = idx.get(&key.uid).is_none();
            idx.upsert_vif(vif);
            // Under the index lock: set by concurrent workers outside it, the gauge could be left
            // at an older count.
            self.metrics.vifs.set(i64::try_from(idx.len()).unwrap_or(i64::MAX));
            fresh
        };
        if fresh {
            self.metrics.allocations.inc();
            if let Some(seen) = entry.first_scheduled {
                self.metrics.vif_latency.observe(seen.elapsed().as_secs_f64());
            }
            let ips: Vec<&str> = record.ips.iter().map(|i| i.address.as_str()).collect();
            tracing::info!(pod = %format!("{}/{}", key.namespace, key.name), uid = %key.uid, node, vif = %record.vif_id,
                ?ips, "VIF handed out");
        }
        Ok(())
    }

    /// Streams a FAILED VIF for the pod, carrying `message`, so that its binder answers the CNI
    /// ADD with the reason at once; the next successful apply replaces it.
    fn publish_failed(&self, key: &PodKey, node: &str, message: &str) {
        let vif = Vif::failed(key, node, &self.network, message);
        let mut idx = lock(&self.index);
        idx.upsert_vif(vif);
        self.metrics.vifs.set(i64::try_from(idx.len()).unwrap_or(i64::MAX));
    }

    /// Puts our finalizer on the pod unless it is there. Returns false when the pod is gone or
    /// being deleted (its next event says so; no finalizer may be added then). A conflict
    /// (someone else edited the finalizers since the read, another replica perhaps) is settled
    /// by reading again at once rather than after a backoff.
    ///
    /// Most pods carry no finalizer at all, so the first attempt assumes that and skips the
    /// read: its precondition (no finalizers, this uid) makes it fail harmlessly for any other
    /// pod — one with finalizers, being deleted (the API server refuses new finalizers then) or
    /// gone — and those take the read path.
    async fn ensure_finalizer(&self, key: &PodKey) -> Result<bool, ClusterError> {
        match self.cluster.add_finalizer(key, &[]).await {
            Ok(()) => return Ok(true),
            Err(e) => tracing::debug!(pod = %format!("{}/{}", key.namespace, key.name), error = %chain(&e),
                "the finalizer needs a read first"),
        }
        let mut attempts = 0;
        loop {
            let Some(meta) = self.cluster.pod(key).await? else { return Ok(false) };
            if meta.deleting {
                return Ok(false);
            }
            if meta.finalizers.iter().any(|f| f == FINALIZER) {
                return Ok(true);
            }
            attempts += 1;
            match self.cluster.add_finalizer(key, &meta.finalizers).await {
                Ok(()) => return Ok(true),
                Err(ClusterError::Conflict(_)) if attempts < FINALIZER_ATTEMPTS => {}
                Err(e) => return Err(e),
            }
        }
    }

    async fn cleanup(&self, entry: &PodEntry) -> Result<(), ReconcileError> {
        let key = &entry.info.key;
        let gone = entry.gone;
        let fail =
            |step: &'static str| move |source| ReconcileError { op: "cleanup", step, pod: key.clone(), gone, source };
        let held = lock(&self.index).get(&key.uid);
        let had = held.is_some();
        if entry.info.has_finalizer || had || entry.orphan {
            // The further networks as recorded, and those the annotation names now (what an
            // apply that failed before recording may have taken).
            let mut further: Vec<String> =
                held.iter().flat_map(|v| v.record.attachments.iter().map(|a| a.network.clone())).collect();
            let pending = self.detaching.lock().unwrap_or_else(PoisonError::into_inner).remove(&key.uid);
            for n in pending.into_iter().flatten() {
                if !further.contains(&n) {
                    further.push(n);
                }
            }
            if let Some(networks) = entry.info.networks.as_deref() {
                for n in self.cluster.attached_networks(key, networks).await {
                    if n != self.network && !further.contains(&n) {
                        further.push(n);
                    }
                }
            }
            // The binder hears first, so that it stops using the address before it is reused.
            {
                let mut idx = lock(&self.index);
                idx.remove_vif(&key.uid);
                self.metrics.vifs.set(i64::try_from(idx.len()).unwrap_or(i64::MAX));
            }
            let released =
                self.cluster.backend().release(key, &entry.info.node).await.map_err(fail("releasing the addresses"))?;
            if !further.is_empty()
                && let Err(e) = self.cluster.detach(key, &entry.info.node, &further).await
            {
                self.detaching.lock().unwrap_or_else(PoisonError::into_inner).insert(key.uid.clone(), further);
                return Err(fail("releasing the further networks' addresses")(e));
            }
            let known = entry.pod_vif.as_deref();
            self.cluster.delete_pod_vif(key, known).await.map_err(fail("deleting the PodVif"))?;
            view_lock(&self.view).set_pod_vif(&key.uid, None);
            if !gone {
                self.remove_finalizer(entry).await.map_err(fail("removing the finalizer"))?;
            }
            if released {
                self.metrics.releases.inc();
            }
            if released || had {
                tracing::info!(pod = %format!("{}/{}", key.namespace, key.name), uid = %key.uid, released, "VIF released");
            }
        }
        if gone {
            view_lock(&self.view).forget(&key.uid);
        }
        Ok(())
    }

    /// Takes our finalizer off the pod. When the view saw it there, the patch is made from the
    /// view's list of finalizers, without a read: its preconditions (this uid, our finalizer at
    /// that position) make it fail harmlessly if the pod changed since, and only then is the pod
    /// read. Without the finalizer in the view (it may be there all the same: the view lags our
    /// own writes) the pod is read first.
    async fn remove_finalizer(&self, entry: &PodEntry) -> Result<(), ClusterError> {
        let key = &entry.info.key;
        if entry.info.has_finalizer {
            match self.cluster.remove_finalizer(key, &entry.info.finalizers).await {
                Ok(()) => return Ok(()),
                Err(e) => tracing::debug!(pod = %format!("{}/{}", key.namespace, key.name), error = %chain(&e),
                    "removing the finalizer needs a read first"),
            }
        }
        if let Some(meta) = self.cluster.pod(key).await?
            && meta.finalizers.iter().any(|f| f == FINALIZER)
        {
            self.cluster.remove_finalizer(key, &meta.finalizers).await?;
        }
        Ok(())
    }

    /// The backend confirmed that a plugged VIF works (Neutron: the port is ACTIVE): READY,
    /// recorded first, then streamed. A VIF no longer PLUGGED (released, replaced, unplugged)
    /// is left alone.
    pub async fn mark_ready(&self, pod_uid: &str, vif_id: &str) -> Result<bool, ClusterError> {
        let _guard = self.locks.lock(pod_uid).await;
        let Some(vif) = lock(&self.index).get(pod_uid) else { return Ok(false) };
        if vif.vif_id() != vif_id || vif.state != VifState::Plugged {
            return Ok(false);
        }
        let key = vif.pod.clone();
        self.cluster.record_state(&key, vif_id, VifState::Ready).await?;
        lock(&self.index).set_state(pod_uid, vif_id, VifState::Ready);
        self.observe_ready(pod_uid);
        tracing::info!(pod = %format!("{}/{}", key.namespace, key.name), uid = pod_uid, vif = vif_id, "VIF ready");
        Ok(true)
    }

    /// A pod's VIF was recorded READY: its network-ready latency, from when it was first seen
    /// scheduled (unknown for pods scheduled before this process started).
    fn observe_ready(&self, pod_uid: &str) {
        if let Some(seen) = view_lock(&self.view).get(pod_uid).and_then(|e| e.first_scheduled) {
            self.metrics.ready_latency.observe(seen.elapsed().as_secs_f64());
        }
    }

    /// The VIF of a pod.
    pub fn get_vif(&self, pod_uid: &str) -> Option<Arc<Vif>> {
        lock(&self.index).get(pod_uid)
    }

    /// The binder plugged (or unplugged) a VIF: with the embedded backend a plugged VIF is
    /// READY at once; with Neutron it is PLUGGED until the backend sees the port ACTIVE
    /// ([`Controller::mark_ready`]). An unplugged one is ALLOCATED again (its addresses stay
    /// with the pod).
    pub async fn report_plugged(
        &self,
        pod_uid: &str,
        vif_id: &str,
        node: &str,
        plugged: bool,
    ) -> Result<Arc<Vif>, PlugError> {
        let _guard = self.locks.lock(pod_uid).await;
        let Some(vif) = lock(&self.index).get(pod_uid) else {
            return Err(PlugError::NotFound(format!("no VIF for pod {pod_uid}")));
        };
        if vif.vif_id() != vif_id {
            return Err(PlugError::FailedPrecondition(format!("pod {pod_uid} has VIF {}, not {vif_id}", vif.vif_id())));
        }
        if vif_node(&vif) != node {
            return Err(PlugError::FailedPrecondition(format!(
                "pod {pod_uid} is on node {}, not {node}",
                vif_node(&vif)
            )));
        }
        let immediate = self.cluster.backend().ready_when_plugged();
        let want = match (plugged, immediate) {
            (false, _) => VifState::Allocated,
            (true, true) => VifState::Ready,
            // Already confirmed (a repeated report after READY) stays READY.
            (true, false) if vif.state == VifState::Ready => VifState::Ready,
            (true, false) => VifState::Plugged,
        };
        if !immediate {
            self.cluster.backend().watch_ready(pod_uid, vif_id, want == VifState::Plugged);
        }
        if vif.state == want {
            return Ok(vif);
        }
        let key = vif.pod.clone();
        self.cluster.record_state(&key, vif_id, want).await.map_err(|e| match e {
            ClusterError::NotFound(m) => PlugError::NotFound(m),
            ClusterError::Conflict(m) => PlugError::FailedPrecondition(m),
            other => PlugError::Unavailable(chain(&other)),
        })?;
        let after = lock(&self.index).set_state(pod_uid, vif_id, want);
        if want == VifState::Ready && after.is_some() {
            self.observe_ready(pod_uid);
        }
        tracing::info!(pod = %format!("{}/{}", key.namespace, key.name), uid = pod_uid, vif = vif_id, state = ?want, "plug reported");
        after.ok_or_else(|| PlugError::NotFound(format!("the VIF of pod {pod_uid} was released meanwhile")))
    }
}

#[cfg(test)]
#[path = "controller_tests.rs"]
pub(crate) mod tests;
