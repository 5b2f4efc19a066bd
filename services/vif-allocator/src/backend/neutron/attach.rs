//! Further interfaces of pods on Neutron networks (the `k8s.v1.cni.cncf.io/networks`
//! annotation, see [`crate::core::attach`]): one more Neutron port per NetworkAttachmentDefinition the
//! pod names, on the definition's network.
//!
//! - **Ports.** Made on the pod's allocation path, all of a pod's missing ones in one bulk create,
//!   like the pod's own port: `device_id` the pod's uid, `binding:host_id` its node, the project,
//!   the cluster's tag, fixed IPs on the definition's subnets (every subnet of the network when
//!   it names none), the definition's security groups or else the pods' primary ones — and
//!   [`ATTACH_OWNER`] as `device_owner`, which keeps them out of the pools and their recovery.
//!   A pod's ports are looked up first (`device_id` and owner): an allocation repeated after a
//!   crash finds the ports it made before instead of making more.
//! - **Readiness.** The pod's VIF is READY once its own port *and* its further ports are ACTIVE:
//!   when the own port turns ACTIVE while further ports are expected, the pod waits here, and a
//!   loop reads the waiting pods' further ports in one batched list per round.
//! - **Release.** The pod's cleanup deletes every port with its uid and [`ATTACH_OWNER`]; the
//!   orphan rounds delete such ports of this replica's nodes whose pod the allocator does not
//!   know (deleted while no allocator ran, or a crash between creating the ports and recording
//!   them), so that none leaks.

use std::collections::BTreeMap;

use super::*;
use crate::core::{AttachedRecord, VifBinding};

/// The `device_owner` of further ports.
pub const ATTACH_OWNER: &str = "compute:kuryr-attach";

/// How long a resolved network (id, subnets, MTU) is used before it is read again.
const SHAPE_TTL: Duration = Duration::from_secs(30);

/// How often the further ports of pods whose own port is ACTIVE are read.
const EXTRA_POLL: Duration = Duration::from_millis(300);

/// One further port a pod asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtraRequest {
    /// The NetworkAttachmentDefinition, `namespace/name`.
    pub attachment: String,
    /// The interface name in the pod.
    pub ifname: String,
    /// The network id or unique name.
    pub network: String,
    /// Subnet ids; empty: every subnet of the network.
    pub subnets: Vec<String>,
    /// Security group ids; absent: the pods' primary groups.
    pub security_groups: Option<Vec<String>>,
}

/// A further network as definitions name it: (network id or name, subnet ids).
type ShapeKey = (String, Vec<String>);

/// What the backend keeps about further ports.
#[derive(Debug, Default)]
pub(super) struct AttachState {
    /// (network, subnets) as a definition names them → when read, and the shape.
    shapes: Mutex<HashMap<ShapeKey, (Instant, VifShape)>>,
    /// Pod uid → its further ports.
    ports: Mutex<HashMap<String, Vec<String>>>,
    /// Pod uid → its own port, ACTIVE, waiting for the further ones.
    waiting: Mutex<BTreeMap<String, (String, Instant)>>,
    wake: Notify,
}

fn looks_like_id(s: &str) -> bool {
    s.len() == 36
        && s.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
        && s.bytes().filter(|b| *b == b'-').count() == 4
}

