//! The Neutron topology the OpenStack suites and benches build around kuryr's services: subnets
//! without DHCP (no DHCP agent runs here), the Service network in the API servers' Service range,
//! and an external network with a router to it.
//!
//! ```no_run
//! # async fn demo(n: &kuryr_openstack::neutron::Neutron) -> anyhow::Result<()> {
//! use kuryr_tests::topology;
//! let (svc_net, svc_sub) = topology::service_network(n, None).await?;
//! let (ext, _) = topology::external_network(n, "public").await?;
//! let router = topology::router_to(n, "services", &ext.id).await?;
//! # Ok(()) }
//! ```

use anyhow::{Context, Result};
use kuryr_openstack::neutron::{
    ExternalGateway, Network, NetworkCreate, Neutron, Router, RouterCreate, Subnet, SubnetCreate,
};

/// The Service range of the test API servers (`--service-cluster-ip-range`).
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The gateway of the Service subnet: at the end of the range, away from the addresses Services get.
pub const SERVICE_GATEWAY: &str = "10.96.255.254";
/// The external network's range (TEST-NET-3).
pub const EXTERNAL_CIDR: &str = "203.0.113.0/24";

/// A network `name` to create, in `project` (`None`: the caller's).
pub fn network(name: &str, project: Option<&str>) -> NetworkCreate {
    NetworkCreate { name: Some(name.into()), project_id: project.map(Into::into), ..NetworkCreate::default() }
}

/// A subnet `cidr` (IP version `ip_version`) of `network_id` to create, without DHCP, in
/// `project` (`None`: the caller's); what else a caller sets goes with struct update syntax.
pub fn subnet(network_id: &str, ip_version: u8, cidr: &str, project: Option<&str>) -> SubnetCreate {
    SubnetCreate {
        network_id: network_id.into(),
        ip_version,
        cidr: Some(cidr.into()),
        project_id: project.map(Into::into),
        enable_dhcp: Some(false),
        ..SubnetCreate::default()
    }
}

/// Creates the Service network `services` with its subnet [`SERVICE_CIDR`] (gateway
/// [`SERVICE_GATEWAY`]), in `project` (`None`: the caller's).
pub async fn service_network(n: &Neutron, project: Option<&str>) -> Result<(Network, Subnet)> {
    let net = n.create_network(network("services", project)).await.context("creating the Service network")?;
    let sub = SubnetCreate { gateway_ip: Some(SERVICE_GATEWAY.into()), ..subnet(&net.id, 4, SERVICE_CIDR, project) };
    let sub = n.create_subnet(sub).await.context("creating the Service subnet")?;
    Ok((net, sub))
}

/// Creates the external network `name` with its subnet [`EXTERNAL_CIDR`].
pub async fn external_network(n: &Neutron, name: &str) -> Result<(Network, Subnet)> {
    let net = NetworkCreate { external: Some(true), ..network(name, None) };
    let net = n.create_network(net).await.with_context(|| format!("creating the external network {name}"))?;
    let sub = n.create_subnet(subnet(&net.id, 4, EXTERNAL_CIDR, None)).await.context("creating the external subnet")?;
    Ok((net, sub))
}

/// Creates the router `name` with its gateway on the external network `external_id`.
pub async fn router_to(n: &Neutron, name: &str, external_id: &str) -> Result<Router> {
    let router = RouterCreate {
        name: Some(name.into()),
        external_gateway_info: Some(ExternalGateway { network_id: external_id.into(), enable_snat: None }),
        ..RouterCreate::default()
    };
    n.create_router(router).await.with_context(|| format!("creating the router {name}"))
}
