//! The node dataplane for NetworkPolicy: the binder follows kuryr-policy's `WatchPolicies`
//! stream for its node and programs nftables in the node's network namespace ([`render`]
//! describes the rules).
//!
//! Two tasks share the [`state::State`]: the follower reads the stream (the one follower of
//! [`kuryr_stream::follow`]: resuming after a break, dropping a stream silent for longer than
//! `--stream-idle-timeout`, reconnecting with jittered backoff), the programmer renders the desired state and writes the
//! difference from what it programmed last as one `nft -f` transaction. Changes that arrive
//! while a transaction runs are applied together in the next one.
//!
//! **Restart.** What was programmed is recorded in the state directory after every transaction.
//! A restarted binder leaves the rules as they are until the stream's snapshot is complete, then
//! writes only the difference between the record and the snapshot. Without a record (or when the
//! kernel's table does not hold the policy chain the record speaks of, after a reboot), or when a
//! difference fails to apply, every policy set is flushed and refilled in one transaction
//! ([`render::replace`]): in neither case is there a moment in which a protected pod is open.
//!
//! **Sharded kuryr-policy.** A replica asked for a node it does not serve answers UNAVAILABLE
//! with the owner's `HOST:PORT` in the `kuryr-shard-owner` trailer, as the allocator does; the
//! follower reconnects there, and back to `--policy` when the owner cannot be reached.
//!
//! The binder's health does not depend on any of this: pods must get networks while
//! kuryr-policy is down, and the rules already programmed stay in place.

pub mod metrics;
pub mod render;
pub mod state;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kuryr_proto::policy::v1::policies_client::PoliciesClient;
use kuryr_proto::policy::v1::{PolicyEventType, WatchPoliciesRequest, WatchPoliciesResponse};
use kuryr_runtime::Shutdown;
use kuryr_runtime::follow::{Failed, next_message};
use kuryr_stream::follow::{Failure, FollowConfig, Followed, Follower, Mark, Retry, Source};
use tokio::sync::Notify;
use tonic::Streaming;

use self::metrics::PolicyMetrics;
use self::render::Rendered;
use self::state::{Applied, State};
use crate::lb::nft::Nft;
use crate::upstream::Upstream;

/// Redirects followed at once in a row; more back off (replicas disagreeing for a moment).
const FRESH_REDIRECTS: u32 = 3;

/// Retry delays after a failed transaction.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// The file, in the state directory, recording what was programmed.
pub const RECORD: &str = "policy.json";

/// kuryr-policy's `WatchPolicies` stream of this node, for the follower.
#[derive(Debug)]
struct PolicySource {
    upstream: Upstream,
    node: String,
    subscriber: String,
    state: Arc<Mutex<State>>,
    /// Redirects in a row, and failures to reach the owner followed.
    hops: u32,
    owner_failures: u32,
}

impl Source for PolicySource {
    type Event = WatchPoliciesResponse;
    type Error = Failed;
    type Stream = Streaming<WatchPoliciesResponse>;

    async fn open(&mut self, resume_from: &str) -> Result<Self::Stream, Failed> {
        let req = WatchPoliciesRequest {
            node_name: self.node.clone(),
            resume_from: resume_from.to_string(),
            subscriber: self.subscriber.clone(),
        };
        let mut client = PoliciesClient::new(self.upstream.channel());
        let stream = client.watch_policies(req).await.map_err(Failed)?.into_inner();
        tracing::info!(resume_from, "following kuryr-policy's compiled policy for this node");
        self.state.lock().unwrap_or_else(PoisonError::into_inner).opened(resume_from);
        Ok(stream)
    }

    async fn next(stream: &mut Self::Stream) -> Result<Option<WatchPoliciesResponse>, Failed> {
        next_message(stream).await
    }

