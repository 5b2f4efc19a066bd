//! A fault-injecting HTTP proxy for OpenStack APIs (Neutron, Octavia): put in front of a real
//! endpoint (the services are given the proxy's URL as their endpoint override), it forwards each
//! request and, at configurable rates, instead
//!
//! - answers `503 Service Unavailable` without forwarding ([`Fault::ServerError`]);
//! - answers `409 Conflict` to a write (POST, PUT, DELETE) without forwarding ([`Fault::Conflict`]);
//! - holds the request without forwarding it, then closes the connection: the client's own
//!   timeout fires first ([`Fault::Timeout`]);
//! - forwards it and answers late ([`Fault::Slow`]);
//! - forwards a POST, lets the upstream create the object, and closes the connection instead of
//!   answering ([`Fault::LostAnswer`]): the object exists but its creator never heard of it.
//!
//! Only writes that were really forwarded have an effect upstream: a 503, a 409 or a timeout
//! leaves the upstream untouched, so a retry is always safe except after a lost answer, which is
//! the fault creation paths must be idempotent against. Every fault is counted
//! ([`FaultProxy::counts`]); the rates can be changed while it runs ([`FaultProxy::set_rates`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// The faults, as counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    ServerError,
    Conflict,
    Timeout,
    Slow,
    LostAnswer,
}

/// Probabilities (0..=1) of each fault per request, drawn in this order; the rest is forwarded
/// untouched. Faults that do not apply to a method (409 to a read, a lost answer to anything but
/// a POST) are not drawn for it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FaultRates {
    pub server_error: f64,
    pub conflict: f64,
    pub timeout: f64,
    pub slow: f64,
    pub lost_answer: f64,
}

impl FaultRates {
    /// No fault.
    pub const NONE: FaultRates =
        FaultRates { server_error: 0.0, conflict: 0.0, timeout: 0.0, slow: 0.0, lost_answer: 0.0 };

    /// Every fault at `rate`.
    pub fn all(rate: f64) -> Self {
        Self { server_error: rate, conflict: rate, timeout: rate, slow: rate, lost_answer: rate }
    }

    /// The fault for one request, if any, given a uniform draw `u` in `0..1`.
    pub fn pick(&self, method: &hyper::Method, u: f64) -> Option<Fault> {
        let write = matches!(*method, hyper::Method::POST | hyper::Method::PUT | hyper::Method::DELETE);
        let post = *method == hyper::Method::POST;
        let mut acc = 0.0;
        for (fault, rate, applies) in [
            (Fault::ServerError, self.server_error, true),
            (Fault::Conflict, self.conflict, write),
            (Fault::Timeout, self.timeout, true),
            (Fault::Slow, self.slow, true),
            (Fault::LostAnswer, self.lost_answer, post),
        ] {
            if !applies {
                continue;
            }
            acc += rate.clamp(0.0, 1.0);
            if u < acc {
                return Some(fault);
            }
        }
        None
    }
}

/// How long the timing faults take.
#[derive(Clone, Copy, Debug)]
pub struct FaultTiming {
    /// A [`Fault::Timeout`] holds the request this long, then closes the connection (longer than
    /// the client's timeout, so that the client gives up first).
    pub hang: Duration,
    /// A [`Fault::Slow`] answer comes this much later.
    pub slow: Duration,
}

impl Default for FaultTiming {
    fn default() -> Self {
        // lib/openstack's clients time out after 30 s.
        Self { hang: Duration::from_secs(35), slow: Duration::from_secs(3) }
    }
}

/// Requests seen and faults injected so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub requests: u64,
    pub server_error: u64,
    pub conflict: u64,
    pub timeout: u64,
    pub slow: u64,
    pub lost_answer: u64,
}

impl FaultCounts {
    /// Faults of every kind.
    pub fn faults(&self) -> u64 {
        self.server_error + self.conflict + self.timeout + self.slow + self.lost_answer
    }
}

impl std::fmt::Display for FaultCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} requests: {} 503, {} 409, {} timeouts, {} slow, {} lost POST answers",
            self.requests, self.server_error, self.conflict, self.timeout, self.slow, self.lost_answer
        )
    }
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    server_error: AtomicU64,
    conflict: AtomicU64,
    timeout: AtomicU64,
    slow: AtomicU64,
    lost_answer: AtomicU64,
}

struct Shared {
    upstream: String,
    http: reqwest::Client,
    rates: Mutex<FaultRates>,
    timing: FaultTiming,
    rng: Mutex<fastrand::Rng>,
    counters: Counters,
}

