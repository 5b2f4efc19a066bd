//! Metrics of every OpenStack call, registered in the service's registry beside the runtime's own
//! gRPC metrics. The crate does not depend on the service runtime: the latency buckets are its own,
//! from a millisecond (a cached Keystone answer, a port read on a quiet Neutron) to a minute (a
//! load balancer create on a busy Octavia).
//!
//! Attempts are counted, not logical calls: a port create retried twice after 503s counts three
//! requests (two `503`, one `201`) and two retries, which is what tells an operator that Neutron is
//! struggling and how many API calls a pod costs.

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::error::Call;

/// Latency buckets of OpenStack API requests, in seconds.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS.iter().copied())
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub service: String,
    pub operation: String,
    pub method: String,
    /// The HTTP status (`201`, `409`, ...), or the failure when there was no answer (`Timeout`,
    /// `ConnectFailed`, `TransportFailed`).
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub service: String,
    pub operation: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    pub service: String,
    pub operation: String,
    /// Why: `conflict`, `server_error`, `too_many_requests`, `connect`, `transport`, `timeout`.
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AuthLabels {
    /// `ok`, or the error's reason.
    pub result: String,
}

/// The client's metrics.
#[derive(Debug)]
pub struct Metrics {
    requests: Family<RequestLabels, Counter>,
    latency: Family<OperationLabels, Histogram, fn() -> Histogram>,
    retries: Family<RetryLabels, Counter>,
    authentications: Family<AuthLabels, Counter>,
}

impl Metrics {
    /// Creates the metrics and registers them (`openstack_requests_total`,
    /// `openstack_request_duration_seconds`, `openstack_request_retries_total`,
    /// `openstack_authentications_total`).
    pub fn register(registry: &mut Registry) -> Arc<Self> {
        let m = Self::unregistered();
        registry.register(
            "openstack_requests",
            "OpenStack API requests (attempts), by status code",
            m.requests.clone(),
        );
        registry.register(
            "openstack_request_duration_seconds",
            "OpenStack API request latency, per attempt",
            m.latency.clone(),
        );
        registry.register("openstack_request_retries", "OpenStack API requests retried, by reason", m.retries.clone());
        registry.register("openstack_authentications", "Keystone token requests, by result", m.authentications.clone());
        Arc::new(m)
    }

    /// Metrics that are kept but exported nowhere (tools, tests).
    pub fn unregistered() -> Self {
        Self {
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            retries: Family::default(),
            authentications: Family::default(),
        }
    }

    pub(crate) fn record_attempt(&self, call: Call, method: &Method, code: String, elapsed: Duration) {
        let service = call.service.as_str().to_string();
        let operation = call.operation.to_string();
        self.requests
            .get_or_create(&RequestLabels {
                service: service.clone(),
                operation: operation.clone(),
                method: method.as_str().to_string(),
                code,
            })
            .inc();
        self.latency.get_or_create(&OperationLabels { service, operation }).observe(elapsed.as_secs_f64());
    }

    pub(crate) fn record_retry(&self, call: Call, reason: &str) {
        self.retries
            .get_or_create(&RetryLabels {
                service: call.service.as_str().to_string(),
                operation: call.operation.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    pub(crate) fn record_auth(&self, result: &str) {
        self.authentications.get_or_create(&AuthLabels { result: result.to_string() }).inc();
    }

    /// Requests sent for `operation` that answered `code` (for tests and benchmarks).
    pub fn requests(&self, service: &str, operation: &str, method: &str, code: &str) -> u64 {
        self.requests
            .get_or_create(&RequestLabels {
                service: service.into(),
                operation: operation.into(),
                method: method.into(),
                code: code.into(),
            })
            .get()
    }

    /// Retries of `operation` for `reason`.
    pub fn retries(&self, service: &str, operation: &str, reason: &str) -> u64 {
        self.retries
            .get_or_create(&RetryLabels { service: service.into(), operation: operation.into(), reason: reason.into() })
            .get()
    }

    /// Successful Keystone authentications.
    pub fn authentications_ok(&self) -> u64 {
        self.authentications.get_or_create(&AuthLabels { result: "ok".into() }).get()
    }
}
