//! The gRPC edge: validates requests (naming the offending field), serves WatchLoadBalancers
//! from the published specs (snapshot, deltas, resume, heartbeats; see [`kuryr_stream::feed`])
//! and answers Get/List from the records. The core's specs become `kuryr.lbaas.v1` messages here
//! ([`convert`]), when a response is built.

pub mod convert;
pub mod follow;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kuryr_proto::lbaas::v1::load_balancers_server::LoadBalancers;
use kuryr_proto::lbaas::v1::{
    GetLoadBalancerRequest, LbEventType, ListLoadBalancersRequest, ListLoadBalancersResponse, LoadBalancer,
    WatchLoadBalancersRequest, WatchLoadBalancersResponse,
};
use kuryr_runtime::Shutdown;
use kuryr_runtime::validate::{dns_label, resume_from, subscriber};
use kuryr_stream::{Event, How, Options, Subscriber};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use self::convert::{identity, load_balancer};
use crate::backend::LbLog;
use crate::core::lb::LoadBalancerSpec;
use crate::core::locked;
use crate::core::view::key;
use crate::k8s::Records;
use crate::metrics::{Metrics, StartLabels};

/// Responses buffered per stream before the stream task waits for the subscriber to read.
const STREAM_BUFFER: usize = 128;

/// The LoadBalancers service.
#[derive(Debug, Clone)]
pub struct LbService {
    log: LbLog,
    records: Records,
    recovered: Arc<AtomicBool>,
    metrics: Metrics,
    shutdown: Shutdown,
    heartbeat: Duration,
}

/// The heartbeat interval unless told otherwise (`--stream-heartbeat`).
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);

impl LbService {
    /// Streams `log`, answers from `records` once `recovered` is set.
    pub fn new(log: LbLog, records: Records, recovered: Arc<AtomicBool>, metrics: Metrics, shutdown: Shutdown) -> Self {
        Self { log, records, recovered, metrics, shutdown, heartbeat: DEFAULT_HEARTBEAT }
    }

    /// Streams carry a HEARTBEAT whenever nothing else was sent for `every`.
    #[must_use]
    pub fn with_heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = every;
        self
    }

    fn check_recovered(&self) -> Result<(), Status> {
        if self.recovered.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(Status::unavailable("kuryr-lbaas has not loaded its records from the Kubernetes API yet"))
        }
    }
}

/// Checks a WatchLoadBalancers request, naming the offending field.
pub fn validate_watch(req: &WatchLoadBalancersRequest) -> Result<(), Status> {
    resume_from(&req.resume_from)?;
    subscriber("subscriber", &req.subscriber)
}

/// Checks a GetLoadBalancer request.
pub fn validate_get(req: &GetLoadBalancerRequest) -> Result<(), Status> {
    dns_label("namespace", &req.namespace, "namespace name")?;
    dns_label("name", &req.name, "Service name")
}

/// Checks a ListLoadBalancers request.
pub fn validate_list(req: &ListLoadBalancersRequest) -> Result<(), Status> {
    if req.namespace.is_empty() { Ok(()) } else { dns_label("namespace", &req.namespace, "namespace name") }
}

/// One WatchLoadBalancers subscriber: everything, as LbEvents. Each response owns its message,
/// so a spec is built from the log's shared value per response (as a clone of a stored message
/// would be).
#[derive(Debug)]
struct Watch {
    metrics: Metrics,
}

impl Subscriber<String, LoadBalancerSpec> for Watch {
    type Item = Result<WatchLoadBalancersResponse, Status>;

