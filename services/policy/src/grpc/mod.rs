//! The gRPC edge: validates requests (naming the offending field), streams one node's part of
//! the log over WatchPolicies (snapshot, deltas, resume, heartbeats; see [`kuryr_stream::feed`])
//! and answers GetNodePolicy from it. A caller whose token is bound to a node (a binder's) gets
//! that node's policy only. With sharding ([`crate::shards`]), a node served by another replica
//! is refused with UNAVAILABLE naming the owner, and a node's streams end that way when its shard
//! moves.
//!
//! The client side is here too: following the watcher's Subscribe stream ([`follow`]) and
//! converting its objects into the compiler's model ([`convert`]).

pub mod convert;
pub mod follow;

use kuryr_policy_core::addr::AddrRange;
use kuryr_policy_core::{Allowed, Protocol};
use kuryr_proto::policy::v1 as pb;
use kuryr_proto::policy::v1::policies_server::Policies;
use std::time::Duration;

use kuryr_runtime::Shutdown;
use kuryr_runtime::auth;
use kuryr_runtime::validate::{node_name, own_node, resume_from, subscriber};
use kuryr_stream::{Event, How, Options, Subscriber};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::core::publish::{Entry, Item, Key, PolicyLog};
use crate::metrics::{Metrics, StartLabels};
use crate::shards::Shards;

/// Responses buffered per stream before the stream task waits for the subscriber to read.
const STREAM_BUFFER: usize = 256;

/// The Policies service.
#[derive(Debug, Clone)]
pub struct PolicyService {
    log: PolicyLog,
    metrics: Metrics,
    shutdown: Shutdown,
    heartbeat: Duration,
    shards: Shards,
}

/// The heartbeat interval unless told otherwise (`--stream-heartbeat`).
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);

impl PolicyService {
    /// Serves `log`.
    pub fn new(log: PolicyLog, metrics: Metrics, shutdown: Shutdown) -> Self {
        Self { log, metrics, shutdown, heartbeat: DEFAULT_HEARTBEAT, shards: Shards::all(crate::shards::SERVICE) }
    }

    /// Serves only the nodes `shards` serves, redirecting the others (every node by default).
    #[must_use]
    pub fn with_shards(mut self, shards: Shards) -> Self {
        self.shards = shards;
        self
    }

    /// Streams carry a HEARTBEAT whenever nothing else was sent for `every`.
    #[must_use]
    pub fn with_heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = every;
        self
    }
}

/// Checks a WatchPolicies request, naming the offending field.
pub fn validate_watch(req: &pb::WatchPoliciesRequest) -> Result<(), Status> {
    node_name("node_name", &req.node_name)?;
    resume_from(&req.resume_from)?;
    subscriber("subscriber", &req.subscriber)
}

fn protocol(p: Protocol) -> pb::Protocol {
    match p {
        Protocol::Tcp => pb::Protocol::Tcp,
        Protocol::Udp => pb::Protocol::Udp,
        Protocol::Sctp => pb::Protocol::Sctp,
    }
}

fn range(r: &AddrRange) -> pb::AddressRange {
    pb::AddressRange { first: r.first_addr().to_string(), last: r.last_addr().to_string() }
}

/// A group on the wire.
pub fn group(id: &str, allowed: &Allowed, policies: &[String]) -> pb::PeerGroup {
    pb::PeerGroup {
        id: id.to_string(),
        addresses: allowed.any.iter().map(ToString::to_string).collect(),
        ranges: allowed.nets.iter().map(range).collect(),
        ports: allowed
            .ports
            .iter()
            .map(|p| pb::AddressPort {
                address: p.addr.to_string(),
                protocol: protocol(p.protocol) as i32,
                port: u32::from(p.port),
            })
            .collect(),
        boxes: allowed
            .ranges
            .iter()
            .map(|b| pb::PortBox {
                addresses: Some(range(&b.addrs)),
                protocol: protocol(b.protocol) as i32,
                first_port: u32::from(b.first_port),
                last_port: u32::from(b.last_port),
            })
            .collect(),
        policies: policies.to_vec(),
    }
}

/// An isolation on the wire.
fn isolation(ip: &std::net::IpAddr, entry: &Entry) -> pb::Isolation {
    let mut out = pb::Isolation { address: ip.to_string(), ..Default::default() };
    if let Entry::Isolation { ingress, egress, pod } = entry {
        out.ingress_group = ingress.as_ref().map(|g| g.0.clone()).unwrap_or_default();
        out.egress_group = egress.as_ref().map(|g| g.0.clone()).unwrap_or_default();
        out.pod.clone_from(pod);
    }
    out
}

/// One WatchPolicies subscriber: one node's items.
#[derive(Debug)]
struct Watch {
    node: String,
    metrics: Metrics,
}

