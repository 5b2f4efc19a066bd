//! The Octavia shape of a Service's load balancer, and the changes that take an observed load
//! balancer there. Pure: no I/O, so every rule here is unit-tested.
//!
//! - One Octavia load balancer per Service, VIP = the Service's first cluster IP on the configured
//!   VIP subnet, named `<cluster>/<namespace>/<name>` and tagged with the cluster, the Service key
//!   and the Service uid ([`tags`]): the tags are how lbaas finds its load balancers again after
//!   a restart and tells its own from anybody else's.
//! - One listener per Service port (protocol and port), each with one named default pool
//!   (round robin; `SOURCE_IP` persistence for `sessionAffinity: ClientIP`).
//! - Members: the ready endpoints; when none is ready, the serving ones (terminating endpoints
//!   still serving), as kube-proxy falls back. UDP and SCTP pools keep only members of the VIP's
//!   address family (the amphora's LVS cannot mix them).
//! - [`plan`] compares with what Octavia holds and lists the changes, each one a separate call
//!   after which the load balancer is immutable until ACTIVE again: deletions first (freeing
//!   ports), then new listeners and pools missing under existing listeners, persistence updates,
//!   and a batch member update per pool whose members differ. (A new listener on an existing
//!   load balancer is three changes — listener, pool, members — because Octavia 19 answers 500
//!   to a pool or members nested in a single listener or pool create; only the load balancer's
//!   fully-populated create takes the whole tree.)

use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::core::lb::{LoadBalancerSpec, Protocol};
use kuryr_openstack::octavia::{
    LbAlgorithm, ListenerCreate, LoadBalancerCreate, MemberCreate, PoolCreate, Protocol as OsProtocol,
    SessionPersistence,
};

/// Tag prefixes. Octavia tags are free strings (no commas: tag filters are comma lists).
pub const TAG_CLUSTER: &str = "kuryr-cluster=";
/// See [`TAG_CLUSTER`]: `namespace/name` of the Service.
pub const TAG_SERVICE: &str = "kuryr-service=";
/// See [`TAG_CLUSTER`]: the Service's uid.
pub const TAG_UID: &str = "kuryr-service-uid=";

/// The cluster's ownership tag.
pub fn cluster_tag(cluster: &str) -> String {
    format!("{TAG_CLUSTER}{cluster}")
}

/// The tags of everything lbaas creates for the Service `key` of `uid`.
pub fn tags(cluster: &str, key: &str, uid: &str) -> Vec<String> {
    vec![cluster_tag(cluster), format!("{TAG_SERVICE}{key}"), format!("{TAG_UID}{uid}")]
}

/// The Service key and uid an object's tags name, when they carry both.
pub fn owner(tags: &[String]) -> Option<(String, String)> {
    let find = |prefix: &str| tags.iter().find_map(|t| t.strip_prefix(prefix)).map(str::to_string);
    Some((find(TAG_SERVICE)?, find(TAG_UID)?))
}

/// Deployment choices that shape every load balancer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    /// Names the cluster in names and tags.
    pub cluster: String,
    /// The subnet the VIPs are allocated on.
    pub vip_subnet_id: String,
    /// The VIP network, when the subnet alone is ambiguous.
    pub vip_network_id: Option<String>,
    /// A pre-created VIP port (Neutron), when lbaas owns the VIP port itself.
    pub vip_port_id: Option<String>,
    /// The subnet members are reached on; unset lets Octavia route to them from the VIP subnet.
    pub member_subnet_id: Option<String>,
    /// Octavia provider (`amphora`, `ovn`); Octavia's default when unset.
    pub provider: Option<String>,
}

/// A listener and its pool as they should be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredListener {
    /// The listener's (and pool's) protocol.
    pub protocol: OsProtocol,
    /// The Service port.
    pub port: u16,
    /// `<protocol>-<port>`; the pool is named the same (fully-populated creates need names).
    pub name: String,
    /// Session persistence of the pool.
    pub persistence: Option<SessionPersistence>,
    /// Members, sorted by address and port.
    pub members: Vec<MemberCreate>,
}

