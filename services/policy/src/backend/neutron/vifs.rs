//! The pods' Neutron ports: the PodVif records the allocator writes (`kuryr.openstack.org/v1alpha1`,
//! one per pod, named after it), taken from kuryr-policy's PodVif watch ([`podvifs`]). Only VIFs of the `neutron`
//! backend count; the port id is the VIF id, and the groups recorded at allocation are what a
//! pod no policy selects gets back.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::api::DynamicObject;
use kube::runtime::watcher;
use kuryr_policy_core::PodKey;
use tokio::sync::watch;

use crate::k8s::podvifs;

/// A pod's Neutron port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vif {
    /// The Neutron port id.
    pub port: String,
    /// The port's security groups at allocation, sorted.
    pub default_groups: Vec<String>,
}

/// Every pod's port.
pub type Vifs = Arc<BTreeMap<PodKey, Vif>>;

/// The port of a PodVif, if it has a Neutron VIF.
pub fn vif_of(o: &DynamicObject) -> Option<(PodKey, Vif)> {
    let key = podvifs::pod_key(o)?;
    let vif = podvifs::recorded_vif(o)?;
    if vif.get("backend").and_then(|b| b.as_str()) != Some("neutron") {
        return None;
    }
    let port = vif.get("vifId")?.as_str()?.to_string();
    if port.is_empty() {
        return None;
    }
    let mut default_groups: Vec<String> = vif
        .get("securityGroups")
        .and_then(|g| g.as_array())
        .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    default_groups.sort();
    Some((key, Vif { port, default_groups }))
}

/// Every pod's Neutron port, sent whole after each change (the reconciler starts on the first
/// complete list).
#[derive(Debug)]
pub struct PortSink {
    tx: watch::Sender<Vifs>,
    current: BTreeMap<PodKey, Vif>,
    init: Option<BTreeMap<PodKey, Vif>>,
}

impl PortSink {
    /// A sink sending into `tx`.
    pub fn new(tx: watch::Sender<Vifs>) -> Self {
        Self { tx, current: BTreeMap::new(), init: None }
    }
}

impl podvifs::Sink for PortSink {
    fn handle(&mut self, ev: &watcher::Event<DynamicObject>) -> bool {
        let changed = match ev {
            watcher::Event::Init => {
                self.init = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(o) => {
                if let (Some(m), Some((k, v))) = (self.init.as_mut(), vif_of(o)) {
                    m.insert(k, v);
                }
                false
            }
            watcher::Event::InitDone => {
                self.current = self.init.take().unwrap_or_default();
                true
            }
            watcher::Event::Apply(o) => match (vif_of(o), podvifs::pod_key(o)) {
                (Some((k, v)), _) => self.current.insert(k, v.clone()) != Some(v),
                (None, Some(key)) => self.current.remove(&key).is_some(),
                (None, None) => false,
            },
            watcher::Event::Delete(o) => podvifs::pod_key(o).is_some_and(|key| self.current.remove(&key).is_some()),
        };
        if changed {
            self.tx.send_replace(Arc::new(self.current.clone()));
        }
        !self.tx.is_closed()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn only_neutron_vifs_name_a_port() {
        let o = |vif: serde_json::Value| -> DynamicObject {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "kuryr.openstack.org/v1alpha1", "kind": "PodVif",
                "metadata": {"namespace": "ns", "name": "p"}, "status": {"vif": vif}
            }))
            .unwrap()
        };
        let (k, v) = vif_of(&o(serde_json::json!({"vifId": "port-1", "backend": "neutron",
                                                 "securityGroups": ["sg-b", "sg-a"]})))
        .unwrap();
        assert_eq!(k, PodKey { namespace: "ns".into(), name: "p".into() });
        assert_eq!(v, Vif { port: "port-1".into(), default_groups: vec!["sg-a".into(), "sg-b".into()] });
        assert_eq!(vif_of(&o(serde_json::json!({"vifId": "default/10.0.0.1"}))), None, "embedded IPAM");
    }

    #[test]
    fn the_vif_is_read_from_the_spec_and_from_an_earlier_version_s_status() {
        let o = |body: serde_json::Value| -> DynamicObject {
            let mut obj = serde_json::json!({
                "apiVersion": "kuryr.openstack.org/v1alpha1", "kind": "PodVif",
                "metadata": {"namespace": "ns", "name": "p"}
            });
            obj.as_object_mut().unwrap().extend(body.as_object().unwrap().clone());
            serde_json::from_value(obj).unwrap()
        };
        let vif = |port: &str| serde_json::json!({"vifId": port, "backend": "neutron"});
        let port = |o: &DynamicObject| vif_of(o).map(|(_, v)| v.port);
        let current =
            o(serde_json::json!({"spec": {"podUid": "u", "vif": vif("port-1")}, "status": {"state": "Ready"}}));
        assert_eq!(port(&current).as_deref(), Some("port-1"));
        let earlier =
            o(serde_json::json!({"spec": {"podUid": "u"}, "status": {"vif": vif("port-2"), "state": "Ready"}}));
        assert_eq!(port(&earlier).as_deref(), Some("port-2"));
        assert_eq!(port(&o(serde_json::json!({"spec": {"podUid": "u"}}))), None, "no VIF yet");
    }
}
