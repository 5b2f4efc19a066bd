//! The pods' recorded VIFs: the PodVif records the allocator writes (`kuryr.openstack.org/v1alpha1`,
//! one per pod, named after it, created with the VIF before the binder plugs it), read with a
//! Kubernetes watch. Their addresses stand for a pod's while its status has none
//! ([`crate::core::VifAddresses`]), so a pod a policy selects is isolated once its VIF is recorded,
//! not only after the kubelet's later status report.

use std::collections::HashMap;
use std::net::IpAddr;

use futures::StreamExt as _;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::{WatchStreamExt as _, watcher};
use kuryr_policy_core::PodKey;
use kuryr_runtime::Shutdown;
use tokio::sync::mpsc;

use crate::core::{VifAddresses, VifChange};

/// The PodVif resource.
pub fn resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk("kuryr.openstack.org", "v1alpha1", "PodVif");
    ApiResource::from_gvk_with_plural(&gvk, "podvifs")
}

/// The VIF a PodVif records: `spec.vif`, or `status.vif` in one written by an earlier allocator.
pub fn recorded_vif(o: &DynamicObject) -> Option<&serde_json::Value> {
    o.data.get("spec").and_then(|s| s.get("vif")).or_else(|| o.data.get("status").and_then(|s| s.get("vif")))
}

/// The pod a PodVif is named after.
pub fn pod_key(o: &DynamicObject) -> Option<PodKey> {
    Some(PodKey { namespace: o.metadata.namespace.clone()?, name: o.metadata.name.clone()? })
}

/// The addresses of a PodVif's VIF, for the pod of `spec.podUid`; `None` without a VIF, a uid or
/// an address.
pub fn addresses(o: &DynamicObject) -> Option<VifAddresses> {
    let uid = o.data.get("spec")?.get("podUid")?.as_str().filter(|u| !u.is_empty())?.to_string();
    let ips: Vec<IpAddr> = recorded_vif(o)?
        .get("ips")?
        .as_array()?
        .iter()
        .filter_map(|ip| ip.get("address")?.as_str()?.split('/').next()?.parse().ok())
        .collect();
    (!ips.is_empty()).then_some(VifAddresses { uid, ips })
}

/// What consumes the PodVif watch: each event in turn (the initial list as `Init`, `InitApply`
/// per object, `InitDone`; then `Apply` and `Delete`). Returns false once it has nobody to deliver
/// to.
pub trait Sink: Send {
    fn handle(&mut self, ev: &watcher::Event<DynamicObject>) -> bool;
}

/// The recorded VIFs' addresses, as [`VifChange`]s for the publisher.
#[derive(Debug)]
pub struct AddressSink {
    tx: mpsc::UnboundedSender<VifChange>,
    listing: Option<HashMap<PodKey, VifAddresses>>,
}

impl AddressSink {
    /// A sink, and where its changes arrive.
    pub fn new() -> (Self, mpsc::UnboundedReceiver<VifChange>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx, listing: None }, rx)
    }
}

impl Sink for AddressSink {
    fn handle(&mut self, ev: &watcher::Event<DynamicObject>) -> bool {
        let change = match ev {
            watcher::Event::Init => {
                self.listing = Some(HashMap::new());
                return true;
            }
            watcher::Event::InitApply(o) => {
                if let (Some(all), Some(key), Some(v)) = (self.listing.as_mut(), pod_key(o), addresses(o)) {
                    all.insert(key, v);
                }
                return true;
            }
            watcher::Event::InitDone => VifChange::Listed(self.listing.take().unwrap_or_default()),
            watcher::Event::Apply(o) => match (pod_key(o), addresses(o)) {
                (Some(key), Some(v)) => VifChange::Set(key, v),
                (Some(key), None) => VifChange::Gone(key),
                (None, _) => return true,
            },
            watcher::Event::Delete(o) => match pod_key(o) {
                Some(key) => VifChange::Gone(key),
                None => return true,
            },
        };
        self.tx.send(change).is_ok()
    }
}

