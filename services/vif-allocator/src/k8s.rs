//! The Kubernetes side: the [`Cluster`] operations on pods, PodVifs and Events, the PodNetwork
//! at start, recovery of recorded VIFs, and the watch of address blocks that keeps the node
//! routes current.
//!
//! Writes that could hit another pod of the same name carry the pod's uid as a precondition:
//! finalizer edits are JSON patches that `test` `/metadata/uid` (and the finalizer list as
//! read), PodVif status writes `test` `/spec/podUid`, and a PodVif is deleted with a uid
//! precondition.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, PartialObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt as _, watcher};
use kuryr_runtime::{Shutdown, retry};
use serde_json::json;

use crate::backend::{AnyBackend, VifBackend as _};
use crate::cluster::{Cluster, ClusterError, Ensured, PodMeta, Recorded};
use crate::crd::{AddressBlock, PodNetwork, PodNetworkSpec, PodVif, PodVifSpec, VifRecord, VifState};
use crate::index::{SharedIndex, lock};
use crate::ipam::store::{IpamStore, PodKey};
use crate::pods::FINALIZER;

/// Page size when listing PodVifs at recovery.
const PAGE: u32 = 500;

/// Makes sure the PodNetwork `name` exists: creates it from `cidrs` (and the other flags in
/// `spec`) when it is absent and `spec` is given; never changes an existing one.
pub async fn ensure_network(
    client: &kube::Client,
    store: &IpamStore,
    name: &str,
    spec: Option<&PodNetworkSpec>,
) -> anyhow::Result<()> {
    let api: Api<PodNetwork> = Api::all(client.clone());
    match (api.get_opt(name).await?, spec) {
        (Some(existing), Some(wanted)) if existing.spec != *wanted => {
            tracing::warn!(network = name, existing = ?existing.spec, flags = ?wanted,
                "the PodNetwork exists with another spec than the flags say; using it as it is");
            Ok(())
        }
        (Some(_), _) => Ok(()),
        (None, Some(spec)) => {
            store.ensure_network(name, spec).await?;
            tracing::info!(network = name, cidrs = ?spec.cidrs, "created the PodNetwork");
            Ok(())
        }
        (None, None) => anyhow::bail!(
            "PodNetwork {name} does not exist; create it (kubectl apply) or pass --network-cidrs to have it created"
        ),
    }
}

/// A PodVif found at recovery.
#[derive(Debug)]
pub struct Found {
    /// Its pod.
    pub pod: PodKey,
    /// spec.nodeName.
    pub node: String,
    /// What its status holds.
    pub recorded: Recorded,
}

/// Lists every PodVif of `network`, in all namespaces.
pub async fn list_pod_vifs(client: &kube::Client, network: &str) -> anyhow::Result<Vec<Found>> {
    let api: Api<PodVif> = Api::all(client.clone());
    let mut found = Vec::new();
    let mut params = ListParams::default().limit(PAGE);
    loop {
        let page = api.list(&params).await?;
        for pv in page.items {
            if pv.spec.network != network {
                continue;
            }
            let namespace = pv.metadata.namespace.clone().unwrap_or_default();
            let status = pv.status.unwrap_or_default();
            let recorded = status.vif.map(|v| (v, status.state.unwrap_or(VifState::Allocated)));
            found.push(Found {
                pod: PodKey::new(namespace, pv.spec.pod_name, pv.spec.pod_uid),
                node: pv.spec.node_name,
                recorded,
            });
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(found),
        }
    }
}

