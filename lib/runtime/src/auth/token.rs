//! ServiceAccount tokens, checked with the Kubernetes TokenReview API (feature `kube`).
//!
//! A caller sends a ServiceAccount token issued for the kuryr audience (`--auth-audience`): in a
//! cluster, a projected token the kubelet keeps fresh, bound to the caller's pod (and so naming
//! its node); for an operator, `kubectl create token ... --audience kuryr`. The API server says
//! whether it is valid, for that audience, and whose it is. Tokens of another audience — the
//! ones pods get for the Kubernetes API — are refused, so a token lifted from a pod for one
//! purpose does not work for the other.
//!
//! The answer is cached per token (by its SHA-256) until shortly before the token expires, and
//! for at most `--auth-cache-ttl`, so a call costs a TokenReview only the first time a token is
//! seen: the per-call cost after that is a hash and a map lookup. Refusals are cached briefly,
//! what is not a JWT or is expired is refused without asking, and reviews in flight are
//! bounded, so that garbage cannot turn into load on the API server. Both caches are bounded.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use base64::Engine as _;
use futures::future::BoxFuture;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::{Api, PostParams};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tonic::Status;

use super::{Account, Call, Caller, Gate, Rules};

/// The longest token considered (ServiceAccount tokens are 1–2 KiB).
const MAX_TOKEN: usize = 16 * 1024;
/// Entries of each cache.
const CAPACITY: usize = 10_000;
/// How long a refusal is remembered.
const REFUSED_TTL: Duration = Duration::from_secs(10);
/// A token stops being trusted this long before it expires.
const EXPIRY_MARGIN: Duration = Duration::from_secs(30);
/// TokenReviews in flight at once.
const CONCURRENT_REVIEWS: usize = 8;
/// Deadline of one TokenReview.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);

/// The extra keys the API server sets for tokens bound to a pod or a node.
const NODE_NAME: &str = "authentication.kubernetes.io/node-name";
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";

type Digest = [u8; 32];

#[derive(Debug, Default)]
struct Cache {
    ok: HashMap<Digest, (Account, Instant)>,
    refused: HashMap<Digest, (String, Instant)>,
}

fn bounded_insert<V>(map: &mut HashMap<Digest, (V, Instant)>, key: Digest, value: (V, Instant)) {
    if map.len() >= CAPACITY {
        let now = Instant::now();
        map.retain(|_, (_, until)| *until > now);
        if map.len() >= CAPACITY
            && let Some(k) = map.keys().next().copied()
        {
            map.remove(&k);
        }
    }
    map.insert(key, value);
}

/// Labels of a token check: `cached`, `reviewed`, `refused` (by the API server or the cache of
/// refusals), `malformed`, `expired`, `unavailable`.
pub use crate::metrics::labels::ResultLabels;

/// Checks ServiceAccount tokens; share it in an `Arc`.
pub struct TokenReviewer {
    kubeconfig: Option<PathBuf>,
    audience: String,
    max_ttl: Duration,
    client: tokio::sync::OnceCell<kube::Client>,
    cache: Mutex<Cache>,
    reviews: tokio::sync::Semaphore,
    checks: Family<ResultLabels, Counter>,
}

impl std::fmt::Debug for TokenReviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReviewer")
            .field("audience", &self.audience)
            .field("max_ttl", &self.max_ttl)
            .field("connected", &self.client.initialized())
            .finish_non_exhaustive()
    }
}

impl TokenReviewer {
    /// Checks tokens for `audience` with the API server of `kubeconfig` (in-cluster when
    /// `None`), connected at the first check; answers are trusted for at most `max_ttl`.
    pub fn new(kubeconfig: Option<PathBuf>, audience: &str, max_ttl: Duration) -> Self {
        Self {
            kubeconfig,
            audience: audience.to_string(),
            max_ttl,
            client: tokio::sync::OnceCell::new(),
            cache: Mutex::default(),
            reviews: tokio::sync::Semaphore::new(CONCURRENT_REVIEWS),
            checks: Family::default(),
        }
    }

