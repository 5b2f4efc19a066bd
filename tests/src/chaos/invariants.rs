//! The invariants a chaos run ends on, as pure functions of a snapshot of the cluster's records,
//! so that the checker itself can be tested on constructed state (a checker that cannot see a
//! leak proves nothing).
//!
//! - every live pod has exactly one VIF (one PodVif of its uid, whose VIF carries the pod's
//!   addresses, each allocated to its uid);
//! - no address or MAC without a live owner (a leak): an allocation in an AddressBlock whose pod
//!   or PodVif is gone, a PodVif whose pod is gone, a host veth, attachment record, nft element or
//!   network namespace of a deleted pod;
//! - no address or MAC twice (a duplicate): in two blocks, held by two pods, two VIFs with one MAC.
//!
//! The same checks also run during a chaos run, every few seconds, through [`Lasting`]: there a
//! problem counts only once it has lasted longer than a grace period, so that work in flight (a
//! pod being set up or torn down, a release not yet done) is not taken for a leak.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// A pod in the API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LivePod {
    /// namespace/name.
    pub key: String,
    pub uid: String,
    pub node: String,
    /// status.podIPs (empty while starting).
    pub ips: Vec<String>,
    /// Running with addresses and not being deleted.
    pub running: bool,
}

/// A PodVif.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VifRecord {
    /// namespace/name (the pod's).
    pub key: String,
    pub pod_uid: String,
    pub mac: String,
    /// Addresses without prefix length.
    pub ips: Vec<String>,
}

/// One allocation in an AddressBlock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub ip: String,
    /// The block's node.
    pub node: String,
    /// namespace/name of the pod it is for.
    pub key: String,
    pub uid: String,
    pub mac: String,
}

/// What one node holds for pods.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeHeld {
    pub node: String,
    /// Host-side pod veths.
    pub veths: usize,
    /// The binder's attachment records.
    pub attachments: usize,
    /// Sandboxes the runtime lists.
    pub sandboxes: usize,
    /// Addresses found in the node's nftables table `inet kuryr` among those of deleted pods.
    pub stale_nft: Vec<String>,
    /// Network namespaces of deleted pods that still exist.
    pub stale_netns: Vec<String>,
}

/// A snapshot of the records.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub pods: Vec<LivePod>,
    pub vifs: Vec<VifRecord>,
    pub allocations: Vec<Allocation>,
    pub nodes: Vec<NodeHeld>,
}

/// What is wrong, one line per problem.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Findings {
    /// Something without a live owner.
    pub leaked: Vec<String>,
    /// Something twice.
    pub duplicate: Vec<String>,
    /// A live, Running pod without exactly one complete VIF.
    pub missing: Vec<String>,
}

impl Findings {
    /// Nothing wrong.
    pub fn clean(&self) -> bool {
        self.leaked.is_empty() && self.duplicate.is_empty() && self.missing.is_empty()
    }

    /// One line per kind, with the first few problems.
    pub fn summary(&self) -> String {
        let few = |v: &[String]| v.iter().take(5).cloned().collect::<Vec<_>>().join("; ");
        format!(
            "{} leaked [{}], {} duplicate [{}], {} without exactly one VIF [{}]",
            self.leaked.len(),
            few(&self.leaked),
            self.duplicate.len(),
            few(&self.duplicate),
            self.missing.len(),
            few(&self.missing)
        )
    }
}

/// What a problem counts as in the verdict line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Leak,
    Duplicate,
    /// A live pod without exactly one working network (counted with the unreachable ones).
    Unreachable,
}

impl Findings {
    /// Every problem with what it counts as (a pod without exactly one VIF as unreachable).
    pub fn problems(&self) -> impl Iterator<Item = (Kind, &String)> {
        [(Kind::Leak, &self.leaked), (Kind::Duplicate, &self.duplicate), (Kind::Unreachable, &self.missing)]
            .into_iter()
            .flat_map(|(k, v)| v.iter().map(move |l| (k, l)))
    }
}

