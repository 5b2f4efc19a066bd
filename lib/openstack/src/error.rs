//! Typed errors, so callers can react: a missing port is [`Error::NotFound`], a load balancer in a
//! PENDING state answers [`Error::Conflict`], an exhausted quota is [`Error::QuotaExceeded`] (never
//! worth retrying), and an unreachable or failing service is [`Error::Unavailable`],
//! [`Error::Connect`] or [`Error::Timeout`].

use std::fmt;
use std::time::Duration;

use http::StatusCode;
use serde_json::Value;

use crate::config::ConfigError;
use crate::service::ServiceType;

/// The longest service message kept in an error: enough for any OpenStack fault, short enough
/// that an HTML error page from a proxy does not flood the logs.
const MAX_MESSAGE: usize = 512;

/// What the service said when it refused a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    pub service: ServiceType,
    /// The operation, e.g. `ports.create`.
    pub operation: &'static str,
    pub status: StatusCode,
    /// The service's own error type, e.g. Neutron's `PortNotFound` or `OverQuota`.
    pub kind: Option<String>,
    pub message: String,
    /// `X-OpenStack-Request-Id`, to find the request in the service's logs.
    pub request_id: Option<String>,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: HTTP {}", self.service, self.operation, self.status.as_u16())?;
        if let Some(kind) = &self.kind {
            write!(f, " {kind}")?;
        }
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        if let Some(id) = &self.request_id {
            write!(f, " (request {id})")?;
        }
        Ok(())
    }
}

/// The call an error without an HTTP answer belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub service: ServiceType,
    pub operation: &'static str,
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.service, self.operation)
    }
}

