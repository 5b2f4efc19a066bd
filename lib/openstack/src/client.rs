//! The client: the tower stack built from a [`CloudConfig`], and typed JSON calls on top of it.

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

use crate::HasId;
use crate::auth::{Authenticator, Keystone, Mode, Session, Stack, auth_request_body};
use crate::config::{AuthConfig, CloudConfig, TlsConfig};
use crate::error::{Call, Error};
use crate::filter::Filter;
use crate::metrics::Metrics;
use crate::policy::{Policy, RetryConfig};
use crate::service::ServiceType;
use crate::transport::{ApiRequest, ApiResponse, Http, MetricsLayer};

/// How the client behaves, apart from where it connects.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Deadline of one attempt. Neutron's bulk create of 50 ports takes ~5 s on a small machine.
    pub timeout: Duration,
    /// Connection establishment deadline, shorter so an unreachable service fails fast.
    pub connect_timeout: Duration,
    pub retry: RetryConfig,
    /// Requests in flight at once across all services; more wait (without a deadline running).
    pub concurrency: usize,
    /// Renew a token this long before it expires.
    pub token_margin: Duration,
    pub user_agent: String,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            retry: RetryConfig::default(),
            concurrency: 32,
            token_margin: Duration::from_secs(300),
            user_agent: concat!("kuryr-rs/", env!("CARGO_PKG_VERSION")).to_string(),
        }
    }
}

/// An OpenStack client, cheap to clone; clones share the token, the connection pool, the
/// concurrency limit and the metrics.
#[derive(Clone, Debug)]
pub struct Client {
    stack: Stack,
    auth: Arc<Authenticator>,
    metrics: Arc<Metrics>,
}

impl Client {
    /// Builds the client; nothing is sent until the first call (or [`Client::authenticate`]).
    pub fn new(config: &CloudConfig, options: ClientOptions, metrics: Arc<Metrics>) -> Result<Self, Error> {
        if options.concurrency == 0 {
            return Err(Error::InvalidRequest("concurrency must be at least 1".into()));
        }
        if options.retry.max_attempts == 0 {
            return Err(Error::InvalidRequest("retry.max_attempts must be at least 1".into()));
        }
        let http = Http { client: http_client(&config.tls, &options)? };
        let base: Stack = BoxCloneSyncService::new(
            tower::ServiceBuilder::new()
                .concurrency_limit(options.concurrency)
                .layer(MetricsLayer { metrics: metrics.clone(), timeout: options.timeout })
                .timeout(options.timeout)
                .service(http),
        );
        let mode = match &config.auth {
            AuthConfig::NoAuth { project_id } => Mode::NoAuth { project_id: project_id.clone() },
            auth @ (AuthConfig::Password { auth_url, .. } | AuthConfig::ApplicationCredential { auth_url, .. }) => {
                let body = auth_request_body(auth).ok_or_else(|| Error::Client("no Keystone request".into()))?;
                let auth_stack: Stack = BoxCloneSyncService::new(
                    tower::ServiceBuilder::new()
                        .retry(Policy::new(options.retry, metrics.clone()))
                        .service(base.clone()),
                );
                Mode::Keystone(Box::new(Keystone::new(
                    auth_url,
                    body,
                    auth_stack,
                    options.token_margin,
                    metrics.clone(),
                )))
            }
        };
        let auth = Arc::new(Authenticator {
            mode,
            interface: config.interface,
            region: config.region_name.clone(),
            overrides: config.endpoint_overrides.clone(),
        });
        let stack: Stack = BoxCloneSyncService::new(
            tower::ServiceBuilder::new()
                .retry(Policy::new(options.retry, metrics.clone()))
                .service(Session { inner: base, auth: auth.clone() }),
        );
        Ok(Self { stack, auth, metrics })
    }

    /// The metrics this client records into.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Gets a token now (no-op without Keystone): a startup and readiness check.
    pub async fn authenticate(&self) -> Result<(), Error> {
        self.auth.project_id().await.map(|_| ())
    }

    /// Successful Keystone authentications so far (0 without Keystone).
    pub fn authentications(&self) -> u64 {
        match &self.auth.mode {
            Mode::Keystone(k) => k.authentications(),
            Mode::NoAuth { .. } => 0,
        }
    }

    /// The current Keystone token (authenticating if needed), for calls to services this client
    /// does not model; `None` without Keystone. Never log it.
    pub async fn token(&self) -> Result<Option<String>, Error> {
        match &self.auth.mode {
            Mode::Keystone(k) => Ok(Some(k.token().await?.secret())),
            Mode::NoAuth { .. } => Ok(None),
        }
    }

