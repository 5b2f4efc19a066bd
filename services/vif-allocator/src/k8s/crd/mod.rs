//! The allocator's custom resources (group `kuryr.openstack.org`, version `v1alpha1`).
//!
//! - [`PodNetwork`] (cluster-scoped): a pod network of the embedded IPAM — its CIDRs, how they are
//!   carved into per-node blocks, and what pods get besides addresses (MTU, routes, bridge).
//! - [`AddressBlock`] (cluster-scoped): one block of a network claimed by one node; its status
//!   holds the block's allocations. Every allocation is a status write carrying the
//!   resourceVersion it was computed from, so concurrent allocators cannot hand out one address
//!   twice (see [`crate::backend::ipam`]).
//! - [`PodVif`] (namespaced, named after its pod): the VIF a pod was given and where it is in its
//!   life. The spec says whose pod it is and which VIF it got: the allocator creates the PodVif
//!   once the VIF is allocated, VIF included, in one request. The status subresource holds only
//!   what changes later (the state the binder's plug reports move), so a state write cannot touch
//!   the record, nor a record rewrite race a state write into last-writer-wins. PodVifs written
//!   by earlier versions hold the VIF in `status.vif` instead; [`PodVif::vif`] reads either.
//! - [`NamespaceNetwork`] (cluster-scoped, named after its namespace): with the Neutron backend's
//!   per-namespace networks, the network, subnets and router interfaces of one namespace.
//! - [`NetworkAttachmentDefinition`] (group `k8s.cni.cncf.io`): the further networks a pod may
//!   ask for ([`crate::core::attach`]); the allocator only reads them.
//!
//! One module per resource: [`network`], [`podvif`], [`namespace`], [`nad`].
//!
//! The manifests in `deploy/crds/` are generated from these types; a unit test fails when they
//! are stale, and `KURYR_UPDATE_CRDS=1 cargo test -p kuryr-vif-allocator crd` rewrites them.

pub mod nad;
pub mod namespace;
pub mod network;
pub mod podvif;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

pub use nad::{NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec};
pub use namespace::{
    NamespaceNetwork, NamespaceNetworkPhase, NamespaceNetworkSpec, NamespaceNetworkStatus, NamespaceSubnet,
};
pub use network::{
    AddressBlock, AddressBlockSpec, AddressBlockStatus, BlockAllocation, PodNetwork, PodNetworkSpec, PodNetworkStatus,
    RouteSpec,
};
pub use podvif::{AttachedRecord, PodVif, PodVifSpec, PodVifStatus, VifBinding, VifIp, VifRecord, VifState};

/// The API group of every Kuryr resource.
pub const GROUP: &str = "kuryr.openstack.org";

