//! The embedded IPAM's resources: [`PodNetwork`] (a network's CIDRs and what its pods get) and
//! [`AddressBlock`] (one node's block of it, whose status holds the pods' addresses).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::core::ipam::{self, NetworkPlan, PlanError};

/// A pod network of the embedded IPAM.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "kuryr.openstack.org",
    version = "v1alpha1",
    kind = "PodNetwork",
    plural = "podnetworks",
    shortname = "podnet",
    category = "kuryr",
    status = "PodNetworkStatus",
    derive = "PartialEq",
    doc = "A pod network of Kuryr's embedded IPAM: CIDRs carved into per-node address blocks.",
    printcolumn = r#"{"name": "CIDRs", "type": "string", "jsonPath": ".spec.cidrs"}"#,
    printcolumn = r#"{"name": "Blocks", "type": "integer", "jsonPath": ".status.allocatedBlocks"}"#,
    printcolumn = r#"{"name": "MTU", "type": "integer", "jsonPath": ".spec.mtu", "priority": 1}"#,
    printcolumn = r#"{"name": "Bridge", "type": "string", "jsonPath": ".spec.bridge", "priority": 1}"#,
    printcolumn = r#"{"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct PodNetworkSpec {
    /// The network's CIDRs: at most one IPv4 and one IPv6 (dual-stack), host bits clear.
    #[schemars(length(min = 1, max = 2))]
    pub cidrs: Vec<String>,
    /// Prefix length of the IPv4 blocks nodes claim (default 24: 253 pods per block).
    #[serde(default = "default_ipv4_block_prefix")]
    #[schemars(range(min = 1, max = 30))]
    pub ipv4_block_prefix: u8,
    /// Prefix length of the IPv6 blocks nodes claim (default 112: 65534 pods per block).
    #[serde(default = "default_ipv6_block_prefix")]
    #[schemars(range(min = 96, max = 126))]
    pub ipv6_block_prefix: u8,
    /// The pods' interface MTU (default 1500; at least 1280 with IPv6).
    #[serde(default = "default_mtu")]
    #[schemars(range(min = 576, max = 65535))]
    pub mtu: u32,
    /// Extra routes for pods, besides the default route via their gateway.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<RouteSpec>,
    /// The Linux bridge on each node that pods are attached to and that carries the gateways.
    #[serde(default = "default_bridge")]
    #[schemars(length(min = 1, max = 15))]
    pub bridge: String,
}

fn default_ipv4_block_prefix() -> u8 {
    ipam::DEFAULT_IPV4_BLOCK_PREFIX
}
fn default_ipv6_block_prefix() -> u8 {
    ipam::DEFAULT_IPV6_BLOCK_PREFIX
}
fn default_mtu() -> u32 {
    ipam::DEFAULT_MTU
}
fn default_bridge() -> String {
    ipam::DEFAULT_BRIDGE.to_string()
}

impl PodNetworkSpec {
    /// A spec with these CIDRs and every other field at its default.
    pub fn new(cidrs: impl IntoIterator<Item = impl Into<String>>) -> PodNetworkSpec {
        PodNetworkSpec {
            cidrs: cidrs.into_iter().map(Into::into).collect(),
            ipv4_block_prefix: default_ipv4_block_prefix(),
            ipv6_block_prefix: default_ipv6_block_prefix(),
            mtu: default_mtu(),
            routes: Vec::new(),
            bridge: default_bridge(),
        }
    }

    /// Validates the spec into the IPAM's view of the network.
    pub fn plan(&self) -> Result<NetworkPlan, PlanError> {
        NetworkPlan::new(&self.cidrs, self.ipv4_block_prefix, self.ipv6_block_prefix)?
            .with_mtu(self.mtu)?
            .with_routes(self.routes.iter().map(|r| (r.destination.as_str(), r.gateway.as_deref())))?
            .with_bridge(&self.bridge)
    }
}

/// A route for pods.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteSpec {
    /// Destination CIDR, e.g. the Service CIDR `10.96.0.0/12`.
    pub destination: String,
    /// Next hop. In a PodNetwork, absent means via the pod's gateway of that family.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

