//! The desired load balancer of a Service, from the Service and its EndpointSlices as the
//! watcher reduced them ([`crate::core::input`]), as a [`LoadBalancerSpec`]. Pure: no kube, no
//! tonic, no protobuf.
//!
//! - ClusterIP, NodePort and LoadBalancer Services get a load balancer; its VIPs are the cluster
//!   IPs (both families when dual-stack). Headless Services (no cluster IP) are ignored silently,
//!   as kube-proxy ignores them. ExternalName is skipped with a reason the controller tells the
//!   Service's users as an Event.
//! - One listener per Service port (a port and protocol pair is unique in a Service), in the
//!   Service's order, with its node port for types NodePort and LoadBalancer (the API server
//!   allocates them).
//! - What the node dataplane needs beyond that is carried as the Service says it: external IPs,
//!   the load balancer ingress addresses of the Service's status, and both traffic policies
//!   (Local, or Cluster for anything else: the API server defaults them to Cluster).
//! - Members come from every slice of the Service, merged: each endpoint address with the port
//!   its slice gives for the listener's port name and protocol. EndpointSlices carry the target
//!   port resolved per pod (a named `targetPort` can differ between pods, which is why the
//!   resolution is per slice); only when a slice lists no ports at all is a numeric `targetPort`
//!   used. FQDN slices are not load-balanced.
//! - Endpoints that are neither ready nor serving never get traffic and are left out; ready and
//!   serving-but-terminating ones are members with their conditions, so that a dataplane sends
//!   to ready members and falls back to serving ones when none is ready.
//! - Members are sorted and de-duplicated (an endpoint can sit in two slices while the slice
//!   controller moves it), so that the same state always gives the same spec.

use std::collections::BTreeMap;

use crate::core::input::{EndpointSlice, Service};
use crate::core::lb::{Listener, LoadBalancerSpec, Member, Pool, Protocol, SessionAffinity, TrafficPolicy};

/// Kubernetes' default ClientIP affinity timeout (spec.sessionAffinityConfig.clientIP).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;

/// The Event reason of a Service that gets no load balancer because of its type.
pub const REASON_SKIPPED: &str = "LoadBalancerSkipped";

/// The Service, as the controller knows it.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceRef<'a> {
    /// metadata.namespace.
    pub namespace: &'a str,
    /// metadata.name.
    pub name: &'a str,
    /// metadata.uid.
    pub uid: &'a str,
    /// The Service body.
    pub service: &'a Service,
}

/// What a Service should have.
#[derive(Clone, Debug, PartialEq)]
pub enum Desired {
    /// This load balancer (its generation is left 0; the record assigns it).
    Lb(LoadBalancerSpec),
    /// None, and the users should be told why.
    Skipped {
        /// A sentence for the Event.
        message: String,
    },
    /// None, silently (headless).
    Ignored,
}

/// Whether this lbaas provides the load balancer of `svc`: a `type: LoadBalancer` Service of its
/// load balancer class (`class`; `None`: Services that name no class), as every load balancer
/// implementation must leave the Services of another class alone.
pub fn owns_load_balancer(svc: &Service, class: Option<&str>) -> bool {
    svc.r#type == "LoadBalancer"
        && match class {
            None => svc.load_balancer_class.is_empty(),
            Some(c) => svc.load_balancer_class == c,
        }
}

/// `svc` as kuryr load-balances it. A `type: LoadBalancer` Service whose load balancer another
/// implementation provides still needs its cluster IP, node ports and the addresses that
/// implementation put in its status answered on the nodes — as kube-proxy would — so to kuryr it
/// is a NodePort Service: no load balancer of kuryr's, no finalizer, no status written.
pub fn effective<'a>(svc: &'a Service, class: Option<&str>) -> std::borrow::Cow<'a, Service> {
    if svc.r#type == "LoadBalancer" && !owns_load_balancer(svc, class) {
        let mut other = svc.clone();
        other.r#type = "NodePort".into();
        return std::borrow::Cow::Owned(other);
    }
    std::borrow::Cow::Borrowed(svc)
}