/// The load balancer as it should be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredLb {
    /// `<cluster>/<namespace>/<name>`.
    pub name: String,
    /// The VIP.
    pub vip_address: String,
    /// Ownership tags.
    pub tags: Vec<String>,
    /// In the Service's port order.
    pub listeners: Vec<DesiredListener>,
}

fn os_protocol(p: Protocol) -> OsProtocol {
    match p {
        Protocol::Tcp => OsProtocol::Tcp,
        Protocol::Udp => OsProtocol::Udp,
        Protocol::Sctp => OsProtocol::Sctp,
    }
}

fn protocol_name(p: OsProtocol) -> &'static str {
    match p {
        OsProtocol::Udp => "UDP",
        OsProtocol::Sctp => "SCTP",
        OsProtocol::Http => "HTTP",
        OsProtocol::Https => "HTTPS",
        OsProtocol::Tcp | OsProtocol::Other => "TCP",
    }
}

fn is_datagram(p: OsProtocol) -> bool {
    matches!(p, OsProtocol::Udp | OsProtocol::Sctp)
}

fn same_family(a: &str, b: &str) -> bool {
    match (a.parse::<IpAddr>(), b.parse::<IpAddr>()) {
        (Ok(a), Ok(b)) => a.is_ipv4() == b.is_ipv4(),
        _ => true,
    }
}

/// An address in one spelling (`fd00::1` and `fd00:0::1` are the same member).
fn canonical(addr: &str) -> String {
    addr.parse::<IpAddr>().map(|a| a.to_string()).unwrap_or_else(|_| addr.to_string())
}

/// The Octavia load balancer of `spec` (namespace/name `key`), or why it cannot have one.
pub fn desired(key: &str, spec: &LoadBalancerSpec, shape: &Shape) -> Result<DesiredLb, String> {
    let vip = spec.vips.first().ok_or_else(|| format!("Service {key} has no cluster IP to use as the VIP"))?;
    let affinity = spec.session_affinity.unwrap_or_default();
    let mut listeners = Vec::with_capacity(spec.listeners.len());
    for l in &spec.listeners {
        let port = u16::try_from(l.port).map_err(|_| format!("Service {key}: port {} is out of range", l.port))?;
        let protocol = os_protocol(l.protocol);
        let persistence = affinity.client_ip.then(|| SessionPersistence {
            kind: "SOURCE_IP".into(),
            cookie_name: None,
            // Octavia takes a timeout for datagram pools only.
            persistence_timeout: is_datagram(protocol).then_some(affinity.timeout_seconds),
            persistence_granularity: None,
        });
        let all = l.pool.as_ref().map(|p| p.members.as_slice()).unwrap_or_default();
        let any_ready = all.iter().any(|m| m.ready);
        let mut members: Vec<MemberCreate> = all
            .iter()
            .filter(|m| if any_ready { m.ready } else { m.serving })
            .filter(|m| !is_datagram(protocol) || same_family(&m.address, vip))
            .filter_map(|m| {
                let protocol_port = u16::try_from(m.port).ok()?;
                Some(MemberCreate {
                    address: canonical(&m.address),
                    protocol_port,
                    name: Some(m.target_pod.clone()).filter(|s| !s.is_empty()),
                    subnet_id: shape.member_subnet_id.clone(),
                    ..Default::default()
                })
            })
            .collect();
        members.sort_by(|a, b| (&a.address, a.protocol_port).cmp(&(&b.address, b.protocol_port)));
        members.dedup_by(|a, b| a.address == b.address && a.protocol_port == b.protocol_port);
        listeners.push(DesiredListener {
            protocol,
            port,
            name: format!("{}-{port}", protocol_name(protocol)),
            persistence,
            members,
        });
    }
    Ok(DesiredLb {
        name: format!("{}/{key}", shape.cluster),
        vip_address: vip.clone(),
        tags: tags(&shape.cluster, key, &spec.uid),
        listeners,
    })
}

