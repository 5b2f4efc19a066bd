//! WatchVifs, ReportPlugged and GetVif through a real tonic server on an ephemeral port, over an
//! index fed directly and a controller on the in-memory cluster.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::vif_allocator_server::VifAllocatorServer;
use kuryr_proto::allocator::v1::{VifEventType, VifState as PbState, WatchVifsRequest};
use kuryr_proto::watcher::v1::EventType;
use kuryr_runtime::shutdown::{self, ShutdownTrigger};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::Streaming;
use tonic::transport::Channel;

use super::*;
use crate::controller::tests::{Fake, key, see, setup};

const EVENT_TIMEOUT: Duration = Duration::from_secs(10);

struct Server {
    client: VifAllocatorClient<Channel>,
    trigger: ShutdownTrigger,
    index: SharedIndex,
    ctl: Arc<Controller<Fake>>,
    fake: Fake,
}

/// Serves a ready index holding nothing, with a controller on the in-memory cluster.
async fn serve() -> Server {
    let s = setup();
    let (trigger, signal) = shutdown::channel();
    let cell: ControllerCell<Fake> = Arc::default();
    cell.set(s.ctl.clone()).unwrap();
    let svc = AllocatorService::new(s.index.clone(), cell, s.metrics.clone(), signal.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(VifAllocatorServer::new(svc))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), signal.wait()),
    );
    let client = VifAllocatorClient::new(kuryr_runtime::client::channel(&addr.to_string()).unwrap());
    Server { client, trigger, index: s.index, ctl: s.ctl, fake: s.fake }
}

impl Server {
    async fn watch(&self, node: &str, resume_from: &str) -> Result<Streaming<WatchVifsResponse>, Status> {
        let req =
            WatchVifsRequest { node_name: node.into(), resume_from: resume_from.into(), binder_id: "test".into() };
        Ok(self.client.clone().watch_vifs(req).await?.into_inner())
    }

    /// Gives pod `name` on `node` its VIF through the controller.
    async fn pod(&self, name: &str, node: &str) {
        self.fake.add_pod(&key(name));
        see(&self.ctl, &self.fake, name, node, "Pending", EventType::Applied);
        self.ctl.reconcile(&format!("uid-{name}")).await.unwrap();
    }
}

async fn next(s: &mut Streaming<WatchVifsResponse>) -> WatchVifsResponse {
    loop {
        match tokio::time::timeout(EVENT_TIMEOUT, s.message()).await {
            Ok(Ok(Some(r))) if r.r#type() == VifEventType::Heartbeat => {}
            Ok(Ok(Some(r))) => return r,
            other => panic!("expected an event, got {other:?}"),
        }
    }
}

/// A compact view of an event.
fn show(ev: &WatchVifsResponse) -> String {
    match ev.r#type() {
        VifEventType::VifApplied => {
            let v = ev.vif.as_ref().unwrap();
            format!("+{} {:?}", v.pod.as_ref().unwrap().uid, v.state())
        }
        VifEventType::VifDeleted => format!("-{}", ev.vif.as_ref().unwrap().pod.as_ref().unwrap().uid),
        VifEventType::NodeRoutesApplied => {
            let r = ev.node_routes.as_ref().unwrap();
            format!("+routes {} {:?} via {:?}", r.node_name, r.cidrs, r.node_ips)
        }
        VifEventType::NodeRoutesDeleted => format!("-routes {}", ev.node_routes.as_ref().unwrap().node_name),
        other => format!("{other:?}"),
    }
}

/// Reads up to SNAPSHOT_COMPLETE; returns the events and the completion's point.
async fn snapshot(s: &mut Streaming<WatchVifsResponse>) -> (Vec<String>, String) {
    let mut seen = Vec::new();
    loop {
        let ev = next(s).await;
        if ev.r#type() == VifEventType::SnapshotComplete {
            return (seen, ev.resume_point);
        }
        seen.push(show(&ev));
    }
}

fn blocks(list: &[(&str, &str)]) -> BTreeMap<String, Vec<String>> {
    list.iter().map(|(n, b)| (n.to_string(), vec![b.to_string()])).collect()
}

