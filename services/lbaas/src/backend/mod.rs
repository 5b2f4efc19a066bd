//! Backends: what turns a desired load balancer into a working one. The controller is the same
//! for all of them; a backend only programs and removes, and says what it observed.
//!
//! [`node::NodeBackend`] (the embedded default) publishes each spec to the [`LbLog`] that
//! `WatchLoadBalancers` streams to every node's binder, which programs nftables. It reports a
//! load balancer `PROGRAMMED` at the generation it published: the stream is the hand-over, and
//! the binders apply each spec atomically (and from the snapshot after any restart).
//! [`crate::backend::octavia::OctaviaBackend`] programs Octavia load balancers.

use std::future::Future;

pub mod node;
pub mod octavia;

use crate::core::lb::LoadBalancerSpec;
use kuryr_stream::SharedLog;

pub use node::NodeBackend;

/// The published specs, by `namespace/name`: what `WatchLoadBalancers` streams (the gRPC edge
/// builds each response's message from the shared spec).
pub type LbLog = SharedLog<String, LoadBalancerSpec>;

/// The node backend's provisioning status.
pub const PROGRAMMED: &str = "PROGRAMMED";

/// What a backend observed after programming a spec.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// `PROGRAMMED`, `ACTIVE`, `PENDING_*`, `ERROR`.
    pub provisioning_status: String,
    /// The generation it converged to.
    pub observed_generation: u64,
    /// The backend's id of the load balancer; empty when it has none.
    pub backend_id: String,
    /// The external address (type=LoadBalancer), when there is one.
    pub ingress_ip: String,
    /// Detail for humans.
    pub message: String,
}

/// Why a backend failed.
#[derive(Debug, thiserror::Error)]
#[error("{backend} backend: {message}")]
pub struct BackendError {
    /// The backend's name.
    pub backend: &'static str,
    /// A short, bounded label for metrics (`busy`, `unavailable`, `error_state`, ...).
    pub reason: &'static str,
    /// What went wrong.
    pub message: String,
    /// What the backend saw, to record in the status although it did not converge (its
    /// `observed_generation` is ignored: the record keeps the last converged one).
    pub observed: Option<Observed>,
}

/// What a backend's background maintenance (drift repair, garbage collection) may use.
#[derive(Clone)]
pub struct Maintenance {
    /// The records, by Service key: what should exist.
    pub records: crate::k8s::Records,
    /// Queues a Service key for reconciling.
    pub enqueue: std::sync::Arc<dyn Fn(&str) + Send + Sync>,
    /// Ends the maintenance.
    pub shutdown: kuryr_runtime::Shutdown,
    /// Whether this replica reconciles the Service of a key now (its shard is served here):
    /// repair and garbage collection touch nothing else — a load balancer of another shard is
    /// not an orphan.
    pub serves: std::sync::Arc<dyn Fn(&str) -> bool + Send + Sync>,
    /// Notified when shards were gained: a pass for them runs at once.
    pub kick: std::sync::Arc<tokio::sync::Notify>,
    /// The Services: garbage collection waits until they are known ([`View::settled`]), and a
    /// load balancer without a record whose Service is there ([`View::holds`]: made before this
    /// lbaas ran, or adopted from Kuryr) is that Service's reconcile's to take or remove.
    ///
    /// [`View::settled`]: crate::core::view::View::settled
    /// [`View::holds`]: crate::core::view::View::holds
    pub view: crate::core::view::SharedView,
}

impl std::fmt::Debug for Maintenance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Maintenance").finish_non_exhaustive()
    }
}

/// A load balancer backend. Implementations are cheap to share; every operation is idempotent.
pub trait Backend: Send + Sync + 'static {
    /// The backend's name, as recorded in the CRD and the `LoadBalancer` message.
    fn name(&self) -> &'static str;

    /// At start, before any reconcile: the specs recorded in the API (by key), as last programmed.
    fn recover(&self, specs: Vec<(String, LoadBalancerSpec)>);

    /// Programs `spec` for the Service `key`.
    fn ensure(&self, key: &str, spec: &LoadBalancerSpec)
    -> impl Future<Output = Result<Observed, BackendError>> + Send;

    /// Removes the load balancer of `key`; nothing to remove is fine.
    fn delete(&self, key: &str) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Starts background maintenance once the records are recovered and the workers run; none
    /// by default.
    fn maintain(&self, _ctx: Maintenance) {}

    /// The record of `key`, written by the replica that owns its shard, as last seen in the API
    /// (`None`: deleted). The node backend streams it, so that binders connected to any replica
    /// get every Service; nothing by default.
    fn mirror(&self, _key: &str, _spec: Option<LoadBalancerSpec>) {}

    /// Forgets what is remembered of the Services whose key matches: their shard moved, so
    /// another replica may have changed them meanwhile. Nothing by default.
    fn forget(&self, _which: &dyn Fn(&str) -> bool) {}
}
