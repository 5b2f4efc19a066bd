//! Why an operation of the controller's cluster or of a VIF backend failed ([`ClusterError`]),
//! with the short labels metrics and Events use; why a reconcile ([`ReconcileError`]) or a plug
//! report ([`PlugError`]) failed; and [`chain`] for logs.

use std::error::Error as StdError;

use crate::backend::ipam::StoreError;
use crate::core::PodKey;

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
    /// The pod's `k8s.v1.cni.cncf.io/networks` cannot be honoured (malformed, an unknown or
    /// unusable NetworkAttachmentDefinition); the message says why.
    #[error("{0}")]
    Attachment(String),
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
            ClusterError::Attachment(_) => "network_attachment",
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
            "network_attachment" => Some("NetworkAttachmentFailed"),
            _ => None,
        }
    }
}

kuryr_runtime::from_api_failure!(ClusterError);

/// A failed reconcile.
#[derive(Debug, thiserror::Error)]
#[error("{op} of pod {}/{} failed while {step}", pod.namespace, pod.name)]
pub struct ReconcileError {
    /// `apply` or `cleanup`.
    pub op: &'static str,
    /// What was being done.
    pub step: &'static str,
    /// The pod.
    pub pod: PodKey,
    /// The pod is gone from the API (no Event can be shown on it).
    pub gone: bool,
    /// Why.
    #[source]
    pub source: ClusterError,
}

/// Why a ReportPlugged was refused.
#[derive(Debug, thiserror::Error)]
pub enum PlugError {
    /// No VIF for the pod.
    #[error("{0}")]
    NotFound(String),
    /// The report names another VIF or node than the pod's.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The state could not be recorded; try again.
    #[error("{0}")]
    Unavailable(String),
}

/// An error and its causes on one line, for logs and Events.
pub use kuryr_runtime::telemetry::error_chain as chain;
