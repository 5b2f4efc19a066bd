//! The reconcile loop: per Service key, serially (the [`WorkQueue`]), bring the record, the
//! backend and the Service's finalizer in line with what the Service should have
//! ([`crate::core::spec::desired`]), reading its latest state from the [`crate::core::view::View`] when the run starts.
//!
//! **Apply** (a ClusterIP or LoadBalancer Service with cluster IPs, not being deleted), each
//! step idempotent:
//! 1. our finalizer on the Service, first — from then on it cannot disappear before cleanup;
//! 2. the ServiceLoadBalancer record's spec (created, or replaced when it differs); the API
//!    server raises its `metadata.generation`, which becomes the spec's generation;
//! 3. the backend programs that spec (the node backend publishes it to the stream);
//! 4. the record's status: what the backend observed, at which generation.
//!
//! **Cleanup** (deleted, being deleted, headless, or of a type that gets no load balancer),
//! tolerating any step never having run: the backend removes the load balancer (LB_DELETED on
//! the stream), the record is deleted, then the finalizer is removed.
//!
//! Failures are retried by the queue with capped exponential backoff, and each is logged,
//! counted in `kuryr_lbaas_failures_total{op,reason}` and told to the Service's users as a
//! Warning Event. ExternalName Services are told once (a Normal Event) why they get no load
//! balancer.
//!
//! **Shards** ([`crate::shards`]): only Services whose shard this replica serves are queued and
//! reconciled; one whose shard moved away is skipped (`result="elsewhere"`), and a reconcile
//! that fails after its shard moved is neither retried nor reported here — the new owner
//! converges it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Notify;

use kuryr_runtime::Shutdown;
use kuryr_stream::{Outcome, WorkQueue};
use tracing::Instrument as _;

use crate::backend::{Backend, BackendError, Maintenance, Observed};
use crate::core::input::EndpointSlice;
use crate::core::lb::LoadBalancerSpec;
use crate::core::spec::{Desired, REASON_SKIPPED, ServiceRef, desired};
use crate::core::view::{FINALIZER, ServiceEntry, SharedView, split};
use crate::core::{chain, locked};
use crate::k8s::api::Kube;
use crate::k8s::crd::{ServiceLoadBalancerSpec, ServiceLoadBalancerStatus};
use crate::k8s::{Cluster, ClusterError, Record, Records};
use crate::metrics::{Metrics, ResultLabels};
use crate::shards::Shards;

/// Event reasons, as `kubectl describe service` shows them.
pub const REASON_FAILED: &str = "LoadBalancerFailed";
/// See [`REASON_FAILED`].
pub const REASON_CLEANUP_FAILED: &str = "LoadBalancerCleanupFailed";

/// The result of a reconcile skipped because the Service's shard is served by another replica.
pub const ELSEWHERE: &str = "elsewhere";

/// Reads and patches of the finalizer before a conflict counts as a failure.
const FINALIZER_ATTEMPTS: u32 = 3;

/// What failed underneath.
#[derive(Debug, thiserror::Error)]
pub enum Cause {
    /// The Kubernetes API.
    #[error(transparent)]
    Kube(#[from] ClusterError),
    /// The backend.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The Service's shard went to another replica between two steps.
    #[error("its shard is served by another replica now")]
    Moved,
}

/// A failed reconcile.
#[derive(Debug, thiserror::Error)]
#[error("{op} of the load balancer of Service {key} failed while {step}")]
pub struct ReconcileError {
    /// `apply` or `cleanup`.
    pub op: &'static str,
    /// What was being done.
    pub step: &'static str,
    /// The Service key.
    pub key: String,
    /// The Service's uid, when it exists (for the Event).
    pub uid: Option<String>,
    /// Why.
    #[source]
    pub cause: Cause,
}

impl ReconcileError {
    fn reason(&self) -> &'static str {
        match &self.cause {
            Cause::Kube(e) => e.reason(),
            Cause::Backend(e) => e.reason,
            Cause::Moved => "moved",
        }
    }
}

