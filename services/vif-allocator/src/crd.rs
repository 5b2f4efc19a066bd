//! The allocator's custom resources (group `kuryr.openstack.org`, version `v1alpha1`).
//!
//! - [`PodNetwork`] (cluster-scoped): a pod network of the embedded IPAM — its CIDRs, how they are
//!   carved into per-node blocks, and what pods get besides addresses (MTU, routes, bridge).
//! - [`AddressBlock`] (cluster-scoped): one block of a network claimed by one node; its status
//!   holds the block's allocations. Every allocation is a status write carrying the
//!   resourceVersion it was computed from, so concurrent allocators cannot hand out one address
//!   twice (see [`crate::ipam::store`]).
//! - [`PodVif`] (namespaced, named after its pod): the VIF a pod was given and where it is in its
//!   life. Unlike Kuryr's KuryrPort it has a status subresource, so the spec (whose pod) and the
//!   status (what it got) are written by different hands without last-writer-wins.
//! - [`NamespaceNetwork`] (cluster-scoped, named after its namespace): with the Neutron backend's
//!   per-namespace networks, the network, subnets and router interfaces of one namespace.
//!
//! The manifests in `deploy/crds/` are generated from these types; a unit test fails when they
//! are stale, and `KURYR_UPDATE_CRDS=1 cargo test -p kuryr-vif-allocator crd` rewrites them.

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ipam::{self, NetworkPlan, PlanError, VifConfig};

/// The API group of every Kuryr resource.
pub const GROUP: &str = "kuryr.openstack.org";

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
    /// Pod address (no prefix length) → the pod holding it.
    // Atomic for the API server's field tracking: the map is only ever replaced whole, under a
    // resourceVersion precondition, so per-entry managedFields would be pure cost (they made a
    // status write grow with the block's size).
    #[serde(default)]
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub allocations: BTreeMap<String, BlockAllocation>,
    /// How many addresses are allocated (for `kubectl get`).
    #[serde(default)]
    pub used: u32,
    /// The address handed out last; the next search starts after it so that a released address
    /// is not reused at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_allocated: Option<String>,
}

/// The pod holding an address.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
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

/// The VIF of one pod; named after the pod, in the pod's namespace.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "kuryr.openstack.org",
    version = "v1alpha1",
    kind = "PodVif",
    plural = "podvifs",
    shortname = "pvif",
    category = "kuryr",
    namespaced,
    status = "PodVifStatus",
    derive = "PartialEq",
    doc = "The virtual interface Kuryr gave a pod, and where it is in its life.",
    printcolumn = r#"{"name": "Node", "type": "string", "jsonPath": ".spec.nodeName"}"#,
    printcolumn = r#"{"name": "State", "type": "string", "jsonPath": ".status.state"}"#,
    printcolumn = r#"{"name": "IPs", "type": "string", "jsonPath": ".status.vif.ips[*].address"}"#,
    printcolumn = r#"{"name": "MAC", "type": "string", "jsonPath": ".status.vif.mac", "priority": 1}"#,
    printcolumn = r#"{"name": "Network", "type": "string", "jsonPath": ".spec.network", "priority": 1}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct PodVifSpec {
    /// The pod's uid; a PodVif with another uid than the pod's is stale.
    pub pod_uid: String,
    /// The pod's name (also this object's name).
    pub pod_name: String,
    /// The node the pod is scheduled to.
    pub node_name: String,
    /// The PodNetwork (embedded IPAM) or Neutron network the VIF is on.
    pub network: String,
}

