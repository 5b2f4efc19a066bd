//! Metrics of the embedded IPAM's backend, the Kubernetes API: every call the store makes, timed
//! by operation, its failures by reason (a `conflict` is optimistic concurrency at work; many of
//! them mean allocators are fighting over one node's blocks), and the addresses free and used in
//! each node's blocks as this replica last read or wrote them — the embedded analogue of the
//! Neutron port pools.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use super::assign::Parsed;
use crate::core::ipam::Family as IpFamily;

kuryr_runtime::label_set! {
    /// One kind of API call of the store.
    pub struct OperationLabels {
        /// `get_network`, `apply_network`, `update_network_status`, `list_blocks`, `create_block`,
        /// `get_block` or `write_block_status`.
        operation,
    }
    /// A failed API call.
    pub struct ErrorLabels {
        /// As in [`OperationLabels`].
        operation,
        /// See [`error_reason`].
        reason,
    }
}

/// Addresses of one node's blocks of one family.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AddressLabels {
    /// The PodNetwork.
    pub network: String,
    /// The node owning the blocks.
    pub node: String,
    /// `ipv4` or `ipv6`.
    pub family: &'static str,
    /// `free` or `used`.
    pub state: &'static str,
}

kuryr_runtime::metric_set! {
    /// The store's metrics; cheap to clone. [`IpamMetrics::default`] makes them unregistered (kept,
    /// exported nowhere), which is what a store built without a registry uses.
    pub struct IpamMetrics {
        calls: Family<OperationLabels, Histogram, fn() -> Histogram>
            = Family::new_with_constructor(kuryr_runtime::metrics::latency_histogram)
            => "kuryr_allocator_ipam_api_request_duration_seconds",
            "Kubernetes API calls of the embedded IPAM, by operation, successful or not";
        errors: Family<ErrorLabels, Counter>
            => "kuryr_allocator_ipam_api_errors",
            "Failed Kubernetes API calls of the embedded IPAM, by operation and reason (conflict: a write lost \
             to another writer and was retried)";
        addresses: Family<AddressLabels, Gauge>
            => "kuryr_allocator_ipam_addresses",
            "Pod addresses in each node's address blocks by family and state (free, used), as this replica \
             last read or wrote them";
    }
}

impl IpamMetrics {
    /// Records one API call.
    pub(super) fn call(&self, operation: &'static str, took: Duration, error: Option<&kube::Error>) {
        self.calls.get_or_create(&OperationLabels { operation }).observe(took.as_secs_f64());
        if let Some(e) = error {
            self.errors.get_or_create(&ErrorLabels { operation, reason: error_reason(e) }).inc();
        }
    }

    /// Sets the address gauges of `node` from its blocks.
    pub(super) fn node_blocks(&self, network: &str, node: &str, blocks: &[Parsed]) {
        for family in [IpFamily::V4, IpFamily::V6] {
            let of_family = blocks.iter().filter(|p| p.block.family() == family);
            let (capacity, free) = of_family.fold((0u128, 0u128), |(c, f), p| (c + p.block.capacity(), f + p.free()));
            let name = family_label(family);
            if capacity == 0 && self.addresses.get(&labels(network, node, name, "free")).is_none() {
                // A family the node never had: no series at all rather than zeros.
                continue;
            }
            let gauge = |n: u128| i64::try_from(n).unwrap_or(i64::MAX);
            self.addresses.get_or_create(&labels(network, node, name, "free")).set(gauge(free));
            self.addresses.get_or_create(&labels(network, node, name, "used")).set(gauge(capacity - free));
        }
    }

    /// Failures of `operation` for `reason` so far (for tests).
    pub fn errors(&self, operation: &'static str, reason: &'static str) -> u64 {
        self.errors.get(&ErrorLabels { operation, reason }).map(|c| c.get()).unwrap_or(0)
    }

    /// The address gauge of `node`, `family` (`ipv4`, `ipv6`) and `state` (for tests).
    pub fn addresses(&self, network: &str, node: &str, family: &'static str, state: &'static str) -> Option<i64> {
        self.addresses.get(&labels(network, node, family, state)).map(|g| g.get())
    }
}