/// Keeps the index's address blocks (for node routes) in line with the network's AddressBlocks:
/// a metadata-only watch (cheap: allocations rewrite block statuses all the time) whose set of
/// names, when it changes, triggers a re-read of the blocks by node.
pub async fn follow_blocks(
    client: kube::Client,
    store: Arc<IpamStore>,
    network: String,
    index: SharedIndex,
    shutdown: Shutdown,
) {
    // Metadata only: allocations rewrite block statuses all the time, names change rarely.
    let api: Api<PartialObjectMeta<AddressBlock>> = Api::all(client);
    let config = kuryr_runtime::watch_config().fields(&format!("spec.network={network}"));
    let mut events = watcher::watcher(api, config).default_backoff().boxed();
    let mut names: BTreeSet<String> = BTreeSet::new();
    let mut relist: Option<BTreeSet<String>> = None;
    loop {
        let next = tokio::select! {
            n = events.next() => n,
            () = shutdown.clone().wait() => return,
        };
        let changed = match next {
            Some(Ok(watcher::Event::Init)) => {
                relist = Some(BTreeSet::new());
                false
            }
            Some(Ok(watcher::Event::InitApply(m))) => {
                if let (Some(r), Some(n)) = (relist.as_mut(), m.metadata.name) {
                    r.insert(n);
                }
                false
            }
            Some(Ok(watcher::Event::InitDone)) => {
                let fresh = relist.take().unwrap_or_default();
                let changed = fresh != names;
                names = fresh;
                changed
            }
            Some(Ok(watcher::Event::Apply(m))) => m.metadata.name.is_some_and(|n| names.insert(n)),
            Some(Ok(watcher::Event::Delete(m))) => m.metadata.name.is_some_and(|n| names.remove(&n)),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "address block watch failed; retrying with backoff");
                false
            }
            None => return,
        };
        if !changed {
            continue;
        }
        let read =
            retry("reading the address blocks", &shutdown, || async { Ok(store.node_blocks(&network).await?) }).await;
        let Some(by_node) = read else { return };
        let blocks: BTreeMap<String, Vec<String>> =
            by_node.into_iter().map(|(n, b)| (n, b.iter().map(ToString::to_string).collect())).collect();
        tracing::info!(blocks = names.len(), nodes = blocks.len(), "address blocks changed");
        lock(&index).set_blocks(blocks);
    }
}

/// The [`Cluster`] of a real API server and a VIF backend (the embedded IPAM or Neutron).
#[derive(Clone)]
pub struct KubeCluster {
    client: kube::Client,
    backend: AnyBackend,
    network: String,
    /// Publishes Events (events.k8s.io/v1), folding repeats into a series.
    recorder: Recorder,
}

impl std::fmt::Debug for KubeCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeCluster")
            .field("network", &self.network)
            .field("backend", &self.backend.name())
            .finish_non_exhaustive()
    }
}

fn api_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> ClusterError {
    let action = action.into();
    move |e| match e {
        kube::Error::Api(s) if s.is_not_found() => ClusterError::NotFound(format!("{action}: not found")),
        // 409: changed since read; 422 from a JSON patch: a `test` failed.
        kube::Error::Api(s) if s.is_conflict() || s.code == 422 => {
            ClusterError::Conflict(format!("{action}: {}", s.message))
        }
        other => ClusterError::Api { action, source: Box::new(other) },
    }
}

impl KubeCluster {
    /// Operations on `network` (the PodNetwork, or the Neutron network id) with `client` and
    /// `backend`, reporting Events as `instance`.
    pub fn new(client: kube::Client, backend: AnyBackend, network: &str, instance: Option<String>) -> Self {
        let reporter = Reporter { controller: "kuryr-vif-allocator".into(), instance };
        let recorder = Recorder::new(client.clone(), reporter);
        Self { client, backend, network: network.to_string(), recorder }
    }

    fn pods(&self, ns: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), ns)
    }

    fn pod_vifs(&self, ns: &str) -> Api<PodVif> {
        Api::namespaced(self.client.clone(), ns)
    }

    async fn json_patch(&self, pod: &PodKey, ops: serde_json::Value, action: &str) -> Result<(), ClusterError> {
        let patch: json_patch::Patch = serde_json::from_value(ops).map_err(|e| ClusterError::Api {
            action: format!("building the patch for {action}"),
            source: Box::new(e),
        })?;
        self.pods(&pod.namespace)
            .patch(&pod.name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
            .map_err(api_err(format!("{action} on pod {}/{}", pod.namespace, pod.name)))?;
        Ok(())
    }
}

