//! The port status poller: Neutron never pushes, so the status of every port in transition —
//! plugged and waiting for ACTIVE, or released and waiting to be seen unplugged — is read in
//! batched list calls (`GET /v2.0/ports?id=..&id=..&fields=status`, 50 ids per call), not one
//! GET per port.
//!
//! Pacing: right after something is added, then backing off by half each idle round from
//! `--status-poll-min` to `--status-poll-max`; back to the minimum whenever a port changed or a
//! new one is watched. When Neutron fails, the wait doubles up to the larger of the maximum and
//! [`FAILURE_CAP`], the failure is logged once and counted; nothing is dropped.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kuryr_openstack::Filter;
use kuryr_runtime::Shutdown;

use super::{NeutronBackend, guard};

/// Longest wait between reads while Neutron fails.
const FAILURE_CAP: Duration = Duration::from_secs(5);

/// A released port still ACTIVE after this long is deleted rather than kept: whatever holds it
/// plugged (a node gone without unplugging) would make it unusable for the next pod.
pub const RECYCLE_TIMEOUT: Duration = Duration::from_secs(300);

/// The next wait of an idle round.
fn idle(delay: Duration, max: Duration) -> Duration {
    (delay + delay / 2).min(max)
}

impl NeutronBackend {
    pub(super) async fn poll_status(self: Arc<Self>, shutdown: Shutdown) {
        let (min, max) = self.poll;
        let mut delay = min;
        let mut failing = false;
        loop {
            let watched: Vec<(String, super::Watched)> =
                guard(&self.watched).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            let recycling = guard(&self.inv).recycling();
            if watched.is_empty() && recycling.is_empty() {
                tokio::select! {
                    () = self.wake.notified() => {}
                    () = shutdown.clone().wait() => return,
                }
                delay = min;
                continue;
            }
            let ids: Vec<String> =
                watched.iter().map(|(id, _)| id.clone()).chain(recycling.iter().map(|(_, id, _)| id.clone())).collect();
            self.metrics.status_polls.inc();
            let filter = Filter::new().fields(&["status", "network_id", "mac_address"]);
            match self.neutron.list_ports_by_ids(&ids, &filter).await {
                Ok(ports) => {
                    if failing {
                        tracing::info!("Neutron answers status reads again");
                        failing = false;
                    }
                    let status: HashMap<&str, &str> =
                        ports.iter().map(|p| (p.id.as_str(), p.status.as_str())).collect();
                    let changed = self.apply_status(&status, &watched, &recycling).await;
                    delay = if changed { min } else { idle(delay, max) };
                }
                Err(e) => {
                    self.metrics.status_poll_failures.inc();
                    if !failing {
                        tracing::warn!(error = %e, ports = ids.len(), "reading port status failed; retrying with backoff");
                        failing = true;
                    }
                    delay = (delay * 2).min(max.max(FAILURE_CAP));
                }
            }
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.wake.notified() => delay = min,
                () = shutdown.clone().wait() => return,
            }
        }
    }

    /// Acts on one round's statuses; returns whether anything changed.
    async fn apply_status(
        &self,
        status: &HashMap<&str, &str>,
        watched: &[(String, super::Watched)],
        recycling: &[(super::PoolKey, String, Instant)],
    ) -> bool {
        let mut changed = false;
        for (port, w) in watched {
            match status.get(port.as_str()) {
                Some(&"ACTIVE") => {
                    let still = {
                        let mut g = guard(&self.watched);
                        let same = g.get(port).is_some_and(|now| now.pod_uid == w.pod_uid);
                        if same {
                            g.remove(port);
                        }
                        same
                    };
                    if still {
                        self.metrics.active_latency.observe(w.since.elapsed().as_secs_f64());
                        tracing::debug!(port, uid = %w.pod_uid, after_ms = w.since.elapsed().as_millis() as u64, "port ACTIVE");
                        self.send_ready(w.pod_uid.clone(), port.clone());
                        changed = true;
                    }
                }
                Some(_) => {}
                None => {
                    tracing::warn!(port, uid = %w.pod_uid, "a plugged port is gone from Neutron; no longer waiting for it");
                    guard(&self.watched).remove(port);
                    changed = true;
                }
            }
        }
        for (key, port, since) in recycling {
            match status.get(port.as_str()) {
                None => {
                    guard(&self.inv).drop_recycling(key, port);
                    changed = true;
                }
                Some(&"ACTIVE") if since.elapsed() >= RECYCLE_TIMEOUT => {
                    tracing::warn!(port, node = %key.node, "released port still ACTIVE after {RECYCLE_TIMEOUT:?}; deleting it");
                    if self.delete_port(port, "recycle_timeout").await.is_ok() {
                        guard(&self.inv).drop_recycling(key, port);
                        changed = true;
                    }
                }
                Some(&"ACTIVE") => {}
                Some(_) => {
                    changed |= guard(&self.inv).recycled(key, port);
                }
            }
        }
        if changed {
            self.gauges();
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_rounds_back_off_to_the_cap() {
        let max = Duration::from_secs(2);
        let mut d = Duration::from_millis(250);
        let mut seen = vec![d];
        for _ in 0..8 {
            d = idle(d, max);
            seen.push(d);
        }
        assert_eq!(seen[1], Duration::from_millis(375));
        assert!(seen.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*seen.last().unwrap_or(&Duration::ZERO), max);
    }
}
