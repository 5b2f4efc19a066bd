//! The one backoff every retry in kuryr uses: exponential ceilings (from `backon`'s
//! [`ExponentialBuilder`]), full jitter on top, and a count of every retry by component and
//! reason in `kuryr_retries_total{component,reason}`.
//!
//! Full jitter (a delay drawn uniformly from `[0, ceiling]`) is what keeps a hundred binders from
//! reconnecting in lockstep after an allocator or lbaas restart: with a fixed schedule they all
//! fail at the same instant and all come back at the same instants, so every retry is a
//! thundering herd. Where a fixed part is wanted on purpose (a loser of a compare-and-swap race
//! must not re-read before the winner wrote), [`Jitter::Equal`] keeps half the ceiling fixed.
//!
//! Two shapes:
//! - [`Backoff`]: a retry loop's state. [`Backoff::next_delay`] (or [`Backoff::sleep`]) after a
//!   failure, [`Backoff::reset`] after a success.
//! - [`delay`]: stateless, for callers that keep the failure count themselves (per key).
//!
//! The counter family is process-wide ([`retries`]); `kuryr_runtime` registers it in every
//! service's registry, so every retry anywhere in the process shows up on `/metrics`.

use std::sync::LazyLock;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// The name the retry counter is registered under (the exposition adds `_total`).
pub const METRIC: &str = "kuryr_retries";
/// Its help text.
pub const METRIC_HELP: &str = "Retries after a failure, by component and reason (each after a jittered backoff)";

/// Labels of a retry.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    /// What retried ("binder-cni", "the VIF stream", "openstack", ...).
    pub component: String,
    /// Why, as a small fixed set per component ("connect", "broke", "conflict", ...).
    pub reason: String,
}

static RETRIES: LazyLock<Family<RetryLabels, Counter>> = LazyLock::new(Family::default);

/// The process-wide retry counters (clone it into a registry: clones share the counts).
pub fn retries() -> &'static Family<RetryLabels, Counter> {
    &RETRIES
}

/// Counts one retry.
pub fn count(component: &str, reason: &str) {
    RETRIES.get_or_create(&RetryLabels { component: component.to_string(), reason: reason.to_string() }).inc();
}

/// The retries counted so far for `component` and `reason`.
pub fn counted(component: &str, reason: &str) -> u64 {
    RETRIES.get_or_create(&RetryLabels { component: component.to_string(), reason: reason.to_string() }).get()
}

/// How the delay is drawn under the ceiling.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Jitter {
    /// Uniform in `[0, ceiling]`: the best spread; the default.
    #[default]
    Full,
    /// Half the ceiling fixed, the other half uniform: `[ceiling/2, ceiling]`.
    Equal,
}

impl Jitter {
    /// The delay under `ceiling` for `unit`, a number in `[0, 1]`.
    pub fn apply(self, ceiling: Duration, unit: f64) -> Duration {
        let unit = unit.clamp(0.0, 1.0);
        match self {
            Self::Full => ceiling.mul_f64(unit),
            Self::Equal => ceiling / 2 + (ceiling / 2).mul_f64(unit),
        }
    }
}

fn schedule(min: Duration, max: Duration, factor: f32) -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(min)
        .with_max_delay(max.max(min))
        .with_factor(factor.max(1.0))
        .without_max_times()
        .build()
}

/// The ceiling before retry number `failures` (1-based; 0 counts as 1): `min * 2^(failures-1)`,
/// capped at `max`.
pub fn ceiling(failures: u32, min: Duration, max: Duration) -> Duration {
    // The schedule reaches the cap after a few dozen steps at most; no need to walk further.
    let steps = failures.clamp(1, 64);
    schedule(min, max, 2.0).nth(steps as usize - 1).unwrap_or(max).min(max.max(min))
}

/// A delay for retry number `failures` of `component` (full jitter under [`ceiling`]), counted in
/// `kuryr_retries_total` under `reason`.
pub fn delay(component: &str, reason: &str, failures: u32, min: Duration, max: Duration) -> Duration {
    count(component, reason);
    Jitter::Full.apply(ceiling(failures, min, max), fastrand::f64())
}

/// A retry loop's backoff: see the module documentation.
#[derive(Debug)]
pub struct Backoff {
    component: &'static str,
    min: Duration,
    max: Duration,
    factor: f32,
    jitter: Jitter,
    schedule: ExponentialBackoff,
    rng: fastrand::Rng,
    failures: u32,
    last_ceiling: Duration,
}

impl Backoff {
    /// A backoff for `component` whose ceiling starts at `min` and doubles up to `max`.
    pub fn new(component: &'static str, min: Duration, max: Duration) -> Self {
        Self {
            component,
            min,
            max,
            factor: 2.0,
            jitter: Jitter::Full,
            schedule: schedule(min, max, 2.0),
            rng: fastrand::Rng::new(),
            failures: 0,
            last_ceiling: Duration::ZERO,
        }
    }

    /// Grows the ceiling by `factor` instead of 2.
    #[must_use]
    pub fn with_factor(mut self, factor: f32) -> Self {
        self.factor = factor;
        self.schedule = schedule(self.min, self.max, factor);
        self
    }

