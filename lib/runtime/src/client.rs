//! Connecting to another kuryr service: `HOST:PORT`, `http://HOST:PORT` or `unix:/path`.

use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// How long a connection attempt may take before the call fails with UNAVAILABLE.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A lazily connecting channel to `target`. Calls fail fast with UNAVAILABLE while the target is
/// down, and the channel reconnects by itself.
pub fn channel(target: &str) -> anyhow::Result<Channel> {
    if let Some(path) = target.strip_prefix("unix:") {
        let path = path.strip_prefix("//").unwrap_or(path).to_string();
        anyhow::ensure!(path.starts_with('/'), "`{target}`: a unix socket target needs an absolute path");
        // The URI is required by the API but unused: the connector below ignores it.
        let ep = Endpoint::try_from("http://localhost")?.connect_timeout(CONNECT_TIMEOUT);
        return Ok(ep.connect_with_connector_lazy(tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(TokioIo::new) }
        })));
    }
    let uri = if target.contains("://") { target.to_string() } else { format!("http://{target}") };
    let ep = Endpoint::try_from(uri.clone()).map_err(|e| anyhow::anyhow!("`{target}` is not a valid address: {e}"))?;
    Ok(ep.connect_timeout(CONNECT_TIMEOUT).tcp_nodelay(true).connect_lazy())
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
