//! The backend's ports as a whole: rebuilt from Neutron at start (and per gained shard), listed
//! and changed through the pool API, and refilled in the background.

use super::*;

/// How long PopulatePool waits at most for ports another creation has in flight.
const POPULATE_SETTLE: Duration = Duration::from_secs(120);
/// How often it looks meanwhile.
const POPULATE_SETTLE_POLL: Duration = Duration::from_millis(50);

/// Whether a populated pool still waits for ports being created to reach `count` free ones.
fn settling(view: &PoolView, count: u32) -> bool {
    view.creating > 0 && view.free.len() < count as usize
}

impl NeutronBackend {
    /// Rebuilds the inventory from Neutron: every port of the network with this cluster's tag,
    /// of the nodes `which` selects (this replica's shards: [`shards`]). `recorded` (pod uid →
    /// port id, from the PodVifs) decides which port a pod keeps should it hold two; the other
    /// is deleted, as are ports that failed to bind.
    pub async fn recover(
        &self,
        recorded: &HashMap<String, String>,
        which: &(dyn Fn(&str) -> bool + Sync),
    ) -> Result<Recovered, ClusterError> {
        if let Some(n) = &self.nested {
            return self.recover_nested(n, recorded).await;
        }
        let summary = self.load_nodes(recorded, which).await?;
        self.recovered.store(true, Ordering::Release);
        self.gauges();
        self.wake.notify_one();
        Ok(summary)
    }

    /// Every pod holding a port: (pod, node). The namespace and name come from the port's name
    /// (`<namespace>/<name>`), empty when it does not have that form.
    pub fn holders(&self) -> Vec<(PodKey, String)> {
        if let Some(n) = &self.nested {
            return n.holders();
        }
        guard(&self.inv)
            .holders()
            .map(|(uid, key, port)| {
                let (ns, name) = port.name.split_once('/').unwrap_or(("", ""));
                (PodKey::new(ns, name, uid), key.node.clone())
            })
            .collect()
    }

    /// Every pool.
    pub fn pools(&self) -> Vec<PoolView> {
        guard(&self.inv).views()
    }

    /// One pool.
    pub fn pool(&self, key: &PoolKey) -> Option<PoolView> {
        guard(&self.inv).view(key)
    }

