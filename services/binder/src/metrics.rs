//! The binder's CNI metrics: requests by operation and CNI code, their latency (by operation and
//! code too: a fast failure and a slow success must not blur into one histogram) in millisecond
//! buckets, how long ADD waited for the VIF to be known, and how long it then waited for the
//! plugged VIF to be ready (the backend's confirmation: at once for the embedded IPAM, Neutron's
//! ACTIVE for ports).

use std::time::Duration;

use kuryr_runtime::metrics::latency_histogram;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpCode {
    op: String,
    /// The CNI error code, "0" for success.
    code: String,
}

/// CNI metrics; cheap to clone.
#[derive(Clone, Debug)]
pub struct CniMetrics {
    requests: Family<OpCode, Counter>,
    duration: Family<OpCode, Histogram, fn() -> Histogram>,
    vif_wait: Histogram,
    ready_wait: Histogram,
}

impl CniMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            requests: Family::default(),
            duration: Family::new_with_constructor(latency_histogram),
            vif_wait: latency_histogram(),
            ready_wait: latency_histogram(),
        };
        registry.register(
            "kuryr_cni_requests",
            "CNI operations by operation and CNI result code (0: success)",
            m.requests.clone(),
        );
        registry.register(
            "kuryr_cni_request_duration_seconds",
            "CNI operation duration in the binder, by operation and CNI result code",
            m.duration.clone(),
        );
        registry.register(
            "kuryr_cni_add_vif_wait_seconds",
            "Time ADD waited for the pod's VIF to be known",
            m.vif_wait.clone(),
        );
        registry.register(
            "kuryr_cni_add_ready_wait_seconds",
            "Time ADD waited, once the VIF was plugged and reported, for the backend to make it ready",
            m.ready_wait.clone(),
        );
        m
    }

    pub fn observe(&self, op: &str, code: Option<u32>, took: Duration) {
        let labels = OpCode { op: op.into(), code: code.unwrap_or(0).to_string() };
        self.requests.get_or_create(&labels).inc();
        self.duration.get_or_create(&labels).observe(took.as_secs_f64());
    }

    pub fn observe_vif_wait(&self, vif_wait: Duration) {
        self.vif_wait.observe(vif_wait.as_secs_f64());
    }

    pub fn observe_ready_wait(&self, ready_wait: Duration) {
        self.ready_wait.observe(ready_wait.as_secs_f64());
    }
}
