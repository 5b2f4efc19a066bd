//! `make chaos`: pods churned on a whole embedded cluster while kuryr processes are killed,
//! stopped and starved at random ([`kuryr_tests::chaos`]), or with `CHAOS_BACKEND=neutron`
//! against real Keystone and Neutron behind a fault proxy ([`kuryr_tests::chaos::neutron`]),
//! then the invariants checked. Prints
//! the faults as they happen, the figures, every problem found, and as its last line exactly
//! `chaos: N pods, K faults, L leaked, D duplicate, U unreachable`; exits non-zero unless the
//! last three are 0.
//!
//! Environment: CHAOS_PODS (pods created over the run, default 1000), CHAOS_SECONDS (length of
//! the churn, default 600), CHAOS_BACKEND (`embedded` or `neutron`), CHAOS_FAULT_SECONDS (mean
//! gap between process faults, default 10), CHAOS_NODES (default 2; embedded), CHAOS_LIVE (live
//! pods at most, default 60; 20 with neutron), CHAOS_SERVICES (default 3),
//! CHAOS_DEPLOYMENTS (embedded: 1, the default, for a Deployment per node scaled at random; 0
//! for none),
//! CHAOS_QUIET_SECONDS (bound on converging after the last fault, default 180), CHAOS_SEED
//! (default 1), CHAOS_PROXY_RATE (neutron: the fault proxy's rate of each of 503, 409, slow
//! answers and lost POST answers, timeouts at a third of it; default 0.03), CHAOS_PARALLEL
//! (neutron: sandboxes set up at once, default 8), CHAOS_ALLOCATORS (neutron: allocator
//! replicas, sharded by Leases, default 2), CHAOS_LBAAS (neutron: kuryr-lbaas replicas on Octavia
//! behind a fault proxy of its own, sharded by Leases, default 2; 0 for no Octavia), CHAOS_POLICY
//! (neutron: 1, the default, for kuryr-policy's security groups through the proxy; 0 for none).

#![allow(clippy::print_stdout)] // a report whose output is the point

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kuryr_tests::chaos::neutron::NeutronChaosOptions;
use kuryr_tests::chaos::{self, ChaosOptions};
use kuryr_tests::faultproxy::FaultRates;
use kuryr_tests::util::loadavg;

fn env_num(name: &str, default: u64) -> Result<u64> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().with_context(|| format!("{name}={v}: not a number")),
        _ => Ok(default),
    }
}

enum Run {
    Embedded(ChaosOptions),
    Neutron(NeutronChaosOptions),
}

fn options() -> Result<Run> {
    let backend = std::env::var("CHAOS_BACKEND").unwrap_or_else(|_| "embedded".into());
    match backend.as_str() {
        "embedded" => Ok(Run::Embedded(embedded_options()?)),
        "neutron" => Ok(Run::Neutron(neutron_options()?)),
        other => bail!("CHAOS_BACKEND={other}: expected embedded or neutron"),
    }
}

fn neutron_options() -> Result<NeutronChaosOptions> {
    let d = NeutronChaosOptions::default();
    let as_usize = |v: u64| usize::try_from(v).context("too large");
    let rate: f64 = match std::env::var("CHAOS_PROXY_RATE") {
        Ok(v) if !v.trim().is_empty() => {
            v.trim().parse().with_context(|| format!("CHAOS_PROXY_RATE={v}: not a number"))?
        }
        _ => 0.03,
    };
    if !(0.0..=0.2).contains(&rate) {
        bail!("CHAOS_PROXY_RATE={rate}: expected 0 to 0.2");
    }
    Ok(NeutronChaosOptions {
        pods: as_usize(env_num("CHAOS_PODS", 1000)?)?,
        duration: Duration::from_secs(env_num("CHAOS_SECONDS", 600)?),
        fault_every: Duration::from_secs(env_num("CHAOS_FAULT_SECONDS", d.fault_every.as_secs())?.max(1)),
        live: as_usize(env_num("CHAOS_LIVE", d.live as u64)?.max(1))?,
        parallel: as_usize(env_num("CHAOS_PARALLEL", d.parallel as u64)?.max(1))?,
        allocators: as_usize(env_num("CHAOS_ALLOCATORS", d.allocators as u64)?.max(1))?,
        lbaas: as_usize(env_num("CHAOS_LBAAS", d.lbaas as u64)?)?,
        services: as_usize(env_num("CHAOS_SERVICES", d.services as u64)?)?,
        policy: env_num("CHAOS_POLICY", u64::from(d.policy))? != 0,
        rates: FaultRates { server_error: rate, conflict: rate, timeout: rate / 3.0, slow: rate, lost_answer: rate },
        quiet: Duration::from_secs(env_num("CHAOS_QUIET_SECONDS", d.quiet.as_secs())?),
        seed: env_num("CHAOS_SEED", d.seed)?,
        verbose: true,
    })
}

