//! The ADD result, held version-neutral and rendered in the layout of the requested `cniVersion`.
//!
//! | field                                 | 0.3.0 / 0.3.1 / 0.4.0 | 1.0.0 | 1.1.0 |
//! |---------------------------------------|-----------------------|-------|-------|
//! | `ips[].version` (`"4"`/`"6"`)         | yes                   | no    | no    |
//! | `interfaces[].mtu/socketPath/pciID`   | no                    | no    | yes   |
//! | `routes[].mtu/advmss/priority/table/scope` | no               | no    | yes   |
//!
//! Everything else is common to all of them. Empty optional fields are left out, as the reference
//! implementation does; parsing accepts every layout, so a `prevResult` of any supported version
//! reads back into the same [`CniResult`].

use std::net::IpAddr;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::CniVersion;
use crate::cidr::{IpCidr, family};

/// A CNI result, independent of the version it will be printed in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CniResult {
    /// Interfaces created by the attachment, host ones included.
    pub interfaces: Vec<Interface>,
    /// Addresses assigned.
    pub ips: Vec<IpConfig>,
    /// Routes installed.
    pub routes: Vec<Route>,
    /// DNS settings; left out of the JSON when empty.
    pub dns: Dns,
}

/// An interface in a result. `None` and empty strings are both left out of the JSON.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub mac: Option<String>,
    /// 1.1.0 only.
    pub mtu: Option<u32>,
    /// The netns path for interfaces in the sandbox; `None` for host interfaces.
    pub sandbox: Option<String>,
    /// 1.1.0 only.
    pub socket_path: Option<String>,
    /// 1.1.0 only.
    pub pci_id: Option<String>,
}

/// An address in a result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpConfig {
    /// The address and its subnet's prefix length.
    pub address: IpCidr,
    pub gateway: Option<IpAddr>,
    /// Index into [`CniResult::interfaces`].
    pub interface: Option<u32>,
}

/// A route in a result. The fields after `gw` are 1.1.0 only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub dst: IpCidr,
    /// Next hop; `None` for a route on the link.
    pub gw: Option<IpAddr>,
    pub mtu: Option<u32>,
    pub advmss: Option<u32>,
    pub priority: Option<u32>,
    pub table: Option<u32>,
    /// 0 global, 253 link, 254 host.
    pub scope: Option<u32>,
}

impl Route {
    /// A route with only a destination and an optional next hop.
    pub fn new(dst: IpCidr, gw: Option<IpAddr>) -> Self {
        Self { dst, gw, mtu: None, advmss: None, priority: None, table: None, scope: None }
    }
}

/// DNS settings in a result.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dns {
    pub nameservers: Vec<String>,
    pub domain: Option<String>,
    pub search: Vec<String>,
    pub options: Vec<String>,
}

impl Dns {
    /// Whether there is nothing to print.
    pub fn is_empty(&self) -> bool {
        self.nameservers.is_empty()
            && self.domain.as_deref().unwrap_or_default().is_empty()
            && self.search.is_empty()
            && self.options.is_empty()
    }
}

/// Why a result (a `prevResult`, or the binder's answer) is not a valid CNI result.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid CNI result: {0}")]
pub struct InvalidResult(pub String);

impl CniResult {
    /// The result in the exact layout of `version` (see the module docs).
    pub fn render(&self, version: CniVersion) -> Value {
        let mut m = Map::new();
        m.insert("cniVersion".into(), version.as_str().into());
        if !self.interfaces.is_empty() {
            let list = self.interfaces.iter().map(|i| render_interface(i, version)).collect();
            m.insert("interfaces".into(), Value::Array(list));
        }
        if !self.ips.is_empty() {
            let list = self.ips.iter().map(|ip| render_ip(ip, version)).collect();
            m.insert("ips".into(), Value::Array(list));
        }
        if !self.routes.is_empty() {
            let list = self.routes.iter().map(|r| render_route(r, version)).collect();
            m.insert("routes".into(), Value::Array(list));
        }
        if !self.dns.is_empty() {
            let mut d = Map::new();
            put_list(&mut d, "nameservers", &self.dns.nameservers);
            put_str(&mut d, "domain", &self.dns.domain);
            put_list(&mut d, "search", &self.dns.search);
            put_list(&mut d, "options", &self.dns.options);
            m.insert("dns".into(), Value::Object(d));
        }
        Value::Object(m)
    }