/// The VIF and its state.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodVifStatus {
    /// The VIF, once allocated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vif: Option<VifRecord>,
    /// Where the VIF is in its life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<VifState>,
    /// Why the VIF failed, or other detail for humans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// A VIF as recorded: the allocator's `Vif` message less the pod and state.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VifRecord {
    /// The backend's identifier (Neutron port id, or `<network>/<address>` for the embedded IPAM).
    pub vif_id: String,
    /// Lower-case, colon-separated.
    pub mac: String,
    /// Interface MTU.
    pub mtu: u32,
    /// Addresses (CIDR notation, the subnet's prefix length) with their gateways.
    pub ips: Vec<VifIp>,
    /// Routes besides the default routes implied by the gateways.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<RouteSpec>,
    /// The bridge the host end is attached to.
    pub bridge: String,
    /// How the host end is attached: a Linux bridge when absent (the embedded backend), or
    /// Open vSwitch with the port id as `iface-id` (Neutron).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binding: Option<VifBinding>,
    /// The backend that allocated the VIF (`neutron`); the embedded IPAM when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The backend's network (the Neutron network id); the PodNetwork when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_id: Option<String>,
    /// The backend's subnets of the addresses (Neutron subnet ids).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subnet_ids: Vec<String>,
    /// Security groups of the port (Neutron).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub security_groups: Vec<String>,
}

/// How a VIF's host end is attached.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum VifBinding {
    /// A veth into the node's Linux bridge.
    Bridge,
    /// A veth into an Open vSwitch bridge with the `external_ids` Neutron's agent expects.
    Ovs,
}

impl VifRecord {
    /// Records an embedded-IPAM VIF under `vif_id`.
    pub fn from_config(vif_id: impl Into<String>, vif: &VifConfig) -> VifRecord {
        VifRecord {
            vif_id: vif_id.into(),
            mac: vif.mac.to_string(),
            mtu: vif.mtu,
            ips: vif
                .ips
                .iter()
                .map(|c| VifIp { address: c.address.to_string(), gateway: Some(c.gateway.to_string()) })
                .collect(),
            routes: vif
                .routes
                .iter()
                .map(|r| RouteSpec {
                    destination: r.destination.to_string(),
                    gateway: r.gateway.map(|g| g.to_string()),
                })
                .collect(),
            bridge: vif.bridge.clone(),
            ..VifRecord::default()
        }
    }
}

/// One address of a VIF.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VifIp {
    /// Address with prefix length, e.g. `10.244.3.7/24`.
    pub address: String,
    /// The subnet's gateway, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

/// Where a VIF is in its life.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum VifState {
    /// Allocated and recorded; not yet plugged by the binder.
    Allocated,
    /// The binder plugged it; the backend has not confirmed it yet.
    Plugged,
    /// Usable: CNI ADD may return.
    Ready,
    /// Allocation or binding failed; `message` says why.
    Failed,
}

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

