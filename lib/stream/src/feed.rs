//! Fan-out: one task per subscriber sends a snapshot (or, when resuming, only SNAPSHOT_COMPLETE),
//! then the log's history from its cursor on, encoded by the service into its own messages.
//!
//! - The snapshot and its cursor are taken under one lock, so between snapshot and live nothing
//!   is lost or duplicated.
//! - A resumed stream begins with SNAPSHOT_COMPLETE at its cursor: the subscriber is caught up as
//!   of its resume point, exactly as after a snapshot, and can tell that it is live again.
//! - Each subscriber has a bounded buffer; a subscriber that does not read only holds up its own
//!   task. When it falls so far behind that its cursor leaves the history, it gets RESET and a
//!   fresh snapshot in place, on the same stream ([`How::Lagged`]), rather than the server
//!   keeping an unbounded backlog for it.
//! - With [`Options::heartbeat`], a stream on which nothing was sent for that long gets
//!   [`Event::Heartbeat`] — also while changes the subscriber does not want keep the task busy —
//!   so that its reader can tell a quiet stream from a server that is gone or stuck
//!   ([`crate::follow`] drops a stream silent for longer than its idle timeout).
//! - The stream ends with the item its `stop` future yields (for gRPC an UNAVAILABLE status
//!   telling the subscriber to reconnect: at shutdown, or when its keys moved to another replica).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::epoch::Epoch;
use crate::log::{Change, Lagged, LogHandle, NotReady, Start};

/// Deltas copied out of the history per lock.
const BATCH: usize = 256;

/// What a subscriber is told.
#[derive(Debug)]
pub enum Event<'a, K, V> {
    /// Forget everything received before: a fresh snapshot follows.
    Reset,
    /// A key's value (a snapshot item, or a change).
    Applied(&'a K, &'a Arc<V>),
    /// A key is gone; its last value.
    Deleted(&'a K, &'a Arc<V>),
    /// The snapshot is complete (or the stream resumed): deltas follow.
    SnapshotComplete,
    /// Nothing was sent for [`Options::heartbeat`]. Its resume point is empty: a heartbeat says
    /// the server is alive, not where the subscriber is.
    Heartbeat,
}

/// How a stream began (or began again), for logs and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// A full snapshot: no resume point was given.
    Snapshot,
    /// Only the deltas after the given resume point.
    Resume,
    /// The resume point could not be honoured: RESET and a snapshot.
    Reset,
    /// The stream fell out of the history: RESET and a snapshot in place.
    Lagged,
}

impl How {
    /// A metrics label.
    pub fn label(self) -> &'static str {
        match self {
            How::Snapshot => "snapshot",
            How::Resume => "resume",
            How::Reset => "reset",
            How::Lagged => "lagged",
        }
    }
}

/// One subscriber's view of the log: what it wants, and how events are encoded for it.
pub trait Subscriber<K, V>: Send + Sync + 'static {
    /// What the stream carries (for gRPC, `Result<Response, Status>`).
    type Item: Send + 'static;

    /// Whether the subscriber wants `key` (in snapshots and deltas); everything by default.
    fn wants(&self, _key: &K, _value: &V) -> bool {
        true
    }

    /// Encodes one event; `point` is its resume point (empty for heartbeats).
    fn encode(&self, point: String, event: Event<'_, K, V>) -> Self::Item;

    /// Called when the stream begins, and again each time it falls out of the history.
    fn started(&self, _how: How) {}

    /// Called once when the stream ends.
    fn ended(&self) {}
}

/// How streams are served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// Items queued before the task waits for the reader.
    pub buffer: usize,
    /// Send [`Event::Heartbeat`] whenever nothing else was sent for this long; never when `None`.
    pub heartbeat: Option<Duration>,
}

impl Default for Options {
    fn default() -> Self {
        Self { buffer: 128, heartbeat: None }
    }
}

/// A stream opened by [`subscribe`].
#[derive(Debug)]
pub struct Opened<T> {
    /// What the subscriber reads.
    pub rx: mpsc::Receiver<T>,
    /// How it begins.
    pub how: How,
    /// Items in the initial snapshot (0 when resuming).
    pub items: usize,
    /// The revision it starts from.
    pub cursor: u64,
}

