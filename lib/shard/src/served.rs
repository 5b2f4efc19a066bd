//! What a replica serves now, from its Lease [`Ownership`]: the one answer to "is this key
//! (node, Service) mine?" that a sharded service's controller, gRPC methods and hand-over share.
//!
//! - A key is served when its shard is owned and, for a service that must read a shard's state
//!   before working on it ([`Served::after_loading`]: the allocator's VIFs, lbaas' records),
//!   once the hand-over marked the shard loaded. A lost shard stops being served at once, before
//!   the hand-over notices.
//! - A call for a key served elsewhere is refused with [`crate::refusal()`] (UNAVAILABLE naming
//!   the owner, and its endpoint in the `kuryr-shard-owner` trailer) and counted by method.
//! - Unsharded ([`Served::all`]): every key is served.

use std::collections::BTreeSet;
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tonic::Status;

use crate::{Ownership, ShardHandle};

kuryr_runtime::label_set! {
    /// Refusals by method.
    pub struct RedirectLabels {
        /// The gRPC method refused (`WatchVifs`, `GetNodePolicy`, ...).
        method,
    }
}

/// The keys this replica serves; cheap to clone (clones share the loaded set and the counters).
#[derive(Clone, Debug)]
pub struct Served {
    /// Names the service in refusals (`kuryr-vif-allocator`).
    service: &'static str,
    ownership: watch::Receiver<Arc<Ownership>>,
    /// Owned shards whose state is loaded; `None` when owned shards are served at once.
    loaded: Option<Arc<watch::Sender<BTreeSet<u32>>>>,
    redirects: Family<RedirectLabels, Counter>,
}

impl Served {
    /// Serving every key: no sharding.
    pub fn all(service: &'static str) -> Self {
        Self::at_once(service, ShardHandle::unsharded("all").ownership())
    }

    /// Following `ownership`; an owned shard is served as soon as it is owned.
    pub fn at_once(service: &'static str, ownership: watch::Receiver<Arc<Ownership>>) -> Self {
        Self { service, ownership, loaded: None, redirects: Family::default() }
    }

    /// Following `ownership`; an owned shard is served once [`Served::set_loaded`] names it.
    pub fn after_loading(service: &'static str, ownership: watch::Receiver<Arc<Ownership>>) -> Self {
        let loaded = Some(Arc::new(watch::Sender::new(BTreeSet::new())));
        Self { service, ownership, loaded, redirects: Family::default() }
    }

    /// Registers the refusals as `<name>_total{method}` (`kuryr_allocator_redirects`).
    pub fn register_redirects(&self, registry: &mut Registry, name: &str) {
        registry.register(
            name,
            "Calls refused because another replica owns the key's shard, by method",
            self.redirects.clone(),
        );
    }

    /// The ownership now.
    pub fn ownership(&self) -> Arc<Ownership> {
        self.ownership.borrow().clone()
    }

    /// The ownership as it changes.
    pub fn ownership_changes(&self) -> watch::Receiver<Arc<Ownership>> {
        self.ownership.clone()
    }

    /// Whether the replica is sharded at all.
    pub fn sharded(&self) -> bool {
        self.ownership.borrow().sharded()
    }

    /// Whether this replica works on `key` now.
    pub fn serves(&self, key: &str) -> bool {
        let own = self.ownership.borrow();
        match own.shard_of(key) {
            None => true,
            Some(i) => own.owned.contains(&i) && self.loaded.as_ref().is_none_or(|l| l.borrow().contains(&i)),
        }
    }

    /// Whether `key` is in one of `shards`.
    pub fn in_shards(&self, key: &str, shards: &BTreeSet<u32>) -> bool {
        self.ownership.borrow().shard_of(key).is_some_and(|i| shards.contains(&i))
    }

    /// `Ok` when `key` is served here, else the UNAVAILABLE to answer `method` with (counted).
    pub fn check(&self, key: &str, method: &'static str) -> Result<(), Status> {
        if self.serves(key) {
            return Ok(());
        }
        self.redirects.get_or_create(&RedirectLabels { method }).inc();
        Err(self.refusal(key))
    }

    /// The UNAVAILABLE telling a client that `key` is served elsewhere (and where, if known).
    pub fn refusal(&self, key: &str) -> Status {
        crate::refusal(&self.ownership(), key, self.service)
    }

