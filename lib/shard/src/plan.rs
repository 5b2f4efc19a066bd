//! The decisions of one round, free of Kubernetes: which Leases are expired, how many shards
//! this replica should own, and which to renew, take, release or give up as lost.
//!
//! **Expiry.** A Lease is expired when nobody holds it, when this process has seen it unchanged
//! (same resourceVersion) for its whole duration — every renewal changes it, so this needs no
//! clock agreement between replicas — or when its renewTime is more than two durations in the
//! past by this machine's clock, which lets a fresh replica take over Leases of replicas that
//! died long ago without waiting a duration first, while tolerating a duration of clock skew.
//!
//! **Renewal through the membership.** A replica renews its membership Lease every round and
//! writes a shard Lease only when it takes it, releases it, or starts working on it again (after
//! a restart or a fence): the membership carries the shards it holds. A shard Lease whose holder's
//! membership Lease says so ([`Member::renews_shards`]) is expired when that membership Lease is;
//! any other (a holder of an earlier version, or one whose membership Lease is gone) by its own
//! renewals, as above. While a live replica of an earlier version is about, which judges every
//! shard Lease by its own renewals, the held shard Leases are renewed every round as well.
//!
//! **Fair share.** `ceil(shards / live members)`, where the live members are the replicas whose
//! membership Lease is not expired (this one always counts). A replica below its share takes
//! free or expired shard Leases; one above it releases the excess, so a new replica gets work
//! at once instead of when someone dies.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant, SystemTime};

/// What a round reads of a Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseView {
    /// spec.holderIdentity; `None` when empty.
    pub holder: Option<String>,
    /// The holder's endpoint (annotation).
    pub endpoint: Option<String>,
    /// spec.renewTime.
    pub renewed: Option<SystemTime>,
    /// spec.leaseDurationSeconds.
    pub duration: Duration,
    /// metadata.resourceVersion.
    pub version: String,
}

/// When this process first saw each Lease's current resourceVersion.
#[derive(Debug, Default)]
pub struct Tracker {
    seen: HashMap<String, (String, Instant)>,
}

impl Tracker {
    /// Records the Leases of one list (by name, with their resourceVersion); Leases not listed
    /// are forgotten.
    pub fn observe<'a>(&mut self, leases: impl IntoIterator<Item = (&'a str, &'a str)>, now: Instant) {
        let mut next = HashMap::new();
        for (name, version) in leases {
            let since = match self.seen.remove(name) {
                Some((v, since)) if v == version => since,
                _ => now,
            };
            next.insert(name.to_string(), (version.to_string(), since));
        }
        self.seen = next;
    }

    /// How long `name` has been seen unchanged (zero when never seen).
    pub fn unchanged_for(&self, name: &str, now: Instant) -> Duration {
        self.seen.get(name).map_or(Duration::ZERO, |(_, since)| now.saturating_duration_since(*since))
    }

    /// When the held Lease `name` expires by observation if it stays unchanged (`None` when it
    /// is not held).
    pub fn expires_at(&self, name: &str, lease: &LeaseView, now: Instant) -> Option<Instant> {
        lease.holder.as_ref()?;
        Some(now + lease.duration.saturating_sub(self.unchanged_for(name, now)))
    }

    /// Whether the Lease `name` is expired (see the module docs).
    pub fn expired(&self, name: &str, lease: &LeaseView, now: Instant, wall: SystemTime) -> bool {
        if lease.holder.is_none() {
            return true;
        }
        if self.unchanged_for(name, now) >= lease.duration {
            return true;
        }
        lease.renewed.is_some_and(|r| r + lease.duration * 2 < wall)
    }
}

/// A membership Lease as the judgement of the shard Leases needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// Whether the membership Lease is expired.
    pub expired: bool,
    /// Whether its holder keeps its shard Leases alive through it (see the module docs).
    pub renews_shards: bool,
}

/// Whether a shard Lease is expired: by its holder's membership Lease (`holder`, when listed)
/// when the holder renews its shards through it, otherwise by its own renewals (`own`).
pub fn shard_expired(own: bool, holder: Option<Member>) -> bool {
    match holder {
        Some(m) if m.renews_shards => m.expired,
        _ => own,
    }
}

/// The fair share of `shards` among `live` replicas.
pub fn fair_share(shards: u32, live: usize) -> u32 {
    shards.div_ceil(u32::try_from(live.max(1)).unwrap_or(u32::MAX))
}

/// A shard Lease as the plan needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLease {
    /// Who holds it (`None`: released).
    pub holder: Option<String>,
    /// Whether it is expired.
    pub expired: bool,
}

/// What one round does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Owned by this replica as far as it knew, now held by someone else or gone: stop at once.
    pub lost: Vec<u32>,
    /// Held by this replica, to be written: not worked on yet (a restart, or fenced earlier),
    /// or renewed every round because a replica of an earlier version is about.
    pub renew: Vec<u32>,
    /// Held by this replica and worked on: kept through the membership Lease, nothing written.
    pub keep: Vec<u32>,
    /// Held by this replica beyond its fair share: stop working on them, then release.
    pub release: Vec<u32>,
    /// Free or expired: take.
    pub acquire: Vec<u32>,
    /// The fair share the plan aimed at.
    pub fair: u32,
}

