//! The desired load balancer of a Service, as plain data: what [`crate::core::spec::desired`]
//! computes, what the records hold and what the backends program. It carries the same fields as
//! the `kuryr.lbaas.v1.LoadBalancerSpec` message, which the gRPC edge builds from it
//! ([`crate::grpc::convert`]).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The transport protocol of a listener.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// TCP (also what a Service port without a protocol means).
    #[default]
    Tcp,
    /// UDP.
    Udp,
    /// SCTP (where the backend supports it).
    Sctp,
}

impl Protocol {
    /// A Service port's protocol as Kubernetes spells it (empty: TCP); `None` for others.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "TCP" | "" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// As Kubernetes spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

/// Which endpoints a class of traffic may go to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TrafficPolicy {
    /// Every endpoint of the Service, wherever it runs (what Kubernetes defaults to).
    #[default]
    Cluster,
    /// Only endpoints on the node that received the traffic.
    Local,
}

impl TrafficPolicy {
    /// A traffic policy as the Service names it: Local, or Cluster for anything else.
    pub fn parse(s: &str) -> Self {
        if s == "Local" { TrafficPolicy::Local } else { TrafficPolicy::Cluster }
    }
}

/// Client affinity for a Service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SessionAffinity {
    /// ClientIP affinity requested.
    pub client_ip: bool,
    /// How long a client stays with its member, in seconds (0 without affinity).
    pub timeout_seconds: u32,
}

// Also the stored shape of a member in a ServiceLoadBalancer's spec (`k8s::crd::ListenerSpec`),
// hence its serde names and schema; the doc comments become the CRD's descriptions.
/// One backend endpoint.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Member {
    /// The endpoint address.
    pub address: String,
    /// The target port on the member.
    pub port: u32,
    /// EndpointSlice condition `ready`: traffic goes to ready members.
    pub ready: bool,
    /// EndpointSlice condition `serving`: may receive traffic even while terminating.
    pub serving: bool,
    /// EndpointSlice condition `terminating`.
    #[serde(default)]
    pub terminating: bool,
    /// The node the member runs on.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node_name: String,
    /// The pod behind the endpoint (`namespace/name`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub target_pod: String,
}

/// The backends of one listener.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pool {
    /// Members from the Service's EndpointSlices.
    pub members: Vec<Member>,
}

/// A Service port: what the load balancer listens on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listener {
    /// The transport protocol.
    pub protocol: Protocol,
    /// The Service port.
    pub port: u32,
    /// The Service port's name (may be empty for a single-port Service).
    pub name: String,
    /// Where the traffic goes.
    pub pool: Option<Pool>,
    /// The node port (types NodePort and LoadBalancer); 0 when there is none.
    pub node_port: u32,
}

impl Listener {
    /// The members of its pool (none without a pool).
    pub fn members(&self) -> &[Member] {
        self.pool.as_ref().map(|p| p.members.as_slice()).unwrap_or_default()
    }
}

/// The desired load balancer of one Service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadBalancerSpec {
    /// The Service's namespace.
    pub namespace: String,
    /// The Service's name.
    pub name: String,
    /// The Service's metadata.uid.
    pub uid: String,
    /// The virtual IPs: the Service's cluster IPs (both families when dual-stack).
    pub vips: Vec<String>,
    /// One listener per Service port and protocol, in the Service's order.
    pub listeners: Vec<Listener>,
    /// spec.sessionAffinity of the Service.
    pub session_affinity: Option<SessionAffinity>,
    /// The Service type: ClusterIP, NodePort or LoadBalancer.
    pub service_type: String,
    /// Raised on every change of the spec (the record's metadata.generation); 0 until recorded.
    pub generation: u64,
    /// spec.externalIPs.
    pub external_ips: Vec<String>,
    /// status.loadBalancer.ingress[].ip.
    pub ingress_ips: Vec<String>,
    /// spec.externalTrafficPolicy: for node ports, external IPs and ingress IPs.
    pub external_traffic_policy: TrafficPolicy,
    /// spec.internalTrafficPolicy: for the cluster IPs.
    pub internal_traffic_policy: TrafficPolicy,
}

impl LoadBalancerSpec {
    /// Members over all listeners.
    pub fn member_count(&self) -> usize {
        self.listeners.iter().map(|l| l.members().len()).sum()
    }
}
