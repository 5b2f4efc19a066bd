//! Further interfaces per pod, requested the Network Plumbing Working Group way: the pod
//! annotation `k8s.v1.cni.cncf.io/networks` names `NetworkAttachmentDefinition`s (group
//! `k8s.cni.cncf.io`, version `v1`), and the pod gets one more interface per name, on the
//! network its definition's `spec.config` names.
//!
//! # The annotation
//!
//! Both forms of the specification are read:
//! - comma-separated `[namespace/]name[@ifname]`, e.g. `blue, other/red@red0`;
//! - a JSON list of `{"name", "namespace", "interface"}` objects. `ips`, `mac` and the other
//!   runtime requests are refused with a clear error: addresses come from the network's IPAM.
//!
//! A definition without a namespace is looked up in the pod's. Interfaces without a requested
//! name are `net1`, `net2`, ... in the order of the annotation (their position, as Multus names
//! them).
//!
//! # The definition's `spec.config`
//!
//! A CNI network configuration whose `type` is `kuryr` and whose `kuryr` object names the
//! network:
//!
//! ```json
//! {"cniVersion": "1.1.0", "name": "blue", "type": "kuryr", "kuryr": {"podNetwork": "blue"}}
//! ```
//!
//! `podNetwork` names a PodNetwork of the embedded IPAM (another one than the pods' primary
//! network). With the Neutron backend the `kuryr` object names a Neutron network instead (by id
//! or by its unique name), optionally the subnets the port takes addresses from (ids; every
//! subnet of the network when absent) and the port's security groups (ids; the pods' primary
//! groups when absent):
//!
//! ```json
//! {"cniVersion": "1.1.0", "name": "red", "type": "kuryr",
//!  "kuryr": {"neutronNetwork": "red-net", "neutronSubnets": ["<subnet id>"], "securityGroups": ["<id>"]}}
//! ```
//!
//! The pod then gets one more Neutron port on that network ([`crate::backend::neutron::attach`]).
//!
//! # What the pod shows
//!
//! The allocator writes `k8s.v1.cni.cncf.io/network-status` as Multus does ([`network_status`]):
//! a JSON list with the primary interface first (`default: true`), then each further one, with
//! the network's name, the interface name, its addresses and MAC.

use std::collections::BTreeSet;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::core::{AttachedRecord, VifRecord};

/// The pod annotation that asks for further interfaces.
pub const NETWORKS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/networks";
/// The pod annotation that reports every interface, written by the allocator.
pub const STATUS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/network-status";
/// The `type` a definition's config must have.
pub const CNI_TYPE: &str = "kuryr";
/// The most further interfaces per pod.
pub const MAX_ATTACHMENTS: usize = 16;
/// The name of the primary network in the network-status annotation: the CNI network name the
/// binder installs.
pub const PRIMARY_NAME: &str = "kuryr";
/// The primary interface's name in the pod.
pub const PRIMARY_IFNAME: &str = "eth0";

/// One interface a pod asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The definition's namespace (the pod's when the annotation names none).
    pub namespace: String,
    /// The definition's name.
    pub name: String,
    /// The interface name in the pod.
    pub ifname: String,
}

