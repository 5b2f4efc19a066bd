//! Start-up steps that must eventually succeed (building a client, loading state from the API):
//! retried with backoff until they do, or until shutdown.

use std::time::Duration;

use crate::Shutdown;

/// The first ceiling of the delay between attempts ([`kuryr_stream::backoff`], full jitter); it
/// doubles after each failure.
pub const RETRY_MIN: Duration = Duration::from_millis(200);
/// The longest ceiling of the delay between attempts.
pub const RETRY_MAX: Duration = Duration::from_secs(5);

/// Runs `step` until it succeeds, backing off between attempts from [`RETRY_MIN`] to
/// [`RETRY_MAX`] (each retry counted in `kuryr_retries_total{component="startup",reason=what}`)
/// and logging each new error once; `None` at shutdown. `what` is a fixed phrase naming the step.
pub async fn retry<T, F, Fut>(what: &'static str, shutdown: &Shutdown, mut step: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let mut backoff = kuryr_stream::Backoff::new("startup", RETRY_MIN, RETRY_MAX);
    let mut last_error = String::new();
    loop {
        let attempt = tokio::select! {
            r = step() => r,
            () = shutdown.clone().wait() => return None,
        };
        match attempt {
            Ok(v) => return Some(v),
            Err(e) => {
                let error = format!("{e:#}");
                if error != last_error {
                    tracing::warn!(error, "{what} failed; retrying with backoff");
                    last_error = error;
                }
            }
        }
        tokio::select! {
            () = backoff.sleep(what) => {}
            () = shutdown.clone().wait() => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn retries_until_success_and_stops_at_shutdown() {
        let (trigger, shutdown) = crate::shutdown::channel();
        let tries = AtomicU32::new(0);
        let got = retry("step", &shutdown, || async {
            if tries.fetch_add(1, Ordering::Relaxed) < 3 { Err(anyhow::anyhow!("not yet")) } else { Ok(7) }
        })
        .await;
        assert_eq!((got, tries.load(Ordering::Relaxed)), (Some(7), 4));

        trigger.trigger();
        let never = retry("step", &shutdown, || async { Err::<(), _>(anyhow::anyhow!("down")) }).await;
        assert_eq!(never, None);
    }
}
