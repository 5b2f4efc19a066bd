//! Nested pods (`--nested-trunks`): the nodes are VMs whose Neutron port is a trunk parent, and
//! each pod's port is a subport of its node's trunk, carried on the VM's interface under a VLAN
//! id of its own (segmentation type `vlan`). The binder in the VM gives the pod an interface on
//! that VLAN ([`crate::k8s::crd::VifBinding::Vlan`], the id in the VIF's binding).
//!
//! **Which trunk is a node's.** A node's InternalIPs (from the watcher's Node objects) are looked
//! up among Neutron ports' fixed IPs; the port that is the parent of a trunk is the VM's, and
//! that trunk the node's — the way Kuryr found it. The answer is kept per node; a node that is
//! not (yet) a trunk parent gets no VIF, with the reason in the pod's Events.
//!
//! **Ports and VLAN ids.** A subport port is created like any pod port but with `device_owner`
//! `trunk:subport`, no `binding:host_id` (Neutron binds subports to the parent's host when the
//! agent wires the trunk) and no `device_id` (Neutron refuses to trunk a port with one), then
//! added to the trunk on the lowest VLAN id no subport of that trunk uses (1–4094; ids used by
//! subports that are not this cluster's are avoided too), then given the pod's uid as
//! `device_id`. A refusal of the id (`DuplicateSubPort`: another client took it meanwhile)
//! re-reads the trunk and tries the next.
//!
//! **Per-trunk pools.** With pools on (`--pool-batch` > 0) a trunk keeps spare subports, already
//! on their VLAN with no pod (`device_id` empty), refilled in bulk (one bulk create and one
//! `add_subports` call per batch) below `--pool-min`; a pod then costs one port update. A pod
//! released returns its subport to the pool under `--pool-max`; beyond it, or with pools off,
//! the subport is removed from the trunk (its VLAN id free again) and the port deleted.
//!
//! **Recovery** ([`Nested::recover`]): the trunks and this cluster's `trunk:subport` ports are
//! read back from Neutron; a port on a trunk is held by the pod in its `device_id` (a second
//! port of one pod is removed and deleted) or spare (removed and deleted with pools off: a
//! crash before the pod's uid was set); a port on no trunk (a crash between its creation and
//! `add_subports`, or between `remove_subports` and its deletion) is deleted. So after a
//! kill -9 no VLAN id is used twice and no port is left behind. A call of the killed allocator
//! still in flight in Neutron can complete after that read (a port created, a subport added, a
//! pod's uid set); such a port is unknown to the state, and the stray collector
//! ([`Nested::collect_strays`]) removes and deletes every port of the cluster's that it has
//! found unknown in two rounds [`STRAY_PERIOD`] apart.

mod backend;
mod recovery;
mod slots;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use kuryr_openstack::Filter;
use kuryr_openstack::neutron::{Neutron, Port, PortCreate, PortUpdate, SubPort};
use kuryr_runtime::Shutdown;

use self::slots::{HeldAt, Slot, State, TrunkState};
use super::pool::Limits;
use super::vif::{PortOwner, VifShape};
use super::{Recovered, guard, neutron_err, port_name};
use crate::core::{PodKey, VifBinding, VifRecord};
use crate::error::ClusterError;

/// `device_owner` of subport ports (what Neutron sets on subports too).
pub const DEVICE_OWNER: &str = "trunk:subport";

/// Attempts at adding a subport when its VLAN id is refused.
const ADD_ATTEMPTS: usize = 4;

/// Period of the stray collector: a port is removed once found unknown in two rounds.
pub const STRAY_PERIOD: Duration = Duration::from_secs(10);

/// Flags of nested mode.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct NestedArgs {
    /// Nested pods: the nodes are VMs whose Neutron port is a trunk parent (found by the node's
    /// InternalIP); pods' ports are subports of the node's trunk, each on a VLAN id of its own.
    #[arg(long, env = "KURYR_NESTED_TRUNKS")]
    pub nested_trunks: bool,
}

