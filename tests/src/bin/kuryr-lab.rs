//! `kuryr-lab`: a two-node Kuryr cluster (embedded IPAM, Linux bridge per node, routes between
//! nodes) running on this machine, to look at and poke — `make lab` and `make lab-down`.
//!
//! `kuryr-lab up` checks the prerequisites, brings up a [`Cluster`] (real API server, watcher,
//! allocator, N nodes of containerd + kuryr-cni + kuryr-binder, each run by the test kubelet),
//! applies the sample workload of `deploy/lab/`, waits for its pods, prints their addresses and
//! how long each took to get its network, pings every pod from every other one, connects to each
//! Service's ClusterIP from a pod on every node and shows which backends answered, prints how to
//! inspect everything, and stays up until it gets SIGTERM/SIGINT (`kuryr-lab down` sends SIGTERM
//! and waits). Its state file (`.lab/state.json` in the repository, or `--state-dir`) records
//! what it made on the host, so `kuryr-lab down` can also clean up after a lab that crashed.
#![allow(clippy::print_stdout)] // a command whose output is the point

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, ListParams};
use kuryr_tests::cluster::reach::{self, PodEndpoint, Summary};
use kuryr_tests::cluster::svc;
use kuryr_tests::cluster::{Cluster, ClusterOptions, Manifest, ProcessRecord, Step, preflight};
use kuryr_tests::kubelet::PodRecord;
use kuryr_tests::services::tool_path;
use kuryr_tests::util::{env_script, repo_root};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// The namespace of the sample workload (`deploy/lab/demo.yaml`).
const DEMO_NAMESPACE: &str = "demo";

#[derive(Debug, Parser)]
#[command(name = "kuryr-lab", about = "A Kuryr cluster on this machine: `up` (stays up), `down`, `status`.")]
struct Cli {
    /// Where the lab keeps its state file, kubeconfig copy and log.
    #[arg(long, env = "KURYR_LAB_DIR", global = true)]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Bring the lab up, deploy the sample workload, and stay up until `kuryr-lab down` or Ctrl-C.
    Up {
        /// Nodes to run (the sample workload uses node-1 and node-2).
        #[arg(long, default_value_t = 2)]
        nodes: usize,
        /// An IPv4-only pod network instead of dual-stack.
        #[arg(long)]
        ipv4_only: bool,
        /// How long to wait for the sample pods to be Running, in seconds.
        #[arg(long, default_value_t = 180)]
        ready_timeout: u64,
        /// Internal: this is the lab process itself, started by `up` in a process group of its own.
        #[arg(long, hide = true)]
        inner: bool,
    },
    /// Stop the running lab and wait until it has torn down; clean up after a crashed one.
    Down {
        /// How long the lab may take to tear down before it is killed and cleaned up after, in
        /// seconds.
        #[arg(long, default_value_t = 180)]
        timeout: u64,
    },
    /// Say whether a lab is running, and how to reach it.
    Status,
}

/// The state file: who runs the lab and what it made on the host.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LabState {
    pid: u32,
    exe: PathBuf,
    /// starting, up, stopping.
    phase: String,
    kubeconfig: Option<PathBuf>,
    manifest: Manifest,
}

impl LabState {
    fn process(&self) -> ProcessRecord {
        ProcessRecord { name: "kuryr-lab".into(), pid: self.pid, exe: self.exe.clone() }
    }
}

/// The lab's files.
#[derive(Debug, Clone)]
struct Files {
    dir: PathBuf,
}

