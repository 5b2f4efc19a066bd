//! The reconcile logic against an in-memory cluster and backend: the order of the steps, what a
//! second pass writes (nothing), cleanup, conflicts, failures and what users are told.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::*;
use crate::core::input::{Endpoint, EndpointPort, Meta, Service, ServicePort};
use crate::core::view::{Event, View};
use crate::k8s::ServiceMeta;

const KEY: &str = "ns/web";
const UID: &str = "svc-uid-1";

/// Makes the error of an injected failure from its description.
type Failure = fn(String) -> ClusterError;

#[derive(Debug, Default)]
struct ClusterState {
    services: HashMap<String, ServiceMeta>,
    records: HashMap<String, Record>,
    next_uid: u32,
    /// Every call, in order: "name key".
    calls: Vec<String>,
    /// Calls that fail, by name: how many more times, and how.
    fail: HashMap<&'static str, (u32, Failure)>,
    /// (key, warning, reason, note).
    events: Vec<(String, bool, String, String)>,
    ingress: HashMap<String, Vec<String>>,
}

#[derive(Clone, Debug, Default)]
struct FakeCluster(Arc<Mutex<ClusterState>>);

impl FakeCluster {
    fn s(&self) -> std::sync::MutexGuard<'_, ClusterState> {
        self.0.lock().unwrap()
    }

    fn call(&self, name: &'static str, key: &str) -> Result<(), ClusterError> {
        let mut s = self.s();
        s.calls.push(format!("{name} {key}"));
        match s.fail.get_mut(name) {
            Some((n, make)) if *n > 0 => {
                *n -= 1;
                Err(make(format!("{name} (injected)")))
            }
            _ => Ok(()),
        }
    }

    fn fail(&self, name: &'static str, times: u32, make: Failure) {
        self.s().fail.insert(name, (times, make));
    }

    fn calls(&self) -> Vec<String> {
        std::mem::take(&mut self.s().calls)
    }

    fn finalizers(&self, key: &str) -> Vec<String> {
        self.s().services.get(key).map(|m| m.finalizers.clone()).unwrap_or_default()
    }
}

impl Cluster for FakeCluster {
    async fn service(&self, key: &str) -> Result<Option<ServiceMeta>, ClusterError> {
        self.call("service", key)?;
        Ok(self.s().services.get(key).cloned())
    }

    async fn add_finalizer(&self, key: &str, uid: &str, current: &[String]) -> Result<(), ClusterError> {
        self.call("add_finalizer", key)?;
        let mut s = self.s();
        let meta = s.services.get_mut(key).ok_or_else(|| ClusterError::NotFound(key.into()))?;
        if meta.uid != uid || meta.finalizers != current {
            return Err(ClusterError::Conflict(format!("{key} changed")));
        }
        meta.finalizers.push(FINALIZER.into());
        Ok(())
    }

    async fn remove_finalizer(&self, key: &str, uid: &str, _current: &[String]) -> Result<(), ClusterError> {
        self.call("remove_finalizer", key)?;
        if let Some(meta) = self.s().services.get_mut(key).filter(|m| m.uid == uid) {
            meta.finalizers.retain(|f| f != FINALIZER);
        }
        Ok(())
    }

    async fn create_record(&self, key: &str, spec: &ServiceLoadBalancerSpec) -> Result<Record, ClusterError> {
        self.call("create_record", key)?;
        let mut s = self.s();
        if let Some(r) = s.records.get(key) {
            return Ok(r.clone());
        }
        s.next_uid += 1;
        let r = Record { uid: format!("rec-{}", s.next_uid), generation: 1, spec: spec.clone(), status: None };
        s.records.insert(key.into(), r.clone());
        Ok(r)
    }

    async fn replace_spec(&self, key: &str, uid: &str, spec: &ServiceLoadBalancerSpec) -> Result<Record, ClusterError> {
        self.call("replace_spec", key)?;
        let mut s = self.s();
        let r = s.records.get_mut(key).ok_or_else(|| ClusterError::NotFound(key.into()))?;
        if r.uid != uid {
            return Err(ClusterError::Conflict(format!("record {key} is another")));
        }
        if r.spec != *spec {
            r.spec = spec.clone();
            r.generation += 1;
        }
        Ok(r.clone())
    }

