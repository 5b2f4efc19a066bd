//! Connecting to another kuryr service: `HOST:PORT`, `http://HOST:PORT` or `unix:/path`.

use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// How long a connection attempt may take before the call fails with UNAVAILABLE.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The deadline of every call on a channel that sets none shorter: until the answer (for a
/// stream, until it opens). Nothing kuryr asks another service takes this long; a peer that is
/// stopped or partitioned makes the call fail instead of hang.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// HTTP/2 PINGs on every connection, idle or not: a peer that stops answering them (stopped,
/// partitioned, its host gone) is found within interval + timeout and the connection closed, so
/// that calls and streams on it fail and reconnect.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// An endpoint for `uri` with the settings every kuryr channel has: connect timeout, call
/// deadline and HTTP/2 keepalive.
pub(crate) fn endpoint(uri: &str) -> Result<Endpoint, tonic::transport::Error> {
    Ok(Endpoint::try_from(uri.to_string())?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(CALL_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true))
}

/// A lazily connecting channel to `target`. Calls fail fast with UNAVAILABLE while the target is
/// down, and the channel reconnects by itself. Every call has a deadline ([`CALL_TIMEOUT`] unless
/// the caller sets a shorter one) and the connection is watched by HTTP/2 keepalive.
pub fn channel(target: &str) -> anyhow::Result<Channel> {
    if let Some(path) = target.strip_prefix("unix:") {
        let path = path.strip_prefix("//").unwrap_or(path).to_string();
        anyhow::ensure!(path.starts_with('/'), "`{target}`: a unix socket target needs an absolute path");
        // The URI is required by the API but unused: the connector below ignores it.
        let ep = endpoint("http://localhost")?;
        return Ok(ep.connect_with_connector_lazy(tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(TokioIo::new) }
        })));
    }
    let uri = if target.contains("://") { target.to_string() } else { format!("http://{target}") };
    let ep = endpoint(&uri).map_err(|e| anyhow::anyhow!("`{target}` is not a valid address: {e}"))?;
    Ok(ep.tcp_nodelay(true).connect_lazy())
}

/// Asks `channel`'s grpc.health.v1 whether `service` is SERVING.
pub async fn check_serving(channel: Channel, service: &str) -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let resp = HealthClient::new(channel)
        .check(HealthCheckRequest { service: service.to_string() })
        .await
        .map_err(|s| anyhow::anyhow!("health check of {service}: {}: {}", s.code(), s.message()))?;
    let status = resp.into_inner().status();
    anyhow::ensure!(status == ServingStatus::Serving, "{service} reports {}", status.as_str_name());
    Ok(())
}
