//! Every kuryr ServiceAccount holds exactly the permissions its code uses: deploy/rbac applied to
//! a real kube-apiserver, each account's rules read back with SelfSubjectRulesReview (as the
//! account itself, in kuryr-system and in another namespace, to tell cluster-wide grants from the
//! kuryr-system Roles), less what any authenticated account holds, compared with the committed
//! list tests/rbac/permissions.txt — a permission not listed fails the test, and so does a listed
//! one not held.
//!
//! And what RBAC cannot narrow: deploy/rbac/admission.yaml lets the allocator and lbaas change
//! only the finalizers of pods, namespaces and Services, though RBAC grants them `patch`.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use k8s_openapi::api::authorization::v1::{SelfSubjectRulesReview, SelfSubjectRulesReviewSpec};
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodSpec, Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kuryr_tests::kube::{KubeEnv, client_from_kubeconfig};
use kuryr_tests::util::repo_root;
use serde_json::json;

const ACCOUNTS: [&str; 6] =
    ["kuryr-watcher", "kuryr-vif-allocator", "kuryr-lbaas", "kuryr-policy", "kuryr-binder", "kuryr-pool-manager"];
/// An account bound to nothing: what it holds, every account holds.
const BASELINE: &str = "rbac-baseline";
/// A namespace with no kuryr Role in it.
const ELSEWHERE: &str = "rbac-elsewhere";

/// (scope, api group, resource, verb); scope `cluster` or the namespace of a Role.
type Permission = (String, String, String, String);

/// The account's rules in `ns`, as (api group, resource, verb); wildcards fail the test.
async fn rules(client: &kube::Client, ns: &str) -> BTreeSet<(String, String, String)> {
    let review = SelfSubjectRulesReview {
        spec: SelfSubjectRulesReviewSpec { namespace: Some(ns.into()) },
        ..Default::default()
    };
    let got = Api::<SelfSubjectRulesReview>::all(client.clone()).create(&PostParams::default(), &review).await.unwrap();
    let status = got.status.unwrap();
    let mut out = BTreeSet::new();
    for r in status.resource_rules {
        for g in &r.api_groups.clone().unwrap_or_default() {
            for res in &r.resources.clone().unwrap_or_default() {
                for v in &r.verbs {
                    let group = if g.is_empty() { "core".to_string() } else { g.clone() };
                    out.insert((group, res.clone(), v.clone()));
                }
            }
        }
    }
    out
}

/// Everything `account` holds beyond `baseline`, with its scope.
async fn held(
    env: &KubeEnv,
    account: &str,
    baseline: &[BTreeSet<(String, String, String)>; 2],
) -> BTreeSet<Permission> {
    let kubeconfig = env.service_account_kubeconfig("kuryr-system", account).await.unwrap();
    let client = client_from_kubeconfig(&kubeconfig).await.unwrap();
    let in_system = rules(&client, "kuryr-system").await;
    let elsewhere = rules(&client, ELSEWHERE).await;
    let mut out = BTreeSet::new();
    for (g, r, v) in in_system.difference(&baseline[0]) {
        assert!(g != "*" && r != "*" && v != "*", "{account} holds a wildcard: {g} {r} {v}");
        let scope = if elsewhere.contains(&(g.clone(), r.clone(), v.clone())) { "cluster" } else { "kuryr-system" };
        out.insert((scope.to_string(), g.clone(), r.clone(), v.clone()));
    }
    for (g, r, v) in elsewhere.difference(&baseline[1]) {
        assert!(in_system.contains(&(g.clone(), r.clone(), v.clone())), "{account}: {g} {r} {v} only in {ELSEWHERE}");
    }
    out
}

