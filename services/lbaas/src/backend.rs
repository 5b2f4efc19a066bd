//! Backends: what turns a desired load balancer into a working one. The controller is the same
//! for all of them; a backend only programs and removes, and says what it observed.
//!
//! [`NodeBackend`] (the embedded default) publishes each spec to the [`LbLog`] that
//! `WatchLoadBalancers` streams to every node's binder, which programs nftables. It reports a
//! load balancer `PROGRAMMED` at the generation it published: the stream is the hand-over, and
//! the binders apply each spec atomically (and from the snapshot after any restart).
//! [`crate::octavia::OctaviaBackend`] programs Octavia load balancers.

use std::future::Future;

use kuryr_proto::lbaas::v1::LoadBalancerSpec;
use kuryr_stream::SharedLog;

/// The published specs, by `namespace/name`: what `WatchLoadBalancers` streams.
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
    pub records: crate::controller::Records,
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

/// The embedded node dataplane: specs streamed to every binder.
#[derive(Clone, Debug)]
pub struct NodeBackend {
    log: LbLog,
}

impl NodeBackend {
    /// Publishes into `log`.
    pub fn new(log: LbLog) -> Self {
        Self { log }
    }
}

impl Backend for NodeBackend {
    fn name(&self) -> &'static str {
        "node"
    }

    fn recover(&self, specs: Vec<(String, LoadBalancerSpec)>) {
        let mut log = kuryr_stream::log::lock(&self.log);
        for (key, spec) in specs {
            log.upsert(key, spec);
        }
    }

    async fn ensure(&self, key: &str, spec: &LoadBalancerSpec) -> Result<Observed, BackendError> {
        kuryr_stream::log::lock(&self.log).upsert(key.to_string(), spec.clone());
        Ok(Observed {
            provisioning_status: PROGRAMMED.into(),
            observed_generation: spec.generation,
            ..Default::default()
        })
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        kuryr_stream::log::lock(&self.log).remove(&key.to_string());
        Ok(())
    }

    fn mirror(&self, key: &str, spec: Option<LoadBalancerSpec>) {
        let mut log = kuryr_stream::log::lock(&self.log);
        let key = key.to_string();
        match spec {
            // An older generation of the same Service never replaces a newer one; an equal spec
            // records nothing (the log compares), so an owner change is silent on the stream.
            Some(spec) => {
                let stale = log.get(&key).is_some_and(|cur| cur.uid == spec.uid && cur.generation > spec.generation);
                if !stale {
                    log.upsert(key, spec);
                }
            }
            None => {
                log.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_stream::{Epoch, Log};

    use super::*;

    fn spec(uid: &str, generation: u64, vip: &str) -> LoadBalancerSpec {
        LoadBalancerSpec {
            namespace: "ns".into(),
            name: "web".into(),
            uid: uid.into(),
            vips: vec![vip.into()],
            generation,
            ..Default::default()
        }
    }

    #[test]
    fn mirrored_records_never_go_back_and_repeat_nothing() {
        let log: LbLog = Log::new(Epoch::random(), 64).shared();
        kuryr_stream::log::lock(&log).set_ready();
        let b = NodeBackend::new(log.clone());
        let rev = || kuryr_stream::log::lock(&log).revision();
        b.mirror("ns/web", Some(spec("u1", 3, "10.96.0.1")));
        assert_eq!(rev(), 1);
        // The same spec again (a new owner publishing what the old one did): nothing streamed.
        b.mirror("ns/web", Some(spec("u1", 3, "10.96.0.1")));
        assert_eq!(rev(), 1);
        // An older generation of the same Service arriving late: ignored.
        b.mirror("ns/web", Some(spec("u1", 2, "10.96.0.9")));
        assert_eq!(kuryr_stream::log::lock(&log).get(&"ns/web".to_string()).unwrap().generation, 3);
        // Newer, or a Service re-created under the name (any generation): applied.
        b.mirror("ns/web", Some(spec("u1", 4, "10.96.0.2")));
        b.mirror("ns/web", Some(spec("u2", 1, "10.96.0.3")));
        assert_eq!(rev(), 3);
        assert_eq!(kuryr_stream::log::lock(&log).get(&"ns/web".to_string()).unwrap().uid, "u2");
        b.mirror("ns/web", None);
        assert!(kuryr_stream::log::lock(&log).get(&"ns/web".to_string()).is_none());
        assert_eq!(rev(), 4);
    }
}