impl Request {
    /// `namespace/name`.
    pub fn attachment(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The network a definition names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A PodNetwork of the embedded IPAM.
    PodNetwork(String),
    /// A Neutron network, optionally some of its subnets and the port's security groups.
    Neutron {
        /// The network id or unique name.
        network: String,
        /// Subnet ids; empty: every subnet of the network.
        subnets: Vec<String>,
        /// Security group ids; absent: the pods' primary groups.
        security_groups: Option<Vec<String>>,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct KuryrField {
    #[serde(default)]
    pod_network: Option<String>,
    #[serde(default)]
    neutron_network: Option<String>,
    #[serde(default)]
    neutron_subnets: Option<Vec<String>>,
    #[serde(default)]
    security_groups: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JsonRequest {
    name: String,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    interface: Option<String>,
    #[serde(default)]
    ips: Option<Value>,
    #[serde(default)]
    mac: Option<Value>,
    #[serde(default)]
    cni_args: Option<Value>,
    #[serde(default)]
    infiniband_guid: Option<Value>,
    #[serde(default)]
    port_mappings: Option<Value>,
    #[serde(default)]
    bandwidth: Option<Value>,
    #[serde(default)]
    gateway_request: Option<Value>,
}

/// Whether `s` is a DNS-1123 label (how namespaces and most object names are spelled).
fn dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.'])
}

/// Whether Linux accepts `s` as an interface name.
fn ifname_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s != "."
        && s != ".."
        && s.bytes().all(|b| b.is_ascii_graphic() && b != b'/' && b != b':')
}

/// Reads the annotation of a pod in `pod_namespace` into its requests, in order, each with its
/// interface name. The error says what is wrong, for the pod's Event and the CNI error.
pub fn parse_networks(annotation: &str, pod_namespace: &str) -> Result<Vec<Request>, String> {
    let text = annotation.trim();
    let raw: Vec<(Option<String>, String, Option<String>)> = if text.starts_with('[') {
        let list: Vec<JsonRequest> = serde_json::from_str(text)
            .map_err(|e| format!("annotation {NETWORKS_ANNOTATION} is not a valid JSON list of networks: {e}"))?;
        let mut out = Vec::with_capacity(list.len());
        for r in list {
            let refused = [
                ("ips", r.ips.is_some()),
                ("mac", r.mac.is_some()),
                ("cni-args", r.cni_args.is_some()),
                ("infiniband-guid", r.infiniband_guid.is_some()),
                ("portMappings", r.port_mappings.is_some()),
                ("bandwidth", r.bandwidth.is_some()),
                ("default-route", r.gateway_request.is_some()),
            ];
            if let Some((field, _)) = refused.iter().find(|(_, set)| *set) {
                return Err(format!(
                    "annotation {NETWORKS_ANNOTATION}: network {:?} asks for {field:?}, which kuryr does not \
                     support (addresses and MACs come from the network's IPAM)",
                    r.name
                ));
            }
            out.push((r.namespace, r.name, r.interface));
        }
        out
    } else {
        let mut out = Vec::new();
        for item in text.split(',').map(str::trim) {
            if item.is_empty() {
                return Err(format!("annotation {NETWORKS_ANNOTATION} has an empty element in {text:?}"));
            }
            let (target, ifname) = match item.split_once('@') {
                Some((t, i)) => (t, Some(i.to_string())),
                None => (item, None),
            };
            let (namespace, name) = match target.split_once('/') {
                Some((ns, n)) => (Some(ns.to_string()), n.to_string()),
                None => (None, target.to_string()),
            };
            out.push((namespace, name, ifname));
        }
        out
    };
    if raw.is_empty() {
        return Err(format!("annotation {NETWORKS_ANNOTATION} names no network"));
    }
    if raw.len() > MAX_ATTACHMENTS {
        return Err(format!(
            "annotation {NETWORKS_ANNOTATION} names {} networks; at most {MAX_ATTACHMENTS} are allowed",
            raw.len()
        ));
    }
    let mut requests = Vec::with_capacity(raw.len());
    let mut ifnames = BTreeSet::from([PRIMARY_IFNAME.to_string()]);
    for (i, (namespace, name, ifname)) in raw.into_iter().enumerate() {
        let namespace = namespace.unwrap_or_else(|| pod_namespace.to_string());
        if !dns_name(&namespace) || !dns_name(&name) {
            return Err(format!(
                "annotation {NETWORKS_ANNOTATION}: {namespace:?}/{name:?} is not a valid NetworkAttachmentDefinition name"
            ));
        }
        let ifname = ifname.unwrap_or_else(|| format!("net{}", i + 1));
        if !ifname_ok(&ifname) {
            return Err(format!(
                "annotation {NETWORKS_ANNOTATION}: interface name {ifname:?} (network {namespace}/{name}) is not a \
                 valid Linux interface name (1 to 15 printable characters, no '/', ':' or space)"
            ));
        }
        if !ifnames.insert(ifname.clone()) {
            return Err(format!(
                "annotation {NETWORKS_ANNOTATION}: interface name {ifname} is used twice (network {namespace}/{name})"
            ));
        }
        requests.push(Request { namespace, name, ifname });
    }
    Ok(requests)
}

/// Reads a definition's `spec.config` into the network it names.
pub fn parse_config(attachment: &str, config: Option<&str>) -> Result<Target, String> {
    let config = config.filter(|c| !c.trim().is_empty()).ok_or_else(|| {
        format!("NetworkAttachmentDefinition {attachment} has no spec.config; kuryr needs {{\"type\": \"kuryr\", \"kuryr\": {{\"podNetwork\": ...}}}}")
    })?;
    let v: Value = serde_json::from_str(config)
        .map_err(|e| format!("NetworkAttachmentDefinition {attachment}: spec.config is not JSON: {e}"))?;
    let ty = v.get("type").and_then(Value::as_str).unwrap_or_default();
    if ty != CNI_TYPE {
        return Err(format!(
            "NetworkAttachmentDefinition {attachment}: spec.config has type {ty:?}; kuryr attaches only type \"{CNI_TYPE}\" \
             (kuryr is the only CNI plugin here; chaining other plugins needs a meta-plugin)"
        ));
    }
    let field = v.get("kuryr").cloned().ok_or_else(|| {
        format!("NetworkAttachmentDefinition {attachment}: spec.config lacks the \"kuryr\" object naming the network")
    })?;
    let k: KuryrField = serde_json::from_value(field)
        .map_err(|e| format!("NetworkAttachmentDefinition {attachment}: spec.config \"kuryr\": {e}"))?;
    let neutron_only = k.neutron_subnets.is_some() || k.security_groups.is_some();
    match (k.pod_network.filter(|s| !s.is_empty()), k.neutron_network.filter(|s| !s.is_empty())) {
        (Some(p), None) if !neutron_only => Ok(Target::PodNetwork(p)),
        (None, Some(n)) => {
            let subnets = k.neutron_subnets.unwrap_or_default();
            if subnets.iter().chain(k.security_groups.iter().flatten()).any(|s| s.trim().is_empty()) {
                return Err(format!(
                    "NetworkAttachmentDefinition {attachment}: spec.config \"kuryr\": neutronSubnets and \
                     securityGroups list ids, and an id cannot be empty"
                ));
            }
            Ok(Target::Neutron { network: n, subnets, security_groups: k.security_groups })
        }
        _ => Err(format!(
            "NetworkAttachmentDefinition {attachment}: spec.config \"kuryr\" must name exactly one of podNetwork \
             or neutronNetwork (neutronSubnets and securityGroups go with neutronNetwork only)"
        )),
    }
}

fn addresses(ips: impl Iterator<Item = String>) -> Vec<String> {
    ips.map(|a| a.split('/').next().unwrap_or_default().to_string()).collect()
}

/// The `k8s.v1.cni.cncf.io/network-status` value: the primary interface first, named
/// `primary_name` and marked `default`, then every further one, named by its definition.
pub fn network_status(primary_name: &str, record: &VifRecord) -> String {
    let mut list = vec![json!({
        "name": primary_name,
        "interface": PRIMARY_IFNAME,
        "ips": addresses(record.ips.iter().map(|i| i.address.clone())),
        "mac": record.mac,
        "default": true,
        "dns": {},
    })];
    list.extend(record.attachments.iter().map(|a: &AttachedRecord| {
        json!({
            "name": a.attachment,
            "interface": a.ifname,
            "ips": addresses(a.ips.iter().map(|i| i.address.clone())),
            "mac": a.mac,
            "dns": {},
        })
    }));
    Value::Array(list).to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::core::VifIp;

    fn req(ns: &str, name: &str, ifname: &str) -> Request {
        Request { namespace: ns.into(), name: name.into(), ifname: ifname.into() }
    }

    #[test]
    fn the_short_form_takes_namespaces_and_interface_names() {
        let got = parse_networks("blue, other/red@red0 ,green", "app").unwrap();
        assert_eq!(got, [req("app", "blue", "net1"), req("other", "red", "red0"), req("app", "green", "net3")]);
        assert_eq!(got[1].attachment(), "other/red");
    }

    #[test]
    fn the_json_form_takes_namespaces_and_interfaces() {
        let got =
            parse_networks(r#"[{"name":"blue"},{"name":"red","namespace":"other","interface":"r0"}]"#, "app").unwrap();
        assert_eq!(got, [req("app", "blue", "net1"), req("other", "red", "r0")]);
    }

    #[test]
    fn bad_annotations_are_refused_with_the_reason() {
        let cases = [
            ("", "empty element"),
            ("blue,,red", "empty element"),
            ("[{\"name\": 3}]", "not a valid JSON list"),
            ("[]", "names no network"),
            (r#"[{"name":"blue","ips":["10.0.0.5/24"]}]"#, "\"ips\""),
            (r#"[{"name":"blue","mac":"02:00:00:00:00:01"}]"#, "\"mac\""),
            ("Blue", "not a valid NetworkAttachmentDefinition name"),
            ("a/b/c", "not a valid NetworkAttachmentDefinition name"),
            ("blue@eth0", "used twice"),
            ("blue@x,red@x", "used twice"),
            ("blue@averyveryverylongname", "not a valid Linux interface name"),
            ("blue@a/b", "not a valid Linux interface name"),
        ];
        for (annotation, want) in cases {
            let e = parse_networks(annotation, "app").unwrap_err();
            assert!(e.contains(want), "{annotation:?}: {e}");
        }
        let many = vec!["n"; MAX_ATTACHMENTS + 1].join(",");
        assert!(parse_networks(&many, "app").unwrap_err().contains("at most"));
    }

    #[test]
    fn configs_name_one_network() {
        let pn = r#"{"cniVersion":"1.1.0","name":"blue","type":"kuryr","kuryr":{"podNetwork":"blue-net"}}"#;
        assert_eq!(parse_config("a/b", Some(pn)).unwrap(), Target::PodNetwork("blue-net".into()));
        let nn = r#"{"type":"kuryr","kuryr":{"neutronNetwork":"n1","neutronSubnets":["s1"],"securityGroups":["g"]}}"#;
        assert_eq!(
            parse_config("a/b", Some(nn)).unwrap(),
            Target::Neutron {
                network: "n1".into(),
                subnets: vec!["s1".into()],
                security_groups: Some(vec!["g".into()])
            }
        );
        let bare = r#"{"type":"kuryr","kuryr":{"neutronNetwork":"red-net"}}"#;
        assert_eq!(
            parse_config("a/b", Some(bare)).unwrap(),
            Target::Neutron { network: "red-net".into(), subnets: Vec::new(), security_groups: None }
        );
        let bad = [
            (None, "no spec.config"),
            (Some("{"), "not JSON"),
            (Some(r#"{"type":"macvlan"}"#), "type \"macvlan\""),
            (Some(r#"{"type":"kuryr"}"#), "lacks the \"kuryr\" object"),
            (Some(r#"{"type":"kuryr","kuryr":{}}"#), "exactly one"),
            (Some(r#"{"type":"kuryr","kuryr":{"podNetwork":"a","neutronNetwork":"b"}}"#), "exactly one"),
            (Some(r#"{"type":"kuryr","kuryr":{"podnetwork":"a"}}"#), "unknown field"),
            (Some(r#"{"type":"kuryr","kuryr":{"podNetwork":"a","neutronSubnets":["s"]}}"#), "exactly one"),
            (Some(r#"{"type":"kuryr","kuryr":{"neutronNetwork":"n","neutronSubnets":[""]}}"#), "cannot be empty"),
            (Some(r#"{"type":"kuryr","kuryr":{"neutronNetwork":"n","neutronSubnet":"s"}}"#), "unknown field"),
        ];
        for (config, want) in bad {
            let e = parse_config("a/b", config).unwrap_err();
            assert!(e.contains(want) && e.contains("a/b"), "{config:?}: {e}");
        }
    }

    #[test]
    fn network_status_lists_the_primary_first_then_each_attachment() {
        let record = VifRecord {
            mac: "0a:58:0a:f4:00:05".into(),
            ips: vec![
                VifIp { address: "10.244.0.5/24".into(), gateway: Some("10.244.0.1".into()) },
                VifIp { address: "fd00::5/112".into(), gateway: None },
            ],
            attachments: vec![AttachedRecord {
                attachment: "app/blue".into(),
                ifname: "net1".into(),
                mac: "0a:58:0a:64:00:07".into(),
                ips: vec![VifIp { address: "10.100.0.7/24".into(), gateway: None }],
                ..AttachedRecord::default()
            }],
            ..VifRecord::default()
        };
        let v: Value = serde_json::from_str(&network_status("kuryr", &record)).unwrap();
        assert_eq!(
            v,
            json!([
                {"name": "kuryr", "interface": "eth0", "ips": ["10.244.0.5", "fd00::5"], "mac": "0a:58:0a:f4:00:05",
                 "default": true, "dns": {}},
                {"name": "app/blue", "interface": "net1", "ips": ["10.100.0.7"], "mac": "0a:58:0a:64:00:07", "dns": {}},
            ])
        );
    }
}
