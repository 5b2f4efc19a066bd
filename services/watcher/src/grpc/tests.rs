//! Stream tests: a real stream task over an index fed directly, with paused time.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kuryr_proto::watcher::v1::Filter;
use kuryr_runtime::shutdown;
use tokio::sync::mpsc;

use super::*;
use crate::index::tests::{pod, synced};
use crate::index::{Update, lock};

type Rx = mpsc::Receiver<Result<SubscribeResponse, Status>>;

/// The heartbeat interval of the streams these tests open.
const HEARTBEAT: Duration = Duration::from_secs(5);

/// Opens a stream over `index` the way `subscribe` does, after validation.
fn open(
    index: &SharedIndex,
    selector: Selector,
    resume_from: &str,
    buffer: usize,
) -> (Rx, Metrics, kuryr_runtime::shutdown::ShutdownTrigger) {
    open_beating(index, selector, resume_from, buffer, HEARTBEAT)
}

/// [`open`] with heartbeats every `heartbeat`.
fn open_beating(
    index: &SharedIndex,
    selector: Selector,
    resume_from: &str,
    buffer: usize,
    heartbeat: Duration,
) -> (Rx, Metrics, kuryr_runtime::shutdown::ShutdownTrigger) {
    let (trigger, signal) = shutdown::channel();
    let metrics = Metrics::default();
    let svc = WatcherService::new(index.clone(), metrics.clone(), signal, heartbeat);
    let rx = svc.open(selector, resume_from, buffer, tracing::Span::none()).unwrap();
    (rx, metrics, trigger)
}

