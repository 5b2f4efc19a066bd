//! Summaries of measured samples for the benches: count, mean, percentiles and maximum; and the
//! millisecond conversions they are reported in.

use std::time::{Duration, Instant};

/// `d` in milliseconds.
#[must_use]
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `b - a` in milliseconds, negative when `b` is earlier.
#[must_use]
pub fn ms_between(a: Instant, b: Instant) -> f64 {
    match b.checked_duration_since(a) {
        Some(d) => ms(d),
        None => -ms(a.duration_since(b)),
    }
}

/// Summary of a sample (in whatever unit the values are; the benches use milliseconds).
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    /// Finite values summarised.
    pub n: usize,
    /// Their mean.
    pub mean: f64,
    /// Nearest-rank percentiles.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// The largest value.
    pub max: f64,
}

impl Stats {
    /// Summarises `values`, ignoring non-finite ones (NaN marks a missing measurement); `None`
    /// when nothing is left.
    #[must_use]
    pub fn of(values: &[f64]) -> Option<Stats> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let pct = |p: f64| v[(((v.len() - 1) as f64) * p).round() as usize];
        Some(Stats {
            n: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: pct(0.50),
            p90: pct(0.90),
            p99: pct(0.99),
            max: v[v.len() - 1],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Stats;

    #[test]
    fn percentiles_skip_missing_values() {
        let v: Vec<f64> = (1..=100).map(f64::from).chain([f64::NAN]).collect();
        let s = Stats::of(&v).unwrap_or_else(|| panic!("a summary"));
        assert_eq!((s.n, s.p50, s.p90, s.p99, s.max), (100, 51.0, 90.0, 99.0, 100.0));
        assert!((s.mean - 50.5).abs() < 1e-9);
        assert!(Stats::of(&[f64::NAN]).is_none());
    }
}
