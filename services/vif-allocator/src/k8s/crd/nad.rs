//! [`NetworkAttachmentDefinition`] (group `k8s.cni.cncf.io`, version `v1`), as the Network
//! Plumbing Working Group specifies it: the networks a pod's further interfaces are on
//! ([`crate::core::attach`] reads the annotation naming them and their `spec.config`).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{CustomResource, CustomResourceExt as _};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A NetworkAttachmentDefinition, as the Network Plumbing Working Group specifies it.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "k8s.cni.cncf.io",
    version = "v1",
    kind = "NetworkAttachmentDefinition",
    plural = "network-attachment-definitions",
    shortname = "net-attach-def",
    namespaced,
    doc = "A network a pod may attach further interfaces to (Network Plumbing Working Group)."
)]
pub struct NetworkAttachmentDefinitionSpec {
    /// The CNI configuration of the network, as JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
}

/// The definition's CRD, as `deploy/crds/` holds it.
pub fn crd() -> CustomResourceDefinition {
    NetworkAttachmentDefinition::crd()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crd_is_the_upstream_one() {
        let c = crd();
        assert_eq!(c.metadata.name.as_deref(), Some("network-attachment-definitions.k8s.cni.cncf.io"));
        assert_eq!(c.spec.scope, "Namespaced");
        assert_eq!(c.spec.names.short_names, Some(vec!["net-attach-def".to_string()]));
    }
}
