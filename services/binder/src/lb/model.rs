//! Services as the node dataplane programs them: a `LoadBalancerSpec` from kuryr-lbaas checked
//! and reduced to what nftables needs — parsed VIPs and external addresses, listeners with their
//! node port and the members that take traffic (ready ones; serving ones when none is ready), both
//! cluster-wide and among the members on this node (for the Local traffic policies), and
//! client-IP affinity.
//!
//! Everything that ends up in an nftables script passes through here first, as a parsed address,
//! a number, an enum or a name checked against the Kubernetes naming rules, so nothing in a spec
//! can inject text into the script.

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;

use kuryr_proto::lbaas::v1::{LoadBalancerSpec, Protocol, TrafficPolicy};
use kuryr_runtime::validate::is_dns_label;

/// Kubernetes' default `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;

/// Kubernetes' upper bound on the affinity timeout (one day).
pub const MAX_AFFINITY_TIMEOUT: u32 = 86_400;

/// A Service: namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl ServiceKey {
    /// The key of a spec, with both names checked (they become part of nftables names).
    pub fn from_spec(spec: &LoadBalancerSpec) -> Result<Self, SpecError> {
        if !is_dns_label(&spec.namespace) {
            return Err(SpecError::Namespace(spec.namespace.clone()));
        }
        if !is_dns_label(&spec.name) {
            return Err(SpecError::Name(spec.name.clone()));
        }
        Ok(Self { namespace: spec.namespace.clone(), name: spec.name.clone() })
    }
}

/// Transport protocols of listeners.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
}

impl Proto {
    /// The protocol's name in nftables (`meta l4proto tcp`).
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }
}

/// A member taking traffic: address and target port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Backend {
    pub addr: IpAddr,
    pub port: u16,
}

/// A Service port and the members it spreads over (sorted, without duplicates).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listener {
    pub proto: Proto,
    pub port: u16,
    /// The node port every node answers on, when the Service has one.
    pub node_port: Option<u16>,
    /// Where cluster-wide traffic goes.
    pub backends: Vec<Backend>,
    /// Where traffic goes under a Local traffic policy: the members on this node, chosen among
    /// themselves the same way (ready ones; serving ones when none of them is ready).
    pub local: Vec<Backend>,
}

impl Listener {
    /// A listener without node port whose members are all elsewhere (tests and tools).
    pub fn new(proto: Proto, port: u16, backends: Vec<Backend>) -> Self {
        Self { proto, port, node_port: None, backends, local: Vec::new() }
    }
}

/// A checked Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub key: ServiceKey,
    pub uid: String,
    pub generation: u64,
    /// The virtual IPs, both families when dual-stack.
    pub vips: Vec<IpAddr>,
    /// External IPs and load balancer ingress addresses: destinations outside the cluster's
    /// Service range, subject to the external traffic policy like node ports.
    pub external: Vec<IpAddr>,
    pub listeners: Vec<Listener>,
    /// Client-IP affinity timeout in seconds, when affinity is asked for.
    pub affinity: Option<u32>,
    /// `externalTrafficPolicy: Local`: traffic from outside to node ports and external addresses
    /// goes to this node's members only, with its source kept.
    pub external_local: bool,
    /// `internalTrafficPolicy: Local`: traffic to the cluster IPs goes to this node's members only.
    pub internal_local: bool,
}

impl Service {
    /// A ClusterIP Service with Cluster traffic policies (tests and tools).
    pub fn cluster_ip(key: ServiceKey, vips: Vec<IpAddr>, listeners: Vec<Listener>, affinity: Option<u32>) -> Self {
        Self {
            key,
            uid: String::new(),
            generation: 0,
            vips,
            external: Vec::new(),
            listeners,
            affinity,
            external_local: false,
            internal_local: false,
        }
    }
}

