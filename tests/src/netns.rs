//! Named network namespaces made by a test and deleted when it ends, even on panic.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, bail};

use crate::util::unique_id;

/// A network namespace under /var/run/netns, with `lo` up; deleted on drop.
#[derive(Debug)]
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// Creates `<prefix><unique id>` (prefix of at most 6 bytes keeps names short).
    pub fn new(prefix: &str) -> Result<Self> {
        let name = format!("{prefix}{}", unique_id());
        let out = Command::new("ip").args(["netns", "add", &name]).output()?;
        if !out.status.success() {
            bail!("ip netns add {name}: {}", String::from_utf8_lossy(&out.stderr));
        }
        let ns = Self { name };
        ns.exec(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace's path, as CNI_NETNS carries it.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/var/run/netns").join(&self.name)
    }

    /// Runs a command inside the namespace and returns its stdout.
    pub fn exec(&self, argv: &[&str]) -> Result<String> {
        let out =
            Command::new("nsenter").arg(format!("--net={}", self.path().display())).arg("--").args(argv).output()?;
        crate::util::checked_stdout(&format!("{argv:?} in {}", self.name), &out)
    }

    /// Pings `to` (IPv4 or IPv6) from this namespace until it answers, for at most `timeout`:
    /// an address answers only once its interface is up and, for IPv6, duplicate address
    /// detection is done.
    pub async fn wait_ping(&self, to: &str, timeout: std::time::Duration) -> Result<()> {
        let family = if to.contains(':') { "-6" } else { "-4" };
        crate::services::wait_until(&format!("{} to reach {to}", self.name), timeout, || async {
            self.exec(&["ping", family, "-n", "-c", "1", "-W", "2", to]).map(drop)
        })
        .await
    }

    /// Interface names in the namespace.
    pub fn links(&self) -> Vec<String> {
        self.exec(&["ip", "-o", "link", "show"])
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_string())
            .collect()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}
