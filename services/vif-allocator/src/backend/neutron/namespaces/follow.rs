//! Following the watcher's namespaces for per-namespace networks: one Subscribe stream of
//! Namespaces (followed by the one follower of [`kuryr_stream::follow`]: resumed after a break,
//! re-listed after RESET, dropped when silent, reopened with backoff) feeding which namespaces
//! exist and which are being deleted; a namespace being deleted or gone is queued for
//! [`NeutronBackend::reconcile_namespace`] on a keyed work queue (one run per namespace at a
//! time, failures retried with capped backoff), and so is one whose last port was just released.
//! At the first snapshot, recorded networks of namespaces the snapshot did not name are queued
//! too: those namespaces went while no allocator ran.

use std::sync::Arc;

use kuryr_proto::watcher::v1::{EventType, Kind, SubscribeRequest};
use kuryr_runtime::Shutdown;
use kuryr_runtime::auth::client::PeerChannel;
use kuryr_runtime::follow::follow_watcher;
use kuryr_stream::{FollowConfig, Followed, Outcome, WorkQueue};
use tracing::Instrument as _;

use super::{NamespaceOutcome, guard};
use crate::backend::neutron::NeutronBackend;

/// Namespaces reconciled at once.
const WORKERS: usize = 4;

/// Runs the namespace follower and its workers until shutdown. Does nothing unless the backend
/// has per-namespace networks.
pub async fn run(
    backend: Arc<NeutronBackend>,
    channel: PeerChannel,
    subscriber: String,
    follow: FollowConfig,
    shutdown: Shutdown,
) {
    let Some(nn) = backend.namespace_networks().cloned() else { return };
    let queue = Arc::new(WorkQueue::default());
    for i in 0..WORKERS {
        let (b, q) = (backend.clone(), queue.clone());
        let work = async move {
            while let Some(ns) = q.next().await {
                let outcome = match b.reconcile_namespace(&ns).await {
                    Ok(NamespaceOutcome::Done) => Outcome::Done,
                    // Woken by the release of a port; the backoff is only the safety net.
                    Ok(NamespaceOutcome::Waiting(_)) => Outcome::Retry,
                    Err(e) => {
                        b.namespace_failed(&ns, &e).await;
                        Outcome::Retry
                    }
                };
                q.done(&ns, outcome);
            }
        };
        tokio::spawn(work.instrument(tracing::info_span!("namespace-worker", id = i)));
    }
    {
        let q = queue.clone();
        let sd = shutdown.clone();
        tokio::spawn(async move {
            sd.wait().await;
            q.close();
        });
    }
    if let Some(mut wake) = nn.take_wake() {
        let q = queue.clone();
        let sd = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    ns = wake.recv() => match ns { Some(ns) => q.add(&ns), None => return },
                    () = sd.clone().wait() => return,
                }
            }
        });
    }
    let req = SubscribeRequest {
        kinds: vec![Kind::Namespace as i32],
        filter: None,
        resume_from: String::new(),
        subscriber: subscriber.clone(),
    };
    let mut follower = follow_watcher(channel, req, follow);
    let mut first_snapshot = true;
    loop {
        let Some(next) = follower.next_or(shutdown.clone().wait()).await else { return };
        let ev = match next {
            Followed::Event(ev) => ev,
            Followed::Down(_) => {
                guard(&nn.state).live = false;
                continue;
            }
        };
        let kind = ev.r#type();
        let obj = ev.object.unwrap_or_default();
        match kind {
            EventType::Applied if obj.kind() == Kind::Namespace && nn.observe(&obj.name, Some(obj.deleting)) => {
                queue.add(&obj.name);
            }
            EventType::Deleted if obj.kind() == Kind::Namespace && nn.observe(&obj.name, None) => {
                queue.add(&obj.name);
            }
            EventType::Reset => {
                let mut st = guard(&nn.state);
                st.seen.clear();
                st.live = false;
            }
            EventType::SnapshotComplete => {
                let mut gone: Vec<String> = {
                    let mut st = guard(&nn.state);
                    st.live = true;
                    st.nets.keys().filter(|ns| !st.seen.contains_key(*ns)).cloned().collect()
                };
                if first_snapshot {
                    first_snapshot = false;
                    // Records of namespaces not loaded (not Ready when the allocator stopped)
                    // count too.
                    match nn.kube.list_records().await {
                        Ok(records) => {
                            let st = guard(&nn.state);
                            gone.extend(
                                records
                                    .into_iter()
                                    .map(|r| r.spec.namespace)
                                    .filter(|ns| st.seen.get(ns) != Some(&false)),
                            );
                        }
                        Err(e) => tracing::warn!(error = %crate::error::chain(&e),
                            "listing NamespaceNetworks failed; deleted namespaces are handled as seen"),
                    }
                }
                for ns in gone {
                    queue.add(&ns);
                }
                tracing::info!(namespaces = guard(&nn.state).seen.len(), "namespace snapshot complete");
            }
            _ => {}
        }
    }
}
