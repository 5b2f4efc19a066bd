//! The VIF backend boundary: where a pod's VIF comes from, where it goes back to, and what makes
//! a plugged VIF ready. The reconcile logic ([`crate::controller`]) is the same for every
//! backend; [`crate::k8s::KubeCluster`] hands these calls to the backend it was built with.
//!
//! - [`EmbeddedBackend`]: addresses from the embedded IPAM ([`crate::ipam::store`]); a plugged
//!   VIF is ready at once.
//! - [`crate::neutron::NeutronBackend`]: a Neutron port per pod (from a pool when one is warm);
//!   a plugged VIF is ready once Neutron reports the port ACTIVE, which a poller watches.
//!
//! Every operation is idempotent per pod uid: allocating twice yields the same VIF, releasing
//! what was never allocated is a no-op.

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;

use crate::cluster::ClusterError;
use crate::crd::VifRecord;
use crate::ipam::store::{IpamStore, PodKey};
use crate::neutron::NeutronBackend;

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

/// The embedded IPAM as a backend.
#[derive(Debug, Clone)]
pub struct EmbeddedBackend {
    store: Arc<IpamStore>,
    network: String,
}

impl EmbeddedBackend {
    /// Addresses of the PodNetwork `network`.
    pub fn new(store: Arc<IpamStore>, network: &str) -> Self {
        Self { store, network: network.to_string() }
    }
}

impl VifBackend for EmbeddedBackend {
    fn name(&self) -> &'static str {
        "embedded"
    }

    async fn allocate(&self, pod: &PodKey, node: &str) -> Result<VifRecord, ClusterError> {
        let a = self.store.allocate(&self.network, node, pod).await.map_err(ClusterError::Ipam)?;
        Ok(VifRecord::from_config(a.vif_id, &a.vif))
    }

    async fn release(&self, pod: &PodKey, node: &str) -> Result<bool, ClusterError> {
        let released = if node.is_empty() {
            self.store.release(&self.network, &pod.uid).await
        } else {
            self.store.release_on_node(&self.network, node, &pod.uid).await
        };
        released.map_err(ClusterError::Ipam)
    }

    async fn holds(&self, pod: &PodKey, node: &str, record: &VifRecord) -> Result<bool, ClusterError> {
        let addresses = addresses(record);
        if addresses.len() != record.ips.len() {
            return Ok(false);
        }
        self.store.holds(&self.network, node, &pod.uid, &addresses).await.map_err(ClusterError::Ipam)
    }

    async fn discard(&self, pod: &PodKey, node: &str, ours: &VifRecord, keep: &VifRecord) -> Result<(), ClusterError> {
        let keep = addresses(keep);
        let give: Vec<IpAddr> = addresses(ours).into_iter().filter(|a| !keep.contains(a)).collect();
        let freed =
            self.store.release_addresses(&self.network, node, &pod.uid, &give).await.map_err(ClusterError::Ipam)?;
        if freed {
            tracing::info!(uid = %pod.uid, node, addresses = ?give, "gave back addresses that lost to the VIF on record");
        }
        Ok(())
    }

    fn ready_when_plugged(&self) -> bool {
        true
    }

    fn watch_ready(&self, _pod_uid: &str, _vif_id: &str, _watch: bool) {}
}

/// The backend an allocator runs with.
#[derive(Debug, Clone)]
pub enum AnyBackend {
    /// The embedded IPAM.
    Embedded(EmbeddedBackend),
    /// Neutron ports.
    Neutron(Arc<NeutronBackend>),
}

impl VifBackend for AnyBackend {
    fn name(&self) -> &'static str {
        match self {
            AnyBackend::Embedded(b) => b.name(),
            AnyBackend::Neutron(b) => b.name(),
        }
    }

    async fn allocate(&self, pod: &PodKey, node: &str) -> Result<VifRecord, ClusterError> {
        match self {
            AnyBackend::Embedded(b) => b.allocate(pod, node).await,
            AnyBackend::Neutron(b) => b.allocate(pod, node).await,
        }
    }

    async fn release(&self, pod: &PodKey, node: &str) -> Result<bool, ClusterError> {
        match self {
            AnyBackend::Embedded(b) => b.release(pod, node).await,
            AnyBackend::Neutron(b) => b.release(pod, node).await,
        }
    }

    async fn holds(&self, pod: &PodKey, node: &str, record: &VifRecord) -> Result<bool, ClusterError> {
        match self {
            AnyBackend::Embedded(b) => b.holds(pod, node, record).await,
            AnyBackend::Neutron(b) => b.holds(pod, node, record).await,
        }
    }

    async fn discard(&self, pod: &PodKey, node: &str, ours: &VifRecord, keep: &VifRecord) -> Result<(), ClusterError> {
        match self {
            AnyBackend::Embedded(b) => b.discard(pod, node, ours, keep).await,
            AnyBackend::Neutron(b) => b.discard(pod, node, ours, keep).await,
        }
    }

    fn ready_when_plugged(&self) -> bool {
        match self {
            AnyBackend::Embedded(b) => b.ready_when_plugged(),
            AnyBackend::Neutron(b) => b.ready_when_plugged(),
        }
    }

    fn watch_ready(&self, pod_uid: &str, vif_id: &str, watch: bool) {
        match self {
            AnyBackend::Embedded(b) => b.watch_ready(pod_uid, vif_id, watch),
            AnyBackend::Neutron(b) => b.watch_ready(pod_uid, vif_id, watch),
        }
    }
}

/// The addresses of a VIF record (those that parse), without their prefix lengths.
fn addresses(record: &VifRecord) -> Vec<IpAddr> {
    record.ips.iter().filter_map(|i| i.address.split('/').next()?.parse().ok()).collect()
}
