//! `kuryr-migrate`: see the library's documentation. Prints one line per object (its remaining
//! steps, or why it is blocked) and a summary line last; exits 0 when everything was migrated
//! (or, with `--dry-run`, could be), 2 when some objects are blocked, 1 on an error.

use std::process::ExitCode;

use clap::Parser as _;
use kuryr_migrate::Args;

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log).unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    match kuryr_migrate::exec::run(&args).await {
        Ok(summary) => {
            kuryr_migrate::report(&mut std::io::stdout(), &summary.line(args.dry_run));
            if summary.blocked > 0 { ExitCode::from(2) } else { ExitCode::SUCCESS }
        }
        Err(e) => {
            kuryr_migrate::report(&mut std::io::stderr(), &format!("kuryr-migrate: error: {e:#}"));
            ExitCode::from(1)
        }
    }
}
