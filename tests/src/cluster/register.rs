//! Registering a node in the API the way kubelet does: the Node object, then its addresses,
//! Ready condition and system info through the status subresource.

use std::net::IpAddr;

use anyhow::Result;
use k8s_openapi::api::core::v1::Node as NodeObject;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

/// Creates the Node object and reports it Ready with its addresses through the status
/// subresource, as kubelet does when it registers.
pub(super) async fn register_node(client: &kube::Client, name: &str, ips: &[IpAddr]) -> Result<()> {
    let nodes: Api<NodeObject> = Api::all(client.clone());
    let labels = [("kubernetes.io/hostname", name), ("kubernetes.io/os", "linux"), ("kubernetes.io/arch", arch())]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let node = NodeObject {
        metadata: ObjectMeta { name: Some(name.into()), labels: Some(labels), ..ObjectMeta::default() },
        ..NodeObject::default()
    };
    nodes.create(&PostParams::default(), &node).await?;
    let now = Time(Timestamp::now());
    let mut addresses: Vec<_> = ips.iter().map(|ip| json!({ "type": "InternalIP", "address": ip })).collect();
    addresses.push(json!({ "type": "Hostname", "address": name }));
    let os = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    let os_image = os
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim_matches('"').to_string())
        .unwrap_or_else(|| "Linux".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let status = json!({ "status": {
        "addresses": addresses,
        "conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "kuryr-tests kubelet is posting ready status",
            "lastHeartbeatTime": now, "lastTransitionTime": now,
        }],
        "nodeInfo": {
            "machineID": "", "systemUUID": "", "bootID": "",
            "kernelVersion": kernel.trim(), "osImage": os_image,
            "containerRuntimeVersion": "containerd", "kubeletVersion": "kuryr-tests",
            "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": arch(),
        },
    }});
    nodes.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await?;
    Ok(())
}

/// The architecture as Kubernetes names it.
fn arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}
