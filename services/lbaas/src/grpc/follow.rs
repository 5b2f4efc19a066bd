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
//!
//! This is where the watcher's `kuryr.watcher.v1` messages become the core's
//! [`crate::core::view::Event`]s ([`event`]).

use std::sync::Arc;

use kuryr_proto::watcher::v1 as pb;
use kuryr_proto::watcher::v1::object::Body;
use kuryr_proto::watcher::v1::{EventType, Kind, SubscribeRequest, SubscribeResponse};
use kuryr_runtime::Shutdown;
use kuryr_runtime::auth::client::PeerChannel;
use kuryr_runtime::follow::follow_watcher;
use kuryr_stream::{FollowConfig, Followed};

use crate::backend::{Backend, LbLog};
use crate::controller::Controller;
use crate::core::input::{Endpoint, EndpointPort, EndpointSlice, Meta, Service, ServicePort};
use crate::core::locked;
use crate::core::view::{Effect, Event};
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
            let Some(ev) = event(ev) else { continue };
            let effects = locked(self.controller.view()).apply(ev);
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

/// What an event of the watcher's stream is to the view; `None` for what it does not hold
/// (heartbeats, other kinds, an event without its object).
pub fn event(ev: SubscribeResponse) -> Option<Event> {
    let t = ev.r#type();
    match t {
        EventType::Reset => return Some(Event::Reset),
        EventType::SnapshotComplete => return Some(Event::SnapshotComplete),
        EventType::Applied | EventType::Deleted => {}
        EventType::Unspecified | EventType::Heartbeat => return None,
    }
    let o = ev.object?;
    let meta = Meta { namespace: o.namespace, name: o.name, uid: o.uid, deleting: o.deleting };
    let applied = t == EventType::Applied;
    match o.body? {
        Body::Service(s) if applied => Some(Event::ServiceApplied(meta, Box::new(service(s)))),
        Body::Service(_) => Some(Event::ServiceDeleted(meta)),
        Body::EndpointSlice(s) if applied => Some(Event::SliceApplied(meta, slice(s))),
        Body::EndpointSlice(_) => Some(Event::SliceDeleted(meta)),
        _ => None,
    }
}

fn service(s: pb::Service) -> Service {
    Service {
        r#type: s.r#type,
        cluster_ips: s.cluster_ips,
        ports: s
            .ports
            .into_iter()
            .map(|p| ServicePort {
                name: p.name,
                protocol: p.protocol,
                port: p.port,
                target_port: p.target_port,
                node_port: p.node_port,
            })
            .collect(),
        selector: s.selector,
        session_affinity: s.session_affinity,
        session_affinity_timeout_seconds: s.session_affinity_timeout_seconds,
        load_balancer_ip: s.load_balancer_ip,
        external_name: s.external_name,
        ip_families: s.ip_families,
        finalizers: s.finalizers,
        external_traffic_policy: s.external_traffic_policy,
        internal_traffic_policy: s.internal_traffic_policy,
        external_ips: s.external_ips,
        load_balancer_ingress_ips: s.load_balancer_ingress_ips,
        load_balancer_class: s.load_balancer_class,
    }
}

fn slice(s: pb::EndpointSlice) -> EndpointSlice {
    EndpointSlice {
        service_name: s.service_name,
        address_type: s.address_type,
        endpoints: s
            .endpoints
            .into_iter()
            .map(|e| Endpoint {
                addresses: e.addresses,
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                node_name: e.node_name,
                target_pod: e.target_pod,
                zone: e.zone,
            })
            .collect(),
        ports: s.ports.into_iter().map(|p| EndpointPort { name: p.name, protocol: p.protocol, port: p.port }).collect(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_proto::watcher::v1::Object;

    use super::*;

    fn ev(t: EventType, body: Option<Body>) -> SubscribeResponse {
        let object = body.map(|body| Object {
            kind: Kind::Service as i32,
            namespace: "ns".into(),
            name: "web".into(),
            uid: "u1".into(),
            deleting: true,
            body: Some(body),
            ..Default::default()
        });
        SubscribeResponse { resume_point: "e-1".into(), r#type: t as i32, object }
    }

    #[test]
    fn watcher_events_become_view_events() {
        let svc = pb::Service {
            r#type: "NodePort".into(),
            cluster_ips: vec!["10.96.0.1".into()],
            ports: vec![pb::ServicePort {
                name: "http".into(),
                protocol: "TCP".into(),
                port: 80,
                target_port: "web".into(),
                node_port: 30080,
            }],
            finalizers: vec!["f".into()],
            load_balancer_class: "c".into(),
            ..Default::default()
        };
        let meta = Meta { namespace: "ns".into(), name: "web".into(), uid: "u1".into(), deleting: true };
        let Some(Event::ServiceApplied(m, s)) = event(ev(EventType::Applied, Some(Body::Service(svc.clone())))) else {
            panic!()
        };
        assert_eq!(m, meta);
        assert_eq!(
            (s.r#type.as_str(), s.cluster_ips.as_slice(), s.finalizers.as_slice()),
            ("NodePort", &["10.96.0.1".to_string()][..], &["f".to_string()][..])
        );
        assert_eq!(
            s.ports[0],
            ServicePort {
                name: "http".into(),
                protocol: "TCP".into(),
                port: 80,
                target_port: "web".into(),
                node_port: 30080
            }
        );
        assert_eq!(s.load_balancer_class, "c");
        assert_eq!(event(ev(EventType::Deleted, Some(Body::Service(svc)))), Some(Event::ServiceDeleted(meta.clone())));

        let slice = pb::EndpointSlice {
            service_name: "web".into(),
            address_type: "IPv6".into(),
            endpoints: vec![pb::Endpoint {
                addresses: vec!["fd00::5".into()],
                ready: false,
                serving: true,
                terminating: true,
                node_name: "n1".into(),
                target_pod: "ns/p".into(),
                zone: "z".into(),
            }],
            ports: vec![pb::EndpointPort { name: "http".into(), protocol: "TCP".into(), port: 8080 }],
        };
        let Some(Event::SliceApplied(_, s)) = event(ev(EventType::Applied, Some(Body::EndpointSlice(slice.clone()))))
        else {
            panic!()
        };
        assert_eq!((s.service_name.as_str(), s.address_type.as_str()), ("web", "IPv6"));
        let e = &s.endpoints[0];
        assert_eq!(
            (e.ready, e.serving, e.terminating, e.node_name.as_str(), e.target_pod.as_str()),
            (false, true, true, "n1", "ns/p")
        );
        assert_eq!(s.ports[0], EndpointPort { name: "http".into(), protocol: "TCP".into(), port: 8080 });
        assert_eq!(event(ev(EventType::Deleted, Some(Body::EndpointSlice(slice)))), Some(Event::SliceDeleted(meta)));

        assert_eq!(event(ev(EventType::Reset, None)), Some(Event::Reset));
        assert_eq!(event(ev(EventType::SnapshotComplete, None)), Some(Event::SnapshotComplete));
        assert_eq!(event(ev(EventType::Heartbeat, None)), None);
        assert_eq!(event(ev(EventType::Applied, None)), None, "no object");
        let node = Body::Node(pb::Node::default());
        assert_eq!(event(ev(EventType::Applied, Some(node))), None, "not a kind the view holds");
    }
}
