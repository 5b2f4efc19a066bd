//! The retry policy: which answers are worth repeating a request for, and how long to wait.
//!
//! - 409 when the caller marked the request as retryable on conflict (an Octavia load balancer in
//!   PENDING_*, a Neutron revision race), never a quota refusal;
//! - 429 always (the service refused before doing anything), honouring `Retry-After`;
//! - 5xx, timeouts and broken connections for idempotent requests only, unless the caller said
//!   a request is safe to repeat: a POST that timed out may have created the port;
//! - a connection that could not be made, always: nothing was sent.
//!
//! Waits grow exponentially with "equal jitter" (half fixed, half random) so that many callers
//! failing together do not retry together, and stop at a cap.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;

use crate::error::{Error, is_quota_fault, parse_fault_body};
use crate::metrics::Metrics;
use crate::transport::{ApiRequest, ApiResponse, RetryMode};

/// How hard to retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryConfig {
    /// Attempts in all, the first included; 1 disables retries.
    pub max_attempts: u32,
    /// The wait before the first retry (before jitter).
    pub base_delay: Duration,
    /// No wait is longer than this, `Retry-After` included.
    pub max_delay: Duration,
}

impl Default for RetryConfig {
    /// Five attempts over roughly 3–6 s: long enough to ride out an Octavia change (request →
    /// ACTIVE is 0.3–4 s) or an API worker restart, short enough that a caller with its own
    /// longer-term backoff (the reconcile loops) gets the error back and can report it.
    fn default() -> Self {
        Self { max_attempts: 5, base_delay: Duration::from_millis(250), max_delay: Duration::from_secs(10) }
    }
}

/// Why a request is retried (the `reason` metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryReason {
    Conflict,
    TooManyRequests,
    ServerError,
    Connect,
    Transport,
    Timeout,
}

impl RetryReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Conflict => "conflict",
            Self::TooManyRequests => "too_many_requests",
            Self::ServerError => "server_error",
            Self::Connect => "connect",
            Self::Transport => "transport",
            Self::Timeout => "timeout",
        }
    }
}

/// Whether the outcome of one attempt is worth another.
pub fn classify(mode: RetryMode, outcome: &Result<ApiResponse, Error>) -> Option<RetryReason> {
    match outcome {
        Ok(resp) => match resp.status {
            StatusCode::CONFLICT if mode.conflict => {
                let (kind, message) = parse_fault_body(&resp.body);
                (!is_quota_fault(resp.status, kind.as_deref(), &message)).then_some(RetryReason::Conflict)
            }
            StatusCode::TOO_MANY_REQUESTS => Some(RetryReason::TooManyRequests),
            s if s.is_server_error() && mode.idempotent => Some(RetryReason::ServerError),
            _ => None,
        },
        Err(Error::Connect { .. }) => Some(RetryReason::Connect),
        Err(Error::Transport { .. }) if mode.idempotent => Some(RetryReason::Transport),
        Err(Error::Timeout { .. }) if mode.idempotent => Some(RetryReason::Timeout),
        Err(_) => None,
    }
}

/// The wait before retry number `retry` (1-based): the shared backoff's ceiling
/// ([`kuryr_stream::backoff::ceiling`], `base * 2^(retry-1)` capped at `max`) scaled by `unit` (a
/// random number in [0, 1)): full jitter, so that clients that failed together do not retry
/// together.
pub fn backoff(config: &RetryConfig, retry: u32, unit: f64) -> Duration {
    let ceiling = kuryr_stream::backoff::ceiling(retry, config.base_delay, config.max_delay);
    kuryr_stream::Jitter::Full.apply(ceiling, unit)
}

