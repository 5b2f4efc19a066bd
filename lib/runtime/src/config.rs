//! Flags every service shares. Each service flattens [`CommonArgs`] into its own clap config and
//! declares its own `--listen` and `--metrics-listen` defaults.

use std::time::Duration;

use clap::{Args, ValueEnum};

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Flags shared by every kuryr service.
#[derive(Clone, Debug, Args)]
pub struct CommonArgs {
    /// Log format.
    #[arg(long, env = "KURYR_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Log filter in tracing's env-filter syntax (for example `info` or `info,kuryr_binder=debug`).
    #[arg(long, env = "KURYR_LOG", default_value = "info")]
    pub log: String,

    /// How long to wait for in-flight requests and streams to finish after SIGTERM before exiting.
    #[arg(long, env = "KURYR_SHUTDOWN_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    #[command(flatten)]
    pub auth: AuthArgs,
}

/// How calls between kuryr's services are authenticated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AuthMode {
    /// ServiceAccount tokens: callers send one (audience `--auth-audience`), checked with the
    /// Kubernetes TokenReview API, and each method admits only the accounts whose role it is.
    Token,
    /// INSECURE, for development only: nothing is checked and nothing is sent; anyone who can
    /// reach the port can call every method.
    None,
}

/// Authentication between kuryr's services; every service takes these.
#[derive(Clone, Debug, Args)]
pub struct AuthArgs {
    /// How calls to this service's API are authenticated, and whether calls it makes to other
    /// kuryr services carry a token. `none` is INSECURE: for development only.
    #[arg(long = "auth", env = "KURYR_AUTH", value_enum, default_value = "token")]
    pub mode: AuthMode,

    /// The audience kuryr's ServiceAccount tokens are issued for; tokens for any other
    /// audience (such as the Kubernetes API's) are refused.
    #[arg(long, env = "KURYR_AUTH_AUDIENCE", default_value = "kuryr")]
    pub auth_audience: String,

    /// The token this service sends to other kuryr services: a projected ServiceAccount token
    /// with the audience above, read again as the kubelet rotates it.
    #[arg(long, env = "KURYR_AUTH_TOKEN_FILE", default_value = "/var/run/secrets/kuryr/token")]
    pub auth_token_file: std::path::PathBuf,

    /// The longest a checked token is trusted without asking the API server again (never past
    /// shortly before it expires): how long a deleted ServiceAccount may go on calling.
    #[arg(long, env = "KURYR_AUTH_CACHE_TTL", default_value = "5m", value_parser = parse_duration)]
    pub auth_cache_ttl: Duration,
}

impl AuthArgs {
    /// What calls to other kuryr services carry.
    pub fn credentials(&self) -> crate::auth::client::Credentials {
        match self.mode {
            AuthMode::Token => {
                crate::auth::client::Credentials::Token(crate::auth::client::TokenFile::new(&self.auth_token_file))
            }
            AuthMode::None => crate::auth::client::Credentials::None,
        }
    }

    /// The gate for this service's own methods: the accounts `rules` name, their tokens checked
    /// with the API server of `kubeconfig` (in-cluster when `None`); everyone with `none`.
    #[cfg(feature = "kube")]
    pub fn gate(
        &self,
        kubeconfig: Option<std::path::PathBuf>,
        rules: crate::auth::Rules,
        registry: &mut prometheus_client::registry::Registry,
    ) -> std::sync::Arc<dyn crate::auth::Gate> {
        use std::sync::Arc;
        match self.mode {
            AuthMode::Token => {
                let reviewer = Arc::new(crate::auth::token::TokenReviewer::new(
                    kubeconfig,
                    &self.auth_audience,
                    self.auth_cache_ttl,
                ));
                reviewer.register(registry);
                Arc::new(crate::auth::token::Accounts::new(reviewer, rules))
            }
            AuthMode::None => {
                tracing::warn!("--auth=none: INSECURE, for development only: every caller may call every method");
                Arc::new(crate::auth::Insecure)
            }
        }
    }
}

/// Parses durations written as `250ms`, `10s`, `2m` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: f64 = num.parse().map_err(|_| format!("`{s}`: expected a duration such as 500ms, 10s or 2m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (use ms, s, m or h)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{s}`: must be a non-negative duration"));
    }
    // Far below what the clock can add to now without overflowing.
    if secs > MAX_DURATION.as_secs_f64() {
        return Err(format!("`{s}`: longer than a year"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The longest duration a flag takes.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);

/// The name a service instance goes by: `explicit` (its `--instance` flag) when set and not
/// empty, else the host name (the pod's name in a cluster), else `fallback`.
pub fn instance_name(explicit: Option<&str>, fallback: &str) -> String {
    explicit
        .map(str::to_string)
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string()))
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| fallback.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5d").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("99999999999999999999999h").unwrap_err().contains("longer than a year"));
        assert!(parse_duration("18446744073709551616").is_err());
    }
}
