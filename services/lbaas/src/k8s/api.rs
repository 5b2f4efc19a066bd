//! The Kubernetes side ([`crate::k8s::Cluster`] against the API server): the Service
//! finalizer, the ServiceLoadBalancer records, and Events on Services.
//!
//! Writes that could hit another object of the same name carry a uid precondition: finalizer
//! edits are JSON patches that `test` the Service's `/metadata/uid` (and the finalizer list as
//! read); spec replacements `test` the record's uid; deletions carry a uid precondition.

use k8s_openapi::api::core::v1::{ObjectReference, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kuryr_runtime::k8s::ApiFailure;
use serde_json::json;

use crate::core::view::{FINALIZER, split};
use crate::k8s::crd::{ServiceLoadBalancer, ServiceLoadBalancerSpec, ServiceLoadBalancerStatus};
use crate::k8s::{Cluster, ClusterError, Record, ServiceMeta};

/// Page size when listing records at recovery.
const PAGE: u32 = 500;
/// The field manager of every write.
const MANAGER: &str = "kuryr-lbaas";

fn api_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> ClusterError {
    let action = action.into();
    move |e| ApiFailure::of(action, e).into()
}

impl Record {
    /// The record of an object read from the API.
    pub fn from_object(o: ServiceLoadBalancer) -> Record {
        Record {
            uid: o.metadata.uid.unwrap_or_default(),
            generation: o.metadata.generation.and_then(|g| u64::try_from(g).ok()).unwrap_or(0),
            spec: o.spec,
            status: o.status,
        }
    }
}

/// The Kubernetes operations of the controller.
#[derive(Clone)]
pub struct Kube {
    client: kube::Client,
    /// Publishes Events (events.k8s.io/v1), folding repeats into a series.
    recorder: Recorder,
}

impl std::fmt::Debug for Kube {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kube").finish_non_exhaustive()
    }
}

impl Kube {
    /// Operations with `client`, reporting Events as `instance`.
    pub fn new(client: kube::Client, instance: Option<String>) -> Self {
        let reporter = Reporter { controller: "kuryr-lbaas".into(), instance };
        let recorder = Recorder::new(client.clone(), reporter);
        Self { client, recorder }
    }

    fn services(&self, ns: &str) -> Api<Service> {
        Api::namespaced(self.client.clone(), ns)
    }

    fn records(&self, ns: &str) -> Api<ServiceLoadBalancer> {
        Api::namespaced(self.client.clone(), ns)
    }

    /// Every record, by Service key.
    pub async fn list_records(&self) -> anyhow::Result<Vec<(String, Record)>> {
        let api: Api<ServiceLoadBalancer> = Api::all(self.client.clone());
        let mut found = Vec::new();
        let mut params = ListParams::default().limit(PAGE);
        loop {
            let page = api.list(&params).await?;
            for o in page.items {
                let key = crate::core::view::key(
                    o.metadata.namespace.as_deref().unwrap_or_default(),
                    o.metadata.name.as_deref().unwrap_or_default(),
                );
                found.push((key, Record::from_object(o)));
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => return Ok(found),
            }
        }
    }

    async fn json_patch_service(&self, key: &str, ops: serde_json::Value, action: &str) -> Result<(), ClusterError> {
        let (ns, name) = split(key);
        let patch: json_patch::Patch = serde_json::from_value(ops)
            .map_err(|e| ClusterError::Conflict(format!("building the patch for {action}: {e}")))?;
        self.services(ns)
            .patch(name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
            .map_err(api_err(format!("{action} on Service {key}")))?;
        Ok(())
    }
}

impl Cluster for Kube {
    /// The Service's metadata; `None` when it does not exist.
    async fn service(&self, key: &str) -> Result<Option<ServiceMeta>, ClusterError> {
        let (ns, name) = split(key);
        let got = self.services(ns).get_metadata_opt(name).await.map_err(api_err(format!("reading Service {key}")))?;
        Ok(got.map(|m| ServiceMeta {
            uid: m.metadata.uid.unwrap_or_default(),
            finalizers: m.metadata.finalizers.unwrap_or_default(),
            deleting: m.metadata.deletion_timestamp.is_some(),
        }))
    }