/// Opens a stream of `log` for `sub`, resuming from `resume_from` when possible. The stream runs
/// in its own task, inside `span`, until the subscriber goes away, the log is dropped, or `stop`
/// completes — then the item `stop` yields is the stream's last.
pub fn subscribe<K, V, L, S, F>(
    log: &L,
    resume_from: &str,
    sub: S,
    options: Options,
    stop: F,
    span: tracing::Span,
) -> Result<Opened<S::Item>, NotReady>
where
    K: Ord + Clone + Send + Sync + 'static,
    V: PartialEq + Send + Sync + 'static,
    L: LogHandle<K, V>,
    S: Subscriber<K, V>,
    F: Future<Output = S::Item> + Send + 'static,
{
    let (start, epoch, revisions) = log.with_log(|l| {
        Ok::<_, NotReady>((l.start(resume_from, |k, v| sub.wants(k, v))?, l.epoch().clone(), l.revisions()))
    })?;
    let (how, items, cursor) = match &start {
        Start::Resume { cursor } => (How::Resume, 0, *cursor),
        Start::Snapshot { reset, items, cursor } => {
            (if *reset { How::Reset } else { How::Snapshot }, items.len(), *cursor)
        }
    };
    let (tx, rx) = mpsc::channel(options.buffer.max(1));
    let feed = Feed {
        log: log.clone(),
        sub,
        epoch,
        tx,
        revisions,
        heartbeat: options.heartbeat,
        last_sent: Instant::now(),
        _marker: std::marker::PhantomData,
    };
    tokio::spawn(feed.run(start, how, stop).instrument(span));
    Ok(Opened { rx, how, items, cursor })
}

/// Why a stream ended.
#[derive(Debug)]
enum Ended {
    /// The subscriber went away.
    Gone,
    /// The log was dropped: the process is ending.
    LogGone,
}

struct Feed<K, V, L, S: Subscriber<K, V>> {
    log: L,
    sub: S,
    epoch: Epoch,
    tx: mpsc::Sender<S::Item>,
    revisions: watch::Receiver<u64>,
    heartbeat: Option<Duration>,
    /// When the subscriber was last sent something: the next heartbeat is due `heartbeat` after.
    last_sent: Instant,
    _marker: std::marker::PhantomData<fn() -> (K, V)>,
}

