//! Readiness: the allocator is SERVING only when (a) the watcher's stream is live (its snapshot
//! complete), (b) the VIFs recorded in PodVifs were loaded (recovery), (c) the PodNetwork
//! exists, and (d) its first round of shard Leases is done (it may own no shard: it then serves
//! by redirecting binders to the owners). Each change is logged once, naming what is missing.
//!
//! WatchVifs itself serves from (b) on, even while the watcher is away: binders then keep the
//! VIFs they have (and get those recovered after a restart at once), which beats refusing them.

use kuryr_proto::service_names;
use kuryr_runtime::{Health, Shutdown};
use tokio::sync::watch;
use tracing::Instrument as _;

/// The conditions of readiness.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Conditions {
    /// The PodNetwork exists.
    pub network: bool,
    /// The recorded VIFs were loaded.
    pub recovered: bool,
    /// The watcher's stream is live.
    pub watcher: bool,
    /// The first round of shard Leases is done (at once without sharding).
    pub shards: bool,
}

impl Conditions {
    /// Whether every condition holds.
    pub fn all(&self) -> bool {
        self.network && self.recovered && self.watcher && self.shards
    }

    fn missing(&self) -> Vec<&'static str> {
        let mut m = Vec::new();
        if !self.network {
            m.push("the PodNetwork");
        }
        if !self.recovered {
            m.push("recovery of the recorded VIFs");
        }
        if !self.watcher {
            m.push("a live watcher stream");
        }
        if !self.shards {
            m.push("the first round of shard Leases");
        }
        m
    }
}

/// Sets the conditions; cheap to clone.
#[derive(Clone, Debug)]
pub struct Readiness(watch::Sender<Conditions>);

impl Default for Readiness {
    fn default() -> Self {
        Self(watch::Sender::new(Conditions::default()))
    }
}

impl Readiness {
    /// Marks the PodNetwork present.
    pub fn set_network(&self) {
        self.0.send_if_modified(|c| !std::mem::replace(&mut c.network, true));
    }

    /// Marks recovery done.
    pub fn set_recovered(&self) {
        self.0.send_if_modified(|c| !std::mem::replace(&mut c.recovered, true));
    }

    /// Marks the first round of shard Leases done.
    pub fn set_shards(&self) {
        self.0.send_if_modified(|c| !std::mem::replace(&mut c.shards, true));
    }

    /// Marks the watcher stream live or not.
    pub fn set_watcher(&self, live: bool) {
        self.0.send_if_modified(|c| std::mem::replace(&mut c.watcher, live) != live);
    }

    /// The conditions now.
    pub fn get(&self) -> Conditions {
        *self.0.borrow()
    }

    /// Keeps the health of the allocator's services in line with the conditions until shutdown.
    pub fn spawn_driver(&self, health: Health, shutdown: Shutdown) {
        let mut rx = self.0.subscribe();
        tokio::spawn(
            async move {
                for svc in SERVICES {
                    health.register(svc).await;
                }
                let mut last = None;
                loop {
                    let now = *rx.borrow_and_update();
                    if last != Some(now.all()) && !shutdown.is_triggered() {
                        if now.all() {
                            tracing::info!("network present, VIFs recovered, watcher live, shards known: serving");
                        } else {
                            tracing::info!(missing = ?now.missing(), "not serving");
                        }
                        for svc in SERVICES {
                            if now.all() {
                                health.set_serving(svc).await;
                            } else {
                                health.set_not_serving(svc).await;
                            }
                        }
                        last = Some(now.all());
                    }
                    tokio::select! {
                        changed = rx.changed() => if changed.is_err() { return },
                        () = shutdown.clone().wait() => return,
                    }
                }
            }
            .instrument(tracing::info_span!("readiness")),
        );
    }
}

/// The services whose health follows the conditions. PoolManager answers UNIMPLEMENTED with the
/// embedded backend; it follows along so that the overall status means "the allocator works".
const SERVICES: [&str; 2] = [service_names::VIF_ALLOCATOR, service_names::POOL_MANAGER];