    /// Reads a result in any supported layout (a `prevResult`). Fields of other versions are
    /// accepted and kept; unknown fields are ignored. Checked: addresses and gateways parse, an IP's
    /// `version` matches its address, gateways match their address's family, and interface indexes
    /// point into `interfaces`.
    pub fn from_value(v: &Value) -> Result<Self, InvalidResult> {
        // serde reads a struct from a JSON array too (positionally); a result is an object.
        if !v.is_object() {
            return Err(InvalidResult("not a JSON object".into()));
        }
        let w = WireResult::deserialize(v).map_err(|e| InvalidResult(e.to_string()))?;
        let interfaces: Vec<Interface> = w.interfaces.unwrap_or_default().into_iter().map(Interface::from).collect();
        let mut ips = Vec::new();
        for (n, ip) in w.ips.unwrap_or_default().into_iter().enumerate() {
            ips.push(ip.check(n, interfaces.len())?);
        }
        let mut routes = Vec::new();
        for (n, r) in w.routes.unwrap_or_default().into_iter().enumerate() {
            routes.push(r.check(n)?);
        }
        let dns = w.dns.map(Dns::from).unwrap_or_default();
        Ok(Self { interfaces, ips, routes, dns })
    }

    /// [`from_value`](Self::from_value) on JSON bytes.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, InvalidResult> {
        let v: Value = serde_json::from_slice(bytes).map_err(|e| InvalidResult(e.to_string()))?;
        Self::from_value(&v)
    }
}

fn render_interface(i: &Interface, version: CniVersion) -> Value {
    let mut m = Map::new();
    m.insert("name".into(), i.name.clone().into());
    put_str(&mut m, "mac", &i.mac);
    put_str(&mut m, "sandbox", &i.sandbox);
    if version.has_1_1_fields() {
        put_nonzero(&mut m, "mtu", i.mtu);
        put_str(&mut m, "socketPath", &i.socket_path);
        put_str(&mut m, "pciID", &i.pci_id);
    }
    Value::Object(m)
}

fn render_ip(ip: &IpConfig, version: CniVersion) -> Value {
    let mut m = Map::new();
    if version.ips_carry_version() {
        m.insert("version".into(), ip.address.family().into());
    }
    m.insert("address".into(), ip.address.to_string().into());
    if let Some(gw) = ip.gateway {
        m.insert("gateway".into(), gw.to_string().into());
    }
    if let Some(i) = ip.interface {
        m.insert("interface".into(), i.into());
    }
    Value::Object(m)
}

fn render_route(r: &Route, version: CniVersion) -> Value {
    let mut m = Map::new();
    m.insert("dst".into(), r.dst.to_string().into());
    if let Some(gw) = r.gw {
        m.insert("gw".into(), gw.to_string().into());
    }
    if version.has_1_1_fields() {
        put_nonzero(&mut m, "mtu", r.mtu);
        put_nonzero(&mut m, "advmss", r.advmss);
        put_nonzero(&mut m, "priority", r.priority);
        // Zero is meaningful for these two (the main table is not 0, but scope 0 is "global").
        if let Some(t) = r.table {
            m.insert("table".into(), t.into());
        }
        if let Some(s) = r.scope {
            m.insert("scope".into(), s.into());
        }
    }
    Value::Object(m)
}

fn put_str(m: &mut Map<String, Value>, key: &str, v: &Option<String>) {
    if let Some(s) = v.as_deref().filter(|s| !s.is_empty()) {
        m.insert(key.into(), s.into());
    }
}

fn put_nonzero(m: &mut Map<String, Value>, key: &str, v: Option<u32>) {
    if let Some(n) = v.filter(|n| *n != 0) {
        m.insert(key.into(), n.into());
    }
}

fn put_list(m: &mut Map<String, Value>, key: &str, v: &[String]) {
    if !v.is_empty() {
        m.insert(key.into(), v.into());
    }
}

// The wire forms: every field of every supported layout, all optional but the ones each layout
// requires.