    /// Resolves once `key` is no longer served here.
    pub async fn lost(&self, key: &str) {
        let mut own = self.ownership.clone();
        let mut loaded = self.loaded.as_ref().map(|l| l.subscribe());
        loop {
            own.borrow_and_update();
            if let Some(l) = loaded.as_mut() {
                l.borrow_and_update();
            }
            if !self.serves(key) {
                return;
            }
            let loaded_changed = async {
                match loaded.as_mut() {
                    Some(l) => l.changed().await,
                    None => std::future::pending().await,
                }
            };
            // A closed channel never changes again: wait for the other one.
            tokio::select! {
                r = own.changed() => if r.is_err() { std::future::pending::<()>().await },
                r = loaded_changed => if r.is_err() { std::future::pending::<()>().await },
            }
        }
    }

    /// Sets the owned shards whose state is loaded (ignored when shards are served at once).
    pub fn set_loaded(&self, shards: BTreeSet<u32>) {
        if let Some(l) = &self.loaded {
            l.send_replace(shards);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use super::*;
    use crate::Owner;

    fn ownership(owned: &[u32], owner: Option<&str>) -> Arc<Ownership> {
        let mut o = Ownership::pending("me", 4);
        o.ready = true;
        o.owned = owned.iter().copied().collect();
        for i in 0..4u32 {
            if !o.owned.contains(&i) {
                o.owners[i as usize] = owner.map(|e| Owner { identity: "other".into(), endpoint: Some(e.to_string()) });
            }
        }
        Arc::new(o)
    }

    #[tokio::test]
    async fn served_once_owned_and_loaded_and_refused_with_the_owner_otherwise() {
        let (tx, rx) = watch::channel(ownership(&[], Some("10.0.0.2:9610")));
        let served = Served::after_loading("kuryr-vif-allocator", rx);
        let node = "node-1";
        let shard = crate::shard_of(node, 4).unwrap();
        let err = served.check(node, "WatchVifs").unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
        assert!(err.message().contains("10.0.0.2:9610") && err.message().contains("kuryr-vif-allocator"), "{err:?}");
        assert_eq!(err.metadata().get(crate::OWNER_METADATA).unwrap(), "10.0.0.2:9610");
        assert_eq!(served.redirects.get_or_create(&RedirectLabels { method: "WatchVifs" }).get(), 1);
        // Owned but not loaded yet: refused, without a redirect.
        tx.send_replace(ownership(&[shard], Some("10.0.0.2:9610")));
        let err = served.check(node, "WatchVifs").unwrap_err();
        assert!(err.metadata().get(crate::OWNER_METADATA).is_none(), "{err:?}");
        served.set_loaded(BTreeSet::from([shard]));
        assert!(served.check(node, "WatchVifs").is_ok());
        assert!(served.in_shards(node, &BTreeSet::from([shard])));
        assert!(!served.in_shards(node, &BTreeSet::from([(shard + 1) % 4])));
        // Lost: `lost` resolves, and the key is not served even before the loaded set changes.
        let waiter = {
            let s = served.clone();
            tokio::spawn(async move { s.lost(node).await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        tx.send_replace(ownership(&[], None));
        tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        assert!(!served.serves(node));
        let err = served.check(node, "GetVif").unwrap_err();
        assert!(err.message().contains("no owner"), "{}", err.message());
    }

    #[tokio::test]
    async fn served_at_once_when_owned() {
        let (tx, rx) = watch::channel(Arc::new(Ownership::pending("me", 4)));
        let served = Served::at_once("kuryr-policy", rx);
        let err = served.check("node-1", "WatchPolicies").unwrap_err();
        assert!(err.message().contains("does not know its shards yet"), "{}", err.message());
        let shard = crate::shard_of("node-1", 4).unwrap();
        tx.send_replace(ownership(&[shard], None));
        assert!(served.serves("node-1"), "no loading step");
        let waiter = {
            let s = served.clone();
            tokio::spawn(async move { s.lost("node-1").await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        tx.send_replace(ownership(&[], None));
        tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
    }

    #[test]
    fn unsharded_serves_every_key() {
        let s = Served::all("kuryr-lbaas");
        assert!(s.serves("node-1") && s.check("ns/web", "GetLoadBalancer").is_ok() && !s.sharded());
    }
}
