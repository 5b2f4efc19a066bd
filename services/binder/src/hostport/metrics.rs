//! Metrics of host ports: the map elements programmed, and the transactions that programmed them
//! by kind and result.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindResult {
    /// "delta" (one attachment's change) or "full" (the host port part rebuilt).
    kind: String,
    /// "ok" or "error".
    result: String,
}

/// Host port metrics; cheap to clone.
#[derive(Clone, Debug)]
pub struct HostPortMetrics {
    transactions: Family<KindResult, Counter>,
    programmed: Gauge,
}

impl HostPortMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self { transactions: Family::default(), programmed: Gauge::default() };
        registry.register(
            "kuryr_binder_hostport_transactions",
            "nftables transactions of host ports by kind (delta, full) and result",
            m.transactions.clone(),
        );
        registry.register(
            "kuryr_binder_hostports",
            "Host port map elements programmed (one per mapping and pod address family)",
            m.programmed.clone(),
        );
        m
    }

    pub fn transaction(&self, kind: &str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.transactions.get_or_create(&KindResult { kind: kind.into(), result: result.into() }).inc();
    }

    pub fn set_programmed(&self, n: usize) {
        self.programmed.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}