/// Problems seen by the checks during a run, each counted once it has been seen continuously for
/// longer than a grace period (from its first sighting to a later one; a check that no longer
/// sees it forgets it). A problem is known by its key, so one whose description changes from one
/// check to the next (a count on a node) starts again and is left to the end checks.
#[derive(Debug, Default)]
pub struct Lasting {
    first_seen: HashMap<String, Instant>,
    counted: BTreeMap<String, (Kind, String)>,
    /// Checks made.
    pub checks: usize,
}

impl Lasting {
    /// One check that found `current` (key, kind, description) at `now`.
    pub fn observe<I>(&mut self, current: I, now: Instant, grace: Duration)
    where
        I: IntoIterator<Item = (String, Kind, String)>,
    {
        self.checks += 1;
        let current: HashMap<String, (Kind, String)> = current.into_iter().map(|(k, kind, l)| (k, (kind, l))).collect();
        self.first_seen.retain(|k, _| current.contains_key(k));
        for (key, (kind, line)) in current {
            let since = *self.first_seen.entry(key.clone()).or_insert(now);
            if now.duration_since(since) >= grace {
                self.counted.entry(key).or_insert_with(|| (kind, format!("{line} for over {grace:?}")));
            }
        }
    }

    /// The problems that lasted, with what they count as.
    pub fn counted(&self) -> impl Iterator<Item = (Kind, &str)> {
        self.counted.values().map(|(k, l)| (*k, l.as_str()))
    }
}

