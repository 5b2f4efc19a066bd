//! The Neutron backend's nested mode: its allocate, release, recovery and port events handed to
//! the trunks ([`super::Nested`]).

use super::*;
use crate::backend::neutron::NeutronBackend;

impl NeutronBackend {
    /// The nested side, with `--nested-trunks`.
    pub fn nested(&self) -> Option<&Arc<Nested>> {
        self.nested.as_ref()
    }

    pub(in crate::backend::neutron) async fn allocate_nested(
        &self,
        n: &Arc<Nested>,
        pod: &PodKey,
        node: &str,
    ) -> Result<VifRecord, ClusterError> {
        let shape = self.shape_for(pod).await?;
        let (port, vlan, source) = n.allocate(&shape, pod, node).await?;
        let record = Nested::record(&shape, &port, vlan);
        self.metrics.source(source);
        if source == "add" {
            self.metrics.created("add", 1);
        }
        if let Some((trunk, count)) = n.refill_wanted(node) {
            let (n, metrics) = (n.clone(), self.metrics.clone());
            tokio::spawn(async move {
                match n.refill(&shape, &trunk, count).await {
                    Ok(joined) => {
                        metrics.created("pool", u64::from(joined));
                        tracing::info!(trunk, created = joined, "trunk pool refilled");
                    }
                    Err(e) => {
                        let reason = e.reason();
                        metrics.refill_failures.get_or_create(&crate::backend::neutron::ReasonLabels { reason }).inc();
                        tracing::warn!(trunk, error = %crate::error::chain(&e), "trunk pool refill failed");
                    }
                }
            });
        }
        record
    }

    /// A pushed port that is neither watched nor in the node pools: a subport's status is noted
    /// (ready at once if its pod's plug was reported meanwhile).
    pub(in crate::backend::neutron) fn nested_port_event(
        &self,
        n: &Nested,
        ev: &crate::backend::neutron::events::decode::PortEvent,
        m: &crate::backend::neutron::events::EventMetrics,
    ) {
        let Some(holder) = n.note_status(&ev.id, ev.status.as_deref(), ev.revision) else { return m.port("foreign") };
        if ev.is_active() && !holder.is_empty() {
            let mut g = guard(&self.watched);
            if let Some(w) = g.get(&ev.id).cloned()
                && w.pod_uid == holder
            {
                g.remove(&ev.id);
                drop(g);
                self.port_active(&ev.id, &w, "event");
                return m.port("ready");
            }
        }
        m.port("early")
    }

    pub(in crate::backend::neutron) async fn release_nested(
        &self,
        n: &Nested,
        pod: &PodKey,
    ) -> Result<bool, ClusterError> {
        guard(&self.watched).retain(|_, w| w.pod_uid != pod.uid);
        n.release(pod).await
    }

    pub(in crate::backend::neutron) async fn recover_nested(
        &self,
        n: &Nested,
        recorded: &HashMap<String, String>,
    ) -> Result<Recovered, ClusterError> {
        let summary = n.recover(recorded).await?;
        self.recovered.store(true, std::sync::atomic::Ordering::Release);
        self.wake.notify_one();
        Ok(summary)
    }
}
