//! The pods' Neutron ports: the PodVif records the allocator writes (`kuryr.openstack.org/v1alpha1`,
//! one per pod, named after it), read with a Kubernetes watch. Only VIFs of the `neutron`
//! backend count; the port id is the VIF id, and the groups recorded at allocation are what a
//! pod no policy selects gets back.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt as _;
use kube::api::{Api, DynamicObject};
use kube::runtime::{WatchStreamExt as _, watcher};
use kuryr_policy_core::PodKey;
use kuryr_runtime::Shutdown;
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

/// Follows every PodVif into `tx` until shutdown (the watch re-lists by itself after errors,
/// with kube's backoff; errors are logged and counted in `errors`).
pub async fn follow(
    client: kube::Client,
    tx: watch::Sender<Vifs>,
    errors: prometheus_client::metrics::counter::Counter,
    shutdown: Shutdown,
) {
    let api: Api<DynamicObject> = Api::all_with(client, &podvifs::resource());
    let mut stream = watcher::watcher(api, kuryr_runtime::watch_config()).default_backoff().boxed();
    let mut current: BTreeMap<PodKey, Vif> = BTreeMap::new();
    let mut init: Option<BTreeMap<PodKey, Vif>> = None;
    loop {
        let ev = tokio::select! {
            ev = stream.next() => ev,
            () = shutdown.clone().wait() => return,
        };
        let Some(ev) = ev else { return };
        match ev {
            Ok(watcher::Event::Init) => init = Some(BTreeMap::new()),
            Ok(watcher::Event::InitApply(o)) => {
                if let (Some(m), Some((k, v))) = (init.as_mut(), vif_of(&o)) {
                    m.insert(k, v);
                }
            }
            Ok(watcher::Event::InitDone) => {
                current = init.take().unwrap_or_default();
                tx.send_replace(Arc::new(current.clone()));
            }
            Ok(watcher::Event::Apply(o)) => {
                let key = PodKey {
                    namespace: o.metadata.namespace.clone().unwrap_or_default(),
                    name: o.metadata.name.clone().unwrap_or_default(),
                };
                let changed = match vif_of(&o) {
                    Some((k, v)) => current.insert(k, v.clone()) != Some(v),
                    None => current.remove(&key).is_some(),
                };
                if changed {
                    tx.send_replace(Arc::new(current.clone()));
                }
            }
            Ok(watcher::Event::Delete(o)) => {
                let key = PodKey {
                    namespace: o.metadata.namespace.clone().unwrap_or_default(),
                    name: o.metadata.name.clone().unwrap_or_default(),
                };
                if current.remove(&key).is_some() {
                    tx.send_replace(Arc::new(current.clone()));
                }
            }
            Err(e) => {
                errors.inc();
                tracing::warn!(error = %e, "watching PodVifs failed; retrying");
            }
        }
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