impl Files {
    fn state(&self) -> PathBuf {
        self.dir.join("state.json")
    }
    fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }
    fn log(&self) -> PathBuf {
        self.dir.join("lab.log")
    }
    fn read(&self) -> Result<Option<LabState>> {
        match std::fs::read(self.state()) {
            Ok(bytes) => {
                Ok(Some(serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", self.state().display()))?))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", self.state().display())),
        }
    }
    /// Written to a temporary file and renamed, so a reader never sees half a file.
    fn write(&self, state: &LabState) -> Result<()> {
        let tmp = self.dir.join("state.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(state)?)?;
        std::fs::rename(&tmp, self.state())?;
        Ok(())
    }
    fn remove(&self) {
        for f in [self.state(), self.kubeconfig()] {
            let _ = std::fs::remove_file(f);
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let files = Files { dir: cli.state_dir.clone().unwrap_or_else(|| repo_root().join(".lab")) };
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kuryr-lab: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Up { inner: false, .. } => relay().await,
            Command::Up { nodes, ipv4_only, ready_timeout, inner: true } => {
                up(&files, nodes, ipv4_only, Duration::from_secs(ready_timeout)).await
            }
            Command::Down { timeout } => down(&files, Duration::from_secs(timeout)).await,
            Command::Status => status(&files).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kuryr-lab: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Seconds since the lab started, for the progress lines.
fn stamp(t0: Instant) -> String {
    format!("[{:6.1}s]", t0.elapsed().as_secs_f64())
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

// ---------------------------------------------------------------------------------------------
// up
// ---------------------------------------------------------------------------------------------

/// `up` as typed: runs the lab as a child in a process group of its own and relays. A terminal's
/// Ctrl-C goes to its whole foreground process group; were the lab's services in it, they would
/// all stop at once while the lab still needs them to tear down (the binders answer CNI DEL).
/// Here only this relay gets it, and turns it into one SIGTERM to the lab, which tears down in
/// order. `kuryr-lab down` signals the lab itself (its pid is in the state file).
async fn relay() -> Result<ExitCode> {
    use tokio::signal::unix::{SignalKind, signal};
    let exe = std::env::current_exe().context("finding kuryr-lab's own path")?;
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    args.push("--inner".into());
    let mut child = tokio::process::Command::new(exe)
        .args(args)
        .process_group(0)
        .stdin(std::process::Stdio::null())
        .spawn()
        .context("starting the lab process")?;
    let pid = child.id().context("the lab process exited at once")?;
    let (mut term, mut int, mut hup) =
        (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?, signal(SignalKind::hangup())?);
    let mut forwarded = false;
    loop {
        let why = tokio::select! {
            status = child.wait() => {
                let code = status?.code().unwrap_or(1);
                return Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)));
            }
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            _ = hup.recv() => "SIGHUP",
        };
        if !forwarded {
            println!("\n({why}: asking the lab to tear down; it takes a few seconds)");
            let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
            forwarded = true;
        }
    }
}

async fn up(files: &Files, nodes: usize, ipv4_only: bool, ready_timeout: Duration) -> Result<ExitCode> {
    let t0 = Instant::now();
    println!("kuryr-lab: a {nodes}-node Kuryr cluster (embedded IPAM) on this machine\n");
    std::fs::create_dir_all(&files.dir).with_context(|| format!("creating {}", files.dir.display()))?;
    if let Some(old) = files.read()? {
        if old.process().alive() {
            bail!(
                "a lab is already running (pid {}, {}).\n  kubeconfig: {}\n  stop it first with `make lab-down` (or `kuryr-lab down`)",
                old.pid,
                old.phase,
                old.kubeconfig.as_deref().unwrap_or(Path::new("-")).display()
            );
        }
        println!("A previous lab (pid {}) did not shut down cleanly; removing what it left:", old.pid);
        report_cleanup(&old.manifest);
        files.remove();
    }

    println!("Prerequisites:");
    if !prerequisites().await? {
        return Ok(ExitCode::FAILURE);
    }
    init_log(&files.log())?;

    // Signals are watched from the start: an interrupted start-up still cleans up (by drop).
    let (stop_tx, mut stop) = watch::channel(None::<&'static str>);
    tokio::spawn(async move {
        let name = wait_signal().await;
        let _ = stop_tx.send(Some(name));
    });

    let exe = std::env::current_exe().context("finding kuryr-lab's own path")?;
    let state = Arc::new(std::sync::Mutex::new(LabState {
        pid: std::process::id(),
        exe,
        phase: "starting".into(),
        kubeconfig: None,
        manifest: Manifest::default(),
    }));
    let save = {
        let (files, state) = (files.clone(), state.clone());
        move |f: &dyn Fn(&mut LabState)| {
            let mut s = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            f(&mut s);
            if let Err(e) = files.write(&s) {
                eprintln!("kuryr-lab: writing the state file: {e:#}");
            }
        }
    };
    save(&|_| {});

    let cidrs: Vec<String> =
        if ipv4_only { vec!["10.244.0.0/16".into()] } else { vec!["10.244.0.0/16".into(), "fd00:10:244::/56".into()] };
    let progress = {
        let save = save.clone();
        Arc::new(move |s: &Step<'_>| {
            println!("{} ✓ {} ({})", stamp(t0), s.what, ms(s.took));
            let manifest = s.manifest.clone();
            save(&|st| st.manifest = manifest.clone());
        })
    };
    let opts = ClusterOptions {
        nodes,
        network_cidrs: cidrs,
        underlay_id: 1,
        run_containers: true,
        services: true,
        service_log: "info".into(),
        progress: Some(progress),
        ..ClusterOptions::default()
    };
    println!("\nStarting the cluster:");
    let cluster = tokio::select! {
        c = Cluster::start(opts) => c.context("starting the cluster")?,
        _ = stop.wait_for(Option::is_some) => {
            println!("{} interrupted during start-up; cleaning up", stamp(t0));
            let manifest = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).manifest.clone();
            report_cleanup(&manifest);
            files.remove();
            return Ok(ExitCode::FAILURE);
        }
    };
    let cluster_up = t0.elapsed();
    std::fs::copy(cluster.kubeconfig(), files.kubeconfig()).context("copying the kubeconfig")?;
    let manifest = cluster.manifest().clone();
    let kubeconfig = files.kubeconfig();
    save(&|s| {
        s.manifest = manifest.clone();
        s.kubeconfig = Some(kubeconfig.clone());
    });

    let outcome = tokio::select! {
        r = workload(&cluster, t0, ready_timeout) => Some(r),
        _ = stop.wait_for(Option::is_some) => None,
    };
    match outcome {
        Some(Ok(())) => {}
        Some(Err(e)) => {
            println!("\n{} ✗ the sample workload is not healthy: {e:#}\n(the lab stays up for inspection)", stamp(t0))
        }
        None => return teardown(cluster, files, &save, t0, "signal").await,
    }
    print_usage(&cluster, files);
    println!(
        "\nThe lab is up: cluster in {:.1} s, everything in {:.1} s. Stop it with `make lab-down` (or Ctrl-C here).",
        cluster_up.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    save(&|s| s.phase = "up".into());
    let _ = stop.wait_for(Option::is_some).await;
    let why = (*stop.borrow()).unwrap_or("signal");
    teardown(cluster, files, &save, t0, why).await
}

async fn wait_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) =
        (signal(SignalKind::terminate()), signal(SignalKind::interrupt()), signal(SignalKind::hangup()))
    else {
        // Without handlers the default actions apply; never resolve.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
        _ = hup.recv() => "SIGHUP",
    }
}

