//! Reading Octavia back as the suites check it: a cluster's load balancers by the Service their
//! `kuryr-service=<namespace>/<name>` tag names, and a load balancer's listeners with their
//! members. Plain HTTP on Octavia's API with a project header (the test Octavia runs with
//! noauth), not through kuryr's own client: what is checked is what Octavia holds.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;

/// Octavia's v2 API for one project.
#[derive(Clone, Debug)]
pub struct OctaviaReader {
    http: reqwest::Client,
    base: String,
    project: String,
}

impl OctaviaReader {
    /// Octavia at `url` (its endpoint, without `/v2`) as project `project`.
    pub fn new(url: &str, project: &str) -> Result<Self> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
        Ok(Self { http, base: format!("{}/v2/lbaas", url.trim_end_matches('/')), project: project.to_string() })
    }

    /// `GET <base>/<path>`, which must answer 200.
    pub async fn get(&self, path: &str) -> Result<Value> {
        let resp = self
            .http
            .get(format!("{}/{path}", self.base))
            .header("X-Project-Id", &self.project)
            .send()
            .await
            .with_context(|| format!("GET {path}"))?;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        anyhow::ensure!(status == 200, "GET {path}: {status} {body}");
        Ok(body)
    }

    /// The load balancers tagged for `cluster_name`, by the Service their tag names (`""` when
    /// none does).
    pub async fn by_service(&self, cluster_name: &str) -> Result<BTreeMap<String, Vec<Value>>> {
        let body = self.get(&format!("loadbalancers?tags=kuryr-cluster%3D{cluster_name}")).await?;
        let mut out: BTreeMap<String, Vec<Value>> = BTreeMap::new();
        for lb in body["loadbalancers"].as_array().cloned().unwrap_or_default() {
            let service = lb["tags"]
                .as_array()
                .into_iter()
                .flatten()
                .find_map(|t| t.as_str().and_then(|t| t.strip_prefix("kuryr-service=")))
                .unwrap_or_default()
                .to_string();
            out.entry(service).or_default().push(lb);
        }
        Ok(out)
    }

    /// The listeners of load balancer `lb` as `PROTO:port`, each with its pool's members as
    /// `address:port` (sorted); an error names anything not ACTIVE.
    pub async fn tree(&self, lb: &str) -> Result<Vec<(String, Vec<String>)>> {
        let listeners = self.get(&format!("listeners?loadbalancer_id={lb}")).await?;
        let mut out = Vec::new();
        for l in listeners["listeners"].as_array().cloned().unwrap_or_default() {
            anyhow::ensure!(l["provisioning_status"] == "ACTIVE", "listener not ACTIVE: {l}");
            let name = format!("{}:{}", l["protocol"].as_str().unwrap_or_default(), l["protocol_port"]);
            let Some(pool) = l["default_pool_id"].as_str() else { anyhow::bail!("listener {name} has no pool") };
            let ms = self.get(&format!("pools/{pool}/members")).await?;
            let mut members = Vec::new();
            for m in ms["members"].as_array().cloned().unwrap_or_default() {
                anyhow::ensure!(m["provisioning_status"] == "ACTIVE", "member not ACTIVE: {m}");
                members.push(format!("{}:{}", m["address"].as_str().unwrap_or_default(), m["protocol_port"]));
            }
            members.sort();
            out.push((name, members));
        }
        out.sort();
        Ok(out)
    }
}
