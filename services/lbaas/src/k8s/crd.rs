//! lbaas' custom resource (group `kuryr.openstack.org`, version `v1alpha1`):
//! [`ServiceLoadBalancer`], namespaced and named after its Service.
//!
//! The spec is the desired load balancer (written by lbaas from the Service and its
//! EndpointSlices); `metadata.generation`, which the API server raises on every spec change, is
//! the generation streamed to dataplanes, so it stays monotonic across lbaas restarts. The status
//! subresource holds what the backend observed — written by another hand than the spec, never
//! last-writer-wins — with `observedGeneration` telling whether it has converged.
//!
//! The manifest in `deploy/crds/` is generated from these types; a unit test fails when it is
//! stale, and `KURYR_UPDATE_CRDS=1 cargo test -p kuryr-lbaas crd` rewrites it.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::core::lb::{Listener, LoadBalancerSpec, Member, Pool, Protocol, SessionAffinity, TrafficPolicy};

/// The desired and observed load balancer of one Service.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "kuryr.openstack.org",
    version = "v1alpha1",
    kind = "ServiceLoadBalancer",
    plural = "serviceloadbalancers",
    shortname = "slb",
    category = "kuryr",
    namespaced,
    status = "ServiceLoadBalancerStatus",
    derive = "PartialEq",
    doc = "The load balancer Kuryr gives a Service: the desired listeners and members, and what the backend observed.",
    printcolumn = r#"{"name": "Type", "type": "string", "jsonPath": ".spec.serviceType"}"#,
    printcolumn = r#"{"name": "VIPs", "type": "string", "jsonPath": ".spec.vips[*]"}"#,
    printcolumn = r#"{"name": "Status", "type": "string", "jsonPath": ".status.provisioningStatus"}"#,
    printcolumn = r#"{"name": "Generation", "type": "integer", "jsonPath": ".metadata.generation"}"#,
    printcolumn = r#"{"name": "Observed", "type": "integer", "jsonPath": ".status.observedGeneration"}"#,
    printcolumn = r#"{"name": "Backend", "type": "string", "jsonPath": ".spec.backend", "priority": 1}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ServiceLoadBalancerSpec {
    /// The Service's uid; changes when the Service is deleted and re-created under its name.
    pub service_uid: String,
    /// `ClusterIP`, `NodePort` or `LoadBalancer`.
    pub service_type: String,
    /// The virtual IPs: the Service's cluster IPs, both families when dual-stack.
    pub vips: Vec<String>,
    /// The Service's `spec.externalIPs`.
    #[serde(default, rename = "externalIPs", skip_serializing_if = "Vec::is_empty")]
    pub external_ips: Vec<String>,
    /// The load balancer addresses of the Service's status (`status.loadBalancer.ingress`).
    #[serde(default, rename = "ingressIPs", skip_serializing_if = "Vec::is_empty")]
    pub ingress_ips: Vec<String>,
    /// `Local` when the Service's `externalTrafficPolicy` is; absent for `Cluster`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub external_traffic_policy: String,
    /// `Local` when the Service's `internalTrafficPolicy` is; absent for `Cluster`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub internal_traffic_policy: String,
    /// One listener per Service port.
    #[serde(default)]
    pub listeners: Vec<ListenerSpec>,
    /// Client affinity.
    #[serde(default)]
    pub session_affinity: AffinitySpec,
    /// The backend that programs it: `node` (the embedded nftables dataplane) or `octavia`.
    pub backend: String,
}

/// A Service port and its members.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListenerSpec {
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    /// The Service port.
    pub port: u32,
    /// The Service port's name (empty for a single unnamed port).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// The node port (types NodePort and LoadBalancer); absent when there is none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub node_port: u32,
    /// The endpoints traffic may go to.
    #[serde(default)]
    pub members: Vec<Member>,
}

/// Client affinity.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AffinitySpec {
    /// ClientIP affinity requested.
    #[serde(default, rename = "clientIP")]
    pub client_ip: bool,
    /// How long a client stays with its member, in seconds (0 without affinity).
    #[serde(default)]
    pub timeout_seconds: u32,
}

/// What the backend observed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceLoadBalancerStatus {
    /// `PROGRAMMED` (node backend: published to every node's dataplane), or Octavia's
    /// `ACTIVE`, `PENDING_*`, `ERROR`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioning_status: Option<String>,
    /// The `metadata.generation` of the spec the backend last converged to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The backend's identifier of the load balancer (Octavia's id); absent for the node backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_id: Option<String>,
    /// The external address for type=LoadBalancer, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress_ip: Option<String>,
    /// Why the load balancer is not converged, or other detail for humans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A traffic policy in the record: `Local`, or empty for Cluster (the default, so that records
