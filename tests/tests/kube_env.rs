//! The Kubernetes test environment itself: a real kube-apiserver that stores and streams objects,
//! and enforces RBAC on ServiceAccount tokens. Every service test builds on these guarantees.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kuryr_tests::kube::KubeEnv;
use kuryr_tests::objects;
use kuryr_tests::util::unique_id;

/// Generous for a loaded 2-core machine; a healthy apiserver delivers the event in milliseconds.
const WATCH_TIMEOUT: Duration = Duration::from_secs(30);

fn pod(name: &str) -> Pod {
    // Bound to a node directly: there is no scheduler (and no kubelet; nothing runs it).
    objects::pod(name).node("node-a").command(vec!["sleep".into(), "3600".into()]).build()
}

/// The HTTP status of a failed API call, or a panic naming what came back instead.
fn api_code<T>(res: Result<T, kube::Error>) -> u16 {
    match res {
        Err(kube::Error::Api(status)) => status.code,
        Err(other) => panic!("expected an API error status, got {other}"),
        Ok(_) => panic!("expected an API error status, but the call succeeded"),
    }
}

#[tokio::test]
async fn apiserver_stores_watches_and_enforces_rbac() {
    let env = KubeEnv::start().await.unwrap();
    let admin = env.client().await.unwrap();
    let ns = format!("kube-env-{}", unique_id());

    // The apiserver creates the system namespaces itself.
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    namespaces.get("default").await.unwrap();
    namespaces.get("kube-system").await.unwrap();
    namespaces
        .create(
            &PostParams::default(),
            &Namespace { metadata: ObjectMeta { name: Some(ns.clone()), ..Default::default() }, ..Default::default() },
        )
        .await
        .unwrap();

    // Watch first, then create: the pod must arrive through the stream, with the stored uid.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let mut stream = watcher(pods.clone(), watcher::Config::default()).default_backoff().applied_objects().boxed();
    let created = pods.create(&PostParams::default(), &pod("p1")).await.unwrap();
    let uid = created.metadata.uid.clone().unwrap();
    let seen = tokio::time::timeout(WATCH_TIMEOUT, async {
        while let Some(p) = stream.try_next().await.unwrap() {
            if p.metadata.name.as_deref() == Some("p1") {
                return p;
            }
        }
        panic!("watch stream ended");
    })
    .await
    .expect("pod p1 did not appear on the watch stream");
    assert_eq!(seen.metadata.uid.as_deref(), Some(uid.as_str()));
    assert_eq!(seen.metadata.namespace.as_deref(), Some(ns.as_str()));
    assert_eq!(seen.spec.unwrap().node_name.as_deref(), Some("node-a"));

    // A ServiceAccount that may only read pods in this namespace.
    let sa = "pod-reader";
    let reader = env.service_account_client(&ns, sa).await.unwrap();
    Api::<Role>::namespaced(admin.clone(), &ns)
        .create(
            &PostParams::default(),
            &Role {
                metadata: ObjectMeta { name: Some("pod-reader".into()), ..Default::default() },
                rules: Some(vec![PolicyRule {
                    api_groups: Some(vec![String::new()]),
                    resources: Some(vec!["pods".into()]),
                    verbs: vec!["get".into(), "list".into(), "watch".into()],
                    ..Default::default()
                }]),
            },
        )
        .await
        .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), &ns)
        .create(
            &PostParams::default(),
            &RoleBinding {
                metadata: ObjectMeta { name: Some("pod-reader".into()), ..Default::default() },
                role_ref: RoleRef {
                    api_group: "rbac.authorization.k8s.io".into(),
                    kind: "Role".into(),
                    name: "pod-reader".into(),
                },
                subjects: Some(vec![Subject {
                    kind: "ServiceAccount".into(),
                    name: sa.into(),
                    namespace: Some(ns.clone()),
                    ..Default::default()
                }]),
            },
        )
        .await
        .unwrap();

    // Allowed: list and get pods in the namespace. RBAC changes take effect immediately (the
    // authorizer reads roles from the apiserver's own watch cache), but allow for its lag.
    let reader_pods: Api<Pod> = Api::namespaced(reader.clone(), &ns);
    let listed = tokio::time::timeout(WATCH_TIMEOUT, async {
        loop {
            match reader_pods.list(&ListParams::default()).await {
                Ok(list) => return list,
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("listing pods as {sa}: {e}"),
            }
        }
    })
    .await
    .expect("the RoleBinding never took effect");
    let names: Vec<_> = listed.items.iter().filter_map(|p| p.metadata.name.as_deref()).collect();
    assert_eq!(names, ["p1"]);
    assert_eq!(reader_pods.get("p1").await.unwrap().metadata.uid.as_deref(), Some(uid.as_str()));

    // Refused with 403: writes, other resources, other namespaces.
    assert_eq!(api_code(reader_pods.create(&PostParams::default(), &pod("p2")).await), 403);
    assert_eq!(api_code(reader_pods.delete("p1", &DeleteParams::default()).await), 403);
    let reader_secrets: Api<Secret> = Api::namespaced(reader.clone(), &ns);
    assert_eq!(api_code(reader_secrets.list(&ListParams::default()).await), 403);
    let reader_default_pods: Api<Pod> = Api::namespaced(reader, "default");
    assert_eq!(api_code(reader_default_pods.list(&ListParams::default()).await), 403);

    // And the refusals changed nothing.
    let names: Vec<_> =
        pods.list(&ListParams::default()).await.unwrap().items.into_iter().filter_map(|p| p.metadata.name).collect();
    assert_eq!(names, ["p1"]);
}

#[tokio::test]
async fn environment_is_stopped_and_removed_on_drop() {
    let env = KubeEnv::start().await.unwrap();
    let dir = env.state_dir().to_path_buf();
    let pids: Vec<i32> =
        ["ETCD_PID", "APISERVER_PID"].iter().map(|k| env.env_value(k).unwrap().parse().unwrap()).collect();
    let out = env.kubectl(&["get", "namespace", "kube-system", "-o", "name"]).await.unwrap();
    assert_eq!(out.trim(), "namespace/kube-system");
    drop(env);
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Gone, or a zombie waiting for its parent to reap it.
        assert!(stat.is_empty() || stat.split(' ').nth(2) == Some("Z"), "pid {pid} still runs: {stat}");
    }
    if std::env::var("KURYR_KEEP_STATE").as_deref() != Ok("1") {
        assert!(!dir.exists(), "{} was not removed", dir.display());
    }
}