    async fn write_status(&self, key: &str, status: &ServiceLoadBalancerStatus) -> Result<(), ClusterError> {
        self.call("write_status", key)?;
        let mut s = self.s();
        let r = s.records.get_mut(key).ok_or_else(|| ClusterError::NotFound(key.into()))?;
        r.status = Some(status.clone());
        Ok(())
    }

    async fn set_ingress(&self, key: &str, _uid: &str, ips: &[String]) -> Result<(), ClusterError> {
        self.call("set_ingress", key)?;
        self.s().ingress.insert(key.into(), ips.to_vec());
        Ok(())
    }

    async fn delete_record(&self, key: &str, uid: &str) -> Result<(), ClusterError> {
        self.call("delete_record", key)?;
        let mut s = self.s();
        if s.records.get(key).is_some_and(|r| r.uid == uid) {
            s.records.remove(key);
        }
        Ok(())
    }

    async fn event(&self, key: &str, _uid: &str, warning: bool, reason: &str, _action: &str, note: &str) {
        self.s().events.push((key.into(), warning, reason.into(), note.into()));
    }
}

#[derive(Debug, Default)]
struct BackendState {
    /// "ensure key generation members" / "delete key".
    calls: Vec<String>,
    /// Fails the next ensure with this status seen.
    fail_with: Option<&'static str>,
    ingress_ip: String,
}

#[derive(Clone, Debug, Default)]
struct FakeBackend(Arc<Mutex<BackendState>>);

impl FakeBackend {
    fn s(&self) -> std::sync::MutexGuard<'_, BackendState> {
        self.0.lock().unwrap()
    }

    fn calls(&self) -> Vec<String> {
        std::mem::take(&mut self.s().calls)
    }
}

impl Backend for FakeBackend {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn recover(&self, _specs: Vec<(String, LoadBalancerSpec)>) {}

    async fn ensure(&self, key: &str, spec: &LoadBalancerSpec) -> Result<Observed, BackendError> {
        let mut s = self.s();
        s.calls.push(format!("ensure {key} gen={} members={}", spec.generation, spec.member_count()));
        if let Some(status) = s.fail_with.take() {
            return Err(BackendError {
                backend: "fake",
                reason: "error_state",
                message: format!("went {status}"),
                observed: Some(Observed {
                    provisioning_status: status.into(),
                    observed_generation: spec.generation,
                    backend_id: "lb-1".into(),
                    message: format!("went {status}"),
                    ..Default::default()
                }),
            });
        }
        Ok(Observed {
            provisioning_status: "ACTIVE".into(),
            observed_generation: spec.generation,
            backend_id: "lb-1".into(),
            ingress_ip: s.ingress_ip.clone(),
            message: String::new(),
        })
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        self.s().calls.push(format!("delete {key}"));
        Ok(())
    }
}

fn meta(name: &str, uid: &str, deleting: bool) -> Meta {
    Meta { namespace: "ns".into(), name: name.into(), uid: uid.into(), deleting }
}

fn service_object(kind: &str) -> Service {
    Service {
        r#type: kind.into(),
        cluster_ips: vec!["10.96.0.10".into()],
        ports: vec![ServicePort {
            name: "http".into(),
            protocol: "TCP".into(),
            port: 80,
            target_port: "8080".into(),
            node_port: if kind == "ClusterIP" { 0 } else { 30080 },
        }],
        ..Default::default()
    }
}

fn slice_object(addresses: &[&str]) -> EndpointSlice {
    EndpointSlice {
        service_name: "web".into(),
        address_type: "IPv4".into(),
        endpoints: addresses
            .iter()
            .map(|a| Endpoint { addresses: vec![(*a).into()], ready: true, ..Default::default() })
            .collect(),
        ports: vec![EndpointPort { name: "http".into(), protocol: "TCP".into(), port: 8080 }],
    }
}

struct Harness {
    c: Controller<FakeBackend, FakeCluster>,
    cluster: FakeCluster,
    backend: FakeBackend,
}

