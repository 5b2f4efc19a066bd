//! Services and EndpointSlices as lbaas takes them in: the watcher's reduction of each, as plain
//! data (the gRPC edge converts the `kuryr.watcher.v1` messages, [`crate::grpc::follow`]).
//!
//! Every field the watcher sends is kept, including those no load balancer depends on
//! (selector, `loadBalancerIP`, `externalName`, IP families, zones): the view compares what it
//! holds with what arrives, and a change to any of them queues the Service as it always has.

use std::collections::HashMap;

/// An object's identity and lifecycle, as the watcher reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    /// metadata.namespace.
    pub namespace: String,
    /// metadata.name.
    pub name: String,
    /// metadata.uid.
    pub uid: String,
    /// metadata.deletionTimestamp is set.
    pub deleting: bool,
}

/// A Service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Service {
    /// spec.type (empty: ClusterIP).
    pub r#type: String,
    /// spec.clusterIPs (`None` for a headless Service).
    pub cluster_ips: Vec<String>,
    /// spec.ports.
    pub ports: Vec<ServicePort>,
    /// spec.selector.
    pub selector: HashMap<String, String>,
    /// spec.sessionAffinity.
    pub session_affinity: String,
    /// spec.sessionAffinityConfig.clientIP.timeoutSeconds (0: unset).
    pub session_affinity_timeout_seconds: i32,
    /// spec.loadBalancerIP.
    pub load_balancer_ip: String,
    /// spec.externalName.
    pub external_name: String,
    /// spec.ipFamilies.
    pub ip_families: Vec<String>,
    /// metadata.finalizers.
    pub finalizers: Vec<String>,
    /// spec.externalTrafficPolicy.
    pub external_traffic_policy: String,
    /// spec.internalTrafficPolicy.
    pub internal_traffic_policy: String,
    /// spec.externalIPs.
    pub external_ips: Vec<String>,
    /// status.loadBalancer.ingress[].ip.
    pub load_balancer_ingress_ips: Vec<String>,
    /// spec.loadBalancerClass.
    pub load_balancer_class: String,
}

/// A Service port.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServicePort {
    /// The port's name (may be empty for a single port).
    pub name: String,
    /// TCP, UDP or SCTP (empty: TCP).
    pub protocol: String,
    /// The Service port.
    pub port: i32,
    /// targetPort: a number or a port name.
    pub target_port: String,
    /// The node port; 0 when none.
    pub node_port: i32,
}

/// An EndpointSlice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointSlice {
    /// The Service its `kubernetes.io/service-name` label names; empty when none.
    pub service_name: String,
    /// IPv4, IPv6 or FQDN.
    pub address_type: String,
    /// The endpoints.
    pub endpoints: Vec<Endpoint>,
    /// The ports, resolved for these endpoints.
    pub ports: Vec<EndpointPort>,
}

/// One endpoint of a slice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Endpoint {
    /// Its addresses.
    pub addresses: Vec<String>,
    /// Condition `ready`.
    pub ready: bool,
    /// Condition `serving`.
    pub serving: bool,
    /// Condition `terminating`.
    pub terminating: bool,
    /// The node it runs on.
    pub node_name: String,
    /// The pod behind it (`namespace/name`).
    pub target_pod: String,
    /// Its zone.
    pub zone: String,
}

/// A port of a slice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointPort {
    /// The Service port's name it serves.
    pub name: String,
    /// TCP, UDP or SCTP.
    pub protocol: String,
    /// The port on the endpoints.
    pub port: i32,
}
