//! Neutron resources as the API shows them, and the bodies to create or change them. Only fields
//! this project reads or writes are modelled; unknown fields in answers are ignored, absent ones
//! take their default (lists asked with `fields=` return only those), and `None` fields are left
//! out of requests so Neutron applies its defaults.

use serde::{Deserialize, Serialize};

/// A fixed IP of a port.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FixedIp {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_address: Option<String>,
}

/// A Neutron port.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Port {
    pub id: String,
    #[serde(default)]
    pub name: String,
    pub network_id: String,
    #[serde(default)]
    pub project_id: Option<String>,
    pub mac_address: String,
    #[serde(default)]
    pub fixed_ips: Vec<FixedIp>,
    #[serde(default)]
    pub device_id: String,
    #[serde(default)]
    pub device_owner: String,
    /// DOWN, ACTIVE, BUILD, ERROR.
    pub status: String,
    #[serde(default)]
    pub security_groups: Vec<String>,
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(default)]
    pub admin_state_up: bool,
    #[serde(default, rename = "binding:host_id")]
    pub binding_host_id: Option<String>,
    /// `ovs`, `unbound`, `binding_failed`, ...
    #[serde(default, rename = "binding:vif_type")]
    pub binding_vif_type: Option<String>,
    #[serde(default, rename = "binding:vnic_type")]
    pub binding_vnic_type: Option<String>,
    #[serde(default, rename = "binding:vif_details")]
    pub binding_vif_details: Option<serde_json::Value>,
    #[serde(default)]
    pub revision_number: Option<u64>,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub updated_at: Option<String>,
}

impl Port {
    pub const ACTIVE: &'static str = "ACTIVE";
    pub const DOWN: &'static str = "DOWN";

    pub fn is_active(&self) -> bool {
        self.status == Self::ACTIVE
    }

    /// Neutron could not bind the port to its host (no agent there): delete and create again.
    pub fn binding_failed(&self) -> bool {
        self.binding_vif_type.as_deref() == Some("binding_failed")
    }
}

/// The body of a port creation (one element of a bulk create).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PortCreate {
    pub network_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fixed_ips: Option<Vec<FixedIp>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mac_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_owner: Option<String>,
    #[serde(rename = "binding:host_id", skip_serializing_if = "Option::is_none")]
    pub binding_host_id: Option<String>,
    #[serde(rename = "binding:vnic_type", skip_serializing_if = "Option::is_none")]
    pub binding_vnic_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub security_groups: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_state_up: Option<bool>,
    /// Sent with the creation, so that with Neutron's ML2 extension driver
    /// `tag_ports_during_bulk_creation` a port is never seen without its ownership tags; without
    /// that driver the client sets them right after (one call per port).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<String>>,
}

/// A port change; `None` fields are left as they are. An empty `device_id` or `binding_host_id`
/// clears it (how a pooled port is released).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PortUpdate {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_owner: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub security_groups: Option<Vec<String>>,
    #[serde(rename = "binding:host_id", skip_serializing_if = "Option::is_none")]
    pub binding_host_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_state_up: Option<bool>,
}

/// A Neutron network.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Network {
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub project_id: Option<String>,
    #[serde(default)]
    pub subnets: Vec<String>,
    #[serde(default)]
    pub mtu: Option<u32>,
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(default)]
    pub admin_state_up: bool,
    #[serde(default)]
    pub shared: bool,
    #[serde(default, rename = "router:external")]
    pub external: bool,
    #[serde(default, rename = "provider:network_type")]
    pub network_type: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct NetworkCreate {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_state_up: Option<bool>,
    /// Set right after the creation (Neutron takes tags in the creation of ports only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<String>>,
    #[serde(rename = "provider:network_type", skip_serializing_if = "Option::is_none")]
    pub network_type: Option<String>,
    /// An external network: where floating IPs and router gateways come from.
    #[serde(rename = "router:external", skip_serializing_if = "Option::is_none")]
    pub external: Option<bool>,
}

/// An allocation pool of a subnet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationPool {
    pub start: String,
    pub end: String,
}

/// A static route a subnet's DHCP hands out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRoute {
    pub destination: String,
    pub nexthop: String,
}