    fn mark(event: &WatchPoliciesResponse) -> Mark {
        match event.r#type() {
            PolicyEventType::Reset => Mark::Reset,
            PolicyEventType::SnapshotComplete => Mark::SnapshotComplete,
            PolicyEventType::Heartbeat => Mark::Heartbeat,
            PolicyEventType::IsolationApplied
            | PolicyEventType::IsolationDeleted
            | PolicyEventType::GroupApplied
            | PolicyEventType::GroupDeleted
            | PolicyEventType::Unspecified => Mark::Change,
        }
    }

    fn resume_point(event: &WatchPoliciesResponse) -> &str {
        &event.resume_point
    }

    fn failed(&mut self, failure: Failure<'_, Failed>) -> Retry {
        if let Failure::Open(Failed(status)) | Failure::Broke(Failed(status)) = &failure
            && let Some(owner) = self.upstream.redirect(status)
        {
            tracing::info!(owner, error = status.message(), "the node's kuryr-policy replica moved; following it");
            (self.hops, self.owner_failures) = (self.hops + 1, 0);
            return if self.hops <= FRESH_REDIRECTS { Retry::Now } else { Retry::Backoff };
        }
        let unreachable = matches!(failure, Failure::Open(_) | Failure::OpenSilent | Failure::Silent);
        if unreachable && self.upstream.owner().is_some() {
            self.owner_failures += 1;
            if self.owner_failures >= 2 {
                self.upstream.fall_back();
                self.owner_failures = 0;
                tracing::warn!("the node's kuryr-policy replica cannot be reached; back to --policy");
            }
        }
        Retry::Backoff
    }

    fn live(&mut self) {
        (self.hops, self.owner_failures) = (0, 0);
    }
}

/// The NetworkPolicy dataplane; cheap to clone.
#[derive(Clone, Debug)]
pub struct Dataplane {
    state: Arc<Mutex<State>>,
    /// When the oldest change not yet programmed arrived.
    since: Arc<Mutex<Option<Instant>>>,
    wake: Arc<Notify>,
    metrics: PolicyMetrics,
    nft: Nft,
    node: String,
    record: PathBuf,
}

impl Dataplane {
    /// The dataplane of the node named `node`, recording what it programs in `state_dir`.
    pub fn new(metrics: PolicyMetrics, nft: Nft, node: &str, state_dir: &Path) -> Self {
        Self {
            state: Arc::default(),
            since: Arc::default(),
            wake: Arc::new(Notify::new()),
            metrics,
            nft,
            node: node.to_string(),
            record: state_dir.join(RECORD),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn mark_changed(&self) {
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        since.get_or_insert_with(Instant::now);
        drop(since);
        self.wake.notify_one();
    }

    /// Starts the follower and the programmer; they run until shutdown.
    pub fn spawn(self, upstream: Upstream, subscriber: String, follow: FollowConfig, shutdown: Shutdown) {
        tokio::spawn(self.clone().program(shutdown.clone()));
        let source = PolicySource {
            upstream,
            node: self.node.clone(),
            subscriber,
            state: self.state.clone(),
            hops: 0,
            owner_failures: 0,
        };
        let follower = Follower::new(source, "kuryr-policy's policy stream", follow);
        tokio::spawn(self.follow(follower, shutdown));
    }

    /// Follows the stream until shutdown. While it is down the rules programmed stay in force.
    async fn follow(self, mut follower: Follower<PolicySource>, shutdown: Shutdown) {
        loop {
            let Some(next) = follower.next_or(shutdown.clone().wait()).await else { return };
            let ev = match next {
                Followed::Event(ev) => ev,
                Followed::Down(_) => {
                    self.metrics.stream_break();
                    continue;
                }
            };
            let applied = self.lock().apply(&ev);
            match applied {
                Applied::Quiet => {}
                Applied::Changed => self.mark_changed(),
                Applied::SnapshotComplete => {
                    let n = self.lock().desired.isolations.len();
                    tracing::info!(isolated = n, "policy snapshot complete; programming");
                    self.mark_changed();
                }
                Applied::Invalid(why) => {
                    self.metrics.invalid(1);
                    tracing::warn!(why, "policy event left out");
                }
            }
        }
    }

    /// Programs the desired state whenever it changed, until shutdown.
    async fn program(self, shutdown: Shutdown) {
        match self.nft.version().await {
            Ok(v) => tracing::info!(nft = v, "NetworkPolicy dataplane: nftables available"),
            Err(e) => tracing::error!(error = %e, "NetworkPolicy dataplane: nft cannot be run; policies will fail"),
        }
        bridged_traffic_filtered();
        let mut programmed = self.load_record().await;
        let mut first = true;
        let mut backoff = kuryr_stream::Backoff::new("binder-policy", RETRY_MIN, RETRY_MAX);
        loop {
            let desired = {
                let s = self.lock();
                s.synced.then(|| s.desired.clone())
            };
            let Some(desired) = desired else {
                tokio::select! {
                    () = self.wake.notified() => continue,
                    () = shutdown.clone().wait() => return,
                }
            };
            let since = self.since.lock().unwrap_or_else(PoisonError::into_inner).take();
            let (new, warnings) = render::render(&desired);
            if !warnings.is_empty() {
                self.metrics.invalid(warnings.len());
                tracing::warn!(?warnings, "parts of the node's policy left out (they allow nothing)");
            }
            let started = Instant::now();
            let result = match &programmed {
                Some(old) if *old == new && !first => Ok("unchanged"),
                Some(old) => {
                    let mut script = String::new();
                    render::diff(&mut script, old, &new, first);
                    self.nft.apply(&script).await.map(|()| "delta").map_err(|e| ("delta", e))
                }
                None => match self.nft.existing().await {
                    Ok(existing) => {
                        let mut script = String::new();
                        render::replace(&mut script, &new, &existing.chains, &existing.sets);
                        self.nft.apply(&script).await.map(|()| "replace").map_err(|e| ("replace", e))
                    }
                    Err(e) => Err(("replace", e)),
                },
            };
            match result {
                Ok(kind) => {
                    if kind != "unchanged" {
                        self.metrics.transaction(kind, true, since.map(|s| s.elapsed()));
                        tracing::info!(
                            kind,
                            elements = new.elements(),
                            groups = desired.groups.len(),
                            isolated = desired.isolations.len(),
                            nft_ms = started.elapsed().as_secs_f64() * 1e3,
                            since_change_ms = since.map(|s| s.elapsed().as_secs_f64() * 1e3),
                            "NetworkPolicy rules programmed"
                        );
                        self.save_record(&new).await;
                    }
                    self.metrics.set_programmed(new.elements(), desired.groups.len(), new.rules());
                    self.metrics.set_synced(true);
                    programmed = Some(new);
                    first = false;
                    backoff.reset();
                    if self.since.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                        continue;
                    }
                    tokio::select! {
                        () = self.wake.notified() => {}
                        () = shutdown.clone().wait() => return,
                    }
                }
                Err((kind, e)) => {
                    self.metrics.transaction(kind, false, None);
                    self.metrics.set_synced(false);
                    let delay = backoff.next_delay(kind);
                    tracing::warn!(kind, error = %e, retry_in = ?delay, "programming NetworkPolicy rules failed");
                    // What the kernel holds is not known any more: the retry replaces it.
                    programmed = None;
                    self.since
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .get_or_insert(since.unwrap_or_else(Instant::now));
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = shutdown.clone().wait() => return,
                    }
                }
            }
        }
    }