impl NeutronBackend {
    /// The VIF shape of a further network: the network read by id or unique name, its subnets
    /// (those named, each checked to be on it, or all of them), read again after [`SHAPE_TTL`].
    async fn extra_shape(&self, r: &ExtraRequest) -> Result<VifShape, ClusterError> {
        let key = (r.network.clone(), r.subnets.clone());
        if let Some((at, shape)) = guard(&self.attached.shapes).get(&key)
            && at.elapsed() < SHAPE_TTL
        {
            return Ok(shape.clone());
        }
        let what = format!("NetworkAttachmentDefinition {}", r.attachment);
        let network = if looks_like_id(&r.network) {
            match self.neutron.get_network(&r.network).await {
                Ok(n) => n,
                Err(e) if e.is_not_found() => {
                    return Err(ClusterError::Attachment(format!(
                        "{what} names Neutron network {}, which does not exist",
                        r.network
                    )));
                }
                Err(e) => return Err(neutron_err(format!("reading Neutron network {}", r.network))(e)),
            }
        } else {
            let mut found = self
                .neutron
                .list_networks(&Filter::new().name(&r.network))
                .await
                .map_err(neutron_err(format!("looking up Neutron network {:?}", r.network)))?;
            match found.len() {
                1 => found.remove(0),
                0 => {
                    return Err(ClusterError::Attachment(format!(
                        "{what} names Neutron network {:?}, and no network has that id or name",
                        r.network
                    )));
                }
                n => {
                    return Err(ClusterError::Attachment(format!(
                        "{what} names Neutron network {:?}, and {n} networks have that name: name it by id",
                        r.network
                    )));
                }
            }
        };
        let ids = if r.subnets.is_empty() { network.subnets.clone() } else { r.subnets.clone() };
        if ids.is_empty() {
            return Err(ClusterError::Attachment(format!("{what}: Neutron network {} has no subnet", network.id)));
        }
        let mut subnets = Vec::with_capacity(ids.len());
        for id in &ids {
            let s = match self.neutron.get_subnet(id).await {
                Ok(s) => s,
                Err(e) if e.is_not_found() => {
                    return Err(ClusterError::Attachment(format!(
                        "{what} names Neutron subnet {id}, which does not exist"
                    )));
                }
                Err(e) => return Err(neutron_err(format!("reading Neutron subnet {id}"))(e)),
            };
            if s.network_id != network.id {
                return Err(ClusterError::Attachment(format!(
                    "{what}: subnet {id} is on network {}, not on {}",
                    s.network_id, network.id
                )));
            }
            subnets.push(SubnetInfo::from_subnet(&s).map_err(|e| ClusterError::Attachment(format!("{what}: {e}")))?);
        }
        let bridge = match &self.networks {
            Networks::Fixed(shape) => shape.bridge.clone(),
            Networks::PerNamespace(nn) => nn.bridge().to_string(),
        };
        let shape = VifShape { network_id: network.id.clone(), subnets, mtu: network.mtu.unwrap_or(1500), bridge };
        guard(&self.attached.shapes).insert(key, (Instant::now(), shape.clone()));
        Ok(shape)
    }

