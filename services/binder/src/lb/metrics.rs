//! Metrics of the Service dataplane: how long an update takes to reach the kernel, transactions
//! by kind and result, whether the rules are in sync with kuryr-lbaas, and what the stream
//! delivered.

use std::time::Duration;

use kuryr_runtime::metrics::labels::{KindLabels, KindResultLabels};
use kuryr_runtime::metrics::latency_histogram;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

kuryr_runtime::label_set! {
    struct EventType { r#type }
}

kuryr_runtime::metric_set! {
    /// Service dataplane metrics; cheap to clone.
    pub struct LbMetrics {
        program: Family<KindLabels, Histogram, fn() -> Histogram> = Family::new_with_constructor(latency_histogram)
            => "kuryr_binder_lb_program_seconds",
            "From an update of kuryr-lbaas's stream arriving to its rules programmed in nftables";
        transactions: Family<KindResultLabels, Counter>
            => "kuryr_binder_lb_transactions",
            "nftables transactions of the Service dataplane by kind (delta, full) and result";
        events: Family<EventType, Counter> => "kuryr_binder_lb_events", "WatchLoadBalancers events received by type";
        invalid: Counter
            => "kuryr_binder_lb_invalid_specs", "Load balancer specs that could not be programmed (see the log for why)";
        stream_breaks: Counter
            => "kuryr_binder_lb_stream_breaks", "Times the WatchLoadBalancers stream could not be opened or broke";
        synced: Gauge
            => "kuryr_binder_lb_synced", "1 when the Service rules reflect kuryr-lbaas's complete, live view; 0 otherwise";
        services: Gauge => "kuryr_binder_lb_services", "Services programmed";
    }
}

impl LbMetrics {
    pub fn transaction(&self, kind: &'static str, ok: bool, since_update: Option<Duration>) {
        let result = if ok { "ok" } else { "error" };
        self.transactions.get_or_create(&KindResultLabels { kind, result }).inc();
        if let (true, Some(d)) = (ok, since_update) {
            self.program.get_or_create(&KindLabels { kind }).observe(d.as_secs_f64());
        }
    }

    pub fn event(&self, t: &'static str) {
        self.events.get_or_create(&EventType { r#type: t }).inc();
    }

    pub fn invalid_spec(&self) {
        self.invalid.inc();
    }

    pub fn stream_break(&self) {
        self.stream_breaks.inc();
    }

    pub fn set_synced(&self, synced: bool) {
        self.synced.set(i64::from(synced));
    }

    pub fn set_services(&self, n: usize) {
        self.services.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}
