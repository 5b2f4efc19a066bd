//! A pod and the VIF it was given, as the allocator reasons about them: plain data, no
//! Kubernetes and no protobuf. The record types ([`VifRecord`] and what it holds, [`VifState`])
//! are also the stored shape: [`crate::k8s::crd`]'s PodVif holds them as they are, with the serde
//! names and the schema written here (the CRD manifests generated from them are checked against
//! `deploy/crds/` by a unit test, so a change to the stored shape cannot pass unnoticed).
//! [`crate::grpc::convert`] streams them as `kuryr.allocator.v1` messages, converting at that edge.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::core::ipam::VifConfig;
use crate::core::ipam::ipnet::IpNet;

/// Identifies a pod.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodKey {
    /// metadata.namespace.
    pub namespace: String,
    /// metadata.name.
    pub name: String,
    /// metadata.uid: allocations are keyed by it.
    pub uid: String,
}

impl PodKey {
    /// A pod key.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>, uid: impl Into<String>) -> PodKey {
        PodKey { namespace: namespace.into(), name: name.into(), uid: uid.into() }
    }
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
    pub routes: Vec<VifRoute>,
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
    /// The VLAN id of the port as a trunk subport of the node's VM (binding `Vlan`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan_id: Option<u16>,
    /// The pod's further interfaces, one per NetworkAttachmentDefinition it asked for with the
    /// `k8s.v1.cni.cncf.io/networks` annotation (see `crate::attach`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<AttachedRecord>,
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
                .map(|r| VifRoute { destination: r.destination.to_string(), gateway: r.gateway.map(|g| g.to_string()) })
                .collect(),
            bridge: vif.bridge.clone(),
            ..VifRecord::default()
        }
    }
}

/// One further interface of a pod, as recorded: the network it is on and what the binder plugs.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttachedRecord {
    /// The NetworkAttachmentDefinition, `namespace/name`.
    pub attachment: String,
    /// The interface name in the pod.
    pub ifname: String,
    /// The PodNetwork the addresses come from (embedded backend), or the Neutron network id.
    pub network: String,
    /// `<network>/<address>` for the embedded IPAM, the port id with Neutron.
    pub vif_id: String,
    /// Lower-case, colon-separated.
    pub mac: String,
    /// Interface MTU.
    pub mtu: u32,
    /// Addresses (CIDR notation) with their gateways.
    pub ips: Vec<VifIp>,
    /// Routes through this interface.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<VifRoute>,
    /// The bridge the host end is attached to.
    pub bridge: String,
    /// How the host end is attached: a Linux bridge when absent (the embedded backend), Open
    /// vSwitch with the port id as `iface-id` for a Neutron port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binding: Option<VifBinding>,
    /// The Neutron subnets of the addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subnet_ids: Vec<String>,
    /// Security groups of the Neutron port.
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
    /// A VLAN of the node's uplink: the port is a subport of the node's Neutron trunk.
    Vlan,
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

/// A route of a VIF.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VifRoute {
    /// Destination CIDR, e.g. the Service CIDR `10.96.0.0/12`.
    pub destination: String,
    /// Next hop; absent means via the VIF's gateway of that family.
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

/// A pod's VIF as handed out to binders: the pod, its node, and either the VIF on record with
/// its state or, when allocation failed before anything was recorded, the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vif {
    /// The pod.
    pub pod: PodKey,
    /// The pod's node: the binder that plugs the VIF.
    pub node: String,
    /// The PodNetwork: the VIF's network unless its record names the backend's.
    pub network: String,
    /// The VIF on record (empty while failed before allocating).
    pub record: VifRecord,
    /// The subnets of its addresses: the record's (Neutron subnet ids), else the blocks the
    /// addresses come from (embedded). Derived once here rather than for every stream it is
    /// sent on.
    pub subnet_ids: Vec<String>,
    /// Where it is in its life.
    pub state: VifState,
    /// Why it failed, for the binder to tell the CNI ADD: set only for a VIF published FAILED
    /// without a record.
    pub failure: Option<String>,
}

impl Vif {
    /// The VIF on record for `pod` on `node`, in `state`.
    pub fn recorded(pod: &PodKey, node: &str, network: &str, record: VifRecord, state: VifState) -> Vif {
        let subnet_ids = subnets_of(&record.ips, &record.subnet_ids);
        Vif {
            pod: pod.clone(),
            node: node.to_string(),
            network: network.to_string(),
            record,
            subnet_ids,
            state,
            failure: None,
        }
    }

    /// A FAILED VIF without a record, carrying why.
    pub fn failed(pod: &PodKey, node: &str, network: &str, message: impl Into<String>) -> Vif {
        Vif {
            pod: pod.clone(),
            node: node.to_string(),
            network: network.to_string(),
            record: VifRecord::default(),
            subnet_ids: Vec::new(),
            state: VifState::Failed,
            failure: Some(message.into()),
        }
    }

    /// The backend's identifier of the VIF (empty for a failure without a record).
    pub fn vif_id(&self) -> &str {
        &self.record.vif_id
    }
}

/// The subnets of `ips`: `recorded` when the backend named them (Neutron), else the blocks the
/// addresses come from (each address with its prefix, truncated).
pub fn subnets_of(ips: &[VifIp], recorded: &[String]) -> Vec<String> {
    if recorded.is_empty() {
        ips.iter().filter_map(|ip| ip.address.parse::<IpNet>().ok()).map(|net| net.trunc().to_string()).collect()
    } else {
        recorded.to_vec()
    }
}

/// A node's pod address blocks and the addresses to reach them through.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeRoutes {
    /// The node.
    pub node_name: String,
    /// Its InternalIPs (sorted): the next hops.
    pub node_ips: Vec<String>,
    /// The address blocks it owns (sorted): the destinations.
    pub cidrs: Vec<String>,
}
