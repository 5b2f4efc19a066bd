//! Host ports: a pod's `ports[].hostPort`, reachable at `<hostIP or any node address>:<hostPort>`,
//! programmed by the binder itself in the node's table `inet kuryr` rather than by chaining the
//! reference `portmap` plugin: one table for everything kuryr does to the node's packets, no
//! iptables, no second binary to install, and the binder's own records to reconcile from.
//!
//! Each mapping is one element of a DNAT map ([`crate::table`]): `hostports4`/`6` keyed by
//! `host IP . protocol . host port` when the pod names a host IP, `hostports_any4`/`6` keyed by
//! `protocol . host port` (matched on any local address) when it does not; the value is the pod's
//! address and container port. So a pod's host ports cost no chain and no rule, and the lookup
//! does not grow with the pods. Masquerading is generic: the node reaching a host port on
//! 127.0.0.1 is masqueraded (the pod could not answer 127.0.0.1), and so is a pod reaching itself
//! (hairpin) — through the skeleton's rules. A pod's bridge also gets `route_localnet`, without
//! which the kernel refuses to route 127.0.0.1-sourced packets to it; the skeleton drops packets
//! to 127.0.0.0/8 that do not come from `lo`, which is what the kernel would do without it.
//!
//! Mappings come from the ADD's `runtimeConfig.portMappings` ([`mapping`]), are kept in the
//! attachment record (with the pod's addresses), programmed before ADD returns, removed on DEL
//! and GC, and restored from the records when the binder starts. A host port two attachments
//! claim (the scheduler prevents it across pods; a sandbox re-created before the old one's DEL
//! can do it) goes to the newest; removing it hands the port back to the other.
//!
//! The same writer keeps `pod_ifaces`, the bridges pods come in through (see [`crate::table`]).

pub mod mapping;
pub mod metrics;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::Mutex;

use self::mapping::{PortMapping, Protocol};
use crate::attachments::Attachment;
use crate::lb::nft::{Nft, NftError};
use crate::table::{HOSTPORT_MAPS, TABLE, skeleton};

/// An attachment: container id and interface name.
type AttKey = (String, String);

/// One element of a host port map.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Entry {
    /// `hostports4`, `hostports_any6`, ...
    pub map: &'static str,
    /// `host IP . proto . port`, or `proto . port`.
    pub key: String,
    /// `pod IP . port`.
    pub value: String,
}

/// The map elements of `mappings` for a pod with addresses `pod_ips` (its first of each family).
pub fn entries(mappings: &[PortMapping], pod_ips: &[IpAddr]) -> Vec<Entry> {
    let mut out = Vec::new();
    for v4 in [true, false] {
        let Some(pod) = pod_ips.iter().find(|ip| ip.is_ipv4() == v4) else { continue };
        for m in mappings {
            let proto = m.protocol.proto().as_str();
            let value = format!("{pod} . {}", m.container_port);
            let entry = match m.host_ip {
                Some(h) if h.is_ipv4() != v4 => continue,
                Some(h) => Entry {
                    map: if v4 { "hostports4" } else { "hostports6" },
                    key: format!("{h} . {proto} . {}", m.host_port),
                    value,
                },
                None => Entry {
                    map: if v4 { "hostports_any4" } else { "hostports_any6" },
                    key: format!("{proto} . {}", m.host_port),
                    value,
                },
            };
            out.push(entry);
        }
    }
    out
}

/// Whether the node reaching 127.0.0.1 hits one of `mappings` of a pod with `pod_ips`.
fn reachable_on_localhost(mappings: &[PortMapping], pod_ips: &[IpAddr]) -> bool {
    pod_ips.iter().any(IpAddr::is_ipv4)
        && mappings.iter().any(|m| m.host_ip.is_none_or(|h| h.is_ipv4() && h.is_loopback()))
}

/// What one attachment asks for.
#[derive(Clone, Debug)]
struct Want {
    entries: Vec<Entry>,
    mappings: Vec<PortMapping>,
    /// The pod's addresses.
    ips: Vec<IpAddr>,
    /// The bridge its pod comes in through (Linux bridge binding).
    bridge: Option<String>,
    /// When it asked: the newest wins a contested element.
    seq: u64,
}

