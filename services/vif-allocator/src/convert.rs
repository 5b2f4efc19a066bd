//! Between the VIF as recorded in a PodVif status ([`VifRecord`], [`VifState`]) and the VIF as
//! streamed to binders (`kuryr.allocator.v1.Vif`).

use kuryr_proto::allocator::v1 as pb;

use crate::crd::{VifBinding, VifRecord, VifState};
use crate::ipam::ipnet::IpNet;
use crate::ipam::store::PodKey;

/// The `backend` of VIFs whose record names none (the embedded IPAM's).
pub const BACKEND: &str = "embedded";

/// The streamed state of a recorded one.
pub fn state_to_proto(state: VifState) -> pb::VifState {
    match state {
        VifState::Allocated => pb::VifState::Allocated,
        VifState::Plugged => pb::VifState::Plugged,
        VifState::Ready => pb::VifState::Ready,
        VifState::Failed => pb::VifState::Failed,
    }
}

/// The recorded state of a streamed one (`None` for UNSPECIFIED).
pub fn state_from_proto(state: pb::VifState) -> Option<VifState> {
    match state {
        pb::VifState::Unspecified => None,
        pb::VifState::Allocated => Some(VifState::Allocated),
        pb::VifState::Plugged => Some(VifState::Plugged),
        pb::VifState::Ready => Some(VifState::Ready),
        pb::VifState::Failed => Some(VifState::Failed),
    }
}

/// The VIF of `pod` on `node`, as streamed.
pub fn to_proto(pod: &PodKey, node: &str, network: &str, record: &VifRecord, state: VifState) -> pb::Vif {
    // Embedded: the subnets are the blocks the addresses come from (the address with its
    // prefix, truncated). Neutron records its subnet ids.
    let subnet_ids = if record.subnet_ids.is_empty() {
        record.ips.iter().filter_map(|ip| ip.address.parse::<IpNet>().ok()).map(|net| net.trunc().to_string()).collect()
    } else {
        record.subnet_ids.clone()
    };
    let driver = match record.binding {
        Some(VifBinding::Ovs) => pb::BindingDriver::Ovs,
        Some(VifBinding::Bridge) | None => pb::BindingDriver::Bridge,
    };
    pb::Vif {
        pod: Some(pb::PodRef {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            uid: pod.uid.clone(),
            node_name: node.to_string(),
        }),
        vif_id: record.vif_id.clone(),
        mac: record.mac.clone(),
        mtu: record.mtu,
        ips: record
            .ips
            .iter()
            .map(|ip| pb::IpConfig { address: ip.address.clone(), gateway: ip.gateway.clone().unwrap_or_default() })
            .collect(),
        routes: record
            .routes
            .iter()
            .map(|r| pb::Route { destination: r.destination.clone(), gateway: r.gateway.clone().unwrap_or_default() })
            .collect(),
        binding: Some(pb::Binding { driver: driver as i32, bridge: record.bridge.clone(), host_ifname: String::new() }),
        state: state_to_proto(state) as i32,
        backend: record.backend.clone().unwrap_or_else(|| BACKEND.to_string()),
        network_id: record.network_id.clone().unwrap_or_else(|| network.to_string()),
        subnet_ids,
        security_groups: record.security_groups.clone(),
        message: String::new(),
        dns: None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::crd::{RouteSpec, VifIp};

    #[test]
    fn a_record_becomes_a_bridge_vif() {
        let record = VifRecord {
            vif_id: "pods/10.244.3.9".into(),
            mac: "0a:58:0a:f4:03:09".into(),
            mtu: 1450,
            ips: vec![
                VifIp { address: "10.244.3.9/24".into(), gateway: Some("10.244.3.1".into()) },
                VifIp { address: "fd00::3:9/112".into(), gateway: Some("fd00::3:1".into()) },
            ],
            routes: vec![RouteSpec { destination: "10.96.0.0/12".into(), gateway: Some("10.244.3.1".into()) }],
            bridge: "kuryr0".into(),
            ..VifRecord::default()
        };
        let pod = PodKey::new("ns", "p", "u1");
        let v = to_proto(&pod, "n1", "pods", &record, VifState::Ready);
        assert_eq!(v.state(), pb::VifState::Ready);
        assert_eq!(v.pod.as_ref().unwrap().node_name, "n1");
        assert_eq!((v.mac.as_str(), v.mtu, v.vif_id.as_str()), ("0a:58:0a:f4:03:09", 1450, "pods/10.244.3.9"));
        assert_eq!(v.ips[1].gateway, "fd00::3:1");
        assert_eq!(v.routes[0].destination, "10.96.0.0/12");
        assert_eq!(v.subnet_ids, ["10.244.3.0/24", "fd00::3:0/112"]);
        let b = v.binding.unwrap();
        assert_eq!((b.driver(), b.bridge.as_str()), (pb::BindingDriver::Bridge, "kuryr0"));
        for s in [VifState::Allocated, VifState::Plugged, VifState::Ready, VifState::Failed] {
            assert_eq!(state_from_proto(state_to_proto(s)), Some(s));
        }
    }
}
