//! A Neutron port as the VIF a binder plugs: the port's MAC, its fixed IPs with the prefix length
//! and gateway of their subnets, the subnets' host routes, the network's MTU, and the `ovs`
//! binding with the port id as `iface-id` (what the ML2/OVS agent looks for on `br-int`).

use ipnet::IpNet;
use kuryr_openstack::neutron::{FixedIp, Neutron, Port, PortCreate, Subnet};

use crate::core::{VifBinding, VifIp, VifRecord, VifRoute};

/// The `backend` of VIFs made from Neutron ports.
pub const BACKEND: &str = "neutron";

/// What a pod subnet contributes to a VIF.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubnetInfo {
    /// The subnet id.
    pub id: String,
    /// The subnet's CIDR: its prefix length is the pod address's.
    pub cidr: IpNet,
    /// The gateway, if the subnet has one.
    pub gateway: Option<String>,
    /// The subnet's host routes.
    pub routes: Vec<VifRoute>,
}

impl SubnetInfo {
    /// Reads a Neutron subnet; an unparsable CIDR is an error naming the subnet.
    pub fn from_subnet(s: &Subnet) -> Result<Self, String> {
        let cidr: IpNet = s.cidr.parse().map_err(|e| format!("subnet {}: CIDR {:?}: {e}", s.id, s.cidr))?;
        Ok(Self {
            id: s.id.clone(),
            cidr,
            gateway: s.gateway_ip.clone().filter(|g| !g.is_empty()),
            routes: s
                .host_routes
                .iter()
                .map(|r| VifRoute { destination: r.destination.clone(), gateway: Some(r.nexthop.clone()) })
                .collect(),
        })
    }
}

/// How every VIF of the backend is shaped besides its port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VifShape {
    /// The network id.
    pub network_id: String,
    /// The pod subnets, in the order addresses are listed.
    pub subnets: Vec<SubnetInfo>,
    /// The network's MTU.
    pub mtu: u32,
    /// The OVS integration bridge on the nodes.
    pub bridge: String,
}

/// Who a port is made for and how it is marked, whatever its binding: the project, the
/// `device_owner`, the security groups (Neutron's default group when empty) and the cluster's tag.
#[derive(Clone, Copy, Debug)]
pub struct PortOwner<'a> {
    /// The project the port is made in.
    pub project: &'a str,
    /// The port's `device_owner`.
    pub device_owner: &'a str,
    /// The port's security groups; Neutron's default group when empty.
    pub security_groups: &'a [String],
    /// The cluster's tag, `kuryr.openstack.org/cluster=<id>`.
    pub tag: &'a str,
}

impl VifShape {
    /// Reads the pod network `network_id` and its subnets (`subnet_ids`, every subnet of the
    /// network when empty), as `--pod-network-id` and `--pod-subnet-ids` name them; the errors
    /// name the flag at fault.
    pub async fn read(
        neutron: &Neutron,
        network_id: &str,
        subnet_ids: &[String],
        bridge: &str,
    ) -> anyhow::Result<VifShape> {
        let network = neutron.get_network(network_id).await.map_err(|e| match e {
            e if e.is_not_found() => anyhow::anyhow!("--pod-network-id {network_id}: no such Neutron network"),
            e => anyhow::anyhow!("reading Neutron network {network_id}: {e}"),
        })?;
        let subnet_ids = if subnet_ids.is_empty() { &network.subnets[..] } else { subnet_ids };
        anyhow::ensure!(
            !subnet_ids.is_empty(),
            "Neutron network {network_id} has no subnet; create one or pass --pod-subnet-ids"
        );
        let mut subnets = Vec::new();
        for id in subnet_ids {
            let s = neutron.get_subnet(id).await.map_err(|e| match e {
                e if e.is_not_found() => anyhow::anyhow!("--pod-subnet-ids: no such Neutron subnet {id}"),
                e => anyhow::anyhow!("reading Neutron subnet {id}: {e}"),
            })?;
            anyhow::ensure!(
                s.network_id == network_id,
                "--pod-subnet-ids: subnet {id} is on network {}, not on --pod-network-id {network_id}",
                s.network_id
            );
            subnets.push(SubnetInfo::from_subnet(&s).map_err(|e| anyhow::anyhow!(e))?);
        }
        Ok(VifShape {
            network_id: network_id.to_string(),
            subnets,
            mtu: network.mtu.unwrap_or(1500),
            bridge: bridge.to_string(),
        })
    }

    /// A port to create on the network, one address on each pod subnet, named after `name`
    /// when given; the binding's fields (`device_id`, `binding_host_id`) are the caller's.
    pub fn port_create(&self, owner: PortOwner<'_>, name: Option<String>) -> PortCreate {
        PortCreate {
            network_id: self.network_id.clone(),
            name,
            project_id: Some(owner.project.to_string()),
            fixed_ips: Some(
                self.subnets.iter().map(|s| FixedIp { subnet_id: Some(s.id.clone()), ip_address: None }).collect(),
            ),
            device_owner: Some(owner.device_owner.to_string()),
            security_groups: (!owner.security_groups.is_empty()).then(|| owner.security_groups.to_vec()),
            admin_state_up: Some(true),
            tags: Some(vec![owner.tag.to_string()]),
            ..PortCreate::default()
        }
    }

