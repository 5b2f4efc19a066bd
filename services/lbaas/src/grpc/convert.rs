//! The `kuryr.lbaas.v1` messages of the core types: specs as WatchLoadBalancers streams them, and
//! the LoadBalancer message Get/List answer with. The only place where a spec becomes protobuf.

use kuryr_proto::lbaas::v1 as pb;

use crate::core::lb::{Listener, LoadBalancerSpec, Member, Pool, Protocol, SessionAffinity, TrafficPolicy};
use crate::core::view::split;
use crate::k8s::Record;

fn protocol(p: Protocol) -> pb::Protocol {
    match p {
        Protocol::Tcp => pb::Protocol::Tcp,
        Protocol::Udp => pb::Protocol::Udp,
        Protocol::Sctp => pb::Protocol::Sctp,
    }
}

/// A protocol of the contract; unset or unknown is TCP.
fn protocol_from(p: i32) -> Protocol {
    match pb::Protocol::try_from(p) {
        Ok(pb::Protocol::Udp) => Protocol::Udp,
        Ok(pb::Protocol::Sctp) => Protocol::Sctp,
        _ => Protocol::Tcp,
    }
}

fn policy(p: TrafficPolicy) -> pb::TrafficPolicy {
    match p {
        TrafficPolicy::Cluster => pb::TrafficPolicy::Cluster,
        TrafficPolicy::Local => pb::TrafficPolicy::Local,
    }
}

/// A traffic policy of the contract; unset is Cluster.
fn policy_from(p: i32) -> TrafficPolicy {
    if p == pb::TrafficPolicy::Local as i32 { TrafficPolicy::Local } else { TrafficPolicy::Cluster }
}

fn member(m: &Member) -> pb::Member {
    pb::Member {
        address: m.address.clone(),
        port: m.port,
        ready: m.ready,
        serving: m.serving,
        terminating: m.terminating,
        node_name: m.node_name.clone(),
        target_pod: m.target_pod.clone(),
    }
}

fn member_from(m: &pb::Member) -> Member {
    Member {
        address: m.address.clone(),
        port: m.port,
        ready: m.ready,
        serving: m.serving,
        terminating: m.terminating,
        node_name: m.node_name.clone(),
        target_pod: m.target_pod.clone(),
    }
}

impl From<&LoadBalancerSpec> for pb::LoadBalancerSpec {
    fn from(s: &LoadBalancerSpec) -> Self {
        pb::LoadBalancerSpec {
            namespace: s.namespace.clone(),
            name: s.name.clone(),
            uid: s.uid.clone(),
            vips: s.vips.clone(),
            listeners: s
                .listeners
                .iter()
                .map(|l| pb::Listener {
                    protocol: protocol(l.protocol) as i32,
                    port: l.port,
                    name: l.name.clone(),
                    pool: l.pool.as_ref().map(|p| pb::Pool { members: p.members.iter().map(member).collect() }),
                    node_port: l.node_port,
                })
                .collect(),
            session_affinity: s
                .session_affinity
                .map(|a| pb::SessionAffinity { client_ip: a.client_ip, timeout_seconds: a.timeout_seconds }),
            service_type: s.service_type.clone(),
            generation: s.generation,
            external_ips: s.external_ips.clone(),
            ingress_ips: s.ingress_ips.clone(),
            external_traffic_policy: policy(s.external_traffic_policy) as i32,
            internal_traffic_policy: policy(s.internal_traffic_policy) as i32,
        }
    }
}

impl From<&pb::LoadBalancerSpec> for LoadBalancerSpec {
    /// A spec as streamed; an unset or unknown protocol is TCP and an unset traffic policy is
    /// Cluster, as everywhere in the contract.
    fn from(s: &pb::LoadBalancerSpec) -> Self {
        LoadBalancerSpec {
            namespace: s.namespace.clone(),
            name: s.name.clone(),
            uid: s.uid.clone(),
            vips: s.vips.clone(),
            listeners: s
                .listeners
                .iter()
                .map(|l| Listener {
                    protocol: protocol_from(l.protocol),
                    port: l.port,
                    name: l.name.clone(),
                    pool: l.pool.as_ref().map(|p| Pool { members: p.members.iter().map(member_from).collect() }),
                    node_port: l.node_port,
                })
                .collect(),
            session_affinity: s
                .session_affinity
                .map(|a| SessionAffinity { client_ip: a.client_ip, timeout_seconds: a.timeout_seconds }),
            service_type: s.service_type.clone(),
            generation: s.generation,
            external_ips: s.external_ips.clone(),
            ingress_ips: s.ingress_ips.clone(),
            external_traffic_policy: policy_from(s.external_traffic_policy),
            internal_traffic_policy: policy_from(s.internal_traffic_policy),
        }
    }
}

