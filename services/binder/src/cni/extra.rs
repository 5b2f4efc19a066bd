//! A pod's further interfaces (the `k8s.v1.cni.cncf.io/networks` annotation): the allocator
//! streams them inside the pod's VIF (`Vif.attachments`), and the ADD of the primary interface
//! plugs them all, each on its own network's bridge, named as the pod asked (`net1`, `net2`, ...
//! by default): a Linux bridge for the embedded backend's, and for Neutron ports the Open vSwitch
//! integration bridge with the port id as `iface-id`, exactly as the primary interface is plugged
//! (the same [`BindingDriver::Ovs`], the same unplug).
//!
//! Each is recorded as an attachment of its own (container id + its interface name) whose
//! `primary` names the primary interface: DEL, GC, the rollback of a failed ADD and recovery
//! after a crash remove them with the primary one. They carry no default route (the primary
//! interface has those): only the routes their VIF lists, the network through its gateway.
//! CHECK verifies the primary interface only.

use std::path::{Path, PathBuf};
use std::sync::PoisonError;

use kuryr_cni_types::{CniError, code};
use kuryr_proto::allocator::v1::Vif;
use kuryr_proto::binder::v1 as pb;

use kuryr_proto::allocator::v1::BindingDriver as ProtoDriver;

use super::{CniService, driver_of, driver_of_record, plug_failure};
use crate::attachments::{Attachment, State};
use crate::plug::{self, BindingDriver, PlugSpec};

type CniResult<T> = Result<T, CniError>;

/// A further interface plugged by this ADD (or, for a repeated ADD, found plugged).
#[derive(Clone, Debug)]
pub struct PluggedExtra {
    /// Its record.
    pub att: Attachment,
    /// Its VIF as the allocator streamed it.
    pub vif: Vif,
    /// What plugging made.
    pub plugged: plug::Plugged,
}

impl CniService {
    /// Plugs the further interfaces `vif` carries into the pod of `primary`, recording each (in
    /// state Adding) before plugging it. On an error the caller's rollback of `primary` removes
    /// those already plugged.
    pub(crate) async fn plug_extras(
        &self,
        primary: &Attachment,
        vif: &Vif,
        netns: &Path,
    ) -> CniResult<Vec<PluggedExtra>> {
        let pod = format!("{}/{}", primary.pod_namespace, primary.pod_name);
        let mut out = Vec::with_capacity(vif.attachments.len());
        for a in &vif.attachments {
            let what = format!("interface {} of pod {pod} (network {})", a.ifname, a.attachment);
            let inner =
                a.vif.clone().ok_or_else(|| CniError::new(code::IO, format!("{what}: the allocator sent no VIF")))?;
            if a.ifname == primary.ifname {
                return Err(CniError::new(
                    code::INVALID_ENVIRONMENT,
                    format!("{what}: the runtime gave the primary interface that name (CNI_IFNAME); pick another"),
                ));
            }
            let bridge = inner
                .binding
                .as_ref()
                .map(|b| b.bridge.clone())
                .filter(|b| !b.is_empty())
                .ok_or_else(|| CniError::new(code::IO, format!("{what}: the VIF names no bridge")))?;
            // The embedded backend's on a Linux bridge; a Neutron port on Open vSwitch with its
            // port id as `iface-id`, as the primary interface.
            let driver = match inner.binding.as_ref().map(|b| b.driver()) {
                Some(ProtoDriver::Ovs) => driver_of(&inner, &primary.pod_uid, &self.nested)?,
                Some(ProtoDriver::Vlan) => {
                    return Err(CniError::new(
                        code::INVALID_CONFIG,
                        format!("{what}: further interfaces on VLANs (nested pods) are not supported"),
                    ));
                }
                _ => BindingDriver::Bridge { bridge: bridge.clone() },
            };
            let mut spec = PlugSpec::from_vif(&primary.container_id, netns, &a.ifname, &inner, driver.clone())
                .map_err(|e| CniError::new(code::IO, format!("{what}: the VIF is unusable: {e}")))?;
            let gateways = spec.gateway_addresses();
            // No default route through a further interface.
            for ip in &mut spec.ips {
                ip.gateway = None;
            }
            let mut att = Attachment {
                container_id: primary.container_id.clone(),
                ifname: a.ifname.clone(),
                netns: primary.netns.clone(),
                host_ifname: spec.host_ifname.clone(),
                pod_uid: primary.pod_uid.clone(),
                pod_namespace: primary.pod_namespace.clone(),
                pod_name: primary.pod_name.clone(),
                vif_id: inner.vif_id.clone(),
                driver: if matches!(driver, BindingDriver::Ovs { .. }) { "ovs" } else { "bridge" }.into(),
                bridge: bridge.clone(),
                ips: spec.ips.iter().map(|ip| ip.address.addr()).collect(),
                port_mappings: Vec::new(),
                state: State::Adding,
                host_mac: String::new(),
                sandbox_mac: String::new(),
                primary: Some(primary.ifname.clone()),
                report_pending: false,
            };
            self.attachments
                .put(&att)
                .map_err(|e| CniError::new(code::IO, format!("cannot record the attachment of {what}: {e}")))?;
            let key = (bridge, gateways);
            let linux_bridge = matches!(driver, BindingDriver::Bridge { .. });
            if linux_bridge && !self.bridges_ready.lock().unwrap_or_else(PoisonError::into_inner).contains(&key) {
                plug::ensure_bridge(&key.0, &key.1)
                    .await
                    .map_err(|e| plug_failure(e, &format!("preparing bridge {} for {what}", key.0)))?;
                self.bridges_ready.lock().unwrap_or_else(PoisonError::into_inner).insert(key.clone());
            }
            let plugged = match plug::plug(&spec, self.ovs_db.as_deref()).await {
                Ok(p) => p,
                Err(e) => {
                    self.bridges_ready.lock().unwrap_or_else(PoisonError::into_inner).remove(&key);
                    return Err(plug_failure(e, &format!("plugging {what}")));
                }
            };
            att.host_mac.clone_from(&plugged.host_mac);
            att.sandbox_mac.clone_from(&plugged.sandbox_mac);
            out.push(PluggedExtra { att, vif: inner, plugged });
        }
        Ok(out)
    }