/// Every CRD of the allocator, with the file it is kept in under `deploy/crds/`.
pub fn crds() -> Vec<(&'static str, CustomResourceDefinition)> {
    vec![
        ("kuryr.openstack.org_podnetworks.yaml", PodNetwork::crd()),
        ("kuryr.openstack.org_addressblocks.yaml", AddressBlock::crd()),
        ("kuryr.openstack.org_podvifs.yaml", PodVif::crd()),
        ("kuryr.openstack.org_namespacenetworks.yaml", NamespaceNetwork::crd()),
    ]
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use serde_json::json;

    use super::*;

    const HEADER: &str = "# Generated from services/vif-allocator/src/crd.rs; do not edit.\n\
                          # Regenerate: KURYR_UPDATE_CRDS=1 cargo test -p kuryr-vif-allocator crd\n";

    fn render(crd: &CustomResourceDefinition) -> String {
        format!("{HEADER}{}", serde_saphyr::to_string(crd).unwrap())
    }

    fn crd_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds")
    }

    /// The committed manifests must be what the types generate. With `KURYR_UPDATE_CRDS=1` the
    /// test rewrites them instead (reading the environment is fine: nothing here sets it).
    #[test]
    fn crd_manifests_are_current() {
        let update = std::env::var("KURYR_UPDATE_CRDS").is_ok_and(|v| v == "1");
        let dir = crd_dir();
        let mut stale = Vec::new();
        for (file, crd) in crds() {
            let path = dir.join(file);
            let want = render(&crd);
            let have = std::fs::read_to_string(&path).unwrap_or_default();
            if have == want {
                continue;
            }
            if update {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &want).unwrap();
                eprintln!("rewrote {}", path.display());
                continue;
            }
            let line = have.lines().zip(want.lines()).position(|(a, b)| a != b);
            let hint = match line {
                Some(i) => format!(
                    "first difference at line {}:\n  committed: {}\n  generated: {}",
                    i + 1,
                    have.lines().nth(i).unwrap_or_default(),
                    want.lines().nth(i).unwrap_or_default()
                ),
                None if have.is_empty() => "missing".to_string(),
                None => format!("lengths differ ({} vs {} lines)", have.lines().count(), want.lines().count()),
            };
            stale.push(format!("{}: {hint}", path.display()));
        }
        assert!(
            stale.is_empty(),
            "deploy/crds is stale; regenerate with `KURYR_UPDATE_CRDS=1 cargo test -p kuryr-vif-allocator crd` \
             and review the diff:\n{}",
            stale.join("\n")
        );
    }

    #[test]
    fn crds_have_status_subresources_and_the_right_scope() {
        for (_, crd) in crds() {
            let name = crd.metadata.name.clone().unwrap();
            assert!(name.ends_with(".kuryr.openstack.org"), "{name}");
            let version = &crd.spec.versions[0];
            assert_eq!(version.name, "v1alpha1");
            assert!(version.subresources.as_ref().and_then(|s| s.status.as_ref()).is_some(), "{name} has no status");
            let scope = if name.starts_with("podvifs.") { "Namespaced" } else { "Cluster" };
            assert_eq!(crd.spec.scope, scope, "{name}");
        }
        let block = serde_json::to_string(&AddressBlock::crd()).unwrap();
        assert!(block.contains(r#""rule":"self == oldSelf""#), "AddressBlock spec must be immutable");
    }

    #[test]
    fn pod_network_defaults_apply_when_fields_are_absent() {
        let spec: PodNetworkSpec = serde_json::from_value(json!({"cidrs": ["10.244.0.0/16"]})).unwrap();
        assert_eq!(spec, PodNetworkSpec::new(["10.244.0.0/16"]));
        assert_eq!((spec.ipv4_block_prefix, spec.ipv6_block_prefix, spec.mtu), (24, 112, 1500));
        assert_eq!(spec.bridge, "kuryr0");
        assert!(spec.plan().is_ok());
        // The schema carries the same defaults, so the API server fills them in too.
        let schema = serde_json::to_value(PodNetwork::crd().spec.versions[0].schema.clone()).unwrap();
        let props = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"];
        assert_eq!(props["ipv4BlockPrefix"]["default"], 24);
        assert_eq!(props["ipv6BlockPrefix"]["default"], 112);
        assert_eq!(props["mtu"]["default"], 1500);
        assert_eq!(props["bridge"]["default"], "kuryr0");
    }

    #[test]
    fn invalid_specs_are_refused_by_plan() {
        let mut spec = PodNetworkSpec::new(["10.244.0.0/16", "10.245.0.0/16"]);
        assert!(matches!(spec.plan(), Err(PlanError::DuplicateFamily { .. })));
        spec.cidrs = vec!["fd00::/64".into()];
        spec.mtu = 1000;
        assert!(matches!(spec.plan(), Err(PlanError::Mtu { .. })));
    }

    #[test]
    fn vif_records_mirror_the_vif_config() {
        let spec = PodNetworkSpec {
            routes: vec![RouteSpec { destination: "10.96.0.0/12".into(), gateway: None }],
            ..PodNetworkSpec::new(["10.244.0.0/16"])
        };
        let plan = spec.plan().unwrap();
        let block = ipam::Block::parse("10.244.3.0/24").unwrap();
        let vif = plan.vif(&[(block, "10.244.3.9".parse().unwrap())]).unwrap();
        let record = VifRecord::from_config("pods/10.244.3.9", &vif);
        assert_eq!(
            serde_json::to_value(&record).unwrap(),
            json!({
                "vifId": "pods/10.244.3.9",
                "mac": "0a:58:0a:f4:03:09",
                "mtu": 1500,
                "ips": [{"address": "10.244.3.9/24", "gateway": "10.244.3.1"}],
                "routes": [{"destination": "10.96.0.0/12", "gateway": "10.244.3.1"}],
                "bridge": "kuryr0",
            })
        );
        let state = serde_json::to_value(VifState::Ready).unwrap();
        assert_eq!(state, json!("Ready"));
    }
}