    /// The project calls act in: the token's scope, or the configured project without Keystone.
    pub async fn project_id(&self) -> Result<Option<String>, Error> {
        self.auth.project_id().await
    }

    /// The project to write into request bodies: without Keystone, Neutron and Octavia take the
    /// owner from the body; with Keystone the token decides and none is sent.
    pub fn body_project_id(&self) -> Option<String> {
        match &self.auth.mode {
            Mode::NoAuth { project_id } => project_id.clone(),
            Mode::Keystone(_) => None,
        }
    }

    /// Sends `req` through the whole stack; any non-2xx answer becomes a typed [`Error`].
    pub async fn send(&self, req: ApiRequest) -> Result<ApiResponse, Error> {
        let (service, operation) = (req.service, req.operation);
        let resp = self.stack.clone().oneshot(req).await?;
        if resp.status.is_success() {
            Ok(resp)
        } else {
            Err(Error::from_response(service, operation, resp.status, resp.request_id(), &resp.body))
        }
    }

    /// Sends `req` and decodes the JSON answer.
    pub async fn json<T: DeserializeOwned>(&self, req: ApiRequest) -> Result<T, Error> {
        let call = Call { service: req.service, operation: req.operation };
        let resp = self.send(req).await?;
        serde_json::from_slice(&resp.body).map_err(|source| Error::Decode { call, source })
    }

    /// Sends `req` and decodes the member `key` of the JSON answer (`{"port": {...}}`).
    pub async fn json_field<T: DeserializeOwned>(&self, req: ApiRequest, key: &'static str) -> Result<T, Error> {
        let call = Call { service: req.service, operation: req.operation };
        let resp = self.send(req).await?;
        let decode = |source| Error::Decode { call, source };
        let mut map: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&resp.body).map_err(decode)?;
        let value = map.remove(key).ok_or_else(|| decode(serde::de::Error::missing_field(key)))?;
        serde_json::from_value(value).map_err(decode)
    }

    /// Every entry of a paged list (`limit`/`marker`, as Neutron and Octavia page).
    pub(crate) async fn list_paged<T: DeserializeOwned + HasId>(
        &self,
        service: ServiceType,
        operation: &'static str,
        path: &str,
        key: &'static str,
        filter: &Filter,
        page_size: usize,
    ) -> Result<Vec<T>, Error> {
        let mut out: Vec<T> = Vec::new();
        let mut marker: Option<String> = None;
        loop {
            let mut req = ApiRequest::get(service, operation, path);
            req.query = filter.pairs().to_vec();
            req.query.push(("limit".into(), page_size.to_string()));
            if let Some(m) = &marker {
                req.query.push(("marker".into(), m.clone()));
            }
            let page: Vec<T> = self.json_field(req, key).await?;
            let full = page.len() >= page_size;
            let last = page.last().map(|t| t.id().to_string());
            out.extend(page);
            match (full, last) {
                (true, Some(id)) if marker.as_deref() != Some(id.as_str()) => marker = Some(id),
                _ => return Ok(out),
            }
        }
    }
}

fn http_client(tls: &TlsConfig, options: &ClientOptions) -> Result<reqwest::Client, Error> {
    let mut builder = reqwest::Client::builder()
        .user_agent(options.user_agent.clone())
        .connect_timeout(options.connect_timeout)
        .pool_idle_timeout(Duration::from_secs(60))
        .danger_accept_invalid_certs(tls.insecure);
    if let Some(path) = &tls.cacert {
        let pem = std::fs::read(path).map_err(|e| Error::Client(format!("cacert {}: {e}", path.display())))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| Error::Client(format!("cacert {}: {e}", path.display())))?;
        if certs.is_empty() {
            return Err(Error::Client(format!("cacert {}: no PEM certificate in it", path.display())));
        }
        for cert in certs {
            builder = builder.add_root_certificate(cert);
        }
    }
    if let Some((cert, key)) = &tls.client_cert {
        let mut pem = std::fs::read(cert).map_err(|e| Error::Client(format!("cert {}: {e}", cert.display())))?;
        pem.extend(std::fs::read(key).map_err(|e| Error::Client(format!("key {}: {e}", key.display())))?);
        let identity = reqwest::Identity::from_pem(&pem).map_err(|e| Error::Client(format!("cert/key: {e}")))?;
        builder = builder.identity(identity);
    }
    builder.build().map_err(|e| Error::Client(e.to_string()))
}