fn labels(network: &str, node: &str, family: &'static str, state: &'static str) -> AddressLabels {
    AddressLabels { network: network.to_string(), node: node.to_string(), family, state }
}

fn family_label(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ipv4",
        IpFamily::V6 => "ipv6",
    }
}

/// Why an API call failed, as a metric label: `conflict` (409, a stale resourceVersion),
/// `already_exists`, `not_found`, `forbidden`, `invalid`, `too_many_requests`, `server_error`
/// (5xx), `other` (another API answer) or `transport` (no answer: connection, TLS, timeout).
pub fn error_reason(e: &kube::Error) -> &'static str {
    match e {
        kube::Error::Api(s) if s.is_already_exists() => "already_exists",
        kube::Error::Api(s) if s.is_conflict() => "conflict",
        kube::Error::Api(s) if s.is_not_found() => "not_found",
        kube::Error::Api(s) if s.is_forbidden() => "forbidden",
        kube::Error::Api(s) if s.is_invalid() => "invalid",
        kube::Error::Api(s) if s.code == 429 => "too_many_requests",
        kube::Error::Api(s) if s.code >= 500 => "server_error",
        kube::Error::Api(_) => "other",
        _ => "transport",
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use crate::k8s::crd::{AddressBlock, AddressBlockSpec, AddressBlockStatus, BlockAllocation};

    fn block(cidr: &str, used: &[&str]) -> Parsed {
        let allocations = used
            .iter()
            .map(|ip| {
                let a =
                    BlockAllocation { namespace: "ns".into(), name: "p".into(), uid: ip.to_string(), mac: "m".into() };
                (ip.to_string(), a)
            })
            .collect();
        let obj = AddressBlock {
            metadata: ObjectMeta { name: Some(cidr.replace(['/', '.', ':'], "-")), ..Default::default() },
            spec: AddressBlockSpec { network: "net".into(), cidr: cidr.into(), node: "n1".into() },
            status: Some(AddressBlockStatus { allocations, used: used.len() as u32, last_allocated: None }),
        };
        Parsed::new(obj).unwrap()
    }

    #[test]
    fn addresses_per_node_and_family() {
        let m = IpamMetrics::default();
        // A /28 holds 13 pods (network, gateway and broadcast reserved).
        let v4 = block("10.0.0.0/28", &["10.0.0.2", "10.0.0.3"]);
        let capacity = v4.block.capacity() as i64;
        m.node_blocks("net", "n1", &[v4.clone(), block("10.0.0.16/28", &[])]);
        assert_eq!(m.addresses("net", "n1", "ipv4", "used"), Some(2));
        assert_eq!(m.addresses("net", "n1", "ipv4", "free"), Some(2 * capacity - 2));
        assert_eq!(m.addresses("net", "n1", "ipv6", "free"), None, "no IPv6 block, no series");
        m.node_blocks("net", "n1", &[block("10.0.0.0/28", &[])]);
        assert_eq!(m.addresses("net", "n1", "ipv4", "used"), Some(0));
        assert_eq!(m.addresses("net", "n1", "ipv4", "free"), Some(capacity));
    }

    #[test]
    fn errors_by_reason() {
        let api = |code: u16, reason: &str| {
            kube::Error::Api(Box::new(kube::core::Status::failure("x", reason).with_code(code)))
        };
        assert_eq!(error_reason(&api(409, "Conflict")), "conflict");
        assert_eq!(error_reason(&api(409, "AlreadyExists")), "already_exists");
        assert_eq!(error_reason(&api(404, "NotFound")), "not_found");
        assert_eq!(error_reason(&api(503, "ServiceUnavailable")), "server_error");
        assert_eq!(error_reason(&api(429, "TooManyRequests")), "too_many_requests");
        let m = IpamMetrics::default();
        m.call("write_block_status", Duration::from_millis(3), Some(&api(409, "Conflict")));
        m.call("write_block_status", Duration::from_millis(3), None);
        assert_eq!(m.errors("write_block_status", "conflict"), 1);
        assert_eq!(m.errors("write_block_status", "not_found"), 0);
    }
}