#[derive(Deserialize)]
struct WireResult {
    interfaces: Option<Vec<WireInterface>>,
    ips: Option<Vec<WireIp>>,
    routes: Option<Vec<WireRoute>>,
    dns: Option<WireDns>,
}

#[derive(Deserialize)]
struct WireInterface {
    name: String,
    mac: Option<String>,
    mtu: Option<u32>,
    sandbox: Option<String>,
    #[serde(rename = "socketPath")]
    socket_path: Option<String>,
    #[serde(rename = "pciID")]
    pci_id: Option<String>,
}

impl From<WireInterface> for Interface {
    fn from(w: WireInterface) -> Self {
        Interface {
            name: w.name,
            mac: non_empty(w.mac),
            mtu: w.mtu.filter(|m| *m != 0),
            sandbox: non_empty(w.sandbox),
            socket_path: non_empty(w.socket_path),
            pci_id: non_empty(w.pci_id),
        }
    }
}

#[derive(Deserialize)]
struct WireIp {
    version: Option<String>,
    address: String,
    gateway: Option<String>,
    interface: Option<u32>,
}

impl WireIp {
    fn check(self, n: usize, interfaces: usize) -> Result<IpConfig, InvalidResult> {
        let at = |msg: String| InvalidResult(format!("ips[{n}]: {msg}"));
        let address: IpCidr = self.address.parse().map_err(|e| at(format!("address: {e}")))?;
        if let Some(v) = self.version.as_deref()
            && v != address.family()
        {
            return Err(at(format!("version \"{v}\" does not match address {address}")));
        }
        let gateway = parse_gateway(self.gateway.as_deref().unwrap_or_default(), address.addr())
            .map_err(|e| at(format!("gateway: {e}")))?;
        check_index(self.interface, interfaces).map_err(at)?;
        Ok(IpConfig { address, gateway, interface: self.interface })
    }
}

#[derive(Deserialize)]
struct WireRoute {
    dst: String,
    gw: Option<String>,
    mtu: Option<u32>,
    advmss: Option<u32>,
    priority: Option<u32>,
    table: Option<u32>,
    scope: Option<u32>,
}

impl WireRoute {
    fn check(self, n: usize) -> Result<Route, InvalidResult> {
        let at = |msg: String| InvalidResult(format!("routes[{n}]: {msg}"));
        let dst: IpCidr = self.dst.parse().map_err(|e| at(format!("dst: {e}")))?;
        let gw =
            parse_gateway(self.gw.as_deref().unwrap_or_default(), dst.addr()).map_err(|e| at(format!("gw: {e}")))?;
        Ok(Route {
            dst,
            gw,
            mtu: self.mtu,
            advmss: self.advmss,
            priority: self.priority,
            table: self.table,
            scope: self.scope,
        })
    }
}

#[derive(Deserialize)]
struct WireDns {
    nameservers: Option<Vec<String>>,
    domain: Option<String>,
    search: Option<Vec<String>>,
    options: Option<Vec<String>>,
}

impl From<WireDns> for Dns {
    fn from(w: WireDns) -> Self {
        Dns {
            nameservers: w.nameservers.unwrap_or_default(),
            domain: non_empty(w.domain),
            search: w.search.unwrap_or_default(),
            options: w.options.unwrap_or_default(),
        }
    }
}

fn non_empty(s: Option<String>) -> Option<String> {
    s.filter(|s| !s.is_empty())
}

/// Parses a gateway (none when empty) that must be of the same family as `of`.
pub(crate) fn parse_gateway(gw: &str, of: IpAddr) -> Result<Option<IpAddr>, String> {
    if gw.is_empty() {
        return Ok(None);
    }
    let addr: IpAddr = gw.parse().map_err(|_| format!("\"{gw}\" is not an IP address"))?;
    if addr.is_ipv4() != of.is_ipv4() {
        return Err(format!("{addr} is IPv{} but the address is IPv{}", family(addr), family(of)));
    }
    Ok(Some(addr))
}

/// Checks that an IP's interface index points into a list of `interfaces` interfaces.
pub(crate) fn check_index(index: Option<u32>, interfaces: usize) -> Result<(), String> {
    match index {
        Some(i) if i as usize >= interfaces => {
            Err(format!("interface index {i} is out of range: the result has {interfaces} interfaces"))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
#[path = "result_tests.rs"]
mod tests;
