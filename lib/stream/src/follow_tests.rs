//! The follower against a scripted source, with a paused clock.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::*;

/// An event: what it is, its resume point, a name for assertions.
#[derive(Clone, Debug, PartialEq)]
struct Ev {
    mark: Mark,
    point: &'static str,
    name: &'static str,
}

fn ev(mark: Mark, point: &'static str, name: &'static str) -> Ev {
    Ev { mark, point, name }
}

type Events = mpsc::UnboundedSender<Result<Ev, String>>;

/// Each open takes the next scripted answer; with none scripted it waits (a stopped server).
struct Fake {
    answers: mpsc::UnboundedReceiver<Result<mpsc::UnboundedReceiver<Result<Ev, String>>, String>>,
    /// `resume_from` of every open, and when it happened.
    opens: Arc<Mutex<Vec<(String, Instant)>>>,
    /// Failures told, by kind.
    failures: Arc<Mutex<Vec<String>>>,
    /// Answer `Retry::Now` to refusals.
    redirect: bool,
}

impl Source for Fake {
    type Event = Ev;
    type Error = String;
    type Stream = mpsc::UnboundedReceiver<Result<Ev, String>>;

    async fn open(&mut self, resume_from: &str) -> Result<Self::Stream, String> {
        self.opens.lock().unwrap().push((resume_from.to_string(), Instant::now()));
        match self.answers.recv().await {
            Some(answer) => answer,
            None => std::future::pending().await,
        }
    }

    async fn next(stream: &mut Self::Stream) -> Result<Option<Ev>, String> {
        stream.recv().await.transpose()
    }

    fn mark(event: &Ev) -> Mark {
        event.mark
    }

    fn resume_point(event: &Ev) -> &str {
        event.point
    }

    fn failed(&mut self, failure: Failure<'_, String>) -> Retry {
        let label = match failure {
            Failure::Open(e) => format!("open: {e}"),
            Failure::OpenSilent => "open silent".into(),
            Failure::Broke(e) => format!("broke: {e}"),
            Failure::Ended => "ended".into(),
            Failure::Silent => "silent".into(),
        };
        self.failures.lock().unwrap().push(label);
        if self.redirect { Retry::Now } else { Retry::Backoff }
    }
}

struct Script {
    answers: mpsc::UnboundedSender<Result<mpsc::UnboundedReceiver<Result<Ev, String>>, String>>,
    opens: Arc<Mutex<Vec<(String, Instant)>>>,
    failures: Arc<Mutex<Vec<String>>>,
}

impl Script {
    /// Lets the next open succeed; returns the stream's sender.
    fn accept(&self) -> Events {
        let (tx, rx) = mpsc::unbounded_channel();
        self.answers.send(Ok(rx)).unwrap();
        tx
    }

    fn refuse(&self, why: &str) {
        self.answers.send(Err(why.to_string())).unwrap();
    }

    fn opened_from(&self) -> Vec<String> {
        self.opens.lock().unwrap().iter().map(|(p, _)| p.clone()).collect()
    }

    fn open_times(&self) -> Vec<Instant> {
        self.opens.lock().unwrap().iter().map(|(_, t)| *t).collect()
    }
}

fn follower(redirect: bool) -> (Follower<Fake>, Script) {
    let (tx, rx) = mpsc::unbounded_channel();
    let opens = Arc::default();
    let failures = Arc::default();
    let fake = Fake { answers: rx, opens: Arc::clone(&opens), failures: Arc::clone(&failures), redirect };
    (Follower::new(fake, "the test stream", FollowConfig::default()), Script { answers: tx, opens, failures })
}

fn name(f: Followed<Ev>) -> String {
    match f {
        Followed::Event(e) => e.name.to_string(),
        Followed::Down(why) => format!("DOWN {why}"),
    }
}

#[tokio::test(start_paused = true)]
async fn resumes_from_the_last_point_and_hands_over_everything_but_heartbeats() {
    let (mut f, script) = follower(false);
    let s = script.accept();
    for e in [
        ev(Mark::Reset, "e-snapshot", "reset"),
        ev(Mark::Change, "e-snapshot", "a"),
        ev(Mark::SnapshotComplete, "e-0", "complete"),
        ev(Mark::Heartbeat, "", "beat"),
        ev(Mark::Change, "e-1", "b"),
        ev(Mark::Change, "", "no point"),
    ] {
        s.send(Ok(e)).unwrap();
    }
    let mut seen = Vec::new();
    for _ in 0..5 {
        seen.push(name(f.next().await));
        if seen.len() == 3 {
            assert!(f.is_live());
        }
    }
    assert_eq!(seen, ["reset", "a", "complete", "b", "no point"]);
    assert_eq!(f.resume_point(), "e-1");
    drop(s);
    assert_eq!(name(f.next().await), "DOWN the server ended the stream");
    assert!(!f.is_live());
    let s = script.accept();
    s.send(Err("reset by peer".into())).unwrap();
    assert_eq!(name(f.next().await), "DOWN the stream broke: reset by peer");
    assert_eq!(script.opened_from(), ["", "e-1"]);
    assert_eq!(*script.failures.lock().unwrap(), ["ended", "broke: reset by peer"]);
}

