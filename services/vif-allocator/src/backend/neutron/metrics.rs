//! Metrics of the Neutron backend, next to the allocator's own (the client's per-call metrics,
//! `kuryr_openstack_*`, are registered beside them and count every Neutron call).

pub use kuryr_runtime::metrics::labels::ReasonLabels;
use kuryr_runtime::metrics::latency_histogram;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

kuryr_runtime::label_set! {
    /// Where something happened or came from.
    pub struct PathLabels {
        /// For creations: `add` (on a pod's allocation path) or `pool` (a refill). For VIF sources:
        /// `pool`, `add` (created for the pod) or `existing` (the pod's port was found in Neutron).
        path,
    }
    /// Why a port was deleted.
    pub struct WhyLabels {
        /// `released` (pool full or off), `binding_failed`, `freed` (pool API), `recycle_timeout`,
        /// `duplicate`, `namespace_deleted` (a pool port of a namespace network being removed),
        /// `lost_to_record` (created by a replica that lost the race for the pod's PodVif).
        why,
    }
    /// How a port was learnt ACTIVE, or why a status read was made.
    pub struct SourceLabels {
        /// `event` (Neutron's push), `poll` (the status poller: no events, or the broker away),
        /// `safety` (the reconciling read with events), `nested` (a trunk subport already known
        /// ACTIVE when its pod's plug was reported). For reads: `interval` or `reconnect`.
        source,
    }
}

/// A pool's node.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// The node of the pool.
    pub node: String,
    /// `free`, `recycling` or `in_use`.
    pub state: &'static str,
}

kuryr_runtime::metric_set! {
    /// The metrics; cheap to clone.
    pub struct NeutronMetrics {
        /// Ports created, by path.
        pub creations: Family<PathLabels, Counter>
            => "kuryr_allocator_neutron_port_creations", "Neutron ports created, by path (add: for a pod; pool: refill)";
        /// VIFs handed out, by where their port came from.
        pub sources: Family<PathLabels, Counter>
            => "kuryr_allocator_neutron_vif_sources",
            "VIFs handed out, by where the port came from (pool, add, existing)";
        /// Ports deleted, by why.
        pub deletions: Family<WhyLabels, Counter>
            => "kuryr_allocator_neutron_port_deletions", "Neutron ports deleted, by why";
        /// Released ports put back into a pool.
        pub recycles: Counter => "kuryr_allocator_neutron_port_recycles", "Released ports put back into their pool";
        /// Ports per pool and state.
        pub pool_ports: Family<PoolLabels, Gauge>
            => "kuryr_allocator_neutron_pool_ports", "Ports per pool node and state (free, recycling, in_use)";
        /// From the binder's plug report to Neutron's ACTIVE seen by the status poller.
        pub active_latency: Histogram = latency_histogram()
            => "kuryr_allocator_neutron_active_seconds", "From the binder's plug report to the port seen ACTIVE in Neutron";
        /// Status list calls (each covers many ports).
        pub status_polls: Counter => "kuryr_allocator_neutron_status_polls", "Batched port status reads";
        /// Status list calls that failed.
        pub status_poll_failures: Counter
            => "kuryr_allocator_neutron_status_poll_failures", "Batched port status reads that failed";
        /// With events: the reconciling status reads, by why (`interval`: ports waiting longer than
        /// the resync interval; `reconnect`: every waiting port after a (re)connection).
        pub status_safety_reads: Family<SourceLabels, Counter>
            => "kuryr_allocator_neutron_status_safety_reads",
            "With port events: reconciling batched status reads, by why (interval, reconnect)";
        /// Watched ports found ACTIVE, by how (`event`, `poll`, `safety`).
        pub ready_sources: Family<SourceLabels, Counter>
            => "kuryr_allocator_neutron_ready_sources", "Plugged ports found ACTIVE, by how (event, poll, safety)";
        /// Background pool refills that failed (retried with backoff), by reason.
        pub refill_failures: Family<ReasonLabels, Counter>
            => "kuryr_allocator_neutron_pool_refill_failures",
            "Background pool refills that failed and will be retried, by reason (neutron_quota_exceeded, ...)";
    }
    nested {
        /// The port event link.
        pub events: super::events::EventMetrics,
        /// Per-namespace networks.
        pub namespaces: super::namespaces::metrics::NamespaceMetrics,
    }
}

impl NeutronMetrics {
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
