//! `make bench-octavia`: kuryr-lbaas with `--backend octavia` against a real Octavia (API +
//! worker, no-op drivers; tests/env/openstack), optimised binaries from `KURYR_BIN_DIR`.
//!
//! One Service with two ports; then `BENCH_OCTAVIA_ROUNDS` endpoint changes (default 20), one at
//! a time, alternating between a change of both pools and of one. For each change:
//! - **converged**: the EndpointSlice write → the ServiceLoadBalancer record ACTIVE at the new
//!   generation (Octavia holds the new members by then);
//! - **Octavia's processing**: a separate poller reads the load balancer every 10 ms and adds up
//!   the periods it is PENDING_* until ACTIVE again — Octavia's own work on the change(s), as
//!   seen from outside;
//! - **beyond Octavia**: converged − Octavia's processing: the watcher, lbaas, its calls and
//!   polls, and the record write;
//! - **Octavia API calls** made by lbaas for the change (from its `openstack_requests_total`),
//!   and the member PUTs among them.
#![allow(clippy::print_stdout)]

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kuryr_lbaas::crd::ServiceLoadBalancer;
use kuryr_tests::kube::KubeEnv;
use kuryr_tests::openstack::{OpenStackEnv, Service as OsService};
use kuryr_tests::services::ServiceProcess;
use kuryr_tests::util::{free_port, repo_root};
use serde_json::{Value, json};

const NS: &str = "bench-octavia";
const PROJECT: &str = "7c1d9e2f4a3b4d5c8e6f0a1b2c3d4e5f";
const VIP_SUBNET: &str = "8e2a6b3d-0c4f-4d8e-9f1a-2b3c4d5e6f70";
const CONVERGE: Duration = Duration::from_secs(120);

/// What the outside poller saw of the load balancer's PENDING periods during one change.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    /// Since when it is PENDING_*, while it is.
    pending_since: Option<Instant>,
    /// PENDING_* → ACTIVE periods completed.
    periods: u32,
    /// Their total length.
    pending_total: Duration,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn sum_metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.split(['{', ' ']).next() == Some(name))
        .filter(|l| labels.iter().all(|w| l.contains(w)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn metrics(url: &str) -> Result<String> {
    let out = tokio::process::Command::new("curl").args(["-sf", url]).output().await?;
    ensure!(out.status.success(), "GET {url} failed");
    Ok(String::from_utf8(out.stdout)?)
}

fn endpoints(round: usize, n: usize) -> Value {
    let eps: Vec<Value> = (0..n)
        .map(|i| {
            json!({"addresses": [format!("10.250.{}.{}", round % 200, i + 1)], "conditions": {"ready": true},
                   "targetRef": {"kind": "Pod", "namespace": NS, "name": format!("p{round}-{i}")}})
        })
        .collect();
    Value::Array(eps)
}

async fn put_slice(api: &Api<EndpointSlice>, name: &str, ports: Value, eps: Value) -> Result<()> {
    let mut slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "ports": ports, "endpoints": eps,
    }))?;
    match api.get_opt(name).await? {
        None => drop(api.create(&PostParams::default(), &slice).await?),
        Some(old) => {
            slice.metadata.resource_version = old.metadata.resource_version;
            api.replace(name, &PostParams::default(), &slice).await?;
        }
    }
    Ok(())
}