impl DesiredListener {
    /// The pool, for a fully-populated create (`listener_id` unset) or under a listener.
    pub fn pool_create(&self, tags: &[String], listener_id: Option<String>) -> PoolCreate {
        PoolCreate {
            name: Some(self.name.clone()),
            listener_id,
            session_persistence: self.persistence.clone(),
            members: self.members.clone(),
            tags: tags.to_vec(),
            ..PoolCreate::new(self.protocol, LbAlgorithm::RoundRobin)
        }
    }

    /// The listener with its pool and members, as a fully-populated load balancer create nests
    /// it.
    pub fn listener_create(&self, tags: &[String], loadbalancer_id: Option<String>) -> ListenerCreate {
        ListenerCreate {
            name: Some(self.name.clone()),
            loadbalancer_id,
            default_pool: Some(self.pool_create(tags, None)),
            tags: tags.to_vec(),
            ..ListenerCreate::new(self.protocol, self.port)
        }
    }
}

impl DesiredLb {
    /// Members over all pools.
    pub fn member_count(&self) -> usize {
        self.listeners.iter().map(|l| l.members.len()).sum()
    }

    /// The fully-populated create: load balancer, listeners, pools and members in one call.
    pub fn create_body(&self, shape: &Shape) -> LoadBalancerCreate {
        LoadBalancerCreate {
            name: Some(self.name.clone()),
            description: Some("Kubernetes Service load balancer, managed by kuryr-lbaas".into()),
            vip_subnet_id: Some(shape.vip_subnet_id.clone()),
            vip_network_id: shape.vip_network_id.clone(),
            vip_port_id: shape.vip_port_id.clone(),
            vip_address: Some(self.vip_address.clone()),
            provider: shape.provider.clone(),
            tags: self.tags.clone(),
            listeners: self.listeners.iter().map(|l| l.listener_create(&self.tags, None)).collect(),
            ..Default::default()
        }
    }
}

/// A pool as Octavia holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObservedPool {
    /// Octavia's id.
    pub id: String,
    /// Its session persistence.
    pub persistence: Option<SessionPersistence>,
    /// `(address, port)` of each member, in canonical spelling.
    pub members: BTreeSet<(String, u16)>,
}

/// A listener as Octavia holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObservedListener {
    /// Octavia's id.
    pub id: String,
    /// Its protocol.
    pub protocol: OsProtocol,
    /// Its port.
    pub port: u16,
    /// Its default pool, if it has one.
    pub pool: Option<ObservedPool>,
}

/// A load balancer's tree as Octavia holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObservedTree {
    /// Every listener.
    pub listeners: Vec<ObservedListener>,
    /// Pools of the load balancer that no listener uses.
    pub stray_pools: Vec<String>,
}

impl ObservedPool {
    /// The observed members of a pool, from Octavia's member list.
    pub fn member_set<'a>(members: impl IntoIterator<Item = (&'a str, u16)>) -> BTreeSet<(String, u16)> {
        members.into_iter().map(|(a, p)| (canonical(a), p)).collect()
    }
}

/// One change: Octavia takes the load balancer to PENDING_UPDATE for each, and refuses any other
/// change until it is ACTIVE again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Remove a pool (its members go with it).
    DeletePool {
        /// The pool.
        id: String,
    },
    /// Remove a listener no Service port asks for.
    DeleteListener {
        /// The listener.
        id: String,
        /// For logs.
        name: String,
    },
    /// A new listener, then its pool and members.
    CreateListener(DesiredListener),
    /// A pool (with its members) under a listener that lost its pool.
    CreatePool {
        /// The listener.
        listener_id: String,
        /// What the pool should be.
        listener: DesiredListener,
    },
    /// Set a pool's session persistence.
    UpdatePersistence {
        /// The pool.
        pool_id: String,
        /// The new persistence (`None` removes it).
        persistence: Option<SessionPersistence>,
    },
    /// The batch member update: the pool's whole member list in one call.
    ReplaceMembers {
        /// The pool.
        pool_id: String,
        /// For logs.
        name: String,
        /// Every member the pool should have.
        members: Vec<MemberCreate>,
    },
}