/// tests/rbac/permissions.txt: account → its permissions.
fn committed() -> Vec<(String, Permission)> {
    let text = std::fs::read_to_string(repo_root().join("tests/rbac/permissions.txt")).unwrap();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 5, "tests/rbac/permissions.txt: `{l}` is not `account scope group resource verb`");
            (f[0].to_string(), (f[1].to_string(), f[2].to_string(), f[3].to_string(), f[4].to_string()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_account_holds_exactly_the_committed_permissions() {
    let env = KubeEnv::start().await.unwrap();
    let admin = env.client().await.unwrap();
    for n in ["kuryr-system", ELSEWHERE] {
        let ns =
            Namespace { metadata: ObjectMeta { name: Some(n.into()), ..Default::default() }, ..Default::default() };
        Api::<Namespace>::all(admin.clone()).create(&PostParams::default(), &ns).await.unwrap();
    }
    env.apply_file(&repo_root().join("deploy/crds")).await.unwrap();
    env.apply_file(&repo_root().join("deploy/rbac")).await.unwrap();

    let base_kc = env.service_account_kubeconfig("kuryr-system", BASELINE).await.unwrap();
    let base = client_from_kubeconfig(&base_kc).await.unwrap();
    let baseline = [rules(&base, "kuryr-system").await, rules(&base, ELSEWHERE).await];
    assert!(!baseline[0].is_empty(), "SelfSubjectRulesReview returned nothing for an unbound account");

    let want = committed();
    let mut failures = Vec::new();
    for account in ACCOUNTS {
        let has = held(&env, account, &baseline).await;
        let listed: BTreeSet<Permission> = want.iter().filter(|(a, _)| a == account).map(|(_, p)| p.clone()).collect();
        for p in has.difference(&listed) {
            failures.push(format!("{account} holds {p:?}, which tests/rbac/permissions.txt does not list"));
        }
        for p in listed.difference(&has) {
            failures.push(format!("{account} does not hold {p:?}, which tests/rbac/permissions.txt lists"));
        }
        eprintln!("{account}: {} permissions beyond any account's", has.len());
    }
    for (a, _) in &want {
        assert!(ACCOUNTS.contains(&a.as_str()), "tests/rbac/permissions.txt names an unknown account {a}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_may_change_finalizers_and_nothing_else() {
    let env = KubeEnv::start().await.unwrap();
    let admin = env.client().await.unwrap();
    let ns = Namespace {
        metadata: ObjectMeta { name: Some("kuryr-system".into()), ..Default::default() },
        ..Default::default()
    };
    Api::<Namespace>::all(admin.clone()).create(&PostParams::default(), &ns).await.unwrap();
    env.apply_file(&repo_root().join("deploy/crds")).await.unwrap();
    env.apply_file(&repo_root().join("deploy/rbac")).await.unwrap();
    let pp = PostParams::default();
    let pod = Pod {
        metadata: ObjectMeta { name: Some("p".into()), ..Default::default() },
        spec: Some(PodSpec {
            containers: vec![Container { name: "c".into(), image: Some("busybox".into()), ..Default::default() }],
            ..Default::default()
        }),
        ..Default::default()
    };
    Api::<Pod>::namespaced(admin.clone(), "default").create(&pp, &pod).await.unwrap();
    let svc = Service {
        metadata: ObjectMeta { name: Some("s".into()), ..Default::default() },
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort { port: 80, ..Default::default() }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    Api::<Service>::namespaced(admin.clone(), "default").create(&pp, &svc).await.unwrap();

    let refused = |r: Result<(), kube::Error>, what: &str| match r {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("finalizers") => {}
        other => panic!("{what}: expected the admission policy's refusal, got {other:?}"),
    };
    let jp = PatchParams::default();
    let add_finalizer = |f: &str| {
        Patch::Json::<()>(
            serde_json::from_value(json!([{"op": "add", "path": "/metadata/finalizers", "value": [f]}])).unwrap(),
        )
    };
    let remove_finalizer = || {
        Patch::Json::<()>(serde_json::from_value(json!([{"op": "remove", "path": "/metadata/finalizers"}])).unwrap())
    };

    // The allocator: its finalizer on a pod, yes; the pod's image, labels, annotations, no.
    let alloc =
        client_from_kubeconfig(&env.service_account_kubeconfig("kuryr-system", "kuryr-vif-allocator").await.unwrap())
            .await
            .unwrap();
    let pods = Api::<Pod>::namespaced(alloc, "default");
    // The API server enforces a new admission policy only once it has loaded and type-checked
    // it, a moment after it was created: wait for that, with a change the policy refuses (a new
    // annotation value each time, so that an attempt let through does not make the next one a
    // no-op).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    for i in 0.. {
        let probe = Patch::Merge(json!({"metadata": {"annotations": {"probe": i.to_string()}}}));
        match pods.patch("p", &jp, &probe).await {
            Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("finalizers") => break,
            other => {
                assert!(std::time::Instant::now() < deadline, "the admission policy is not enforced: {other:?}");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    }
    pods.patch("p", &jp, &add_finalizer("kuryr.openstack.org/vif")).await.unwrap();
    let image = Patch::Json::<()>(
        serde_json::from_value(json!([{"op": "replace", "path": "/spec/containers/0/image", "value": "evil"}]))
            .unwrap(),
    );
    refused(pods.patch("p", &jp, &image).await.map(drop), "the allocator changing a pod's image");
    let label = Patch::Merge(json!({"metadata": {"labels": {"app": "x"}}}));
    refused(pods.patch("p", &jp, &label).await.map(drop), "the allocator labelling a pod");
    let annotation = Patch::Merge(json!({"metadata": {"annotations": {"a": "x"}}}));
    refused(pods.patch("p", &jp, &annotation).await.map(drop), "the allocator annotating a pod");
    // Its report of a pod's interfaces, yes, but not with another annotation alongside.
    let status = Patch::Merge(json!({"metadata": {"annotations": {"k8s.v1.cni.cncf.io/network-status": "[]"}}}));
    pods.patch("p", &jp, &status).await.unwrap();
    let both = Patch::Merge(
        json!({"metadata": {"annotations": {"k8s.v1.cni.cncf.io/network-status": "[{}]", "k8s.v1.cni.cncf.io/networks": "x"}}}),
    );
    refused(pods.patch("p", &jp, &both).await.map(drop), "the allocator asking for networks with the status");
    pods.patch("p", &jp, &remove_finalizer()).await.unwrap();

    // lbaas: its finalizer on a Service, yes; the Service's selector, no.
    let lbaas = client_from_kubeconfig(&env.service_account_kubeconfig("kuryr-system", "kuryr-lbaas").await.unwrap())
        .await
        .unwrap();
    let services = Api::<Service>::namespaced(lbaas, "default");
    services.patch("s", &jp, &add_finalizer("kuryr.openstack.org/lbaas")).await.unwrap();
    let selector = Patch::Merge(json!({"spec": {"selector": {"app": "stolen"}}}));
    refused(services.patch("s", &jp, &selector).await.map(drop), "lbaas changing a Service's selector");
    services.patch("s", &jp, &remove_finalizer()).await.unwrap();

    // Others (the admin here) are not held by the policy.
    Api::<Pod>::namespaced(admin, "default").patch("p", &jp, &label).await.unwrap();
}