/// Why a spec cannot be programmed at all.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("namespace {0:?}: not a DNS label")]
    Namespace(String),
    #[error("name {0:?}: not a DNS label")]
    Name(String),
    #[error("vips: none")]
    NoVips,
    #[error("vips[{index}]: {value:?} is not an IP address")]
    Vip { index: usize, value: String },
    #[error("listeners[{index}].protocol: unspecified or unknown ({value})")]
    Protocol { index: usize, value: i32 },
    #[error("listeners[{index}].port: {value} is not a port (1-65535)")]
    Port { index: usize, value: u32 },
    #[error("listeners[{index}]: {proto} port {port} listed twice")]
    DuplicateListener { index: usize, proto: &'static str, port: u16 },
    #[error("listeners[{index}].node_port: {value} is not a port (1-65535)")]
    NodePort { index: usize, value: u32 },
    #[error("listeners[{index}]: {proto} node port {port} listed twice")]
    DuplicateNodePort { index: usize, proto: &'static str, port: u16 },
}

/// Checks a spec and reduces it to a [`Service`] as the node named `node` programs it (its
/// members there are the local ones). Members and external addresses that cannot be used (bad
/// address or port) are left out and described in the returned warnings; a spec that cannot be
/// programmed at all is an error.
pub fn service_from_spec(spec: &LoadBalancerSpec, node: &str) -> Result<(Service, Vec<String>), SpecError> {
    let key = ServiceKey::from_spec(spec)?;
    if spec.vips.is_empty() {
        return Err(SpecError::NoVips);
    }
    let mut vips = Vec::new();
    for (index, v) in spec.vips.iter().enumerate() {
        let ip: IpAddr = v.parse().map_err(|_| SpecError::Vip { index, value: v.clone() })?;
        if !vips.contains(&ip) {
            vips.push(ip);
        }
    }
    let mut warnings = Vec::new();
    let mut external = Vec::new();
    for (field, list) in [("external_ips", &spec.external_ips), ("ingress_ips", &spec.ingress_ips)] {
        for (index, v) in list.iter().enumerate() {
            match v.parse::<IpAddr>() {
                Ok(ip) if !vips.contains(&ip) && !external.contains(&ip) => external.push(ip),
                Ok(_) => {}
                Err(_) => warnings.push(format!("{field}[{index}]: {v:?} is not an IP address; left out")),
            }
        }
    }
    let mut listeners: Vec<Listener> = Vec::new();
    for (index, l) in spec.listeners.iter().enumerate() {
        let proto = match Protocol::try_from(l.protocol) {
            Ok(Protocol::Tcp) => Proto::Tcp,
            Ok(Protocol::Udp) => Proto::Udp,
            Ok(Protocol::Sctp) => Proto::Sctp,
            _ => return Err(SpecError::Protocol { index, value: l.protocol }),
        };
        let port = to_port(l.port).ok_or(SpecError::Port { index, value: l.port })?;
        if listeners.iter().any(|x| x.proto == proto && x.port == port) {
            return Err(SpecError::DuplicateListener { index, proto: proto.as_str(), port });
        }
        let node_port = match l.node_port {
            0 => None,
            n => Some(to_port(n).ok_or(SpecError::NodePort { index, value: n })?),
        };
        if let Some(np) = node_port
            && listeners.iter().any(|x| x.proto == proto && x.node_port == Some(np))
        {
            return Err(SpecError::DuplicateNodePort { index, proto: proto.as_str(), port: np });
        }
        let members = l.pool.as_ref().map(|p| p.members.as_slice()).unwrap_or_default();
        let mut ready = BTreeSet::new();
        let mut serving = BTreeSet::new();
        let mut local_ready = BTreeSet::new();
        let mut local_serving = BTreeSet::new();
        for (m_index, m) in members.iter().enumerate() {
            let (Ok(addr), Some(mport)) = (m.address.parse::<IpAddr>(), to_port(m.port)) else {
                warnings.push(format!(
                    "listeners[{index}].pool.members[{m_index}]: {:?} port {} is not an address and port; left out",
                    m.address, m.port
                ));
                continue;
            };
            let b = Backend { addr, port: mport };
            let here = !node.is_empty() && m.node_name == node;
            if m.ready {
                ready.insert(b);
                if here {
                    local_ready.insert(b);
                }
            } else if m.serving {
                serving.insert(b);
                if here {
                    local_serving.insert(b);
                }
            }
        }
        // Kubernetes semantics: ready endpoints take the traffic; only when none is ready do
        // serving (terminating) ones, so that connections drain instead of being refused. The
        // members on this node are chosen the same way among themselves, as kube-proxy does.
        let pick = |ready: BTreeSet<Backend>, serving: BTreeSet<Backend>| -> Vec<Backend> {
            if ready.is_empty() { serving } else { ready }.into_iter().collect()
        };
        listeners.push(Listener {
            proto,
            port,
            node_port,
            backends: pick(ready, serving),
            local: pick(local_ready, local_serving),
        });
    }
    let affinity = spec.session_affinity.as_ref().filter(|a| a.client_ip).map(|a| match a.timeout_seconds {
        0 => DEFAULT_AFFINITY_TIMEOUT,
        t => t.min(MAX_AFFINITY_TIMEOUT),
    });
    let svc = Service {
        key,
        uid: spec.uid.clone(),
        generation: spec.generation,
        vips,
        external,
        listeners,
        affinity,
        external_local: spec.external_traffic_policy() == TrafficPolicy::Local,
        internal_local: spec.internal_traffic_policy() == TrafficPolicy::Local,
    };
    Ok((svc, warnings))
}

fn to_port(p: u32) -> Option<u16> {
    u16::try_from(p).ok().filter(|p| *p != 0)
}

#[cfg(test)]
mod tests {
    use kuryr_proto::lbaas::v1::{Listener as PbListener, Member, Pool, SessionAffinity};

    use super::*;

    fn member(addr: &str, ready: bool, serving: bool) -> Member {
        Member { address: addr.into(), port: 8080, ready, serving, terminating: !ready, ..Default::default() }
    }

    fn spec(members: Vec<Member>) -> LoadBalancerSpec {
        LoadBalancerSpec {
            namespace: "default".into(),
            name: "web".into(),
            uid: "u1".into(),
            vips: vec!["10.96.0.10".into(), "fd00:96::10".into()],
            listeners: vec![PbListener {
                protocol: Protocol::Tcp as i32,
                port: 80,
                name: "http".into(),
                pool: Some(Pool { members }),
                node_port: 0,
            }],
            session_affinity: None,
            service_type: "ClusterIP".into(),
            generation: 3,
            ..Default::default()
        }
    }

    fn service_from_spec_here(spec: &LoadBalancerSpec) -> Result<(Service, Vec<String>), SpecError> {
        service_from_spec(spec, "node-1")
    }

    fn addrs(s: &Service) -> Vec<String> {
        s.listeners[0].backends.iter().map(|b| b.addr.to_string()).collect()
    }

    #[test]
    fn ready_members_take_the_traffic_serving_ones_only_when_none_is_ready() {
        let (s, w) = service_from_spec_here(&spec(vec![
            member("10.0.0.2", true, true),
            member("10.0.0.1", true, true),
            member("10.0.0.3", false, true),
            member("10.0.0.4", false, false),
            member("10.0.0.1", true, true),
        ]))
        .unwrap();
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(addrs(&s), ["10.0.0.1", "10.0.0.2"], "sorted, deduplicated, ready only");
        let (s, _) =
            service_from_spec_here(&spec(vec![member("10.0.0.3", false, true), member("10.0.0.4", false, false)]))
                .unwrap();
        assert_eq!(addrs(&s), ["10.0.0.3"], "terminating but serving when nothing is ready");
        let (s, _) = service_from_spec_here(&spec(vec![member("10.0.0.4", false, false)])).unwrap();
        assert!(s.listeners[0].backends.is_empty());
    }

    #[test]
    fn bad_members_are_left_out_with_a_warning() {
        let mut sp = spec(vec![member("10.0.0.1", true, true), member("not-an-ip", true, true)]);
        if let Some(p) = sp.listeners[0].pool.as_mut() {
            p.members.push(Member { port: 70_000, ..member("10.0.0.9", true, true) });
        }
        let (s, w) = service_from_spec_here(&sp).unwrap();
        assert_eq!(addrs(&s), ["10.0.0.1"]);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("members[1]") && w[0].contains("not-an-ip"), "{w:?}");
        assert!(w[1].contains("members[2]") && w[1].contains("70000"), "{w:?}");
    }

    #[test]
    fn errors_name_the_field() {
        let mut sp = spec(vec![]);
        sp.namespace = "Default".into();
        assert_eq!(service_from_spec_here(&sp).unwrap_err().to_string(), "namespace \"Default\": not a DNS label");
        let mut sp = spec(vec![]);
        sp.name = "web; flush ruleset".into();
        assert!(service_from_spec_here(&sp).unwrap_err().to_string().starts_with("name "));
        let mut sp = spec(vec![]);
        sp.vips[1] = "10.96.0.300".into();
        assert_eq!(
            service_from_spec_here(&sp).unwrap_err().to_string(),
            "vips[1]: \"10.96.0.300\" is not an IP address"
        );
        let mut sp = spec(vec![]);
        sp.vips.clear();
        assert_eq!(service_from_spec_here(&sp).unwrap_err(), SpecError::NoVips);
        let mut sp = spec(vec![]);
        sp.listeners[0].protocol = 0;
        assert!(service_from_spec_here(&sp).unwrap_err().to_string().starts_with("listeners[0].protocol"));
        let mut sp = spec(vec![]);
        sp.listeners[0].port = 0;
        assert!(service_from_spec_here(&sp).unwrap_err().to_string().starts_with("listeners[0].port: 0"));
        let mut sp = spec(vec![]);
        sp.listeners.push(sp.listeners[0].clone());
        assert_eq!(service_from_spec_here(&sp).unwrap_err().to_string(), "listeners[1]: tcp port 80 listed twice");
    }

    #[test]
    fn affinity_timeout_defaults_and_is_capped() {
        let mut sp = spec(vec![]);
        assert_eq!(service_from_spec_here(&sp).unwrap().0.affinity, None);
        sp.session_affinity = Some(SessionAffinity { client_ip: true, timeout_seconds: 0 });
        assert_eq!(service_from_spec_here(&sp).unwrap().0.affinity, Some(DEFAULT_AFFINITY_TIMEOUT));
        sp.session_affinity = Some(SessionAffinity { client_ip: true, timeout_seconds: 30 });
        assert_eq!(service_from_spec_here(&sp).unwrap().0.affinity, Some(30));
        sp.session_affinity = Some(SessionAffinity { client_ip: true, timeout_seconds: 1_000_000 });
        assert_eq!(service_from_spec_here(&sp).unwrap().0.affinity, Some(MAX_AFFINITY_TIMEOUT));
        sp.session_affinity = Some(SessionAffinity { client_ip: false, timeout_seconds: 30 });
        assert_eq!(service_from_spec_here(&sp).unwrap().0.affinity, None);
    }

    #[test]
    fn local_members_node_ports_external_addresses_and_policies() {
        let on = |addr: &str, node: &str, ready: bool| Member { node_name: node.into(), ..member(addr, ready, true) };
        let mut sp =
            spec(vec![on("10.0.0.1", "node-1", true), on("10.0.0.2", "node-2", true), on("10.0.0.3", "node-1", false)]);
        sp.listeners[0].node_port = 30080;
        sp.external_ips = vec!["192.0.2.1".into(), "10.96.0.10".into(), "bogus".into()];
        sp.ingress_ips = vec!["192.0.2.1".into(), "2001:db8::1".into()];
        sp.external_traffic_policy = TrafficPolicy::Local as i32;
        let (s, w) = service_from_spec_here(&sp).unwrap();
        let l = &s.listeners[0];
        assert_eq!(l.node_port, Some(30080));
        assert_eq!(addrs(&s), ["10.0.0.1", "10.0.0.2"]);
        assert_eq!(l.local.iter().map(|b| b.addr.to_string()).collect::<Vec<_>>(), ["10.0.0.1"]);
        let ext: Vec<String> = s.external.iter().map(ToString::to_string).collect();
        assert_eq!(ext, ["192.0.2.1", "2001:db8::1"], "deduplicated, the VIP left out");
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("external_ips[2]"), "{w:?}");
        assert!(s.external_local && !s.internal_local);

        // Another node sees no local ready member: its serving one on node-1 is not its own.
        let (s, _) = service_from_spec(&sp, "node-2").unwrap();
        assert_eq!(s.listeners[0].local.iter().map(|b| b.addr.to_string()).collect::<Vec<_>>(), ["10.0.0.2"]);
        // Among local members too, serving ones only when none is ready.
        let mut sp2 = sp.clone();
        sp2.listeners[0].pool =
            Some(Pool { members: vec![on("10.0.0.3", "node-1", false), on("10.0.0.2", "node-2", true)] });
        let (s, _) = service_from_spec_here(&sp2).unwrap();
        assert_eq!(s.listeners[0].local.iter().map(|b| b.addr.to_string()).collect::<Vec<_>>(), ["10.0.0.3"]);
        assert_eq!(addrs(&s), ["10.0.0.2"]);

        sp.listeners[0].node_port = 70_000;
        assert_eq!(
            service_from_spec_here(&sp).unwrap_err().to_string(),
            "listeners[0].node_port: 70000 is not a port (1-65535)"
        );
        sp.listeners[0].node_port = 30080;
        let mut udp = sp.listeners[0].clone();
        udp.protocol = Protocol::Udp as i32;
        sp.listeners.push(udp.clone());
        assert!(service_from_spec_here(&sp).is_ok(), "one node port for TCP and UDP is fine");
        udp.port = 81;
        sp.listeners.push(udp);
        assert_eq!(
            service_from_spec_here(&sp).unwrap_err().to_string(),
            "listeners[2]: udp node port 30080 listed twice"
        );
    }
}