/// Whether `svc` gets a load balancer at all: of a type kuryr load-balances and not headless
/// (what [`desired`] answers `Lb` for, whatever its ports).
pub fn load_balanced(svc: &Service) -> bool {
    matches!(svc.r#type.as_str(), "ClusterIP" | "" | "NodePort" | "LoadBalancer") && !is_headless(svc)
}

fn is_headless(svc: &Service) -> bool {
    svc.cluster_ips.iter().all(|ip| ip.is_empty() || ip == "None")
}

/// The load balancer `svc` should have, given the slices that name it.
pub fn desired(svc: &ServiceRef<'_>, slices: &[&EndpointSlice]) -> Desired {
    let s = svc.service;
    let node_ports = match s.r#type.as_str() {
        "ClusterIP" | "" => false,
        "NodePort" | "LoadBalancer" => true,
        "ExternalName" => {
            return Desired::Skipped {
                message: "type ExternalName is a DNS alias: there is nothing to load-balance".into(),
            };
        }
        other => return Desired::Skipped { message: format!("type {other:?} is not a Service type kuryr knows") },
    };
    if is_headless(s) {
        return Desired::Ignored;
    }
    let listeners = s
        .ports
        .iter()
        .filter_map(|p| {
            let protocol = Protocol::parse(&p.protocol)?;
            let port = u32::try_from(p.port).ok().filter(|p| *p > 0)?;
            Some(Listener {
                protocol,
                port,
                name: p.name.clone(),
                pool: Some(Pool { members: members(&p.name, &p.protocol, &p.target_port, slices) }),
                node_port: if node_ports { u32::try_from(p.node_port).unwrap_or(0) } else { 0 },
            })
        })
        .collect();
    let client_ip = s.session_affinity == "ClientIP";
    let timeout = u32::try_from(s.session_affinity_timeout_seconds).unwrap_or(0);
    Desired::Lb(LoadBalancerSpec {
        namespace: svc.namespace.to_string(),
        name: svc.name.to_string(),
        uid: svc.uid.to_string(),
        vips: s.cluster_ips.iter().filter(|ip| !ip.is_empty() && *ip != "None").cloned().collect(),
        listeners,
        session_affinity: Some(SessionAffinity {
            client_ip,
            timeout_seconds: match (client_ip, timeout) {
                (false, _) => 0,
                (true, 0) => DEFAULT_AFFINITY_TIMEOUT,
                (true, t) => t,
            },
        }),
        service_type: if s.r#type.is_empty() { "ClusterIP".into() } else { s.r#type.clone() },
        generation: 0,
        external_ips: addresses(&s.external_ips),
        ingress_ips: addresses(&s.load_balancer_ingress_ips),
        external_traffic_policy: TrafficPolicy::parse(&s.external_traffic_policy),
        internal_traffic_policy: TrafficPolicy::parse(&s.internal_traffic_policy),
    })
}

/// Addresses without blanks or repeats, in their first order.
fn addresses(list: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(list.len());
    for a in list.iter().filter(|a| !a.is_empty()) {
        if !out.contains(a) {
            out.push(a.clone());
        }
    }
    out
}

/// The members of the Service port named `name` with `proto`, merged over `slices`.
fn members(name: &str, proto: &str, target_port: &str, slices: &[&EndpointSlice]) -> Vec<Member> {
    let mut by_target: BTreeMap<(String, u32), Member> = BTreeMap::new();
    for slice in slices {
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            continue;
        }
        let port = match slice.ports.iter().find(|p| p.name == name && same_protocol(&p.protocol, proto)) {
            Some(p) => u32::try_from(p.port).ok().filter(|p| *p > 0),
            // No ports at all in the slice: fall back to a numeric targetPort.
            None if slice.ports.is_empty() => target_port.parse().ok().filter(|p: &u32| *p > 0),
            None => None,
        };
        let Some(port) = port else { continue };
        for ep in &slice.endpoints {
            if !ep.ready && !ep.serving {
                continue;
            }
            for address in &ep.addresses {
                let m = Member {
                    address: address.clone(),
                    port,
                    ready: ep.ready,
                    serving: ep.serving,
                    terminating: ep.terminating,
                    node_name: ep.node_name.clone(),
                    target_pod: ep.target_pod.clone(),
                };
                by_target
                    .entry((address.clone(), port))
                    .and_modify(|old| {
                        // Listed twice: the more usable view wins.
                        old.ready |= m.ready;
                        old.serving |= m.serving;
                        old.terminating &= m.terminating;
                    })
                    .or_insert(m);
            }
        }
    }
    by_target.into_values().collect()
}

