//! What the controller needs of the Kubernetes API, as a trait: the Service's metadata and
//! finalizer, the ServiceLoadBalancer records, the Service's ingress and Events. [`crate::k8s::api::Kube`]
//! implements it against the API server; the controller's unit tests use an in-memory one.
//!
//! Every write that could hit another object of the same name takes the uid it expects.

pub mod api;
pub mod crd;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use crate::k8s::crd::{ServiceLoadBalancerSpec, ServiceLoadBalancerStatus};

/// Why a Kubernetes call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The object changed since it was read, or no longer holds what a precondition expected.
    #[error("{0}")]
    Conflict(String),
    /// The object does not exist.
    #[error("{0}")]
    NotFound(String),
    /// Another failure.
    #[error("{action}")]
    Api {
        /// What was being done.
        action: String,
        /// The client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl ClusterError {
    /// A short, bounded label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            ClusterError::Conflict(_) => "conflict",
            ClusterError::NotFound(_) => "not_found",
            ClusterError::Api { .. } => "api",
        }
    }
}

kuryr_runtime::from_api_failure!(ClusterError);

/// A Service's metadata as the API holds it now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceMeta {
    /// metadata.uid.
    pub uid: String,
    /// metadata.finalizers.
    pub finalizers: Vec<String>,
    /// metadata.deletionTimestamp is set.
    pub deleting: bool,
}

/// A record as the API returned it.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// The record's own uid (for preconditions).
    pub uid: String,
    /// metadata.generation.
    pub generation: u64,
    /// The desired load balancer.
    pub spec: ServiceLoadBalancerSpec,
    /// What the backend observed.
    pub status: Option<ServiceLoadBalancerStatus>,
}

/// The records by Service key: what Get/List answer, and what reconciles compare against.
pub type Records = Arc<Mutex<BTreeMap<String, Record>>>;

/// The Kubernetes operations of the controller, by Service key (`namespace/name`).
pub trait Cluster: Send + Sync + 'static {
    /// The Service's metadata; `None` when it does not exist.
    fn service(&self, key: &str) -> impl Future<Output = Result<Option<ServiceMeta>, ClusterError>> + Send;

    /// Adds our finalizer to the Service of `uid`, given the finalizers just read.
    fn add_finalizer(
        &self,
        key: &str,
        uid: &str,
        current: &[String],
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Removes our finalizer from the Service of `uid`, given the finalizers just read; a
    /// Service that is gone is fine.
    fn remove_finalizer(
        &self,
        key: &str,
        uid: &str,
        current: &[String],
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Creates the record of `key`, owned by the Service `spec.service_uid`; an existing record
    /// is returned as it is.
    fn create_record(
        &self,
        key: &str,
        spec: &ServiceLoadBalancerSpec,
    ) -> impl Future<Output = Result<Record, ClusterError>> + Send;

    /// Replaces the spec (and the owner, when the Service was re-created) of the record `uid`.
    fn replace_spec(
        &self,
        key: &str,
        uid: &str,
        spec: &ServiceLoadBalancerSpec,
    ) -> impl Future<Output = Result<Record, ClusterError>> + Send;

    /// Writes the record's status.
    fn write_status(
        &self,
        key: &str,
        status: &ServiceLoadBalancerStatus,
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Sets the Service's `status.loadBalancer.ingress` to `ips` (empty clears it), only while it
    /// is the Service of `uid`; a Service that is gone is fine.
    fn set_ingress(
        &self,
        key: &str,
        uid: &str,
        ips: &[String],
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Deletes the record `uid` of `key`; none is fine.
    fn delete_record(&self, key: &str, uid: &str) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Tells the Service's users something (an Event on the Service); best effort.
    fn event(
        &self,
        key: &str,
        uid: &str,
        warning: bool,
        reason: &str,
        action: &str,
        note: &str,
    ) -> impl Future<Output = ()> + Send;
}
