//! Following the records of the shards this replica does not serve: a Kubernetes watch on every
//! ServiceLoadBalancer. What the owner of a Service's shard publishes is exactly its record's
//! spec at the record's `metadata.generation`, so a replica that sees the record can publish the
//! same thing: the node backend's WatchLoadBalancers stream carries every Service on every
//! replica, and binders may connect to any of them.
//!
//! - A record of a shard served here is this replica's own writing: ignored (the controller
//!   keeps it and publishes it).
//! - Any other record updates the records (Get/List answer from them) and is handed to the
//!   backend ([`crate::backend::Backend::mirror`]); an older generation of the same Service
//!   never replaces a newer one, and an unchanged spec publishes nothing, so a shard changing
//!   owner is silent on the stream: no LB_DELETED, no re-add.
//! - A deleted record is removed, and its load balancer leaves the stream (LB_DELETED), as it
//!   does on the owner's.
//! - After every (re-)list, records no longer listed are removed as if deleted.
//!
//! Readiness waits for the first list. The watch backs off and resumes by itself; its failures
//! are logged once per streak and counted.

use std::collections::HashSet;
use std::sync::Arc;

use futures::StreamExt as _;
use kube::api::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kuryr_runtime::Shutdown;

use crate::backend::Backend;
use crate::controller::Controller;
use crate::core::locked;
use crate::core::view::{key, split};
use crate::k8s::Record;
use crate::k8s::crd::ServiceLoadBalancer;
use crate::metrics::Metrics;
use crate::ready::{Condition, Readiness};
use crate::shards::Shards;

/// What the mirror works with.
pub struct Mirror<B> {
    /// Lists and watches the records.
    pub client: kube::Client,
    /// Holds the records and the backend.
    pub controller: Arc<Controller<B>>,
    /// Which records are this replica's own.
    pub shards: Shards,
    /// The mirror condition.
    pub readiness: Readiness,
    /// Counts what was followed.
    pub metrics: Metrics,
}

impl<B> std::fmt::Debug for Mirror<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirror").finish_non_exhaustive()
    }
}

impl<B: Backend> Mirror<B> {
    /// Follows the records until shutdown.
    pub async fn run(self, shutdown: Shutdown) {
        let api: Api<ServiceLoadBalancer> = Api::all(self.client.clone());
        let mut stream = watcher::watcher(api, kuryr_runtime::watch_config()).default_backoff().boxed();
        // Keys named by the list in progress, after a (re-)start of the watch.
        let mut listing: Option<HashSet<String>> = None;
        let mut failing = false;
        loop {
            let next = tokio::select! {
                n = stream.next() => n,
                () = shutdown.clone().wait() => return,
            };
            let Some(ev) = next else { return };
            match ev {
                Ok(Event::Init) => listing = Some(HashSet::new()),
                Ok(Event::InitApply(o)) => {
                    let k = object_key(&o);
                    if let Some(seen) = &mut listing {
                        seen.insert(k.clone());
                    }
                    self.applied(k, o);
                }
                Ok(Event::InitDone) => {
                    if let Some(seen) = listing.take() {
                        self.forget_unlisted(&seen);
                    }
                    if failing {
                        tracing::info!("watching the ServiceLoadBalancers again");
                        failing = false;
                    }
                    self.readiness.set(Condition::Mirror, true);
                }
                Ok(Event::Apply(o)) => self.applied(object_key(&o), o),
                Ok(Event::Delete(o)) => self.deleted(&object_key(&o), o.metadata.uid.as_deref().unwrap_or_default()),
                Err(e) => {
                    self.metrics.mirror_errors.inc();
                    if !failing {
                        tracing::warn!(error = %e, "watching the ServiceLoadBalancers failed; retrying with backoff");
                        failing = true;
                    }
                }
            }
        }
    }

    fn applied(&self, k: String, o: ServiceLoadBalancer) {
        if self.shards.serves(&k) {
            return;
        }
        let r = Record::from_object(o);
        {
            let mut records = locked(self.controller.records());
            if records.get(&k).is_some_and(|cur| cur.uid == r.uid && cur.generation > r.generation) {
                return;
            }
            if records.get(&k) == Some(&r) {
                return;
            }
            records.insert(k.clone(), r.clone());
        }
        self.metrics.mirrored.inc();
        let backend = self.controller.backend();
        if r.spec.backend == backend.name() {
            let (ns, name) = split(&k);
            backend.mirror(&k, Some(r.spec.to_spec(ns, name, r.generation)));
        }
        tracing::debug!(service = k, generation = r.generation, "followed the record of another replica's shard");
    }

    fn deleted(&self, k: &str, uid: &str) {
        if self.shards.serves(k) {
            return;
        }
        let removed = {
            let mut records = locked(self.controller.records());
            match records.get(k) {
                Some(cur) if cur.uid == uid || uid.is_empty() => records.remove(k),
                _ => None,
            }
        };
        if let Some(r) = removed {
            self.metrics.mirrored.inc();
            let backend = self.controller.backend();
            if r.spec.backend == backend.name() {
                backend.mirror(k, None);
            }
            tracing::debug!(service = k, "the record of another replica's shard was deleted");
        }
    }

    /// After a list: records of shards not served here that the list did not name are gone.
    fn forget_unlisted(&self, seen: &HashSet<String>) {
        let gone: Vec<(String, String)> = locked(self.controller.records())
            .iter()
            .filter(|(k, _)| !seen.contains(*k) && !self.shards.serves(k))
            .map(|(k, r)| (k.clone(), r.uid.clone()))
            .collect();
        for (k, uid) in gone {
            self.deleted(&k, &uid);
        }
    }
}

fn object_key(o: &ServiceLoadBalancer) -> String {
    key(o.metadata.namespace.as_deref().unwrap_or_default(), o.metadata.name.as_deref().unwrap_or_default())
}
