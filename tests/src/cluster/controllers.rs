//! The real `kube-controller-manager`, running only the controllers the cluster needs: the
//! EndpointSlice controller, which turns a Service's selector and the Ready pods it selects
//! (their `status.podIPs`, the `Ready` condition, `deletionTimestamp` for terminating) into
//! EndpointSlices — what kuryr-lbaas turns into load balancer members.
//!
//! It authenticates as `system:kube-controller-manager` with a client certificate signed by the
//! cluster's CA (the bootstrap RBAC policy's role for it), and with
//! `--use-service-account-credentials` each controller then acts as its own ServiceAccount in
//! `kube-system` (`endpointslice-controller`, bound to `system:controller:endpointslice-controller`),
//! with tokens from the TokenRequest API — as on a kubeadm cluster. No leader election (one
//! instance); its HTTPS port (`/healthz`) is on a free loopback port.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};

use crate::kube::KubeEnv;
use crate::services::tool_path;
use crate::util::{env_script, free_port, tail};

/// The tool's name in the tools directory.
pub const BINARY: &str = "kube-controller-manager";
/// The controllers run (names as `--controllers` takes them).
pub const CONTROLLERS: &str = "endpointslice-controller";
/// [`CONTROLLERS`] and what runs Deployments (their ReplicaSets, and those their pods).
pub const WORKLOAD_CONTROLLERS: &str = "endpointslice-controller,deployment-controller,replicaset-controller";
/// Bound on turning healthy after start (a cold start on a loaded machine takes a few seconds).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A running kube-controller-manager; killed on drop unless stopped before.
#[derive(Debug)]
pub struct ControllerManager {
    child: Option<Child>,
    log: PathBuf,
    exe: PathBuf,
    port: u16,
}

impl ControllerManager {
    /// Starts it against `kube`, logging and keeping its serving certificate in `dir`, and waits
    /// until `/healthz` answers ok. Builds the binary first (`tests/env/tools.sh`) when missing.
    pub async fn start(kube: &KubeEnv, dir: &Path) -> Result<ControllerManager> {
        Self::start_with(kube, dir, CONTROLLERS).await
    }

    /// [`ControllerManager::start`] running `controllers` (comma-separated, as `--controllers`
    /// takes them; e.g. `namespace-controller`, which empties a deleted namespace and removes
    /// its `kubernetes` finalizer).
    pub async fn start_with(kube: &KubeEnv, dir: &Path, controllers: &str) -> Result<ControllerManager> {
        let exe = match tool_path(BINARY) {
            Ok(p) => p,
            Err(_) => {
                let status = Command::new("bash")
                    .arg(env_script("tools.sh"))
                    .arg(BINARY)
                    .status()
                    .await
                    .context("running tests/env/tools.sh")?;
                anyhow::ensure!(status.success(), "tests/env/tools.sh {BINARY} failed ({status})");
                tool_path(BINARY)?
            }
        };
        let kubeconfig = kube.user_kubeconfig("system:kube-controller-manager", &[]).await?;
        let port = free_port()?;
        let log = dir.join("kube-controller-manager.log");
        let file = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let certs = dir.join("kcm-certs");
        let kubeconfig = kubeconfig.display().to_string();
        let args = [
            format!("--kubeconfig={kubeconfig}"),
            // Delegated authentication/authorization of its own HTTPS endpoint go through the
            // API server too, as on kubeadm; /healthz is always allowed.
            format!("--authentication-kubeconfig={kubeconfig}"),
            format!("--authorization-kubeconfig={kubeconfig}"),
            format!("--controllers={controllers}"),
            "--use-service-account-credentials=true".into(),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", certs.display()),
            // No batching: an endpoint change is written as soon as it is seen.
            "--endpointslice-updates-batch-period=0s".into(),
            "--profiling=false".into(),
            "--v=2".into(),
        ];
        let child = Command::new(&exe)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        let mut kcm = ControllerManager { child: Some(child), log, exe, port };
        let url = format!("https://127.0.0.1:{port}/healthz");
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let why = match kcm.child.as_mut().map(Child::try_wait).transpose()? {
                Some(Some(status)) => format!("it exited with {status}"),
                _ => {
                    let out = Command::new("curl").args(["-sk", "--max-time", "2", &url]).output().await?;
                    let body = String::from_utf8_lossy(&out.stdout).trim().to_string();
                    if out.status.success() && body == "ok" {
                        break;
                    }
                    if Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                    format!("not healthy after {READY_TIMEOUT:?} (/healthz: {body:?})")
                }
            };
            bail!("kube-controller-manager: {why}\n---- its log ----\n{}", tail(&kcm.logs(), 60));
        }
        Ok(kcm)
    }

    /// Its pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// The executable it runs.
    pub fn exe(&self) -> &Path {
        &self.exe
    }

    /// Its HTTPS port on 127.0.0.1 (`/healthz`, `/metrics`).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// What it logged.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// SIGTERM, then SIGKILL if it has not exited within `bound`.
    pub async fn stop(&mut self, bound: Duration) -> Result<()> {
        let Some(mut child) = self.child.take() else { return Ok(()) };
        if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
        }
        if tokio::time::timeout(bound, child.wait()).await.is_err() {
            child.kill().await.context("killing kube-controller-manager")?;
            bail!("kube-controller-manager did not exit within {bound:?} of SIGTERM");
        }
        Ok(())
    }
}
