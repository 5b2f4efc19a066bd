//! Plugging a VIF into a pod: the veth pair, its addresses and routes, and its attachment to the
//! node's switch (a Linux bridge or an Open vSwitch integration bridge), as Kuryr's OVS and
//! hybrid bindings did.
//!
//! Everything here is async and never blocks the caller's executor: netlink work runs on
//! dedicated OS threads with their own current-thread runtimes ([`crate::netns`]), `ovs-vsctl`
//! runs as a child process.
//!
//! - [`plug`] creates and configures the pair and attaches the host end; a failure part-way
//!   undoes everything it did (a rollback guard, disarmed only once the caller has the result).
//! - [`unplug`] is idempotent: a gone netns, missing links and repeats are all success, as CNI
//!   DEL requires.
//! - [`inspect`] and [`diff`] back CNI CHECK.
//! - Open vSwitch is driven through `ovs-vsctl` found on PATH; `ovs_db` (`--db=...`, e.g.
//!   `unix:/run/openvswitch/db.sock`) overrides its default socket, which honours `OVS_RUNDIR`.
//! - [`ensure_bridge`], [`list_host_links`], [`link_exists`] and [`host_ifname`] support start-up
//!   and garbage collection of host-side leftovers.

mod attach;
mod check;
mod nl;
mod ovs;
pub mod routes;
pub mod vlan;

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::netns::NetnsError;

pub use self::attach::{ensure_bridge, link_exists, list_host_links, plug, plug_timed, unplug};
pub use self::check::{Expected, Observed, diff, diff_expected, inspect};
pub(crate) use self::nl::hairpin_port;

/// Prefix of every host-side interface name made by [`host_ifname`], for garbage collection.
pub const HOST_IFNAME_PREFIX: &str = "kv";

/// Longest interface name the kernel accepts (IFNAMSIZ - 1).
pub const MAX_IFNAME_LEN: usize = 15;

/// What to plug: one pod interface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlugSpec {
    /// The CNI container id; only used in log and error messages here (the host name derives
    /// from it through [`host_ifname`]).
    pub container_id: String,
    /// The pod's network namespace file (`CNI_NETNS`).
    pub netns: PathBuf,
    /// The interface name inside the pod (`CNI_IFNAME`).
    pub ifname: String,
    /// The host end's name, normally [`host_ifname`]`(container_id, ifname)`.
    pub host_ifname: String,
    /// The pod interface's MAC, `aa:bb:cc:dd:ee:ff` (the Neutron port's MAC).
    pub mac: String,
    /// MTU of both ends (the network's MTU); 0 keeps the kernel's default.
    pub mtu: u32,
    /// Addresses of the pod interface, each with its subnet's gateway if any.
    pub ips: Vec<IpConfig>,
    /// Extra routes (subnet host routes). A default route per family is added on top through
    /// the first gateway of that family, unless one is listed here.
    pub routes: Vec<Route>,
    /// How the host end joins the node's switch.
    pub driver: BindingDriver,
}

/// One address of the pod interface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpConfig {
    /// Address and prefix length, e.g. `10.0.0.5/24`.
    pub address: IpNet,
    /// The subnet's gateway: the default route of this family goes through it.
    pub gateway: Option<IpAddr>,
}

/// A route in the pod; without a gateway it is on-link (scope link).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Route {
    pub dst: IpNet,
    pub gw: Option<IpAddr>,
}

impl Route {
    /// The same route with the destination's host bits cleared, as the kernel stores it.
    pub fn normalized(&self) -> Route {
        Route { dst: self.dst.trunc(), gw: self.gw }
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.gw {
            Some(gw) => write!(f, "{} via {gw}", self.dst),
            None => write!(f, "{} on-link", self.dst),
        }
    }
}

/// How the host end of the veth pair is attached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BindingDriver {
    /// Enslaved to a Linux bridge, created (up, without addresses) if missing.
    Bridge { bridge: String },
    /// Added as a port of an Open vSwitch bridge (normally `br-int`) with the external ids the
    /// Neutron OVS agent / OVN controller use to recognise the port.
    Ovs {
        bridge: String,
        /// `external_ids:iface-id`: the Neutron port id.
        iface_id: String,
        /// `external_ids:attached-mac`: the port's MAC.
        attached_mac: String,
        /// `external_ids:vm-uuid`: the pod's UID.
        vm_uuid: String,
        /// An access port on this VLAN (`tag=`): a nested pod's subport VLAN on the VM's own
        /// Open vSwitch bridge ([`vlan`]); untagged when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vlan: Option<u16>,
    },
    /// The pod's interface is a kernel 802.1Q device of the VM's `uplink` on `vlan` (nested
    /// pods, [`vlan`]): there is no host end.
    Vlan { uplink: String, vlan: u16 },
}

