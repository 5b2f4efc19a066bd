//! What kuryr-migrate reads of Kuryr-Kubernetes' own state: its custom resources (group
//! `openstack.org`, version `v1`, no status subresource) and the names it uses for finalizers.
//!
//! The objects are read as dynamic objects and only the fields the migration needs are
//! extracted, so that unknown or extra fields (Kuryr wrote several generations of them) never
//! make a read fail. A KuryrPort's `status.vifs` holds os-vif objects serialised as
//! `{"versioned_object.data": {...}, "versioned_object.name": ...}`; [`default_vif`] walks them.

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::Value;

/// Kuryr's finalizer on pods.
pub const POD_FINALIZER: &str = "kuryr.openstack.org/pod-finalizer";
/// Kuryr's finalizer on KuryrPorts.
pub const KURYRPORT_FINALIZER: &str = "kuryr.openstack.org/kuryrport-finalizer";
/// Kuryr's finalizer on Services.
pub const SERVICE_FINALIZER: &str = "kuryr.openstack.org/service-finalizer";
/// Kuryr's finalizer on KuryrLoadBalancers.
pub const KURYRLB_FINALIZER: &str = "kuryr.openstack.org/kuryrloadbalancer-finalizers";
/// The name Kuryr gives the free ports of its pools.
pub const POOL_PORT_NAME: &str = "kuryr-pool-port";

/// Kuryr's resources, by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Per pod: its VIFs.
    KuryrPort,
    /// Per Service: its Octavia load balancer.
    KuryrLoadBalancer,
    /// Per namespace (namespace subnet driver): its network, subnet and router interface.
    KuryrNetwork,
    /// Per NetworkPolicy: its security group and rules.
    KuryrNetworkPolicy,
}

impl Kind {
    /// Every kind, in the order the migration looks at them.
    pub const ALL: [Kind; 4] = [Kind::KuryrPort, Kind::KuryrLoadBalancer, Kind::KuryrNetwork, Kind::KuryrNetworkPolicy];

    /// The kind's name.
    pub fn name(self) -> &'static str {
        match self {
            Kind::KuryrPort => "KuryrPort",
            Kind::KuryrLoadBalancer => "KuryrLoadBalancer",
            Kind::KuryrNetwork => "KuryrNetwork",
            Kind::KuryrNetworkPolicy => "KuryrNetworkPolicy",
        }
    }

    /// The API resource (`openstack.org/v1`, plural lower-case).
    pub fn resource(self) -> ApiResource {
        let plural = match self {
            Kind::KuryrPort => "kuryrports",
            Kind::KuryrLoadBalancer => "kuryrloadbalancers",
            Kind::KuryrNetwork => "kuryrnetworks",
            Kind::KuryrNetworkPolicy => "kuryrnetworkpolicies",
        };
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("openstack.org", "v1", self.name()), plural)
    }
}

/// A KuryrPort as the migration needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KuryrPort {
    /// Namespace (the pod's).
    pub namespace: String,
    /// Name (the pod's).
    pub name: String,
    /// `spec.podUid`.
    pub pod_uid: String,
    /// `spec.podNodeName`.
    pub node: String,
    /// `metadata.finalizers`.
    pub finalizers: Vec<String>,
    /// The pod's default VIF, once Kuryr gave it one.
    pub vif: Option<KuryrVif>,
    /// Interfaces besides the default one (additional networks): not migrated.
    pub extra_vifs: Vec<String>,
}

/// One VIF of a KuryrPort.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KuryrVif {
    /// The interface name in the pod (`eth0`).
    pub ifname: String,
    /// The Neutron port id.
    pub port_id: String,
    /// The port's MAC.
    pub mac: String,
    /// The addresses, without prefix length.
    pub ips: Vec<String>,
    /// Whether Kuryr saw the port ACTIVE (the pod was plugged).
    pub active: bool,
}

fn data(v: &Value) -> Option<&Value> {
    v.get("versioned_object.data")
}

fn objects(list: Option<&Value>) -> impl Iterator<Item = &Value> {
    list.and_then(data).and_then(|d| d.get("objects")).and_then(Value::as_array).into_iter().flatten()
}