/// The controller: reconciles through `backend` and writes to Kubernetes through `kube` (the
/// API server by default; the unit tests give it an in-memory cluster).
#[derive(Debug)]
pub struct Controller<B, C = Kube> {
    kube: C,
    backend: B,
    view: SharedView,
    records: Records,
    queue: Arc<WorkQueue>,
    metrics: Metrics,
    /// Services told why they get no load balancer: key → (uid, message).
    told: Mutex<HashMap<String, (String, String)>>,
    /// The Services this replica reconciles.
    shards: Shards,
    /// Wakes the backend's maintenance when shards are gained.
    kick: Arc<Notify>,
    /// Which Services carry our finalizer.
    finalizers: FinalizerPolicy,
    /// The load balancer class this lbaas provides (`None`: Services that name none).
    lb_class: Option<String>,
}

/// Which Services get kuryr's finalizer (`--service-finalizer`).
///
/// The finalizer makes a Service's deletion wait until its load balancer is gone. Services
/// without it are still cleaned up: their ServiceLoadBalancer record (in kuryr's namespace,
/// written before the backend is programmed) outlives them, and a record without its Service is
/// removed with its load balancer as soon as lbaas sees it — at once, or after a restart or a
/// shard handover.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FinalizerPolicy {
    /// Only `type: LoadBalancer` Services, as Kubernetes' own service controllers do: deleting
    /// any other Service is immediate, as Kubernetes clients (and its conformance tests) expect.
    #[default]
    LoadBalancer,
    /// Every Service that gets a load balancer (Kuryr's behaviour).
    All,
    /// None.
    None,
}

impl FinalizerPolicy {
    /// Whether a Service of `service_type` carries the finalizer.
    pub fn wants(self, service_type: &str) -> bool {
        match self {
            FinalizerPolicy::LoadBalancer => service_type == "LoadBalancer",
            FinalizerPolicy::All => true,
            FinalizerPolicy::None => false,
        }
    }
}

impl<B: Backend, C: Cluster> Controller<B, C> {
    /// A controller writing through `kube` and programming `backend`.
    pub fn new(kube: C, backend: B, view: SharedView, records: Records, metrics: Metrics) -> Self {
        Self {
            kube,
            backend,
            view,
            records,
            queue: Arc::new(WorkQueue::default().counted_as("lbaas")),
            metrics,
            told: Mutex::default(),
            shards: Shards::all(),
            kick: Arc::default(),
            finalizers: FinalizerPolicy::default(),
            lb_class: None,
        }
    }

    /// Provides the load balancers of `type: LoadBalancer` Services of `class` (`None`: of those
    /// that name no class); the others get their cluster IP and node ports only.
    #[must_use]
    pub fn with_load_balancer_class(mut self, class: Option<String>) -> Self {
        self.lb_class = class;
        self
    }

    /// Puts the finalizer on the Services `policy` names.
    #[must_use]
    pub fn with_finalizers(mut self, policy: FinalizerPolicy) -> Self {
        self.finalizers = policy;
        self
    }

