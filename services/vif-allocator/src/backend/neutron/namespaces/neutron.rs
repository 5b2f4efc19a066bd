//! The Neutron resources of a namespace: one network, one subnet per subnet pool, and the
//! router's interface on each subnet. Every network and subnet carries two tags — the cluster's
//! (`kuryr.openstack.org/cluster=<id>`) and the namespace's (`kuryr.openstack.org/namespace=<ns>`)
//! — and is always looked up by them before anything is created, so a restart (or a create whose
//! answer was lost) finds what exists instead of making it twice. Should two allocators race and
//! both create a network, both keep the one with the smallest id and delete the other.

use kuryr_openstack::Filter;
use kuryr_openstack::neutron::{Network, NetworkCreate, Neutron, Port, RouterInterface, Subnet, SubnetCreate};

use crate::backend::neutron::neutron_err;
use crate::error::ClusterError;

/// `device_owner` prefix of a router's ports on a network (`network:router_interface`, and the
/// distributed and HA variants).
const ROUTER_INTERFACE: &str = "network:router_interface";

/// The tag naming a namespace on its network and subnets.
pub fn namespace_tag(namespace: &str) -> String {
    format!("kuryr.openstack.org/namespace={namespace}")
}

/// The namespace a network's tags name, if any.
pub fn tagged_namespace(tags: &[String]) -> Option<&str> {
    tags.iter().find_map(|t| t.strip_prefix("kuryr.openstack.org/namespace="))
}

/// A subnet pool namespace subnets come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolRef {
    /// The pool's id.
    pub id: String,
    /// 4 or 6.
    pub ip_version: u8,
}

/// What exists for a namespace once [`NamespaceNeutron::ensure`] returned.
#[derive(Clone, Debug)]
pub struct Provisioned {
    /// The network.
    pub network: Network,
    /// Its subnets in pool order, each with the pool it came from and the router's port on it.
    pub subnets: Vec<(Subnet, String, Option<String>)>,
}

/// Makes and removes the Neutron resources of namespaces.
#[derive(Clone, Debug)]
pub struct NamespaceNeutron {
    /// The client.
    pub neutron: Neutron,
    /// The project owning the networks.
    pub project: String,
    /// The cluster's tag.
    pub cluster_tag: String,
    /// The router subnets are attached to.
    pub router: String,
    /// The subnet pools, IPv4 first.
    pub pools: Vec<PoolRef>,
}

impl NamespaceNeutron {
    fn tags(&self, namespace: &str) -> Vec<String> {
        vec![self.cluster_tag.clone(), namespace_tag(namespace)]
    }

    /// The namespace's networks, the one to keep first (smallest id).
    pub async fn networks(&self, namespace: &str) -> Result<Vec<Network>, ClusterError> {
        let filter = Filter::new().tags(&self.tags(namespace));
        let mut nets = self
            .neutron
            .list_networks(&filter)
            .await
            .map_err(neutron_err(format!("looking up the network of namespace {namespace}")))?;
        nets.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(nets)
    }

    /// The namespace's network, subnets and router interfaces, creating what is missing.
    pub async fn ensure(&self, namespace: &str) -> Result<Provisioned, ClusterError> {
        let mut nets = self.networks(namespace).await?;
        if nets.is_empty() {
            let create = NetworkCreate {
                name: Some(format!("kuryr-ns-{namespace}")),
                project_id: Some(self.project.clone()),
                admin_state_up: Some(true),
                tags: Some(self.tags(namespace)),
                ..NetworkCreate::default()
            };
            let made = self
                .neutron
                .create_network(create)
                .await
                .map_err(neutron_err(format!("creating the network of namespace {namespace}")))?;
            tracing::info!(namespace, network = %made.id, "created the namespace's network");
            // Another allocator may have raced us: settle on the smallest id, as it will.
            nets = self.networks(namespace).await?;
            if nets.is_empty() {
                nets.push(made);
            }
        }
        let network = nets.remove(0);
        for extra in nets {
            tracing::warn!(namespace, network = %extra.id, keep = %network.id, "second network for one namespace; deleting it");
            if let Err(e) = self.delete_network(&extra.id).await {
                tracing::warn!(network = %extra.id, error = %crate::error::chain(&e), "could not delete the second network");
            }
        }
        let existing = self
            .neutron
            .list_subnets(&Filter::new().network_id(&network.id))
            .await
            .map_err(neutron_err(format!("listing the subnets of network {}", network.id)))?;
        let mut subnets = Vec::new();
        for pool in &self.pools {
            let found = existing.iter().find(|s| s.subnetpool_id.as_deref() == Some(pool.id.as_str())).cloned();
            let subnet = match found {
                Some(s) => s,
                None => {
                    let create = SubnetCreate {
                        network_id: network.id.clone(),
                        ip_version: pool.ip_version,
                        name: Some(format!("kuryr-ns-{namespace}-v{}", pool.ip_version)),
                        project_id: Some(self.project.clone()),
                        subnetpool_id: Some(pool.id.clone()),
                        tags: Some(self.tags(namespace)),
                        ..SubnetCreate::default()
                    };
                    let s = self.neutron.create_subnet(create).await.map_err(neutron_err(format!(
                        "creating the IPv{} subnet of namespace {namespace} from subnet pool {}",
                        pool.ip_version, pool.id
                    )))?;
                    tracing::info!(namespace, subnet = %s.id, cidr = %s.cidr, "created the namespace's subnet");
                    s
                }
            };
            subnets.push((subnet, pool.id.clone(), None));
        }
        let mut router_ports = self.router_ports(&network.id).await?;
        for (subnet, _, port) in &mut subnets {
            if let Some(p) = on_subnet(&router_ports, &subnet.id) {
                *port = Some(p.id.clone());
                continue;
            }
            let added =
                self.neutron.add_router_interface(&self.router, &RouterInterface::SubnetId(subnet.id.clone())).await;
            match added {
                Ok(info) => {
                    tracing::info!(namespace, subnet = %subnet.id, router = %self.router, port = %info.port_id,
                        "attached the namespace's subnet to the router");
                    *port = Some(info.port_id);
                }
                // Refused as a duplicate after a lost answer or a race: it is there now.
                Err(e) if matches!(e, kuryr_openstack::Error::BadRequest(_) | kuryr_openstack::Error::Conflict(_)) => {
                    router_ports = self.router_ports(&network.id).await?;
                    let p = on_subnet(&router_ports, &subnet.id).ok_or_else(|| {
                        neutron_err(format!("attaching subnet {} to router {}", subnet.id, self.router))(e)
                    })?;
                    *port = Some(p.id.clone());
                }
                Err(e) => {
                    return Err(neutron_err(format!("attaching subnet {} to router {}", subnet.id, self.router))(e));
                }
            }
        }
        Ok(Provisioned { network, subnets })
    }