/// Plans a round for replica `me`. `leases[i]` is shard `i`'s Lease (`None`: it does not
/// exist yet); `owned` what this replica works on now; `live` the live replicas (this one
/// included); shards are considered in order from `offset`, so that replicas starting together
/// do not all reach for the same free shards first. With `by_membership` the shards worked on
/// are kept without a write ([`Plan::keep`]); without it every held shard is renewed.
pub fn plan(
    me: &str,
    leases: &[Option<ShardLease>],
    owned: &BTreeSet<u32>,
    live: usize,
    offset: u32,
    by_membership: bool,
) -> Plan {
    let shards = u32::try_from(leases.len()).unwrap_or(u32::MAX);
    let fair = fair_share(shards, live);
    let order: Vec<u32> = (0..shards).map(|k| (k + offset % shards.max(1)) % shards.max(1)).collect();
    let held_by_me = |i: u32| leases[i as usize].as_ref().is_some_and(|l| l.holder.as_deref() == Some(me));
    let mut p = Plan { fair, ..Plan::default() };
    p.lost = owned.iter().copied().filter(|&i| i >= shards || !held_by_me(i)).collect();
    let mine: Vec<u32> = order.iter().copied().filter(|&i| held_by_me(i)).collect();
    let keep = usize::try_from(fair).unwrap_or(usize::MAX).min(mine.len());
    (p.keep, p.renew) = mine[..keep].iter().partition(|&&i| by_membership && owned.contains(&i));
    p.release = mine[keep..].to_vec();
    let need = usize::try_from(fair).unwrap_or(usize::MAX).saturating_sub(mine.len());
    p.acquire = order
        .iter()
        .copied()
        .filter(|&i| match &leases[i as usize] {
            None => true,
            Some(l) => l.holder.as_deref() != Some(me) && (l.holder.is_none() || l.expired),
        })
        .take(need)
        .collect();
    p
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn held(by: &str) -> Option<ShardLease> {
        Some(ShardLease { holder: Some(by.into()), expired: false })
    }

    fn expired(by: &str) -> Option<ShardLease> {
        Some(ShardLease { holder: Some(by.into()), expired: true })
    }

    fn free() -> Option<ShardLease> {
        Some(ShardLease { holder: None, expired: true })
    }

    fn set(v: &[u32]) -> BTreeSet<u32> {
        v.iter().copied().collect()
    }

    #[test]
    fn fair_shares() {
        assert_eq!(fair_share(16, 1), 16);
        assert_eq!(fair_share(16, 2), 8);
        assert_eq!(fair_share(16, 3), 6);
        assert_eq!(fair_share(16, 5), 4);
        assert_eq!(fair_share(16, 0), 16, "this replica always counts");
        assert_eq!(fair_share(1, 4), 1);
    }

    #[test]
    fn a_lone_replica_takes_everything_that_is_free_or_expired() {
        let leases = vec![None, free(), expired("dead"), held("other"), None];
        let p = plan("me", &leases, &set(&[]), 1, 0, false);
        assert_eq!(p.acquire, [0, 1, 2, 4], "not the one another replica holds");
        assert!(p.renew.is_empty() && p.release.is_empty() && p.lost.is_empty());
    }

    #[test]
    fn two_replicas_split_and_the_rich_one_releases_its_excess() {
        // Four shards, all held by a; b joined.
        let leases = vec![held("a"), held("a"), held("a"), held("a")];
        let pa = plan("a", &leases, &set(&[0, 1, 2, 3]), 2, 0, false);
        assert_eq!((pa.fair, pa.renew.as_slice(), pa.release.as_slice()), (2, &[0, 1][..], &[2, 3][..]));
        assert!(pa.acquire.is_empty());
        let pb = plan("b", &leases, &set(&[]), 2, 0, false);
        assert!(pb.acquire.is_empty(), "nothing free yet");
        // a released 2 and 3: b takes them.
        let leases = vec![held("a"), held("a"), free(), free()];
        assert_eq!(plan("b", &leases, &set(&[]), 2, 0, false).acquire, [2, 3]);
        assert_eq!(plan("a", &leases, &set(&[0, 1]), 2, 0, false).renew, [0, 1]);
    }

    #[test]
    fn a_dead_replica_s_shards_are_taken_once_expired() {
        let leases = vec![held("a"), held("a"), held("b"), held("b")];
        let p = plan("a", &leases, &set(&[0, 1]), 1, 0, false);
        assert!(p.acquire.is_empty(), "b's Leases are not expired yet");
        let leases = vec![held("a"), held("a"), expired("b"), expired("b")];
        let p = plan("a", &leases, &set(&[0, 1]), 1, 0, false);
        assert_eq!((p.renew.as_slice(), p.acquire.as_slice()), (&[0, 1][..], &[2, 3][..]));
    }

    #[test]
    fn shards_taken_by_someone_else_are_lost_at_once() {
        let leases = vec![held("a"), held("b"), None];
        let p = plan("a", &leases, &set(&[0, 1, 2]), 2, 0, false);
        assert_eq!(p.lost, [1, 2]);
        assert_eq!(p.renew, [0]);
        assert_eq!(p.acquire, [2], "a shard whose Lease is gone is free again");
    }

    #[test]
    fn leases_still_held_after_a_restart_are_renewed() {
        // Same identity, nothing owned in memory yet: the Leases are its own.
        let leases = vec![held("a"), held("a"), free()];
        let p = plan("a", &leases, &set(&[]), 1, 0, false);
        assert_eq!((p.renew.as_slice(), p.acquire.as_slice()), (&[0, 1][..], &[2][..]));
    }

    #[test]
    fn through_the_membership_only_shards_not_worked_on_are_written() {
        let leases = vec![held("a"), held("a"), held("a"), held("b")];
        // 0 and 1 worked on; 2 held from before a restart (or a fence): confirmed by a write.
        let p = plan("a", &leases, &set(&[0, 1]), 2, 0, true);
        assert_eq!((p.keep.as_slice(), p.renew.as_slice()), (&[0, 1][..], &[][..]), "fair share 2: {p:?}");
        assert_eq!(p.release, [2]);
        let p = plan("a", &leases, &set(&[0]), 1, 0, true);
        assert_eq!((p.keep.as_slice(), p.renew.as_slice()), (&[0][..], &[1, 2][..]));
        // With a replica of an earlier version about, every held shard is written.
        let p = plan("a", &leases, &set(&[0, 1]), 1, 0, false);
        assert_eq!((p.keep.as_slice(), p.renew.as_slice()), (&[][..], &[0, 1, 2][..]));
        // A shard lost is lost either way.
        let p = plan("a", &leases, &set(&[0, 3]), 1, 0, true);
        assert_eq!((p.lost.as_slice(), p.keep.as_slice()), (&[3][..], &[0][..]));
    }

    #[test]
    fn a_shard_lease_follows_its_holder_s_membership_when_it_says_so() {
        let member = |expired, renews_shards| Some(Member { expired, renews_shards });
        // Unchanged for ages by itself, but its holder's membership is renewed: alive.
        assert!(!shard_expired(true, member(false, true)));
        assert!(shard_expired(false, member(true, true)), "the holder's membership expired");
        // A holder of an earlier version, or without a membership Lease: the shard's own renewals.
        assert!(shard_expired(true, member(false, false)));
        assert!(!shard_expired(false, member(true, false)));
        assert!(shard_expired(true, None));
        assert!(!shard_expired(false, None));
    }

    #[test]
    fn the_offset_rotates_the_choice() {
        let leases = vec![free(), free(), free(), free()];
        assert_eq!(plan("a", &leases, &set(&[]), 2, 0, false).acquire, [0, 1]);
        assert_eq!(plan("b", &leases, &set(&[]), 2, 3, false).acquire, [3, 0]);
        assert_eq!(plan("b", &[], &set(&[]), 2, 3, false), Plan { fair: 0, ..Plan::default() });
    }

    #[test]
    fn expiry_by_observation_and_by_clock() {
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let d = Duration::from_secs(15);
        let lease = |holder: Option<&str>, renewed: SystemTime, version: &str| LeaseView {
            holder: holder.map(Into::into),
            endpoint: None,
            renewed: Some(renewed),
            duration: d,
            version: version.into(),
        };
        let mut t = Tracker::default();
        let l1 = lease(Some("a"), wall, "1");
        t.observe([("x", "1")], t0);
        assert!(!t.expired("x", &l1, t0, wall));
        assert!(t.expired("x", &lease(None, wall, "1"), t0, wall), "released");
        // Unchanged for a whole duration by this process's clock.
        t.observe([("x", "1")], t0 + Duration::from_secs(10));
        assert!(!t.expired("x", &l1, t0 + Duration::from_secs(10), wall));
        assert!(t.expired("x", &l1, t0 + d, wall));
        // A renewal restarts the observation.
        t.observe([("x", "2")], t0 + d);
        let l2 = lease(Some("a"), wall, "2");
        assert!(!t.expired("x", &l2, t0 + d, wall));
        // A Lease renewed long ago by the wall clock is expired when first seen; a little skew
        // is not enough.
        let mut fresh = Tracker::default();
        fresh.observe([("y", "7")], t0);
        let old = lease(Some("b"), wall - d * 3, "7");
        assert!(fresh.expired("y", &old, t0, wall));
        let skewed = lease(Some("b"), wall - d - Duration::from_secs(5), "7");
        assert!(!fresh.expired("y", &skewed, t0, wall));
        assert_eq!(fresh.expires_at("y", &old, t0 + Duration::from_secs(4)), Some(t0 + d));
        assert_eq!(fresh.expires_at("y", &lease(None, wall, "7"), t0), None);
        // Leases no longer listed are forgotten.
        fresh.observe([], t0);
        assert_eq!(fresh.unchanged_for("y", t0 + d), Duration::ZERO);
    }
}
