//! Port status reads. The status of ports in transition — plugged and waiting for ACTIVE, or
//! released and waiting to be seen unplugged — is read in batched list calls
//! (`GET /v2.0/ports?id=..&id=..&fields=status`, 50 ids per call), not one GET per port.
//!
//! **With port events** ([`super::events`]) and the broker consumed, these reads are only the
//! safety net: every `--neutron-events-resync-interval`, the ports that have waited longer than
//! that interval (an event lost), and once after each (re)connection every waiting port (events
//! missed while away, or before the subscription). They are counted apart
//! (`kuryr_allocator_neutron_status_safety_reads_total`). A port they find ACTIVE is logged: with
//! a working subscription that does not happen. While the broker is unreachable the poller below
//! runs as without events.
//!
//! **Without events** (or the broker away), the poller:
//! Pacing: right after something is added; then every `--status-poll-min` while a plugged port
//! waits for ACTIVE and was plugged less than [`EXPECTED_ACTIVE`] ago — the agent wires a port
//! within seconds, and each round's wait is time added to the pod's start (one read covers
//! every waiting port, so the reads are per interval, not per port). Otherwise (only released
//! ports being recycled, or ports waiting far longer than an agent takes) the wait grows by half
//! each idle round up to `--status-poll-max`, back to the minimum whenever a port changed or a
//! new one is watched. The interval counts from the start of a read, so a slow answer does not
//! stretch it. When Neutron fails, the wait doubles up to the larger of the maximum and
//! `FAILURE_CAP`, the failure is logged once and counted; nothing is dropped.

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

/// How long after its plug report a port is expected to turn ACTIVE at the latest: the ML2/OVS
/// agent measured 1–3 s here, more on a loaded node. Until then its status is read at the
/// shortest interval; a port still waiting beyond it (agent down or overloaded) is read on the
/// backoff.
pub const EXPECTED_ACTIVE: Duration = Duration::from_secs(30);

/// The next wait of an idle round.
fn idle(delay: Duration, max: Duration) -> Duration {
    (delay + delay / 2).min(max)
}

/// The wait after a successful round: the shortest while a port is expected to turn ACTIVE
/// soon or something changed, else one step further on the backoff.
fn next_delay(delay: Duration, (min, max): (Duration, Duration), changed: bool, expecting: bool) -> Duration {
    if changed || expecting { min } else { idle(delay, max) }
}

