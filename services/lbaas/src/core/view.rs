//! lbaas' view of Services and EndpointSlices, fed by the watcher's Subscribe stream as
//! [`Event`]s (the gRPC edge converts the stream's messages). Free of kube, tonic and protobuf.
//!
//! Keyed by `namespace/name` of the Service: a load balancer belongs to a Service name (its
//! record is named after the Service), and a Service deleted and re-created under the same name
//! is, to a dataplane, the same VIP with a new uid. Slices are grouped by the Service their
//! `kubernetes.io/service-name` label names.
//!
//! A snapshot (the first one, or one after a reset) is a re-list: when it is complete every
//! Service and slice it did not name is gone, so a deletion missed while disconnected still
//! removes the load balancer.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use crate::core::input::{EndpointSlice, Meta, Service};

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

/// One event of the watcher's stream, as far as the view is concerned.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A Service was created or changed (or listed by a snapshot).
    ServiceApplied(Meta, Box<Service>),
    /// A Service was deleted (of the uid in the [`Meta`]).
    ServiceDeleted(Meta),
    /// An EndpointSlice was created or changed (or listed by a snapshot).
    SliceApplied(Meta, EndpointSlice),
    /// An EndpointSlice was deleted.
    SliceDeleted(Meta),
    /// Forget nothing yet: a fresh snapshot follows, and what it does not name is gone.
    Reset,
    /// The snapshot is complete; deltas follow.
    SnapshotComplete,
}

/// What an event changed.
#[derive(Debug, PartialEq, Eq)]
pub enum Effect {
    /// Reconcile this Service key.
    Service(String),
    /// The snapshot is complete: the stream is live.
    Live,
    /// A reset: a new snapshot follows.
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

    /// Whether the Services held are the cluster's as of a complete snapshot: false before the
    /// first one has ended, and while a re-list is under way.
    pub fn settled(&self) -> bool {
        self.resync.is_none()
    }

    /// Whether the Service `key` of `uid` is held, not being deleted, and load-balanced
    /// ([`crate::core::spec::load_balanced`]).
    pub fn holds(&self, key: &str, uid: &str) -> bool {
        self.services
            .get(key)
            .is_some_and(|e| e.uid == uid && !e.deleting && crate::core::spec::load_balanced(&e.service))
    }

