//! `kuryr-conformance` (`make conformance`): a cluster of real nodes with kuryr installed from
//! `deploy/` as a user installs it, judged by the upstream Kubernetes e2e tests. Prints what
//! e2e.test prints and ends with ginkgo's own summary line (`N Passed | M Failed | ...`); exits
//! non-zero when a test failed or none ran.
#![allow(clippy::print_stdout)] // a command whose output is the point

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use kuryr_tests::conformance::{self, SIG_NETWORK_CONFORMANCE, Setup};
use kuryr_tests::util::repo_root;

#[derive(Debug, Parser)]
#[command(name = "kuryr-conformance", about = "Upstream e2e.test against a real-node cluster running kuryr.")]
struct Cli {
    /// Ginkgo focus: which tests to run.
    #[arg(long, env = "CONFORMANCE_FOCUS", default_value = SIG_NETWORK_CONFORMANCE)]
    focus: String,
    /// Ginkgo skip.
    #[arg(long, env = "CONFORMANCE_SKIP")]
    skip: Option<String>,
    /// Nodes.
    #[arg(long, env = "CONFORMANCE_NODES", default_value_t = 2)]
    nodes: usize,
    /// The kuryr overlay installed (`deploy/overlays/<overlay>`).
    #[arg(long, default_value = "embedded")]
    overlay: String,
    /// Where the JUnit report and e2e.log go (default `target/conformance/<unix time>`).
    #[arg(long)]
    report_dir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kuryr-conformance: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode> {
    let t0 = Instant::now();
    let report_dir = cli.report_dir.unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        repo_root().join("target/conformance").join(now.to_string())
    });
    let setup = Setup { nodes: cli.nodes, overlay: cli.overlay, ..Setup::default() };
    let cluster = conformance::prepare(&setup).await?;
    let prepared = t0.elapsed();
    let result = conformance::run_e2e(&cluster, &cli.focus, cli.skip.as_deref(), &report_dir).await;
    let down = cluster.shutdown().await;
    let summary = result?;
    down?;
    println!(
        "kuryr-conformance: cluster with kuryr ready in {prepared:.0?}, total {:.0?}; report in {}",
        t0.elapsed(),
        report_dir.display()
    );
    println!("{}", summary.line);
    Ok(if summary.failed == 0 && summary.passed > 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