    /// Registers `kuryr_auth_token_checks_total{result}`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register("kuryr_auth_token_checks", "Bearer tokens checked, by how", self.checks.clone());
    }

    fn count(&self, result: &'static str) {
        self.checks.get_or_create(&ResultLabels { result }).inc();
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn cached(&self, key: &Digest) -> Option<Result<Account, Status>> {
        let now = Instant::now();
        let c = self.cache();
        if let Some((a, until)) = c.ok.get(key)
            && *until > now
        {
            return Some(Ok(a.clone()));
        }
        if let Some((why, until)) = c.refused.get(key)
            && *until > now
        {
            return Some(Err(Status::unauthenticated(why.clone())));
        }
        None
    }

    /// The account `token` belongs to: UNAUTHENTICATED when it is not a valid ServiceAccount
    /// token for the audience, UNAVAILABLE when the API server cannot be asked.
    pub async fn account(&self, token: &str) -> Result<Account, Status> {
        let exp = match claims_exp(token) {
            Ok(exp) => exp,
            Err(why) => {
                self.count("malformed");
                return Err(Status::unauthenticated(why));
            }
        };
        let now_unix = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs();
        if exp.is_some_and(|e| e <= now_unix) {
            self.count("expired");
            return Err(Status::unauthenticated("the token has expired"));
        }
        let key: Digest = {
            let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
            let mut k = [0u8; 32];
            k.copy_from_slice(d.as_ref());
            k
        };
        if let Some(hit) = self.cached(&key) {
            self.count(if hit.is_ok() { "cached" } else { "refused" });
            return hit;
        }
        let _permit = self.reviews.acquire().await.map_err(|_| Status::unavailable("shutting down"))?;
        // Another call may have reviewed the same token while this one waited.
        if let Some(hit) = self.cached(&key) {
            self.count(if hit.is_ok() { "cached" } else { "refused" });
            return hit;
        }
        let reviewed = self.review(token).await;
        let now = Instant::now();
        match reviewed {
            Ok(account) => {
                let by_exp = exp.map(|e| {
                    let left = Duration::from_secs(e.saturating_sub(now_unix));
                    now + left.saturating_sub(EXPIRY_MARGIN)
                });
                let until = by_exp.map_or(now + self.max_ttl, |t| t.min(now + self.max_ttl));
                bounded_insert(&mut self.cache().ok, key, (account.clone(), until));
                self.count("reviewed");
                Ok(account)
            }
            Err(s) if s.code() == tonic::Code::Unauthenticated => {
                bounded_insert(&mut self.cache().refused, key, (s.message().to_string(), now + REFUSED_TTL));
                self.count("refused");
                Err(s)
            }
            Err(s) => {
                self.count("unavailable");
                Err(s)
            }
        }
    }

    async fn review(&self, token: &str) -> Result<Account, Status> {
        let client =
            self.client.get_or_try_init(|| crate::k8s::kube_client(self.kubeconfig.as_deref())).await.map_err(|e| {
                Status::unavailable(format!("cannot reach the Kubernetes API to check the token: {e:#}"))
            })?;
        let review = TokenReview {
            spec: TokenReviewSpec { token: Some(token.to_string()), audiences: Some(vec![self.audience.clone()]) },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(client.clone());
        let created = tokio::time::timeout(REVIEW_TIMEOUT, api.create(&PostParams::default(), &review))
            .await
            .map_err(|_| Status::unavailable("the Kubernetes API did not answer the TokenReview in time"))?
            .map_err(|e| Status::unavailable(format!("TokenReview failed: {e}")))?;
        let status = created.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            let why = status.error.filter(|e| !e.is_empty()).unwrap_or_else(|| "not valid".into());
            return Err(Status::unauthenticated(format!("the Kubernetes API does not accept the token: {why}")));
        }
        if !status.audiences.iter().flatten().any(|a| *a == self.audience) {
            return Err(Status::unauthenticated(format!("the token is not for the audience {}", self.audience)));
        }
        let user = status.user.unwrap_or_default();
        let username = user.username.unwrap_or_default();
        let (namespace, name) = username
            .strip_prefix("system:serviceaccount:")
            .and_then(|r| r.split_once(':'))
            .ok_or_else(|| Status::unauthenticated(format!("{username} is not a ServiceAccount")))?;
        let extra = user.extra.unwrap_or_default();
        let one = |k: &str| extra.get(k).and_then(|v| v.first()).filter(|v| !v.is_empty()).cloned();
        Ok(Account {
            namespace: namespace.to_string(),
            name: name.to_string(),
            node: one(NODE_NAME),
            pod: one(POD_NAME),
        })
    }
}