#[tokio::test(start_paused = true)]
async fn a_silent_stream_is_dropped_after_the_idle_timeout_and_reopened() {
    let (mut f, script) = follower(false);
    let s = script.accept();
    s.send(Ok(ev(Mark::SnapshotComplete, "e-0", "complete"))).unwrap();
    assert_eq!(name(f.next().await), "complete");
    // Heartbeats keep it alive past the timeout...
    let started = Instant::now();
    let next = tokio::spawn(async move { (name(f.next().await), Instant::now(), f) });
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        s.send(Ok(ev(Mark::Heartbeat, "", "beat"))).unwrap();
    }
    // ...then silence (the server stopped, its connection still open): down one timeout after
    // the last heartbeat.
    let (got, at, mut f) = next.await.unwrap();
    assert!(got.starts_with("DOWN nothing received for 15s"), "{got}");
    assert_eq!(at - started, Duration::from_secs(20 + 15));
    drop(s);
    // An open that gets no answer fails the same way; the backoff grows meanwhile.
    let before = Instant::now();
    assert!(name(f.next().await).starts_with("DOWN opening the stream got no answer within 15s"));
    let waited = Instant::now() - before;
    assert!(waited >= Duration::from_secs(15) && waited <= Duration::from_millis(15_200), "{waited:?}");
    let s = script.accept();
    s.send(Ok(ev(Mark::SnapshotComplete, "e-3", "again"))).unwrap();
    assert_eq!(name(f.next().await), "again");
    assert_eq!(script.opened_from(), ["", "e-0", "e-0"]);
    assert_eq!(*script.failures.lock().unwrap(), ["silent", "open silent"]);
}

#[tokio::test(start_paused = true)]
async fn reconnects_back_off_with_jitter_and_start_over_once_live() {
    let (mut f, script) = follower(false);
    for _ in 0..7 {
        script.refuse("connection refused");
    }
    for _ in 0..7 {
        assert!(name(f.next().await).starts_with("DOWN cannot open the stream: connection refused"));
    }
    let s = script.accept();
    s.send(Ok(ev(Mark::SnapshotComplete, "e-0", "complete"))).unwrap();
    assert_eq!(name(f.next().await), "complete");
    let times = script.open_times();
    for (i, pair) in times.windows(2).enumerate() {
        let gap = pair[1] - pair[0];
        let ceiling = (BACKOFF_MIN * (1 << i)).min(BACKOFF_MAX);
        assert!(gap <= ceiling, "reconnect {i}: {gap:?} vs ceiling {ceiling:?}");
    }
    // Live: the next failure starts from the minimum again.
    drop(s);
    assert!(name(f.next().await).starts_with("DOWN"));
    let _s = script.accept();
    let down = Instant::now();
    let waiting = tokio::spawn(async move { f.next().await });
    while script.open_times().len() < 9 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let gap = script.open_times()[8] - down;
    assert!(gap <= BACKOFF_MIN + Duration::from_millis(1), "{gap:?}");
    waiting.abort();
}

#[tokio::test(start_paused = true)]
async fn a_source_that_was_redirected_reconnects_at_once() {
    let (mut f, script) = follower(true);
    script.refuse("the node is served by 10.0.0.2:9610");
    assert!(name(f.next().await).starts_with("DOWN"));
    let s = script.accept();
    s.send(Ok(ev(Mark::SnapshotComplete, "e-0", "complete"))).unwrap();
    assert_eq!(name(f.next().await), "complete");
    let times = script.open_times();
    assert_eq!(times[1] - times[0], Duration::ZERO, "no backoff after a redirect");
}

#[tokio::test(start_paused = true)]
async fn next_or_hands_over_events_until_the_stop_signal_wins() {
    let (mut f, script) = follower(false);
    let s = script.accept();
    s.send(Ok(ev(Mark::SnapshotComplete, "e-0", "complete"))).unwrap();
    let got = f.next_or(std::future::pending()).await.map(name);
    assert_eq!(got.as_deref(), Some("complete"));
    // Nothing more comes: the stop signal ends the wait, and the stream stays open.
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stop = async move {
        let _ = stop_rx.await;
    };
    let waiting = tokio::spawn(async move { (f.next_or(stop).await.map(name), f) });
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop_tx.send(()).unwrap();
    let (got, f) = waiting.await.unwrap();
    assert_eq!(got, None);
    assert!(f.is_live());
    assert_eq!(script.opened_from(), [""]);
}