    /// Adds our finalizer to the Service of `uid`, given the finalizers just read.
    async fn add_finalizer(&self, key: &str, uid: &str, current: &[String]) -> Result<(), ClusterError> {
        // As kube-runtime's finalizer helper does: an absent list tests as null.
        let ops = if current.is_empty() {
            json!([
                {"op": "test", "path": "/metadata/uid", "value": uid},
                {"op": "test", "path": "/metadata/finalizers", "value": null},
                {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
            ])
        } else {
            json!([
                {"op": "test", "path": "/metadata/uid", "value": uid},
                {"op": "test", "path": "/metadata/finalizers", "value": current},
                {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER},
            ])
        };
        self.json_patch_service(key, ops, "adding the finalizer").await
    }

    /// Removes our finalizer from the Service of `uid`, given the finalizers just read.
    async fn remove_finalizer(&self, key: &str, uid: &str, current: &[String]) -> Result<(), ClusterError> {
        let Some(i) = current.iter().position(|f| f == FINALIZER) else { return Ok(()) };
        let ops = json!([
            {"op": "test", "path": "/metadata/uid", "value": uid},
            {"op": "test", "path": format!("/metadata/finalizers/{i}"), "value": FINALIZER},
            {"op": "remove", "path": format!("/metadata/finalizers/{i}")},
        ]);
        match self.json_patch_service(key, ops, "removing the finalizer").await {
            Err(ClusterError::NotFound(_)) => Ok(()),
            other => other,
        }
    }

    /// Creates the record of `key`, owned by the Service `service_uid`; an existing record is
    /// returned as it is.
    async fn create_record(&self, key: &str, spec: &ServiceLoadBalancerSpec) -> Result<Record, ClusterError> {
        let (ns, name) = split(key);
        let mut o = ServiceLoadBalancer::new(name, spec.clone());
        o.metadata.namespace = Some(ns.to_string());
        // Owned by the Service, so that the garbage collector removes it should all else fail.
        o.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "v1".into(),
            kind: "Service".into(),
            name: name.to_string(),
            uid: spec.service_uid.clone(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        let pp = PostParams { field_manager: Some(MANAGER.into()), ..Default::default() };
        match self.records(ns).create(&pp, &o).await {
            Ok(created) => Ok(Record::from_object(created)),
            Err(kube::Error::Api(s)) if s.is_already_exists() => {
                let got =
                    self.records(ns).get(name).await.map_err(api_err(format!("reading ServiceLoadBalancer {key}")))?;
                Ok(Record::from_object(got))
            }
            Err(e) => Err(api_err(format!("creating ServiceLoadBalancer {key}"))(e)),
        }
    }

    /// Replaces the spec (and the owner, when the Service was re-created) of the record `uid`.
    async fn replace_spec(&self, key: &str, uid: &str, spec: &ServiceLoadBalancerSpec) -> Result<Record, ClusterError> {
        let (ns, name) = split(key);
        let owner = json!([{
            "apiVersion": "v1", "kind": "Service", "name": name, "uid": spec.service_uid, "controller": true,
        }]);
        let ops = json!([
            {"op": "test", "path": "/metadata/uid", "value": uid},
            {"op": "replace", "path": "/spec", "value": spec},
            {"op": "add", "path": "/metadata/ownerReferences", "value": owner},
        ]);
        let patch: json_patch::Patch =
            serde_json::from_value(ops).map_err(|e| ClusterError::Conflict(format!("building the spec patch: {e}")))?;
        let pp = PatchParams { field_manager: Some(MANAGER.into()), ..Default::default() };
        let got = self
            .records(ns)
            .patch(name, &pp, &Patch::Json::<()>(patch))
            .await
            .map_err(api_err(format!("updating ServiceLoadBalancer {key}")))?;
        Ok(Record::from_object(got))
    }

    /// Writes the record's status.
    async fn write_status(&self, key: &str, status: &ServiceLoadBalancerStatus) -> Result<(), ClusterError> {
        let (ns, name) = split(key);
        let pp = PatchParams { field_manager: Some(MANAGER.into()), ..Default::default() };
        // A merge patch of the whole status: absent fields are nulled, so none lingers.
        let body = json!({"status": {
            "provisioningStatus": status.provisioning_status,
            "observedGeneration": status.observed_generation,
            "backendId": status.backend_id,
            "ingressIp": status.ingress_ip,
            "message": status.message,
        }});
        self.records(ns)
            .patch_status(name, &pp, &Patch::Merge(body))
            .await
            .map_err(api_err(format!("writing the status of ServiceLoadBalancer {key}")))?;
        Ok(())
    }

    /// Sets the Service's `status.loadBalancer.ingress` to `ips` (empty clears it), only while it
    /// is the Service of `uid`.
    async fn set_ingress(&self, key: &str, uid: &str, ips: &[String]) -> Result<(), ClusterError> {
        let (ns, name) = split(key);
        let ingress: Vec<serde_json::Value> = ips.iter().map(|ip| json!({"ip": ip})).collect();
        let body = json!({"metadata": {"uid": uid}, "status": {"loadBalancer": {"ingress": ingress}}});
        let pp = PatchParams { field_manager: Some(MANAGER.into()), ..Default::default() };
        match self.services(ns).patch_status(name, &pp, &Patch::Merge(body)).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
            Err(e) => Err(api_err(format!("setting the ingress of Service {key}"))(e)),
        }
    }

    /// Deletes the record `uid` of `key`; none is fine.
    async fn delete_record(&self, key: &str, uid: &str) -> Result<(), ClusterError> {
        let (ns, name) = split(key);
        let dp = DeleteParams {
            preconditions: Some(Preconditions { uid: Some(uid.to_string()), resource_version: None }),
            ..Default::default()
        };
        match self.records(ns).delete(name, &dp).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
            Err(e) => Err(api_err(format!("deleting ServiceLoadBalancer {key}"))(e)),
        }
    }

    /// Tells the Service's users something (an Event on the Service); best effort.
    async fn event(&self, key: &str, uid: &str, warning: bool, reason: &str, action: &str, note: &str) {
        let (ns, name) = split(key);
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(ns.to_string()),
            name: Some(name.to_string()),
            uid: Some(uid.to_string()),
            ..Default::default()
        };
        // An Event note is at most 1 kB.
        let note: String = note.chars().take(1000).collect();
        let ev = Event {
            type_: if warning { EventType::Warning } else { EventType::Normal },
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            tracing::debug!(service = key, error = %e, "could not record an Event");
        }
    }
}