impl Harness {
    fn new(policy: FinalizerPolicy) -> Harness {
        let cluster = FakeCluster::default();
        let backend = FakeBackend::default();
        let view: SharedView = Arc::new(Mutex::new(View::default()));
        let c = Controller::new(cluster.clone(), backend.clone(), view, Records::default(), Metrics::default())
            .with_finalizers(policy);
        Harness { c, cluster, backend }
    }

    /// The Service as the watcher streams it, and as the API holds it.
    fn service(&self, kind: &str, deleting: bool) {
        let mut s = service_object(kind);
        let finalizers = self.cluster.finalizers(KEY);
        s.finalizers.clone_from(&finalizers);
        self.cluster.s().services.insert(KEY.into(), ServiceMeta { uid: UID.into(), finalizers, deleting });
        self.event(Event::ServiceApplied(meta("web", UID, deleting), Box::new(s)));
    }

    fn endpoints(&self, addresses: &[&str]) {
        self.event(Event::SliceApplied(meta("web-abc", "slice-uid", false), slice_object(addresses)));
    }

    fn service_gone(&self) {
        self.cluster.s().services.remove(KEY);
        self.event(Event::ServiceDeleted(meta("web", UID, false)));
    }

    fn event(&self, ev: Event) {
        locked(self.c.view()).apply(ev);
    }

    fn record(&self) -> Option<Record> {
        self.cluster.s().records.get(KEY).cloned()
    }
}

#[tokio::test]
async fn a_cluster_ip_service_gets_its_record_then_the_backend_then_the_status() {
    let h = Harness::new(FinalizerPolicy::LoadBalancer);
    h.service("ClusterIP", false);
    h.endpoints(&["10.1.0.5", "10.1.0.6"]);
    assert_eq!(h.c.reconcile(KEY).await.unwrap(), "applied");
    // No finalizer on a ClusterIP Service under the default policy; the record before the backend.
    assert_eq!(h.cluster.calls(), ["create_record ns/web", "write_status ns/web"]);
    assert_eq!(h.backend.calls(), ["ensure ns/web gen=1 members=2"]);
    let rec = h.record().unwrap();
    assert_eq!(rec.spec.vips, ["10.96.0.10"]);
    assert_eq!(rec.spec.backend, "fake");
    let status = rec.status.unwrap();
    assert_eq!(status.provisioning_status.as_deref(), Some("ACTIVE"));
    assert_eq!((status.observed_generation, status.backend_id.as_deref()), (Some(1), Some("lb-1")));
    assert!(h.cluster.finalizers(KEY).is_empty());

    // Nothing changed: the backend is asked again (it is idempotent), the API is not written.
    assert_eq!(h.c.reconcile(KEY).await.unwrap(), "applied");
    assert_eq!(h.cluster.calls(), Vec::<String>::new());
    assert_eq!(h.backend.calls(), ["ensure ns/web gen=1 members=2"]);

    // An endpoint goes: the spec is replaced, its generation is the one the backend programs.
    h.endpoints(&["10.1.0.5"]);
    h.c.reconcile(KEY).await.unwrap();
    assert_eq!(h.cluster.calls(), ["replace_spec ns/web", "write_status ns/web"]);
    assert_eq!(h.backend.calls(), ["ensure ns/web gen=2 members=1"]);
    assert_eq!(h.record().unwrap().status.unwrap().observed_generation, Some(2));
}

#[tokio::test]
async fn a_load_balancer_service_gets_the_finalizer_first_and_its_ingress_before_the_status() {
    let h = Harness::new(FinalizerPolicy::LoadBalancer);
    h.backend.s().ingress_ip = "172.24.4.10".into();
    h.service("LoadBalancer", false);
    h.endpoints(&["10.1.0.5"]);
    h.c.reconcile(KEY).await.unwrap();
    assert_eq!(
        h.cluster.calls(),
        ["service ns/web", "add_finalizer ns/web", "create_record ns/web", "set_ingress ns/web", "write_status ns/web"]
    );
    assert_eq!(h.cluster.finalizers(KEY), [FINALIZER]);
    assert_eq!(h.cluster.s().ingress[KEY], ["172.24.4.10"]);
    assert_eq!(h.record().unwrap().status.unwrap().ingress_ip.as_deref(), Some("172.24.4.10"));

    // Deleted by its user: the load balancer goes, then the record, then the finalizer.
    h.service("LoadBalancer", true);
    assert_eq!(h.c.reconcile(KEY).await.unwrap(), "deleted");
    assert_eq!(h.backend.calls(), ["ensure ns/web gen=1 members=1", "delete ns/web"]);
    assert_eq!(h.cluster.calls(), ["delete_record ns/web", "service ns/web", "remove_finalizer ns/web"]);
    assert!(h.record().is_none());
    assert!(h.cluster.finalizers(KEY).is_empty());
}

