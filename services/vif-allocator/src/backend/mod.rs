//! The VIF backend boundary: where a pod's VIF comes from, where it goes back to, and what makes
//! a plugged VIF ready. The reconcile logic ([`crate::controller`]) is the same for every
//! backend; it calls the backend [`crate::k8s::api::KubeCluster`] was built with directly, through
//! [`crate::cluster::Cluster::backend`].
//!
//! - [`embedded::EmbeddedBackend`]: addresses from the embedded IPAM ([`crate::backend::ipam`]); a plugged
//!   VIF is ready at once.
//! - [`neutron::NeutronBackend`]: a Neutron port per pod (from a pool when one is warm); a
//!   plugged VIF is ready once Neutron reports the port ACTIVE, which a poller watches.
//!
//! [`any::AnyBackend`] is the one an allocator runs with.
//!
//! Every operation is idempotent per pod uid: allocating twice yields the same VIF, releasing
//! what was never allocated is a no-op.

pub mod any;
pub mod embedded;
pub mod ipam;
pub mod neutron;

use std::future::Future;

use crate::core::{PodKey, VifRecord};
use crate::error::ClusterError;

/// What every VIF backend does.
pub trait VifBackend: Send + Sync + 'static {
    /// `embedded` or `neutron`: the `backend` of the VIFs it hands out.
    fn name(&self) -> &'static str;

    /// The VIF of `pod` on `node`, allocating it unless the pod already holds one.
    fn allocate(&self, pod: &PodKey, node: &str) -> impl Future<Output = Result<VifRecord, ClusterError>> + Send;

    /// Gives back whatever the pod holds (searching `node` first when given); returns whether
    /// anything was held.
    fn release(&self, pod: &PodKey, node: &str) -> impl Future<Output = Result<bool, ClusterError>> + Send;

    /// Whether the pod still holds what `record` describes (a read made now). When two
    /// allocators raced for one pod, the VIF on record in the PodVif is the one that stays.
    fn holds(
        &self,
        pod: &PodKey,
        node: &str,
        record: &VifRecord,
    ) -> impl Future<Output = Result<bool, ClusterError>> + Send;

    /// Gives back what `ours` holds for the pod and `keep` does not: an allocation that lost to
    /// the one on record.
    fn discard(
        &self,
        pod: &PodKey,
        node: &str,
        ours: &VifRecord,
        keep: &VifRecord,
    ) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Whether a VIF the binder reports plugged is ready at once. When not, the backend's
    /// readiness source tells (see [`VifBackend::watch_ready`]).
    fn ready_when_plugged(&self) -> bool;

    /// Starts (`watch`) or stops watching the readiness of a plugged VIF; the backend's
    /// readiness source reports `(pod uid, vif id)` once it is ready.
    fn watch_ready(&self, pod_uid: &str, vif_id: &str, watch: bool);
}
