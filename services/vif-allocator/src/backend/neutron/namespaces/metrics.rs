//! Metrics of per-namespace networks (`kuryr_allocator_namespace_network_*`).

pub use kuryr_runtime::metrics::labels::{FailureLabels, OpLabels};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

kuryr_runtime::metric_set! {
    /// The metrics; cheap to clone.
    pub struct NamespaceMetrics {
        /// Namespace networks in service.
        pub networks: Gauge => "kuryr_allocator_namespace_network_networks", "Namespace networks in service";
        /// Networks made and removed.
        pub operations: Family<OpLabels, Counter>
            => "kuryr_allocator_namespace_network_operations",
            "Namespace networks made (create) and removed (delete)";
        /// Failed attempts (each is retried).
        pub failures: Family<FailureLabels, Counter>
            => "kuryr_allocator_namespace_network_failures",
            "Failed attempts to make or remove a namespace network, by reason";
        /// From the start of a removal (the last pod's port released) to the finalizer removed.
        pub cleanup_seconds: Histogram = kuryr_runtime::metrics::latency_histogram()
            => "kuryr_allocator_namespace_network_cleanup_seconds",
            "Removal of a namespace network, from start to the namespace's finalizer removed";
    }
}

impl NamespaceMetrics {
    /// Counts a success.
    pub fn done(&self, op: &'static str) {
        self.operations.get_or_create(&OpLabels { op }).inc();
    }

    /// Counts a failure.
    pub fn failed(&self, op: &'static str, reason: &'static str) {
        self.failures.get_or_create(&FailureLabels { op, reason }).inc();
    }
}
