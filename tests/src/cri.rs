//! containerd + runc for one test, driven over CRI exactly as kubelet drives it.
//!
//! [`Containerd::start`] runs `tests/env/containerd-up.sh`: a private containerd (own root, state,
//! sockets, runc root, cgroup parent) inside its own network namespace, with the locally built
//! `pause` and `busybox` images imported. CRI calls the CNI plugins found in the instance's CNI bin
//! dir with the conflist in its conf dir, so a pod sandbox gets its network from whatever plugin a
//! test puts there — the reference `bridge`, or Kuryr's shim.
//!
//! [`Cri`] is the kubelet side: `RunPodSandbox`, `PodSandboxStatus`, `StopPodSandbox`,
//! `RemovePodSandbox`, busybox containers, `ExecSync`, plus [`Cri::exec_in_sandbox_netns`] to run a
//! host command (e.g. `ping`) inside a sandbox's network namespace.
//!
//! Teardown: [`Containerd::shutdown`] (or `Drop`, best effort) first stops and removes every
//! sandbox through CRI, so CNI DEL runs as it would on a node, then runs
//! `tests/env/containerd-down.sh`, which removes whatever is left. `KURYR_KEEP_STATE=1` keeps the
//! state directory (config, logs) for debugging.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use hyper_util::rt::TokioIo;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, ExecSyncRequest, ImageSpec, LinuxContainerConfig,
    LinuxContainerSecurityContext, LinuxPodSandboxConfig, LinuxSandboxSecurityContext, ListContainersRequest,
    ListImagesRequest, ListPodSandboxRequest, NamespaceMode, NamespaceOption, PodSandbox, PodSandboxConfig,
    PodSandboxMetadata, PodSandboxState, PodSandboxStatusRequest, RemoveContainerRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StartContainerRequest, StatusRequest, StopContainerRequest, StopPodSandboxRequest,
};
use tonic::transport::{Channel, Endpoint, Uri};

use crate::util::{parse_env_file, run_script, unique_id};

/// Deadline of one CRI call. RunPodSandbox includes the CNI ADD, and the machines running these
/// tests are small and busy, so this is generous; a hung runtime still fails the test.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long CRI may take to report RuntimeReady / NetworkReady after start or a new conflist.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Polling interval while waiting for a condition (never a fixed sleep in place of a check).
const POLL: Duration = Duration::from_millis(20);
/// Bound of the CRI clean-up that runs before containerd-down.sh.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the CNI configuration of an instance comes from.
#[derive(Debug, Clone, Default)]
pub struct ContainerdOptions {
    /// CNI plugin directory handed to CRI. `None`: a fresh private directory the test fills
    /// (`loopback` is linked in by the script either way, because CRI needs it for `lo`).
    pub cni_bin_dir: Option<PathBuf>,
    /// CNI conflist directory handed to CRI. `None`: a fresh private, empty directory; CRI picks
    /// up a conflist written there later without a restart (see [`Cri::wait_network_ready`]).
    pub cni_conf_dir: Option<PathBuf>,
}

/// Start-up timings, measured by the script and here.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timings {
    /// From spawning containerd until its socket answered `ctr version`.
    pub containerd_ready: Duration,
    /// `ctr images import` of both images.
    pub image_import: Duration,
    /// The whole of containerd-up.sh (includes the image build if the cache was stale).
    pub up_script: Duration,
    /// From the end of the script until CRI reported RuntimeReady.
    pub cri_ready: Duration,
}

/// One running containerd instance; stopped and cleaned up on [`Containerd::shutdown`] or drop.
#[derive(Debug)]
pub struct Containerd {
    teardown: Teardown,
    env: HashMap<String, String>,
    /// The temporary directory holding STATE_DIR (and the default CNI dirs).
    scratch_dir: PathBuf,
    address: PathBuf,
    cni_bin_dir: PathBuf,
    cni_conf_dir: PathBuf,
    cri: Cri,
    timings: Timings,
}

