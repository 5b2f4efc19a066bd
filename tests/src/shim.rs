//! Executing the `kuryr-cni` shim the way a container runtime does: environment + stdin.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::services::bin_path;

/// What one execution produced.
#[derive(Debug)]
pub struct ShimOutput {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

impl ShimOutput {
    /// stdout parsed as JSON.
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_str(&self.stdout).with_context(|| format!("stdout is not JSON: {:?}", self.stdout))
    }
}

/// The first IPv6 (`v6`) or IPv4 address of a CNI result's `ips`, without its prefix length.
pub fn result_ip(result: &serde_json::Value, v6: bool) -> Option<String> {
    let ips = result["ips"].as_array()?;
    let a = ips.iter().filter_map(|i| i["address"].as_str()).find(|a| a.contains(':') == v6)?;
    Some(a.split('/').next().unwrap_or(a).to_string())
}

/// Runs `kuryr-cni` with exactly `env` (nothing inherited) and `stdin`.
pub fn run_shim(env: &[(&str, &str)], stdin: &[u8]) -> Result<ShimOutput> {
    run(env, stdin, None)
}

/// [`run_shim`] as the user `uid` with the primary group `gid` (and no supplementary groups):
/// a process other than the container runtime.
pub fn run_shim_as(env: &[(&str, &str)], stdin: &[u8], uid: u32, gid: u32) -> Result<ShimOutput> {
    run(env, stdin, Some((uid, gid)))
}

fn run(env: &[(&str, &str)], stdin: &[u8], user: Option<(u32, u32)>) -> Result<ShimOutput> {
    use std::os::unix::process::CommandExt;
    let path = bin_path("kuryr-cni")?;
    let start = Instant::now();
    let mut cmd = Command::new(&path);
    if let Some((uid, gid)) = user {
        // As root, std drops the supplementary groups when it changes the uid.
        cmd.uid(uid).gid(gid);
    }
    let mut child = cmd
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", path.display()))?;
    if let Some(mut i) = child.stdin.take() {
        // The shim may exit before reading everything (bad environment): ignore a broken pipe.
        let _ = i.write_all(stdin);
    }
    let out = child.wait_with_output()?;
    Ok(ShimOutput {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        took: start.elapsed(),
    })
}
