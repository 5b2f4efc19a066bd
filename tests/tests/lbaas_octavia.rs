//! kuryr-lbaas with `--backend octavia` as users run it: its own process under the
//! `kuryr-lbaas` ServiceAccount (deploy/rbac), fed by a real kuryr-watcher, against a real
//! kube-apiserver and a real Octavia (API + worker over RabbitMQ, amphora provider with the
//! no-op drivers, tests/env/openstack). Everything is read back from Octavia's own API.
//!
//! The life of a Service's load balancer: created in one fully-populated call with a listener
//! and a named pool per port and the ready endpoints as members, recorded ACTIVE at its
//! generation; endpoint churn → one batch member update per changed pool; ports added and
//! removed → listeners and pools follow; a pool and a whole load balancer deleted behind lbaas'
//! back → recreated by the drift pass; kill -9 and restart → the load balancer adopted (no
//! second one) and an orphan of this cluster removed; the Octavia worker and then the API
//! stopped in the middle of a change → retries with backoff, failures reported (status,
//! metrics, Events), convergence once they return; Service deleted → cascade delete, record and
//! finalizer gone.
//!
//! type=LoadBalancer against real Neutron too: lbaas creates the VIP port in Neutron (the
//! no-op network driver of Octavia would only invent a port id), Octavia takes it, and a
//! floating IP from an external network behind a router lands on it and in the Service's
//! `status.loadBalancer.ingress`; deleting the Service removes the floating IP and the port.
//!
//! Members carry no `subnet_id`: with the no-op network driver, removing a member whose subnet
//! is the VIP subnet fails inside the worker (tests/env/openstack, RECIPES), which real Neutron
//! does not do.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kuryr_lbaas::k8s::crd::ServiceLoadBalancer;
use kuryr_openstack::neutron::RouterInterface;
use kuryr_openstack::{Client, ClientOptions, CloudConfig, Filter, Metrics};
use kuryr_proto::lbaas::v1::GetLoadBalancerRequest;
use kuryr_proto::lbaas::v1::load_balancers_client::LoadBalancersClient;
use kuryr_proto::service_names::LOAD_BALANCERS;
use kuryr_tests::control::{ControlPlane, Watcher};
use kuryr_tests::metrics::Scrape;
use kuryr_tests::openstack::{OctaviaLbaas, Service as OsService};
use kuryr_tests::services::wait_until;
use kuryr_tests::sut::{self, Sut};
use kuryr_tests::topology;
use kuryr_tests::util::unique_id;
use serde_json::{Value, json};

/// Bound on one convergence: Octavia takes 0.3–4 s per change on an idle machine, several
/// times that on a loaded one.
const CONVERGE: Duration = Duration::from_secs(120);
/// Bound on something lbaas does within a poll or two.
const EVENT_WAIT: Duration = Duration::from_secs(10);
/// Bound on becoming SERVING.
const PHASE_TIMEOUT: Duration = Duration::from_secs(90);
const FINALIZER: &str = "kuryr.openstack.org/lbaas";
const NS: &str = "lbo";
/// The project owning the load balancers (Octavia runs with noauth: any id will do).
const PROJECT: &str = "5b0c8e1f3a2d4c6b9e7f1a2b3c4d5e6f";
/// Any id is a VIP subnet for the no-op network driver.
const VIP_SUBNET: &str = "6d1f5a2c-9b3e-4c7d-8e0f-1a2b3c4d5e6f";

fn start_watcher(c: &ControlPlane) -> Watcher {
    c.watcher(None, &[]).unwrap()
}

fn start_lbaas(c: &ControlPlane, watcher: &Watcher, octavia_url: &str, cluster_name: &str, extra: &[&str]) -> Sut {
    let octavia = OctaviaLbaas {
        url: octavia_url.into(),
        project: PROJECT.into(),
        vip_subnet: (!extra.contains(&"--vip-subnet-id")).then(|| VIP_SUBNET.into()),
        cluster_name: cluster_name.into(),
        drift_interval: "3s".into(),
        active_timeout: "20s".into(),
    };
    let mut args = octavia.args();
    // This suite follows the finalizer's life on ClusterIP Services too.
    args.extend(["--service-finalizer", "all"]);
    args.extend_from_slice(extra);
    c.lbaas(watcher, "lbo-1", &args).unwrap()
}

