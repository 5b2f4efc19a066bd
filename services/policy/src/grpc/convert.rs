//! The edge between the watcher's reduced objects and the compiler's model
//! ([`kuryr_policy_core::model`]).
//!
//! The API server has validated what it stored, but the compiler trusts nothing: whatever cannot
//! be read here (an unknown operator or protocol, an unparsable CIDR or port) becomes a part that
//! matches nothing, never one that matches everything — a policy is never opened by a part the
//! service does not understand.

use std::net::IpAddr;

use k8s_openapi::api::networking::v1 as net;
use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kuryr_policy_core::model::{
    ContainerPort, LabelSelector, Namespace, NetworkPolicy, Operator, Peer, Pod, PolicyType, PortRef, PortRule,
    Protocol, Requirement, Rule,
};
use kuryr_proto::watcher::v1::object::Body;
use kuryr_proto::watcher::v1::{EventType, Kind, Object, SubscribeResponse};

use crate::core::{self, Change, ObjKey};

/// One event of the watcher's stream as the publisher reads it.
pub fn change(ev: &SubscribeResponse) -> Change {
    let applied = match ev.r#type() {
        EventType::Reset => return Change::Reset,
        EventType::SnapshotComplete => return Change::SnapshotComplete,
        EventType::Heartbeat | EventType::Unspecified => return Change::None,
        EventType::Applied => true,
        EventType::Deleted => false,
    };
    let Some(o) = &ev.object else { return Change::None };
    let kind = match o.kind() {
        Kind::Pod => core::Kind::Pod,
        Kind::Namespace => core::Kind::Namespace,
        Kind::NetworkPolicy => core::Kind::NetworkPolicy,
        _ => core::Kind::Other(o.kind),
    };
    let key = ObjKey { kind, namespace: o.namespace.clone(), name: o.name.clone() };
    if !applied {
        return Change::Deleted(key);
    }
    let object = match kind {
        core::Kind::Pod => match pod(o) {
            Some(pod) => {
                let done = matches!(&o.body, Some(Body::Pod(p)) if finished(&p.phase));
                core::Object::Pod(core::WatchedPod { pod, uid: o.uid.clone(), finished: done })
            }
            None => core::Object::Unreadable,
        },
        core::Kind::Namespace => core::Object::Namespace(namespace(o)),
        core::Kind::NetworkPolicy => match policy(o) {
            Some(p) => core::Object::NetworkPolicy { uid: o.uid.clone(), policy: p.map_err(|e| e.to_string()) },
            None => core::Object::Unreadable,
        },
        core::Kind::Other(_) => core::Object::Unreadable,
    };
    Change::Applied(key, object)
}

/// Whether a pod of `phase` finished (and no longer holds its addresses).
fn finished(phase: &str) -> bool {
    matches!(phase, "Succeeded" | "Failed")
}

/// A pod as the compiler sees it. Pods that finished (Succeeded, Failed) no longer hold their
/// addresses, which may already be another pod's: they keep none here.
pub fn pod(o: &Object) -> Option<Pod> {
    let Some(Body::Pod(p)) = &o.body else { return None };
    let ips = if finished(&p.phase) {
        Vec::new()
    } else {
        p.pod_ips.iter().filter_map(|s| s.parse::<IpAddr>().ok()).collect()
    };
    let ports = p
        .named_ports
        .iter()
        .filter_map(|n| {
            Some(ContainerPort {
                name: n.name.clone(),
                protocol: Protocol::parse(&n.protocol)?,
                port: u16::try_from(n.port).ok().filter(|p| *p > 0)?,
            })
        })
        .collect();
    Some(Pod {
        namespace: o.namespace.clone(),
        name: o.name.clone(),
        labels: o.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        node: p.node_name.clone(),
        ips,
        ports,
        host_network: p.host_network,
    })
}

/// A namespace.
pub fn namespace(o: &Object) -> Namespace {
    Namespace { name: o.name.clone(), labels: o.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect() }
}

/// Why a NetworkPolicy cannot be read at all.
#[derive(Debug, thiserror::Error)]
#[error("spec of NetworkPolicy {namespace}/{name} is not valid JSON")]
pub struct BadSpec {
    pub namespace: String,
    pub name: String,
    #[source]
    pub source: serde_json::Error,
}

