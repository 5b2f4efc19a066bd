//! kuryr-binder as an attacker on the node meets it: through the real `kuryr-cni` shim (and raw
//! gRPC on its socket), against a binder in a node network namespace following a scripted
//! allocator.
//!
//! - only root (and the uids/gids allowed by flag) can run ADD, DEL or GC, even when the
//!   socket's file mode lets anyone connect; TCP is refused at start;
//! - `CNI_NETNS` must be a pod's network namespace: never the binder's own (by any path), never a
//!   file that is not a namespace; DEL there touches nothing;
//! - one pod's VIF cannot be taken into another namespace by another container; a repeated ADD
//!   of a live attachment answers the same and keeps the record; an ADD the binder died in is
//!   rolled back at its next start; a plugged report ADD did not wait for (a VIF ready once
//!   plugged) is retried until delivered, also after a restart;
//! - a shim of another version is told "incompatible" and nothing more; an absurd
//!   `timeoutSeconds` is a CNI error, not an abort.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use kuryr_proto::allocator::v1::VifState;
use kuryr_tests::binder::Binder;
use kuryr_tests::netns::Netns;
use kuryr_tests::services::{bin_path, wait_until};
use kuryr_tests::shim::{ShimOutput, run_shim, run_shim_as};
use kuryr_tests::vifserver::{ScriptedAllocator, ScriptedServer, bridge_vif};
use serde_json::Value;

struct Env {
    _server: ScriptedServer,
    alloc: ScriptedAllocator,
    node: Netns,
    binder: Binder,
    _dir: tempfile::TempDir,
}

async fn env(auto_ready: bool, extra: &[&str]) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let alloc = ScriptedAllocator::new(auto_ready);
    let server = alloc.serve_unix(&dir.path().join("alloc.sock")).await.unwrap();
    let node = Netns::new("ksn").unwrap();
    let mut args: Vec<String> = vec!["--vif-wait-timeout".into(), "10s".into()];
    args.extend(extra.iter().map(ToString::to_string));
    let binder = Binder::start("node-s", &node.path(), &server.target, &args).await.unwrap();
    Env { _server: server, alloc, node, binder, _dir: dir }
}

/// A pod: its namespace, uid and VIF (offered by the allocator).
struct Pod {
    netns: Netns,
    uid: String,
    name: String,
    address: String,
}

fn pod(e: &Env, name: &str, host: u8) -> Pod {
    let o = std::process::id() % 200 + 20;
    let uid = format!("uid-{name}-{}", std::process::id());
    let address = format!("10.81.{o}.{host}/24");
    e.alloc.upsert(bridge_vif("node-s", "default", name, &uid, (&address, &format!("10.81.{o}.1")), None, "kuryr0"));
    Pod { netns: Netns::new("ksp").unwrap(), uid, name: name.to_string(), address }
}