    /// Creates ports until the pool has `count` spare ones (within its maximum); returns the pool.
    pub async fn populate(&self, key: &PoolKey, count: u32) -> Result<PoolView, ClusterError> {
        let n = guard(&self.inv).top_up(key, count, self.limits);
        let joined = self.create_into_pool(key, n).await?;
        tracing::info!(node = %key.node, asked = count, created = joined, "pool populated");
        // Ports a refill had in flight counted toward `count`: answer once they have landed, so
        // that the pool shown holds what was asked (ports being recycled aside).
        let deadline = tokio::time::Instant::now() + POPULATE_SETTLE;
        loop {
            let view = guard(&self.inv).view(key);
            match view {
                Some(v) if settling(&v, count) && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(POPULATE_SETTLE_POLL).await;
                }
                v => {
                    return Ok(v.unwrap_or_else(|| PoolView {
                        key: key.clone(),
                        free: Vec::new(),
                        recycling: 0,
                        in_use: 0,
                        creating: 0,
                    }));
                }
            }
        }
    }

    /// Deletes the free ports of the pools `which` selects; returns how many were deleted.
    /// Ports whose deletion failed go back to their pool, and the first failure is returned.
    pub async fn free(&self, which: impl Fn(&PoolKey) -> bool) -> Result<u32, ClusterError> {
        let drained = guard(&self.inv).drain_free(which);
        let results: Vec<_> = futures::stream::iter(drained)
            .map(|(key, port)| async move {
                let r = self.delete_port(&port.id, "freed").await;
                (key, port, r)
            })
            .buffer_unordered(DELETE_CONCURRENCY)
            .collect()
            .await;
        let mut deleted = 0;
        let mut first_err = None;
        for (key, port, r) in results {
            match r {
                Ok(()) => deleted += 1,
                Err(e) => {
                    guard(&self.inv).put_free(&key, port);
                    first_err.get_or_insert(e);
                }
            }
        }
        self.gauges();
        match first_err {
            Some(e) => Err(e),
            None => Ok(deleted),
        }
    }

    /// Runs the background work — the status poller, pool refills, and handing READY VIFs to
    /// `on_ready` — until shutdown.
    pub fn spawn(self: &Arc<Self>, refill: mpsc::UnboundedReceiver<PoolKey>, shutdown: Shutdown) {
        if let Some(consumer) = self.events.as_ref().and_then(|e| guard(&e.consumer).take()) {
            let sink: Arc<dyn PortEventSink> = self.clone();
            let sd = shutdown.clone();
            tokio::spawn(async move { consumer.run(sink, sd).await }.instrument(tracing::info_span!("port-events")));
        }
        if let Some(n) = &self.nested {
            let (n, sd) = (n.clone(), shutdown.clone());
            tokio::spawn(async move { n.collect_strays(sd).await }.instrument(tracing::info_span!("subport-gc")));
        }
        let this = self.clone();
        let sd = shutdown.clone();
        tokio::spawn(async move { this.poll_status(sd).await }.instrument(tracing::info_span!("port-status")));
        let this = self.clone();
        let sd = shutdown.clone();
        tokio::spawn(async move { this.wait_extras(sd).await }.instrument(tracing::info_span!("further-ports")));
        let this = self.clone();
        tokio::spawn(async move { this.refills(refill, shutdown).await }.instrument(tracing::info_span!("pools")));
    }

    pub(super) async fn refills(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<PoolKey>, shutdown: Shutdown) {
        loop {
            let key = tokio::select! {
                k = rx.recv() => match k { Some(k) => k, None => return },
                () = shutdown.clone().wait() => return,
            };
            if !guard(&self.filling).insert(key.clone()) {
                continue;
            }
            let this = self.clone();
            let span = tracing::info_span!("refill", node = %key.node);
            tokio::spawn(
                async move {
                    let mut backoff =
                        kuryr_stream::Backoff::new("pool-refill", Duration::from_millis(500), Duration::from_secs(30));
                    // A pool of a network no longer served (a namespace's, being removed) is not refilled.
                    while this.serves(&key) && this.owns_node(&key.node) {
                        let n = guard(&this.inv).refill(&key, this.limits);
                        if n == 0 {
                            break;
                        }
                        match this.create_into_pool(&key, n).await {
                            Ok(joined) => {
                                tracing::info!(created = joined, "pool refilled");
                                if joined == 0 {
                                    break;
                                }
                            }
                            Err(e) => {
                                let reason = e.reason();
                                this.metrics.refill_failures.get_or_create(&ReasonLabels { reason }).inc();
                                let delay = backoff.next_delay(reason);
                                tracing::warn!(error = %crate::error::chain(&e), reason, retry_in = ?delay,
                                    "pool refill failed");
                                tokio::time::sleep(delay).await;
                            }
                        }
                    }
                    guard(&this.filling).remove(&key);
                }
                .instrument(span),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(free: usize, creating: u32) -> PoolView {
        PoolView {
            key: PoolKey { node: "n".into(), project: "p".into(), network: "net".into(), security_groups: Vec::new() },
            free: (0..free).map(|i| format!("p{i}")).collect(),
            recycling: 0,
            in_use: 1,
            creating,
        }
    }

    #[test]
    fn populate_answers_once_the_ports_in_flight_landed_or_count_is_reached() {
        // A refill of 4 in flight when 6 were asked: top_up created 2, the answer waits.
        assert!(settling(&view(2, 4), 6));
        assert!(!settling(&view(6, 0), 6));
        // Enough free already, even with more coming: answer.
        assert!(!settling(&view(6, 2), 6));
        // Nothing in flight: what there is, is the answer (pods may have taken some).
        assert!(!settling(&view(3, 0), 6));
    }
}
