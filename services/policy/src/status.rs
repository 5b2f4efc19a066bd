//! Each NetworkPolicy's status, told as Kubernetes Events (events.k8s.io/v1) on the
//! NetworkPolicy, as `kubectl describe networkpolicy` shows them:
//!
//! - `Normal Compiled`: compiled, and on which nodes it is enforced (the nodes of the pods it
//!   isolates; each node's binder programs it from WatchPolicies), e.g. `compiled; enforced on
//!   2 nodes (node-1, node-2) for 3 pods`;
//! - `Warning UnresolvedNamedPort`: an ingress rule names a port some pods it isolates do not
//!   declare (on those pods that port rule allows nothing, as Kubernetes specifies);
//! - `Warning InvalidParts`: parts that match nothing (an unknown operator or protocol, a bad
//!   CIDR: what a validating API server refuses), which kuryr-policy enforces as allowing nothing.
//!
//! The [`Tracker`] (in the [`Publisher`](crate::publish::Publisher), next to the compiler)
//! recomputes the statuses at most every [`PERIOD`] while changes come, and reports only those
//! that changed; the [`EventSink`] writes them, retrying each a few times with backoff. An Event
//! that cannot be written is logged and counted (`kuryr_policy_status_events{result="error"}`):
//! it never holds up the compiled state.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kuryr_policy_core::{Compiler, PolicyKey, PolicyStatus};
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// How often statuses are recomputed while changes come.
pub const PERIOD: Duration = Duration::from_secs(1);
/// Nodes named in a note; more are counted.
const NODES_NAMED: usize = 5;
/// Attempts to write one Event, and the first delay between them (doubling).
const ATTEMPTS: u32 = 4;
const FIRST_DELAY: Duration = Duration::from_millis(200);

/// One policy's status to tell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub policy: PolicyKey,
    pub uid: String,
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// What was last reported per policy.
#[derive(Debug, Default)]
pub struct Tracker {
    uids: HashMap<PolicyKey, String>,
    reported: HashMap<PolicyKey, (bool, &'static str, String)>,
    dirty: bool,
}

impl Tracker {
    /// A policy seen (again), with its uid.
    pub fn seen(&mut self, key: PolicyKey, uid: String) {
        self.uids.insert(key, uid);
        self.dirty = true;
    }

    /// A policy gone: nothing more to report on it.
    pub fn forget(&mut self, key: &PolicyKey) {
        self.uids.remove(key);
        self.reported.remove(key);
    }

    /// Something changed that may change statuses.
    pub fn mark(&mut self) {
        self.dirty = true;
    }