/// The nodes' InternalIPs, by node name (from the watcher's Node objects).
pub type NodeIps = Arc<dyn Fn() -> BTreeMap<String, Vec<String>> + Send + Sync>;

/// A pool of one trunk as the tests and the pool API read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrunkView {
    /// The trunk id.
    pub trunk: String,
    /// Its parent port.
    pub parent_port: String,
    /// VLAN id → port id of this cluster's subports held by pods.
    pub held: BTreeMap<u16, String>,
    /// VLAN id → port id of spare subports.
    pub free: BTreeMap<u16, String>,
}

/// The nested side of the Neutron backend.
pub struct Nested {
    neutron: Neutron,
    tag: String,
    project: String,
    security_groups: Vec<String>,
    reset_groups: Vec<String>,
    limits: Limits,
    node_ips: OnceLock<NodeIps>,
    state: Mutex<State>,
    /// Ports a call is working on while the state does not hold them (being created, added,
    /// assigned or released): not strays.
    busy: Mutex<HashSet<String>>,
}

/// Marks a port busy until dropped.
struct Busy<'a> {
    set: &'a Mutex<HashSet<String>>,
    id: String,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        guard(self.set).remove(&self.id);
    }
}

impl std::fmt::Debug for Nested {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nested").field("limits", &self.limits).finish_non_exhaustive()
    }
}

impl Nested {
    /// Nested mode for a backend of `project` whose ports carry `tag`.
    pub fn new(
        neutron: Neutron,
        tag: &str,
        project: &str,
        security_groups: Vec<String>,
        reset_groups: Vec<String>,
        limits: Limits,
    ) -> Self {
        Self {
            neutron,
            tag: tag.into(),
            project: project.into(),
            security_groups,
            reset_groups,
            limits,
            node_ips: OnceLock::new(),
            state: Mutex::default(),
            busy: Mutex::default(),
        }
    }