#[tokio::test]
async fn a_finalizer_conflict_is_read_again_at_once_and_fails_after_three() {
    let h = Harness::new(FinalizerPolicy::All);
    h.service("ClusterIP", false);
    h.cluster.fail("add_finalizer", 2, ClusterError::Conflict);
    h.c.reconcile(KEY).await.unwrap();
    assert_eq!(h.cluster.finalizers(KEY), [FINALIZER], "two conflicts, then added");
    let reads = h.cluster.calls().iter().filter(|c| c.starts_with("service ")).count();
    assert_eq!(reads, 3, "read again after each conflict");

    let h = Harness::new(FinalizerPolicy::All);
    h.service("ClusterIP", false);
    h.cluster.fail("add_finalizer", 3, ClusterError::Conflict);
    let e = h.c.reconcile(KEY).await.unwrap_err();
    assert_eq!((e.op, e.step, e.reason()), ("apply", "adding the finalizer", "conflict"));
    assert!(h.record().is_none(), "no record before the finalizer");
    assert!(h.backend.calls().is_empty(), "nothing programmed before the finalizer");
}

#[tokio::test]
async fn a_backend_failure_is_recorded_as_seen_and_told_as_a_warning() {
    let h = Harness::new(FinalizerPolicy::LoadBalancer);
    h.service("ClusterIP", false);
    h.endpoints(&["10.1.0.5"]);
    h.c.reconcile(KEY).await.unwrap();
    h.endpoints(&["10.1.0.5", "10.1.0.7"]);
    h.backend.s().fail_with = Some("ERROR");
    let e = h.c.reconcile(KEY).await.unwrap_err();
    assert_eq!((e.op, e.step, e.reason()), ("apply", "programming the backend", "error_state"));
    let status = h.record().unwrap().status.unwrap();
    assert_eq!(status.provisioning_status.as_deref(), Some("ERROR"), "what the backend saw is recorded");
    assert_eq!(status.observed_generation, Some(1), "the last converged generation stays");
    assert_eq!(status.message.as_deref(), Some("went ERROR"));

    h.c.report(&e).await;
    let events = h.cluster.s().events.clone();
    assert_eq!(events.len(), 1);
    let (key, warning, reason, note) = &events[0];
    assert_eq!((key.as_str(), *warning, reason.as_str()), (KEY, true, REASON_FAILED));
    assert!(note.contains("programming the backend") && note.contains("went ERROR"), "{note}");
    let failures =
        h.c.metrics.failures.get_or_create(&crate::metrics::FailureLabels { op: "apply", reason: "error_state" });
    assert_eq!(failures.get(), 1);

    // The retry converges.
    h.c.reconcile(KEY).await.unwrap();
    let status = h.record().unwrap().status.unwrap();
    assert_eq!((status.provisioning_status.as_deref(), status.observed_generation), (Some("ACTIVE"), Some(2)));
}

#[tokio::test]
async fn an_external_name_service_is_told_once_why_it_has_no_load_balancer() {
    let h = Harness::new(FinalizerPolicy::LoadBalancer);
    let mut s = service_object("ExternalName");
    s.cluster_ips.clear();
    s.external_name = "example.org".into();
    h.event(Event::ServiceApplied(meta("web", UID, false), Box::new(s)));
    assert_eq!(h.c.reconcile(KEY).await.unwrap(), "skipped");
    assert_eq!(h.c.reconcile(KEY).await.unwrap(), "skipped");
    let events = h.cluster.s().events.clone();
    assert_eq!(events.len(), 1, "told once: {events:?}");
    assert_eq!((events[0].1, events[0].2.as_str()), (false, REASON_SKIPPED));
    assert!(events[0].3.contains("ExternalName"));
    assert!(h.record().is_none());
    assert_eq!(h.backend.calls(), ["delete ns/web", "delete ns/web"], "cleanup tolerates nothing to remove");
}

