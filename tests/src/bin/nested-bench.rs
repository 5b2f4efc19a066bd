//! `make bench-nested`: nested pods (`kuryr-vif-allocator --nested-trunks`) against the real
//! Neutron with the trunk service plugin and the OVS agent's trunk driver, on the VM of
//! [`kuryr_tests::nested`] (a namespace whose tap sits on a `tbr-` trunk bridge, with its own
//! userspace Open vSwitch and a binder with `--nested-plug ovs`); binaries from `KURYR_BIN_DIR`.
//!
//! Pods are created one after the other; right after each create the bench runs CNI ADD for it
//! (as a kubelet would), which returns once the pod's subport is ACTIVE and plugged. Three
//! phases, each with a fresh allocator and cluster id:
//! - **cold, polling**: pools off (`--pool-batch 0`): each pod's port is created, added to the
//!   trunk on a free VLAN id and given the pod's uid on its path; port status polled (every
//!   100 ms while a port waits);
//! - **cold, events**: the same with port status from Neutron's push (the test RabbitMQ,
//!   `--neutron-transport-url`);
//! - **warm, events**: a first pod (not measured) makes the allocator fill the trunk's pool with
//!   spare subports for every measured pod (one bulk create, one `add_subports`); the measured
//!   pods then each cost one port update.
//!
//! Printed per phase: pod created → ADD returned (p50, p90, max) and the allocator's Neutron calls
//! per measured pod (`openstack_requests_total{service="network"}`, by operation, as deltas over
//! the measured pods; every call counted, status reads included), and for warm the pool fill's
//! calls apart. The machine's load average is printed beside the figures.
//!
//! Environment: `BENCH_NESTED_PODS` (per phase, default 10).
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kube::api::{Api, DeleteParams, PostParams};
use kuryr_tests::nested::Vm;
use kuryr_tests::netns::Netns;
use kuryr_tests::neutron::{AllocatorOptions, CniPod, NeutronCluster, Svc, metric_sum};
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use kuryr_tests::stats::Stats;
use kuryr_tests::util::loadavg;

const NS: &str = "bench-nested";
/// Bound on one ADD and on a phase's teardown.
const SLOW: Duration = Duration::from_secs(180);

/// Neutron calls by operation, from an allocator's metrics; the status poller's and the
/// reconciling batched reads (`ports.list` calls) apart as `status reads`.
async fn calls(alloc: &Svc) -> Result<BTreeMap<String, f64>> {
    let text = alloc.metrics().await?;
    let mut out = BTreeMap::new();
    let reads = metric_sum(&text, "kuryr_allocator_neutron_status_polls_total", &[])
        + metric_sum(&text, "kuryr_allocator_neutron_status_safety_reads_total", &[]);
    out.insert("status reads".to_string(), reads);
    *out.entry("ports.list".to_string()).or_default() -= reads;
    for l in text.lines().filter(|l| l.starts_with("openstack_requests_total{") && l.contains(r#"service="network""#)) {
        let Some(op) = l.split("operation=\"").nth(1).and_then(|r| r.split('"').next()) else { continue };
        let Some(v) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        *out.entry(op.to_string()).or_default() += v;
    }
    Ok(out)
}

fn delta(after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

struct Phase {
    name: String,
    add_ms: Vec<f64>,
    calls: BTreeMap<String, f64>,
    fill: Option<BTreeMap<String, f64>>,
    load: String,
}

fn main() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build()?;
    rt.block_on(run())
}

async fn run() -> Result<()> {
    let pods: usize = match std::env::var("BENCH_NESTED_PODS") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().context("BENCH_NESTED_PODS")?,
        _ => 10,
    };
    ensure!(pods > 0, "BENCH_NESTED_PODS must be positive");
    let t0 = Instant::now();
    let c = NeutronCluster::start(&[NS]).await?;
    eprintln!("# API server, Keystone and Neutron up in {:.1} s", t0.elapsed().as_secs_f64());
    let mut vm = Vm::start(&c, 1).await?;
    let watcher = c.watcher()?;
    let mut phases = Vec::new();
    for (name, warm, events) in
        [("cold, polling", false, false), ("cold, events", false, true), ("warm, events", true, true)]
    {
        let n = u32::try_from(pods)?;
        let id = name.replace(", ", "-");
        let mut extra = vec!["--nested-trunks".into(), "--pool-max".into(), (2 * n + 2).to_string()];
        if events {
            extra.extend(["--neutron-transport-url".into(), c.transport_url(false)?]);
        }
        let opts = AllocatorOptions {
            cluster_id: format!("bench-nested-{id}"),
            pool_min: u32::from(warm),
            pool_batch: if warm { n + 1 } else { 0 },
            instance: format!("bench-nested-{id}"),
            log: "info".into(),
            status_poll_min: Some("100ms".into()),
            extra,
        };
        let mut alloc = c.allocator(&watcher, &opts)?;
        alloc.wait_ready(SLOW).await?;
        if vm.binder.is_none() {
            vm.start_binder(&c, &alloc, SLOW).await?;
        }
        let phase = phase(&c, &vm, &alloc, &id, name, warm, pods).await;
        let phase = phase.map_err(|e| anyhow::anyhow!("{e:#}\nallocator:\n{}", alloc.proc.logs()))?;
        alloc.proc.terminate(Duration::from_secs(10)).await?;
        print_phase(&phase, pods);
        phases.push(phase);
    }
    println!();
    println!("nested-bench: {pods} pods per phase, created one after the other, each ADD right after its create");
    println!(
        "{:<14} {:>32} {:>24} {:>22}",
        "# phase", "created → ADD p50 / p90 / max", "Neutron calls per pod", "of which status reads"
    );
    for p in &phases {
        let s = Stats::of(&p.add_ms);
        println!(
            "{:<14} {:>32} {:>24.2} {:>22.2}   (load {})",
            p.name,
            s.map_or("-".into(), |s| format!("{:.0} / {:.0} / {:.0} ms", s.p50, s.p90, s.max)),
            p.calls.values().sum::<f64>() / pods as f64,
            p.calls.get("status reads").copied().unwrap_or(0.0) / pods as f64,
            p.load
        );
    }
    Ok(())
}

