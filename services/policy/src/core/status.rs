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
//! The [`Tracker`] (in the [`Publisher`](crate::core::publish::Publisher), next to the
//! compiler) recomputes the statuses at most every [`PERIOD`] while changes come, and reports
//! only those that changed; [`crate::k8s::EventSink`] writes them as Events. Pure: no
//! Kubernetes client here.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use kuryr_policy_core::{Compiler, PolicyKey, PolicyStatus};

/// How often statuses are recomputed while changes come.
pub const PERIOD: Duration = Duration::from_secs(1);
/// Nodes named in a note; more are counted.
const NODES_NAMED: usize = 5;

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
