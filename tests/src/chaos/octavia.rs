//! The load-balancer part of the Neutron chaos run: replicas of kuryr-lbaas `--backend octavia`
//! sharded by Leases, reaching the real Octavia (API and worker, amphora provider with the no-op
//! drivers) only through a [`FaultProxy`] of their own (503s, 409s, timeouts, slow answers and
//! lost answers to POSTs: the load balancer, listener, pool or member was created but lbaas never
//! heard), for a few Services whose endpoints are the live pods of the run. The members follow
//! the pods as they churn, Services are deleted and others created under new names, and replicas
//! are killed and stopped among the other process faults.
//!
//! Read from Octavia directly (not through the proxy): a load balancer tagged for the cluster whose
//! Service does not exist (a leak), two for one Service (a duplicate) — during the run only when
//! they last longer than the grace period — and at the end, once quiet: every Service has exactly
//! one load balancer, ACTIVE, whose one listener's members are exactly the Service's endpoints
//! (otherwise the Service does not answer as it should: counted as unreachable); every deleted
//! Service is gone (its finalizer released).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use super::invariants::Kind;
use crate::faultproxy::{FaultProxy, FaultRates, FaultTiming};
use crate::neutron::{NeutronCluster, Svc};
use crate::octavia::OctaviaReader;
use crate::openstack::OctaviaLbaas;
use crate::sut::{self, Sut};

/// The project owning the load balancers (the test Octavia runs with noauth: any id will do).
const PROJECT: &str = "5d0c4e8f1a2b4c3d9e8f7a6b5c4d3e2f";
/// Any id is a VIP subnet for the no-op network driver.
const VIP_SUBNET: &str = "3c9e1f7a-2b4d-4e6f-8a0b-1c2d3e4f5a6b";
/// Lease shards of the lbaas replicas.
const SHARDS: u32 = 8;
/// The port every Service listens on, and its endpoints' port.
const PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;

/// The load balancers under chaos.
#[allow(missing_debug_implementations)] // holds the proxy, which has no Debug
pub struct LbChaos {
    /// The fault proxy in front of Octavia.
    pub proxy: FaultProxy,
    /// The kuryr-lbaas replicas, by index.
    pub replicas: Vec<Sut>,
    reader: OctaviaReader,
    flags: OctaviaLbaas,
    namespace: String,
    /// The Services of the run now, each with the endpoints it was last given.
    services: BTreeMap<String, Vec<String>>,
    /// Services deleted during the run.
    deleted: BTreeSet<String>,
    next: usize,
}

impl LbChaos {
    /// Starts `replicas` kuryr-lbaas replicas following `watcher`, Octavia behind a proxy with no
    /// faults yet, and creates `services` Services in `namespace` with no endpoints.
    pub async fn start(
        c: &NeutronCluster,
        watcher: &Svc,
        (replicas, services): (usize, usize),
        namespace: &str,
        seed: u64,
    ) -> Result<Self> {
        let octavia = c.os.octavia_url().context("the OpenStack environment runs no Octavia")?.to_string();
        let proxy = FaultProxy::start(&octavia, FaultRates::NONE, FaultTiming::default(), seed).await?;
        let flags = OctaviaLbaas {
            url: proxy.url().to_string(),
            project: PROJECT.into(),
            vip_subnet: Some(VIP_SUBNET.into()),
            cluster_name: format!("chaos{}", crate::util::unique_id()),
            drift_interval: "5s".into(),
            active_timeout: "60s".into(),
        };
        let mut lb = Self {
            proxy,
            replicas: Vec::new(),
            reader: OctaviaReader::new(&octavia, PROJECT)?,
            flags,
            namespace: namespace.to_string(),
            services: BTreeMap::new(),
            deleted: BTreeSet::new(),
            next: 0,
        };
        for i in 0..replicas.max(1) {
            let r = lb.spawn(c, watcher, i).await?;
            lb.replicas.push(r);
        }
        for r in &lb.replicas {
            r.wait_serving(kuryr_proto::service_names::LOAD_BALANCERS, Duration::from_secs(120)).await?;
        }
        for _ in 0..services {
            lb.create(&c.admin).await?;
        }
        Ok(lb)
    }

    async fn spawn(&self, c: &NeutronCluster, watcher: &Svc, i: usize) -> Result<Sut> {
        let id = format!("lbc-{i}");
        let mut extra: Vec<String> = sut::replica_args(&id, SHARDS, "3s");
        // ClusterIP Services get Octavia load balancers and the finalizer too.
        extra.extend(["--service-finalizer".to_string(), "all".to_string()]);
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        c.lbaas_as(watcher, &self.flags, &id, &extra).await
    }

    /// Replica `i` killed with SIGKILL and started again under its name.
    pub async fn kill(&mut self, c: &NeutronCluster, watcher: &Svc, i: usize) -> Result<()> {
        self.replicas[i].proc.kill().await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        self.replicas[i] = self.spawn(c, watcher, i).await?;
        Ok(())
    }

    fn services(&self, admin: &kube::Client) -> Api<Service> {
        Api::namespaced(admin.clone(), &self.namespace)
    }

    fn slices(&self, admin: &kube::Client) -> Api<EndpointSlice> {
        Api::namespaced(admin.clone(), &self.namespace)
    }

    async fn create(&mut self, admin: &kube::Client) -> Result<String> {
        let name = format!("lb{}", self.next);
        self.next += 1;
        let svc = sut::service(&name, json!({"ports": [{"port": PORT, "targetPort": TARGET_PORT}]}))?;
        self.services(admin).create(&PostParams::default(), &svc).await.with_context(|| format!("creating {name}"))?;
        self.put(admin, &name, &[]).await?;
        self.services.insert(name.clone(), Vec::new());
        Ok(name)
    }

