//! Following the watcher's `Subscribe` stream, as its consumers do.
//!
//! The stream is resumed after a break with the point of the last event that carried one; when
//! the watcher cannot resume (another replica, a restart) it sends RESET and a snapshot, which
//! the consumer treats as a re-list. Reconnects back off from 100 ms to 5 s, and start from
//! 100 ms again once the stream has been live. The first break after the stream was live is
//! logged as a warning, the failed reconnects that follow at debug level.

use std::time::Duration;

use kuryr_proto::watcher::v1::watcher_client::WatcherClient;
use kuryr_proto::watcher::v1::{EventType, SubscribeRequest, SubscribeResponse};

use crate::Shutdown;

/// The first delay before reconnecting; it doubles after each failure.
pub const RECONNECT_MIN: Duration = Duration::from_millis(100);
/// The longest delay before reconnecting.
pub const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// Follows the watcher over `channel` with `request` (its `resume_from` is the starting point)
/// until shutdown.
///
/// `on_event` is called with every event but heartbeats, after its resume point was taken; it
/// returns whether the stream is live now (the event was SNAPSHOT_COMPLETE), which resets the
/// backoff. `on_break` is called each time the stream breaks or cannot be opened, before the
/// backoff — also when nothing, not even a heartbeat, arrived for `idle`.
pub async fn follow_watcher<E, B, C>(
    channel: C,
    mut request: SubscribeRequest,
    idle: Duration,
    shutdown: &Shutdown,
    mut on_event: E,
    mut on_break: B,
) where
    E: FnMut(SubscribeResponse) -> bool,
    B: FnMut(),
    C: tonic::client::GrpcService<tonic::body::Body>,
    C::Error: Into<tonic::codegen::StdError>,
    C::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <C::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let mut client = WatcherClient::new(channel);
    let mut delay = RECONNECT_MIN;
    let mut logged_down = false;
    loop {
        let opened = tokio::select! {
            r = client.subscribe(request.clone()) => r,
            () = shutdown.clone().wait() => return,
        };
        let why = match opened {
            Ok(resp) => {
                let mut stream = resp.into_inner();
                loop {
                    let msg = tokio::select! {
                        m = crate::streams::next_message(&mut stream, idle) => m,
                        () = shutdown.clone().wait() => return,
                    };
                    match msg {
                        Ok(Some(ev)) if ev.r#type() == EventType::Heartbeat => {}
                        Ok(Some(ev)) => {
                            if !ev.resume_point.is_empty() {
                                request.resume_from.clone_from(&ev.resume_point);
                            }
                            if on_event(ev) {
                                delay = RECONNECT_MIN;
                                logged_down = false;
                            }
                        }
                        Ok(None) => break "the watcher ended the stream".to_string(),
                        Err(s) => break format!("the stream broke: {}: {}", s.code(), s.message()),
                    }
                }
            }
            Err(s) => format!("cannot subscribe: {}: {}", s.code(), s.message()),
        };
        on_break();
        if logged_down {
            tracing::debug!(error = why, retry_in = ?delay, "watcher still unavailable");
        } else {
            tracing::warn!(error = why, "watcher unavailable; reconnecting with backoff");
            logged_down = true;
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.clone().wait() => return,
        }
        delay = (delay * 2).min(RECONNECT_MAX);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::{Arc, Mutex};

    use kuryr_proto::watcher::v1::watcher_server::{Watcher, WatcherServer};
    use tokio_stream::wrappers::TcpListenerStream;
    use tonic::{Request, Response, Status};

    use super::*;

    /// The events of one stream: (resume point, type).
    type Script = Vec<(&'static str, EventType)>;

    /// Answers each Subscribe with the next script (then ends the stream), recording the
    /// `resume_from` of every request.
    #[derive(Clone, Default)]
    struct Fake {
        scripts: Arc<Mutex<Vec<Script>>>,
        resumed_from: Arc<Mutex<Vec<String>>>,
    }

    #[tonic::async_trait]
    impl Watcher for Fake {
        type SubscribeStream = tokio_stream::Iter<std::vec::IntoIter<Result<SubscribeResponse, Status>>>;

        async fn subscribe(&self, req: Request<SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
            self.resumed_from.lock().unwrap().push(req.into_inner().resume_from);
            let mut scripts = self.scripts.lock().unwrap();
            if scripts.is_empty() {
                return Err(Status::unavailable("no more"));
            }
            let events = scripts
                .remove(0)
                .into_iter()
                .map(|(point, kind)| {
                    Ok(SubscribeResponse { resume_point: point.into(), r#type: kind as i32, object: None })
                })
                .collect::<Vec<_>>();
            Ok(Response::new(tokio_stream::iter(events)))
        }
    }

    #[tokio::test]
    async fn resumes_from_the_last_point_after_each_break() {
        let fake = Fake::default();
        *fake.scripts.lock().unwrap() = vec![
            vec![
                ("e-snapshot", EventType::Reset),
                ("e-snapshot", EventType::Applied),
                ("e-0", EventType::SnapshotComplete),
                ("e-1", EventType::Applied),
                ("", EventType::Applied),
            ],
            vec![("e-2", EventType::Deleted)],
        ];
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tonic::transport::Server::builder()
            .add_service(WatcherServer::new(fake.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener));
        tokio::spawn(server);

        let (trigger, shutdown) = crate::shutdown::channel();
        let (mut seen, mut breaks) = (Vec::new(), 0);
        let req = SubscribeRequest { subscriber: "test".into(), ..Default::default() };
        let on_event = |ev: SubscribeResponse| {
            seen.push(ev.resume_point.clone());
            ev.r#type() == EventType::SnapshotComplete
        };
        let on_break = || {
            breaks += 1;
            // Third break: the second stream ended and one reconnect was refused.
            if breaks == 3 {
                trigger.trigger();
            }
        };
        let channel = crate::client::channel(&addr.to_string()).unwrap();
        let follow = follow_watcher(channel, req, Duration::from_secs(5), &shutdown, on_event, on_break);
        tokio::time::timeout(Duration::from_secs(10), follow).await.unwrap();
        assert_eq!(seen, ["e-snapshot", "e-snapshot", "e-0", "e-1", "", "e-2"]);
        assert_eq!(breaks, 3);
        assert_eq!(*fake.resumed_from.lock().unwrap(), ["", "e-1", "e-2"]);
    }
}
