//! Octavia v2 resources and the bodies to create them. Everything Octavia builds carries a
//! `provisioning_status`; PENDING_* means "immutable until the worker is done" (409 on change).

use serde::{Deserialize, Serialize};

/// Where an object is in its life, as Octavia's worker reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ProvisioningStatus {
    Active,
    PendingCreate,
    PendingUpdate,
    PendingDelete,
    Deleted,
    Error,
    /// A value this client does not know.
    #[default]
    #[serde(other)]
    Unknown,
}

impl ProvisioningStatus {
    /// Immutable until the worker finishes.
    pub fn is_pending(self) -> bool {
        matches!(self, Self::PendingCreate | Self::PendingUpdate | Self::PendingDelete)
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Protocol {
    #[default]
    Tcp,
    Udp,
    Sctp,
    Http,
    Https,
    #[serde(other)]
    Other,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum LbAlgorithm {
    #[default]
    RoundRobin,
    LeastConnections,
    SourceIp,
    SourceIpPort,
    #[serde(other)]
    Other,
}

/// Session persistence of a pool; `SOURCE_IP` implements a Service's `sessionAffinity: ClientIP`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionPersistence {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cookie_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence_timeout: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence_granularity: Option<String>,
}

/// A reference to another object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdRef {
    pub id: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct LoadBalancer {
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub vip_address: Option<String>,
    #[serde(default)]
    pub vip_port_id: Option<String>,
    #[serde(default)]
    pub vip_subnet_id: Option<String>,
    #[serde(default)]
    pub vip_network_id: Option<String>,
    pub provisioning_status: ProvisioningStatus,
    #[serde(default)]
    pub operating_status: String,
    #[serde(default)]
    pub project_id: Option<String>,
    #[serde(default)]
    pub provider: Option<String>,
    #[serde(default)]
    pub listeners: Vec<IdRef>,
    #[serde(default)]
    pub pools: Vec<IdRef>,
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(default)]
    pub admin_state_up: bool,
}

/// A load balancer to create, optionally fully populated (listeners with their default pools and
/// members, in one call).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadBalancerCreate {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vip_subnet_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vip_network_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vip_port_id: Option<String>,
    /// The Service's ClusterIP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vip_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flavor_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_state_up: Option<bool>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub listeners: Vec<ListenerCreate>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Listener {
    pub id: String,
    #[serde(default)]
    pub name: String,
    pub protocol: Protocol,
    pub protocol_port: u16,
    #[serde(default)]
    pub loadbalancers: Vec<IdRef>,
    #[serde(default)]
    pub default_pool_id: Option<String>,
    pub provisioning_status: ProvisioningStatus,
    #[serde(default)]
    pub operating_status: String,
    #[serde(default)]
    pub connection_limit: Option<i64>,
    #[serde(default)]
    pub allowed_cidrs: Option<Vec<String>>,
    #[serde(default)]
    pub tags: Vec<String>,
}

/// A listener to create: alone (`loadbalancer_id` set) or inside a [`LoadBalancerCreate`]
/// (`loadbalancer_id` unset, `default_pool` given).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ListenerCreate {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub protocol: Protocol,
    pub protocol_port: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loadbalancer_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_pool_id: Option<String>,
    /// Fully-populated create only; the pool must be named there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_pool: Option<PoolCreate>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connection_limit: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_client_data: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_member_data: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allowed_cidrs: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
}

impl ListenerCreate {
    pub fn new(protocol: Protocol, protocol_port: u16) -> Self {
        Self {
            name: None,
            protocol,
            protocol_port,
            loadbalancer_id: None,
            default_pool_id: None,
            default_pool: None,
            connection_limit: None,
            timeout_client_data: None,
            timeout_member_data: None,
            allowed_cidrs: None,
            tags: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Pool {
    pub id: String,
    #[serde(default)]
    pub name: String,
    pub protocol: Protocol,
    pub lb_algorithm: LbAlgorithm,
    #[serde(default)]
    pub listeners: Vec<IdRef>,
    #[serde(default)]
    pub loadbalancers: Vec<IdRef>,
    #[serde(default)]
    pub members: Vec<IdRef>,
    #[serde(default)]
    pub session_persistence: Option<SessionPersistence>,
    pub provisioning_status: ProvisioningStatus,
    #[serde(default)]
    pub operating_status: String,
    #[serde(default)]
    pub healthmonitor_id: Option<String>,
    #[serde(default)]
    pub tags: Vec<String>,
}

/// A pool to create: on a listener (`listener_id`), on a load balancer (`loadbalancer_id`), or
/// inside a fully-populated create (neither, `name` required, `members` allowed).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolCreate {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub protocol: Protocol,
    pub lb_algorithm: LbAlgorithm,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listener_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loadbalancer_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_persistence: Option<SessionPersistence>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<MemberCreate>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
}

impl PoolCreate {
    pub fn new(protocol: Protocol, lb_algorithm: LbAlgorithm) -> Self {
        Self {
            name: None,
            protocol,
            lb_algorithm,
            listener_id: None,
            loadbalancer_id: None,
            session_persistence: None,
            members: Vec::new(),
            tags: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Member {
    pub id: String,
    #[serde(default)]
    pub name: String,
    pub address: String,
    pub protocol_port: u16,
    #[serde(default)]
    pub subnet_id: Option<String>,
    #[serde(default)]
    pub weight: Option<u16>,
    #[serde(default)]
    pub backup: bool,
    pub provisioning_status: ProvisioningStatus,
    #[serde(default)]
    pub operating_status: String,
    #[serde(default)]
    pub tags: Vec<String>,
}

/// A member to create, or one entry of a batch member update (matched to existing members by
/// address and port).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemberCreate {
    pub address: String,
    pub protocol_port: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subnet_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backup: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub monitor_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub monitor_port: Option<u16>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
}
