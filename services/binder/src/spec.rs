//! From the allocator's VIF to what the plugging layer needs.

use std::net::IpAddr;
use std::path::Path;

use ipnet::IpNet;
use kuryr_proto::allocator::v1::Vif;

use crate::plug::{self, BindingDriver, IpConfig, PlugSpec, Route};

impl PlugSpec {
    /// The plug request for `vif` in the pod `netns`/`ifname`. Fails naming the field when the
    /// VIF carries something unusable (a malformed address), so a bad VIF never half-plugs.
    pub fn from_vif(
        container_id: &str,
        netns: &Path,
        ifname: &str,
        vif: &Vif,
        driver: BindingDriver,
    ) -> Result<Self, String> {
        let mut ips = Vec::with_capacity(vif.ips.len());
        for ip in &vif.ips {
            let address: IpNet = ip.address.parse().map_err(|e| format!("address `{}`: {e}", ip.address))?;
            let gateway = parse_gateway(&ip.gateway)?;
            ips.push(IpConfig { address, gateway });
        }
        let mut routes = Vec::with_capacity(vif.routes.len());
        for r in &vif.routes {
            let dst: IpNet =
                r.destination.parse().map_err(|e| format!("route destination `{}`: {e}", r.destination))?;
            routes.push(Route { dst, gw: parse_gateway(&r.gateway)? });
        }
        let host_ifname = vif
            .binding
            .as_ref()
            .map(|b| b.host_ifname.clone())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| plug::host_ifname(container_id, ifname));
        Ok(Self {
            container_id: container_id.to_string(),
            netns: netns.to_path_buf(),
            ifname: ifname.to_string(),
            host_ifname,
            mac: vif.mac.clone(),
            mtu: vif.mtu,
            ips,
            routes,
            driver,
        })
    }
}

fn parse_gateway(s: &str) -> Result<Option<IpAddr>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    s.parse().map(Some).map_err(|e| format!("gateway `{s}`: {e}"))
}

#[cfg(test)]
mod tests {
    use kuryr_proto::allocator::v1::{IpConfig as PbIp, Route as PbRoute};

    use super::*;

    #[test]
    fn vif_to_spec() {
        let vif = Vif {
            mac: "0a:58:0a:00:00:05".into(),
            mtu: 1400,
            ips: vec![
                PbIp { address: "10.0.0.5/24".into(), gateway: "10.0.0.1".into() },
                PbIp { address: "fd00::5/64".into(), gateway: String::new() },
            ],
            routes: vec![PbRoute { destination: "10.96.0.0/12".into(), gateway: "10.0.0.1".into() }],
            ..Default::default()
        };
        let d = BindingDriver::Bridge { bridge: "kuryr0".into() };
        let s = PlugSpec::from_vif("c1", Path::new("/run/netns/x"), "eth0", &vif, d.clone()).unwrap();
        assert_eq!(s.host_ifname, plug::host_ifname("c1", "eth0"));
        assert_eq!(s.routes[0].gw, Some("10.0.0.1".parse().unwrap()));
        let bad = Vif { ips: vec![PbIp { address: "10.0.0.300/24".into(), gateway: String::new() }], ..vif };
        let e = PlugSpec::from_vif("c1", Path::new("/x"), "eth0", &bad, d).unwrap_err();
        assert!(e.contains("10.0.0.300/24"), "{e}");
    }
}
