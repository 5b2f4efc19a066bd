//! Following the watcher: one Subscribe stream of pods, namespaces and NetworkPolicies, fed into
//! the [`Publisher`]. The stream is resumed after a break ([`follow_watcher`]); a RESET is
//! treated as a re-list. The Policies service is SERVING while the stream is live.

use kuryr_proto::service_names::POLICIES;
use kuryr_proto::watcher::v1::{Kind, SubscribeRequest};
use kuryr_runtime::follow::follow_watcher;
use kuryr_runtime::{Health, Shutdown};
use tokio::sync::watch;
use tonic::transport::Channel;

use crate::metrics::Metrics;
use crate::publish::{Effect, Publisher};

/// What the follower works with.
#[derive(Debug)]
pub struct Follower {
    /// The watcher.
    pub channel: Channel,
    /// Compiles and publishes.
    pub publisher: Publisher,
    /// Readiness of the Policies service.
    pub health: Health,
    /// Reconnects.
    pub metrics: Metrics,
    /// How kuryr-policy names itself to the watcher.
    pub subscriber: String,
}

impl Follower {
    /// Follows the watcher until shutdown.
    pub async fn run(mut self, shutdown: Shutdown) {
        self.health.register(POLICIES).await;
        let req = SubscribeRequest {
            kinds: vec![Kind::Pod as i32, Kind::Namespace as i32, Kind::NetworkPolicy as i32],
            filter: None,
            resume_from: String::new(),
            subscriber: self.subscriber.clone(),
        };
        // The follower's callbacks are synchronous; readiness changes go through a watch
        // channel to a task that updates the health service.
        let (live_tx, live_rx) = watch::channel(false);
        tokio::spawn(drive_health(self.health.clone(), live_rx, shutdown.clone()));
        let publisher = &mut self.publisher;
        let mut first = true;
        let on_event = |ev| match publisher.apply(&ev) {
            Effect::Live => {
                let stats = publisher.stats();
                if first {
                    tracing::info!(
                        pods = stats.pods,
                        policies = stats.policies,
                        groups = stats.groups,
                        "watcher snapshot complete; serving WatchPolicies"
                    );
                    first = false;
                } else {
                    tracing::info!("watcher stream live again");
                }
                live_tx.send_replace(true);
                true
            }
            Effect::Resync => {
                tracing::info!("the watcher sent RESET; re-listing from its snapshot");
                false
            }
            Effect::None => false,
        };
        let on_break = || {
            self.metrics.watcher_reconnects.inc();
            live_tx.send_replace(false);
        };
        follow_watcher(self.channel.clone(), req, &shutdown, on_event, on_break).await;
    }
}

async fn drive_health(health: Health, mut live: watch::Receiver<bool>, shutdown: Shutdown) {
    loop {
        let now = *live.borrow_and_update();
        if !shutdown.is_triggered() {
            if now {
                health.set_serving(POLICIES).await;
            } else {
                health.set_not_serving(POLICIES).await;
            }
        }
        tokio::select! {
            changed = live.changed() => if changed.is_err() { return },
            () = shutdown.clone().wait() => return,
        }
    }
}
