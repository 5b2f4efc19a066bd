//! Reducing Kubernetes objects to the `Object` messages of the contract.
//!
//! Each conversion takes the object by value and moves the strings it keeps, so the full object
//! (managed fields, container specs, status details) is dropped as soon as it has been reduced:
//! the index never holds more than what consumers read.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kuryr_proto::watcher::v1 as pb;
use pb::object::Body;

/// Annotation key prefixes that belong to kuryr; other annotations are not carried.
pub const KURYR_ANNOTATION_PREFIXES: &[&str] = &["kuryr.", "openstack.org/"];
/// Pod annotations carried besides kuryr's: a pod's request for further interfaces (the Network
/// Plumbing Working Group's `k8s.v1.cni.cncf.io/networks`).
pub const CARRIED_ANNOTATIONS: &[&str] = &["k8s.v1.cni.cncf.io/networks"];

/// The label naming the Service an EndpointSlice belongs to.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// A Kubernetes resource the watcher serves.
pub trait Reduce {
    /// The kind the contract calls it.
    const KIND: pb::Kind;
    /// Reduces the object, consuming it.
    fn reduce(self) -> pb::Object;
}

fn object(kind: pb::Kind, meta: ObjectMeta, body: Body) -> (pb::Object, BTreeMap<String, String>) {
    let obj = pb::Object {
        kind: kind as i32,
        namespace: meta.namespace.unwrap_or_default(),
        name: meta.name.unwrap_or_default(),
        uid: meta.uid.unwrap_or_default(),
        resource_version: meta.resource_version.unwrap_or_default(),
        deleting: meta.deletion_timestamp.is_some(),
        labels: meta.labels.unwrap_or_default().into_iter().collect(),
        body: Some(body),
    };
    (obj, meta.annotations.unwrap_or_default())
}

fn kuryr_annotations(all: BTreeMap<String, String>, also: &[&str]) -> HashMap<String, String> {
    all.into_iter()
        .filter(|(k, _)| KURYR_ANNOTATION_PREFIXES.iter().any(|p| k.starts_with(p)) || also.contains(&k.as_str()))
        .collect()
}

impl Reduce for core::Pod {
    const KIND: pb::Kind = pb::Kind::Pod;
    fn reduce(self) -> pb::Object {
        let spec = self.spec.unwrap_or_default();
        let status = self.status.unwrap_or_default();
        let pod = pb::Pod {
            node_name: spec.node_name.unwrap_or_default(),
            host_network: spec.host_network.unwrap_or(false),
            phase: status.phase.unwrap_or_default(),
            pod_ips: status.pod_ips.unwrap_or_default().into_iter().map(|ip| ip.ip).collect(),
            finalizers: self.metadata.finalizers.clone().unwrap_or_default(),
            annotations: HashMap::new(),
            named_ports: spec
                .containers
                .iter()
                .flat_map(|c| c.ports.iter().flatten())
                .filter_map(|p| {
                    Some(pb::NamedPort {
                        name: p.name.clone().filter(|n| !n.is_empty())?,
                        protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                        port: p.container_port,
                    })
                })
                .collect(),
        };
        let (mut obj, annotations) = object(Self::KIND, self.metadata, Body::Pod(pod));
        if let Some(Body::Pod(p)) = &mut obj.body {
            p.annotations = kuryr_annotations(annotations, CARRIED_ANNOTATIONS);
        }
        obj
    }
}

impl Reduce for core::Service {
    const KIND: pb::Kind = pb::Kind::Service;
    fn reduce(self) -> pb::Object {
        let spec = self.spec.unwrap_or_default();
        let cluster_ips = match (spec.cluster_ips, spec.cluster_ip) {
            (Some(ips), _) if !ips.is_empty() => ips,
            (_, Some(ip)) if !ip.is_empty() => vec![ip],
            _ => Vec::new(),
        };
        let ports = spec
            .ports
            .unwrap_or_default()
            .into_iter()
            .map(|p| pb::ServicePort {
                name: p.name.unwrap_or_default(),
                protocol: p.protocol.unwrap_or_else(|| "TCP".into()),
                port: p.port,
                // The API defaults an unset targetPort to the port itself.
                target_port: match p.target_port {
                    Some(IntOrString::Int(n)) => n.to_string(),
                    Some(IntOrString::String(s)) => s,
                    None => p.port.to_string(),
                },
                node_port: p.node_port.unwrap_or(0),
            })
            .collect();
        let svc = pb::Service {
            r#type: spec.type_.unwrap_or_else(|| "ClusterIP".into()),
            cluster_ips,
            ports,
            selector: spec.selector.unwrap_or_default().into_iter().collect(),
            session_affinity: spec.session_affinity.unwrap_or_else(|| "None".into()),
            session_affinity_timeout_seconds: spec
                .session_affinity_config
                .and_then(|c| c.client_ip)
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(0),
            load_balancer_ip: spec.load_balancer_ip.unwrap_or_default(),
            external_name: spec.external_name.unwrap_or_default(),
            ip_families: spec.ip_families.unwrap_or_default(),
            finalizers: self.metadata.finalizers.clone().unwrap_or_default(),
            external_traffic_policy: spec.external_traffic_policy.unwrap_or_default(),
            internal_traffic_policy: spec.internal_traffic_policy.unwrap_or_default(),
            external_ips: spec.external_ips.unwrap_or_default(),
            load_balancer_class: spec.load_balancer_class.unwrap_or_default(),
            // Hostname-only ingress entries (some cloud load balancers) have no address to
            // answer on.
            load_balancer_ingress_ips: self
                .status
                .and_then(|s| s.load_balancer)
                .and_then(|lb| lb.ingress)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|i| i.ip.filter(|ip| !ip.is_empty()))
                .collect(),
        };
        object(Self::KIND, self.metadata, Body::Service(svc)).0
    }
}

