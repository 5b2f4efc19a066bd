//! The shard set's Prometheus metrics, registered on the service's registry.

use kuryr_runtime::metrics::labels::ReasonLabels;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

kuryr_runtime::metric_set! {
    /// The metrics; cheap to clone.
    pub struct ShardMetrics {
        /// Shards owned now.
        pub owned: Gauge => "kuryr_shards_owned", "Shards this replica owns";
        /// Live replicas seen in the last round (this one included).
        pub members: Gauge => "kuryr_shard_members", "Live replicas seen in the last round";
        /// Shards taken.
        pub acquisitions: Counter => "kuryr_shard_acquisitions", "Shards taken";
        /// Shards released voluntarily (above the fair share, or at shutdown).
        pub releases: Counter => "kuryr_shard_releases", "Shards released voluntarily";
        /// Shards lost, by reason: `taken` (another replica holds its Lease), `conflict` (a
        /// renewal lost a race), `expired` (not renewed in time: fenced by the clock), `gone` (the
        /// Lease was deleted).
        pub losses: Family<ReasonLabels, Counter> => "kuryr_shard_losses", "Shards lost, by reason";
        /// Duration of the renewals of one round: the membership, then the shard Leases written
        /// in it (taken, confirmed), concurrently.
        pub renew_latency: Histogram = kuryr_runtime::metrics::latency_histogram()
            => "kuryr_shard_renew_seconds", "Time to renew the membership and write the shard Leases of one round";
        /// The Lease lists of the rounds: the others read the set's Leases from a watch.
        pub lease_lists: Counter
            => "kuryr_shard_lease_lists", "Rounds that listed the Leases instead of reading them from the watch";
        /// Rounds that failed (the Lease list or the membership renewal).
        pub round_failures: Counter
            => "kuryr_shard_round_failures", "Rounds that could not list the Leases or renew the membership";
    }
}

impl ShardMetrics {
    /// Counts a loss.
    pub fn lost(&self, reason: &'static str) {
        self.losses.get_or_create(&ReasonLabels { reason }).inc();
    }
}
