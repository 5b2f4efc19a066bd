//! Calling kuryr's services as their clients do: with a ServiceAccount token for the kuryr
//! audience (from [`crate::kube::KubeEnv::kuryr_token`]).

use anyhow::Result;
use kuryr_runtime::auth::client::{Credentials, PeerChannel, with_credentials};

/// A channel to `target` (`HOST:PORT` or `unix:/path`) whose calls carry `token`.
pub fn channel(target: &str, token: &str) -> Result<PeerChannel> {
    Ok(with_credentials(kuryr_runtime::client::channel(target)?, Credentials::bearer(token)?))
}

/// The grpcurl flag pair sending `token`: `-H`, `authorization: Bearer <token>`.
pub fn grpcurl_header(token: &str) -> [String; 2] {
    ["-H".to_string(), format!("authorization: Bearer {token}")]
}