/// The next event as (type, object name, resume point).
async fn next(rx: &mut Rx) -> (EventType, String, String) {
    let r = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("an event within 5s")
        .expect("stream open")
        .unwrap();
    let name = r.object.as_ref().map(|o| o.name.clone()).unwrap_or_default();
    (r.r#type(), name, r.resume_point)
}

async fn quiet(rx: &mut Rx) {
    if let Ok(ev) = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await {
        panic!("unexpected event {ev:?}");
    }
}

fn pods() -> Selector {
    Selector::new([Kind::Pod])
}

#[tokio::test(start_paused = true)]
async fn snapshot_then_live_deltas_in_order() {
    let index = synced(16, vec![pod("a", "n1", "1"), pod("b", "n2", "1")]).shared();
    let (mut rx, metrics, _t) = open(&index, pods(), "", 8);
    assert_eq!(next(&mut rx).await, (EventType::Applied, "a".into(), "e-snapshot".into()));
    assert_eq!(next(&mut rx).await, (EventType::Applied, "b".into(), "e-snapshot".into()));
    assert_eq!(next(&mut rx).await, (EventType::SnapshotComplete, String::new(), "e-0".into()));
    quiet(&mut rx).await;
    lock(&index).apply(Kind::Pod, Update::Applied(pod("c", "n1", "2")));
    lock(&index).apply(Kind::Pod, Update::Deleted(pod("a", "n1", "3")));
    assert_eq!(next(&mut rx).await, (EventType::Applied, "c".into(), "e-1".into()));
    assert_eq!(next(&mut rx).await, (EventType::Deleted, "a".into(), "e-2".into()));
    quiet(&mut rx).await;
    assert_eq!(metrics.subscribers.get(), 1);
    // Nothing to say for a heartbeat interval: a HEARTBEAT, with no resume point.
    let before = tokio::time::Instant::now();
    assert_eq!(next(&mut rx).await, (EventType::Heartbeat, String::new(), String::new()));
    assert!(before.elapsed() <= HEARTBEAT);
}

#[tokio::test(start_paused = true)]
async fn resume_sends_only_the_missed_matching_deltas() {
    let index = synced(16, vec![pod("a", "n1", "1")]).shared();
    for (name, node) in [("b", "n1"), ("c", "n2"), ("d", "n1")] {
        lock(&index).apply(Kind::Pod, Update::Applied(pod(name, node, "2")));
    }
    let mut sel = pods();
    sel.node_name = Some("n1".into());
    let (mut rx, _m, _t) = open(&index, sel, "e-1", 8);
    // Caught up as of e-1 (b was handled); c is on another node; d is what was missed.
    assert_eq!(next(&mut rx).await, (EventType::SnapshotComplete, String::new(), "e-1".into()));
    assert_eq!(next(&mut rx).await, (EventType::Applied, "d".into(), "e-3".into()));
    quiet(&mut rx).await;
}

#[tokio::test(start_paused = true)]
async fn unknown_resume_points_get_reset_and_snapshot() {
    let index = synced(16, vec![pod("a", "n1", "1")]).shared();
    for bad in ["other-0", "e-99", "e-snapshot"] {
        let (mut rx, metrics, _t) = open(&index, pods(), bad, 8);
        assert_eq!(next(&mut rx).await.0, EventType::Reset, "{bad}");
        assert_eq!(next(&mut rx).await.1, "a", "{bad}");
        assert_eq!(next(&mut rx).await, (EventType::SnapshotComplete, String::new(), "e-0".into()));
        assert_eq!(metrics.subscriptions.get_or_create(&crate::metrics::StartLabels { start: "reset" }).get(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_falls_out_of_the_history_is_reset_in_place() {
    let index = synced(2, vec![pod("a", "n1", "1")]).shared();
    // A client that reads nothing: the stream stops after filling its one-slot buffer.
    let (mut rx, metrics, _t) = open(&index, pods(), "", 1);
    tokio::time::sleep(Duration::from_millis(10)).await;
    for i in 0..5 {
        lock(&index).apply(Kind::Pod, Update::Applied(pod(&format!("p{i}"), "n1", "2")));
    }
    // The snapshot (a, SNAPSHOT_COMPLETE at 0) is sent; revision 1 has left the 2-delta history.
    assert_eq!(next(&mut rx).await.1, "a");
    assert_eq!(next(&mut rx).await, (EventType::SnapshotComplete, String::new(), "e-0".into()));
    assert_eq!(next(&mut rx).await.0, EventType::Reset);
    let mut names = Vec::new();
    loop {
        match next(&mut rx).await {
            (EventType::Applied, name, _) => names.push(name),
            (EventType::SnapshotComplete, _, point) => {
                assert_eq!(point, "e-5");
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(names, ["a", "p0", "p1", "p2", "p3", "p4"]);
    assert_eq!(metrics.subscriptions.get_or_create(&crate::metrics::StartLabels { start: "lagged" }).get(), 1);
    lock(&index).apply(Kind::Pod, Update::Applied(pod("z", "n1", "3")));
    assert_eq!(next(&mut rx).await, (EventType::Applied, "z".into(), "e-6".into()));
}

#[tokio::test(start_paused = true)]
async fn streams_end_with_unavailable_at_shutdown_and_when_the_client_leaves() {
    let index = synced(16, vec![]).shared();
    let (mut rx, metrics, trigger) = open(&index, pods(), "", 8);
    assert_eq!(next(&mut rx).await.0, EventType::SnapshotComplete);
    trigger.trigger();
    let end = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
    assert_eq!(end.unwrap_err().code(), tonic::Code::Unavailable);
    assert!(tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().is_none(), "closed");
    assert_eq!(metrics.subscribers.get(), 0);

    let (rx, metrics, _t) = open(&index, pods(), "", 8);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(metrics.subscribers.get(), 1);
    drop(rx);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(metrics.subscribers.get(), 0, "the task noticed the client left");
}

#[test]
fn requests_are_validated_naming_the_field() {
    let mut r = SubscribeRequest::default();
    let msg = |r: &SubscribeRequest| {
        let e = validate(r).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        e.message().to_string()
    };
    assert!(msg(&r).starts_with("kinds:"));
    r.kinds = vec![0];
    assert!(msg(&r).contains("KIND_UNSPECIFIED"));
    r.kinds = vec![99];
    assert!(msg(&r).contains("99"));
    r.kinds = vec![Kind::Pod as i32, Kind::Node as i32, Kind::Pod as i32];
    let s = validate(&r).unwrap();
    assert_eq!(s.kinds().collect::<Vec<_>>(), [Kind::Node, Kind::Pod]);
    r.filter = Some(Filter { node_name: "Node_1".into(), ..Default::default() });
    assert!(msg(&r).starts_with("filter.node_name:"));
    r.filter = Some(Filter { node_name: "node-1.example".into(), namespace: "a.b".into(), ..Default::default() });
    assert!(msg(&r).starts_with("filter.namespace:"));
    r.filter = Some(Filter { node_name: "node-1".into(), namespace: "kube-system".into(), exclude_host_network: true });
    let s = validate(&r).unwrap();
    assert_eq!(
        (s.node_name.as_deref(), s.namespace.as_deref(), s.exclude_host_network),
        (Some("node-1"), Some("kube-system"), true)
    );
    r.resume_from = "x".repeat(500);
    assert!(msg(&r).starts_with("resume_from:"));
    r.resume_from.clear();
    r.subscriber = "bad\nname".into();
    assert!(msg(&r).starts_with("subscriber:"));
}

#[tokio::test(start_paused = true)]
async fn quiet_streams_carry_heartbeats_also_while_others_change() {
    let index = synced(16, vec![pod("a", "n1", "1")]).shared();
    let mut sel = pods();
    sel.node_name = Some("n1".into());
    let (mut rx, _m, _t) = open_beating(&index, sel, "", 64, Duration::from_secs(2));
    assert_eq!(next(&mut rx).await.0, EventType::Applied);
    assert_eq!(next(&mut rx).await.0, EventType::SnapshotComplete);
    // Quiet: a heartbeat, without a resume point.
    let t = tokio::time::Instant::now();
    assert_eq!(next(&mut rx).await, (EventType::Heartbeat, String::new(), String::new()));
    assert!(t.elapsed() >= Duration::from_secs(2) && t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // Busy with another node's pods, none of which this stream carries: still heartbeats.
    let busy = {
        let index = index.clone();
        tokio::spawn(async move {
            for i in 0..40 {
                lock(&index).apply(Kind::Pod, Update::Applied(pod(&format!("o{i}"), "n2", "2")));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let t = tokio::time::Instant::now();
    assert_eq!(next(&mut rx).await.0, EventType::Heartbeat);
    assert!(t.elapsed() <= Duration::from_secs(3), "{:?}", t.elapsed());
    busy.await.unwrap();
}
