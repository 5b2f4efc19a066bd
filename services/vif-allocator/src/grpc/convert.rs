//! Between the allocator's VIF ([`Vif`], [`VifRecord`], [`VifState`] of [`crate::core`]) and the
//! VIF as streamed to binders (`kuryr.allocator.v1.Vif`), and between [`NodeRoutes`] and their
//! message: the protobuf types stay at this edge. The VIF index holds the domain types; each
//! response is encoded here as it is sent.

use kuryr_proto::allocator::v1 as pb;

use crate::core::PodKey;
use crate::core::vif::subnets_of;
use crate::core::{AttachedRecord, NodeRoutes, Vif, VifBinding, VifRecord, VifState};

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

/// A VIF of the index, as streamed.
pub fn vif_to_proto(v: &Vif) -> pb::Vif {
    match &v.failure {
        // Failed before anything was recorded: the pod, the state and why, nothing else.
        Some(message) => pb::Vif {
            pod: Some(pod_ref(&v.pod, &v.node)),
            state: state_to_proto(v.state) as i32,
            message: message.clone(),
            network_id: v.network.clone(),
            ..pb::Vif::default()
        },
        None => encode(&v.pod, &v.node, &v.network, &v.record, v.subnet_ids.clone(), v.state),
    }
}

/// A node's routes, as streamed.
pub fn routes_to_proto(r: &NodeRoutes) -> pb::NodeRoutes {
    pb::NodeRoutes { node_name: r.node_name.clone(), node_ips: r.node_ips.clone(), cidrs: r.cidrs.clone() }
}

fn pod_ref(pod: &PodKey, node: &str) -> pb::PodRef {
    pb::PodRef {
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        uid: pod.uid.clone(),
        node_name: node.to_string(),
    }
}

/// The VIF of `pod` on `node`, as streamed.
pub fn to_proto(pod: &PodKey, node: &str, network: &str, record: &VifRecord, state: VifState) -> pb::Vif {
    encode(pod, node, network, record, subnets_of(&record.ips, &record.subnet_ids), state)
}

fn encode(
    pod: &PodKey,
    node: &str,
    network: &str,
    record: &VifRecord,
    subnet_ids: Vec<String>,
    state: VifState,
) -> pb::Vif {
    let driver = match record.binding {
        Some(VifBinding::Ovs) => pb::BindingDriver::Ovs,
        Some(VifBinding::Vlan) => pb::BindingDriver::Vlan,
        Some(VifBinding::Bridge) | None => pb::BindingDriver::Bridge,
    };
    pb::Vif {
        pod: Some(pod_ref(pod, node)),
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
        binding: Some(pb::Binding {
            driver: driver as i32,
            bridge: record.bridge.clone(),
            host_ifname: String::new(),
            vlan_id: record.vlan_id.map_or(0, u32::from),
        }),
        state: state_to_proto(state) as i32,
        backend: record.backend.clone().unwrap_or_else(|| BACKEND.to_string()),
        // The embedded IPAM's VIFs are READY once plugged (its `ready_when_plugged`); a Neutron
        // port waits for Neutron to report it ACTIVE.
        ready_when_plugged: record.backend.as_deref().is_none_or(|b| b == BACKEND),
        network_id: record.network_id.clone().unwrap_or_else(|| network.to_string()),
        subnet_ids,
        security_groups: record.security_groups.clone(),
        message: String::new(),
        dns: None,
        attachments: record.attachments.iter().map(attached_to_proto).collect(),
    }
}

/// A further interface as streamed: its own VIF (no pod, state or DNS: the pod's VIF has them),
/// on a Linux bridge (embedded) or Open vSwitch with its port id as `iface-id` (Neutron).
fn attached_to_proto(a: &AttachedRecord) -> pb::AttachedVif {
    let vif = pb::Vif {
        vif_id: a.vif_id.clone(),
        mac: a.mac.clone(),
        mtu: a.mtu,
        ips: a
            .ips
            .iter()
            .map(|ip| pb::IpConfig { address: ip.address.clone(), gateway: ip.gateway.clone().unwrap_or_default() })
            .collect(),
        routes: a
            .routes
            .iter()
            .map(|r| pb::Route { destination: r.destination.clone(), gateway: r.gateway.clone().unwrap_or_default() })
            .collect(),
        binding: Some(pb::Binding {
            driver: match a.binding {
                Some(VifBinding::Ovs) => pb::BindingDriver::Ovs,
                Some(VifBinding::Vlan) => pb::BindingDriver::Vlan,
                Some(VifBinding::Bridge) | None => pb::BindingDriver::Bridge,
            } as i32,
            bridge: a.bridge.clone(),
            host_ifname: String::new(),
            vlan_id: 0,
        }),
        backend: if a.binding == Some(VifBinding::Ovs) {
            crate::backend::neutron::vif::BACKEND.to_string()
        } else {
            BACKEND.to_string()
        },
        network_id: a.network.clone(),
        subnet_ids: subnets_of(&a.ips, &a.subnet_ids),
        security_groups: a.security_groups.clone(),
        ..pb::Vif::default()
    };
    pb::AttachedVif { attachment: a.attachment.clone(), ifname: a.ifname.clone(), vif: Some(vif) }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::core::{VifIp, VifRoute};

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
            routes: vec![VifRoute { destination: "10.96.0.0/12".into(), gateway: Some("10.244.3.1".into()) }],
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
        let b = v.binding.clone().unwrap();
        assert_eq!((b.driver(), b.bridge.as_str()), (pb::BindingDriver::Bridge, "kuryr0"));
        assert!(v.ready_when_plugged, "the embedded IPAM's VIF is ready once plugged");
        let port = VifRecord { backend: Some(crate::backend::neutron::vif::BACKEND.into()), ..record.clone() };
        assert!(
            !to_proto(&pod, "n1", "pods", &port, VifState::Allocated).ready_when_plugged,
            "a port waits for ACTIVE"
        );
        let failed = vif_to_proto(&Vif::failed(&pod, "n1", "pods", "no addresses left"));
        let want = pb::Vif {
            pod: v.pod.clone(),
            state: pb::VifState::Failed as i32,
            message: "no addresses left".into(),
            network_id: "pods".into(),
            ..pb::Vif::default()
        };
        assert_eq!(failed, want, "a failure carries the pod, the state and why only");
        assert_eq!(vif_to_proto(&Vif::recorded(&pod, "n1", "pods", record.clone(), VifState::Ready)), v);
        for s in [VifState::Allocated, VifState::Plugged, VifState::Ready, VifState::Failed] {
            assert_eq!(state_from_proto(state_to_proto(s)), Some(s));
        }
    }
}