/// `Retry-After` in seconds (the HTTP-date form is not used by OpenStack services).
fn retry_after(resp: &ApiResponse) -> Option<Duration> {
    let v = resp.headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// The tower retry policy. Each request gets its own copy (tower clones the policy per call), so
/// `attempt` counts that request's attempts.
#[derive(Clone, Debug)]
pub(crate) struct Policy {
    pub config: RetryConfig,
    pub metrics: Arc<Metrics>,
    pub attempt: u32,
}

impl Policy {
    pub fn new(config: RetryConfig, metrics: Arc<Metrics>) -> Self {
        Self { config, metrics, attempt: 1 }
    }
}

impl tower::retry::Policy<ApiRequest, ApiResponse, Error> for Policy {
    type Future = Pin<Box<dyn Future<Output = ()> + Send>>;

    fn retry(&mut self, req: &mut ApiRequest, result: &mut Result<ApiResponse, Error>) -> Option<Self::Future> {
        let reason = classify(req.retry, result)?;
        if self.attempt >= self.config.max_attempts {
            tracing::warn!(
                service = %req.service, operation = req.operation, attempts = self.attempt, reason = reason.as_str(),
                "openstack call still failing, giving up"
            );
            return None;
        }
        let mut delay = backoff(&self.config, self.attempt, fastrand::f64());
        if let Ok(resp) = result
            && let Some(after) = retry_after(resp)
        {
            delay = delay.max(after.min(self.config.max_delay));
        }
        self.attempt += 1;
        self.metrics.record_retry(req.call(), reason.as_str());
        kuryr_stream::backoff::count("openstack", reason.as_str());
        let detail = match result {
            Ok(resp) => format!("HTTP {}", resp.status.as_u16()),
            Err(e) => e.to_string(),
        };
        tracing::info!(
            service = %req.service, operation = req.operation, attempt = self.attempt, reason = reason.as_str(),
            detail, delay_ms = delay.as_millis() as u64, "retrying openstack call"
        );
        Some(Box::pin(tokio::time::sleep(delay)))
    }

    fn clone_request(&mut self, req: &ApiRequest) -> Option<ApiRequest> {
        Some(req.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Call;
    use crate::service::ServiceType;
    use bytes::Bytes;
    use http::HeaderMap;

    fn resp(status: u16, body: &str) -> Result<ApiResponse, Error> {
        Ok(ApiResponse {
            status: StatusCode::from_u16(status).unwrap(),
            headers: HeaderMap::new(),
            body: Bytes::from(body.to_string()),
        })
    }

    const GET: RetryMode = RetryMode { idempotent: true, conflict: false };
    const POST: RetryMode = RetryMode { idempotent: false, conflict: false };
    const OCTAVIA_CHANGE: RetryMode = RetryMode { idempotent: false, conflict: true };

    fn timeout() -> Error {
        Error::Timeout { call: Call { service: ServiceType::Network, operation: "x" }, timeout: Duration::from_secs(1) }
    }

    #[test]
    fn server_errors_are_retried_for_idempotent_requests_only() {
        for status in [500, 502, 503, 504] {
            assert_eq!(classify(GET, &resp(status, "")), Some(RetryReason::ServerError), "{status}");
            assert_eq!(classify(POST, &resp(status, "")), None, "{status}");
        }
        assert_eq!(classify(GET, &Err(timeout())), Some(RetryReason::Timeout));
        assert_eq!(classify(POST, &Err(timeout())), None);
    }

    #[test]
    fn conflicts_are_retried_when_asked_but_never_quota() {
        let immutable = r#"{"faultstring": "Load Balancer x is immutable and cannot be updated."}"#;
        assert_eq!(classify(OCTAVIA_CHANGE, &resp(409, immutable)), Some(RetryReason::Conflict));
        assert_eq!(classify(POST, &resp(409, immutable)), None);
        let quota = r#"{"NeutronError": {"type": "OverQuota", "message": "Quota exceeded for resources: ['port']."}}"#;
        assert_eq!(classify(OCTAVIA_CHANGE, &resp(409, quota)), None);
    }

    #[test]
    fn too_many_requests_always_and_client_errors_never() {
        assert_eq!(classify(POST, &resp(429, "")), Some(RetryReason::TooManyRequests));
        for status in [200, 201, 204, 400, 401, 403, 404, 412] {
            assert_eq!(classify(GET, &resp(status, "")), None, "{status}");
        }
        let other = Error::InvalidRequest("x".into());
        assert_eq!(classify(GET, &Err(other)), None);
    }

    #[test]
    fn backoff_doubles_with_full_jitter_up_to_the_cap() {
        let c =
            RetryConfig { max_attempts: 10, base_delay: Duration::from_millis(100), max_delay: Duration::from_secs(1) };
        let ms = |retry, unit| backoff(&c, retry, unit).as_millis();
        assert_eq!(ms(1, 0.0), 0);
        assert_eq!(ms(1, 1.0), 100);
        assert_eq!(ms(2, 1.0), 200);
        assert_eq!(ms(3, 0.5), 200);
        assert_eq!(ms(5, 1.0), 1000);
        assert_eq!(ms(60, 1.0), 1000);
        for retry in 1..40 {
            let d = backoff(&c, retry, fastrand::f64());
            assert!(d <= c.max_delay, "{retry}: {d:?}");
        }
    }

    #[test]
    fn retry_after_is_read_in_seconds() {
        let mut r = resp(429, "").unwrap();
        r.headers.insert(http::header::RETRY_AFTER, "3".parse().unwrap());
        assert_eq!(retry_after(&r), Some(Duration::from_secs(3)));
        r.headers.insert(http::header::RETRY_AFTER, "Wed, 21 Oct 2015 07:28:00 GMT".parse().unwrap());
        assert_eq!(retry_after(&r), None);
    }
}
