//! What a cluster made on the host, written down as it goes, so that another process can remove
//! it after the cluster's own process died without shutting down (`kuryr-lab down` after a
//! crash, or after a SIGKILL). A cluster that shuts down normally removes everything itself and
//! never needs this.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::util::env_script;

/// How long a leftover process gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Everything a cluster created outside its own process memory.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Manifest {
    /// The process that owns the cluster.
    pub owner_pid: u32,
    /// The cluster's directory (service sockets and logs).
    pub dir: Option<PathBuf>,
    /// `kube-up.sh`'s state directory (its servers also stop by themselves when the owner dies).
    pub kube_state_dir: Option<PathBuf>,
    /// The network namespace of the underlay bridge.
    pub underlay_netns: Option<String>,
    /// The service processes (watcher, allocator, binders), by pid and executable.
    pub processes: Vec<ProcessRecord>,
    /// The nodes, as far as they got.
    pub nodes: Vec<NodeRecord>,
}

/// A process the cluster started.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessRecord {
    /// What it is, e.g. `kuryr-binder node-1`.
    pub name: String,
    /// Its pid.
    pub pid: u32,
    /// Its executable: a pid is only acted on while it still runs this file (pids are reused).
    pub exe: PathBuf,
}

/// One node's host state.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node's name.
    pub name: String,
    /// The node's network namespace (containerd's; the binder runs in it too).
    pub netns: Option<String>,
    /// containerd's scratch directory; `state/` in it is what `containerd-down.sh` takes.
    pub containerd_dir: Option<PathBuf>,
    /// The binder's directory (socket, attachment records, log).
    pub binder_dir: Option<PathBuf>,
}

impl Manifest {
    /// The record of node `name`, created if missing.
    pub fn node_mut(&mut self, name: &str) -> &mut NodeRecord {
        if let Some(i) = self.nodes.iter().position(|n| n.name == name) {
            return &mut self.nodes[i];
        }
        self.nodes.push(NodeRecord { name: name.to_string(), ..NodeRecord::default() });
        let last = self.nodes.len() - 1;
        &mut self.nodes[last]
    }

    /// Removes whatever of this manifest is still on the host: stops the recorded processes that
    /// still run their recorded executable, runs `containerd-down.sh` for each node, deletes the
    /// network namespaces, stops the API server (`kube-down.sh --purge`) and removes the
    /// directories. Idempotent; returns what it did, and the failures.
    pub fn cleanup(&self) -> (Vec<String>, Vec<String>) {
        let (mut done, mut failed) = (Vec::new(), Vec::new());
        for p in &self.processes {
            if process_alive(p) {
                match stop_process(p) {
                    Ok(()) => done.push(format!("stopped {} (pid {})", p.name, p.pid)),
                    Err(e) => failed.push(format!("{} (pid {}): {e}", p.name, p.pid)),
                }
            }
        }
        for n in &self.nodes {
            if let Some(dir) = &n.containerd_dir {
                let state = dir.join("state");
                if state.exists() {
                    match script("containerd-down.sh", &[&state.to_string_lossy()]) {
                        Ok(()) => done.push(format!("stopped containerd of {}", n.name)),
                        Err(e) => failed.push(format!("containerd-down.sh {}: {e}", state.display())),
                    }
                }
                // Only once containerd-down.sh has unmounted everything under it.
                if dir.exists() && !state.exists() {
                    remove_dir(dir, &mut done, &mut failed);
                }
            }
            if let Some(dir) = &n.binder_dir {
                remove_dir(dir, &mut done, &mut failed);
            }
            if let Some(ns) = &n.netns {
                delete_netns(ns, &mut done, &mut failed);
            }
        }
        if let Some(ns) = &self.underlay_netns {
            delete_netns(ns, &mut done, &mut failed);
        }
        if let Some(dir) = &self.kube_state_dir
            && dir.exists()
        {
            match script("kube-down.sh", &[&dir.to_string_lossy(), "--purge"]) {
                Ok(()) => done.push("stopped the API server and etcd".to_string()),
                Err(e) => failed.push(format!("kube-down.sh {}: {e}", dir.display())),
            }
        }
        if let Some(dir) = &self.dir {
            remove_dir(dir, &mut done, &mut failed);
        }
        (done, failed)
    }

    /// What of this manifest still exists on the host (empty after a clean shutdown).
    pub fn leftovers(&self) -> Vec<String> {
        let mut left = Vec::new();
        for p in self.processes.iter().filter(|p| process_alive(p)) {
            left.push(format!("process {} (pid {})", p.name, p.pid));
        }
        let netns = self.nodes.iter().filter_map(|n| n.netns.as_deref()).chain(self.underlay_netns.as_deref());
        for ns in netns.filter(|ns| netns_path(ns).exists()) {
            left.push(format!("network namespace {ns}"));
        }
        let dirs = self
            .nodes
            .iter()
            .flat_map(|n| [n.containerd_dir.as_deref(), n.binder_dir.as_deref()])
            .chain([self.dir.as_deref(), self.kube_state_dir.as_deref()])
            .flatten();
        for d in dirs.filter(|d| d.exists()) {
            left.push(format!("directory {}", d.display()));
        }
        left
    }
}

fn netns_path(name: &str) -> PathBuf {
    Path::new("/var/run/netns").join(name)
}

impl ProcessRecord {
    /// True while the pid exists, is not a zombie, and still runs the recorded executable.
    pub fn alive(&self) -> bool {
        process_alive(self)
    }
}

fn process_alive(p: &ProcessRecord) -> bool {
    let Ok(exe) = std::fs::read_link(format!("/proc/{}/exe", p.pid)) else {
        return false;
    };
    // A rebuilt binary shows as "<path> (deleted)".
    let same = exe == p.exe || exe.to_string_lossy().strip_suffix(" (deleted)") == Some(&*p.exe.to_string_lossy());
    let zombie = std::fs::read_to_string(format!("/proc/{}/stat", p.pid))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')))
        .unwrap_or(true);
    same && !zombie
}

/// SIGTERM, then SIGKILL after [`STOP_GRACE`].
fn stop_process(p: &ProcessRecord) -> anyhow::Result<()> {
    let pid = p.pid.to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status()?;
    let deadline = Instant::now() + STOP_GRACE;
    while process_alive(p) {
        if Instant::now() > deadline {
            let _ = Command::new("kill").args(["-KILL", &pid]).status()?;
            std::thread::sleep(Duration::from_millis(200));
            anyhow::ensure!(!process_alive(p), "survived SIGKILL");
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn delete_netns(name: &str, done: &mut Vec<String>, failed: &mut Vec<String>) {
    if !netns_path(name).exists() {
        return;
    }
    match Command::new("ip").args(["netns", "delete", name]).output() {
        Ok(o) if o.status.success() => done.push(format!("deleted network namespace {name}")),
        Ok(o) => failed.push(format!("ip netns delete {name}: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => failed.push(format!("ip netns delete {name}: {e}")),
    }
}

/// `rm -rf --one-file-system`: never descends into something still mounted below `dir`.
fn remove_dir(dir: &Path, done: &mut Vec<String>, failed: &mut Vec<String>) {
    if !dir.exists() {
        return;
    }
    match Command::new("rm").arg("-rf").arg("--one-file-system").arg(dir).output() {
        Ok(o) if o.status.success() => done.push(format!("removed {}", dir.display())),
        Ok(o) => failed.push(format!("rm -rf {}: {}", dir.display(), String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => failed.push(format!("rm -rf {}: {e}", dir.display())),
    }
}

fn script(name: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("bash").arg(env_script(name)).args(args).output()?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr).trim());
    Ok(())
}
