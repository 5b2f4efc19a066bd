//! The watcher's own Prometheus metrics, registered on the runtime's registry next to the gRPC
//! call metrics.

pub use kuryr_runtime::metrics::labels::{KindLabels, StartLabels};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

kuryr_runtime::metric_set! {
    /// The metrics; cheap to clone (each is a handle to shared state).
    pub struct Metrics {
        /// Errors reported by the Kubernetes watches, by kind; each is retried with backoff.
        pub watch_errors: Family<KindLabels, Counter>
            => "kuryr_watcher_watch_errors", "Errors of the Kubernetes watches, by kind (each retried with backoff)";
        /// Objects held in the index, by kind.
        pub objects: Family<KindLabels, Gauge> => "kuryr_watcher_objects", "Objects held in the index, by kind";
        /// Deltas recorded (reduced objects that changed), by kind.
        pub deltas: Family<KindLabels, Counter>
            => "kuryr_watcher_deltas", "Changes of reduced objects recorded, by kind";
        /// Open Subscribe streams.
        pub subscribers: Gauge => "kuryr_watcher_subscribers", "Open Subscribe streams";
        /// Subscribe streams begun (or restarted after lagging), by how.
        pub subscriptions: Family<StartLabels, Counter>
            => "kuryr_watcher_subscriptions",
            "Subscribe streams begun, by how they began (snapshot, resume, reset, lagged)";
    }
}

impl Metrics {
    /// Counts a subscription start.
    pub fn started(&self, start: &'static str) {
        self.subscriptions.get_or_create(&StartLabels { start }).inc();
    }
}