/// A NetworkPolicy, from the spec the watcher carries as JSON.
pub fn policy(o: &Object) -> Option<Result<NetworkPolicy, BadSpec>> {
    let Some(Body::NetworkPolicy(p)) = &o.body else { return None };
    let spec: net::NetworkPolicySpec = match serde_json::from_str(&p.spec_json) {
        Ok(s) => s,
        Err(source) => return Some(Err(BadSpec { namespace: o.namespace.clone(), name: o.name.clone(), source })),
    };
    Some(Ok(policy_spec(&o.namespace, &o.name, spec)))
}

/// The model of a NetworkPolicy spec.
pub fn policy_spec(namespace: &str, name: &str, spec: net::NetworkPolicySpec) -> NetworkPolicy {
    let policy_types = spec
        .policy_types
        .unwrap_or_default()
        .iter()
        .filter_map(|t| match t.as_str() {
            "Ingress" => Some(PolicyType::Ingress),
            "Egress" => Some(PolicyType::Egress),
            _ => None,
        })
        .collect();
    let ingress =
        spec.ingress.unwrap_or_default().into_iter().map(|r| rule(r.from.unwrap_or_default(), r.ports)).collect();
    let egress = spec.egress.unwrap_or_default().into_iter().map(|r| rule(r.to.unwrap_or_default(), r.ports)).collect();
    NetworkPolicy {
        namespace: namespace.to_string(),
        name: name.to_string(),
        pod_selector: spec.pod_selector.map(selector).unwrap_or_default(),
        policy_types,
        ingress,
        egress,
    }
}

fn rule(peers: Vec<net::NetworkPolicyPeer>, ports: Option<Vec<net::NetworkPolicyPort>>) -> Rule {
    Rule {
        peers: peers.into_iter().map(peer).collect(),
        ports: ports.unwrap_or_default().into_iter().map(port).collect(),
    }
}

/// A selector that matches nothing (`In` with no values).
fn nothing() -> LabelSelector {
    LabelSelector {
        match_labels: Default::default(),
        match_expressions: vec![Requirement {
            key: "kuryr.openstack.org/unreadable".into(),
            operator: Operator::In,
            values: Default::default(),
        }],
    }
}

fn peer(p: net::NetworkPolicyPeer) -> Peer {
    if let Some(block) = p.ip_block {
        let cidr = block.cidr.parse();
        let except: Result<Vec<ipnet::IpNet>, _> = block.except.unwrap_or_default().iter().map(|e| e.parse()).collect();
        return match (cidr, except) {
            (Ok(cidr), Ok(except)) => Peer::IpBlock { cidr, except },
            _ => Peer::Pods { namespace_selector: None, pod_selector: Some(nothing()) },
        };
    }
    Peer::Pods { namespace_selector: p.namespace_selector.map(selector), pod_selector: p.pod_selector.map(selector) }
}

fn port(p: net::NetworkPolicyPort) -> PortRule {
    let protocol = p.protocol.as_deref().map_or(Some(Protocol::Tcp), Protocol::parse);
    let port = match p.port {
        None => None,
        Some(IntOrString::Int(n)) => Some(PortRef::Number(u16::try_from(n).unwrap_or(0))),
        Some(IntOrString::String(s)) => Some(PortRef::Name(s)),
    };
    let end_port = p.end_port.map(|e| u16::try_from(e).unwrap_or(0));
    match protocol {
        Some(protocol) => PortRule { protocol, port, end_port },
        // Port 0 is invalid: the compiler matches nothing with it.
        None => PortRule { protocol: Protocol::Tcp, port: Some(PortRef::Number(0)), end_port: None },
    }
}