/// What the allocator observed about a network.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodNetworkStatus {
    /// How many address blocks nodes have claimed from the network.
    #[serde(default)]
    pub allocated_blocks: u32,
    /// `Ready`: the spec is valid and addresses can be allocated (reason `Valid` or `InvalidSpec`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Human-readable summary, e.g. why the spec is invalid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// One block of a network's CIDR, claimed by one node. Named `<network>-<cidr>` with `.`, `:`
/// and `/` mapped to `-`, so that claiming is a create and a name clash means "already claimed".
/// `spec.network` and `spec.node` are selectable fields: an allocator lists only one node's
/// blocks (`--field-selector spec.network=pods,spec.node=node-a`), not the whole network's.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[kube(
    group = "kuryr.openstack.org",
    version = "v1alpha1",
    kind = "AddressBlock",
    plural = "addressblocks",
    shortname = "ablock",
    category = "kuryr",
    status = "AddressBlockStatus",
    derive = "PartialEq",
    doc = "A block of a PodNetwork's CIDR owned by one node; its status holds the block's pod addresses.",
    printcolumn = r#"{"name": "Network", "type": "string", "jsonPath": ".spec.network"}"#,
    printcolumn = r#"{"name": "CIDR", "type": "string", "jsonPath": ".spec.cidr"}"#,
    printcolumn = r#"{"name": "Node", "type": "string", "jsonPath": ".spec.node"}"#,
    printcolumn = r#"{"name": "Used", "type": "integer", "jsonPath": ".status.used"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#,
    selectable = ".spec.network",
    selectable = ".spec.node"
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("an address block's spec is immutable"))]
#[serde(rename_all = "camelCase")]
pub struct AddressBlockSpec {
    /// The PodNetwork the block belongs to.
    pub network: String,
    /// The block, e.g. `10.244.3.0/24`; its first usable address is the node's gateway.
    pub cidr: String,
    /// The node that owns the block: only its pods get addresses from it.
    pub node: String,
}

/// The addresses handed out from a block.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AddressBlockStatus {
    /// Pod address (no prefix length) → the pod holding it: `namespace`, `name`, `uid`, `mac`.
    // Atomic for the API server's field tracking: the map is only ever replaced whole, under a
    // resourceVersion precondition, so per-entry managedFields would be pure cost (they made a
    // status write grow with the block's size). And opaque to its validation: the API server
    // checked every entry of the block against the entry's schema on every status write, the
    // largest part of what a write cost it (a burst of 600 pods: 8.9 ms of API server and etcd
    // CPU per pod with the entries' schema, 7.6 ms without). The allocator reads the entries
    // leniently instead (see `BlockAllocation`); only the allocators may write the status.
    #[serde(default)]
    #[schemars(schema_with = "opaque_allocations")]
    pub allocations: BTreeMap<String, BlockAllocation>,
    /// How many addresses are allocated (for `kubectl get`).
    #[serde(default)]
    pub used: u32,
    /// The address handed out last; the next search starts after it so that a released address
    /// is not reused at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_allocated: Option<String>,
}

/// `allocations`' schema: an object kept whole, its entries unchecked by the API server.
fn opaque_allocations(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "default": {},
        "x-kubernetes-map-type": "atomic",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// The pod holding an address. Read leniently, as the API server does not check the entries: a
/// field that is missing or not a string reads as empty, so an entry of another shape still
/// holds its address and matches no pod (the address stays taken until an operator mends the
/// entry) instead of making the whole block, or the list of blocks, unreadable.
#[derive(Serialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct BlockAllocation {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's uid: the key for idempotent allocation and release.
    pub uid: String,
    /// The pod interface's MAC.
    pub mac: String,
}

impl<'de> Deserialize<'de> for BlockAllocation {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let entry = serde_json::Value::deserialize(d)?;
        let field = |key: &str| entry.get(key).and_then(serde_json::Value::as_str).unwrap_or_default().to_string();
        Ok(Self { namespace: field("namespace"), name: field("name"), uid: field("uid"), mac: field("mac") })
    }
}