async fn put_slice(c: &ControlPlane, name: &str, service: &str, ports: Value, eps: Value) {
    sut::put_slice(&c.api(), sut::slice(name, service, "IPv4", ports, eps).unwrap()).await.unwrap();
}

/// The record once it is ACTIVE at its current generation.
async fn converged(c: &ControlPlane, name: &str, lbaas: &Sut) -> ServiceLoadBalancer {
    sut::wait_record_active(&c.api(), name, CONVERGE).await.unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)))
}

async fn events_about(c: &ControlPlane, name: &str) -> Vec<Event> {
    let events: Api<Event> = Api::namespaced(c.admin.clone(), NS);
    let all = events.list(&ListParams::default()).await.unwrap().items;
    all.into_iter().filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)).collect()
}

async fn wait_serving(lbaas: &Sut) {
    lbaas.wait_serving(LOAD_BALANCERS, PHASE_TIMEOUT).await.unwrap();
}

/// The sum of the samples of `name` with every one of `labels`.
async fn metric(lbaas: &Sut, name: &str, labels: &[(&str, &str)]) -> f64 {
    lbaas.scrape().await.unwrap().sum(name, labels)
}

/// Octavia's API read directly, as an operator would.
#[derive(Clone)]
struct OctaviaApi {
    http: reqwest::Client,
    base: String,
}

impl OctaviaApi {
    fn new(url: &str) -> Self {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        Self { http, base: format!("{url}/v2/lbaas") }
    }

    async fn get(&self, path: &str) -> anyhow::Result<(u16, Value)> {
        let resp = self.http.get(format!("{}/{path}", self.base)).header("X-Project-Id", PROJECT).send().await?;
        let status = resp.status().as_u16();
        Ok((status, resp.json().await.unwrap_or(Value::Null)))
    }

    async fn ok(&self, path: &str) -> anyhow::Result<Value> {
        let (status, body) = self.get(path).await?;
        anyhow::ensure!(status == 200, "GET {path}: {status} {body}");
        Ok(body)
    }

    async fn delete(&self, path: &str) -> u16 {
        let resp = self.http.delete(format!("{}/{path}", self.base)).header("X-Project-Id", PROJECT).send().await;
        resp.unwrap().status().as_u16()
    }

    /// Load balancers carrying `tag`.
    async fn lbs_tagged(&self, tag: &str) -> anyhow::Result<Vec<Value>> {
        let body = self.ok(&format!("loadbalancers?tags={}", urlencode(tag))).await?;
        Ok(body["loadbalancers"].as_array().cloned().unwrap_or_default())
    }

    /// Listeners as `PROTO:port`, and per listener its pool's members as `address:port`.
    async fn tree(&self, lb: &str) -> anyhow::Result<Vec<(String, Vec<String>)>> {
        let listeners = self.ok(&format!("listeners?loadbalancer_id={lb}")).await?;
        let mut out = Vec::new();
        for l in listeners["listeners"].as_array().cloned().unwrap_or_default() {
            let name = format!("{}:{}", l["protocol"].as_str().unwrap(), l["protocol_port"]);
            let mut members = Vec::new();
            match l["default_pool_id"].as_str() {
                Some(pool) => {
                    let ms = self.ok(&format!("pools/{pool}/members")).await?;
                    for m in ms["members"].as_array().cloned().unwrap_or_default() {
                        anyhow::ensure!(m["provisioning_status"] == "ACTIVE", "member not ACTIVE: {m}");
                        members.push(format!("{}:{}", m["address"].as_str().unwrap(), m["protocol_port"]));
                    }
                }
                None => members.push("(no pool)".into()),
            }
            members.sort();
            out.push((name, members));
        }
        out.sort();
        Ok(out)
    }

