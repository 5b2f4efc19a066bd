//! The backend a running allocator was started with: one enum over the implementations of
//! [`VifBackend`], so that the controller, the shard hand-over and the VIF streams stay generic
//! over none of them. It depends on every backend; no backend depends on it.

use std::sync::Arc;

use crate::backend::VifBackend;
use crate::backend::embedded::EmbeddedBackend;
use crate::backend::neutron::NeutronBackend;
use crate::core::{PodKey, VifRecord};
use crate::error::ClusterError;

/// The backend an allocator runs with.
#[derive(Debug, Clone)]
pub enum AnyBackend {
    /// The embedded IPAM.
    Embedded(EmbeddedBackend),
    /// Neutron ports.
    Neutron(Arc<NeutronBackend>),
}

impl AnyBackend {
    /// A VIF found recorded (a restart, a shard taken over): with Neutron, its further ports
    /// must be ACTIVE too before it is READY.
    pub fn expect_extras(&self, pod_uid: &str, record: &VifRecord) {
        if let AnyBackend::Neutron(b) = self
            && !record.attachments.is_empty()
        {
            b.expect_extras(pod_uid, record.attachments.iter().map(|a| a.vif_id.clone()).collect());
        }
    }
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
