//! The Neutron backend as the controller sees it ([`VifBackend`]): a port per pod, from a pool
//! when one is warm, released back to it; ready once Neutron says the port is ACTIVE.

use super::push::newer;
use super::*;

impl VifBackend for NeutronBackend {
    fn name(&self) -> &'static str {
        vif::BACKEND
    }

    async fn allocate(&self, pod: &PodKey, node: &str) -> Result<VifRecord, ClusterError> {
        if !self.is_recovered() {
            return Err(ClusterError::NotReady("the Neutron ports are still being recovered".into()));
        }
        if let Some(n) = &self.nested {
            return self.allocate_nested(n, pod, node).await;
        }
        let held = guard(&self.inv).held(&pod.uid).cloned();
        if let Some(port) = held {
            let shape = match self.shape_of(&port.network_id) {
                Some(s) => s,
                None => self.shape_for(pod).await?,
            };
            return self.record(&shape, &port);
        }
        let shape = self.shape_for(pod).await?;
        let key = self.key_on(node, &shape.network_id);
        let (port, source) = match self.take_from_pool(pod, &key).await? {
            Some(p) => (p, "pool"),
            None => self.create_for(&shape, pod, node).await?,
        };
        let record = self.record(&shape, &port);
        guard(&self.inv).assign(&pod.uid, &key, port);
        self.metrics.source(source);
        let _ = self.refill_tx.send(key);
        self.gauges();
        record
    }

    async fn release(&self, pod: &PodKey, _node: &str) -> Result<bool, ClusterError> {
        if let Some(n) = &self.nested {
            return self.release_nested(n, pod).await;
        }
        let (taken, keep) = {
            let mut inv = guard(&self.inv);
            let taken = inv.unassign(&pod.uid);
            let keep = taken.as_ref().is_some_and(|(k, _)| inv.keeps(k, self.limits) && self.serves(k));
            (taken, keep)
        };
        let Some((key, port)) = taken else { return Ok(false) };
        // Until the release ends: an audit listing Neutron meanwhile may still see the pod's
        // device id on the port.
        let _change = InFlight::begin(&self.inv, &port.id);
        guard(&self.watched).remove(&port.id);
        let outcome = if keep {
            match self.neutron.update_port(&port.id, &recycled(&self.reset_groups), None).await {
                // The pool may have stopped being served during the update (its namespace's
                // network is being removed, and that removal already drained it): the port
                // goes, rather than into a pool nothing drains again.
                Ok(p) if !self.serves(&key) => match self.delete_port(&p.id, "released").await {
                    Err(ClusterError::Neutron { source, .. }) if source.is_not_found() => Ok(()),
                    other => other,
                },
                Ok(p) => {
                    guard(&self.inv).put_recycling(&key, p, Instant::now());
                    self.metrics.recycles.inc();
                    self.wake.notify_one();
                    Ok(())
                }
                Err(e) if e.is_not_found() => Ok(()),
                Err(e) => Err(neutron_err(format!("recycling port {}", port.id))(e)),
            }
        } else {
            match self.delete_port(&port.id, "released").await {
                Err(ClusterError::Neutron { source, .. }) if source.is_not_found() => Ok(()),
                other => other,
            }
        };
        if let Err(e) = outcome {
            guard(&self.inv).assign(&pod.uid, &key, port);
            return Err(e);
        }
        self.gauges();
        if let Some(nn) = self.namespace_networks() {
            nn.released(&key.network);
        }
        Ok(true)
    }

    async fn holds(&self, pod: &PodKey, _node: &str, record: &VifRecord) -> Result<bool, ClusterError> {
        let filter = Filter::new().device_id(&pod.uid);
        let ports = self
            .neutron
            .list_ports(&filter)
            .await
            .map_err(neutron_err(format!("looking up the ports of pod {}", pod.uid)))?;
        Ok(ports.iter().any(|p| p.id == record.vif_id && p.device_owner == self.device_owner))
    }

    async fn discard(&self, pod: &PodKey, node: &str, ours: &VifRecord, keep: &VifRecord) -> Result<(), ClusterError> {
        if ours.vif_id == keep.vif_id {
            return Ok(());
        }
        // The kept port becomes the pod's here too, so that releasing the pod deletes it even
        // when the allocator that made it is gone (a shard handover).
        let filter = Filter::new().device_id(&pod.uid);
        let kept = self
            .neutron
            .list_ports(&filter)
            .await
            .map_err(neutron_err(format!("looking up the ports of pod {}", pod.uid)))?
            .into_iter()
            .find(|p| p.id == keep.vif_id);
        // Deleted first: should that fail, the pod still holds ours here and a retry comes back.
        match self.delete_port(&ours.vif_id, "lost_to_record").await {
            Err(ClusterError::Neutron { source, .. }) if source.is_not_found() => {}
            other => other?,
        }
        guard(&self.watched).remove(&ours.vif_id);
        {
            let mut inv = guard(&self.inv);
            if inv.held(&pod.uid).is_some_and(|p| p.id == ours.vif_id) {
                inv.unassign(&pod.uid);
            }
            if let Some(port) = kept {
                let key = self.key_on(node, &port.network_id);
                inv.assign(&pod.uid, &key, port);
            }
        }
        self.gauges();
        tracing::info!(uid = %pod.uid, port = %ours.vif_id, kept = %keep.vif_id, "deleted a port that lost to the VIF on record");
        Ok(())
    }

    fn ready_when_plugged(&self) -> bool {
        false
    }

    fn watch_ready(&self, pod_uid: &str, vif_id: &str, watch: bool) {
        if !watch {
            guard(&self.watched).remove(vif_id);
            self.unhold(vif_id);
            if let Some(side) = &self.events {
                guard(&side.state).early.remove(vif_id);
            }
            return;
        }
        let revision = guard(&self.inv).held(pod_uid).filter(|p| p.id == vif_id).and_then(|p| p.revision_number);
        let w = Watched { pod_uid: pod_uid.to_string(), since: Instant::now(), revision };
        // The watched ports' lock held throughout (then the event state's, as on_port_event
        // takes them): a push is either remembered as early here or sees the port watched.
        let mut g = guard(&self.watched);
        // A subport is ACTIVE once its trunk is wired, whatever the pod's plug: known ACTIVE
        // already (a spare one, or pushed before the plug report), it is ready now.
        if let Some(n) = &self.nested
            && n.active_for(pod_uid, vif_id)
        {
            g.remove(vif_id);
            drop(g);
            self.port_active(vif_id, &w, "nested");
            return;
        }
        // Pushed ACTIVE for this pod before its plug was reported: ready at once.
        if let Some(side) = &self.events {
            let early = guard(&side.state).early.remove(vif_id);
            if let Some((rev, uid)) = early
                && uid == pod_uid
                && newer(Some(rev), revision)
            {
                g.remove(vif_id);
                drop(g);
                self.port_active(vif_id, &w, "event");
                return;
            }
        }
        g.insert(vif_id.to_string(), w);
        drop(g);
        self.wake.notify_one();
    }
}
