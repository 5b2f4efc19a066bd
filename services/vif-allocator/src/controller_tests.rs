//! The reconcile logic against an in-memory cluster: order of the steps, idempotency, cleanup of
//! what never was, failures, and plug reports.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kuryr_proto::allocator::v1::VifState as PbState;
use kuryr_proto::watcher::v1::object::Body;
use kuryr_proto::watcher::v1::{EventType, Kind, Object, Pod, SubscribeResponse};

use super::*;
use crate::backend::VifBackend;
use crate::cluster::{Ensured, PodMeta, Recorded};
use crate::core::{AttachedRecord, VifIp, VifRecord};
use crate::index::{Change, VifIndex};
use kuryr_stream::Epoch;

#[derive(Debug, Default)]
pub(crate) struct FakeState {
    /// uid → (pod, metadata).
    pods: HashMap<String, (PodKey, PodMeta)>,
    /// (namespace, name) → (pod uid, node, status).
    podvifs: HashMap<(String, String), (String, String, Recorded)>,
    /// (namespace, name) → the PodVif's version, bumped by every write.
    versions: HashMap<(String, String), u64>,
    /// Another allocator records this VIF in the pod's PodVif just before our next write.
    records_first: Option<(PodKey, u32)>,
    /// Another allocator creates the pod's PodVif with this VIF just before our create.
    creates_first: Option<(PodKey, u32)>,
    /// uid → address index.
    allocations: HashMap<String, u32>,
    /// Further allocations held by pods (another allocator's), uid → address indexes.
    also_held: HashMap<String, Vec<u32>>,
    next_address: u32,
    /// Every call, in order.
    calls: Vec<String>,
    /// Calls that fail, by name, and how many more times.
    fail: HashMap<&'static str, u32>,
    events: Vec<(String, &'static str)>,
    /// Behave like a backend whose plugged VIFs wait for confirmation (Neutron).
    confirmed_readiness: bool,
    /// watch_ready calls: (vif id, watch).
    watches: Vec<(String, bool)>,
    /// uid → the further networks it holds (`attach`: the annotation's names; "bad" fails).
    attached: HashMap<String, Vec<String>>,
    /// network-status annotations written.
    statuses: Vec<String>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Fake(Arc<Mutex<FakeState>>);

impl Fake {
    pub(crate) fn s(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.0.lock().unwrap()
    }

    fn call(&self, name: &'static str, pod: &PodKey) -> Result<(), ClusterError> {
        let mut s = self.s();
        s.calls.push(format!("{name} {}", pod.name));
        match s.fail.get_mut(name) {
            Some(n) if *n > 0 => {
                *n -= 1;
                Err(ClusterError::Api { action: format!("{name} (injected)"), source: "boom".into() })
            }
            _ => Ok(()),
        }
    }

    fn calls(&self) -> Vec<String> {
        std::mem::take(&mut self.s().calls)
    }

    /// Puts a PodVif for pod `name` in namespace `ns` on node `n1`, owned by `uid`, recording `vif`.
    fn put_podvif(&self, name: &str, uid: &str, vif: Option<(VifRecord, VifState)>) {
        self.s().podvifs.insert(("ns".into(), name.into()), (uid.into(), "n1".into(), vif));
    }

    /// What the PodVif of pod `name` in namespace `ns` records.
    fn recorded(&self, name: &str) -> Option<(VifRecord, VifState)> {
        self.s().podvifs[&("ns".to_string(), name.to_string())].2.clone()
    }

    pub(crate) fn add_pod(&self, key: &PodKey) {
        self.s().pods.insert(key.uid.clone(), (key.clone(), PodMeta::default()));
    }

    fn meta(&self, uid: &str) -> Option<PodMeta> {
        self.s().pods.get(uid).map(|p| p.1.clone())
    }
}

fn record(i: u32) -> VifRecord {
    VifRecord {
        vif_id: format!("net/10.0.0.{i}"),
        mac: format!("0a:58:0a:00:00:{i:02x}"),
        mtu: 1500,
        ips: vec![VifIp { address: format!("10.0.0.{i}/24"), gateway: Some("10.0.0.1".into()) }],
        routes: Vec::new(),
        bridge: "kuryr0".into(),
        ..VifRecord::default()
    }
}

impl Cluster for Fake {
    type Backend = Fake;

    fn backend(&self) -> &Fake {
        self
    }

    async fn pod(&self, pod: &PodKey) -> Result<Option<PodMeta>, ClusterError> {
        self.call("pod", pod)?;
        Ok(self.meta(&pod.uid))
    }
    async fn add_finalizer(&self, pod: &PodKey, current: &[String]) -> Result<(), ClusterError> {
        self.call("add_finalizer", pod)?;
        let mut s = self.s();
        if let Some(n) = s.fail.get_mut("finalizer_conflict").filter(|n| **n > 0) {
            *n -= 1;
            return Err(ClusterError::Conflict("another writer".into()));
        }
        let (_, meta) = s.pods.get_mut(&pod.uid).ok_or_else(|| ClusterError::NotFound("pod".into()))?;
        if meta.finalizers != current {
            return Err(ClusterError::Conflict("finalizers changed".into()));
        }
        if meta.deleting {
            // As the API server answers (403).
            let source = "no new finalizers can be added if the object is being deleted".into();
            return Err(ClusterError::Api { action: "adding the finalizer".into(), source });
        }
        meta.finalizers.push(FINALIZER.into());
        Ok(())
    }
    async fn remove_finalizer(&self, pod: &PodKey, _: &[String]) -> Result<(), ClusterError> {
        self.call("remove_finalizer", pod)?;
        let mut s = self.s();
        let deleting = match s.pods.get_mut(&pod.uid) {
            Some((_, meta)) => {
                meta.finalizers.retain(|f| f != FINALIZER);
                meta.deleting && meta.finalizers.is_empty()
            }
            None => false,
        };
        if deleting {
            s.pods.remove(&pod.uid);
        }
        Ok(())
    }
    async fn ensure_pod_vif(&self, pod: &PodKey, node: &str, vif: &VifRecord) -> Result<Ensured, ClusterError> {
        self.call("ensure_pod_vif", pod)?;
        let mut s = self.s();
        let name = (pod.namespace.clone(), pod.name.clone());
        if let Some((other, i)) = s.creates_first.take_if(|(k, _)| *k == *pod) {
            s.also_held.entry(other.uid.clone()).or_default().push(i);
            let theirs = (other.uid.clone(), node.to_string(), Some((self::record(i), VifState::Allocated)));
            s.podvifs.insert(name.clone(), theirs);
            *s.versions.entry(name.clone()).or_default() += 1;
        }
        let version = s.versions.get(&name).copied().unwrap_or_default().to_string();
        match s.podvifs.get(&name) {
            Some((uid, _, recorded)) if *uid == pod.uid => {
                let status_set = recorded.as_ref().is_some_and(|(_, st)| *st != VifState::Allocated);
                Ok(Ensured { recorded: recorded.clone(), version, uid: format!("podvif-{}", pod.uid), status_set })
            }
            Some((uid, node, _)) => Err(ClusterError::StalePodVif {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                other_uid: uid.clone(),
                node: node.clone(),
            }),
            None => {
                let recorded = Some((vif.clone(), VifState::Allocated));
                s.podvifs.insert(name, (pod.uid.clone(), node.to_string(), recorded.clone()));
                Ok(Ensured { recorded, version, uid: format!("podvif-{}", pod.uid), status_set: false })
            }
        }
    }
    async fn record_vif(&self, pod: &PodKey, record: &VifRecord, found: &Ensured) -> Result<(), ClusterError> {
        self.call("record_vif", pod)?;
        let version = found.version.as_str();
        let mut s = self.s();
        let name = (pod.namespace.clone(), pod.name.clone());
        if let Some((other, i)) = s.records_first.take_if(|(k, _)| *k == *pod) {
            s.also_held.entry(other.uid.clone()).or_default().push(i);
            s.podvifs.get_mut(&name).unwrap().2 = Some((self::record(i), VifState::Allocated));
            *s.versions.entry(name.clone()).or_default() += 1;
        }
        let current = s.versions.get(&name).copied().unwrap_or_default();
        if version != current.to_string() {
            return Err(ClusterError::Conflict(format!("PodVif at version {current}, not {version}")));
        }
        let (_, _, status) = s.podvifs.get_mut(&name).ok_or_else(|| ClusterError::NotFound("podvif".into()))?;
        *status = Some((record.clone(), VifState::Allocated));
        *s.versions.entry(name).or_default() += 1;
        Ok(())
    }
    async fn record_state(&self, pod: &PodKey, vif_id: &str, state: VifState) -> Result<(), ClusterError> {
        self.call("record_state", pod)?;
        let mut s = self.s();
        let Some((_, _, Some((r, st)))) = s.podvifs.get_mut(&(pod.namespace.clone(), pod.name.clone())) else {
            return Err(ClusterError::NotFound("podvif".into()));
        };
        if r.vif_id != vif_id {
            return Err(ClusterError::Conflict("another VIF".into()));
        }
        *st = state;
        *s.versions.entry((pod.namespace.clone(), pod.name.clone())).or_default() += 1;
        Ok(())
    }
    async fn delete_pod_vif(&self, pod: &PodKey, known: Option<&str>) -> Result<(), ClusterError> {
        self.call(if known.is_some() { "delete_pod_vif" } else { "delete_pod_vif (read)" }, pod)?;
        let mut s = self.s();
        let name = (pod.namespace.clone(), pod.name.clone());
        if s.podvifs.get(&name).is_some_and(|p| p.0 == pod.uid) {
            s.podvifs.remove(&name);
        }
        Ok(())
    }
    async fn warn(&self, pod: &PodKey, reason: &'static str, _note: String) {
        self.s().events.push((pod.uid.clone(), reason));
    }
    async fn attach(&self, pod: &PodKey, _node: &str, networks: &str) -> Result<Vec<AttachedRecord>, ClusterError> {
        self.call("attach", pod)?;
        let names: Vec<String> = networks.split(',').map(|n| n.trim().to_string()).collect();
        if names.iter().any(|n| n == "bad") {
            return Err(ClusterError::Attachment("NetworkAttachmentDefinition ns/bad does not exist".into()));
        }
        self.s().attached.insert(pod.uid.clone(), names.clone());
        Ok(names
            .iter()
            .enumerate()
            .map(|(i, n)| AttachedRecord {
                attachment: format!("ns/{n}"),
                ifname: format!("net{}", i + 1),
                network: n.clone(),
                vif_id: format!("{n}/10.9.{i}.2"),
                ips: vec![VifIp { address: format!("10.9.{i}.2/24"), gateway: Some(format!("10.9.{i}.1")) }],
                bridge: format!("br-{n}"),
                ..AttachedRecord::default()
            })
            .collect())
    }
    async fn detach(&self, pod: &PodKey, _node: &str, networks: &[String]) -> Result<(), ClusterError> {
        self.call("detach", pod)?;
        if let Some(held) = self.s().attached.get_mut(&pod.uid) {
            held.retain(|n| !networks.contains(n));
        }
        Ok(())
    }
    async fn attached_networks(&self, _pod: &PodKey, networks: &str) -> Vec<String> {
        networks.split(',').map(|n| n.trim().to_string()).filter(|n| n != "bad").collect()
    }
    async fn network_status(&self, pod: &PodKey, value: &str) -> Result<(), ClusterError> {
        self.call("network_status", pod)?;
        self.s().statuses.push(value.to_string());
        Ok(())
    }
}

/// The fake is its own backend: one call log, in order, for both.
impl VifBackend for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }
    async fn allocate(&self, pod: &PodKey, _node: &str) -> Result<VifRecord, ClusterError> {
        self.call("allocate", pod)?;
        let mut s = self.s();
        if let Some(i) = s.allocations.get(&pod.uid) {
            return Ok(record(*i));
        }
        s.next_address += 1;
        let i = s.next_address + 1;
        s.allocations.insert(pod.uid.clone(), i);
        Ok(record(i))
    }
    async fn release(&self, pod: &PodKey, _node: &str) -> Result<bool, ClusterError> {
        self.call("release", pod)?;
        let mut s = self.s();
        let also = s.also_held.remove(&pod.uid).is_some_and(|v| !v.is_empty());
        Ok(s.allocations.remove(&pod.uid).is_some() || also)
    }
    async fn holds(&self, pod: &PodKey, _node: &str, r: &VifRecord) -> Result<bool, ClusterError> {
        self.call("holds", pod)?;
        let s = self.s();
        let held = s.allocations.get(&pod.uid).into_iter().chain(s.also_held.get(&pod.uid).into_iter().flatten());
        Ok(held.map(|i| record(*i)).any(|h| h == *r))
    }
    async fn discard(&self, pod: &PodKey, _node: &str, ours: &VifRecord, keep: &VifRecord) -> Result<(), ClusterError> {
        self.call("discard", pod)?;
        let mut s = self.s();
        // What the backend does: ours goes; the pod's allocation is the one kept from now on.
        if ours != keep && s.allocations.get(&pod.uid).is_some_and(|i| record(*i) == *ours) {
            s.allocations.remove(&pod.uid);
            let kept = s.also_held.get_mut(&pod.uid).and_then(|v| {
                let at = v.iter().position(|i| record(*i) == *keep)?;
                Some(v.remove(at))
            });
            if let Some(i) = kept {
                s.allocations.insert(pod.uid.clone(), i);
            }
        }
        Ok(())
    }
    fn ready_when_plugged(&self) -> bool {
        !self.s().confirmed_readiness
    }
    fn watch_ready(&self, _pod_uid: &str, vif_id: &str, watch: bool) {
        self.s().watches.push((vif_id.to_string(), watch));
    }
}

