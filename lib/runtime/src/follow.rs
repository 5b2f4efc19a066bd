//! Streams between kuryr services, at the gRPC edge: the flags of both ends (the server's
//! heartbeat, the reader's idle timeout) and the watcher's `Subscribe` as a
//! [`kuryr_stream::follow::Source`], which the allocator and lbaas follow with the one follower
//! of [`kuryr_stream::follow`] (resume, RESET, idle timeout, jittered backoff).

use std::fmt;
use std::time::Duration;

use clap::Args;
use kuryr_proto::watcher::v1::watcher_client::WatcherClient;
use kuryr_proto::watcher::v1::{EventType, SubscribeRequest, SubscribeResponse};
use kuryr_stream::follow::{FollowConfig, Follower, Mark, Source};
use tonic::{Status, Streaming};

use crate::auth::client::PeerChannel;
use crate::config::parse_duration;

/// The heartbeat of the streams a service serves (`Subscribe`, `WatchVifs`, `WatchLoadBalancers`).
#[derive(Clone, Debug, Args)]
pub struct HeartbeatArgs {
    /// Streams this service serves carry a HEARTBEAT event whenever nothing else was sent for
    /// this long, so that their readers can tell a quiet stream from a server that is gone,
    /// stopped or stuck.
    #[arg(long, env = "KURYR_STREAM_HEARTBEAT", default_value = "5s", value_parser = parse_heartbeat)]
    pub stream_heartbeat: Duration,
}

/// How a service reads the streams of the others.
#[derive(Clone, Debug, Args)]
pub struct FollowArgs {
    /// A stream this service reads from another kuryr service on which nothing arrives for this
    /// long — not even a heartbeat — is taken for dead (a stopped, partitioned or stuck peer): it
    /// is dropped and reopened with backoff, and what depends on it is NOT_SERVING meanwhile.
    /// Keep it a few times the peers' --stream-heartbeat.
    #[arg(long, env = "KURYR_STREAM_IDLE_TIMEOUT", default_value = "15s", value_parser = parse_idle_timeout)]
    pub stream_idle_timeout: Duration,
}

impl FollowArgs {
    /// The follower's configuration.
    pub fn config(&self) -> FollowConfig {
        FollowConfig::with_idle_timeout(self.stream_idle_timeout)
    }
}

fn at_least(s: &str, min: Duration) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < min {
        return Err(format!("`{s}`: at least {min:?}"));
    }
    Ok(d)
}

/// A heartbeat interval: at least 100 ms (more often is only load).
pub fn parse_heartbeat(s: &str) -> Result<Duration, String> {
    at_least(s, Duration::from_millis(100))
}

/// An idle timeout: at least 500 ms.
pub fn parse_idle_timeout(s: &str) -> Result<Duration, String> {
    at_least(s, Duration::from_millis(500))
}

/// A failed call or stream, as followers log it: `CODE: message`.
#[derive(Debug)]
pub struct Failed(pub Status);

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.0.code(), self.0.message())
    }
}

/// The next message of a gRPC stream, for [`Source::next`] implementations.
pub async fn next_message<T>(stream: &mut Streaming<T>) -> Result<Option<T>, Failed> {
    stream.message().await.map_err(Failed)
}

/// The watcher's `Subscribe` stream for one request (its `resume_from` is set by the follower).
#[derive(Debug)]
pub struct WatcherSource {
    client: WatcherClient<PeerChannel>,
    request: SubscribeRequest,
}

impl Source for WatcherSource {
    type Event = SubscribeResponse;
    type Error = Failed;
    type Stream = Streaming<SubscribeResponse>;

    async fn open(&mut self, resume_from: &str) -> Result<Self::Stream, Failed> {
        let mut req = self.request.clone();
        resume_from.clone_into(&mut req.resume_from);
        Ok(self.client.subscribe(req).await.map_err(Failed)?.into_inner())
    }

    async fn next(stream: &mut Self::Stream) -> Result<Option<SubscribeResponse>, Failed> {
        next_message(stream).await
    }

    fn mark(event: &SubscribeResponse) -> Mark {
        match event.r#type() {
            EventType::Reset => Mark::Reset,
            EventType::SnapshotComplete => Mark::SnapshotComplete,
            EventType::Heartbeat => Mark::Heartbeat,
            EventType::Applied | EventType::Deleted | EventType::Unspecified => Mark::Change,
        }
    }

    fn resume_point(event: &SubscribeResponse) -> &str {
        &event.resume_point
    }
}

/// A follower of the watcher over `channel` with `request`, starting from its `resume_from`.
pub fn follow_watcher(
    channel: PeerChannel,
    request: SubscribeRequest,
    config: FollowConfig,
) -> Follower<WatcherSource> {
    let resume = request.resume_from.clone();
    Follower::new(WatcherSource { client: WatcherClient::new(channel), request }, "the watcher", config)
        .resuming_from(resume)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::{Arc, Mutex};

    use kuryr_proto::watcher::v1::watcher_server::{Watcher, WatcherServer};
    use kuryr_stream::Followed;
    use tokio_stream::wrappers::TcpListenerStream;
    use tonic::{Request, Response};

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
    async fn follows_a_real_server_resuming_after_each_break() {
        let fake = Fake::default();
        *fake.scripts.lock().unwrap() = vec![
            vec![
                ("e-snapshot", EventType::Reset),
                ("e-snapshot", EventType::Applied),
                ("e-0", EventType::SnapshotComplete),
                ("", EventType::Heartbeat),
                ("e-1", EventType::Applied),
                ("", EventType::Applied),
            ],
            vec![("e-1", EventType::SnapshotComplete), ("e-2", EventType::Deleted)],
        ];
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tonic::transport::Server::builder()
            .add_service(WatcherServer::new(fake.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener));
        tokio::spawn(server);

        let channel = crate::client::channel(&addr.to_string()).unwrap();
        let channel = crate::auth::client::with_credentials(channel, crate::auth::client::Credentials::None);
        let req = SubscribeRequest { subscriber: "test".into(), ..Default::default() };
        let mut f = follow_watcher(channel, req, FollowConfig::default());
        let mut seen = Vec::new();
        let mut downs = Vec::new();
        while downs.len() < 3 {
            match tokio::time::timeout(Duration::from_secs(10), f.next()).await.unwrap() {
                Followed::Event(ev) => seen.push(format!("{:?}@{}", ev.r#type(), ev.resume_point)),
                Followed::Down(why) => downs.push(why),
            }
        }
        assert_eq!(
            seen,
            [
                "Reset@e-snapshot",
                "Applied@e-snapshot",
                "SnapshotComplete@e-0",
                "Applied@e-1",
                "Applied@",
                "SnapshotComplete@e-1",
                "Deleted@e-2"
            ]
        );
        assert_eq!(downs[0], "the server ended the stream");
        assert!(downs[2].contains("Unavailable: no more"), "{downs:?}");
        assert_eq!(*fake.resumed_from.lock().unwrap(), ["", "e-1", "e-2"]);
    }

    #[test]
    fn flags_refuse_useless_values() {
        assert_eq!(parse_heartbeat("5s"), Ok(Duration::from_secs(5)));
        assert!(parse_heartbeat("10ms").unwrap_err().contains("at least"));
        assert_eq!(parse_idle_timeout("15s"), Ok(Duration::from_secs(15)));
        assert!(parse_idle_timeout("0").is_err());
    }
}
