//! Reading a server stream from another kuryr service with an idle timeout.
//!
//! The servers send a heartbeat whenever a stream has been quiet for their `--stream-heartbeat`;
//! a reader that hears nothing at all for its `--stream-idle-timeout` takes the server for gone
//! (stopped, partitioned, stuck) and drops the stream, rather than waiting on a connection that
//! may never say another word. HTTP/2 keepalive finds dead connections too, but not a server
//! whose process answers PINGs while the stream itself is stuck.

use std::time::Duration;

use tonic::{Status, Streaming};

/// The next message of `stream`; DEADLINE_EXCEEDED when nothing, not even a heartbeat, arrived
/// for `idle`.
pub async fn next_message<T>(stream: &mut Streaming<T>, idle: Duration) -> Result<Option<T>, Status> {
    match tokio::time::timeout(idle, stream.message()).await {
        Ok(r) => r,
        Err(_) => Err(Status::deadline_exceeded(format!(
            "nothing received for {idle:?}, not even a heartbeat: the server is gone, stopped or stuck"
        ))),
    }
}
