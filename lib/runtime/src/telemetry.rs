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

/// An error and its causes on one line (`top: cause: root cause`), for logs and Events: many
/// errors (transport, API clients) say little at the top.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    /// An error with a message and, maybe, a cause.
    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn an_error_chain_names_every_cause() {
        let root = Layer("connection refused", None);
        let top = Layer("transport error", Some(Box::new(Layer("tcp connect", Some(Box::new(root))))));
        assert_eq!(super::error_chain(&top), "transport error: tcp connect: connection refused");
        assert_eq!(super::error_chain(&Layer("alone", None)), "alone");
    }
}