fn same_protocol(a: &str, b: &str) -> bool {
    Protocol::parse(a) == Protocol::parse(b)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::core::input::{Endpoint, EndpointPort, ServicePort};

    use super::*;

    fn port(name: &str, proto: &str, port: i32, target: &str) -> ServicePort {
        ServicePort { name: name.into(), protocol: proto.into(), port, target_port: target.into(), node_port: 0 }
    }

    fn service(ty: &str, ips: &[&str], ports: Vec<ServicePort>) -> Service {
        Service {
            r#type: ty.into(),
            cluster_ips: ips.iter().map(ToString::to_string).collect(),
            ports,
            session_affinity: "None".into(),
            ..Default::default()
        }
    }

    fn ep(addr: &str, ready: bool, serving: bool, terminating: bool, pod: &str) -> Endpoint {
        Endpoint {
            addresses: vec![addr.into()],
            ready,
            serving,
            terminating,
            node_name: "n1".into(),
            target_pod: format!("ns/{pod}"),
            zone: String::new(),
        }
    }

    fn slice(family: &str, ports: &[(&str, &str, i32)], endpoints: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            service_name: "web".into(),
            address_type: family.into(),
            endpoints,
            ports: ports
                .iter()
                .map(|(n, p, port)| EndpointPort { name: (*n).into(), protocol: (*p).into(), port: *port })
                .collect(),
        }
    }

    fn lb(svc: &Service, slices: &[&EndpointSlice]) -> LoadBalancerSpec {
        let r = ServiceRef { namespace: "ns", name: "web", uid: "u1", service: svc };
        match desired(&r, slices) {
            Desired::Lb(spec) => spec,
            other => panic!("{other:?}"),
        }
    }

    fn shown(l: &Listener) -> Vec<String> {
        l.pool
            .as_ref()
            .unwrap()
            .members
            .iter()
            .map(|m| {
                let flags = [(m.ready, "r"), (m.serving, "s"), (m.terminating, "t")]
                    .iter()
                    .filter(|(b, _)| *b)
                    .map(|(_, f)| *f)
                    .collect::<String>();
                format!("{}:{} {flags}", m.address, m.port)
            })
            .collect()
    }

    #[test]
    fn dual_stack_listeners_and_members_merged_over_slices() {
        let svc = service(
            "ClusterIP",
            &["10.96.0.10", "fd00:96::10"],
            vec![port("http", "TCP", 80, "web"), port("dns", "UDP", 53, "53")],
        );
        // Named targetPort "web" resolved per slice: the pods of the second slice listen on 8081.
        let a = slice(
            "IPv4",
            &[("http", "TCP", 8080), ("dns", "UDP", 5353)],
            vec![ep("10.1.0.5", true, true, false, "a"), ep("10.1.0.6", false, true, true, "b")],
        );
        let b = slice("IPv4", &[("http", "TCP", 8081)], vec![ep("10.1.0.7", true, true, false, "c")]);
        let v6 = slice(
            "IPv6",
            &[("http", "TCP", 8080), ("dns", "UDP", 5353)],
            vec![ep("fd00:1::5", true, true, false, "a"), ep("fd00:1::9", false, false, false, "dead")],
        );
        let spec = lb(&svc, &[&a, &b, &v6]);
        assert_eq!(spec.vips, ["10.96.0.10", "fd00:96::10"]);
        assert_eq!((spec.namespace.as_str(), spec.name.as_str(), spec.uid.as_str()), ("ns", "web", "u1"));
        assert_eq!(spec.listeners.len(), 2);
        let http = &spec.listeners[0];
        assert_eq!((http.protocol, http.port, http.name.as_str()), (Protocol::Tcp, 80, "http"));
        assert_eq!(shown(http), ["10.1.0.5:8080 rs", "10.1.0.6:8080 st", "10.1.0.7:8081 rs", "fd00:1::5:8080 rs"]);
        let dns = &spec.listeners[1];
        assert_eq!((dns.protocol, dns.port), (Protocol::Udp, 53));
        // The second slice has no "dns" port: its endpoint is not a DNS member.
        assert_eq!(shown(dns), ["10.1.0.5:5353 rs", "10.1.0.6:5353 st", "fd00:1::5:5353 rs"]);
        let m = &http.pool.as_ref().unwrap().members[0];
        assert_eq!((m.node_name.as_str(), m.target_pod.as_str()), ("n1", "ns/a"));
        assert_eq!(spec.session_affinity.unwrap(), SessionAffinity { client_ip: false, timeout_seconds: 0 });
        assert_eq!(spec.service_type, "ClusterIP");
    }

    #[test]
    fn the_same_endpoint_in_two_slices_is_one_member() {
        let svc = service("LoadBalancer", &["10.96.0.11"], vec![port("", "TCP", 80, "8080")]);
        let a = slice("IPv4", &[("", "TCP", 8080)], vec![ep("10.1.0.5", false, true, true, "a")]);
        let b = slice("IPv4", &[("", "TCP", 8080)], vec![ep("10.1.0.5", true, true, false, "a")]);
        let spec = lb(&svc, &[&a, &b]);
        assert_eq!(shown(&spec.listeners[0]), ["10.1.0.5:8080 rs"]);
        assert_eq!(spec.service_type, "LoadBalancer");
        // Slices in another order: the same spec.
        assert_eq!(lb(&svc, &[&b, &a]), spec);
    }

    #[test]
    fn numeric_target_port_only_when_a_slice_lists_no_ports() {
        let svc = service("ClusterIP", &["10.96.0.12"], vec![port("", "TCP", 80, "9090"), port("x", "TCP", 81, "xp")]);
        let bare = slice("IPv4", &[], vec![ep("10.1.0.5", true, true, false, "a")]);
        let fqdn = slice("FQDN", &[("", "TCP", 80)], vec![ep("example.com", true, true, false, "a")]);
        let spec = lb(&svc, &[&bare, &fqdn]);
        assert_eq!(shown(&spec.listeners[0]), ["10.1.0.5:9090 rs"]);
        assert!(shown(&spec.listeners[1]).is_empty(), "a named target port cannot be resolved without slice ports");
    }

    #[test]
    fn affinity_defaults_the_timeout() {
        let mut svc = service("ClusterIP", &["10.96.0.13"], vec![]);
        svc.session_affinity = "ClientIP".into();
        assert_eq!(
            lb(&svc, &[]).session_affinity.unwrap(),
            SessionAffinity { client_ip: true, timeout_seconds: DEFAULT_AFFINITY_TIMEOUT }
        );
        svc.session_affinity_timeout_seconds = 60;
        assert_eq!(lb(&svc, &[]).session_affinity.unwrap().timeout_seconds, 60);
    }

    #[test]
    fn node_ports_external_addresses_and_traffic_policies_are_carried() {
        let mut ports = vec![port("http", "TCP", 80, "8080"), port("dns", "UDP", 80, "8080")];
        ports[0].node_port = 30080;
        ports[1].node_port = 30081;
        let mut svc = service("NodePort", &["10.96.0.20"], ports);
        svc.external_traffic_policy = "Local".into();
        svc.internal_traffic_policy = "Cluster".into();
        svc.external_ips = vec!["192.0.2.1".into(), String::new(), "192.0.2.1".into(), "2001:db8::1".into()];
        svc.load_balancer_ingress_ips = vec!["198.51.100.1".into()];
        let a =
            slice("IPv4", &[("http", "TCP", 8080), ("dns", "UDP", 8080)], vec![ep("10.1.0.5", true, true, false, "a")]);
        let spec = lb(&svc, &[&a]);
        assert_eq!(spec.service_type, "NodePort");
        let got: Vec<(Protocol, u32, u32)> = spec.listeners.iter().map(|l| (l.protocol, l.port, l.node_port)).collect();
        assert_eq!(got, [(Protocol::Tcp, 80, 30080), (Protocol::Udp, 80, 30081)], "same port, both protocols");
        assert_eq!(shown(&spec.listeners[1]), ["10.1.0.5:8080 rs"]);
        assert_eq!(spec.external_ips, ["192.0.2.1", "2001:db8::1"]);
        assert_eq!(spec.ingress_ips, ["198.51.100.1"]);
        assert_eq!(spec.external_traffic_policy, TrafficPolicy::Local);
        assert_eq!(spec.internal_traffic_policy, TrafficPolicy::Cluster);

        // LoadBalancer keeps its node ports; ClusterIP never has any, whatever the port says.
        svc.r#type = "LoadBalancer".into();
        assert_eq!(lb(&svc, &[&a]).listeners[0].node_port, 30080);
        svc.r#type = "ClusterIP".into();
        svc.external_traffic_policy = String::new();
        let spec = lb(&svc, &[&a]);
        assert!(spec.listeners.iter().all(|l| l.node_port == 0), "{spec:?}");
        assert_eq!(spec.external_traffic_policy, TrafficPolicy::Cluster, "unset is Cluster");
    }

    #[test]
    fn headless_is_ignored_and_other_types_are_skipped() {
        let headless = service("ClusterIP", &["None"], vec![port("", "TCP", 80, "80")]);
        let r = |s| ServiceRef { namespace: "ns", name: "web", uid: "u", service: s };
        assert_eq!(desired(&r(&headless), &[]), Desired::Ignored);
        let node_port = service("NodePort", &["10.96.0.1"], vec![]);
        assert!(matches!(desired(&r(&node_port), &[]), Desired::Lb(_)), "NodePort is load-balanced");
        let odd = service("Nonsense", &["10.96.0.1"], vec![]);
        let Desired::Skipped { message } = desired(&r(&odd), &[]) else { panic!() };
        assert!(message.contains("Nonsense"), "{message}");
        let external = service("ExternalName", &[], vec![]);
        let Desired::Skipped { message } = desired(&r(&external), &[]) else { panic!() };
        assert!(message.contains("ExternalName"), "{message}");
    }
}

#[cfg(test)]
mod class_tests {
    use super::*;

    fn lb(class: &str) -> Service {
        Service { r#type: "LoadBalancer".into(), load_balancer_class: class.into(), ..Default::default() }
    }

    #[test]
    fn load_balancers_of_another_class_are_node_port_services_to_kuryr() {
        assert!(owns_load_balancer(&lb(""), None));
        assert!(!owns_load_balancer(&lb("example.com/internal-vip"), None));
        assert!(owns_load_balancer(&lb("kuryr.openstack.org/octavia"), Some("kuryr.openstack.org/octavia")));
        assert!(!owns_load_balancer(&lb(""), Some("kuryr.openstack.org/octavia")));
        assert_eq!(effective(&lb("example.com/internal-vip"), None).r#type, "NodePort");
        assert_eq!(effective(&lb(""), None).r#type, "LoadBalancer");
        let cluster_ip = Service { r#type: "ClusterIP".into(), ..Default::default() };
        assert!(!owns_load_balancer(&cluster_ip, None));
        assert_eq!(effective(&cluster_ip, None).r#type, "ClusterIP");
    }
}
