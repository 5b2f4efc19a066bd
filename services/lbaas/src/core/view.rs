//! lbaas' view of Services and EndpointSlices, fed by the watcher's Subscribe stream. Free of
//! kube and tonic.
//!
//! Keyed by `namespace/name` of the Service: a load balancer belongs to a Service name (its
//! record is named after the Service), and a Service deleted and re-created under the same name
//! is, to a dataplane, the same VIP with a new uid. Slices are grouped by the Service their
//! `kubernetes.io/service-name` label names.
//!
//! A snapshot (the first one, or one after RESET) is a re-list: at SNAPSHOT_COMPLETE every
//! Service and slice it did not name is gone, so a deletion missed while disconnected still
//! removes the load balancer.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use kuryr_proto::watcher::v1::object::Body;
use kuryr_proto::watcher::v1::{EndpointSlice, EventType, Object, Service, SubscribeResponse};

/// The finalizer lbaas puts on every Service it gives a load balancer: the Service cannot
/// disappear before its load balancer is gone.
pub const FINALIZER: &str = "kuryr.openstack.org/lbaas";

/// `namespace/name`.
pub fn key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// Splits a key into namespace and name.
pub fn split(key: &str) -> (&str, &str) {
    key.split_once('/').unwrap_or(("", key))
}

/// A slice's key: (namespace, name).
type SliceKey = (String, String);

/// While a snapshot is being received: the Service keys and slices it named.
type Seen = (HashSet<String>, HashSet<SliceKey>);

/// A Service as last seen.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceEntry {
    /// metadata.uid.
    pub uid: String,
    /// metadata.deletionTimestamp is set.
    pub deleting: bool,
    /// Our finalizer is on it.
    pub has_finalizer: bool,
    /// The reduced Service.
    pub service: Arc<Service>,
}

/// What an event changed.
#[derive(Debug, PartialEq, Eq)]
pub enum Effect {
    /// Reconcile this Service key.
    Service(String),
    /// The snapshot is complete: the stream is live.
    Live,
    /// RESET: a new snapshot follows.
    Resync,
}

/// The view shared by the watcher follower and the workers.
pub type SharedView = std::sync::Arc<std::sync::Mutex<View>>;

/// The view.
#[derive(Debug)]
pub struct View {
    services: BTreeMap<String, ServiceEntry>,
    /// By slice key: the Service key it belongs to, and the slice.
    slices: BTreeMap<SliceKey, (String, Arc<EndpointSlice>)>,
    /// Service key → the names of its slices.
    by_service: BTreeMap<String, BTreeSet<String>>,
    /// While a snapshot is being received: what it named.
    resync: Option<Seen>,
}

impl Default for View {
    fn default() -> Self {
        // The first snapshot is a re-list like any other.
        Self {
            services: BTreeMap::new(),
            slices: BTreeMap::new(),
            by_service: BTreeMap::new(),
            resync: Some(Default::default()),
        }
    }
}

impl View {
    /// The Service of `key`, if it exists.
    pub fn service(&self, key: &str) -> Option<&ServiceEntry> {
        self.services.get(key)
    }

