//! The Kubernetes edge of kuryr-policy: each NetworkPolicy's status
//! ([`crate::core::status`]) written as Events (events.k8s.io/v1) on the NetworkPolicy, as
//! `kubectl describe networkpolicy` shows them. Each Event is retried a few times with backoff;
//! one that cannot be written is logged and counted
//! (`kuryr_policy_status_events{result="error"}`): it never holds up the compiled state.
//! [`podvifs`]: the pods' recorded VIFs, whose addresses count until a pod's status has its own.

pub mod podvifs;

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;

use crate::core::status::Report;
use crate::metrics::Metrics;

/// Attempts to write one Event, and the first delay between them (doubling).
const ATTEMPTS: u32 = 4;
const FIRST_DELAY: Duration = Duration::from_millis(200);

/// Where reports go: a task writing them as Events.
pub type ReportSender = mpsc::UnboundedSender<Vec<Report>>;

/// Writes reports as Events on their NetworkPolicies.
pub struct EventSink {
    recorder: Recorder,
    metrics: Metrics,
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSink").finish_non_exhaustive()
    }
}

impl EventSink {
    /// Events reported as `kuryr-policy` (`instance`: this replica).
    pub fn new(client: kube::Client, instance: String, metrics: Metrics) -> Self {
        let reporter = Reporter { controller: "kuryr-policy".into(), instance: Some(instance) };
        Self { recorder: Recorder::new(client, reporter), metrics }
    }

    /// Writes every report received until the sender is dropped.
    pub async fn run(self, mut rx: mpsc::UnboundedReceiver<Vec<Report>>) {
        while let Some(batch) = rx.recv().await {
            for r in batch {
                self.write(&r).await;
            }
        }
    }

    async fn write(&self, r: &Report) {
        let reference = ObjectReference {
            api_version: Some("networking.k8s.io/v1".into()),
            kind: Some("NetworkPolicy".into()),
            namespace: Some(r.policy.namespace.clone()),
            name: Some(r.policy.name.clone()),
            uid: (!r.uid.is_empty()).then(|| r.uid.clone()),
            ..ObjectReference::default()
        };
        // An Event note is at most 1 kB.
        let note: String = r.note.chars().take(1000).collect();
        let ev = Event {
            type_: if r.warning { EventType::Warning } else { EventType::Normal },
            reason: r.reason.into(),
            note: Some(note),
            action: "Compile".into(),
            secondary: None,
        };
        let kind = if r.warning { "Warning" } else { "Normal" };
        let mut backoff = kuryr_stream::Backoff::new("policy-status", FIRST_DELAY, FIRST_DELAY * 2u32.pow(ATTEMPTS));
        for attempt in 1..=ATTEMPTS {
            match self.recorder.publish(&ev, &reference).await {
                Ok(()) => {
                    self.metrics.status_event(kind, true);
                    return;
                }
                Err(e) if attempt == ATTEMPTS => {
                    self.metrics.status_event(kind, false);
                    tracing::warn!(policy = %r.policy, reason = r.reason, error = %e, "could not record the policy's status Event");
                }
                Err(_) => backoff.sleep("event").await,
            }
        }
    }
}
