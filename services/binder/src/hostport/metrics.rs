//! Metrics of host ports: the map elements programmed, and the transactions that programmed them
//! by kind and result.

use kuryr_runtime::metrics::labels::KindResultLabels;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

kuryr_runtime::metric_set! {
    /// Host port metrics; cheap to clone.
    pub struct HostPortMetrics {
        transactions: Family<KindResultLabels, Counter>
            => "kuryr_binder_hostport_transactions", "nftables transactions of host ports by kind (delta, full) and result";
        programmed: Gauge
            => "kuryr_binder_hostports", "Host port map elements programmed (one per mapping and pod address family)";
    }
}

impl HostPortMetrics {
    pub fn transaction(&self, kind: &'static str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.transactions.get_or_create(&KindResultLabels { kind, result }).inc();
    }

    pub fn set_programmed(&self, n: usize) {
        self.programmed.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}
