//! The rounds against the Kubernetes API: list the Leases, renew the membership, carry out the
//! [plan](crate::plan), publish the [`Ownership`] (module `publish`, with the fence that stops
//! work on a shard whose membership was not renewed in time); the Lease objects themselves are
//! built in module `objects`.

mod cache;
mod objects;
mod publish;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::future::join_all;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kuryr_runtime::Shutdown;
use tokio::sync::watch;
use tracing::Instrument as _;

use self::cache::LeaseCache;
pub use self::objects::{
    ENDPOINT_ANNOTATION, RENEWAL_ANNOTATION, RENEWAL_BY_MEMBERSHIP, ROLE_LABEL, SET_LABEL, SHARDS_ANNOTATION,
};
use self::objects::{MEMBER, SHARD, fresh, member_renewed, renewed, renews_shards, view_of};
use self::publish::{Publisher, State, fence};
use crate::config::ShardConfig;
use crate::hash::fnv1a64;
use crate::metrics::ShardMetrics;
use crate::ownership::{Owner, Ownership};
use crate::plan::{LeaseView, Member, ShardLease, Tracker, plan, shard_expired};

/// Membership Leases of replicas gone this many durations are deleted by the others.
const STALE_MEMBER_DURATIONS: u32 = 10;
/// At shutdown, how long releasing the Leases may take.
const RELEASE_BOUND: Duration = Duration::from_secs(5);

/// A running shard set: the ownership it publishes, and the end of its release at shutdown.
#[derive(Clone, Debug)]
pub struct ShardHandle {
    ownership: watch::Receiver<Arc<Ownership>>,
    stopped: watch::Receiver<bool>,
}

impl ShardHandle {
    /// No sharding: this replica owns everything, at once; nothing runs.
    pub fn unsharded(identity: &str) -> Self {
        let (_, ownership) = watch::channel(Arc::new(Ownership::everything(identity)));
        let (_, stopped) = watch::channel(true);
        Self { ownership, stopped }
    }

    /// The ownership, updated after every change.
    pub fn ownership(&self) -> watch::Receiver<Arc<Ownership>> {
        self.ownership.clone()
    }

    /// The ownership now.
    pub fn current(&self) -> Arc<Ownership> {
        self.ownership.borrow().clone()
    }

    /// Resolves once the shard set has stopped after shutdown: its shards released and its
    /// membership Lease deleted (or given up on after a few seconds).
    pub async fn stopped(&self) {
        let mut rx = self.stopped.clone();
        let _ = rx.wait_for(|s| *s).await;
    }
}

/// Starts the shard set of `config` with `client` (its account needs get, list, watch, create,
/// update and delete on Leases in the namespace); runs until `shutdown`, then releases everything.
/// With `config.shards == 0` nothing runs and everything is owned.
pub fn start(client: kube::Client, config: ShardConfig, metrics: ShardMetrics, shutdown: Shutdown) -> ShardHandle {
    if config.shards == 0 {
        return ShardHandle::unsharded(&config.identity);
    }
    let (tx, ownership) = watch::channel(Arc::new(Ownership::pending(&config.identity, config.shards)));
    let (stopped_tx, stopped) = watch::channel(false);
    let state = Arc::new(Mutex::new(State {
        owned: BTreeMap::new(),
        owners: vec![None; config.shards as usize],
        ready: false,
    }));
    let publisher = Publisher { tx: Arc::new(tx), state, config: Arc::new(config.clone()), metrics: metrics.clone() };
    let offset = u32::try_from(fnv1a64(config.identity.as_bytes()) % u64::from(config.shards)).unwrap_or(0);
    let span = tracing::info_span!("shards", service = %config.service, replica = %config.identity);
    let api = Api::namespaced(client, &config.namespace);
    let selector = format!("{SET_LABEL}={}", config.service);
    let cache = LeaseCache::start(api.clone(), &selector, span.clone(), shutdown.clone());
    let driver = Driver {
        api,
        cache,
        written: None,
        list_next: false,
        config,
        metrics,
        tracker: Tracker::default(),
        publisher: publisher.clone(),
        offset,
        failing: false,
        next_expiry: None,
    };
    tokio::spawn(fence(publisher, shutdown.clone()).instrument(span.clone()));
    tokio::spawn(
        async move {
            driver.run(shutdown).await;
            let _ = stopped_tx.send(true);
        }
        .instrument(span),
    );
    ShardHandle { ownership, stopped }
}

