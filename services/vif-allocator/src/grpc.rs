//! The gRPC edge: validates requests (naming the offending field), serves `WatchVifs` streams
//! from the VIF index, and hands `ReportPlugged` to the controller.
//!
//! A stream reads deltas from the index's history by revision (like the watcher's Subscribe):
//! the history is the one ordered log, so between snapshot and live nothing is lost or
//! duplicated (the snapshot and its cursor are taken under one lock), and memory does not grow
//! with the number of binders. A stream so far behind that its cursor left the history gets
//! RESET and a fresh snapshot in place. At shutdown every stream ends with UNAVAILABLE, telling
//! binders to reconnect (to another replica, or to this one once it is back).
//!
//! With sharding ([`crate::shards`]), calls about a node this replica does not serve fail with
//! UNAVAILABLE naming the owner (and its endpoint in the `kuryr-shard-owner` trailer), and a
//! node's streams end that way when its shard moves to another replica.

use std::convert::Infallible;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use kuryr_proto::allocator::v1::vif_allocator_server::VifAllocator;
use kuryr_proto::allocator::v1::{
    GetVifRequest, ReportPluggedRequest, ReportPluggedResponse, Vif, VifEventType, WatchVifsRequest, WatchVifsResponse,
};
use kuryr_runtime::Shutdown;
use kuryr_runtime::auth::{self, Caller};
use kuryr_stream::Epoch;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::cluster::Cluster;
use crate::controller::{Controller, PlugError, view_lock};
use crate::index::{Change, Lagged, SharedIndex, Start, lock};
use crate::metrics::Metrics;
use crate::shards::Shards;

/// Responses buffered per stream before the stream task waits for the binder to read.
const STREAM_BUFFER: usize = 128;
/// Deltas copied out of the history per lock.
const BATCH: usize = 256;
/// Bounds on request fields: a resume point is ~40 bytes, names are DNS names.
const MAX_RESUME_FROM: usize = 128;
const MAX_NAME: usize = 253;

/// The heartbeat interval unless told otherwise.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);

/// The controller, once the Kubernetes client exists (the server starts before that).
pub type ControllerCell<C> = Arc<OnceLock<Arc<Controller<C>>>>;

/// The VifAllocator service.
#[derive(Debug)]
pub struct AllocatorService<C> {
    index: SharedIndex,
    controller: ControllerCell<C>,
    metrics: Metrics,
    shutdown: Shutdown,
    shards: Shards,
    heartbeat: Duration,
}

impl<C> AllocatorService<C> {
    /// Serves `index`; plug reports go to the controller once it is in `controller`.
    pub fn new(index: SharedIndex, controller: ControllerCell<C>, metrics: Metrics, shutdown: Shutdown) -> Self {
        Self { index, controller, metrics, shutdown, shards: Shards::all(), heartbeat: DEFAULT_HEARTBEAT }
    }

    /// Streams send a HEARTBEAT whenever nothing else was sent for `every` (`--stream-heartbeat`).
    #[must_use]
    pub fn with_heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = every;
        self
    }

    /// Serves only the nodes `shards` serves, redirecting the others (every node by default).
    #[must_use]
    pub fn with_shards(mut self, shards: Shards) -> Self {
        self.shards = shards;
        self
    }
}

fn required(field: &str, value: &str) -> Result<(), Status> {
    if value.trim().is_empty() {
        return Err(Status::invalid_argument(format!("{field}: required")));
    }
    Ok(())
}

/// An RFC 1123 label.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// An RFC 1123 subdomain: node names.
fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= MAX_NAME && s.split('.').all(is_dns_label)
}

fn node_name(field: &str, value: &str) -> Result<(), Status> {
    required(field, value)?;
    if !is_dns_subdomain(value) {
        return Err(Status::invalid_argument(format!("{field}: `{value}` is not a valid node name")));
    }
    Ok(())
}

/// PERMISSION_DENIED when the caller's credentials are bound to a node other than `node`: a
/// binder acts for its own node only. Callers bound to no node (an operator's token, `--auth
/// none`) are not held to one.
pub fn own_node(caller: Option<&Caller>, field: &str, node: &str) -> Result<(), Status> {
    match caller.and_then(Caller::node) {
        Some(bound) if bound != node => Err(Status::permission_denied(format!(
            "{field}: `{node}` is not the node this caller's token is bound to ({bound})"
        ))),
        _ => Ok(()),
    }
}

