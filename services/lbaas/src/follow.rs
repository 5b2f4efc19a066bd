//! Following the watcher: one Subscribe stream of Services and EndpointSlices, fed into the
//! [`View`](crate::view::View); the Services an event touches are queued for reconciling.
//!
//! The stream is resumed after a break with the point of the last event handled; when the
//! watcher cannot resume (another replica, a restart) it sends RESET and a snapshot, which the
//! view treats as a re-list. Reconnects back off from 100 ms to 5 s. The first SNAPSHOT_COMPLETE
//! makes the load balancer stream servable and queues every Service and every record (so that
//! records whose Service went away while lbaas was down are deleted); readiness holds while the
//! stream is live.

use std::sync::Arc;
use std::time::Duration;

use kuryr_proto::watcher::v1::watcher_client::WatcherClient;
use kuryr_proto::watcher::v1::{Kind, SubscribeRequest};
use kuryr_runtime::Shutdown;
use tonic::transport::Channel;

use crate::backend::{Backend, LbLog};
use crate::controller::{Controller, locked};
use crate::metrics::Metrics;
use crate::ready::Readiness;
use crate::view::Effect;

const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What the follower works with.
#[derive(Debug)]
pub struct Follower<B> {
    /// The watcher.
    pub channel: Channel,
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
}

impl<B: Backend> Follower<B> {
    /// Follows the watcher until shutdown.
    pub async fn run(self, shutdown: Shutdown) {
        let mut client = WatcherClient::new(self.channel.clone());
        let mut resume = String::new();
        let mut delay = RETRY_MIN;
        let mut logged_down = false;
        let mut first = true;
        loop {
            let req = SubscribeRequest {
                kinds: vec![Kind::Service as i32, Kind::EndpointSlice as i32],
                filter: None,
                resume_from: resume.clone(),
                subscriber: self.subscriber.clone(),
            };
            let opened = tokio::select! {
                r = client.subscribe(req) => r,
                () = shutdown.clone().wait() => return,
            };
            let why = match opened {
                Ok(resp) => {
                    let mut stream = resp.into_inner();
                    loop {
                        let msg = tokio::select! {
                            m = stream.message() => m,
                            () = shutdown.clone().wait() => return,
                        };
                        match msg {
                            Ok(Some(ev)) => {
                                if !ev.resume_point.is_empty() {
                                    resume.clone_from(&ev.resume_point);
                                }
                                let effects = locked(self.controller.view()).apply(&ev);
                                for e in effects {
                                    match e {
                                        // Before the first snapshot is complete the view is
                                        // partial (a slice may come before its Service):
                                        // everything is queued at once when it is.
                                        Effect::Service(key) if !first => self.controller.enqueue(&key),
                                        Effect::Service(_) => {}
                                        Effect::Resync => {
                                            tracing::info!("the watcher sent RESET; re-listing from its snapshot");
                                            self.readiness.set_watcher(false);
                                        }
                                        Effect::Live => {
                                            self.live(first);
                                            first = false;
                                            delay = RETRY_MIN;
                                            logged_down = false;
                                        }
                                    }
                                }
                            }
                            Ok(None) => break "the watcher ended the stream".to_string(),
                            Err(s) => break format!("the stream broke: {}: {}", s.code(), s.message()),
                        }
                    }
                }
                Err(s) => format!("cannot subscribe: {}: {}", s.code(), s.message()),
            };
            self.metrics.watcher_reconnects.inc();
            self.readiness.set_watcher(false);
            if logged_down {
                tracing::debug!(error = why, retry_in = ?delay, "watcher still unavailable");
            } else {
                tracing::warn!(error = why, "watcher unavailable; reconnecting with backoff");
                logged_down = true;
            }
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = shutdown.clone().wait() => return,
            }
            delay = (delay * 2).min(RETRY_MAX);
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
        self.readiness.set_watcher(true);
    }
}
