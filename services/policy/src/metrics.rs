//! kuryr-policy's own Prometheus metrics, registered on the runtime's registry next to the gRPC
//! call metrics.

use std::time::Duration;

pub use kuryr_runtime::metrics::labels::StartLabels;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

kuryr_runtime::label_set! {
    /// A status Event's type and whether it was written.
    pub struct EventLabels {
        /// `Normal` or `Warning`.
        r#type,
        /// `ok` or `error`.
        result,
    }
}

kuryr_runtime::metric_set! {
    /// The metrics; cheap to clone (each is a handle to shared state).
    pub struct Metrics {
        /// Time from a watched change to its nodes' states written to the log.
        pub publish: Histogram = kuryr_runtime::metrics::latency_histogram()
            => "kuryr_policy_publish_seconds", "Time to compile a watched change and write the changed nodes' states";
        /// Log changes (items applied or deleted) written.
        pub changes: Counter => "kuryr_policy_changes", "Items applied or deleted in the streamed state";
        /// Items the log holds, over every node (groups and isolations).
        pub items: Gauge => "kuryr_policy_items", "Groups and isolations streamed, over every node";
        /// Pods, policies, interned selectors and groups the compiler holds.
        pub pods: Gauge => "kuryr_policy_pods", "Pods the compiler holds";
        pub policies: Gauge => "kuryr_policy_policies", "NetworkPolicies the compiler holds";
        pub selectors: Gauge => "kuryr_policy_selectors", "Distinct peer selectors of every policy";
        pub groups: Gauge => "kuryr_policy_groups", "Groups of pods judged alike";
        /// Policies with parts that match nothing (the API server would have refused them).
        pub invalid_policies: Counter
            => "kuryr_policy_invalid_policies",
            "NetworkPolicy versions with parts that match nothing (refused by a validating API server)";
        /// Set and map elements of every node's state (what the binders program), over every node.
        pub elements: Gauge
            => "kuryr_policy_elements",
            "Set and map elements of the compiled node states (what the binders program), over every node";
        /// Policy status Events written (or not), by type.
        pub status_events: Family<EventLabels, Counter>
            => "kuryr_policy_status_events",
            "NetworkPolicy status Events by type (Normal, Warning) and result (ok, error)";
        /// Open WatchPolicies streams.
        pub subscribers: Gauge => "kuryr_policy_watch_subscribers", "Open WatchPolicies streams";
        /// WatchPolicies streams begun, by how.
        pub subscriptions: Family<StartLabels, Counter>
            => "kuryr_policy_watch_subscriptions",
            "WatchPolicies streams begun, by how they began (snapshot, resume, reset, lagged)";
        /// Times the watcher's stream broke or could not be opened.
        pub watcher_reconnects: Counter
            => "kuryr_policy_watcher_reconnects", "Times the watcher's Subscribe stream broke or could not be opened";
        /// Failed calls of the PodVif watch (retried).
        pub podvif_watch_errors: Counter
            => "kuryr_policy_podvif_watch_errors",
            "Failed calls of the PodVif watch (the addresses of pods whose status has none yet, the Neutron ports); retried";
    }
}

impl Metrics {
    /// Counts one status Event.
    pub fn status_event(&self, r#type: &'static str, ok: bool) {
        self.status_events.get_or_create(&EventLabels { r#type, result: if ok { "ok" } else { "error" } }).inc();
    }

    /// Records one publication.
    pub fn observe_publish(&self, took: Duration, changes: usize, stats: kuryr_policy_core::Stats, items: usize) {
        self.publish.observe(took.as_secs_f64());
        self.changes.inc_by(changes as u64);
        self.items.set(items as i64);
        self.pods.set(stats.pods as i64);
        self.policies.set(stats.policies as i64);
        self.selectors.set(stats.selectors as i64);
        self.groups.set(stats.groups as i64);
    }
}