#[derive(Debug, Default)]
struct Inner {
    wants: BTreeMap<AttKey, Want>,
    /// What the table holds: per (map, key), the owner and the value.
    programmed: BTreeMap<(&'static str, String), (AttKey, String)>,
    ifaces: BTreeSet<String>,
    /// Bridges given `route_localnet` by this process.
    localnet: BTreeSet<String>,
    /// IP forwarding is on (traffic from outside to a host port is forwarded to the pod).
    forwarding: bool,
    /// The table holds exactly `programmed` and `ifaces` (false at start and after a failure:
    /// the next change rebuilds the host port part of the table).
    synced: bool,
    seq: u64,
}

impl Inner {
    fn desired(&self) -> BTreeMap<(&'static str, String), (AttKey, String)> {
        let mut best: BTreeMap<(&'static str, String), (u64, AttKey, String)> = BTreeMap::new();
        for (att, w) in &self.wants {
            for e in &w.entries {
                let slot = (e.map, e.key.clone());
                if best.get(&slot).is_none_or(|(seq, ..)| *seq < w.seq) {
                    best.insert(slot, (w.seq, att.clone(), e.value.clone()));
                }
            }
        }
        best.into_iter().map(|(k, (_, att, v))| (k, (att, v))).collect()
    }

    fn wanted_ifaces(&self) -> BTreeSet<String> {
        self.wants.values().filter_map(|w| w.bridge.clone()).collect()
    }
}

/// The host port writer; cheap to clone.
#[derive(Clone, Debug)]
pub struct HostPorts {
    nft: Nft,
    /// Where the node's sysctls are (`/proc/sys`; a directory of the test's elsewhere).
    proc_sys: PathBuf,
    metrics: Option<metrics::HostPortMetrics>,
    inner: Arc<Mutex<Inner>>,
}

fn add_element(out: &mut String, map: &str, key: &str, value: &str) {
    let _ = writeln!(out, "add element inet {TABLE} {map} {{ {key} : {value} }}");
}

fn add_iface(out: &mut String, iface: &str) {
    // Interface names are checked by the kernel (no quotes, no spaces), and come from VIFs.
    let _ = writeln!(out, "add element inet {TABLE} pod_ifaces {{ \"{iface}\" }}");
}

impl HostPorts {
    /// Programs with `nft`, in the network namespace the binder runs in.
    pub fn new(nft: Nft) -> Self {
        Self::with_proc_sys(nft, "/proc/sys")
    }

    /// Like [`HostPorts::new`], setting sysctls (IP forwarding, `route_localnet`) under
    /// `proc_sys` instead of `/proc/sys`.
    pub fn with_proc_sys(nft: Nft, proc_sys: impl Into<PathBuf>) -> Self {
        Self { nft, proc_sys: proc_sys.into(), metrics: None, inner: Arc::default() }
    }