    /// What a previous run recorded as programmed, if the kernel still holds its policy chain.
    async fn load_record(&self) -> Option<Rendered> {
        let text = match tokio::fs::read(&self.record).await {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(record = %self.record.display(), error = %e, "cannot read the policy record; rules will be replaced");
                return None;
            }
        };
        let rendered: Rendered = match serde_json::from_slice(&text) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(record = %self.record.display(), error = %e, "unreadable policy record; rules will be replaced");
                return None;
            }
        };
        match self.nft.existing().await {
            Ok(existing) if existing.chains.contains(render::BASE_CHAIN) => {
                tracing::info!(
                    elements = rendered.elements(),
                    "policy rules of the previous run found; they stay until the snapshot is reconciled"
                );
                Some(rendered)
            }
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the table; rules will be replaced");
                None
            }
        }
    }

    async fn save_record(&self, r: &Rendered) {
        let Ok(text) = serde_json::to_vec(r) else { return };
        let tmp = self.record.with_extension("json.tmp");
        let res = async {
            tokio::fs::write(&tmp, &text).await?;
            tokio::fs::rename(&tmp, &self.record).await
        }
        .await;
        if let Err(e) = res {
            tracing::warn!(record = %self.record.display(), error = %e, "cannot record the programmed policy; a restart will replace the rules");
        }
    }
}

/// Pods of one node talk across its bridge: their traffic meets the forward hook only when the
/// bridge hands IP traffic to netfilter (`br_netfilter`, on by default in every namespace once
/// the module is loaded). Turned on here when off; a warning when the module is missing.
fn bridged_traffic_filtered() {
    for f in ["bridge-nf-call-iptables", "bridge-nf-call-ip6tables"] {
        let path = format!("/proc/sys/net/bridge/{f}");
        match std::fs::read_to_string(&path) {
            Ok(v) if v.trim() == "1" => {}
            Ok(_) => match std::fs::write(&path, "1") {
                Ok(()) => tracing::info!(sysctl = path, "enabled, so that policies apply between pods of this node"),
                Err(e) => {
                    tracing::warn!(sysctl = path, error = %e, "cannot enable; policies between pods of this node's bridge are not enforced")
                }
            },
            Err(_) => tracing::warn!(
                "br_netfilter is not loaded: policies between pods of this node's bridge are not enforced (modprobe br_netfilter)"
            ),
        }
    }
}
