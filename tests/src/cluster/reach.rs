//! Reachability between pods: `ping` from each pod's network namespace to every other pod's
//! addresses, as a matrix (within a node and across nodes, per address family).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::StreamExt;

/// Pings run at once (each is a short-lived `nsenter` + `ping`).
const PARALLEL: usize = 8;
/// Bound on one `ping` process.
const PING_TIMEOUT: Duration = Duration::from_secs(10);

/// A pod as seen from the host: where its network namespace is and what its addresses are.
#[derive(Debug, Clone)]
pub struct PodEndpoint {
    /// `namespace/name`.
    pub pod: String,
    /// The node it runs on.
    pub node: String,
    /// Its network namespace (the path CRI gave CNI).
    pub netns: PathBuf,
    /// Its addresses.
    pub ips: Vec<IpAddr>,
}

/// One ping from one pod to one address of another.
#[derive(Debug, Clone)]
pub struct Ping {
    /// Index of the source in the endpoint list.
    pub from: usize,
    /// Index of the destination.
    pub to: usize,
    /// The destination address.
    pub ip: IpAddr,
    /// Whether replies came back.
    pub ok: bool,
    /// Whether source and destination are on the same node.
    pub same_node: bool,
    /// How long the ping took (process start to exit).
    pub took: Duration,
    /// ping's output when it failed.
    pub output: String,
    /// The first try's output when only the second try got replies.
    pub first_failure: Option<String>,
}

/// Pings every address of every other endpoint from every endpoint: `n·(n-1)` pairs per family.
/// A first failure is retried once (the first packet also resolves the neighbour).
pub async fn ping_all(endpoints: &[PodEndpoint]) -> Vec<Ping> {
    let mut jobs = Vec::new();
    for (from, src) in endpoints.iter().enumerate() {
        for (to, dst) in endpoints.iter().enumerate() {
            if from == to {
                continue;
            }
            for ip in &dst.ips {
                jobs.push((from, to, *ip, src.node == dst.node, src.netns.clone()));
            }
        }
    }
    let mut out: Vec<Ping> = futures::stream::iter(jobs)
        .map(|(from, to, ip, same_node, netns)| async move {
            let t = Instant::now();
            let (mut ok, mut output) = ping(&netns, ip).await;
            let mut first_failure = None;
            if !ok {
                let first = std::mem::take(&mut output);
                (ok, output) = ping(&netns, ip).await;
                first_failure = ok.then_some(first);
            }
            Ping { from, to, ip, ok, same_node, took: t.elapsed(), output, first_failure }
        })
        .buffer_unordered(PARALLEL)
        .collect()
        .await;
    out.sort_by_key(|p| (p.from, p.to, p.ip.is_ipv6()));
    out
}

/// One `ping -c 1 -W 2` from inside `netns`; (replied, output).
pub async fn ping(netns: &std::path::Path, ip: IpAddr) -> (bool, String) {
    let mut cmd = tokio::process::Command::new("nsenter");
    cmd.arg(format!("--net={}", netns.display()))
        .args(["--", "ping", "-n", "-q", "-c", "1", "-W", "2"])
        .arg(ip.to_string())
        .kill_on_drop(true);
    match tokio::time::timeout(PING_TIMEOUT, cmd.output()).await {
        Ok(Ok(o)) => {
            let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
            (o.status.success(), text)
        }
        Ok(Err(e)) => (false, format!("running nsenter ping: {e}")),
        Err(_) => (false, format!("ping {ip} took over {PING_TIMEOUT:?}")),
    }
}

/// The pings as a table, one row per source and one column per destination: `v4+v6` when every
/// address of the destination answered, `v4` when it has only IPv4, `FAIL` or `!v4`/`!v6` for
/// what did not answer.
pub fn matrix(endpoints: &[PodEndpoint], pings: &[Ping]) -> String {
    use std::fmt::Write;
    let short = |e: &PodEndpoint| e.pod.rsplit('/').next().unwrap_or(&e.pod).to_string();
    let width = endpoints.iter().map(|e| short(e).len()).max().unwrap_or(5).max(5) + 2;
    let label = endpoints.iter().map(|e| short(e).len() + e.node.len() + 3).max().unwrap_or(10).max(10) + 2;
    let mut out = format!("  {:<label$}", "from \\ to");
    for e in endpoints {
        let _ = write!(out, "{:>width$}", short(e));
    }
    out.push('\n');
    for (i, src) in endpoints.iter().enumerate() {
        let _ = write!(out, "  {:<label$}", format!("{} ({})", short(src), src.node));
        for j in 0..endpoints.len() {
            let family = |v6: bool| {
                let mine: Vec<_> = pings.iter().filter(|p| p.from == i && p.to == j && p.ip.is_ipv6() == v6).collect();
                (!mine.is_empty()).then(|| mine.iter().all(|p| p.ok))
            };
            let cell = match (i == j, family(false), family(true)) {
                (true, _, _) => "·",
                (false, Some(true), Some(true)) => "v4+v6",
                (false, Some(true), None) => "v4",
                (false, None, Some(true)) => "v6",
                (false, Some(true), Some(false)) => "v4 !v6",
                (false, Some(false), Some(true)) => "!v4 v6",
                _ => "FAIL",
            };
            let _ = write!(out, "{cell:>width$}");
        }
        out.push('\n');
    }
    out
}

/// Counts per (same node?, IPv6?): (succeeded, total).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// IPv4 within a node.
    pub v4_local: (usize, usize),
    /// IPv4 across nodes.
    pub v4_remote: (usize, usize),
    /// IPv6 within a node.
    pub v6_local: (usize, usize),
    /// IPv6 across nodes.
    pub v6_remote: (usize, usize),
}

impl Summary {
    /// Tallies `pings`.
    pub fn of(pings: &[Ping]) -> Summary {
        let mut s = Summary::default();
        for p in pings {
            let slot = match (p.ip.is_ipv6(), p.same_node) {
                (false, true) => &mut s.v4_local,
                (false, false) => &mut s.v4_remote,
                (true, true) => &mut s.v6_local,
                (true, false) => &mut s.v6_remote,
            };
            slot.1 += 1;
            if p.ok {
                slot.0 += 1;
            }
        }
        s
    }

    /// True when every ping got replies (and there was at least one).
    pub fn all_ok(&self) -> bool {
        let all = [self.v4_local, self.v4_remote, self.v6_local, self.v6_remote];
        all.iter().all(|(ok, n)| ok == n) && all.iter().any(|(_, n)| *n > 0)
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let part = |name: &str, (ok, n): (usize, usize)| format!("{name} {ok}/{n}");
        write!(
            f,
            "{}, {}, {}, {}",
            part("IPv4 same node", self.v4_local),
            part("IPv4 across nodes", self.v4_remote),
            part("IPv6 same node", self.v6_local),
            part("IPv6 across nodes", self.v6_remote)
        )
    }
}