/// The VIF of one `status.vifs` entry.
fn parse_vif(ifname: &str, entry: &Value) -> Result<KuryrVif, String> {
    let vif = entry.get("vif").and_then(data).ok_or_else(|| format!("VIF {ifname}: no os-vif object"))?;
    let field = |k: &str| vif.get(k).and_then(Value::as_str).map(str::to_string);
    let port_id = field("id").filter(|s| !s.is_empty()).ok_or_else(|| format!("VIF {ifname}: no port id"))?;
    let mac = field("address").unwrap_or_default().to_ascii_lowercase();
    let mut ips = Vec::new();
    let network = vif.get("network").and_then(data);
    for subnet in objects(network.and_then(|n| n.get("subnets"))) {
        for ip in objects(data(subnet).and_then(|s| s.get("ips"))) {
            if let Some(a) = data(ip).and_then(|d| d.get("address")).and_then(Value::as_str) {
                ips.push(a.to_string());
            }
        }
    }
    let active = vif.get("active").and_then(Value::as_bool).unwrap_or(false);
    Ok(KuryrVif { ifname: ifname.to_string(), port_id, mac, ips, active })
}

/// The default VIF of a KuryrPort's `status.vifs` (the one marked `default`, else the only one),
/// and the names of the others.
pub fn default_vif(vifs: Option<&Value>) -> Result<(Option<KuryrVif>, Vec<String>), String> {
    let Some(map) = vifs.and_then(Value::as_object) else { return Ok((None, Vec::new())) };
    let default = map
        .iter()
        .find(|(_, e)| e.get("default").and_then(Value::as_bool) == Some(true))
        .or_else(|| if map.len() == 1 { map.iter().next() } else { None });
    let Some((ifname, entry)) = default else {
        return if map.is_empty() { Ok((None, Vec::new())) } else { Err("no VIF is marked default".into()) };
    };
    let vif = parse_vif(ifname, entry)?;
    let extra = map.keys().filter(|k| *k != ifname).cloned().collect();
    Ok((Some(vif), extra))
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(k)).and_then(Value::as_str)
}

impl KuryrPort {
    /// Reads a KuryrPort object.
    pub fn from_object(o: &DynamicObject) -> Result<KuryrPort, String> {
        let namespace = o.metadata.namespace.clone().unwrap_or_default();
        let name = o.metadata.name.clone().unwrap_or_default();
        let pod_uid = str_at(&o.data, &["spec", "podUid"]).unwrap_or_default().to_string();
        if pod_uid.is_empty() {
            return Err(format!("KuryrPort {namespace}/{name}: no spec.podUid"));
        }
        let node = str_at(&o.data, &["spec", "podNodeName"]).unwrap_or_default().to_string();
        let (vif, extra_vifs) = default_vif(o.data.get("status").and_then(|s| s.get("vifs")))
            .map_err(|e| format!("KuryrPort {namespace}/{name}: {e}"))?;
        Ok(KuryrPort {
            namespace,
            name,
            pod_uid,
            node,
            finalizers: o.metadata.finalizers.clone().unwrap_or_default(),
            vif,
            extra_vifs,
        })
    }
}

/// A KuryrLoadBalancer as the migration needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KuryrLoadBalancer {
    /// Namespace (the Service's).
    pub namespace: String,
    /// Name (the Service's).
    pub name: String,
    /// `metadata.finalizers`.
    pub finalizers: Vec<String>,
    /// `status.loadbalancer.id`: the Octavia load balancer, once Kuryr made it.
    pub lb_id: Option<String>,
    /// `status.loadbalancer.ip`.
    pub vip: Option<String>,
    /// `status.service_pub_ip_info.ip_id`: the floating IP of a type=LoadBalancer Service.
    pub floating_ip_id: Option<String>,
    /// `status.service_pub_ip_info.alloc_method` is `user`: the Service's `loadBalancerIP`.
    pub floating_ip_user: bool,
    /// How many listeners, pools and members Kuryr recorded.
    pub counts: (usize, usize, usize),
}