    /// Applies one event of the watcher's stream.
    pub fn apply(&mut self, ev: Event) -> Vec<Effect> {
        match ev {
            Event::Reset => {
                self.resync = Some(Default::default());
                vec![Effect::Resync]
            }
            Event::SnapshotComplete => {
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
            Event::ServiceApplied(o, s) => self.service_applied(o, *s),
            Event::SliceApplied(o, s) => self.slice_applied(o, s),
            Event::ServiceDeleted(o) => {
                let k = key(&o.namespace, &o.name);
                // A delete of an earlier object of the name (the watcher reports a re-used name
                // as a delete of the old uid, then the new object) must not drop the new one.
                if self.services.get(&k).is_some_and(|e| e.uid == o.uid) {
                    self.services.remove(&k);
                }
                vec![Effect::Service(k)]
            }
            Event::SliceDeleted(o) => {
                let sk = (o.namespace, o.name);
                self.remove_slice(&sk).map(Effect::Service).into_iter().collect()
            }
        }
    }

    fn service_applied(&mut self, o: Meta, s: Service) -> Vec<Effect> {
        let k = key(&o.namespace, &o.name);
        if let Some((services, _)) = &mut self.resync {
            services.insert(k.clone());
        }
        let has_finalizer = s.finalizers.iter().any(|f| f == FINALIZER);
        if self.services.get(&k).is_some_and(|cur| {
            cur.uid == o.uid && cur.deleting == o.deleting && cur.has_finalizer == has_finalizer && *cur.service == s
        }) {
            return Vec::new();
        }
        let entry = ServiceEntry { uid: o.uid, deleting: o.deleting, has_finalizer, service: Arc::new(s) };
        self.services.insert(k.clone(), entry);
        vec![Effect::Service(k)]
    }

    fn slice_applied(&mut self, o: Meta, s: EndpointSlice) -> Vec<Effect> {
        let owner = key(&o.namespace, &s.service_name);
        let sk = (o.namespace, o.name);
        if let Some((_, slices)) = &mut self.resync {
            slices.insert(sk.clone());
        }
        let mut effects = Vec::new();
        if let Some((old_owner, old)) = self.slices.get(&sk) {
            if *old_owner == owner && **old == s {
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
            self.by_service.entry(owner.clone()).or_default().insert(sk.1.clone());
            self.slices.insert(sk, (owner.clone(), Arc::new(s)));
            effects.push(Effect::Service(owner));
        }
        effects
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

    use crate::core::input::Endpoint;

    use super::*;

    fn meta(name: &str, uid: &str) -> Meta {
        Meta { namespace: "ns".into(), name: name.into(), uid: uid.into(), deleting: false }
    }

    fn svc(name: &str, uid: &str, finalizers: &[&str]) -> Event {
        let s = Service {
            r#type: "ClusterIP".into(),
            cluster_ips: vec!["10.96.0.1".into()],
            finalizers: finalizers.iter().map(ToString::to_string).collect(),
            ..Default::default()
        };
        Event::ServiceApplied(meta(name, uid), Box::new(s))
    }

    fn svc_gone(name: &str, uid: &str) -> Event {
        Event::ServiceDeleted(meta(name, uid))
    }

    fn slice(name: &str, service: &str, addr: &str) -> Event {
        let s = EndpointSlice {
            service_name: service.into(),
            address_type: "IPv4".into(),
            endpoints: vec![Endpoint { addresses: vec![addr.into()], ready: true, ..Default::default() }],
            ports: vec![],
        };
        Event::SliceApplied(meta(name, &format!("uid-{name}")), s)
    }

    fn slice_gone(name: &str) -> Event {
        Event::SliceDeleted(meta(name, &format!("uid-{name}")))
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
        assert_eq!(services(&v.apply(svc("web", "u1", &[]))), ["ns/web"]);
        assert_eq!(services(&v.apply(slice("web-a", "web", "10.1.0.1"))), ["ns/web"]);
        assert_eq!(services(&v.apply(slice("web-b", "web", "10.1.0.2"))), ["ns/web"]);
        assert!(v.apply(slice("web-b", "web", "10.1.0.2")).is_empty(), "no change");
        assert!(v.apply(svc("web", "u1", &[])).is_empty(), "no change");
        assert_eq!(v.apply(Event::SnapshotComplete), [Effect::Live]);
        assert_eq!(v.slices("ns/web").len(), 2);
        assert!(!v.service("ns/web").unwrap().has_finalizer);
        v.apply(svc("web", "u1", &[FINALIZER]));
        assert!(v.service("ns/web").unwrap().has_finalizer);
        // Relabelled to another Service: both are queued.
        let moved = v.apply(slice("web-b", "api", "10.1.0.2"));
        assert_eq!(services(&moved), ["ns/web", "ns/api"]);
        assert_eq!((v.slices("ns/web").len(), v.slices("ns/api").len()), (1, 1));
        assert_eq!(services(&v.apply(slice_gone("web-a"))), ["ns/web"]);
        assert!(v.slices("ns/web").is_empty());
        // A delete of an earlier uid of the name keeps the current Service.
        v.apply(svc_gone("web", "u0"));
        assert_eq!(v.service("ns/web").unwrap().uid, "u1");
        v.apply(svc_gone("web", "u1"));
        assert!(v.service("ns/web").is_none());
    }

    #[test]
    fn a_reset_snapshot_drops_what_it_does_not_name() {
        let mut v = View::default();
        for e in
            [svc("a", "ua", &[]), svc("b", "ub", &[]), slice("a-1", "a", "10.1.0.1"), slice("b-1", "b", "10.1.0.2")]
        {
            v.apply(e);
        }
        v.apply(Event::SnapshotComplete);
        assert_eq!(v.apply(Event::Reset), [Effect::Resync]);
        v.apply(svc("a", "ua", &[]));
        v.apply(slice("b-1", "b", "10.1.0.2"));
        let effects = v.apply(Event::SnapshotComplete);
        // b's Service and a's slice were deleted while disconnected.
        assert_eq!(services(&effects), ["ns/b", "ns/a"]);
        assert_eq!(effects.last(), Some(&Effect::Live));
        assert_eq!(v.keys(), ["ns/a"]);
        assert!(v.slices("ns/a").is_empty());
        assert_eq!(v.slices("ns/b").len(), 1, "a slice can outlive its Service");
    }

    #[test]
    fn a_service_holds_its_load_balancers_once_the_snapshot_is_complete() {
        let mut v = View::default();
        assert!(!v.settled(), "nothing known before the first snapshot ends");
        let headless = Service { r#type: "ClusterIP".into(), cluster_ips: vec!["None".into()], ..Default::default() };
        let alias = Service { r#type: "ExternalName".into(), ..Default::default() };
        v.apply(svc("a", "ua", &[]));
        v.apply(Event::ServiceApplied(meta("h", "uh"), Box::new(headless)));
        v.apply(Event::ServiceApplied(meta("x", "ux"), Box::new(alias)));
        v.apply(Event::SnapshotComplete);
        assert!(v.settled());
        assert!(v.holds("ns/a", "ua"));
        assert!(!v.holds("ns/a", "another uid"), "a Service of the name made again");
        assert!(!v.holds("ns/b", "ub"), "no such Service");
        assert!(!v.holds("ns/h", "uh"), "headless: no load balancer");
        assert!(!v.holds("ns/x", "ux"), "ExternalName: no load balancer");
        let Event::ServiceApplied(_, a) = svc("a", "ua", &[]) else { unreachable!() };
        v.apply(Event::ServiceApplied(Meta { deleting: true, ..meta("a", "ua") }, a));
        assert!(!v.holds("ns/a", "ua"), "being deleted");
        v.apply(Event::Reset);
        assert!(!v.settled(), "a re-list under way");
    }
}