/// written before the field existed read the same).
fn policy_name(p: TrafficPolicy) -> String {
    match p {
        TrafficPolicy::Local => "Local".into(),
        TrafficPolicy::Cluster => String::new(),
    }
}

impl ServiceLoadBalancerSpec {
    /// Records `spec` (its generation aside) as programmed by `backend`.
    pub fn from_spec(spec: &LoadBalancerSpec, backend: &str) -> Self {
        let affinity = spec.session_affinity.unwrap_or_default();
        Self {
            service_uid: spec.uid.clone(),
            service_type: spec.service_type.clone(),
            vips: spec.vips.clone(),
            external_ips: spec.external_ips.clone(),
            ingress_ips: spec.ingress_ips.clone(),
            external_traffic_policy: policy_name(spec.external_traffic_policy),
            internal_traffic_policy: policy_name(spec.internal_traffic_policy),
            listeners: spec
                .listeners
                .iter()
                .map(|l| ListenerSpec {
                    protocol: l.protocol.as_str().to_string(),
                    port: l.port,
                    name: l.name.clone(),
                    node_port: l.node_port,
                    members: l.pool.iter().flat_map(|p| &p.members).cloned().collect(),
                })
                .collect(),
            session_affinity: AffinitySpec { client_ip: affinity.client_ip, timeout_seconds: affinity.timeout_seconds },
            backend: backend.to_string(),
        }
    }

    /// The spec of the Service `namespace/name` at `generation`, as recorded.
    pub fn to_spec(&self, namespace: &str, name: &str, generation: u64) -> LoadBalancerSpec {
        LoadBalancerSpec {
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: self.service_uid.clone(),
            vips: self.vips.clone(),
            listeners: self
                .listeners
                .iter()
                .map(|l| Listener {
                    protocol: Protocol::parse(&l.protocol).unwrap_or(Protocol::Tcp),
                    port: l.port,
                    name: l.name.clone(),
                    node_port: l.node_port,
                    pool: Some(Pool { members: l.members.clone() }),
                })
                .collect(),
            session_affinity: Some(SessionAffinity {
                client_ip: self.session_affinity.client_ip,
                timeout_seconds: self.session_affinity.timeout_seconds,
            }),
            service_type: self.service_type.clone(),
            generation,
            external_ips: self.external_ips.clone(),
            ingress_ips: self.ingress_ips.clone(),
            external_traffic_policy: TrafficPolicy::parse(&self.external_traffic_policy),
            internal_traffic_policy: TrafficPolicy::parse(&self.internal_traffic_policy),
        }
    }
}

