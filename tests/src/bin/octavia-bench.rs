//! `make bench-octavia`: kuryr-lbaas with `--backend octavia` against a real Octavia (API +
//! worker, no-op drivers; tests/env/openstack), optimised binaries from `KURYR_BIN_DIR`.
//!
//! One Service with two ports; then `BENCH_OCTAVIA_ROUNDS` endpoint changes (default 20), one at
//! a time, alternating between a change of both pools and of one. For each change:
//! - **converged**: the EndpointSlice write → the ServiceLoadBalancer record ACTIVE at the new
//!   generation (Octavia holds the new members by then);
//! - **Octavia's processing**: a separate poller reads the load balancer's row in Octavia's
//!   database every 5 ms (one `mariadb` client session, so the measurement does not load
//!   Octavia's API) and adds up the periods it is PENDING_* until ACTIVE again — Octavia's own
//!   work on the change(s);
//! - **beyond Octavia**: converged − Octavia's processing: the watcher, lbaas, its calls and
//!   polls, the record write — and the part of Octavia's API answer to the member PUT before it
//!   marks the load balancer PENDING, shown apart;
//! - **Octavia API calls** made by lbaas for the change (from its `openstack_requests_total`),
//!   the member PUTs among them, and their latency (`openstack_request_duration_seconds`).
#![allow(clippy::print_stdout)]

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use kuryr_lbaas::k8s::crd::ServiceLoadBalancer;
use kuryr_tests::control::{ControlPlane, Served};
use kuryr_tests::kube::KubeEnv;
use kuryr_tests::openstack::{OpenStackEnv, Service as OsService};
use kuryr_tests::services::ServiceProcess;
use kuryr_tests::stats::Stats;
use kuryr_tests::util::free_port;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

const NS: &str = "bench-octavia";
const PROJECT: &str = "7c1d9e2f4a3b4d5c8e6f0a1b2c3d4e5f";
const VIP_SUBNET: &str = "8e2a6b3d-0c4f-4d8e-9f1a-2b3c4d5e6f70";
const CONVERGE: Duration = Duration::from_secs(120);
/// Direct member PUTs that measure Octavia's API on its own.
const CALIBRATION_PUTS: usize = 6;

/// What the outside poller saw of the load balancer's PENDING periods during one change.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    /// Since when it is PENDING_*, while it is.
    pending_since: Option<Instant>,
    /// When the first PENDING_* of the change was seen.
    first_pending: Option<Instant>,
    /// When it was last seen turning ACTIVE.
    last_active: Option<Instant>,
    /// PENDING_* → ACTIVE periods completed.
    periods: u32,
    /// Their total length.
    pending_total: Duration,
    /// ACTIVE between two periods (lbaas seeing ACTIVE and making the next change).
    between: Duration,
}

/// One reading of the load balancer's provisioning status at `now`.
fn record(seen: &Mutex<Seen>, status: &str, now: Instant) {
    let mut s = seen.lock().unwrap_or_else(PoisonError::into_inner);
    if status.starts_with("PENDING") && s.pending_since.is_none() {
        s.pending_since = Some(now);
        s.first_pending.get_or_insert(now);
        if let Some(active) = s.last_active {
            s.between += now.duration_since(active);
        }
    } else if status == "ACTIVE"
        && let Some(since) = s.pending_since.take()
    {
        s.periods += 1;
        s.pending_total += now.duration_since(since);
        s.last_active = Some(now);
    }
}