async fn teardown(
    cluster: Cluster,
    files: &Files,
    save: &impl Fn(&dyn Fn(&mut LabState)),
    t0: Instant,
    why: &str,
) -> Result<ExitCode> {
    println!("\n{} {why}: tearing the lab down", stamp(t0));
    save(&|s| s.phase = "stopping".into());
    let manifest = cluster.manifest().clone();
    let result = cluster.shutdown().await;
    match &result {
        Ok(took) => println!("{} ✓ cluster stopped in {:.1} s", stamp(t0), took.as_secs_f64()),
        Err(e) => println!("{} ✗ {e:#}", stamp(t0)),
    }
    let left = manifest.leftovers();
    if left.is_empty() {
        println!("{} ✓ nothing left behind (processes, network namespaces, directories)", stamp(t0));
        files.remove();
        Ok(if result.is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
    } else {
        println!("{} ✗ left behind: {}; `make lab-down` removes it", stamp(t0), left.join(", "));
        Ok(ExitCode::FAILURE)
    }
}

/// Removes what `manifest` lists and says what happened.
fn report_cleanup(manifest: &Manifest) {
    let (done, failed) = manifest.cleanup();
    for d in &done {
        println!("  ✓ {d}");
    }
    for f in &failed {
        println!("  ✗ {f}");
    }
}

fn init_log(path: &Path) -> Result<()> {
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let filter = tracing_subscriber::EnvFilter::try_from_env("KURYR_LAB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn,tower=warn,hyper=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_writer(std::sync::Mutex::new(file)).init();
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// prerequisites
// ---------------------------------------------------------------------------------------------

/// Prints one line per prerequisite; false if any is missing (each with what to do about it).
/// Missing Go tools are built first (tests/env/tools.sh).
async fn prerequisites() -> Result<bool> {
    if !preflight::tools_built() {
        println!("  … building the test tools with tests/env/tools.sh (a cold build takes ~16 min)");
        let status = tokio::process::Command::new("bash").arg(env_script("tools.sh")).status().await?;
        if !status.success() {
            println!("  ✗ tests/env/tools.sh failed ({status})");
        }
    }
    let checks = preflight::checks();
    for c in &checks {
        match c.ok {
            true => println!("  ✓ {}", c.what),
            false => println!("  ✗ {}: {}", c.what, c.hint),
        }
    }
    Ok(checks.iter().all(|c| c.ok))
}

// ---------------------------------------------------------------------------------------------
// the sample workload
// ---------------------------------------------------------------------------------------------

/// One sample pod as the lab reports it.
#[derive(Debug)]
struct Row {
    pod: String,
    node: String,
    phase: String,
    v4: Option<IpAddr>,
    v6: Option<IpAddr>,
    record: Option<PodRecord>,
}

async fn workload(cluster: &Cluster, t0: Instant, ready_timeout: Duration) -> Result<()> {
    println!("\nSample workload (deploy/lab/):");
    let t = Instant::now();
    cluster.kube().apply_file(&repo_root().join("deploy/lab")).await.context("kubectl apply -f deploy/lab/")?;
    let api: Api<Pod> = Api::namespaced(cluster.client(), DEMO_NAMESPACE);
    let want = api.list(&ListParams::default()).await?.items.len();
    println!("{} ✓ applied: namespace {DEMO_NAMESPACE}, {want} pods ({})", stamp(t0), ms(t.elapsed()));

    let deadline = Instant::now() + ready_timeout;
    let mut last = usize::MAX;
    let pods = loop {
        let pods = api.list(&ListParams::default()).await?.items;
        let running = pods.iter().filter(|p| is_running(p)).count();
        if running != last {
            println!("{}   {running}/{} pods Running", stamp(t0), pods.len());
            last = running;
        }
        if running == pods.len() && running > 0 {
            break pods;
        }
        if Instant::now() > deadline {
            print_rows(&rows(cluster, &pods));
            bail!("only {running}/{} pods Running after {ready_timeout:?}", pods.len());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!("{} ✓ all {} pods Running ({})", stamp(t0), pods.len(), ms(t.elapsed()));
    let rows = rows(cluster, &pods);
    print_rows(&rows);

    println!("\nReachability (ping from each pod's network namespace to every other pod):");
    let endpoints: Vec<PodEndpoint> = rows
        .iter()
        .filter_map(|r| {
            let rec = r.record.as_ref()?;
            Some(PodEndpoint {
                pod: r.pod.clone(),
                node: r.node.clone(),
                netns: rec.netns.clone()?,
                ips: rec.ips.clone(),
            })
        })
        .collect();
    let t = Instant::now();
    let pings = reach::ping_all(&endpoints).await;
    print!("{}", reach::matrix(&endpoints, &pings));
    let summary = Summary::of(&pings);
    println!(
        "{} {} {summary} ({} pings in {})",
        stamp(t0),
        if summary.all_ok() { "✓" } else { "✗" },
        pings.len(),
        ms(t.elapsed())
    );
    let retried: Vec<_> = pings.iter().filter(|p| p.first_failure.is_some()).collect();
    if let Some(p) = retried.first() {
        println!(
            "  {} ping(s) answered only on a second try; e.g. {} → {} ({}) first said: {}",
            retried.len(),
            endpoints[p.from].pod,
            endpoints[p.to].pod,
            p.ip,
            p.first_failure.as_deref().unwrap_or_default().trim().replace('\n', " | ")
        );
    }
    if let Some(p) = pings.iter().find(|p| !p.ok) {
        bail!("{} cannot reach {} at {}: {}", endpoints[p.from].pod, endpoints[p.to].pod, p.ip, p.output.trim());
    }
    services(cluster, &endpoints, t0).await
}

/// Connections per Service port and client in the Services table.
const CONNECTIONS: usize = 24;
/// Bound on a Service's endpoints being ready and answering from every node.
const SERVICE_TIMEOUT: Duration = Duration::from_secs(30);

/// The Services table: for each Service of the sample workload, its ready endpoints (from the
/// EndpointSlices the controller wrote) and, from a pod on each node, who answered connections to
/// its ClusterIP and port. Every ready backend must answer every client.
async fn services(cluster: &Cluster, endpoints: &[PodEndpoint], t0: Instant) -> Result<()> {
    let client = cluster.client();
    let list = Api::<Service>::namespaced(client.clone(), DEMO_NAMESPACE).list(&ListParams::default()).await?.items;
    println!(
        "\nServices (TCP connections from a pod on each node to the ClusterIP; the web pods' container is\n\
         busybox `nc -ll -p 8080 -e /bin/hostname`, which answers with the pod's name):"
    );
    println!(
        "\n  {:<10} {:<18} {:<22} {:<16} ANSWERED BY ({CONNECTIONS} connections)",
        "SERVICE", "CLUSTER-IP:PORT", "READY ENDPOINTS", "FROM"
    );
    let t = Instant::now();
    let mut failures = Vec::new();
    for s in &list {
        let name = s.metadata.name.clone().unwrap_or_default();
        let (vip, ports) = svc::cluster_ip(&client, DEMO_NAMESPACE, &name).await?;
        // Every Running pod the selector matches should be a ready endpoint.
        let selector = s.spec.as_ref().and_then(|sp| sp.selector.clone()).unwrap_or_default();
        let selected = Api::<Pod>::namespaced(client.clone(), DEMO_NAMESPACE)
            .list(
                &ListParams::default()
                    .labels(&selector.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")),
            )
            .await?
            .items
            .len();
        let ready = wait_until_ready(&client, &name, selected).await;
        let mut names: Vec<String> = ready.iter().map(|(_, pod)| pod.clone()).collect();
        names.dedup();
        let want: Vec<&str> = names.iter().map(String::as_str).collect();
        for port in ports {
            for (i, node) in cluster.nodes().iter().enumerate() {
                // A client that is not itself a backend, on this node.
                let from = endpoints
                    .iter()
                    .filter(|e| e.node == node.name)
                    .find(|e| !want.contains(&short(&e.pod)))
                    .or_else(|| endpoints.iter().find(|e| e.node == node.name));
                let Some(from) = from else { continue };
                let got = svc::wait_answers(&from.netns, vip, port, CONNECTIONS, &want, SERVICE_TIMEOUT).await;
                let (ok, shown) = match &got {
                    Ok(a) => (true, svc::describe(a)),
                    Err(e) => (false, format!("{e:#}")),
                };
                let (svc_col, ip_col, eps_col) = if i == 0 {
                    (format!("{DEMO_NAMESPACE}/{name}"), format!("{vip}:{port}"), want.join(", "))
                } else {
                    Default::default()
                };
                println!(
                    "  {svc_col:<10} {ip_col:<18} {eps_col:<22} {:<16} {} {shown}",
                    format!("{} ({})", short(&from.pod), from.node),
                    if ok { "✓" } else { "✗" }
                );
                if !ok {
                    failures.push(format!("{name} from {}: {shown}", short(&from.pod)));
                }
            }
        }
    }
    if !failures.is_empty() {
        bail!("Services not answered by all their backends: {}", failures.join("; "));
    }
    println!(
        "{} ✓ every Service answered by all its ready backends, from pods on every node ({})",
        stamp(t0),
        ms(t.elapsed())
    );
    Ok(())
}

/// The Service's ready endpoints once there are `want` of them (or whatever there is after
/// [`SERVICE_TIMEOUT`]).
async fn wait_until_ready(client: &kube::Client, name: &str, want: usize) -> Vec<(IpAddr, String)> {
    let deadline = Instant::now() + SERVICE_TIMEOUT;
    loop {
        let ready = svc::ready_endpoints(client, DEMO_NAMESPACE, name).await.unwrap_or_default();
        let pods = ready.iter().map(|(_, p)| p).collect::<std::collections::BTreeSet<_>>().len();
        if pods >= want || Instant::now() > deadline {
            let mut ready = ready;
            ready.sort_by(|a, b| (&a.1, a.0).cmp(&(&b.1, b.0)));
            return ready;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `demo/web-0` → `web-0`.
fn short(pod: &str) -> &str {
    pod.rsplit('/').next().unwrap_or(pod)
}

fn is_running(p: &Pod) -> bool {
    p.status.as_ref().is_some_and(|s| s.phase.as_deref() == Some("Running") && s.pod_ip.is_some())
}

fn rows(cluster: &Cluster, pods: &[Pod]) -> Vec<Row> {
    let mut rows: Vec<Row> = pods
        .iter()
        .map(|p| {
            let (ns, name) =
                (p.metadata.namespace.clone().unwrap_or_default(), p.metadata.name.clone().unwrap_or_default());
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
            let ips: Vec<IpAddr> =
                p.status.iter().flat_map(|s| s.pod_ips.iter().flatten()).filter_map(|i| i.ip.parse().ok()).collect();
            let record = cluster.kubelets().iter().find(|k| k.node() == node).and_then(|k| k.pod(&ns, &name));
            Row {
                pod: format!("{ns}/{name}"),
                node,
                phase: p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_else(|| "Pending".into()),
                v4: ips.iter().find(|i| i.is_ipv4()).copied(),
                v6: ips.iter().find(|i| i.is_ipv6()).copied(),
                record,
            }
        })
        .collect();
    rows.sort_by(|a, b| (&a.node, &a.pod).cmp(&(&b.node, &b.pod)));
    rows
}

fn print_rows(rows: &[Row]) {
    println!(
        "\n  {:<14} {:<8} {:<8} {:<14} {:<22} {:>15} {:>14} {:>8}",
        "POD", "NODE", "PHASE", "IPv4", "IPv6", "NETWORK-READY", "RunPodSandbox", "ATTEMPTS"
    );
    let show = |ip: Option<IpAddr>| ip.map_or_else(|| "-".to_string(), |i| i.to_string());
    let mut ready = Vec::new();
    for r in rows {
        let rec = r.record.as_ref();
        let net = rec.and_then(|x| x.network_ready);
        ready.extend(net);
        println!(
            "  {:<14} {:<8} {:<8} {:<14} {:<22} {:>15} {:>14} {:>8}",
            r.pod,
            r.node,
            r.phase,
            show(r.v4),
            show(r.v6),
            net.map_or_else(|| "-".into(), ms),
            rec.and_then(|x| x.sandbox_call).map_or_else(|| "-".into(), ms),
            rec.map_or(0, |x| x.attempts),
        );
        if let Some(e) = rec.and_then(|x| x.last_error.as_ref()) {
            println!("      last error: {e}");
        }
    }
    ready.sort();
    if let (Some(min), Some(max)) = (ready.first(), ready.last()) {
        println!(
            "  network-ready (kubelet first saw the pod → RunPodSandbox returned): min {}, median {}, max {}",
            ms(*min),
            ms(ready[ready.len() / 2]),
            ms(*max)
        );
    }
}

fn print_usage(cluster: &Cluster, files: &Files) {
    let g = tool_path("grpcurl").map_or_else(|_| "grpcurl".to_string(), |p| p.display().to_string());
    let (w, a) = (cluster.watcher(), cluster.allocator());
    let lines = [
        "Try it:".to_string(),
        format!("  export KUBECONFIG={}", files.kubeconfig().display()),
        "  kubectl get nodes -o wide".into(),
        "  kubectl get pods -o wide -A".into(),
        "  kubectl get podnetworks,addressblocks,podvifs -A".into(),
        "  kubectl -n demo describe pod web-0".into(),
        "  # a new pod (no scheduler here: name the node), and a deleted one (sandbox torn down, address released)"
            .into(),
        r#"  kubectl -n demo run extra --image=busybox --overrides='{"spec":{"nodeName":"node-2"}}' -- sleep 1000000"#
            .into(),
        "  kubectl -n demo delete pod web-2".into(),
        String::new(),
        "  # the services over gRPC (health, reflection): grpcurl needs no proto files".into(),
        format!("  G={g}"),
        format!("  $G -plaintext {} list    # kuryr-watcher; also unix://{}", w.tcp, w.socket.display()),
        format!("  $G -plaintext unix://{} list    # kuryr-vif-allocator; also {}", a.socket.display(), a.tcp),
        "  # the APIs need a ServiceAccount token for the kuryr audience, of the account whose role it is".into(),
        r#"  BINDER="authorization: Bearer $(kubectl -n kuryr-system create token kuryr-binder --audience kuryr)""#
            .into(),
        format!(
            r#"  $G -plaintext -H "$BINDER" -max-time 2 -d '{{"node_name":"node-1"}}' unix://{} kuryr.allocator.v1.VifAllocator/WatchVifs"#,
            a.socket.display()
        ),
    ];
    let mut lines = lines.to_vec();
    if let Some(l) = cluster.lbaas() {
        lines.extend([
            String::new(),
            "  # Services: EndpointSlices from kube-controller-manager, load balancer specs from kuryr-lbaas".into(),
            "  kubectl -n demo get svc,endpointslices,slb -o wide".into(),
            "  kubectl -n demo delete pod web-1    # its address leaves every node's rules".into(),
            format!(
                r#"  $G -plaintext -H "$BINDER" -max-time 2 -d '{{"subscriber":"me"}}' {} kuryr.lbaas.v1.LoadBalancers/WatchLoadBalancers"#,
                l.tcp
            ),
        ]);
        if let Some((n, e)) = cluster.nodes().first().zip(cluster.kubelets().first())
            && let Some(netns) = e.pods().into_iter().find_map(|p| p.netns)
        {
            lines.push(format!(
                "  nsenter --net={} busybox nc -w 2 $(kubectl -n demo get svc web -o jsonpath='{{.spec.clusterIP}}') 80    # from a pod on {}",
                netns.display(),
                n.name
            ));
        }
    }
    println!("\n{}", lines.join("\n"));
    for n in cluster.nodes() {
        println!("  $G -plaintext unix://{} list    # kuryr-binder on {}", n.node.binder.socket.display(), n.name);
    }
    println!("  curl -s {}/metrics | grep grpc_server_handled_total    # the allocator's metrics", a.metrics);
    println!("\n  # inside a node (bridge kuryr0, routes to the other nodes' pod blocks) and a pod");
    for n in cluster.nodes() {
        println!("  nsenter --net={} ip route    # {}", n.node.netns_path().display(), n.name);
    }
    if cluster.lbaas().is_some() {
        for n in cluster.nodes() {
            println!(
                "  nsenter --net={} nft list table inet kuryr    # Service rules on {}",
                n.node.netns_path().display(),
                n.name
            );
        }
    }
    if let Some((p, ns)) =
        cluster.kubelets().first().and_then(|k| k.pods().into_iter().find_map(|p| p.netns.clone().map(|ns| (p, ns))))
    {
        println!("  nsenter --net={} ip addr    # pod {}/{}", ns.display(), p.namespace, p.name);
    }
    println!(
        "\n  Logs: {} (services, kube-controller-manager), {} (kubelets)",
        cluster.dir().display(),
        files.log().display()
    );
}

// ---------------------------------------------------------------------------------------------
// down, status
// ---------------------------------------------------------------------------------------------

async fn down(files: &Files, timeout: Duration) -> Result<ExitCode> {
    let Some(state) = files.read()? else {
        println!("No lab is running ({} does not exist).", files.state().display());
        return Ok(ExitCode::SUCCESS);
    };
    let lab = state.process();
    let t0 = Instant::now();
    if lab.alive() {
        println!("Stopping the lab (pid {}, {}); it tears itself down…", state.pid, state.phase);
        let status = std::process::Command::new("kill").args(["-TERM", &state.pid.to_string()]).status()?;
        anyhow::ensure!(status.success(), "kill -TERM {} failed", state.pid);
        let mut next_note = Duration::from_secs(10);
        while lab.alive() && t0.elapsed() < timeout {
            if t0.elapsed() > next_note {
                println!("  still tearing down after {:.0} s…", t0.elapsed().as_secs_f64());
                next_note += Duration::from_secs(10);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if lab.alive() {
            println!("  the lab did not finish within {timeout:?}; killing it and cleaning up after it");
            let _ = std::process::Command::new("kill").args(["-KILL", &state.pid.to_string()]).status();
            tokio::time::sleep(Duration::from_millis(500)).await;
        } else {
            println!("  the lab exited after {:.1} s", t0.elapsed().as_secs_f64());
        }
    } else {
        println!("The lab process (pid {}) is gone without having cleaned up; removing what it left:", state.pid);
    }
    // A lab that tore down cleanly removed its state file; otherwise clean up from it.
    let state = match files.read()? {
        Some(latest) => {
            report_cleanup(&latest.manifest);
            files.remove();
            latest
        }
        None => state,
    };
    let left = state.manifest.leftovers();
    if left.is_empty() {
        println!("✓ Nothing of the lab is left (processes, network namespaces, directories).");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("✗ Still present: {}", left.join(", "));
        Ok(ExitCode::FAILURE)
    }
}

async fn status(files: &Files) -> Result<ExitCode> {
    match files.read()? {
        None => println!("No lab is running."),
        Some(s) if s.process().alive() => {
            println!("A lab is {} (pid {}).", s.phase, s.pid);
            if let Some(kc) = &s.kubeconfig {
                println!("  kubectl --kubeconfig {} get pods -o wide -A", kc.display());
            }
            for n in &s.manifest.nodes {
                println!("  node {}: netns {}", n.name, n.netns.as_deref().unwrap_or("-"));
            }
        }
        Some(s) => println!("A lab (pid {}) died without cleaning up; run `make lab-down`.", s.pid),
    }
    Ok(ExitCode::SUCCESS)
}
