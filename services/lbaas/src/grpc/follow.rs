//! Following the watcher: one Subscribe stream of Services and EndpointSlices, fed into the
//! [`View`](crate::core::view::View); the Services an event touches are queued for reconciling.
//!
//! The stream is followed by the one follower of [`kuryr_stream::follow`]: resumed after a break
//! with the point of the last event handled (when the watcher cannot resume — another replica, a
//! restart — it sends RESET and a snapshot, which the view treats as a re-list), dropped when
//! silent for longer than `--stream-idle-timeout`, reopened with jittered backoff. The first
//! SNAPSHOT_COMPLETE makes the load balancer stream servable and queues every Service and every
//! record (so that records whose Service went away while lbaas was down are deleted); readiness
//! holds while the stream is live.

use std::sync::Arc;

use kuryr_proto::watcher::v1::{Kind, SubscribeRequest};
use kuryr_runtime::Shutdown;
use kuryr_runtime::auth::client::PeerChannel;
use kuryr_runtime::follow::follow_watcher;
use kuryr_stream::{FollowConfig, Followed};

use crate::backend::{Backend, LbLog};
use crate::controller::Controller;
use crate::core::locked;
use crate::core::view::Effect;
use crate::metrics::Metrics;
use crate::ready::{Condition, Readiness};

/// What the follower works with.
#[derive(Debug)]
pub struct Follower<B> {
    /// The watcher.
    pub channel: PeerChannel,
    /// Queues Services.
    pub controller: Arc<Controller<B>>,
    /// Made servable at the first complete snapshot.
    pub log: LbLog,
    /// The watcher condition.
    pub readiness: Readiness,
    /// Reconnects.
    pub metrics: Metrics,
    /// How lbaas names itself to the watcher.
    pub subscriber: String,
    /// Set at the first complete snapshot: from then on the view holds every Service.
    pub synced: tokio::sync::watch::Sender<bool>,
    /// The idle timeout and backoff.
    pub follow: FollowConfig,
}

impl<B: Backend> Follower<B> {
    /// Follows the watcher until shutdown.
    pub async fn run(self, shutdown: Shutdown) {
        let req = SubscribeRequest {
            kinds: vec![Kind::Service as i32, Kind::EndpointSlice as i32],
            filter: None,
            resume_from: String::new(),
            subscriber: self.subscriber.clone(),
        };
        let mut first = true;
        let mut follower = follow_watcher(self.channel.clone(), req, self.follow);
        loop {
            let Some(next) = follower.next_or(shutdown.clone().wait()).await else { return };
            let ev = match next {
                Followed::Event(ev) => ev,
                Followed::Down(_) => {
                    self.metrics.watcher_reconnects.inc();
                    self.readiness.set(Condition::Watcher, false);
                    continue;
                }
            };
            let effects = locked(self.controller.view()).apply(&ev);
            for e in effects {
                match e {
                    // Before the first snapshot is complete the view is partial (a slice may come
                    // before its Service): everything is queued at once when it is.
                    Effect::Service(key) if !first => self.controller.enqueue(&key),
                    Effect::Service(_) => {}
                    Effect::Resync => {
                        tracing::info!("the watcher sent RESET; re-listing from its snapshot");
                        self.readiness.set(Condition::Watcher, false);
                    }
                    Effect::Live => {
                        self.live(first);
                        first = false;
                    }
                }
            }
        }
    }

    fn live(&self, first: bool) {
        if first {
            let services = locked(self.controller.view()).len();
            self.controller.enqueue_all();
            kuryr_stream::log::lock(&self.log).set_ready();
            self.synced.send_replace(true);
            tracing::info!(services, "watcher snapshot complete; serving WatchLoadBalancers");
        } else {
            tracing::info!("watcher stream live again");
        }
        self.readiness.set(Condition::Watcher, true);
    }
}
