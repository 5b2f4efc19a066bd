//! [`PodVif`]: the VIF a pod was given, as stored. Its record types mirror
//! [`crate::core`]'s and convert to and from them here, so that the stored shape (and the CRD
//! schema generated from it) stays what it is whatever the core's types become.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::network::RouteSpec;
use crate::core;

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
    printcolumn = r#"{"name": "IPs", "type": "string", "jsonPath": ".spec.vif.ips[*].address"}"#,
    printcolumn = r#"{"name": "MAC", "type": "string", "jsonPath": ".spec.vif.mac", "priority": 1}"#,
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
    /// The VIF the pod was given, written with the PodVif by its create (the allocator creates
    /// it only once the VIF is allocated). Absent in PodVifs written by earlier versions, which
    /// hold it in `status.vif`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vif: Option<VifRecord>,
}

/// The VIF's state.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodVifStatus {
    /// Where PodVifs written by earlier versions hold the VIF: read when `spec.vif` is absent,
    /// never written any more (see `spec.vif`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vif: Option<VifRecord>,
    /// Where the VIF is in its life; absent means `Allocated` (a PodVif is created with its VIF
    /// and no status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<VifState>,
    /// Why the VIF failed, or other detail for humans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl PodVif {
    /// The VIF on record: `spec.vif`, or `status.vif` in a PodVif written by an earlier version
    /// (which put the VIF in the status).
    pub fn vif(&self) -> Option<&VifRecord> {
        self.spec.vif.as_ref().or_else(|| self.status.as_ref().and_then(|s| s.vif.as_ref()))
    }

    /// Whether the VIF on record is in `status.vif` (a PodVif written by an earlier version).
    pub fn vif_in_status(&self) -> bool {
        self.spec.vif.is_none() && self.status.as_ref().is_some_and(|s| s.vif.is_some())
    }

    /// The VIF's state: `Allocated` until a state was written.
    pub fn state(&self) -> VifState {
        self.status.as_ref().and_then(|s| s.state).unwrap_or(VifState::Allocated)
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
    /// The VLAN id of the port as a trunk subport of the node's VM (binding `Vlan`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan_id: Option<u16>,
    /// The pod's further interfaces, one per NetworkAttachmentDefinition it asked for with the
    /// `k8s.v1.cni.cncf.io/networks` annotation (see `crate::attach`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<AttachedRecord>,
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
    pub routes: Vec<RouteSpec>,
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

impl From<core::VifRecord> for VifRecord {
    fn from(v: core::VifRecord) -> Self {
        VifRecord {
            vif_id: v.vif_id,
            mac: v.mac,
            mtu: v.mtu,
            ips: v.ips.into_iter().map(Into::into).collect(),
            routes: v.routes.into_iter().map(Into::into).collect(),
            bridge: v.bridge,
            binding: v.binding.map(Into::into),
            backend: v.backend,
            network_id: v.network_id,
            subnet_ids: v.subnet_ids,
            security_groups: v.security_groups,
            vlan_id: v.vlan_id,
            attachments: v.attachments.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<VifRecord> for core::VifRecord {
    fn from(v: VifRecord) -> Self {
        core::VifRecord {
            vif_id: v.vif_id,
            mac: v.mac,
            mtu: v.mtu,
            ips: v.ips.into_iter().map(Into::into).collect(),
            routes: v.routes.into_iter().map(Into::into).collect(),
            bridge: v.bridge,
            binding: v.binding.map(Into::into),
            backend: v.backend,
            network_id: v.network_id,
            subnet_ids: v.subnet_ids,
            security_groups: v.security_groups,
            vlan_id: v.vlan_id,
            attachments: v.attachments.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<core::AttachedRecord> for AttachedRecord {
    fn from(a: core::AttachedRecord) -> Self {
        AttachedRecord {
            attachment: a.attachment,
            ifname: a.ifname,
            network: a.network,
            vif_id: a.vif_id,
            mac: a.mac,
            mtu: a.mtu,
            ips: a.ips.into_iter().map(Into::into).collect(),
            routes: a.routes.into_iter().map(Into::into).collect(),
            bridge: a.bridge,
            binding: a.binding.map(Into::into),
            subnet_ids: a.subnet_ids,
            security_groups: a.security_groups,
        }
    }
}

impl From<AttachedRecord> for core::AttachedRecord {
    fn from(a: AttachedRecord) -> Self {
        core::AttachedRecord {
            attachment: a.attachment,
            ifname: a.ifname,
            network: a.network,
            vif_id: a.vif_id,
            mac: a.mac,
            mtu: a.mtu,
            ips: a.ips.into_iter().map(Into::into).collect(),
            routes: a.routes.into_iter().map(Into::into).collect(),
            bridge: a.bridge,
            binding: a.binding.map(Into::into),
            subnet_ids: a.subnet_ids,
            security_groups: a.security_groups,
        }
    }
}

impl From<core::VifIp> for VifIp {
    fn from(i: core::VifIp) -> Self {
        VifIp { address: i.address, gateway: i.gateway }
    }
}

impl From<VifIp> for core::VifIp {
    fn from(i: VifIp) -> Self {
        core::VifIp { address: i.address, gateway: i.gateway }
    }
}

impl From<core::VifRoute> for RouteSpec {
    fn from(r: core::VifRoute) -> Self {
        RouteSpec { destination: r.destination, gateway: r.gateway }
    }
}

impl From<RouteSpec> for core::VifRoute {
    fn from(r: RouteSpec) -> Self {
        core::VifRoute { destination: r.destination, gateway: r.gateway }
    }
}

impl From<core::VifBinding> for VifBinding {
    fn from(b: core::VifBinding) -> Self {
        match b {
            core::VifBinding::Bridge => VifBinding::Bridge,
            core::VifBinding::Ovs => VifBinding::Ovs,
            core::VifBinding::Vlan => VifBinding::Vlan,
        }
    }
}

impl From<VifBinding> for core::VifBinding {
    fn from(b: VifBinding) -> Self {
        match b {
            VifBinding::Bridge => core::VifBinding::Bridge,
            VifBinding::Ovs => core::VifBinding::Ovs,
            VifBinding::Vlan => core::VifBinding::Vlan,
        }
    }
}

impl From<core::VifState> for VifState {
    fn from(s: core::VifState) -> Self {
        match s {
            core::VifState::Allocated => VifState::Allocated,
            core::VifState::Plugged => VifState::Plugged,
            core::VifState::Ready => VifState::Ready,
            core::VifState::Failed => VifState::Failed,
        }
    }
}

impl From<VifState> for core::VifState {
    fn from(s: VifState) -> Self {
        match s {
            VifState::Allocated => core::VifState::Allocated,
            VifState::Plugged => core::VifState::Plugged,
            VifState::Ready => core::VifState::Ready,
            VifState::Failed => core::VifState::Failed,
        }
    }
}