impl NeutronBackend {
    pub(super) async fn poll_status(self: Arc<Self>, shutdown: Shutdown) {
        let (min, max) = self.poll;
        let mut delay = min;
        let mut failing = false;
        let mut failures = kuryr_stream::Backoff::new("neutron-status", min, max.max(FAILURE_CAP));
        let mut link_rx = self.events.as_ref().map(|e| e.link.clone());
        // The link epoch whose (re)connection read is done.
        let mut synced = 0u64;
        loop {
            if let Some(link) = self.event_link().filter(|l| l.connected) {
                synced = self.safety_round(link.epoch, synced, &mut failing).await;
                let resync = self.events.as_ref().map_or(max, |e| e.resync);
                let changed = async {
                    match link_rx.as_mut() {
                        Some(rx) => drop(rx.changed().await),
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = tokio::time::sleep(if failing { resync.min(FAILURE_CAP) } else { resync }) => {}
                    () = changed => {}
                    () = shutdown.clone().wait() => return,
                }
                delay = min;
                continue;
            }
            let watched: Vec<(String, super::Watched)> =
                guard(&self.watched).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            let recycling = guard(&self.inv).recycling();
            if watched.is_empty() && recycling.is_empty() {
                let changed = async {
                    match link_rx.as_mut() {
                        Some(rx) => drop(rx.changed().await),
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = self.wake.notified() => {}
                    () = changed => {}
                    () = shutdown.clone().wait() => return,
                }
                delay = min;
                continue;
            }
            let ids: Vec<String> =
                watched.iter().map(|(id, _)| id.clone()).chain(recycling.iter().map(|(_, id, _)| id.clone())).collect();
            let expecting = watched.iter().any(|(_, w)| w.since.elapsed() < EXPECTED_ACTIVE);
            let started = tokio::time::Instant::now();
            self.metrics.status_polls.inc();
            let filter = Filter::new().fields(&["status", "network_id", "mac_address"]);
            match self.neutron.list_ports_by_ids(&ids, &filter).await {
                Ok(ports) => {
                    if failing {
                        tracing::info!("Neutron answers status reads again");
                        failing = false;
                    }
                    failures.reset();
                    let status: HashMap<&str, &str> =
                        ports.iter().map(|p| (p.id.as_str(), p.status.as_str())).collect();
                    let changed = self.apply_status(&status, &watched, &recycling, "poll").await;
                    delay = next_delay(delay, (min, max), changed, expecting);
                }
                Err(e) => {
                    self.metrics.status_poll_failures.inc();
                    if !failing {
                        tracing::warn!(error = %e, ports = ids.len(), "reading port status failed; retrying with backoff");
                        failing = true;
                    }
                    delay = failures.next_delay("list-ports");
                }
            }
            let next = if failing { tokio::time::Instant::now() + delay } else { started + delay };
            let changed = async {
                match link_rx.as_mut() {
                    Some(rx) => drop(rx.changed().await),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                () = self.wake.notified() => delay = min,
                () = changed => {}
                () = shutdown.clone().wait() => return,
            }
        }
    }

    /// One reconciling read while events are consumed: every waiting port once per link epoch
    /// (after a (re)connection), else those waiting longer than the resync interval. Returns the
    /// epoch now synced.
    async fn safety_round(&self, epoch: u64, synced: u64, failing: &mut bool) -> u64 {
        let resync = self.events.as_ref().map_or(FAILURE_CAP, |e| e.resync);
        let all = epoch != synced;
        let watched: Vec<(String, super::Watched)> = guard(&self.watched)
            .iter()
            .filter(|(_, w)| all || w.since.elapsed() >= resync)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let recycling: Vec<_> =
            guard(&self.inv).recycling().into_iter().filter(|(_, _, at)| all || at.elapsed() >= resync).collect();
        self.prune_event_state();
        if watched.is_empty() && recycling.is_empty() {
            return epoch;
        }
        let ids: Vec<String> =
            watched.iter().map(|(id, _)| id.clone()).chain(recycling.iter().map(|(_, id, _)| id.clone())).collect();
        let reason = if all { "reconnect" } else { "interval" };
        self.metrics.safety_read(reason);
        let filter = Filter::new().fields(&["status", "network_id", "mac_address"]);
        match self.neutron.list_ports_by_ids(&ids, &filter).await {
            Ok(ports) => {
                *failing = false;
                let status: HashMap<&str, &str> = ports.iter().map(|p| (p.id.as_str(), p.status.as_str())).collect();
                if !all {
                    let late: Vec<&str> = watched
                        .iter()
                        .filter(|(id, _)| status.get(id.as_str()) == Some(&"ACTIVE"))
                        .map(|(id, _)| id.as_str())
                        .collect();
                    if !late.is_empty() {
                        tracing::warn!(ports = ?late, after = ?resync,
                            "ports found ACTIVE by the reconciling read, no event seen for them (lost, or \
                             --neutron-events-port-versions misses Neutron's Port version)");
                    }
                }
                self.apply_status(&status, &watched, &recycling, "safety").await;
                epoch
            }
            Err(e) => {
                self.metrics.status_poll_failures.inc();
                if !*failing {
                    tracing::warn!(error = %e, ports = ids.len(), reason, "reconciling port status read failed; retrying");
                    *failing = true;
                }
                synced
            }
        }
    }

    /// Acts on one round's statuses; returns whether anything changed.
    async fn apply_status(
        &self,
        status: &HashMap<&str, &str>,
        watched: &[(String, super::Watched)],
        recycling: &[(super::PoolKey, String, Instant)],
        source: &'static str,
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
                        self.port_active(port, w, source);
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

    #[test]
    fn ports_expected_active_soon_are_read_at_the_shortest_interval() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(2));
        let d = Duration::from_millis(900);
        assert_eq!(next_delay(d, (min, max), false, true), min, "a port plugged moments ago");
        assert_eq!(next_delay(d, (min, max), true, false), min, "something changed");
        assert_eq!(next_delay(d, (min, max), false, false), Duration::from_millis(1350), "idle: back off");
        assert_eq!(next_delay(max, (min, max), false, false), max);
    }
}
