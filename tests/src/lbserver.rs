//! A scripted kuryr-lbaas: a real gRPC server implementing `kuryr.lbaas.v1.LoadBalancers` whose
//! load balancer specs the test decides. It streams them as kuryr-lbaas does — a snapshot,
//! SNAPSHOT_COMPLETE, deltas, a HEARTBEAT whenever quiet for [`HEARTBEAT`]; resuming from a
//! resume point with SNAPSHOT_COMPLETE and only what changed, or RESET and a fresh snapshot when
//! the point is unknown — so the binder's Service dataplane can be tested on its own.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::Result;
use futures::Stream;
use kuryr_proto::lbaas::v1::load_balancers_server::{LoadBalancers, LoadBalancersServer};
use kuryr_proto::lbaas::v1::{
    GetLoadBalancerRequest, LbEventType, ListLoadBalancersRequest, ListLoadBalancersResponse, Listener, LoadBalancer,
    LoadBalancerSpec, Member, Pool, Protocol, SessionAffinity, TrafficPolicy, WatchLoadBalancersRequest,
    WatchLoadBalancersResponse,
};
use tokio::sync::{broadcast, oneshot, watch};
use tonic::{Request, Response, Status};

/// How often a quiet stream carries a HEARTBEAT, as kuryr-lbaas' default `--stream-heartbeat`.
pub const HEARTBEAT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct State {
    specs: BTreeMap<(String, String), LoadBalancerSpec>,
    /// Every event so far, by revision (index + 1); resumes replay from here.
    history: Vec<WatchLoadBalancersResponse>,
    /// Resume points carry it; changing it makes every resume fail (as a restarted kuryr-lbaas).
    epoch: u64,
    /// `resume_from` of every WatchLoadBalancers request, in order.
    requests: Vec<String>,
}

impl State {
    fn point(&self, revision: usize) -> String {
        format!("{}-{revision}", self.epoch)
    }

    fn revision_of(&self, point: &str) -> Option<usize> {
        let (epoch, rev) = point.split_once('-')?;
        (epoch.parse::<u64>().ok()? == self.epoch).then_some(())?;
        rev.parse::<usize>().ok().filter(|r| *r <= self.history.len())
    }
}

/// The scripted kuryr-lbaas; cheap to clone.
#[derive(Clone)]
pub struct ScriptedLbaas {
    state: Arc<Mutex<State>>,
    events: broadcast::Sender<(usize, WatchLoadBalancersResponse)>,
    /// Bumped to end every open stream with UNAVAILABLE (a network break, a restart).
    breaks: watch::Sender<u64>,
}

impl std::fmt::Debug for ScriptedLbaas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScriptedLbaas")
    }
}

