//! Small shared helpers for the test environment.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result, bail};

/// The repository root (the workspace directory).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// A path inside `tests/env/`.
pub fn env_script(name: &str) -> PathBuf {
    repo_root().join("tests/env").join(name)
}

/// A short identifier unique across concurrently running test binaries and within one: the pid
/// plus a per-process counter. Short because it ends up in interface and netns names (15 bytes).
pub fn unique_id() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{:x}x{:x}", std::process::id() & 0xfffff, n)
}

/// A TCP port on 127.0.0.1 that is free now, for a server started a moment later. Taken at
/// random from the [`PORT_POOL`] ports below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`): outgoing connections get their local ports from that range,
/// so a port taken from it could be some client's by the time the server binds it (a database
/// migration or a bootstrap can sit in between). Below the range, only another picker choosing
/// the same port in the same moment collides; servers started with it fail loudly rather than
/// silently share it. A range that starts too low to leave 1,000 ports below it gets any free
/// port, as before.
pub fn free_port() -> Result<u16> {
    let high = ephemeral_low();
    let low = high.saturating_sub(PORT_POOL).max(1024);
    if high.saturating_sub(low) < 1000 {
        // An ephemeral range that starts too low to leave ports below it: any free port.
        let l = TcpListener::bind("127.0.0.1:0").context("binding an ephemeral port")?;
        return Ok(l.local_addr()?.port());
    }
    for _ in 0..256 {
        let port = fastrand::u16(low..high);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free TCP port among 256 tries in {low}..{high} on 127.0.0.1")
}

/// How many ports below the ephemeral range [`free_port`] draws from.
pub const PORT_POOL: u16 = 12_000;

/// The first port of the kernel's ephemeral range (32768 when it cannot be read).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// Runs a `tests/env` script with arguments, failing with its output when it exits non-zero.
pub fn run_script(name: &str, args: &[&str]) -> Result<String> {
    let path = env_script(name);
    let out =
        Command::new("bash").arg(&path).args(args).output().with_context(|| format!("running {}", path.display()))?;
    checked_stdout(&format!("{} {args:?}", path.display()), &out)
}

/// The standard output of a command that ran, or, when it failed, an error naming `what` with its
/// exit status, standard output and standard error.
pub fn checked_stdout(what: &str, out: &std::process::Output) -> Result<String> {
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs a command with an optional stdin and a deadline; returns stdout, or fails with both
/// streams (the child is killed when the deadline passes).
pub async fn run_command(
    mut cmd: tokio::process::Command,
    stdin: Option<&[u8]>,
    timeout: std::time::Duration,
) -> Result<String> {
    use tokio::io::AsyncWriteExt as _;
    let what = format!("{:?}", cmd.as_std());
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().with_context(|| format!("spawning {what}"))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input).await.with_context(|| format!("writing stdin of {what}"))?;
    }
    let out = tokio::time::timeout(timeout, child.wait_with_output())
        .await
        .with_context(|| format!("{what} did not finish within {timeout:?}"))?
        .with_context(|| format!("waiting for {what}"))?;
    checked_stdout(&what, &out)
}

/// A new state directory `/tmp/<prefix>…` for an environment's up script, left on disk (from then
/// on its down script, from `Drop` or the watchdog, owns its removal); and whether
/// `KURYR_KEEP_STATE=1` asks to keep it after the test.
pub fn state_dir(prefix: &str) -> Result<(PathBuf, bool)> {
    let keep_state = std::env::var("KURYR_KEEP_STATE").is_ok_and(|v| v == "1");
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .context("creating the state directory under /tmp")?
        .keep();
    Ok((dir, keep_state))
}

/// Runs the down script `script` (named `label` in messages) on `state_dir`, with `--purge` unless
/// the state is to be kept; for `Drop`, which cannot fail: a failure is printed, and where the
/// kept state is.
pub fn run_down_script(script: &Path, label: &str, state_dir: &Path, keep_state: bool) {
    let mut cmd = Command::new("bash");
    cmd.arg(script).arg(state_dir);
    if !keep_state {
        cmd.arg("--purge");
    }
    match cmd.output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => eprintln!(
            "{label} {} failed ({}): {}",
            state_dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => eprintln!("running {label} {}: {e}", state_dir.display()),
    }
    if keep_state {
        eprintln!("KURYR_KEEP_STATE=1: kept {}", state_dir.display());
    }
}

/// Parses `KEY=VALUE` lines (an env file written by the scripts) into pairs.
pub fn parse_env_file(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            if l.is_empty() || l.starts_with('#') {
                return None;
            }
            let (k, v) = l.split_once('=')?;
            Some((k.trim().to_string(), v.trim().trim_matches('"').to_string()))
        })
        .collect()
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The 1, 5 and 15 minute load averages, as the benches print them beside their results (`?`
/// when /proc/loadavg cannot be read).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Where the benches' report says the binaries came from: `KURYR_BIN_DIR`, else cargo's target
/// directories.
pub fn bin_dir() -> String {
    std::env::var("KURYR_BIN_DIR").unwrap_or_else(|_| "target/{debug,release}".into())
}

/// The value of the environment variable `name` (benches' knobs), `default` when unset or
/// empty; a value that does not parse is an error naming the variable.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => {
            v.trim().parse().map_err(|e| anyhow::anyhow!("{name}={v:?} is not a valid value: {e}"))
        }
        _ => Ok(default),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_file_parsing_skips_comments_and_strips_quotes() {
        let got = parse_env_file("# c\nA=1\n\nB=\"x y\"\nnot a pair\n");
        assert_eq!(got, vec![("A".into(), "1".into()), ("B".into(), "x y".into())]);
    }

    #[test]
    fn unique_ids_differ() {
        assert_ne!(unique_id(), unique_id());
    }

    #[test]
    fn free_ports_are_bindable_and_below_the_ephemeral_range() {
        let high = ephemeral_low();
        let ports: std::collections::BTreeSet<u16> = (0..64).map(|_| free_port().unwrap()).collect();
        assert!(ports.len() > 1, "64 picks gave one port: {ports:?}");
        for p in ports {
            assert!((high.saturating_sub(PORT_POOL)..high).contains(&p), "{p} is not in the pool below {high}");
            TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }
}
