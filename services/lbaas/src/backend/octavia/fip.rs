//! Neutron's part of a Service load balancer, all tagged like the load balancer (cluster,
//! Service, uid) and found again by those tags:
//! - floating IPs of type=LoadBalancer Services, on the load balancer's VIP port;
//! - with `--vip-port-precreate`, the VIP port itself (the Service's cluster IP on the VIP
//!   subnet), created before the load balancer and handed to Octavia, deleted after it.

use kuryr_openstack::neutron::{
    FixedIp, FloatingIp, FloatingIpAssociation, FloatingIpCreate, Neutron, Port, PortCreate, TaggedResource,
};
use kuryr_openstack::{Error, Filter};

use crate::backend::octavia::plan::{TAG_SERVICE, cluster_tag};

/// The floating IP of the Service tagged `tags` ([`crate::backend::octavia::plan::tags`]), on `network`,
/// associated with `port` (the VIP port) at `vip`: found by tags, or created and tagged.
pub async fn ensure(
    neutron: &Neutron,
    network: &str,
    tags: &[String],
    port: &str,
    vip: &str,
) -> Result<FloatingIp, Error> {
    let mut found = neutron.list_floating_ips(&Filter::new().tags(tags)).await?.into_iter();
    let fip = match found.next() {
        Some(fip) => {
            for extra in found {
                tracing::warn!(
                    fip = extra.id,
                    address = extra.floating_ip_address,
                    "duplicate floating IP: deleting it"
                );
                neutron.delete_floating_ip(&extra.id).await?;
            }
            if fip.port_id.as_deref() == Some(port) {
                fip
            } else {
                let assoc =
                    FloatingIpAssociation { port_id: Some(port.to_string()), fixed_ip_address: Some(vip.to_string()) };
                neutron.associate_floating_ip(&fip.id, &assoc).await?
            }
        }
        None => {
            let create = FloatingIpCreate {
                floating_network_id: network.to_string(),
                port_id: Some(port.to_string()),
                fixed_ip_address: Some(vip.to_string()),
                description: Some("Kubernetes Service ingress, managed by kuryr-lbaas".into()),
                ..Default::default()
            };
            let fip = neutron.create_floating_ip(create).await?;
            // Tagged right after: until then only the description says whose it is.
            neutron.set_tags(TaggedResource::FloatingIp, &fip.id, tags).await?;
            tracing::info!(fip = fip.id, address = fip.floating_ip_address, port, "floating IP created");
            fip
        }
    };
    Ok(fip)
}

/// Deletes every floating IP of this cluster tagged with the Service `key`.
pub async fn delete(neutron: &Neutron, cluster: &str, key: &str) -> Result<(), Error> {
    let tags = [cluster_tag(cluster), format!("{TAG_SERVICE}{key}")];
    for fip in neutron.list_floating_ips(&Filter::new().tags(&tags)).await? {
        neutron.delete_floating_ip(&fip.id).await?;
        tracing::info!(fip = fip.id, address = fip.floating_ip_address, service = key, "floating IP deleted");
    }
    Ok(())
}

/// The `device_owner` of VIP ports lbaas creates.
pub const VIP_PORT_OWNER: &str = "kuryr:lbaas-vip";

/// The VIP port of the Service tagged `tags`: found by tags, or created on `network` with `vip`
/// on `subnet`.
pub async fn ensure_vip_port(
    neutron: &Neutron,
    network: &str,
    subnet: &str,
    vip: &str,
    name: &str,
    tags: &[String],
) -> Result<Port, Error> {
    if let Some(port) = neutron.list_ports(&Filter::new().tags(tags)).await?.into_iter().next() {
        return Ok(port);
    }
    let port = neutron
        .create_port(PortCreate {
            network_id: network.to_string(),
            name: Some(name.to_string()),
            fixed_ips: Some(vec![FixedIp { subnet_id: Some(subnet.to_string()), ip_address: Some(vip.to_string()) }]),
            device_owner: Some(VIP_PORT_OWNER.into()),
            tags: Some(tags.to_vec()),
            ..Default::default()
        })
        .await?;
    tracing::info!(port = port.id, vip, "VIP port created");
    Ok(port)
}

/// Deletes every VIP port of this cluster tagged with the Service `key`.
pub async fn delete_vip_ports(neutron: &Neutron, cluster: &str, key: &str) -> Result<(), Error> {
    let tags = [cluster_tag(cluster), format!("{TAG_SERVICE}{key}")];
    for port in neutron.list_ports(&Filter::new().tags(&tags).device_owner(VIP_PORT_OWNER)).await? {
        neutron.delete_port(&port.id).await?;
        tracing::info!(port = port.id, service = key, "VIP port deleted");
    }
    Ok(())
}