impl Containerd {
    /// Brings up a private containerd and connects a CRI client to it; waits until CRI reports
    /// RuntimeReady (NetworkReady needs a conflist: see [`Cri::wait_network_ready`]).
    pub async fn start(opts: ContainerdOptions) -> Result<Self> {
        // Short, because it is part of unix socket paths (107 bytes at most).
        let dir =
            tempfile::Builder::new().prefix("kuryr-ctd-").tempdir_in("/tmp").context("creating the state directory")?;
        let netns = fresh_netns_name();
        let state_dir = dir.path().join("state");
        let cni_bin_dir = opts.cni_bin_dir.unwrap_or_else(|| dir.path().join("cni/bin"));
        let cni_conf_dir = opts.cni_conf_dir.unwrap_or_else(|| dir.path().join("cni/conf"));
        for d in [&cni_bin_dir, &cni_conf_dir] {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        let scratch_dir = dir.path().to_path_buf();
        // From here on, dropping the guard undoes whatever the script got to.
        let mut teardown = Teardown { dir: Some(dir), state_dir: state_dir.clone(), address: None };

        let t0 = Instant::now();
        let args =
            [&state_dir, Path::new(&netns), &cni_bin_dir, &cni_conf_dir].map(|p| p.to_string_lossy().into_owned());
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run_script("containerd-up.sh", &args)
        })
        .await
        .context("containerd-up.sh task")??;
        let up_script = t0.elapsed();

        let env_text = std::fs::read_to_string(state_dir.join("env"))
            .context("reading the env file written by containerd-up.sh")?;
        let env: HashMap<String, String> = parse_env_file(&env_text).into_iter().collect();
        let get = |k: &str| env.get(k).cloned().ok_or_else(|| anyhow!("env file lacks {k}"));
        let address = PathBuf::from(get("CONTAINERD_ADDRESS")?);
        teardown.address = Some(address.clone());
        let ms = |k: &str| -> Duration { Duration::from_millis(env.get(k).and_then(|v| v.parse().ok()).unwrap_or(0)) };
        let mut this = Self {
            teardown,
            scratch_dir,
            address: address.clone(),
            cni_bin_dir,
            cni_conf_dir,
            cri: Cri::connect(
                &address,
                Defaults {
                    busybox_image: get("BUSYBOX_IMAGE")?,
                    pod_log_dir: PathBuf::from(get("POD_LOG_DIR")?),
                    cgroup_parent: get("CGROUP_PARENT")?,
                },
            )
            .await?,
            timings: Timings {
                containerd_ready: ms("TIMING_CONTAINERD_READY_MS"),
                image_import: ms("TIMING_IMPORT_MS"),
                up_script,
                cri_ready: Duration::ZERO,
            },
            env,
        };
        let t1 = Instant::now();
        this.cri.wait_condition("RuntimeReady").await?;
        this.timings.cri_ready = t1.elapsed();
        Ok(this)
    }

    /// The CRI client (cheap to clone).
    pub fn cri(&self) -> &Cri {
        &self.cri
    }

    /// The CNI plugin directory CRI executes plugins from.
    pub fn cni_bin_dir(&self) -> &Path {
        &self.cni_bin_dir
    }

    /// The CNI conflist directory CRI reads.
    pub fn cni_conf_dir(&self) -> &Path {
        &self.cni_conf_dir
    }

    /// A private directory for the test's own files (e.g. an IPAM data dir); removed with the
    /// instance.
    pub fn scratch_dir(&self) -> &Path {
        &self.scratch_dir
    }

    /// The name of the network namespace containerd (and so every CNI plugin it runs) lives in.
    pub fn netns(&self) -> &str {
        self.env.get("NETNS").map_or("", String::as_str)
    }

    /// `/var/run/netns/<netns()>`.
    pub fn netns_path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(self.netns())
    }

    /// containerd's gRPC socket (CRI and the containerd API).
    pub fn address(&self) -> &Path {
        &self.address
    }

    /// Everything containerd-up.sh recorded (KEY=VALUE of STATE_DIR/env).
    pub fn env(&self) -> &HashMap<String, String> {
        &self.env
    }

    /// Start-up timings.
    pub fn timings(&self) -> Timings {
        self.timings
    }

    /// Stops and removes all sandboxes through CRI (CNI DEL runs), then runs containerd-down.sh
    /// and reports whether anything stayed behind.
    pub async fn shutdown(mut self) -> Result<()> {
        let cri_result = tokio::time::timeout(CLEANUP_TIMEOUT, self.cri.remove_all())
            .await
            .map_err(|_| anyhow!("CRI clean-up took longer than {CLEANUP_TIMEOUT:?}"))
            .and_then(|r| r);
        let mut teardown = std::mem::take(&mut self.teardown);
        let down_result =
            tokio::task::spawn_blocking(move || teardown.run_down()).await.context("containerd-down.sh task")?;
        cri_result.context("removing sandboxes through CRI")?;
        down_result
    }
}