/// The record once ACTIVE at a generation above `after`; returns that generation.
async fn converged(records: &Api<ServiceLoadBalancer>, after: i64) -> Result<i64> {
    let deadline = Instant::now() + CONVERGE;
    loop {
        let r = records.get_opt("web").await?;
        let g = r.as_ref().and_then(|r| r.metadata.generation).unwrap_or(0);
        let st = r.and_then(|r| r.status).unwrap_or_default();
        if g > after && st.provisioning_status.as_deref() == Some("ACTIVE") && st.observed_generation == Some(g) {
            return Ok(g);
        }
        ensure!(Instant::now() < deadline, "not converged within {CONVERGE:?}: {st:?} at {g}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let rounds: usize = std::env::var("BENCH_OCTAVIA_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let members: usize = std::env::var("BENCH_OCTAVIA_MEMBERS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let t0 = Instant::now();
    let (kube, os) = tokio::join!(KubeEnv::start(), OpenStackEnv::start(&[OsService::Octavia]));
    let (kube, os) = (kube?, os?);
    println!("octavia-bench: API server and Octavia up in {:.1} s", t0.elapsed().as_secs_f64());
    let admin = kube.client().await?;
    let nss: Api<Namespace> = Api::all(admin.clone());
    for n in ["kuryr-system", NS] {
        let meta = ObjectMeta { name: Some(n.into()), ..Default::default() };
        nss.create(&PostParams::default(), &Namespace { metadata: meta, ..Default::default() }).await?;
    }
    for (file, _) in kuryr_lbaas::crd::crds() {
        kube.apply_file(&repo_root().join("deploy/crds").join(file)).await?;
    }
    for f in ["deploy/rbac/watcher.yaml", "deploy/rbac/lbaas.yaml"] {
        kube.apply_file(&repo_root().join(f)).await?;
    }
    let watcher_kc = kube.service_account_kubeconfig("kuryr-system", "kuryr-watcher").await?;
    let lbaas_kc = kube.service_account_kubeconfig("kuryr-system", "kuryr-lbaas").await?;
    let dir = tempfile::tempdir()?;
    let watcher_addr = format!("127.0.0.1:{}", free_port()?);
    let args = |v: &[&str]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
    let wm = format!("127.0.0.1:{}", free_port()?);
    let _watcher = ServiceProcess::spawn(
        "kuryr-watcher",
        &args(&["--kubeconfig", &watcher_kc.display().to_string(), "--listen", &watcher_addr, "--metrics-listen", &wm]),
        dir.path(),
    )?;
    let octavia_url = os.octavia_url().context("no Octavia URL")?.to_string();
    let mport = free_port()?;
    let lbaas_addr = format!("127.0.0.1:{}", free_port()?);
    let lbaas = ServiceProcess::spawn(
        "kuryr-lbaas",
        &args(&[
            "--kubeconfig",
            &lbaas_kc.display().to_string(),
            "--watcher",
            &watcher_addr,
            "--backend",
            "octavia",
            "--octavia-url",
            &octavia_url,
            "--os-project-id",
            PROJECT,
            "--vip-subnet-id",
            VIP_SUBNET,
            "--cluster-name",
            "bench",
            "--listen",
            &lbaas_addr,
            "--metrics-listen",
            &format!("127.0.0.1:{mport}"),
        ]),
        dir.path(),
    )?;
    let metrics_url = format!("http://127.0.0.1:{mport}/metrics");

    let services: Api<Service> = Api::namespaced(admin.clone(), NS);
    let slices: Api<EndpointSlice> = Api::namespaced(admin.clone(), NS);
    let records: Api<ServiceLoadBalancer> = Api::namespaced(admin.clone(), NS);
    let svc: Service = serde_json::from_value(json!({"metadata": {"name": "web"}, "spec": {"ports": [
        {"name": "http", "port": 80, "targetPort": 8080}, {"name": "alt", "port": 81, "targetPort": 8081}]}}))?;
    services.create(&PostParams::default(), &svc).await?;
    let both =
        json!([{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "alt", "port": 8081, "protocol": "TCP"}]);
    let one = json!([{"name": "http", "port": 8080, "protocol": "TCP"}]);
    let created = Instant::now();
    put_slice(&slices, "web-a", both.clone(), endpoints(0, members)).await?;
    put_slice(&slices, "web-b", one.clone(), endpoints(100, 1)).await?;
    let mut generation =
        converged(&records, 0).await.with_context(|| format!("first convergence; lbaas log:\n{}", lbaas.logs()))?;
    let create_s = created.elapsed().as_secs_f64();
    let lb_id = records.get("web").await?.status.and_then(|s| s.backend_id).context("no backend id")?;

    // The outside poller.
    let seen = Arc::new(Mutex::new(Seen::default()));
    let poller = {
        let seen = seen.clone();
        let url = format!("{octavia_url}/v2/lbaas/loadbalancers/{lb_id}");
        let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
        tokio::spawn(async move {
            loop {
                if let Ok(resp) = http.get(&url).header("X-Project-Id", PROJECT).send().await
                    && let Ok(body) = resp.json::<Value>().await
                {
                    let status = body["loadbalancer"]["provisioning_status"].as_str().unwrap_or_default().to_string();
                    let now = Instant::now();
                    let mut s = seen.lock().unwrap_or_else(PoisonError::into_inner);
                    if status.starts_with("PENDING") && s.pending_since.is_none() {
                        s.pending_since = Some(now);
                    } else if status == "ACTIVE"
                        && let Some(since) = s.pending_since.take()
                    {
                        s.periods += 1;
                        s.pending_total += now.duration_since(since);
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };

    let (mut total, mut octavia, mut beyond, mut calls, mut puts) = (vec![], vec![], vec![], vec![], vec![]);
    for round in 1..=rounds {
        let before = metrics(&metrics_url).await?;
        *seen.lock().unwrap_or_else(PoisonError::into_inner) = Seen::default();
        let start = Instant::now();
        if round % 2 == 1 {
            put_slice(&slices, "web-a", both.clone(), endpoints(round, members)).await?;
        } else {
            put_slice(&slices, "web-b", one.clone(), endpoints(100 + round, 1)).await?;
        }
        generation = converged(&records, generation).await?;
        let done = Instant::now();
        let after = metrics(&metrics_url).await?;
        let s = *seen.lock().unwrap_or_else(PoisonError::into_inner);
        let t = done.duration_since(start).as_secs_f64() * 1e3;
        let o = if s.periods > 0 { s.pending_total.as_secs_f64() * 1e3 } else { f64::NAN };
        let lb_calls = sum_metric(&after, "openstack_requests_total", &[r#"service="load-balancer""#])
            - sum_metric(&before, "openstack_requests_total", &[r#"service="load-balancer""#]);
        let replace = r#"operation="members.replace""#;
        let p = sum_metric(&after, "openstack_requests_total", &[replace])
            - sum_metric(&before, "openstack_requests_total", &[replace]);
        total.push(t);
        if o.is_finite() {
            octavia.push(o);
            beyond.push(t - o);
        }
        calls.push(lb_calls);
        puts.push(p);
    }
    poller.abort();
    let m = metrics(&metrics_url).await?;
    let lag_sum = sum_metric(&m, "kuryr_lbaas_octavia_poll_lag_seconds_sum", &[]);
    let lag_n = sum_metric(&m, "kuryr_lbaas_octavia_poll_lag_seconds_count", &[]);
    let over_sum = sum_metric(&m, "kuryr_lbaas_octavia_overhead_seconds_sum", &[]);
    let over_n = sum_metric(&m, "kuryr_lbaas_octavia_overhead_seconds_count", &[]);

    println!("octavia-bench: {rounds} endpoint changes, {members} members (odd rounds: both pools; even: one)");
    println!("  Service created → load balancer ACTIVE and recorded: {create_s:.2} s");
    let row = |name: &str, v: &mut Vec<f64>| {
        let n = v.len();
        println!(
            "  {name:<44} n={n:<3} p50={:>8.1} ms  p90={:>8.1} ms  max={:>8.1} ms",
            pct(v, 0.5),
            pct(v, 0.9),
            pct(v, 1.0)
        );
    };
    row("endpoint change → converged and recorded", &mut total);
    row("Octavia's processing (PENDING → ACTIVE, summed)", &mut octavia);
    row("beyond Octavia (the rest)", &mut beyond);
    let avg = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!(
        "  Octavia API calls per change: mean {:.1}, max {:.0}; member PUTs per change: mean {:.1} (odd rounds 2, even 1)",
        avg(&calls),
        calls.iter().copied().fold(0.0, f64::max),
        avg(&puts)
    );
    println!(
        "  lbaas: ACTIVE seen at most {:.0} ms late on average (poll lag); {:.0} ms per change outside Octavia waits",
        1e3 * lag_sum / lag_n.max(1.0),
        1e3 * over_sum / over_n.max(1.0)
    );
    drop(lbaas);
    Ok(())
}
