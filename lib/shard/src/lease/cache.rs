//! The service's Leases as a watch keeps them, so that a round reads them without a request.
//!
//! A round needs every Lease of its set, every renewal interval. Listing them cost one LIST per
//! replica and round, whatever happened; a watch costs an event per Lease written, and nothing
//! while nothing is. Every write of a round carries the resourceVersion read, so a view that lags
//! can only make a write lose its race (409), never win one it should not. The round still lists
//! when the watch cannot vouch for its view: before its first listing is complete, and when the
//! view does not show this replica's own last membership write (a watch that lags, hangs or
//! fails) — see [`LeaseCache::view`] — or that write lost a race.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::StreamExt as _;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use kube::runtime::{WatchStreamExt as _, watcher};
use kuryr_runtime::Shutdown;
use tracing::Instrument as _;

#[derive(Debug, Default)]
struct Inner {
    leases: BTreeMap<String, Lease>,
    /// A listing is complete.
    listed: bool,
}

/// A watch of the Leases of one set (a label selector), kept in memory.
#[derive(Clone, Debug)]
pub(super) struct LeaseCache {
    inner: Arc<Mutex<Inner>>,
}

impl LeaseCache {
    /// Starts the watch of the Leases of `api` that `selector` selects, logging in `span`; it runs
    /// until `shutdown`.
    pub(super) fn start(api: Api<Lease>, selector: &str, span: tracing::Span, shutdown: Shutdown) -> Self {
        let cache = Self { inner: Arc::default() };
        let config = kuryr_runtime::watch_config().labels(selector);
        let events = watcher(api, config).default_backoff().boxed();
        tokio::spawn(cache.clone().follow(events, shutdown).instrument(span));
        cache
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn follow(
        self,
        mut events: futures::stream::BoxStream<'static, Result<watcher::Event<Lease>, watcher::Error>>,
        shutdown: Shutdown,
    ) {
        // A listing is gathered apart and put in place whole once complete.
        let mut listing: Option<BTreeMap<String, Lease>> = None;
        // Failing since the last event: logged once per streak.
        let mut failing = false;
        loop {
            let next = tokio::select! {
                n = events.next() => n,
                () = shutdown.clone().wait() => return,
            };
            match next {
                Some(Ok(event)) => {
                    failing = false;
                    self.apply(event, &mut listing);
                }
                // Retried with backoff by the watcher; meanwhile this replica's next membership write
                // does not show here, and the rounds list.
                Some(Err(e)) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "the Lease watch failed (may the account watch Leases?); \
                        the rounds list the Leases until it is back");
                }
                Some(Err(e)) => tracing::debug!(error = %e, "the Lease watch failed again"),
                None => return,
            }
        }
    }

    fn apply(&self, event: watcher::Event<Lease>, listing: &mut Option<BTreeMap<String, Lease>>) {
        let name = |l: &Lease| l.metadata.name.clone().unwrap_or_default();
        match event {
            watcher::Event::Init => *listing = Some(BTreeMap::new()),
            watcher::Event::InitApply(l) => {
                if let Some(m) = listing.as_mut() {
                    m.insert(name(&l), l);
                }
            }
            watcher::Event::InitDone => {
                let mut inner = self.lock();
                inner.leases = listing.take().unwrap_or_default();
                inner.listed = true;
            }
            watcher::Event::Apply(l) => {
                self.lock().leases.insert(name(&l), l);
            }
            watcher::Event::Delete(l) => {
                self.lock().leases.remove(&name(&l));
            }
        }
    }

    /// The Leases as the watch has them, once listed, when they show `member` (this replica's
    /// membership Lease) at `written`, the resourceVersion its last write returned (if any);
    /// `None` otherwise, and the round lists instead.
    pub(super) fn view(&self, member: &str, written: Option<&str>) -> Option<Vec<Lease>> {
        let inner = self.lock();
        if !inner.listed {
            return None;
        }
        if let Some(rv) = written {
            let seen = inner.leases.get(member).and_then(|l| l.metadata.resource_version.as_deref());
            if seen != Some(rv) {
                return None;
            }
        }
        Some(inner.leases.values().cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kube::api::ObjectMeta;

    use super::*;

    fn lease(name: &str, rv: &str) -> Lease {
        Lease {
            metadata: ObjectMeta { name: Some(name.into()), resource_version: Some(rv.into()), ..Default::default() },
            spec: None,
        }
    }

    fn cache() -> LeaseCache {
        LeaseCache { inner: Arc::default() }
    }

    fn names(v: &[Lease]) -> Vec<String> {
        v.iter().map(|l| l.metadata.name.clone().unwrap()).collect()
    }

    #[test]
    fn nothing_is_vouched_for_before_the_first_listing_is_complete() {
        let c = cache();
        let mut listing = None;
        assert!(c.view("m", None).is_none());
        c.apply(watcher::Event::Init, &mut listing);
        c.apply(watcher::Event::InitApply(lease("m", "1")), &mut listing);
        assert!(c.view("m", None).is_none(), "half a listing");
        c.apply(watcher::Event::InitDone, &mut listing);
        assert_eq!(names(&c.view("m", None).unwrap()), ["m"]);
    }

    #[test]
    fn a_view_that_does_not_show_the_member_s_last_write_is_not_used() {
        let c = cache();
        let mut listing = None;
        for e in [watcher::Event::Init, watcher::Event::InitApply(lease("m", "1")), watcher::Event::InitDone] {
            c.apply(e, &mut listing);
        }
        assert!(c.view("m", Some("5")).is_none(), "the write of 5 not seen yet");
        c.apply(watcher::Event::Apply(lease("m", "5")), &mut listing);
        assert_eq!(names(&c.view("m", Some("5")).unwrap()), ["m"]);
        c.apply(watcher::Event::Delete(lease("m", "5")), &mut listing);
        assert!(c.view("m", Some("5")).is_none(), "the membership deleted");
    }

    #[test]
    fn a_new_listing_replaces_the_old_one_whole() {
        let c = cache();
        let mut listing = None;
        for e in [
            watcher::Event::Init,
            watcher::Event::InitApply(lease("a", "1")),
            watcher::Event::InitApply(lease("b", "2")),
            watcher::Event::InitDone,
        ] {
            c.apply(e, &mut listing);
        }
        assert_eq!(names(&c.view("a", None).unwrap()), ["a", "b"]);
        c.apply(watcher::Event::Init, &mut listing);
        c.apply(watcher::Event::InitApply(lease("b", "3")), &mut listing);
        assert_eq!(names(&c.view("a", None).unwrap()), ["a", "b"], "the old view until the new listing is done");
        c.apply(watcher::Event::InitDone, &mut listing);
        assert_eq!(names(&c.view("b", None).unwrap()), ["b"], "a, gone while the watch was down");
    }
}
