//! Metrics of per-namespace networks (`kuryr_allocator_namespace_network_*`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

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

/// The metrics; cheap to clone.
#[derive(Clone, Debug)]
pub struct NamespaceMetrics {
    /// Namespace networks in service.
    pub networks: Gauge,
    /// Networks made and removed.
    pub operations: Family<OpLabels, Counter>,
    /// Failed attempts (each is retried).
    pub failures: Family<FailureLabels, Counter>,
    /// From the start of a removal (the last pod's port released) to the finalizer removed.
    pub cleanup_seconds: Histogram,
}

impl Default for NamespaceMetrics {
    fn default() -> Self {
        Self {
            networks: Gauge::default(),
            operations: Family::default(),
            failures: Family::default(),
            cleanup_seconds: kuryr_runtime::metrics::latency_histogram(),
        }
    }
}

impl NamespaceMetrics {
    /// Creates the metrics and registers them.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("kuryr_allocator_namespace_network");
        r.register("networks", "Namespace networks in service", m.networks.clone());
        r.register("operations", "Namespace networks made (create) and removed (delete)", m.operations.clone());
        r.register("failures", "Failed attempts to make or remove a namespace network, by reason", m.failures.clone());
        r.register(
            "cleanup_seconds",
            "Removal of a namespace network, from start to the namespace's finalizer removed",
            m.cleanup_seconds.clone(),
        );
        m
    }

    /// Counts a success.
    pub fn done(&self, op: &'static str) {
        self.operations.get_or_create(&OpLabels { op }).inc();
    }

    /// Counts a failure.
    pub fn failed(&self, op: &'static str, reason: &'static str) {
        self.failures.get_or_create(&FailureLabels { op, reason }).inc();
    }
}
