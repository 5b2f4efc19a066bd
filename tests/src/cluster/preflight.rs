//! What a machine needs to run a [`Cluster`](super::Cluster), checked up front so that a missing
//! piece is named with what to do about it instead of surfacing as a failure halfway through.

use std::path::Path;

use crate::services::{bin_path, tool_path};

/// The Go tools `tests/env/tools.sh` builds that a cluster of real nodes runs.
pub const TOOLS: [&str; 8] =
    ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl", "etcd", "coredns", "grpcurl"];
/// The project's binaries a cluster runs.
pub const BINARIES: [&str; 6] =
    ["kuryr-watcher", "kuryr-vif-allocator", "kuryr-lbaas", "kuryr-policy", "kuryr-binder", "kuryr-cni"];

/// One prerequisite.
#[derive(Debug, Clone)]
pub struct Check {
    /// What was checked (with the path found, where there is one).
    pub what: String,
    /// Whether it is there.
    pub ok: bool,
    /// What to do when it is not.
    pub hint: &'static str,
}

/// Every prerequisite: root, the system commands, the reference loopback plugin, the tools and the
/// project's binaries.
pub fn checks() -> Vec<Check> {
    let mut out = vec![Check {
        what: "running as root".into(),
        ok: effective_uid() == Some(0),
        hint: "the cluster creates network namespaces and runs containerd; run it as root",
    }];
    for (cmd, hint) in [
        ("containerd", "apt-get install containerd (or `make setup`)"),
        ("runc", "apt-get install runc (or `make setup`)"),
        ("ctr", "comes with the containerd package"),
        ("ip", "apt-get install iproute2"),
        ("nsenter", "apt-get install util-linux"),
        ("ping", "apt-get install iputils-ping"),
        ("openssl", "apt-get install openssl"),
        ("curl", "apt-get install curl"),
        ("python3", "apt-get install python3"),
    ] {
        out.push(Check { what: format!("{cmd} on PATH"), ok: on_path(cmd), hint });
    }
    out.push(Check {
        what: "/usr/lib/cni/loopback (CRI runs it for lo)".into(),
        ok: Path::new("/usr/lib/cni/loopback").is_file(),
        hint: "apt-get install containernetworking-plugins (or `make setup`)",
    });
    for t in TOOLS {
        let r = tool_path(t);
        let shown = r.as_ref().map_or_else(|_| "missing".to_string(), |p| p.display().to_string());
        out.push(Check { what: format!("{t} ({shown})"), ok: r.is_ok(), hint: "run `bash tests/env/tools.sh`" });
    }
    for b in BINARIES {
        let r = bin_path(b);
        let shown = r.as_ref().map_or_else(|_| "not built".to_string(), |p| p.display().to_string());
        out.push(Check {
            what: format!("{b} ({shown})"),
            ok: r.is_ok(),
            hint: "run `cargo build --release --workspace --bins` (`make lab` does)",
        });
    }
    out
}

/// True when every Go tool is built.
pub fn tools_built() -> bool {
    TOOLS.iter().all(|t| tool_path(t).is_ok())
}

/// The effective uid, from /proc (no libc call needed).
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().nth(1)?.parse().ok()
}

fn on_path(cmd: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(cmd).is_file()))
}
