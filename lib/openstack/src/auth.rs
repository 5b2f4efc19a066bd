//! Keystone v3 tokens and the session layer that puts them on requests.
//!
//! - One token is shared by every call. It is requested again a margin before it expires (the
//!   lifetime is measured from Keystone's own `issued_at`/`expires_at`, so clock skew between this
//!   node and Keystone does not matter), and once when a service answers 401 (revoked token).
//! - Concurrent callers that find no valid token wait for one authentication instead of each
//!   starting their own.
//! - If renewing fails while the old token has not expired yet, the old one keeps being used.
//! - Endpoints come from the token's catalog (service type, interface, region), unless overridden.
//! - Without Keystone (`auth_type: none`) the configured endpoints are used and the project goes in
//!   the `X-Project-Id` header.

use std::collections::BTreeMap;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Method, StatusCode};
use reqwest::Url;
use serde::Deserialize;
use serde_json::json;
use tokio::time::Instant;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

use crate::config::{AppCredential, AuthConfig, DomainRef, Interface, ProjectScope, UserRef};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::service::ServiceType;
use crate::transport::{ApiRequest, ApiResponse, Target};

pub(crate) type Stack = BoxCloneSyncService<ApiRequest, ApiResponse, Error>;

/// Where a service's endpoint comes from and how requests are authenticated.
pub(crate) struct Authenticator {
    pub mode: Mode,
    pub interface: Interface,
    pub region: Option<String>,
    pub overrides: BTreeMap<ServiceType, Url>,
}

pub(crate) enum Mode {
    NoAuth { project_id: Option<String> },
    Keystone(Box<Keystone>),
}

impl fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match &self.mode {
            Mode::NoAuth { .. } => "none",
            Mode::Keystone(_) => "keystone",
        };
        f.debug_struct("Authenticator")
            .field("mode", &mode)
            .field("interface", &self.interface)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

/// A Keystone token with what came with it.
pub(crate) struct Token {
    /// The `X-Subject-Token` value, marked sensitive so it is never logged.
    secret: HeaderValue,
    /// When to get a new one.
    refresh_at: Instant,
    /// When Keystone stops accepting it.
    expires: Instant,
    catalog: Vec<CatalogService>,
    pub project_id: Option<String>,
}

impl Token {
    /// The token itself.
    pub fn secret(&self) -> String {
        String::from_utf8_lossy(self.secret.as_bytes()).into_owned()
    }
}

#[derive(Clone, Debug, Deserialize)]
pub(crate) struct CatalogService {
    #[serde(rename = "type")]
    service_type: String,
    #[serde(default)]
    endpoints: Vec<CatalogEndpoint>,
}

#[derive(Clone, Debug, Deserialize)]
pub(crate) struct CatalogEndpoint {
    interface: String,
    #[serde(default)]
    region: Option<String>,
    #[serde(default)]
    region_id: Option<String>,
    url: String,
}

#[derive(Debug, Deserialize)]
struct TokenBody {
    token: TokenInfo,
}

#[derive(Debug, Deserialize)]
struct TokenInfo {
    expires_at: String,
    #[serde(default)]
    issued_at: Option<String>,
    #[serde(default)]
    catalog: Vec<CatalogService>,
    #[serde(default)]
    project: Option<IdOnly>,
}

#[derive(Debug, Deserialize)]
struct IdOnly {
    id: String,
}

/// When to renew a token that lives `lifetime`: `margin` before it expires, but never in the
/// first half of its life (a Keystone configured with very short tokens would otherwise have
/// every call authenticate).
pub(crate) fn refresh_after(lifetime: Duration, margin: Duration) -> Duration {
    lifetime.saturating_sub(margin.min(lifetime / 2))
}