    /// Waits until the load balancer `lb` is ACTIVE with exactly `want`.
    async fn wait_tree(&self, lb: &str, want: &[(&str, &[&str])], lbaas: &Sut) {
        let want: Vec<(String, Vec<String>)> =
            want.iter().map(|(l, ms)| (l.to_string(), ms.iter().map(ToString::to_string).collect())).collect();
        wait_until(&format!("load balancer {lb} with {want:?}"), CONVERGE, || async {
            let body = self.ok(&format!("loadbalancers/{lb}")).await?;
            anyhow::ensure!(body["loadbalancer"]["provisioning_status"] == "ACTIVE", "{}", body["loadbalancer"]);
            let have = self.tree(lb).await?;
            anyhow::ensure!(have == want, "have {have:?}");
            Ok(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The endpoints of a slice, each (address, ready (and serving), pod) on node n1, none terminating.
fn endpoints(list: &[(&str, bool, &str)]) -> Value {
    let full: Vec<_> = list.iter().map(|&(addr, ready, pod)| (addr, ready, ready, false, pod)).collect();
    sut::pod_endpoints(NS, "n1", &full)
}

fn backend_id(r: &ServiceLoadBalancer) -> String {
    r.status.as_ref().and_then(|s| s.backend_id.clone()).unwrap_or_default()
}

const REPLACE: (&str, &str) = ("operation", "members.replace");
const CREATE: (&str, &str) = ("operation", "loadbalancers.create");
const REQUESTS: &str = "openstack_requests_total";

#[tokio::test]
async fn services_become_octavia_load_balancers_that_converge_through_faults() {
    let started = Instant::now();
    let (c, os, octavia_url) = ControlPlane::lbaas_with_openstack(NS, &[OsService::Octavia]).await.unwrap();
    let c = &c;
    eprintln!("API server and Octavia up in {:?}", started.elapsed());
    let api = OctaviaApi::new(&octavia_url);
    let cluster_name = format!("t{}", unique_id());
    let cluster_tag = format!("kuryr-cluster={cluster_name}");
    let web_tag = format!("kuryr-service={NS}/web");

    let watcher = start_watcher(c);
    let mut lbaas = start_lbaas(c, &watcher, &octavia_url, &cluster_name, &[]);
    wait_serving(&lbaas).await;
    // The API server's own `default/kubernetes` Service gets a load balancer too; counts of
    // calls below start once it has one.
    wait_until("default/kubernetes ACTIVE", CONVERGE, || async {
        let api: Api<ServiceLoadBalancer> = Api::namespaced(c.admin.clone(), "default");
        let st = api.get("kubernetes").await?.status.unwrap_or_default();
        anyhow::ensure!(st.provisioning_status.as_deref() == Some("ACTIVE"), "{st:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));
    let creates = metric(&lbaas, REQUESTS, &[CREATE]).await;
    let scraped_before = lbaas.scrape().await.unwrap();

    // A Service with two ports; two ready endpoints and one that is not.
    let svc: Service = serde_json::from_value(json!({"metadata": {"name": "web"}, "spec": {"ports": [
        {"name": "http", "port": 80, "targetPort": 8080},
        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353},
    ]}}))
    .unwrap();
    let web = c.api::<Service>().create(&PostParams::default(), &svc).await.unwrap();
    let uid = web.metadata.uid.clone().unwrap();
    let vip = web.spec.as_ref().unwrap().cluster_ip.clone().unwrap();
    let both =
        json!([{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "dns", "port": 5353, "protocol": "UDP"}]);
    let created = Instant::now();
    // The slice of both ports, whose endpoints change below.
    let put_web_a = async |eps: &[(&str, bool, &str)]| put_slice(c, "web-a", "web", both.clone(), endpoints(eps)).await;
    put_web_a(&[("10.244.0.5", true, "a"), ("10.244.0.6", true, "b"), ("10.244.0.9", false, "c")]).await;
    let record = converged(c, "web", &lbaas).await;
    eprintln!("Service created → load balancer ACTIVE and recorded: {:?}", created.elapsed());
    let lb = backend_id(&record);
    assert!(!lb.is_empty(), "{record:?}");
    let body = api.ok(&format!("loadbalancers/{lb}")).await.unwrap();
    let l = &body["loadbalancer"];
    assert_eq!(l["vip_address"], vip.as_str(), "{l}");
    assert_eq!(l["vip_subnet_id"], VIP_SUBNET);
    assert_eq!(l["name"], format!("{cluster_name}/{NS}/web"));
    let tags: BTreeSet<&str> = l["tags"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    let want_tags = [cluster_tag.clone(), format!("kuryr-service={NS}/web"), format!("kuryr-service-uid={uid}")];
    assert!(want_tags.iter().all(|t| tags.contains(t.as_str())), "{tags:?}");
    api.wait_tree(
        &lb,
        &[("TCP:80", &["10.244.0.5:8080", "10.244.0.6:8080"]), ("UDP:53", &["10.244.0.5:5353", "10.244.0.6:5353"])],
        &lbaas,
    )
    .await;
    assert_eq!(metric(&lbaas, REQUESTS, &[CREATE]).await - creates, 1.0, "one fully-populated create");
    assert_eq!(metric(&lbaas, REQUESTS, &[("operation", "listeners.create")]).await, 0.0);
    assert!(
        c.api::<Service>()
            .get("web")
            .await
            .unwrap()
            .metadata
            .finalizers
            .unwrap_or_default()
            .iter()
            .any(|f| f == FINALIZER)
    );
    // The record read above can be the one from before the slice reached lbaas (generation 1,
    // no members; the members came with generation 2): compare with the record as it is now,
    // once lbaas has settled on it.
    wait_until("GetLoadBalancer to answer as the record says", CONVERGE, || async {
        let got = LoadBalancersClient::new(kuryr_tests::auth::channel(&lbaas.addr, &c.binder_token)?)
            .get_load_balancer(GetLoadBalancerRequest { namespace: NS.into(), name: "web".into() })
            .await?
            .into_inner();
        let now = c.api::<ServiceLoadBalancer>().get("web").await?;
        let want = ("octavia", lb.as_str(), "ACTIVE", u64::try_from(now.metadata.generation.unwrap_or_default())?);
        let have =
            (got.backend.as_str(), got.backend_id.as_str(), got.provisioning_status.as_str(), got.observed_generation);
        anyhow::ensure!(have == want, "GetLoadBalancer {have:?}, record {want:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));

    // Endpoint churn. A change in the slice of both ports: one batch update per pool, two.
    let puts = metric(&lbaas, REQUESTS, &[REPLACE]).await;
    let changed = Instant::now();
    put_web_a(&[("10.244.0.5", true, "a"), ("10.244.0.7", true, "d"), ("10.244.0.9", true, "c")]).await;
    api.wait_tree(
        &lb,
        &[
            ("TCP:80", &["10.244.0.5:8080", "10.244.0.7:8080", "10.244.0.9:8080"]),
            ("UDP:53", &["10.244.0.5:5353", "10.244.0.7:5353", "10.244.0.9:5353"]),
        ],
        &lbaas,
    )
    .await;
    converged(c, "web", &lbaas).await;
    eprintln!("endpoint change (2 pools) → converged and recorded: {:?}", changed.elapsed());
    assert_eq!(metric(&lbaas, REQUESTS, &[REPLACE]).await - puts, 2.0, "one member PUT per changed pool");
    // A slice serving only the http port: one pool changes, one PUT.
    let puts = metric(&lbaas, REQUESTS, &[REPLACE]).await;
    let changed = Instant::now();
    put_slice(
        c,
        "web-b",
        "web",
        json!([{"name": "http", "port": 8081, "protocol": "TCP"}]),
        endpoints(&[("10.244.1.3", true, "e")]),
    )
    .await;
    api.wait_tree(
        &lb,
        &[
            ("TCP:80", &["10.244.0.5:8080", "10.244.0.7:8080", "10.244.0.9:8080", "10.244.1.3:8081"]),
            ("UDP:53", &["10.244.0.5:5353", "10.244.0.7:5353", "10.244.0.9:5353"]),
        ],
        &lbaas,
    )
    .await;
    converged(c, "web", &lbaas).await;
    eprintln!("endpoint change (1 pool) → converged and recorded: {:?}", changed.elapsed());
    assert_eq!(metric(&lbaas, REQUESTS, &[REPLACE]).await - puts, 1.0, "one member PUT for the one changed pool");
    assert_eq!(metric(&lbaas, REQUESTS, &[CREATE]).await - creates, 1.0, "no load balancer was re-created");
    // The Service's create and two member updates, in the Octavia and client metrics. A reconcile
    // is timed (and its Service leaves the queue) once it has written the record the test saw
    // ACTIVE: wait for the metrics rather than reading them once.
    let b = &scraped_before;
    let octavia_calls = [("service", "load-balancer")];
    let octavia_moved = |m: &Scrape| -> anyhow::Result<()> {
        m.moved(b, "kuryr_lbaas_octavia_changes_total", &[("kind", "members_replace")]).at_least(2.0)?;
        m.moved_count(b, "kuryr_lbaas_octavia_active_seconds", &[("kind", "lb_create")]).exactly(1.0)?;
        m.moved_count(b, "kuryr_lbaas_octavia_active_seconds", &[("kind", "members_replace")]).at_least(2.0)?;
        m.moved_count(b, "kuryr_lbaas_octavia_calls_per_reconcile", &[("outcome", "changed")]).at_least(3.0)?;
        m.moved_count(b, "kuryr_lbaas_octavia_overhead_seconds", &[]).at_least(3.0)?;
        m.moved(b, REQUESTS, &octavia_calls).at_least(3.0)?;
        m.moved_count(b, "openstack_request_duration_seconds", &octavia_calls).at_least(3.0)?;
        m.moved_count(b, "kuryr_lbaas_reconcile_seconds", &[("result", "applied")]).at_least(3.0)?;
        anyhow::ensure!(m.value("kuryr_lbaas_queue_depth", &[])? == 0.0, "lbaas queue not drained");
        Ok(())
    };
    wait_until("the Service's changes in the metrics", EVENT_WAIT, || async {
        let m = lbaas.scrape().await?;
        octavia_moved(&m).map_err(|e| {
            let octavia: Vec<String> =
                m.series.iter().filter(|s| s.name.contains("octavia")).map(ToString::to_string).collect();
            anyhow::anyhow!("{e:#}\n{}", octavia.join("\n"))
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));

    // Ports change: dns goes, https comes; its listener and pool follow.
    let patch = json!({"spec": {"ports": [
        {"name": "http", "port": 80, "targetPort": 8080},
        {"name": "https", "port": 443, "targetPort": 8443},
    ]}});
    c.api::<Service>().patch("web", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    put_slice(
        c,
        "web-a",
        "web",
        json!([{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "https", "port": 8443, "protocol": "TCP"}]),
        endpoints(&[("10.244.0.5", true, "a")]),
    )
    .await;
    let http_members: &[&str] = &["10.244.0.5:8080", "10.244.1.3:8081"];
    api.wait_tree(&lb, &[("TCP:443", &["10.244.0.5:8443"]), ("TCP:80", http_members)], &lbaas).await;
    converged(c, "web", &lbaas).await;

    // Drift: a pool deleted behind lbaas' back is created again by the periodic pass.
    let listeners = api.ok(&format!("listeners?loadbalancer_id={lb}")).await.unwrap();
    let https = listeners["listeners"].as_array().unwrap().iter().find(|l| l["protocol_port"] == 443).unwrap().clone();
    let pool = https["default_pool_id"].as_str().unwrap().to_string();
    assert_eq!(api.delete(&format!("pools/{pool}")).await, 204);
    api.wait_tree(&lb, &[("TCP:443", &["10.244.0.5:8443"]), ("TCP:80", http_members)], &lbaas).await;
    let listeners = api.ok(&format!("listeners?loadbalancer_id={lb}")).await.unwrap();
    let new_pool = listeners["listeners"].as_array().unwrap().iter().find(|l| l["protocol_port"] == 443).unwrap()
        ["default_pool_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(new_pool, pool, "the pool was not re-created");

    // Drift: the whole load balancer deleted out of band is created again.
    assert_eq!(api.delete(&format!("loadbalancers/{lb}?cascade=true")).await, 204);
    let deleted = Instant::now();
    let record = wait_until("a new load balancer recorded", CONVERGE, || async {
        let r = c.api::<ServiceLoadBalancer>().get("web").await?;
        anyhow::ensure!(!backend_id(&r).is_empty() && backend_id(&r) != lb, "still {}", backend_id(&r));
        Ok(r)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));
    let lb = backend_id(&record);
    api.wait_tree(&lb, &[("TCP:443", &["10.244.0.5:8443"]), ("TCP:80", http_members)], &lbaas).await;
    eprintln!("load balancer deleted out of band → re-created: {:?}", deleted.elapsed());
    assert_eq!(metric(&lbaas, REQUESTS, &[CREATE]).await - creates, 2.0);

    // kill -9 and restart. Meanwhile an orphan of this cluster appears (its Service is gone).
    lbaas.proc.kill().await.unwrap();
    let orphan = api
        .http
        .post(format!("{}/loadbalancers", api.base))
        .header("X-Project-Id", PROJECT)
        .json(&json!({"loadbalancer": {
            "name": "orphan", "vip_subnet_id": VIP_SUBNET,
            "tags": [cluster_tag.clone(), format!("kuryr-service={NS}/ghost"), "kuryr-service-uid=gone"],
        }}))
        .send()
        .await
        .unwrap();
    assert_eq!(orphan.status().as_u16(), 201);
    let orphan: Value = orphan.json().await.unwrap();
    let orphan = orphan["loadbalancer"]["id"].as_str().unwrap().to_string();
    let lbaas = start_lbaas(c, &watcher, &octavia_url, &cluster_name, &[]);
    wait_serving(&lbaas).await;
    wait_until("the orphan deleted, web's load balancer adopted", CONVERGE, || async {
        let (status, body) = api.get(&format!("loadbalancers/{orphan}")).await?;
        anyhow::ensure!(status == 404 || body["loadbalancer"]["provisioning_status"] == "DELETED", "orphan: {status}");
        let ours: Vec<String> = api
            .lbs_tagged(&web_tag)
            .await?
            .iter()
            .filter(|l| l["provisioning_status"] != "DELETED")
            .map(|l| l["id"].as_str().unwrap_or_default().to_string())
            .collect();
        anyhow::ensure!(ours == [lb.clone()], "load balancers of the cluster: {ours:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));
    let record = converged(c, "web", &lbaas).await;
    assert_eq!(backend_id(&record), lb, "adopted, not replaced");
    assert_eq!(metric(&lbaas, REQUESTS, &[CREATE]).await, 0.0, "the restarted lbaas created a load balancer");
    // Counted once lbaas' own wait sees it gone, which may be a poll after the test saw it.
    wait_until("the orphan counted", EVENT_WAIT, || async {
        let n = metric(&lbaas, "kuryr_lbaas_octavia_orphans_deleted_total", &[]).await;
        anyhow::ensure!(n >= 1.0, "kuryr_lbaas_octavia_orphans_deleted_total {n}");
        Ok(())
    })
    .await
    .unwrap();

    // The worker stops in the middle of a change: the load balancer stays PENDING_UPDATE, the
    // wait times out (20 s here: a cold worker on a loaded machine may take 10 s for a first
    // create), is retried with backoff and reported; it converges once the worker is back.
    os.stop_process("octavia-worker").await.unwrap();
    let failures = metric(&lbaas, "kuryr_lbaas_failures_total", &[]).await;
    put_slice(
        c,
        "web-b",
        "web",
        json!([{"name": "http", "port": 8081, "protocol": "TCP"}]),
        endpoints(&[("10.244.1.4", true, "f")]),
    )
    .await;
    wait_until("the stalled change reported", CONVERGE, || async {
        let r = c.api::<ServiceLoadBalancer>().get("web").await?;
        let st = r.status.unwrap_or_default();
        anyhow::ensure!(st.provisioning_status.as_deref() == Some("PENDING_UPDATE"), "{st:?}");
        anyhow::ensure!(metric(&lbaas, "kuryr_lbaas_failures_total", &[]).await > failures, "no failure counted");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));
    os.start_process("octavia-worker").await.unwrap();
    let http_members: &[&str] = &["10.244.0.5:8080", "10.244.1.4:8081"];
    api.wait_tree(&lb, &[("TCP:443", &["10.244.0.5:8443"]), ("TCP:80", http_members)], &lbaas).await;
    converged(c, "web", &lbaas).await;

    // The API stops: calls fail to connect, are retried, reported as Events; converges after.
    os.stop_process("octavia-api").await.unwrap();
    let failures = metric(&lbaas, "kuryr_lbaas_failures_total", &[("reason", "unavailable")]).await;
    put_slice(
        c,
        "web-b",
        "web",
        json!([{"name": "http", "port": 8081, "protocol": "TCP"}]),
        endpoints(&[("10.244.1.5", true, "g")]),
    )
    .await;
    wait_until("failures while the API is down", CONVERGE, || async {
        let n = metric(&lbaas, "kuryr_lbaas_failures_total", &[("reason", "unavailable")]).await;
        anyhow::ensure!(n >= failures + 2.0, "{n} failures");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));
    let events = events_about(c, "web").await;
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("LoadBalancerFailed") && e.type_.as_deref() == Some("Warning")),
        "{events:?}"
    );
    assert!(lbaas.proc.pid().is_some_and(|p| Path::new(&format!("/proc/{p}")).exists()), "lbaas died");
    os.start_process("octavia-api").await.unwrap();
    let http_members: &[&str] = &["10.244.0.5:8080", "10.244.1.5:8081"];
    api.wait_tree(&lb, &[("TCP:443", &["10.244.0.5:8443"]), ("TCP:80", http_members)], &lbaas).await;
    converged(c, "web", &lbaas).await;

    // Deletion: cascade delete, then the record and the finalizer go, and the Service with them.
    c.api::<Service>().delete("web", &DeleteParams::default()).await.unwrap();
    wait_until("web, its record and its load balancer gone", CONVERGE, || async {
        anyhow::ensure!(c.api::<Service>().get_opt("web").await?.is_none(), "Service still there");
        anyhow::ensure!(c.api::<ServiceLoadBalancer>().get_opt("web").await?.is_none(), "record still there");
        let (status, _) = api.get(&format!("loadbalancers/{lb}")).await?;
        anyhow::ensure!(status == 404, "load balancer answers {status}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));
    assert!(api.lbs_tagged(&web_tag).await.unwrap().iter().all(|l| l["provisioning_status"] == "DELETED"));
    eprintln!("whole test {:?}", started.elapsed());
}

#[tokio::test]
async fn load_balancer_services_get_a_floating_ip_on_a_neutron_vip_port() {
    let (c, os, octavia_url) =
        ControlPlane::lbaas_with_openstack(NS, &[OsService::Neutron, OsService::Octavia]).await.unwrap();
    let c = &c;
    let neutron_url = os.neutron_url().unwrap().to_string();
    let vars = HashMap::from([
        ("OS_AUTH_TYPE".to_string(), "none".to_string()),
        ("OS_PROJECT_ID".to_string(), PROJECT.to_string()),
        ("OS_NETWORK_ENDPOINT_OVERRIDE".to_string(), neutron_url.clone()),
    ]);
    let client =
        Client::new(&CloudConfig::from_env(&vars).unwrap(), ClientOptions::default(), Metrics::unregistered().into())
            .unwrap();
    let n = client.network();
    // The Service network: the API server's Service range (10.96.0.0/16), its gateway away from
    // the addresses Services get; behind a router to an external network.
    let (svc_net, svc_sub) = topology::service_network(&n, None).await.unwrap();
    let (ext, _) = topology::external_network(&n, "public").await.unwrap();
    let router = topology::router_to(&n, "services", &ext.id).await.unwrap();
    n.add_router_interface(&router.id, &RouterInterface::SubnetId(svc_sub.id.clone())).await.unwrap();

    let watcher = start_watcher(c);
    let cluster_name = format!("f{}", unique_id());
    let extra = [
        "--vip-subnet-id",
        &svc_sub.id,
        "--neutron-url",
        &neutron_url,
        "--vip-network-id",
        &svc_net.id,
        "--vip-port-precreate",
        "--floating-network-id",
        &ext.id,
    ];
    let lbaas = start_lbaas(c, &watcher, &octavia_url, &cluster_name, &extra);
    wait_serving(&lbaas).await;
    let api = OctaviaApi::new(&octavia_url);

    let svc: Service = serde_json::from_value(json!({"metadata": {"name": "pub"}, "spec": {
        "type": "LoadBalancer", "clusterIP": "10.96.7.7", "ports": [{"port": 80, "targetPort": 8080}]}}))
    .unwrap();
    c.api::<Service>().create(&PostParams::default(), &svc).await.unwrap();
    put_slice(c, "pub-a", "pub", json!([{"port": 8080, "protocol": "TCP"}]), endpoints(&[("10.244.2.5", true, "a")]))
        .await;
    let record = converged(c, "pub", &lbaas).await;
    let ingress = record.status.as_ref().and_then(|s| s.ingress_ip.clone()).unwrap_or_default();
    assert!(ingress.starts_with("203.0.113."), "ingress {ingress:?} is not a floating IP: {record:?}");
    let svc = c.api::<Service>().get("pub").await.unwrap();
    let shown = svc.status.and_then(|s| s.load_balancer).and_then(|l| l.ingress).unwrap_or_default();
    assert_eq!(shown.first().and_then(|i| i.ip.as_deref()), Some(ingress.as_str()), "Service status");

    // Octavia's VIP port is the real Neutron port lbaas made, and the floating IP is on it.
    let lb = api.ok(&format!("loadbalancers/{}", backend_id(&record))).await.unwrap();
    let port_id = lb["loadbalancer"]["vip_port_id"].as_str().unwrap().to_string();
    assert_eq!(lb["loadbalancer"]["vip_address"], "10.96.7.7");
    let port = n.get_port(&port_id).await.unwrap();
    assert_eq!(port.device_owner, "kuryr:lbaas-vip", "{port:?}");
    assert!(port.fixed_ips.iter().any(|f| f.ip_address.as_deref() == Some("10.96.7.7")), "{port:?}");
    let fips = n.list_floating_ips(&Filter::new().eq("floating_network_id", ext.id.clone())).await.unwrap();
    let fip = fips.iter().find(|f| f.floating_ip_address == ingress).unwrap_or_else(|| panic!("{fips:?}"));
    assert_eq!(fip.port_id.as_deref(), Some(port_id.as_str()));
    assert_eq!(fip.fixed_ip_address.as_deref(), Some("10.96.7.7"));
    assert!(fip.tags.iter().any(|t| t == &format!("kuryr-service={NS}/pub")), "{fip:?}");

    // Deleted: the load balancer, the floating IP and the VIP port go, then the Service.
    c.api::<Service>().delete("pub", &DeleteParams::default()).await.unwrap();
    wait_until("pub, its floating IP and its VIP port gone", CONVERGE, || async {
        anyhow::ensure!(c.api::<Service>().get_opt("pub").await?.is_none(), "Service still there");
        anyhow::ensure!(n.get_port(&port_id).await.is_err_and(|e| e.is_not_found()), "VIP port still there");
        let left = n.list_floating_ips(&Filter::new().eq("floating_network_id", ext.id.clone())).await?;
        anyhow::ensure!(left.iter().all(|f| f.floating_ip_address != ingress), "floating IP still there");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));
}
