//! When to poll a load balancer for ACTIVE after a change.
//!
//! Octavia's time for one kind and size of change on one deployment is fairly steady (a member
//! update on a busy worker: 0.5–1.5 s), so polling on a blind growing interval either hammers the
//! API or sees ACTIVE late: with 50 ms growing by a quarter, the poll that finds ACTIVE comes up to
//! a quarter of the wait after Octavia finished. The [`Pacer`] remembers the last few settle times
//! of each kind and size of change (Octavia's work grows with the members added and removed, so a
//! one-member change and a twenty-member one are learnt apart) and lets the first poll wait until
//! just before the quickest of them; from there polls are close together ([`NEAR`], growing
//! slowly), so ACTIVE is seen within tens of milliseconds with about as many calls as before.
//! Without history (the first changes, or waiting for someone else's change) it falls back to the
//! blind schedule.
//!
//! When the first poll already finds ACTIVE, the real settle time is unknown (only that it was
//! shorter); a quarter less is remembered, so an overestimate is unlearnt within a few changes.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

/// The first poll without history.
pub const FIRST: Duration = Duration::from_millis(50);
/// The gap between polls once the expected settle time is near.
pub const NEAR: Duration = Duration::from_millis(20);
/// The longest gap between two polls.
pub const MAX: Duration = Duration::from_millis(500);
/// Settle times remembered per kind and size class of change.
const HISTORY: usize = 16;

/// Settle times of recent changes, per kind and size class; shared by all reconciles.
#[derive(Debug, Default)]
pub struct Pacer {
    recent: Mutex<HashMap<(&'static str, u32), VecDeque<Duration>>>,
}

/// Changes of sizes within a factor of two share their history: 0, 1–2, 3–6, 7–14, ...
fn size_class(size: usize) -> u32 {
    (size + 1).ilog2()
}

impl Pacer {
    /// The polls for a change of `kind` touching `size` objects (members added and removed)
    /// (empty kind: not a change of ours, e.g. waiting out a pending state found on adoption —
    /// polled at once).
    pub fn schedule(&self, kind: &'static str, size: usize) -> Schedule {
        if kind.is_empty() {
            return Schedule { first: Duration::ZERO, gap: FIRST, growth: Growth::Quarter };
        }
        let quickest = self.lock().get(&(kind, size_class(size))).and_then(|v| v.iter().min().copied());
        match quickest {
            // Just before the quickest recent one, then close polls.
            Some(q) => Schedule { first: q.mul_f64(0.9).saturating_sub(NEAR), gap: NEAR, growth: Growth::Eighth },
            None => Schedule { first: FIRST, gap: FIRST, growth: Growth::Quarter },
        }
    }