    fn encode(&self, resume_point: String, event: Event<'_, String, LoadBalancerSpec>) -> Self::Item {
        let (t, spec) = match event {
            Event::Reset => (LbEventType::Reset, None),
            Event::SnapshotComplete => (LbEventType::SnapshotComplete, None),
            Event::Heartbeat => (LbEventType::Heartbeat, None),
            Event::Applied(_, spec) => (LbEventType::LbApplied, Some(spec.as_ref().into())),
            Event::Deleted(_, spec) => (LbEventType::LbDeleted, Some(identity(spec))),
        };
        Ok(WatchLoadBalancersResponse { resume_point, r#type: t as i32, spec })
    }

    fn started(&self, how: How) {
        self.metrics.subscriptions.get_or_create(&StartLabels { start: how.label() }).inc();
    }

    fn ended(&self) {
        self.metrics.subscribers.dec();
    }
}

#[tonic::async_trait]
impl LoadBalancers for LbService {
    type WatchLoadBalancersStream = ReceiverStream<Result<WatchLoadBalancersResponse, Status>>;

    async fn watch_load_balancers(
        &self,
        req: Request<WatchLoadBalancersRequest>,
    ) -> Result<Response<Self::WatchLoadBalancersStream>, Status> {
        let peer = req.remote_addr().map_or_else(|| "local".to_string(), |a| a.to_string());
        let req = req.into_inner();
        validate_watch(&req)?;
        let subscriber = if req.subscriber.is_empty() { peer.clone() } else { req.subscriber.clone() };
        let span = tracing::info_span!("subscriber", subscriber = %subscriber, peer = %peer);
        let watch = Watch { metrics: self.metrics.clone() };
        let shutdown = self.shutdown.clone();
        let stop = async move {
            shutdown.wait().await;
            Err(Status::unavailable("kuryr-lbaas is shutting down; reconnect with resume_from"))
        };
        let options = Options { buffer: STREAM_BUFFER, heartbeat: Some(self.heartbeat) };
        let opened = kuryr_stream::feed::subscribe(&self.log, &req.resume_from, watch, options, stop, span.clone())
            .map_err(|_| {
                Status::unavailable(
                    "kuryr-lbaas does not have its first complete view of Services and EndpointSlices yet",
                )
            })?;
        self.metrics.subscribers.inc();
        span.in_scope(|| {
            tracing::info!(resume_from = %req.resume_from, how = opened.how.label(), items = opened.items,
                cursor = opened.cursor, "WatchLoadBalancers");
        });
        Ok(Response::new(ReceiverStream::new(opened.rx)))
    }

    async fn get_load_balancer(&self, req: Request<GetLoadBalancerRequest>) -> Result<Response<LoadBalancer>, Status> {
        let r = req.into_inner();
        validate_get(&r)?;
        self.check_recovered()?;
        let k = key(&r.namespace, &r.name);
        let records = locked(&self.records);
        let record = records.get(&k).ok_or_else(|| Status::not_found(format!("Service {k} has no load balancer")))?;
        Ok(Response::new(load_balancer(&k, record)))
    }

    async fn list_load_balancers(
        &self,
        req: Request<ListLoadBalancersRequest>,
    ) -> Result<Response<ListLoadBalancersResponse>, Status> {
        let r = req.into_inner();
        validate_list(&r)?;
        self.check_recovered()?;
        let prefix = format!("{}/", r.namespace);
        let records = locked(&self.records);
        let load_balancers = records
            .iter()
            .filter(|(k, _)| r.namespace.is_empty() || k.starts_with(&prefix))
            .map(|(k, rec)| load_balancer(k, rec))
            .collect();
        Ok(Response::new(ListLoadBalancersResponse { load_balancers }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn bad_requests_name_the_field() {
        let get = |ns: &str, name: &str| {
            validate_get(&GetLoadBalancerRequest { namespace: ns.into(), name: name.into() }).unwrap_err()
        };
        for (ns, name, field) in
            [("", "x", "namespace"), ("ns", "", "name"), ("NS", "x", "namespace"), ("ns", "a/b", "name")]
        {
            let e = get(ns, name);
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with(&format!("{field}:")), "{ns}/{name}: {}", e.message());
        }
        assert!(validate_get(&GetLoadBalancerRequest { namespace: "ns".into(), name: "web".into() }).is_ok());
        assert!(validate_list(&ListLoadBalancersRequest { namespace: String::new() }).is_ok());
        let e = validate_list(&ListLoadBalancersRequest { namespace: "-x".into() }).unwrap_err();
        assert!(e.message().starts_with("namespace:"), "{}", e.message());
        let long = WatchLoadBalancersRequest { resume_from: "x".repeat(200), subscriber: String::new() };
        assert!(validate_watch(&long).unwrap_err().message().starts_with("resume_from:"));
        let ctl = WatchLoadBalancersRequest { resume_from: String::new(), subscriber: "a\nb".into() };
        assert!(validate_watch(&ctl).unwrap_err().message().starts_with("subscriber:"));
    }

    #[test]
    fn deletions_carry_only_the_identity() {
        let w = Watch { metrics: Metrics::default() };
        let spec = Arc::new(LoadBalancerSpec {
            namespace: "ns".into(),
            name: "web".into(),
            uid: "u".into(),
            vips: vec!["10.96.0.1".into()],
            generation: 3,
            ..Default::default()
        });
        let k = "ns/web".to_string();
        let resp = w.encode("e-4".into(), Event::Deleted(&k, &spec)).unwrap();
        assert_eq!(resp.r#type(), LbEventType::LbDeleted);
        let s = resp.spec.unwrap();
        assert_eq!((s.namespace.as_str(), s.name.as_str(), s.uid.as_str()), ("ns", "web", "u"));
        assert!(s.vips.is_empty() && s.generation == 0);
        let resp = w.encode("e-5".into(), Event::Applied(&k, &spec)).unwrap();
        assert_eq!(
            (resp.r#type(), resp.spec.unwrap().generation, resp.resume_point.as_str()),
            (LbEventType::LbApplied, 3, "e-5")
        );
    }
}
