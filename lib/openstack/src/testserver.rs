//! A scripted local HTTP server for unit tests of the client's own logic (retries, 401 handling,
//! token reuse, request shapes). It is not a stand-in for Neutron or Octavia: the integration
//! tests run those for real.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

/// A request the server received.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: Method,
    pub path: String,
    pub query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Recorded {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// What to answer.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
    pub delay: Duration,
}

impl Reply {
    pub fn json(status: u16, body: serde_json::Value) -> Self {
        Self {
            status,
            headers: vec![("content-type", "application/json".into())],
            body: body.to_string(),
            delay: Duration::ZERO,
        }
    }

    pub fn empty(status: u16) -> Self {
        Self { status, headers: vec![], body: String::new(), delay: Duration::ZERO }
    }

    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    pub fn delayed(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }
}

type Handler = dyn Fn(&Recorded, &str) -> Reply + Send + Sync;

struct Shared {
    log: Mutex<Vec<Recorded>>,
    handler: Box<Handler>,
    base: Mutex<String>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

/// The server; stops when dropped.
pub struct TestServer {
    pub url: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl TestServer {
    /// Serves `handler(request, own base URL)` on a free loopback port.
    pub async fn start(handler: impl Fn(&Recorded, &str) -> Reply + Send + Sync + 'static) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let shared = Arc::new(Shared {
            log: Mutex::new(Vec::new()),
            handler: Box::new(handler),
            base: Mutex::new(url.clone()),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        });
        let app = axum::Router::new().fallback(serve).with_state(shared.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { url, shared, task }
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.log.lock().unwrap().clone()
    }

    /// Requests whose path ends with `suffix`.
    pub fn count(&self, method: &str, suffix: &str) -> usize {
        self.requests().iter().filter(|r| r.method.as_str() == method && r.path.ends_with(suffix)).count()
    }

    /// The most requests ever being answered at once.
    pub fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let rec = Recorded {
        method,
        path: uri.path().to_string(),
        query: uri.query().unwrap_or_default().to_string(),
        headers,
        body,
    };
    let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    shared.max_in_flight.fetch_max(now, Ordering::SeqCst);
    shared.log.lock().unwrap().push(rec.clone());
    let base = shared.base.lock().unwrap().clone();
    let reply = (shared.handler)(&rec, &base);
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    shared.in_flight.fetch_sub(1, Ordering::SeqCst);
    let mut resp = (StatusCode::from_u16(reply.status).unwrap(), reply.body).into_response();
    for (k, v) in reply.headers {
        resp.headers_mut().insert(k, v.parse().unwrap());
    }
    resp
}

/// A server serving `handler` and a client (no authentication, project `proj`) whose endpoint
/// for `service` is that server.
pub async fn with_client(
    service: crate::service::ServiceType,
    handler: impl Fn(&Recorded, &str) -> Reply + Send + Sync + 'static,
) -> (TestServer, crate::Client) {
    let server = TestServer::start(handler).await;
    let mut config = crate::config::CloudConfig {
        origin: "test".into(),
        auth: crate::config::AuthConfig::NoAuth { project_id: Some("proj".into()) },
        region_name: None,
        interface: Default::default(),
        tls: Default::default(),
        endpoint_overrides: Default::default(),
    };
    config.endpoint_overrides.insert(service, reqwest::Url::parse(&server.url).unwrap());
    let options = crate::ClientOptions::default();
    let client = crate::Client::new(&config, options, Arc::new(crate::Metrics::unregistered())).unwrap();
    (server, client)
}

/// A Keystone token answer: token `token`, living `lifetime`, with a catalog that points the
/// network and load-balancer services at `base` (public, region `RegionOne`).
pub fn keystone_token(token: &str, base: &str, lifetime: Duration) -> Reply {
    let issued = jiff::Timestamp::now();
    let expires = issued + jiff::SignedDuration::try_from(lifetime).unwrap();
    let endpoints = |path: &str| {
        serde_json::json!([
            {"interface": "public", "region": "RegionOne", "region_id": "RegionOne", "url": format!("{base}{path}")},
            {"interface": "internal", "region": "RegionOne", "region_id": "RegionOne", "url": format!("{base}/internal{path}")},
        ])
    };
    Reply::json(
        201,
        serde_json::json!({"token": {
            "methods": ["password"],
            "issued_at": issued.to_string(),
            "expires_at": expires.to_string(),
            "project": {"id": "proj-1", "name": "demo"},
            "catalog": [
                {"type": "network", "name": "neutron", "endpoints": endpoints("/networking")},
                {"type": "load-balancer", "name": "octavia", "endpoints": endpoints("/load-balancer")},
            ],
        }}),
    )
    .header("x-subject-token", token)
}
