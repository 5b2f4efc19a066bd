//! Neutron trunks (the `trunk` service plugin, VLAN-aware VMs): a trunk is a parent port (a VM's
//! interface) with subports, each carried on the parent's link under a segmentation id (a VLAN
//! tag). What pods inside VMs get their ports through.

use http::Method;
use serde::{Deserialize, Serialize};

use super::{NET, Neutron};
use crate::error::Error;
use crate::filter::Filter;
use crate::require_id;
use crate::resource::{Resources, has_id};
use crate::transport::ApiRequest;

/// The segmentation type of every subport this crate adds.
pub const VLAN: &str = "vlan";

/// A subport of a trunk.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubPort {
    pub port_id: String,
    /// `vlan` (or `inherit`); left out of removals.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub segmentation_type: String,
    /// The VLAN id (1–4094); 0 in removals, where it is left out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub segmentation_id: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl SubPort {
    /// A subport on VLAN `vlan_id`.
    pub fn vlan(port_id: impl Into<String>, vlan_id: u16) -> Self {
        Self { port_id: port_id.into(), segmentation_type: VLAN.into(), segmentation_id: vlan_id.into() }
    }
}

/// A Neutron trunk.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct Trunk {
    pub id: String,
    pub name: String,
    /// The parent port.
    pub port_id: String,
    pub project_id: Option<String>,
    /// DOWN, BUILD, ACTIVE, DEGRADED, ERROR.
    pub status: String,
    pub sub_ports: Vec<SubPort>,
    pub tags: Vec<String>,
}

has_id!(Trunk);

/// The body of a trunk creation.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TrunkCreate {
    pub port_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sub_ports: Vec<SubPort>,
}

#[derive(Serialize)]
struct SubPorts<'a> {
    sub_ports: &'a [SubPort],
}

impl Neutron {
    /// Creates a trunk on a parent port.
    pub async fn create_trunk(&self, mut trunk: TrunkCreate) -> Result<Trunk, Error> {
        super::fill_project(&mut trunk.project_id, &self.client);
        self.create("trunks.create", "/trunks", "trunk", &trunk).await
    }

    pub async fn get_trunk(&self, id: &str) -> Result<Trunk, Error> {
        self.get("trunks.show", "/trunks", id, "trunk").await
    }

    /// Every trunk matching `filter` (e.g. `port_id=` the parent), with its subports.
    pub async fn list_trunks(&self, filter: &Filter) -> Result<Vec<Trunk>, Error> {
        self.list("trunks.list", "/trunks", "trunks", filter).await
    }

    /// Deletes a trunk (it must have no subports left); `Ok(false)` if it was already gone.
    pub async fn delete_trunk(&self, id: &str) -> Result<bool, Error> {
        self.delete("trunks.delete", "/trunks", id).await
    }

    /// Adds subports; a segmentation id or port already in use on the trunk is refused as a
    /// whole ([`Error::Conflict`]). Returns the trunk as it is now.
    pub async fn add_subports(&self, trunk_id: &str, sub_ports: &[SubPort]) -> Result<Trunk, Error> {
        self.subports("trunks.add_subports", trunk_id, "add_subports", sub_ports).await
    }

    /// Removes subports (by port id); a port that is not a subport of the trunk is refused
    /// (HTTP 404). Returns the trunk as it is now.
    pub async fn remove_subports(&self, trunk_id: &str, port_ids: &[String]) -> Result<Trunk, Error> {
        let subs: Vec<SubPort> =
            port_ids.iter().map(|p| SubPort { port_id: p.clone(), ..SubPort::default() }).collect();
        self.subports("trunks.remove_subports", trunk_id, "remove_subports", &subs).await
    }

    async fn subports(
        &self,
        operation: &'static str,
        trunk_id: &str,
        action: &str,
        sub_ports: &[SubPort],
    ) -> Result<Trunk, Error> {
        let path = format!("/trunks/{}/{action}", require_id("trunk", trunk_id)?);
        let req = ApiRequest::with_json(NET, operation, Method::PUT, path, &SubPorts { sub_ports })?;
        // The answer is the trunk itself, not wrapped in `{"trunk": ...}`.
        self.client.json(req).await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn subports_serialize_as_neutron_takes_them() {
        let add = serde_json::to_value(SubPorts { sub_ports: &[SubPort::vlan("p1", 101)] }).unwrap();
        assert_eq!(
            add,
            serde_json::json!({"sub_ports": [{"port_id": "p1", "segmentation_type": "vlan", "segmentation_id": 101}]})
        );
        let rm =
            serde_json::to_value(SubPorts { sub_ports: &[SubPort { port_id: "p1".into(), ..Default::default() }] })
                .unwrap();
        assert_eq!(rm, serde_json::json!({"sub_ports": [{"port_id": "p1"}]}));
        let t: Trunk = serde_json::from_value(serde_json::json!({
            "id": "t1", "port_id": "parent", "status": "ACTIVE", "admin_state_up": true,
            "sub_ports": [{"port_id": "p1", "segmentation_type": "vlan", "segmentation_id": 7}]
        }))
        .unwrap();
        assert_eq!(t.sub_ports, [SubPort::vlan("p1", 7)]);
    }
}