/// Checks `s`; see the module documentation.
pub fn check(s: &Snapshot) -> Findings {
    let mut f = Findings::default();
    let pods: HashMap<&str, &LivePod> = s.pods.iter().map(|p| (p.key.as_str(), p)).collect();

    // PodVifs: one per pod of the same uid; none without its pod.
    let mut vifs_of: BTreeMap<&str, Vec<&VifRecord>> = BTreeMap::new();
    for v in &s.vifs {
        match pods.get(v.key.as_str()) {
            Some(p) if p.uid == v.pod_uid => vifs_of.entry(v.key.as_str()).or_default().push(v),
            _ => f.leaked.push(format!("PodVif {} (uid {}) has no live pod", v.key, v.pod_uid)),
        }
    }
    for (key, vs) in &vifs_of {
        if vs.len() > 1 {
            f.duplicate.push(format!("{key} has {} PodVifs", vs.len()));
        }
    }

    // Allocations: each address once; each for a live pod whose VIF carries it.
    let mut by_ip: BTreeMap<&str, Vec<&Allocation>> = BTreeMap::new();
    for a in &s.allocations {
        by_ip.entry(a.ip.as_str()).or_default().push(a);
        let owner = pods.get(a.key.as_str()).filter(|p| p.uid == a.uid);
        let vif_has = vifs_of.get(a.key.as_str()).is_some_and(|vs| vs.iter().any(|v| v.ips.contains(&a.ip)));
        if owner.is_none() || !vif_has {
            f.leaked.push(format!(
                "address {} (block of {}) allocated to {} uid {} without a live owner",
                a.ip, a.node, a.key, a.uid
            ));
        }
    }
    for (ip, allocs) in &by_ip {
        if allocs.len() > 1 {
            let who: Vec<_> = allocs.iter().map(|a| a.key.as_str()).collect();
            f.duplicate.push(format!("address {ip} allocated {} times: {who:?}", allocs.len()));
        }
    }

    // MACs once among the VIFs and among the allocations' owners.
    let mut macs: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for v in s.vifs.iter().filter(|v| !v.mac.is_empty()) {
        macs.entry(v.mac.as_str()).or_default().insert(v.key.as_str());
    }
    for a in s.allocations.iter().filter(|a| !a.mac.is_empty()) {
        macs.entry(a.mac.as_str()).or_default().insert(a.key.as_str());
    }
    for (mac, owners) in &macs {
        if owners.len() > 1 {
            f.duplicate.push(format!("MAC {mac} held by {owners:?}"));
        }
    }

    // Running pods: exactly one VIF with their addresses, each allocated to them; no address
    // held by two pods.
    let mut holders: BTreeMap<&str, &str> = BTreeMap::new();
    for p in s.pods.iter().filter(|p| p.running) {
        match vifs_of.get(p.key.as_str()).map(Vec::as_slice) {
            Some([v]) => {
                if v.ips != p.ips {
                    f.missing.push(format!("{}: status {:?}, PodVif {:?}", p.key, p.ips, v.ips));
                }
            }
            Some(_) => {} // counted as a duplicate above
            None => f.missing.push(format!("{} is Running with {:?} but has no PodVif", p.key, p.ips)),
        }
        for ip in &p.ips {
            let mine = by_ip.get(ip.as_str()).is_some_and(|a| a.iter().any(|a| a.uid == p.uid && a.node == p.node));
            if !mine {
                f.missing.push(format!("{}: {ip} is not allocated to it in a block of {}", p.key, p.node));
            }
            if let Some(other) = holders.insert(ip.as_str(), p.key.as_str()) {
                f.duplicate.push(format!("address {ip} held by both {other} and {}", p.key));
            }
        }
    }

    // Nodes: one veth and one attachment per pod there (live in the API: a pod being deleted
    // still owns its interface until its teardown); nothing of a deleted pod.
    for n in &s.nodes {
        let want = s.pods.iter().filter(|p| p.node == n.node && !p.ips.is_empty()).count();
        let max = s.pods.iter().filter(|p| p.node == n.node).count();
        for (what, have) in [("host veths", n.veths), ("attachment records", n.attachments), ("sandboxes", n.sandboxes)]
        {
            if have > max {
                f.leaked.push(format!("{}: {have} {what} for {max} pods ({want} with addresses)", n.node));
            }
        }
        f.leaked.extend(n.stale_nft.iter().map(|ip| format!("{}: nft element {ip} of a deleted pod", n.node)));
        f.leaked.extend(n.stale_netns.iter().map(|ns| format!("{}: network namespace {ns} of a deleted pod", n.node)));
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, uid: &str, node: &str, ip: &str) -> LivePod {
        LivePod { key: format!("c/{name}"), uid: uid.into(), node: node.into(), ips: vec![ip.into()], running: true }
    }
    fn vif(name: &str, uid: &str, mac: &str, ip: &str) -> VifRecord {
        VifRecord { key: format!("c/{name}"), pod_uid: uid.into(), mac: mac.into(), ips: vec![ip.into()] }
    }
    fn alloc(name: &str, uid: &str, node: &str, mac: &str, ip: &str) -> Allocation {
        Allocation { ip: ip.into(), node: node.into(), key: format!("c/{name}"), uid: uid.into(), mac: mac.into() }
    }
    fn healthy() -> Snapshot {
        Snapshot {
            pods: vec![pod("a", "u1", "n1", "10.0.0.2"), pod("b", "u2", "n2", "10.0.1.2")],
            vifs: vec![vif("a", "u1", "m1", "10.0.0.2"), vif("b", "u2", "m2", "10.0.1.2")],
            allocations: vec![alloc("a", "u1", "n1", "m1", "10.0.0.2"), alloc("b", "u2", "n2", "m2", "10.0.1.2")],
            nodes: vec![
                NodeHeld { node: "n1".into(), veths: 1, attachments: 1, sandboxes: 1, ..NodeHeld::default() },
                NodeHeld { node: "n2".into(), veths: 1, attachments: 1, sandboxes: 1, ..NodeHeld::default() },
            ],
        }
    }

    #[test]
    fn a_consistent_snapshot_is_clean() {
        let f = check(&healthy());
        assert!(f.clean(), "{}", f.summary());
    }

    #[test]
    fn an_address_allocated_to_a_deleted_pod_is_a_leak() {
        let mut s = healthy();
        s.allocations.push(alloc("gone", "u9", "n1", "m9", "10.0.0.9"));
        let f = check(&s);
        assert_eq!(f.leaked.len(), 1, "{}", f.summary());
        assert!(f.leaked[0].contains("10.0.0.9"), "{}", f.summary());
        assert!(f.duplicate.is_empty() && f.missing.is_empty(), "{}", f.summary());
    }

    #[test]
    fn a_pod_recreated_under_its_name_does_not_own_the_old_uids_address() {
        let mut s = healthy();
        // The old incarnation of `a` (uid u0) still holds an address and a PodVif.
        s.allocations.push(alloc("a", "u0", "n1", "m0", "10.0.0.7"));
        s.vifs.push(vif("a", "u0", "m0", "10.0.0.7"));
        let f = check(&s);
        assert_eq!(f.leaked.len(), 2, "{}", f.summary());
    }

    #[test]
    fn one_address_or_mac_twice_is_a_duplicate() {
        let mut s = healthy();
        s.allocations[1].ip = "10.0.0.2".into();
        s.pods[1].ips = vec!["10.0.0.2".into()];
        s.vifs[1].ips = vec!["10.0.0.2".into()];
        let f = check(&s);
        assert!(f.duplicate.iter().any(|d| d.contains("allocated 2 times")), "{}", f.summary());
        assert!(f.duplicate.iter().any(|d| d.contains("held by both")), "{}", f.summary());

        let mut s = healthy();
        s.vifs[1].mac = "m1".into();
        let f = check(&s);
        assert!(f.duplicate.iter().any(|d| d.contains("MAC m1")), "{}", f.summary());
    }

    #[test]
    fn a_running_pod_without_its_vif_is_reported() {
        let mut s = healthy();
        s.vifs.remove(1);
        let f = check(&s);
        assert!(f.missing.iter().any(|m| m.contains("c/b") && m.contains("no PodVif")), "{}", f.summary());
        assert!(f.leaked.iter().any(|m| m.contains("10.0.1.2")), "its allocation lost its VIF: {}", f.summary());
    }

    #[test]
    fn problems_during_a_run_count_only_once_they_outlast_the_grace_period() {
        let grace = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut s = healthy();
        s.allocations.push(alloc("gone", "u9", "n1", "m9", "10.0.0.9"));
        let seen =
            |s: &Snapshot| check(s).problems().map(|(k, l)| (l.clone(), k, l.clone())).collect::<Vec<_>>().into_iter();
        let mut w = Lasting::default();
        w.observe(seen(&s), t0, grace);
        w.observe(seen(&s), t0 + Duration::from_secs(5), grace);
        assert_eq!(w.counted().count(), 0, "in flight, not yet counted");
        // Gone before the grace period ended: forgotten, and its clock starts again if it returns.
        w.observe(seen(&healthy()), t0 + Duration::from_secs(8), grace);
        w.observe(seen(&s), t0 + Duration::from_secs(12), grace);
        assert_eq!(w.counted().count(), 0, "seen again only 0 s ago");
        w.observe(seen(&s), t0 + Duration::from_secs(23), grace);
        let counted: Vec<_> = w.counted().collect();
        assert_eq!(counted.len(), 1, "{counted:?}");
        assert_eq!(counted[0].0, Kind::Leak);
        assert!(counted[0].1.contains("10.0.0.9") && counted[0].1.ends_with("for over 10s"), "{counted:?}");
        assert_eq!(w.checks, 5);
    }

    #[test]
    fn leftovers_on_a_node_are_leaks() {
        let mut s = healthy();
        s.nodes[0].veths = 2;
        s.nodes[1].stale_nft = vec!["10.0.1.9".into()];
        s.nodes[1].stale_netns = vec!["/var/run/netns/cni-x".into()];
        let f = check(&s);
        assert_eq!(f.leaked.len(), 3, "{}", f.summary());
    }
}
