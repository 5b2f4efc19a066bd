//! A scripted VIF allocator: a real gRPC server implementing `kuryr.allocator.v1.VifAllocator`
//! whose VIFs the test decides. It lets the binder be tested through the real CNI path before
//! (and independently of) the real allocator. Like the real one, it sends a HEARTBEAT whenever a
//! stream has been quiet for [`HEARTBEAT`].

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::Result;
use futures::Stream;
use kuryr_proto::allocator::v1::vif_allocator_server::{VifAllocator, VifAllocatorServer};
use kuryr_proto::allocator::v1::{
    Binding, BindingDriver, GetVifRequest, IpConfig, NodeRoutes, PodRef, ReportPluggedRequest, ReportPluggedResponse,
    Route, Vif, VifEventType, VifState, WatchVifsRequest, WatchVifsResponse,
};
use tokio::sync::{broadcast, oneshot};
use tonic::{Request, Response, Status};

/// How often a quiet stream carries a HEARTBEAT, as the allocator's default `--stream-heartbeat`.
pub const HEARTBEAT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct State {
    vifs: BTreeMap<String, Vif>,
    node_routes: BTreeMap<String, NodeRoutes>,
    revision: u64,
    reports: Vec<ReportPluggedRequest>,
    /// When set, a plugged report makes the VIF READY at once (as the embedded backend does).
    auto_ready: bool,
    /// When set, every report is answered UNAVAILABLE (and counted in `refused_reports`).
    refuse_reports: bool,
    refused_reports: usize,
}

/// The scripted allocator; cheap to clone.
#[derive(Clone)]
pub struct ScriptedAllocator {
    state: Arc<Mutex<State>>,
    events: broadcast::Sender<WatchVifsResponse>,
}

impl std::fmt::Debug for ScriptedAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScriptedAllocator")
    }
}

