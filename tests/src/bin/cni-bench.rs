//! `make bench-cni` (and `make bench`): CNI ADD and DEL latency of `kuryr-cni` (VIF already
//! known) next to the reference `bridge` + `host-local` plugins doing the same job in the same run,
//! measured as a runtime sees it — from exec of the plugin to its exit — plus the floor under it
//! (an exec of `true`, the shim's exec alone, and with one call to the binder), the time budget of
//! each hop, the shim's size and memory, the binder's RSS and its CPU per call (utime + stime
//! while the calls ran, its reactions to them included).
//!
//! The time budget comes from the parts themselves: the shim's log line of each call (its
//! runtime, connection, call), the binder's per-ADD and per-DEL log line (each step, in ms) and its
//! `kuryr_cni_step_duration_seconds` histograms, scraped before and after; what no part measures
//! (the exec and exit of the shim, the gRPC transport) is the difference, labelled as derived.
//!
//! Runs inside a network namespace of its own (it re-executes itself under `nsenter`), so the
//! bridges, veths and routes of both plugins never touch the host's network configuration. The last
//! line is `ratio kuryr/reference: p50 <x>x  p99 <y>x` (ADD).
#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kuryr_proto::allocator::v1::Vif;
use kuryr_tests::binder::Binder;
use kuryr_tests::metrics::Scrape;
use kuryr_tests::netns::Netns;
use kuryr_tests::procstat::{clock_ticks, cpu_ticks};
use kuryr_tests::services::bin_path;
use kuryr_tests::stats::ms;
use kuryr_tests::vifserver::{ScriptedAllocator, bridge_vif};

const REFERENCE: &str = "/usr/lib/cni";
/// Where the binder serves its metrics, inside the node's namespace (see `Binder::start`).
const BINDER_METRICS: &str = "127.0.0.1:9631";
const STEP_METRIC: &str = "kuryr_cni_step_duration_seconds";

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// One execution of a plugin: how long from exec to exit, and what it printed.
struct Exec {
    took: Duration,
    stderr: String,
}

/// Executes a CNI plugin with `env` and `conf`; fails on a non-zero exit.
fn exec_plugin(path: &Path, env: &[(&str, String)], conf: &[u8]) -> Result<Exec> {
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
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        bail!("{} failed: {}{stderr}", path.display(), String::from_utf8_lossy(&out.stdout));
    }
    Ok(Exec { took, stderr })
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
        "{name:<40} n={:<4} p50={:>7.2} ms  p90={:>7.2} ms  p99={:>7.2} ms  max={:>7.2} ms",
        v.len(),
        ms(p50),
        ms(percentile(&v, 0.90)),
        ms(p99),
        ms(*v.last().unwrap())
    );
    (p50, p99)
}

/// The shim's own account of one call, from its log line
/// `ADD ok in 1.234 ms (runtime 0.030, connect 0.120, call 1.000, rest 0.084)`: (total, runtime,
/// connect, call, rest) in ms.
fn shim_hops(stderr: &str) -> Option<[f64; 5]> {
    let line = stderr.lines().find(|l| l.contains(" ok in "))?;
    let rest = line.split(" ok in ").nth(1)?;
    let total: f64 = rest.split_whitespace().next()?.parse().ok()?;
    let mut out = [total, 0.0, 0.0, 0.0, 0.0];
    for (i, name) in ["runtime", "connect", "call", "rest"].iter().enumerate() {
        let v = rest.split(&format!("{name} ")).nth(1)?;
        out[i + 1] = v.split([',', ')']).next()?.trim().parse().ok()?;
    }
    Some(out)
}

/// The binder's account of each call: container → (took_ms, [(step, ms)]).
type BinderCalls = BTreeMap<String, (f64, Vec<(String, f64)>)>;

/// The binder's per-operation log lines (`ADD done` / `DEL done`): container → (took_ms, steps).
fn binder_lines(logs: &str, what: &str) -> BinderCalls {
    let field = |l: &str, name: &str| -> Option<String> {
        let v = l.split(&format!("{name}=")).nth(1)?;
        let v = v.trim_start_matches('"');
        Some(v.split(['"', ' ', '\u{1b}']).next()?.to_string())
    };
    let mut out = BTreeMap::new();
    for l in logs.lines().filter(|l| l.contains(what)) {
        let (Some(container), Some(took), Some(steps)) =
            (field(l, "container"), field(l, "took_ms"), field(l, "steps"))
        else {
            continue;
        };
        let Ok(took) = took.parse::<f64>() else { continue };
        let steps = steps
            .split(',')
            .filter_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                Some((k.to_string(), v.parse::<f64>().ok()?))
            })
            .collect();
        out.insert(container, (took, steps));
    }
    out
}

