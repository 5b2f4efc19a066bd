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
//! The watcher's messages stop here: each event is made into a [`Watched`] ([`watched`]) before
//! the view sees it.
//!
//! At the first SNAPSHOT_COMPLETE the PodVifs found at recovery whose pod the snapshot did not
//! name are queued for cleanup: their pods were deleted while no allocator was running.

use std::sync::Arc;
use std::time::Instant;

use kuryr_proto::watcher::v1::object::Body;
use kuryr_proto::watcher::v1::{EventType, Filter, Kind, Object, SubscribeRequest, SubscribeResponse};
use kuryr_runtime::Shutdown;
use kuryr_runtime::auth::client::PeerChannel;
use kuryr_runtime::follow::follow_watcher;
use kuryr_stream::{FollowConfig, Followed};

use crate::cluster::Cluster;
use crate::controller::{Controller, view_lock};
use crate::core::PodKey;
use crate::index::{SharedIndex, lock};
use crate::metrics::Metrics;
use crate::pods::{Effect, FINALIZER, PodInfo, Watched};
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
            let Some(next) = follower.next_or(shutdown.clone().wait()).await else { return };
            match next {
                Followed::Event(ev) => {
                    let Some(ev) = watched(&ev) else { continue };
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

/// What the view reads of one event of the watcher's stream; `None` for events that concern
/// neither a pod nor a node (heartbeats, other kinds, objects without a body).
pub fn watched(ev: &SubscribeResponse) -> Option<Watched> {
    match ev.r#type() {
        EventType::Reset => Some(Watched::Reset),
        EventType::SnapshotComplete => Some(Watched::SnapshotComplete),
        EventType::Applied => {
            let o = ev.object.as_ref()?;
            match (o.kind(), &o.body) {
                (Kind::Pod, _) => pod_info(o).map(Watched::PodApplied),
                (Kind::Node, Some(Body::Node(n))) => Some(Watched::NodeApplied(o.name.clone(), n.internal_ips.clone())),
                _ => None,
            }
        }
        EventType::Deleted => {
            let o = ev.object.as_ref()?;
            match o.kind() {
                Kind::Pod => Some(Watched::PodDeleted(o.uid.clone(), pod_info(o))),
                Kind::Node => Some(Watched::NodeDeleted(o.name.clone())),
                _ => None,
            }
        }
        EventType::Unspecified | EventType::Heartbeat => None,
    }
}

/// What the allocator reads of a pod object of the watcher; `None` without a pod body.
pub fn pod_info(o: &Object) -> Option<PodInfo> {
    let Some(Body::Pod(p)) = &o.body else { return None };
    Some(PodInfo {
        key: PodKey::new(&o.namespace, &o.name, &o.uid),
        node: p.node_name.clone(),
        phase: p.phase.clone(),
        deleting: o.deleting,
        host_network: p.host_network,
        has_finalizer: p.finalizers.iter().any(|f| f == FINALIZER),
        finalizers: p.finalizers.clone(),
        networks: p.annotations.get(crate::core::attach::NETWORKS_ANNOTATION).cloned(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_proto::watcher::v1::{Node, Pod};

    use super::*;

    fn ev(t: EventType, object: Option<Object>) -> SubscribeResponse {
        SubscribeResponse { resume_point: "e-1".into(), r#type: t as i32, object }
    }

    fn pod() -> Object {
        Object {
            kind: Kind::Pod as i32,
            namespace: "ns".into(),
            name: "a".into(),
            uid: "uid-a".into(),
            deleting: true,
            body: Some(Body::Pod(Pod {
                node_name: "n1".into(),
                phase: "Running".into(),
                host_network: false,
                finalizers: vec!["other".into(), FINALIZER.into()],
                annotations: [(crate::core::attach::NETWORKS_ANNOTATION.to_string(), "blue".to_string())].into(),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn the_watchers_events_become_the_views() {
        let info = PodInfo {
            key: PodKey::new("ns", "a", "uid-a"),
            node: "n1".into(),
            phase: "Running".into(),
            deleting: true,
            host_network: false,
            has_finalizer: true,
            finalizers: vec!["other".into(), FINALIZER.into()],
            networks: Some("blue".into()),
        };
        assert_eq!(watched(&ev(EventType::Applied, Some(pod()))), Some(Watched::PodApplied(info.clone())));
        assert_eq!(
            watched(&ev(EventType::Deleted, Some(pod()))),
            Some(Watched::PodDeleted("uid-a".into(), Some(info)))
        );
        let bare = Object { body: None, ..pod() };
        assert_eq!(watched(&ev(EventType::Applied, Some(bare.clone()))), None, "a pod without its body");
        assert_eq!(watched(&ev(EventType::Deleted, Some(bare))), Some(Watched::PodDeleted("uid-a".into(), None)));
        let node = Object {
            kind: Kind::Node as i32,
            name: "n1".into(),
            body: Some(Body::Node(Node { internal_ips: vec!["192.168.0.1".into()], ..Default::default() })),
            ..Default::default()
        };
        assert_eq!(
            watched(&ev(EventType::Applied, Some(node.clone()))),
            Some(Watched::NodeApplied("n1".into(), vec!["192.168.0.1".into()]))
        );
        assert_eq!(watched(&ev(EventType::Deleted, Some(node))), Some(Watched::NodeDeleted("n1".into())));
        assert_eq!(watched(&ev(EventType::Reset, None)), Some(Watched::Reset));
        assert_eq!(watched(&ev(EventType::SnapshotComplete, None)), Some(Watched::SnapshotComplete));
        assert_eq!(watched(&ev(EventType::Heartbeat, None)), None);
        assert_eq!(watched(&ev(EventType::Applied, None)), None);
        let service = Object { kind: Kind::Service as i32, ..Default::default() };
        assert_eq!(watched(&ev(EventType::Applied, Some(service))), None);
    }
}