    fn busy(&self, id: &str) -> Busy<'_> {
        guard(&self.busy).insert(id.to_string());
        Busy { set: &self.busy, id: id.to_string() }
    }

    /// Where the nodes' InternalIPs are read from (set once, before pods are allocated).
    pub fn set_node_ips(&self, f: NodeIps) {
        let _ = self.node_ips.set(f);
    }

    fn ips_of(&self, node: &str) -> Vec<String> {
        self.node_ips.get().and_then(|f| f().remove(node)).unwrap_or_default()
    }

    /// A subport port: without `device_id`, which Neutron requires of a port it adds to a
    /// trunk (`PortInUse` otherwise); the pod's uid is set once it is a subport.
    fn port_create(&self, shape: &VifShape, pod: Option<&PodKey>) -> PortCreate {
        let owner = PortOwner {
            project: &self.project,
            device_owner: DEVICE_OWNER,
            security_groups: &self.security_groups,
            tag: &self.tag,
        };
        shape.port_create(owner, pod.map(port_name))
    }

    /// The VIF of a subport.
    pub fn record(shape: &VifShape, port: &Port, vlan: u16) -> Result<VifRecord, ClusterError> {
        let mut r = shape.record(port).map_err(ClusterError::NotReady)?;
        r.binding = Some(VifBinding::Vlan);
        r.vlan_id = Some(vlan);
        // The binder in the VM chooses its uplink or bridge.
        r.bridge = String::new();
        Ok(r)
    }

    /// The pod's subport and VLAN id, if it holds one.
    pub fn held(&self, pod_uid: &str) -> Option<(Port, u16)> {
        let st = guard(&self.state);
        let at = st.held.get(pod_uid)?;
        match st.trunks.get(&at.trunk)?.slots.get(&at.vlan)? {
            Slot::Held(_, p) => Some(((**p).clone(), at.vlan)),
            _ => None,
        }
    }

    /// The trunk of `node`: found once by the node's InternalIPs among Neutron ports, then kept.
    async fn trunk_of(&self, node: &str) -> Result<String, ClusterError> {
        if let Some(t) = guard(&self.state).nodes.get(node) {
            return Ok(t.clone());
        }
        let ips = self.ips_of(node);
        if ips.is_empty() {
            return Err(ClusterError::NotReady(format!(
                "node {node} has no InternalIP known yet: its trunk is found by that address"
            )));
        }
        // A trunk known already (recovered) whose parent has one of the node's addresses.
        let known = guard(&self.state)
            .trunks
            .iter()
            .find(|(_, t)| t.parent_ips.iter().any(|a| ips.contains(a)))
            .map(|(id, _)| id.clone());
        let trunk = match known {
            Some(t) => t,
            None => self.find_trunk(node, &ips).await?,
        };
        guard(&self.state).nodes.insert(node.to_string(), trunk.clone());
        tracing::info!(node, trunk, ?ips, "node's trunk found");
        Ok(trunk)
    }

    async fn find_trunk(&self, node: &str, ips: &[String]) -> Result<String, ClusterError> {
        for ip in ips {
            let filter = Filter::new().eq("fixed_ips", format!("ip_address={ip}")).fields(&["id", "fixed_ips"]);
            let ports = self
                .neutron
                .list_ports(&filter)
                .await
                .map_err(neutron_err(format!("looking up the port of node {node} ({ip})")))?;
            for p in ports {
                let trunks = self
                    .neutron
                    .list_trunks(&Filter::new().eq("port_id", p.id.clone()))
                    .await
                    .map_err(neutron_err(format!("looking up the trunk of port {}", p.id)))?;
                if let Some(t) = trunks.into_iter().next() {
                    let mut st = guard(&self.state);
                    let entry = st
                        .trunks
                        .entry(t.id.clone())
                        .or_insert_with(|| TrunkState { parent_port: t.port_id.clone(), ..TrunkState::default() });
                    entry.parent_ips = p.fixed_ips.iter().filter_map(|f| f.ip_address.clone()).collect();
                    entry.learn(&t.sub_ports);
                    return Ok(t.id);
                }
            }
        }
        Err(ClusterError::NotReady(format!(
            "node {node} is not a trunk parent: no Neutron trunk has a parent port with its addresses {ips:?}"
        )))
    }

    /// The pod's subport: a spare one of its node's trunk, or a port created and added on the
    /// lowest free VLAN id. Returns the port, its VLAN id and where it came from.
    pub async fn allocate(
        &self,
        shape: &VifShape,
        pod: &PodKey,
        node: &str,
    ) -> Result<(Port, u16, &'static str), ClusterError> {
        if let Some((p, vlan)) = self.held(&pod.uid) {
            return Ok((p, vlan, "existing"));
        }
        let trunk = self.trunk_of(node).await?;
        // A spare subport first.
        loop {
            let taken = guard(&self.state).trunks.get_mut(&trunk).and_then(TrunkState::take_free);
            let Some((vlan, port)) = taken else { break };
            let _busy = self.busy(&port.id);
            let update =
                PortUpdate { device_id: Some(pod.uid.clone()), name: Some(port_name(pod)), ..PortUpdate::default() };
            match self.neutron.update_port(&port.id, &update, None).await {
                Ok(p) => {
                    self.hold(&trunk, vlan, &pod.uid, p.clone());
                    return Ok((p, vlan, "pool"));
                }
                Err(e) if e.is_not_found() => {
                    tracing::warn!(port = %port.id, trunk, vlan, "spare subport deleted behind our back");
                    self.forget(&trunk, vlan);
                }
                Err(e) => {
                    self.set(&trunk, vlan, Slot::Free(Box::new(port.clone())));
                    return Err(neutron_err(format!("assigning spare subport {} to the pod", port.id))(e));
                }
            }
        }
        let port = self
            .neutron
            .create_port(self.port_create(shape, Some(pod)))
            .await
            .map_err(neutron_err(format!("creating a subport for pod {}/{} on {node}", pod.namespace, pod.name)))?;
        let _busy = self.busy(&port.id);
        match self.add(&trunk, std::slice::from_ref(&port)).await {
            Ok(vlans) if vlans.len() == 1 => {
                let vlan = vlans[0];
                let update = PortUpdate { device_id: Some(pod.uid.clone()), ..PortUpdate::default() };
                match self.neutron.update_port(&port.id, &update, None).await {
                    Ok(p) => {
                        self.hold(&trunk, vlan, &pod.uid, p.clone());
                        Ok((p, vlan, "add"))
                    }
                    Err(e) => {
                        // A spare subport now: the pod's retry takes it.
                        self.set(&trunk, vlan, Slot::Free(Box::new(port.clone())));
                        Err(neutron_err(format!("assigning subport {} to the pod", port.id))(e))
                    }
                }
            }
            outcome => {
                // Not on the trunk: the port goes (recovery would delete it anyway).
                if let Err(e) = self.neutron.delete_port(&port.id).await {
                    tracing::warn!(port = %port.id, error = %e, "deleting a port that is not a subport failed");
                }
                match outcome {
                    Err(e) => Err(e),
                    Ok(_) => Err(ClusterError::NotReady(format!("trunk {trunk} has no free VLAN id"))),
                }
            }
        }
    }

    /// Adds `ports` to `trunk`, each on a free VLAN id; returns the ids in the ports' order.
    async fn add(&self, trunk: &str, ports: &[Port]) -> Result<Vec<u16>, ClusterError> {
        let mut last = None;
        for _ in 0..ADD_ATTEMPTS {
            let vlans = guard(&self.state).trunks.get_mut(trunk).map(|t| t.reserve(ports.len())).unwrap_or_default();
            if vlans.len() < ports.len() {
                for v in vlans {
                    self.forget(trunk, v);
                }
                return Ok(Vec::new());
            }
            let subs: Vec<SubPort> = ports.iter().zip(&vlans).map(|(p, v)| SubPort::vlan(p.id.clone(), *v)).collect();
            match self.neutron.add_subports(trunk, &subs).await {
                Ok(_) => return Ok(vlans),
                Err(e) => {
                    for v in &vlans {
                        self.forget(trunk, *v);
                    }
                    let taken = e.fault().and_then(|f| f.kind.as_deref()) == Some("DuplicateSubPort");
                    if !taken {
                        return Err(neutron_err(format!("adding subports to trunk {trunk}"))(e));
                    }
                    // Someone else took an id: read the trunk again and retry.
                    tracing::warn!(trunk, ?vlans, error = %e, "VLAN ids refused; re-reading the trunk");
                    let t =
                        self.neutron.get_trunk(trunk).await.map_err(neutron_err(format!("reading trunk {trunk}")))?;
                    if let Some(ts) = guard(&self.state).trunks.get_mut(trunk) {
                        ts.learn(&t.sub_ports);
                    }
                    last = Some(e);
                }
            }
        }
        Err(match last {
            Some(e) => neutron_err(format!("adding subports to trunk {trunk}"))(e),
            None => ClusterError::NotReady(format!("trunk {trunk}: no VLAN id could be added")),
        })
    }

    fn set(&self, trunk: &str, vlan: u16, slot: Slot) {
        if let Some(t) = guard(&self.state).trunks.get_mut(trunk) {
            t.slots.insert(vlan, slot);
        }
    }

    fn forget(&self, trunk: &str, vlan: u16) {
        if let Some(t) = guard(&self.state).trunks.get_mut(trunk) {
            t.slots.remove(&vlan);
        }
    }

    fn hold(&self, trunk: &str, vlan: u16, uid: &str, port: Port) {
        let mut st = guard(&self.state);
        if let Some(t) = st.trunks.get_mut(trunk) {
            t.slots.insert(vlan, Slot::Held(uid.to_string(), Box::new(port)));
        }
        st.held.insert(uid.to_string(), HeldAt { trunk: trunk.to_string(), vlan });
    }

    /// Whether the trunk of `node` is below its pool minimum (and no refill runs): if so, the
    /// refill is marked running and its size returned.
    pub fn refill_wanted(&self, node: &str) -> Option<(String, u32)> {
        if !self.limits.pooling() {
            return None;
        }
        let mut st = guard(&self.state);
        let trunk = st.nodes.get(node)?.clone();
        let t = st.trunks.get_mut(&trunk)?;
        let spare = t.spare();
        if t.filling || spare >= self.limits.min {
            return None;
        }
        let want = self.limits.batch.max(self.limits.min - spare);
        let n = if self.limits.max == 0 { want } else { want.min(self.limits.max.saturating_sub(spare)) };
        if n == 0 {
            return None;
        }
        t.filling = true;
        Some((trunk, n))
    }

    /// Creates `n` spare subports on `trunk` (one bulk create, one `add_subports`); returns how
    /// many joined. Ends the refill [`Nested::refill_wanted`] marked.
    pub async fn refill(&self, shape: &VifShape, trunk: &str, n: u32) -> Result<u32, ClusterError> {
        let result = self.fill(shape, trunk, n).await;
        if let Some(t) = guard(&self.state).trunks.get_mut(trunk) {
            t.filling = false;
        }
        result
    }

    async fn fill(&self, shape: &VifShape, trunk: &str, n: u32) -> Result<u32, ClusterError> {
        let specs = (0..n).map(|_| self.port_create(shape, None)).collect();
        let ports = self
            .neutron
            .create_ports(specs)
            .await
            .map_err(neutron_err(format!("creating {n} spare subports for trunk {trunk}")))?;
        let _busy: Vec<Busy<'_>> = ports.iter().map(|p| self.busy(&p.id)).collect();
        match self.add(trunk, &ports).await {
            Ok(vlans) if vlans.len() == ports.len() => {
                for (p, v) in ports.into_iter().zip(vlans) {
                    self.set(trunk, v, Slot::Free(Box::new(p)));
                }
                Ok(n)
            }
            outcome => {
                for p in &ports {
                    let _ = self.neutron.delete_port(&p.id).await;
                }
                outcome.map(|_| 0)
            }
        }
    }

    /// Releases the pod's subport: back to its trunk's pool (device_id cleared) under the pool's
    /// maximum, else removed from the trunk and deleted. `Ok(false)`: the pod held none.
    pub async fn release(&self, pod: &PodKey) -> Result<bool, ClusterError> {
        let (at, port, keep) = {
            let mut st = guard(&self.state);
            let Some(at) = st.held.remove(&pod.uid) else { return Ok(false) };
            let Some(t) = st.trunks.get_mut(&at.trunk) else { return Ok(false) };
            let keep = self.limits.pooling() && (self.limits.max == 0 || t.spare() < self.limits.max);
            match t.slots.insert(at.vlan, Slot::Reserved) {
                Some(Slot::Held(_, p)) => (at, *p, keep),
                other => {
                    // Not what the pod held: put back whatever was there.
                    match other {
                        Some(s) => t.slots.insert(at.vlan, s),
                        None => t.slots.remove(&at.vlan),
                    };
                    return Ok(false);
                }
            }
        };
        let _busy = self.busy(&port.id);
        let outcome = if keep {
            match self.neutron.update_port(&port.id, &super::recycled(&self.reset_groups), None).await {
                Ok(p) => {
                    self.set(&at.trunk, at.vlan, Slot::Free(Box::new(p)));
                    return Ok(true);
                }
                Err(e) if e.is_not_found() => Ok(()),
                Err(e) => Err(neutron_err(format!("returning subport {} to the pool", port.id))(e)),
            }
        } else {
            self.remove_and_delete(&at.trunk, &port.id).await
        };
        match outcome {
            Ok(()) => {
                self.forget(&at.trunk, at.vlan);
                Ok(true)
            }
            Err(e) => {
                self.hold(&at.trunk, at.vlan, &pod.uid, port);
                Err(e)
            }
        }
    }

    /// Removes a subport from its trunk and deletes its port; either already done is fine.
    async fn remove_and_delete(&self, trunk: &str, port: &str) -> Result<(), ClusterError> {
        match self.neutron.remove_subports(trunk, &[port.to_string()]).await {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(neutron_err(format!("removing subport {port} from trunk {trunk}"))(e)),
        }
        match self.neutron.delete_port(port).await {
            Ok(_) => Ok(()),
            Err(e) => Err(neutron_err(format!("deleting port {port}"))(e)),
        }
    }
}
