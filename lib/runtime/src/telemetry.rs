//! Logging: tracing to stderr, as text or JSON.

use tracing_subscriber::EnvFilter;

use crate::config::{CommonArgs, LogFormat};

/// Installs the global tracing subscriber. Fails with a message naming the bad filter.
pub fn init_logging(args: &CommonArgs) -> anyhow::Result<()> {
    let filter = EnvFilter::try_new(&args.log)
        .map_err(|e| anyhow::anyhow!("--log `{}` is not a valid filter: {e}", args.log))?;
    // Colours only for a terminal: log files and collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    let res = match args.log_format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).try_init(),
    };
    // A subscriber may already be installed (tests start several servers in one process).
    if let Err(e) = res {
        tracing::debug!(error = %e, "logging already initialised");
    }
    Ok(())
}