fn cni_env(cmd: &str, container: &str, netns: &str, ifname: &str, p: &Pod) -> Vec<(String, String)> {
    let args = format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={container};K8S_POD_UID={}",
        p.name, p.uid
    );
    [
        ("CNI_COMMAND", cmd),
        ("CNI_CONTAINERID", container),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", ifname),
        ("CNI_PATH", "/usr/lib/cni"),
        ("CNI_ARGS", args.as_str()),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn shim(env: &[(String, String)], conf: &Value) -> ShimOutput {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    run_shim(&env, conf.to_string().as_bytes()).unwrap()
}

fn shim_as(env: &[(String, String)], conf: &Value, uid: u32, gid: u32) -> ShimOutput {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    run_shim_as(&env, conf.to_string().as_bytes(), uid, gid).unwrap()
}

/// A CNI error object alone on stdout with a non-zero exit, `code`, and `names` in its text.
fn assert_error(out: &ShimOutput, code: u64, names: &str, what: &str) {
    assert_ne!(out.code, 0, "{what}: exit 0; stdout {}", out.stdout);
    let v = out.json().unwrap_or_else(|e| panic!("{what}: {e:#}; stderr {}", out.stderr));
    assert_eq!(v["code"].as_u64(), Some(code), "{what}: {v}");
    let text = format!("{} {}", v["msg"].as_str().unwrap_or_default(), v["details"].as_str().unwrap_or_default());
    assert!(text.contains(names), "{what}: `{names}` not in {v}");
}

fn host_veths(node: &Netns) -> Vec<String> {
    node.links().into_iter().filter(|l| l.starts_with("kv")).collect()
}

fn pod_addresses(p: &Pod) -> String {
    p.netns.exec(&["ip", "-o", "addr", "show", "dev", "eth0"]).unwrap_or_default()
}

/// Lets anyone on the machine reach the binder's socket, as a mistaken hostPath or `chmod`
/// would: from here on only the binder's own check stands in the way.
fn open_socket_to_everyone(b: &Binder) {
    let dir = b.socket.parent().unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&b.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_root_and_allowed_ids_drive_the_binder() {
    let e = env(true, &["--cni-allow-uid", "4343"]).await;
    open_socket_to_everyone(&e.binder);
    let conf = e.binder.netconf("1.1.0", "kuryr");
    let a = pod(&e, "root-a", 10);
    let a_ns = a.netns.path().display().to_string();

    // A process of another user connects (the mode allows it) and is refused every operation.
    let add = cni_env("ADD", "ctr-nobody", &a_ns, "eth0", &a);
    let out = shim_as(&add, &conf, 65534, 65534);
    assert_error(&out, 5, "uid 65534 gid 65534", "ADD as nobody");
    assert!(host_veths(&e.node).is_empty() && e.binder.attachment_records() == 0, "nobody's ADD made something");

    // Root's ADD works; nobody's DEL and GC of it are refused and leave it alone.
    let add = cni_env("ADD", "ctr-root", &a_ns, "eth0", &a);
    let out = shim(&add, &conf);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, e.binder.logs());
    let out = shim_as(&cni_env("DEL", "ctr-root", &a_ns, "eth0", &a), &conf, 65534, 65534);
    assert_error(&out, 5, "may not call", "DEL as nobody");
    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = serde_json::json!([]);
    let gc_env = vec![("CNI_COMMAND".to_string(), "GC".to_string()), ("CNI_PATH".into(), "/usr/lib/cni".into())];
    let out = shim_as(&gc_env, &gc, 65534, 65534);
    assert_error(&out, 5, "may not call", "GC as nobody");
    assert!(pod_addresses(&a).contains(&a.address), "the attachment was touched: {}", pod_addresses(&a));
    assert_eq!((host_veths(&e.node).len(), e.binder.attachment_records()), (1, 1));

    // An allowed uid may.
    let out = shim_as(&cni_env("DEL", "ctr-root", &a_ns, "eth0", &a), &conf, 4343, 65534);
    assert_eq!(out.code, 0, "DEL as the allowed uid: {}", out.stdout);
    assert!(host_veths(&e.node).is_empty() && e.binder.attachment_records() == 0);
    assert!(e.binder.logs().contains("refused a local caller"), "refusals are logged:\n{}", e.binder.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_is_refused_and_not_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let out = tokio::process::Command::new(bin_path("kuryr-binder").unwrap())
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--node-name", "n", "--state-dir"])
        .arg(dir.path())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), out).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "a TCP listener was accepted: {text}");
    assert!(text.contains("unix sockets only"), "{text}");
    let help = std::process::Command::new(bin_path("kuryr-binder").unwrap()).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("[default: unix:/run/kuryr/binder.sock]"), "{help}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cni_netns_must_be_a_pods_namespace() {
    let e = env(true, &[]).await;
    let conf = e.binder.netconf("1.0.0", "kuryr");
    let a = pod(&e, "ns-a", 20);
    let a_ns = a.netns.path().display().to_string();
    let out = shim(&cni_env("ADD", "ctr-a", &a_ns, "eth0", &a), &conf);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, e.binder.logs());
    let victim = host_veths(&e.node);
    assert_eq!(victim.len(), 1);

    // The binder's own namespace, by two paths (it runs in the node's), and a file that is no
    // namespace at all: ADD refused with code 4, nothing made.
    let node_ns = e.node.path().display().to_string();
    let plain = tempfile::NamedTempFile::new().unwrap();
    let plain = plain.path().display().to_string();
    let b = pod(&e, "ns-b", 21);
    for (netns, says) in [
        ("/proc/self/ns/net", "binder's own"),
        (node_ns.as_str(), "binder's own"),
        (plain.as_str(), "not a network namespace"),
    ] {
        let out = shim(&cni_env("ADD", "ctr-b", netns, "eth1", &b), &conf);
        assert_error(&out, 4, says, &format!("ADD into {netns}"));
    }
    assert_eq!(host_veths(&e.node), victim);
    assert_eq!(e.binder.attachment_records(), 1);

    // DEL naming the node's namespace and another pod's host-side interface: refused, and the
    // interface (with the pod's network) is still there.
    for netns in ["/proc/self/ns/net", node_ns.as_str()] {
        let out = shim(&cni_env("DEL", "ctr-evil", netns, &victim[0], &b), &conf);
        assert_error(&out, 4, "binder's own", &format!("DEL in {netns}"));
    }
    assert_eq!(host_veths(&e.node), victim);
    assert!(pod_addresses(&a).contains(&a.address));
    // A DEL whose namespace is gone is still fine.
    let out = shim(&cni_env("DEL", "ctr-gone", "/var/run/netns/kuryr-gone", "eth0", &b), &conf);
    assert_eq!(out.code, 0, "{}", out.stdout);
    assert_eq!(shim(&cni_env("DEL", "ctr-a", &a_ns, "eth0", &a), &conf).code, 0);
    assert!(host_veths(&e.node).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_vif_stays_with_its_sandbox() {
    let e = env(true, &[]).await;
    let conf = e.binder.netconf("1.0.0", "kuryr");
    let a = pod(&e, "own-a", 30);
    let a_ns = a.netns.path().display().to_string();
    let add = cni_env("ADD", "ctr-a", &a_ns, "eth0", &a);
    let first = shim(&add, &conf);
    assert_eq!(first.code, 0, "{}\n{}", first.stdout, e.binder.logs());
    let record = std::fs::read_dir(e.binder.state_dir.join("attachments")).unwrap().next().unwrap().unwrap().path();
    let record_bytes = std::fs::read(&record).unwrap();
    let plugged_reports = |al: &ScriptedAllocator| al.reports().iter().filter(|r| r.plugged).count();
    assert_eq!(plugged_reports(&e.alloc), 1);

    // The runtime retrying the same ADD: the same answer; the record and the VIF untouched.
    let again = shim(&add, &conf);
    assert_eq!(again.code, 0, "{}\n{}", again.stdout, e.binder.logs());
    assert_eq!(again.json().unwrap(), first.json().unwrap());
    assert_eq!(std::fs::read(&record).unwrap(), record_bytes);
    assert_eq!(plugged_reports(&e.alloc), 1, "a repeated ADD plugs nothing");
    assert!(pod_addresses(&a).contains(&a.address));

    // The same container into another namespace, and another container with the pod's UID into
    // an attacker's namespace: both refused, the pod's network intact.
    let thief = Netns::new("kst").unwrap();
    let thief_ns = thief.path().display().to_string();
    let out = shim(&cni_env("ADD", "ctr-a", &thief_ns, "eth0", &a), &conf);
    assert_error(&out, 4, "already attached", "the same container into another namespace");
    let out = shim(&cni_env("ADD", "ctr-thief", &thief_ns, "eth0", &a), &conf);
    assert_error(&out, 4, "already attached", "another container with the pod's UID");
    assert!(!thief.links().iter().any(|l| l == "eth0"), "the thief got an interface");
    assert!(pod_addresses(&a).contains(&a.address));
    assert_eq!((host_veths(&e.node).len(), e.binder.attachment_records()), (1, 1));

    // DEL after the repeated ADD cleans up as for any attachment: veth, record, and the report.
    assert_eq!(shim(&cni_env("DEL", "ctr-a", &a_ns, "eth0", &a), &conf).code, 0);
    assert!(host_veths(&e.node).is_empty() && e.binder.attachment_records() == 0);
    assert!(e.alloc.reports().iter().any(|r| !r.plugged && r.pod_uid == a.uid), "no unplugged report");

    // A sandbox that is gone without a DEL (its namespace deleted) does not keep the pod: its
    // replacement gets the VIF, and the stale record goes.
    let out = shim(&add, &conf);
    assert_eq!(out.code, 0, "{}", out.stdout);
    let Pod { netns, uid, name, address } = a;
    drop(netns);
    let a = Pod { netns: Netns::new("ksp").unwrap(), uid, name, address };
    let new_ns = a.netns.path().display().to_string();
    let out = shim(&cni_env("ADD", "ctr-a2", &new_ns, "eth0", &a), &conf);
    assert_eq!(out.code, 0, "the replacement sandbox: {}\n{}", out.stdout, e.binder.logs());
    assert!(pod_addresses(&a).contains(&a.address));
    assert_eq!(e.binder.attachment_records(), 1);
    assert_eq!(shim(&cni_env("DEL", "ctr-a2", &new_ns, "eth0", &a), &conf).code, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_the_binder_died_in_is_rolled_back_at_its_next_start() {
    // VIFs stay ALLOCATED after the plug report: ADD waits, plugged, for a readiness that
    // never comes — until the binder is killed.
    let mut e = env(false, &[]).await;
    let conf = e.binder.netconf("1.0.0", "kuryr");
    let a = pod(&e, "crash-a", 40);
    let a_ns = a.netns.path().display().to_string();
    let add = cni_env("ADD", "ctr-crash", &a_ns, "eth0", &a);
    let (add2, conf2) = (add.clone(), conf.clone());
    let pending = tokio::task::spawn_blocking(move || shim(&add2, &conf2));
    wait_until("the ADD to plug", Duration::from_secs(20), || async {
        anyhow::ensure!(e.alloc.reports().iter().any(|r| r.plugged && r.pod_uid == a.uid), "no plug report yet");
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(host_veths(&e.node).len(), 1);
    e.binder.kill().await.unwrap();
    let out = pending.await.unwrap();
    assert_ne!(out.code, 0, "the ADD the binder died in succeeded: {}", out.stdout);
    assert!(out.json().unwrap()["code"].is_u64(), "not a CNI error: {}", out.stdout);
    let record = std::fs::read_dir(e.binder.state_dir.join("attachments")).unwrap().next().unwrap().unwrap().path();
    assert!(std::fs::read_to_string(&record).unwrap().contains("\"adding\""), "the record is not marked adding");

    // The next start undoes it: no veth, no record, no eth0 in the pod, the VIF reported unplugged.
    e.binder.restart().await.unwrap();
    wait_until("the interrupted ADD to be rolled back", Duration::from_secs(20), || async {
        anyhow::ensure!(host_veths(&e.node).is_empty(), "veths {:?}", host_veths(&e.node));
        anyhow::ensure!(e.binder.attachment_records() == 0, "records left");
        Ok(())
    })
    .await
    .unwrap();
    assert!(!a.netns.links().iter().any(|l| l == "eth0"));
    assert!(e.alloc.reports().iter().any(|r| !r.plugged && r.pod_uid == a.uid));
    assert!(e.binder.logs().contains("rolling back an ADD the binder exited in"), "{}", e.binder.logs());

    // The runtime's retry then works.
    e.alloc.set_state(&a.uid, VifState::Allocated);
    let retry = tokio::task::spawn_blocking(move || shim(&add, &conf));
    wait_until("the retried ADD to plug", Duration::from_secs(20), || async {
        anyhow::ensure!(e.alloc.reports().iter().filter(|r| r.plugged && r.pod_uid == a.uid).count() == 2, "no");
        Ok(())
    })
    .await
    .unwrap();
    e.alloc.set_state(&a.uid, VifState::Ready);
    let out = retry.await.unwrap();
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, e.binder.logs());
    assert!(pod_addresses(&a).contains(&a.address));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vif_ready_when_plugged_is_reported_after_add_even_across_a_restart() {
    // The allocator answers no report: ADD of a VIF that is ready once plugged (the embedded
    // IPAM's) does not wait for it, and the binder keeps trying in the background.
    let mut e = env(false, &[]).await;
    let conf = e.binder.netconf("1.0.0", "kuryr");
    e.alloc.refuse_reports(true);
    let a = pod(&e, "late-a", 60);
    let mut vif = e.alloc.vif(&a.uid).unwrap();
    vif.ready_when_plugged = true;
    e.alloc.upsert(vif);
    let a_ns = a.netns.path().display().to_string();
    let out = shim(&cni_env("ADD", "ctr-late", &a_ns, "eth0", &a), &conf);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, e.binder.logs());
    assert!(pod_addresses(&a).contains(&a.address));
    let record = std::fs::read_dir(e.binder.state_dir.join("attachments")).unwrap().next().unwrap().unwrap().path();
    let pending = |r: &std::path::Path| {
        serde_json::from_slice::<Value>(&std::fs::read(r).unwrap()).unwrap()["report_pending"] == Value::Bool(true)
    };
    assert!(pending(&record), "the record does not say the report is pending");
    wait_until("the report to be retried", Duration::from_secs(20), || async {
        anyhow::ensure!(e.alloc.refused_reports() >= 2, "{} attempts", e.alloc.refused_reports());
        Ok(())
    })
    .await
    .unwrap();

    // The binder exits with the report still pending; the allocator answers again; the next
    // start delivers it, and the record says so.
    e.binder.kill().await.unwrap();
    e.alloc.refuse_reports(false);
    assert!(e.alloc.reports().is_empty(), "{:?}", e.alloc.reports());
    e.binder.restart().await.unwrap();
    wait_until("the pending report to be delivered", Duration::from_secs(20), || async {
        let delivered = e.alloc.reports().iter().filter(|r| r.plugged && r.pod_uid == a.uid).count();
        anyhow::ensure!(delivered == 1 && !pending(&record), "{delivered} delivered");
        Ok(())
    })
    .await
    .unwrap();
    assert!(pod_addresses(&a).contains(&a.address), "the restart touched the pod");

    // DEL reports the VIF unplugged after it: the allocator's last word is "unplugged".
    assert_eq!(shim(&cni_env("DEL", "ctr-late", &a_ns, "eth0", &a), &conf).code, 0);
    let last = e.alloc.reports().into_iter().rfind(|r| r.pod_uid == a.uid).unwrap();
    assert!(!last.plugged, "{last:?}");
    assert!(host_veths(&e.node).is_empty() && e.binder.attachment_records() == 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_and_deadlines_are_answered_as_cni_errors() {
    let e = env(true, &[]).await;
    let a = pod(&e, "ver-a", 50);
    let a_ns = a.netns.path().display().to_string();

    // timeoutSeconds of 3.6e11 s and more once aborted the shim (the gRPC deadline overflowed).
    for t in [360_000_000_000u64, u64::MAX] {
        let mut conf = e.binder.netconf("1.0.0", "kuryr");
        conf["timeoutSeconds"] = t.into();
        for cmd in ["ADD", "DEL", "CHECK"] {
            let out = shim(&cni_env(cmd, "ctr-t", &a_ns, "eth0", &a), &conf);
            assert_eq!(out.code, 1, "{cmd} timeoutSeconds {t}: exit {} stderr {}", out.code, out.stderr);
            assert_error(&out, 7, "timeoutSeconds", &format!("{cmd} timeoutSeconds {t}"));
        }
    }
    assert!(host_veths(&e.node).is_empty());

    // A shim of another version (spoken to in gRPC directly) learns only that it is
    // incompatible.
    use kuryr_proto::binder::v1::CniRequest;
    use kuryr_proto::binder::v1::cni_client::CniClient;
    let channel = e.binder.channel().await.unwrap();
    let req = CniRequest { shim_version: "0.0.1-old".into(), container_id: "c".into(), ..Default::default() };
    let status = CniClient::new(channel).add(req).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("incompatible"), "{}", status.message());
    let own = env!("CARGO_PKG_VERSION");
    assert!(!status.message().contains(own), "the binder's version leaked: {}", status.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_method_paths_add_no_metric_series() {
    let e = env(true, &[]).await;
    let channel = e.binder.channel().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    let mut seed = u64::from(std::process::id());
    let mut call = async |path: String| {
        grpc.ready().await.unwrap();
        let req = tonic::Request::new(tonic_health::pb::HealthCheckRequest::default());
        let codec = tonic_prost::ProstCodec::<_, tonic_health::pb::HealthCheckResponse>::default();
        let path: http::uri::PathAndQuery = path.parse().unwrap();
        grpc.unary(req, path, codec).await.unwrap_err().code()
    };
    let series = || {
        let m = e.node.exec(&["curl", "-sf", "http://127.0.0.1:9631/metrics"]).unwrap();
        m.lines().filter(|l| l.starts_with("grpc_server_")).count()
    };
    assert_eq!(call("/made.Up/First".into()).await, tonic::Code::Unimplemented);
    let before = series();
    for i in 0..10_000u32 {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let path = format!("/pkg{:x}.Svc{i}/M{:x}", seed >> 40, seed & 0xffff);
        assert_eq!(call(path).await, tonic::Code::Unimplemented);
    }
    let after = series();
    assert_eq!(before, after, "10,000 made-up paths changed the number of gRPC metric series");
    let m = e.node.exec(&["curl", "-sf", "http://127.0.0.1:9631/metrics"]).unwrap();
    let line = r#"grpc_server_handled_total{service="unknown",method="unknown",code="UNIMPLEMENTED"} 10001"#;
    assert!(m.contains(line), "made-up paths are not counted under one series: {line} not in\n{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_when_asked_for_is_authenticated_like_the_services() {
    use kuryr_proto::binder::v1::VersionRequest;
    use kuryr_proto::binder::v1::cni_client::CniClient;
    use kuryr_tests::services::ServiceProcess;
    let kube = kuryr_tests::kube::KubeEnv::start().await.unwrap();
    kube.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: kuryr-system\n").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let alloc = ScriptedAllocator::new(true);
    let server = alloc.serve_unix(&dir.path().join("alloc.sock")).await.unwrap();
    let addr = format!("127.0.0.1:{}", kuryr_tests::util::free_port().unwrap());
    let args: Vec<String> = [
        "--listen",
        &format!("unix:{}", dir.path().join("binder.sock").display()),
        "--tcp-listen",
        &addr,
        "--metrics-listen",
        "127.0.0.1:0",
        "--allocator",
        &server.target,
        "--node-name",
        "node-tcp",
        "--state-dir",
        &dir.path().join("state").display().to_string(),
        // The API server checks the callers' tokens (TokenReview) for the binder.
        "--kubeconfig",
        &kube.kubeconfig_path().display().to_string(),
        "--cni-tcp-accounts",
        "kuryr-system:cni-tool",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    // Declared before the binder, so dropped after it is killed.
    let _table = kuryr_tests::binder::HostTable::claim().unwrap();
    let binder = ServiceProcess::spawn("kuryr-binder", &args, dir.path()).unwrap();
    // Health stays open over TCP.
    wait_until("the binder's TCP listener", Duration::from_secs(30), || async {
        kuryr_runtime::client::check_serving(kuryr_runtime::client::channel(&addr)?, "kuryr.binder.v1.Cni").await
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", binder.logs()));
    let version = || VersionRequest { shim_version: env!("CARGO_PKG_VERSION").into() };
    let call = async |token: Option<&str>| {
        let channel = match token {
            Some(t) => kuryr_tests::auth::channel(&addr, t).unwrap(),
            None => kuryr_runtime::auth::client::with_credentials(
                kuryr_runtime::client::channel(&addr).unwrap(),
                kuryr_runtime::auth::client::Credentials::None,
            ),
        };
        CniClient::new(channel).version(version()).await.map(|r| r.into_inner())
    };
    let e = call(None).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    let other = kube.kuryr_token("kuryr-system", "other", None).await.unwrap();
    let e = call(Some(&other)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    let allowed = kube.kuryr_token("kuryr-system", "cni-tool", None).await.unwrap();
    let v = call(Some(&allowed)).await.unwrap_or_else(|e| panic!("{e}\n{}", binder.logs()));
    assert_eq!(v.binder_version, env!("CARGO_PKG_VERSION"));
}
