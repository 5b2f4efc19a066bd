//! CPU time of processes from `/proc/<pid>/stat`, for benchmarks that say where the CPU went.

use std::collections::{BTreeMap, HashMap};

/// Clock ticks per second (`getconf CLK_TCK`; 100 when it cannot be read).
pub fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// The command name and the fields after it of `/proc/<pid>/stat`.
fn stat(pid: u32) -> Option<(String, Vec<u64>)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (head, rest) = text.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_string();
    // Field 3 (state) is a letter: parsed as 0.
    let fields = rest.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0)).collect();
    Some((comm, fields))
}

/// utime + stime of one process, clock ticks (0 when it is gone).
pub fn cpu_ticks(pid: u32) -> u64 {
    stat(pid).map_or(0, |(_, f)| f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0))
}

/// Every process's command name and CPU ticks, its own and those of the children it reaped
/// (utime + stime + cutime + cstime): the CNI plugins a runtime executes count towards it.
#[derive(Clone, Debug, Default)]
pub struct CpuSnapshot {
    by_pid: HashMap<u32, (String, u64)>,
}

impl CpuSnapshot {
    /// Now.
    pub fn take() -> Self {
        let mut by_pid = HashMap::new();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for e in dir.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
                if let Some((comm, f)) = stat(pid) {
                    let at = |i: usize| f.get(i).copied().unwrap_or(0);
                    by_pid.insert(pid, (comm, at(11) + at(12) + at(13) + at(14)));
                }
            }
        }
        Self { by_pid }
    }

    /// CPU seconds spent between `self` and `later`, summed by `group` of the command name, over
    /// the processes alive at `later` (a process that started in between counts whole; one that
    /// ended in between counts only through the parent that reaped it).
    pub fn since(&self, later: &CpuSnapshot, group: impl Fn(&str) -> String) -> BTreeMap<String, f64> {
        let tck = clock_ticks();
        let mut out: BTreeMap<String, f64> = BTreeMap::new();
        for (pid, (comm, ticks)) in &later.by_pid {
            let before = match self.by_pid.get(pid) {
                Some((c, t)) if c == comm => *t,
                _ => 0,
            };
            *out.entry(group(comm)).or_default() += ticks.saturating_sub(before) as f64 / tck;
        }
        out
    }
}
