//! `make bench`: CNI ADD latency of `kuryr-cni` (VIF already known) next to the reference
//! `bridge` + `host-local` plugins doing the same job in the same run, measured as a runtime sees
//! it — from exec of the plugin to its exit — plus the floor under it (the shim's exec alone, and
//! with one call to the binder), the shim's size and memory and the binder's RSS.
//!
//! Runs inside a network namespace of its own (it re-executes itself under `nsenter`), so the
//! bridges, veths and routes of both plugins never touch the host's network configuration.
#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kuryr_tests::binder::Binder;
use kuryr_tests::netns::Netns;
use kuryr_tests::services::bin_path;
use kuryr_tests::vifserver::{ScriptedAllocator, bridge_vif};

const REFERENCE: &str = "/usr/lib/cni";

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Executes a CNI plugin with `env` and `conf`; returns its duration, failing on a non-zero exit.
fn exec_plugin(path: &Path, env: &[(&str, String)], conf: &[u8]) -> Result<(Duration, String)> {
    let start = Instant::now();
    let mut child = Command::new(path)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child.stdin.take().context("stdin")?.write_all(conf)?;
    let out = child.wait_with_output()?;
    let took = start.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!("{} failed: {stdout}{}", path.display(), String::from_utf8_lossy(&out.stderr));
    }
    Ok((took, stdout))
}

fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .context("no VmRSS")
}

/// Peak RSS of one execution, from GNU time's %M when available.
fn peak_rss_kib(path: &Path, env: &[(&str, String)], conf: &[u8]) -> Option<u64> {
    let mut child = Command::new("/usr/bin/time")
        .args(["-f", "%M"])
        .arg(path)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(conf).ok()?;
    let out = child.wait_with_output().ok()?;
    String::from_utf8_lossy(&out.stderr).lines().last()?.trim().parse().ok()
}

fn summary(name: &str, mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    let (p50, p99) = (percentile(&v, 0.50), percentile(&v, 0.99));
    println!(
        "{name:<36} n={:<4} p50={:>7.2} ms  p90={:>7.2} ms  p99={:>7.2} ms  max={:>7.2} ms",
        v.len(),
        ms(p50),
        ms(percentile(&v, 0.90)),
        ms(p99),
        ms(*v.last().unwrap())
    );
    (p50, p99)
}

fn main() -> Result<()> {
    // Re-execute inside a private network namespace; it is deleted (with the reference plugin's
    // bridge and everything else in it) when the run ends.
    if std::env::var_os("KURYR_BENCH_INNER").is_none() {
        let ns = Netns::new("kbh")?;
        let status = Command::new("nsenter")
            .arg(format!("--net={}", ns.path().display()))
            .arg("--")
            .arg(std::env::current_exe()?)
            .args(std::env::args().skip(1))
            .env("KURYR_BENCH_INNER", "1")
            .status()?;
        drop(ns);
        std::process::exit(status.code().unwrap_or(1));
    }
    tokio::runtime::Runtime::new()?.block_on(run())
}