fn selector(s: meta::LabelSelector) -> LabelSelector {
    let mut out = LabelSelector { match_labels: s.match_labels.unwrap_or_default(), match_expressions: vec![] };
    for r in s.match_expressions.unwrap_or_default() {
        let operator = match r.operator.as_str() {
            "In" => Operator::In,
            "NotIn" => Operator::NotIn,
            "Exists" => Operator::Exists,
            "DoesNotExist" => Operator::DoesNotExist,
            _ => return nothing(),
        };
        out.match_expressions.push(Requirement {
            key: r.key,
            operator,
            values: r.values.unwrap_or_default().into_iter().collect(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_proto::watcher::v1::{Kind, NamedPort};

    use super::*;

    fn np(json: &str) -> NetworkPolicy {
        let o = Object {
            kind: Kind::NetworkPolicy as i32,
            namespace: "ns".into(),
            name: "p".into(),
            body: Some(Body::NetworkPolicy(kuryr_proto::watcher::v1::NetworkPolicy { spec_json: json.into() })),
            ..Default::default()
        };
        policy(&o).unwrap().unwrap()
    }

    #[test]
    fn policies_keep_the_api_meaning() {
        let p = np(r#"{"podSelector": {"matchLabels": {"app": "db"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchExpressions":
                [{"key": "role", "operator": "NotIn", "values": ["x"]}]}},
                {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
                "ports": [{"port": "http"}, {"protocol": "UDP", "port": 53, "endPort": 60}]}],
            "egress": [{}]}"#);
        assert_eq!(p.pod_selector.match_labels.get("app").map(String::as_str), Some("db"));
        assert_eq!(p.policy_types, [PolicyType::Ingress, PolicyType::Egress]);
        let r = &p.ingress[0];
        let Peer::Pods { namespace_selector: Some(ns), pod_selector: Some(ps) } = &r.peers[0] else { panic!() };
        assert_eq!(ns, &LabelSelector::default(), "empty, not absent");
        assert_eq!(ps.match_expressions[0].operator, Operator::NotIn);
        assert!(matches!(&r.peers[1], Peer::IpBlock { except, .. } if except.len() == 1));
        assert_eq!(
            r.ports[0],
            PortRule { protocol: Protocol::Tcp, port: Some(PortRef::Name("http".into())), end_port: None }
        );
        assert_eq!(
            r.ports[1],
            PortRule { protocol: Protocol::Udp, port: Some(PortRef::Number(53)), end_port: Some(60) }
        );
        assert_eq!(p.egress, [Rule::default()], "an empty egress rule allows everything");
        assert!(p.validate().is_empty());
    }

    #[test]
    fn what_cannot_be_read_matches_nothing() {
        let p = np(r#"{"podSelector": {}, "ingress": [{"from": [
                {"ipBlock": {"cidr": "not-a-cidr"}},
                {"podSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}}],
              "ports": [{"protocol": "ICMP", "port": 1}, {"port": 70000}]}]}"#);
        let r = &p.ingress[0];
        for peer in &r.peers {
            let Peer::Pods { pod_selector: Some(s), .. } = peer else { panic!("{peer:?}") };
            assert_eq!(s, &nothing());
        }
        assert!(r.ports.iter().all(|p| p.port == Some(PortRef::Number(0))), "{:?}", r.ports);
        assert_eq!(p.validate().len(), 2, "both ports are refused by the compiler");
        let o = Object {
            body: Some(Body::NetworkPolicy(kuryr_proto::watcher::v1::NetworkPolicy { spec_json: "{".into() })),
            ..Default::default()
        };
        assert!(policy(&o).unwrap().is_err());
    }

    #[test]
    fn finished_pods_hold_no_addresses_and_named_ports_are_kept() {
        let mut o = Object {
            namespace: "ns".into(),
            name: "a".into(),
            labels: [("app".to_string(), "web".to_string())].into(),
            body: Some(Body::Pod(kuryr_proto::watcher::v1::Pod {
                node_name: "n1".into(),
                phase: "Running".into(),
                pod_ips: vec!["10.0.0.5".into(), "fd00::5".into(), "junk".into()],
                named_ports: vec![
                    NamedPort { name: "http".into(), protocol: "TCP".into(), port: 8080 },
                    NamedPort { name: "bad".into(), protocol: "ICMP".into(), port: 1 },
                ],
                ..Default::default()
            })),
            ..Default::default()
        };
        let p = pod(&o).unwrap();
        assert_eq!(p.ips.len(), 2);
        assert_eq!(p.ports, [ContainerPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }]);
        assert_eq!((p.node.as_str(), p.labels.len()), ("n1", 1));
        if let Some(Body::Pod(b)) = &mut o.body {
            b.phase = "Succeeded".into();
        }
        assert!(pod(&o).unwrap().ips.is_empty());
    }
}
