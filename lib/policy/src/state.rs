//! The compiler's output: one node's desired policy state ([`NodePolicy`]), the decision it
//! stands for ([`NodePolicy::allows`], the same one the binder's nftables rules make), and the
//! difference between two states ([`NodeDelta`]), which is what a dataplane applies and what a
//! stream carries after its snapshot.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use crate::allowed::{Allowed, Traffic};
use crate::model::PolicyType;

/// A group of pods that are judged alike: same direction, same namespace, same policies
/// selecting them and, for ingress, the same resolution of the named ports those policies use.
/// Its id is derived from that key (`i` or `e`, then 16 hex digits), so it stays the same while
/// the group's peers change and is the same on every node.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(pub String);

impl GroupId {
    /// The direction, from the id's first letter.
    pub fn direction(&self) -> PolicyType {
        if self.0.starts_with('e') { PolicyType::Egress } else { PolicyType::Ingress }
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One node's desired policy state.
///
/// A local pod address in `ingress` is isolated for ingress: a new connection to it is allowed
/// only if its group's [`Allowed`] holds the source (and the destination port); one absent is
/// not isolated. `egress` likewise, by source address, for destinations. `groups` holds the
/// groups those maps name, and only those.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePolicy {
    pub ingress: BTreeMap<IpAddr, GroupId>,
    pub egress: BTreeMap<IpAddr, GroupId>,
    pub groups: BTreeMap<GroupId, Arc<Allowed>>,
}

impl NodePolicy {
    /// The ingress decision this node makes for a new connection `src → dst`: `None` when `dst`
    /// is no isolated pod of this node.
    pub fn ingress_allows(&self, src: &IpAddr, dst: &IpAddr, traffic: Traffic) -> Option<bool> {
        let g = self.ingress.get(dst)?;
        Some(self.groups.get(g).is_some_and(|a| a.allows(src, traffic)))
    }

    /// The egress decision this node makes for a new connection `src → dst`: `None` when `src`
    /// is no isolated pod of this node.
    pub fn egress_allows(&self, src: &IpAddr, dst: &IpAddr, traffic: Traffic) -> Option<bool> {
        let g = self.egress.get(src)?;
        Some(self.groups.get(g).is_some_and(|a| a.allows(dst, traffic)))
    }

    /// Whether this node forwards a new connection `src → dst`, as its ruleset decides: a pod
    /// reaching itself is always allowed; otherwise the source's egress and the destination's
    /// ingress must both allow it (each where it applies).
    pub fn allows(&self, src: &IpAddr, dst: &IpAddr, traffic: Traffic) -> bool {
        if src == dst {
            return true;
        }
        self.egress_allows(src, dst, traffic) != Some(false) && self.ingress_allows(src, dst, traffic) != Some(false)
    }

    /// The addresses of this node's pods that some policy isolates (a pod may always reach
    /// itself: these are the `address . address` elements that say so).
    pub fn isolated_addresses(&self) -> BTreeSet<IpAddr> {
        self.ingress.keys().chain(self.egress.keys()).copied().collect()
    }

    /// The number of set elements the state amounts to, maps included.
    pub fn elements(&self) -> usize {
        self.ingress.len() + self.egress.len() + self.groups.values().map(|g| g.len()).sum::<usize>()
    }

    /// What turns `self` into `new`.
    pub fn diff(&self, new: &NodePolicy) -> NodeDelta {
        let mut d = NodeDelta::default();
        for (id, g) in &new.groups {
            match self.groups.get(id) {
                None => {
                    d.groups_added.insert(id.clone(), g.clone());
                }
                Some(old) if old != g => {
                    d.groups_changed.insert(id.clone(), GroupDelta { added: g.minus(old), removed: old.minus(g) });
                }
                Some(_) => {}
            }
        }
        d.groups_removed = self.groups.keys().filter(|id| !new.groups.contains_key(*id)).cloned().collect();
        (d.ingress_set, d.ingress_removed) = map_diff(&self.ingress, &new.ingress);
        (d.egress_set, d.egress_removed) = map_diff(&self.egress, &new.egress);
        d
    }

    /// `self` with `delta` applied (the inverse of [`Self::diff`]).
    pub fn apply(&mut self, delta: &NodeDelta) {
        for id in &delta.groups_removed {
            self.groups.remove(id);
        }
        for (id, g) in &delta.groups_added {
            self.groups.insert(id.clone(), g.clone());
        }
        for (id, change) in &delta.groups_changed {
            let g = Arc::make_mut(self.groups.entry(id.clone()).or_default());
            g.any.retain(|x| !change.removed.any.contains(x));
            g.nets.retain(|x| !change.removed.nets.contains(x));
            g.ports.retain(|x| !change.removed.ports.contains(x));
            g.ranges.retain(|x| !change.removed.ranges.contains(x));
            g.any.extend(change.added.any.iter().copied());
            g.nets.extend(change.added.nets.iter().copied());
            g.ports.extend(change.added.ports.iter().copied());
            g.ranges.extend(change.added.ranges.iter().copied());
        }
        for (map, set, removed) in [
            (&mut self.ingress, &delta.ingress_set, &delta.ingress_removed),
            (&mut self.egress, &delta.egress_set, &delta.egress_removed),
        ] {
            for ip in removed {
                map.remove(ip);
            }
            map.extend(set.iter().map(|(ip, g)| (*ip, g.clone())));
        }
    }
}

fn map_diff(
    old: &BTreeMap<IpAddr, GroupId>,
    new: &BTreeMap<IpAddr, GroupId>,
) -> (BTreeMap<IpAddr, GroupId>, BTreeSet<IpAddr>) {
    let set = new.iter().filter(|(ip, g)| old.get(*ip) != Some(*g)).map(|(ip, g)| (*ip, g.clone())).collect();
    let removed = old.keys().filter(|ip| !new.contains_key(*ip)).copied().collect();
    (set, removed)
}

/// The elements a group gains and loses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupDelta {
    pub added: Allowed,
    pub removed: Allowed,
}