    /// Gives the pod one port per request on `node`, made here or found made before, and
    /// returns them as the pod's further interfaces, in the order asked.
    pub async fn attach_ports(
        &self,
        pod: &PodKey,
        node: &str,
        requests: &[ExtraRequest],
    ) -> Result<Vec<AttachedRecord>, ClusterError> {
        if !self.is_recovered() {
            return Err(ClusterError::NotReady("the Neutron ports are still being recovered".into()));
        }
        if self.nested.is_some() {
            return Err(ClusterError::Attachment(format!(
                "annotation {}: further interfaces are not supported for nested pods (--nested-trunks)",
                crate::core::attach::NETWORKS_ANNOTATION
            )));
        }
        let mut shapes: Vec<VifShape> = Vec::with_capacity(requests.len());
        for r in requests {
            let shape = self.extra_shape(r).await?;
            if let Networks::Fixed(primary) = &self.networks
                && primary.network_id == shape.network_id
            {
                return Err(ClusterError::Attachment(format!(
                    "NetworkAttachmentDefinition {} names the pods' primary network {}: a further interface needs \
                     another network",
                    r.attachment, shape.network_id
                )));
            }
            if let Some((other, _)) = requests.iter().zip(&shapes).find(|(_, s)| s.network_id == shape.network_id) {
                return Err(ClusterError::Attachment(format!(
                    "annotation {}: Neutron network {} is asked for twice ({} and {}); a pod gets one interface per \
                     network",
                    crate::core::attach::NETWORKS_ANNOTATION,
                    shape.network_id,
                    other.attachment,
                    r.attachment
                )));
            }
            shapes.push(shape);
        }
        let mut have = self.extra_ports_of(pod).await?;
        let missing: Vec<usize> =
            (0..requests.len()).filter(|&i| !have.iter().any(|p| p.network_id == shapes[i].network_id)).collect();
        if !missing.is_empty() {
            let specs = missing
                .iter()
                .map(|&i| {
                    let groups = requests[i].security_groups.clone().unwrap_or_else(|| self.security_groups.clone());
                    PortCreate {
                        device_owner: Some(ATTACH_OWNER.into()),
                        security_groups: (!groups.is_empty()).then_some(groups),
                        ..self.port_create(&shapes[i], node, Some(pod))
                    }
                })
                .collect();
            let made = self.neutron.create_ports(specs).await.map_err(neutron_err(format!(
                "creating {} further port(s) for pod {}/{} on {node}",
                missing.len(),
                pod.namespace,
                pod.name
            )))?;
            self.metrics.created("attach", made.len() as u64);
            if let Some(bad) = made.iter().find(|p| p.binding_failed()) {
                let port = bad.id.clone();
                for p in &made {
                    if let Err(e) = self.delete_port(&p.id, "binding_failed").await {
                        tracing::warn!(port = %p.id, error = %crate::error::chain(&e),
                            "deleting a further port that failed to bind failed; the pod's cleanup retries");
                    }
                }
                return Err(ClusterError::BindingFailed { port, host: node.to_string() });
            }
            have.extend(made);
        }
        let mut out = Vec::with_capacity(requests.len());
        for (r, shape) in requests.iter().zip(&shapes) {
            let Some(port) = have.iter().find(|p| p.network_id == shape.network_id) else {
                return Err(ClusterError::NotReady(format!("the further port on {} vanished", shape.network_id)));
            };
            let v = self.record(shape, port)?;
            out.push(AttachedRecord {
                attachment: r.attachment.clone(),
                ifname: r.ifname.clone(),
                network: shape.network_id.clone(),
                vif_id: v.vif_id,
                mac: v.mac,
                mtu: v.mtu,
                ips: v.ips,
                routes: v.routes,
                bridge: v.bridge,
                binding: Some(VifBinding::Ovs),
                subnet_ids: v.subnet_ids,
                security_groups: v.security_groups,
            });
        }
        self.expect_extras(&pod.uid, out.iter().map(|a| a.vif_id.clone()).collect());
        Ok(out)
    }

    /// The pod's further ports in Neutron.
    async fn extra_ports_of(&self, pod: &PodKey) -> Result<Vec<Port>, ClusterError> {
        let filter = Filter::new().device_id(&pod.uid).device_owner(ATTACH_OWNER).tags(std::slice::from_ref(&self.tag));
        self.neutron
            .list_ports(&filter)
            .await
            .map_err(neutron_err(format!("looking up the further ports of pod {}", pod.uid)))
    }

    /// Deletes every further port of the pod; returns how many were deleted.
    pub async fn detach_ports(&self, pod: &PodKey) -> Result<usize, ClusterError> {
        let ports = self.extra_ports_of(pod).await?;
        let mut deleted = 0;
        for p in &ports {
            match self.delete_port(&p.id, "released").await {
                Ok(()) => deleted += 1,
                Err(ClusterError::Neutron { source, .. }) if source.is_not_found() => {}
                Err(e) => return Err(e),
            }
        }
        guard(&self.attached.ports).remove(&pod.uid);
        guard(&self.attached.waiting).remove(&pod.uid);
        if deleted > 0 {
            tracing::info!(uid = %pod.uid, deleted, "further ports deleted");
        }
        Ok(deleted)
    }

    /// The cluster's further ports on this replica's nodes: (port id, pod uid).
    pub async fn extra_ports(&self) -> Result<Vec<(String, String)>, ClusterError> {
        let filter = Filter::new().device_owner(ATTACH_OWNER).tags(std::slice::from_ref(&self.tag));
        let ports =
            self.neutron.list_ports(&filter).await.map_err(neutron_err("listing the cluster's further ports"))?;
        Ok(ports
            .into_iter()
            .filter(|p| self.owns_node(p.binding_host_id.as_deref().unwrap_or_default()))
            .map(|p| (p.id, p.device_id))
            .collect())
    }

