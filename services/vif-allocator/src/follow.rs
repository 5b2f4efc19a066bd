//! Following the watcher: one Subscribe stream of pods (not on the host network) and nodes, fed
//! into the [`PodView`](crate::pods::PodView); changed pods are queued for reconciling, node
//! addresses go to the VIF index (for node routes).
//!
//! The stream is followed by the one follower of [`kuryr_stream::follow`]: resumed after a break
//! with the point of the last event handled (when the watcher cannot resume — another replica, a
//! restart — it sends RESET and a snapshot, which the view treats as a re-list), dropped when
//! silent for longer than `--stream-idle-timeout`, reopened with jittered backoff. The watcher
//! condition of readiness holds while the stream is live (its snapshot complete).
//!
//! At the first SNAPSHOT_COMPLETE the PodVifs found at recovery whose pod the snapshot did not
//! name are queued for cleanup: their pods were deleted while no allocator was running.

use std::sync::Arc;
use std::time::Instant;

use kuryr_proto::watcher::v1::{Filter, Kind, SubscribeRequest};
use kuryr_runtime::Shutdown;
use kuryr_runtime::auth::client::PeerChannel;
use kuryr_runtime::follow::follow_watcher;
use kuryr_stream::{FollowConfig, Followed};

use crate::cluster::Cluster;
use crate::controller::{Controller, view_lock};
use crate::index::{SharedIndex, lock};
use crate::ipam::store::PodKey;
use crate::metrics::Metrics;
use crate::pods::Effect;
use crate::ready::{Condition, Readiness};

/// What the follower works with.
#[derive(Debug)]
pub struct Follower<C> {
    /// The watcher.
    pub channel: PeerChannel,
    /// Queues pods and adopts orphans.
    pub controller: Arc<Controller<C>>,
    /// Receives node addresses.
    pub index: SharedIndex,
    /// PodVifs found at recovery: (pod, node).
    pub recovered: Vec<(PodKey, String)>,
    /// The watcher condition.
    pub readiness: Readiness,
    /// Reconnects.
    pub metrics: Metrics,
    /// How this allocator names itself to the watcher.
    pub subscriber: String,
    /// The idle timeout and backoff.
    pub follow: FollowConfig,
}

impl<C: Cluster> Follower<C> {
    /// Follows the watcher until shutdown.
    pub async fn run(self, shutdown: Shutdown) {
        let req = SubscribeRequest {
            kinds: vec![Kind::Pod as i32, Kind::Node as i32],
            filter: Some(Filter { exclude_host_network: true, ..Default::default() }),
            resume_from: String::new(),
            subscriber: self.subscriber.clone(),
        };
        let mut recovered = Some(self.recovered.clone());
        let mut follower = follow_watcher(self.channel.clone(), req, self.follow);
        loop {
            let next = tokio::select! {
                next = follower.next() => next,
                () = shutdown.clone().wait() => return,
            };
            match next {
                Followed::Event(ev) => {
                    let effects = view_lock(self.controller.view()).apply(&ev, Instant::now());
                    for e in effects {
                        self.effect(e, &mut recovered);
                    }
                }
                Followed::Down(_) => {
                    self.metrics.watcher_reconnects.inc();
                    self.readiness.set(Condition::Watcher, false);
                }
            }
        }
    }

    /// Acts on one effect.
    fn effect(&self, e: Effect, recovered: &mut Option<Vec<(PodKey, String)>>) {
        match e {
            Effect::Pod(uid) => self.controller.enqueue(&uid),
            Effect::NodeIps(node, ips) => lock(&self.index).set_node_ips(&node, ips),
            Effect::Resync => {
                tracing::info!("the watcher sent RESET; re-listing from its snapshot");
                self.readiness.set(Condition::Watcher, false);
            }
            Effect::Live => {
                if let Some(found) = recovered.take() {
                    let total = found.len();
                    for (pod, node) in found {
                        self.controller.adopt_orphan(pod, &node);
                    }
                    let pods = view_lock(self.controller.view()).len();
                    tracing::info!(pods, recovered = total, "watcher snapshot complete");
                } else {
                    tracing::info!("watcher stream live again");
                }
                self.readiness.set(Condition::Watcher, true);
            }
        }
    }
}
