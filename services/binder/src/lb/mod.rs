//! The node dataplane for Services (embedded backend), in place of kube-proxy: the binder follows
//! kuryr-lbaas's `WatchLoadBalancers` stream and programs nftables in the node's network namespace
//! so that every Service's cluster IPs, node ports and external addresses are DNAT'd to its
//! members, under the Service's traffic policies ([`mod@render`] describes the Service part of the
//! ruleset, [`crate::table`] the table as a whole).
//!
//! Two tasks share the [`state::State`]: the follower reads the stream (the one follower of
//! [`kuryr_stream::follow`]: resuming after a break, dropping a stream silent for longer than
//! `--stream-idle-timeout`, reconnecting with jittered backoff) and marks what changed; the programmer turns pending changes into
//! one `nft -f` transaction — the changed Services only, or the whole table after a snapshot —
//! and retries failures with backoff as a full rebuild. Changes that arrive while a transaction
//! runs are applied together in the next one.
//!
//! The binder's health does not depend on any of this (pods must get networks while kuryr-lbaas
//! is down; the rules already programmed stay in place). Whether the Service rules are in sync
//! is logged on every change and exported as `kuryr_binder_lb_synced`.

pub mod conntrack;
pub mod hairpin;
pub mod metrics;
pub mod model;
pub mod nft;
pub mod render;
pub mod state;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kuryr_proto::lbaas::v1::load_balancers_client::LoadBalancersClient;
use kuryr_proto::lbaas::v1::{LbEventType, WatchLoadBalancersRequest, WatchLoadBalancersResponse};
use kuryr_runtime::Shutdown;
use kuryr_runtime::auth::client::PeerChannel;
use kuryr_runtime::follow::{Failed, next_message};
use kuryr_stream::follow::{FollowConfig, Followed, Follower, Mark, Source};
use tokio::sync::Notify;
use tonic::Streaming;

use self::metrics::LbMetrics;
use self::model::{Service, ServiceKey};
use self::nft::Nft;
use self::render::{Rendered, render};
use self::state::{Applied, State, Work};

/// Retry delays after a failed transaction.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// kuryr-lbaas's `WatchLoadBalancers` stream, for the follower.
#[derive(Debug)]
struct LbSource {
    client: LoadBalancersClient<PeerChannel>,
    subscriber: String,
}

impl Source for LbSource {
    type Event = WatchLoadBalancersResponse;
    type Error = Failed;
    type Stream = Streaming<WatchLoadBalancersResponse>;

    async fn open(&mut self, resume_from: &str) -> Result<Self::Stream, Failed> {
        let req =
            WatchLoadBalancersRequest { resume_from: resume_from.to_string(), subscriber: self.subscriber.clone() };
        tracing::info!(resume_from, "following kuryr-lbaas's load balancers");
        Ok(self.client.watch_load_balancers(req).await.map_err(Failed)?.into_inner())
    }

    async fn next(stream: &mut Self::Stream) -> Result<Option<WatchLoadBalancersResponse>, Failed> {
        next_message(stream).await
    }

    fn mark(event: &WatchLoadBalancersResponse) -> Mark {
        match event.r#type() {
            LbEventType::Reset => Mark::Reset,
            LbEventType::SnapshotComplete => Mark::SnapshotComplete,
            LbEventType::Heartbeat => Mark::Heartbeat,
            LbEventType::LbApplied | LbEventType::LbDeleted | LbEventType::Unspecified => Mark::Change,
        }
    }

    fn resume_point(event: &WatchLoadBalancersResponse) -> &str {
        &event.resume_point
    }
}

/// The Service dataplane; cheap to clone.
#[derive(Clone, Debug)]
pub struct Dataplane {
    state: Arc<Mutex<State>>,
    wake: Arc<Notify>,
    metrics: LbMetrics,
    nft: Nft,
    /// The last sync status logged, to log transitions only.
    logged_synced: Arc<Mutex<Option<bool>>>,
}

