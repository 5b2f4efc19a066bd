//! What the node must enforce, as kuryr-policy's `WatchPolicies` stream describes it: groups of
//! peers by id and the isolated local addresses naming them. Events are applied here as they
//! arrive; a snapshot (a fresh stream, or after RESET) is collected aside and replaces the state
//! only when complete, so the programmer never sees half of one.

use std::collections::BTreeMap;
use std::net::IpAddr;

use kuryr_proto::policy::v1::{PeerGroup, PolicyEventType, WatchPoliciesResponse};

/// The groups judging one address: ingress, egress.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Isolation {
    pub ingress: Option<String>,
    pub egress: Option<String>,
}

/// One node's desired policy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Desired {
    pub groups: BTreeMap<String, PeerGroup>,
    pub isolations: BTreeMap<IpAddr, Isolation>,
}

/// What applying an event did.
#[derive(Debug, PartialEq, Eq)]
pub enum Applied {
    /// Nothing to program (a snapshot item, or an event ignored).
    Quiet,
    /// The desired state changed.
    Changed,
    /// A snapshot completed: the desired state was replaced.
    SnapshotComplete,
    /// The event could not be read; it was left out.
    Invalid(String),
}

/// The stream's state.
#[derive(Debug, Default)]
pub struct State {
    /// What the node must enforce (valid once `synced`).
    pub desired: Desired,
    /// A snapshot being received.
    pending: Option<Desired>,
    /// The resume point of the last event handled.
    pub resume_from: String,
    /// A snapshot has completed since the process started.
    pub synced: bool,
}

impl State {
    /// Called when a stream is opened from `resume_from`: without a resume point, a snapshot
    /// follows at once.
    pub fn opened(&mut self, resume_from: &str) {
        self.pending = if resume_from.is_empty() { Some(Desired::default()) } else { None };
    }

    /// Applies one event.
    pub fn apply(&mut self, ev: &WatchPoliciesResponse) -> Applied {
        let applied = match ev.r#type() {
            PolicyEventType::Reset => {
                self.pending = Some(Desired::default());
                Applied::Quiet
            }
            PolicyEventType::SnapshotComplete => match self.pending.take() {
                Some(d) => {
                    self.desired = d;
                    self.synced = true;
                    Applied::SnapshotComplete
                }
                None => Applied::Quiet,
            },
            PolicyEventType::GroupApplied | PolicyEventType::GroupDeleted => {
                let Some(g) = &ev.group else { return Applied::Invalid("group event without a group".into()) };
                let target = self.pending.as_mut().unwrap_or(&mut self.desired);
                if ev.r#type() == PolicyEventType::GroupApplied {
                    target.groups.insert(g.id.clone(), g.clone());
                } else {
                    target.groups.remove(&g.id);
                }
                if self.pending.is_some() { Applied::Quiet } else { Applied::Changed }
            }
            PolicyEventType::IsolationApplied | PolicyEventType::IsolationDeleted => {
                let Some(i) = &ev.isolation else {
                    return Applied::Invalid("isolation event without an isolation".into());
                };
                let Ok(ip) = i.address.parse::<IpAddr>() else {
                    return Applied::Invalid(format!("isolation address `{}` is not an IP address", i.address));
                };
                let target = self.pending.as_mut().unwrap_or(&mut self.desired);
                if ev.r#type() == PolicyEventType::IsolationApplied {
                    let some = |s: &String| (!s.is_empty()).then(|| s.clone());
                    target
                        .isolations
                        .insert(ip, Isolation { ingress: some(&i.ingress_group), egress: some(&i.egress_group) });
                } else {
                    target.isolations.remove(&ip);
                }
                if self.pending.is_some() { Applied::Quiet } else { Applied::Changed }
            }
            PolicyEventType::Heartbeat | PolicyEventType::Unspecified => Applied::Quiet,
        };
        if !ev.resume_point.is_empty() {
            self.resume_from.clone_from(&ev.resume_point);
        }
        applied
    }
}

#[cfg(test)]
mod tests {
    use kuryr_proto::policy::v1::Isolation as PbIsolation;

    use super::*;

    fn ev(t: PolicyEventType, point: &str) -> WatchPoliciesResponse {
        WatchPoliciesResponse { resume_point: point.into(), r#type: t as i32, ..Default::default() }
    }

    fn group(t: PolicyEventType, id: &str) -> WatchPoliciesResponse {
        WatchPoliciesResponse { group: Some(PeerGroup { id: id.into(), ..Default::default() }), ..ev(t, "e-snapshot") }
    }

    fn iso(t: PolicyEventType, ip: &str, ingress: &str, point: &str) -> WatchPoliciesResponse {
        let isolation = PbIsolation { address: ip.into(), ingress_group: ingress.into(), ..Default::default() };
        WatchPoliciesResponse { isolation: Some(isolation), ..ev(t, point) }
    }

    #[test]
    fn a_snapshot_replaces_the_state_only_when_complete() {
        let mut s = State::default();
        s.opened("");
        assert_eq!(s.apply(&group(PolicyEventType::GroupApplied, "i1")), Applied::Quiet);
        assert_eq!(s.apply(&iso(PolicyEventType::IsolationApplied, "10.0.0.1", "i1", "e-snapshot")), Applied::Quiet);
        assert!(s.desired.groups.is_empty() && !s.synced);
        assert_eq!(s.apply(&ev(PolicyEventType::SnapshotComplete, "e-3")), Applied::SnapshotComplete);
        assert_eq!(s.desired.isolations.len(), 1);
        assert_eq!(s.resume_from, "e-3");
        // Deltas apply at once.
        assert_eq!(s.apply(&iso(PolicyEventType::IsolationDeleted, "10.0.0.1", "", "e-4")), Applied::Changed);
        assert!(s.desired.isolations.is_empty());
        // Reconnecting with a resume point: no snapshot expected unless RESET comes.
        s.opened("e-4");
        assert_eq!(s.apply(&iso(PolicyEventType::IsolationApplied, "10.0.0.2", "i1", "e-5")), Applied::Changed);
        assert_eq!(s.apply(&ev(PolicyEventType::Reset, "e-snapshot")), Applied::Quiet);
        assert_eq!(s.desired.isolations.len(), 1, "kept until the new snapshot completes");
        s.apply(&ev(PolicyEventType::SnapshotComplete, "f-0"));
        assert!(s.desired.isolations.is_empty() && s.desired.groups.is_empty());
        assert!(matches!(
            s.apply(&iso(PolicyEventType::IsolationApplied, "junk", "i1", "f-1")),
            Applied::Invalid(m) if m.contains("junk")
        ));
    }
}