    /// Draws with `jitter` instead of [`Jitter::Full`].
    #[must_use]
    pub fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// Draws from a seeded generator (tests).
    #[must_use]
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.rng = fastrand::Rng::with_seed(seed);
        self
    }

    /// The component the retries are counted under.
    pub fn component(&self) -> &'static str {
        self.component
    }

    /// Failures since the last [`reset`](Self::reset).
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The ceiling the last delay was drawn under (zero before the first failure).
    pub fn last_ceiling(&self) -> Duration {
        self.last_ceiling
    }

    /// Records a failure and returns the delay before the next attempt; counts the retry under
    /// `reason`.
    pub fn next_delay(&mut self, reason: &str) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let ceiling = self.schedule.next().unwrap_or(self.max).min(self.max.max(self.min));
        self.last_ceiling = ceiling;
        count(self.component, reason);
        self.jitter.apply(ceiling, self.rng.f64())
    }

    /// Records a failure and sleeps the delay.
    pub async fn sleep(&mut self, reason: &str) {
        let d = self.next_delay(reason);
        tokio::time::sleep(d).await;
    }

    /// After a success: the next failure starts from the minimum again.
    pub fn reset(&mut self) {
        self.failures = 0;
        self.last_ceiling = Duration::ZERO;
        self.schedule = schedule(self.min, self.max, self.factor);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(5);

    #[test]
    fn ceilings_double_from_the_minimum_up_to_the_cap() {
        // (backon multiplies in f32: compare to the millisecond.)
        let got: Vec<_> = (1..=8).map(|n| ceiling(n, MIN, MAX).as_millis()).collect();
        assert_eq!(got, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(ceiling(0, MIN, MAX), MIN, "0 counts as the first retry");
        assert_eq!(ceiling(u32::MAX, MIN, MAX), MAX);
        assert_eq!(ceiling(3, MAX, MIN), MAX, "a cap below the minimum is the minimum");
    }

    #[test]
    fn delays_stay_within_zero_and_the_ceiling() {
        let mut b = Backoff::new("test-bounds", MIN, MAX).with_seed(7);
        for n in 1..=40u32 {
            let d = b.next_delay("fail");
            let c = ceiling(n, MIN, MAX);
            assert_eq!(b.last_ceiling(), c, "retry {n}: the loop and the stateless form agree");
            assert!(d <= c, "retry {n}: {d:?} above the ceiling {c:?}");
        }
        assert_eq!(b.failures(), 40);
        let mut e = Backoff::new("test-bounds", MIN, MAX).with_jitter(Jitter::Equal).with_seed(7);
        for n in 1..=10u32 {
            let d = e.next_delay("fail");
            let c = ceiling(n, MIN, MAX);
            assert!(d >= c / 2 && d <= c, "equal jitter, retry {n}: {d:?} vs {c:?}");
        }
    }

    #[test]
    fn jitter_spreads_retries_over_the_whole_window() {
        // A thousand clients failing at the same instant: their first retries must not bunch
        // (a herd), so every tenth of the window gets some, and none gets most.
        let mut tenths = [0u32; 10];
        for seed in 0..1000u64 {
            let mut b = Backoff::new("test-spread", MAX, MAX).with_seed(seed);
            let d = b.next_delay("restart");
            let i = ((d.as_secs_f64() / MAX.as_secs_f64()) * 10.0).floor() as usize;
            tenths[i.min(9)] += 1;
        }
        for (i, n) in tenths.iter().enumerate() {
            assert!((50..=150).contains(n), "tenth {i} got {n} of 1000 retries: {tenths:?}");
        }
        // Two identical loops do not retry at the same instants.
        let mut a = Backoff::new("test-spread", MIN, MAX).with_seed(1);
        let mut b = Backoff::new("test-spread", MIN, MAX).with_seed(2);
        let same = (0..10).filter(|_| a.next_delay("x") == b.next_delay("x")).count();
        assert!(same < 2, "{same} of 10 retries at the same instant");
    }

    #[test]
    fn a_success_starts_the_ceiling_over() {
        let mut b = Backoff::new("test-reset", MIN, MAX).with_factor(1.5);
        for _ in 0..6 {
            b.next_delay("down");
        }
        let grown = b.last_ceiling().as_secs_f64();
        assert!((grown - 0.1 * 1.5f64.powi(5)).abs() < 1e-3, "{grown}");
        b.reset();
        assert_eq!((b.failures(), b.last_ceiling()), (0, Duration::ZERO));
        assert!(b.next_delay("down") <= MIN);
        assert_eq!(b.last_ceiling(), MIN);
    }

    #[test]
    fn every_retry_is_counted_by_component_and_reason() {
        let before = counted("test-count", "refused");
        let mut b = Backoff::new("test-count", MIN, MAX);
        b.next_delay("refused");
        b.next_delay("refused");
        let _ = delay("test-count", "refused", 3, MIN, MAX);
        assert_eq!(counted("test-count", "refused") - before, 3);
        assert_eq!(counted("test-count", "other"), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn sleep_waits_the_drawn_delay() {
        let mut b =
            Backoff::new("test-sleep", Duration::from_secs(1), Duration::from_secs(1)).with_jitter(Jitter::Equal);
        let t = tokio::time::Instant::now();
        b.sleep("x").await;
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(500) && waited <= Duration::from_millis(1001), "{waited:?}");
    }
}
