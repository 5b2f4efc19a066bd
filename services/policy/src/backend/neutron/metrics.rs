//! The Neutron backend's metrics (the Neutron calls themselves are counted by the OpenStack
//! client).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The operation that failed.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    /// `read`, `group_create`, `rule_create`, `rule_delete`, `port_update`, `group_delete`.
    pub operation: &'static str,
}

/// The backend's metrics (the Neutron calls themselves are counted by the OpenStack client:
/// `openstack_requests_total{service="network",operation}`).
#[derive(Clone, Debug)]
pub struct NeutronMetrics {
    /// Time of a pass that changed something, from its start to Neutron converged.
    pub converge: Histogram,
    /// Failures, by operation.
    pub errors: Family<OpLabels, Counter>,
    /// Security groups owned, and their rules.
    pub groups: Gauge,
    pub rules: Gauge,
    /// Ports whose groups were changed.
    pub port_updates: Counter,
    /// The generation of the desired state last handed over, and the last one Neutron fully
    /// holds (equal when converged).
    pub desired_generation: Gauge,
    pub applied_generation: Gauge,
}

impl NeutronMetrics {
    /// Creates the metrics and registers them.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            converge: kuryr_runtime::metrics::latency_histogram(),
            errors: Family::default(),
            groups: Gauge::default(),
            rules: Gauge::default(),
            port_updates: Counter::default(),
            desired_generation: Gauge::default(),
            applied_generation: Gauge::default(),
        };
        registry.register(
            "kuryr_policy_neutron_converge_seconds",
            "Time for Neutron to hold a new desired state (passes that changed something)",
            m.converge.clone(),
        );
        registry.register("kuryr_policy_neutron_errors", "Failed Neutron operations, by operation", m.errors.clone());
        registry.register("kuryr_policy_neutron_groups", "Security groups owned by kuryr-policy", m.groups.clone());
        registry.register("kuryr_policy_neutron_rules", "Rules of the owned security groups", m.rules.clone());
        registry.register(
            "kuryr_policy_neutron_port_updates",
            "Ports whose security groups were changed",
            m.port_updates.clone(),
        );
        registry.register(
            "kuryr_policy_neutron_desired_generation",
            "Generation of the desired Neutron state (one per change)",
            m.desired_generation.clone(),
        );
        registry.register(
            "kuryr_policy_neutron_applied_generation",
            "Last generation of the desired state Neutron fully holds",
            m.applied_generation.clone(),
        );
        m
    }
}