/// The `exp` claim of a JWT, read without checking anything else (the API server does that):
/// an error for what is not a JWT at all.
fn claims_exp(token: &str) -> Result<Option<u64>, String> {
    let not_jwt = || "the bearer token is not a ServiceAccount token (a JWT)".to_string();
    if token.len() > MAX_TOKEN {
        return Err(format!("the bearer token is longer than {MAX_TOKEN} bytes"));
    }
    let mut parts = token.split('.');
    let (Some(_), Some(payload), Some(_), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(not_jwt());
    };
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|_| not_jwt())?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|_| not_jwt())?;
    Ok(v.get("exp").and_then(serde_json::Value::as_u64))
}

/// Admits callers with a ServiceAccount token whose account the [`Rules`] allow the method.
#[derive(Debug, Clone)]
pub struct Accounts {
    reviewer: Arc<TokenReviewer>,
    rules: Arc<Rules>,
}

impl Accounts {
    pub fn new(reviewer: Arc<TokenReviewer>, rules: Rules) -> Self {
        Self { reviewer, rules: Arc::new(rules) }
    }
}

impl Gate for Accounts {
    fn admit(&self, call: Call) -> BoxFuture<'static, Result<Caller, Status>> {
        let this = self.clone();
        Box::pin(async move {
            let token = call.bearer()?.ok_or_else(|| {
                Status::unauthenticated(format!(
                    "{} needs `authorization: Bearer <token>`: a ServiceAccount token with the audience {}",
                    call.path, this.reviewer.audience
                ))
            })?;
            let account = this.reviewer.account(token).await?;
            if let Err(denied) = this.rules.check(&call.path, &account) {
                tracing::warn!(caller = %account, path = call.path, "refused a call");
                return Err(denied);
            }
            Ok(Caller::Account(account))
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn jwt(payload: &str) -> String {
        let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        format!("{}.{}.sig", b(r#"{"alg":"RS256"}"#), b(payload))
    }

    #[test]
    fn only_jwts_are_considered() {
        assert_eq!(claims_exp(&jwt(r#"{"exp":1700000000,"sub":"x"}"#)).unwrap(), Some(1_700_000_000));
        assert_eq!(claims_exp(&jwt(r#"{"sub":"x"}"#)).unwrap(), None);
        for bad in ["", "abc", "a.b", "a.b.c.d", "a.!!!.c", &jwt("not json"), &"x".repeat(MAX_TOKEN + 1)] {
            assert!(claims_exp(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn garbage_and_expired_tokens_are_refused_without_asking() {
        // No API server anywhere: a check that asked would answer UNAVAILABLE.
        let r = TokenReviewer::new(Some(PathBuf::from("/nonexistent/kubeconfig")), "kuryr", Duration::from_secs(60));
        let e = r.account("garbage").await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
        let e = r.account(&jwt(r#"{"exp":1}"#)).await.unwrap_err();
        assert_eq!((e.code(), e.message()), (tonic::Code::Unauthenticated, "the token has expired"));
        let e = r.account(&jwt(r#"{"exp":99999999999}"#)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    }

    #[test]
    fn caches_stay_bounded() {
        let mut m: HashMap<Digest, ((), Instant)> = HashMap::new();
        let later = Instant::now() + Duration::from_secs(60);
        for i in 0..(CAPACITY + 50) {
            let mut k = [0u8; 32];
            k[..8].copy_from_slice(&(i as u64).to_le_bytes());
            bounded_insert(&mut m, k, ((), later));
        }
        assert_eq!(m.len(), CAPACITY);
    }
}
