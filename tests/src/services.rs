//! Running the project's own binaries as separate processes, as users run them.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};

use crate::util::{repo_root, unique_id};

/// The path of a binary of this workspace. `make test` builds them before the tests run
/// (`cargo build --workspace --bins`); a missing binary is an error naming that command.
/// `KURYR_BIN_DIR` overrides the directory.
pub fn bin_path(name: &str) -> Result<PathBuf> {
    // Benchmarks point this at optimised builds.
    if let Some(dir) = std::env::var_os("KURYR_BIN_DIR") {
        // Absolute: the path is also linked into containerd's CNI directory (the shim), where a
        // relative one would dangle.
        let p = std::path::absolute(PathBuf::from(dir).join(name))?;
        if p.is_file() {
            return Ok(p);
        }
        bail!("{} is not built (KURYR_BIN_DIR)", p.display());
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"));
    let target = std::path::absolute(target)?;
    for profile in ["debug", "release"] {
        let p = target.join(profile).join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("{name} is not built: run `cargo build --workspace --bins` first (or `make test`)")
}

/// The path of a test tool built by `tests/env/tools.sh` (grpcurl, cnitool, ...).
pub fn tool_path(name: &str) -> Result<PathBuf> {
    let dir = std::env::var_os("KURYR_TOOLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/kuryr-rs/bin"));
    let p = dir.join(name);
    if p.is_file() {
        return Ok(p);
    }
    bail!("{} is missing: run `bash tests/env/tools.sh`", p.display())
}

/// A running service process; killed (SIGKILL) on drop unless stopped before.
#[derive(Debug)]
pub struct ServiceProcess {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl ServiceProcess {
    /// Starts `bin` with `args`, logging to a file in `log_dir`.
    ///
    /// A service given a ServiceAccount kubeconfig made by
    /// [`KubeEnv::service_account_kubeconfig`](crate::kube::KubeEnv::service_account_kubeconfig)
    /// (`--kubeconfig`) also authenticates to the other kuryr services as that account: unless
    /// the arguments say otherwise, it gets the account's kuryr token as `--auth-token-file`, as
    /// the deployment's projected token volume gives it.
    pub fn spawn(bin: &str, args: &[String], log_dir: &Path) -> Result<Self> {
        Self::spawn_in_netns(bin, &with_kuryr_token(args), log_dir, None)
    }

    /// Starts `bin` inside the network namespace at `netns` (a node of the test), via
    /// `nsenter --net`, which keeps the host's mount namespace (unlike `ip netns exec`).
    pub fn spawn_in_netns(bin: &str, args: &[String], log_dir: &Path, netns: Option<&Path>) -> Result<Self> {
        let path = bin_path(bin)?;
        let log = log_dir.join(format!("{bin}-{}.log", unique_id()));
        let file = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={}", ns.display())).arg("--").arg(&path);
                c
            }
            None => Command::new(&path),
        };
        let child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", path.display()))?;
        Ok(Self { name: bin.to_string(), child: Some(child), log })
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// What the process has logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGTERM and waits up to `bound` for the exit; returns how long it took.
    pub async fn terminate(&mut self, bound: Duration) -> Result<Duration> {
        let child = self.child.as_mut().context("already stopped")?;
        let pid = child.id().context("already exited")?;
        let start = Instant::now();
        let status = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status()?;
        anyhow::ensure!(status.success(), "kill -TERM {pid} failed");
        match tokio::time::timeout(bound, child.wait()).await {
            Ok(res) => {
                let st = res?;
                self.child = None;
                anyhow::ensure!(st.success(), "{} exited with {st} after SIGTERM:\n{}", self.name, self.logs());
                Ok(start.elapsed())
            }
            Err(_) => bail!("{} did not exit within {bound:?} of SIGTERM:\n{}", self.name, self.logs()),
        }
    }

    /// Kills the process at once (SIGKILL), as a crash would.
    pub async fn kill(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill().await?;
        }
        Ok(())
    }
}

/// `args` plus `--auth-token-file` for the kubeconfig's account (see [`ServiceProcess::spawn`]).
fn with_kuryr_token(args: &[String]) -> Vec<String> {
    let mut out = args.to_vec();
    if args.iter().any(|a| a.starts_with("--auth-token-file") || a == "--auth=none") {
        return out;
    }
    let kubeconfig = args.iter().position(|a| a == "--kubeconfig").and_then(|i| args.get(i + 1));
    if let Some(token) = kubeconfig.map(|k| crate::kube::kuryr_token_path(Path::new(k))).filter(|t| t.is_file()) {
        out.extend(["--auth-token-file".to_string(), token.display().to_string()]);
    }
    out
}

/// Polls `f` every 50 ms until it succeeds or `timeout` passes; the error names `what` and the
/// last failure.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e.context(format!("timed out waiting for {what}"))),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Runs grpcurl with `args`; returns (success, stdout + stderr).
pub async fn grpcurl(args: &[&str]) -> Result<(bool, String)> {
    let out = Command::new(tool_path("grpcurl")?).args(args).output().await.context("running grpcurl")?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), text))
}