fn embedded_options() -> Result<ChaosOptions> {
    let d = ChaosOptions::default();
    let as_usize = |v: u64| usize::try_from(v).context("too large");
    Ok(ChaosOptions {
        pods: as_usize(env_num("CHAOS_PODS", d.pods as u64)?)?,
        duration: Duration::from_secs(env_num("CHAOS_SECONDS", d.duration.as_secs())?),
        fault_every: Duration::from_secs(env_num("CHAOS_FAULT_SECONDS", d.fault_every.as_secs())?.max(1)),
        nodes: as_usize(env_num("CHAOS_NODES", d.nodes as u64)?.max(1))?,
        live: as_usize(env_num("CHAOS_LIVE", d.live as u64)?.max(1))?,
        services: as_usize(env_num("CHAOS_SERVICES", d.services as u64)?)?,
        deployments: env_num("CHAOS_DEPLOYMENTS", u64::from(d.deployments))? != 0,
        quiet: Duration::from_secs(env_num("CHAOS_QUIET_SECONDS", d.quiet.as_secs())?),
        seed: env_num("CHAOS_SEED", d.seed)?,
        verbose: true,
    })
}

fn main() -> ExitCode {
    let opts = match options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("chaos: {e:#}");
            return ExitCode::from(2);
        }
    };
    let t = Instant::now();
    let load_before = loadavg();
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("chaos: {e}");
            return ExitCode::from(2);
        }
    };
    let (live, nodes, services) = match &opts {
        Run::Embedded(o) => (o.live, o.nodes, o.services),
        Run::Neutron(o) => (o.live, 1, if o.lbaas > 0 { o.services } else { 0 }),
    };
    let quiet = match &opts {
        Run::Embedded(o) => o.quiet,
        Run::Neutron(o) => o.quiet,
    };
    let result = match &opts {
        Run::Embedded(o) => runtime.block_on(chaos::run(o)),
        Run::Neutron(o) => runtime.block_on(chaos::neutron::run(o)),
    };
    let outcome = match result {
        Ok(o) => o,
        Err(e) => {
            eprintln!("chaos: the run failed: {e:#}");
            return ExitCode::from(2);
        }
    };
    println!("faults:");
    for f in &outcome.fault_log {
        println!("  {f}");
    }
    println!(
        "churn: {} pods created over {:.0} s ({} live at most, {} nodes, {} Services), {} live at the end",
        outcome.pods,
        outcome.ran.as_secs_f64(),
        live,
        nodes,
        services,
        outcome.live_at_end
    );
    if outcome.scaled > 0 || outcome.by_deployments > 0 {
        println!(
            "deployments: scaled {} times, {} of the pods created by their ReplicaSets",
            outcome.scaled, outcome.by_deployments
        );
    }
    match outcome.converged_in {
        Some(d) => println!("converged {:.1} s after the last fault", d.as_secs_f64()),
        None => println!("NOT converged within {:?} of the last fault", quiet),
    }
    if let Some((p50, p99, max)) = outcome.startup {
        println!(
            "pod start-up during chaos (kubelet sees the pod → sandbox with network): p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; {} pods needed more than one RunPodSandbox",
            p50.as_secs_f64() * 1e3,
            p99.as_secs_f64() * 1e3,
            max.as_secs_f64() * 1e3,
            outcome.retried_starts
        );
    }
    println!("checked: {} pings answered, {} Services from every node", outcome.pings, outcome.services_checked);
    let retries: Vec<String> = outcome.retries.iter().map(|(c, n)| format!("{c} {n}")).collect();
    println!("kuryr_retries_total by component at the end (since each process's last start): {}", retries.join(", "));
    println!(
        "load average: {load_before} at the start, {} at the end; run took {:.0} s",
        loadavg(),
        t.elapsed().as_secs_f64()
    );
    for d in &outcome.details {
        println!("  {d}");
    }
    println!("{}", outcome.last_line());
    if outcome.ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