impl Subscriber<Key, Entry> for Watch {
    type Item = Result<pb::WatchPoliciesResponse, Status>;

    fn wants(&self, key: &Key, _: &Entry) -> bool {
        key.0 == self.node
    }

    fn encode(&self, resume_point: String, event: Event<'_, Key, Entry>) -> Self::Item {
        use pb::PolicyEventType as T;
        let mut out = pb::WatchPoliciesResponse { resume_point, ..Default::default() };
        let t = match event {
            Event::Reset => T::Reset,
            Event::Heartbeat => T::Heartbeat,
            Event::SnapshotComplete => T::SnapshotComplete,
            Event::Applied((_, Item::Group(id)), e) => {
                if let Entry::Group { allowed, policies } = &**e {
                    out.group = Some(group(id, allowed, policies));
                }
                T::GroupApplied
            }
            Event::Deleted((_, Item::Group(id)), _) => {
                out.group = Some(pb::PeerGroup { id: id.clone(), ..Default::default() });
                T::GroupDeleted
            }
            Event::Applied((_, Item::Isolation(ip)), e) => {
                out.isolation = Some(isolation(ip, e));
                T::IsolationApplied
            }
            Event::Deleted((_, Item::Isolation(ip)), _) => {
                out.isolation = Some(pb::Isolation { address: ip.to_string(), ..Default::default() });
                T::IsolationDeleted
            }
        };
        out.r#type = t as i32;
        Ok(out)
    }

    fn started(&self, how: How) {
        self.metrics.subscriptions.get_or_create(&StartLabels { start: how.label() }).inc();
    }

    fn ended(&self) {
        self.metrics.subscribers.dec();
    }
}

const NOT_READY: &str =
    "kuryr-policy does not have its first complete view of pods, namespaces and NetworkPolicies yet";

#[tonic::async_trait]
impl Policies for PolicyService {
    type WatchPoliciesStream = ReceiverStream<Result<pb::WatchPoliciesResponse, Status>>;

    async fn watch_policies(
        &self,
        req: Request<pb::WatchPoliciesRequest>,
    ) -> Result<Response<Self::WatchPoliciesStream>, Status> {
        let peer = req.remote_addr().map_or_else(|| "local".to_string(), |a| a.to_string());
        let caller = auth::caller(&req).cloned();
        let req = req.into_inner();
        validate_watch(&req)?;
        own_node(caller.as_ref(), "node_name", &req.node_name)?;
        self.shards.check(&req.node_name, "WatchPolicies")?;
        let subscriber = if req.subscriber.is_empty() { peer.clone() } else { req.subscriber.clone() };
        let span = tracing::info_span!("subscriber", node = %req.node_name, subscriber = %subscriber, peer = %peer);
        let watch = Watch { node: req.node_name.clone(), metrics: self.metrics.clone() };
        let (shutdown, shards, node) = (self.shutdown.clone(), self.shards.clone(), req.node_name.clone());
        let stop = async move {
            tokio::select! {
                () = shards.lost(&node) => {
                    tracing::info!("the node's shard moved to another replica; ending its stream");
                    Err(shards.refusal(&node))
                }
                () = shutdown.wait() => Err(Status::unavailable("kuryr-policy is shutting down; reconnect with resume_from")),
            }
        };
        let options = Options { buffer: STREAM_BUFFER, heartbeat: Some(self.heartbeat) };
        let opened = kuryr_stream::feed::subscribe(&self.log, &req.resume_from, watch, options, stop, span.clone())
            .map_err(|_| Status::unavailable(NOT_READY))?;
        self.metrics.subscribers.inc();
        span.in_scope(|| {
            tracing::info!(resume_from = %req.resume_from, how = opened.how.label(), items = opened.items,
                cursor = opened.cursor, "WatchPolicies");
        });
        Ok(Response::new(ReceiverStream::new(opened.rx)))
    }

