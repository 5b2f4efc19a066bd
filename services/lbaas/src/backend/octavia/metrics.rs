//! The Octavia backend's metrics, next to the OpenStack client's per-request ones
//! (`openstack_requests_total{service="load-balancer",operation=...}` counts every attempt).
//!
//! They separate Octavia's own processing from lbaas' share: `..._active_seconds` is a change
//! accepted → ACTIVE observed (Octavia's work plus at most one poll interval, which
//! `..._poll_lag_seconds` bounds), and `..._overhead_seconds` is the rest of a reconcile (lbaas
//! and the API calls themselves).

use std::time::Duration;

pub use kuryr_runtime::metrics::labels::KindLabels;
use kuryr_runtime::metrics::latency_histogram;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

/// What one reconcile cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Octavia API calls (changes, reads and polls).
    pub calls: u32,
    /// Changes among them (each followed by a wait for ACTIVE).
    pub changes: u32,
    /// Time spent waiting for Octavia to finish changes.
    pub waited: Duration,
}

kuryr_runtime::label_set! {
    /// How a reconcile ended.
    pub struct OutcomeLabels {
        /// `changed`, `unchanged` or `failed`.
        outcome,
    }
}

fn calls_histogram() -> Histogram {
    Histogram::new([1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0, 128.0])
}

kuryr_runtime::metric_set! {
    /// The metrics; cheap to clone.
    pub struct OctaviaMetrics {
        /// Changes made, by kind.
        pub changes: Family<KindLabels, Counter> => "kuryr_lbaas_octavia_changes", "Octavia changes made, by kind";
        /// Change accepted → ACTIVE observed, by kind.
        pub active: Family<KindLabels, Histogram, fn() -> Histogram> = Family::new_with_constructor(latency_histogram)
            => "kuryr_lbaas_octavia_active_seconds", "Octavia change accepted to load balancer ACTIVE observed, by kind";
        /// How late ACTIVE may have been seen: the time since the last poll that was still pending.
        pub poll_lag: Histogram = latency_histogram()
            => "kuryr_lbaas_octavia_poll_lag_seconds",
            "Upper bound on how late ACTIVE was observed (time since the last pending poll)";
        /// Octavia API calls per reconcile, by outcome.
        pub calls: Family<OutcomeLabels, Histogram, fn() -> Histogram> = Family::new_with_constructor(calls_histogram)
            => "kuryr_lbaas_octavia_calls_per_reconcile",
            "Octavia API calls per reconcile (changes, reads, polls), by outcome";
        /// Reconcile time not spent waiting for Octavia, for reconciles that changed something.
        pub overhead: Histogram = latency_histogram()
            => "kuryr_lbaas_octavia_overhead_seconds",
            "Time of a changing reconcile not spent waiting for Octavia to finish its changes";
        /// Drift-repair passes made.
        pub drift_passes: Counter => "kuryr_lbaas_octavia_drift_passes", "Drift-repair passes";
        /// Load balancers of this cluster deleted because their Service was gone.
        pub orphans_deleted: Counter
            => "kuryr_lbaas_octavia_orphans_deleted",
            "Load balancers of this cluster deleted because their Service was gone";
        /// Maintenance steps that failed (retried at the next pass).
        pub maintenance_failures: Counter
            => "kuryr_lbaas_octavia_maintenance_failures", "Maintenance steps (listing, orphan deletion) that failed";
    }
}

impl OctaviaMetrics {
    /// Counts a change of `kind`.
    pub fn changed(&self, kind: &'static str) {
        self.changes.get_or_create(&KindLabels { kind }).inc();
    }

    /// A change of `kind` settled after `took`, seen at most `lag` late.
    pub fn settled(&self, kind: &'static str, took: Duration, lag: Duration) {
        self.active.get_or_create(&KindLabels { kind }).observe(took.as_secs_f64());
        self.poll_lag.observe(lag.as_secs_f64());
    }

    /// A reconcile ended after `total`.
    pub fn reconciled(&self, t: &Tally, total: Duration, ok: bool) {
        let outcome = match (ok, t.changes) {
            (false, _) => "failed",
            (true, 0) => "unchanged",
            (true, _) => "changed",
        };
        self.calls.get_or_create(&OutcomeLabels { outcome }).observe(f64::from(t.calls));
        if ok && t.changes > 0 {
            self.overhead.observe(total.saturating_sub(t.waited).as_secs_f64());
        }
    }

    /// Counts a failed maintenance step.
    pub fn maintenance_failed(&self) {
        self.maintenance_failures.inc();
    }
}
