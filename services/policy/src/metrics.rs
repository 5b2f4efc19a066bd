//! kuryr-policy's own Prometheus metrics, registered on the runtime's registry next to the gRPC
//! call metrics.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// How a WatchPolicies stream began.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StartLabels {
    /// `snapshot`, `resume`, `reset` or `lagged`.
    pub start: &'static str,
}

/// A status Event's type and whether it was written.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    /// `Normal` or `Warning`.
    pub r#type: &'static str,
    /// `ok` or `error`.
    pub result: &'static str,
}

/// The metrics; cheap to clone (each is a handle to shared state).
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Time from a watched change to its nodes' states written to the log.
    pub publish: Histogram,
    /// Log changes (items applied or deleted) written.
    pub changes: Counter,
    /// Items the log holds, over every node (groups and isolations).
    pub items: Gauge,
    /// Pods, policies, interned selectors and groups the compiler holds.
    pub pods: Gauge,
    pub policies: Gauge,
    pub selectors: Gauge,
    pub groups: Gauge,
    /// Policies with parts that match nothing (the API server would have refused them).
    pub invalid_policies: Counter,
    /// Set and map elements of every node's state (what the binders program), over every node.
    pub elements: Gauge,
    /// Policy status Events written (or not), by type.
    pub status_events: Family<EventLabels, Counter>,
    /// Open WatchPolicies streams.
    pub subscribers: Gauge,
    /// WatchPolicies streams begun, by how.
    pub subscriptions: Family<StartLabels, Counter>,
    /// Times the watcher's stream broke or could not be opened.
    pub watcher_reconnects: Counter,
    /// Failed calls of the PodVif watch (retried).
    pub podvif_watch_errors: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            publish: kuryr_runtime::metrics::latency_histogram(),
            changes: Counter::default(),
            items: Gauge::default(),
            pods: Gauge::default(),
            policies: Gauge::default(),
            selectors: Gauge::default(),
            groups: Gauge::default(),
            invalid_policies: Counter::default(),
            elements: Gauge::default(),
            status_events: Family::default(),
            subscribers: Gauge::default(),
            subscriptions: Family::default(),
            watcher_reconnects: Counter::default(),
            podvif_watch_errors: Counter::default(),
        }
    }
}

impl Metrics {
    /// Creates the metrics and registers them.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "kuryr_policy_publish_seconds",
            "Time to compile a watched change and write the changed nodes' states",
            m.publish.clone(),
        );
        registry.register("kuryr_policy_changes", "Items applied or deleted in the streamed state", m.changes.clone());
        registry.register("kuryr_policy_items", "Groups and isolations streamed, over every node", m.items.clone());
        registry.register("kuryr_policy_pods", "Pods the compiler holds", m.pods.clone());
        registry.register("kuryr_policy_policies", "NetworkPolicies the compiler holds", m.policies.clone());
        registry.register("kuryr_policy_selectors", "Distinct peer selectors of every policy", m.selectors.clone());
        registry.register("kuryr_policy_groups", "Groups of pods judged alike", m.groups.clone());
        registry.register(
            "kuryr_policy_invalid_policies",
            "NetworkPolicy versions with parts that match nothing (refused by a validating API server)",
            m.invalid_policies.clone(),
        );
        registry.register(
            "kuryr_policy_elements",
            "Set and map elements of the compiled node states (what the binders program), over every node",
            m.elements.clone(),
        );
        registry.register(
            "kuryr_policy_status_events",
            "NetworkPolicy status Events by type (Normal, Warning) and result (ok, error)",
            m.status_events.clone(),
        );
        registry.register("kuryr_policy_watch_subscribers", "Open WatchPolicies streams", m.subscribers.clone());
        registry.register(
            "kuryr_policy_watch_subscriptions",
            "WatchPolicies streams begun, by how they began (snapshot, resume, reset, lagged)",
            m.subscriptions.clone(),
        );
        registry.register(
            "kuryr_policy_watcher_reconnects",
            "Times the watcher's Subscribe stream broke or could not be opened",
            m.watcher_reconnects.clone(),
        );
        registry.register(
            "kuryr_policy_podvif_watch_errors",
            "Failed calls of the PodVif watch (the addresses of pods whose status has none yet, the Neutron ports); retried",
            m.podvif_watch_errors.clone(),
        );
        m
    }

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
