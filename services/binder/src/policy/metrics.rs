//! Metrics of the NetworkPolicy dataplane: how long a change of kuryr-policy's stream takes to
//! reach the kernel, transactions by kind and result, elements programmed, and whether the rules
//! are in sync.

use std::time::Duration;

use kuryr_runtime::metrics::labels::KindResultLabels;
use kuryr_runtime::metrics::latency_histogram;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

kuryr_runtime::metric_set! {
    /// NetworkPolicy dataplane metrics; cheap to clone.
    pub struct PolicyMetrics {
        program: Histogram = latency_histogram()
            => "kuryr_binder_policy_program_seconds",
            "From a change of kuryr-policy's stream arriving to its rules programmed in nftables";
        transactions: Family<KindResultLabels, Counter>
            => "kuryr_binder_policy_transactions",
            "nftables transactions of the NetworkPolicy dataplane by kind (delta, replace) and result";
        stream_breaks: Counter
            => "kuryr_binder_policy_stream_breaks", "Times the WatchPolicies stream could not be opened or broke";
        invalid: Counter
            => "kuryr_binder_policy_invalid",
            "Parts of kuryr-policy's stream that could not be programmed (see the log for why)";
        synced: Gauge
            => "kuryr_binder_policy_synced",
            "1 when the NetworkPolicy rules reflect kuryr-policy's complete view; 0 otherwise";
        elements: Gauge => "kuryr_binder_policy_elements", "Set and map elements programmed";
        groups: Gauge => "kuryr_binder_policy_groups", "Groups of peers programmed (a chain each)";
        rules: Gauge
            => "kuryr_binder_policy_rules",
            "Rules of the groups' chains programmed (a fixed number per group: the per-packet cost does not grow with peers)";
    }
}

impl PolicyMetrics {
    pub fn transaction(&self, kind: &'static str, ok: bool, since_change: Option<Duration>) {
        let result = if ok { "ok" } else { "error" };
        self.transactions.get_or_create(&KindResultLabels { kind, result }).inc();
        if let (true, Some(d)) = (ok, since_change) {
            self.program.observe(d.as_secs_f64());
        }
    }

    pub fn stream_break(&self) {
        self.stream_breaks.inc();
    }

    pub fn invalid(&self, n: usize) {
        self.invalid.inc_by(n as u64);
    }

    pub fn set_synced(&self, synced: bool) {
        self.synced.set(i64::from(synced));
    }

    pub fn set_programmed(&self, elements: usize, groups: usize, rules: usize) {
        self.elements.set(i64::try_from(elements).unwrap_or(i64::MAX));
        self.groups.set(i64::try_from(groups).unwrap_or(i64::MAX));
        self.rules.set(i64::try_from(rules).unwrap_or(i64::MAX));
    }
}
