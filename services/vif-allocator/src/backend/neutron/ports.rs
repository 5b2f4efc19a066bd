//! The port operations of the pools and the allocation path: the create request for a pod or
//! a pool, taking a free pool port for a pod, creating a pod's port on its path (after looking
//! for one a lost answer left behind), bulk creates into a pool, and deleting.

use std::sync::Mutex;

use kuryr_openstack::Filter;
use kuryr_openstack::neutron::{Port, PortCreate, PortUpdate};

use super::pool::{Inventory, PoolKey};
use super::vif::{PortOwner, VifShape};
use super::{NeutronBackend, guard, neutron_err};
use crate::core::PodKey;
use crate::error::ClusterError;

/// Most ports asked for in one bulk create: Neutron handles a bulk as one transaction, and
/// measured here it is no faster per port than single creates beyond a few dozen.
const BULK_MAX: u32 = 50;

impl NeutronBackend {
    pub(super) fn port_create(&self, shape: &VifShape, node: &str, pod: Option<&PodKey>) -> PortCreate {
        let owner = PortOwner {
            project: &self.project,
            device_owner: &self.device_owner,
            security_groups: &self.security_groups,
            tag: &self.tag,
        };
        PortCreate {
            device_id: pod.map(|p| p.uid.clone()),
            binding_host_id: Some(node.to_string()),
            ..shape.port_create(owner, pod.map(port_name))
        }
    }

    /// Deletes a port in Neutron; while the call is in flight (and for audits listing Neutron
    /// meanwhile, after it) the pools' audit does not take the port back (`Inventory::changing`).
    pub(super) async fn delete_port(&self, id: &str, why: &'static str) -> Result<(), ClusterError> {
        let deleted = {
            let _change = InFlight::begin(&self.inv, id);
            self.neutron.delete_port(id).await
        };
        deleted.map_err(neutron_err(format!("deleting port {id}")))?;
        self.metrics.deleted(why);
        Ok(())
    }

    /// The pod's port from a pool, if a free one can be had.
    pub(super) async fn take_from_pool(&self, pod: &PodKey, key: &PoolKey) -> Result<Option<Port>, ClusterError> {
        loop {
            // The hand-out is over when the guard drops, whichever way (cancelled too): an audit
            // that listed Neutron while the update was in flight may have seen the port still
            // free, and must not put it back into the pool.
            let Some((port, change)) = InFlight::take(&self.inv, key) else { return Ok(None) };
            let handed = self.hand_out(pod, key, &port).await;
            drop(change);
            if let Some(p) = handed? {
                return Ok(Some(p));
            }
        }
    }

    /// Gives a port taken from a pool to the pod in Neutron: the port as updated, or `None`
    /// when it cannot be had (changed, gone, failed to bind) and the next one is to be tried.
    async fn hand_out(&self, pod: &PodKey, key: &PoolKey, port: &Port) -> Result<Option<Port>, ClusterError> {
        // The pool's groups too: a pool port can have been given a NetworkPolicy's group after
        // its pod was released (kuryr-policy's Neutron backend acting on a stale view), and the
        // pod gets what its record says it got.
        let update = PortUpdate {
            device_id: Some(pod.uid.clone()),
            name: Some(port_name(pod)),
            security_groups: (!self.reset_groups.is_empty()).then(|| self.reset_groups.clone()),
            ..PortUpdate::default()
        };
        // Only if the port is as this replica last saw it: another replica that held the
        // node's shard may have handed it out meanwhile ([`shards`]).
        match self.neutron.update_port(&port.id, &update, port.revision_number).await {
            Err(e) if e.is_conflict() => self.pool_port_changed(key, port).await.map(|()| None),
            Ok(p) if p.binding_failed() => {
                tracing::warn!(port = %p.id, node = %key.node, "pool port failed to bind; deleting it");
                let _ = self.delete_port(&p.id, "binding_failed").await;
                Ok(None)
            }
            Ok(p) => Ok(Some(p)),
            Err(e) if e.is_not_found() => {
                tracing::warn!(port = %port.id, "pool port deleted behind our back; taking the next");
                Ok(None)
            }
            Err(e) => {
                guard(&self.inv).untake(key, port.clone());
                Err(neutron_err(format!("assigning pool port {} to the pod", port.id))(e))
            }
        }
    }

    /// The pod's port created on its allocation path, after making sure none exists already
    /// (a create whose answer was lost, a port assigned before a crash and not yet tagged).
    pub(super) async fn create_for(
        &self,
        shape: &VifShape,
        pod: &PodKey,
        node: &str,
    ) -> Result<(Port, &'static str), ClusterError> {
        let filter = Filter::new().network_id(&shape.network_id).device_id(&pod.uid);
        let mut found = self
            .neutron
            .list_ports(&filter)
            .await
            .map_err(neutron_err(format!("looking up the port of pod {}", pod.uid)))?;
        found.retain(|p| p.device_owner == self.device_owner);
        if let Some(existing) = found.first().cloned() {
            for extra in &found[1..] {
                tracing::warn!(port = %extra.id, uid = %pod.uid, "second port for one pod; deleting it");
                self.delete_port(&extra.id, "duplicate").await?;
            }
            if !existing.tags.contains(&self.tag) {
                // The whole list in one request: the cluster tag holds a `/`, which Neutron's
                // one-tag call (the tag in the URL path) cannot take.
                let mut tags = existing.tags.clone();
                tags.push(self.tag.clone());
                self.neutron
                    .set_tags(kuryr_openstack::neutron::TaggedResource::Port, &existing.id, &tags)
                    .await
                    .map_err(neutron_err(format!("tagging port {}", existing.id)))?;
            }
            return Ok((existing, "existing"));
        }
        let port = self
            .neutron
            .create_port(self.port_create(shape, node, Some(pod)))
            .await
            .map_err(neutron_err(format!("creating a port for pod {}/{} on {node}", pod.namespace, pod.name)))?;
        self.metrics.created("add", 1);
        if port.binding_failed() {
            self.delete_port(&port.id, "binding_failed").await?;
            return Err(ClusterError::BindingFailed { port: port.id, host: node.to_string() });
        }
        Ok((port, "add"))
    }