impl KuryrLoadBalancer {
    /// Reads a KuryrLoadBalancer object.
    pub fn from_object(o: &DynamicObject) -> KuryrLoadBalancer {
        let status = o.data.get("status");
        let s = |path: &[&str]| status.and_then(|v| str_at(v, path)).filter(|s| !s.is_empty()).map(str::to_string);
        let n = |k: &str| status.and_then(|v| v.get(k)).and_then(Value::as_array).map_or(0, Vec::len);
        KuryrLoadBalancer {
            namespace: o.metadata.namespace.clone().unwrap_or_default(),
            name: o.metadata.name.clone().unwrap_or_default(),
            finalizers: o.metadata.finalizers.clone().unwrap_or_default(),
            lb_id: s(&["loadbalancer", "id"]),
            vip: s(&["loadbalancer", "ip"]),
            floating_ip_id: s(&["service_pub_ip_info", "ip_id"]),
            floating_ip_user: s(&["service_pub_ip_info", "alloc_method"]).as_deref() == Some("user"),
            counts: (n("listeners"), n("pools"), n("members")),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    fn ovs_vif(id: &str, mac: &str, ips: &[&str], active: bool) -> Value {
        let ips: Vec<Value> = ips
            .iter()
            .map(|a| json!({"versioned_object.data": {"address": a}, "versioned_object.name": "FixedIP"}))
            .collect();
        json!({"versioned_object.data": {
            "active": active, "address": mac, "id": id,
            "network": {"versioned_object.data": {"id": "net", "subnets": {"versioned_object.data": {"objects": [
                {"versioned_object.data": {"cidr": "10.0.0.0/16", "ips": {"versioned_object.data": {"objects": ips}}}}
            ]}}}}
        }, "versioned_object.name": "VIFOpenVSwitch"})
    }

    #[test]
    fn the_default_vif_is_read_from_the_os_vif_objects() {
        let vifs = json!({
            "eth0": {"default": true, "vif": ovs_vif("p1", "FA:16:3E:00:00:01", &["10.0.3.10"], true)},
            "eth1": {"default": false, "vif": ovs_vif("p2", "fa:16:3e:00:00:02", &["10.1.0.4"], false)},
        });
        let (vif, extra) = default_vif(Some(&vifs)).unwrap();
        let vif = vif.unwrap();
        assert_eq!(vif.port_id, "p1");
        assert_eq!(vif.mac, "fa:16:3e:00:00:01");
        assert_eq!(vif.ips, vec!["10.0.3.10"]);
        assert!(vif.active);
        assert_eq!(extra, vec!["eth1"]);
    }

    #[test]
    fn no_vifs_yet_is_none_and_an_ambiguous_set_is_an_error() {
        assert_eq!(default_vif(Some(&json!({}))).unwrap(), (None, vec![]));
        assert_eq!(default_vif(None).unwrap(), (None, vec![]));
        let two = json!({
            "eth0": {"vif": ovs_vif("p1", "m", &[], false)},
            "eth1": {"vif": ovs_vif("p2", "m", &[], false)},
        });
        assert!(default_vif(Some(&two)).is_err());
        let broken = json!({"eth0": {"default": true, "vif": {"versioned_object.data": {}}}});
        assert!(default_vif(Some(&broken)).unwrap_err().contains("no port id"));
    }

    #[test]
    fn a_load_balancer_is_read_with_its_floating_ip_and_how_kuryr_got_it() {
        let o: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "openstack.org/v1", "kind": "KuryrLoadBalancer",
            "metadata": {"name": "web", "namespace": "ns", "finalizers": ["f"]},
            "status": {
                "loadbalancer": {"id": "lb1", "ip": "10.96.0.10"},
                "listeners": [{}, {}], "pools": [{}, {}], "members": [{}],
                "service_pub_ip_info": {"ip_id": "fip1", "ip_addr": "203.0.113.5", "alloc_method": "user"},
            },
        }))
        .unwrap();
        let klb = KuryrLoadBalancer::from_object(&o);
        assert_eq!((klb.lb_id.as_deref(), klb.vip.as_deref()), (Some("lb1"), Some("10.96.0.10")));
        assert_eq!((klb.floating_ip_id.as_deref(), klb.floating_ip_user), (Some("fip1"), true));
        assert_eq!(klb.counts, (2, 2, 1));
        let pool: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "openstack.org/v1", "kind": "KuryrLoadBalancer", "metadata": {"name": "web"},
            "status": {"service_pub_ip_info": {"ip_id": "fip2", "alloc_method": "pool"}},
        }))
        .unwrap();
        assert!(!KuryrLoadBalancer::from_object(&pool).floating_ip_user);
    }

    #[test]
    fn resources_are_the_openstack_org_v1_plurals() {
        let r = Kind::KuryrNetworkPolicy.resource();
        assert_eq!(
            (r.group.as_str(), r.version.as_str(), r.plural.as_str()),
            ("openstack.org", "v1", "kuryrnetworkpolicies")
        );
        assert_eq!(Kind::KuryrPort.resource().plural, "kuryrports");
    }
}