impl Reduce for discovery::EndpointSlice {
    const KIND: pb::Kind = pb::Kind::EndpointSlice;
    fn reduce(self) -> pb::Object {
        let endpoints = self
            .endpoints
            .into_iter()
            .map(|e| {
                let c = e.conditions.unwrap_or_default();
                // The API documents: ready unset means ready; serving unset defers to ready;
                // terminating unset means not terminating.
                let ready = c.ready.unwrap_or(true);
                pb::Endpoint {
                    addresses: e.addresses,
                    ready,
                    serving: c.serving.unwrap_or(ready),
                    terminating: c.terminating.unwrap_or(false),
                    node_name: e.node_name.unwrap_or_default(),
                    target_pod: match e.target_ref {
                        Some(r) if r.kind.as_deref() == Some("Pod") => {
                            format!("{}/{}", r.namespace.unwrap_or_default(), r.name.unwrap_or_default())
                        }
                        _ => String::new(),
                    },
                    zone: e.zone.unwrap_or_default(),
                }
            })
            .collect();
        let ports = self
            .ports
            .unwrap_or_default()
            .into_iter()
            .map(|p| pb::EndpointPort {
                name: p.name.unwrap_or_default(),
                protocol: p.protocol.unwrap_or_else(|| "TCP".into()),
                port: p.port.unwrap_or(0),
            })
            .collect();
        let service_name =
            self.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL)).cloned().unwrap_or_default();
        let slice = pb::EndpointSlice { service_name, address_type: self.address_type, endpoints, ports };
        object(Self::KIND, self.metadata, Body::EndpointSlice(slice)).0
    }
}

impl Reduce for core::Namespace {
    const KIND: pb::Kind = pb::Kind::Namespace;
    fn reduce(self) -> pb::Object {
        let phase = self.status.and_then(|s| s.phase).unwrap_or_default();
        let (mut obj, annotations) = object(
            Self::KIND,
            self.metadata,
            Body::NamespaceInfo(pb::Namespace { phase, annotations: HashMap::new() }),
        );
        if let Some(Body::NamespaceInfo(n)) = &mut obj.body {
            n.annotations = kuryr_annotations(annotations, &[]);
        }
        obj
    }
}

impl Reduce for networking::NetworkPolicy {
    const KIND: pb::Kind = pb::Kind::NetworkPolicy;
    fn reduce(self) -> pb::Object {
        let spec_json = match &self.spec {
            None => String::new(),
            // Serializing these generated types cannot fail (string-keyed maps only); if it ever
            // did, an empty spec is logged rather than the whole watch stopping.
            Some(spec) => serde_json::to_string(spec).unwrap_or_else(|e| {
                tracing::error!(error = %e, "cannot serialize a NetworkPolicy spec");
                String::new()
            }),
        };
        object(Self::KIND, self.metadata, Body::NetworkPolicy(pb::NetworkPolicy { spec_json })).0
    }
}

