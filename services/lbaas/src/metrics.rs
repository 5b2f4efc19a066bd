//! lbaas' own Prometheus metrics, registered on the runtime's registry next to the gRPC call
//! metrics.

use std::collections::BTreeMap;

pub use kuryr_runtime::metrics::labels::{FailureLabels, ResultLabels, StartLabels};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

/// Load balancers by state.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    /// The provisioning status (`PROGRAMMED`, ...), or `PENDING` before the backend reported.
    pub state: String,
}

kuryr_runtime::metric_set! {
    /// The metrics; cheap to clone (each is a handle to shared state).
    pub struct Metrics {
        /// Services waiting for a worker.
        pub queue_depth: Gauge => "kuryr_lbaas_queue_depth", "Services waiting for a worker";
        /// Services whose last reconcile failed and is being retried.
        pub queue_failing: Gauge
            => "kuryr_lbaas_queue_failing", "Services whose last reconcile failed and is being retried";
        /// Reconcile latency by result.
        pub reconcile: Family<ResultLabels, Histogram>
            = Family::new_with_constructor(kuryr_runtime::metrics::latency_histogram)
            => "kuryr_lbaas_reconcile_seconds",
            "Reconcile latency by result (applied, deleted, skipped, ignored, elsewhere, error)";
        /// Failed reconciles, each retried with backoff.
        pub failures: Family<FailureLabels, Counter>
            => "kuryr_lbaas_failures", "Failed reconciles by operation and reason (each retried with backoff)";
        /// Load balancers recorded, by state.
        pub load_balancers: Family<StateLabels, Gauge>
            => "kuryr_lbaas_load_balancers", "Load balancers recorded, by state";
        /// Open WatchLoadBalancers streams.
        pub subscribers: Gauge => "kuryr_lbaas_watch_subscribers", "Open WatchLoadBalancers streams";
        /// WatchLoadBalancers streams begun, by how.
        pub subscriptions: Family<StartLabels, Counter>
            => "kuryr_lbaas_watch_subscriptions",
            "WatchLoadBalancers streams begun, by how they began (snapshot, resume, reset, lagged)";
        /// Times the watcher's stream broke or could not be opened.
        pub watcher_reconnects: Counter
            => "kuryr_lbaas_watcher_reconnects", "Times the watcher's Subscribe stream broke or could not be opened";
        /// Changes to records of shards served by other replicas, followed from the API.
        pub mirrored: Counter
            => "kuryr_lbaas_records_mirrored",
            "Changes to the records of shards served by other replicas, followed from the API";
        /// Failures of the watch on the records.
        pub mirror_errors: Counter
            => "kuryr_lbaas_record_watch_errors",
            "Failures of the watch on the ServiceLoadBalancer records (retried with backoff)";
    }
}

impl Metrics {
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
