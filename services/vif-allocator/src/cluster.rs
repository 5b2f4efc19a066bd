//! What the controller needs from the Kubernetes API and the VIF backend, as a trait: the
//! reconcile logic ([`crate::controller`]) stays free of kube, and its tests run against an
//! in-memory fake. [`crate::k8s::KubeCluster`] is the real thing, with the backend of
//! [`crate::backend`] (the embedded IPAM or Neutron).
//!
//! Every operation is idempotent, and every write that could hit another pod of the same name
//! carries the pod's uid as a precondition.

use std::error::Error as StdError;
use std::future::Future;

use crate::crd::{VifRecord, VifState};
use crate::ipam::store::{PodKey, StoreError};

/// The pod's metadata as the API holds it now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodMeta {
    /// metadata.finalizers.
    pub finalizers: Vec<String>,
    /// metadata.deletionTimestamp is set.
    pub deleting: bool,
}

/// What a PodVif's status holds.
pub type Recorded = Option<(VifRecord, VifState)>;

/// A pod's PodVif as [`Cluster::ensure_pod_vif`] found or made it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Ensured {
    /// What its status holds.
    pub recorded: Recorded,
    /// Its resourceVersion then: [`Cluster::record_vif`] writes only over that version, so that
    /// of two allocators racing for one pod exactly one records its VIF.
    pub version: String,
    /// Its metadata.uid: [`Cluster::delete_pod_vif`] deletes exactly this object.
    pub uid: String,
}

/// Why a cluster operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The PodVif named after the pod belongs to an earlier pod of that name whose cleanup has
    /// not run yet.
    #[error("PodVif {namespace}/{name} belongs to an earlier pod (uid {other_uid}) that is being cleaned up")]
    StalePodVif {
        /// The namespace.
        namespace: String,
        /// The pod's (and PodVif's) name.
        name: String,
        /// The earlier pod's uid.
        other_uid: String,
        /// The earlier pod's node.
        node: String,
    },
    /// The object changed since it was read, or no longer holds what a precondition expected.
    #[error("{0}")]
    Conflict(String),
    /// The object does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The IPAM refused or failed.
    #[error("IPAM")]
    Ipam(#[source] StoreError),
    /// A Neutron call failed.
    #[error("{action}")]
    Neutron {
        /// What was being done.
        action: String,
        /// The client's error (quota, unavailable, ...); boxed, it is large.
        #[source]
        source: Box<kuryr_openstack::Error>,
    },
    /// Neutron could not bind the pod's port to the node; the port was deleted.
    #[error(
        "Neutron could not bind port {port} to host {host} (binding_failed; is an L2 agent running there?); \
         the port was deleted and another is tried"
    )]
    BindingFailed {
        /// The port.
        port: String,
        /// Its `binding:host_id`: the pod's node.
        host: String,
    },
    /// The backend is not ready to allocate yet (recovering).
    #[error("{0}")]
    NotReady(String),
    /// A Kubernetes API call failed.
    #[error("{action}")]
    Api {
        /// What was being done.
        action: String,
        /// The client's error.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
}

impl ClusterError {
    /// A short, bounded label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            ClusterError::StalePodVif { .. } => "stale_podvif",
            ClusterError::Conflict(_) => "conflict",
            ClusterError::NotFound(_) => "not_found",
            ClusterError::Ipam(e) => match e {
                StoreError::NetworkNotFound(_) => "network_not_found",
                StoreError::InvalidNetwork { .. } => "invalid_network",
                StoreError::Exhausted { .. } => "ipam_exhausted",
                StoreError::Contention { .. } => "ipam_contention",
                StoreError::Kube { .. } => "api",
                _ => "ipam",
            },
            ClusterError::Neutron { source, .. } => match &**source {
                kuryr_openstack::Error::QuotaExceeded(_) => "neutron_quota_exceeded",
                e if e.is_transient() => "neutron_unavailable",
                _ => "neutron",
            },
            ClusterError::BindingFailed { .. } => "binding_failed",
            ClusterError::NotReady(_) => "not_ready",
            ClusterError::Api { .. } => "api",
        }
    }

    /// The reason of the Warning Event for this failure when it deserves its own (the pod's
    /// users can act on it), `None` for the generic one.
    pub fn event_reason(&self) -> Option<&'static str> {
        match self.reason() {
            "neutron_quota_exceeded" => Some("NeutronQuotaExceeded"),
            "neutron_unavailable" => Some("NeutronUnavailable"),
            "binding_failed" => Some("PortBindingFailed"),
            _ => None,
        }
    }
}