    /// The VIF of `port`. Fixed IPs on subnets other than the pod subnets are left out; a port
    /// with no address on a pod subnet is an error (it cannot carry the pod's traffic).
    pub fn record(&self, port: &Port) -> Result<VifRecord, String> {
        let mut ips = Vec::new();
        let mut routes = Vec::new();
        let mut subnet_ids = Vec::new();
        for subnet in &self.subnets {
            for fixed in port.fixed_ips.iter().filter(|f| f.subnet_id.as_deref() == Some(subnet.id.as_str())) {
                let Some(addr) = fixed.ip_address.as_deref() else { continue };
                let ip: std::net::IpAddr =
                    addr.parse().map_err(|e| format!("port {}: fixed IP {addr:?}: {e}", port.id))?;
                let net = IpNet::new(ip, subnet.cidr.prefix_len())
                    .map_err(|e| format!("port {}: fixed IP {addr}: {e}", port.id))?;
                ips.push(VifIp { address: net.to_string(), gateway: subnet.gateway.clone() });
                if !subnet_ids.contains(&subnet.id) {
                    subnet_ids.push(subnet.id.clone());
                    routes.extend(subnet.routes.iter().cloned());
                }
            }
        }
        if ips.is_empty() {
            return Err(format!("port {} has no fixed IP on the pod subnets", port.id));
        }
        let mut security_groups = port.security_groups.clone();
        security_groups.sort();
        Ok(VifRecord {
            vif_id: port.id.clone(),
            mac: port.mac_address.to_ascii_lowercase(),
            mtu: self.mtu,
            ips,
            routes,
            bridge: self.bridge.clone(),
            binding: Some(VifBinding::Ovs),
            backend: Some(BACKEND.to_string()),
            network_id: Some(self.network_id.clone()),
            subnet_ids,
            security_groups,
            vlan_id: None,
            attachments: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_openstack::neutron::HostRoute;

    use super::*;

    fn subnet(id: &str, cidr: &str, gw: Option<&str>) -> Subnet {
        Subnet {
            id: id.into(),
            network_id: "net".into(),
            cidr: cidr.into(),
            ip_version: if cidr.contains(':') { 6 } else { 4 },
            gateway_ip: gw.map(Into::into),
            ..Default::default()
        }
    }

    fn fixed(subnet: &str, ip: &str) -> FixedIp {
        FixedIp { subnet_id: Some(subnet.into()), ip_address: Some(ip.into()) }
    }

    #[test]
    fn a_dual_stack_port_becomes_an_ovs_vif() {
        let mut v4 = subnet("s4", "10.100.0.0/16", Some("10.100.0.1"));
        v4.host_routes = vec![HostRoute { destination: "10.96.0.0/12".into(), nexthop: "10.100.0.254".into() }];
        let shape = VifShape {
            network_id: "net".into(),
            subnets: vec![
                SubnetInfo::from_subnet(&v4).unwrap(),
                SubnetInfo::from_subnet(&subnet("s6", "fd00:100::/64", Some("fd00:100::1"))).unwrap(),
            ],
            mtu: 1450,
            bridge: "br-int".into(),
        };
        let port = Port {
            id: "p1".into(),
            network_id: "net".into(),
            mac_address: "FA:16:3E:00:00:01".into(),
            fixed_ips: vec![fixed("s6", "fd00:100::5"), fixed("other", "192.0.2.9"), fixed("s4", "10.100.3.7")],
            status: "DOWN".into(),
            security_groups: vec!["sg-b".into(), "sg-a".into()],
            ..Default::default()
        };
        let r = shape.record(&port).unwrap();
        assert_eq!(r.vif_id, "p1");
        assert_eq!(r.mac, "fa:16:3e:00:00:01");
        assert_eq!(r.mtu, 1450);
        let ips: Vec<(&str, Option<&str>)> = r.ips.iter().map(|i| (i.address.as_str(), i.gateway.as_deref())).collect();
        assert_eq!(ips, [("10.100.3.7/16", Some("10.100.0.1")), ("fd00:100::5/64", Some("fd00:100::1"))]);
        assert_eq!(r.routes, [VifRoute { destination: "10.96.0.0/12".into(), gateway: Some("10.100.0.254".into()) }]);
        assert_eq!(r.subnet_ids, ["s4", "s6"]);
        assert_eq!(r.security_groups, ["sg-a", "sg-b"]);
        assert_eq!(
            (r.binding, r.backend.as_deref(), r.bridge.as_str()),
            (Some(VifBinding::Ovs), Some("neutron"), "br-int")
        );
    }

    #[test]
    fn ports_without_pod_addresses_and_bad_subnets_are_refused() {
        let shape = VifShape {
            network_id: "net".into(),
            subnets: vec![SubnetInfo::from_subnet(&subnet("s4", "10.100.0.0/16", None)).unwrap()],
            mtu: 1500,
            bridge: "br-int".into(),
        };
        let port = Port { id: "p2".into(), fixed_ips: vec![fixed("other", "192.0.2.9")], ..Default::default() };
        assert_eq!(shape.record(&port).unwrap_err(), "port p2 has no fixed IP on the pod subnets");
        let e = SubnetInfo::from_subnet(&subnet("bad", "10.1.0.0/33", None)).unwrap_err();
        assert!(e.starts_with("subnet bad: CIDR \"10.1.0.0/33\""), "{e}");
        // No gateway: the address still carries the subnet's prefix.
        let port = Port { id: "p3".into(), fixed_ips: vec![fixed("s4", "10.100.0.9")], ..Default::default() };
        assert_eq!(shape.record(&port).unwrap().ips, [VifIp { address: "10.100.0.9/16".into(), gateway: None }]);
    }
}
