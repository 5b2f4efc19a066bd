//! The Neutron backend's metrics (the Neutron calls themselves are counted by the OpenStack
//! client).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

kuryr_runtime::label_set! {
    /// The operation that failed.
    pub struct OpLabels {
        /// `read`, `group_create`, `rule_create`, `rule_delete`, `port_update`, `group_delete`.
        operation,
    }
}

kuryr_runtime::metric_set! {
    /// The backend's metrics (the Neutron calls themselves are counted by the OpenStack client:
    /// `openstack_requests_total{service="network",operation}`).
    pub struct NeutronMetrics {
        /// Time of a pass that changed something, from its start to Neutron converged.
        pub converge: Histogram = kuryr_runtime::metrics::latency_histogram()
            => "kuryr_policy_neutron_converge_seconds",
            "Time for Neutron to hold a new desired state (passes that changed something)";
        /// Failures, by operation.
        pub errors: Family<OpLabels, Counter>
            => "kuryr_policy_neutron_errors", "Failed Neutron operations, by operation";
        /// Security groups owned, and their rules.
        pub groups: Gauge => "kuryr_policy_neutron_groups", "Security groups owned by kuryr-policy";
        pub rules: Gauge => "kuryr_policy_neutron_rules", "Rules of the owned security groups";
        /// Ports whose groups were changed.
        pub port_updates: Counter
            => "kuryr_policy_neutron_port_updates", "Ports whose security groups were changed";
        /// The generation of the desired state last handed over, and the last one Neutron fully
        /// holds (equal when converged).
        pub desired_generation: Gauge
            => "kuryr_policy_neutron_desired_generation", "Generation of the desired Neutron state (one per change)";
        pub applied_generation: Gauge
            => "kuryr_policy_neutron_applied_generation", "Last generation of the desired state Neutron fully holds";
    }
}
