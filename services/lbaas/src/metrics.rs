//! lbaas' own Prometheus metrics, registered on the runtime's registry next to the gRPC call
//! metrics.

use std::collections::BTreeMap;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// How a reconcile ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `applied`, `deleted`, `skipped` (ExternalName), `ignored` (headless),
    /// `elsewhere` (its shard is served by another replica) or `error`.
    pub result: &'static str,
}

/// Why a reconcile failed.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// `apply` or `cleanup`.
    pub op: &'static str,
    /// The error's kind: `conflict`, `not_found`, `api`, `backend`.
    pub reason: &'static str,
}

/// Load balancers by state.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    /// The provisioning status (`PROGRAMMED`, ...), or `PENDING` before the backend reported.
    pub state: String,
}

/// How a WatchLoadBalancers stream began.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StartLabels {
    /// `snapshot`, `resume`, `reset` or `lagged`.
    pub start: &'static str,
}

/// The metrics; cheap to clone (each is a handle to shared state).
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Services waiting for a worker.
    pub queue_depth: Gauge,
    /// Services whose last reconcile failed and is being retried.
    pub queue_failing: Gauge,
    /// Reconcile latency by result.
    pub reconcile: Family<ResultLabels, Histogram>,
    /// Failed reconciles, each retried with backoff.
    pub failures: Family<FailureLabels, Counter>,
    /// Load balancers recorded, by state.
    pub load_balancers: Family<StateLabels, Gauge>,
    /// Open WatchLoadBalancers streams.
    pub subscribers: Gauge,
    /// WatchLoadBalancers streams begun, by how.
    pub subscriptions: Family<StartLabels, Counter>,
    /// Times the watcher's stream broke or could not be opened.
    pub watcher_reconnects: Counter,
    /// Changes to records of shards served by other replicas, followed from the API.
    pub mirrored: Counter,
    /// Failures of the watch on the records.
    pub mirror_errors: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            queue_depth: Gauge::default(),
            queue_failing: Gauge::default(),
            reconcile: Family::new_with_constructor(kuryr_runtime::metrics::latency_histogram),
            failures: Family::default(),
            load_balancers: Family::default(),
            subscribers: Gauge::default(),
            subscriptions: Family::default(),
            watcher_reconnects: Counter::default(),
            mirrored: Counter::default(),
            mirror_errors: Counter::default(),
        }
    }
}

impl Metrics {
    /// Creates the metrics and registers them.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register("kuryr_lbaas_queue_depth", "Services waiting for a worker", m.queue_depth.clone());
        registry.register(
            "kuryr_lbaas_queue_failing",
            "Services whose last reconcile failed and is being retried",
            m.queue_failing.clone(),
        );
        registry.register(
            "kuryr_lbaas_reconcile_seconds",
            "Reconcile latency by result (applied, deleted, skipped, ignored, elsewhere, error)",
            m.reconcile.clone(),
        );
        registry.register(
            "kuryr_lbaas_failures",
            "Failed reconciles by operation and reason (each retried with backoff)",
            m.failures.clone(),
        );
        registry.register("kuryr_lbaas_load_balancers", "Load balancers recorded, by state", m.load_balancers.clone());
        registry.register("kuryr_lbaas_watch_subscribers", "Open WatchLoadBalancers streams", m.subscribers.clone());
        registry.register(
            "kuryr_lbaas_watch_subscriptions",
            "WatchLoadBalancers streams begun, by how they began (snapshot, resume, reset, lagged)",
            m.subscriptions.clone(),
        );
        registry.register(
            "kuryr_lbaas_watcher_reconnects",
            "Times the watcher's Subscribe stream broke or could not be opened",
            m.watcher_reconnects.clone(),
        );
        registry.register(
            "kuryr_lbaas_records_mirrored",
            "Changes to the records of shards served by other replicas, followed from the API",
            m.mirrored.clone(),
        );
        registry.register(
            "kuryr_lbaas_record_watch_errors",
            "Failures of the watch on the ServiceLoadBalancer records (retried with backoff)",
            m.mirror_errors.clone(),
        );
        m
    }

    /// Counts a failed reconcile.
    pub fn failed(&self, op: &'static str, reason: &'static str) {
        self.failures.get_or_create(&FailureLabels { op, reason }).inc();
    }

    /// Sets the load balancer counts by state; states no longer present go to 0.
    pub fn set_states(&self, counts: &BTreeMap<String, i64>) {
        for state in ["PENDING", crate::backend::PROGRAMMED] {
            if !counts.contains_key(state) {
                self.load_balancers.get_or_create(&StateLabels { state: state.into() }).set(0);
            }
        }
        for (state, n) in counts {
            self.load_balancers.get_or_create(&StateLabels { state: state.clone() }).set(*n);
        }
    }
}