/// What [`plug`] made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plugged {
    pub host_ifname: String,
    pub host_mac: String,
    pub sandbox_ifname: String,
    pub sandbox_mac: String,
    /// The netns the pod end lives in (the CNI result's `sandbox`).
    pub sandbox: PathBuf,
    /// MTU of the pod end as the kernel reports it.
    pub mtu: u32,
}

/// Why plugging, unplugging or inspecting failed. Each variant names the operation.
#[derive(Debug, thiserror::Error)]
pub enum PlugError {
    /// The pod's network namespace does not exist (or is no longer a namespace). CNI code 4 for
    /// ADD; success for DEL.
    #[error("network namespace {} does not exist", netns.display())]
    NetnsMissing { netns: PathBuf },
    /// The interface name is already taken in the pod's namespace. CNI code 4.
    #[error("interface {ifname} already exists in network namespace {}", netns.display())]
    IfnameExists { netns: PathBuf, ifname: String },
    /// An interface that must exist does not (CHECK of a pod whose interface vanished).
    #[error("interface {ifname} not found in {netns}")]
    LinkNotFound { netns: String, ifname: String },
    /// The request itself is wrong (bad MAC, interface name too long, ...).
    #[error("invalid plug request: {0}")]
    InvalidSpec(String),
    /// An interface with the bridge's name exists and is not a Linux bridge.
    #[error("{0} exists but is not a Linux bridge")]
    NotABridge(String),
    /// A netlink request failed; `op` says which.
    #[error("netlink: cannot {op}")]
    Netlink {
        op: String,
        #[source]
        source: rtnetlink::Error,
    },
    /// `ovs-vsctl` ran and failed; `detail` holds its exit status and stderr.
    #[error("ovs-vsctl {args} failed: {detail}")]
    Ovs { args: String, detail: String },
    /// `ovs-vsctl` could not be started (not installed, not on PATH).
    #[error("cannot run ovs-vsctl {args}")]
    OvsSpawn {
        args: String,
        #[source]
        source: std::io::Error,
    },
    /// Entering the namespace failed for a reason other than its absence.
    #[error(transparent)]
    Netns(NetnsError),
    /// Local resources (threads, sockets, runtimes).
    #[error("cannot {op}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The plugging thread ended without an answer (it panicked, in a build that unwinds); its
    /// rollback ran.
    #[error("the plugging thread ended without an answer")]
    ThreadDied,
}

impl PlugError {
    /// True when the pod's namespace is gone: CNI DEL treats this as success.
    pub fn is_netns_gone(&self) -> bool {
        match self {
            Self::NetnsMissing { .. } => true,
            Self::Netns(e) => e.is_gone(),
            _ => false,
        }
    }
}

impl From<NetnsError> for PlugError {
    fn from(e: NetnsError) -> Self {
        match e {
            NetnsError::NotFound { path } => Self::NetnsMissing { netns: path },
            e => Self::Netns(e),
        }
    }
}

/// The host-side interface name for a pod interface: `kv` + 12 hex digits of a 64-bit FNV-1a
/// hash of `container_id`, a NUL byte and `ifname` (14 characters, within IFNAMSIZ).
///
/// Deterministic on purpose: a restarted binder, or a CNI DEL that arrives without any state
/// (RemovePodSandbox sends one with no prevResult), recomputes the same name and finds the link
/// and its OVS port. The hash algorithm is therefore frozen; changing it would orphan every
/// plugged pod across an upgrade. 48 bits make a collision among the pods of one node
/// vanishingly unlikely.
pub fn host_ifname(container_id: &str, ifname: &str) -> String {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let bytes = container_id.as_bytes().iter().chain(&[0u8]).chain(ifname.as_bytes());
    let hash = bytes.fold(FNV_OFFSET, |h, b| (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME));
    // The top bits are the best mixed ones of FNV.
    format!("{HOST_IFNAME_PREFIX}{:012x}", hash >> 16)
}

