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

/// Runs `kuryr-cni` with exactly `env` (nothing inherited) and `stdin`.
pub fn run_shim(env: &[(&str, &str)], stdin: &[u8]) -> Result<ShimOutput> {
    let path = bin_path("kuryr-cni")?;
    let start = Instant::now();
    let mut child = Command::new(&path)
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