#[tokio::test]
async fn requests_are_validated_naming_the_field() {
    let srv = serve().await;
    let err = srv.watch("", "").await.unwrap_err();
    assert_eq!((err.code(), err.message()), (tonic::Code::InvalidArgument, "node_name: required"));
    let err = srv.watch("Not_A_Node", "").await.unwrap_err();
    assert!(err.code() == tonic::Code::InvalidArgument && err.message().starts_with("node_name:"), "{err}");
    let err = srv.watch("n1", &"x".repeat(200)).await.unwrap_err();
    assert!(err.message().starts_with("resume_from:"), "{err}");
    let mut client = srv.client.clone();
    for (req, field) in [
        (ReportPluggedRequest { vif_id: "v".into(), node_name: "n1".into(), ..Default::default() }, "pod_uid"),
        (ReportPluggedRequest { pod_uid: "u".into(), node_name: "n1".into(), ..Default::default() }, "vif_id"),
        (ReportPluggedRequest { pod_uid: "u".into(), vif_id: "v".into(), ..Default::default() }, "node_name"),
    ] {
        let err = client.report_plugged(req).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().starts_with(field), "{field}: {err}");
    }
    let err = client.get_vif(GetVifRequest { pod_uid: String::new() }).await.unwrap_err();
    assert_eq!(err.message(), "pod_uid: required");
    let err = client.get_vif(GetVifRequest { pod_uid: "nobody".into() }).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn unavailable_until_recovered() {
    let s = setup();
    let (_trigger, signal) = shutdown::channel();
    let index = crate::index::VifIndex::new(kuryr_stream::Epoch::fixed("e"), 8).shared();
    let svc = AllocatorService::new(index, ControllerCell::<Fake>::default(), s.metrics, signal);
    let req = WatchVifsRequest { node_name: "n1".into(), ..Default::default() };
    let err = svc.watch_vifs(Request::new(req)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    let req = ReportPluggedRequest {
        pod_uid: "u".into(),
        vif_id: "v".into(),
        node_name: "n1".into(),
        plugged: true,
        ..Default::default()
    };
    assert_eq!(svc.report_plugged(Request::new(req)).await.unwrap_err().code(), tonic::Code::Unavailable);
    let err = svc.get_vif(Request::new(GetVifRequest { pod_uid: "u".into() })).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
}

#[tokio::test]
async fn a_node_gets_its_vifs_and_the_other_nodes_routes_then_deltas() {
    let srv = serve().await;
    srv.pod("a", "n1").await;
    srv.pod("b", "n2").await;
    {
        let mut idx = lock(&srv.index);
        idx.set_node_ips("n1", vec!["192.168.0.1".into()]);
        idx.set_node_ips("n2", vec!["192.168.0.2".into()]);
        idx.set_blocks(blocks(&[("n1", "10.0.0.0/24"), ("n2", "10.0.1.0/24")]));
    }
    let mut s1 = srv.watch("n1", "").await.unwrap();
    let (snap, point) = snapshot(&mut s1).await;
    assert_eq!(snap, ["+uid-a Allocated", r#"+routes n2 ["10.0.1.0/24"] via ["192.168.0.2"]"#]);
    assert!(point.starts_with("e-"), "{point}");

    // Deltas: n1's own VIFs and other nodes' routes only.
    srv.pod("c", "n2").await;
    srv.pod("d", "n1").await;
    lock(&srv.index).set_blocks(blocks(&[("n1", "10.0.2.0/24"), ("n2", "10.0.3.0/24")]));
    lock(&srv.index).set_node_ips("n2", vec![]);
    let vif = srv.ctl.get_vif("uid-a").unwrap();
    let mut client = srv.client.clone();
    let req = ReportPluggedRequest {
        pod_uid: "uid-a".into(),
        vif_id: vif.vif_id().to_string(),
        node_name: "n1".into(),
        plugged: true,
        host_ifname: "veth1".into(),
    };
    let resp = client.report_plugged(req).await.unwrap().into_inner();
    assert_eq!(resp.vif.unwrap().state(), PbState::Ready);
    let mut got = Vec::new();
    let mut last = String::new();
    for _ in 0..4 {
        let ev = next(&mut s1).await;
        last = ev.resume_point.clone();
        got.push(show(&ev));
    }
    assert_eq!(
        got,
        ["+uid-d Allocated", r#"+routes n2 ["10.0.3.0/24"] via ["192.168.0.2"]"#, "-routes n2", "+uid-a Ready",]
    );
    let got = client.get_vif(GetVifRequest { pod_uid: "uid-a".into() }).await.unwrap().into_inner();
    assert_eq!(got.state(), PbState::Ready);
    drop(s1);

    // Resume: only what was missed.
    srv.pod("e", "n1").await;
    let mut s1 = srv.watch("n1", &last).await.unwrap();
    // A resumed stream starts with SNAPSHOT_COMPLETE: the binder is caught up, live again.
    assert_eq!(next(&mut s1).await.r#type(), VifEventType::SnapshotComplete);
    assert_eq!(show(&next(&mut s1).await), "+uid-e Allocated");
    // A point of another epoch: RESET, then a fresh snapshot.
    let mut s2 = srv.watch("n1", "other-3").await.unwrap();
    assert_eq!(next(&mut s2).await.r#type(), VifEventType::Reset);
    let (snap, _) = snapshot(&mut s2).await;
    assert_eq!(snap, ["+uid-a Ready", "+uid-d Allocated", "+uid-e Allocated"]);

    // Shutdown ends open streams with UNAVAILABLE.
    srv.trigger.trigger();
    loop {
        match tokio::time::timeout(EVENT_TIMEOUT, s1.message()).await.unwrap() {
            Err(status) => break assert_eq!(status.code(), tonic::Code::Unavailable, "{status}"),
            Ok(Some(r)) if r.r#type() == VifEventType::Heartbeat => {}
            other => panic!("expected UNAVAILABLE at shutdown, got {other:?}"),
        }
    }
}