impl<K, V, L, S> Feed<K, V, L, S>
where
    K: Ord + Clone + Send + Sync + 'static,
    V: PartialEq + Send + Sync + 'static,
    L: LogHandle<K, V>,
    S: Subscriber<K, V>,
{
    async fn run(mut self, start: Start<K, V>, how: How, stop: impl Future<Output = S::Item>) {
        self.sub.started(how);
        let ended = tokio::select! {
            res = self.serve(start) => match res {
                Ok(never) => match never {},
                Err(ended) => Err(ended),
            },
            last = stop => Ok(last),
        };
        match ended {
            Ok(last) => {
                let _ = self.tx.try_send(last);
                tracing::info!("stream ended by the server");
            }
            Err(why) => tracing::info!(?why, "stream ended"),
        }
        self.sub.ended();
    }

    async fn serve(&mut self, start: Start<K, V>) -> Result<Infallible, Ended> {
        let mut cursor = match start {
            Start::Resume { cursor } => {
                self.send(self.sub.encode(self.epoch.point(cursor), Event::SnapshotComplete)).await?;
                cursor
            }
            Start::Snapshot { reset, items, cursor } => {
                self.send_snapshot(reset, items, cursor).await?;
                cursor
            }
        };
        loop {
            // Marked seen before reading, so a delta recorded after this read wakes the wait.
            self.revisions.borrow_and_update();
            let batch = self.log.with_log(|l| l.since(cursor, BATCH));
            // Due also while deltas this subscriber does not want keep the loop busy.
            if self.heartbeat.is_some_and(|every| self.last_sent.elapsed() >= every) {
                self.send(self.sub.encode(String::new(), Event::Heartbeat)).await?;
            }
            match batch {
                Ok(deltas) if deltas.is_empty() => {
                    let due = self.last_sent + self.heartbeat.unwrap_or_default();
                    tokio::select! {
                        changed = self.revisions.changed() => changed.map_err(|_| Ended::LogGone)?,
                        () = self.tx.closed() => return Err(Ended::Gone),
                        () = tokio::time::sleep_until(due), if self.heartbeat.is_some() => {}
                    }
                }
                Ok(deltas) => {
                    for d in deltas {
                        cursor = d.revision;
                        if !self.sub.wants(&d.key, d.change.value()) {
                            continue;
                        }
                        let point = self.epoch.point(d.revision);
                        let item = match &d.change {
                            Change::Applied(v) => self.sub.encode(point, Event::Applied(&d.key, v)),
                            Change::Deleted(v) => self.sub.encode(point, Event::Deleted(&d.key, v)),
                        };
                        self.send(item).await?;
                    }
                }
                Err(Lagged(at)) => {
                    tracing::warn!(cursor = at, "stream fell out of the history; sending RESET and a new snapshot");
                    self.sub.started(How::Lagged);
                    let (items, now) = self.log.with_log(|l| l.snapshot(|k, v| self.sub.wants(k, v)));
                    self.send_snapshot(true, items, now).await?;
                    cursor = now;
                }
            }
        }
    }

    async fn send_snapshot(&mut self, reset: bool, items: Vec<(K, Arc<V>)>, cursor: u64) -> Result<(), Ended> {
        let point = self.epoch.snapshot_point();
        if reset {
            self.send(self.sub.encode(point.clone(), Event::Reset)).await?;
        }
        for (k, v) in &items {
            self.send(self.sub.encode(point.clone(), Event::Applied(k, v))).await?;
        }
        self.send(self.sub.encode(self.epoch.point(cursor), Event::SnapshotComplete)).await
    }

    async fn send(&mut self, item: S::Item) -> Result<(), Ended> {
        self.tx.send(item).await.map_err(|_| Ended::Gone)?;
        self.last_sent = Instant::now();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Mutex;
    use std::time::Duration;

    use tokio::sync::oneshot;

    use super::*;
    use crate::log::{Log, SharedLog, lock};

    /// Encodes events as text; wants even values only; records how it started.
    #[derive(Clone, Default)]
    struct Text(Arc<Mutex<Vec<How>>>);

    impl Subscriber<String, u32> for Text {
        type Item = String;
        fn wants(&self, _: &String, v: &u32) -> bool {
            v.is_multiple_of(2)
        }
        fn encode(&self, point: String, event: Event<'_, String, u32>) -> String {
            match event {
                Event::Reset => format!("RESET@{point}"),
                Event::Applied(k, v) => format!("{k}={v}@{point}"),
                Event::Deleted(k, v) => format!("-{k}({v})@{point}"),
                Event::SnapshotComplete => format!("COMPLETE@{point}"),
                Event::Heartbeat => format!("BEAT@{point}"),
            }
        }
        fn started(&self, how: How) {
            self.0.lock().unwrap().push(how);
        }
    }

    fn log(capacity: usize) -> SharedLog<String, u32> {
        let mut l = Log::new(Epoch::fixed("e"), capacity);
        l.upsert("a".into(), 2);
        l.upsert("b".into(), 3);
        l.set_ready();
        l.shared()
    }

    async fn take(rx: &mut mpsc::Receiver<String>, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        for _ in 0..n {
            let got = tokio::time::timeout(Duration::from_secs(60), rx.recv()).await.unwrap().unwrap();
            out.push(got);
        }
        out
    }

    fn never() -> impl Future<Output = String> + Send + 'static {
        std::future::pending()
    }

    fn opts(buffer: usize) -> Options {
        Options { buffer, heartbeat: None }
    }

    #[tokio::test(start_paused = true)]
    async fn snapshot_then_filtered_deltas_then_resume() {
        let log = log(16);
        let sub = Text::default();
        let mut o = subscribe(&log, "", sub.clone(), opts(8), never(), tracing::Span::none()).unwrap();
        assert_eq!((o.how, o.items, o.cursor), (How::Snapshot, 1, 0));
        assert_eq!(take(&mut o.rx, 2).await, ["a=2@e-snapshot", "COMPLETE@e-0"]);
        {
            let mut l = lock(&log);
            l.upsert("c".into(), 4);
            l.upsert("b".into(), 5); // odd: not wanted
            l.upsert("a".into(), 6);
            l.remove(&"c".into());
        }
        assert_eq!(take(&mut o.rx, 3).await, ["c=4@e-1", "a=6@e-3", "-c(4)@e-4"]);
        drop(o);
        // Resuming from e-1: caught up as of e-1, then only what came after it.
        let mut o = subscribe(&log, "e-1", sub.clone(), opts(8), never(), tracing::Span::none()).unwrap();
        assert_eq!(o.how, How::Resume);
        assert_eq!(take(&mut o.rx, 3).await, ["COMPLETE@e-1", "a=6@e-3", "-c(4)@e-4"]);
        // Another epoch's point: RESET and a snapshot.
        let mut o = subscribe(&log, "x-1", sub.clone(), opts(8), never(), tracing::Span::none()).unwrap();
        assert_eq!(take(&mut o.rx, 3).await, ["RESET@e-snapshot", "a=6@e-snapshot", "COMPLETE@e-4"]);
        assert_eq!(*sub.0.lock().unwrap(), [How::Snapshot, How::Resume, How::Reset]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_subscriber_that_falls_out_of_the_history_is_reset_in_place() {
        let log = log(4);
        let sub = Text::default();
        // A buffer of 1: the task blocks on the second item until the test reads.
        let mut o = subscribe(&log, "", sub.clone(), opts(1), never(), tracing::Span::none()).unwrap();
        assert_eq!(take(&mut o.rx, 2).await, ["a=2@e-snapshot", "COMPLETE@e-0"]);
        {
            let mut l = lock(&log);
            for i in 0..10u32 {
                l.upsert(format!("k{i}"), i * 2);
            }
        }
        // The task copied a batch of deltas while they were still in the history, or it finds
        // its cursor gone; either way, once it has to catch up past the ring, it resets.
        let mut seen = Vec::new();
        while !seen.iter().any(|s: &String| s.starts_with("COMPLETE@e-10")) {
            seen.extend(take(&mut o.rx, 1).await);
        }
        let after_reset: Vec<&String> = seen.iter().skip_while(|s| !s.starts_with("RESET")).collect();
        assert!(!after_reset.is_empty(), "expected a RESET: {seen:?}");
        assert_eq!(after_reset.len(), 1 + 11 + 1, "RESET, a and k0..k9, COMPLETE: {seen:?}");
        assert!(sub.0.lock().unwrap().contains(&How::Lagged));
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_sends_the_closing_item_and_ends_the_stream() {
        let log = log(4);
        let (tx, rx) = oneshot::channel::<()>();
        let stop = async move {
            let _ = rx.await;
            "CLOSING".to_string()
        };
        let mut o = subscribe(&log, "", Text::default(), opts(8), stop, tracing::Span::none()).unwrap();
        assert_eq!(take(&mut o.rx, 2).await.len(), 2);
        tx.send(()).unwrap();
        assert_eq!(take(&mut o.rx, 1).await, ["CLOSING"]);
        assert_eq!(o.rx.recv().await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn quiet_streams_get_heartbeats_even_while_unwanted_changes_flow() {
        let log = log(64);
        let o = Options { buffer: 8, heartbeat: Some(Duration::from_secs(5)) };
        let mut s = subscribe(&log, "", Text::default(), o, never(), tracing::Span::none()).unwrap();
        assert_eq!(take(&mut s.rx, 2).await, ["a=2@e-snapshot", "COMPLETE@e-0"]);
        let opened = tokio::time::Instant::now();
        assert_eq!(take(&mut s.rx, 1).await, ["BEAT@"]);
        assert_eq!(opened.elapsed(), Duration::from_secs(5), "one interval after the last item");
        // A wanted change resets the interval.
        tokio::time::sleep(Duration::from_secs(3)).await;
        lock(&log).upsert("c".into(), 8);
        assert_eq!(take(&mut s.rx, 1).await, ["c=8@e-1"]);
        let sent = tokio::time::Instant::now();
        // Unwanted (odd) changes every second send nothing, but the heartbeat still comes.
        let writer = {
            let log = log.clone();
            tokio::spawn(async move {
                for i in 0..20u32 {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    lock(&log).upsert("b".into(), 2 * i + 11);
                }
            })
        };
        assert_eq!(take(&mut s.rx, 1).await, ["BEAT@"]);
        let gap = sent.elapsed();
        assert!(gap >= Duration::from_secs(5) && gap <= Duration::from_secs(6), "{gap:?}");
        writer.await.unwrap();
        // Without a heartbeat configured, nothing comes.
        let mut s = subscribe(&log, "", Text::default(), opts(8), never(), tracing::Span::none()).unwrap();
        assert_eq!(take(&mut s.rx, 3).await.last().map(String::as_str), Some("COMPLETE@e-21"));
        assert!(tokio::time::timeout(Duration::from_secs(60), s.rx.recv()).await.is_err());
    }

    #[test]
    fn nothing_is_served_before_the_log_is_ready() {
        let log: SharedLog<String, u32> = Log::new(Epoch::fixed("e"), 4).shared();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let _guard = rt.enter();
        let err = subscribe(&log, "", Text::default(), opts(8), never(), tracing::Span::none()).unwrap_err();
        assert_eq!(err, NotReady);
    }
}
