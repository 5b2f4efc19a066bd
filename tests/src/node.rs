//! A test node: containerd in its own network namespace, with `kuryr-cni` installed as its CNI
//! plugin and a `kuryr-binder` running in that namespace — what a Kubernetes node runs.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::cri::{Containerd, ContainerdOptions};
use crate::binder::Binder;
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
        std::os::unix::fs::symlink(bin_path("kuryr-cni")?, ctd.cni_bin_dir().join("kuryr-cni"))
            .context("installing kuryr-cni")?;
        let binder = Binder::start(name, &ctd.netns_path(), allocator, extra_binder_args).await?;
        let node = Self { name: name.to_string(), ctd, binder };
        let path = node.ctd.cni_conf_dir().join("10-kuryr.conflist");
        std::fs::write(&path, serde_json::to_vec_pretty(&node.conflist("1.0.0"))?)?;
        node.ctd.cri().wait_network_ready().await?;
        Ok(node)
    }

    /// The conflist CRI uses: just `kuryr-cni`, talking to this node's binder.
    pub fn conflist(&self, cni_version: &str) -> serde_json::Value {
        let mut plugin = self.binder.netconf(cni_version, NETWORK);
        if let Some(o) = plugin.as_object_mut() {
            o.remove("cniVersion");
            o.remove("name");
        }
        serde_json::json!({ "cniVersion": cni_version, "name": NETWORK, "plugins": [plugin] })
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