#[tokio::test]
async fn a_record_deleted_behind_its_back_is_made_again() {
    let h = Harness::new(FinalizerPolicy::LoadBalancer);
    h.service("ClusterIP", false);
    h.endpoints(&["10.1.0.5"]);
    h.c.reconcile(KEY).await.unwrap();
    h.cluster.calls();
    // Someone deletes the record: the spec replacement finds it gone and creates it again.
    h.cluster.s().records.remove(KEY);
    h.endpoints(&["10.1.0.6"]);
    h.c.reconcile(KEY).await.unwrap();
    assert_eq!(h.cluster.calls(), ["replace_spec ns/web", "create_record ns/web", "write_status ns/web"]);
    let rec = h.record().unwrap();
    assert_eq!(rec.spec.listeners[0].members.len(), 1);
    assert_eq!(rec.status.unwrap().provisioning_status.as_deref(), Some("ACTIVE"));

    // Gone just before the status write: forgotten, so that the retry starts from the API.
    h.endpoints(&["10.1.0.7"]);
    h.cluster.fail("write_status", 1, ClusterError::NotFound);
    let e = h.c.reconcile(KEY).await.unwrap_err();
    assert_eq!((e.step, e.reason()), ("writing the status", "not_found"));
    assert!(!locked(h.c.records()).contains_key(KEY), "the cached record is forgotten");
    h.cluster.calls();
    h.c.reconcile(KEY).await.unwrap();
    assert_eq!(h.cluster.calls(), ["create_record ns/web", "write_status ns/web"]);
    assert_eq!(h.record().unwrap().status.unwrap().provisioning_status.as_deref(), Some("ACTIVE"));
}

#[tokio::test]
async fn a_service_gone_while_lbaas_was_away_leaves_nothing() {
    let h = Harness::new(FinalizerPolicy::LoadBalancer);
    h.service("ClusterIP", false);
    h.c.reconcile(KEY).await.unwrap();
    h.service_gone();
    h.cluster.calls();
    h.backend.calls();
    assert_eq!(h.c.reconcile(KEY).await.unwrap(), "deleted");
    assert_eq!(h.backend.calls(), ["delete ns/web"]);
    assert_eq!(h.cluster.calls(), ["delete_record ns/web"], "no Service to take a finalizer off");
    assert!(h.record().is_none());
    assert!(locked(h.c.records()).is_empty());
    // Again: nothing left to do, and nothing fails.
    assert_eq!(h.c.reconcile(KEY).await.unwrap(), "deleted");
    assert_eq!(h.cluster.calls(), Vec::<String>::new());
}

#[tokio::test]
async fn a_cleanup_failure_is_retried_and_the_finalizer_stays_until_it_succeeds() {
    let h = Harness::new(FinalizerPolicy::All);
    h.service("ClusterIP", false);
    h.c.reconcile(KEY).await.unwrap();
    h.service("ClusterIP", true);
    h.cluster.fail("delete_record", 1, |a| ClusterError::Api { action: a, source: "apiserver down".into() });
    let e = h.c.reconcile(KEY).await.unwrap_err();
    assert_eq!((e.op, e.step, e.reason()), ("cleanup", "deleting the record", "api"));
    assert_eq!(h.cluster.finalizers(KEY), [FINALIZER], "the finalizer outlives a failed cleanup");
    h.c.report(&e).await;
    assert_eq!(h.cluster.s().events.last().unwrap().2, REASON_CLEANUP_FAILED);
    assert_eq!(h.c.reconcile(KEY).await.unwrap(), "deleted");
    assert!(h.cluster.finalizers(KEY).is_empty());
    assert!(h.record().is_none());
}
