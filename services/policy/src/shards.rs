//! Sharding by node ([`kuryr_shard`], `--shards`): replicas split the nodes through Kubernetes
//! Leases, as the allocator's replicas do. Every replica follows the watcher and compiles the
//! whole cluster (a pod anywhere may be a peer of a pod on any node), but streams and answers
//! only for the nodes whose shard it owns.
//!
//! - WatchPolicies and GetNodePolicy for a node served by another replica fail with UNAVAILABLE
//!   naming the owner, with the trailer `kuryr-shard-owner: HOST:PORT` when its endpoint is
//!   known; binders follow it, and fall back to `--policy` when the owner cannot be reached.
//! - A node's streams end that way when its shard moves (a new replica took its fair share, or
//!   this one lost its Lease); the binder resumes from the new owner, which holds the same
//!   compiled state (its own log: the resume point of another replica is answered with a
//!   snapshot, and the binder programs only the difference).
//! - A replica killed: its Leases expire and the others take its shards within the Lease
//!   duration plus one renewal interval; the rules already programmed stay in force meanwhile.

use std::sync::Arc;

use kuryr_shard::Ownership;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tonic::Status;

pub use kuryr_shard::OWNER_METADATA;

/// Refusals by method.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RedirectLabels {
    /// `WatchPolicies` or `GetNodePolicy`.
    pub method: &'static str,
}

/// The nodes this replica serves; cheap to clone.
#[derive(Clone, Debug)]
pub struct Shards {
    ownership: watch::Receiver<Arc<Ownership>>,
    redirects: Family<RedirectLabels, Counter>,
}

impl Shards {
    /// Serving every node: no sharding.
    pub fn all() -> Self {
        Self::new(kuryr_shard::ShardHandle::unsharded("all").ownership())
    }

    /// Following `ownership`.
    pub fn new(ownership: watch::Receiver<Arc<Ownership>>) -> Self {
        Self { ownership, redirects: Family::default() }
    }

    /// Registers `kuryr_policy_redirects_total{method}`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kuryr_policy_redirects",
            "Calls refused because another replica owns the node's shard, by method",
            self.redirects.clone(),
        );
    }

    /// The ownership, following its changes.
    pub fn watch(&self) -> watch::Receiver<Arc<Ownership>> {
        self.ownership.clone()
    }

    /// The ownership now.
    pub fn ownership(&self) -> Arc<Ownership> {
        self.ownership.borrow().clone()
    }

    /// Whether this replica serves `node` now.
    pub fn serves(&self, node: &str) -> bool {
        let own = self.ownership.borrow();
        own.shard_of(node).is_none_or(|i| own.owned.contains(&i))
    }

    /// `Ok` when `node` is served here, else the UNAVAILABLE to answer `method` with.
    pub fn check(&self, node: &str, method: &'static str) -> Result<(), Status> {
        if self.serves(node) {
            return Ok(());
        }
        self.redirects.get_or_create(&RedirectLabels { method }).inc();
        Err(self.refusal(node))
    }

    /// The UNAVAILABLE telling a client that `node` is served elsewhere (and where, if known).
    pub fn refusal(&self, node: &str) -> Status {
        kuryr_shard::refusal(&self.ownership(), node, "kuryr-policy")
    }

    /// Resolves once `node` is no longer served here.
    pub async fn lost(&self, node: &str) {
        let mut own = self.ownership.clone();
        loop {
            own.borrow_and_update();
            if !self.serves(node) {
                return;
            }
            if own.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn unsharded_serves_every_node() {
        let s = Shards::all();
        assert!(s.serves("node-1") && s.check("anything", "WatchPolicies").is_ok());
    }

    #[test]
    fn pending_refuses_until_the_shards_are_known() {
        let (_tx, rx) = watch::channel(Arc::new(Ownership::pending("me", 4)));
        let s = Shards::new(rx);
        let e = s.check("node-1", "WatchPolicies").unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert!(e.message().contains("does not know its shards yet"), "{}", e.message());
    }
}
