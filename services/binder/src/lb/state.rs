//! What the binder knows of kuryr-lbaas's stream, free of I/O: the desired Services, which of
//! them changed since they were programmed, and whether the view is complete.
//!
//! Nothing is programmed from a partial view: the Services of a snapshot are collected until
//! SNAPSHOT_COMPLETE and then applied in one full sync, so a restart or a RESET never leaves a
//! moment with fewer rules than before. Deltas after that mark single Services dirty.

use std::collections::BTreeMap;
use std::time::Instant;

use kuryr_proto::lbaas::v1::{LbEventType, WatchLoadBalancersResponse};

use super::model::{Service, ServiceKey, service_from_spec};

/// What one stream event did, for logs and metrics.
#[derive(Debug, PartialEq, Eq)]
pub enum Applied {
    /// Nothing to report.
    Quiet,
    /// A Service whose spec cannot be programmed (treated as absent).
    Invalid { service: String, error: String },
    /// A Service programmed without some of its members.
    Warnings { service: String, warnings: Vec<String> },
    /// The first complete view after a start or RESET.
    SnapshotComplete { services: usize },
    /// kuryr-lbaas asked to forget everything; a snapshot follows.
    Reset,
}

/// Work for the programmer.
#[derive(Debug, PartialEq, Eq)]
pub enum Work {
    /// Rebuild the table from every desired Service.
    Full { services: Vec<Service>, since: Instant },
    /// Reprogram these Services (None: delete it).
    Delta { changes: Vec<(ServiceKey, Option<Service>)>, since: Instant },
}

/// The stream-fed state.
#[derive(Debug, Default)]
pub struct State {
    /// This node's name: members running here are the local ones.
    node: String,
    desired: BTreeMap<ServiceKey, Service>,
    /// Services changed since last programmed, with when their oldest pending change arrived.
    dirty: BTreeMap<ServiceKey, Instant>,
    /// A full sync is due, since this instant.
    full: Option<Instant>,
    /// The desired set reflects a complete snapshot and the deltas after it.
    complete: bool,
    /// The stream is open.
    pub connected: bool,
    /// The last transaction succeeded.
    pub programmed_ok: bool,
}

impl State {
    /// The state of the node named `node`.
    pub fn for_node(node: &str) -> Self {
        Self { node: node.to_string(), ..Self::default() }
    }

    fn forget(&mut self) {
        self.desired.clear();
        self.dirty.clear();
        self.full = None;
        self.complete = false;
    }

    fn touch(&mut self, key: ServiceKey, now: Instant) {
        if self.complete {
            self.dirty.entry(key).or_insert(now);
        }
    }

    /// Applies one stream event received at `now`.
    /// (The follower keeps the resume point; see [`kuryr_stream::follow`].)
    pub fn apply(&mut self, ev: &WatchLoadBalancersResponse, now: Instant) -> Applied {
        match ev.r#type() {
            LbEventType::Reset => {
                self.forget();
                Applied::Reset
            }
            LbEventType::SnapshotComplete => {
                if self.complete {
                    return Applied::Quiet;
                }
                self.complete = true;
                self.full = Some(now);
                self.dirty.clear();
                Applied::SnapshotComplete { services: self.desired.len() }
            }
            LbEventType::LbApplied => {
                let Some(spec) = &ev.spec else {
                    return Applied::Invalid { service: "?".into(), error: "spec: missing".into() };
                };
                let name = format!("{}/{}", spec.namespace, spec.name);
                match service_from_spec(spec, &self.node) {
                    Ok((svc, warnings)) => {
                        let key = svc.key.clone();
                        let changed = self.desired.get(&key) != Some(&svc);
                        self.desired.insert(key.clone(), svc);
                        if changed {
                            self.touch(key, now);
                        }
                        if warnings.is_empty() { Applied::Quiet } else { Applied::Warnings { service: name, warnings } }
                    }
                    Err(e) => {
                        // Whatever was programmed for it goes: stale rules are worse than none.
                        let key = ServiceKey { namespace: spec.namespace.clone(), name: spec.name.clone() };
                        if self.desired.remove(&key).is_some() {
                            self.touch(key, now);
                        }
                        Applied::Invalid { service: name, error: e.to_string() }
                    }
                }
            }
            LbEventType::LbDeleted => {
                if let Some(spec) = &ev.spec {
                    let key = ServiceKey { namespace: spec.namespace.clone(), name: spec.name.clone() };
                    self.desired.remove(&key);
                    self.touch(key, now);
                }
                Applied::Quiet
            }
            LbEventType::Unspecified | LbEventType::Heartbeat => Applied::Quiet,
        }
    }

    /// Takes the pending work, if the view is complete.
    pub fn take_work(&mut self) -> Option<Work> {
        if !self.complete {
            return None;
        }
        if let Some(since) = self.full.take() {
            let since = self.dirty.values().copied().chain([since]).min().unwrap_or(since);
            self.dirty.clear();
            return Some(Work::Full { services: self.desired.values().cloned().collect(), since });
        }
        let since = self.dirty.values().copied().min()?;
        let changes =
            std::mem::take(&mut self.dirty).into_keys().map(|k| (k.clone(), self.desired.get(&k).cloned())).collect();
        Some(Work::Delta { changes, since })
    }

    /// After a failed transaction: the next attempt rebuilds the whole table.
    pub fn retry_full(&mut self, since: Instant) {
        if self.complete {
            let at = self.full.map_or(since, |f| f.min(since));
            self.full = Some(at);
        }
    }

    /// Whether the rules reflect a complete, live view with nothing pending.
    pub fn synced(&self) -> bool {
        self.connected && self.complete && self.programmed_ok && self.full.is_none() && self.dirty.is_empty()
    }

    /// The number of desired Services.
    pub fn services(&self) -> usize {
        self.desired.len()
    }
}

