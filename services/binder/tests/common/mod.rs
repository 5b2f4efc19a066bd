//! What the binder's kernel-facing suites share: running commands, names unique to the process,
//! and network namespaces and host links removed by guards, also when an assertion fails.
// Each suite uses its own part of this module.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Runs a prepared command; returns (success, stdout + stderr).
pub fn run_cmd(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Runs a command; returns (success, stdout + stderr).
pub fn run(cmd: &str, args: &[&str]) -> (bool, String) {
    run_cmd(Command::new(cmd).args(args))
}

/// Runs a command that must succeed; returns its output.
pub fn ok(cmd: &str, args: &[&str]) -> String {
    let (success, text) = run(cmd, args);
    assert!(success, "{cmd} {} failed: {text}", args.join(" "));
    text
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

/// A name unique to this process and call: `<prefix><pid hex>x<n>`.
fn numbered(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}{:x}x{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// An interface name unique to this process and call ([`numbered`]), at most 15 characters (an
/// interface name's limit).
pub fn unique(prefix: &str) -> String {
    let name = numbered(prefix);
    assert!(name.len() <= 15, "{name} is too long for an interface name");
    name
}

/// A network namespace (`ip netns add`) that is deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(prefix: &str) -> Self {
        // Namespace names have no interface name's length limit.
        let name = numbered(prefix);
        ok("ip", &["netns", "add", &name]);
        Netns { name }
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/var/run/netns/{}", self.name))
    }

    /// `ip netns exec <ns> args...`
    pub fn exec(&self, args: &[&str]) -> (bool, String) {
        let mut all = vec!["netns", "exec", self.name.as_str()];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// `ip -n <ns> args...`
    pub fn ip(&self, args: &[&str]) -> (bool, String) {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// One ping from inside the namespace, waiting 2 s at most.
    pub fn ping(&self, args: &[&str]) -> (bool, String) {
        let mut all = vec!["ping", "-c1", "-W2"];
        all.extend_from_slice(args);
        self.exec(&all)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run("ip", &["netns", "del", &self.name]);
    }
}

/// Host links deleted on drop (a test bridge, host ends left by a failing assertion).
pub struct HostLinks(pub Vec<String>);

impl Drop for HostLinks {
    fn drop(&mut self) {
        for l in &self.0 {
            if host_link_exists(l) {
                let _ = run("ip", &["link", "del", l]);
            }
        }
    }
}

/// Whether the link exists in this thread's namespace.
pub fn host_link_exists(name: &str) -> bool {
    run("ip", &["link", "show", "dev", name]).0
}