async fn phase(
    c: &NeutronCluster,
    vm: &Vm,
    alloc: &Svc,
    id: &str,
    name: &str,
    warm: bool,
    pods: usize,
) -> Result<Phase> {
    let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(c.admin.clone(), NS);
    let binder = vm.binder()?;
    let mut cnis = Vec::new();
    let add = |pod: String| {
        let binder = binder.clone();
        let api = api.clone();
        let node = vm.name.clone();
        async move {
            let mut p = c.pod(&pod);
            if let Some(spec) = p.spec.as_mut() {
                spec.node_name = Some(node);
            }
            let t = Instant::now();
            let uid = api.create(&PostParams::default(), &p).await?.metadata.uid.context("no uid")?;
            let netns = Arc::new(Netns::new("nb")?);
            let cni = CniPod { namespace: NS.into(), name: pod.clone(), uid, netns };
            let run = cni.clone();
            let out = tokio::task::spawn_blocking(move || run.run("ADD", &binder, None, SLOW)).await??;
            let took = t.elapsed();
            ensure!(out.code == 0, "ADD {pod}: {} {}", out.stdout, out.stderr);
            Ok::<_, anyhow::Error>((cni, took))
        }
    };
    let mut fill = None;
    if warm {
        let before = calls(alloc).await?;
        cnis.push(add(format!("{id}-primer")).await?.0);
        let tag = format!("kuryr.openstack.org/cluster=bench-nested-{id}");
        wait_until("the trunk's pool filled", SLOW, || async {
            // Spare: on the trunk (added) and without a pod.
            let on_trunk = vm.subports(c).await?;
            let ports = c.neutron.list_ports(&kuryr_openstack::Filter::new().tags(std::slice::from_ref(&tag))).await?;
            let spare = ports.iter().filter(|p| p.device_id.is_empty() && on_trunk.contains_key(&p.id)).count();
            ensure!(spare >= pods, "{spare} spare subports of {pods}");
            Ok(())
        })
        .await?;
        fill = Some(delta(&calls(alloc).await?, &before));
    }
    let load = loadavg();
    let before = calls(alloc).await?;
    let mut add_ms = Vec::new();
    for i in 0..pods {
        let (cni, took) = add(format!("{id}-{i}")).await?;
        add_ms.push(took.as_secs_f64() * 1000.0);
        cnis.push(cni);
    }
    let calls = delta(&calls(alloc).await?, &before);
    // Teardown: DEL, pods deleted, nothing held.
    for cni in &cnis {
        let (run, b) = (cni.clone(), binder.clone());
        let out = tokio::task::spawn_blocking(move || run.run("DEL", &b, None, SLOW)).await??;
        ensure!(out.code == 0, "DEL {}: {} {}", cni.name, out.stdout, out.stderr);
    }
    let grace0 = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    for cni in &cnis {
        api.delete(&cni.name, &grace0).await?;
    }
    objects::wait_no_pods(&api, "the pods gone", SLOW).await?;
    Ok(Phase { name: name.to_string(), add_ms, calls, fill, load })
}

fn print_phase(p: &Phase, pods: usize) {
    let s = Stats::of(&p.add_ms);
    println!(
        "{}: created → ADD returned p50 {:.0} ms, p90 {:.0} ms, max {:.0} ms over {} pods (load {})",
        p.name,
        s.as_ref().map_or(f64::NAN, |s| s.p50),
        s.as_ref().map_or(f64::NAN, |s| s.p90),
        s.as_ref().map_or(f64::NAN, |s| s.max),
        pods,
        p.load
    );
    let per_pod: Vec<String> = p.calls.iter().map(|(op, n)| format!("{op} {:.2}", n / pods as f64)).collect();
    println!(
        "{}: Neutron calls per pod {:.2} ({})",
        p.name,
        p.calls.values().sum::<f64>() / pods as f64,
        per_pod.join(", ")
    );
    if let Some(fill) = &p.fill {
        let ops: Vec<String> = fill.iter().map(|(op, n)| format!("{op} {n:.0}")).collect();
        println!(
            "{}: the pool fill before the measured pods: {} calls ({})",
            p.name,
            fill.values().sum::<f64>(),
            ops.join(", ")
        );
    }
}