/// Rows of a time budget: a name, its samples (ms), who measured it.
struct Budget {
    rows: Vec<(String, Vec<f64>, &'static str)>,
}

impl Budget {
    fn new() -> Self {
        Self { rows: Vec::new() }
    }

    fn row(&mut self, name: impl Into<String>, samples: Vec<f64>, by: &'static str) {
        self.rows.push((name.into(), samples, by));
    }

    fn print(&self, title: &str, scraped: Option<&BTreeMap<String, (f64, f64)>>) {
        println!("{title}");
        println!(
            "  {:<44} {:>5} {:>9} {:>9} {:>9} {:>12}   measured by",
            "hop", "n", "p50 ms", "p99 ms", "mean ms", "metrics mean"
        );
        for (name, samples, by) in &self.rows {
            if samples.is_empty() {
                continue;
            }
            let mut v = samples.clone();
            v.sort_by(f64::total_cmp);
            let at = |p: f64| v[(((v.len() - 1) as f64) * p).round() as usize];
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            let step = name.trim_start().strip_prefix("binder: ").unwrap_or("");
            let metric = scraped
                .and_then(|m| m.get(step))
                .map(|(count, sum)| format!("{:>12.3}", sum * 1e3 / count))
                .unwrap_or_else(|| format!("{:>12}", ""));
            println!("  {name:<44} {:>5} {:>9.3} {:>9.3} {:>9.3} {metric}   {by}", v.len(), at(0.5), at(0.99), mean);
        }
    }
}

/// Per step of `op`: (observations, seconds) the binder's histograms gained between two scrapes.
fn scraped_steps(before: &Scrape, after: &Scrape, op: &str) -> BTreeMap<String, (f64, f64)> {
    let mut out = BTreeMap::new();
    for s in after.series.iter().filter(|s| s.name == format!("{STEP_METRIC}_count")) {
        let (Some(o), Some(step)) = (s.labels.get("op"), s.labels.get("step")) else { continue };
        if o != op {
            continue;
        }
        let f: [(&str, &str); 2] = [("op", op), ("step", step)];
        let count = after.count(STEP_METRIC, &f) - before.count(STEP_METRIC, &f);
        let sum = after.hist_sum(STEP_METRIC, &f) - before.hist_sum(STEP_METRIC, &f);
        if count > 0.0 {
            out.insert(step.clone(), (count, sum));
        }
    }
    out
}

/// The budget of `op` (ADD or DEL): the exec, the shim's hops, the gRPC transport and each of the
/// binder's steps, paired call by call.
fn budget(op: &str, calls: &[(String, Exec)], binder: &BinderCalls, scraped: &BTreeMap<String, (f64, f64)>) {
    let mut b = Budget::new();
    let (mut exec, mut runtime, mut connect, mut call, mut rest) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut transport, mut binder_total) = (vec![], vec![]);
    let mut steps: Vec<(String, Vec<f64>)> = Vec::new();
    for (container, e) in calls {
        let Some([total, rt, co, ca, re]) = shim_hops(&e.stderr) else { continue };
        exec.push(ms(e.took) - total);
        runtime.push(rt);
        connect.push(co);
        call.push(ca);
        rest.push(re);
        if let Some((took, s)) = binder.get(container) {
            transport.push(ca - took);
            binder_total.push(*took);
            for (name, v) in s {
                match steps.iter_mut().find(|(n, _)| n == name) {
                    Some((_, vs)) => vs.push(*v),
                    None => steps.push((name.clone(), vec![*v])),
                }
            }
        }
    }
    b.row("exec of the shim, start-up and exit", exec, "bench: exec→exit − shim's own time (derived)");
    b.row("shim: tokio runtime", runtime, "shim log");
    b.row("shim: connect (unix socket + HTTP/2)", connect, "shim log");
    b.row("shim: call → answer", call, "shim log");
    b.row("  gRPC transport, both ways", transport, "shim call − binder total (derived)");
    b.row(format!("  binder: {op} total"), binder_total, "binder log");
    let mut binder_sum = 0.0;
    for (name, v) in steps {
        binder_sum += v.iter().sum::<f64>() / v.len().max(1) as f64;
        b.row(format!("    binder: {name}"), v, "binder log / metrics");
    }
    b.row("shim: parse, print result, log", rest, "shim log");
    b.print(&format!("# time budget of one kuryr-cni {op} (every call of the run)"), Some(scraped));
    println!("  (the binder's steps add up to {binder_sum:.3} ms on average; their names: docs/benchmarks.md)");
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

fn del_env(env: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    let mut env = env.to_vec();
    env[0].1 = "DEL".into();
    env
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

    println!("# CNI ADD and DEL, exec to exit, {pods} sandboxes each (VIF already known for kuryr)");
    let conf = binder.netconf("1.0.0", "kuryr").to_string();
    let mut rss_100 = None;
    // Every VIF is known to the binder before the runtime calls ADD; like the embedded IPAM's,
    // they are ready once plugged (ADD answers before the plugged report).
    let embedded = |v| Vif { ready_when_plugged: true, ..v };
    for i in 0..pods {
        let uid = format!("bench-{i}");
        let (a, b) = (i / 250, i % 250 + 2);
        alloc.upsert(embedded(bridge_vif(
            "bench-node",
            "bench",
            &uid,
            &uid,
            (&format!("10.98.{a}.{b}/16"), "10.98.255.254"),
            None,
            "kuryr0",
        )));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // One ADD and DEL first, outside the figures: the binder prepares its bridge on the first.
    {
        let ns = Netns::new("kbw")?;
        alloc.upsert(embedded(bridge_vif(
            "bench-node",
            "bench",
            "warm-up",
            "warm-up",
            ("10.98.254.1/16", "10.98.255.254"),
            None,
            "kuryr0",
        )));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let env = pod_env("ADD", "warm-up", &ns.path(), Some("warm-up"));
        exec_plugin(&shim, &env, conf.as_bytes())?;
        exec_plugin(&shim, &del_env(&env), conf.as_bytes())?;
    }

    let node_path = node.path();
    let scrape = || Scrape::in_netns(&node_path, BINDER_METRICS);
    let before_add = scrape().await?;
    let cpu_before_add = cpu_ticks(binder_pid);
    let mut kuryr = Vec::with_capacity(pods);
    let mut pod_ns = Vec::with_capacity(pods);
    for i in 0..pods {
        let ns = Netns::new("kbp")?;
        let id = format!("bench-{i}");
        let env = pod_env("ADD", &id, &ns.path(), Some(&id));
        kuryr.push((id, exec_plugin(&shim, &env, conf.as_bytes())?));
        pod_ns.push((ns, env));
        if i + 1 == 100 {
            rss_100 = Some(rss_kib(binder_pid)?);
        }
    }
    let cpu_add = cpu_ticks(binder_pid) - cpu_before_add;
    let after_add = scrape().await?;
    let shim_rss = peak_rss_kib(&shim, &[("CNI_COMMAND", "VERSION".to_string())], conf.as_bytes());
    // The floor under each call: an exec of `true`, the shim's exec alone (VERSION is answered by
    // the shim itself), and the exec plus one call to the binder that does no work there (STATUS).
    let true_bin = ["/usr/bin/true", "/bin/true"].into_iter().map(PathBuf::from).find(|p| p.exists());
    let (mut floor, mut version, mut status) = (Vec::new(), Vec::with_capacity(pods), Vec::with_capacity(pods));
    let conf_11 = binder.netconf("1.1.0", "kuryr").to_string();
    for _ in 0..pods {
        if let Some(t) = &true_bin {
            floor.push(exec_plugin(t, &[], b"")?.took);
        }
        version.push(exec_plugin(&shim, &[("CNI_COMMAND", "VERSION".to_string())], conf.as_bytes())?.took);
        status.push(exec_plugin(&shim, &[("CNI_COMMAND", "STATUS".to_string())], conf_11.as_bytes())?.took);
    }

    // The reference plugins on the same machine, same run, same number of fresh netns.
    let ipam_dir = dir.path().join("host-local");
    let ref_conf = serde_json::json!({
        "cniVersion": "1.0.0", "name": "bench-ref", "type": "bridge", "bridge": "cnibench0", "isGateway": true,
        "ipam": { "type": "host-local", "subnet": "10.97.0.0/16", "dataDir": ipam_dir }
    })
    .to_string();
    let bridge = PathBuf::from(REFERENCE).join("bridge");
    // The same warm-up as kuryr's: the first ADD creates the plugin's bridge.
    {
        let ns = Netns::new("kbw")?;
        let env = pod_env("ADD", "ref-warm-up", &ns.path(), None);
        exec_plugin(&bridge, &env, ref_conf.as_bytes())?;
        exec_plugin(&bridge, &del_env(&env), ref_conf.as_bytes())?;
    }
    let mut reference = Vec::with_capacity(pods);
    let mut ref_ns = Vec::with_capacity(pods);
    for i in 0..pods {
        let ns = Netns::new("kbr")?;
        let env = pod_env("ADD", &format!("ref-{i}"), &ns.path(), None);
        reference.push(exec_plugin(&bridge, &env, ref_conf.as_bytes())?.took);
        ref_ns.push((ns, env));
    }

    // DEL of every sandbox through the plugins themselves, the namespaces still there (as a
    // runtime does: DEL before it removes the sandbox's namespace).
    let mut kuryr_del = Vec::with_capacity(pods);
    let cpu_before_del = cpu_ticks(binder_pid);
    for (_, env) in &pod_ns {
        let id = env[1].1.clone();
        kuryr_del.push((id, exec_plugin(&shim, &del_env(env), conf.as_bytes())?));
    }
    let cpu_del = cpu_ticks(binder_pid) - cpu_before_del;
    let after_del = scrape().await?;
    let mut reference_del = Vec::with_capacity(pods);
    for (_, env) in &ref_ns {
        reference_del.push(exec_plugin(&bridge, &del_env(env), ref_conf.as_bytes())?.took);
    }

    // Where the time goes, from the shim's and the binder's own accounts.
    let logs = binder.logs();
    budget("ADD", &kuryr, &binder_lines(&logs, "ADD done"), &scraped_steps(&before_add, &after_add, "ADD"));
    budget("DEL", &kuryr_del, &binder_lines(&logs, "DEL done"), &scraped_steps(&after_add, &after_del, "DEL"));

    println!("# floors and footprint");
    if !floor.is_empty() {
        summary("exec of `true` (the machine's floor)", floor);
    }
    summary("kuryr-cni VERSION (exec only)", version);
    summary("kuryr-cni STATUS (exec + binder call)", status);
    let size = std::fs::metadata(&shim)?.len();
    println!("kuryr-cni binary: {} ({:.2} MiB)", shim.display(), size as f64 / 1048576.0);
    match shim_rss {
        Some(k) => println!("kuryr-cni peak RSS (VERSION): {:.1} MiB   (target <= 5 MB)", k as f64 / 1024.0),
        None => println!("kuryr-cni peak RSS: /usr/bin/time not available"),
    }
    println!("kuryr-binder RSS idle: {:.1} MiB   (target <= 15 MB)", rss_idle as f64 / 1024.0);
    if let Some(r) = rss_100 {
        println!("kuryr-binder RSS with 100 pods: {:.1} MiB", r as f64 / 1024.0);
    }
    // Everything the binder did while the calls ran, its reactions to them included (the
    // background report, the VIF stream's updates, the hairpin sweep).
    let per_call = |ticks: u64| ticks as f64 * 1000.0 / clock_ticks() / pods.max(1) as f64;
    println!(
        "kuryr-binder CPU per call (utime + stime while the calls ran): ADD {:.2} ms  DEL {:.2} ms",
        per_call(cpu_add),
        per_call(cpu_del)
    );

    println!("# latency, exec to exit");
    let (d50, d99) = summary("kuryr-cni DEL", kuryr_del.into_iter().map(|(_, e)| e.took).collect());
    let (rd50, rd99) = summary("bridge+host-local DEL", reference_del);
    println!("DEL kuryr/reference: p50 {:.2}x  p99 {:.2}x", ms(d50) / ms(rd50), ms(d99) / ms(rd99));
    let (k50, k99) = summary("kuryr-cni ADD", kuryr.into_iter().map(|(_, e)| e.took).collect());
    let (r50, r99) = summary("bridge+host-local ADD", reference);
    println!("targets: ADD p50 <= 2 ms, p99 <= 5 ms, <= 0.25x the reference");
    drop(binder);
    drop(pod_ns);
    println!("ratio kuryr/reference: p50 {:.2}x  p99 {:.2}x", ms(k50) / ms(r50), ms(k99) / ms(r99));
    Ok(())
}

/// The CNI environment of one sandbox; `uid` adds the Kubernetes CNI_ARGS kuryr needs.
fn pod_env(command: &str, id: &str, netns: &Path, uid: Option<&str>) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("CNI_COMMAND", command.to_string()),
        ("CNI_CONTAINERID", id.to_string()),
        ("CNI_NETNS", netns.display().to_string()),
        ("CNI_IFNAME", "eth0".to_string()),
        ("CNI_PATH", REFERENCE.to_string()),
    ];
    if let Some(uid) = uid {
        env.push(("CNI_ARGS", format!("K8S_POD_NAMESPACE=bench;K8S_POD_NAME={uid};K8S_POD_UID={uid}")));
    }
    env
}
