//! The network between the nodes of a test cluster: a private network namespace holding one Linux
//! bridge, with every node's namespace plugged into it by a veth pair — the "physical" L2 segment a
//! real cluster's nodes share. Node addresses are private to these namespaces; the host's network
//! configuration is never touched.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use anyhow::{Context, Result};

use crate::netns::Netns;
use crate::node::netns_exec;

/// The bridge inside the underlay namespace.
const BRIDGE: &str = "br0";
/// The node's end of its uplink, inside the node's namespace.
pub const NODE_IFNAME: &str = "eth0";
/// Node `i` (0-based) gets host number `FIRST_HOST + i` on the underlay subnets.
const FIRST_HOST: u8 = 10;

/// The underlay namespace and its bridge; deleting the namespace (on drop) deletes the bridge and
/// every veth pair plugged into it, whose other ends are the nodes' uplinks.
#[derive(Debug)]
pub struct Underlay {
    /// Distinguishes concurrent clusters in addresses (`172.30.<id>.0/24`), so that a failure
    /// message names one cluster.
    id: u8,
    netns: Netns,
}

impl Underlay {
    /// Creates the namespace and its bridge (up, with IPv6 disabled on the bridge itself: it only
    /// switches).
    pub fn new(id: u8) -> Result<Self> {
        let netns = Netns::new("kul").context("creating the underlay network namespace")?;
        netns.exec(&["ip", "link", "add", BRIDGE, "type", "bridge"])?;
        netns.exec(&["sysctl", "-qw", &format!("net.ipv6.conf.{BRIDGE}.disable_ipv6=1")])?;
        netns.exec(&["ip", "link", "set", BRIDGE, "up"])?;
        Ok(Self { id, netns })
    }

    /// The underlay namespace's name.
    pub fn netns_name(&self) -> &str {
        &self.netns.name
    }

    /// Node `index`'s underlay IPv4 address, `172.30.<id>.<10+index>`.
    pub fn node_ipv4(&self, index: usize) -> Ipv4Addr {
        Ipv4Addr::new(172, 30, self.id, host_number(index))
    }

    /// Node `index`'s underlay IPv6 address, `fd00:172:30:<id>::<10+index>`.
    pub fn node_ipv6(&self, index: usize) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x172, 0x30, u16::from(self.id), 0, 0, 0, u16::from(host_number(index)))
    }

    /// Plugs the network namespace at `node_netns` into the bridge as node `index`: a veth pair
    /// created inside the two namespaces (never in the host's), the node's end named
    /// [`NODE_IFNAME`] with both underlay addresses (no DAD: the segment is private and the
    /// addresses unique by construction). Returns the addresses.
    pub async fn attach(&self, index: usize, node_netns: &Path) -> Result<Vec<IpAddr>> {
        let port = format!("n{index}");
        let ns = node_netns.to_str().context("netns path is not UTF-8")?;
        let (v4, v6) = (self.node_ipv4(index), self.node_ipv6(index));
        self.netns
            .exec(&["ip", "link", "add", &port, "type", "veth", "peer", "name", NODE_IFNAME, "netns", ns])
            .with_context(|| format!("creating the uplink of node {index}"))?;
        self.netns.exec(&["ip", "link", "set", &port, "master", BRIDGE, "up"])?;
        let (a4, a6) = (format!("{v4}/24"), format!("{v6}/64"));
        netns_exec(node_netns, &["ip", "addr", "add", &a4, "dev", NODE_IFNAME]).await?;
        netns_exec(node_netns, &["ip", "addr", "add", &a6, "dev", NODE_IFNAME, "nodad"]).await?;
        netns_exec(node_netns, &["ip", "link", "set", NODE_IFNAME, "up"]).await?;
        Ok(vec![IpAddr::V4(v4), IpAddr::V6(v6)])
    }
}

fn host_number(index: usize) -> u8 {
    u8::try_from(index).ok().and_then(|i| i.checked_add(FIRST_HOST)).unwrap_or(u8::MAX)
}
