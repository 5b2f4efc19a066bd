//! The upstream Kubernetes end-to-end tests (`e2e.test`, built from the same pinned module as the
//! cluster's binaries) run against a [`RealCluster`] with kuryr installed from `deploy/` — the peer
//! suite that judges kuryr as a cluster's network and Service dataplane.
//!
//! [`prepare`] builds what the cluster needs (the test images, the `kuryr-rs` image from the
//! built binaries), starts the cluster, installs kuryr and the cluster DNS; [`run_e2e`] runs
//! `e2e.test` inside the control-plane node's network namespace (where a cluster's own test pods
//! would run it) and returns ginkgo's summary. Everything `e2e.test` prints goes to the caller's
//! stdout and to `e2e.log` in the report directory, with its JUnit report beside it.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

use crate::realcluster::{RealCluster, RealClusterOptions};
use crate::services::{bin_path, tool_path};
use crate::util::run_command as run;
use crate::util::{env_script, parse_env_file, repo_root};

/// The sig-network conformance tests (45 in v1.34.4).
pub const SIG_NETWORK_CONFORMANCE: &str = r"\[sig-network\].*\[Conformance\]";
/// The subset `make test` runs: Networking and Services conformance (21 in v1.34.4).
pub const NETWORKING_AND_SERVICES: &str = r"\[sig-network\].*(Networking|Services).*\[Conformance\]";

/// What a cluster for the e2e tests is made of.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Nodes (e2e's networking tests want at least two schedulable ones).
    pub nodes: usize,
    /// The kuryr overlay to install (`deploy/overlays/<overlay>`).
    pub overlay: String,
    /// Where kuryr's binaries come from (their image is assembled from them).
    pub bin_dir: PathBuf,
    /// The cluster's state directory (`None`: a fresh one under /tmp).
    pub state_dir: Option<PathBuf>,
}

impl Default for Setup {
    fn default() -> Self {
        let bin_dir = bin_path("kuryr-binder")
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .unwrap_or_else(|| repo_root().join("target/debug"));
        Self { nodes: 2, overlay: "embedded".into(), bin_dir, state_dir: None }
    }
}

/// The images every node imports, and the names the cluster needs from them.
#[derive(Debug, Clone)]
pub struct Images {
    /// OCI image-layout tars.
    pub tars: Vec<PathBuf>,
    /// The pod sandbox image.
    pub pause: String,
    /// CoreDNS, for the cluster DNS.
    pub coredns: String,
}

/// Builds (or finds cached) the e2e test images and CoreDNS (`tests/env/images/e2e.sh`), and the
/// `kuryr-rs` image from the binaries in `bin_dir` (`tests/env/images/kuryr-image.sh`).
pub async fn images(bin_dir: &Path, out: &Path) -> Result<Images> {
    std::fs::create_dir_all(out)?;
    let mut cmd = Command::new("bash");
    cmd.arg(env_script("images/e2e.sh"));
    let listing = run(cmd, None, Duration::from_secs(900)).await.context("building the e2e images")?;
    let env: Vec<(String, String)> = parse_env_file(&listing);
    let get = |k: &str| {
        env.iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .with_context(|| format!("e2e.sh did not print {k}"))
    };
    let mut tars: Vec<PathBuf> =
        env.iter().filter(|(k, _)| k.ends_with("_TAR")).map(|(_, v)| PathBuf::from(v)).collect();
    tars.push(kuryr_image(bin_dir, out).await?);
    Ok(Images { tars, pause: get("PAUSE_IMAGE")?, coredns: get("COREDNS_IMAGE")? })
}

/// The `kuryr-rs` image (the name `deploy/` uses) assembled from the binaries in `bin_dir`
/// (`tests/env/images/kuryr-image.sh`), as `out/kuryr-rs.tar`.
pub async fn kuryr_image(bin_dir: &Path, out: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(out)?;
    let kuryr = out.join("kuryr-rs.tar");
    let mut cmd = Command::new("bash");
    cmd.arg(env_script("images/kuryr-image.sh")).arg(bin_dir).arg(&kuryr);
    run(cmd, None, Duration::from_secs(300)).await.context("assembling the kuryr-rs image")?;
    Ok(kuryr)
}

/// A cluster ready for e2e.test: nodes up, kuryr installed and serving, cluster DNS rolled out.
pub async fn prepare(setup: &Setup) -> Result<RealCluster> {
    let t0 = Instant::now();
    let out = repo_root().join("target/kuryr-images");
    let images = images(&setup.bin_dir, &out).await?;
    eprintln!("conformance: images ready after {:.0?}", t0.elapsed());
    let cluster = RealCluster::start(RealClusterOptions {
        nodes: setup.nodes,
        images: images.tars.clone(),
        sandbox_image: images.pause.clone(),
        state_dir: setup.state_dir.clone(),
        ..RealClusterOptions::default()
    })
    .await?;
    eprintln!("conformance: {} nodes registered after {:.0?}", setup.nodes, t0.elapsed());
    cluster.install_kuryr(&setup.overlay, "").await.context("installing kuryr")?;
    eprintln!("conformance: kuryr installed, nodes Ready after {:.0?}", t0.elapsed());
    cluster.install_dns(&images.coredns).await.context("installing the cluster DNS")?;
    eprintln!("conformance: cluster DNS ready after {:.0?}", t0.elapsed());
    Ok(cluster)
}