    /// The statuses that changed since they were last reported (nothing when nothing changed).
    pub fn reports(&mut self, compiler: &mut Compiler, invalid: &BTreeMap<PolicyKey, Vec<String>>) -> Vec<Report> {
        if !std::mem::take(&mut self.dirty) {
            return Vec::new();
        }
        let mut out = Vec::new();
        for key in compiler.policy_keys() {
            let Some(status) = compiler.policy_status(&key) else { continue };
            let problems = invalid.get(&key).map(Vec::as_slice).unwrap_or_default();
            let told = describe(&status, problems);
            if self.reported.get(&key) == Some(&told) {
                continue;
            }
            let (warning, reason, note) = told.clone();
            self.reported.insert(key.clone(), told);
            let uid = self.uids.get(&key).cloned().unwrap_or_default();
            out.push(Report { policy: key, uid, warning, reason, note });
        }
        out.sort_by_key(|a| a.policy.to_string());
        out
    }
}

/// A policy's status in words: (warning, reason, note).
pub fn describe(status: &PolicyStatus, problems: &[String]) -> (bool, &'static str, String) {
    let mut note = if status.nodes.is_empty() {
        "compiled; isolates no pod yet: enforced on no node".to_string()
    } else {
        let mut names: Vec<&str> = status.nodes.iter().take(NODES_NAMED).map(String::as_str).collect();
        let more = status.nodes.len().saturating_sub(NODES_NAMED);
        let more = if more > 0 { format!(" and {more} more") } else { String::new() };
        names.sort_unstable();
        format!(
            "compiled; enforced on {} node{} ({}{more}) for {} pod{}",
            status.nodes.len(),
            plural(status.nodes.len()),
            names.join(", "),
            status.pods,
            plural(status.pods)
        )
    };
    let mut reason = "Compiled";
    for (port, lacking) in &status.unresolved_ports {
        note.push_str(&format!(
            "; named port \"{port}\" is not declared by {lacking} of the {} pod{} it isolates (that port rule allows nothing there)",
            status.pods,
            plural(status.pods)
        ));
        reason = "UnresolvedNamedPort";
    }
    if !problems.is_empty() {
        note.push_str(&format!("; parts that match nothing: {}", problems.join("; ")));
        reason = "InvalidParts";
    }
    (reason != "Compiled", reason, note)
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn status(nodes: &[&str], pods: usize) -> PolicyStatus {
        PolicyStatus { pods, nodes: nodes.iter().map(ToString::to_string).collect(), unresolved_ports: BTreeMap::new() }
    }

    #[test]
    fn notes_say_where_a_policy_is_enforced_and_what_is_wrong() {
        assert_eq!(
            describe(&status(&["node-2", "node-1"], 3), &[]),
            (false, "Compiled", "compiled; enforced on 2 nodes (node-1, node-2) for 3 pods".to_string())
        );
        assert_eq!(describe(&status(&[], 0), &[]).2, "compiled; isolates no pod yet: enforced on no node");
        let many: Vec<String> = (0..7).map(|i| format!("n{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(describe(&status(&many, 7), &[]).2.contains("(n0, n1, n2, n3, n4 and 2 more)"));
        let mut s = status(&["node-1"], 1);
        s.unresolved_ports.insert("metrics".into(), 1);
        let (warning, reason, note) = describe(&s, &[]);
        assert!(warning && reason == "UnresolvedNamedPort", "{reason}");
        assert!(note.contains("named port \"metrics\" is not declared by 1 of the 1 pod it isolates"), "{note}");
        let (warning, reason, note) = describe(&s, &["ipBlock `10.0.0.0/33`".to_string()]);
        assert!(warning && reason == "InvalidParts" && note.contains("10.0.0.0/33"), "{note}");
    }

    #[test]
    fn only_changed_statuses_are_reported() {
        use kuryr_policy_core::{LabelSelector, NetworkPolicy, Pod};
        let mut c = Compiler::new();
        let mut t = Tracker::default();
        let key = PolicyKey { namespace: "a".into(), name: "deny".into() };
        c.upsert_policy(NetworkPolicy {
            namespace: "a".into(),
            name: "deny".into(),
            pod_selector: LabelSelector::everything(),
            ..NetworkPolicy::default()
        });
        t.seen(key.clone(), "uid-1".into());
        let r = t.reports(&mut c, &BTreeMap::new());
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].uid.as_str(), r[0].note.as_str()),
            ("uid-1", "compiled; isolates no pod yet: enforced on no node")
        );
        t.mark();
        assert!(t.reports(&mut c, &BTreeMap::new()).is_empty(), "unchanged");
        c.upsert_pod(Pod {
            namespace: "a".into(),
            name: "p".into(),
            node: "node-1".into(),
            ips: vec!["10.0.0.1".parse().unwrap()],
            ..Pod::default()
        });
        assert!(t.reports(&mut c, &BTreeMap::new()).is_empty(), "not marked: not recomputed");
        t.mark();
        let r = t.reports(&mut c, &BTreeMap::new());
        assert_eq!(r[0].note, "compiled; enforced on 1 node (node-1) for 1 pod");
        t.forget(&key);
        c.remove_policy(&key);
        t.mark();
        assert!(t.reports(&mut c, &BTreeMap::new()).is_empty());
    }
}