    /// Reconciles only the Services `shards` serves (every one by default).
    #[must_use]
    pub fn with_shards(mut self, shards: Shards) -> Self {
        self.shards = shards;
        self
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The records.
    pub fn records(&self) -> &Records {
        &self.records
    }

    /// Wakes the backend's maintenance.
    pub fn kick(&self) -> Arc<Notify> {
        self.kick.clone()
    }

    /// Starts the backend's background maintenance, feeding this controller's queue.
    pub fn start_maintenance(self: &Arc<Self>, shutdown: Shutdown) {
        let this = Arc::downgrade(self);
        let enqueue = Arc::new(move |key: &str| {
            if let Some(c) = this.upgrade() {
                c.enqueue(key);
            }
        });
        let shards = self.shards.clone();
        let serves = Arc::new(move |key: &str| shards.serves(key));
        self.backend.maintain(Maintenance {
            records: self.records.clone(),
            enqueue,
            shutdown,
            serves,
            kick: self.kick.clone(),
            view: self.view.clone(),
        });
    }

    /// The view.
    pub fn view(&self) -> &SharedView {
        &self.view
    }

    /// Queues a Service key for reconciling, when its shard is served here.
    pub fn enqueue(&self, key: &str) {
        if self.shards.serves(key) {
            self.queue.add(key);
            self.gauge_queue();
        }
    }

    /// Queues every Service held and every record (of the served shards): at the first complete
    /// snapshot this deletes records whose Service is gone and creates those missing.
    pub fn enqueue_all(&self) {
        self.enqueue_where(|_| true);
    }

    /// Queues every Service held and every record whose key matches `which` and is served
    /// here; returns how many.
    pub fn enqueue_where(&self, which: impl Fn(&str) -> bool) -> usize {
        let mut keys = locked(&self.view).keys();
        keys.extend(locked(&self.records).keys().cloned());
        keys.sort();
        keys.dedup();
        let mut n = 0;
        for k in keys.iter().filter(|k| which(k) && self.shards.serves(k)) {
            self.queue.add(k);
            n += 1;
        }
        self.gauge_queue();
        n
    }

    fn gauge_queue(&self) {
        self.metrics.queue_depth.set(i64::try_from(self.queue.depth()).unwrap_or(i64::MAX));
        self.metrics.queue_failing.set(i64::try_from(self.queue.failing()).unwrap_or(i64::MAX));
    }

    fn gauge_states(&self) {
        let mut counts: BTreeMap<String, i64> = BTreeMap::new();
        for r in locked(&self.records).values() {
            let state =
                r.status.as_ref().and_then(|s| s.provisioning_status.clone()).unwrap_or_else(|| "PENDING".into());
            *counts.entry(state).or_default() += 1;
        }
        self.metrics.set_states(&counts);
    }

    /// Runs `workers` workers until shutdown.
    pub fn spawn_workers(self: &Arc<Self>, workers: usize, shutdown: Shutdown) {
        self.gauge_states();
        self.queue.run_workers(workers, async move { shutdown.wait().await }, || {
            let this = self.clone();
            async move { this.work().await }
        });
    }

    async fn work(&self) {
        while let Some(key) = self.queue.next().await {
            self.gauge_queue();
            let started = Instant::now();
            // Every line logged while reconciling, the backend's included, names the Service.
            let span = tracing::info_span!("reconcile", service = %key);
            let (result, outcome) = match self.reconcile(&key).instrument(span).await {
                Ok(result) => (result, Outcome::Done),
                // Its shard moved while it ran: the new owner converges it from what is there.
                Err(e) if !self.shards.serves(&key) => {
                    tracing::info!(service = %key, error = chain(&e), "shard moved during the reconcile; left to its new owner");
                    (ELSEWHERE, Outcome::Done)
                }
                Err(e) => {
                    self.report(&e).await;
                    ("error", Outcome::Retry)
                }
            };
            self.metrics.reconcile.get_or_create(&ResultLabels { result }).observe(started.elapsed().as_secs_f64());
            self.queue.done(&key, outcome);
            self.gauge_queue();
            self.gauge_states();
        }
    }

    async fn report(&self, e: &ReconcileError) {
        let reason = e.reason();
        self.metrics.failed(e.op, reason);
        let error = chain(e);
        tracing::warn!(service = %e.key, op = e.op, reason, error, "reconcile failed; retrying with backoff");
        if let Some(uid) = &e.uid {
            let why = if e.op == "apply" { REASON_FAILED } else { REASON_CLEANUP_FAILED };
            let action = if e.op == "apply" { "Program" } else { "Delete" };
            self.kube.event(&e.key, uid, true, why, action, &error).await;
        }
    }

    /// Brings one Service key in line with its latest state; returns the result label.
    pub async fn reconcile(&self, key: &str) -> Result<&'static str, ReconcileError> {
        if !self.shards.serves(key) {
            return Ok(ELSEWHERE);
        }
        let (entry, slices) = {
            let v = locked(&self.view);
            (v.service(key).cloned(), v.slices(key))
        };
        let Some(entry) = entry.filter(|e| !e.deleting) else {
            let entry = locked(&self.view).service(key).cloned();
            self.cleanup(key, entry.as_ref()).await?;
            if entry.is_none() {
                locked(&self.told).remove(key);
            }
            return Ok("deleted");
        };
        let (namespace, name) = split(key);
        let slices: Vec<&EndpointSlice> = slices.iter().map(AsRef::as_ref).collect();
        let service = crate::core::spec::effective(&entry.service, self.lb_class.as_deref());
        let svc = ServiceRef { namespace, name, uid: &entry.uid, service: &service };
        match desired(&svc, &slices) {
            Desired::Lb(spec) => {
                self.apply(key, &entry, spec).await?;
                Ok("applied")
            }
            Desired::Skipped { message } => {
                self.tell_skipped(key, &entry.uid, &message).await;
                self.cleanup(key, Some(&entry)).await?;
                Ok("skipped")
            }
            Desired::Ignored => {
                self.cleanup(key, Some(&entry)).await?;
                Ok("ignored")
            }
        }
    }

