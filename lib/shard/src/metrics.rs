//! The shard set's Prometheus metrics, registered on the service's registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Why a shard was lost.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LossLabels {
    /// `taken` (another replica holds its Lease), `conflict` (a renewal lost a race),
    /// `expired` (not renewed in time: fenced by the clock), `gone` (the Lease was deleted).
    pub reason: &'static str,
}

/// The metrics; cheap to clone.
#[derive(Clone, Debug)]
pub struct ShardMetrics {
    /// Shards owned now.
    pub owned: Gauge,
    /// Live replicas seen in the last round (this one included).
    pub members: Gauge,
    /// Shards taken.
    pub acquisitions: Counter,
    /// Shards released voluntarily (above the fair share, or at shutdown).
    pub releases: Counter,
    /// Shards lost, by reason.
    pub losses: Family<LossLabels, Counter>,
    /// Duration of the renewals of one round (all owned Leases, concurrently).
    pub renew_latency: Histogram,
    /// Rounds that failed (the Lease list or the membership renewal).
    pub round_failures: Counter,
}

impl Default for ShardMetrics {
    fn default() -> Self {
        Self {
            owned: Gauge::default(),
            members: Gauge::default(),
            acquisitions: Counter::default(),
            releases: Counter::default(),
            losses: Family::default(),
            renew_latency: kuryr_runtime::metrics::latency_histogram(),
            round_failures: Counter::default(),
        }
    }
}

impl ShardMetrics {
    /// Creates the metrics and registers them.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register("kuryr_shards_owned", "Shards this replica owns", m.owned.clone());
        registry.register("kuryr_shard_members", "Live replicas seen in the last round", m.members.clone());
        registry.register("kuryr_shard_acquisitions", "Shards taken", m.acquisitions.clone());
        registry.register("kuryr_shard_releases", "Shards released voluntarily", m.releases.clone());
        registry.register("kuryr_shard_losses", "Shards lost, by reason", m.losses.clone());
        registry.register(
            "kuryr_shard_renew_seconds",
            "Time to renew the owned shard Leases in one round",
            m.renew_latency.clone(),
        );
        registry.register(
            "kuryr_shard_round_failures",
            "Rounds that could not list the Leases or renew the membership",
            m.round_failures.clone(),
        );
        m
    }

    /// Counts a loss.
    pub fn lost(&self, reason: &'static str) {
        self.losses.get_or_create(&LossLabels { reason }).inc();
    }
}
