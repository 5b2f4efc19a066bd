//! Nested pods: the node is a VM whose Neutron port is a trunk parent, and a pod's port is a
//! subport carried on the VM's interface (the uplink) under a VLAN id the allocator chose
//! (binding `BINDING_DRIVER_VLAN` with `vlan_id`). The binder gives the pod an interface on
//! that VLAN, in one of two ways (`--nested-plug`):
//!
//! - `ovs`: the VM runs its own Open vSwitch bridge (`--nested-ovs-bridge`, reached through
//!   `--ovs-db`) whose uplink is the VM's interface, and the pod's veth host end becomes an
//!   access port of that bridge with `tag=<vlan id>`: frames leave the VM tagged, untagged in the
//!   pod. Needs nothing of the kernel beyond veth.
//! - `vlan` (the production path on a VM): a kernel 802.1Q VLAN device of the uplink
//!   (`--nested-uplink`), born inside the pod's namespace already named `CNI_IFNAME` with the
//!   port's MAC and MTU, as Kuryr's `nested-vlan` driver made it; then addresses and routes as
//!   for a veth. There is no host end: deleting the device (DEL, rollback) is done in the pod.
//!   Needs the kernel's `8021q` module in the VM.
//!
//! Kuryr's `nested-macvlan` driver (macvlan devices on the VM's interface, the pods' addresses
//! as allowed address pairs of the VM's port, no trunk) is not offered.

use std::fs::File;
use std::os::fd::AsRawFd;

use kuryr_proto::allocator::v1::Vif;
use nix::errno::Errno;
use rtnetlink::LinkVlan;

use super::nl::{self, Nl};
use super::{BindingDriver, PlugError, PlugSpec, format_mac};

/// How VLAN VIFs are plugged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum NestedPlugKind {
    /// An access port (`tag=`) of the VM's own Open vSwitch bridge.
    #[default]
    Ovs,
    /// A kernel 802.1Q VLAN device on the uplink.
    Vlan,
}

/// Flags of the binder for nested pods.
#[derive(Clone, Debug, clap::Args)]
pub struct NestedArgs {
    /// How a pod whose port is a trunk subport (a VIF on a VLAN of the VM's uplink) is plugged:
    /// `ovs` (an access port of --nested-ovs-bridge with the subport's VLAN tag) or `vlan` (a
    /// kernel 802.1Q device on --nested-uplink).
    #[arg(long, env = "KURYR_NESTED_PLUG", value_enum, default_value = "ovs")]
    pub nested_plug: NestedPlugKind,

    /// The VM's Open vSwitch bridge holding its uplink, for `--nested-plug ovs`.
    #[arg(long, env = "KURYR_NESTED_OVS_BRIDGE", default_value = "br-vm")]
    pub nested_ovs_bridge: String,

    /// The VM's interface carrying the trunk's VLANs, for `--nested-plug vlan`.
    #[arg(long, env = "KURYR_NESTED_UPLINK", default_value = "eth0")]
    pub nested_uplink: String,
}

impl NestedArgs {
    /// What [`NestedPlug::driver`] needs.
    pub fn plug(&self) -> NestedPlug {
        NestedPlug {
            kind: self.nested_plug,
            ovs_bridge: self.nested_ovs_bridge.clone(),
            uplink: self.nested_uplink.clone(),
        }
    }
}

/// The nested plugging configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NestedPlug {
    pub kind: NestedPlugKind,
    pub ovs_bridge: String,
    pub uplink: String,
}

impl Default for NestedPlug {
    fn default() -> Self {
        Self { kind: NestedPlugKind::Ovs, ovs_bridge: "br-vm".into(), uplink: "eth0".into() }
    }
}

impl NestedPlug {
    /// The binding driver of a VLAN VIF.
    pub fn driver(&self, vif: &Vif, pod_uid: &str, vlan_id: u32) -> Result<BindingDriver, String> {
        let vlan = u16::try_from(vlan_id)
            .ok()
            .filter(|v| (1..=4094).contains(v))
            .ok_or_else(|| format!("VIF {} is on VLAN {vlan_id}, outside 1-4094", vif.vif_id))?;
        match self.kind {
            NestedPlugKind::Ovs => Ok(BindingDriver::Ovs {
                bridge: self.ovs_bridge.clone(),
                iface_id: vif.vif_id.clone(),
                attached_mac: vif.mac.clone(),
                vm_uuid: pod_uid.to_string(),
                vlan: Some(vlan),
            }),
            NestedPlugKind::Vlan => Ok(BindingDriver::Vlan { uplink: self.uplink.clone(), vlan }),
        }
    }
}

/// Creates the pod's interface as VLAN `vlan` of `uplink` (in the binder's namespace, the VM's),
/// born in the pod's namespace (`netns_file`) as `spec.ifname` with `mac` and the MTU. Returns
/// its index in the pod and the uplink's MAC.
pub(super) async fn add_kernel_vlan(
    spec: &PlugSpec,
    mac: [u8; 6],
    uplink: &str,
    vlan: u16,
    netns_file: &File,
    pod: &Nl,
    host: &Nl,
) -> Result<(u32, String), PlugError> {
    let ifname = spec.ifname.as_str();
    let base = host.require(uplink).await?;
    let uplink_mac = nl::link_mac(&base).map(format_mac).unwrap_or_default();
    let mut msg =
        LinkVlan::new(ifname, base.header.index, vlan).address(mac.to_vec()).setns_by_fd(netns_file.as_raw_fd());
    if spec.mtu > 0 {
        msg = msg.mtu(spec.mtu);
    }
    let op = || format!("create VLAN {vlan} of {uplink} as {ifname} in {}", spec.netns.display());
    match host.add_link(msg.build()).await {
        Ok(()) => {}
        Err(e) if nl::errno(&e) == Some(Errno::EEXIST) && pod.link(ifname).await?.is_some() => {
            return Err(PlugError::IfnameExists { netns: spec.netns.clone(), ifname: ifname.to_string() });
        }
        Err(e) => return Err(host.fail(op())(e)),
    }
    let index = pod.require(ifname).await?.header.index;
    Ok((index, uplink_mac))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vlan_vif_becomes_a_tagged_access_port() {
        let vif = Vif { vif_id: "port-1".into(), mac: "fa:16:3e:00:00:01".into(), ..Vif::default() };
        let d = NestedPlug::default().driver(&vif, "uid-1", 101).unwrap();
        assert_eq!(
            d,
            BindingDriver::Ovs {
                bridge: "br-vm".into(),
                iface_id: "port-1".into(),
                attached_mac: "fa:16:3e:00:00:01".into(),
                vm_uuid: "uid-1".into(),
                vlan: Some(101),
            }
        );
        for bad in [0, 4095, 70_000] {
            let e = NestedPlug::default().driver(&vif, "uid-1", bad).unwrap_err();
            assert!(e.contains("outside 1-4094"), "{e}");
        }
        let kernel = NestedPlug { kind: NestedPlugKind::Vlan, ..NestedPlug::default() };
        assert_eq!(kernel.driver(&vif, "uid-1", 5).unwrap(), BindingDriver::Vlan { uplink: "eth0".into(), vlan: 5 });
    }
}
