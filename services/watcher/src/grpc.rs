//! The gRPC edge: validates Subscribe requests and runs one task per stream that sends a
//! snapshot (or nothing, when resuming) and then the index's history from its cursor on.
//!
//! A stream reads deltas from the index's history by revision instead of receiving its own copy
//! of each: the history is the one ordered log, so between snapshot and live nothing can be lost
//! or duplicated (the snapshot and its cursor are taken under one lock), and memory does not grow
//! with the number of subscribers. A stream that falls so far behind (a client not reading) that
//! its cursor leaves the bounded history gets RESET + a fresh snapshot in place, on the same
//! stream, counted as `kuryr_watcher_subscriptions_total{start="lagged"}`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use kuryr_proto::watcher::v1::watcher_server::Watcher;
use kuryr_proto::watcher::v1::{EventType, Kind, Object, SubscribeRequest, SubscribeResponse};
use kuryr_runtime::Shutdown;
use kuryr_stream::Epoch;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::index::{Change, Delta, Lagged, SharedIndex, Start, lock};
use crate::metrics::Metrics;
use crate::selector::{Selector, kind_label};

/// Responses buffered per stream before the stream task waits for the client to read.
const STREAM_BUFFER: usize = 128;
/// Deltas copied out of the history per lock.
const BATCH: usize = 256;
/// Bounds on request fields: a resume point is ~40 bytes, names are DNS names.
const MAX_RESUME_FROM: usize = 128;
const MAX_SUBSCRIBER: usize = 253;

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
    /// else was sent for `heartbeat` (`--stream-heartbeat`).
    pub fn new(index: SharedIndex, metrics: Metrics, shutdown: Shutdown, heartbeat: Duration) -> Self {
        Self { index, metrics, shutdown, heartbeat }
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
        let (start, epoch, revisions) = {
            let idx = lock(&self.index);
            let start = idx.start(&selector, &req.resume_from).map_err(|e| Status::unavailable(e.to_string()))?;
            (start, idx.epoch().clone(), idx.revisions())
        };
        let span = tracing::info_span!("subscriber", subscriber = %subscriber, peer = %peer);
        span.in_scope(|| {
            let kinds: Vec<_> = selector.kinds().map(kind_label).collect();
            let how = match &start {
                Start::Resume { cursor } => format!("resuming after revision {cursor}"),
                Start::Snapshot { reset, objects, cursor } => {
                    format!("{}snapshot of {} objects at revision {cursor}", if *reset { "RESET + " } else { "" }, objects.len())
                }
            };
            tracing::info!(?kinds, node = ?selector.node_name, namespace = ?selector.namespace,
                exclude_host_network = selector.exclude_host_network, resume_from = %req.resume_from, "subscribed: {how}");
        });
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let stream = Stream {
            index: self.index.clone(),
            selector,
            epoch,
            tx,
            revisions,
            metrics: self.metrics.clone(),
            heartbeat: self.heartbeat,
            last_sent: Instant::now(),
        };
        tokio::spawn(stream.run(start, self.shutdown.clone()).instrument(span));
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
    if req.resume_from.len() > MAX_RESUME_FROM {
        return Err(Status::invalid_argument(format!(
            "resume_from: longer than {MAX_RESUME_FROM} bytes; pass a resume_point back exactly as received"
        )));
    }
    if req.subscriber.len() > MAX_SUBSCRIBER || req.subscriber.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!(
            "subscriber: at most {MAX_SUBSCRIBER} bytes of printable text (for example \"binder/node-1\")"
        )));
    }
    Ok(selector)
}

/// An RFC 1123 label: namespace names.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// An RFC 1123 subdomain: node names.
fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// Why a stream ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The client went away (cancelled, disconnected).
    ClientGone,
    /// The index was dropped: the process is ending.
    IndexGone,
}

/// One Subscribe stream.
struct Stream {
    index: SharedIndex,
    selector: Selector,
    epoch: Epoch,
    tx: mpsc::Sender<Result<SubscribeResponse, Status>>,
    revisions: watch::Receiver<u64>,
    metrics: Metrics,
    heartbeat: Duration,
    /// When the subscriber was last sent something: a heartbeat is due `heartbeat` after it,
    /// also while changes it does not select keep the stream busy.
    last_sent: Instant,
}

