//! Readiness: lbaas is SERVING only when (a) the records were loaded from the API (recovery),
//! (b) the watcher's stream is live (its snapshot complete) and (c) with sharding, the watch on
//! the records of the other replicas' shards has listed them once ([`crate::mirror`]). Each
//! change is logged once, naming what is missing.

use kuryr_proto::service_names;
use kuryr_runtime::{Health, Shutdown};
use tokio::sync::watch;
use tracing::Instrument as _;

/// The conditions of readiness.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Conditions {
    /// The records were loaded.
    pub recovered: bool,
    /// The watcher's stream is live.
    pub watcher: bool,
    /// The records of every shard are followed (always true without sharding).
    pub mirror: bool,
}

impl Conditions {
    /// Whether every condition holds.
    pub fn all(&self) -> bool {
        self.recovered && self.watcher && self.mirror
    }

    fn missing(&self) -> Vec<&'static str> {
        let mut m = Vec::new();
        if !self.recovered {
            m.push("recovery of the ServiceLoadBalancer records");
        }
        if !self.watcher {
            m.push("a live watcher stream");
        }
        if !self.mirror {
            m.push("the first list of the other shards' records");
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
    /// Marks recovery done.
    pub fn set_recovered(&self) {
        self.0.send_if_modified(|c| !std::mem::replace(&mut c.recovered, true));
    }

    /// Marks the watcher stream live or not.
    pub fn set_watcher(&self, live: bool) {
        self.0.send_if_modified(|c| std::mem::replace(&mut c.watcher, live) != live);
    }

    /// Marks the records of the other shards followed (or not needed).
    pub fn set_mirror(&self, synced: bool) {
        self.0.send_if_modified(|c| std::mem::replace(&mut c.mirror, synced) != synced);
    }

    /// The conditions now.
    pub fn get(&self) -> Conditions {
        *self.0.borrow()
    }

    /// Keeps the health of the LoadBalancers service in line with the conditions until shutdown.
    pub fn spawn_driver(&self, health: Health, shutdown: Shutdown) {
        let mut rx = self.0.subscribe();
        let svc = service_names::LOAD_BALANCERS;
        tokio::spawn(
            async move {
                health.register(svc).await;
                let mut last = None;
                loop {
                    let now = *rx.borrow_and_update();
                    if last != Some(now.all()) && !shutdown.is_triggered() {
                        if now.all() {
                            tracing::info!("records recovered, watcher live: serving");
                            health.set_serving(svc).await;
                        } else {
                            tracing::info!(missing = ?now.missing(), "not serving");
                            health.set_not_serving(svc).await;
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