/// lbaas' CRDs, with the file each is kept in under `deploy/crds/`.
pub fn crds() -> Vec<(&'static str, CustomResourceDefinition)> {
    vec![("kuryr.openstack.org_serviceloadbalancers.yaml", ServiceLoadBalancer::crd())]
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::path::{Path, PathBuf};

    use serde_json::json;

    use super::*;
    use crate::core::spec::{Desired, ServiceRef, desired};

    const HEADER: &str = "# Generated from services/lbaas/src/k8s/crd.rs; do not edit.\n\
                          # Regenerate: KURYR_UPDATE_CRDS=1 cargo test -p kuryr-lbaas crd\n";

    fn render(crd: &CustomResourceDefinition) -> String {
        format!("{HEADER}{}", serde_saphyr::to_string(crd).unwrap())
    }

    fn crd_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds")
    }

    /// The committed manifest must be what the types generate. With `KURYR_UPDATE_CRDS=1` the
    /// test rewrites it instead (reading the environment is fine: nothing here sets it).
    #[test]
    fn crd_manifest_is_current() {
        let update = std::env::var("KURYR_UPDATE_CRDS").is_ok_and(|v| v == "1");
        for (file, crd) in crds() {
            let path = crd_dir().join(file);
            let want = render(&crd);
            let have = std::fs::read_to_string(&path).unwrap_or_default();
            if have == want {
                continue;
            }
            if update {
                std::fs::write(&path, &want).unwrap();
                eprintln!("rewrote {}", path.display());
                continue;
            }
            let line = have.lines().zip(want.lines()).position(|(a, b)| a != b);
            panic!(
                "{} is stale (first difference at line {:?}); regenerate with \
                 `KURYR_UPDATE_CRDS=1 cargo test -p kuryr-lbaas crd` and review the diff",
                path.display(),
                line.map(|l| l + 1)
            );
        }
    }

    #[test]
    fn the_crd_is_namespaced_with_a_status_subresource() {
        let crd = ServiceLoadBalancer::crd();
        assert_eq!(crd.metadata.name.as_deref(), Some("serviceloadbalancers.kuryr.openstack.org"));
        assert_eq!(crd.spec.scope, "Namespaced");
        let v = &crd.spec.versions[0];
        assert_eq!(v.name, "v1alpha1");
        assert!(v.subresources.as_ref().and_then(|s| s.status.as_ref()).is_some());
        let columns: Vec<&str> = v.additional_printer_columns.iter().flatten().map(|c| c.name.as_str()).collect();
        assert_eq!(columns, ["Type", "VIPs", "Status", "Generation", "Observed", "Backend", "Age"]);
    }

    #[test]
    fn specs_round_trip_through_the_record() {
        use crate::core::input::{Endpoint, EndpointPort, EndpointSlice, Service, ServicePort};
        let svc = Service {
            r#type: "NodePort".into(),
            cluster_ips: vec!["10.96.0.10".into(), "fd00::10".into()],
            external_traffic_policy: "Local".into(),
            external_ips: vec!["192.0.2.7".into()],
            load_balancer_ingress_ips: vec!["198.51.100.7".into()],
            ports: vec![
                ServicePort {
                    name: "a".into(),
                    protocol: "UDP".into(),
                    port: 53,
                    target_port: "53".into(),
                    node_port: 30053,
                },
                ServicePort {
                    name: "b".into(),
                    protocol: "SCTP".into(),
                    port: 9,
                    target_port: "9".into(),
                    node_port: 0,
                },
            ],
            session_affinity: "ClientIP".into(),
            ..Default::default()
        };
        let slice = EndpointSlice {
            service_name: "s".into(),
            address_type: "IPv4".into(),
            endpoints: vec![Endpoint {
                addresses: vec!["10.1.0.1".into()],
                ready: false,
                serving: true,
                terminating: true,
                node_name: "n1".into(),
                target_pod: "ns/p".into(),
                zone: String::new(),
            }],
            ports: vec![
                EndpointPort { name: "a".into(), protocol: "UDP".into(), port: 5353 },
                EndpointPort { name: "b".into(), protocol: "SCTP".into(), port: 99 },
            ],
        };
        let r = ServiceRef { namespace: "ns", name: "s", uid: "u", service: &svc };
        let Desired::Lb(spec) = desired(&r, &[&slice]) else { panic!() };
        let record = ServiceLoadBalancerSpec::from_spec(&spec, "node");
        let back = record.to_spec("ns", "s", 0);
        assert_eq!(back, spec);
        assert_eq!(record.to_spec("ns", "s", 7).generation, 7);
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(json["listeners"][1]["protocol"], "SCTP");
        assert_eq!(
            (json["listeners"][0]["nodePort"].clone(), json["listeners"][1].get("nodePort")),
            (json!(30053), None)
        );
        assert_eq!(json["externalIPs"], json!(["192.0.2.7"]));
        assert_eq!(json["ingressIPs"], json!(["198.51.100.7"]));
        assert_eq!(json["externalTrafficPolicy"], "Local");
        assert_eq!(json.get("internalTrafficPolicy"), None, "Cluster is the default and left out");
        // A record written before these fields existed reads as a ClusterIP spec with defaults.
        let old: ServiceLoadBalancerSpec = serde_json::from_value(json!({
            "serviceUid": "u", "serviceType": "ClusterIP", "vips": ["10.96.0.1"], "backend": "node",
            "listeners": [{"protocol": "TCP", "port": 80}]
        }))
        .unwrap();
        let p = old.to_spec("ns", "s", 1);
        assert_eq!((p.listeners[0].node_port, p.external_traffic_policy), (0, TrafficPolicy::Cluster));
        assert_eq!(json["sessionAffinity"], json!({"clientIP": true, "timeoutSeconds": 10800}));
        assert_eq!(
            json["listeners"][0]["members"][0],
            json!({"address": "10.1.0.1", "port": 5353, "ready": false, "serving": true, "terminating": true,
                   "nodeName": "n1", "targetPod": "ns/p"})
        );
    }
}
