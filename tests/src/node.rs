//! A test node: containerd in its own network namespace, with `kuryr-cni` installed as its CNI
//! plugin and a `kuryr-binder` running in that namespace — what a Kubernetes node runs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::binder::Binder;
use crate::cri::{Containerd, ContainerdOptions};
use crate::services::bin_path;

/// The CNI network name of the kuryr conflist.
pub const NETWORK: &str = "kuryr";

/// One node.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub ctd: Containerd,
    pub binder: Binder,
}

impl Node {
    /// Starts containerd, installs the shim and its conflist, and starts a binder following
    /// `allocator` (an address reachable from the node's namespace, e.g. `unix:/path`).
    pub async fn start(name: &str, allocator: &str, extra_binder_args: &[String]) -> Result<Self> {
        let ctd = Containerd::start(ContainerdOptions::default()).await?;
        Self::with_containerd(ctd, name, allocator, extra_binder_args).await
    }

    /// Like [`Node::start`], on a containerd the caller started (and may have prepared, e.g. by
    /// giving its network namespace an uplink before the binder starts there).
    pub async fn with_containerd(
        ctd: Containerd,
        name: &str,
        allocator: &str,
        extra_binder_args: &[String],
    ) -> Result<Self> {
        std::os::unix::fs::symlink(bin_path("kuryr-cni")?, ctd.cni_bin_dir().join("kuryr-cni"))
            .context("installing kuryr-cni")?;
        let binder = Binder::start(name, &ctd.netns_path(), allocator, extra_binder_args).await?;
        let node = Self { name: name.to_string(), ctd, binder };
        let path = node.ctd.cni_conf_dir().join("10-kuryr.conflist");
        std::fs::write(&path, serde_json::to_vec_pretty(&node.conflist("1.0.0"))?)?;
        node.ctd.cri().wait_network_ready().await?;
        Ok(node)
    }

    /// The conflist CRI uses: just `kuryr-cni`, talking to this node's binder, with the
    /// `portMappings` capability (as the binder writes it), so that pods' host ports reach it.
    pub fn conflist(&self, cni_version: &str) -> serde_json::Value {
        let mut plugin = self.binder.netconf(cni_version, NETWORK);
        if let Some(o) = plugin.as_object_mut() {
            o.remove("cniVersion");
            o.remove("name");
            o.insert("capabilities".into(), serde_json::json!({ "portMappings": true }));
        }
        serde_json::json!({ "cniVersion": cni_version, "name": NETWORK, "plugins": [plugin] })
    }

    /// Stops the node in the order a node drains: every sandbox is stopped and removed through
    /// CRI while the binder still answers (so CNI DEL unplugs each pod), then the binder stops,
    /// then containerd-down.sh removes containerd and the node's network namespace. Every step
    /// runs even if an earlier one failed; the first failure is returned.
    pub async fn shutdown(mut self) -> Result<()> {
        let sandboxes = match tokio::time::timeout(Duration::from_secs(60), self.ctd.cri().remove_all()).await {
            Ok(r) => r.context("removing sandboxes through CRI"),
            Err(_) => Err(anyhow::anyhow!("removing sandboxes through CRI took over 60 s")),
        };
        let binder = self.binder.stop().await.context("stopping the binder");
        let Node { ctd, .. } = self;
        let containerd = ctd.shutdown().await.context("stopping containerd");
        sandboxes.and(binder).and(containerd)
    }

    /// What the binder logged.
    pub fn binder_logs(&self) -> String {
        self.binder.logs()
    }

    /// The node's network namespace path.
    pub fn netns_path(&self) -> PathBuf {
        self.ctd.netns_path()
    }

    /// Runs a command in the node's network namespace.
    pub async fn exec(&self, argv: &[&str]) -> Result<String> {
        netns_exec(&self.netns_path(), argv).await
    }
}

/// Runs `argv` inside the network namespace at `netns` and returns its stdout; fails with its
/// output when it exits non-zero.
pub async fn netns_exec(netns: &Path, argv: &[&str]) -> Result<String> {
    let out = tokio::process::Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg("--")
        .args(argv)
        .output()
        .await
        .with_context(|| format!("nsenter {argv:?}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{argv:?} in {} failed: {}{}",
        netns.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
