//! Prometheus metrics: the registry services add their own metrics to, a tower layer that records
//! every gRPC request by service, method and status code, and the HTTP endpoint serving them
//! (`/metrics`, plus `/livez` and `/readyz` for probes that do not speak gRPC).
//!
//! Latency histograms use millisecond-scale buckets: the CNI path is measured in milliseconds, and
//! a histogram whose smallest bucket is seconds cannot tell a healthy node from a slow one.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use http_body::{Body, Frame};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use tokio::net::TcpListener;

pub use prometheus_client::encoding::EncodeLabelSet;
pub use prometheus_client::registry::Registry;

use crate::health::Health;
use crate::shutdown::Shutdown;

pub mod labels;
mod set;

/// Latency buckets in seconds, from half a millisecond to a minute.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// A histogram with [`LATENCY_BUCKETS`].
pub fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS.iter().copied())
}

/// Labels of a gRPC method.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    pub service: String,
    pub method: String,
}

/// Labels of a finished gRPC call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandledLabels {
    pub service: String,
    pub method: String,
    /// The gRPC status code name (OK, NOT_FOUND, ...), or CANCELLED when the client went away.
    pub code: String,
}

/// The label of every path that is not a known method: requests for made-up paths are counted,
/// under one series, instead of each adding series of its own (memory without bound).
pub const UNKNOWN: &str = "unknown";

/// gRPC server metrics.
#[derive(Debug)]
pub struct GrpcMetrics {
    started: Family<MethodLabels, Counter>,
    handled: Family<HandledLabels, Counter>,
    latency: Family<MethodLabels, Histogram, fn() -> Histogram>,
    /// `/package.Service/Method` → its labels, for every method of the contracts served.
    known: HashMap<String, MethodLabels>,
}

/// Every method of the services described in `sets` (encoded `FileDescriptorSet`s), by path.
pub fn methods_of(sets: &[&[u8]]) -> HashMap<String, MethodLabels> {
    let mut out = HashMap::new();
    for bytes in sets {
        let Ok(set) = <prost_types::FileDescriptorSet as prost::Message>::decode(*bytes) else { continue };
        for file in set.file {
            let package = file.package.unwrap_or_default();
            for svc in file.service {
                let svc_name = svc.name.unwrap_or_default();
                let service = if package.is_empty() { svc_name } else { format!("{package}.{svc_name}") };
                for m in svc.method {
                    let method = m.name.unwrap_or_default();
                    out.insert(format!("/{service}/{method}"), MethodLabels { service: service.clone(), method });
                }
            }
        }
    }
    out
}

impl GrpcMetrics {
    /// Creates the metrics and registers them. Calls are labelled with their method only when
    /// it is one of `known` (see [`methods_of`]); every other path is [`UNKNOWN`].
    pub fn register(registry: &mut Registry, known: HashMap<String, MethodLabels>) -> Arc<Self> {
        let m = Self {
            started: Family::default(),
            handled: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            known,
        };
        registry.register("grpc_server_started", "gRPC calls started", m.started.clone());
        registry.register("grpc_server_handled", "gRPC calls finished, by status code", m.handled.clone());
        registry.register(
            "grpc_server_handling_seconds",
            "gRPC call duration, until the last message of a stream",
            m.latency.clone(),
        );
        Arc::new(m)
    }
}

/// A tower layer that records [`GrpcMetrics`] for every call.
#[derive(Clone, Debug)]
pub struct GrpcMetricsLayer(pub Arc<GrpcMetrics>);

impl<S> tower::Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetricsService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetricsService { inner, metrics: self.0.clone() }
    }
}

/// See [`GrpcMetricsLayer`].
#[derive(Clone, Debug)]
pub struct GrpcMetricsService<S> {
    inner: S,
    metrics: Arc<GrpcMetrics>,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for GrpcMetricsService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<MetricsBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let labels = self.metrics.labels(req.uri().path());
        self.metrics.started.get_or_create(&labels).inc();
        let mut recorder = Recorder { metrics: self.metrics.clone(), labels, start: Instant::now(), code: None };
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await?;
            // A trailers-only response (most errors) carries the status in its headers.
            if let Some(code) = res.headers().get("grpc-status").and_then(|v| v.to_str().ok()) {
                recorder.code = Some(code_name(code));
            }
            Ok(res.map(|inner| MetricsBody { inner, recorder: Some(recorder) }))
        })
    }
}