impl Dataplane {
    /// The dataplane of the node named `node` (its members are the local ones).
    pub fn new(metrics: LbMetrics, nft: Nft, node: &str) -> Self {
        Self {
            state: Arc::new(Mutex::new(State::for_node(node))),
            wake: Arc::new(Notify::new()),
            metrics,
            nft,
            logged_synced: Arc::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts the follower and the programmer; they run until shutdown.
    pub fn spawn(self, channel: PeerChannel, subscriber: String, follow: FollowConfig, shutdown: Shutdown) {
        tokio::spawn(self.clone().program(shutdown.clone()));
        let source = LbSource { client: LoadBalancersClient::new(channel), subscriber };
        let follower = Follower::new(source, "kuryr-lbaas's load balancer stream", follow);
        tokio::spawn(self.follow(follower, shutdown));
    }

    /// Publishes and logs whether the rules are in sync, when that changed.
    fn report_sync(&self, why: &str) {
        let (synced, services) = {
            let s = self.lock();
            (s.synced(), s.services())
        };
        self.metrics.set_synced(synced);
        let mut last = self.logged_synced.lock().unwrap_or_else(PoisonError::into_inner);
        if *last != Some(synced) {
            *last = Some(synced);
            if synced {
                tracing::info!(services, "Service dataplane in sync with kuryr-lbaas");
            } else {
                tracing::warn!(services, why, "Service dataplane not in sync with kuryr-lbaas");
            }
        }
    }

    /// Follows the stream until shutdown.
    async fn follow(self, mut follower: Follower<LbSource>, shutdown: Shutdown) {
        loop {
            let Some(next) = follower.next_or(shutdown.clone().wait()).await else { return };
            match next {
                Followed::Event(ev) => {
                    let now = Instant::now();
                    if !self.lock().connected {
                        self.lock().connected = true;
                        self.report_sync("stream opened");
                    }
                    self.metrics.event(ev.r#type().as_str_name());
                    let applied = self.lock().apply(&ev, now);
                    self.log_applied(applied);
                    self.wake.notify_one();
                }
                Followed::Down(why) => {
                    self.metrics.stream_break();
                    self.lock().connected = false;
                    self.report_sync(&why);
                }
            }
        }
    }

    fn log_applied(&self, applied: Applied) {
        match applied {
            Applied::Quiet => {}
            Applied::Invalid { service, error } => {
                self.metrics.invalid_spec();
                tracing::warn!(service, error, "load balancer spec cannot be programmed; its rules are removed");
            }
            Applied::Warnings { service, warnings } => {
                for w in warnings {
                    tracing::warn!(service, warning = w, "load balancer member left out");
                }
            }
            Applied::SnapshotComplete { services } => {
                tracing::info!(services, "load balancer snapshot complete; rebuilding the Service rules");
            }
            Applied::Reset => tracing::info!("kuryr-lbaas sent RESET; a new snapshot follows"),
        }
    }

    /// Programs pending work until shutdown.
    async fn program(self, shutdown: Shutdown) {
        match self.nft.version().await {
            Ok(v) => tracing::info!(nft = v, "Service dataplane: nftables available"),
            Err(e) => tracing::error!(error = %e, "Service dataplane: nft cannot be run; Service rules will fail"),
        }
        let mut p = Programmer::default();
        let mut backoff = kuryr_stream::Backoff::new("binder-services", RETRY_MIN, RETRY_MAX);
        loop {
            let work = self.lock().take_work();
            let Some(work) = work else {
                self.report_sync("waiting for a complete view");
                tokio::select! {
                    () = self.wake.notified() => continue,
                    () = shutdown.clone().wait() => return,
                }
            };
            let (kind, since) = match &work {
                Work::Full { since, .. } => ("full", *since),
                Work::Delta { since, .. } => ("delta", *since),
            };
            let started = Instant::now();
            match p.apply(&self.nft, work).await {
                Ok(summary) => {
                    let took = since.elapsed();
                    self.metrics.transaction(kind, true, Some(took));
                    self.metrics.set_services(p.programmed.len());
                    tracing::info!(
                        kind,
                        summary,
                        nft_ms = started.elapsed().as_secs_f64() * 1e3,
                        since_update_ms = took.as_secs_f64() * 1e3,
                        "Service rules programmed"
                    );
                    self.lock().programmed_ok = true;
                    backoff.reset();
                    self.report_sync("programmed");
                }
                Err(e) => {
                    self.metrics.transaction(kind, false, None);
                    let delay = backoff.next_delay(kind);
                    tracing::warn!(kind, error = %e, retry_in = ?delay, "programming Service rules failed");
                    {
                        let mut s = self.lock();
                        s.programmed_ok = false;
                        s.retry_full(since);
                    }
                    self.report_sync("programming failed");
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = shutdown.clone().wait() => return,
                    }
                }
            }
        }
    }
}

/// What is programmed in the kernel, per Service, and which Service owns each VIP:port.
#[derive(Debug, Default)]
struct Programmer {
    programmed: BTreeMap<ServiceKey, Rendered>,
    /// The Services as last programmed, to tell which UDP flows lost their member.
    services: BTreeMap<ServiceKey, Service>,
    /// `VIP . proto . port` (or `proto . node port`) → the Service whose element it is.
    claimed: HashMap<String, ServiceKey>,
    forwarding: bool,
    /// `services` is what was programmed before (false until this process's first full sync:
    /// flows left from before that are not judged, see [`conntrack::stale_udp_flows`]).
    seen: bool,
}

impl Programmer {
    /// Renders a Service, leaving out VIP:ports another Service already has (Kubernetes never
    /// hands out a ClusterIP twice, but a stream could briefly carry both the old and the new
    /// owner of one).
    fn render_claimed(&mut self, svc: &Service) -> Rendered {
        let mut r = render(svc);
        r.elements.retain(|e| match self.claimed.get(&e.key) {
            Some(owner) if *owner != svc.key => {
                tracing::warn!(service = %svc.key, owner = %owner, vip = e.key, "VIP and port taken by another Service; left out");
                false
            }
            _ => true,
        });
        for e in &r.elements {
            self.claimed.insert(e.key.clone(), svc.key.clone());
        }
        r
    }

    fn unclaim(&mut self, key: &ServiceKey) {
        self.claimed.retain(|_, owner| owner != key);
    }

    async fn apply(&mut self, nft: &Nft, work: Work) -> Result<String, nft::NftError> {
        if !self.forwarding {
            // Connections to a VIP are routed to members on the node's bridge or other nodes.
            match crate::plug::routes::enable_forwarding() {
                Ok(()) => self.forwarding = true,
                Err(e) => tracing::warn!(error = %e, "cannot enable IP forwarding for Services"),
            }
        }
        let mut script = String::new();
        match work {
            Work::Full { services, .. } => {
                let existing = nft.existing().await?;
                self.claimed.clear();
                let mut next = BTreeMap::new();
                for svc in &services {
                    next.insert(svc.key.clone(), self.render_claimed(svc));
                }
                let all: Vec<&Rendered> = next.values().collect();
                render::full(&mut script, &existing, &all);
                if let Err(e) = nft.apply(&script).await {
                    // What the kernel holds is unknown now; the retry lists it again.
                    self.programmed.clear();
                    self.claimed.clear();
                    return Err(e);
                }
                self.programmed = next;
                let mut stale = Vec::new();
                let new: BTreeMap<ServiceKey, Service> = services.into_iter().map(|s| (s.key.clone(), s)).collect();
                for key in self.services.keys().chain(new.keys()).collect::<std::collections::BTreeSet<_>>() {
                    stale.extend(conntrack::stale_udp_flows(self.services.get(key), new.get(key), self.seen));
                }
                self.services = new;
                self.seen = true;
                clear_later(stale);
                Ok(format!("{} Services", self.services.len()))
            }
            Work::Delta { changes, .. } => {
                for (key, _) in &changes {
                    self.unclaim(key);
                }
                let mut next = Vec::new();
                for (key, svc) in &changes {
                    let new = svc.as_ref().map(|s| self.render_claimed(s)).unwrap_or_default();
                    next.push((key.clone(), new));
                }
                let empty = Rendered::default();
                let pairs: Vec<(&Rendered, &Rendered)> =
                    next.iter().map(|(k, new)| (self.programmed.get(k).unwrap_or(&empty), new)).collect();
                render::delta(&mut script, &pairs);
                nft.apply(&script).await?;
                let mut names = Vec::new();
                for (key, new) in next {
                    names.push(key.to_string());
                    if new == empty {
                        self.programmed.remove(&key);
                    } else {
                        self.programmed.insert(key, new);
                    }
                }
                let mut stale = Vec::new();
                for (key, svc) in changes {
                    stale.extend(conntrack::stale_udp_flows(self.services.get(&key), svc.as_ref(), self.seen));
                    match svc {
                        Some(svc) => self.services.insert(key, svc),
                        None => self.services.remove(&key),
                    };
                }
                clear_later(stale);
                Ok(names.join(" "))
            }
        }
    }
}

/// Clears conntrack entries of UDP flows whose member is gone, off the programming path.
fn clear_later(stale: Vec<conntrack::Flow>) {
    if !stale.is_empty() {
        tokio::spawn(conntrack::clear(stale));
    }
}

#[cfg(test)]
mod tests {
    use super::model::{Backend, Listener, Proto, ServiceKey};
    use super::*;

    fn svc(name: &str, vip: &str, external: &str, node_port: u16) -> Service {
        let mut l = Listener::new(Proto::Tcp, 80, vec![Backend { addr: "10.0.0.1".parse().unwrap(), port: 8080 }]);
        l.node_port = Some(node_port);
        let mut s = Service::cluster_ip(
            ServiceKey { namespace: "default".into(), name: name.into() },
            vec![vip.parse().unwrap()],
            vec![l],
            None,
        );
        s.external = vec![external.parse().unwrap()];
        s
    }

    fn keys(r: &Rendered) -> Vec<String> {
        r.elements.iter().map(|e| format!("{} {}", e.set, e.key)).collect()
    }

    #[test]
    fn an_address_and_port_two_services_claim_stays_with_the_first() {
        // The API server checks neither external IPs nor (while a stream carries both the old and
        // the new owner) node ports across Services; the kernel would refuse the whole
        // transaction for a key present twice.
        let mut p = Programmer::default();
        let a = p.render_claimed(&svc("a", "10.96.0.1", "192.0.2.1", 30080));
        let b = p.render_claimed(&svc("b", "10.96.0.2", "192.0.2.1", 30080));
        assert_eq!(
            keys(&a),
            ["services4 10.96.0.1 . tcp . 80", "services4 192.0.2.1 . tcp . 80", "nodeports4 tcp . 30080"]
        );
        assert_eq!(keys(&b), ["services4 10.96.0.2 . tcp . 80"], "b's external IP and node port are a's");
        // Once a is gone, b gets them on its next rendering.
        p.unclaim(&ServiceKey { namespace: "default".into(), name: "a".into() });
        p.unclaim(&ServiceKey { namespace: "default".into(), name: "b".into() });
        let b = p.render_claimed(&svc("b", "10.96.0.2", "192.0.2.1", 30080));
        assert_eq!(keys(&b).len(), 3, "{b:?}");
    }
}
