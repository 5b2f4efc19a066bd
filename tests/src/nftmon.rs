//! When a change reached the kernel on each node: `nft monitor` in every node's namespace prints a
//! `# new generation` line as each nftables transaction commits. After a change, [`wait_all`] reads
//! `nft list table inet kuryr` on every new generation until the table shows the change; the change
//! counts as programmed on a node at the first transaction committed after the last read that did
//! not show it, and on every node at the latest of those. Used by the dataplane benches
//! (`svc-bench`, `netpol-bench`).

use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::Notify;

use crate::cluster::ClusterNode;
use crate::cluster::svc::nft_table;

/// `nft monitor` in one node's namespace: when each nftables transaction committed there.
#[derive(Debug)]
pub struct Monitor {
    node: String,
    commits: Arc<Mutex<Vec<Instant>>>,
    notify: Arc<Notify>,
    _child: tokio::process::Child,
}

impl Monitor {
    /// Starts `nft monitor` in `node`'s namespace (killed on drop).
    pub async fn start(node: &ClusterNode) -> Result<Monitor> {
        let mut child = tokio::process::Command::new("nsenter")
            .arg(format!("--net={}", node.node.netns_path().display()))
            .args(["--", "nft", "monitor"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting nft monitor")?;
        let stdout = child.stdout.take().context("nft monitor's stdout")?;
        let (commits, notify) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Notify::new()));
        let (c, n) = (commits.clone(), notify.clone());
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with("# new generation") {
                    c.lock().unwrap_or_else(PoisonError::into_inner).push(Instant::now());
                    n.notify_waiters();
                }
            }
        });
        // Let it subscribe before anything is measured.
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(Monitor { node: node.name.clone(), commits, notify, _child: child })
    }

    /// Transactions seen so far.
    pub fn seen(&self) -> usize {
        self.commits.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// When transaction `i` (counting from 0) was seen.
    fn commit(&self, i: usize) -> Option<Instant> {
        self.commits.lock().unwrap_or_else(PoisonError::into_inner).get(i).copied()
    }
}

/// Every node's transaction count, taken just before a change is written.
pub fn baseline(monitors: &[Monitor]) -> Vec<usize> {
    monitors.iter().map(Monitor::seen).collect()
}

/// Waits until `pred` holds for every node's table, reading a node's table again on each of its
/// transactions (and every 100 ms); returns when the change was programmed on the last node —
/// on each node the first transaction after the last read that did not show it (`base`: the
/// count before the change was written) — and how long each table read took (ms).
pub async fn wait_all(
    nodes: &[ClusterNode],
    monitors: &[Monitor],
    base: &[usize],
    timeout: Duration,
    pred: impl Fn(&str) -> bool + Sync,
) -> Result<(Instant, Vec<f64>)> {
    let pred = &pred;
    let per_node = futures::future::join_all(nodes.iter().zip(monitors).zip(base).map(|((n, m), &b)| async move {
        let deadline = Instant::now() + timeout;
        let mut reads = Vec::new();
        // The transactions seen before the last read that did not show the change: the change
        // came with a later one.
        let mut before = b;
        loop {
            let notified = m.notify.notified();
            let seen = m.seen();
            let t = Instant::now();
            let table = nft_table(n).await;
            reads.push(t.elapsed().as_secs_f64() * 1e3);
            if pred(&table) {
                // The monitor's line may trail the read by a moment.
                let until = Instant::now() + Duration::from_secs(2);
                loop {
                    if let Some(at) = m.commit(before) {
                        return Ok((at, reads));
                    }
                    ensure!(Instant::now() < until, "{}: the change shows but no transaction was seen", m.node);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            before = seen;
            if Instant::now() > deadline {
                anyhow::bail!("{}: not programmed after {timeout:?}; table:\n{table}", n.name);
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
        }
    }))
    .await;
    let mut last = None::<Instant>;
    let mut reads = Vec::new();
    for r in per_node {
        let (at, p) = r?;
        last = Some(last.map_or(at, |l| l.max(at)));
        reads.extend(p);
    }
    Ok((last.context("no nodes")?, reads))
}