/// An OpenStack call that did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("not found: {0}")]
    NotFound(Fault),
    /// 409 other than quota: a concurrent change, an immutable (PENDING_*) load balancer, an address
    /// in use.
    #[error("conflict: {0}")]
    Conflict(Fault),
    /// Neutron's `OverQuota` (409), Octavia's quota fault (403), or 413.
    #[error("quota exceeded: {0}")]
    QuotaExceeded(Fault),
    #[error("bad request: {0}")]
    BadRequest(Fault),
    /// 401 even after authenticating again.
    #[error("unauthorized: {0}")]
    Unauthorized(Fault),
    #[error("forbidden: {0}")]
    Forbidden(Fault),
    /// 5xx or 429, after the retries the request was allowed.
    #[error("service unavailable: {0}")]
    Unavailable(Fault),
    /// Any other unexpected status.
    #[error("unexpected answer: {0}")]
    Http(Fault),
    #[error("{call}: no answer within {timeout:?}")]
    Timeout { call: Call, timeout: Duration },
    /// The connection could not be made; the request was not sent.
    #[error("{call}: cannot connect")]
    Connect {
        call: Call,
        #[source]
        source: reqwest::Error,
    },
    /// The request failed after it may have been sent (connection reset, body error).
    #[error("{call}: request failed")]
    Transport {
        call: Call,
        #[source]
        source: reqwest::Error,
    },
    #[error("{call}: cannot decode the answer")]
    Decode {
        call: Call,
        #[source]
        source: serde_json::Error,
    },
    #[error("no {service} endpoint for interface {interface}{} in the service catalog", region.as_ref().map(|r| format!(" in region {r}")).unwrap_or_default())]
    NoEndpoint { service: ServiceType, interface: &'static str, region: Option<String> },
    /// Getting a Keystone token failed.
    #[error("Keystone authentication failed")]
    Auth(#[source] Box<Error>),
    /// Keystone answered, but not with a usable token.
    #[error("Keystone answer unusable: {0}")]
    BadToken(String),
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The caller's request cannot be sent as it is.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The HTTP client could not be built (TLS material).
    #[error("building the HTTP client: {0}")]
    Client(String),
}

impl Error {
    /// The service's fault, for errors that carry an HTTP answer.
    pub fn fault(&self) -> Option<&Fault> {
        match self {
            Self::NotFound(f)
            | Self::Conflict(f)
            | Self::QuotaExceeded(f)
            | Self::BadRequest(f)
            | Self::Unauthorized(f)
            | Self::Forbidden(f)
            | Self::Unavailable(f)
            | Self::Http(f) => Some(f),
            Self::Auth(inner) => inner.fault(),
            _ => None,
        }
    }

    /// The HTTP status, when there was an answer.
    pub fn status(&self) -> Option<StatusCode> {
        self.fault().map(|f| f.status)
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::NotFound(_))
    }

    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Conflict(_))
    }

    /// Whether trying again later may succeed: the service is down, slow or busy. Quota, bad
    /// requests and authorization failures need a change first.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Unavailable(_)
            | Self::Conflict(_)
            | Self::Timeout { .. }
            | Self::Connect { .. }
            | Self::Transport { .. } => true,
            Self::Auth(inner) => inner.is_transient(),
            _ => false,
        }
    }

    /// A short stable name, for metric labels and Event reasons.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotFound(_) => "NotFound",
            Self::Conflict(_) => "Conflict",
            Self::QuotaExceeded(_) => "QuotaExceeded",
            Self::BadRequest(_) => "BadRequest",
            Self::Unauthorized(_) => "Unauthorized",
            Self::Forbidden(_) => "Forbidden",
            Self::Unavailable(_) => "Unavailable",
            Self::Http(_) => "UnexpectedStatus",
            Self::Timeout { .. } => "Timeout",
            Self::Connect { .. } => "ConnectFailed",
            Self::Transport { .. } => "TransportFailed",
            Self::Decode { .. } => "BadAnswer",
            Self::NoEndpoint { .. } => "NoEndpoint",
            Self::Auth(_) | Self::BadToken(_) => "AuthFailed",
            Self::Config(_) => "BadConfig",
            Self::InvalidRequest(_) => "InvalidRequest",
            Self::Client(_) => "ClientSetup",
        }
    }

    /// The typed error for a non-success answer.
    pub fn from_response(
        service: ServiceType,
        operation: &'static str,
        status: StatusCode,
        request_id: Option<String>,
        body: &[u8],
    ) -> Self {
        let (kind, message) = parse_fault_body(body);
        let quota = is_quota_fault(status, kind.as_deref(), &message);
        let fault = Fault { service, operation, status, kind, message, request_id };
        match status.as_u16() {
            _ if quota => Self::QuotaExceeded(fault),
            400 | 422 => Self::BadRequest(fault),
            401 => Self::Unauthorized(fault),
            403 => Self::Forbidden(fault),
            404 => Self::NotFound(fault),
            409 | 412 => Self::Conflict(fault),
            429 | 500..=599 => Self::Unavailable(fault),
            _ => Self::Http(fault),
        }
    }
}

/// Whether an answer is a quota refusal: Neutron answers 409 `OverQuota`, Octavia 403 "Quota has
/// been met", some proxies 413.
pub(crate) fn is_quota_fault(status: StatusCode, kind: Option<&str>, message: &str) -> bool {
    match status.as_u16() {
        413 => true,
        403 | 409 => {
            kind.is_some_and(|k| k.contains("OverQuota") || k.contains("Quota"))
                || message.to_ascii_lowercase().contains("quota")
        }
        _ => false,
    }
}

/// The error type and message from an OpenStack fault body: Neutron's
/// `{"NeutronError": {"type", "message"}}`, Octavia's `{"faultstring"}`, Keystone's
/// `{"error": {"title", "message"}}`, or any text, shortened.
pub(crate) fn parse_fault_body(body: &[u8]) -> (Option<String>, String) {
    let text = |v: &Value| v.as_str().map(str::to_string);
    if let Ok(json) = serde_json::from_slice::<Value>(body) {
        if let Some(e) = json.get("NeutronError") {
            // Older Neutron sends the error as a plain string.
            if let Some(s) = e.as_str() {
                return (None, shorten(s));
            }
            let message = [e.get("message"), e.get("detail")]
                .into_iter()
                .flatten()
                .filter_map(text)
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(": ");
            return (e.get("type").and_then(text), shorten(&message));
        }
        if let Some(s) = json.get("faultstring").and_then(text) {
            return (None, shorten(&s));
        }
        if let Some(e) = json.get("error") {
            return (e.get("title").and_then(text), shorten(&e.get("message").and_then(text).unwrap_or_default()));
        }
        for key in ["message", "description", "detail"] {
            if let Some(s) = json.get(key).and_then(text) {
                return (json.get("title").and_then(text), shorten(&s));
            }
        }
    }
    (None, shorten(&String::from_utf8_lossy(body)))
}