    /// The router ports on a network (any router).
    async fn router_ports(&self, network: &str) -> Result<Vec<Port>, ClusterError> {
        let ports = self
            .neutron
            .list_ports(&Filter::new().network_id(network))
            .await
            .map_err(neutron_err(format!("listing the ports of network {network}")))?;
        Ok(ports.into_iter().filter(|p| p.device_owner.starts_with(ROUTER_INTERFACE)).collect())
    }

    /// Removes every network of the namespace: router interfaces, the cluster's ports left on
    /// it, subnets, the network. Returns the ids of the networks removed. A port someone else
    /// made on the network makes the network's deletion fail (and it is retried).
    pub async fn remove(&self, namespace: &str) -> Result<Vec<String>, ClusterError> {
        let nets = self.networks(namespace).await?;
        let mut removed = Vec::new();
        for net in nets {
            self.delete_network(&net.id).await?;
            removed.push(net.id);
        }
        Ok(removed)
    }

    async fn delete_network(&self, id: &str) -> Result<(), ClusterError> {
        let ports = self
            .neutron
            .list_ports(&Filter::new().network_id(id))
            .await
            .map_err(neutron_err(format!("listing the ports of network {id}")))?;
        for p in &ports {
            if p.device_owner.starts_with(ROUTER_INTERFACE) {
                match self.neutron.remove_router_interface(&p.device_id, &RouterInterface::PortId(p.id.clone())).await {
                    Ok(_) => {
                        tracing::info!(network = id, router = %p.device_id, port = %p.id, "detached from the router")
                    }
                    Err(e) if e.is_not_found() => {}
                    Err(e) => {
                        return Err(neutron_err(format!("detaching network {id} from router {}", p.device_id))(e));
                    }
                }
            } else if p.tags.contains(&self.cluster_tag) {
                self.neutron.delete_port(&p.id).await.map_err(neutron_err(format!("deleting port {}", p.id)))?;
            }
        }
        let subnets = self
            .neutron
            .list_subnets(&Filter::new().network_id(id))
            .await
            .map_err(neutron_err(format!("listing the subnets of network {id}")))?;
        for s in subnets {
            self.neutron.delete_subnet(&s.id).await.map_err(neutron_err(format!("deleting subnet {}", s.id)))?;
        }
        self.neutron.delete_network(id).await.map_err(neutron_err(format!("deleting network {id}")))?;
        tracing::info!(network = id, "deleted the namespace's network");
        Ok(())
    }
}

/// The router port with an address on `subnet`.
fn on_subnet<'a>(ports: &'a [Port], subnet: &str) -> Option<&'a Port> {
    ports.iter().find(|p| p.fixed_ips.iter().any(|f| f.subnet_id.as_deref() == Some(subnet)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_tags_round_trip() {
        let tags = vec!["kuryr.openstack.org/cluster=c".to_string(), namespace_tag("team-a")];
        assert_eq!(tags[1], "kuryr.openstack.org/namespace=team-a");
        assert_eq!(tagged_namespace(&tags), Some("team-a"));
        assert_eq!(tagged_namespace(&tags[..1]), None);
    }
}