/// The difference between two [`NodePolicy`] values: groups created, changed (by elements) and
/// removed, and map entries set (new or pointing at another group) and removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeDelta {
    pub groups_added: BTreeMap<GroupId, Arc<Allowed>>,
    pub groups_changed: BTreeMap<GroupId, GroupDelta>,
    pub groups_removed: BTreeSet<GroupId>,
    pub ingress_set: BTreeMap<IpAddr, GroupId>,
    pub ingress_removed: BTreeSet<IpAddr>,
    pub egress_set: BTreeMap<IpAddr, GroupId>,
    pub egress_removed: BTreeSet<IpAddr>,
}

impl NodeDelta {
    pub fn is_empty(&self) -> bool {
        self == &NodeDelta::default()
    }

    /// Set elements added and removed (map entries count once each; a map entry pointing at
    /// another group counts as one).
    pub fn element_changes(&self) -> usize {
        self.groups_added.values().map(|g| g.len()).sum::<usize>()
            + self.groups_changed.values().map(|c| c.added.len() + c.removed.len()).sum::<usize>()
            + self.ingress_set.len()
            + self.ingress_removed.len()
            + self.egress_set.len()
            + self.egress_removed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allowed::{Builder, Ports};
    use crate::model::Protocol;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn group(peers: &[&str], port: Option<u16>) -> Arc<Allowed> {
        let mut b = Builder::default();
        for p in peers {
            b.address(ip(p), port.map_or(Ports::All, |n| Ports::Range(Protocol::Tcp, n, n)));
        }
        Arc::new(b.build())
    }

    #[test]
    fn decisions_combine_egress_and_ingress_and_a_pod_may_reach_itself() {
        let gi = GroupId("i1".into());
        let ge = GroupId("e1".into());
        let s = NodePolicy {
            ingress: [(ip("10.0.0.1"), gi.clone())].into(),
            egress: [(ip("10.0.0.2"), ge.clone())].into(),
            groups: [(gi, group(&["10.0.0.2"], Some(80))), (ge, group(&["10.0.0.1", "10.0.0.3"], None))].into(),
        };
        let tcp = |p| Traffic::Port(Protocol::Tcp, p);
        assert!(s.allows(&ip("10.0.0.2"), &ip("10.0.0.1"), tcp(80)));
        assert!(!s.allows(&ip("10.0.0.2"), &ip("10.0.0.1"), tcp(81)), "ingress of .1 allows port 80 only");
        assert!(!s.allows(&ip("10.0.0.2"), &ip("10.0.0.4"), tcp(80)), "egress of .2 does not allow .4");
        assert!(s.allows(&ip("10.0.0.2"), &ip("10.0.0.3"), Traffic::Other));
        assert!(s.allows(&ip("10.0.0.9"), &ip("10.0.0.3"), tcp(1)), "neither end isolated here");
        assert!(s.allows(&ip("10.0.0.1"), &ip("10.0.0.1"), tcp(9)), "itself");
        assert_eq!(s.ingress_allows(&ip("10.0.0.9"), &ip("10.0.0.2"), tcp(1)), None);
        assert_eq!(s.isolated_addresses().len(), 2);
        assert_eq!(s.elements(), 5);
    }

    #[test]
    fn a_diff_applied_gives_the_new_state() {
        let (a, b, c) = (GroupId("i-a".into()), GroupId("i-b".into()), GroupId("e-c".into()));
        let old = NodePolicy {
            ingress: [(ip("10.0.0.1"), a.clone()), (ip("10.0.0.2"), a.clone())].into(),
            egress: [(ip("10.0.0.1"), c.clone())].into(),
            groups: [(a.clone(), group(&["10.0.1.1", "10.0.1.2"], Some(80))), (c.clone(), group(&["10.0.1.1"], None))]
                .into(),
        };
        let new = NodePolicy {
            ingress: [(ip("10.0.0.1"), a.clone()), (ip("10.0.0.2"), b.clone()), (ip("10.0.0.3"), b.clone())].into(),
            egress: [].into(),
            groups: [(a.clone(), group(&["10.0.1.2", "10.0.1.3"], Some(80))), (b.clone(), group(&["10.0.1.9"], None))]
                .into(),
        };
        let d = old.diff(&new);
        assert_eq!(d.groups_added.keys().collect::<Vec<_>>(), [&b]);
        assert_eq!(d.groups_removed.iter().collect::<Vec<_>>(), [&c]);
        let ch = &d.groups_changed[&a];
        assert_eq!(ch.added.ports.iter().map(|p| p.addr).collect::<Vec<_>>(), [ip("10.0.1.3")]);
        assert_eq!(ch.removed.ports.iter().map(|p| p.addr).collect::<Vec<_>>(), [ip("10.0.1.1")]);
        assert_eq!(d.ingress_set.len(), 2, "one moved, one new");
        assert_eq!(d.egress_removed.len(), 1);
        assert_eq!(d.element_changes(), 1 + 2 + 2 + 1);
        let mut applied = old.clone();
        applied.apply(&d);
        assert_eq!(applied, new);
        assert!(new.diff(&new).is_empty());
    }
}
