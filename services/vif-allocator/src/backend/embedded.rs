//! The embedded backend: a pod's VIF is addresses of the embedded IPAM ([`crate::backend::ipam`],
//! kept in the AddressBlocks of a PodNetwork); a plugged VIF is ready at once.

use std::net::IpAddr;
use std::sync::Arc;

use crate::backend::VifBackend;
use crate::backend::ipam::IpamStore;
use crate::core::{PodKey, VifRecord};
use crate::error::ClusterError;

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

    /// The IPAM store (for the pods' further networks, [`crate::core::attach`]).
    pub fn store(&self) -> &Arc<IpamStore> {
        &self.store
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

/// The addresses of a VIF record (those that parse), without their prefix lengths.
fn addresses(record: &VifRecord) -> Vec<IpAddr> {
    record.ips.iter().filter_map(|i| i.address.split('/').next()?.parse().ok()).collect()
}