    /// Creates `n` ports into a pool, in bulk calls of at most a batch, a bounded number at
    /// once over all pools. Returns how many joined the pool.
    pub(super) async fn create_into_pool(&self, key: &PoolKey, n: u32) -> Result<u32, ClusterError> {
        if n == 0 {
            return Ok(0);
        }
        let Some(shape) = self.shape_of(&key.network) else { return Ok(0) };
        let shape = &shape;
        guard(&self.inv).creating(key, n);
        let chunk = self.limits.batch.clamp(1, BULK_MAX);
        let mut sizes = Vec::new();
        let mut left = n;
        while left > 0 {
            let c = left.min(chunk);
            sizes.push(c);
            left -= c;
        }
        let calls = sizes.into_iter().map(|c| async move {
            let result = async {
                let _permit = self.bulk.acquire().await.map_err(|_| ClusterError::NotReady("shutting down".into()))?;
                let specs = (0..c).map(|_| self.port_create(shape, &key.node, None)).collect();
                self.neutron
                    .create_ports(specs)
                    .await
                    .map_err(neutron_err(format!("creating {c} ports for the pool of {}", key.node)))
            }
            .await;
            guard(&self.inv).created(key, c);
            let ports = result?;
            self.metrics.created("pool", ports.len() as u64);
            let mut joined = 0;
            for p in ports {
                if p.binding_failed() {
                    tracing::warn!(port = %p.id, node = %key.node, "new pool port failed to bind; deleting it");
                    let _ = self.delete_port(&p.id, "binding_failed").await;
                } else {
                    guard(&self.inv).put_free(key, p);
                    joined += 1;
                }
            }
            Ok::<u32, ClusterError>(joined)
        });
        let results = futures::future::join_all(calls).await;
        self.gauges();
        let mut joined = 0;
        let mut first_err = None;
        for r in results {
            match r {
                Ok(j) => joined += j,
                Err(e) if first_err.is_none() => first_err = Some(e),
                Err(_) => {}
            }
        }
        match first_err {
            Some(e) if joined == 0 => Err(e),
            Some(e) => {
                tracing::warn!(pool = %key.node, joined, error = %crate::error::chain(&e), "some pool creations failed");
                Ok(joined)
            }
            None => Ok(joined),
        }
    }
}

/// A port's change in Neutron in flight (`Inventory::changing`), ended (`Inventory::changed`)
/// when dropped: also when the call making the change is cancelled, so that the audit takes the
/// port in again from later listings.
pub(super) struct InFlight<'a> {
    inv: &'a Mutex<Inventory>,
    port: String,
}

impl<'a> InFlight<'a> {
    pub(super) fn begin(inv: &'a Mutex<Inventory>, port: &str) -> Self {
        guard(inv).changing(port);
        Self { inv, port: port.to_string() }
    }

    /// Takes the oldest free port of a pool (`Inventory::take`, which puts its hand-out in
    /// flight) with the guard that ends the hand-out.
    pub(super) fn take(inv: &'a Mutex<Inventory>, key: &PoolKey) -> Option<(Port, Self)> {
        let port = guard(inv).take(key)?;
        let id = port.id.clone();
        Some((port, Self { inv, port: id }))
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        guard(self.inv).changed(&self.port);
    }
}

/// The name of a pod's port: `<namespace>/<name>`, what orphan collection reads back.
pub(super) fn port_name(pod: &PodKey) -> String {
    format!("{}/{}", pod.namespace, pod.name)
}

/// The update that makes a released port a pool port again: no pod, no name, and back to the
/// pool's groups (kuryr-policy's Neutron backend may have changed them): `reset_groups`, else
/// the project's default group.
pub(super) fn recycled(reset_groups: &[String]) -> PortUpdate {
    PortUpdate {
        device_id: Some(String::new()),
        name: Some(String::new()),
        security_groups: (!reset_groups.is_empty()).then(|| reset_groups.to_vec()),
        ..PortUpdate::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::task::{Context, Waker};

    use super::*;

    fn port(id: &str) -> Port {
        Port { id: id.into(), ..Port::default() }
    }

    #[test]
    fn a_change_cancelled_half_way_ends_and_the_port_can_be_taken_in_again() {
        let inv = Mutex::new(Inventory::default());
        let key = PoolKey::new("n1", "p", "net", Vec::new());
        guard(&inv).put_free(&key, port("a"));
        let listing = || {
            let mut fresh = Inventory::default();
            fresh.put_free(&key, port("a"));
            fresh
        };
        // A hand-out polled until its Neutron call, then dropped: the caller was cancelled.
        let mut hand_out = Box::pin(async {
            let _taken = InFlight::take(&inv, &key).unwrap();
            std::future::pending::<()>().await;
        });
        assert!(hand_out.as_mut().poll(&mut Context::from_waker(Waker::noop())).is_pending());
        let during = guard(&inv).removals();
        assert_eq!(guard(&inv).absorb_unknown(|_| true, listing(), during), 0, "in flight");
        drop(hand_out);
        assert_eq!(guard(&inv).absorb_unknown(|_| true, listing(), during), 0, "listed while in flight");
        let after = guard(&inv).removals();
        assert_eq!(guard(&inv).absorb_unknown(|_| true, listing(), after), 1, "a later listing takes it in");
        assert_eq!(guard(&inv).view(&key).unwrap().free, ["a"]);
    }
}