/// Checks a WatchVifs request, naming the offending field.
pub fn validate_watch(req: &WatchVifsRequest) -> Result<(), Status> {
    node_name("node_name", &req.node_name)?;
    if req.resume_from.len() > MAX_RESUME_FROM {
        return Err(Status::invalid_argument(format!(
            "resume_from: longer than {MAX_RESUME_FROM} bytes; pass a resume_point back exactly as received"
        )));
    }
    if req.binder_id.len() > MAX_NAME || req.binder_id.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!("binder_id: at most {MAX_NAME} bytes of printable text")));
    }
    Ok(())
}

#[tonic::async_trait]
impl<C: Cluster + std::fmt::Debug> VifAllocator for AllocatorService<C> {
    type WatchVifsStream = ReceiverStream<Result<WatchVifsResponse, Status>>;

    async fn watch_vifs(&self, req: Request<WatchVifsRequest>) -> Result<Response<Self::WatchVifsStream>, Status> {
        let peer = req.remote_addr().map_or_else(|| "local".to_string(), |a| a.to_string());
        let caller = auth::caller(&req).cloned();
        let req = req.into_inner();
        validate_watch(&req)?;
        own_node(caller.as_ref(), "node_name", &req.node_name)?;
        if lock(&self.index).is_ready() {
            self.shards.check(&req.node_name, "WatchVifs")?;
        }
        let (start, epoch, revisions) = {
            let idx = lock(&self.index);
            let start = idx.start(&req.node_name, &req.resume_from).map_err(|e| Status::unavailable(e.to_string()))?;
            (start, idx.epoch().clone(), idx.revisions())
        };
        let binder = if req.binder_id.is_empty() { peer.clone() } else { req.binder_id.clone() };
        let span = tracing::info_span!("binder", node = %req.node_name, binder = %binder, peer = %peer);
        span.in_scope(|| {
            let how = match &start {
                Start::Resume { cursor } => format!("resuming after revision {cursor}"),
                Start::Snapshot { reset, items, cursor } => {
                    format!(
                        "{}snapshot of {} items at revision {cursor}",
                        if *reset { "RESET + " } else { "" },
                        items.len()
                    )
                }
            };
            tracing::info!(resume_from = %req.resume_from, "WatchVifs: {how}");
        });
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let stream = Stream {
            index: self.index.clone(),
            node: req.node_name,
            epoch,
            tx,
            revisions,
            metrics: self.metrics.clone(),
            shards: self.shards.clone(),
            heartbeat: self.heartbeat,
            last_sent: Instant::now(),
        };
        tokio::spawn(stream.run(start, self.shutdown.clone()).instrument(span));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn report_plugged(
        &self,
        req: Request<ReportPluggedRequest>,
    ) -> Result<Response<ReportPluggedResponse>, Status> {
        let caller = auth::caller(&req).cloned();
        let r = req.into_inner();
        required("pod_uid", &r.pod_uid)?;
        required("vif_id", &r.vif_id)?;
        node_name("node_name", &r.node_name)?;
        own_node(caller.as_ref(), "node_name", &r.node_name)?;
        let Some(ctl) = self.controller.get() else {
            return Err(Status::unavailable("the allocator has not recovered its VIFs yet"));
        };
        self.shards.check(&r.node_name, "ReportPlugged")?;
        let vif = ctl.report_plugged(&r.pod_uid, &r.vif_id, &r.node_name, r.plugged).await.map_err(|e| match e {
            PlugError::NotFound(m) => Status::not_found(m),
            PlugError::FailedPrecondition(m) => Status::failed_precondition(m),
            PlugError::Unavailable(m) => Status::unavailable(m),
        })?;
        Ok(Response::new(ReportPluggedResponse { vif: Some(Vif::clone(&vif)) }))
    }

    async fn get_vif(&self, req: Request<GetVifRequest>) -> Result<Response<Vif>, Status> {
        let uid = req.into_inner().pod_uid;
        required("pod_uid", &uid)?;
        let found = {
            let idx = lock(&self.index);
            if !idx.is_ready() {
                return Err(Status::unavailable("the allocator has not recovered its VIFs yet"));
            }
            idx.get(&uid)
        };
        if let Some(v) = found {
            return Ok(Response::new(Vif::clone(&v)));
        }
        // Not here: perhaps because another replica serves the pod's node.
        let node = self.controller.get().and_then(|c| view_lock(c.view()).get(&uid).map(|e| e.info.node.clone()));
        if let Some(node) = node.filter(|n| !n.is_empty()) {
            self.shards.check(&node, "GetVif")?;
        }
        Err(Status::not_found(format!("no VIF for pod {uid}")))
    }
}

/// Why a stream ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The binder went away.
    ClientGone,
    /// The index was dropped: the process is ending.
    IndexGone,
    /// The node's shard is no longer served here.
    Moved,
}

