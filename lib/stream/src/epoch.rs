//! Resume points: `"<epoch>-<revision>"`.
//!
//! Events sent before SNAPSHOT_COMPLETE (the RESET and the snapshot's items) carry
//! `"<epoch>-snapshot"`, a point that is never resumable: a subscriber cut off in the middle of
//! a snapshot cannot continue from there (the rest of the snapshot would be lost), and passing
//! that point back gets it RESET and a fresh snapshot, which tells it to drop its partial state.

use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::time::SystemTime;

/// The revision-less suffix of the points carried by snapshot events.
const SNAPSHOT: &str = "snapshot";

/// This process's identity in resume points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Epoch(String);

impl Epoch {
    /// A fresh random epoch: 64 bits from std's per-process random hash keys, mixed with the
    /// clock and pid, as 16 hex digits (no `-`, so a point splits unambiguously).
    pub fn random() -> Self {
        let bits = RandomState::new().hash_one((SystemTime::now(), std::process::id()));
        Self(format!("{bits:016x}"))
    }

    /// A fixed epoch, for tests. `-` is not allowed in an epoch and is dropped.
    pub fn fixed(s: &str) -> Self {
        Self(s.replace('-', ""))
    }

    /// The point after the delta of `revision` (or of a snapshot taken at `revision`).
    pub fn point(&self, revision: u64) -> String {
        format!("{}-{revision}", self.0)
    }

    /// The point carried by events inside a snapshot; never resumable.
    pub fn snapshot_point(&self) -> String {
        format!("{}-{SNAPSHOT}", self.0)
    }

    /// The revision `point` names, when it is this epoch's and well-formed.
    pub fn revision_of(&self, point: &str) -> Option<u64> {
        let (epoch, rev) = point.rsplit_once('-')?;
        if epoch != self.0 {
            return None;
        }
        rev.parse().ok()
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_round_trip_only_within_their_epoch() {
        let e = Epoch::fixed("a-bc");
        assert_eq!(e.point(7), "abc-7");
        assert_eq!(e.revision_of("abc-7"), Some(7));
        assert_eq!(e.revision_of("abc-0"), Some(0));
        for bad in ["abd-7", "abc-snapshot", "abc-", "abc--1", "garbage", ""] {
            assert_eq!(e.revision_of(bad), None, "{bad}");
        }
        assert_eq!(e.revision_of(&e.snapshot_point()), None);
    }

    #[test]
    fn random_epochs_differ_and_have_no_dash() {
        let (a, b) = (Epoch::random(), Epoch::random());
        assert_ne!(a, b);
        assert_eq!(a.to_string().len(), 16);
        assert!(!a.to_string().contains('-'));
        assert_eq!(a.revision_of(&b.point(1)), None);
    }
}