impl GrpcMetrics {
    /// The labels of a request path: its method's, or [`UNKNOWN`] for both.
    fn labels(&self, path: &str) -> MethodLabels {
        self.known
            .get(path)
            .cloned()
            .unwrap_or_else(|| MethodLabels { service: UNKNOWN.to_string(), method: UNKNOWN.to_string() })
    }
}

/// Records the call when the response body is finished or dropped.
#[derive(Debug)]
struct Recorder {
    metrics: Arc<GrpcMetrics>,
    labels: MethodLabels,
    start: Instant,
    code: Option<String>,
}

impl Drop for Recorder {
    fn drop(&mut self) {
        // Dropped before a status was seen: the client cancelled or the connection broke.
        let code = self.code.take().unwrap_or_else(|| "CANCELLED".to_string());
        self.metrics.latency.get_or_create(&self.labels).observe(self.start.elapsed().as_secs_f64());
        let labels = HandledLabels { service: self.labels.service.clone(), method: self.labels.method.clone(), code };
        self.metrics.handled.get_or_create(&labels).inc();
    }
}

pin_project_lite::pin_project! {
    /// A response body that finds the gRPC status in the trailers.
    #[derive(Debug)]
    pub struct MetricsBody<B> {
        #[pin]
        inner: B,
        recorder: Option<Recorder>,
    }
}

impl<B: Body> Body for MetricsBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let res = this.inner.poll_frame(cx);
        match &res {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(code) =
                    frame.trailers_ref().and_then(|t| t.get("grpc-status")).and_then(|v| v.to_str().ok())
                    && let Some(r) = this.recorder.as_mut()
                {
                    r.code = Some(code_name(code));
                }
            }
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => {
                if let Some(mut r) = this.recorder.take() {
                    r.code.get_or_insert_with(|| "UNKNOWN".to_string());
                }
            }
            Poll::Pending => {}
        }
        res
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The name of a numeric gRPC status code.
fn code_name(code: &str) -> String {
    let name = match code.trim() {
        "0" => "OK",
        "1" => "CANCELLED",
        "2" => "UNKNOWN",
        "3" => "INVALID_ARGUMENT",
        "4" => "DEADLINE_EXCEEDED",
        "5" => "NOT_FOUND",
        "6" => "ALREADY_EXISTS",
        "7" => "PERMISSION_DENIED",
        "8" => "RESOURCE_EXHAUSTED",
        "9" => "FAILED_PRECONDITION",
        "10" => "ABORTED",
        "11" => "OUT_OF_RANGE",
        "12" => "UNIMPLEMENTED",
        "13" => "INTERNAL",
        "14" => "UNAVAILABLE",
        "15" => "DATA_LOSS",
        "16" => "UNAUTHENTICATED",
        other => return format!("CODE_{other}"),
    };
    name.to_string()
}

#[derive(Clone)]
struct HttpState {
    registry: Arc<Registry>,
    health: Health,
}

/// Serves `/metrics`, `/livez` and `/readyz` until shutdown.
pub async fn serve_http(
    listener: TcpListener,
    registry: Arc<Registry>,
    health: Health,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(HttpState { registry, health });
    axum::serve(listener, app).with_graceful_shutdown(shutdown.wait()).await
}

async fn metrics_handler(State(s): State<HttpState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &s.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}\n")).into_response(),
    }
}

async fn ready_handler(State(s): State<HttpState>) -> impl IntoResponse {
    let mut body = String::new();
    for (svc, serving) in s.health.snapshot() {
        body.push_str(&format!("{svc}: {}\n", if serving { "SERVING" } else { "NOT_SERVING" }));
    }
    let code = if s.health.all_serving() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_codes() {
        let mut registry = Registry::default();
        let m = GrpcMetrics::register(&mut registry, methods_of(&[kuryr_proto::FILE_DESCRIPTOR_SET]));
        let l = m.labels("/kuryr.binder.v1.Cni/Add");
        assert_eq!((l.service.as_str(), l.method.as_str()), ("kuryr.binder.v1.Cni", "Add"));
        for made_up in ["/kuryr.binder.v1.Cni/Nope", "/x/y", "", "/", "/kuryr.binder.v1.Cni/Add/extra"] {
            let l = m.labels(made_up);
            assert_eq!((l.service.as_str(), l.method.as_str()), (UNKNOWN, UNKNOWN), "{made_up}");
        }
        assert_eq!(code_name("12"), "UNIMPLEMENTED");
        assert_eq!(code_name("99"), "CODE_99");
    }
}