async fn run() -> Result<()> {
    let pods: usize = std::env::args().nth(1).map(|a| a.parse()).transpose()?.unwrap_or(200);
    let shim = bin_path("kuryr-cni")?;
    let dir = tempfile::tempdir()?;
    let alloc = ScriptedAllocator::new(true);
    let server = alloc.serve_unix(&dir.path().join("alloc.sock")).await?;
    let node = Netns::new("kbn")?;
    let binder = Binder::start("bench-node", &node.path(), &server.target, &[]).await?;
    let binder_pid = binder.pid().context("binder pid")?;
    // Let the binder settle, then take its idle RSS.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_idle = rss_kib(binder_pid)?;

    println!("# CNI ADD, exec to exit, {pods} sandboxes each (VIF already known for kuryr)");
    let conf = binder.netconf("1.0.0", "kuryr").to_string();
    let mut kuryr = Vec::with_capacity(pods);
    let mut pod_ns = Vec::with_capacity(pods);
    let mut rss_100 = None;
    // Every VIF is known to the binder before the runtime calls ADD.
    for i in 0..pods {
        let uid = format!("bench-{i}");
        let (a, b) = (i / 250, i % 250 + 2);
        alloc.upsert(bridge_vif(
            "bench-node",
            "bench",
            &uid,
            &uid,
            (&format!("10.98.{a}.{b}/16"), "10.98.255.254"),
            None,
            "kuryr0",
        ));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 0..pods {
        let ns = Netns::new("kbp")?;
        let uid = format!("bench-{i}");
        let env = vec![
            ("CNI_COMMAND", "ADD".to_string()),
            ("CNI_CONTAINERID", format!("bench-{i}")),
            ("CNI_NETNS", ns.path().display().to_string()),
            ("CNI_IFNAME", "eth0".to_string()),
            ("CNI_PATH", REFERENCE.to_string()),
            ("CNI_ARGS", format!("K8S_POD_NAMESPACE=bench;K8S_POD_NAME={uid};K8S_POD_UID={uid}")),
        ];
        let (took, _) = exec_plugin(&shim, &env, conf.as_bytes())?;
        kuryr.push(took);
        pod_ns.push((ns, env));
        if i + 1 == 100 {
            rss_100 = Some(rss_kib(binder_pid)?);
        }
    }
    let shim_rss = peak_rss_kib(&shim, &[("CNI_COMMAND", "VERSION".to_string())], conf.as_bytes());
    // The floor under each ADD: the exec alone (VERSION is answered by the shim itself), and the
    // exec plus one call to the binder that does no work there (STATUS).
    let (mut version, mut status) = (Vec::with_capacity(pods), Vec::with_capacity(pods));
    let conf_11 = binder.netconf("1.1.0", "kuryr").to_string();
    for _ in 0..pods {
        version.push(exec_plugin(&shim, &[("CNI_COMMAND", "VERSION".to_string())], conf.as_bytes())?.0);
        status.push(exec_plugin(&shim, &[("CNI_COMMAND", "STATUS".to_string())], conf_11.as_bytes())?.0);
    }

    // The reference plugins on the same machine, same run, same number of fresh netns.
    let ipam_dir = dir.path().join("host-local");
    let ref_conf = serde_json::json!({
        "cniVersion": "1.0.0", "name": "bench-ref", "type": "bridge", "bridge": "cnibench0", "isGateway": true,
        "ipam": { "type": "host-local", "subnet": "10.97.0.0/16", "dataDir": ipam_dir }
    })
    .to_string();
    let mut reference = Vec::with_capacity(pods);
    let mut ref_ns = Vec::with_capacity(pods);
    for i in 0..pods {
        let ns = Netns::new("kbr")?;
        let env = vec![
            ("CNI_COMMAND", "ADD".to_string()),
            ("CNI_CONTAINERID", format!("ref-{i}")),
            ("CNI_NETNS", ns.path().display().to_string()),
            ("CNI_IFNAME", "eth0".to_string()),
            ("CNI_PATH", REFERENCE.to_string()),
        ];
        let (took, _) = exec_plugin(&PathBuf::from(REFERENCE).join("bridge"), &env, ref_conf.as_bytes())?;
        reference.push(took);
        ref_ns.push((ns, env));
    }

    let (k50, k99) = summary("kuryr-cni ADD", kuryr);
    let (r50, r99) = summary("bridge+host-local ADD", reference);
    println!(
        "ratio kuryr/reference: p50 {:.2}x  p99 {:.2}x   (target: p50 <= 3 ms, p99 <= 10 ms, <= 0.3x)",
        ms(k50) / ms(r50),
        ms(k99) / ms(r99)
    );
    summary("kuryr-cni VERSION (exec only)", version);
    summary("kuryr-cni STATUS (exec + binder call)", status);
    let size = std::fs::metadata(&shim)?.len();
    println!("kuryr-cni binary: {} ({:.2} MiB)", shim.display(), size as f64 / 1048576.0);
    match shim_rss {
        Some(k) => println!("kuryr-cni peak RSS (VERSION): {:.1} MiB   (target <= 5 MB)", k as f64 / 1024.0),
        None => println!("kuryr-cni peak RSS: /usr/bin/time not available"),
    }
    println!("kuryr-binder RSS idle: {:.1} MiB   (target <= 20 MB)", rss_idle as f64 / 1024.0);
    if let Some(r) = rss_100 {
        println!("kuryr-binder RSS with 100 pods: {:.1} MiB", r as f64 / 1024.0);
    }

    // Where the time goes, from the binder's own per-ADD log fields.
    let logs = binder.logs();
    let field = |name: &str| -> Vec<Duration> {
        logs.lines()
            .filter(|l| l.contains("ADD done"))
            .filter_map(|l| {
                let v = l.split(&format!("{name}=")).nth(1)?.split([' ', '\u{1b}']).next()?;
                v.parse::<f64>().ok().map(|ms| Duration::from_secs_f64(ms / 1000.0))
            })
            .collect()
    };
    for (name, label) in [
        ("took_ms", "binder: ADD total"),
        ("vif_wait_ms", "binder: VIF lookup"),
        ("plug_ms", "binder: plugging (netlink)"),
        ("ready_wait_ms", "binder: reported → READY seen"),
    ] {
        let v = field(name);
        if !v.is_empty() {
            summary(label, v);
        }
    }

    // Clean up: DEL everything through the plugins themselves.
    for (_, env) in &pod_ns {
        let mut env = env.clone();
        env[0].1 = "DEL".into();
        exec_plugin(&shim, &env, conf.as_bytes())?;
    }
    for (_, env) in &ref_ns {
        let mut env = env.clone();
        env[0].1 = "DEL".into();
        exec_plugin(&PathBuf::from(REFERENCE).join("bridge"), &env, ref_conf.as_bytes())?;
    }
    drop(binder);
    Ok(())
}
