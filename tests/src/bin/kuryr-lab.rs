//! `kuryr-lab`: a Kubernetes cluster of real nodes on this machine with kuryr as its network —
//! `make lab` and `make lab-down`.
//!
//! `kuryr-lab up` checks the prerequisites, builds (or finds cached) the images, brings up a
//! [`RealCluster`] (each node a network and mount namespace running containerd and a real kubelet;
//! kube-apiserver, kube-controller-manager and kube-scheduler on the first node; no kube-proxy),
//! installs kuryr on it as a user would (`kubectl apply -k deploy/overlays/embedded`: the binder
//! DaemonSet, the watcher, allocator and lbaas Deployments) and the cluster DNS (CoreDNS pods on
//! kuryr's network behind a kuryr Service), applies the sample workload of `deploy/lab/` (the
//! scheduler places it), waits for its pods, prints their addresses and how long each took,
//! pings every pod from every other one, connects to each Service's ClusterIP from a pod on every
//! node and shows which backends answered, prints how to inspect everything, and stays up until
//! it gets SIGTERM/SIGINT (`kuryr-lab down` sends SIGTERM and waits). Its state file
//! (`.lab/state.json` in the repository, or `--state-dir`) names the cluster's directory, so
//! `kuryr-lab down` can also clean up after a lab that crashed (the cluster's own watchdog does
//! it too, once the lab process is gone).
#![allow(clippy::print_stdout)] // a command whose output is the point

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, ListParams};
use kube::runtime::watcher::{self, Event, watcher};
use kuryr_tests::cluster::reach::{self, PodEndpoint, Summary};
use kuryr_tests::cluster::{preflight, svc};
use kuryr_tests::conformance;
use kuryr_tests::realcluster::{RealCluster, RealClusterOptions};
use kuryr_tests::services::{bin_path, tool_path};
use kuryr_tests::util::{env_script, repo_root};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// The namespace of the sample workload (`deploy/lab/demo.yaml`).
const DEMO_NAMESPACE: &str = "demo";
/// The lab's cluster id: its namespaces are `kr1-n1`, `kr1-n2`, ..., `kr1-ul`; the underlay
/// `172.28.1.0/24`.
const LAB_CLUSTER_ID: u8 = 1;

