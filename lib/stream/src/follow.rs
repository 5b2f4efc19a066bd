//! Following a stream another kuryr service serves with [`crate::feed`] — a snapshot, then
//! deltas, each with a resume point — as every consumer does: the watcher's `Subscribe` (the
//! allocator, lbaas), `WatchVifs` and `WatchLoadBalancers` (the binder).
//!
//! One [`Follower`] per stream, generic over a [`Source`] that opens the stream and reads its
//! events (the gRPC edge lives there, not here). The follower:
//!
//! - resumes after a break from the point of the last event that carried one; a server that
//!   cannot resume sends RESET and a snapshot, which the consumer handles as a re-list;
//! - takes a stream on which nothing arrived for [`FollowConfig::idle_timeout`] — not even a
//!   heartbeat — for dead (the server is stopped, partitioned or stuck: its connection may stay
//!   open for ever), drops it and reconnects; an open that does not answer within that time
//!   fails the same way;
//! - reconnects with full-jitter exponential backoff ([`crate::backoff`]; each reconnect counted in
//!   `kuryr_retries_total` under the follower's name and the failure), from [`FollowConfig::backoff_min`] up to
//!   [`FollowConfig::backoff_max`], starting from the minimum again once the stream was live
//!   (its snapshot complete), unless the source asks to retry at once (a redirect to the replica
//!   that serves the stream);
//! - logs the first failure after the stream was live as a warning and the failed reconnects
//!   that follow at debug level, so that an outage is one line, not one per attempt.
//!
//! The consumer pulls [`Followed`] items: every event but heartbeats, and a [`Followed::Down`]
//! each time the stream is lost or could not be opened, so that it can drop its readiness and
//! count reconnects. Time is tokio's: tests drive it with a paused clock.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::backoff::Backoff;

/// The first reconnect delay (before jitter); it doubles after each failure.
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// The longest reconnect delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How long a stream may stay silent before it is taken for dead: three heartbeats of the
/// servers' default 5 s interval, so that one late heartbeat never drops a healthy stream.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(15);

/// What an event is to the follower.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    /// A change (or a snapshot item).
    Change,
    /// Forget everything: a snapshot follows. The stream is not live until it completes.
    Reset,
    /// The snapshot is complete (or the stream resumed): the stream is live.
    SnapshotComplete,
    /// Proof of life only; not handed to the consumer.
    Heartbeat,
}

/// How following failed, for [`Source::failed`].
#[derive(Debug)]
pub enum Failure<'a, E> {
    /// The stream could not be opened.
    Open(&'a E),
    /// The open did not answer within the idle timeout.
    OpenSilent,
    /// The open stream failed.
    Broke(&'a E),
    /// The server ended the stream.
    Ended,
    /// Nothing arrived on the open stream within the idle timeout.
    Silent,
}

/// What to do after a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Reconnect after the backoff.
    Backoff,
    /// Reconnect at once (the failure named where to go instead).
    Now,
}

/// A stream to follow: how to open it and read it, and what its events mean.
pub trait Source: Send {
    /// One event of the stream.
    type Event: Send;
    /// Why opening or reading failed.
    type Error: fmt::Display + Send + Sync;
    /// An open stream.
    type Stream: Send;

    /// Opens the stream, resuming after `resume_from` (empty: a full snapshot).
    fn open(&mut self, resume_from: &str) -> impl Future<Output = Result<Self::Stream, Self::Error>> + Send;

    /// The next event of `stream`; `None` when the server ended it.
    fn next(stream: &mut Self::Stream) -> impl Future<Output = Result<Option<Self::Event>, Self::Error>> + Send;

    /// What `event` is.
    fn mark(event: &Self::Event) -> Mark;

    /// The point to resume after once `event` is handled; empty when it carries none.
    fn resume_point(event: &Self::Event) -> &str;

    /// Told every failure; decides whether to back off. Backs off by default.
    fn failed(&mut self, _failure: Failure<'_, Self::Error>) -> Retry {
        Retry::Backoff
    }

    /// Told when the stream turned live.
    fn live(&mut self) {}
}

/// How to follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FollowConfig {
    /// A stream silent for longer (no event, no heartbeat) is dropped and reopened.
    pub idle_timeout: Duration,
    /// The first reconnect delay, before jitter.
    pub backoff_min: Duration,
    /// The longest reconnect delay.
    pub backoff_max: Duration,
}

impl Default for FollowConfig {
    fn default() -> Self {
        Self { idle_timeout: IDLE_TIMEOUT, backoff_min: BACKOFF_MIN, backoff_max: BACKOFF_MAX }
    }
}

impl FollowConfig {
    /// The defaults with another idle timeout.
    pub fn with_idle_timeout(idle_timeout: Duration) -> Self {
        Self { idle_timeout, ..Self::default() }
    }
}

