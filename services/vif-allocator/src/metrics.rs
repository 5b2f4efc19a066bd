//! The allocator's own Prometheus metrics, registered on the runtime's registry next to the gRPC
//! call metrics, and the embedded IPAM's ([`IpamMetrics`]: its Kubernetes API calls and the
//! addresses per node). The Neutron backend registers its own beside them.

use kuryr_runtime::metrics::latency_histogram;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::backend::ipam::IpamMetrics;
pub use kuryr_runtime::metrics::labels::{FailureLabels, StartLabels};

kuryr_runtime::metric_set! {
    /// The metrics; cheap to clone (each is a handle to shared state).
    pub struct Metrics {
        /// VIFs handed out (recorded and published for a pod that had none).
        pub allocations: Counter => "kuryr_allocator_allocations", "VIFs handed out";
        /// Pods whose addresses were released.
        pub releases: Counter => "kuryr_allocator_releases", "Pods whose addresses were released";
        /// Failed reconciles, each retried with backoff.
        pub failures: Family<FailureLabels, Counter>
            => "kuryr_allocator_failures", "Failed reconciles by operation and reason (each retried with backoff)";
        /// Pod uids waiting for a worker.
        pub queue_depth: Gauge => "kuryr_allocator_queue_depth", "Pods waiting for a worker";
        /// Pod uids whose last reconcile failed.
        pub queue_failing: Gauge
            => "kuryr_allocator_queue_failing", "Pods whose last reconcile failed and is being retried";
        /// VIFs held (and streamed).
        pub vifs: Gauge => "kuryr_allocator_vifs", "VIFs held and streamed to binders";
        /// From a pod first seen scheduled to its VIF published.
        pub vif_latency: Histogram = latency_histogram()
            => "kuryr_allocator_vif_ready_seconds",
            "Time from a pod first seen scheduled to its VIF published to its node's stream";
        /// From a pod first seen scheduled to its VIF recorded READY (plugged by the binder and,
        /// with Neutron, the port ACTIVE): the allocator's view of the pod's network-ready latency.
        pub ready_latency: Histogram = latency_histogram()
            => "kuryr_allocator_pod_ready_seconds",
            "Time from a pod first seen scheduled to its VIF recorded READY (plugged, and confirmed by the backend)";
        /// Open WatchVifs streams.
        pub subscribers: Gauge => "kuryr_allocator_watchvifs_subscribers", "Open WatchVifs streams";
        /// WatchVifs streams begun, by how.
        pub subscriptions: Family<StartLabels, Counter>
            => "kuryr_allocator_watchvifs_subscriptions",
            "WatchVifs streams begun, by how they began (snapshot, resume, reset, lagged)";
        /// Times the watcher's stream broke or could not be opened.
        pub watcher_reconnects: Counter
            => "kuryr_allocator_watcher_reconnects", "Times the watcher's Subscribe stream broke or could not be opened";
        /// Allocations given back because the pod's PodVif recorded another VIF that it still held.
        pub lost_races: Counter
            => "kuryr_allocator_lost_races",
            "Allocations given back because the pod's PodVif already recorded another VIF (another replica's)";
    }
    nested {
        /// The embedded IPAM's backend calls and addresses (no series with `--backend neutron`).
        pub ipam: IpamMetrics,
    }
}

impl Metrics {
    /// Counts a failed reconcile.
    pub fn failed(&self, op: &'static str, reason: &'static str) {
        self.failures.get_or_create(&FailureLabels { op, reason }).inc();
    }

    /// Counts a stream start.
    pub fn started(&self, start: &'static str) {
        self.subscriptions.get_or_create(&StartLabels { start }).inc();
    }
}
