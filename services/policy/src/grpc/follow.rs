//! Following the watcher: one Subscribe stream of pods, namespaces and NetworkPolicies, fed into
//! the [`Publisher`].
//!
//! The stream is followed by the one follower of [`kuryr_stream::follow`]: resumed after a break
//! with the point of the last event handled (when the watcher cannot resume it sends RESET and a
//! snapshot, which the publisher treats as a re-list), dropped when silent for longer than
//! `--stream-idle-timeout`, reopened with jittered backoff. The Policies service is SERVING
//! while the stream is live ([`Condition::Watcher`]); the state already streamed to the binders
//! stays in force meanwhile.

use kuryr_proto::service_names;
use kuryr_proto::watcher::v1::{Kind, SubscribeRequest};
use kuryr_runtime::Shutdown;
use kuryr_runtime::auth::client::PeerChannel;
use kuryr_runtime::follow::follow_watcher;
use kuryr_runtime::readiness::Conditions;
use kuryr_stream::{FollowConfig, Followed};
use tokio::sync::mpsc;

use crate::core::VifChange;
use crate::core::publish::{Effect, Publisher};
use crate::core::status;
use crate::grpc::convert;
use crate::k8s::ReportSender;
use crate::metrics::Metrics;

/// The conditions of readiness.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    /// The watcher's stream is live (its snapshot complete, and not silent for longer than
    /// `--stream-idle-timeout`).
    Watcher,
}

impl Conditions for Condition {
    const ALL: &'static [Self] = &[Condition::Watcher];

    fn describe(self) -> &'static str {
        match self {
            Condition::Watcher => "a live watcher stream",
        }
    }
}

/// kuryr-policy's readiness; cheap to clone.
pub type Readiness = kuryr_runtime::readiness::Readiness<Condition>;

/// The services whose health follows the conditions.
pub const SERVICES: &[&str] = &[service_names::POLICIES];

/// What the follower works with.
#[derive(Debug)]
pub struct Follower {
    /// The watcher.
    pub channel: PeerChannel,
    /// Compiles and publishes.
    pub publisher: Publisher,
    /// Readiness of the Policies service.
    pub readiness: Readiness,
    /// Reconnects.
    pub metrics: Metrics,
    /// How kuryr-policy names itself to the watcher.
    pub subscriber: String,
    /// The idle timeout and backoff.
    pub follow: FollowConfig,
    /// Where the policies' statuses go ([`crate::core::status`], written by [`crate::k8s`]); `None`: not reported.
    pub status: Option<ReportSender>,
    /// The recorded VIFs' changes ([`crate::k8s::podvifs`]); `None`: pods have the addresses of
    /// their status only.
    pub vifs: Option<mpsc::UnboundedReceiver<VifChange>>,
}

/// The next recorded-VIF change; pending forever without a watch or once it ended.
async fn next_vif(vifs: &mut Option<mpsc::UnboundedReceiver<VifChange>>) -> Option<VifChange> {
    match vifs {
        Some(rx) => match rx.recv().await {
            Some(change) => Some(change),
            None => {
                *vifs = None;
                None
            }
        },
        None => std::future::pending().await,
    }
}

impl Follower {
    /// Follows the watcher until shutdown.
    pub async fn run(mut self, shutdown: Shutdown) {
        let req = SubscribeRequest {
            kinds: vec![Kind::Pod as i32, Kind::Namespace as i32, Kind::NetworkPolicy as i32],
            filter: None,
            resume_from: String::new(),
            subscriber: self.subscriber.clone(),
        };
        let mut first = true;
        let mut follower = follow_watcher(self.channel.clone(), req, self.follow);
        let mut status_tick = tokio::time::interval(status::PERIOD);
        status_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next = tokio::select! {
                next = follower.next() => next,
                _ = status_tick.tick(), if self.status.is_some() => {
                    let reports = self.publisher.status_reports();
                    if let (false, Some(tx)) = (reports.is_empty(), &self.status) {
                        let _ = tx.send(reports);
                    }
                    continue;
                }
                Some(change) = next_vif(&mut self.vifs) => {
                    self.publisher.vif(change);
                    continue;
                }
                () = shutdown.clone().wait() => return,
            };
            let ev = match next {
                Followed::Event(ev) => ev,
                Followed::Down(_) => {
                    self.metrics.watcher_reconnects.inc();
                    self.readiness.set(Condition::Watcher, false);
                    continue;
                }
            };
            match self.publisher.apply(convert::change(&ev)) {
                Effect::Live => {
                    let stats = self.publisher.stats();
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
                    self.readiness.set(Condition::Watcher, true);
                }
                Effect::Resync => {
                    tracing::info!("the watcher sent RESET; re-listing from its snapshot");
                    self.readiness.set(Condition::Watcher, false);
                }
                Effect::None => {}
            }
        }
    }
}