/// What the consumer is handed.
#[derive(Debug, PartialEq)]
pub enum Followed<E> {
    /// An event (never a heartbeat); its resume point is taken already.
    Event(E),
    /// The stream was lost or could not be opened (why, for logs). Whatever was live is not; the
    /// follower reconnects (with backoff) on the next call.
    Down(String),
}

/// Follows one stream; see the module documentation.
#[derive(Debug)]
pub struct Follower<S: Source> {
    source: S,
    /// Names the stream in logs ("the watcher", "the VIF stream").
    what: &'static str,
    config: FollowConfig,
    resume: String,
    stream: Option<S::Stream>,
    live: bool,
    /// The reconnect backoff: it grows with the failures since the stream was last live.
    backoff: Backoff,
    /// Wait this long before the next open.
    wait: Option<Duration>,
    /// The current outage has been logged as a warning.
    warned: bool,
}

impl<S: Source> Follower<S> {
    /// Follows `source`, starting with a full snapshot.
    pub fn new(source: S, what: &'static str, config: FollowConfig) -> Self {
        Self {
            source,
            what,
            config,
            resume: String::new(),
            stream: None,
            live: false,
            backoff: Backoff::new(what, config.backoff_min, config.backoff_max),
            wait: None,
            warned: false,
        }
    }

    /// Starts from `point` instead of a full snapshot.
    #[must_use]
    pub fn resuming_from(mut self, point: impl Into<String>) -> Self {
        self.resume = point.into();
        self
    }

    /// Whether the stream is open and its snapshot complete.
    pub fn is_live(&self) -> bool {
        self.live
    }

    /// The point the next open resumes from.
    pub fn resume_point(&self) -> &str {
        &self.resume
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// [`Follower::next`] raced against `stop` (a shutdown signal): `None` once `stop` has
    /// completed first, which is the consumer's cue to return.
    pub async fn next_or(&mut self, stop: impl Future<Output = ()>) -> Option<Followed<S::Event>> {
        tokio::select! {
            next = self.next() => Some(next),
            () = stop => None,
        }
    }

    /// The next event, or news that the stream is down. Opens (and after a failure, reopens
    /// after the backoff) as needed; never ends by itself: select it against shutdown.
    pub async fn next(&mut self) -> Followed<S::Event> {
        let idle = self.config.idle_timeout;
        loop {
            let Some(stream) = self.stream.as_mut() else {
                if let Some(wait) = self.wait.take() {
                    tokio::time::sleep(wait).await;
                }
                match tokio::time::timeout(idle, self.source.open(&self.resume)).await {
                    Ok(Ok(stream)) => {
                        self.stream = Some(stream);
                        continue;
                    }
                    Ok(Err(e)) => {
                        let why = format!("cannot open the stream: {e}");
                        let retry = self.source.failed(Failure::Open(&e));
                        return self.down(why, "open", retry);
                    }
                    Err(_) => {
                        let retry = self.source.failed(Failure::OpenSilent);
                        return self.down(
                            format!("opening the stream got no answer within {idle:?}"),
                            "open-silent",
                            retry,
                        );
                    }
                }
            };
            let (why, reason, retry) = match tokio::time::timeout(idle, S::next(stream)).await {
                Ok(Ok(Some(event))) => {
                    let point = S::resume_point(&event);
                    if !point.is_empty() {
                        point.clone_into(&mut self.resume);
                    }
                    match S::mark(&event) {
                        Mark::Heartbeat => continue,
                        Mark::Change => {}
                        Mark::Reset => self.live = false,
                        Mark::SnapshotComplete => {
                            if !self.live {
                                self.live = true;
                                self.backoff.reset();
                                self.warned = false;
                                self.source.live();
                            }
                        }
                    }
                    return Followed::Event(event);
                }
                Ok(Ok(None)) => {
                    ("the server ended the stream".to_string(), "ended", self.source.failed(Failure::Ended))
                }
                Ok(Err(e)) => (format!("the stream broke: {e}"), "broke", self.source.failed(Failure::Broke(&e))),
                Err(_) => (
                    format!(
                        "nothing received for {idle:?}, not even a heartbeat: the server is gone, stopped or stuck"
                    ),
                    "silent",
                    self.source.failed(Failure::Silent),
                ),
            };
            return self.down(why, reason, retry);
        }
    }

    /// Drops the stream and schedules the reconnect.
    fn down(&mut self, why: String, reason: &'static str, retry: Retry) -> Followed<S::Event> {
        self.stream = None;
        self.live = false;
        self.wait = match retry {
            Retry::Now => None,
            Retry::Backoff => Some(self.backoff.next_delay(reason)),
        };
        if self.warned {
            tracing::debug!(error = why, retry_in = ?self.wait, "{} still unavailable", self.what);
        } else {
            tracing::warn!(error = why, "{} unavailable; reconnecting with backoff", self.what);
            self.warned = true;
        }
        Followed::Down(why)
    }
}

#[cfg(test)]
#[path = "follow_tests.rs"]
mod tests;