/// A running scripted server; stops (ending its streams) on drop.
#[derive(Debug)]
pub struct ScriptedLbServer {
    pub lbaas: ScriptedLbaas,
    /// The address to give binders (`--lbaas`).
    pub target: String,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for ScriptedLbServer {
    fn drop(&mut self) {
        // Open streams would keep a graceful shutdown waiting: end them first.
        self.lbaas.break_streams();
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

impl Default for ScriptedLbaas {
    fn default() -> Self {
        Self::new()
    }
}

impl ScriptedLbaas {
    pub fn new() -> Self {
        let (events, _) = broadcast::channel(4096);
        Self {
            state: Arc::new(Mutex::new(State { epoch: 1, ..Default::default() })),
            events,
            breaks: watch::channel(0).0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Serves on a unix socket at `path`, reachable from binders in any network namespace.
    pub async fn serve_unix(&self, path: &std::path::Path) -> Result<ScriptedLbServer> {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path)?;
        let (tx, rx) = oneshot::channel::<()>();
        let svc = LoadBalancersServer::new(self.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(listener), async {
                    let _ = rx.await;
                })
                .await;
        });
        Ok(ScriptedLbServer { lbaas: self.clone(), target: format!("unix:{}", path.display()), stop: Some(tx) })
    }

    fn publish(&self, s: &mut State, t: LbEventType, spec: LoadBalancerSpec) {
        let revision = s.history.len() + 1;
        let ev = WatchLoadBalancersResponse { resume_point: s.point(revision), r#type: t as i32, spec: Some(spec) };
        s.history.push(ev.clone());
        let _ = self.events.send((revision, ev));
    }

    /// Adds or replaces a Service's spec (raising its generation) and streams it.
    pub fn upsert(&self, mut spec: LoadBalancerSpec) {
        let mut s = self.lock();
        let key = (spec.namespace.clone(), spec.name.clone());
        spec.generation = s.specs.get(&key).map_or(1, |old| old.generation + 1);
        s.specs.insert(key, spec.clone());
        self.publish(&mut s, LbEventType::LbApplied, spec);
    }

    /// Deletes a Service's load balancer and streams LB_DELETED.
    pub fn delete(&self, namespace: &str, name: &str) {
        let mut s = self.lock();
        if let Some(old) = s.specs.remove(&(namespace.to_string(), name.to_string())) {
            let spec =
                LoadBalancerSpec { namespace: old.namespace, name: old.name, uid: old.uid, ..Default::default() };
            self.publish(&mut s, LbEventType::LbDeleted, spec);
        }
    }

    /// Ends every open stream with UNAVAILABLE; subscribers reconnect and resume.
    pub fn break_streams(&self) {
        self.breaks.send_modify(|n| *n += 1);
    }

    /// Forgets the resume points handed out (a restarted kuryr-lbaas): the next resume gets RESET
    /// and a fresh snapshot. Open streams are ended.
    pub fn new_epoch(&self) {
        self.lock().epoch += 1;
        self.break_streams();
    }

    /// Changes a spec without streaming it (what a binder that missed an event would not know).
    pub fn upsert_silently(&self, spec: LoadBalancerSpec) {
        self.lock().specs.insert((spec.namespace.clone(), spec.name.clone()), spec);
    }

    /// Removes a spec without streaming it.
    pub fn delete_silently(&self, namespace: &str, name: &str) {
        self.lock().specs.remove(&(namespace.to_string(), name.to_string()));
    }

    /// The `resume_from` of every WatchLoadBalancers request so far.
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<WatchLoadBalancersResponse, Status>> + Send>>;

fn marker(resume_point: String, t: LbEventType) -> WatchLoadBalancersResponse {
    WatchLoadBalancersResponse { resume_point, r#type: t as i32, spec: None }
}

#[tonic::async_trait]
impl LoadBalancers for ScriptedLbaas {
    type WatchLoadBalancersStream = EventStream;

    async fn watch_load_balancers(
        &self,
        req: Request<WatchLoadBalancersRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let req = req.into_inner();
        let mut rx = self.events.subscribe();
        let mut breaks = self.breaks.subscribe();
        breaks.borrow_and_update();
        // What to send first, decided under the lock that publishing takes too.
        let (first, cursor) = {
            let mut s = self.lock();
            s.requests.push(req.resume_from.clone());
            let now = s.history.len();
            match s.revision_of(&req.resume_from) {
                Some(rev) => {
                    let mut first = vec![marker(s.point(rev), LbEventType::SnapshotComplete)];
                    first.extend_from_slice(&s.history[rev..]);
                    (first, now)
                }
                None => {
                    let mut first = Vec::new();
                    if !req.resume_from.is_empty() {
                        first.push(marker(s.point(now), LbEventType::Reset));
                    }
                    for spec in s.specs.values() {
                        first.push(WatchLoadBalancersResponse {
                            resume_point: s.point(now),
                            r#type: LbEventType::LbApplied as i32,
                            spec: Some(spec.clone()),
                        });
                    }
                    first.push(marker(s.point(now), LbEventType::SnapshotComplete));
                    (first, now)
                }
            }
        };
        let stream = async_stream::stream! {
            for ev in first {
                yield Ok(ev);
            }
            loop {
                tokio::select! {
                    ev = rx.recv() => match ev {
                        Ok((rev, ev)) => if rev > cursor { yield Ok(ev) },
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            yield Err(Status::data_loss("subscriber fell behind; resubscribe"));
                            break;
                        }
                        Err(broadcast::error::RecvError::Closed) => break,
                    },
                    _ = breaks.changed() => {
                        yield Err(Status::unavailable("stream ended by the test; resume"));
                        break;
                    }
                    () = tokio::time::sleep(HEARTBEAT) => yield Ok(marker(String::new(), LbEventType::Heartbeat)),
                }
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_load_balancer(&self, req: Request<GetLoadBalancerRequest>) -> Result<Response<LoadBalancer>, Status> {
        let r = req.into_inner();
        let s = self.lock();
        let spec = s
            .specs
            .get(&(r.namespace.clone(), r.name.clone()))
            .cloned()
            .ok_or_else(|| Status::not_found(format!("no load balancer for {}/{}", r.namespace, r.name)))?;
        Ok(Response::new(LoadBalancer { spec: Some(spec), backend: "node".into(), ..Default::default() }))
    }

    async fn list_load_balancers(
        &self,
        req: Request<ListLoadBalancersRequest>,
    ) -> Result<Response<ListLoadBalancersResponse>, Status> {
        let ns = req.into_inner().namespace;
        let s = self.lock();
        let load_balancers = s
            .specs
            .values()
            .filter(|spec| ns.is_empty() || spec.namespace == ns)
            .map(|spec| LoadBalancer { spec: Some(spec.clone()), backend: "node".into(), ..Default::default() })
            .collect();
        Ok(Response::new(ListLoadBalancersResponse { load_balancers }))
    }
}

/// A member of a pool.
#[derive(Clone, Debug)]
pub struct TestMember {
    pub address: String,
    pub port: u32,
    pub ready: bool,
    pub serving: bool,
    pub pod: String,
    /// The node it runs on (empty: unknown, never local).
    pub node: String,
}

impl TestMember {
    /// A ready member.
    pub fn ready(address: &str, port: u32, pod: &str) -> Self {
        Self { address: address.into(), port, ready: true, serving: true, pod: pod.into(), node: String::new() }
    }

    /// A terminating member that still serves.
    pub fn terminating(address: &str, port: u32, pod: &str) -> Self {
        Self { address: address.into(), port, ready: false, serving: true, pod: pod.into(), node: String::new() }
    }

    /// The member, running on `node`.
    pub fn on(mut self, node: &str) -> Self {
        self.node = node.into();
        self
    }
}

/// What a Service spec carries beyond one TCP port on cluster IPs ([`service_spec_with`]).
#[derive(Clone, Debug, Default)]
pub struct SpecOptions {
    /// The node port of every listener.
    pub node_port: Option<u32>,
    /// Listen on UDP as well, same port (and node port).
    pub udp: bool,
    pub external_ips: Vec<String>,
    pub ingress_ips: Vec<String>,
    pub external_local: bool,
    pub internal_local: bool,
}

/// A ClusterIP Service spec with one TCP listener on `port` over `members`.
pub fn service_spec(
    namespace: &str,
    name: &str,
    vips: &[&str],
    port: u32,
    members: &[TestMember],
    affinity_timeout: Option<u32>,
) -> LoadBalancerSpec {
    service_spec_with(namespace, name, vips, port, members, affinity_timeout, &SpecOptions::default())
}

/// A Service spec with a TCP listener (and a UDP one with [`SpecOptions::udp`]) on `port` over
/// `members`; type NodePort when it has a node port.
pub fn service_spec_with(
    namespace: &str,
    name: &str,
    vips: &[&str],
    port: u32,
    members: &[TestMember],
    affinity_timeout: Option<u32>,
    opts: &SpecOptions,
) -> LoadBalancerSpec {
    let listener = |protocol: Protocol, pname: &str| Listener {
        protocol: protocol as i32,
        port,
        name: pname.into(),
        pool: Some(Pool {
            members: members
                .iter()
                .map(|m| Member {
                    address: m.address.clone(),
                    port: m.port,
                    ready: m.ready,
                    serving: m.serving,
                    terminating: !m.ready,
                    node_name: m.node.clone(),
                    target_pod: format!("{namespace}/{}", m.pod),
                })
                .collect(),
        }),
        node_port: opts.node_port.unwrap_or(0),
    };
    let mut listeners = vec![listener(Protocol::Tcp, "tcp")];
    if opts.udp {
        listeners.push(listener(Protocol::Udp, "udp"));
    }
    let policy = |local: bool| if local { TrafficPolicy::Local } else { TrafficPolicy::Cluster } as i32;
    LoadBalancerSpec {
        namespace: namespace.into(),
        name: name.into(),
        uid: format!("uid-{namespace}-{name}"),
        vips: vips.iter().map(|v| (*v).to_string()).collect(),
        listeners,
        session_affinity: affinity_timeout.map(|t| SessionAffinity { client_ip: true, timeout_seconds: t }),
        service_type: if opts.node_port.is_some() { "NodePort" } else { "ClusterIP" }.into(),
        generation: 0,
        external_ips: opts.external_ips.clone(),
        ingress_ips: opts.ingress_ips.clone(),
        external_traffic_policy: policy(opts.external_local),
        internal_traffic_policy: policy(opts.internal_local),
    }
}