    /// The slices of the Service `key`, in name order.
    pub fn slices(&self, key: &str) -> Vec<Arc<EndpointSlice>> {
        let (ns, _) = split(key);
        self.by_service
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|name| self.slices.get(&(ns.to_string(), name.clone())).map(|(_, s)| s.clone()))
            .collect()
    }

    /// Every Service key held.
    pub fn keys(&self) -> Vec<String> {
        self.services.keys().cloned().collect()
    }

    /// How many Services are held.
    pub fn len(&self) -> usize {
        self.services.len()
    }

    /// Whether no Service is held.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    /// Applies one event of the watcher's stream.
    pub fn apply(&mut self, ev: &SubscribeResponse) -> Vec<Effect> {
        match ev.r#type() {
            EventType::Reset => {
                self.resync = Some(Default::default());
                vec![Effect::Resync]
            }
            EventType::SnapshotComplete => {
                let mut effects = Vec::new();
                if let Some((services, slices)) = self.resync.take() {
                    let gone: Vec<String> = self.services.keys().filter(|k| !services.contains(*k)).cloned().collect();
                    for k in gone {
                        self.services.remove(&k);
                        effects.push(Effect::Service(k));
                    }
                    let gone: Vec<SliceKey> = self.slices.keys().filter(|k| !slices.contains(*k)).cloned().collect();
                    for k in gone {
                        if let Some(svc) = self.remove_slice(&k) {
                            effects.push(Effect::Service(svc));
                        }
                    }
                }
                effects.push(Effect::Live);
                effects
            }
            EventType::Applied => ev.object.as_ref().map(|o| self.applied(o)).unwrap_or_default(),
            EventType::Deleted => ev.object.as_ref().map(|o| self.deleted(o)).unwrap_or_default(),
            EventType::Unspecified | EventType::Heartbeat => Vec::new(),
        }
    }

    fn applied(&mut self, o: &Object) -> Vec<Effect> {
        match &o.body {
            Some(Body::Service(s)) => {
                let k = key(&o.namespace, &o.name);
                if let Some((services, _)) = &mut self.resync {
                    services.insert(k.clone());
                }
                let entry = ServiceEntry {
                    uid: o.uid.clone(),
                    deleting: o.deleting,
                    has_finalizer: s.finalizers.iter().any(|f| f == FINALIZER),
                    service: Arc::new(s.clone()),
                };
                if self.services.get(&k) == Some(&entry) {
                    return Vec::new();
                }
                self.services.insert(k.clone(), entry);
                vec![Effect::Service(k)]
            }
            Some(Body::EndpointSlice(s)) => {
                let sk = (o.namespace.clone(), o.name.clone());
                if let Some((_, slices)) = &mut self.resync {
                    slices.insert(sk.clone());
                }
                let owner = key(&o.namespace, &s.service_name);
                let mut effects = Vec::new();
                if let Some((old_owner, old)) = self.slices.get(&sk) {
                    if *old_owner == owner && **old == *s {
                        return effects;
                    }
                    if *old_owner != owner {
                        // Relabelled to another Service: the old one loses it.
                        let old_owner = old_owner.clone();
                        self.remove_slice(&sk);
                        effects.push(Effect::Service(old_owner));
                    }
                }
                if !s.service_name.is_empty() {
                    self.by_service.entry(owner.clone()).or_default().insert(o.name.clone());
                    self.slices.insert(sk, (owner.clone(), Arc::new(s.clone())));
                    effects.push(Effect::Service(owner));
                }
                effects
            }
            _ => Vec::new(),
        }
    }

    fn deleted(&mut self, o: &Object) -> Vec<Effect> {
        match &o.body {
            Some(Body::Service(_)) => {
                let k = key(&o.namespace, &o.name);
                // A delete of an earlier object of the name (the watcher reports a re-used name
                // as a delete of the old uid, then the new object) must not drop the new one.
                if self.services.get(&k).is_some_and(|e| e.uid == o.uid) {
                    self.services.remove(&k);
                }
                vec![Effect::Service(k)]
            }
            Some(Body::EndpointSlice(_)) => {
                let sk = (o.namespace.clone(), o.name.clone());
                self.remove_slice(&sk).map(Effect::Service).into_iter().collect()
            }
            _ => Vec::new(),
        }
    }

    /// Removes a slice; returns the Service it belonged to.
    fn remove_slice(&mut self, sk: &SliceKey) -> Option<String> {
        let (owner, _) = self.slices.remove(sk)?;
        if let Some(names) = self.by_service.get_mut(&owner) {
            names.remove(&sk.1);
            if names.is_empty() {
                self.by_service.remove(&owner);
            }
        }
        Some(owner)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_proto::watcher::v1::{Endpoint, Kind};

    use super::*;

    fn ev(t: EventType, object: Option<Object>) -> SubscribeResponse {
        SubscribeResponse { resume_point: String::new(), r#type: t as i32, object }
    }

    fn svc(name: &str, uid: &str, finalizers: &[&str]) -> Object {
        Object {
            kind: Kind::Service as i32,
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
            body: Some(Body::Service(Service {
                r#type: "ClusterIP".into(),
                cluster_ips: vec!["10.96.0.1".into()],
                finalizers: finalizers.iter().map(ToString::to_string).collect(),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    fn slice(name: &str, service: &str, addr: &str) -> Object {
        Object {
            kind: Kind::EndpointSlice as i32,
            namespace: "ns".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            body: Some(Body::EndpointSlice(EndpointSlice {
                service_name: service.into(),
                address_type: "IPv4".into(),
                endpoints: vec![Endpoint { addresses: vec![addr.into()], ready: true, ..Default::default() }],
                ports: vec![],
            })),
            ..Default::default()
        }
    }

    fn services(effects: &[Effect]) -> Vec<&str> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Service(k) => Some(k.as_str()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn services_and_their_slices_queue_the_service() {
        let mut v = View::default();
        assert_eq!(services(&v.apply(&ev(EventType::Applied, Some(svc("web", "u1", &[]))))), ["ns/web"]);
        assert_eq!(services(&v.apply(&ev(EventType::Applied, Some(slice("web-a", "web", "10.1.0.1"))))), ["ns/web"]);
        assert_eq!(services(&v.apply(&ev(EventType::Applied, Some(slice("web-b", "web", "10.1.0.2"))))), ["ns/web"]);
        assert!(v.apply(&ev(EventType::Applied, Some(slice("web-b", "web", "10.1.0.2")))).is_empty(), "no change");
        assert_eq!(v.apply(&ev(EventType::SnapshotComplete, None)), [Effect::Live]);
        assert_eq!(v.slices("ns/web").len(), 2);
        assert!(!v.service("ns/web").unwrap().has_finalizer);
        v.apply(&ev(EventType::Applied, Some(svc("web", "u1", &[FINALIZER]))));
        assert!(v.service("ns/web").unwrap().has_finalizer);
        // Relabelled to another Service: both are queued.
        let moved = v.apply(&ev(EventType::Applied, Some(slice("web-b", "api", "10.1.0.2"))));
        assert_eq!(services(&moved), ["ns/web", "ns/api"]);
        assert_eq!((v.slices("ns/web").len(), v.slices("ns/api").len()), (1, 1));
        assert_eq!(services(&v.apply(&ev(EventType::Deleted, Some(slice("web-a", "web", ""))))), ["ns/web"]);
        assert!(v.slices("ns/web").is_empty());
        // A delete of an earlier uid of the name keeps the current Service.
        v.apply(&ev(EventType::Deleted, Some(svc("web", "u0", &[]))));
        assert_eq!(v.service("ns/web").unwrap().uid, "u1");
        v.apply(&ev(EventType::Deleted, Some(svc("web", "u1", &[]))));
        assert!(v.service("ns/web").is_none());
    }

    #[test]
    fn a_reset_snapshot_drops_what_it_does_not_name() {
        let mut v = View::default();
        for o in
            [svc("a", "ua", &[]), svc("b", "ub", &[]), slice("a-1", "a", "10.1.0.1"), slice("b-1", "b", "10.1.0.2")]
        {
            v.apply(&ev(EventType::Applied, Some(o)));
        }
        v.apply(&ev(EventType::SnapshotComplete, None));
        assert_eq!(v.apply(&ev(EventType::Reset, None)), [Effect::Resync]);
        v.apply(&ev(EventType::Applied, Some(svc("a", "ua", &[]))));
        v.apply(&ev(EventType::Applied, Some(slice("b-1", "b", "10.1.0.2"))));
        let effects = v.apply(&ev(EventType::SnapshotComplete, None));
        // b's Service and a's slice were deleted while disconnected.
        assert_eq!(services(&effects), ["ns/b", "ns/a"]);
        assert_eq!(effects.last(), Some(&Effect::Live));
        assert_eq!(v.keys(), ["ns/a"]);
        assert!(v.slices("ns/a").is_empty());
        assert_eq!(v.slices("ns/b").len(), 1, "a slice can outlive its Service");
    }
}
