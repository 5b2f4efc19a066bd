//! A kuryr service under test: one process of a service binary with its gRPC and metrics
//! addresses on free loopback ports, and what every suite asks of it — SERVING on its health
//! service, a metrics scrape, the tail of its log when something fails — plus the Kubernetes
//! objects the Service suites write (Services, EndpointSlices and their endpoints).
//!
//! ```no_run
//! # async fn demo(dir: &std::path::Path) -> anyhow::Result<()> {
//! use kuryr_tests::sut::Sut;
//! let lbaas = Sut::spawn("kuryr-lbaas", &["--kubeconfig".into(), "k.yaml".into()], dir, "lb-1")?;
//! lbaas.wait_serving("kuryr.lbaas.v1.LoadBalancers", std::time::Duration::from_secs(60)).await?;
//! let before = lbaas.scrape().await?;
//! # Ok(()) }
//! ```

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use kuryr_lbaas::k8s::crd::ServiceLoadBalancer;
use serde_json::{Value, json};

use crate::metrics::Scrape;
use crate::services::{ServiceProcess, wait_until};
use crate::util::free_port;

/// One running service process.
#[derive(Debug)]
pub struct Sut {
    /// The process (killed on drop).
    pub proc: ServiceProcess,
    /// What the test calls it (a replica id, `lb-1`); names it in failures.
    pub id: String,
    /// `127.0.0.1:port` of its gRPC server.
    pub addr: String,
    /// `127.0.0.1:port` of its metrics server.
    pub metrics_addr: String,
}

impl Sut {
    /// Starts `bin` with `args` plus `--listen` and `--metrics-listen` on free loopback ports,
    /// logging to a file in `dir`.
    pub fn spawn(bin: &str, args: &[String], dir: &Path, id: &str) -> Result<Self> {
        let addr = format!("127.0.0.1:{}", free_port()?);
        let metrics_addr = format!("127.0.0.1:{}", free_port()?);
        let mut args = args.to_vec();
        args.extend(["--listen".into(), addr.clone(), "--metrics-listen".into(), metrics_addr.clone()]);
        let proc = ServiceProcess::spawn(bin, &args, dir)?;
        Ok(Self { proc, id: id.to_string(), addr, metrics_addr })
    }

    /// `http://127.0.0.1:port/metrics`.
    pub fn metrics_url(&self) -> String {
        format!("http://{}/metrics", self.metrics_addr)
    }

    /// Waits until its health service reports `service` SERVING; the error carries the tail of
    /// its log.
    pub async fn wait_serving(&self, service: &str, timeout: Duration) -> Result<()> {
        wait_until(&format!("{} SERVING {service}", self.id), timeout, || async {
            kuryr_runtime::client::check_serving(kuryr_runtime::client::channel(&self.addr)?, service).await
        })
        .await
        .with_context(|| self.logs_tail(80))
    }

    /// Its metrics now.
    pub async fn scrape(&self) -> Result<Scrape> {
        Scrape::http(&self.metrics_addr).await
    }

    /// Its metrics exposition now, as text.
    pub async fn metrics_text(&self) -> Result<String> {
        let url = self.metrics_url();
        let resp = reqwest::Client::new().get(&url).timeout(Duration::from_secs(10)).send().await?;
        anyhow::ensure!(resp.status().is_success(), "GET {url}: {}", resp.status());
        resp.text().await.with_context(|| format!("GET {url}: reading the body"))
    }

    /// The last `n` lines of its log, headed by its id.
    pub fn logs_tail(&self, n: usize) -> String {
        let text = self.proc.logs();
        let lines: Vec<&str> = text.lines().collect();
        format!("==== {} (last {n} lines)\n{}", self.id, lines[lines.len().saturating_sub(n)..].join("\n"))
    }
}

/// The flags that make a process replica `id` of a service split into `shards` Lease shards
/// held for `lease` (`3s`): `--instance` and `--replica-id` `id`, `--shards`, `--lease-duration`,
/// and a short `--shutdown-grace`.
pub fn replica_args(id: &str, shards: u32, lease: &str) -> Vec<String> {
    ["--instance", id, "--replica-id", id, "--shards", &shards.to_string(), "--lease-duration", lease]
        .into_iter()
        .chain(["--shutdown-grace", "3s"])
        .map(str::to_string)
        .collect()
}

/// The log tails of several processes, for a failure message.
pub fn logs(suts: &[&Sut], n: usize) -> String {
    suts.iter().map(|s| s.logs_tail(n)).collect::<Vec<_>>().join("\n")
}

/// A Service `name` with `spec` (JSON as in a manifest).
pub fn service(name: &str, spec: Value) -> Result<Service> {
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).context("building a Service")
}

/// An EndpointSlice `name` of the Service `service` in `family` (`IPv4`, `IPv6`) with `ports` and
/// `endpoints` (JSON as in a manifest).
pub fn slice(name: &str, service: &str, family: &str, ports: Value, endpoints: Value) -> Result<EndpointSlice> {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": family,
        "ports": ports,
        "endpoints": endpoints,
    }))
    .context("building an EndpointSlice")
}

/// A ready, serving endpoint at `addr`.
pub fn ready_endpoint(addr: &str) -> Value {
    json!({"addresses": [addr], "conditions": {"ready": true, "serving": true, "terminating": false}})
}

/// The endpoints of pods on `node` in namespace `ns`, each (address, ready, serving, terminating,
/// pod name), as a JSON array for [`slice()`].
pub fn pod_endpoints(ns: &str, node: &str, list: &[(&str, bool, bool, bool, &str)]) -> Value {
    let eps: Vec<Value> = list
        .iter()
        .map(|(addr, ready, serving, terminating, pod)| {
            json!({
                "addresses": [addr],
                "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
                "nodeName": node,
                "targetRef": {"kind": "Pod", "namespace": ns, "name": pod},
            })
        })
        .collect();
    Value::Array(eps)
}

/// Fails unless kuryr-lbaas' `record` is ACTIVE at its current generation (lbaas has settled on it).
pub fn active_at_generation(record: &ServiceLoadBalancer) -> Result<()> {
    let st = record.status.clone().unwrap_or_default();
    anyhow::ensure!(
        st.provisioning_status.as_deref() == Some("ACTIVE") && st.observed_generation == record.metadata.generation,
        "{st:?} at generation {:?}",
        record.metadata.generation
    );
    Ok(())
}

/// Waits until the record `name` of `records` is ACTIVE at its current generation; the record.
pub async fn wait_record_active(
    records: &Api<ServiceLoadBalancer>,
    name: &str,
    timeout: Duration,
) -> Result<ServiceLoadBalancer> {
    wait_until(&format!("{name}'s record ACTIVE at its generation"), timeout, || async {
        let r = records.get(name).await?;
        active_at_generation(&r)?;
        Ok(r)
    })
    .await
}

/// Creates `slice`, or replaces the slice of that name.
pub async fn put_slice(api: &Api<EndpointSlice>, slice: EndpointSlice) -> Result<()> {
    let name = slice.metadata.name.clone().context("EndpointSlice without a name")?;
    match api.get_opt(&name).await? {
        None => drop(api.create(&PostParams::default(), &slice).await?),
        Some(old) => {
            let mut slice = slice;
            slice.metadata.resource_version = old.metadata.resource_version;
            api.replace(&name, &PostParams::default(), &slice).await?;
        }
    }
    Ok(())
}
