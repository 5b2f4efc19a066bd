//! The VIF a pod gets from the embedded IPAM: the shape of the allocator's `Vif` message without
//! the pod and state, built from the network plan and the pod's addresses.
//!
//! Which prefix length a pod's address carries, and why it is the **block's**, not the network's:
//! pods are attached to a Linux bridge on their node, and that bridge holds the gateway (the
//! block's first usable address) and the node's pods, nothing else. Pods of other nodes are not
//! on that L2 segment. With the block prefix a pod resolves (ARP/ND) only neighbours that really
//! are on its bridge, and sends everything else, including pods of other nodes, to its gateway;
//! the node then routes it to the owning node (`crate::k8s::blocks` feeds those routes).
//! With the network prefix a pod would ARP for pods on other nodes, which nobody answers unless
//! every node runs proxy ARP/NDP for the whole network: more state, more broadcast, and the
//! failure mode is silent. A node that owns several blocks carries each block's gateway on the
//! same bridge, so pods of two blocks on one node reach each other through the node.

use std::net::IpAddr;

use ipnet::IpNet;

use super::block::{Block, Family};
use super::mac::MacAddr;
use super::plan::{NetworkPlan, Route};

/// One pod address with its gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpConfig {
    /// The pod address with the block's prefix length, e.g. `10.244.3.7/24`.
    pub address: IpNet,
    /// The block's gateway, on the node's bridge.
    pub gateway: IpAddr,
}

/// What the binder needs to plug a pod, as the embedded IPAM decides it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VifConfig {
    /// Derived from the pod's address; see [`super::mac`].
    pub mac: MacAddr,
    /// The network's MTU.
    pub mtu: u32,
    /// One address per family, IPv4 first.
    pub ips: Vec<IpConfig>,
    /// The network's extra routes, next hops filled in.
    pub routes: Vec<Route>,
    /// The node bridge to attach the host end to.
    pub bridge: String,
}

impl NetworkPlan {
    /// The VIF for a pod holding `assigned` (block, address) pairs, or `None` when it holds no
    /// address. Extra routes of a family the pod has no address in are left out.
    pub fn vif(&self, assigned: &[(Block, IpAddr)]) -> Option<VifConfig> {
        let mut assigned = assigned.to_vec();
        assigned.sort_by_key(|(b, _)| b.family());
        let addresses: Vec<IpAddr> = assigned.iter().map(|(_, ip)| *ip).collect();
        let mac = MacAddr::for_pod(&addresses)?;
        let gateway_of = |family: Family| assigned.iter().find(|(b, _)| b.family() == family).map(|(b, _)| b.gateway());
        let routes = self
            .routes()
            .iter()
            .filter_map(|r| {
                let gateway = r.gateway.or_else(|| gateway_of(Family::of_net(&r.destination)))?;
                Some(Route { destination: r.destination, gateway: Some(gateway) })
            })
            .collect();
        Some(VifConfig {
            mac,
            mtu: self.mtu(),
            ips: assigned
                .iter()
                .map(|(b, ip)| IpConfig { address: b.pod_address(*ip), gateway: b.gateway() })
                .collect(),
            routes,
            bridge: self.bridge().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn pods_get_the_block_prefix_and_gateway() {
        let plan = NetworkPlan::new(&["10.244.0.0/16".into(), "fd00:10::/64".into()], 24, 112)
            .unwrap()
            .with_mtu(1450)
            .unwrap()
            .with_routes([("10.96.0.0/12", None), ("fd00:96::/108", None), ("192.168.0.0/16", Some("10.244.3.254"))])
            .unwrap()
            .with_bridge("br-pods")
            .unwrap();
        let v6 = Block::parse("fd00:10::3:0/112").unwrap();
        let v4 = Block::parse("10.244.3.0/24").unwrap();
        let vif = plan.vif(&[(v6, ip("fd00:10::3:7")), (v4, ip("10.244.3.7"))]).unwrap();
        assert_eq!(vif.mac.to_string(), "0a:58:0a:f4:03:07");
        assert_eq!(vif.mtu, 1450);
        assert_eq!(vif.bridge, "br-pods");
        let ips: Vec<_> = vif.ips.iter().map(|c| (c.address.to_string(), c.gateway.to_string())).collect();
        assert_eq!(
            ips,
            [("10.244.3.7/24".into(), "10.244.3.1".into()), ("fd00:10::3:7/112".into(), "fd00:10::3:1".into())]
                as [(String, String); 2]
        );
        let routes: Vec<_> =
            vif.routes.iter().map(|r| (r.destination.to_string(), r.gateway.unwrap().to_string())).collect();
        assert_eq!(
            routes,
            [
                ("10.96.0.0/12".into(), "10.244.3.1".into()),
                ("fd00:96::/108".into(), "fd00:10::3:1".into()),
                ("192.168.0.0/16".into(), "10.244.3.254".into())
            ] as [(String, String); 3]
        );
    }

    #[test]
    fn no_addresses_no_vif() {
        let plan = NetworkPlan::new(&["10.244.0.0/16".into()], 24, 112).unwrap();
        assert_eq!(plan.vif(&[]), None);
    }
}
