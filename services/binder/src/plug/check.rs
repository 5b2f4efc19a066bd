//! CNI CHECK: what a pod interface looks like ([`inspect`]) against what ADD set up ([`diff`]).

use std::path::PathBuf;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::nl::{self, in_netns};
use super::{PlugError, PlugSpec, Route, format_mac, parse_mac};

/// A pod interface as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observed {
    /// Lowercase `aa:bb:...`.
    pub mac: String,
    pub mtu: u32,
    /// Every address on the interface, link-local ones included.
    pub addresses: Vec<IpNet>,
    /// Routes out of the interface in the main table, without the ones the kernel adds by itself
    /// (connected subnets, `fe80::/64`, multicast).
    pub routes: Vec<Route>,
    /// Administratively up.
    pub up: bool,
}

/// What a pod interface should look like; from [`PlugSpec::expected`] or from a CNI prevResult.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expected {
    /// The interface's name, for messages.
    pub ifname: String,
    /// Not checked when `None`.
    pub mac: Option<String>,
    /// Not checked when `None`.
    pub mtu: Option<u32>,
    pub addresses: Vec<IpNet>,
    pub routes: Vec<Route>,
}

impl PlugSpec {
    /// What [`super::plug`] sets up for this spec.
    pub fn expected(&self) -> Expected {
        Expected {
            ifname: self.ifname.clone(),
            mac: Some(self.mac.clone()),
            mtu: (self.mtu > 0).then_some(self.mtu),
            addresses: self.ips.iter().map(|ip| ip.address).collect(),
            routes: self.all_routes(),
        }
    }
}

/// Reads the interface `ifname` in the namespace `netns`. A missing interface is
/// [`PlugError::LinkNotFound`], a missing namespace [`PlugError::NetnsMissing`].
pub async fn inspect(netns: PathBuf, ifname: impl Into<String>) -> Result<Observed, PlugError> {
    let ifname = ifname.into();
    in_netns(Some(netns), move |nl| async move {
        let link = nl.require(&ifname).await?;
        let index = link.header.index;
        Ok(Observed {
            mac: nl::link_mac(&link).map(format_mac).unwrap_or_default(),
            mtu: nl::link_mtu(&link).unwrap_or_default(),
            up: nl::link_up(&link),
            addresses: nl.addresses(index).await?,
            routes: nl.routes(index).await?,
        })
    })
    .await
}

/// Each way the interface falls short of what [`super::plug`] set up for `spec`; see
/// [`diff_expected`].
pub fn diff(spec: &PlugSpec, observed: &Observed) -> Vec<String> {
    diff_expected(&spec.expected(), observed)
}

/// Each way `observed` falls short of `expected`, in words: `interface eth0 is down`,
/// `MAC 02:00:00:00:00:01 != 02:00:00:00:00:02`, `MTU 1400 != 1500` (expected first),
/// `missing address 10.0.0.5/24`, `missing route 0.0.0.0/0 via 10.0.0.1`. Empty when all is well.
///
/// Only what ADD set up is checked: extra addresses and routes (added by the kernel or by
/// someone else inside the pod) are not differences. An expected on-link route for a subnet
/// the interface is connected to counts as present, as the kernel's connected route covers it.
pub fn diff_expected(expected: &Expected, observed: &Observed) -> Vec<String> {
    let mut out = Vec::new();
    if !observed.up {
        out.push(format!("interface {} is down", expected.ifname));
    }
    if let Some(mac) = &expected.mac {
        let same = parse_mac(mac).is_some_and(|m| format_mac(&m) == observed.mac);
        if !same {
            out.push(format!("MAC {mac} != {}", observed.mac));
        }
    }
    if let Some(mtu) = expected.mtu
        && mtu != observed.mtu
    {
        out.push(format!("MTU {mtu} != {}", observed.mtu));
    }
    for addr in expected.addresses.iter().filter(|a| !observed.addresses.contains(a)) {
        out.push(format!("missing address {addr}"));
    }
    let connected: Vec<IpNet> = observed.addresses.iter().map(IpNet::trunc).collect();
    for route in expected.routes.iter().map(Route::normalized) {
        let present = observed.routes.iter().any(|r| r.normalized() == route)
            || (route.gw.is_none() && connected.contains(&route.dst));
        if !present {
            match route.gw {
                Some(gw) => out.push(format!("missing route {} via {gw}", route.dst)),
                None => out.push(format!("missing route {}", route.dst)),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn route(dst: &str, gw: Option<&str>) -> Route {
        Route { dst: net(dst), gw: gw.map(|g| g.parse().unwrap()) }
    }

    fn expected() -> Expected {
        Expected {
            ifname: "eth0".into(),
            mac: Some("02:AA:00:00:00:01".into()),
            mtu: Some(1400),
            addresses: vec![net("10.0.0.5/24"), net("fd00::5/64")],
            routes: vec![
                route("0.0.0.0/0", Some("10.0.0.1")),
                route("10.0.0.0/24", None),
                route("::/0", Some("fd00::1")),
            ],
        }
    }

    fn observed() -> Observed {
        Observed {
            mac: "02:aa:00:00:00:01".into(),
            mtu: 1400,
            addresses: vec![net("10.0.0.5/24"), net("fd00::5/64"), net("fe80::aa:ff:fe00:1/64")],
            routes: vec![
                route("0.0.0.0/0", Some("10.0.0.1")),
                route("::/0", Some("fd00::1")),
                route("192.168.0.0/16", None),
            ],
            up: true,
        }
    }

    #[test]
    fn matching_interface_has_no_differences() {
        assert_eq!(diff_expected(&expected(), &observed()), Vec::<String>::new());
    }

    #[test]
    fn each_difference_is_named() {
        let mut o = observed();
        o.up = false;
        o.mtu = 1500;
        o.mac = "02:aa:00:00:00:02".into();
        o.addresses.retain(|a| *a != net("10.0.0.5/24"));
        o.routes.retain(|r| r.dst.prefix_len() != 0 || r.dst.addr().is_ipv6());
        assert_eq!(
            diff_expected(&expected(), &o),
            vec![
                "interface eth0 is down",
                "MAC 02:AA:00:00:00:01 != 02:aa:00:00:00:02",
                "MTU 1400 != 1500",
                "missing address 10.0.0.5/24",
                "missing route 0.0.0.0/0 via 10.0.0.1",
                // The connected route went with the address.
                "missing route 10.0.0.0/24",
            ]
        );
    }

    #[test]
    fn unchecked_fields_are_skipped() {
        let e = Expected { ifname: "eth0".into(), ..Default::default() };
        let o = Observed { mac: "x".into(), mtu: 9000, addresses: vec![], routes: vec![], up: true };
        assert!(diff_expected(&e, &o).is_empty());
    }
}