struct Driver {
    api: Api<Lease>,
    /// The set's Leases as a watch has them: what a round reads when it can.
    cache: LeaseCache,
    /// The resourceVersion of this replica's membership Lease as its last write left it (`None`
    /// before the first): a view of the watch that does not show it is not used.
    written: Option<String>,
    /// The last membership write lost a race: the next round lists.
    list_next: bool,
    config: ShardConfig,
    metrics: ShardMetrics,
    tracker: Tracker,
    publisher: Publisher,
    offset: u32,
    /// The last round failed (logged once per streak).
    failing: bool,
    /// When the first Lease of another replica expires if not renewed: the next round runs
    /// then rather than up to a renewal interval later, so takeover is prompt.
    next_expiry: Option<Instant>,
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

impl Driver {
    async fn run(mut self, shutdown: Shutdown) {
        let tick = self.config.tick();
        tracing::info!(shards = self.config.shards, namespace = %self.config.namespace, duration = ?self.config.duration,
            endpoint = %self.config.endpoint, "taking part in the shard Leases");
        loop {
            let started = tokio::time::Instant::now();
            let round = tokio::time::timeout(self.config.duration, self.round());
            let result = tokio::select! {
                r = round => r.unwrap_or_else(|_| Err(anyhow::anyhow!("the round took longer than the Lease duration"))),
                () = shutdown.clone().wait() => break,
            };
            match result {
                Ok(()) => {
                    if self.failing {
                        tracing::info!("shard Leases reachable again");
                    }
                    self.failing = false;
                }
                Err(e) => {
                    self.metrics.round_failures.inc();
                    if !self.failing {
                        tracing::warn!(error = format!("{e:#}"), "shard round failed; retrying every renewal interval");
                    }
                    self.failing = true;
                }
            }
            let mut wake = started + tick;
            if let Some(at) = self.next_expiry.take() {
                // Just after it: the expiry test is `>=`.
                wake = wake.min(tokio::time::Instant::from_std(at) + Duration::from_millis(5));
            }
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                () = shutdown.clone().wait() => break,
            }
        }
        if tokio::time::timeout(RELEASE_BOUND, self.release_all()).await.is_err() {
            tracing::warn!("releasing the shard Leases at shutdown timed out; they expire by themselves");
        }
    }