#[derive(Debug, Parser)]
#[command(name = "kuryr-lab", about = "A Kuryr cluster on this machine: `up` (stays up), `down`, `status`.")]
struct Cli {
    /// Where the lab keeps its state file, kubeconfig, cluster state and log.
    #[arg(long, env = "KURYR_LAB_DIR", global = true)]
    state_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Bring the lab up, deploy the sample workload, and stay up until `kuryr-lab down` or Ctrl-C.
    Up {
        /// Nodes to run (the first one is also the control plane).
        #[arg(long, default_value_t = 2)]
        nodes: usize,
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

/// The state file: who runs the lab and where its cluster lives.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LabState {
    pid: u32,
    exe: PathBuf,
    /// starting, up, stopping.
    phase: String,
    kubeconfig: Option<PathBuf>,
    /// The cluster's state directory (`tests/env/cluster/down.sh` takes it).
    cluster_dir: PathBuf,
}

impl LabState {
    /// Whether the lab process is still the one recorded (its pid alive, running our binary).
    fn alive(&self) -> bool {
        std::fs::read_link(format!("/proc/{}/exe", self.pid)).is_ok_and(|exe| exe.file_name() == self.exe.file_name())
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
    fn cluster(&self) -> PathBuf {
        self.dir.join("cluster")
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
            Command::Up { nodes, ready_timeout, inner: true } => {
                up(&files, nodes, Duration::from_secs(ready_timeout)).await
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

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

// ---------------------------------------------------------------------------------------------
// up
// ---------------------------------------------------------------------------------------------

/// `up` as typed: runs the lab as a child in a process group of its own and relays. A terminal's
/// Ctrl-C goes to its whole foreground process group; were the cluster's processes in it, they
/// would all stop at once. Here only this relay gets it, and turns it into one SIGTERM to the lab,
/// which tears down in order. `kuryr-lab down` signals the lab itself (its pid is in the state
/// file).
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

async fn up(files: &Files, nodes: usize, ready_timeout: Duration) -> Result<ExitCode> {
    let t0 = Instant::now();
    println!(
        "kuryr-lab: a {nodes}-node Kubernetes cluster of real kubelets with kuryr (embedded backend) as its network\n"
    );
    std::fs::create_dir_all(&files.dir).with_context(|| format!("creating {}", files.dir.display()))?;
    if let Some(old) = files.read()? {
        if old.alive() {
            bail!(
                "a lab is already running (pid {}, {}).\n  kubeconfig: {}\n  stop it first with `make lab-down` (or `kuryr-lab down`)",
                old.pid,
                old.phase,
                old.kubeconfig.as_deref().unwrap_or(Path::new("-")).display()
            );
        }
        println!("A previous lab (pid {}) did not shut down cleanly; removing what it left:", old.pid);
        cleanup(&old.cluster_dir).await;
        files.remove();
    }
    // A cluster directory without a state file: a start that died before writing it.
    if files.cluster().join("partial.env").exists() {
        cleanup(&files.cluster()).await;
    }

    println!("Prerequisites:");
    if !prerequisites().await? {
        return Ok(ExitCode::FAILURE);
    }
    init_log(&files.log())?;

    // Signals are watched from the start: an interrupted start-up still cleans up.
    let (stop_tx, mut stop) = watch::channel(None::<&'static str>);
    tokio::spawn(async move {
        let name = wait_signal().await;
        let _ = stop_tx.send(Some(name));
    });

    let exe = std::env::current_exe().context("finding kuryr-lab's own path")?;
    let mut state = LabState {
        pid: std::process::id(),
        exe,
        phase: "starting".into(),
        kubeconfig: None,
        cluster_dir: files.cluster(),
    };
    files.write(&state)?;

    println!("\nStarting the cluster:");
    let started = tokio::select! {
        c = start(files, nodes, t0) => Some(c),
        _ = stop.wait_for(Option::is_some) => None,
    };
    let cluster = match started {
        Some(Ok(c)) => c,
        Some(Err(e)) => {
            println!("{} ✗ {e:#}", stamp(t0));
            cleanup(&files.cluster()).await;
            files.remove();
            return Ok(ExitCode::FAILURE);
        }
        None => {
            println!("{} interrupted during start-up; cleaning up", stamp(t0));
            cleanup(&files.cluster()).await;
            files.remove();
            return Ok(ExitCode::FAILURE);
        }
    };
    let cluster_up = t0.elapsed();
    std::fs::copy(cluster.kubeconfig(), files.kubeconfig()).context("copying the kubeconfig")?;
    state.kubeconfig = Some(files.kubeconfig());
    files.write(&state)?;

    let outcome = tokio::select! {
        r = workload(&cluster, t0, ready_timeout) => Some(r),
        _ = stop.wait_for(Option::is_some) => None,
    };
    match outcome {
        Some(Ok(())) => {}
        Some(Err(e)) => {
            println!("\n{} ✗ the sample workload is not healthy: {e:#}\n(the lab stays up for inspection)", stamp(t0))
        }
        None => return teardown(cluster, files, &mut state, t0, "signal").await,
    }
    print_usage(&cluster, files).await;
    println!(
        "\nThe lab is up: cluster with kuryr in {}, everything in {}. Stop it with `make lab-down` (or Ctrl-C here).",
        secs(cluster_up),
        secs(t0.elapsed())
    );
    state.phase = "up".into();
    files.write(&state)?;
    let _ = stop.wait_for(Option::is_some).await;
    let why = (*stop.borrow()).unwrap_or("signal");
    teardown(cluster, files, &mut state, t0, why).await
}

/// Images, nodes, kuryr, DNS: each step reported as it finishes.
async fn start(files: &Files, nodes: usize, t0: Instant) -> Result<RealCluster> {
    let t = Instant::now();
    let bin_dir = bin_path("kuryr-binder")?.parent().map(Path::to_path_buf).context("the binaries' directory")?;
    let images = conformance::images(&bin_dir, &repo_root().join("target/kuryr-images")).await?;
    println!(
        "{} ✓ images: kuryr-rs from {}, CoreDNS, pause, busybox ({})",
        stamp(t0),
        bin_dir.display(),
        secs(t.elapsed())
    );

    let t = Instant::now();
    let cluster = RealCluster::start(RealClusterOptions {
        nodes,
        id: LAB_CLUSTER_ID,
        images: images.tars.clone(),
        sandbox_image: images.pause.clone(),
        state_dir: Some(files.cluster()),
        ..RealClusterOptions::default()
    })
    .await?;
    for n in cluster.nodes() {
        println!("{}   {}: netns {}, InternalIP {}, {}", stamp(t0), n.name, n.netns, n.ip4, n.ip6);
    }
    println!(
        "{} ✓ {nodes} nodes registered (kubelet + containerd each; API server, controller manager, scheduler on {}) ({})",
        stamp(t0),
        cluster.nodes()[0].name,
        secs(t.elapsed())
    );

    let t = Instant::now();
    cluster.install_kuryr("embedded", "").await?;
    println!(
        "{} ✓ kuryr installed (kubectl apply -k deploy/overlays/embedded): binder DaemonSet, watcher, allocator and lbaas Deployments rolled out, every node Ready ({})",
        stamp(t0),
        secs(t.elapsed())
    );
    let t = Instant::now();
    cluster.install_dns(&images.coredns).await?;
    println!("{} ✓ cluster DNS: CoreDNS pods on kuryr's network, Service kube-dns ({})", stamp(t0), secs(t.elapsed()));
    Ok(cluster)
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
    cluster: RealCluster,
    files: &Files,
    state: &mut LabState,
    t0: Instant,
    why: &str,
) -> Result<ExitCode> {
    println!("\n{} {why}: tearing the lab down", stamp(t0));
    state.phase = "stopping".into();
    let _ = files.write(state);
    let prefix = cluster.nodes().first().map(|n| n.netns.clone()).unwrap_or_default();
    let t = Instant::now();
    let result = cluster.shutdown().await;
    match &result {
        Ok(()) => println!("{} ✓ cluster stopped in {}", stamp(t0), secs(t.elapsed())),
        Err(e) => println!("{} ✗ {e:#}", stamp(t0)),
    }
    let left = leftovers(&prefix);
    if left.is_empty() && result.is_ok() {
        println!("{} ✓ nothing left behind (processes, network and mount namespaces, cgroups)", stamp(t0));
        files.remove();
        Ok(ExitCode::SUCCESS)
    } else {
        println!("{} ✗ left behind: {}; `make lab-down` removes it", stamp(t0), left.join(", "));
        Ok(ExitCode::FAILURE)
    }
}

/// Network namespaces of the lab's cluster still present (`kr1-...`).
fn leftovers(first_netns: &str) -> Vec<String> {
    let prefix = match first_netns.rsplit_once('-') {
        Some((p, _)) => format!("{p}-"),
        None => format!("kr{LAB_CLUSTER_ID}-"),
    };
    std::fs::read_dir("/var/run/netns")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .map(|n| format!("netns {n}"))
                .collect()
        })
        .unwrap_or_default()
}

/// Runs the cluster's `down.sh` on a lab directory and says what happened.
async fn cleanup(cluster_dir: &Path) {
    let out = tokio::process::Command::new("bash")
        .arg(env_script("cluster/down.sh"))
        .arg(cluster_dir)
        .arg("--purge")
        .output()
        .await;
    match out {
        Ok(o) if o.status.success() => println!("  ✓ cluster {} removed", cluster_dir.display()),
        Ok(o) => {
            println!("  ✗ cluster/down.sh {}: {}", cluster_dir.display(), String::from_utf8_lossy(&o.stderr).trim())
        }
        Err(e) => println!("  ✗ running cluster/down.sh: {e}"),
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
        println!("  … building the test tools with tests/env/tools.sh (a cold build takes ~20 min)");
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
    /// From `kubectl apply` to the lab's watch seeing it Running.
    running: Option<Duration>,
    /// The binder's own time for the pod's CNI ADD (its "ADD done" log line).
    cni_add_ms: Option<f64>,
}

async fn workload(cluster: &RealCluster, t0: Instant, ready_timeout: Duration) -> Result<()> {
    println!("\nSample workload (deploy/lab/, placed by kube-scheduler):");
    let api: Api<Pod> = Api::namespaced(cluster.client(), DEMO_NAMESPACE);
    // Running sightings, recorded from before the apply.
    let seen: std::sync::Arc<std::sync::Mutex<HashMap<String, Instant>>> = std::sync::Arc::default();
    let watch = {
        let (api, seen) = (api.clone(), seen.clone());
        tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default()).boxed();
            while let Some(ev) = events.next().await {
                let now = Instant::now();
                if let Ok(Event::Apply(p) | Event::InitApply(p)) = ev
                    && is_running(&p)
                    && let Some(name) = p.metadata.name
                {
                    seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(name).or_insert(now);
                }
            }
        })
    };
    let t = Instant::now();
    let demo = repo_root().join("deploy/lab");
    cluster
        .kubectl(&["apply", "-f", demo.to_str().context("path is not UTF-8")?])
        .await
        .context("kubectl apply -f deploy/lab/")?;
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
            watch.abort();
            print_rows(&rows(&pods, t, &HashMap::new(), &HashMap::new()));
            bail!("only {running}/{} pods Running after {ready_timeout:?}", pods.len());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    watch.abort();
    println!("{} ✓ all {} pods Running ({})", stamp(t0), pods.len(), ms(t.elapsed()));
    let seen = seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    let adds = cni_add_times(cluster).await;
    let rows = rows(&pods, t, &seen, &adds);
    print_rows(&rows);

    println!("\nReachability (ping from each pod's network namespace to every other pod):");
    let mut endpoints = Vec::new();
    for r in &rows {
        let name = short(&r.pod);
        let netns = cluster.pod_netns(DEMO_NAMESPACE, name).await?;
        endpoints.push(PodEndpoint {
            pod: r.pod.clone(),
            node: r.node.clone(),
            netns,
            ips: r.v4.into_iter().chain(r.v6).collect(),
        });
    }
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
    if let Some(p) = pings.iter().find(|p| !p.ok) {
        bail!("{} cannot reach {} at {}: {}", endpoints[p.from].pod, endpoints[p.to].pod, p.ip, p.output.trim());
    }
    services(cluster, &endpoints, t0).await
}

/// The binders' "ADD done" log lines: pod (`namespace/name`) → the ADD's duration in ms.
async fn cni_add_times(cluster: &RealCluster) -> HashMap<String, f64> {
    let logs = cluster
        .kubectl(&[
            "-n",
            "kuryr-system",
            "logs",
            "-l",
            "app.kubernetes.io/name=kuryr-binder",
            "-c",
            "kuryr-binder",
            "--tail=-1",
            "--max-log-requests=20",
        ])
        .await
        .unwrap_or_default();
    let mut out = HashMap::new();
    for line in logs.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if v["message"] == "ADD done"
            && let (Some(pod), Some(took)) = (v["pod"].as_str(), v["took_ms"].as_f64())
        {
            out.insert(pod.to_string(), took);
        }
    }
    out
}

/// Connections per Service port and client in the Services table.
const CONNECTIONS: usize = 24;
/// Bound on a Service's endpoints being ready and answering from every node.
const SERVICE_TIMEOUT: Duration = Duration::from_secs(30);

/// The Services table: for each Service of the sample workload, its ready endpoints (from the
/// EndpointSlices the controller wrote) and, from a pod on each node, who answered connections to
/// its ClusterIP and port. Every ready backend must answer every client.
async fn services(cluster: &RealCluster, endpoints: &[PodEndpoint], t0: Instant) -> Result<()> {
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

fn rows(pods: &[Pod], applied: Instant, seen: &HashMap<String, Instant>, adds: &HashMap<String, f64>) -> Vec<Row> {
    let mut rows: Vec<Row> = pods
        .iter()
        .map(|p| {
            let (ns, name) =
                (p.metadata.namespace.clone().unwrap_or_default(), p.metadata.name.clone().unwrap_or_default());
            let ips: Vec<IpAddr> =
                p.status.iter().flat_map(|s| s.pod_ips.iter().flatten()).filter_map(|i| i.ip.parse().ok()).collect();
            let key = format!("{ns}/{name}");
            Row {
                running: seen.get(&name).map(|t| t.duration_since(applied)),
                cni_add_ms: adds.get(&key).copied(),
                pod: key,
                node: p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_else(|| "-".into()),
                phase: p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_else(|| "Pending".into()),
                v4: ips.iter().find(|i| i.is_ipv4()).copied(),
                v6: ips.iter().find(|i| i.is_ipv6()).copied(),
            }
        })
        .collect();
    rows.sort_by(|a, b| (&a.node, &a.pod).cmp(&(&b.node, &b.pod)));
    rows
}

fn print_rows(rows: &[Row]) {
    println!(
        "\n  {:<14} {:<8} {:<8} {:<14} {:<22} {:>12} {:>10}",
        "POD", "NODE", "PHASE", "IPv4", "IPv6", "RUNNING", "CNI ADD"
    );
    let show = |ip: Option<IpAddr>| ip.map_or_else(|| "-".to_string(), |i| i.to_string());
    for r in rows {
        println!(
            "  {:<14} {:<8} {:<8} {:<14} {:<22} {:>12} {:>10}",
            r.pod,
            r.node,
            r.phase,
            show(r.v4),
            show(r.v6),
            r.running.map_or_else(|| "-".into(), ms),
            r.cni_add_ms.map_or_else(|| "-".into(), |v| format!("{v:.1} ms")),
        );
    }
    println!(
        "  RUNNING: from `kubectl apply` to the pod seen Running (scheduling, kubelet, sandbox, network, container);\n  \
         CNI ADD: kuryr-binder's own time for the pod's ADD (from its log)."
    );
}

async fn print_usage(cluster: &RealCluster, files: &Files) {
    let g = tool_path("grpcurl").map_or_else(|_| "grpcurl".to_string(), |p| p.display().to_string());
    let k = tool_path("kubectl").map_or_else(|_| "kubectl".to_string(), |p| p.display().to_string());
    let n1 = &cluster.nodes()[0];
    let enter = |n: &kuryr_tests::realcluster::RealNode| format!("nsenter --net=/var/run/netns/{}", n.netns);
    let mut lines = vec![
        "Try it:".to_string(),
        format!("  export KUBECONFIG={}    # through a forwarder in this lab process", files.kubeconfig().display()),
        format!("  alias kubectl={k}"),
        "  kubectl get nodes -o wide".into(),
        "  kubectl get pods -o wide -A                      # kuryr's own pods in kuryr-system, CoreDNS, the demo"
            .into(),
        "  kubectl get podnetworks,addressblocks,podvifs -A".into(),
        "  kubectl -n demo run extra --image=registry.k8s.io/e2e-test-images/busybox:1.37.0-1 -- sleep 1000000".into(),
        "  kubectl -n demo delete pod web-2                 # sandbox torn down, address released".into(),
        "  kubectl -n demo get svc,endpointslices,slb -o wide".into(),
        "  kubectl -n kuryr-system logs ds/kuryr-binder     # JSON logs, one line per CNI call".into(),
        String::new(),
        "  # the services over gRPC (health, reflection: grpcurl needs no proto files); they listen on".into(),
        "  # the nodes' addresses, inside the nodes' network namespaces".into(),
        format!("  G={g}"),
        format!("  {} $G -plaintext {}:9600 list    # kuryr-watcher", enter(n1), n1.ip4),
        "  # the APIs need a ServiceAccount token for the kuryr audience, of the account whose role it is".into(),
        r#"  BINDER="authorization: Bearer $(kubectl -n kuryr-system create token kuryr-binder --audience kuryr)""#
            .into(),
        format!(
            r#"  {} $G -plaintext -H "$BINDER" -max-time 2 -d '{{"node_name":"{}"}}' {}:9610 kuryr.allocator.v1.VifAllocator/WatchVifs"#,
            enter(n1),
            n1.name,
            n1.ip4
        ),
        format!(
            "  {} curl -s {}:9611/metrics | grep grpc_server_handled_total    # the allocator's metrics",
            enter(n1),
            n1.ip4
        ),
    ];
    for n in cluster.nodes() {
        lines.push(format!(
            "  $G -plaintext unix://{} list    # kuryr-binder on {}",
            n.path("/run/kuryr/binder.sock").display(),
            n.name
        ));
    }
    lines.push("\n  # inside a node (bridge kuryr0, routes to the other nodes' pod blocks, the Service rules)".into());
    for n in cluster.nodes() {
        lines.push(format!("  {} ip route; {} nft list table inet kuryr    # {}", enter(n), enter(n), n.name));
    }
    if let Ok(ns) = cluster.pod_netns(DEMO_NAMESPACE, "api-0").await {
        lines.push(format!("  nsenter --net={} ip addr    # pod demo/api-0", ns.display()));
    }
    lines.push(format!(
        "\n  Logs: {}/logs (kubelets, containerd, control plane), {} (this lab)",
        cluster.state_dir().display(),
        files.log().display()
    ));
    println!("\n{}", lines.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// down, status
// ---------------------------------------------------------------------------------------------

async fn down(files: &Files, timeout: Duration) -> Result<ExitCode> {
    let Some(state) = files.read()? else {
        if files.cluster().join("partial.env").exists() {
            println!("No lab process is recorded, but a cluster directory is left; removing it:");
            cleanup(&files.cluster()).await;
        } else {
            println!("No lab is running ({} does not exist).", files.state().display());
        }
        return Ok(ExitCode::SUCCESS);
    };
    let t0 = Instant::now();
    if state.alive() {
        println!("Stopping the lab (pid {}, {}); it tears itself down…", state.pid, state.phase);
        let status = std::process::Command::new("kill").args(["-TERM", &state.pid.to_string()]).status()?;
        anyhow::ensure!(status.success(), "kill -TERM {} failed", state.pid);
        let mut next_note = Duration::from_secs(10);
        while state.alive() && t0.elapsed() < timeout {
            if t0.elapsed() > next_note {
                println!("  still tearing down after {:.0} s…", t0.elapsed().as_secs_f64());
                next_note += Duration::from_secs(10);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if state.alive() {
            println!("  the lab did not finish within {timeout:?}; killing it and cleaning up after it");
            let _ = std::process::Command::new("kill").args(["-KILL", &state.pid.to_string()]).status();
            tokio::time::sleep(Duration::from_millis(500)).await;
        } else {
            println!("  the lab exited after {:.1} s", t0.elapsed().as_secs_f64());
        }
    } else {
        println!("The lab process (pid {}) is gone without having cleaned up; removing what it left:", state.pid);
    }
    // A lab that tore down cleanly removed its state file; otherwise clean up after it.
    if files.read()?.is_some() || state.cluster_dir.join("partial.env").exists() {
        cleanup(&state.cluster_dir).await;
        files.remove();
    }
    let left = leftovers("");
    if left.is_empty() {
        println!("✓ Nothing of the lab is left (processes, network and mount namespaces, cgroups).");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("✗ Still present: {}", left.join(", "));
        Ok(ExitCode::FAILURE)
    }
}

async fn status(files: &Files) -> Result<ExitCode> {
    match files.read()? {
        None => println!("No lab is running."),
        Some(s) if s.alive() => {
            println!("A lab is {} (pid {}).", s.phase, s.pid);
            if let Some(kc) = &s.kubeconfig {
                println!("  kubectl --kubeconfig {} get pods -o wide -A", kc.display());
            }
            let nodes: BTreeMap<String, String> = std::fs::read_to_string(s.cluster_dir.join("env"))
                .map(|t| kuryr_tests::util::parse_env_file(&t).into_iter().collect())
                .unwrap_or_default();
            for (k, v) in &nodes {
                if k.ends_with("_NETNS") && k.starts_with("NODE") {
                    println!("  {k}={v}");
                }
            }
        }
        Some(s) => println!("A lab (pid {}) died without cleaning up; run `make lab-down`.", s.pid),
    }
    Ok(ExitCode::SUCCESS)
}
