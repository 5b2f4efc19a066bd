//! What can go wrong, and the argument checks that say so early.

use std::sync::Arc;

use super::MAX_NETWORK_NAME;
use crate::core::ipam::ipnet::IpNet;
use crate::core::ipam::{Block, PlanError};

/// Why an IPAM operation failed. Cloneable: one failed write of a batch fails every request in
/// it (see [`super::IpamStore`]), and each caller gets the same error.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// No PodNetwork of that name.
    #[error("pod network {0:?} does not exist")]
    NetworkNotFound(String),
    /// The PodNetwork's spec is unusable.
    #[error("pod network {network:?} is invalid")]
    InvalidNetwork {
        /// The network.
        network: String,
        /// What is wrong.
        #[source]
        source: PlanError,
    },
    /// A name or uid the store cannot work with.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// Which argument.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// Every block of the node is full and no block of the network is left to claim.
    #[error(
        "pod network {network:?} is exhausted ({cidr}): node {node:?} has no free address in its blocks \
         and no unclaimed /{block_prefix} block is left"
    )]
    Exhausted {
        /// The network.
        network: String,
        /// The exhausted CIDR.
        cidr: IpNet,
        /// The node asking.
        node: String,
        /// Block size.
        block_prefix: u8,
    },
    /// Too many conflicting writes in a row.
    #[error("gave up on pod network {network:?} for node {node:?} after {retries} conflicting writes")]
    Contention {
        /// The network.
        network: String,
        /// The node.
        node: String,
        /// Retries made.
        retries: u32,
    },
    /// The deterministic name of a block is taken by an object that is not that block.
    #[error("cannot claim {cidr} for network {network:?}: object {name} exists but is not that block (name clash)")]
    NameCollision {
        /// The object name.
        name: String,
        /// The network.
        network: String,
        /// The block wanted.
        cidr: Block,
    },
    /// An AddressBlock of the network whose CIDR is not a valid block; allocating around it
    /// could overlap it, so the network stops until it is fixed.
    #[error("address block {name} is corrupt")]
    CorruptBlock {
        /// The object name.
        name: String,
        /// What is wrong.
        #[source]
        source: PlanError,
    },
    /// A Kubernetes API call failed.
    #[error("Kubernetes API call failed: {action}")]
    Kube {
        /// What was being done.
        action: String,
        /// The client's error (shared by every request of the batch it failed).
        #[source]
        source: Arc<kube::Error>,
    },
}

pub(super) fn kube_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> StoreError {
    let action = action.into();
    move |source| StoreError::Kube { action, source: Arc::new(source) }
}

/// 409 Conflict (stale resourceVersion) or 404 (the block vanished): re-read and try again.
pub(super) fn is_retryable(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_conflict() || s.is_not_found())
}

/// Every removal without an outcome fails with `e`; those already carried out report so.
pub(super) fn fail_rest(
    outcome: Vec<Option<Result<bool, StoreError>>>,
    released: Vec<bool>,
    e: &StoreError,
) -> Vec<Result<bool, StoreError>> {
    outcome
        .into_iter()
        .zip(released)
        .map(|(o, r)| o.unwrap_or_else(|| if r { Ok(true) } else { Err(e.clone()) }))
        .collect()
}

pub(super) fn check_non_empty(field: &'static str, value: &str) -> Result<(), StoreError> {
    if value.trim().is_empty() {
        return Err(StoreError::InvalidArgument { field, reason: "must not be empty".into() });
    }
    Ok(())
}

pub(super) fn check_network_name(network: &str) -> Result<(), StoreError> {
    check_non_empty("network", network)?;
    if network.len() > MAX_NETWORK_NAME {
        return Err(StoreError::InvalidArgument {
            field: "network",
            reason: format!("{network:?} is longer than {MAX_NETWORK_NAME} characters (block names add up to 44)"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_names_leave_room_for_block_names() {
        assert!(check_network_name("pods").is_ok());
        assert!(matches!(check_network_name(""), Err(StoreError::InvalidArgument { .. })));
        assert!(check_network_name(&"n".repeat(MAX_NETWORK_NAME)).is_ok());
        assert!(matches!(
            check_network_name(&"n".repeat(MAX_NETWORK_NAME + 1)),
            Err(StoreError::InvalidArgument { .. })
        ));
    }
}
