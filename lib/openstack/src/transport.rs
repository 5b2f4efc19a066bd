//! One OpenStack HTTP call as a tower request, and the layers below the session: the concurrency
//! limit, per-attempt metrics (which also turn transport failures into typed errors), the
//! per-attempt timeout, and the reqwest client.
//!
//! ```text
//! Retry (policy.rs) → Session (auth.rs: endpoint, token, re-auth on 401)
//!   → ConcurrencyLimit → Metrics → Timeout → Http (reqwest)
//! ```
//!
//! The limit sits below the retry layer so that a call waiting out its backoff holds no slot, and
//! above the metrics so that the latency recorded is the service's, not the queue's.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use reqwest::Url;
use serde::Serialize;

use crate::error::{Call, Error};
use crate::metrics::Metrics;
use crate::service::ServiceType;

/// What tower's timeout layer and the reqwest service fail with.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Where a request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A path below the service's versioned base URL (`/ports`, `/lbaas/loadbalancers`); the
    /// session resolves the endpoint from the overrides or the catalog.
    Path(String),
    /// A complete URL (Keystone's token endpoint).
    Url(Url),
}

/// Which failures a request may be retried after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryMode {
    /// Whether repeating the request is harmless: then 5xx, timeouts and broken connections are
    /// retried. Defaults to true for GET, HEAD, PUT and DELETE.
    pub idempotent: bool,
    /// Whether a 409 (other than quota) means "busy, try again": true for Octavia changes, whose
    /// load balancer is immutable while PENDING_*.
    pub conflict: bool,
}

/// One OpenStack API call.
#[derive(Clone, Debug)]
pub struct ApiRequest {
    pub service: ServiceType,
    /// A stable name for logs and metrics, e.g. `ports.create`.
    pub operation: &'static str,
    pub method: Method,
    pub target: Target,
    pub query: Vec<(String, String)>,
    pub headers: HeaderMap,
    pub body: Option<Bytes>,
    pub retry: RetryMode,
    /// Filled in by the session: the full URL (without the query).
    pub(crate) url: Option<Url>,
}

impl ApiRequest {
    pub fn new(service: ServiceType, operation: &'static str, method: Method, path: impl Into<String>) -> Self {
        let idempotent = matches!(method, Method::GET | Method::HEAD | Method::PUT | Method::DELETE);
        Self {
            service,
            operation,
            method,
            target: Target::Path(path.into()),
            query: Vec::new(),
            headers: HeaderMap::new(),
            body: None,
            retry: RetryMode { idempotent, conflict: false },
            url: None,
        }
    }

    pub fn get(service: ServiceType, operation: &'static str, path: impl Into<String>) -> Self {
        Self::new(service, operation, Method::GET, path)
    }

    pub fn delete(service: ServiceType, operation: &'static str, path: impl Into<String>) -> Self {
        Self::new(service, operation, Method::DELETE, path)
    }

    /// A request with a JSON body.
    pub fn with_json(
        service: ServiceType,
        operation: &'static str,
        method: Method,
        path: impl Into<String>,
        body: &impl Serialize,
    ) -> Result<Self, Error> {
        let bytes = serde_json::to_vec(body).map_err(|e| Error::InvalidRequest(format!("{operation}: {e}")))?;
        let mut req = Self::new(service, operation, method, path);
        req.headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        req.body = Some(Bytes::from(bytes));
        Ok(req)
    }

    pub fn query(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.query.push((key.into(), value.into()));
        self
    }

    /// Marks a 409 as "busy, retry".
    pub fn retry_on_conflict(mut self) -> Self {
        self.retry.conflict = true;
        self
    }

    /// Overrides whether the request is safe to repeat.
    pub fn idempotent(mut self, idempotent: bool) -> Self {
        self.retry.idempotent = idempotent;
        self
    }

    pub(crate) fn call(&self) -> Call {
        Call { service: self.service, operation: self.operation }
    }
}

