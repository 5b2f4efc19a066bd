//! Dependency probes: a service is NOT_SERVING while what it depends on is unreachable, and keeps
//! serving health and reflection meanwhile so that it can be inspected.

use std::future::Future;
use std::time::Duration;

use crate::health::Health;
use crate::shutdown::Shutdown;

/// How often a healthy dependency is checked again.
const RECHECK: Duration = Duration::from_secs(5);
/// Retry delays while a dependency is down: start fast (startup order is arbitrary), back off to
/// a ceiling that keeps logs quiet.
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// A probe that takes longer than this counts as a failure.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Spawns a task that runs `probe` and sets `service` SERVING while it succeeds and NOT_SERVING
/// while it fails, logging each change once with the cause. Ends at shutdown.
pub fn spawn_probe<F, Fut>(
    health: Health,
    service: &'static str,
    dependency: &'static str,
    shutdown: Shutdown,
    probe: F,
) where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    tokio::spawn(async move {
        health.register(service).await;
        let mut backoff = kuryr_stream::Backoff::new("dependency-probe", RETRY_MIN, RETRY_MAX);
        let mut was_ok: Option<bool> = None;
        loop {
            let res = match tokio::time::timeout(PROBE_TIMEOUT, probe()).await {
                Ok(r) => r,
                Err(_) => Err(anyhow::anyhow!("no answer within {PROBE_TIMEOUT:?}")),
            };
            let next = match res {
                Ok(()) => {
                    if was_ok != Some(true) {
                        tracing::info!(service, dependency, "dependency reachable");
                        health.set_serving(service).await;
                    }
                    was_ok = Some(true);
                    backoff.reset();
                    RECHECK
                }
                Err(e) => {
                    if was_ok != Some(false) {
                        tracing::warn!(
                            service,
                            dependency,
                            error = format!("{e:#}"),
                            "dependency unreachable; not serving"
                        );
                        health.set_not_serving(service).await;
                    }
                    was_ok = Some(false);
                    backoff.next_delay("unreachable")
                }
            };
            tokio::select! {
                () = tokio::time::sleep(next) => {}
                () = shutdown.clone().wait() => return,
            }
        }
    });
}