/// Parses `aa:bb:cc:dd:ee:ff` (either case).
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for byte in &mut mac {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// Formats a hardware address as lowercase `aa:bb:...`.
pub fn format_mac(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// Checks an interface name the way the kernel does (`dev_valid_name`).
fn check_ifname(what: &str, name: &str) -> Result<(), PlugError> {
    let bad = name.is_empty()
        || name.len() > MAX_IFNAME_LEN
        || name == "."
        || name == ".."
        || name.chars().any(|c| c == '/' || c == ':' || c.is_whitespace());
    if bad {
        return Err(PlugError::InvalidSpec(format!(
            "{what} `{name}` is not a valid interface name (1-{MAX_IFNAME_LEN} bytes, no '/', ':' or spaces)"
        )));
    }
    Ok(())
}

impl PlugSpec {
    /// Validates the request; returns the MAC's bytes.
    fn validate(&self) -> Result<[u8; 6], PlugError> {
        check_ifname("ifname", &self.ifname)?;
        check_ifname("host_ifname", &self.host_ifname)?;
        let mac = parse_mac(&self.mac).ok_or_else(|| {
            PlugError::InvalidSpec(format!("mac `{}` is not of the form aa:bb:cc:dd:ee:ff", self.mac))
        })?;
        if mac[0] & 1 == 1 {
            return Err(PlugError::InvalidSpec(format!("mac `{}` is a multicast address", self.mac)));
        }
        for ip in &self.ips {
            if let Some(gw) = ip.gateway
                && gw.is_ipv4() != ip.address.addr().is_ipv4()
            {
                return Err(PlugError::InvalidSpec(format!("gateway {gw} is not of the family of {}", ip.address)));
            }
        }
        for r in &self.routes {
            if let Some(gw) = r.gw
                && gw.is_ipv4() != r.dst.addr().is_ipv4()
            {
                return Err(PlugError::InvalidSpec(format!("route {r}: gateway of another family")));
            }
        }
        match &self.driver {
            BindingDriver::Bridge { bridge } => check_ifname("bridge", bridge)?,
            BindingDriver::Ovs { bridge, iface_id, .. } => {
                if bridge.is_empty() || iface_id.is_empty() {
                    return Err(PlugError::InvalidSpec("OVS driver needs a bridge and an iface_id".to_string()));
                }
            }
            BindingDriver::Vlan { uplink, vlan } => {
                check_ifname("uplink", uplink)?;
                if !(1..=4094).contains(vlan) {
                    return Err(PlugError::InvalidSpec(format!("VLAN id {vlan} is outside 1-4094")));
                }
            }
        }
        Ok(mac)
    }

    /// The gateways with their subnets' prefix lengths (`10.0.0.1/24`): the addresses the node
    /// bridge holds for [`ensure_bridge`].
    pub fn gateway_addresses(&self) -> Vec<IpNet> {
        let mut out: Vec<IpNet> = Vec::new();
        for ip in &self.ips {
            if let Some(net) = ip.gateway.and_then(|gw| IpNet::new(gw, ip.address.prefix_len()).ok())
                && !out.contains(&net)
            {
                out.push(net);
            }
        }
        out
    }

    /// Every route the pod gets: [`PlugSpec::routes`] plus a default route per family through
    /// the first gateway of that family, unless `routes` already has a default of that family.
    pub fn all_routes(&self) -> Vec<Route> {
        let mut all: Vec<Route> = self.routes.iter().map(Route::normalized).collect();
        for v4 in [true, false] {
            let has_default = all.iter().any(|r| r.dst.prefix_len() == 0 && r.dst.addr().is_ipv4() == v4);
            let gateway = self.ips.iter().filter_map(|ip| ip.gateway).find(|gw| gw.is_ipv4() == v4);
            if let (false, Some(gw)) = (has_default, gateway) {
                let dst = if v4 { IpNet::V4(Default::default()) } else { IpNet::V6(Default::default()) };
                all.push(Route { dst, gw: Some(gw) });
            }
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> PlugSpec {
        PlugSpec {
            container_id: "c1".into(),
            netns: "/var/run/netns/x".into(),
            ifname: "eth0".into(),
            host_ifname: host_ifname("c1", "eth0"),
            mac: "02:00:00:00:00:01".into(),
            mtu: 1400,
            ips: vec![
                IpConfig { address: "10.0.0.5/24".parse().unwrap(), gateway: Some("10.0.0.1".parse().unwrap()) },
                IpConfig { address: "fd00::5/64".parse().unwrap(), gateway: Some("fd00::1".parse().unwrap()) },
                IpConfig { address: "10.1.0.5/24".parse().unwrap(), gateway: Some("10.1.0.1".parse().unwrap()) },
            ],
            routes: vec![Route { dst: "172.16.1.7/16".parse().unwrap(), gw: Some("10.0.0.254".parse().unwrap()) }],
            driver: BindingDriver::Bridge { bridge: "br0".into() },
        }
    }

    #[test]
    fn host_ifname_is_deterministic_short_and_distinct() {
        let a = host_ifname("0123456789abcdef", "eth0");
        assert_eq!(a, host_ifname("0123456789abcdef", "eth0"));
        assert_eq!(a.len(), 14);
        assert!(a.len() <= MAX_IFNAME_LEN && a.starts_with(HOST_IFNAME_PREFIX));
        assert!(a[2..].chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, host_ifname("0123456789abcdef", "eth1"));
        assert_ne!(a, host_ifname("0123456789abcdee", "eth0"));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(host_ifname("ab", "c"), host_ifname("a", "bc"));
        // Frozen: a changed value would orphan plugged pods across an upgrade.
        assert_eq!(host_ifname("", ""), "kvaf63bd4c8601");
        assert_eq!(a, "kvc152f20cf955");
    }

    #[test]
    fn macs_parse_and_format() {
        assert_eq!(parse_mac("FA:16:3e:00:0a:ff"), Some([0xfa, 0x16, 0x3e, 0, 0x0a, 0xff]));
        assert_eq!(format_mac(&[0xfa, 0x16, 0x3e, 0, 0x0a, 0xff]), "fa:16:3e:00:0a:ff");
        for bad in
            ["", "fa:16:3e:00:0a", "fa:16:3e:00:0a:ff:00", "fa:16:3e:00:0a:f", "fa-16-3e-00-0a-ff", "zz:16:3e:00:0a:ff"]
        {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }

    #[test]
    fn validation_names_the_field() {
        assert!(spec().validate().is_ok());
        let mut s = spec();
        s.ifname = "a-very-long-ifname".into();
        assert!(matches!(s.validate(), Err(PlugError::InvalidSpec(m)) if m.contains("ifname")));
        let mut s = spec();
        s.mac = "01:00:00:00:00:01".into();
        assert!(matches!(s.validate(), Err(PlugError::InvalidSpec(m)) if m.contains("multicast")));
        let mut s = spec();
        s.ips[0].gateway = Some("fd00::1".parse().unwrap());
        assert!(matches!(s.validate(), Err(PlugError::InvalidSpec(m)) if m.contains("family")));
    }

    #[test]
    fn default_routes_use_the_first_gateway_of_each_family() {
        let routes = spec().all_routes();
        assert_eq!(
            routes,
            vec![
                Route { dst: "172.16.0.0/16".parse().unwrap(), gw: Some("10.0.0.254".parse().unwrap()) },
                Route { dst: "0.0.0.0/0".parse().unwrap(), gw: Some("10.0.0.1".parse().unwrap()) },
                Route { dst: "::/0".parse().unwrap(), gw: Some("fd00::1".parse().unwrap()) },
            ]
        );
        let mut s = spec();
        s.routes.push(Route { dst: "0.0.0.0/0".parse().unwrap(), gw: Some("10.1.0.1".parse().unwrap()) });
        s.ips.retain(|ip| ip.address.addr().is_ipv4());
        let routes = s.all_routes();
        assert_eq!(routes.iter().filter(|r| r.dst.prefix_len() == 0).count(), 1);
        assert_eq!(routes.last().unwrap().gw, Some("10.1.0.1".parse().unwrap()));
    }

    #[test]
    fn gateway_addresses_carry_the_subnet_prefix() {
        let mut s = spec();
        s.ips.push(IpConfig { address: "10.0.0.6/24".parse().unwrap(), gateway: Some("10.0.0.1".parse().unwrap()) });
        let want: Vec<IpNet> =
            ["10.0.0.1/24", "fd00::1/64", "10.1.0.1/24"].iter().map(|s| s.parse().unwrap()).collect();
        assert_eq!(s.gateway_addresses(), want);
    }

    #[test]
    fn missing_netns_maps_to_its_own_variant() {
        let e = PlugError::from(NetnsError::NotFound { path: "/x".into() });
        assert!(matches!(e, PlugError::NetnsMissing { .. }));
        assert!(e.is_netns_gone());
        assert!(!PlugError::from(NetnsError::ThreadDied).is_netns_gone());
    }
}
