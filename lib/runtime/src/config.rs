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

    /// Streams this service serves (Subscribe, WatchVifs, WatchLoadBalancers) carry a heartbeat
    /// whenever nothing else was sent for this long, so that their readers can tell a quiet
    /// stream from a dead or stuck server.
    #[arg(long, env = "KURYR_STREAM_HEARTBEAT", default_value = "5s", value_parser = parse_heartbeat)]
    pub stream_heartbeat: Duration,

    /// A stream this service reads from another kuryr service on which nothing arrives for this
    /// long — not even a heartbeat — is taken as dead (a partitioned, stopped or stuck peer): it
    /// is dropped and reopened, and what depends on it turns NOT_SERVING meanwhile. Keep it a few
    /// times the peers' --stream-heartbeat.
    #[arg(long, env = "KURYR_STREAM_IDLE_TIMEOUT", default_value = "15s", value_parser = parse_idle_timeout)]
    pub stream_idle_timeout: Duration,
}

fn parse_heartbeat(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(100) {
        return Err(format!("`{s}`: at least 100ms"));
    }
    Ok(d)
}

fn parse_idle_timeout(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(500) {
        return Err(format!("`{s}`: at least 500ms"));
    }
    Ok(d)
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