/// A running scripted allocator server; stops on drop.
#[derive(Debug)]
pub struct ScriptedServer {
    pub allocator: ScriptedAllocator,
    /// The address to give binders (`--allocator`).
    pub target: String,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

impl ScriptedAllocator {
    /// A new allocator with no VIFs; `auto_ready` as described on `State`.
    pub fn new(auto_ready: bool) -> Self {
        let (events, _) = broadcast::channel(1024);
        Self { state: Arc::new(Mutex::new(State { auto_ready, ..Default::default() })), events }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Serves on a unix socket at `path`: reachable from binders in any network namespace of
    /// the test, since the socket lives in the filesystem.
    pub async fn serve_unix(&self, path: &std::path::Path) -> Result<ScriptedServer> {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path)?;
        let (tx, rx) = oneshot::channel::<()>();
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter.set_serving::<VifAllocatorServer<ScriptedAllocator>>().await;
        let svc = VifAllocatorServer::new(self.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(health)
                .add_service(svc)
                .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(listener), async {
                    let _ = rx.await;
                })
                .await;
        });
        Ok(ScriptedServer { allocator: self.clone(), target: format!("unix:{}", path.display()), stop: Some(tx) })
    }

    /// Streams an event about a VIF or a node's routes at the next revision.
    fn send(&self, s: &mut State, t: VifEventType, vif: Option<Vif>, node_routes: Option<NodeRoutes>) {
        s.revision += 1;
        let _ = self.events.send(WatchVifsResponse {
            resume_point: s.revision.to_string(),
            r#type: t as i32,
            vif,
            node_routes,
        });
    }

    fn publish(&self, s: &mut State, t: VifEventType, vif: Vif) {
        self.send(s, t, Some(vif), None);
    }

    /// Adds or replaces a VIF and streams it.
    pub fn upsert(&self, vif: Vif) {
        let mut s = self.lock();
        let uid = vif.pod.as_ref().map(|p| p.uid.clone()).unwrap_or_default();
        s.vifs.insert(uid, vif.clone());
        self.publish(&mut s, VifEventType::VifApplied, vif);
    }

    /// Sets a VIF's state and streams it.
    pub fn set_state(&self, pod_uid: &str, state: VifState) {
        let mut s = self.lock();
        if let Some(v) = s.vifs.get_mut(pod_uid) {
            v.state = state as i32;
            let v = v.clone();
            self.publish(&mut s, VifEventType::VifApplied, v);
        }
    }

    /// Releases a pod's VIF (the pod was deleted) and streams it.
    pub fn delete(&self, pod_uid: &str) {
        let mut s = self.lock();
        if let Some(v) = s.vifs.remove(pod_uid) {
            self.publish(&mut s, VifEventType::VifDeleted, v);
        }
    }

    /// Announces (or changes) another node's pod blocks.
    pub fn upsert_node_routes(&self, routes: NodeRoutes) {
        let mut s = self.lock();
        s.node_routes.insert(routes.node_name.clone(), routes.clone());
        self.send(&mut s, VifEventType::NodeRoutesApplied, None, Some(routes));
    }

    /// Withdraws a node's pod blocks.
    pub fn delete_node_routes(&self, node: &str) {
        let mut s = self.lock();
        if let Some(r) = s.node_routes.remove(node) {
            self.send(&mut s, VifEventType::NodeRoutesDeleted, None, Some(r));
        }
    }

    /// Makes every report from now on fail with UNAVAILABLE (`true`), or be answered again.
    pub fn refuse_reports(&self, refuse: bool) {
        self.lock().refuse_reports = refuse;
    }

    /// How many reports were refused (see [`ScriptedAllocator::refuse_reports`]).
    pub fn refused_reports(&self) -> usize {
        self.lock().refused_reports
    }

    /// The VIF of a pod, as served now.
    pub fn vif(&self, pod_uid: &str) -> Option<Vif> {
        self.lock().vifs.get(pod_uid).cloned()
    }

    /// Every plugged/unplugged report received.
    pub fn reports(&self) -> Vec<ReportPluggedRequest> {
        self.lock().reports.clone()
    }

    /// A VIF's current state.
    pub fn state_of(&self, pod_uid: &str) -> Option<VifState> {
        self.lock().vifs.get(pod_uid).map(Vif::state)
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<WatchVifsResponse, Status>> + Send>>;

#[tonic::async_trait]
impl VifAllocator for ScriptedAllocator {
    type WatchVifsStream = EventStream;

    async fn watch_vifs(&self, req: Request<WatchVifsRequest>) -> Result<Response<EventStream>, Status> {
        let req = req.into_inner();
        if req.node_name.is_empty() {
            return Err(Status::invalid_argument("node_name: required"));
        }
        let node = req.node_name.clone();
        let mut rx = self.events.subscribe();
        let (snapshot, routes, revision) = {
            let s = self.lock();
            let vifs: Vec<Vif> =
                s.vifs.values().filter(|v| v.pod.as_ref().is_some_and(|p| p.node_name == node)).cloned().collect();
            let routes: Vec<NodeRoutes> = s.node_routes.values().filter(|r| r.node_name != node).cloned().collect();
            (vifs, routes, s.revision)
        };
        let resumed = !req.resume_from.is_empty();
        let stream = async_stream::stream! {
            // This scripted server keeps no history: a resume always restarts from a snapshot.
            if resumed {
                yield Ok(WatchVifsResponse { resume_point: String::new(), r#type: VifEventType::Reset as i32, vif: None, node_routes: None });
            }
            for v in snapshot {
                yield Ok(WatchVifsResponse { resume_point: revision.to_string(), r#type: VifEventType::VifApplied as i32, vif: Some(v), node_routes: None });
            }
            for r in routes {
                yield Ok(WatchVifsResponse { resume_point: revision.to_string(), r#type: VifEventType::NodeRoutesApplied as i32, vif: None, node_routes: Some(r) });
            }
            yield Ok(WatchVifsResponse { resume_point: revision.to_string(), r#type: VifEventType::SnapshotComplete as i32, vif: None, node_routes: None });
            loop {
                let Ok(next) = tokio::time::timeout(HEARTBEAT, rx.recv()).await else {
                    yield Ok(WatchVifsResponse { resume_point: String::new(), r#type: VifEventType::Heartbeat as i32, vif: None, node_routes: None });
                    continue;
                };
                match next {
                    Ok(ev) => {
                        if ev.resume_point.parse::<u64>().unwrap_or(0) <= revision { continue; }
                        let for_node = ev.vif.as_ref().and_then(|v| v.pod.as_ref()).is_some_and(|p| p.node_name == node)
                            || ev.node_routes.as_ref().is_some_and(|r| r.node_name != node);
                        if for_node {
                            yield Ok(ev);
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        yield Err(Status::data_loss("subscriber fell behind; resubscribe"));
                        break;
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                }
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn report_plugged(
        &self,
        req: Request<ReportPluggedRequest>,
    ) -> Result<Response<ReportPluggedResponse>, Status> {
        let r = req.into_inner();
        let mut s = self.lock();
        if s.refuse_reports {
            s.refused_reports += 1;
            return Err(Status::unavailable("the scripted allocator refuses reports"));
        }
        s.reports.push(r.clone());
        let auto = s.auto_ready;
        let Some(v) = s.vifs.get_mut(&r.pod_uid) else {
            return Err(Status::not_found(format!("no VIF for pod {}", r.pod_uid)));
        };
        if v.vif_id != r.vif_id {
            return Err(Status::failed_precondition(format!(
                "pod {} has VIF {}, not {}",
                r.pod_uid, v.vif_id, r.vif_id
            )));
        }
        if r.plugged {
            v.state = if auto { VifState::Ready } else { VifState::Plugged } as i32;
        } else {
            v.state = VifState::Allocated as i32;
        }
        let v = v.clone();
        self.publish(&mut s, VifEventType::VifApplied, v.clone());
        Ok(Response::new(ReportPluggedResponse { vif: Some(v) }))
    }

    async fn get_vif(&self, req: Request<GetVifRequest>) -> Result<Response<Vif>, Status> {
        let uid = req.into_inner().pod_uid;
        self.lock()
            .vifs
            .get(&uid)
            .cloned()
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no VIF for pod {uid}")))
    }
}

/// A VIF for the bridge driver with one IPv4 address (and optionally IPv6).
pub fn bridge_vif(
    node: &str,
    ns: &str,
    name: &str,
    uid: &str,
    ipv4: (&str, &str),
    ipv6: Option<(&str, &str)>,
    bridge: &str,
) -> Vif {
    let mut ips = vec![IpConfig { address: ipv4.0.into(), gateway: ipv4.1.into() }];
    if let Some((a, g)) = ipv6 {
        ips.push(IpConfig { address: a.into(), gateway: g.into() });
    }
    // A locally administered unicast MAC derived from the uid, so tests can predict it.
    let h = uid.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    let mac = format!("0a:58:{:02x}:{:02x}:{:02x}:{:02x}", h >> 24, (h >> 16) & 0xff, (h >> 8) & 0xff, h & 0xff);
    Vif {
        pod: Some(PodRef { namespace: ns.into(), name: name.into(), uid: uid.into(), node_name: node.into() }),
        vif_id: format!("vif-{uid}"),
        mac,
        mtu: 1400,
        ips,
        routes: vec![Route { destination: "198.18.0.0/15".into(), gateway: ipv4.1.into() }],
        binding: Some(Binding {
            driver: BindingDriver::Bridge as i32,
            bridge: bridge.into(),
            host_ifname: String::new(),
            vlan_id: 0,
        }),
        state: VifState::Allocated as i32,
        backend: "scripted".into(),
        ..Default::default()
    }
}