/// Runs containerd-down.sh once: on [`Containerd::shutdown`], or on drop (best effort, with a
/// CRI clean-up first on a thread of its own, since drop cannot await).
#[derive(Debug, Default)]
struct Teardown {
    /// The temporary directory holding STATE_DIR and the default CNI dirs; `None` once torn down.
    dir: Option<tempfile::TempDir>,
    state_dir: PathBuf,
    /// containerd's socket, once the script has got that far.
    address: Option<PathBuf>,
}

impl Teardown {
    fn run_down(&mut self) -> Result<()> {
        let Some(dir) = self.dir.take() else {
            return Ok(());
        };
        let result = run_script("containerd-down.sh", &[&self.state_dir.to_string_lossy()]);
        if std::env::var_os("KURYR_KEEP_STATE").is_some_and(|v| v == "1") {
            eprintln!("KURYR_KEEP_STATE=1: keeping containerd state in {}", dir.keep().display());
        }
        result.map(drop)
    }
}

impl Drop for Teardown {
    fn drop(&mut self) {
        if self.dir.is_none() {
            return;
        }
        if let Some(address) = self.address.clone() {
            // A fresh runtime on a fresh thread: the test's runtime may be single-threaded and is
            // blocked in this drop, so nothing connected to it can make progress here.
            let cleanup = std::thread::spawn(move || -> Result<()> {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                rt.block_on(async {
                    let cri = Cri::connect(&address, Defaults::default()).await?;
                    tokio::time::timeout(CLEANUP_TIMEOUT, cri.remove_all()).await?
                })
            });
            // Reported on stderr, which the test harness shows with a failing test's output:
            // drop cannot return an error, and tests install no tracing subscriber.
            match cleanup.join() {
                Ok(Ok(())) => {}
                Ok(Err(error)) => eprintln!("CRI clean-up before teardown failed: {error:#}"),
                Err(_) => eprintln!("CRI clean-up thread panicked"),
            }
        }
        if let Err(error) = self.run_down() {
            eprintln!("containerd-down.sh failed: {error:#}");
        }
    }
}

/// Values the convenience methods fill into sandbox and container configs.
#[derive(Debug, Clone, Default)]
struct Defaults {
    busybox_image: String,
    pod_log_dir: PathBuf,
    /// Every sandbox's cgroup parent lives under this one, which containerd-down.sh removes.
    cgroup_parent: String,
}

/// A CRI client (RuntimeService + ImageService) for one containerd, with kubelet-like helpers.
#[derive(Debug, Clone)]
pub struct Cri {
    runtime: RuntimeServiceClient<Channel>,
    image: ImageServiceClient<Channel>,
    defaults: Arc<Defaults>,
    /// Sandbox configs by sandbox id: CreateContainer needs the sandbox's config again.
    sandboxes: Arc<Mutex<HashMap<String, PodSandboxConfig>>>,
}

/// What PodSandboxStatus says about a sandbox, reduced to what network tests look at.
#[derive(Debug, Clone)]
pub struct SandboxStatus {
    pub id: String,
    pub ready: bool,
    /// The primary IP first, then the additional ones.
    pub ips: Vec<IpAddr>,
    /// The network namespace CRI passed to CNI as `CNI_NETNS` (from the verbose info).
    pub netns_path: Option<PathBuf>,
    /// The verbose `info` JSON of containerd, for anything else a test needs.
    pub info: serde_json::Value,
}