impl Reduce for core::Node {
    const KIND: pb::Kind = pb::Kind::Node;
    fn reduce(self) -> pb::Object {
        let status = self.status.unwrap_or_default();
        let node = pb::Node {
            internal_ips: status
                .addresses
                .unwrap_or_default()
                .into_iter()
                .filter(|a| a.type_ == "InternalIP")
                .map(|a| a.address)
                .collect(),
            pod_cidrs: self.spec.and_then(|s| s.pod_cidrs).unwrap_or_default(),
            ready: status.conditions.unwrap_or_default().iter().any(|c| c.type_ == "Ready" && c.status == "True"),
        };
        object(Self::KIND, self.metadata, Body::Node(node)).0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    fn meta(ns: Option<&str>, name: &str) -> ObjectMeta {
        ObjectMeta {
            namespace: ns.map(Into::into),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            resource_version: Some("42".into()),
            labels: Some([("app".to_string(), "web".to_string())].into()),
            annotations: Some(
                [
                    ("kuryr.openstack.org/vif".to_string(), "v".to_string()),
                    ("openstack.org/kuryr-x".to_string(), "x".to_string()),
                    ("kubectl.kubernetes.io/last-applied-configuration".to_string(), "{}".to_string()),
                    ("k8s.v1.cni.cncf.io/networks".to_string(), "blue".to_string()),
                    ("k8s.v1.cni.cncf.io/network-status".to_string(), "[]".to_string()),
                ]
                .into(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn pods_keep_what_the_allocator_and_binder_read() {
        let mut m = meta(Some("ns"), "p");
        m.finalizers = Some(vec!["kuryr.openstack.org/vif".into()]);
        m.deletion_timestamp = Some(Time(Default::default()));
        let pod = core::Pod {
            metadata: m,
            spec: Some(core::PodSpec {
                node_name: Some("n1".into()),
                host_network: Some(true),
                containers: vec![core::Container {
                    name: "c".into(),
                    ports: Some(vec![
                        core::ContainerPort { name: Some("http".into()), container_port: 8080, ..Default::default() },
                        core::ContainerPort { container_port: 9090, ..Default::default() },
                        core::ContainerPort {
                            name: Some("dns".into()),
                            container_port: 53,
                            protocol: Some("UDP".into()),
                            ..Default::default()
                        },
                    ]),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            status: Some(core::PodStatus {
                phase: Some("Running".into()),
                pod_ips: Some(vec![core::PodIP { ip: "10.0.0.5".into() }, core::PodIP { ip: "fd00::5".into() }]),
                ..Default::default()
            }),
        };
        let o = pod.reduce();
        assert_eq!((o.kind, o.namespace.as_str(), o.name.as_str()), (pb::Kind::Pod as i32, "ns", "p"));
        assert_eq!((o.uid.as_str(), o.resource_version.as_str(), o.deleting), ("uid-p", "42", true));
        assert_eq!(o.labels.get("app").map(String::as_str), Some("web"));
        let Some(Body::Pod(p)) = o.body else { panic!("{o:?}") };
        assert_eq!((p.node_name.as_str(), p.host_network, p.phase.as_str()), ("n1", true, "Running"));
        assert_eq!(p.pod_ips, ["10.0.0.5", "fd00::5"]);
        assert_eq!(p.finalizers, ["kuryr.openstack.org/vif"]);
        let named: Vec<_> = p.named_ports.iter().map(|n| (n.name.as_str(), n.protocol.as_str(), n.port)).collect();
        assert_eq!(named, [("http", "TCP", 8080), ("dns", "UDP", 53)], "unnamed ports are left out");
        let mut keys: Vec<_> = p.annotations.keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, ["k8s.v1.cni.cncf.io/networks", "kuryr.openstack.org/vif", "openstack.org/kuryr-x"]);
    }

    #[test]
    fn services_default_what_the_api_defaults() {
        let svc = core::Service {
            metadata: meta(Some("ns"), "s"),
            spec: Some(core::ServiceSpec {
                cluster_ip: Some("10.96.0.10".into()),
                ports: Some(vec![
                    core::ServicePort {
                        name: Some("http".into()),
                        port: 80,
                        target_port: Some(IntOrString::String("web".into())),
                        ..Default::default()
                    },
                    core::ServicePort {
                        port: 53,
                        protocol: Some("UDP".into()),
                        target_port: None,
                        node_port: Some(30053),
                        ..Default::default()
                    },
                ]),
                selector: Some([("app".to_string(), "web".to_string())].into()),
                session_affinity_config: Some(core::SessionAffinityConfig {
                    client_ip: Some(core::ClientIPConfig { timeout_seconds: Some(600) }),
                }),
                external_traffic_policy: Some("Local".into()),
                external_ips: Some(vec!["192.0.2.10".into()]),
                load_balancer_class: Some("example.com/internal-vip".into()),
                ..Default::default()
            }),
            status: Some(core::ServiceStatus {
                load_balancer: Some(core::LoadBalancerStatus {
                    ingress: Some(vec![
                        core::LoadBalancerIngress { ip: Some("198.51.100.7".into()), ..Default::default() },
                        core::LoadBalancerIngress { hostname: Some("lb.example.com".into()), ..Default::default() },
                    ]),
                }),
                ..Default::default()
            }),
        };
        let Some(Body::Service(s)) = svc.reduce().body else { panic!() };
        assert_eq!((s.r#type.as_str(), s.session_affinity.as_str()), ("ClusterIP", "None"));
        assert_eq!(s.cluster_ips, ["10.96.0.10"]);
        assert_eq!(s.session_affinity_timeout_seconds, 600);
        assert_eq!((s.external_traffic_policy.as_str(), s.internal_traffic_policy.as_str()), ("Local", ""));
        assert_eq!(s.external_ips, ["192.0.2.10"]);
        assert_eq!(s.load_balancer_class, "example.com/internal-vip");
        assert_eq!(s.load_balancer_ingress_ips, ["198.51.100.7"], "hostname-only ingress entries are left out");
        assert_eq!(s.selector.get("app").map(String::as_str), Some("web"));
        assert_eq!((s.ports[0].protocol.as_str(), s.ports[0].target_port.as_str()), ("TCP", "web"));
        assert_eq!(
            (s.ports[1].protocol.as_str(), s.ports[1].target_port.as_str(), s.ports[1].node_port),
            ("UDP", "53", 30053)
        );
    }

    #[test]
    fn endpoints_with_unset_conditions_are_ready_and_serving() {
        let mut m = meta(Some("ns"), "s-abc");
        m.labels = Some([(SERVICE_NAME_LABEL.to_string(), "s".to_string())].into());
        let slice = discovery::EndpointSlice {
            metadata: m,
            address_type: "IPv4".into(),
            endpoints: vec![
                discovery::Endpoint {
                    addresses: vec!["10.1.0.5".into()],
                    node_name: Some("n1".into()),
                    target_ref: Some(core::ObjectReference {
                        kind: Some("Pod".into()),
                        namespace: Some("ns".into()),
                        name: Some("web-1".into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                discovery::Endpoint {
                    addresses: vec!["10.1.0.6".into()],
                    conditions: Some(discovery::EndpointConditions {
                        ready: Some(false),
                        serving: Some(true),
                        terminating: Some(true),
                    }),
                    ..Default::default()
                },
            ],
            ports: Some(vec![discovery::EndpointPort {
                name: Some("http".into()),
                port: Some(8080),
                ..Default::default()
            }]),
        };
        let Some(Body::EndpointSlice(s)) = slice.reduce().body else { panic!() };
        assert_eq!((s.service_name.as_str(), s.address_type.as_str()), ("s", "IPv4"));
        let e = &s.endpoints[0];
        assert!(e.ready && e.serving && !e.terminating);
        assert_eq!((e.node_name.as_str(), e.target_pod.as_str()), ("n1", "ns/web-1"));
        let e = &s.endpoints[1];
        assert!(!e.ready && e.serving && e.terminating);
        assert_eq!((s.ports[0].protocol.as_str(), s.ports[0].port), ("TCP", 8080));
    }

    #[test]
    fn nodes_report_internal_ips_cidrs_and_readiness() {
        let cond = |t: &str, s: &str| core::NodeCondition { type_: t.into(), status: s.into(), ..Default::default() };
        let node = core::Node {
            metadata: meta(None, "n1"),
            spec: Some(core::NodeSpec { pod_cidrs: Some(vec!["10.244.1.0/24".into()]), ..Default::default() }),
            status: Some(core::NodeStatus {
                addresses: Some(vec![
                    core::NodeAddress { type_: "Hostname".into(), address: "n1".into() },
                    core::NodeAddress { type_: "InternalIP".into(), address: "192.168.1.10".into() },
                ]),
                conditions: Some(vec![cond("MemoryPressure", "False"), cond("Ready", "True")]),
                ..Default::default()
            }),
        };
        let o = node.reduce();
        assert_eq!(o.namespace, "");
        let Some(Body::Node(n)) = o.body else { panic!() };
        assert_eq!(
            (n.internal_ips, n.pod_cidrs, n.ready),
            (vec!["192.168.1.10".to_string()], vec!["10.244.1.0/24".to_string()], true)
        );
    }

    #[test]
    fn namespaces_and_policies() {
        let ns = core::Namespace {
            metadata: meta(None, "team"),
            status: Some(core::NamespaceStatus { phase: Some("Active".into()), ..Default::default() }),
            ..Default::default()
        };
        let Some(Body::NamespaceInfo(n)) = ns.reduce().body else { panic!() };
        assert_eq!((n.phase.as_str(), n.annotations.len()), ("Active", 2));

        let np = networking::NetworkPolicy {
            metadata: meta(Some("team"), "deny"),
            spec: Some(networking::NetworkPolicySpec {
                policy_types: Some(vec!["Ingress".into()]),
                ..Default::default()
            }),
        };
        let Some(Body::NetworkPolicy(p)) = np.reduce().body else { panic!() };
        let spec: serde_json::Value = serde_json::from_str(&p.spec_json).unwrap();
        assert_eq!(spec["policyTypes"][0], "Ingress");
    }
}
