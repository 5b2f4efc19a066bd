//! [`PodVif`]: the VIF a pod was given, as stored. The record it holds is [`crate::core`]'s
//! [`VifRecord`] as it is (see there for how its stored shape is kept).

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::core::{AttachedRecord, VifBinding, VifIp, VifRecord, VifRoute, VifState};

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