impl Cri {
    /// Connects over containerd's unix socket. The URI is a placeholder; the connector ignores it.
    async fn connect(address: &Path, defaults: Defaults) -> Result<Self> {
        let path = address.to_path_buf();
        let channel = Endpoint::try_from("http://[::1]:50051")?
            .connect_timeout(Duration::from_secs(10))
            .timeout(CALL_TIMEOUT)
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }))
            .await
            .with_context(|| format!("connecting to CRI at {}", address.display()))?;
        Ok(Self {
            runtime: RuntimeServiceClient::new(channel.clone()),
            image: ImageServiceClient::new(channel),
            defaults: Arc::new(defaults),
            sandboxes: Arc::default(),
        })
    }

    /// The raw RuntimeService client, for calls without a helper here.
    pub fn runtime(&self) -> RuntimeServiceClient<Channel> {
        self.runtime.clone()
    }

    /// The raw ImageService client.
    pub fn images(&self) -> ImageServiceClient<Channel> {
        self.image.clone()
    }

    /// Image references CRI knows (the imported pause and busybox images among them).
    pub async fn list_image_tags(&self) -> Result<Vec<String>> {
        let resp = self.images().list_images(ListImagesRequest { filter: None }).await?;
        Ok(resp.into_inner().images.into_iter().flat_map(|i| i.repo_tags).collect())
    }

    /// Waits until CRI's Status reports the condition (`RuntimeReady` or `NetworkReady`) true.
    pub async fn wait_condition(&self, condition: &str) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let last = match self.runtime().status(StatusRequest { verbose: false }).await {
                Ok(resp) => {
                    let conds = resp.into_inner().status.map(|s| s.conditions).unwrap_or_default();
                    match conds.into_iter().find(|c| c.r#type == condition) {
                        Some(c) if c.status => return Ok(()),
                        Some(c) => format!("{}: {}", c.reason, c.message),
                        None => "condition not reported".to_string(),
                    }
                }
                Err(status) => format!("Status failed: {status}"),
            };
            if Instant::now() > deadline {
                bail!("CRI {condition} not true after {READY_TIMEOUT:?}: {last}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until CRI has loaded a CNI conflist (NetworkReady), e.g. after writing one.
    pub async fn wait_network_ready(&self) -> Result<()> {
        self.wait_condition("NetworkReady").await
    }

    /// The sandbox config kubelet would send for a pod: metadata, hostname, log directory, a
    /// cgroup parent under this instance's, and pod-scoped network/IPC namespaces.
    pub fn pod_sandbox_config(&self, name: &str, namespace: &str, uid: &str) -> PodSandboxConfig {
        let labels = HashMap::from([
            ("io.kubernetes.pod.name".to_string(), name.to_string()),
            ("io.kubernetes.pod.namespace".to_string(), namespace.to_string()),
            ("io.kubernetes.pod.uid".to_string(), uid.to_string()),
        ]);
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.to_string(),
                uid: uid.to_string(),
                namespace: namespace.to_string(),
                attempt: 0,
            }),
            hostname: name.to_string(),
            log_directory: self
                .defaults
                .pod_log_dir
                .join(format!("{namespace}_{name}_{uid}"))
                .to_string_lossy()
                .into_owned(),
            labels,
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: format!("{}/pod{uid}", self.defaults.cgroup_parent),
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(pod_namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// RunPodSandbox for a pod (see [`Cri::pod_sandbox_config`]); returns the sandbox id.
    pub async fn run_pod_sandbox(&self, name: &str, namespace: &str, uid: &str) -> Result<String> {
        self.run_pod_sandbox_with(self.pod_sandbox_config(name, namespace, uid)).await
    }

    /// RunPodSandbox with a config of the caller's (e.g. with annotations or port mappings).
    pub async fn run_pod_sandbox_with(&self, config: PodSandboxConfig) -> Result<String> {
        if !config.log_directory.is_empty() {
            // kubelet creates the pod log directory before asking for the sandbox.
            std::fs::create_dir_all(&config.log_directory)
                .with_context(|| format!("creating {}", config.log_directory))?;
        }
        let req = RunPodSandboxRequest { config: Some(config.clone()), runtime_handler: String::new() };
        let id = self.runtime().run_pod_sandbox(req).await?.into_inner().pod_sandbox_id;
        self.sandboxes.lock().unwrap_or_else(PoisonError::into_inner).insert(id.clone(), config);
        Ok(id)
    }

    /// PodSandboxStatus (verbose), with the IPs parsed and the network namespace path extracted.
    pub async fn pod_sandbox_status(&self, id: &str) -> Result<SandboxStatus> {
        let req = PodSandboxStatusRequest { pod_sandbox_id: id.to_string(), verbose: true };
        let resp = self.runtime().pod_sandbox_status(req).await?.into_inner();
        let status = resp.status.ok_or_else(|| anyhow!("PodSandboxStatus without status"))?;
        let mut ips = Vec::new();
        if let Some(net) = &status.network {
            for ip in std::iter::once(net.ip.as_str())
                .chain(net.additional_ips.iter().map(|a| a.ip.as_str()))
                .filter(|ip| !ip.is_empty())
            {
                ips.push(ip.parse().with_context(|| format!("sandbox IP {ip:?}"))?);
            }
        }
        let info: serde_json::Value = match resp.info.get("info") {
            Some(text) => serde_json::from_str(text).context("parsing the verbose sandbox info")?,
            None => serde_json::Value::Null,
        };
        let netns_path = info["runtimeSpec"]["linux"]["namespaces"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|ns| ns["type"] == "network")
            .and_then(|ns| ns["path"].as_str())
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        Ok(SandboxStatus {
            id: status.id,
            ready: status.state == PodSandboxState::SandboxReady as i32,
            ips,
            netns_path,
            info,
        })
    }

    /// StopPodSandbox: stops its containers and tears its network down (CNI DEL).
    pub async fn stop_pod_sandbox(&self, id: &str) -> Result<()> {
        let req = StopPodSandboxRequest { pod_sandbox_id: id.to_string() };
        self.runtime().stop_pod_sandbox(req).await?;
        Ok(())
    }

    /// RemovePodSandbox (CRI sends a second CNI DEL, without netns).
    pub async fn remove_pod_sandbox(&self, id: &str) -> Result<()> {
        let req = RemovePodSandboxRequest { pod_sandbox_id: id.to_string() };
        self.runtime().remove_pod_sandbox(req).await?;
        self.sandboxes.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
        Ok(())
    }

    /// ListPodSandbox, unfiltered.
    pub async fn list_pod_sandboxes(&self) -> Result<Vec<PodSandbox>> {
        let resp = self.runtime().list_pod_sandbox(ListPodSandboxRequest { filter: None }).await?;
        Ok(resp.into_inner().items)
    }

    /// Stops and removes every sandbox, as kubelet would when all pods are gone.
    pub async fn remove_all(&self) -> Result<()> {
        // A sandbox listed here may be removed meanwhile by a kubelet stand-in whose last
        // RemovePodSandbox was still in flight when it was dropped: gone is what was wanted.
        let gone =
            |e: &anyhow::Error| e.downcast_ref::<tonic::Status>().is_some_and(|s| s.code() == tonic::Code::NotFound);
        for sandbox in self.list_pod_sandboxes().await? {
            match self.stop_pod_sandbox(&sandbox.id).await {
                Err(e) if gone(&e) => continue,
                r => r?,
            }
            match self.remove_pod_sandbox(&sandbox.id).await {
                Err(e) if gone(&e) => {
                    self.sandboxes.lock().unwrap_or_else(PoisonError::into_inner).remove(&sandbox.id);
                }
                r => r?,
            }
        }
        Ok(())
    }

    /// Creates and starts a busybox container running `command` in a sandbox made by
    /// [`Cri::run_pod_sandbox`]; returns the container id.
    pub async fn run_busybox(&self, sandbox_id: &str, name: &str, command: &[&str]) -> Result<String> {
        let sandbox_config = self
            .sandboxes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(sandbox_id)
            .cloned()
            .ok_or_else(|| anyhow!("sandbox {sandbox_id} was not run through this client"))?;
        let config = ContainerConfig {
            metadata: Some(ContainerMetadata { name: name.to_string(), attempt: 0 }),
            image: Some(ImageSpec { image: self.defaults.busybox_image.clone(), ..Default::default() }),
            command: command.iter().map(|s| s.to_string()).collect(),
            log_path: format!("{name}/0.log"),
            linux: Some(LinuxContainerConfig {
                security_context: Some(LinuxContainerSecurityContext {
                    namespace_options: Some(pod_namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let req = CreateContainerRequest {
            pod_sandbox_id: sandbox_id.to_string(),
            config: Some(config),
            sandbox_config: Some(sandbox_config),
        };
        let id = self.runtime().create_container(req).await?.into_inner().container_id;
        self.runtime().start_container(StartContainerRequest { container_id: id.clone() }).await?;
        Ok(id)
    }

    /// ExecSync in a container: (exit code, stdout, stderr). `timeout` bounds the command.
    pub async fn exec_sync(
        &self,
        container_id: &str,
        cmd: &[&str],
        timeout: Duration,
    ) -> Result<(i32, String, String)> {
        let req = ExecSyncRequest {
            container_id: container_id.to_string(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            timeout: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX).max(1),
        };
        let resp = self.runtime().exec_sync(req).await?.into_inner();
        Ok((
            resp.exit_code,
            String::from_utf8_lossy(&resp.stdout).into_owned(),
            String::from_utf8_lossy(&resp.stderr).into_owned(),
        ))
    }

    /// StopContainer (with a grace period in seconds) and RemoveContainer.
    pub async fn remove_container(&self, container_id: &str, grace_secs: i64) -> Result<()> {
        let id = container_id.to_string();
        self.runtime().stop_container(StopContainerRequest { container_id: id.clone(), timeout: grace_secs }).await?;
        self.runtime().remove_container(RemoveContainerRequest { container_id: id }).await?;
        Ok(())
    }

    /// ListContainers, unfiltered: ids.
    pub async fn list_container_ids(&self) -> Result<Vec<String>> {
        let resp = self.runtime().list_containers(ListContainersRequest { filter: None }).await?;
        Ok(resp.into_inner().containers.into_iter().map(|c| c.id).collect())
    }

    /// Runs a host program inside a sandbox's network namespace (`nsenter --net=<path>`), e.g.
    /// `ping` or `ip`; fails if it cannot be started, returns its output otherwise.
    pub async fn exec_in_sandbox_netns(
        &self,
        sandbox_id: &str,
        argv: &[&str],
        timeout: Duration,
    ) -> Result<std::process::Output> {
        let (program, args) = argv.split_first().ok_or_else(|| anyhow!("empty command"))?;
        let status = self.pod_sandbox_status(sandbox_id).await?;
        let netns = status.netns_path.ok_or_else(|| anyhow!("sandbox {sandbox_id} reports no network namespace"))?;
        let mut cmd = tokio::process::Command::new("nsenter");
        cmd.arg(format!("--net={}", netns.display())).arg("--").arg(program).args(args);
        cmd.kill_on_drop(true);
        tokio::time::timeout(timeout, cmd.output())
            .await
            .map_err(|_| anyhow!("{argv:?} in {} took longer than {timeout:?}", netns.display()))?
            .with_context(|| format!("running nsenter {argv:?}"))
    }

    /// Pings `dst` from a sandbox's network namespace (`count` echo requests, 0.2 s apart, waiting
    /// 1 s for the last reply);
    /// `Ok(true)` if replies came back.
    pub async fn ping_from_sandbox(&self, sandbox_id: &str, dst: IpAddr, count: u32) -> Result<bool> {
        let count = count.max(1).to_string();
        let dst = dst.to_string();
        let argv = ["ping", "-n", "-c", &count, "-W", "1", "-i", "0.2", &dst];
        let out = self.exec_in_sandbox_netns(sandbox_id, &argv, Duration::from_secs(30)).await?;
        Ok(out.status.success())
    }
}

/// Network and IPC shared by the pod, PID per container: what kubelet asks for a normal pod.
fn pod_namespaces() -> NamespaceOption {
    NamespaceOption {
        network: NamespaceMode::Pod as i32,
        pid: NamespaceMode::Container as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

/// A network namespace name not in use on this host, ≤ 15 bytes (it may end up in interface
/// names): `kctd` + [`unique_id`], skipping names a crashed earlier run may have left behind.
fn fresh_netns_name() -> String {
    loop {
        let name = format!("kctd{}", unique_id());
        if !Path::new("/var/run/netns").join(&name).exists() {
            return name;
        }
    }
}