/// What an LB_DELETED event carries of `spec`: the Service's namespace, name and uid only.
pub fn identity(spec: &LoadBalancerSpec) -> pb::LoadBalancerSpec {
    pb::LoadBalancerSpec {
        namespace: spec.namespace.clone(),
        name: spec.name.clone(),
        uid: spec.uid.clone(),
        ..Default::default()
    }
}

/// The LoadBalancer message of a record.
pub fn load_balancer(key: &str, r: &Record) -> pb::LoadBalancer {
    let (ns, name) = split(key);
    let status = r.status.clone().unwrap_or_default();
    pb::LoadBalancer {
        spec: Some(pb::LoadBalancerSpec::from(&r.spec.to_spec(ns, name, r.generation))),
        backend: r.spec.backend.clone(),
        backend_id: status.backend_id.unwrap_or_default(),
        provisioning_status: status.provisioning_status.unwrap_or_else(|| "PENDING".into()),
        observed_generation: status.observed_generation.and_then(|g| u64::try_from(g).ok()).unwrap_or(0),
        ingress_ip: status.ingress_ip.unwrap_or_default(),
        message: status.message.unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn spec() -> LoadBalancerSpec {
        let m = |a: &str, ready| Member {
            address: a.into(),
            port: 8080,
            ready,
            serving: true,
            terminating: !ready,
            node_name: "n1".into(),
            target_pod: format!("ns/{a}"),
        };
        LoadBalancerSpec {
            namespace: "ns".into(),
            name: "web".into(),
            uid: "u1".into(),
            vips: vec!["10.96.0.10".into(), "fd00::10".into()],
            listeners: vec![
                Listener {
                    protocol: Protocol::Udp,
                    port: 53,
                    name: "dns".into(),
                    pool: Some(Pool { members: vec![m("10.1.0.5", true), m("10.1.0.6", false)] }),
                    node_port: 30053,
                },
                Listener { protocol: Protocol::Sctp, port: 9, name: "b".into(), pool: None, node_port: 0 },
                Listener {
                    protocol: Protocol::Tcp,
                    port: 80,
                    name: String::new(),
                    pool: Some(Pool::default()),
                    node_port: 0,
                },
            ],
            session_affinity: Some(SessionAffinity { client_ip: true, timeout_seconds: 600 }),
            service_type: "NodePort".into(),
            generation: 7,
            external_ips: vec!["192.0.2.7".into()],
            ingress_ips: vec!["198.51.100.7".into()],
            external_traffic_policy: TrafficPolicy::Local,
            internal_traffic_policy: TrafficPolicy::Cluster,
        }
    }

    #[test]
    fn specs_round_trip_through_the_message() {
        let s = spec();
        let m = pb::LoadBalancerSpec::from(&s);
        assert_eq!(m.listeners[0].protocol(), pb::Protocol::Udp);
        assert_eq!(m.listeners[1].protocol(), pb::Protocol::Sctp);
        assert_eq!(m.listeners[2].protocol(), pb::Protocol::Tcp);
        assert_eq!(m.external_traffic_policy(), pb::TrafficPolicy::Local);
        assert_eq!(m.internal_traffic_policy(), pb::TrafficPolicy::Cluster);
        assert_eq!(m.listeners[0].pool.as_ref().unwrap().members[1].target_pod, "ns/10.1.0.6");
        assert!(m.listeners[1].pool.is_none());
        assert_eq!(LoadBalancerSpec::from(&m), s);
        let none = LoadBalancerSpec { session_affinity: None, ..s };
        assert_eq!(LoadBalancerSpec::from(&pb::LoadBalancerSpec::from(&none)), none);
    }

    #[test]
    fn unset_enums_read_as_the_contract_defaults() {
        let m = pb::LoadBalancerSpec {
            listeners: vec![
                pb::Listener { protocol: 0, ..Default::default() },
                pb::Listener { protocol: 42, ..Default::default() },
            ],
            ..Default::default()
        };
        let s = LoadBalancerSpec::from(&m);
        assert!(s.listeners.iter().all(|l| l.protocol == Protocol::Tcp));
        assert_eq!(
            (s.external_traffic_policy, s.internal_traffic_policy),
            (TrafficPolicy::Cluster, TrafficPolicy::Cluster)
        );
    }
}
