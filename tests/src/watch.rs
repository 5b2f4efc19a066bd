//! Reading the services' watch streams (WatchVifs, WatchLoadBalancers) as a binder does: heartbeats
//! skipped, every event awaited for a bounded time, and how the stream stopped delivering.

use std::time::Duration;

/// How a stream stopped delivering.
#[derive(Debug)]
pub enum End {
    /// It ended cleanly.
    Ended,
    /// It failed with a status (or a broken connection).
    Failed(tonic::Status),
    /// Nothing arrived within the bound.
    Silent,
}

/// The next event of `stream` that is not a heartbeat (`is_heartbeat`), waiting at most
/// `timeout` for each message.
pub async fn next_event<T>(
    stream: &mut tonic::Streaming<T>,
    timeout: Duration,
    is_heartbeat: impl Fn(&T) -> bool,
) -> Result<T, End> {
    loop {
        match tokio::time::timeout(timeout, stream.message()).await {
            Ok(Ok(Some(ev))) if is_heartbeat(&ev) => {}
            Ok(Ok(Some(ev))) => return Ok(ev),
            Ok(Ok(None)) => return Err(End::Ended),
            Ok(Err(s)) => return Err(End::Failed(s)),
            Err(_) => return Err(End::Silent),
        }
    }
}

/// Calls `next` (reading and applying one event) until the stream ends or fails, and says how;
/// panics when it stays open, silent.
pub async fn until_end<T>(mut next: impl AsyncFnMut() -> Result<T, End>) -> End {
    loop {
        match next().await {
            Ok(_) => {}
            Err(End::Silent) => panic!("the stream stayed open, silent"),
            Err(e) => return e,
        }
    }
}
