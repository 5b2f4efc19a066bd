//! The Kubernetes side of namespace networks: the finalizer on the Namespace (its deletion waits
//! for the network's removal), the NamespaceNetwork record and its status, and Events on the
//! Namespace. Finalizer edits are JSON patches that `test` the namespace's uid and the finalizer
//! list as read, as for pods.

use k8s_openapi::api::core::v1::{Namespace, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kuryr_runtime::k8s::ApiFailure;
use serde_json::json;

use crate::error::ClusterError;
use crate::k8s::crd::{NamespaceNetwork, NamespaceNetworkSpec, NamespaceNetworkStatus};

/// The finalizer on a Namespace whose network exists.
pub const FINALIZER: &str = "kuryr.openstack.org/namespace-network";

/// A Namespace as read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceMeta {
    /// metadata.uid.
    pub uid: String,
    /// metadata.finalizers.
    pub finalizers: Vec<String>,
    /// metadata.deletionTimestamp is set.
    pub deleting: bool,
}

impl NamespaceMeta {
    /// Whether our finalizer is on it.
    pub fn has_finalizer(&self) -> bool {
        self.finalizers.iter().any(|f| f == FINALIZER)
    }
}

fn api_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> ClusterError {
    let action = action.into();
    move |e| ApiFailure::of(action, e).into()
}

/// Namespaces, NamespaceNetworks and Events.
#[derive(Clone)]
pub struct NamespaceKube {
    client: kube::Client,
    recorder: Recorder,
}

impl std::fmt::Debug for NamespaceKube {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamespaceKube").finish_non_exhaustive()
    }
}

impl NamespaceKube {
    /// Works through `client`, reporting Events as `instance`.
    pub fn new(client: kube::Client, instance: Option<String>) -> Self {
        let reporter = Reporter { controller: "kuryr-vif-allocator".into(), instance };
        let recorder = Recorder::new(client.clone(), reporter);
        Self { client, recorder }
    }

    fn namespaces(&self) -> Api<Namespace> {
        Api::all(self.client.clone())
    }

    fn records(&self) -> Api<NamespaceNetwork> {
        Api::all(self.client.clone())
    }

    /// The namespace's metadata; `None` when it does not exist.
    pub async fn namespace(&self, name: &str) -> Result<Option<NamespaceMeta>, ClusterError> {
        let got =
            self.namespaces().get_metadata_opt(name).await.map_err(api_err(format!("reading namespace {name}")))?;
        Ok(got.map(|m| NamespaceMeta {
            uid: m.metadata.uid.unwrap_or_default(),
            finalizers: m.metadata.finalizers.unwrap_or_default(),
            deleting: m.metadata.deletion_timestamp.is_some(),
        }))
    }

