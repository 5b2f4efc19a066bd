//! Kubernetes objects the suites create, built in one place: a pod with one `busybox` container
//! named `main`, and what the suites vary about it (node, namespace, labels, annotations, host network,
//! grace period, command, ports). The Service-side objects are in [`crate::sut`].
//!
//! ```
//! let p = kuryr_tests::objects::pod("web-1").node("node-1").label("app", "web").sleeping().build();
//! assert_eq!(p.spec.unwrap().node_name.as_deref(), Some("node-1"));
//! ```

use std::collections::BTreeMap;

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Container, ContainerPort, Namespace, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use crate::services::wait_until;

/// Creates the namespace `name`, without labels.
pub async fn create_namespace(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let ns =
        Namespace { metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() }, ..Namespace::default() };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    Ok(())
}

/// Creates the namespace `name` (without labels); the API of its pods.
pub async fn namespace_with_pods(client: &kube::Client, name: &str) -> anyhow::Result<Api<Pod>> {
    create_namespace(client, name).await?;
    Ok(Api::namespaced(client.clone(), name))
}

/// Waits until `pods` lists no pod any more (their finalizers released), for at most `timeout`;
/// `what` names the wait in the error, which says how many are left.
pub async fn wait_no_pods(pods: &Api<Pod>, what: &str, timeout: Duration) -> anyhow::Result<()> {
    wait_until(what, timeout, || async {
        let left = pods.list(&ListParams::default()).await?.items.len();
        anyhow::ensure!(left == 0, "{left} pods left");
        Ok(())
    })
    .await
}

/// Deletes the pods `names` of `pods` at once (grace period 0), all the calls together; fails
/// when any of them does.
pub async fn delete_pods_now(pods: &Api<Pod>, names: impl IntoIterator<Item = String>) -> anyhow::Result<()> {
    let grace0 = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    let deletes = names.into_iter().map(|name| {
        let grace0 = &grace0;
        async move { pods.delete(&name, grace0).await.with_context(|| format!("deleting pod {name}")) }
    });
    for r in futures::future::join_all(deletes).await {
        r?;
    }
    Ok(())
}

/// A pod being described; [`PodBuilder::build`] makes it.
#[derive(Clone, Debug, Default)]
pub struct PodBuilder {
    name: String,
    namespace: Option<String>,
    node: Option<String>,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    host_network: Option<bool>,
    grace: Option<i64>,
    command: Option<Vec<String>>,
    ports: Vec<ContainerPort>,
}

/// A pod named `name`: no namespace (the API's client decides), not pinned to a node, no labels.
pub fn pod(name: &str) -> PodBuilder {
    PodBuilder { name: name.to_string(), ..PodBuilder::default() }
}

impl PodBuilder {
    /// In namespace `ns`.
    #[must_use]
    pub fn namespace(mut self, ns: &str) -> Self {
        self.namespace = Some(ns.to_string());
        self
    }

    /// Pinned to `node` (`spec.nodeName`), as a scheduler would have bound it.
    #[must_use]
    pub fn node(mut self, node: &str) -> Self {
        self.node = Some(node.to_string());
        self
    }

    /// With the label `key=value`.
    #[must_use]
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_string(), value.to_string());
        self
    }

    /// With the annotation `key: value`.
    #[must_use]
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.to_string(), value.to_string());
        self
    }

    /// With `spec.hostNetwork` set to `on`.
    #[must_use]
    pub fn host_network(mut self, on: bool) -> Self {
        self.host_network = Some(on);
        self
    }

    /// With `spec.terminationGracePeriodSeconds`.
    #[must_use]
    pub fn grace(mut self, seconds: i64) -> Self {
        self.grace = Some(seconds);
        self
    }

    /// Running `command`.
    #[must_use]
    pub fn command(mut self, command: Vec<String>) -> Self {
        self.command = Some(command);
        self
    }

    /// Running `sleep 1000000`: a pod that only holds its network.
    #[must_use]
    pub fn sleeping(self) -> Self {
        self.command(vec!["sleep".into(), "1000000".into()])
    }

    /// With a container port (`name` for named ports, `host_port` for hostPort).
    #[must_use]
    pub fn port(mut self, name: Option<&str>, protocol: &str, port: u16, host_port: Option<u16>) -> Self {
        self.ports.push(ContainerPort {
            name: name.map(ToString::to_string),
            container_port: i32::from(port),
            host_port: host_port.map(i32::from),
            protocol: Some(protocol.to_string()),
            ..ContainerPort::default()
        });
        self
    }

    /// The pod.
    pub fn build(self) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(self.name),
                namespace: self.namespace,
                labels: (!self.labels.is_empty()).then_some(self.labels),
                annotations: (!self.annotations.is_empty()).then_some(self.annotations),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: self.node,
                host_network: self.host_network,
                termination_grace_period_seconds: self.grace,
                containers: vec![Container {
                    name: "main".into(),
                    image: Some("busybox".into()),
                    command: self.command,
                    ports: (!self.ports.is_empty()).then_some(self.ports),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_pod_carries_what_was_asked_and_nothing_else() {
        let bare = pod("a").build();
        assert_eq!(bare.metadata.name.as_deref(), Some("a"));
        assert!(bare.metadata.namespace.is_none() && bare.metadata.labels.is_none());
        assert!(bare.metadata.annotations.is_none());
        let spec = bare.spec.unwrap();
        assert!(spec.node_name.is_none() && spec.host_network.is_none());
        assert_eq!(spec.containers[0].image.as_deref(), Some("busybox"));
        assert!(spec.containers[0].ports.is_none());

        let p = pod("b")
            .namespace("ns")
            .node("n1")
            .label("app", "web")
            .annotation("note", "x")
            .host_network(true)
            .grace(1)
            .sleeping()
            .port(Some("http"), "TCP", 8080, Some(80))
            .build();
        assert_eq!(p.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(p.metadata.labels.unwrap()["app"], "web");
        assert_eq!(p.metadata.annotations.unwrap()["note"], "x");
        let spec = p.spec.unwrap();
        assert_eq!(
            (spec.node_name.as_deref(), spec.host_network, spec.termination_grace_period_seconds),
            (Some("n1"), Some(true), Some(1))
        );
        let c = &spec.containers[0];
        assert_eq!(c.command.as_deref().unwrap(), ["sleep", "1000000"]);
        let port = &c.ports.as_ref().unwrap()[0];
        assert_eq!((port.name.as_deref(), port.container_port, port.host_port), (Some("http"), 8080, Some(80)));
    }
}