impl Stream {
    async fn run(mut self, start: Start, shutdown: Shutdown) {
        self.metrics.subscribers.inc();
        let ended = tokio::select! {
            res = self.serve(start) => match res {
                Ok(never) => match never {},
                Err(ended) => Some(ended),
            },
            () = shutdown.wait() => None,
        };
        match ended {
            None => {
                // Tell the client to go elsewhere rather than end as if the stream were complete.
                let status = Status::unavailable("kuryr-watcher is shutting down; resubscribe with resume_from");
                let _ = self.tx.try_send(Err(status));
                tracing::info!("stream ended: shutting down");
            }
            Some(why) => tracing::info!(?why, "stream ended"),
        }
        self.metrics.subscribers.dec();
    }

    async fn serve(&mut self, start: Start) -> Result<Infallible, Ended> {
        let mut cursor = match start {
            Start::Resume { cursor } => {
                self.metrics.started("resume");
                // The subscriber is caught up as of `cursor`, exactly as after a snapshot; without
                // the marker a subscriber that resumed after a break (an idle timeout, a lost
                // connection) could not tell that it is live again.
                let done = SubscribeResponse {
                    resume_point: self.epoch.point(cursor),
                    r#type: EventType::SnapshotComplete as i32,
                    object: None,
                };
                self.send(done).await?;
                cursor
            }
            Start::Snapshot { reset, objects, cursor } => {
                self.metrics.started(if reset { "reset" } else { "snapshot" });
                self.send_snapshot(reset, objects, cursor).await?;
                cursor
            }
        };
        loop {
            // Marked seen before reading, so a delta recorded after this read wakes the wait.
            self.revisions.borrow_and_update();
            let batch = lock(&self.index).since(cursor, BATCH);
            if self.last_sent.elapsed() >= self.heartbeat {
                let beat = SubscribeResponse {
                    resume_point: String::new(),
                    r#type: EventType::Heartbeat as i32,
                    object: None,
                };
                self.send(beat).await?;
            }
            match batch {
                Ok(deltas) if deltas.is_empty() => {
                    let due = self.last_sent + self.heartbeat;
                    tokio::select! {
                        changed = self.revisions.changed() => changed.map_err(|_| Ended::IndexGone)?,
                        () = self.tx.closed() => return Err(Ended::ClientGone),
                        () = tokio::time::sleep_until(due) => {}
                    }
                }
                Ok(deltas) => {
                    for d in deltas {
                        cursor = d.revision;
                        if self.selector.matches(&d.object) {
                            self.send(self.delta(&d)).await?;
                        }
                    }
                }
                Err(Lagged(at)) => {
                    tracing::warn!(cursor = at, "stream fell out of the history; sending RESET and a new snapshot");
                    self.metrics.started("lagged");
                    let (objects, now) = lock(&self.index).snapshot(&self.selector);
                    self.send_snapshot(true, objects, now).await?;
                    cursor = now;
                }
            }
        }
    }

    async fn send_snapshot(&mut self, reset: bool, objects: Vec<Arc<Object>>, cursor: u64) -> Result<(), Ended> {
        let point = self.epoch.snapshot_point();
        if reset {
            self.send(SubscribeResponse { resume_point: point.clone(), r#type: EventType::Reset as i32, object: None })
                .await?;
        }
        for obj in objects {
            let object = Some(Arc::unwrap_or_clone(obj));
            self.send(SubscribeResponse { resume_point: point.clone(), r#type: EventType::Applied as i32, object })
                .await?;
        }
        let done = SubscribeResponse {
            resume_point: self.epoch.point(cursor),
            r#type: EventType::SnapshotComplete as i32,
            object: None,
        };
        self.send(done).await
    }

    fn delta(&self, d: &Delta) -> SubscribeResponse {
        let r#type = match d.change {
            Change::Applied => EventType::Applied,
            Change::Deleted => EventType::Deleted,
        };
        SubscribeResponse {
            resume_point: self.epoch.point(d.revision),
            r#type: r#type as i32,
            object: Some(Object::clone(&d.object)),
        }
    }

    async fn send(&mut self, resp: SubscribeResponse) -> Result<(), Ended> {
        self.tx.send(Ok(resp)).await.map_err(|_| Ended::ClientGone)?;
        self.last_sent = Instant::now();
        Ok(())
    }
}

#[cfg(test)]
#[path = "grpc_tests.rs"]
mod tests;