/// A running proxy; dropping it stops it.
pub struct FaultProxy {
    url: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy").field("url", &self.url).field("upstream", &self.shared.upstream).finish()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream` (`http://host:port`, paths are
    /// appended as received), injecting faults at `rates`; `seed` fixes the draws.
    pub async fn start(upstream: &str, rates: FaultRates, timing: FaultTiming, seed: u64) -> Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the fault proxy")?;
        let addr: SocketAddr = listener.local_addr()?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .context("building the fault proxy's client")?;
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_string(),
            http,
            rates: Mutex::new(rates),
            timing,
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
            counters: Counters::default(),
        });
        let s = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let s = s.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| handle(s.clone(), req));
                    // An error here is a connection closed on purpose (a fault) or by the client.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(FaultProxy { url: format!("http://{addr}"), shared, task })
    }

    /// `http://127.0.0.1:<port>`: what to give clients instead of the upstream's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The upstream's URL.
    pub fn upstream(&self) -> &str {
        &self.shared.upstream
    }

    /// Changes the rates from the next request on.
    pub fn set_rates(&self, rates: FaultRates) {
        *self.shared.rates.lock().unwrap_or_else(PoisonError::into_inner) = rates;
    }

    /// What was seen and injected so far.
    pub fn counts(&self) -> FaultCounts {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FaultCounts {
            requests: l(&c.requests),
            server_error: l(&c.server_error),
            conflict: l(&c.conflict),
            timeout: l(&c.timeout),
            slow: l(&c.slow),
            lost_answer: l(&c.lost_answer),
        }
    }
}

/// Why a connection was closed without an answer.
#[derive(Debug)]
struct Dropped(&'static str);

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Dropped {}

fn plain(code: StatusCode, text: &str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(format!("{{\"error\": \"{text}\"}}"))));
    *resp.status_mut() = code;
    resp.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    resp
}

async fn handle(s: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Dropped> {
    let c = &s.counters;
    c.requests.fetch_add(1, Ordering::Relaxed);
    let rates = *s.rates.lock().unwrap_or_else(PoisonError::into_inner);
    let u = s.rng.lock().unwrap_or_else(PoisonError::into_inner).f64();
    let fault = rates.pick(req.method(), u);
    match fault {
        Some(Fault::ServerError) => {
            c.server_error.fetch_add(1, Ordering::Relaxed);
            return Ok(plain(StatusCode::SERVICE_UNAVAILABLE, "injected by the fault proxy"));
        }
        Some(Fault::Conflict) => {
            c.conflict.fetch_add(1, Ordering::Relaxed);
            return Ok(plain(StatusCode::CONFLICT, "injected by the fault proxy"));
        }
        Some(Fault::Timeout) => {
            c.timeout.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(s.timing.hang).await;
            return Err(Dropped("timeout injected by the fault proxy"));
        }
        _ => {}
    }
    let resp = match forward(&s, req).await {
        Ok(r) => r,
        Err(e) => return Ok(plain(StatusCode::BAD_GATEWAY, &format!("{e:#}").replace('"', "'"))),
    };
    match fault {
        Some(Fault::Slow) => {
            c.slow.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(s.timing.slow).await;
            Ok(resp)
        }
        Some(Fault::LostAnswer) => {
            c.lost_answer.fetch_add(1, Ordering::Relaxed);
            Err(Dropped("answer dropped by the fault proxy"))
        }
        _ => Ok(resp),
    }
}

async fn forward(s: &Shared, req: Request<Incoming>) -> Result<Response<Full<Bytes>>> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.context("reading the request body")?.to_bytes();
    let path = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let url = format!("{}{path}", s.upstream);
    let mut out = s.http.request(parts.method.clone(), &url).body(body);
    for (name, value) in &parts.headers {
        if name != http::header::HOST && name != http::header::CONTENT_LENGTH {
            out = out.header(name, value);
        }
    }
    let up = out.send().await.with_context(|| format!("{} {url}", parts.method))?;
    let mut resp = Response::builder().status(up.status());
    for (name, value) in up.headers() {
        if name != http::header::TRANSFER_ENCODING
            && name != http::header::CONNECTION
            && name != http::header::CONTENT_LENGTH
        {
            resp = resp.header(name, value);
        }
    }
    let bytes = up.bytes().await.context("reading the upstream's answer")?;
    Ok(resp.body(Full::new(bytes))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::Method;

    #[test]
    fn faults_are_drawn_by_rate_and_only_where_they_apply() {
        let r = FaultRates { server_error: 0.1, conflict: 0.1, timeout: 0.1, slow: 0.1, lost_answer: 0.1 };
        assert_eq!(r.pick(&Method::POST, 0.05), Some(Fault::ServerError));
        assert_eq!(r.pick(&Method::POST, 0.15), Some(Fault::Conflict));
        assert_eq!(r.pick(&Method::POST, 0.25), Some(Fault::Timeout));
        assert_eq!(r.pick(&Method::POST, 0.35), Some(Fault::Slow));
        assert_eq!(r.pick(&Method::POST, 0.45), Some(Fault::LostAnswer));
        assert_eq!(r.pick(&Method::POST, 0.55), None);
        // A read gets no 409 and no lost answer: the bands shift.
        assert_eq!(r.pick(&Method::GET, 0.15), Some(Fault::Timeout));
        assert_eq!(r.pick(&Method::GET, 0.25), Some(Fault::Slow));
        assert_eq!(r.pick(&Method::GET, 0.35), None);
        assert_eq!(r.pick(&Method::PUT, 0.45), None, "a lost answer only to a POST");
        assert_eq!(FaultRates::NONE.pick(&Method::POST, 0.0), None);
    }
}