    /// Counts transactions and programmed host ports in `metrics`.
    pub fn with_metrics(mut self, metrics: metrics::HostPortMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn observe(&self, kind: &'static str, ok: bool, programmed: usize) {
        if let Some(m) = &self.metrics {
            m.transaction(kind, ok);
            if ok {
                m.set_programmed(programmed);
            }
        }
    }

    /// Takes the attachments on record (at start) as the whole truth and programs their host
    /// ports, rebuilding the host port part of the table.
    pub async fn restore(&self, atts: &[Attachment]) -> Result<usize, NftError> {
        let mut inner = self.inner.lock().await;
        inner.wants.clear();
        for att in atts {
            want(&mut inner, att);
        }
        inner.synced = false;
        self.apply(&mut inner).await?;
        let bridges: Vec<String> = inner
            .wants
            .values()
            .filter(|w| reachable_on_localhost(&w.mappings, &w.ips))
            .filter_map(|w| w.bridge.clone())
            .collect();
        for b in bridges {
            self.route_localnet(&mut inner, &b);
        }
        if !inner.programmed.is_empty() {
            self.enable_forwarding(&mut inner);
        }
        Ok(inner.programmed.len())
    }

    /// Programs the host ports of `att` (and registers its bridge); returns once the table holds
    /// them. UDP flows to a new host port left from before (not translated) are forgotten, so the
    /// next datagram reaches the pod.
    pub async fn set(&self, att: &Attachment) -> Result<(), NftError> {
        let mut inner = self.inner.lock().await;
        let before = inner.programmed.clone();
        want(&mut inner, att);
        self.apply(&mut inner).await?;
        let ips: Vec<IpAddr> = att.ips.clone();
        if !att.port_mappings.is_empty() {
            self.enable_forwarding(&mut inner);
        }
        if reachable_on_localhost(&att.port_mappings, &ips)
            && let Some(b) = bridge_of(att)
        {
            self.route_localnet(&mut inner, &b);
        }
        drop(inner);
        for m in att.port_mappings.iter().filter(|m| m.protocol == Protocol::Udp) {
            let fresh =
                entries(std::slice::from_ref(m), &ips).iter().any(|e| !before.contains_key(&(e.map, e.key.clone())));
            if fresh {
                clear_udp(m).await;
            }
        }
        Ok(())
    }

    /// Forgets the host ports of an attachment; a port another attachment also asked for goes
    /// to it.
    pub async fn remove(&self, container_id: &str, ifname: &str) -> Result<(), NftError> {
        let mut inner = self.inner.lock().await;
        if inner.wants.remove(&(container_id.to_string(), ifname.to_string())).is_none() {
            return Ok(());
        }
        self.apply(&mut inner).await
    }

    /// Makes the table match the wants: the difference when in sync, else (or when that fails)
    /// the whole host port part in one transaction.
    async fn apply(&self, inner: &mut Inner) -> Result<(), NftError> {
        let desired = inner.desired();
        let ifaces = inner.wanted_ifaces();
        if inner.synced {
            let mut script = String::new();
            for (slot, (_, value)) in &inner.programmed {
                if desired.get(slot).is_none_or(|(_, v)| v != value) {
                    let _ = writeln!(script, "delete element inet {TABLE} {} {{ {} }}", slot.0, slot.1);
                }
            }
            for (slot, (_, value)) in &desired {
                if inner.programmed.get(slot).is_none_or(|(_, v)| v != value) {
                    add_element(&mut script, slot.0, &slot.1, value);
                }
            }
            for i in ifaces.difference(&inner.ifaces) {
                add_iface(&mut script, i);
            }
            if script.is_empty() {
                inner.programmed = desired;
                return Ok(());
            }
            match self.nft.apply(&script).await {
                Ok(()) => {
                    self.observe("delta", true, desired.len());
                    inner.programmed = desired;
                    inner.ifaces.extend(ifaces);
                    return Ok(());
                }
                Err(e) => {
                    self.observe("delta", false, 0);
                    tracing::warn!(error = %e, "host port change failed; rebuilding the host ports");
                    inner.synced = false;
                }
            }
        }
        let mut script = String::new();
        skeleton(&mut script);
        for (kind, name) in HOSTPORT_MAPS {
            let _ = writeln!(script, "flush {kind} inet {TABLE} {name}");
        }
        for (slot, (_, value)) in &desired {
            add_element(&mut script, slot.0, &slot.1, value);
        }
        for i in &ifaces {
            add_iface(&mut script, i);
        }
        if let Err(e) = self.nft.apply(&script).await {
            self.observe("full", false, 0);
            return Err(e);
        }
        self.observe("full", true, desired.len());
        inner.programmed = desired;
        inner.ifaces = ifaces;
        inner.synced = true;
        Ok(())
    }

    /// Lets the kernel route 127.0.0.1-sourced packets to the pods behind `bridge` (the node
    /// reaching a host port on localhost) and their replies back, once per bridge and process; a
    /// failure is logged (only localhost access is lost).
    fn route_localnet(&self, inner: &mut Inner, bridge: &str) {
        if inner.localnet.contains(bridge) {
            return;
        }
        let path = self.proc_sys.join(format!("net/ipv4/conf/{bridge}/route_localnet"));
        match std::fs::write(&path, "1") {
            Ok(()) => {
                inner.localnet.insert(bridge.to_string());
            }
            Err(e) => tracing::warn!(path = %path.display(), error = %e,
                "cannot enable route_localnet; host ports unreachable on 127.0.0.1"),
        }
    }

    /// Turns IP forwarding on, once per process: packets from outside to a host port are
    /// forwarded to the pod. A failure is logged (only traffic from outside the node is lost).
    fn enable_forwarding(&self, inner: &mut Inner) {
        if inner.forwarding {
            return;
        }
        let mut ok = true;
        for key in ["net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"] {
            let path = self.proc_sys.join(key);
            if std::fs::read_to_string(&path).is_ok_and(|v| v.trim() == "1") {
                continue;
            }
            if let Err(e) = std::fs::write(&path, "1") {
                tracing::warn!(path = %path.display(), error = %e,
                    "cannot enable IP forwarding; host ports unreachable from outside");
                ok = false;
            }
        }
        inner.forwarding = ok;
    }
}

/// The bridge an attachment's pod comes in through, when it is one and its name is a plain
/// interface name (it ends up in the nftables script and in a /proc/sys path).
fn bridge_of(att: &Attachment) -> Option<String> {
    if att.driver != "bridge" || att.bridge.is_empty() {
        return None;
    }
    if !is_ifname(&att.bridge) {
        tracing::warn!(bridge = att.bridge, "not an interface name; left out of the pod interfaces");
        return None;
    }
    Some(att.bridge.clone())
}

/// An interface name kept to what cannot change the meaning of a script or a path: at most 15
/// bytes of ASCII letters, digits, `-`, `_` and `.` (not `.` or `..` alone).
pub fn is_ifname(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s != "."
        && s != ".."
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn want(inner: &mut Inner, att: &Attachment) {
    inner.seq += 1;
    let w = Want {
        entries: entries(&att.port_mappings, &att.ips),
        mappings: att.port_mappings.clone(),
        ips: att.ips.clone(),
        bridge: bridge_of(att),
        seq: inner.seq,
    };
    inner.wants.insert(att.key(), w);
}

/// Deletes the UDP conntrack entries to a host port (as the reference `portmap` plugin does).
async fn clear_udp(m: &PortMapping) {
    let mut args = vec!["-D".to_string(), "-p".into(), "udp".into(), "--orig-port-dst".into(), m.host_port.to_string()];
    if let Some(ip) = m.host_ip {
        args.extend(["--orig-dst".into(), ip.to_string()]);
    }
    match tokio::process::Command::new("conntrack").args(&args).output().await {
        Ok(out) if out.status.success() => tracing::debug!(mapping = %m, "UDP flows to a new host port cleared"),
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stderr);
            if !text.contains("0 flow entries") {
                tracing::warn!(mapping = %m, error = %text.trim(), "clearing UDP flows to a host port failed");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot run conntrack; UDP flows to a new host port may go astray"),
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
