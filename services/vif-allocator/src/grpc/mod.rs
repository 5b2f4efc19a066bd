//! The gRPC edge: validates requests (naming the offending field), serves `WatchVifs` streams
//! from the VIF index, and hands `ReportPlugged` to the controller.
//!
//! A stream is served by the shared core ([`kuryr_stream::feed`], as the watcher's Subscribe):
//! it reads deltas from the index's log by revision, so between snapshot and live nothing is
//! lost or duplicated and memory does not grow with the number of binders; a stream so far
//! behind that its cursor left the history gets RESET and a fresh snapshot in place; a resumed
//! stream begins with SNAPSHOT_COMPLETE; a quiet one gets a HEARTBEAT every `--stream-heartbeat`.
//! Events are encoded as `WatchVifsResponse`s here, at the edge. At shutdown every stream ends
//! with UNAVAILABLE, telling binders to reconnect (to another replica, or to this one once it is
//! back).
//!
//! With sharding ([`crate::shards`]), calls about a node this replica does not serve fail with
//! UNAVAILABLE naming the owner (and its endpoint in the `kuryr-shard-owner` trailer), and a
//! node's streams end that way when its shard moves to another replica.

pub mod convert;
pub mod follow;
pub mod pool_api;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kuryr_proto::allocator::v1::vif_allocator_server::VifAllocator;
use kuryr_proto::allocator::v1::{
    GetVifRequest, ReportPluggedRequest, ReportPluggedResponse, Vif, VifEventType, WatchVifsRequest, WatchVifsResponse,
};
use kuryr_runtime::Shutdown;
use kuryr_runtime::auth;
use kuryr_runtime::validate::{node_name, own_node, required, resume_from, subscriber};
use kuryr_stream::{Event, How, Options, Subscriber};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::cluster::Cluster;
use crate::controller::{Controller, view_lock};
use crate::error::PlugError;
use crate::index::{Change, Item, Key, SharedIndex, lock};
use crate::metrics::Metrics;
use crate::shards::Shards;

/// Responses buffered per stream before the stream task waits for the binder to read.
const STREAM_BUFFER: usize = 128;
/// The heartbeat interval unless told otherwise (`--stream-heartbeat`).
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);

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
        Self {
            index,
            controller,
            metrics,
            shutdown,
            shards: Shards::all(crate::shards::SERVICE),
            heartbeat: DEFAULT_HEARTBEAT,
        }
    }

    /// Streams carry a HEARTBEAT whenever nothing else was sent for `every`.
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

/// Checks a WatchVifs request, naming the offending field.
pub fn validate_watch(req: &WatchVifsRequest) -> Result<(), Status> {
    node_name("node_name", &req.node_name)?;
    resume_from(&req.resume_from)?;
    subscriber("binder_id", &req.binder_id)
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
        let binder = if req.binder_id.is_empty() { peer.clone() } else { req.binder_id.clone() };
        let span = tracing::info_span!("binder", node = %req.node_name, binder = %binder, peer = %peer);
        let sub = Stream { node: req.node_name.clone(), metrics: self.metrics.clone() };
        let (shutdown, shards, node) = (self.shutdown.clone(), self.shards.clone(), req.node_name.clone());
        let stop = async move {
            tokio::select! {
                () = shards.lost(&node) => {
                    tracing::info!("the node's shard moved to another replica; ending its stream");
                    Err(shards.refusal(&node))
                }
                () = shutdown.wait() => {
                    Err(Status::unavailable("kuryr-vif-allocator is shutting down; reconnect with resume_from"))
                }
            }
        };
        let options = Options { buffer: STREAM_BUFFER, heartbeat: Some(self.heartbeat) };
        let opened = kuryr_stream::feed::subscribe(&self.index, &req.resume_from, sub, options, stop, span.clone())
            .map_err(|_| Status::unavailable("the allocator has not recovered its VIFs from the Kubernetes API yet"))?;
        self.metrics.subscribers.inc();
        span.in_scope(|| {
            tracing::info!(resume_from = %req.resume_from, how = opened.how.label(), items = opened.items,
                cursor = opened.cursor, "WatchVifs");
        });
        Ok(Response::new(ReceiverStream::new(opened.rx)))
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
        Ok(Response::new(ReportPluggedResponse { vif: Some(convert::vif_to_proto(&vif)) }))
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
            return Ok(Response::new(convert::vif_to_proto(&v)));
        }
        // Not here: perhaps because another replica serves the pod's node.
        let node = self.controller.get().and_then(|c| view_lock(c.view()).get(&uid).map(|e| e.info.node.clone()));
        if let Some(node) = node.filter(|n| !n.is_empty()) {
            self.shards.check(&node, "GetVif")?;
        }
        Err(Status::not_found(format!("no VIF for pod {uid}")))
    }
}

/// One WatchVifs stream: its node's VIFs and the other nodes' routes, as `WatchVifsResponse`s.
struct Stream {
    node: String,
    metrics: Metrics,
}

impl Subscriber<Key, Item> for Stream {
    type Item = Result<WatchVifsResponse, Status>;

    fn wants(&self, _key: &Key, item: &Item) -> bool {
        item.concerns(&self.node)
    }

    fn encode(&self, point: String, event: Event<'_, Key, Item>) -> Self::Item {
        Ok(match event {
            Event::Reset => marker(point, VifEventType::Reset),
            Event::SnapshotComplete => marker(point, VifEventType::SnapshotComplete),
            Event::Heartbeat => marker(point, VifEventType::Heartbeat),
            Event::Applied(_, item) => response(point, Change::applied(item)),
            Event::Deleted(_, item) => response(point, Change::deleted(item)),
        })
    }

    fn started(&self, how: How) {
        self.metrics.started(how.label());
    }

    fn ended(&self) {
        self.metrics.subscribers.dec();
    }
}

fn marker(resume_point: String, t: VifEventType) -> WatchVifsResponse {
    WatchVifsResponse { resume_point, r#type: t as i32, vif: None, node_routes: None }
}

/// The response streaming `change`, encoded from the index's domain types here, at the edge.
pub fn response(resume_point: String, change: Change<'_>) -> WatchVifsResponse {
    let (t, vif, node_routes) = match change {
        Change::VifApplied(v) => (VifEventType::VifApplied, Some(convert::vif_to_proto(v)), None),
        Change::VifDeleted(v) => (VifEventType::VifDeleted, Some(convert::vif_to_proto(v)), None),
        Change::RoutesApplied(r) => (VifEventType::NodeRoutesApplied, None, Some(convert::routes_to_proto(r))),
        Change::RoutesDeleted(r) => (VifEventType::NodeRoutesDeleted, None, Some(convert::routes_to_proto(r))),
    };
    WatchVifsResponse { resume_point, r#type: t as i32, vif, node_routes }
}

#[cfg(test)]
#[path = "grpc_tests.rs"]
mod tests;