/// The lifetime Keystone gave a token, from its own timestamps.
pub(crate) fn token_lifetime(issued_at: Option<&str>, expires_at: &str) -> Result<Duration, Error> {
    let parse = |s: &str| s.parse::<jiff::Timestamp>().map_err(|e| Error::BadToken(format!("timestamp {s:?}: {e}")));
    let expires = parse(expires_at)?;
    let issued = match issued_at {
        Some(s) => parse(s)?,
        None => jiff::Timestamp::now(),
    };
    let secs = expires.duration_since(issued).as_secs_f64();
    if secs <= 0.0 {
        return Err(Error::BadToken(format!("token expires ({expires_at}) before it was issued")));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The endpoint of `service` in `catalog` for `interface`, in `region` if one is given.
pub(crate) fn find_endpoint(
    catalog: &[CatalogService],
    service: ServiceType,
    interface: Interface,
    region: Option<&str>,
) -> Result<Url, Error> {
    let found = catalog
        .iter()
        .filter(|s| s.service_type == service.as_str())
        .flat_map(|s| s.endpoints.iter())
        .filter(|e| Interface::parse(&e.interface) == Some(interface))
        .find(|e| match region {
            None => true,
            Some(r) => e.region_id.as_deref() == Some(r) || e.region.as_deref() == Some(r),
        });
    let not_found = || Error::NoEndpoint { service, interface: interface.as_str(), region: region.map(str::to_string) };
    let endpoint = found.ok_or_else(not_found)?;
    Url::parse(&endpoint.url).map_err(|e| Error::BadToken(format!("catalog URL {:?} for {service}: {e}", endpoint.url)))
}

/// The JSON body of `POST /v3/auth/tokens` for `auth` (None for no-auth mode).
pub(crate) fn auth_request_body(auth: &AuthConfig) -> Option<serde_json::Value> {
    let domain = |d: &DomainRef| match d {
        DomainRef::Id(id) => json!({"id": id}),
        DomainRef::Name(name) => json!({"name": name}),
    };
    let user = |u: &UserRef| match u {
        UserRef::Id(id) => json!({"id": id}),
        UserRef::Name { name, domain: d } => json!({"name": name, "domain": domain(d)}),
    };
    match auth {
        AuthConfig::Password { user: u, password, project, .. } => {
            let mut identity_user = user(u);
            identity_user["password"] = json!(password);
            let project = match project {
                ProjectScope::Id(id) => json!({"id": id}),
                ProjectScope::Name { name, domain: d } => json!({"name": name, "domain": domain(d)}),
            };
            Some(json!({"auth": {
                "identity": {"methods": ["password"], "password": {"user": identity_user}},
                "scope": {"project": project},
            }}))
        }
        AuthConfig::ApplicationCredential { credential, .. } => {
            let cred = match credential {
                AppCredential::Id { id, secret } => json!({"id": id, "secret": secret}),
                AppCredential::Name { name, user: u, secret } => {
                    json!({"name": name, "user": user(u), "secret": secret})
                }
            };
            Some(json!({"auth": {"identity": {"methods": ["application_credential"], "application_credential": cred}}}))
        }
        AuthConfig::NoAuth { .. } => None,
    }
}

/// Keystone authentication with a cached, shared token.
pub(crate) struct Keystone {
    tokens_url: Url,
    body: bytes::Bytes,
    transport: Stack,
    margin: Duration,
    metrics: Arc<Metrics>,
    current: RwLock<Option<Arc<Token>>>,
    /// Held while authenticating, so that concurrent callers share one authentication.
    refreshing: tokio::sync::Mutex<()>,
    count: AtomicU64,
}

impl Keystone {
    pub fn new(
        auth_url: &Url,
        body: serde_json::Value,
        transport: Stack,
        margin: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        let mut tokens_url = auth_url.clone();
        tokens_url.set_path(&format!("{}/auth/tokens", auth_url.path().trim_end_matches('/')));
        Self {
            tokens_url,
            body: bytes::Bytes::from(body.to_string()),
            transport,
            margin,
            metrics,
            current: RwLock::new(None),
            refreshing: tokio::sync::Mutex::new(()),
            count: AtomicU64::new(0),
        }
    }

    /// Successful authentications so far.
    pub fn authentications(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn fresh(&self) -> Option<Arc<Token>> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        current.as_ref().filter(|t| Instant::now() < t.refresh_at).cloned()
    }

    /// A valid token, authenticating if there is none or it is due for renewal.
    pub async fn token(&self) -> Result<Arc<Token>, Error> {
        if let Some(t) = self.fresh() {
            return Ok(t);
        }
        let _one_at_a_time = self.refreshing.lock().await;
        // Whoever held the lock before may have just renewed it.
        if let Some(t) = self.fresh() {
            return Ok(t);
        }
        match self.authenticate().await {
            Ok(token) => {
                let token = Arc::new(token);
                *self.current.write().unwrap_or_else(PoisonError::into_inner) = Some(token.clone());
                Ok(token)
            }
            Err(e) => {
                let current = self.current.read().unwrap_or_else(PoisonError::into_inner).clone();
                match current.filter(|t| Instant::now() < t.expires) {
                    Some(old) => {
                        tracing::warn!(error = %e, "renewing the Keystone token failed; the current one is still valid");
                        Ok(old)
                    }
                    None => Err(e),
                }
            }
        }
    }

    /// Forgets `failed` (a service answered 401 with it); a newer token is kept.
    pub fn invalidate(&self, failed: &Arc<Token>) {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        if current.as_ref().is_some_and(|t| Arc::ptr_eq(t, failed)) {
            *current = None;
        }
    }

    async fn authenticate(&self) -> Result<Token, Error> {
        let result = self.request_token().await;
        match &result {
            Ok(t) => {
                self.count.fetch_add(1, Ordering::Relaxed);
                self.metrics.record_auth("ok");
                tracing::info!(
                    url = %self.tokens_url, project_id = t.project_id,
                    renew_in_s = t.refresh_at.saturating_duration_since(Instant::now()).as_secs(),
                    "authenticated with Keystone"
                );
            }
            Err(e) => {
                self.metrics.record_auth(e.reason());
                tracing::warn!(url = %self.tokens_url, error = %e, "Keystone authentication failed");
            }
        }
        result.map_err(|e| Error::Auth(Box::new(e)))
    }

    async fn request_token(&self) -> Result<Token, Error> {
        let mut req = ApiRequest::new(ServiceType::Identity, "auth.tokens", Method::POST, "").idempotent(true);
        req.target = Target::Url(self.tokens_url.clone());
        req.headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        req.body = Some(self.body.clone());
        let sent = Instant::now();
        let resp = self.transport.clone().oneshot(req).await?;
        if resp.status != StatusCode::CREATED && resp.status != StatusCode::OK {
            return Err(Error::from_response(
                ServiceType::Identity,
                "auth.tokens",
                resp.status,
                resp.request_id(),
                &resp.body,
            ));
        }
        let mut secret = resp
            .headers
            .get("x-subject-token")
            .cloned()
            .ok_or_else(|| Error::BadToken("no X-Subject-Token header".into()))?;
        secret.set_sensitive(true);
        let body: TokenBody = serde_json::from_slice(&resp.body).map_err(|source| Error::Decode {
            call: crate::error::Call { service: ServiceType::Identity, operation: "auth.tokens" },
            source,
        })?;
        let lifetime = token_lifetime(body.token.issued_at.as_deref(), &body.token.expires_at)?;
        Ok(Token {
            secret,
            refresh_at: sent + refresh_after(lifetime, self.margin),
            expires: sent + lifetime,
            catalog: body.token.catalog,
            project_id: body.token.project.map(|p| p.id),
        })
    }
}

impl Authenticator {
    /// The project requests act in: the token's, or the configured one without Keystone.
    pub async fn project_id(&self) -> Result<Option<String>, Error> {
        match &self.mode {
            Mode::NoAuth { project_id } => Ok(project_id.clone()),
            Mode::Keystone(k) => Ok(k.token().await?.project_id.clone()),
        }
    }

    /// The URL of `req` and its authentication headers.
    fn prepare(&self, req: &mut ApiRequest, token: Option<&Token>) -> Result<(), Error> {
        if let Target::Path(path) = &req.target {
            let endpoint = match (self.overrides.get(&req.service), token) {
                (Some(url), _) => url.clone(),
                (None, Some(t)) => find_endpoint(&t.catalog, req.service, self.interface, self.region.as_deref())?,
                (None, None) => {
                    return Err(Error::NoEndpoint {
                        service: req.service,
                        interface: self.interface.as_str(),
                        region: self.region.clone(),
                    });
                }
            };
            let mut url = req.service.versioned_base(&endpoint);
            url.set_path(&format!("{}{}", url.path(), path));
            req.url = Some(url);
        }
        match (&self.mode, token) {
            (Mode::Keystone(_), Some(t)) => {
                req.headers.insert("x-auth-token", t.secret.clone());
            }
            (Mode::NoAuth { project_id: Some(p) }, _) => {
                let v = HeaderValue::from_str(p).map_err(|_| Error::InvalidRequest(format!("project id {p:?}")))?;
                req.headers.insert("x-project-id", v);
            }
            _ => {}
        }
        Ok(())
    }
}

/// The session layer: endpoint and token on every request, one re-authentication on 401.
#[derive(Clone)]
pub(crate) struct Session<S> {
    pub inner: S,
    pub auth: Arc<Authenticator>,
}

impl<S> fmt::Debug for Session<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session").field("auth", &self.auth).finish_non_exhaustive()
    }
}

impl<S> tower::Service<ApiRequest> for Session<S>
where
    S: tower::Service<ApiRequest, Response = ApiResponse, Error = Error> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = ApiResponse;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<ApiResponse, Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Error>> {
        // Readiness is awaited per call on a clone of the inner service (`oneshot`).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: ApiRequest) -> Self::Future {
        let inner = self.inner.clone();
        let auth = self.auth.clone();
        Box::pin(async move {
            let Mode::Keystone(keystone) = &auth.mode else {
                auth.prepare(&mut req, None)?;
                return inner.oneshot(req).await;
            };
            let token = keystone.token().await?;
            let mut first = req.clone();
            auth.prepare(&mut first, Some(&token))?;
            let resp = inner.clone().oneshot(first).await?;
            if resp.status != StatusCode::UNAUTHORIZED {
                return Ok(resp);
            }
            tracing::info!(
                service = %req.service, operation = req.operation,
                "token refused (revoked or expired early), authenticating again"
            );
            keystone.invalidate(&token);
            let token = keystone.token().await?;
            auth.prepare(&mut req, Some(&token))?;
            inner.oneshot(req).await
        })
    }
}

#[cfg(test)]
#[path = "auth_tests.rs"]
mod tests;
