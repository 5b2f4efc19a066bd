//! [`NamespaceNetwork`]: with the Neutron backend's per-namespace networks, what exists in
//! Neutron for one namespace.

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The Neutron network of one namespace (with `--neutron-namespace-subnets`): cluster-scoped,
/// named after the namespace. The spec says whose it is; the status what exists in Neutron.
/// The Neutron resources carry the cluster's and the namespace's tags, so they are found again
/// without this record; it is what operators read (`kubectl get namespacenetworks`).
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[kube(
    group = "kuryr.openstack.org",
    version = "v1alpha1",
    kind = "NamespaceNetwork",
    plural = "namespacenetworks",
    shortname = "nsnet",
    category = "kuryr",
    status = "NamespaceNetworkStatus",
    derive = "PartialEq",
    doc = "The Neutron network, subnets and router interfaces Kuryr made for one namespace.",
    printcolumn = r#"{"name": "Phase", "type": "string", "jsonPath": ".status.phase"}"#,
    printcolumn = r#"{"name": "Network", "type": "string", "jsonPath": ".status.networkId"}"#,
    printcolumn = r#"{"name": "CIDRs", "type": "string", "jsonPath": ".status.subnets[*].cidr"}"#,
    printcolumn = r#"{"name": "Router", "type": "string", "jsonPath": ".status.routerId", "priority": 1}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("a namespace network's spec is immutable"))]
#[serde(rename_all = "camelCase")]
pub struct NamespaceNetworkSpec {
    /// The namespace (also this object's name).
    pub namespace: String,
    /// The namespace's uid: a record of an earlier namespace of that name is stale.
    pub namespace_uid: String,
}

/// What exists in Neutron for a namespace.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespaceNetworkStatus {
    /// `Creating`, `Ready` (pods get ports on the network), `Deleting`, or `Failed` (the last
    /// attempt failed; `message` says why, and it is retried).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<NamespaceNetworkPhase>,
    /// The Neutron network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_id: Option<String>,
    /// Its subnets, one per subnet pool (IPv4, and IPv6 when configured).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subnets: Vec<NamespaceSubnet>,
    /// The router the subnets are attached to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_id: Option<String>,
    /// The last failure, or other detail for humans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Where a namespace network is in its life.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum NamespaceNetworkPhase {
    /// Being made.
    Creating,
    /// Network, subnets and router interfaces exist.
    Ready,
    /// The namespace is being deleted; waiting for its pods, then removing everything.
    Deleting,
    /// The last attempt failed; retried with backoff.
    Failed,
}

/// One subnet of a namespace network.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespaceSubnet {
    /// The Neutron subnet.
    pub id: String,
    /// Its CIDR, allocated from the subnet pool.
    pub cidr: String,
    /// The subnet pool it came from.
    pub subnet_pool_id: String,
    /// The router's port on the subnet (its address is the subnet's gateway).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_port_id: Option<String>,
}
