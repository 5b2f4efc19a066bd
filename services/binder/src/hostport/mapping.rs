//! Port mappings as the runtime hands them to the CNI plugin: `runtimeConfig.portMappings` of the
//! network configuration, present when the conflist declares the `portMappings` capability.
//! containerd's CRI writes the keys capitalised (`HostPort`, `ContainerPort`, `Protocol`,
//! `HostIP`), podman and cnitool in lower camel case (`hostPort`, ...); both are read.

use std::fmt;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::lb::model::Proto;

/// One host port of a pod: traffic to `host_ip` (any local address when `None`) on `host_port`
/// goes to the pod's `container_port`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PortMapping {
    pub host_port: u16,
    pub container_port: u16,
    pub protocol: Protocol,
    /// `None`: every address of the node (the runtime's `""`, `0.0.0.0` or `::`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_ip: Option<IpAddr>,
}

/// A mapping's transport protocol (kept in attachment records: a name, not the nftables one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// As the Service dataplane names it.
    pub fn proto(self) -> Proto {
        match self {
            Protocol::Tcp => Proto::Tcp,
            Protocol::Udp => Proto::Udp,
            Protocol::Sctp => Proto::Sctp,
        }
    }
}

impl fmt::Display for PortMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let proto = self.protocol.proto().as_str();
        match self.host_ip {
            Some(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}/{proto}", self.host_port)?,
            Some(ip) => write!(f, "{ip}:{}/{proto}", self.host_port)?,
            None => write!(f, "*:{}/{proto}", self.host_port)?,
        }
        write!(f, " -> {}", self.container_port)
    }
}

/// The port mappings in a network configuration's `runtimeConfig` (none when absent). Fails
/// naming the entry and field when one cannot be used: a runtime asking for a host port the pod
/// would not get must hear so.
pub fn from_runtime_config(runtime_config: Option<&Value>) -> Result<Vec<PortMapping>, String> {
    let Some(list) = runtime_config.and_then(|rc| rc.get("portMappings")) else { return Ok(Vec::new()) };
    if list.is_null() {
        return Ok(Vec::new());
    }
    let list = list.as_array().ok_or("runtimeConfig.portMappings: not a list")?;
    let mut out = Vec::with_capacity(list.len());
    for (i, entry) in list.iter().enumerate() {
        let field = |lower: &str, upper: &str| entry.get(lower).or_else(|| entry.get(upper)).filter(|v| !v.is_null());
        let port = |lower: &str, upper: &str| -> Result<u16, String> {
            let v = field(lower, upper).ok_or_else(|| format!("runtimeConfig.portMappings[{i}].{lower}: missing"))?;
            v.as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .filter(|n| *n != 0)
                .ok_or_else(|| format!("runtimeConfig.portMappings[{i}].{lower}: {v} is not a port (1-65535)"))
        };
        let host_port = port("hostPort", "HostPort")?;
        let container_port = port("containerPort", "ContainerPort")?;
        let protocol = match field("protocol", "Protocol").map(|v| v.as_str().map(str::to_ascii_lowercase)) {
            None => Protocol::Tcp,
            Some(Some(p)) if p.is_empty() || p == "tcp" => Protocol::Tcp,
            Some(Some(p)) if p == "udp" => Protocol::Udp,
            Some(Some(p)) if p == "sctp" => Protocol::Sctp,
            Some(_) => {
                return Err(format!(
                    "runtimeConfig.portMappings[{i}].protocol: {} is not tcp, udp or sctp",
                    field("protocol", "Protocol").map(ToString::to_string).unwrap_or_default()
                ));
            }
        };
        let host_ip = match field("hostIP", "HostIP") {
            None => None,
            Some(v) => {
                let s =
                    v.as_str().ok_or_else(|| format!("runtimeConfig.portMappings[{i}].hostIP: {v} is not a string"))?;
                if s.is_empty() {
                    None
                } else {
                    let ip: IpAddr = s
                        .parse()
                        .map_err(|_| format!("runtimeConfig.portMappings[{i}].hostIP: {s:?} is not an IP address"))?;
                    Some(ip).filter(|ip| !ip.is_unspecified())
                }
            }
        };
        let m = PortMapping { host_port, container_port, protocol, host_ip };
        if !out.contains(&m) {
            out.push(m);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn both_key_spellings_and_the_defaults() {
        let rc = json!({"portMappings": [
            {"HostPort": 54321, "ContainerPort": 8080, "Protocol": "TCP", "HostIP": "127.0.0.1"},
            {"hostPort": 54321, "containerPort": 8080, "protocol": "udp", "hostIP": "172.30.0.10"},
            {"hostPort": 8443, "containerPort": 443},
            {"HostPort": 9, "ContainerPort": 9, "Protocol": "SCTP", "HostIP": "0.0.0.0"},
            {"HostPort": 10, "ContainerPort": 10, "Protocol": "TCP", "HostIP": "::"},
            {"hostPort": 8443, "containerPort": 443},
        ]});
        let got: Vec<String> = from_runtime_config(Some(&rc)).unwrap().iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            [
                "127.0.0.1:54321/tcp -> 8080",
                "172.30.0.10:54321/udp -> 8080",
                "*:8443/tcp -> 443",
                "*:9/sctp -> 9",
                "*:10/tcp -> 10",
            ]
        );
        assert!(from_runtime_config(None).unwrap().is_empty());
        assert!(from_runtime_config(Some(&json!({"bandwidth": {}}))).unwrap().is_empty());
        assert!(from_runtime_config(Some(&json!({"portMappings": null}))).unwrap().is_empty());
    }

    #[test]
    fn unusable_entries_are_named() {
        let bad = |m: Value| from_runtime_config(Some(&json!({ "portMappings": [m] }))).unwrap_err();
        assert_eq!(bad(json!({"containerPort": 80})), "runtimeConfig.portMappings[0].hostPort: missing");
        assert!(bad(json!({"hostPort": 70000, "containerPort": 80})).contains("70000 is not a port"));
        assert!(bad(json!({"hostPort": 80, "containerPort": 0})).contains("containerPort: 0 is not a port"));
        assert!(bad(json!({"hostPort": 80, "containerPort": 80, "protocol": "icmp"})).contains("\"icmp\""));
        assert!(bad(json!({"hostPort": 80, "containerPort": 80, "hostIP": "localhost"})).contains("\"localhost\""));
        let e = from_runtime_config(Some(&json!({"portMappings": {}}))).unwrap_err();
        assert_eq!(e, "runtimeConfig.portMappings: not a list");
    }

    #[test]
    fn records_keep_them() {
        let m = PortMapping { host_port: 80, container_port: 8080, protocol: Protocol::Udp, host_ip: None };
        let v = serde_json::to_value(m).unwrap();
        assert_eq!(v, json!({"host_port": 80, "container_port": 8080, "protocol": "udp"}));
        assert_eq!(serde_json::from_value::<PortMapping>(v).unwrap(), m);
    }
}
