//! Neutron's push (port events over the message bus) and the READY hand-over: which pushed
//! port is whose, and what a push makes of it.

use super::*;

impl NeutronBackend {
    /// Chain for the channel of READY VIFs (the status poller sends, the allocator receives).
    pub(super) fn send_ready(&self, pod_uid: String, vif_id: String) {
        let _ = self.ready_tx.send(ReadyVif { pod_uid, vif_id });
    }

    /// A watched port is ACTIVE (`source`: `event`, `poll` or `safety`): the pod's VIF is ready.
    pub(super) fn port_active(&self, port: &str, w: &Watched, source: &'static str) {
        let after = w.since.elapsed();
        self.metrics.active_latency.observe(after.as_secs_f64());
        self.metrics.ready_source(source);
        tracing::debug!(port, uid = %w.pod_uid, after_ms = after.as_millis() as u64, source, "port ACTIVE");
        if self.hold_for_extras(&w.pod_uid, port) {
            return;
        }
        self.send_ready(w.pod_uid.clone(), port.to_string());
    }

    /// Whether readiness comes from events and the broker is consumed right now; the link's
    /// epoch with it.
    pub(super) fn event_link(&self) -> Option<Link> {
        self.events.as_ref().map(|e| *e.link.borrow())
    }

    /// Forgets event bookkeeping of ports no longer in the inventory.
    pub(super) fn prune_event_state(&self) {
        let Some(side) = &self.events else { return };
        let ours = guard(&self.inv).port_ids();
        let mut st = guard(&side.state);
        st.revisions.retain(|id, _| ours.contains(id));
        st.early.retain(|id, _| ours.contains(id));
    }
}

/// Whether `rev` is newer than `floor` (unknown revisions are taken as newer: a push without one
/// is acted on, as the safety read would).
pub(super) fn newer(rev: Option<u64>, floor: Option<u64>) -> bool {
    match (rev, floor) {
        (Some(r), Some(f)) => r > f,
        _ => true,
    }
}

impl PortEventSink for NeutronBackend {
    /// Maps a pushed port to what waits for it: the pod whose plugged port it is (READY once
    /// ACTIVE), a released port waiting to be seen unplugged (free again), a held port not yet
    /// reported plugged (remembered). A push older than or as old as what is known of the port
    /// (by revision), or naming another device than the waiting pod, changes nothing; ports
    /// that are not this allocator's are skipped.
    fn on_port_event(&self, ev: &PortEvent) {
        let Some(side) = &self.events else { return };
        let m = &side.metrics;
        if ev.device_owner.as_deref().is_some_and(|o| !o.is_empty() && o != self.device_owner) {
            return m.port("foreign");
        }
        let watched = guard(&self.watched).get(&ev.id).cloned();
        let place = if watched.is_some() { None } else { guard(&self.inv).place(&ev.id) };
        if watched.is_none() && place.is_none() {
            if let Some(n) = &self.nested {
                return self.nested_port_event(n, ev, m);
            }
            return m.port("foreign");
        }
        {
            let mut st = guard(&side.state);
            let known = st.revisions.get(&ev.id).copied();
            let floor = match (&watched, &place) {
                (Some(w), _) => w.revision,
                (None, Some(Place::Recycling(_, r) | Place::Held(_, r))) => *r,
                _ => None,
            };
            if !newer(ev.revision, known.max(floor)) {
                return m.port("stale");
            }
            // A push naming another device than the pod is not about this assignment: it moves
            // nothing, not even the revision the next pushes are ordered by.
            let holder = match (&watched, &place) {
                (Some(w), _) => Some(w.pod_uid.as_str()),
                (None, Some(Place::Held(uid, _))) => Some(uid.as_str()),
                _ => None,
            };
            if let (Some(h), Some(d)) = (holder, ev.device_id.as_deref())
                && !ev.deleted
                && d != h
            {
                return m.port("stale");
            }
            if let Some(r) = ev.revision {
                st.revisions.insert(ev.id.clone(), r);
            }
        }
        if let Some(w) = watched {
            if ev.deleted {
                let removed = {
                    let mut g = guard(&self.watched);
                    g.get(&ev.id).is_some_and(|now| now.pod_uid == w.pod_uid) && g.remove(&ev.id).is_some()
                };
                if removed {
                    tracing::warn!(port = %ev.id, uid = %w.pod_uid, "a plugged port was deleted from Neutron; no longer waiting for it");
                }
                return m.port("gone");
            }
            if !ev.is_active() {
                return m.port("pending");
            }
            let still = {
                let mut g = guard(&self.watched);
                let same = g.get(&ev.id).is_some_and(|now| now.pod_uid == w.pod_uid);
                if same {
                    g.remove(&ev.id);
                }
                same
            };
            if still {
                self.port_active(&ev.id, &w, "event");
                return m.port("ready");
            }
            return m.port("stale");
        }
        match place {
            Some(Place::Recycling(key, _)) => {
                if ev.deleted {
                    guard(&self.inv).drop_recycling(&key, &ev.id);
                    self.gauges();
                    m.port("gone");
                } else if ev.is_active() {
                    m.port("pending");
                } else if guard(&self.inv).recycled(&key, &ev.id) {
                    self.gauges();
                    m.port("recycled");
                } else {
                    m.port("pending");
                }
            }
            Some(Place::Held(uid, _)) => {
                // Both locks, in watch_ready's order: the plug report may have come meanwhile.
                let mut g = guard(&self.watched);
                if let Some(w) = g.get(&ev.id).cloned() {
                    if ev.is_active() && w.pod_uid == uid {
                        g.remove(&ev.id);
                        drop(g);
                        self.port_active(&ev.id, &w, "event");
                        return m.port("ready");
                    }
                    return m.port("pending");
                }
                let mut st = guard(&side.state);
                match ev.revision {
                    Some(rev) if ev.is_active() => {
                        st.early.insert(ev.id.clone(), (rev, uid));
                        m.port("early");
                    }
                    _ => {
                        st.early.remove(&ev.id);
                        m.port("pending");
                    }
                }
            }
            Some(Place::Free) | None => m.port("idle"),
        }
    }
}
