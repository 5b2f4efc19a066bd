//! The CNI result of an ADD: the pod's interfaces, addresses, routes and DNS as plugged.

use super::*;

/// The CNI result of an ADD: the host end, the pod end, addresses and routes.
pub(super) fn result_for(vif: &Vif, ifname: &str, netns: &Path, plugged: &plug::Plugged) -> pb::CniResult {
    let interfaces = vec![
        pb::Interface {
            name: plugged.host_ifname.clone(),
            mac: plugged.host_mac.clone(),
            mtu: vif.mtu,
            sandbox: String::new(),
        },
        pb::Interface {
            name: ifname.to_string(),
            mac: plugged.sandbox_mac.clone(),
            mtu: vif.mtu,
            sandbox: netns.display().to_string(),
        },
    ];
    let ips = vif
        .ips
        .iter()
        .map(|ip| pb::IpConfig { address: ip.address.clone(), gateway: ip.gateway.clone(), interface: Some(1) })
        .collect();
    let mut routes = Vec::new();
    for ip in &vif.ips {
        if !ip.gateway.is_empty() {
            let dst = if ip.gateway.contains(':') { "::/0" } else { "0.0.0.0/0" };
            routes.push(pb::Route { dst: dst.into(), gw: ip.gateway.clone() });
        }
    }
    routes.extend(vif.routes.iter().map(|r| pb::Route { dst: r.destination.clone(), gw: r.gateway.clone() }));
    let dns = vif.dns.as_ref().map(|d| pb::Dns {
        nameservers: d.nameservers.clone(),
        domain: d.domain.clone(),
        search: d.search.clone(),
        options: d.options.clone(),
    });
    pb::CniResult { interfaces, ips, routes, dns }
}