/// Follows every PodVif into `sinks` until shutdown or until no sink has anybody to deliver to.
/// The watch re-lists by itself after errors, with kube's backoff; errors are logged and counted
/// in `errors`.
pub async fn follow(
    client: kube::Client,
    mut sinks: Vec<Box<dyn Sink>>,
    errors: prometheus_client::metrics::counter::Counter,
    shutdown: Shutdown,
) {
    let api: Api<DynamicObject> = Api::all_with(client, &resource());
    let mut stream = watcher::watcher(api, kuryr_runtime::watch_config()).default_backoff().boxed();
    while !sinks.is_empty() {
        let ev = tokio::select! {
            ev = stream.next() => ev,
            () = shutdown.clone().wait() => return,
        };
        match ev {
            None => return,
            Some(Ok(ev)) => sinks.retain_mut(|s| s.handle(&ev)),
            Some(Err(e)) => {
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

    fn podvif(body: serde_json::Value) -> DynamicObject {
        let mut o = serde_json::json!({
            "apiVersion": "kuryr.openstack.org/v1alpha1", "kind": "PodVif",
            "metadata": {"namespace": "ns", "name": "p"}
        });
        o.as_object_mut().unwrap().extend(body.as_object().unwrap().clone());
        serde_json::from_value(o).unwrap()
    }

    #[test]
    fn addresses_come_from_the_spec_or_an_earlier_version_s_status() {
        let vif = serde_json::json!({"vifId": "default/10.244.0.5", "ips": [
            {"address": "10.244.0.5/24", "gateway": "10.244.0.1"}, {"address": "fd00::5/64"}]});
        let want =
            VifAddresses { uid: "u1".into(), ips: vec!["10.244.0.5".parse().unwrap(), "fd00::5".parse().unwrap()] };
        let o = podvif(serde_json::json!({"spec": {"podUid": "u1", "vif": vif}}));
        assert_eq!(pod_key(&o), Some(PodKey { namespace: "ns".into(), name: "p".into() }));
        assert_eq!(addresses(&o), Some(want.clone()));
        let o = podvif(serde_json::json!({"spec": {"podUid": "u1"}, "status": {"vif": vif}}));
        assert_eq!(addresses(&o), Some(want));
    }

    #[test]
    fn no_uid_no_vif_or_no_address_gives_nothing() {
        let vif = serde_json::json!({"ips": [{"address": "10.244.0.5/24"}]});
        assert_eq!(addresses(&podvif(serde_json::json!({"spec": {"vif": vif}}))), None);
        assert_eq!(addresses(&podvif(serde_json::json!({"spec": {"podUid": "u1"}}))), None);
        let junk = serde_json::json!({"ips": [{"address": "junk"}]});
        assert_eq!(addresses(&podvif(serde_json::json!({"spec": {"podUid": "u1", "vif": junk}}))), None);
    }

    #[test]
    fn the_address_sink_sends_the_list_whole_then_each_change() {
        let (mut sink, mut rx) = AddressSink::new();
        let vif = serde_json::json!({"ips": [{"address": "10.244.0.5/24"}]});
        let o = podvif(serde_json::json!({"spec": {"podUid": "u1", "vif": vif}}));
        let bare = podvif(serde_json::json!({"spec": {"podUid": "u1"}}));
        let key = PodKey { namespace: "ns".into(), name: "p".into() };
        let want = VifAddresses { uid: "u1".into(), ips: vec!["10.244.0.5".parse().unwrap()] };
        assert!(sink.handle(&watcher::Event::Init));
        assert!(sink.handle(&watcher::Event::InitApply(o.clone())));
        assert!(rx.try_recv().is_err(), "nothing before the list is complete");
        assert!(sink.handle(&watcher::Event::InitDone));
        assert_eq!(rx.try_recv().unwrap(), VifChange::Listed([(key.clone(), want.clone())].into()));
        assert!(sink.handle(&watcher::Event::Apply(o.clone())));
        assert_eq!(rx.try_recv().unwrap(), VifChange::Set(key.clone(), want));
        assert!(sink.handle(&watcher::Event::Apply(bare)));
        assert_eq!(rx.try_recv().unwrap(), VifChange::Gone(key.clone()));
        assert!(sink.handle(&watcher::Event::Delete(o.clone())));
        assert_eq!(rx.try_recv().unwrap(), VifChange::Gone(key));
        drop(rx);
        assert!(!sink.handle(&watcher::Event::Delete(o)), "nobody to deliver to");
    }
}