fn shorten(s: &str) -> String {
    let collapsed = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if collapsed.len() <= MAX_MESSAGE {
        return collapsed;
    }
    let mut end = MAX_MESSAGE;
    while !collapsed.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &collapsed[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(status: u16, body: &str) -> Error {
        Error::from_response(
            ServiceType::Network,
            "ports.create",
            StatusCode::from_u16(status).unwrap(),
            Some("req-1".into()),
            body.as_bytes(),
        )
    }

    #[test]
    fn neutron_faults_keep_type_and_message() {
        let e = err(
            404,
            r#"{"NeutronError": {"type": "PortNotFound", "message": "Port 42 could not be found.", "detail": ""}}"#,
        );
        let Error::NotFound(f) = &e else { panic!("{e:?}") };
        assert_eq!(f.kind.as_deref(), Some("PortNotFound"));
        assert_eq!(f.message, "Port 42 could not be found.");
        assert_eq!(
            e.to_string(),
            "not found: network ports.create: HTTP 404 PortNotFound: Port 42 could not be found. (request req-1)"
        );
        assert!(!e.is_transient());
    }

    #[test]
    fn neutron_over_quota_is_quota_not_conflict() {
        let e = err(
            409,
            r#"{"NeutronError": {"type": "OverQuota", "message": "Quota exceeded for resources: ['port'].", "detail": ""}}"#,
        );
        assert!(matches!(e, Error::QuotaExceeded(_)), "{e:?}");
        assert!(!e.is_transient());
        assert_eq!(e.reason(), "QuotaExceeded");
    }

    #[test]
    fn octavia_immutable_is_conflict_and_quota_403_is_quota() {
        let e = err(
            409,
            r#"{"faultcode": "Client", "faultstring": "Load Balancer 1 is immutable and cannot be updated.", "debuginfo": null}"#,
        );
        let Error::Conflict(f) = &e else { panic!("{e:?}") };
        assert!(f.message.contains("immutable"));
        assert!(e.is_transient());
        let e = err(
            403,
            r#"{"faultcode": "Client", "faultstring": "Quota has been met for resources: Load Balancer", "debuginfo": null}"#,
        );
        assert!(matches!(e, Error::QuotaExceeded(_)), "{e:?}");
        let e = err(
            403,
            r#"{"faultcode": "Client", "faultstring": "Policy does not allow this request to be performed."}"#,
        );
        assert!(matches!(e, Error::Forbidden(_)), "{e:?}");
    }

    #[test]
    fn keystone_and_unknown_bodies() {
        let e = err(
            401,
            r#"{"error": {"code": 401, "message": "The request you have made requires authentication.", "title": "Unauthorized"}}"#,
        );
        let Error::Unauthorized(f) = &e else { panic!("{e:?}") };
        assert_eq!(f.kind.as_deref(), Some("Unauthorized"));
        assert!(f.message.starts_with("The request you have made"));

        let e = err(503, "<html>\n<body>  Service   Unavailable </body></html>");
        let Error::Unavailable(f) = &e else { panic!("{e:?}") };
        assert_eq!(f.message, "<html> <body> Service Unavailable </body></html>");
        assert!(e.is_transient());

        let e = err(
            400,
            r#"{"NeutronError": {"type": "HTTPBadRequest", "message": "Invalid input for fixed_ips.", "detail": ""}}"#,
        );
        assert!(matches!(e, Error::BadRequest(_)));
        assert_eq!(err(418, "").reason(), "UnexpectedStatus");
        assert_eq!(err(429, "").reason(), "Unavailable");
    }

    #[test]
    fn long_messages_are_shortened_on_a_char_boundary() {
        let body = "é".repeat(2000);
        let (_, m) = parse_fault_body(body.as_bytes());
        assert!(m.len() <= MAX_MESSAGE + '…'.len_utf8());
        assert!(m.ends_with('…'));
    }
}