    async fn tell_skipped(&self, key: &str, uid: &str, message: &str) {
        let told = (uid.to_string(), message.to_string());
        if locked(&self.told).get(key) == Some(&told) {
            return;
        }
        tracing::info!(service = key, reason = message, "no load balancer");
        self.kube.event(key, uid, false, REASON_SKIPPED, "Skip", message).await;
        locked(&self.told).insert(key.to_string(), told);
    }

    async fn apply(&self, key: &str, entry: &ServiceEntry, mut spec: LoadBalancerSpec) -> Result<(), ReconcileError> {
        let fail = |step: &'static str| {
            let uid = Some(entry.uid.clone());
            move |cause: Cause| ReconcileError { op: "apply", step, key: key.to_string(), uid, cause }
        };
        locked(&self.told).remove(key);
        if self.finalizers.wants(&spec.service_type) {
            if !entry.has_finalizer
                && !self.ensure_finalizer(key, &entry.uid).await.map_err(|e| fail("adding the finalizer")(e.into()))?
            {
                return Ok(());
            }
        } else if entry.has_finalizer && !entry.deleting {
            // Put there under another policy (or type): its deletion needs no wait any more.
            if let Some(meta) = self
                .kube
                .service(key)
                .await
                .map_err(|e| fail("reading the Service")(e.into()))?
                .filter(|m| m.uid == entry.uid)
            {
                self.kube
                    .remove_finalizer(key, &meta.uid, &meta.finalizers)
                    .await
                    .map_err(|e| fail("removing the finalizer")(e.into()))?;
            }
        }
        let want = ServiceLoadBalancerSpec::from_spec(&spec, self.backend.name());
        if !self.shards.serves(key) {
            return Err(fail("writing the record")(Cause::Moved));
        }
        let record = self.ensure_record(key, &want).await.map_err(|e| fail("writing the record")(e.into()))?;
        spec.generation = record.generation;
        if !self.shards.serves(key) {
            return Err(fail("programming the backend")(Cause::Moved));
        }
        let observed = match self.backend.ensure(key, &spec).await {
            Ok(o) => o,
            Err(e) => {
                if let Some(seen) = &e.observed {
                    self.record_unconverged(key, &record, seen).await;
                }
                return Err(fail("programming the backend")(e.into()));
            }
        };
        let status = ServiceLoadBalancerStatus {
            provisioning_status: Some(observed.provisioning_status),
            observed_generation: i64::try_from(observed.observed_generation).ok(),
            backend_id: Some(observed.backend_id).filter(|s| !s.is_empty()),
            ingress_ip: Some(observed.ingress_ip).filter(|s| !s.is_empty()),
            message: Some(observed.message).filter(|s| !s.is_empty()),
        };
        if record.status.as_ref() != Some(&status) {
            // The Service's ingress first: once the record says so, nothing would retry it.
            let old_ingress = record.status.as_ref().and_then(|s| s.ingress_ip.clone());
            if status.ingress_ip != old_ingress {
                let ips: Vec<String> = status.ingress_ip.iter().cloned().collect();
                self.kube
                    .set_ingress(key, &entry.uid, &ips)
                    .await
                    .map_err(|e| fail("writing the Service's load balancer ingress")(e.into()))?;
            }
            if let Err(e) = self.kube.write_status(key, &status).await {
                // Deleted behind our back: forget it, so that the retry creates it again.
                if matches!(e, ClusterError::NotFound(_)) {
                    locked(&self.records).remove(key);
                }
                return Err(fail("writing the status")(e.into()));
            }
            if let Some(r) = locked(&self.records).get_mut(key) {
                r.status = Some(status);
            }
            tracing::info!(service = key, generation = spec.generation, vips = ?spec.vips,
                listeners = spec.listeners.len(), members = spec.member_count(), "load balancer programmed");
        }
        Ok(())
    }

    /// Records what the backend saw although it did not converge (best effort: the failure itself
    /// is reported by the caller); the last converged generation stays.
    async fn record_unconverged(&self, key: &str, record: &Record, seen: &Observed) {
        let old = record.status.clone().unwrap_or_default();
        let status = ServiceLoadBalancerStatus {
            provisioning_status: Some(seen.provisioning_status.clone()).filter(|s| !s.is_empty()),
            observed_generation: old.observed_generation,
            backend_id: Some(seen.backend_id.clone()).filter(|s| !s.is_empty()).or(old.backend_id),
            ingress_ip: old.ingress_ip,
            message: Some(seen.message.clone()).filter(|s| !s.is_empty()),
        };
        if record.status.as_ref() == Some(&status) {
            return;
        }
        match self.kube.write_status(key, &status).await {
            Ok(()) => {
                if let Some(r) = locked(&self.records).get_mut(key) {
                    r.status = Some(status);
                }
            }
            Err(e) => tracing::debug!(service = key, error = %e, "could not record the unconverged status"),
        }
    }

    /// The record of `key` holding `want`: created, or its spec replaced; kept in `records`.
    async fn ensure_record(&self, key: &str, want: &ServiceLoadBalancerSpec) -> Result<Record, ClusterError> {
        let cached = locked(&self.records).get(key).cloned();
        let record = match cached {
            Some(r) if r.spec == *want => return Ok(r),
            Some(r) => match self.kube.replace_spec(key, &r.uid, want).await {
                Ok(r) => r,
                // Deleted or re-created behind our back: start from what the API holds.
                Err(ClusterError::NotFound(_) | ClusterError::Conflict(_)) => {
                    locked(&self.records).remove(key);
                    self.create_or_update(key, want).await?
                }
                Err(e) => return Err(e),
            },
            None => self.create_or_update(key, want).await?,
        };
        locked(&self.records).insert(key.to_string(), record.clone());
        Ok(record)
    }

    async fn create_or_update(&self, key: &str, want: &ServiceLoadBalancerSpec) -> Result<Record, ClusterError> {
        let r = self.kube.create_record(key, want).await?;
        if r.spec == *want { Ok(r) } else { self.kube.replace_spec(key, &r.uid, want).await }
    }

    /// Puts our finalizer on the Service unless it is there. Returns false when the Service is
    /// gone, re-created or being deleted (its next event says so; no finalizer may be added
    /// then). A conflict is settled by reading again at once rather than after a backoff.
    async fn ensure_finalizer(&self, key: &str, uid: &str) -> Result<bool, ClusterError> {
        let mut attempts = 0;
        loop {
            let Some(meta) = self.kube.service(key).await?.filter(|m| m.uid == uid) else { return Ok(false) };
            if meta.deleting {
                return Ok(false);
            }
            if meta.finalizers.iter().any(|f| f == FINALIZER) {
                return Ok(true);
            }
            attempts += 1;
            match self.kube.add_finalizer(key, uid, &meta.finalizers).await {
                Ok(()) => return Ok(true),
                Err(ClusterError::Conflict(_)) if attempts < FINALIZER_ATTEMPTS => {}
                Err(e) => return Err(e),
            }
        }
    }

    async fn cleanup(&self, key: &str, entry: Option<&ServiceEntry>) -> Result<(), ReconcileError> {
        let fail = |step: &'static str| {
            let uid = entry.map(|e| e.uid.clone());
            move |cause: Cause| ReconcileError { op: "cleanup", step, key: key.to_string(), uid, cause }
        };
        // Dataplanes hear first, so that they stop sending to the VIP before the record goes.
        self.backend.delete(key).await.map_err(|e| fail("removing the load balancer")(e.into()))?;
        let record = locked(&self.records).get(key).cloned();
        if let Some(r) = &record {
            self.kube.delete_record(key, &r.uid).await.map_err(|e| fail("deleting the record")(e.into()))?;
            locked(&self.records).remove(key);
            tracing::info!(service = key, "load balancer deleted");
        }
        if let Some(e) = entry
            && (e.has_finalizer || record.is_some())
        {
            let meta = self.kube.service(key).await.map_err(|e| fail("reading the Service")(e.into()))?;
            if let Some(meta) = meta.filter(|m| m.uid == e.uid) {
                self.kube
                    .remove_finalizer(key, &meta.uid, &meta.finalizers)
                    .await
                    .map_err(|e| fail("removing the finalizer")(e.into()))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "controller_tests.rs"]
mod tests;
