//! The gRPC edge: validates Subscribe requests and serves each stream from the index's log with
//! [`kuryr_stream::feed`] — a snapshot (or, when resuming, SNAPSHOT_COMPLETE), then the history
//! from its cursor on, with heartbeats while there is nothing to send — encoding each event as a
//! `SubscribeResponse` here, at the edge.
//!
//! A stream reads deltas from the index's history by revision instead of receiving its own copy
//! of each: the history is the one ordered log, so between snapshot and live nothing can be lost
//! or duplicated, and memory does not grow with the number of subscribers. A stream that falls so
//! far behind (a client not reading) that its cursor leaves the bounded history gets RESET + a
//! fresh snapshot in place, on the same stream, counted as
//! `kuryr_watcher_subscriptions_total{start="lagged"}`.

use std::time::Duration;

use kuryr_proto::watcher::v1::watcher_server::Watcher;
use kuryr_proto::watcher::v1::{EventType, Kind, Object, SubscribeRequest, SubscribeResponse};
use kuryr_runtime::Shutdown;
use kuryr_runtime::validate::{is_dns_label, is_dns_subdomain, resume_from, subscriber};
use kuryr_stream::{Event, How, Options, Subscriber};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::index::{Key, SharedIndex};
use crate::metrics::Metrics;
use crate::selector::{Selector, kind_label};

/// Responses buffered per stream before the stream task waits for the client to read.
const STREAM_BUFFER: usize = 128;

/// The Watcher service.
#[derive(Debug, Clone)]
pub struct WatcherService {
    index: SharedIndex,
    metrics: Metrics,
    shutdown: Shutdown,
    heartbeat: Duration,
}

impl WatcherService {
    /// Serves `index`; streams end when `shutdown` fires, and carry a HEARTBEAT whenever nothing
    /// else was sent for `heartbeat`.
    pub fn new(index: SharedIndex, metrics: Metrics, shutdown: Shutdown, heartbeat: Duration) -> Self {
        Self { index, metrics, shutdown, heartbeat }
    }

    /// Opens a stream for a validated request; what `subscribe` does after validation.
    pub(crate) fn open(
        &self,
        selector: Selector,
        resume_from: &str,
        buffer: usize,
        span: tracing::Span,
    ) -> Result<tokio::sync::mpsc::Receiver<Result<SubscribeResponse, Status>>, Status> {
        let kinds: Vec<_> = selector.kinds().map(kind_label).collect();
        let (node, namespace, exclude) =
            (selector.node_name.clone(), selector.namespace.clone(), selector.exclude_host_network);
        let sub = Stream { selector, metrics: self.metrics.clone() };
        let shutdown = self.shutdown.clone();
        let stop = async move {
            shutdown.wait().await;
            // Tell the client to go elsewhere rather than end as if the stream were complete.
            Err(Status::unavailable("kuryr-watcher is shutting down; resubscribe with resume_from"))
        };
        let options = Options { buffer, heartbeat: Some(self.heartbeat) };
        let opened = kuryr_stream::feed::subscribe(&self.index, resume_from, sub, options, stop, span.clone())
            .map_err(|_| Status::unavailable(crate::index::NotSynced.to_string()))?;
        self.metrics.subscribers.inc();
        span.in_scope(|| {
            tracing::info!(
                ?kinds,
                ?node,
                ?namespace,
                exclude_host_network = exclude,
                resume_from,
                how = opened.how.label(),
                objects = opened.items,
                cursor = opened.cursor,
                "subscribed"
            );
        });
        Ok(opened.rx)
    }
}

#[tonic::async_trait]
impl Watcher for WatcherService {
    type SubscribeStream = ReceiverStream<Result<SubscribeResponse, Status>>;

    async fn subscribe(&self, req: Request<SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        let peer = req.remote_addr().map_or_else(|| "local".to_string(), |a| a.to_string());
        let req = req.into_inner();
        let selector = validate(&req)?;
        let subscriber = if req.subscriber.is_empty() { peer.clone() } else { req.subscriber.clone() };
        let span = tracing::info_span!("subscriber", subscriber = %subscriber, peer = %peer);
        let rx = self.open(selector, &req.resume_from, STREAM_BUFFER, span)?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Checks a request, naming the offending field; returns what it selects.
pub fn validate(req: &SubscribeRequest) -> Result<Selector, Status> {
    if req.kinds.is_empty() {
        return Err(Status::invalid_argument("kinds: at least one kind is required"));
    }
    let mut kinds = Vec::with_capacity(req.kinds.len());
    for k in &req.kinds {
        match Kind::try_from(*k) {
            Ok(Kind::Unspecified) => return Err(Status::invalid_argument("kinds: KIND_UNSPECIFIED is not a kind")),
            Ok(kind) => kinds.push(kind),
            Err(_) => return Err(Status::invalid_argument(format!("kinds: {k} is not a known kind"))),
        }
    }
    let mut selector = Selector::new(kinds);
    let filter = req.filter.clone().unwrap_or_default();
    if !filter.node_name.is_empty() {
        if !is_dns_subdomain(&filter.node_name) {
            return Err(Status::invalid_argument(format!(
                "filter.node_name: `{}` is not a valid node name",
                filter.node_name
            )));
        }
        selector.node_name = Some(filter.node_name);
    }
    if !filter.namespace.is_empty() {
        if !is_dns_label(&filter.namespace) {
            return Err(Status::invalid_argument(format!(
                "filter.namespace: `{}` is not a valid namespace name",
                filter.namespace
            )));
        }
        selector.namespace = Some(filter.namespace);
    }
    selector.exclude_host_network = filter.exclude_host_network;
    resume_from(&req.resume_from)?;
    subscriber("subscriber", &req.subscriber)?;
    Ok(selector)
}

/// One Subscribe stream: what it selects, and how its events become `SubscribeResponse`s.
struct Stream {
    selector: Selector,
    metrics: Metrics,
}

fn response(resume_point: String, t: EventType, object: Option<Object>) -> Result<SubscribeResponse, Status> {
    Ok(SubscribeResponse { resume_point, r#type: t as i32, object })
}

impl Subscriber<Key, Object> for Stream {
    type Item = Result<SubscribeResponse, Status>;

    fn wants(&self, _key: &Key, object: &Object) -> bool {
        self.selector.matches(object)
    }

    fn encode(&self, point: String, event: Event<'_, Key, Object>) -> Self::Item {
        match event {
            Event::Reset => response(point, EventType::Reset, None),
            Event::SnapshotComplete => response(point, EventType::SnapshotComplete, None),
            Event::Heartbeat => response(point, EventType::Heartbeat, None),
            Event::Applied(_, o) => response(point, EventType::Applied, Some(Object::clone(o))),
            Event::Deleted(_, o) => response(point, EventType::Deleted, Some(Object::clone(o))),
        }
    }

    fn started(&self, how: How) {
        self.metrics.started(how.label());
    }

    fn ended(&self) {
        self.metrics.subscribers.dec();
    }
}

#[cfg(test)]
mod tests;