/// A Neutron subnet.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Subnet {
    pub id: String,
    #[serde(default)]
    pub name: String,
    pub network_id: String,
    pub cidr: String,
    pub ip_version: u8,
    #[serde(default)]
    pub gateway_ip: Option<String>,
    #[serde(default)]
    pub enable_dhcp: bool,
    #[serde(default)]
    pub allocation_pools: Vec<AllocationPool>,
    #[serde(default)]
    pub host_routes: Vec<HostRoute>,
    #[serde(default)]
    pub dns_nameservers: Vec<String>,
    #[serde(default)]
    pub project_id: Option<String>,
    #[serde(default)]
    pub subnetpool_id: Option<String>,
    #[serde(default)]
    pub tags: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SubnetCreate {
    pub network_id: String,
    pub ip_version: u8,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway_ip: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_dhcp: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subnetpool_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefixlen: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocation_pools: Option<Vec<AllocationPool>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_routes: Option<Vec<HostRoute>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dns_nameservers: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipv6_ra_mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipv6_address_mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<String>>,
}

/// A Neutron subnet pool: the prefixes subnets created without a CIDR are carved from.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SubnetPool {
    pub id: String,
    #[serde(default)]
    pub name: String,
    pub ip_version: u8,
    #[serde(default)]
    pub prefixes: Vec<String>,
    #[serde(default)]
    pub project_id: Option<String>,
    #[serde(default)]
    pub shared: bool,
    #[serde(default)]
    pub tags: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SubnetPoolCreate {
    pub name: String,
    pub prefixes: Vec<String>,
    /// The prefix length of subnets that ask for none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_prefixlen: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared: Option<bool>,
}

/// A router's external gateway.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExternalGateway {
    pub network_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_snat: Option<bool>,
}

/// A Neutron router.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Router {
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub project_id: Option<String>,
    #[serde(default)]
    pub external_gateway_info: Option<ExternalGateway>,
    #[serde(default)]
    pub tags: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RouterCreate {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub external_gateway_info: Option<ExternalGateway>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_state_up: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<String>>,
}

/// What to attach to or detach from a router: a subnet (Neutron creates the port) or a port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterInterface {
    SubnetId(String),
    PortId(String),
}

/// Neutron's answer to adding or removing a router interface.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct RouterInterfaceInfo {
    pub id: String,
    pub port_id: String,
    #[serde(default)]
    pub subnet_id: Option<String>,
    #[serde(default)]
    pub subnet_ids: Vec<String>,
    #[serde(default)]
    pub network_id: Option<String>,
}

/// A floating IP.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct FloatingIp {
    pub id: String,
    pub floating_ip_address: String,
    pub floating_network_id: String,
    #[serde(default)]
    pub port_id: Option<String>,
    #[serde(default)]
    pub fixed_ip_address: Option<String>,
    #[serde(default)]
    pub router_id: Option<String>,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub project_id: Option<String>,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub tags: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FloatingIpCreate {
    pub floating_network_id: String,
    /// A specific address (a Service's `loadBalancerIP`), else Neutron picks one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub floating_ip_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subnet_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fixed_ip_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// Associates a floating IP with a port (`Some`) or dissociates it (`None`, sent as `null`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FloatingIpAssociation {
    pub port_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fixed_ip_address: Option<String>,
}

/// A security group.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SecurityGroup {
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub project_id: Option<String>,
    #[serde(default)]
    pub security_group_rules: Vec<SecurityGroupRule>,
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(default)]
    pub revision_number: Option<u64>,
}

/// The body of a security group creation. Neutron adds its default rules to a new group (today:
/// allow all egress, IPv4 and IPv6); callers that want none delete them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SecurityGroupCreate {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    /// Set right after the creation (Neutron refuses tags in the creation of a group).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<String>>,
}

/// A security group rule as Neutron shows it. `None` fields mean "any": every protocol, every
/// port, every remote address.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SecurityGroupRule {
    pub id: String,
    pub security_group_id: String,
    /// `ingress` or `egress`.
    pub direction: String,
    /// `IPv4` or `IPv6`.
    pub ethertype: String,
    /// A name (`tcp`) or a number as Neutron stored it.
    #[serde(default)]
    pub protocol: Option<String>,
    #[serde(default)]
    pub port_range_min: Option<u16>,
    #[serde(default)]
    pub port_range_max: Option<u16>,
    #[serde(default)]
    pub remote_ip_prefix: Option<String>,
    #[serde(default)]
    pub remote_group_id: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
}

/// The body of a security group rule creation (one element of a bulk create).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SecurityGroupRuleCreate {
    pub security_group_id: String,
    /// `ingress` or `egress`.
    pub direction: String,
    /// `IPv4` or `IPv6`.
    pub ethertype: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_range_min: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_range_max: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_ip_prefix: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_group_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
}