/// The cluster operations of the controller. Implementations are cheap to share.
pub trait Cluster: Send + Sync + 'static {
    /// The pod's current metadata; `None` when no pod of that name and uid exists.
    fn pod(&self, pod: &PodKey) -> impl Future<Output = Result<Option<PodMeta>, ClusterError>> + Send;

    /// Adds our finalizer, given the finalizers just read (a precondition: a concurrent change
    /// fails with [`ClusterError::Conflict`]).
    fn add_finalizer(&self, pod: &PodKey, current: &[String]) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Removes our finalizer, given the finalizers just read.
    fn remove_finalizer(
        &self,
        pod: &PodKey,
        current: &[String],
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Creates the pod's PodVif (spec only) unless it exists; returns what its status holds and
    /// its version. [`ClusterError::StalePodVif`] when the name is held by an earlier pod.
    fn ensure_pod_vif(&self, pod: &PodKey, node: &str) -> impl Future<Output = Result<Ensured, ClusterError>> + Send;

    /// Writes the PodVif's status (the VIF and its state), provided the PodVif is still at
    /// `version` ([`ClusterError::Conflict`] otherwise).
    fn record_vif(
        &self,
        pod: &PodKey,
        record: &VifRecord,
        state: VifState,
        version: &str,
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Writes only the state, provided the PodVif still records `vif_id`
    /// ([`ClusterError::Conflict`] otherwise, [`ClusterError::NotFound`] without a PodVif).
    fn record_state(
        &self,
        pod: &PodKey,
        vif_id: &str,
        state: VifState,
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Deletes the pod's PodVif if it is this pod's; no PodVif is fine. With `known`, the
    /// PodVif's uid as created or read earlier, no read is needed: only that object can be
    /// deleted (a uid precondition), and one of another uid under the name is another pod's.
    fn delete_pod_vif(
        &self,
        pod: &PodKey,
        known: Option<&str>,
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Allocates the pod's addresses on `node` (idempotent per pod uid).
    fn allocate(&self, pod: &PodKey, node: &str) -> impl Future<Output = Result<VifRecord, ClusterError>> + Send;

    /// Releases every address the pod holds (searching `node`'s blocks when given); returns
    /// whether anything was released.
    fn release(&self, pod: &PodKey, node: &str) -> impl Future<Output = Result<bool, ClusterError>> + Send;

    /// Whether the pod still holds what `record` describes in the backend (a read made now).
    fn holds(
        &self,
        pod: &PodKey,
        node: &str,
        record: &VifRecord,
    ) -> impl Future<Output = Result<bool, ClusterError>> + Send;

    /// Gives back what `ours` holds for the pod and `keep` does not.
    fn discard(
        &self,
        pod: &PodKey,
        node: &str,
        ours: &VifRecord,
        keep: &VifRecord,
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Whether a VIF the binder reports plugged is READY at once (the embedded backend) or only
    /// once the backend confirms it (Neutron: port ACTIVE), see [`Cluster::watch_ready`].
    fn ready_when_plugged(&self) -> bool {
        true
    }

    /// Starts (`watch`) or stops watching a plugged VIF's readiness in the backend.
    fn watch_ready(&self, _pod_uid: &str, _vif_id: &str, _watch: bool) {}

    /// Tells the pod's users why its VIF is late (a Warning Event); best effort.
    fn warn(&self, pod: &PodKey, reason: &'static str, note: String) -> impl Future<Output = ()> + Send;
}

/// An error and its causes on one line, for logs and Events.
pub fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
