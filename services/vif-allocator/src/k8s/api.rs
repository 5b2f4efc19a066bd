//! The Kubernetes side: the [`Cluster`] operations on pods, PodVifs and Events, the PodNetwork
//! at start, and recovery of recorded VIFs.
//!
//! Writes that could hit another pod of the same name carry the pod's uid as a precondition:
//! finalizer edits are JSON patches that `test` `/metadata/uid` (and the finalizer list as
//! read), PodVif writes `test` `/spec/podUid`, and a PodVif is deleted with a uid
//! precondition.
//!
//! A PodVif is created with its VIF in `spec.vif`; PodVifs written by earlier versions hold it
//! in `status.vif`, and are read as they are ([`PodVif::vif`]): such a PodVif is rewritten only
//! when its record changes (the status cleared, then the spec written), and a state write whose
//! `test` of `/spec/vif/vifId` fails is tried once more against `/status/vif/vifId`.
//!
//! The VIFs it reads and writes are [`crate::core`]'s, stored in the PodVif as they are.

use kuryr_runtime::k8s::ApiFailure;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use serde_json::json;

use crate::backend::VifBackend as _;
use crate::backend::any::AnyBackend;
use crate::backend::ipam::IpamStore;
use crate::cluster::{Cluster, Ensured, PodMeta, Recorded};
use crate::core::{AttachedRecord, PodKey, VifRecord, VifState};
use crate::error::ClusterError;
use crate::k8s::crd::{self, PodNetwork, PodNetworkSpec, PodVif, PodVifSpec};
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

