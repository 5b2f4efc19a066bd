//! What the controller needs from the Kubernetes API, as a trait, and the VIF backend
//! ([`crate::backend::VifBackend`]) it hands out directly ([`Cluster::backend`]): the reconcile
//! logic ([`crate::controller`]) stays free of kube, and its tests run against an in-memory fake.
//! [`crate::k8s::api::KubeCluster`] is the real thing, with the backend of [`crate::backend`] (the
//! embedded IPAM or Neutron).
//!
//! Every operation is idempotent, and every write that could hit another pod of the same name
//! carries the pod's uid as a precondition.

use std::future::Future;

use crate::backend::VifBackend;
use crate::core::{AttachedRecord, PodKey, VifRecord, VifState};
use crate::error::ClusterError;

/// Event reasons, as `kubectl describe pod` shows them.
pub const REASON_ALLOCATION_FAILED: &str = "VifAllocationFailed";
/// See [`REASON_ALLOCATION_FAILED`].
pub const REASON_RELEASE_FAILED: &str = "VifReleaseFailed";

/// The pod's metadata as the API holds it now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodMeta {
    /// metadata.finalizers.
    pub finalizers: Vec<String>,
    /// metadata.deletionTimestamp is set.
    pub deleting: bool,
}

/// The VIF a PodVif records and its state.
pub type Recorded = Option<(VifRecord, VifState)>;

/// A pod's PodVif as [`Cluster::ensure_pod_vif`] found or made it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Ensured {
    /// The VIF it records (`spec.vif`, or an earlier version's `status.vif`) and its state.
    pub recorded: Recorded,
    /// Its resourceVersion then: [`Cluster::record_vif`] writes only over that version, so that
    /// of two allocators racing for one pod exactly one records its VIF.
    pub version: String,
    /// Its metadata.uid: [`Cluster::delete_pod_vif`] deletes exactly this object.
    pub uid: String,
    /// Its status holds something a new record must clear first: a state other than
    /// `Allocated`, or the VIF of a PodVif written by an earlier version.
    pub status_set: bool,
}

/// The cluster operations of the controller. Implementations are cheap to share.
pub trait Cluster: Send + Sync + 'static {
    /// The VIF backend the cluster was built with: the controller allocates, releases and
    /// watches VIFs through it directly.
    type Backend: VifBackend;

    /// See [`Cluster::Backend`].
    fn backend(&self) -> &Self::Backend;

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

    /// Creates the pod's PodVif recording `vif` (in the spec: one request) unless it exists;
    /// returns what it records and its version — `vif`, `Allocated`, for one this call created.
    /// [`ClusterError::StalePodVif`] when the name is held by an earlier pod.
    fn ensure_pod_vif(
        &self,
        pod: &PodKey,
        node: &str,
        vif: &VifRecord,
    ) -> impl Future<Output = Result<Ensured, ClusterError>> + Send;

    /// Records `record` (state `Allocated`) in the PodVif found as `found`, provided it is still
    /// at `found.version` ([`ClusterError::Conflict`] otherwise): the status is cleared first
    /// when `found.status_set`, so that a state never stands beside a VIF it was not written
    /// for.
    fn record_vif(
        &self,
        pod: &PodKey,
        record: &VifRecord,
        found: &Ensured,
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

    /// Allocates the pod's further interfaces on `node`, one per network its
    /// `k8s.v1.cni.cncf.io/networks` annotation (`networks`) names (idempotent per pod uid and
    /// network). All or nothing: on an error, what this call allocated is given back.
    fn attach(
        &self,
        _pod: &PodKey,
        _node: &str,
        _networks: &str,
    ) -> impl Future<Output = Result<Vec<AttachedRecord>, ClusterError>> + Send {
        std::future::ready(Err(ClusterError::Attachment("further interfaces are not supported here".into())))
    }

    /// Gives back the pod's addresses on the further networks `networks` (PodNetwork names).
    fn detach(
        &self,
        _pod: &PodKey,
        _node: &str,
        _networks: &[String],
    ) -> impl Future<Output = Result<(), ClusterError>> + Send {
        std::future::ready(Ok(()))
    }

    /// The PodNetworks the `networks` annotation resolves to now, as far as they resolve (for
    /// cleanup: never an error).
    fn attached_networks(&self, _pod: &PodKey, _networks: &str) -> impl Future<Output = Vec<String>> + Send {
        std::future::ready(Vec::new())
    }

    /// Writes the pod's `k8s.v1.cni.cncf.io/network-status` annotation.
    fn network_status(&self, _pod: &PodKey, _value: &str) -> impl Future<Output = Result<(), ClusterError>> + Send {
        std::future::ready(Ok(()))
    }

    /// Tells the pod's users why its VIF is late (a Warning Event); best effort.
    fn warn(&self, pod: &PodKey, reason: &'static str, note: String) -> impl Future<Output = ()> + Send;
}