    /// A change of `kind` and `size` was seen settled `took` after it was made, by the first
    /// poll of its schedule or a later one.
    pub fn observe(&self, kind: &'static str, size: usize, took: Duration, first_poll: bool) {
        if kind.is_empty() {
            return;
        }
        let took = if first_poll { took - took / 4 } else { took };
        let mut recent = self.lock();
        let v = recent.entry((kind, size_class(size))).or_default();
        if v.len() == HISTORY {
            v.pop_front();
        }
        v.push_back(took);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(&'static str, u32), VecDeque<Duration>>> {
        self.recent.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Growth {
    /// ×1.25 per poll: the blind schedule.
    Quarter,
    /// ×1.125 per poll: near the expected time.
    Eighth,
}

/// The waits between the polls of one change.
#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    first: Duration,
    gap: Duration,
    growth: Growth,
}

impl Schedule {
    /// How long to wait before the first poll.
    pub fn first(&self) -> Duration {
        self.first
    }

    /// How long to wait before the next poll, after one that found the load balancer pending.
    pub fn next_gap(&mut self) -> Duration {
        let gap = self.gap;
        let grown = match self.growth {
            Growth::Quarter => self.gap + self.gap / 4,
            Growth::Eighth => self.gap + self.gap / 8,
        };
        self.gap = grown.min(MAX);
        gap
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// Poll times (from the change) until one at or after `settled`.
    fn polls(mut s: Schedule, settled: Duration) -> Vec<Duration> {
        let mut at = s.first();
        let mut out = vec![at];
        while at < settled {
            at += s.next_gap();
            out.push(at);
        }
        out
    }

    #[test]
    fn without_history_polls_blindly_from_the_first_gap() {
        let p = Pacer::default();
        let mut s = p.schedule("members", 10);
        assert_eq!(s.first(), FIRST);
        assert_eq!(s.next_gap(), ms(50));
        assert_eq!(s.next_gap(), ms(62) + Duration::from_micros(500));
        // Someone else's change: the first poll at once.
        assert_eq!(p.schedule("", 0).first(), Duration::ZERO);
    }

    #[test]
    fn gaps_never_exceed_the_maximum() {
        let mut s = Pacer::default().schedule("members", 10);
        let gaps: Vec<_> = (0..40).map(|_| s.next_gap()).collect();
        assert_eq!(*gaps.last().unwrap(), MAX);
        assert!(gaps.iter().all(|g| *g <= MAX));
    }

    #[test]
    fn with_history_the_first_poll_waits_until_just_before_the_quickest() {
        let p = Pacer::default();
        for took in [900, 700, 1200] {
            p.observe("members", 10, ms(took), false);
        }
        let s = p.schedule("members", 10);
        assert_eq!(s.first(), ms(610)); // 0.9 × 700 − 20
        // Kinds are separate; the empty kind is never learnt.
        assert_eq!(p.schedule("listener", 10).first(), FIRST);
        p.observe("", 10, ms(10), false);
        assert_eq!(p.schedule("", 0).first(), Duration::ZERO);
    }

    #[test]
    fn learnt_schedule_sees_active_sooner_than_the_blind_one_with_few_more_polls() {
        let p = Pacer::default();
        for took in [780, 820, 760, 900, 1000] {
            p.observe("members", 10, ms(took), false);
        }
        // Averaged over settle times around the learnt ones (a single one can be lucky either way).
        let (mut lag, mut n) = ([Duration::ZERO; 2], [0usize; 2]);
        let settles: Vec<u64> = (760..=1300).step_by(10).collect();
        for &settled in &settles {
            let runs = [
                polls(Pacer::default().schedule("members", 10), ms(settled)),
                polls(p.schedule("members", 10), ms(settled)),
            ];
            for (i, v) in runs.iter().enumerate() {
                lag[i] += *v.last().unwrap() - ms(settled);
                n[i] += v.len();
            }
        }
        let k = settles.len() as u32;
        let (blind_lag, learnt_lag) = (lag[0] / k, lag[1] / k);
        assert!(learnt_lag <= ms(40), "learnt: ACTIVE seen {learnt_lag:?} late on average");
        assert!(learnt_lag * 3 <= blind_lag, "learnt {learnt_lag:?} vs blind {blind_lag:?}");
        assert!(n[1] <= n[0] + 3 * settles.len(), "learnt {} polls vs blind {}", n[1], n[0]);
    }

    #[test]
    fn sizes_within_a_factor_of_two_share_their_history() {
        let p = Pacer::default();
        p.observe("members", 1, ms(300), false);
        p.observe("members", 20, ms(1500), false);
        assert_eq!(p.schedule("members", 2).first(), ms(250)); // 0.9 × 300 − 20
        assert_eq!(p.schedule("members", 16).first(), ms(1330)); // 0.9 × 1500 − 20
        assert_eq!(p.schedule("members", 8).first(), FIRST); // 7–14: nothing learnt yet
        assert_eq!((size_class(0), size_class(2), size_class(3), size_class(6), size_class(7)), (0, 1, 2, 2, 3));
    }

    #[test]
    fn an_active_first_poll_pulls_the_schedule_earlier() {
        let p = Pacer::default();
        p.observe("members", 10, ms(800), false);
        // Octavia got quicker: the first poll (at 700 ms) already finds ACTIVE.
        let first = p.schedule("members", 10).first();
        p.observe("members", 10, first, true);
        let next = p.schedule("members", 10).first();
        assert!(next < first * 3 / 4, "{next:?} vs {first:?}");
    }

    #[test]
    fn only_the_recent_history_counts() {
        let p = Pacer::default();
        p.observe("members", 10, ms(100), false);
        for _ in 0..HISTORY {
            p.observe("members", 10, ms(1000), false);
        }
        assert_eq!(p.schedule("members", 10).first(), ms(880));
    }
}