pub(crate) struct Setup {
    pub(crate) fake: Fake,
    pub(crate) ctl: Arc<Controller<Fake>>,
    pub(crate) index: SharedIndex,
    pub(crate) metrics: Metrics,
}

pub(crate) fn setup() -> Setup {
    let fake = Fake::default();
    let mut idx = VifIndex::new(Epoch::fixed("e"), 64);
    idx.set_ready();
    let index = idx.shared();
    let metrics = Metrics::default();
    let queue = Arc::new(WorkQueue::new(Duration::from_millis(100), Duration::from_secs(1)));
    let view = SharedView::default();
    let ctl = Arc::new(Controller::new(fake.clone(), "net", view, index.clone(), queue, metrics.clone()));
    Setup { fake, ctl, index, metrics }
}

pub(crate) fn key(name: &str) -> PodKey {
    PodKey::new("ns", name, format!("uid-{name}"))
}

/// Feeds the view a pod event as the watcher would send it.
pub(crate) fn see(ctl: &Controller<Fake>, fake: &Fake, name: &str, node: &str, phase: &str, t: EventType) {
    see_pod(ctl, fake, name, Pod { node_name: node.into(), phase: phase.into(), ..Default::default() }, t);
}

/// Feeds the view an event of pod `name` whose body is `pod`, with the fake's finalizers and
/// deletion mark.
fn see_pod(ctl: &Controller<Fake>, fake: &Fake, name: &str, pod: Pod, t: EventType) {
    let k = key(name);
    let meta = fake.meta(&k.uid).unwrap_or_default();
    let obj = Object {
        kind: Kind::Pod as i32,
        namespace: k.namespace.clone(),
        name: k.name.clone(),
        uid: k.uid.clone(),
        deleting: meta.deleting,
        body: Some(Body::Pod(Pod { finalizers: meta.finalizers, ..pod })),
        ..Default::default()
    };
    let ev = SubscribeResponse { resume_point: String::new(), r#type: t as i32, object: Some(obj) };
    let ev = crate::grpc::follow::watched(&ev).unwrap();
    view_lock(ctl.view()).apply(&ev, Instant::now());
}

/// A VIF of the index as binders receive it.
fn streamed(v: &Vif) -> kuryr_proto::allocator::v1::Vif {
    crate::grpc::convert::vif_to_proto(v)
}

fn deltas(index: &SharedIndex) -> Vec<String> {
    lock(index)
        .since(0, 1000)
        .unwrap()
        .iter()
        .map(|d| match Change::of(&d.change) {
            Change::VifApplied(v) => format!("+{} {:?}", v.pod.name, v.state),
            Change::VifDeleted(v) => format!("-{}", v.pod.name),
            other => format!("{other:?}"),
        })
        .collect()
}

#[tokio::test]
async fn apply_puts_the_finalizer_first_and_publishes_only_what_is_recorded() {
    let Setup { fake, ctl, index, metrics } = setup();
    fake.add_pod(&key("a"));
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(
        fake.calls(),
        ["add_finalizer a", "allocate a", "ensure_pod_vif a"],
        "finalizer first (no read: the pod had none), then the addresses, then the PodVif created with \
         them (no status write), all before the VIF is streamed"
    );
    let recorded = fake.recorded("a");
    assert_eq!(recorded, Some((record(2), VifState::Allocated)), "the create recorded the VIF");
    assert_eq!(fake.meta("uid-a").unwrap().finalizers, [FINALIZER]);
    let vif = streamed(&ctl.get_vif("uid-a").unwrap());
    assert_eq!(
        (vif.state(), vif.ips[0].address.as_str(), vif.pod.as_ref().unwrap().node_name.as_str()),
        (PbState::Allocated, "10.0.0.2/24", "n1")
    );
    assert_eq!(vif.binding.as_ref().unwrap().bridge, "kuryr0");
    assert_eq!(deltas(&index), ["+a Allocated"]);
    assert_eq!(metrics.allocations.get(), 1);

    // The watcher reports the finalizer: nothing more to do, no API call.
    see(&ctl, &fake, "a", "n1", "Running", EventType::Applied);
    ctl.reconcile("uid-a").await.unwrap();
    assert!(fake.calls().is_empty());

    // Unscheduled pods get nothing and cost nothing.
    fake.add_pod(&key("u"));
    see(&ctl, &fake, "u", "", "Pending", EventType::Applied);
    ctl.reconcile("uid-u").await.unwrap();
    assert!(fake.calls().is_empty());
    assert!(ctl.get_vif("uid-u").is_none());
}

#[tokio::test]
async fn a_finalizer_conflict_is_settled_by_reading_again_at_once() {
    let Setup { fake, ctl, .. } = setup();
    fake.add_pod(&key("a"));
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    fake.s().fail.insert("finalizer_conflict", 1);
    ctl.reconcile("uid-a").await.unwrap();
    let calls = fake.calls();
    assert_eq!(calls[..3], ["add_finalizer a", "pod a", "add_finalizer a"]);
    // Conflicts without end are a failure, retried by the queue.
    fake.add_pod(&key("b"));
    see(&ctl, &fake, "b", "n1", "Pending", EventType::Applied);
    fake.s().fail.insert("finalizer_conflict", 100);
    let err = ctl.reconcile("uid-b").await.unwrap_err();
    assert_eq!((err.step, err.source.reason()), ("adding the finalizer", "conflict"));
}

#[tokio::test]
async fn no_finalizer_is_added_to_a_pod_the_api_is_deleting() {
    let Setup { fake, ctl, index, .. } = setup();
    fake.add_pod(&key("a"));
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    // Deleted in the API before the watcher said so: the blind attempt is refused, the read
    // sees the deletion, and nothing is allocated (the next event runs the cleanup).
    fake.s().pods.get_mut("uid-a").unwrap().1.deleting = true;
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(fake.calls(), ["add_finalizer a", "pod a"]);
    assert!(fake.meta("uid-a").unwrap().finalizers.is_empty());
    assert!(ctl.get_vif("uid-a").is_none() && deltas(&index).is_empty());
}

#[tokio::test]
async fn a_failed_record_hands_nothing_out_and_a_retry_finishes_the_job() {
    let Setup { fake, ctl, index, .. } = setup();
    fake.add_pod(&key("a"));
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    fake.s().fail.insert("ensure_pod_vif", 1);
    let err = ctl.reconcile("uid-a").await.unwrap_err();
    assert_eq!((err.op, err.step, err.source.reason()), ("apply", "creating the PodVif", "api"));
    assert!(ctl.get_vif("uid-a").is_none(), "a VIF was streamed before it was recorded");
    assert!(deltas(&index).is_empty());
    assert!(fake.s().allocations.contains_key("uid-a"), "held under the finalizer until the retry");
    fake.calls();
    ctl.reconcile("uid-a").await.unwrap();
    // The finalizer is there now (the blind attempt fails its precondition, the read finds
    // it: not added twice); same address.
    assert_eq!(fake.calls(), ["add_finalizer a", "pod a", "allocate a", "ensure_pod_vif a"]);
    assert_eq!(fake.meta("uid-a").unwrap().finalizers, [FINALIZER]);
    assert_eq!(streamed(&ctl.get_vif("uid-a").unwrap()).ips[0].address, "10.0.0.2/24");
}

#[tokio::test]
async fn deletion_streams_then_releases_then_deletes_then_unblocks_the_pod() {
    let Setup { fake, ctl, index, metrics } = setup();
    fake.add_pod(&key("a"));
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    ctl.reconcile("uid-a").await.unwrap();
    fake.calls();
    fake.s().pods.get_mut("uid-a").unwrap().1.deleting = true;
    see(&ctl, &fake, "a", "n1", "Running", EventType::Applied);
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(fake.calls(), ["release a", "delete_pod_vif a", "remove_finalizer a"]);
    assert_eq!(deltas(&index), ["+a Allocated", "-a"]);
    assert!(fake.meta("uid-a").is_none(), "the pod, unblocked, is gone");
    assert!(fake.s().podvifs.is_empty() && fake.s().allocations.is_empty());
    assert_eq!(metrics.releases.get(), 1);

    // The DELETED event: nothing left to do; the tombstone is forgotten.
    see(&ctl, &fake, "a", "n1", "Running", EventType::Deleted);
    ctl.reconcile("uid-a").await.unwrap();
    assert!(fake.calls().is_empty());
    assert!(view_lock(ctl.view()).get("uid-a").is_none());
}

#[tokio::test]
async fn cleanup_tolerates_what_never_happened() {
    let Setup { fake, ctl, .. } = setup();
    // Finalizer added, then the allocator died before the PodVif: the pod is deleted.
    fake.add_pod(&key("a"));
    {
        let mut s = fake.s();
        let meta = &mut s.pods.get_mut("uid-a").unwrap().1;
        meta.finalizers = vec![FINALIZER.into()];
        meta.deleting = true;
    }
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    ctl.reconcile("uid-a").await.unwrap();
    // Nothing known of its PodVif here: read before the delete; the finalizer was in the view.
    assert_eq!(fake.calls(), ["release a", "delete_pod_vif (read) a", "remove_finalizer a"]);
    // A finished pod gets its VIF released and its finalizer removed, and stays.
    fake.add_pod(&key("b"));
    see(&ctl, &fake, "b", "n1", "Running", EventType::Applied);
    ctl.reconcile("uid-b").await.unwrap();
    see(&ctl, &fake, "b", "n1", "Running", EventType::Applied);
    see(&ctl, &fake, "b", "n1", "Succeeded", EventType::Applied);
    fake.calls();
    ctl.reconcile("uid-b").await.unwrap();
    assert_eq!(fake.calls(), ["release b", "delete_pod_vif b", "remove_finalizer b"]);
    assert!(fake.meta("uid-b").unwrap().finalizers.is_empty());
    assert!(ctl.get_vif("uid-b").is_none());
}

#[tokio::test]
async fn a_stale_pod_vif_of_the_same_name_is_cleaned_first() {
    let Setup { fake, ctl, .. } = setup();
    fake.put_podvif("a", "uid-old", Some((record(9), VifState::Ready)));
    fake.s().allocations.insert("uid-old".into(), 9);
    fake.add_pod(&key("a"));
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    let err = ctl.reconcile("uid-a").await.unwrap_err();
    assert_eq!(err.source.reason(), "stale_podvif");
    // The earlier pod is a tombstone now; its cleanup releases it and deletes its PodVif.
    ctl.reconcile("uid-old").await.unwrap();
    assert!(fake.s().podvifs.is_empty());
    assert!(!fake.s().allocations.contains_key("uid-old"));
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(streamed(&ctl.get_vif("uid-a").unwrap()).state(), PbState::Allocated);
}

#[tokio::test]
async fn a_recorded_state_survives_a_re_apply() {
    let Setup { fake, ctl, .. } = setup();
    let mut meta = PodMeta::default();
    meta.finalizers.push(FINALIZER.into());
    fake.s().pods.insert("uid-a".into(), (key("a"), meta));
    fake.put_podvif("a", "uid-a", Some((record(2), VifState::Ready)));
    fake.s().allocations.insert("uid-a".into(), 2);
    see(&ctl, &fake, "a", "n1", "Running", EventType::Applied);
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(fake.calls(), ["allocate a", "ensure_pod_vif a"], "nothing to write");
    assert_eq!(streamed(&ctl.get_vif("uid-a").unwrap()).state(), PbState::Ready);
}

/// A pod with our finalizer, seen scheduled on n1.
fn scheduled(fake: &Fake, ctl: &Controller<Fake>, name: &str) {
    let mut meta = PodMeta::default();
    meta.finalizers.push(FINALIZER.into());
    fake.s().pods.insert(key(name).uid, (key(name), meta));
    see(ctl, fake, name, "n1", "Pending", EventType::Applied);
}

#[tokio::test]
async fn the_vif_on_record_wins_over_a_racing_allocation_which_is_given_back() {
    let Setup { fake, ctl, metrics, .. } = setup();
    scheduled(&fake, &ctl, "a");
    // Another allocator recorded its VIF (7) while ours (2) was being allocated.
    fake.put_podvif("a", "uid-a", Some((record(7), VifState::Plugged)));
    fake.s().also_held.insert("uid-a".into(), vec![7]);
    fake.s().allocations.insert("uid-a".into(), 2);
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(fake.calls(), ["allocate a", "ensure_pod_vif a", "holds a", "discard a"], "no write over the record");
    let vif = streamed(&ctl.get_vif("uid-a").unwrap());
    assert_eq!((vif.vif_id.as_str(), vif.state()), ("net/10.0.0.7", PbState::Plugged));
    assert_eq!(fake.s().allocations["uid-a"], 7, "ours given back, the recorded one kept");
    assert!(fake.s().also_held["uid-a"].is_empty());
    assert_eq!(metrics.lost_races.get(), 1);
}

#[tokio::test]
async fn a_vif_on_record_the_backend_no_longer_holds_is_replaced() {
    let Setup { fake, ctl, metrics, .. } = setup();
    scheduled(&fake, &ctl, "a");
    fake.put_podvif("a", "uid-a", Some((record(7), VifState::Ready)));
    fake.s().allocations.insert("uid-a".into(), 2);
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(fake.calls(), ["allocate a", "ensure_pod_vif a", "holds a", "record_vif a"]);
    let recorded = fake.recorded("a");
    assert_eq!(recorded, Some((record(2), VifState::Allocated)));
    assert_eq!(streamed(&ctl.get_vif("uid-a").unwrap()).vif_id, "net/10.0.0.2");
    assert_eq!(metrics.lost_races.get(), 0);
}

#[tokio::test]
async fn the_same_allocation_with_other_details_is_recorded_anew_without_a_race() {
    let Setup { fake, ctl, metrics, .. } = setup();
    scheduled(&fake, &ctl, "a");
    let mut old = record(2);
    old.mtu = 9000;
    fake.put_podvif("a", "uid-a", Some((old, VifState::Ready)));
    fake.s().allocations.insert("uid-a".into(), 2);
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(fake.calls(), ["allocate a", "ensure_pod_vif a", "record_vif a"], "no race to settle");
    let recorded = fake.recorded("a");
    assert_eq!(recorded, Some((record(2), VifState::Allocated)));
    assert_eq!(metrics.lost_races.get(), 0);
}

#[tokio::test]
async fn of_two_allocators_racing_for_a_pod_exactly_one_creates_and_the_other_follows() {
    let Setup { fake, ctl, metrics, .. } = setup();
    scheduled(&fake, &ctl, "a");
    // The other allocator creates the PodVif with its VIF 7 just before our create.
    fake.s().creates_first = Some((key("a"), 7));
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(fake.calls(), ["allocate a", "ensure_pod_vif a", "holds a", "discard a"], "no write over theirs");
    let recorded = fake.recorded("a");
    assert_eq!(recorded, Some((record(7), VifState::Allocated)), "their record stands");
    assert_eq!(streamed(&ctl.get_vif("uid-a").unwrap()).vif_id, "net/10.0.0.7");
    assert_eq!(fake.s().allocations["uid-a"], 7, "ours given back");
    assert_eq!(metrics.lost_races.get(), 1);
}

#[tokio::test]
async fn of_two_allocators_replacing_a_record_exactly_one_writes_and_the_other_follows() {
    let Setup { fake, ctl, metrics, .. } = setup();
    scheduled(&fake, &ctl, "a");
    // A record the backend no longer holds, READY: both replace it; the other one writes VIF 7
    // between our read of the PodVif and our write.
    fake.put_podvif("a", "uid-a", Some((record(9), VifState::Ready)));
    fake.s().records_first = Some((key("a"), 7));
    let err = ctl.reconcile("uid-a").await.unwrap_err();
    assert_eq!(err.source.reason(), "conflict", "{err}");
    assert!(ctl.get_vif("uid-a").is_none(), "nothing published from a lost write");
    let recorded = fake.recorded("a");
    assert_eq!(recorded, Some((record(7), VifState::Allocated)), "their record stands");
    fake.calls();
    // Retried: the record is kept and our allocation given back.
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(fake.calls(), ["allocate a", "ensure_pod_vif a", "holds a", "discard a"]);
    assert_eq!(streamed(&ctl.get_vif("uid-a").unwrap()).vif_id, "net/10.0.0.7");
    assert_eq!(fake.s().allocations["uid-a"], 7);
    assert_eq!(metrics.lost_races.get(), 1);
}

#[tokio::test]
async fn plug_reports_are_checked_persisted_then_streamed() {
    let Setup { fake, ctl, index, .. } = setup();
    let err = ctl.report_plugged("uid-a", "x", "n1", true).await.unwrap_err();
    assert!(matches!(err, PlugError::NotFound(_)), "{err:?}");
    fake.add_pod(&key("a"));
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    ctl.reconcile("uid-a").await.unwrap();
    let id = streamed(&ctl.get_vif("uid-a").unwrap()).vif_id.clone();
    let err = ctl.report_plugged("uid-a", "net/other", "n1", true).await.unwrap_err();
    assert!(matches!(err, PlugError::FailedPrecondition(_)), "{err:?}");
    let err = ctl.report_plugged("uid-a", &id, "n2", true).await.unwrap_err();
    assert!(matches!(err, PlugError::FailedPrecondition(_)), "{err:?}");
    fake.s().fail.insert("record_state", 1);
    let err = ctl.report_plugged("uid-a", &id, "n1", true).await.unwrap_err();
    assert!(matches!(err, PlugError::Unavailable(_)), "{err:?}");
    assert_eq!(streamed(&ctl.get_vif("uid-a").unwrap()).state(), PbState::Allocated, "streamed before it was recorded");

    let v = streamed(&ctl.report_plugged("uid-a", &id, "n1", true).await.unwrap());
    assert_eq!(v.state(), PbState::Ready);
    assert_eq!(fake.recorded("a").unwrap().1, VifState::Ready);
    // Again: nothing to do.
    fake.calls();
    streamed(&ctl.report_plugged("uid-a", &id, "n1", true).await.unwrap());
    assert!(fake.calls().is_empty());
    // Unplugged: back to ALLOCATED, addresses kept.
    let v = streamed(&ctl.report_plugged("uid-a", &id, "n1", false).await.unwrap());
    assert_eq!(v.state(), PbState::Allocated);
    assert!(fake.s().allocations.contains_key("uid-a"));
    assert_eq!(deltas(&index), ["+a Allocated", "+a Ready", "+a Allocated"]);
}

#[tokio::test]
async fn with_confirmed_readiness_a_plugged_vif_waits_for_the_backend() {
    let Setup { fake, ctl, index, .. } = setup();
    fake.s().confirmed_readiness = true;
    fake.add_pod(&key("a"));
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    ctl.reconcile("uid-a").await.unwrap();
    let id = streamed(&ctl.get_vif("uid-a").unwrap()).vif_id.clone();
    assert!(!ctl.mark_ready("uid-a", &id).await.unwrap(), "not plugged yet: nothing to confirm");

    let v = streamed(&ctl.report_plugged("uid-a", &id, "n1", true).await.unwrap());
    assert_eq!(v.state(), PbState::Plugged);
    assert_eq!(fake.s().watches, [(id.clone(), true)]);
    assert_eq!(fake.recorded("a").unwrap().1, VifState::Plugged);
    assert!(!ctl.mark_ready("uid-a", "net/other").await.unwrap(), "another VIF");
    fake.s().fail.insert("record_state", 1);
    assert!(ctl.mark_ready("uid-a", &id).await.is_err(), "an unrecorded READY is not streamed");
    assert_eq!(streamed(&ctl.get_vif("uid-a").unwrap()).state(), PbState::Plugged);
    assert!(ctl.mark_ready("uid-a", &id).await.unwrap());
    assert_eq!(streamed(&ctl.get_vif("uid-a").unwrap()).state(), PbState::Ready);
    assert_eq!(fake.recorded("a").unwrap().1, VifState::Ready);
    // A repeated plug report keeps READY; unplugging stops the watch.
    assert_eq!(streamed(&ctl.report_plugged("uid-a", &id, "n1", true).await.unwrap()).state(), PbState::Ready);
    assert_eq!(streamed(&ctl.report_plugged("uid-a", &id, "n1", false).await.unwrap()).state(), PbState::Allocated);
    assert_eq!(fake.s().watches.last(), Some(&(id.clone(), false)));
    assert_eq!(deltas(&index), ["+a Allocated", "+a Plugged", "+a Ready", "+a Allocated"]);
}

#[test]
fn neutron_failures_have_their_own_event_reasons() {
    let quota = kuryr_openstack::Error::QuotaExceeded(kuryr_openstack::Fault {
        service: kuryr_openstack::ServiceType::Network,
        operation: "ports.create",
        status: http::StatusCode::CONFLICT,
        kind: Some("OverQuota".into()),
        message: "Quota exceeded for resources: ['port']".into(),
        request_id: None,
    });
    let e = ClusterError::Neutron { action: "creating a port".into(), source: Box::new(quota) };
    assert_eq!((e.reason(), e.event_reason()), ("neutron_quota_exceeded", Some("NeutronQuotaExceeded")));
    let e = ClusterError::BindingFailed { port: "p".into(), host: "n1".into() };
    assert_eq!((e.reason(), e.event_reason()), ("binding_failed", Some("PortBindingFailed")));
    assert!(chain(&e).contains("binding_failed"), "{}", chain(&e));
    let e = ClusterError::Conflict("x".into());
    assert_eq!(e.event_reason(), None, "the generic VifAllocationFailed");
}

#[tokio::test(start_paused = true)]
async fn workers_retry_failures_and_say_so() {
    let Setup { fake, ctl, metrics, .. } = setup();
    let (_trigger, shutdown) = kuryr_runtime::shutdown::channel();
    ctl.spawn_workers(2, shutdown);
    fake.add_pod(&key("a"));
    fake.s().fail.insert("allocate", 2);
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    ctl.enqueue("uid-a");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while ctl.get_vif("uid-a").is_none() {
        assert!(tokio::time::Instant::now() < deadline, "never allocated");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let events = fake.s().events.clone();
    assert_eq!(events, vec![("uid-a".to_string(), REASON_ALLOCATION_FAILED); 2]);
    let failed = metrics.failures.get_or_create(&crate::metrics::FailureLabels { op: "apply", reason: "api" }).get();
    assert_eq!(failed, 2);
}

#[tokio::test]
async fn a_finalizer_removal_from_a_stale_view_falls_back_to_a_read() {
    let Setup { fake, ctl, .. } = setup();
    fake.add_pod(&key("a"));
    see(&ctl, &fake, "a", "n1", "Pending", EventType::Applied);
    ctl.reconcile("uid-a").await.unwrap();
    fake.s().pods.get_mut("uid-a").unwrap().1.deleting = true;
    see(&ctl, &fake, "a", "n1", "Running", EventType::Applied);
    fake.calls();
    // The patch made from the view fails (the pod changed since): read, then patch again.
    fake.s().fail.insert("remove_finalizer", 1);
    ctl.reconcile("uid-a").await.unwrap();
    assert_eq!(fake.calls(), ["release a", "delete_pod_vif a", "remove_finalizer a", "pod a", "remove_finalizer a"]);
    assert!(fake.meta("uid-a").is_none(), "the pod, unblocked, is gone");
}

/// Feeds the view a pod asking for further interfaces.
fn see_networks(ctl: &Controller<Fake>, fake: &Fake, name: &str, networks: &str, t: EventType) {
    let annotations = [(crate::core::attach::NETWORKS_ANNOTATION.to_string(), networks.to_string())].into();
    let pod = Pod { node_name: "n1".into(), phase: "Pending".into(), annotations, ..Default::default() };
    see_pod(ctl, fake, name, pod, t);
}

#[tokio::test]
async fn further_interfaces_are_recorded_with_the_vif_reported_and_released_with_it() {
    let Setup { fake, ctl, index, .. } = setup();
    fake.add_pod(&key("m"));
    see_networks(&ctl, &fake, "m", "blue, green", EventType::Applied);
    ctl.reconcile("uid-m").await.unwrap();
    assert_eq!(
        fake.calls(),
        ["add_finalizer m", "allocate m", "attach m", "ensure_pod_vif m", "network_status m"],
        "the further interfaces are recorded with the VIF (the create) and reported before it is streamed"
    );
    let vif = streamed(&ctl.get_vif("uid-m").unwrap());
    let got: Vec<(&str, &str, &str)> = vif
        .attachments
        .iter()
        .map(|a| (a.attachment.as_str(), a.ifname.as_str(), a.vif.as_ref().unwrap().network_id.as_str()))
        .collect();
    assert_eq!(got, [("ns/blue", "net1", "blue"), ("ns/green", "net2", "green")]);
    let status: serde_json::Value = serde_json::from_str(&fake.s().statuses[0]).unwrap();
    assert_eq!(status[0]["interface"], "eth0");
    assert_eq!(status[2]["interface"], "net2");
    assert_eq!(deltas(&index), ["+m Allocated"]);

    // Deleted: the further networks' addresses go back with the primary one.
    fake.s().pods.get_mut("uid-m").unwrap().1.deleting = true;
    see_networks(&ctl, &fake, "m", "blue, green", EventType::Deleted);
    ctl.reconcile("uid-m").await.unwrap();
    assert!(fake.calls().contains(&"detach m".to_string()));
    assert_eq!(fake.s().attached["uid-m"], Vec::<String>::new());
}

#[tokio::test]
async fn a_bad_request_fails_the_vif_with_the_reason_until_it_is_fixed() {
    let Setup { fake, ctl, index, .. } = setup();
    fake.add_pod(&key("x"));
    see_networks(&ctl, &fake, "x", "blue, bad", EventType::Applied);
    let e = ctl.reconcile("uid-x").await.unwrap_err();
    assert_eq!(
        (e.step, e.source.reason(), e.source.event_reason()),
        ("attaching further networks", "network_attachment", Some("NetworkAttachmentFailed"))
    );
    let vif = streamed(&ctl.get_vif("uid-x").unwrap());
    assert_eq!(vif.state(), PbState::Failed);
    assert!(vif.message.contains("ns/bad does not exist"), "{}", vif.message);
    assert!(fake.s().statuses.is_empty() && !fake.calls().contains(&"ensure_pod_vif x".to_string()));
    // Fixed: the next attempt records and streams a working VIF in place of the failed one.
    see_networks(&ctl, &fake, "x", "blue", EventType::Applied);
    ctl.reconcile("uid-x").await.unwrap();
    let vif = streamed(&ctl.get_vif("uid-x").unwrap());
    assert_eq!((vif.state(), vif.attachments.len()), (PbState::Allocated, 1));
    assert_eq!(deltas(&index), ["+x Failed", "+x Allocated"]);
}

#[tokio::test]
async fn further_addresses_a_failed_cleanup_kept_are_given_back_on_the_retry() {
    let Setup { fake, ctl, .. } = setup();
    fake.add_pod(&key("r"));
    see_networks(&ctl, &fake, "r", "blue", EventType::Applied);
    ctl.reconcile("uid-r").await.unwrap();
    // Gone, as the watcher reports it without the annotation (an orphan, say): only the VIF in
    // the index lists the further network, and the first attempt to give it back fails.
    fake.s().pods.get_mut("uid-r").unwrap().1.deleting = true;
    see(&ctl, &fake, "r", "n1", "Running", EventType::Deleted);
    fake.s().fail.insert("detach", 1);
    let e = ctl.reconcile("uid-r").await.unwrap_err();
    assert_eq!(e.step, "releasing the further networks' addresses");
    assert!(ctl.get_vif("uid-r").is_none());
    assert_eq!(fake.s().attached["uid-r"], ["blue"]);
    ctl.reconcile("uid-r").await.unwrap();
    assert_eq!(fake.s().attached["uid-r"], Vec::<String>::new(), "the retry still knew the network");
}