    /// Deletes further ports whose pod is gone (the orphan rounds); returns how many.
    pub async fn delete_orphan_extras(&self, ports: &[(String, String)]) -> usize {
        let mut deleted = 0;
        for (id, uid) in ports {
            tracing::info!(port = %id, uid = %uid, "further port of a pod that no longer exists; deleting it");
            match self.delete_port(id, "orphan").await {
                Ok(()) => deleted += 1,
                Err(ClusterError::Neutron { source, .. }) if source.is_not_found() => {}
                Err(e) => {
                    tracing::warn!(port = %id, error = %crate::error::chain(&e), "deleting an orphaned further port failed; retried next round");
                }
            }
            guard(&self.attached.ports).remove(uid);
            guard(&self.attached.waiting).remove(uid);
        }
        deleted
    }

    /// The pod's VIF is ready only once `ports` (its further ports) are ACTIVE too.
    pub fn expect_extras(&self, pod_uid: &str, ports: Vec<String>) {
        let mut g = guard(&self.attached.ports);
        if ports.is_empty() {
            g.remove(pod_uid);
        } else {
            g.insert(pod_uid.to_string(), ports);
        }
    }

    /// The pod's own port `port` is ACTIVE: true when it has further ports to wait for (then
    /// the pod is ready once they are ACTIVE: [`NeutronBackend::wait_extras`]).
    pub(super) fn hold_for_extras(&self, pod_uid: &str, port: &str) -> bool {
        if guard(&self.attached.ports).get(pod_uid).is_none_or(Vec::is_empty) {
            return false;
        }
        guard(&self.attached.waiting).insert(pod_uid.to_string(), (port.to_string(), Instant::now()));
        self.attached.wake.notify_one();
        true
    }

    /// Stops waiting for the further ports of the pod whose own port is `port`.
    pub(super) fn unhold(&self, port: &str) {
        guard(&self.attached.waiting).retain(|_, (p, _)| p != port);
    }

    /// Reads the further ports of the waiting pods, all in one batched list per round, and
    /// hands a pod's VIF to READY once all of them are ACTIVE.
    pub(super) async fn wait_extras(self: Arc<Self>, shutdown: Shutdown) {
        loop {
            let idle = guard(&self.attached.waiting).is_empty();
            if idle {
                tokio::select! {
                    () = self.attached.wake.notified() => {}
                    () = shutdown.clone().wait() => return,
                }
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep(EXTRA_POLL) => {}
                () = shutdown.clone().wait() => return,
            }
            let waiting: Vec<(String, String, Vec<String>)> = {
                let w = guard(&self.attached.waiting);
                let ports = guard(&self.attached.ports);
                w.iter()
                    .map(|(uid, (own, _))| (uid.clone(), own.clone(), ports.get(uid).cloned().unwrap_or_default()))
                    .collect()
            };
            let ids: Vec<String> = waiting.iter().flat_map(|(_, _, p)| p.iter().cloned()).collect();
            let active: HashSet<String> =
                match self.neutron.list_ports_by_ids(&ids, &Filter::new().fields(&["id", "status"])).await {
                    Ok(ports) => ports.into_iter().filter(|p| p.status == "ACTIVE").map(|p| p.id).collect(),
                    Err(e) => {
                        tracing::warn!(error = %e, "reading the further ports' status failed; retrying");
                        continue;
                    }
                };
            for (uid, own, extras) in waiting {
                if extras.iter().all(|p| active.contains(p)) {
                    let since = guard(&self.attached.waiting).remove(&uid).map(|(_, at)| at);
                    if let Some(at) = since {
                        tracing::debug!(uid = %uid, port = %own, after_ms = at.elapsed().as_millis() as u64,
                            "further ports ACTIVE");
                        self.send_ready(uid, own);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::looks_like_id;

    #[test]
    fn ids_and_names_are_told_apart() {
        assert!(looks_like_id("0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"));
        assert!(!looks_like_id("red-net"));
        assert!(!looks_like_id("0b1c2d3e-4f50-6172-8394-a5b6c7d8e9fz"));
    }
}
