//! Metrics of the Neutron backend, next to the allocator's own (the client's per-call metrics,
//! `kuryr_openstack_*`, are registered beside them and count every Neutron call).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Where something happened or came from.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabels {
    /// For creations: `add` (on a pod's allocation path) or `pool` (a refill). For VIF sources:
    /// `pool`, `add` (created for the pod) or `existing` (the pod's port was found in Neutron).
    pub path: &'static str,
}

/// Why something failed.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// [`crate::error::ClusterError::reason`]: `neutron_quota_exceeded`, `neutron_unavailable`, ...
    pub reason: &'static str,
}

/// Why a port was deleted.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WhyLabels {
    /// `released` (pool full or off), `binding_failed`, `freed` (pool API), `recycle_timeout`,
    /// `duplicate`, `namespace_deleted` (a pool port of a namespace network being removed),
    /// `lost_to_record` (created by a replica that lost the race for the pod's PodVif).
    pub why: &'static str,
}

/// How a port was learnt ACTIVE, or why a status read was made.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// `event` (Neutron's push), `poll` (the status poller: no events, or the broker away),
    /// `safety` (the reconciling read with events), `nested` (a trunk subport already known
    /// ACTIVE when its pod's plug was reported). For reads: `interval` or `reconnect`.
    pub source: &'static str,
}

/// A pool's node.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// The node of the pool.
    pub node: String,
    /// `free`, `recycling` or `in_use`.
    pub state: &'static str,
}

/// The metrics; cheap to clone.
#[derive(Clone, Debug)]
pub struct NeutronMetrics {
    /// Ports created, by path.
    pub creations: Family<PathLabels, Counter>,
    /// VIFs handed out, by where their port came from.
    pub sources: Family<PathLabels, Counter>,
    /// Ports deleted, by why.
    pub deletions: Family<WhyLabels, Counter>,
    /// Released ports put back into a pool.
    pub recycles: Counter,
    /// Ports per pool and state.
    pub pool_ports: Family<PoolLabels, Gauge>,
    /// From the binder's plug report to Neutron's ACTIVE seen by the status poller.
    pub active_latency: Histogram,
    /// Status list calls (each covers many ports).
    pub status_polls: Counter,
    /// Status list calls that failed.
    pub status_poll_failures: Counter,
    /// With events: the reconciling status reads, by why (`interval`: ports waiting longer than
    /// the resync interval; `reconnect`: every waiting port after a (re)connection).
    pub status_safety_reads: Family<SourceLabels, Counter>,
    /// Watched ports found ACTIVE, by how (`event`, `poll`, `safety`).
    pub ready_sources: Family<SourceLabels, Counter>,
    /// The port event link.
    pub events: super::events::EventMetrics,
    /// Background pool refills that failed (retried with backoff), by reason.
    pub refill_failures: Family<ReasonLabels, Counter>,
    /// Per-namespace networks.
    pub namespaces: super::namespaces::metrics::NamespaceMetrics,
}

impl Default for NeutronMetrics {
    fn default() -> Self {
        Self {
            creations: Family::default(),
            sources: Family::default(),
            deletions: Family::default(),
            recycles: Counter::default(),
            pool_ports: Family::default(),
            active_latency: kuryr_runtime::metrics::latency_histogram(),
            status_polls: Counter::default(),
            status_poll_failures: Counter::default(),
            status_safety_reads: Family::default(),
            ready_sources: Family::default(),
            events: super::events::EventMetrics::default(),
            refill_failures: Family::default(),
            namespaces: super::namespaces::metrics::NamespaceMetrics::default(),
        }
    }
}

impl NeutronMetrics {
    /// Creates the metrics and registers them.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            namespaces: super::namespaces::metrics::NamespaceMetrics::register(registry),
            events: super::events::EventMetrics::register(registry),
            ..Self::default()
        };
        let r = registry.sub_registry_with_prefix("kuryr_allocator_neutron");
        r.register(
            "port_creations",
            "Neutron ports created, by path (add: for a pod; pool: refill)",
            m.creations.clone(),
        );
        r.register(
            "vif_sources",
            "VIFs handed out, by where the port came from (pool, add, existing)",
            m.sources.clone(),
        );
        r.register("port_deletions", "Neutron ports deleted, by why", m.deletions.clone());
        r.register("port_recycles", "Released ports put back into their pool", m.recycles.clone());
        r.register("pool_ports", "Ports per pool node and state (free, recycling, in_use)", m.pool_ports.clone());
        r.register(
            "active_seconds",
            "From the binder's plug report to the port seen ACTIVE in Neutron",
            m.active_latency.clone(),
        );
        r.register("status_polls", "Batched port status reads", m.status_polls.clone());
        r.register("status_poll_failures", "Batched port status reads that failed", m.status_poll_failures.clone());
        r.register(
            "status_safety_reads",
            "With port events: reconciling batched status reads, by why (interval, reconnect)",
            m.status_safety_reads.clone(),
        );
        r.register(
            "ready_sources",
            "Plugged ports found ACTIVE, by how (event, poll, safety)",
            m.ready_sources.clone(),
        );
        r.register(
            "pool_refill_failures",
            "Background pool refills that failed and will be retried, by reason (neutron_quota_exceeded, ...)",
            m.refill_failures.clone(),
        );
        m
    }

    /// Counts a creation.
    pub fn created(&self, path: &'static str, n: u64) {
        self.creations.get_or_create(&PathLabels { path }).inc_by(n);
    }

    /// Counts a VIF handed out.
    pub fn source(&self, path: &'static str) {
        self.sources.get_or_create(&PathLabels { path }).inc();
    }

    /// Counts a port found ACTIVE.
    pub fn ready_source(&self, source: &'static str) {
        self.ready_sources.get_or_create(&SourceLabels { source }).inc();
    }

    /// Counts a reconciling read.
    pub fn safety_read(&self, source: &'static str) {
        self.status_safety_reads.get_or_create(&SourceLabels { source }).inc();
    }

    /// Counts a deletion.
    pub fn deleted(&self, why: &'static str) {
        self.deletions.get_or_create(&WhyLabels { why }).inc();
    }
}