/// Ginkgo's verdict, read from its summary line (`SUCCESS! -- 21 Passed | 0 Failed | ...`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// The summary line as ginkgo printed it.
    pub line: String,
    pub passed: u32,
    pub failed: u32,
    pub pending: u32,
    pub skipped: u32,
    /// The names of the failed specs (ginkgo's `[FAIL]` lines of its summary).
    pub failures: Vec<String>,
}

impl Summary {
    /// Parses e2e.test's output; `None` when it printed no summary (it crashed or was killed).
    pub fn parse(output: &str) -> Option<Self> {
        let line = output.lines().rev().find(|l| l.contains(" Passed | ") && l.contains(" Failed"))?.trim().to_string();
        let count = |what: &str| -> u32 {
            line.split('|')
                .find_map(|part| {
                    let part = part.trim().trim_start_matches(|c: char| !c.is_ascii_digit());
                    let (n, rest) = part.split_once(' ')?;
                    (rest.trim() == what).then(|| n.parse().ok()).flatten()
                })
                .unwrap_or(0)
        };
        let failures =
            output.lines().filter_map(|l| l.trim().strip_prefix("[FAIL] ")).map(str::to_string).collect::<Vec<_>>();
        Some(Summary {
            passed: count("Passed"),
            failed: count("Failed"),
            pending: count("Pending"),
            skipped: count("Skipped"),
            failures,
            line,
        })
    }
}

/// Runs `e2e.test` with `focus` (and `skip`, if any) against `cluster`, writing its JUnit report
/// and full log to `report_dir`; its output is also copied to stdout as it comes.
pub async fn run_e2e(cluster: &RealCluster, focus: &str, skip: Option<&str>, report_dir: &Path) -> Result<Summary> {
    std::fs::create_dir_all(report_dir)?;
    let e2e = tool_path("e2e.test")?;
    let kubectl = tool_path("kubectl")?;
    let kubeconfig = cluster.internal_kubeconfig();
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/var/run/netns/{}", cluster.control_plane_netns()))
        .arg("--")
        .arg(&e2e)
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--kubectl-path={}", kubectl.display()))
        .arg("--provider=skeleton")
        .arg(format!("--report-dir={}", report_dir.display()))
        .arg(format!("--ginkgo.focus={focus}"))
        .arg("--ginkgo.no-color")
        .arg("--ginkgo.timeout=90m");
    if let Some(skip) = skip {
        cmd.arg(format!("--ginkgo.skip={skip}"));
    }
    cmd.env("KUBECONFIG", &kubeconfig)
        .current_dir(report_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().context("starting e2e.test")?;
    let mut log = tokio::fs::File::create(report_dir.join("e2e.log")).await?;
    let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
        bail!("e2e.test's output is not captured");
    };
    let mut lines = futures::stream::select(
        tokio_stream::wrappers::LinesStream::new(BufReader::new(stdout).lines()),
        tokio_stream::wrappers::LinesStream::new(BufReader::new(stderr).lines()),
    );
    let mut output = String::new();
    use futures::StreamExt as _;
    while let Some(line) = lines.next().await {
        let line = line?;
        log.write_all(line.as_bytes()).await?;
        log.write_all(b"\n").await?;
        #[allow(clippy::print_stdout)] // the run's output is what the caller asked for
        {
            println!("{line}");
        }
        output.push_str(&line);
        output.push('\n');
    }
    let status = child.wait().await?;
    log.flush().await?;
    Summary::parse(&output).with_context(|| {
        format!("e2e.test ({status}) printed no summary; its log: {}", report_dir.join("e2e.log").display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ginkgo_summaries() {
        let out = "...\n  [FAIL] [sig-network] Services should be able to create a functioning NodePort service [Conformance]\n\
                   Ran 21 of 7000 Specs in 230.1 seconds\n\
                   FAIL! -- 20 Passed | 1 Failed | 0 Pending | 6979 Skipped\n--- FAIL: TestE2E (230.2s)\n";
        let s = Summary::parse(out).unwrap();
        assert_eq!((s.passed, s.failed, s.pending, s.skipped), (20, 1, 0, 6979));
        assert_eq!(s.failures.len(), 1);
        assert!(s.line.starts_with("FAIL! -- 20 Passed"));
        let ok = Summary::parse("SUCCESS! -- 45 Passed | 0 Failed | 0 Pending | 6955 Skipped\nPASS\n").unwrap();
        assert_eq!((ok.passed, ok.failed), (45, 0));
        assert!(Summary::parse("panic: something\n").is_none());
    }
}