    async fn put(&self, admin: &kube::Client, name: &str, addrs: &[String]) -> Result<()> {
        let endpoints: Vec<serde_json::Value> = addrs.iter().map(|a| sut::ready_endpoint(a)).collect();
        let ports = json!([{"port": TARGET_PORT, "protocol": "TCP"}]);
        let slice = sut::slice(&format!("{name}-1"), name, "IPv4", ports, json!(endpoints))?;
        sut::put_slice(&self.slices(admin), slice).await.with_context(|| format!("the EndpointSlice of {name}"))
    }

    /// Gives the Services the live pods' addresses as endpoints (pod `j` of `addrs` behind
    /// Service `j mod n`); only the Services whose endpoints changed are written.
    pub async fn follow_pods(&mut self, admin: &kube::Client, addrs: &[String]) -> Result<usize> {
        let names: Vec<String> = self.services.keys().cloned().collect();
        let mut written = 0;
        for (k, name) in names.iter().enumerate() {
            let mut want: Vec<String> =
                addrs.iter().enumerate().filter(|(j, _)| j % names.len() == k).map(|(_, a)| a.clone()).collect();
            want.sort();
            if self.services.get(name) != Some(&want) {
                self.put(admin, name, &want).await?;
                self.services.insert(name.clone(), want);
                written += 1;
            }
        }
        Ok(written)
    }

    /// Deletes the oldest Service and creates one under a new name; says which.
    pub async fn rotate(&mut self, admin: &kube::Client) -> Result<String> {
        let Some(old) = self.services.keys().next().cloned() else { return Ok(String::new()) };
        self.services(admin).delete(&old, &DeleteParams::default()).await.with_context(|| format!("deleting {old}"))?;
        let _ = self.slices(admin).delete(&format!("{old}-1"), &DeleteParams::default()).await;
        self.services.remove(&old);
        self.deleted.insert(old.clone());
        let new = self.create(admin).await?;
        Ok(format!("{old} → {new}"))
    }

    /// Leaks and duplicates now, keyed for [`super::invariants::Lasting`].
    pub async fn problems(&self, admin: &kube::Client) -> Result<Vec<(String, Kind, String)>> {
        // Every namespace's: `default/kubernetes` has a load balancer too.
        let existing: BTreeSet<String> = Api::<Service>::all(admin.clone())
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .map(|s| format!("{}/{}", s.metadata.namespace.unwrap_or_default(), s.metadata.name.unwrap_or_default()))
            .collect();
        let lbs = self.reader.by_service(&self.flags.cluster_name).await.context("listing Octavia's load balancers")?;
        let mut out = Vec::new();
        for (service, of) in &lbs {
            let ids: Vec<&str> = of.iter().filter_map(|l| l["id"].as_str()).collect();
            if !existing.contains(service) {
                let line = format!("load balancers {ids:?} of {service}, which does not exist");
                out.push((format!("lb-leak {service}"), Kind::Leak, line));
            } else if of.len() > 1 {
                out.push((
                    format!("lb-dup {service}"),
                    Kind::Duplicate,
                    format!("{service} has load balancers {ids:?}"),
                ));
            }
        }
        Ok(out)
    }

    /// Everything [`Self::problems`] finds, and: a Service of the run without exactly one ACTIVE
    /// load balancer whose members are its endpoints; a deleted Service still there.
    pub async fn final_problems(&self, admin: &kube::Client) -> Result<Vec<(Kind, String)>> {
        let mut out: Vec<(Kind, String)> = self.problems(admin).await?.into_iter().map(|(_, k, l)| (k, l)).collect();
        let lbs = self.reader.by_service(&self.flags.cluster_name).await?;
        for (name, endpoints) in &self.services {
            let key = format!("{}/{name}", self.namespace);
            let of = lbs.get(&key).cloned().unwrap_or_default();
            let [lb] = of.as_slice() else {
                if of.is_empty() {
                    out.push((Kind::Unreachable, format!("Service {key} has no load balancer")));
                }
                continue;
            };
            let id = lb["id"].as_str().unwrap_or_default();
            if lb["provisioning_status"] != "ACTIVE" {
                out.push((
                    Kind::Unreachable,
                    format!("Service {key}: load balancer {id} is {}", lb["provisioning_status"]),
                ));
                continue;
            }
            // Sorted as the tree's members are: with the port ("10.0.0.241:8080" before "10.0.0.2:8080").
            let mut members: Vec<String> = endpoints.iter().map(|a| format!("{a}:{TARGET_PORT}")).collect();
            members.sort();
            let want = vec![(format!("TCP:{PORT}"), members)];
            match self.reader.tree(id).await {
                Ok(tree) if tree == want => {}
                Ok(tree) => out
                    .push((Kind::Unreachable, format!("Service {key}: load balancer {id} is {tree:?}, want {want:?}"))),
                Err(e) => out.push((Kind::Unreachable, format!("Service {key}: load balancer {id}: {e:#}"))),
            }
        }
        let api = self.services(admin);
        for name in &self.deleted {
            if let Some(s) = api.get_opt(name).await? {
                let fin = s.metadata.finalizers.unwrap_or_default();
                out.push((
                    Kind::Leak,
                    format!("Service {}/{name} deleted but still there, finalizers {fin:?}", self.namespace),
                ));
            }
        }
        Ok(out)
    }

    /// The replicas' logs.
    pub fn logs(&self) -> String {
        sut::logs(&self.replicas.iter().collect::<Vec<_>>(), 200)
    }

    /// `kuryr_retries_total` text of every replica that answers.
    pub async fn metrics(&self) -> String {
        let mut out = String::new();
        for r in &self.replicas {
            out.push_str(&r.metrics_text().await.unwrap_or_default());
        }
        out
    }
}