impl Cluster for KubeCluster {
    async fn pod(&self, pod: &PodKey) -> Result<Option<PodMeta>, ClusterError> {
        let got = self
            .pods(&pod.namespace)
            .get_metadata_opt(&pod.name)
            .await
            .map_err(api_err(format!("reading pod {}/{}", pod.namespace, pod.name)))?;
        Ok(got.filter(|m| m.metadata.uid.as_deref() == Some(pod.uid.as_str())).map(|m| PodMeta {
            finalizers: m.metadata.finalizers.unwrap_or_default(),
            deleting: m.metadata.deletion_timestamp.is_some(),
        }))
    }

    async fn add_finalizer(&self, pod: &PodKey, current: &[String]) -> Result<(), ClusterError> {
        // As kube-runtime's finalizer helper does: an absent list tests as null.
        let ops = if current.is_empty() {
            json!([
                {"op": "test", "path": "/metadata/uid", "value": pod.uid},
                {"op": "test", "path": "/metadata/finalizers", "value": null},
                {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
            ])
        } else {
            json!([
                {"op": "test", "path": "/metadata/uid", "value": pod.uid},
                {"op": "test", "path": "/metadata/finalizers", "value": current},
                {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER},
            ])
        };
        self.json_patch(pod, ops, "adding the finalizer").await
    }

    async fn remove_finalizer(&self, pod: &PodKey, current: &[String]) -> Result<(), ClusterError> {
        let Some(i) = current.iter().position(|f| f == FINALIZER) else { return Ok(()) };
        let ops = json!([
            {"op": "test", "path": "/metadata/uid", "value": pod.uid},
            {"op": "test", "path": format!("/metadata/finalizers/{i}"), "value": FINALIZER},
            {"op": "remove", "path": format!("/metadata/finalizers/{i}")},
        ]);
        match self.json_patch(pod, ops, "removing the finalizer").await {
            Err(ClusterError::NotFound(_)) => Ok(()),
            other => other,
        }
    }

    async fn ensure_pod_vif(&self, pod: &PodKey, node: &str) -> Result<Ensured, ClusterError> {
        let api = self.pod_vifs(&pod.namespace);
        let what = format!("PodVif {}/{}", pod.namespace, pod.name);
        let mut pv = PodVif::new(
            &pod.name,
            PodVifSpec {
                pod_uid: pod.uid.clone(),
                pod_name: pod.name.clone(),
                node_name: node.to_string(),
                network: self.network.clone(),
            },
        );
        pv.metadata.namespace = Some(pod.namespace.clone());
        // Owned by the pod, so that the garbage collector removes it should everything else fail.
        pv.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: pod.name.clone(),
            uid: pod.uid.clone(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        pv.metadata.labels = Some([("kuryr.openstack.org/node".to_string(), node.to_string())].into());
        let pp = PostParams { field_manager: Some("kuryr-vif-allocator".into()), ..Default::default() };
        let existing = match api.create(&pp, &pv).await {
            Ok(made) => {
                return Ok(Ensured {
                    recorded: None,
                    version: made.metadata.resource_version.unwrap_or_default(),
                    uid: made.metadata.uid.unwrap_or_default(),
                });
            }
            Err(kube::Error::Api(s)) if s.is_already_exists() => {
                api.get(&pod.name).await.map_err(api_err(format!("reading {what}")))?
            }
            Err(e) => return Err(api_err(format!("creating {what}"))(e)),
        };
        if existing.spec.pod_uid != pod.uid {
            return Err(ClusterError::StalePodVif {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                other_uid: existing.spec.pod_uid,
                node: existing.spec.node_name,
            });
        }
        let version = existing.metadata.resource_version.unwrap_or_default();
        let uid = existing.metadata.uid.unwrap_or_default();
        let status = existing.status.unwrap_or_default();
        let recorded = status.vif.map(|v| (v, status.state.unwrap_or(VifState::Allocated)));
        Ok(Ensured { recorded, version, uid })
    }

    async fn record_vif(
        &self,
        pod: &PodKey,
        record: &VifRecord,
        state: VifState,
        version: &str,
    ) -> Result<(), ClusterError> {
        let ops = json!([
            {"op": "test", "path": "/spec/podUid", "value": pod.uid},
            {"op": "test", "path": "/metadata/resourceVersion", "value": version},
            {"op": "add", "path": "/status", "value": {"vif": record, "state": state}},
        ]);
        let patch: json_patch::Patch = serde_json::from_value(ops)
            .map_err(|e| ClusterError::Api { action: "building the status patch".into(), source: Box::new(e) })?;
        self.pod_vifs(&pod.namespace)
            .patch_status(&pod.name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
            .map_err(api_err(format!("recording the VIF in PodVif {}/{}", pod.namespace, pod.name)))?;
        Ok(())
    }

    async fn record_state(&self, pod: &PodKey, vif_id: &str, state: VifState) -> Result<(), ClusterError> {
        let ops = json!([
            {"op": "test", "path": "/spec/podUid", "value": pod.uid},
            {"op": "test", "path": "/status/vif/vifId", "value": vif_id},
            {"op": "add", "path": "/status/state", "value": state},
        ]);
        let patch: json_patch::Patch = serde_json::from_value(ops)
            .map_err(|e| ClusterError::Api { action: "building the state patch".into(), source: Box::new(e) })?;
        self.pod_vifs(&pod.namespace)
            .patch_status(&pod.name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
            .map_err(api_err(format!("recording state {state:?} in PodVif {}/{}", pod.namespace, pod.name)))?;
        Ok(())
    }

    async fn delete_pod_vif(&self, pod: &PodKey, known: Option<&str>) -> Result<(), ClusterError> {
        let api = self.pod_vifs(&pod.namespace);
        let what = format!("PodVif {}/{}", pod.namespace, pod.name);
        if let Some(uid) = known.filter(|u| !u.is_empty()) {
            let dp = DeleteParams {
                preconditions: Some(Preconditions { uid: Some(uid.to_string()), resource_version: None }),
                ..Default::default()
            };
            return match api.delete(&pod.name, &dp).await {
                Ok(_) => Ok(()),
                // Gone already, or (409: the uid precondition failed) the name holds a later
                // pod's PodVif: ours is gone either way.
                Err(kube::Error::Api(s)) if s.is_not_found() || s.is_conflict() => Ok(()),
                Err(e) => Err(api_err(format!("deleting {what}"))(e)),
            };
        }
        let Some(existing) = api.get_opt(&pod.name).await.map_err(api_err(format!("reading {what}")))? else {
            return Ok(());
        };
        if existing.spec.pod_uid != pod.uid {
            // Another pod's (a later one of the same name): not ours to delete.
            return Ok(());
        }
        let dp = DeleteParams {
            preconditions: Some(Preconditions { uid: existing.metadata.uid.clone(), resource_version: None }),
            ..Default::default()
        };
        match api.delete(&pod.name, &dp).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
            Err(e) => Err(api_err(format!("deleting {what}"))(e)),
        }
    }

    async fn allocate(&self, pod: &PodKey, node: &str) -> Result<VifRecord, ClusterError> {
        self.backend.allocate(pod, node).await
    }

    async fn release(&self, pod: &PodKey, node: &str) -> Result<bool, ClusterError> {
        self.backend.release(pod, node).await
    }

    async fn holds(&self, pod: &PodKey, node: &str, record: &VifRecord) -> Result<bool, ClusterError> {
        self.backend.holds(pod, node, record).await
    }

    async fn discard(&self, pod: &PodKey, node: &str, ours: &VifRecord, keep: &VifRecord) -> Result<(), ClusterError> {
        self.backend.discard(pod, node, ours, keep).await
    }

    fn ready_when_plugged(&self) -> bool {
        self.backend.ready_when_plugged()
    }

    fn watch_ready(&self, pod_uid: &str, vif_id: &str, watch: bool) {
        self.backend.watch_ready(pod_uid, vif_id, watch);
    }

    async fn warn(&self, pod: &PodKey, reason: &'static str, note: String) {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(pod.namespace.clone()),
            name: Some(pod.name.clone()),
            uid: Some(pod.uid.clone()),
            ..Default::default()
        };
        // An Event note is at most 1 kB.
        let note: String = note.chars().take(1000).collect();
        let action = if reason == crate::controller::REASON_RELEASE_FAILED { "Release" } else { "Allocate" };
        let ev = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            tracing::debug!(pod = %format!("{}/{}", pod.namespace, pod.name), error = %e, "could not record an Event");
        }
    }
}