/// The mean of `v` (0 when empty).
fn mean(v: &[f64]) -> f64 {
    Stats::of(v).map_or(0.0, |s| s.mean)
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
    let c = ControlPlane::on(kube, Served::Lbaas, NS).await?;
    let admin = c.admin.clone();
    let watcher = c.watcher(None, &[])?;
    let args = |v: &[&str]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
    let octavia_url = os.octavia_url().context("no Octavia URL")?.to_string();
    let mport = free_port()?;
    let lbaas_addr = format!("127.0.0.1:{}", free_port()?);
    let lbaas = ServiceProcess::spawn(
        "kuryr-lbaas",
        &args(&[
            "--kubeconfig",
            &c.kubeconfig.display().to_string(),
            "--watcher",
            &watcher.addr,
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
        c.dir.path(),
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

    // The outside poller: Octavia's own record of the load balancer, straight from its database.
    let socket = os.env_value("MARIADB_SOCKET").context("no MARIADB_SOCKET in the OpenStack env")?.to_string();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let poller = {
        let seen = seen.clone();
        let mut db = tokio::process::Command::new("mariadb")
            .args(["--socket", &socket, "-u", "root", "--batch", "--skip-column-names", "--unbuffered", "octavia"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting the mariadb client")?;
        let mut stdin = db.stdin.take().context("mariadb stdin")?;
        let mut lines = BufReader::new(db.stdout.take().context("mariadb stdout")?).lines();
        let query = format!("SELECT provisioning_status FROM load_balancer WHERE id = '{lb_id}';\n");
        // One round trip first, so a broken poller fails the bench instead of measuring nothing.
        stdin.write_all(query.as_bytes()).await?;
        let first = lines.next_line().await?.context("no answer from Octavia's database")?;
        ensure!(first == "ACTIVE", "the load balancer is {first:?} in Octavia's database, not ACTIVE");
        tokio::spawn(async move {
            let _db = db;
            loop {
                if stdin.write_all(query.as_bytes()).await.is_err() {
                    return;
                }
                let Ok(Some(status)) = lines.next_line().await else { return };
                record(&seen, &status, Instant::now());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };

    let (mut total, mut octavia, mut beyond, mut calls, mut puts) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut put_ms, mut get_ms) = (vec![], vec![]);
    // Where the time beyond Octavia goes: before its first PENDING, between its changes, after
    // its last ACTIVE; for single-pool changes apart.
    let (mut lead, mut between, mut tail, mut beyond_one) = (vec![], vec![], vec![], vec![]);
    let mut beyond_puts = vec![];
    let m0 = metrics(&metrics_url).await?;
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
        let secs = |text: &str, op: &str, what: &str| {
            sum_metric(text, &format!("openstack_request_duration_seconds_{what}"), &[&format!(r#"operation="{op}""#)])
        };
        let mean_ms = |op: &str| {
            let n = secs(&after, op, "count") - secs(&before, op, "count");
            (n > 0.0).then(|| 1e3 * (secs(&after, op, "sum") - secs(&before, op, "sum")) / n)
        };
        put_ms.extend(mean_ms("members.replace"));
        get_ms.extend(mean_ms("loadbalancers.show"));
        total.push(t);
        if o.is_finite() {
            octavia.push(o);
            beyond.push(t - o);
            beyond_puts.push((t - o, p));
            if round % 2 == 0 {
                beyond_one.push(t - o);
            }
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            if let (Some(first), Some(last)) = (s.first_pending, s.last_active) {
                lead.push(ms(first.duration_since(start)));
                tail.push(ms(done.duration_since(last)));
                if s.periods > 1 {
                    between.push(ms(s.between) / f64::from(s.periods - 1));
                }
            }
        }
        calls.push(lb_calls);
        puts.push(p);
    }
    let m = metrics(&metrics_url).await?;
    let delta = |name: &str| sum_metric(&m, name, &[]) - sum_metric(&m0, name, &[]);
    let lag_sum = delta("kuryr_lbaas_octavia_poll_lag_seconds_sum");
    let lag_n = delta("kuryr_lbaas_octavia_poll_lag_seconds_count");
    let over_sum = delta("kuryr_lbaas_octavia_overhead_seconds_sum");
    let over_n = delta("kuryr_lbaas_octavia_overhead_seconds_count");
    drop(lbaas);

    // Octavia's API on its own: member PUTs made directly (lbaas stopped), PUT sent → PENDING in
    // the database, so that part of "beyond Octavia" can be told apart from lbaas' own.
    let (mut pre_pending, mut answered) = (vec![], vec![]);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
    let pools: Value = http
        .get(format!("{octavia_url}/v2/lbaas/pools?loadbalancer_id={lb_id}"))
        .header("X-Project-Id", PROJECT)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let pool = pools["pools"][0]["id"].as_str().context("no pool")?.to_string();
    for k in 0..CALIBRATION_PUTS {
        let body = json!({"members": (0..members).map(|i| json!({
            "address": format!("10.251.{k}.{}", i + 1), "protocol_port": 8080})).collect::<Vec<_>>()});
        *seen.lock().unwrap_or_else(PoisonError::into_inner) = Seen::default();
        let sent = Instant::now();
        http.put(format!("{octavia_url}/v2/lbaas/pools/{pool}/members"))
            .header("X-Project-Id", PROJECT)
            .json(&body)
            .send()
            .await?
            .error_for_status()?;
        answered.push(sent.elapsed().as_secs_f64() * 1e3);
        let deadline = Instant::now() + CONVERGE;
        let s = loop {
            let s = *seen.lock().unwrap_or_else(PoisonError::into_inner);
            if s.last_active.is_some() {
                break s;
            }
            ensure!(Instant::now() < deadline, "direct member PUT {k} not ACTIVE within {CONVERGE:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        if let Some(first) = s.first_pending {
            pre_pending.push(first.duration_since(sent).as_secs_f64() * 1e3);
        }
    }
    poller.abort();
    let pre = Stats::of(&pre_pending).map_or(f64::NAN, |s| s.p50);
    let get_mean = mean(&get_ms);
    // Per change: beyond − (PUT sent → PENDING) and the status GET that sees ACTIVE, per PUT.
    let ours: Vec<f64> = beyond_puts.iter().map(|(b, n)| b - n * (pre + get_mean)).collect();

    println!("octavia-bench: {rounds} endpoint changes, {members} members (odd rounds: both pools; even: one)");
    println!("  Service created → load balancer ACTIVE and recorded: {create_s:.2} s");
    let row = |name: &str, v: &[f64]| match Stats::of(v) {
        Some(s) => {
            println!("  {name:<44} n={:<3} p50={:>8.1} ms  p90={:>8.1} ms  max={:>8.1} ms", s.n, s.p50, s.p90, s.max)
        }
        None => println!("  {name:<44} n=0"),
    };
    row("endpoint change → converged and recorded", &total);
    row("Octavia's processing (PENDING → ACTIVE, summed)", &octavia);
    row("beyond Octavia (the rest)", &beyond);
    row("  of single-pool changes (one member PUT)", &beyond_one);
    row("  change written → Octavia's first PENDING", &lead);
    row("  ACTIVE → next PENDING (two-pool changes)", &between);
    row("  last ACTIVE → record ACTIVE", &tail);
    row("Octavia's API: member PUT sent → PENDING", &pre_pending);
    row("Octavia's API: member PUT answered", &answered);
    row("beyond Octavia's API and worker (lbaas, k8s)", &ours);
    println!(
        "  Octavia API calls per change: mean {:.1}, max {:.0}; member PUTs per change: mean {:.1} (odd rounds 2, even 1)",
        mean(&calls),
        Stats::of(&calls).map_or(0.0, |s| s.max),
        mean(&puts)
    );
    println!(
        "  lbaas's Octavia requests: member PUT answered in {:.1} ms, status GET in {:.1} ms (means)",
        mean(&put_ms),
        get_mean
    );
    println!(
        "  lbaas: ACTIVE seen at most {:.0} ms late on average (poll lag); {:.0} ms per change outside Octavia waits",
        1e3 * lag_sum / lag_n.max(1.0),
        1e3 * over_sum / over_n.max(1.0)
    );
    Ok(())
}
