//! Metrics of per-namespace networks (`kuryr_allocator_namespace_network_*`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

/// What was being done.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    /// `create` or `delete`.
    pub op: &'static str,
}

/// A failure.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// `create` or `delete`.
    pub op: &'static str,
    /// The error's bounded label (`neutron_unavailable`, `neutron`, `api`, `conflict`, ...).
    pub reason: &'static str,
}

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