    async fn get_node_policy(
        &self,
        req: Request<pb::GetNodePolicyRequest>,
    ) -> Result<Response<pb::NodePolicy>, Status> {
        let caller = auth::caller(&req).cloned();
        let req = req.into_inner();
        node_name("node_name", &req.node_name)?;
        own_node(caller.as_ref(), "node_name", &req.node_name)?;
        self.shards.check(&req.node_name, "GetNodePolicy")?;
        let log = kuryr_stream::log::lock(&self.log);
        if !log.is_ready() {
            return Err(Status::unavailable(NOT_READY));
        }
        let (items, cursor) = log.snapshot(|k, _| k.0 == req.node_name);
        let resume_point = log.epoch().point(cursor);
        drop(log);
        let mut out = pb::NodePolicy { node_name: req.node_name, resume_point, ..Default::default() };
        for ((_, item), entry) in &items {
            match (item, &**entry) {
                (Item::Group(id), Entry::Group { allowed, policies }) => out.groups.push(group(id, allowed, policies)),
                (Item::Isolation(ip), e) => out.isolations.push(isolation(ip, e)),
                _ => {}
            }
        }
        Ok(Response::new(out))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn bad_requests_name_the_field() {
        let watch = |node: &str, resume: &str, sub: &str| {
            validate_watch(&pb::WatchPoliciesRequest {
                node_name: node.into(),
                resume_from: resume.into(),
                subscriber: sub.into(),
            })
        };
        for (node, resume, sub, field) in [
            ("", "", "", "node_name"),
            ("Node_1", "", "", "node_name"),
            ("a..b", "", "", "node_name"),
            ("n1", &"x".repeat(200) as &str, "", "resume_from"),
            ("n1", "", "a\nb", "subscriber"),
        ] {
            let e = watch(node, resume, sub).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with(&format!("{field}:")), "{}", e.message());
        }
        assert!(watch("node-1.example", "abc-3", "binder/node-1").is_ok());
    }

    #[test]
    fn only_the_binders_may_call() {
        use clap::Parser as _;
        use kuryr_runtime::auth::Account;

        let config = crate::Config::parse_from(["kuryr-policy"]);
        let rules = crate::rules(&config);
        let account = |name: &str| Account {
            namespace: "kuryr-system".into(),
            name: name.into(),
            node: Some("n1".into()),
            pod: None,
        };
        for method in ["WatchPolicies", "GetNodePolicy"] {
            let path = format!("/kuryr.policy.v1.Policies/{method}");
            assert!(rules.check(&path, &account("kuryr-binder")).is_ok(), "{method}");
            let e = rules.check(&path, &account("kuryr-vif-allocator")).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{method}");
        }
    }

    #[test]
    fn events_carry_what_the_binder_needs_and_deletions_only_the_key() {
        use std::sync::Arc;

        use kuryr_policy_core::{AddrPort, GroupId};

        let w = Watch { node: "n1".into(), metrics: Metrics::default() };
        let mut allowed = Allowed::default();
        allowed.any.insert("10.0.0.9".parse().unwrap());
        allowed.ports.insert(AddrPort { addr: "fd00::9".parse().unwrap(), protocol: Protocol::Udp, port: 53 });
        let group = Arc::new(Entry::Group { allowed: Arc::new(allowed), policies: Arc::new(vec!["ns/p".into()]) });
        let key = ("n1".to_string(), Item::Group("i0123".into()));
        assert!(w.wants(&key, &group));
        assert!(!w.wants(&("n2".to_string(), Item::Group("i0123".into())), &group));
        let r = w.encode("e-3".into(), Event::Applied(&key, &group)).unwrap();
        assert_eq!(r.r#type(), pb::PolicyEventType::GroupApplied);
        let g = r.group.unwrap();
        assert_eq!(
            (g.id.as_str(), g.addresses.as_slice(), g.policies.as_slice()),
            ("i0123", &["10.0.0.9".to_string()][..], &["ns/p".to_string()][..])
        );
        assert_eq!(
            (g.ports[0].address.as_str(), g.ports[0].protocol(), g.ports[0].port),
            ("fd00::9", pb::Protocol::Udp, 53)
        );
        let r = w.encode("e-4".into(), Event::Deleted(&key, &group)).unwrap();
        assert_eq!(r.group.unwrap(), pb::PeerGroup { id: "i0123".into(), ..Default::default() });

        let iso =
            Arc::new(Entry::Isolation { ingress: Some(GroupId("i0123".into())), egress: None, pod: "ns/a".into() });
        let key = ("n1".to_string(), Item::Isolation("10.0.0.1".parse().unwrap()));
        let r = w.encode("e-5".into(), Event::Applied(&key, &iso)).unwrap();
        assert_eq!(r.r#type(), pb::PolicyEventType::IsolationApplied);
        let i = r.isolation.unwrap();
        assert_eq!(
            (i.address.as_str(), i.ingress_group.as_str(), i.egress_group.as_str(), i.pod.as_str()),
            ("10.0.0.1", "i0123", "", "ns/a")
        );
        let r = w.encode("e-6".into(), Event::Deleted(&key, &iso)).unwrap();
        assert_eq!(r.isolation.unwrap(), pb::Isolation { address: "10.0.0.1".into(), ..Default::default() });
        assert_eq!(
            w.encode("e-6".into(), Event::SnapshotComplete).unwrap().r#type(),
            pb::PolicyEventType::SnapshotComplete
        );
        let beat = w.encode(String::new(), Event::Heartbeat).unwrap();
        assert_eq!((beat.r#type(), beat.resume_point.as_str()), (pb::PolicyEventType::Heartbeat, ""));
        assert!(beat.group.is_none() && beat.isolation.is_none());
    }
}