/// The VIF a PodVif records, wherever its version put it, and its state.
fn recorded(pv: &PodVif) -> Recorded {
    pv.vif().map(|v| (v.clone(), pv.state()))
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
            let recorded = recorded(&pv);
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

/// A JSON patch from its operations.
fn json_ops(ops: serde_json::Value, what: &str) -> Result<json_patch::Patch, ClusterError> {
    serde_json::from_value(ops)
        .map_err(|e| ClusterError::Api { action: format!("building the {what} patch"), source: Box::new(e) })
}

fn api_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> ClusterError {
    let action = action.into();
    move |e| ApiFailure::of(action, e).into()
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
    type Backend = AnyBackend;

    fn backend(&self) -> &AnyBackend {
        &self.backend
    }

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

    async fn ensure_pod_vif(&self, pod: &PodKey, node: &str, vif: &VifRecord) -> Result<Ensured, ClusterError> {
        let api = self.pod_vifs(&pod.namespace);
        let what = format!("PodVif {}/{}", pod.namespace, pod.name);
        let mut pv = PodVif::new(
            &pod.name,
            PodVifSpec {
                pod_uid: pod.uid.clone(),
                pod_name: pod.name.clone(),
                node_name: node.to_string(),
                network: self.network.clone(),
                vif: Some(vif.clone()),
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
                    recorded: Some((vif.clone(), VifState::Allocated)),
                    version: made.metadata.resource_version.unwrap_or_default(),
                    uid: made.metadata.uid.unwrap_or_default(),
                    status_set: false,
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
        let recorded = recorded(&existing);
        let status_set = existing.vif_in_status() || existing.state() != crd::VifState::Allocated;
        let version = existing.metadata.resource_version.unwrap_or_default();
        let uid = existing.metadata.uid.unwrap_or_default();
        Ok(Ensured { recorded, version, uid, status_set })
    }

    async fn record_vif(&self, pod: &PodKey, record: &VifRecord, found: &Ensured) -> Result<(), ClusterError> {
        let api = self.pod_vifs(&pod.namespace);
        let what = format!("PodVif {}/{}", pod.namespace, pod.name);
        let mut version = found.version.clone();
        if found.status_set {
            // The state (and an earlier version's VIF) goes first: should the spec write below
            // not follow, the PodVif records the old VIF as ALLOCATED, or none, never a state
            // beside a VIF it was not written for.
            let ops = json!([
                {"op": "test", "path": "/spec/podUid", "value": pod.uid},
                {"op": "test", "path": "/metadata/resourceVersion", "value": version},
                {"op": "add", "path": "/status", "value": {"state": crd::VifState::Allocated}},
            ]);
            let cleared = api
                .patch_status(&pod.name, &PatchParams::default(), &Patch::Json::<()>(json_ops(ops, "status")?))
                .await
                .map_err(api_err(format!("clearing the status of {what}")))?;
            version = cleared.metadata.resource_version.unwrap_or_default();
        }
        let ops = json!([
            {"op": "test", "path": "/spec/podUid", "value": pod.uid},
            {"op": "test", "path": "/metadata/resourceVersion", "value": version},
            {"op": "add", "path": "/spec/vif", "value": record},
        ]);
        api.patch(&pod.name, &PatchParams::default(), &Patch::Json::<()>(json_ops(ops, "VIF")?))
            .await
            .map_err(api_err(format!("recording the VIF in {what}")))?;
        Ok(())
    }

    async fn record_state(&self, pod: &PodKey, vif_id: &str, state: VifState) -> Result<(), ClusterError> {
        let api = self.pod_vifs(&pod.namespace);
        let what = format!("recording state {state:?} in PodVif {}/{}", pod.namespace, pod.name);
        let write = |legacy: bool| {
            // A new PodVif has no status until its first state: the whole status is written (it
            // holds nothing else). An earlier version's keeps its VIF there: only the state.
            let ops = if legacy {
                json!([
                    {"op": "test", "path": "/spec/podUid", "value": pod.uid},
                    {"op": "test", "path": "/status/vif/vifId", "value": vif_id},
                    {"op": "add", "path": "/status/state", "value": state},
                ])
            } else {
                json!([
                    {"op": "test", "path": "/spec/podUid", "value": pod.uid},
                    {"op": "test", "path": "/spec/vif/vifId", "value": vif_id},
                    {"op": "add", "path": "/status", "value": {"state": state}},
                ])
            };
            let api = api.clone();
            let what = what.clone();
            async move {
                api.patch_status(&pod.name, &PatchParams::default(), &Patch::Json::<()>(json_ops(ops, "state")?))
                    .await
                    .map_err(api_err(what))?;
                Ok::<(), ClusterError>(())
            }
        };
        match write(false).await {
            // A PodVif of an earlier version records the VIF in its status.
            Err(ClusterError::Conflict(_)) => write(true).await,
            other => other,
        }
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

    async fn attach(&self, pod: &PodKey, node: &str, networks: &str) -> Result<Vec<AttachedRecord>, ClusterError> {
        crate::k8s::attach::attach(&self.client, &self.backend, &self.network, pod, node, networks).await
    }

    async fn detach(&self, pod: &PodKey, node: &str, networks: &[String]) -> Result<(), ClusterError> {
        crate::k8s::attach::detach(&self.backend, pod, node, networks).await
    }

    async fn attached_networks(&self, pod: &PodKey, networks: &str) -> Vec<String> {
        let neutron = matches!(self.backend, crate::backend::any::AnyBackend::Neutron(_));
        crate::k8s::attach::resolve(&self.client, neutron, pod, networks).await
    }

    async fn network_status(&self, pod: &PodKey, value: &str) -> Result<(), ClusterError> {
        let ops = json!([
            {"op": "test", "path": "/metadata/uid", "value": pod.uid},
            {"op": "add", "path": "/metadata/annotations/k8s.v1.cni.cncf.io~1network-status", "value": value},
        ]);
        match self.json_patch(pod, ops, "writing the network-status annotation").await {
            Err(ClusterError::NotFound(_)) => Ok(()),
            other => other,
        }
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
        let action = if reason == crate::cluster::REASON_RELEASE_FAILED { "Release" } else { "Allocate" };
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