    /// Records the further interfaces of a successful ADD as Ready (before the primary one, so
    /// that a crash in between rolls them back with it).
    pub(crate) fn extras_ready(&self, extras: &mut [PluggedExtra]) -> CniResult<()> {
        for e in extras {
            e.att.state = State::Ready;
            self.attachments.put(&e.att).map_err(|err| {
                CniError::new(code::IO, format!("cannot record the attachment of {}: {err}", e.att.ifname))
            })?;
        }
        Ok(())
    }

    /// The records of the further interfaces plugged with `container_id`/`ifname`.
    pub(crate) fn extras_of(&self, container_id: &str, ifname: &str) -> Vec<Attachment> {
        self.attachments.filter(|a| a.container_id == container_id && a.primary.as_deref() == Some(ifname))
    }

    /// The further interfaces of a live attachment, for a repeated ADD's answer: in the order of
    /// the VIF's, as the first ADD answered.
    pub(crate) fn live_extras(&self, primary: &Attachment, vif: &Vif, netns: &Path) -> Vec<PluggedExtra> {
        let records = self.extras_of(&primary.container_id, &primary.ifname);
        let mut out = Vec::new();
        for a in &vif.attachments {
            let (Some(att), Some(inner)) = (records.iter().find(|r| r.ifname == a.ifname).cloned(), a.vif.clone())
            else {
                continue;
            };
            let plugged = plug::Plugged {
                host_ifname: att.host_ifname.clone(),
                host_mac: att.host_mac.clone(),
                sandbox_ifname: att.ifname.clone(),
                sandbox_mac: if att.sandbox_mac.is_empty() { inner.mac.clone() } else { att.sandbox_mac.clone() },
                sandbox: netns.to_path_buf(),
                mtu: inner.mtu,
            };
            out.push(PluggedExtra { att, vif: inner, plugged });
        }
        out
    }

    /// Unplugs and forgets the further interfaces of `primary`; every step tolerates what is
    /// gone already.
    pub(crate) async fn teardown_extras(&self, primary: &Attachment, netns: Option<PathBuf>) {
        for e in self.extras_of(&primary.container_id, &primary.ifname) {
            let driver = driver_of_record(&e);
            if let Err(err) =
                plug::unplug(netns.clone(), &e.ifname, &e.host_ifname, &driver, self.ovs_db.as_deref()).await
            {
                tracing::warn!(container = e.container_id, ifname = e.ifname, error = %err, "unplugging a further interface failed");
            }
            if let Err(err) = self.attachments.remove(&e.container_id, &e.ifname) {
                tracing::error!(container = e.container_id, ifname = e.ifname, error = %err,
                    "cannot remove the attachment record");
            }
        }
    }
}

/// Adds the further interfaces to an ADD's result: host and pod ends, and their addresses tied
/// to the pod end's index. Their gateways are left out (they route nothing by default).
pub fn append_results(result: &mut pb::CniResult, extras: &[PluggedExtra]) {
    for e in extras {
        result.interfaces.push(pb::Interface {
            name: e.plugged.host_ifname.clone(),
            mac: e.plugged.host_mac.clone(),
            mtu: e.vif.mtu,
            sandbox: String::new(),
        });
        let index = u32::try_from(result.interfaces.len()).unwrap_or(u32::MAX);
        result.interfaces.push(pb::Interface {
            name: e.att.ifname.clone(),
            mac: e.plugged.sandbox_mac.clone(),
            mtu: e.vif.mtu,
            sandbox: e.plugged.sandbox.display().to_string(),
        });
        result.ips.extend(e.vif.ips.iter().map(|ip| pb::IpConfig {
            address: ip.address.clone(),
            gateway: String::new(),
            interface: Some(index),
        }));
        result
            .routes
            .extend(e.vif.routes.iter().map(|r| pb::Route { dst: r.destination.clone(), gw: r.gateway.clone() }));
    }
}