    async fn json_patch(&self, name: &str, ops: serde_json::Value, action: &str) -> Result<(), ClusterError> {
        let patch: json_patch::Patch = serde_json::from_value(ops).map_err(|e| ClusterError::Api {
            action: format!("building the patch for {action}"),
            source: Box::new(e),
        })?;
        self.namespaces()
            .patch(name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
            .map_err(api_err(format!("{action} on namespace {name}")))?;
        Ok(())
    }

    /// Adds the finalizer, given the namespace as just read.
    pub async fn add_finalizer(&self, name: &str, meta: &NamespaceMeta) -> Result<(), ClusterError> {
        let ops = if meta.finalizers.is_empty() {
            json!([
                {"op": "test", "path": "/metadata/uid", "value": meta.uid},
                {"op": "test", "path": "/metadata/finalizers", "value": null},
                {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
            ])
        } else {
            json!([
                {"op": "test", "path": "/metadata/uid", "value": meta.uid},
                {"op": "test", "path": "/metadata/finalizers", "value": meta.finalizers},
                {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER},
            ])
        };
        self.json_patch(name, ops, "adding the finalizer").await
    }

    /// Removes the finalizer, given the namespace as just read; gone is fine.
    pub async fn remove_finalizer(&self, name: &str, meta: &NamespaceMeta) -> Result<(), ClusterError> {
        let Some(i) = meta.finalizers.iter().position(|f| f == FINALIZER) else { return Ok(()) };
        let ops = json!([
            {"op": "test", "path": "/metadata/uid", "value": meta.uid},
            {"op": "test", "path": format!("/metadata/finalizers/{i}"), "value": FINALIZER},
            {"op": "remove", "path": format!("/metadata/finalizers/{i}")},
        ]);
        match self.json_patch(name, ops, "removing the finalizer").await {
            Err(ClusterError::NotFound(_)) => Ok(()),
            other => other,
        }
    }

    /// The namespace's record, created (spec only) unless it exists for this namespace uid; a
    /// record of an earlier namespace of that name is replaced.
    pub async fn ensure_record(&self, name: &str, uid: &str) -> Result<NamespaceNetwork, ClusterError> {
        let mut rec = NamespaceNetwork::new(
            name,
            NamespaceNetworkSpec { namespace: name.to_string(), namespace_uid: uid.to_string() },
        );
        rec.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "v1".into(),
            kind: "Namespace".into(),
            name: name.to_string(),
            uid: uid.to_string(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        let pp = PostParams { field_manager: Some("kuryr-vif-allocator".into()), ..Default::default() };
        let what = format!("NamespaceNetwork {name}");
        match self.records().create(&pp, &rec).await {
            Ok(made) => return Ok(made),
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(api_err(format!("creating {what}"))(e)),
        }
        let existing = self.records().get(name).await.map_err(api_err(format!("reading {what}")))?;
        if existing.spec.namespace_uid == uid {
            return Ok(existing);
        }
        tracing::warn!(namespace = name, stale = %existing.spec.namespace_uid, "replacing the record of an earlier namespace");
        self.delete_record(name).await?;
        self.records().create(&pp, &rec).await.map_err(api_err(format!("creating {what}")))
    }

    /// Every record.
    pub async fn list_records(&self) -> Result<Vec<NamespaceNetwork>, ClusterError> {
        let list = self.records().list(&ListParams::default()).await.map_err(api_err("listing NamespaceNetworks"))?;
        Ok(list.items)
    }

    /// Merges `status` into the record's (fields left `None` stay as they are, except the
    /// message, which is cleared); no record is fine (nothing to tell).
    pub async fn write_status(&self, name: &str, status: &NamespaceNetworkStatus) -> Result<(), ClusterError> {
        let mut value = serde_json::to_value(status).map_err(|e| ClusterError::Api {
            action: "encoding a NamespaceNetwork status".into(),
            source: Box::new(e),
        })?;
        if status.message.is_none() {
            value["message"] = serde_json::Value::Null;
        }
        let patch = json!({ "status": value });
        match self.records().patch_status(name, &PatchParams::default(), &Patch::Merge(patch)).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
            Err(e) => Err(api_err(format!("writing the status of NamespaceNetwork {name}"))(e)),
        }
    }

    /// Deletes the record; gone is fine.
    pub async fn delete_record(&self, name: &str) -> Result<(), ClusterError> {
        match self.records().delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
            Err(e) => Err(api_err(format!("deleting NamespaceNetwork {name}"))(e)),
        }
    }

    /// An Event on the namespace; best effort.
    pub async fn event(&self, name: &str, uid: &str, warning: bool, reason: &str, action: &str, note: String) {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Namespace".into()),
            name: Some(name.to_string()),
            uid: (!uid.is_empty()).then(|| uid.to_string()),
            ..Default::default()
        };
        let ev = Event {
            type_: if warning { EventType::Warning } else { EventType::Normal },
            reason: reason.into(),
            note: Some(note.chars().take(1000).collect()),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            tracing::debug!(namespace = name, error = %e, "could not record an Event");
        }
    }
}