impl Step {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Step::DeletePool { .. } => "pool_delete",
            Step::DeleteListener { .. } => "listener_delete",
            Step::CreateListener(_) => "listener_create",
            Step::CreatePool { .. } => "pool_create",
            Step::UpdatePersistence { .. } => "pool_update",
            Step::ReplaceMembers { .. } => "members_replace",
        }
    }
}

fn persistence_matches(want: Option<&SessionPersistence>, have: Option<&SessionPersistence>) -> bool {
    match (want, have) {
        (None, None) => true,
        (Some(w), Some(h)) => {
            w.kind == h.kind && (w.persistence_timeout.is_none() || w.persistence_timeout == h.persistence_timeout)
        }
        _ => false,
    }
}

/// The changes that take `have` to `want`, in the order to make them.
pub fn plan(want: &DesiredLb, have: &ObservedTree) -> Vec<Step> {
    let mut deletes = Vec::new();
    let mut creates = Vec::new();
    let mut updates = Vec::new();
    let mut members = Vec::new();
    let wanted = |l: &ObservedListener| want.listeners.iter().find(|w| w.protocol == l.protocol && w.port == l.port);
    for pool in &have.stray_pools {
        deletes.push(Step::DeletePool { id: pool.clone() });
    }
    for l in &have.listeners {
        if wanted(l).is_none() {
            if let Some(p) = &l.pool {
                deletes.push(Step::DeletePool { id: p.id.clone() });
            }
            deletes.push(Step::DeleteListener {
                id: l.id.clone(),
                name: format!("{}-{}", protocol_name(l.protocol), l.port),
            });
        }
    }
    for w in &want.listeners {
        let Some(l) = have.listeners.iter().find(|l| l.protocol == w.protocol && l.port == w.port) else {
            creates.push(Step::CreateListener(w.clone()));
            continue;
        };
        let Some(pool) = &l.pool else {
            creates.push(Step::CreatePool { listener_id: l.id.clone(), listener: w.clone() });
            continue;
        };
        if !persistence_matches(w.persistence.as_ref(), pool.persistence.as_ref()) {
            updates.push(Step::UpdatePersistence { pool_id: pool.id.clone(), persistence: w.persistence.clone() });
        }
        let target: BTreeSet<(String, u16)> = w.members.iter().map(|m| (m.address.clone(), m.protocol_port)).collect();
        if target != pool.members {
            members.push(Step::ReplaceMembers {
                pool_id: pool.id.clone(),
                name: w.name.clone(),
                members: w.members.clone(),
            });
        }
    }
    deletes.into_iter().chain(creates).chain(updates).chain(members).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::core::lb::{Listener, Member, Pool, SessionAffinity};

    use super::*;

    fn member(addr: &str, port: u32, ready: bool, serving: bool) -> Member {
        Member { address: addr.into(), port, ready, serving, target_pod: format!("ns/{addr}"), ..Default::default() }
    }

    fn spec(listeners: Vec<(Protocol, u32, Vec<Member>)>, client_ip: bool) -> LoadBalancerSpec {
        LoadBalancerSpec {
            namespace: "ns".into(),
            name: "web".into(),
            uid: "u1".into(),
            vips: vec!["10.96.0.10".into(), "fd00::10".into()],
            listeners: listeners
                .into_iter()
                .map(|(p, port, members)| Listener {
                    protocol: p,
                    port,
                    name: String::new(),
                    pool: Some(Pool { members }),
                    node_port: 0,
                })
                .collect(),
            session_affinity: Some(SessionAffinity { client_ip, timeout_seconds: if client_ip { 600 } else { 0 } }),
            service_type: "ClusterIP".into(),
            generation: 3,
            ..Default::default()
        }
    }

    fn shape() -> Shape {
        Shape { cluster: "c1".into(), vip_subnet_id: "sub".into(), ..Default::default() }
    }

    fn addrs(l: &DesiredListener) -> Vec<String> {
        l.members.iter().map(|m| format!("{}:{}", m.address, m.protocol_port)).collect()
    }

    #[test]
    fn desired_shape_names_tags_members_and_persistence() {
        let s = spec(
            vec![
                (
                    Protocol::Tcp,
                    80,
                    vec![
                        member("10.1.0.6", 8080, true, true),
                        member("10.1.0.5", 8080, true, true),
                        member("10.1.0.7", 8080, false, true),
                        member("fd00:0::5", 8080, true, true),
                    ],
                ),
                (Protocol::Udp, 53, vec![member("10.1.0.5", 5353, true, true), member("fd00::5", 5353, true, true)]),
            ],
            true,
        );
        let d = desired("ns/web", &s, &shape()).unwrap();
        assert_eq!(d.name, "c1/ns/web");
        assert_eq!(d.vip_address, "10.96.0.10");
        assert_eq!(d.tags, ["kuryr-cluster=c1", "kuryr-service=ns/web", "kuryr-service-uid=u1"]);
        assert_eq!(owner(&d.tags), Some(("ns/web".to_string(), "u1".to_string())));
        let (tcp, udp) = (&d.listeners[0], &d.listeners[1]);
        assert_eq!((tcp.name.as_str(), tcp.port, tcp.protocol), ("TCP-80", 80, OsProtocol::Tcp));
        // Ready ones only (the serving-only one waits), sorted, IPv6 spelled canonically.
        assert_eq!(addrs(tcp), ["10.1.0.5:8080", "10.1.0.6:8080", "fd00::5:8080"]);
        assert_eq!(tcp.members[0].name.as_deref(), Some("ns/10.1.0.5"));
        assert_eq!(tcp.persistence.as_ref().unwrap().kind, "SOURCE_IP");
        assert_eq!(tcp.persistence.as_ref().unwrap().persistence_timeout, None);
        // UDP keeps the VIP's family only, and carries the affinity timeout.
        assert_eq!(addrs(udp), ["10.1.0.5:5353"]);
        assert_eq!(udp.persistence.as_ref().unwrap().persistence_timeout, Some(600));

        let body = d.create_body(&shape());
        let json = serde_json::to_value(&body).unwrap();
        assert_eq!(json["vip_address"], "10.96.0.10");
        assert_eq!(json["vip_subnet_id"], "sub");
        assert_eq!(json["listeners"][0]["default_pool"]["name"], "TCP-80");
        assert_eq!(json["listeners"][0]["default_pool"]["members"][2]["address"], "fd00::5");
        assert_eq!(json["listeners"][1]["protocol"], "UDP");
        assert!(json.get("vip_port_id").is_none());
    }

    #[test]
    fn serving_members_stand_in_when_none_is_ready() {
        let s = spec(
            vec![(Protocol::Tcp, 80, vec![member("10.1.0.7", 80, false, true), member("10.1.0.8", 80, false, false)])],
            false,
        );
        let d = desired("ns/web", &s, &shape()).unwrap();
        assert_eq!(addrs(&d.listeners[0]), ["10.1.0.7:80"]);
        assert_eq!(d.listeners[0].persistence, None);
    }

    #[test]
    fn a_service_without_vips_or_with_a_bad_port_is_refused() {
        let mut s = spec(vec![], false);
        s.vips.clear();
        assert!(desired("ns/web", &s, &shape()).unwrap_err().contains("no cluster IP"));
        let s = spec(vec![(Protocol::Tcp, 70000, vec![])], false);
        assert!(desired("ns/web", &s, &shape()).unwrap_err().contains("70000"));
    }

    fn observed(d: &DesiredLb) -> ObservedTree {
        ObservedTree {
            listeners: d
                .listeners
                .iter()
                .enumerate()
                .map(|(i, l)| ObservedListener {
                    id: format!("l{i}"),
                    protocol: l.protocol,
                    port: l.port,
                    pool: Some(ObservedPool {
                        id: format!("p{i}"),
                        persistence: l.persistence.clone(),
                        members: ObservedPool::member_set(
                            l.members.iter().map(|m| (m.address.as_str(), m.protocol_port)),
                        ),
                    }),
                })
                .collect(),
            stray_pools: vec![],
        }
    }

    #[test]
    fn converged_means_no_steps_and_a_member_change_is_one_batch_per_pool() {
        let s = spec(
            vec![(Protocol::Tcp, 80, vec![member("10.1.0.5", 8080, true, true)]), (Protocol::Tcp, 443, vec![])],
            false,
        );
        let d = desired("ns/web", &s, &shape()).unwrap();
        let mut have = observed(&d);
        assert_eq!(plan(&d, &have), []);
        // Octavia spells an address differently: still the same member.
        have.listeners[0].pool.as_mut().unwrap().members = ObservedPool::member_set([("10.1.0.5", 8080)]);
        assert_eq!(plan(&d, &have), []);
        have.listeners[0].pool.as_mut().unwrap().members = ObservedPool::member_set([("10.1.0.9", 8080)]);
        let steps = plan(&d, &have);
        assert_eq!(steps.len(), 1, "{steps:?}");
        let Step::ReplaceMembers { pool_id, members, .. } = &steps[0] else { panic!("{steps:?}") };
        assert_eq!((pool_id.as_str(), members.len(), members[0].address.as_str()), ("p0", 1, "10.1.0.5"));
        assert_eq!(steps[0].kind(), "members_replace");
    }

    #[test]
    fn listeners_and_pools_are_added_removed_and_repaired_deletions_first() {
        let s = spec(
            vec![(Protocol::Tcp, 80, vec![member("10.1.0.5", 8080, true, true)]), (Protocol::Udp, 53, vec![])],
            true,
        );
        let d = desired("ns/web", &s, &shape()).unwrap();
        let mut have = observed(&d);
        // Port 53 was removed out of band, port 80 lost its pool, 8443 is no longer asked for,
        // and a pool hangs on the load balancer without a listener.
        have.listeners.retain(|l| l.port != 53);
        have.listeners[0].pool = None;
        have.listeners.push(ObservedListener {
            id: "old".into(),
            protocol: OsProtocol::Tcp,
            port: 8443,
            pool: Some(ObservedPool { id: "old-pool".into(), ..Default::default() }),
        });
        have.stray_pools.push("stray".into());
        let steps = plan(&d, &have);
        let kinds: Vec<&str> = steps.iter().map(Step::kind).collect();
        assert_eq!(kinds, ["pool_delete", "pool_delete", "listener_delete", "pool_create", "listener_create"]);
        assert_eq!(steps[0], Step::DeletePool { id: "stray".into() });
        assert_eq!(steps[1], Step::DeletePool { id: "old-pool".into() });
        let Step::CreatePool { listener_id, listener } = &steps[3] else { panic!() };
        assert_eq!((listener_id.as_str(), listener.port), ("l0", 80));
        let Step::CreateListener(l) = &steps[4] else { panic!() };
        assert_eq!((l.protocol, l.port), (OsProtocol::Udp, 53));
        let body = serde_json::to_value(l.listener_create(&d.tags, Some("lb".into()))).unwrap();
        assert_eq!(body["loadbalancer_id"], "lb");
        assert_eq!(body["default_pool"]["session_persistence"]["type"], "SOURCE_IP");

        // Affinity dropped: one pool update per pool.
        let plain = desired(
            "ns/web",
            &spec(vec![(Protocol::Tcp, 80, vec![member("10.1.0.5", 8080, true, true)])], false),
            &shape(),
        )
        .unwrap();
        let have = observed(&d);
        let steps = plan(&plain, &have);
        let kinds: Vec<&str> = steps.iter().map(Step::kind).collect();
        assert_eq!(kinds, ["pool_delete", "listener_delete", "pool_update"], "{steps:?}");
    }
}