/// An HTTP answer, whatever its status.
#[derive(Clone, Debug)]
pub struct ApiResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl ApiResponse {
    /// `X-OpenStack-Request-Id` (or Octavia's `X-Openstack-Request-Id`; header names are
    /// case-insensitive).
    pub fn request_id(&self) -> Option<String> {
        self.headers.get("x-openstack-request-id").and_then(|v| v.to_str().ok()).map(str::to_string)
    }
}

/// The innermost service: sends the request with reqwest and reads the whole answer.
#[derive(Clone, Debug)]
pub(crate) struct Http {
    pub client: reqwest::Client,
}

impl tower::Service<ApiRequest> for Http {
    type Response = ApiResponse;
    type Error = Error;
    type Future = BoxFuture<Result<ApiResponse, Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: ApiRequest) -> Self::Future {
        let client = self.client.clone();
        Box::pin(async move {
            let call = req.call();
            let url = match (&req.url, &req.target) {
                (Some(url), _) | (None, Target::Url(url)) => url.clone(),
                (None, Target::Path(p)) => {
                    return Err(Error::InvalidRequest(format!("{call}: path {p} not resolved to an endpoint")));
                }
            };
            let mut builder = client.request(req.method.clone(), url).headers(req.headers.clone());
            if !req.query.is_empty() {
                builder = builder.query(&req.query);
            }
            if let Some(body) = req.body.clone() {
                builder = builder.body(body);
            }
            let classify = |source: reqwest::Error| {
                if source.is_connect() { Error::Connect { call, source } } else { Error::Transport { call, source } }
            };
            let resp = builder.send().await.map_err(classify)?;
            let status = resp.status();
            let headers = resp.headers().clone();
            let body = resp.bytes().await.map_err(classify)?;
            Ok(ApiResponse { status, headers, body })
        })
    }
}

/// Records every attempt (service, operation, method, status or failure, latency) and turns the
/// timeout layer's error into [`Error::Timeout`].
#[derive(Clone, Debug)]
pub(crate) struct MetricsLayer {
    pub metrics: Arc<Metrics>,
    pub timeout: Duration,
}

impl<S> tower::Layer<S> for MetricsLayer {
    type Service = MetricsService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        MetricsService { inner, metrics: self.metrics.clone(), timeout: self.timeout }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct MetricsService<S> {
    inner: S,
    metrics: Arc<Metrics>,
    timeout: Duration,
}

impl<S> tower::Service<ApiRequest> for MetricsService<S>
where
    S: tower::Service<ApiRequest, Response = ApiResponse, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = ApiResponse;
    type Error = Error;
    type Future = BoxFuture<Result<ApiResponse, Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.inner.poll_ready(cx).map_err(|e| into_error(e, None, self.timeout))
    }

    fn call(&mut self, req: ApiRequest) -> Self::Future {
        let call = req.call();
        let method = req.method.clone();
        let metrics = self.metrics.clone();
        let timeout = self.timeout;
        let started = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let result = fut.await.map_err(|e| into_error(e, Some(call), timeout));
            let code = match &result {
                Ok(resp) => resp.status.as_str().to_string(),
                Err(e) => e.reason().to_string(),
            };
            metrics.record_attempt(call, &method, code.clone(), started.elapsed());
            match &result {
                Ok(resp) => tracing::debug!(
                    service = %call.service, operation = call.operation, %method, status = resp.status.as_u16(),
                    request_id = resp.request_id(), elapsed_ms = started.elapsed().as_millis() as u64,
                    "openstack call"
                ),
                Err(e) => tracing::debug!(
                    service = %call.service, operation = call.operation, %method, error = %e,
                    elapsed_ms = started.elapsed().as_millis() as u64, "openstack call failed"
                ),
            }
            result
        })
    }
}

fn into_error(e: BoxError, call: Option<Call>, timeout: Duration) -> Error {
    match e.downcast::<Error>() {
        Ok(e) => *e,
        Err(e) if e.is::<tower::timeout::error::Elapsed>() => match call {
            Some(call) => Error::Timeout { call, timeout },
            None => Error::Client(e.to_string()),
        },
        Err(e) => Error::Client(e.to_string()),
    }
}
