#![allow(clippy::unwrap_used)]

use kuryr_proto::watcher::v1::object::Body;
use kuryr_proto::watcher::v1::{EventType, Kind, NetworkPolicy as PbPolicy, Object, Pod as PbPod, SubscribeResponse};
use kuryr_stream::Epoch;
use kuryr_stream::log::{Change, Log};

use super::*;

/// A watcher event, converted as the follower converts it.
fn ev(t: EventType, object: Option<Object>) -> crate::core::Change {
    crate::grpc::convert::change(&SubscribeResponse { resume_point: String::new(), r#type: t as i32, object })
}

fn pod(name: &str, node: &str, ip: &str, app: &str) -> Object {
    Object {
        kind: Kind::Pod as i32,
        namespace: "ns".into(),
        name: name.into(),
        labels: [("app".to_string(), app.to_string())].into(),
        body: Some(Body::Pod(PbPod {
            node_name: node.into(),
            phase: "Running".into(),
            pod_ips: vec![ip.into()],
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Pods labelled app=db accept TCP 5432 from app=web.
fn policy() -> Object {
    let spec = r#"{"podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": 5432}]}]}"#;
    Object {
        kind: Kind::NetworkPolicy as i32,
        namespace: "ns".into(),
        name: "db".into(),
        body: Some(Body::NetworkPolicy(PbPolicy { spec_json: spec.into() })),
        ..Default::default()
    }
}

fn publisher() -> (Publisher, PolicyLog) {
    let log: PolicyLog = Log::new(Epoch::fixed("e"), 1024).shared();
    (Publisher::new(log.clone(), Metrics::default()), log)
}

/// A node's items, in log order, as text.
fn items(log: &PolicyLog, node: &str) -> Vec<String> {
    let (items, _) = lock(log).snapshot(|k, _| k.0 == node);
    items
        .iter()
        .map(|((_, item), e)| match (item, &**e) {
            (Item::Group(id), Entry::Group { allowed, policies }) => {
                format!("group {} {} {:?}", &id[..1], allowed.len(), policies)
            }
            (Item::Isolation(ip), Entry::Isolation { ingress, egress, pod }) => {
                format!("isolation {ip} {pod} in={} eg={}", ingress.is_some(), egress.is_some())
            }
            other => format!("{other:?}"),
        })
        .collect()
}

#[test]
fn the_first_snapshot_is_published_whole_then_changes_as_deltas() {
    let (mut p, log) = publisher();
    p.apply(ev(EventType::Applied, Some(policy())));
    p.apply(ev(EventType::Applied, Some(pod("db-1", "n1", "10.0.1.1", "db"))));
    p.apply(ev(EventType::Applied, Some(pod("web-1", "n2", "10.0.2.1", "web"))));
    assert!(!lock(&log).is_ready(), "nothing is served before the snapshot is complete");
    assert_eq!(p.apply(ev(EventType::SnapshotComplete, None)), Effect::Live);
    assert!(lock(&log).is_ready());
    assert_eq!(lock(&log).revision(), 0, "the first snapshot is state, not history");
    assert_eq!(items(&log, "n1"), ["group i 1 [\"ns/db\"]", "isolation 10.0.1.1 ns/db-1 in=true eg=false"]);
    assert!(items(&log, "n2").is_empty(), "web is not isolated");

    // A second web pod: one more peer in n1's group, nothing for n2.
    p.apply(ev(EventType::Applied, Some(pod("web-2", "n2", "10.0.2.2", "web"))));
    assert_eq!(items(&log, "n1")[0], "group i 2 [\"ns/db\"]");
    let deltas = lock(&log).since(0, 100).unwrap();
    assert_eq!(deltas.len(), 1, "{deltas:?}");
    assert!(matches!(&deltas[0].change, Change::Applied(e) if matches!(&**e, Entry::Group { .. })));

    // db-1 relabelled: no longer isolated; its isolation goes before its group.
    p.apply(ev(EventType::Applied, Some(pod("db-1", "n1", "10.0.1.1", "cache"))));
    assert!(items(&log, "n1").is_empty());
    let deltas = lock(&log).since(1, 100).unwrap();
    let kinds: Vec<&Item> = deltas.iter().map(|d| &d.key.1).collect();
    assert!(matches!(kinds[..], [Item::Isolation(_), Item::Group(_)]), "{kinds:?}");
    assert!(deltas.iter().all(|d| matches!(d.change, Change::Deleted(_))));
}

#[test]
fn a_reset_snapshot_removes_what_it_did_not_mention_and_publishes_only_at_its_end() {
    let (mut p, log) = publisher();
    p.apply(ev(EventType::Applied, Some(policy())));
    p.apply(ev(EventType::Applied, Some(pod("db-1", "n1", "10.0.1.1", "db"))));
    p.apply(ev(EventType::SnapshotComplete, None));
    assert_eq!(items(&log, "n1").len(), 2);
    assert_eq!(p.apply(ev(EventType::Reset, None)), Effect::Resync);
    p.apply(ev(EventType::Applied, Some(pod("db-1", "n1", "10.0.1.1", "db"))));
    assert_eq!(items(&log, "n1").len(), 2, "still the old state inside the snapshot");
    p.apply(ev(EventType::SnapshotComplete, None));
    assert!(items(&log, "n1").is_empty(), "the policy was not in the new snapshot: gone");
}

#[test]
fn a_deleted_pod_frees_its_address_for_the_next_owner() {
    let (mut p, log) = publisher();
    p.apply(ev(EventType::Applied, Some(policy())));
    p.apply(ev(EventType::Applied, Some(pod("db-1", "n1", "10.0.1.1", "db"))));
    p.apply(ev(EventType::SnapshotComplete, None));
    p.apply(ev(EventType::Deleted, Some(pod("db-1", "n1", "10.0.1.1", "db"))));
    assert!(items(&log, "n1").is_empty());
    p.apply(ev(EventType::Applied, Some(pod("web-9", "n1", "10.0.1.1", "web"))));
    assert!(items(&log, "n1").is_empty(), "the new owner of the address is not isolated");
    p.apply(ev(EventType::Applied, Some(pod("db-2", "n1", "10.0.1.2", "db"))));
    assert_eq!(items(&log, "n1"), ["group i 1 [\"ns/db\"]", "isolation 10.0.1.2 ns/db-2 in=true eg=false"]);
}

/// A pod as watched before the kubelet reported its addresses, with its uid and phase.
fn addressless(name: &str, uid: &str, phase: &str, app: &str) -> Object {
    let mut o = pod(name, "n1", "", app);
    o.uid = uid.into();
    if let Some(Body::Pod(p)) = &mut o.body {
        p.pod_ips.clear();
        p.phase = phase.into();
    }
    o
}

fn vif(uid: &str, ip: &str) -> VifAddresses {
    VifAddresses { uid: uid.into(), ips: vec![ip.parse().unwrap()] }
}

fn key(name: &str) -> PodKey {
    PodKey { namespace: "ns".into(), name: name.into() }
}

#[test]
fn a_pod_is_isolated_from_its_recorded_vif_before_its_status_has_addresses() {
    let (mut p, log) = publisher();
    p.apply(ev(EventType::Applied, Some(policy())));
    p.apply(ev(EventType::SnapshotComplete, None));
    // Recorded before the pod is seen: taken when it is.
    p.vif(VifChange::Listed([(key("db-1"), vif("u1", "10.0.1.1"))].into()));
    p.apply(ev(EventType::Applied, Some(addressless("db-1", "u1", "Pending", "db"))));
    // No app=web pod: the group admits nobody.
    assert_eq!(items(&log, "n1"), ["group i 0 [\"ns/db\"]", "isolation 10.0.1.1 ns/db-1 in=true eg=false"]);

    // Recorded after the pod is seen: published then.
    p.apply(ev(EventType::Applied, Some(addressless("db-2", "u2", "Pending", "db"))));
    assert_eq!(items(&log, "n1").len(), 2);
    p.vif(VifChange::Set(key("db-2"), vif("u2", "10.0.1.2")));
    assert!(items(&log, "n1").contains(&"isolation 10.0.1.2 ns/db-2 in=true eg=false".to_string()));

    // The status takes over with the same address: nothing changes.
    let revision = lock(&log).revision();
    p.apply(ev(EventType::Applied, Some(pod("db-2", "n1", "10.0.1.2", "db"))));
    assert_eq!(lock(&log).revision(), revision);
    // Once the status holds the addresses, the VIF record no longer counts for the pod.
    p.vif(VifChange::Gone(key("db-2")));
    assert!(items(&log, "n1").contains(&"isolation 10.0.1.2 ns/db-2 in=true eg=false".to_string()));

    // The record of db-1 gone while its status is still empty: the address leaves the rules.
    p.vif(VifChange::Gone(key("db-1")));
    assert!(!items(&log, "n1").iter().any(|i| i.contains("10.0.1.1")), "{:?}", items(&log, "n1"));
}

#[test]
fn a_vif_of_another_pod_of_the_name_or_a_finished_pod_gives_no_address() {
    let (mut p, log) = publisher();
    p.apply(ev(EventType::Applied, Some(policy())));
    p.apply(ev(EventType::SnapshotComplete, None));
    // The record of an earlier pod of that name (another uid).
    p.vif(VifChange::Set(key("db-1"), vif("old", "10.0.1.1")));
    p.apply(ev(EventType::Applied, Some(addressless("db-1", "new", "Pending", "db"))));
    assert!(items(&log, "n1").iter().all(|i| !i.starts_with("isolation")), "{:?}", items(&log, "n1"));
    p.vif(VifChange::Set(key("db-1"), vif("new", "10.0.1.7")));
    assert!(items(&log, "n1").contains(&"isolation 10.0.1.7 ns/db-1 in=true eg=false".to_string()));
    // Finished: its address may be another pod's already.
    p.apply(ev(EventType::Applied, Some(addressless("db-1", "new", "Succeeded", "db"))));
    assert!(items(&log, "n1").iter().all(|i| !i.starts_with("isolation")), "{:?}", items(&log, "n1"));
    // Deleted: a later record of the name does nothing.
    p.apply(ev(EventType::Deleted, Some(addressless("db-1", "new", "Succeeded", "db"))));
    p.vif(VifChange::Set(key("db-1"), vif("new", "10.0.1.8")));
    assert!(items(&log, "n1").iter().all(|i| !i.starts_with("isolation")), "{:?}", items(&log, "n1"));
}
