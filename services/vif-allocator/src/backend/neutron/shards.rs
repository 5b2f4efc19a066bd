//! Port pools split between allocator replicas by the shard of their node, the way the
//! allocator splits nodes ([`crate::shards`], [`kuryr_shard`]): a replica keeps, refills,
//! recycles and hands out only the pools and ports of the nodes whose shard it owns.
//!
//! Nothing of a pool lives only in memory: every port is in Neutron with the cluster's tag and
//! `device_owner`, its node in `binding:host_id` and its pod (if any) in `device_id`. So
//! - **at start and on gaining shards** the replica reads its nodes' ports from Neutron
//!   ([`NeutronBackend::load_nodes`]) and replaces what it knew of them: free (DOWN, no
//!   device), recycling (no device, still ACTIVE) and held (by the pod in `device_id`);
//! - **on losing shards** it forgets their ports ([`NeutronBackend::forget_nodes`]);
//! - **every orphan-collection round** it adds the ports of its nodes that it does not know
//!   ([`NeutronBackend::audit`]): ones a previous owner created or handed out after this
//!   replica read Neutron (a bulk create still running when that owner was killed);
//! - **a pool port is handed out only if it is as last seen**: the update carries
//!   `If-Match: revision_number=<n>`, so a port another replica assigned meanwhile is refused by
//!   Neutron, read again and counted as held by its pod instead
//!   (`NeutronBackend::pool_port_changed`). Two pods never get one port, whatever the timing of
//!   a takeover.
//!
//! Namespace-level Neutron work (per-namespace networks: removal with the namespace) is done by
//! one replica only, the holder of shard 0 ([`NeutronBackend::leads`]), as kuryr-policy does
//! for its Neutron reconciler.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use kuryr_openstack::Filter;
use kuryr_openstack::neutron::Port;
use kuryr_shard::Ownership;
use tokio::sync::watch;

use super::pool::{Inventory, PoolKey};
use super::{Networks, NeutronBackend, Recovered, guard, neutron_err};
use crate::error::ClusterError;

/// What the backend keeps for sharding.
#[derive(Debug, Default)]
pub struct ShardState {
    /// This replica's shards; every node until set.
    ownership: OnceLock<watch::Receiver<Arc<Ownership>>>,
    /// Second ports of a pod seen by the last audit: deleted when the next one sees them still.
    suspects: Mutex<HashSet<String>>,
}