#[cfg(test)]
mod tests {
    use kuryr_proto::lbaas::v1::{Listener, LoadBalancerSpec, Member, Pool, Protocol};

    use super::*;

    fn spec(name: &str, members: &[&str]) -> LoadBalancerSpec {
        LoadBalancerSpec {
            namespace: "default".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            vips: vec!["10.96.0.10".into()],
            listeners: vec![Listener {
                protocol: Protocol::Tcp as i32,
                port: 80,
                name: String::new(),
                pool: Some(Pool {
                    members: members
                        .iter()
                        .map(|a| Member { address: (*a).into(), port: 80, ready: true, ..Default::default() })
                        .collect(),
                }),
                node_port: 0,
            }],
            ..Default::default()
        }
    }

    fn ev(t: LbEventType, spec: Option<LoadBalancerSpec>, rp: &str) -> WatchLoadBalancersResponse {
        WatchLoadBalancersResponse { resume_point: rp.into(), r#type: t as i32, spec }
    }

    fn names(w: &Work) -> Vec<String> {
        match w {
            Work::Full { services, .. } => services.iter().map(|s| s.key.name.clone()).collect(),
            Work::Delta { changes, .. } => {
                changes.iter().map(|(k, s)| format!("{}{}", k.name, if s.is_some() { "" } else { "-" })).collect()
            }
        }
    }

    #[test]
    fn a_snapshot_is_programmed_whole_then_deltas_one_by_one() {
        let mut s = State::default();
        let t0 = Instant::now();
        s.apply(&ev(LbEventType::LbApplied, Some(spec("a", &["10.0.0.1"])), "1"), t0);
        s.apply(&ev(LbEventType::LbApplied, Some(spec("b", &["10.0.0.2"])), "1"), t0);
        assert_eq!(s.take_work(), None, "nothing from a partial view");
        let done = s.apply(&ev(LbEventType::SnapshotComplete, None, "2"), t0);
        assert_eq!(done, Applied::SnapshotComplete { services: 2 });
        let w = s.take_work().unwrap();
        assert_eq!(names(&w), ["a", "b"]);
        assert!(matches!(w, Work::Full { .. }));
        assert_eq!(s.take_work(), None);

        let t1 = Instant::now();
        s.apply(&ev(LbEventType::LbApplied, Some(spec("a", &["10.0.0.1", "10.0.0.3"])), "3"), t1);
        // The same spec again changes nothing.
        s.apply(&ev(LbEventType::LbApplied, Some(spec("b", &["10.0.0.2"])), "4"), t1);
        s.apply(&ev(LbEventType::LbDeleted, Some(spec("c", &[])), "5"), t1);
        let w = s.take_work().unwrap();
        assert_eq!(names(&w), ["a", "c-"]);
        match w {
            Work::Delta { since, .. } => assert_eq!(since, t1),
            other => panic!("{other:?}"),
        }
        assert_eq!(s.services(), 2);
    }

    #[test]
    fn reset_collects_a_new_snapshot_before_anything_is_programmed() {
        let mut s = State::default();
        let t = Instant::now();
        s.apply(&ev(LbEventType::LbApplied, Some(spec("a", &["10.0.0.1"])), "1"), t);
        s.apply(&ev(LbEventType::SnapshotComplete, None, "1"), t);
        s.take_work();
        assert_eq!(s.apply(&ev(LbEventType::Reset, None, ""), t), Applied::Reset);
        s.apply(&ev(LbEventType::LbApplied, Some(spec("b", &["10.0.0.1"])), "x-1"), t);
        assert_eq!(s.take_work(), None);
        s.apply(&ev(LbEventType::SnapshotComplete, None, "x-1"), t);
        assert_eq!(names(&s.take_work().unwrap()), ["b"], "a is gone: the full sync removes it");
    }

    #[test]
    fn invalid_specs_remove_what_was_programmed() {
        let mut s = State::default();
        let t = Instant::now();
        s.apply(&ev(LbEventType::LbApplied, Some(spec("a", &["10.0.0.1"])), "1"), t);
        s.apply(&ev(LbEventType::SnapshotComplete, None, "1"), t);
        s.take_work();
        let mut bad = spec("a", &["10.0.0.1"]);
        bad.vips = vec!["nope".into()];
        match s.apply(&ev(LbEventType::LbApplied, Some(bad), "2"), t) {
            Applied::Invalid { service, error } => {
                assert_eq!(service, "default/a");
                assert!(error.contains("vips[0]"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(names(&s.take_work().unwrap()), ["a-"]);
    }

    #[test]
    fn a_failed_transaction_is_retried_as_a_full_sync_and_sync_state_follows() {
        let mut s = State::default();
        let t = Instant::now();
        s.connected = true;
        s.apply(&ev(LbEventType::SnapshotComplete, None, "1"), t);
        let w = s.take_work().unwrap();
        assert!(!s.synced(), "not programmed yet");
        s.retry_full(t);
        assert!(matches!(s.take_work(), Some(Work::Full { .. })), "{w:?}");
        s.programmed_ok = true;
        assert!(s.synced());
        s.connected = false;
        assert!(!s.synced());
    }
}