/// Every CRD of the allocator, with the file it is kept in under `deploy/crds/`.
pub fn crds() -> Vec<(&'static str, CustomResourceDefinition)> {
    vec![
        ("kuryr.openstack.org_podnetworks.yaml", PodNetwork::crd()),
        ("kuryr.openstack.org_addressblocks.yaml", AddressBlock::crd()),
        ("kuryr.openstack.org_podvifs.yaml", PodVif::crd()),
        ("kuryr.openstack.org_namespacenetworks.yaml", NamespaceNetwork::crd()),
    ]
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use serde_json::json;

    use super::*;
    use crate::core::ipam::{self, PlanError};

    const HEADER: &str = "# Generated from services/vif-allocator/src/k8s/crd/; do not edit.\n\
                          # Regenerate: KURYR_UPDATE_CRDS=1 cargo test -p kuryr-vif-allocator crd\n";

    fn render(crd: &CustomResourceDefinition) -> String {
        format!("{HEADER}{}", serde_saphyr::to_string(crd).unwrap())
    }

    fn crd_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds")
    }

    /// The committed manifests must be what the types generate. With `KURYR_UPDATE_CRDS=1` the
    /// test rewrites them instead (reading the environment is fine: nothing here sets it).
    #[test]
    fn crd_manifests_are_current() {
        let update = std::env::var("KURYR_UPDATE_CRDS").is_ok_and(|v| v == "1");
        let dir = crd_dir();
        let mut stale = Vec::new();
        let nad = ("k8s.cni.cncf.io_network-attachment-definitions.yaml", nad::crd());
        for (file, crd) in crds().into_iter().chain([nad]) {
            let path = dir.join(file);
            let want = render(&crd);
            let have = std::fs::read_to_string(&path).unwrap_or_default();
            if have == want {
                continue;
            }
            if update {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &want).unwrap();
                eprintln!("rewrote {}", path.display());
                continue;
            }
            let line = have.lines().zip(want.lines()).position(|(a, b)| a != b);
            let hint = match line {
                Some(i) => format!(
                    "first difference at line {}:\n  committed: {}\n  generated: {}",
                    i + 1,
                    have.lines().nth(i).unwrap_or_default(),
                    want.lines().nth(i).unwrap_or_default()
                ),
                None if have.is_empty() => "missing".to_string(),
                None => format!("lengths differ ({} vs {} lines)", have.lines().count(), want.lines().count()),
            };
            stale.push(format!("{}: {hint}", path.display()));
        }
        assert!(
            stale.is_empty(),
            "deploy/crds is stale; regenerate with `KURYR_UPDATE_CRDS=1 cargo test -p kuryr-vif-allocator crd` \
             and review the diff:\n{}",
            stale.join("\n")
        );
    }

    #[test]
    fn crds_have_status_subresources_and_the_right_scope() {
        for (_, crd) in crds() {
            let name = crd.metadata.name.clone().unwrap();
            assert!(name.ends_with(".kuryr.openstack.org"), "{name}");
            let version = &crd.spec.versions[0];
            assert_eq!(version.name, "v1alpha1");
            assert!(version.subresources.as_ref().and_then(|s| s.status.as_ref()).is_some(), "{name} has no status");
            let scope = if name.starts_with("podvifs.") { "Namespaced" } else { "Cluster" };
            assert_eq!(crd.spec.scope, scope, "{name}");
        }
        let block = serde_json::to_string(&AddressBlock::crd()).unwrap();
        assert!(block.contains(r#""rule":"self == oldSelf""#), "AddressBlock spec must be immutable");
    }

    #[test]
    fn pod_network_defaults_apply_when_fields_are_absent() {
        let spec: PodNetworkSpec = serde_json::from_value(json!({"cidrs": ["10.244.0.0/16"]})).unwrap();
        assert_eq!(spec, PodNetworkSpec::new(["10.244.0.0/16"]));
        assert_eq!((spec.ipv4_block_prefix, spec.ipv6_block_prefix, spec.mtu), (24, 112, 1500));
        assert_eq!(spec.bridge, "kuryr0");
        assert!(spec.plan().is_ok());
        // The schema carries the same defaults, so the API server fills them in too.
        let schema = serde_json::to_value(PodNetwork::crd().spec.versions[0].schema.clone()).unwrap();
        let props = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"];
        assert_eq!(props["ipv4BlockPrefix"]["default"], 24);
        assert_eq!(props["ipv6BlockPrefix"]["default"], 112);
        assert_eq!(props["mtu"]["default"], 1500);
        assert_eq!(props["bridge"]["default"], "kuryr0");
    }

    #[test]
    fn invalid_specs_are_refused_by_plan() {
        let mut spec = PodNetworkSpec::new(["10.244.0.0/16", "10.245.0.0/16"]);
        assert!(matches!(spec.plan(), Err(PlanError::DuplicateFamily { .. })));
        spec.cidrs = vec!["fd00::/64".into()];
        spec.mtu = 1000;
        assert!(matches!(spec.plan(), Err(PlanError::Mtu { .. })));
    }

    #[test]
    fn a_pod_vif_is_read_in_its_shape_and_in_the_earlier_one() {
        let vif = json!({"vifId": "pods/10.244.3.9", "mac": "0a:58:0a:f4:03:09", "mtu": 1500,
                         "ips": [{"address": "10.244.3.9/24"}], "bridge": "kuryr0"});
        let pv = |body: serde_json::Value| -> PodVif {
            let mut obj = json!({"apiVersion": "kuryr.openstack.org/v1alpha1", "kind": "PodVif",
                                 "metadata": {"name": "p", "namespace": "ns"}});
            obj.as_object_mut().unwrap().extend(body.as_object().unwrap().clone());
            serde_json::from_value(obj).unwrap()
        };
        let spec = json!({"podUid": "u", "podName": "p", "nodeName": "n1", "network": "pods"});
        let mut with_vif = spec.clone();
        with_vif["vif"] = vif.clone();
        // As created now: the VIF in the spec, no status (Allocated).
        let now = pv(json!({"spec": with_vif}));
        assert_eq!(now.vif().map(|v| v.vif_id.as_str()), Some("pods/10.244.3.9"));
        assert_eq!((now.state(), now.vif_in_status()), (VifState::Allocated, false));
        // As earlier versions wrote it: the VIF in the status.
        let earlier = pv(json!({"spec": spec, "status": {"vif": vif, "state": "Ready"}}));
        assert_eq!(earlier.vif(), now.vif());
        assert_eq!((earlier.state(), earlier.vif_in_status()), (VifState::Ready, true));
        // Created, nothing recorded (an earlier version between its create and its status write).
        let bare = pv(json!({"spec": spec}));
        assert_eq!((bare.vif(), bare.vif_in_status()), (None, false));
        // What the create sends: the VIF in the spec, no status at all.
        let sent = serde_json::to_value(&now).unwrap();
        assert_eq!(sent["spec"]["vif"]["vifId"], "pods/10.244.3.9");
        assert!(sent.get("status").is_none_or(serde_json::Value::is_null), "{sent}");
    }

    #[test]
    fn vif_records_mirror_the_vif_config() {
        let spec = PodNetworkSpec {
            routes: vec![RouteSpec { destination: "10.96.0.0/12".into(), gateway: None }],
            ..PodNetworkSpec::new(["10.244.0.0/16"])
        };
        let plan = spec.plan().unwrap();
        let block = ipam::Block::parse("10.244.3.0/24").unwrap();
        let vif = plan.vif(&[(block, "10.244.3.9".parse().unwrap())]).unwrap();
        let record = VifRecord::from_config("pods/10.244.3.9", &vif);
        assert_eq!(
            serde_json::to_value(&record).unwrap(),
            json!({
                "vifId": "pods/10.244.3.9",
                "mac": "0a:58:0a:f4:03:09",
                "mtu": 1500,
                "ips": [{"address": "10.244.3.9/24", "gateway": "10.244.3.1"}],
                "routes": [{"destination": "10.96.0.0/12", "gateway": "10.244.3.1"}],
                "bridge": "kuryr0",
            })
        );
        let state = serde_json::to_value(VifState::Ready).unwrap();
        assert_eq!(state, json!("Ready"));
    }

    /// The API server does not check a block's entries, so the allocator reads any entry: one of
    /// another shape holds its address and matches no pod; a good one reads whole and is written
    /// back in the same shape.
    #[test]
    fn block_entries_are_read_leniently() {
        let block: AddressBlock = serde_json::from_value(json!({
            "apiVersion": "kuryr.openstack.org/v1alpha1",
            "kind": "AddressBlock",
            "metadata": {"name": "pods-10-244-3-0-24"},
            "spec": {"network": "pods", "cidr": "10.244.3.0/24", "node": "n1"},
            "status": {"used": 3, "allocations": {
                "10.244.3.2": {"namespace": "ns", "name": "a", "uid": "u1", "mac": "0a:58:0a:f4:03:02"},
                "10.244.3.3": {"namespace": "ns", "uid": 7},
                "10.244.3.4": "garbage",
            }},
        }))
        .unwrap();
        let allocations = &block.status.as_ref().unwrap().allocations;
        let good = &allocations["10.244.3.2"];
        assert_eq!((good.name.as_str(), good.uid.as_str(), good.mac.as_str()), ("a", "u1", "0a:58:0a:f4:03:02"));
        assert_eq!(allocations["10.244.3.3"], BlockAllocation { namespace: "ns".into(), ..BlockAllocation::default() });
        assert_eq!(allocations["10.244.3.4"], BlockAllocation::default());
        assert_eq!(
            serde_json::to_value(good).unwrap(),
            json!({"namespace": "ns", "name": "a", "uid": "u1", "mac": "0a:58:0a:f4:03:02"})
        );
    }
}