    async fn round(&mut self) -> anyhow::Result<()> {
        let me = self.config.identity.clone();
        let service = self.config.service.clone();
        let my_member = self.config.member_lease(&me);
        let watched = if self.list_next { None } else { self.cache.view(&my_member, self.written.as_deref()) };
        let items = match watched {
            Some(items) => items,
            None => {
                self.list_next = false;
                self.metrics.lease_lists.inc();
                self.api
                    .list(&ListParams::default().labels(&format!("{SET_LABEL}={service}")))
                    .await
                    .map_err(|e| anyhow::anyhow!("listing the Leases in {}: {e}", self.config.namespace))?
                    .items
            }
        };
        let (now, wall) = (Instant::now(), SystemTime::now());
        self.tracker.observe(
            items.iter().map(|l| {
                (
                    l.metadata.name.as_deref().unwrap_or_default(),
                    l.metadata.resource_version.as_deref().unwrap_or_default(),
                )
            }),
            now,
        );
        let shards = self.config.shards as usize;
        let mut shard_leases: Vec<Option<(Lease, LeaseView)>> = vec![None; shards];
        let mut member: Option<Lease> = None;
        // The other replicas' memberships, by holder.
        let mut members: HashMap<String, Member> = HashMap::new();
        let mut live: HashSet<String> = HashSet::from([me.clone()]);
        let mut stale = Vec::new();
        // When the first Lease of another replica that decides something expires.
        let mut next_expiry: Option<Instant> = None;
        let mut expiring = |name: &str, view: &LeaseView| {
            if view.holder.as_deref().is_some_and(|h| h != me) && !self.tracker.expired(name, view, now, wall) {
                let at = self.tracker.expires_at(name, view, now);
                next_expiry = match (next_expiry, at) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
        };
        for l in items {
            let name = l.metadata.name.clone().unwrap_or_default();
            let view = view_of(&l);
            let role = l.metadata.labels.as_ref().and_then(|m| m.get(ROLE_LABEL)).map(String::as_str);
            if let Some(i) = self.config.shard_index(&name) {
                shard_leases[i as usize] = Some((l, view));
            } else if name == my_member {
                member = Some(l);
            } else if role == Some(MEMBER) {
                expiring(&name, &view);
                let expired = self.tracker.expired(&name, &view, now, wall);
                if let Some(h) = &view.holder {
                    members.insert(h.clone(), Member { expired, renews_shards: renews_shards(&l) });
                }
                match &view.holder {
                    Some(h) if !expired => {
                        live.insert(h.clone());
                    }
                    _ => {
                        let long_gone = view.renewed.is_none_or(|r| r + view.duration * STALE_MEMBER_DURATIONS < wall);
                        if expired && long_gone {
                            stale.push((name, view.version));
                        }
                    }
                }
            }
        }
        // A shard Lease decides its own expiry only when its holder does not renew it through the
        // membership (whose expiry is counted above).
        let holder_of = |v: &LeaseView| v.holder.as_ref().and_then(|h| members.get(h)).copied();
        for (i, o) in shard_leases.iter().enumerate() {
            if let Some((_, v)) = o
                && !holder_of(v).is_some_and(|m| m.renews_shards)
            {
                expiring(&self.config.shard_lease(i as u32), v);
            }
        }
        self.next_expiry = next_expiry;
        // A live replica of an earlier version judges every shard Lease by its own renewals.
        let earlier = members.values().any(|m| !m.expired && !m.renews_shards);
        let member_sent = self.renew_member(&my_member, member).await?;
        self.metrics.members.set(i64::try_from(live.len()).unwrap_or(i64::MAX));
        for (name, version) in stale.into_iter().take(4) {
            let dp = DeleteParams {
                preconditions: Some(Preconditions { resource_version: Some(version), uid: None }),
                ..Default::default()
            };
            match self.api.delete(&name, &dp).await {
                Ok(_) => tracing::info!(lease = name, "deleted the membership Lease of a replica long gone"),
                Err(e) => tracing::debug!(lease = name, error = %e, "could not delete a stale membership Lease"),
            }
        }

        let views: Vec<Option<ShardLease>> = shard_leases
            .iter()
            .enumerate()
            .map(|(i, o)| {
                o.as_ref().map(|(_, v)| ShardLease {
                    holder: v.holder.clone(),
                    expired: shard_expired(
                        self.tracker.expired(&self.config.shard_lease(i as u32), v, now, wall),
                        holder_of(v),
                    ),
                })
            })
            .collect();
        let owned: BTreeSet<u32> = self.publisher.lock().owned.keys().copied().collect();
        let mut p = plan(&me, &views, &owned, live.len(), self.offset, !earlier);
        if member_sent.is_none() {
            // The membership was not renewed: nothing is kept, confirmed or taken on it. The shards
            // worked on run until the fence, and the next round tries again.
            (p.keep, p.renew, p.acquire) = (Vec::new(), Vec::new(), Vec::new());
        }

        // Lost, then released: work stops before anything is written.
        if !p.lost.is_empty() || !p.release.is_empty() {
            let mut s = self.publisher.lock();
            for &i in &p.lost {
                s.owned.remove(&i);
                let by = views.get(i as usize).and_then(|v| v.as_ref()).and_then(|v| v.holder.clone());
                self.metrics.lost(if by.is_some() { "taken" } else { "gone" });
                tracing::warn!(shard = i, holder = ?by, "shard lost to another replica; stopped working on it");
            }
            for &i in &p.release {
                s.owned.remove(&i);
            }
            self.publisher.publish(&s);
        }
        let releases = p.release.iter().filter_map(|&i| {
            let (l, _) = shard_leases[i as usize].clone()?;
            let mut l = l;
            if let Some(spec) = l.spec.as_mut() {
                spec.holder_identity = None;
            }
            let name = self.config.shard_lease(i);
            let api = self.api.clone();
            Some(async move { (i, api.replace(&name, &PostParams::default(), &l).await) })
        });
        for (i, r) in join_all(releases).await {
            match r {
                Ok(_) => {
                    self.metrics.releases.inc();
                    tracing::info!(shard = i, fair_share = p.fair, members = live.len(), "shard released to rebalance");
                }
                Err(e) => tracing::info!(shard = i, error = %e, "releasing a shard failed; it expires by itself"),
            }
        }

        // Renewals and acquisitions, all at once. Every shard is valid from when the membership
        // was renewed, which came first: the others judge it by the membership. (Without a
        // renewal there is nothing to keep, renew or take, so no shard gets a deadline here.)
        let valid_until =
            member_sent.unwrap_or_else(Instant::now) + self.config.duration.saturating_sub(self.config.tick());
        let renewals = p.renew.iter().filter_map(|&i| {
            let (l, _) = shard_leases[i as usize].clone()?;
            let l = renewed(&self.config, l, false);
            let name = self.config.shard_lease(i);
            let api = self.api.clone();
            Some(async move { (i, api.replace(&name, &PostParams::default(), &l).await) })
        });
        let acquisitions = p.acquire.iter().map(|&i| {
            let name = self.config.shard_lease(i);
            let existing = shard_leases[i as usize].clone().map(|(l, _)| renewed(&self.config, l, true));
            let fresh = fresh(&self.config, &name, SHARD, Some(&me));
            let api = self.api.clone();
            async move {
                let r = match existing {
                    Some(l) => api.replace(&name, &PostParams::default(), &l).await,
                    None => api.create(&PostParams::default(), &fresh).await,
                };
                (i, r)
            }
        });
        let (renewed, acquired) = tokio::join!(join_all(renewals), join_all(acquisitions));
        if let Some(sent) = member_sent {
            self.metrics.renew_latency.observe(sent.elapsed().as_secs_f64());
        }

        let mut s = self.publisher.lock();
        let mut gained = Vec::new();
        for i in &p.keep {
            // Unless the fence let it go meanwhile: then the next round confirms it by a write.
            if let Some(t) = s.owned.get_mut(i) {
                *t = valid_until;
            }
        }
        for (i, r) in renewed {
            match r {
                Ok(_) => {
                    if s.owned.insert(i, valid_until).is_none() {
                        // Held by this identity but not worked on: a restart, or fenced earlier.
                        gained.push(i);
                    }
                }
                Err(e) => {
                    let reason = if is_status(&e, 409) {
                        "conflict"
                    } else if is_status(&e, 404) {
                        "gone"
                    } else {
                        ""
                    };
                    if reason.is_empty() {
                        // Not an answer about the Lease: work goes on until the fence says no.
                        tracing::debug!(shard = i, error = %e, "renewing a shard Lease failed; retrying");
                    } else if s.owned.remove(&i).is_some() {
                        self.metrics.lost(reason);
                        tracing::warn!(shard = i, error = %e, "renewing a shard Lease failed; stopped working on it");
                    }
                }
            }
        }
        for (i, r) in acquired {
            match r {
                Ok(_) => {
                    s.owned.insert(i, valid_until);
                    gained.push(i);
                }
                Err(e) if is_status(&e, 409) => tracing::debug!(shard = i, "another replica took the shard first"),
                Err(e) => tracing::info!(shard = i, error = %e, "taking a shard failed; retrying next round"),
            }
        }
        for &i in &gained {
            self.metrics.acquisitions.inc();
            let from = views.get(i as usize).and_then(|v| v.as_ref()).and_then(|v| v.holder.clone());
            tracing::info!(shard = i, previous_holder = ?from, "shard acquired");
        }
        // Who owns the others, as the Leases say.
        for (i, o) in shard_leases.iter().enumerate() {
            s.owners[i] = o.as_ref().and_then(|(_, v)| {
                let expired = views[i].as_ref().is_none_or(|x| x.expired);
                let h = v.holder.clone()?;
                (!expired && h != me).then(|| Owner { identity: h, endpoint: v.endpoint.clone() })
            });
        }
        let first = !s.ready;
        s.ready = true;
        self.publisher.publish(&s);
        if first || !gained.is_empty() || !p.release.is_empty() || !p.lost.is_empty() {
            tracing::info!(owned = ?s.owned.keys().collect::<Vec<_>>(), members = live.len(), fair_share = p.fair,
                "shard ownership");
        }
        Ok(())
    }

    /// Creates or renews this replica's membership Lease; returns when the write was sent, or
    /// `None` when it lost a race (the membership was not renewed).
    async fn renew_member(&mut self, name: &str, current: Option<Lease>) -> anyhow::Result<Option<Instant>> {
        let me = self.config.identity.clone();
        let sent = Instant::now();
        let r = match current {
            Some(l) => self.api.replace(name, &PostParams::default(), &member_renewed(&self.config, l)).await,
            None => self.api.create(&PostParams::default(), &fresh(&self.config, name, MEMBER, Some(&me))).await,
        };
        match r {
            Ok(l) => {
                self.written = l.metadata.resource_version;
                Ok(Some(sent))
            }
            // Written by someone else since the list (a replica with the same identity?): the
            // next round reads it again, with a list.
            Err(e) if is_status(&e, 409) => {
                (self.written, self.list_next) = (None, true);
                tracing::warn!(lease = name, "membership Lease changed under this replica; is --replica-id unique?");
                Ok(None)
            }
            Err(e) => Err(anyhow::anyhow!("renewing the membership Lease {name}: {e}")),
        }
    }

    /// At shutdown: stop working on everything, release the shard Leases, delete the membership
    /// Lease, so that the others take over at once.
    async fn release_all(&self) {
        let owned: Vec<u32> = {
            let mut s = self.publisher.lock();
            let owned = s.owned.keys().copied().collect();
            s.owned.clear();
            self.publisher.publish(&s);
            owned
        };
        let me = self.config.identity.as_str();
        let releases = owned.iter().map(|&i| {
            let name = self.config.shard_lease(i);
            async move {
                let mut l = self.api.get(&name).await?;
                let spec = l.spec.get_or_insert_with(Default::default);
                if spec.holder_identity.as_deref() != Some(me) {
                    return Ok(());
                }
                spec.holder_identity = None;
                self.api.replace(&name, &PostParams::default(), &l).await.map(drop)
            }
        });
        let results: Vec<Result<(), kube::Error>> = join_all(releases).await;
        let released = results.iter().filter(|r| r.is_ok()).count();
        self.metrics.releases.inc_by(released as u64);
        let member = self.config.member_lease(me);
        let deleted = self.api.delete(&member, &DeleteParams::default()).await;
        tracing::info!(released, of = owned.len(), member_deleted = deleted.is_ok(), "released the shard Leases");
    }
}