/// The inventory a list of the cluster's ports makes, for the nodes `which` selects, and the
/// ports to delete (failed bindings, second ports of one pod). `recorded` (pod uid → port id)
/// picks the port a pod keeps.
pub fn classify(
    mut ports: Vec<Port>,
    recorded: &HashMap<String, String>,
    which: &(dyn Fn(&str) -> bool + Sync),
    default_project: &str,
    keep_groups: bool,
    now: Instant,
) -> (Inventory, Vec<(String, &'static str)>, Recovered) {
    // The recorded port of a pod first, so that it is the one kept.
    ports.sort_by_key(|p| recorded.get(&p.device_id) != Some(&p.id));
    let mut inv = Inventory::default();
    let mut doomed: Vec<(String, &'static str)> = Vec::new();
    let mut summary = Recovered::default();
    for p in ports {
        // A port without a host belongs to the owner of the shard of "" (one replica).
        let node = p.binding_host_id.clone().unwrap_or_default();
        if !which(&node) {
            continue;
        }
        let sgs = if keep_groups { p.security_groups.clone() } else { Vec::new() };
        let project = p.project_id.clone().filter(|s| !s.is_empty()).unwrap_or_else(|| default_project.to_string());
        let key = PoolKey::new(&node, &project, &p.network_id, sgs);
        if p.binding_failed() || node.is_empty() {
            doomed.push((p.id.clone(), "binding_failed"));
        } else if !p.device_id.is_empty() {
            if inv.held(&p.device_id).is_some() {
                doomed.push((p.id.clone(), "duplicate"));
            } else {
                inv.assign(&p.device_id.clone(), &key, p);
                summary.in_use += 1;
            }
        } else if p.is_active() {
            inv.put_recycling(&key, p, now);
            summary.recycling += 1;
        } else {
            inv.put_free(&key, p);
            summary.free += 1;
        }
    }
    (inv, doomed, summary)
}

impl NeutronBackend {
    /// Follows this replica's shards: from now on only their nodes' pools are kept.
    pub fn follow_shards(&self, ownership: watch::Receiver<Arc<Ownership>>) {
        let _ = self.shards.ownership.set(ownership);
    }

    /// Whether `node`'s shard is this replica's (every node without sharding).
    pub fn owns_node(&self, node: &str) -> bool {
        self.shards.ownership.get().is_none_or(|o| o.borrow().owns(node))
    }

    /// Whether this replica does the namespace-level work: it holds shard 0 (or is not sharded).
    pub fn leads(&self) -> bool {
        self.shards.ownership.get().is_none_or(|o| {
            let o = o.borrow();
            o.ready && o.owns_shard(0)
        })
    }

    /// `Ok` when `node`'s pools are this replica's, else the UNAVAILABLE naming their owner.
    #[allow(clippy::result_large_err)]
    pub fn check_node(&self, node: &str) -> Result<(), tonic::Status> {
        match self.shards.ownership.get() {
            Some(o) if !o.borrow().owns(node) => {
                Err(kuryr_shard::refusal(&o.borrow().clone(), node, "kuryr-vif-allocator"))
            }
            _ => Ok(()),
        }
    }

    /// Every port of the cluster in Neutron (of the pod network, with one).
    async fn cluster_ports(&self) -> Result<Vec<Port>, ClusterError> {
        let mut filter = Filter::new();
        if let Networks::Fixed(shape) = &self.networks {
            filter = filter.network_id(&shape.network_id);
        }
        let filter = filter.device_owner(&self.device_owner).tags(std::slice::from_ref(&self.tag));
        self.neutron.list_ports(&filter).await.map_err(neutron_err("listing the cluster's ports"))
    }

    /// Reads the ports of the nodes `which` selects from Neutron and makes them what this
    /// replica knows of those nodes; deletes their failed bindings and second ports of a pod.
    pub async fn load_nodes(
        &self,
        recorded: &HashMap<String, String>,
        which: &(dyn Fn(&str) -> bool + Sync),
    ) -> Result<Recovered, ClusterError> {
        let ports = self.cluster_ports().await?;
        let (inv, doomed, mut summary) =
            classify(ports, recorded, which, &self.project, !self.security_groups.is_empty(), Instant::now());
        guard(&self.inv).replace_nodes(which, inv);
        for (id, why) in doomed {
            tracing::warn!(port = %id, why, "deleting a port found at recovery");
            self.delete_port(&id, why).await?;
            summary.deleted += 1;
        }
        self.prune_event_state();
        self.gauges();
        self.wake.notify_one();
        Ok(summary)
    }

    /// Forgets the ports of the nodes `which` selects (their shards went to another replica):
    /// no more refills, recycling or readiness watches for them here. Returns how many.
    pub fn forget_nodes(&self, which: &(dyn Fn(&str) -> bool + Sync)) -> usize {
        let gone = guard(&self.inv).forget_nodes(which);
        {
            let mut watched = guard(&self.watched);
            for id in &gone {
                watched.remove(id);
            }
        }
        self.prune_event_state();
        // The lost nodes' gauges leave with them; their new owner publishes theirs.
        self.metrics.pool_ports.clear();
        self.gauges();
        gone.len()
    }

    /// Adds the ports of this replica's nodes that Neutron has and this replica does not know
    /// (see the module docs), and deletes second ports of a pod that holds another one here
    /// when two audits in a row see them (a create whose answer was lost, then a pool port);
    /// returns how many ports were added.
    pub async fn audit(&self) -> Result<usize, ClusterError> {
        // Ports removed while Neutron is listed (a namespace network's pool drained, a port
        // handed out or released) may still be in the listing: they must not come back.
        let listed_after = guard(&self.inv).removals();
        let ports = self.cluster_ports().await?;
        let owns = |n: &str| self.owns_node(n);
        let extra: HashSet<String> = {
            let inv = guard(&self.inv);
            ports
                .iter()
                .filter(|p| !p.device_id.is_empty() && owns(p.binding_host_id.as_deref().unwrap_or_default()))
                .filter(|p| inv.held(&p.device_id).is_some_and(|h| h.id != p.id))
                .map(|p| p.id.clone())
                .collect()
        };
        let doomed: Vec<String> = {
            let mut suspects = guard(&self.shards.suspects);
            let doomed = extra.intersection(&suspects).cloned().collect();
            *suspects = extra;
            doomed
        };
        for id in &doomed {
            tracing::warn!(port = %id, "a second port of a pod that holds another one; deleting it");
            match self.delete_port(id, "duplicate").await {
                Err(ClusterError::Neutron { source, .. }) if source.is_not_found() => {}
                other => other?,
            }
        }
        let (fresh, _, _) =
            classify(ports, &HashMap::new(), &owns, &self.project, !self.security_groups.is_empty(), Instant::now());
        let added = guard(&self.inv).absorb_unknown(owns, fresh, listed_after);
        if added > 0 {
            tracing::info!(added, "ports of this replica's nodes found in Neutron and taken into the pools");
            self.gauges();
            self.wake.notify_one();
        }
        Ok(added)
    }

    /// Whether replicas share the nodes (a shard set is followed and it has shards).
    pub fn sharded(&self) -> bool {
        self.shards.ownership.get().is_some_and(|o| o.borrow().sharded())
    }

    /// The cluster's ports on `networks` that a pod holds, as Neutron has them: what a
    /// namespace network's removal waits for when other replicas' pods may hold ports on it.
    pub async fn held_in_neutron(&self, networks: &[String]) -> Result<usize, ClusterError> {
        let mut held = 0;
        for net in networks {
            let filter =
                Filter::new().network_id(net).device_owner(&self.device_owner).tags(std::slice::from_ref(&self.tag));
            let ports = self
                .neutron
                .list_ports(&filter)
                .await
                .map_err(neutron_err(format!("listing the cluster's ports on network {net}")))?;
            held += ports.iter().filter(|p| !p.device_id.is_empty()).count();
        }
        Ok(held)
    }

    /// Deletes the cluster's ports on `network` that no pod holds, whichever replica pooled
    /// them (a namespace network being removed); returns how many.
    pub async fn delete_unheld_on(&self, network: &str) -> Result<usize, ClusterError> {
        let filter =
            Filter::new().network_id(network).device_owner(&self.device_owner).tags(std::slice::from_ref(&self.tag));
        let ports = self
            .neutron
            .list_ports(&filter)
            .await
            .map_err(neutron_err(format!("listing the cluster's ports on network {network}")))?;
        let mut deleted = 0;
        for p in ports.iter().filter(|p| p.device_id.is_empty()) {
            match self.delete_port(&p.id, "namespace_deleted").await {
                Ok(()) => deleted += 1,
                Err(ClusterError::Neutron { source, .. }) if source.is_not_found() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(deleted)
    }

    /// A pool port's conditional update was refused: it changed since it was read. Read again:
    /// gone, it is dropped; held by a pod now (another replica handed it out), it is counted
    /// as that pod's; still free, it goes back to the head of its pool with its new revision.
    pub(super) async fn pool_port_changed(&self, key: &PoolKey, seen: &Port) -> Result<(), ClusterError> {
        let now = match self.neutron.get_port(&seen.id).await {
            Ok(p) => p,
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) => {
                guard(&self.inv).untake(key, seen.clone());
                return Err(neutron_err(format!("reading pool port {} again", seen.id))(e));
            }
        };
        let mut inv = guard(&self.inv);
        if now.device_id.is_empty() {
            inv.untake(key, now);
        } else if inv.held(&now.device_id).is_none() {
            tracing::info!(port = %now.id, uid = %now.device_id, "pool port was handed out by another replica; counted as its pod's");
            let uid = now.device_id.clone();
            inv.assign(&uid, key, now);
        } else {
            tracing::warn!(port = %now.id, uid = %now.device_id, "pool port was handed out by another replica to a pod holding another port; left to orphan collection");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn port(id: &str, node: &str, device: &str, status: &str) -> Port {
        Port {
            id: id.into(),
            network_id: "net".into(),
            device_id: device.into(),
            binding_host_id: Some(node.into()),
            status: status.into(),
            ..Port::default()
        }
    }

    #[test]
    fn a_replica_reads_only_its_nodes_ports_and_keeps_the_recorded_one() {
        let ports = vec![
            port("free-1", "n1", "", "DOWN"),
            port("busy-1", "n1", "uid-a", "ACTIVE"),
            port("recycling-1", "n1", "", "ACTIVE"),
            port("dup-1", "n1", "uid-b", "DOWN"),
            port("rec-1", "n1", "uid-b", "DOWN"),
            port("free-2", "n2", "", "DOWN"),
            port("busy-2", "n2", "uid-c", "ACTIVE"),
        ];
        let recorded: HashMap<String, String> = [("uid-b".to_string(), "rec-1".to_string())].into();
        let (inv, doomed, summary) = classify(ports, &recorded, &|n: &str| n == "n1", "p", false, Instant::now());
        assert_eq!(doomed, [("dup-1".to_string(), "duplicate")]);
        assert_eq!((summary.free, summary.recycling, summary.in_use), (1, 1, 2));
        assert_eq!(inv.held("uid-b").unwrap().id, "rec-1");
        assert!(inv.held("uid-c").is_none(), "another replica's node");
        assert_eq!(inv.nodes().into_iter().collect::<Vec<_>>(), ["n1"]);
    }
}
