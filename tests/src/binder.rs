//! A `kuryr-binder` process inside a node's network namespace, following a VIF allocator.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;

use crate::services::{ServiceProcess, grpcurl, wait_until};

/// Where the binder serves its metrics and probes, inside its node's namespace.
const METRICS_LISTEN: &str = "127.0.0.1:9631";

/// A binder; stopped (killed) on drop.
#[derive(Debug)]
pub struct Binder {
    pub node: String,
    /// The binder's unix socket (CNI and grpcurl).
    pub socket: PathBuf,
    /// The binder's state directory (attachment records).
    pub state_dir: PathBuf,
    netns: PathBuf,
    allocator: String,
    extra_args: Vec<String>,
    dir: tempfile::TempDir,
    proc: Option<ServiceProcess>,
}

impl Binder {
    /// Starts a binder for `node` in the network namespace at `netns`, following `allocator` (an
    /// address reachable from that namespace, e.g. `unix:/path`), and waits until it serves.
    pub async fn start(node: &str, netns: &Path, allocator: &str, extra_args: &[String]) -> Result<Self> {
        // On a tmpfs when the host has one, as `/run/kuryr/binder` is on a node: the records are
        // written twice per ADD, and a file system with a journal would make them cost ~1 ms.
        let base = if Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" };
        let dir = tempfile::Builder::new().prefix("kuryr-binder-").tempdir_in(base)?;
        let mut b = Self {
            node: node.to_string(),
            socket: dir.path().join("binder.sock"),
            state_dir: dir.path().join("state"),
            netns: netns.to_path_buf(),
            allocator: allocator.to_string(),
            extra_args: extra_args.to_vec(),
            dir,
            proc: None,
        };
        b.restart().await?;
        Ok(b)
    }

    /// Starts the binder again (after [`Binder::stop`] or a crash) and waits until it serves.
    pub async fn restart(&mut self) -> Result<()> {
        let mut args: Vec<String> = vec![
            "--listen".into(),
            format!("unix:{}", self.socket.display()),
            "--metrics-listen".into(),
            METRICS_LISTEN.into(),
            "--allocator".into(),
            self.allocator.clone(),
            "--node-name".into(),
            self.node.clone(),
            "--state-dir".into(),
            self.state_dir.display().to_string(),
            "--shutdown-grace".into(),
            "3s".into(),
        ];
        if !self.extra_args.iter().any(|a| a == "--vif-wait-timeout") {
            args.extend(["--vif-wait-timeout".into(), "20s".into()]);
        }
        args.extend(self.extra_args.iter().cloned());
        self.proc = Some(ServiceProcess::spawn_in_netns("kuryr-binder", &args, self.dir.path(), Some(&self.netns))?);
        let target = self.grpc_target();
        wait_until("the binder to serve", Duration::from_secs(30), || async {
            let (ok, out) = grpcurl(&[
                "-plaintext",
                "-d",
                r#"{"service":"kuryr.binder.v1.Cni"}"#,
                &target,
                "grpc.health.v1.Health/Check",
            ])
            .await?;
            anyhow::ensure!(ok && out.contains("\"SERVING\""), "{out}");
            Ok(())
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\n{}", self.logs()))
    }

    /// Stops the binder with SIGTERM and waits for it to exit.
    pub async fn stop(&mut self) -> Result<()> {
        if let Some(mut p) = self.proc.take() {
            p.terminate(Duration::from_secs(10)).await?;
        }
        Ok(())
    }

    /// Kills the binder with SIGKILL, as a crash would: no drain, its socket left behind.
    /// [`Binder::restart`] starts it again.
    pub async fn kill(&mut self) -> Result<()> {
        if let Some(mut p) = self.proc.take() {
            p.kill().await?;
        }
        Ok(())
    }

    /// The binder's gRPC target for grpcurl.
    pub fn grpc_target(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// A gRPC channel over the binder's unix socket, as the shim opens one.
    pub async fn channel(&self) -> Result<tonic::transport::Channel> {
        let socket = self.socket.clone();
        let channel = tonic::transport::Endpoint::from_static("http://binder")
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let s = socket.clone();
                async move { tokio::net::UnixStream::connect(s).await.map(hyper_util::rt::TokioIo::new) }
            }))
            .await?;
        Ok(channel)
    }

    /// The binder's metrics, read inside its node's namespace.
    pub async fn scrape(&self) -> Result<crate::metrics::Scrape> {
        crate::metrics::Scrape::in_netns(&self.netns, METRICS_LISTEN).await
    }

    /// What the binder logged.
    pub fn logs(&self) -> String {
        self.proc.as_ref().map(ServiceProcess::logs).unwrap_or_default()
    }

    /// The binder's process id.
    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().and_then(ServiceProcess::pid)
    }

    /// A CNI network configuration (one plugin, `kuryr-cni`) pointing at this binder.
    pub fn netconf(&self, cni_version: &str, name: &str) -> serde_json::Value {
        serde_json::json!({
            "cniVersion": cni_version,
            "name": name,
            "type": "kuryr-cni",
            "binderSocket": self.socket,
            "timeoutSeconds": 30,
        })
    }

    /// The number of attachment records on disk.
    pub fn attachment_records(&self) -> usize {
        std::fs::read_dir(self.state_dir.join("attachments"))
            .map(|d| d.filter(|e| e.as_ref().is_ok_and(|e| e.path().extension().is_some_and(|x| x == "json"))).count())
            .unwrap_or(0)
    }
}

/// How many [`HostTable`]s are held in this process.
static HOST_TABLE_HOLDERS: std::sync::Mutex<usize> = std::sync::Mutex::new(0);

/// The nftables table a binder programs in its network namespace, for a binder a suite runs in
/// the host's (its TCP listener, or the API server it asks, on the host's loopback): as on a
/// node, the binder leaves its table when it stops. The first claim in the process requires
/// that the host has none (a binder of this host's own would share it); the table is deleted
/// when the last claim is dropped. Hold it longer than the binder process.
#[derive(Debug)]
pub struct HostTable(());

impl HostTable {
    /// Claims the host's table; an error when the host has one that is not this process's.
    pub fn claim() -> Result<Self> {
        let mut holders = HOST_TABLE_HOLDERS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if *holders == 0 {
            let out = std::process::Command::new("nft").args(["list", "table", "inet", "kuryr"]).output()?;
            anyhow::ensure!(
                !out.status.success(),
                "the host's network namespace already has the table inet kuryr (a kuryr binder on this host?): \
                 a binder started here would program it; remove it or run the suite elsewhere"
            );
        }
        *holders += 1;
        Ok(Self(()))
    }
}

impl Drop for HostTable {
    fn drop(&mut self) {
        let mut holders = HOST_TABLE_HOLDERS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *holders -= 1;
        if *holders == 0 {
            let _ = std::process::Command::new("nft").args(["delete", "table", "inet", "kuryr"]).status();
        }
    }
}