/// One WatchVifs stream.
struct Stream {
    index: SharedIndex,
    node: String,
    epoch: Epoch,
    tx: mpsc::Sender<Result<WatchVifsResponse, Status>>,
    revisions: watch::Receiver<u64>,
    metrics: Metrics,
    shards: Shards,
    heartbeat: Duration,
    /// When the binder was last sent something: a heartbeat is due `heartbeat` after it, also
    /// while changes of other nodes keep the stream busy without anything for this one.
    last_sent: Instant,
}

impl Stream {
    async fn run(mut self, start: Start, shutdown: Shutdown) {
        self.metrics.subscribers.inc();
        let shards = self.shards.clone();
        let node = self.node.clone();
        let ended = tokio::select! {
            res = self.serve(start) => match res {
                Ok(never) => match never {},
                Err(ended) => Some(ended),
            },
            () = shards.lost(&node) => Some(Ended::Moved),
            () = shutdown.wait() => None,
        };
        match ended {
            Some(Ended::Moved) => {
                let _ = self.tx.try_send(Err(shards.refusal(&node)));
                tracing::info!("stream ended: the node's shard moved to another replica");
            }
            None => {
                let status = Status::unavailable("kuryr-vif-allocator is shutting down; reconnect with resume_from");
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
                // Resumed: the subscriber is caught up as of `cursor`, exactly as after a snapshot;
                // without the marker a resuming binder could not tell it is live again.
                self.send(marker(self.epoch.point(cursor), VifEventType::SnapshotComplete)).await?;
                cursor
            }
            Start::Snapshot { reset, items, cursor } => {
                self.metrics.started(if reset { "reset" } else { "snapshot" });
                self.send_snapshot(reset, items, cursor).await?;
                cursor
            }
        };
        loop {
            // Marked seen before reading, so a delta recorded after this read wakes the wait.
            self.revisions.borrow_and_update();
            let batch = lock(&self.index).since(cursor, BATCH);
            if self.last_sent.elapsed() >= self.heartbeat {
                self.send(marker(String::new(), VifEventType::Heartbeat)).await?;
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
                        if d.change.concerns(&self.node) {
                            self.send(response(self.epoch.point(d.revision), &d.change)).await?;
                        }
                    }
                }
                Err(Lagged(at)) => {
                    tracing::warn!(cursor = at, "stream fell out of the history; sending RESET and a new snapshot");
                    self.metrics.started("lagged");
                    let (items, now) = lock(&self.index).snapshot(&self.node);
                    self.send_snapshot(true, items, now).await?;
                    cursor = now;
                }
            }
        }
    }

    async fn send_snapshot(&mut self, reset: bool, items: Vec<Change>, cursor: u64) -> Result<(), Ended> {
        let point = self.epoch.snapshot_point();
        if reset {
            self.send(marker(point.clone(), VifEventType::Reset)).await?;
        }
        for item in &items {
            self.send(response(point.clone(), item)).await?;
        }
        self.send(marker(self.epoch.point(cursor), VifEventType::SnapshotComplete)).await
    }

    async fn send(&mut self, resp: WatchVifsResponse) -> Result<(), Ended> {
        self.tx.send(Ok(resp)).await.map_err(|_| Ended::ClientGone)?;
        self.last_sent = Instant::now();
        Ok(())
    }
}

fn marker(resume_point: String, t: VifEventType) -> WatchVifsResponse {
    WatchVifsResponse { resume_point, r#type: t as i32, vif: None, node_routes: None }
}

/// The response streaming `change`.
pub fn response(resume_point: String, change: &Change) -> WatchVifsResponse {
    let (t, vif, node_routes) = match change {
        Change::VifApplied(v) => (VifEventType::VifApplied, Some(Vif::clone(v)), None),
        Change::VifDeleted(v) => (VifEventType::VifDeleted, Some(Vif::clone(v)), None),
        Change::RoutesApplied(r) => (VifEventType::NodeRoutesApplied, None, Some((**r).clone())),
        Change::RoutesDeleted(r) => (VifEventType::NodeRoutesDeleted, None, Some((**r).clone())),
    };
    WatchVifsResponse { resume_point, r#type: t as i32, vif, node_routes }
}

#[cfg(test)]
#[path = "grpc_tests.rs"]
mod tests;
