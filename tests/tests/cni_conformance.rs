//! CNI conformance of `kuryr-cni` + `kuryr-binder`, executed as a runtime executes plugins: every
//! operation for each cniVersion, and bad input of every kind, each answered with the spec's code,
//! a message naming the problem, a non-zero exit, and nothing left behind.
#![allow(clippy::unwrap_used)]

use kuryr_tests::binder::Binder;
use kuryr_tests::netns::Netns;
use kuryr_tests::shim::{ShimOutput, run_shim};
use kuryr_tests::vifserver::{ScriptedAllocator, bridge_vif};
use serde_json::Value;

struct Env {
    _alloc_server: kuryr_tests::vifserver::ScriptedServer,
    alloc: ScriptedAllocator,
    node: Netns,
    binder: Binder,
    _dir: tempfile::TempDir,
}

async fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let alloc = ScriptedAllocator::new(true);
    let server = alloc.serve_unix(&dir.path().join("alloc.sock")).await.unwrap();
    let node = Netns::new("kcn").unwrap();
    let binder = Binder::start("node-c", &node.path(), &server.target, &["--vif-wait-timeout".into(), "3s".into()])
        .await
        .unwrap();
    Env { _alloc_server: server, alloc, node, binder, _dir: dir }
}

fn host_veths(node: &Netns) -> Vec<String> {
    node.links().into_iter().filter(|l| l.starts_with("kv")).collect()
}

fn cni_args(name: &str, uid: &str) -> String {
    format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID=x;K8S_POD_UID={uid}"
    )
}

/// Asserts a CNI error: non-zero exit, the error object alone on stdout, the code, and a message
/// containing `names`.
fn assert_error(out: &ShimOutput, code: u64, names: &str, what: &str) {
    assert_ne!(out.code, 0, "{what}: exit 0; stdout {}", out.stdout);
    let v = out.json().unwrap_or_else(|e| panic!("{what}: {e:#}; stderr {}", out.stderr));
    assert_eq!(v["code"].as_u64(), Some(code), "{what}: {v}");
    let msg = format!("{} {}", v["msg"].as_str().unwrap_or_default(), v["details"].as_str().unwrap_or_default());
    assert!(msg.contains(names), "{what}: message does not name `{names}`: {v}");
    assert!(v["cniVersion"].is_string(), "{what}: no cniVersion in {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_in_every_cni_version() {
    let e = env().await;
    let o = std::process::id() % 200 + 20;
    for (i, ver) in ["0.3.1", "0.4.0", "1.0.0", "1.1.0"].iter().enumerate() {
        let pod = Netns::new("kcp").unwrap();
        let uid = format!("uid-conf-{i}-{}", std::process::id());
        let name = format!("conf{i}");
        let vif = bridge_vif(
            "node-c",
            "default",
            &name,
            &uid,
            (&format!("10.79.{o}.{}/24", 10 + i), &format!("10.79.{o}.1")),
            None,
            "kuryr0",
        );
        e.alloc.upsert(vif.clone());
        let cid = format!("ctr-{i}-{}", std::process::id());
        let netns = pod.path().display().to_string();
        let args = cni_args(&name, &uid);
        let conf = e.binder.netconf(ver, "kuryr");
        let env_for = |cmd: &'static str| {
            vec![
                ("CNI_COMMAND", cmd),
                ("CNI_CONTAINERID", cid.as_str()),
                ("CNI_NETNS", netns.as_str()),
                ("CNI_IFNAME", "eth0"),
                ("CNI_PATH", "/usr/lib/cni"),
                ("CNI_ARGS", args.as_str()),
            ]
        };

        // ADD: the result in the layout of the requested version.
        let out = run_shim(&env_for("ADD"), conf.to_string().as_bytes()).unwrap();
        assert_eq!(out.code, 0, "{ver} ADD: {}\n{}\n{}", out.stdout, out.stderr, e.binder.logs());
        let res = out.json().unwrap();
        assert_eq!(res["cniVersion"], *ver, "{res}");
        assert_eq!(res["ips"][0]["address"], vif.ips[0].address, "{res}");
        assert_eq!(res["ips"][0]["gateway"], vif.ips[0].gateway, "{res}");
        let legacy = ver.starts_with("0.");
        assert_eq!(res["ips"][0].get("version").is_some(), legacy, "{ver}: ips[].version: {res}");
        if legacy {
            assert_eq!(res["ips"][0]["version"], "4", "{res}");
        }
        let pod_if = res["interfaces"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["sandbox"] == netns)
            .cloned()
            .unwrap_or_else(|| panic!("{res}"));
        assert_eq!(pod_if["name"], "eth0");
        assert_eq!(pod_if["mac"], vif.mac);
        let idx = res["ips"][0]["interface"].as_u64().unwrap() as usize;
        assert_eq!(res["interfaces"][idx]["sandbox"], netns, "ips[0].interface points at the pod end: {res}");
        assert!(res["routes"].as_array().unwrap().iter().any(|r| r["dst"] == "0.0.0.0/0"), "{res}");
        if *ver == "1.1.0" {
            assert_eq!(pod_if["mtu"], 1400, "1.1.0 reports the MTU: {res}");
        }
        assert_eq!(host_veths(&e.node).len(), 1);

        // CHECK (from 0.4.0): passes with the prevResult; fails naming a removed route.
        let mut with_prev = conf.clone();
        with_prev["prevResult"] = res.clone();
        let out = run_shim(&env_for("CHECK"), with_prev.to_string().as_bytes()).unwrap();
        if legacy && *ver == "0.3.1" {
            assert_error(&out, 1, "0.4.0", "CHECK with cniVersion 0.3.1");
        } else {
            assert_eq!(out.code, 0, "{ver} CHECK: {}\n{}", out.stdout, e.binder.logs());
            assert!(out.stdout.trim().is_empty(), "CHECK prints nothing on success: {}", out.stdout);
            pod.exec(&["ip", "route", "del", "198.18.0.0/15"]).unwrap();
            let out = run_shim(&env_for("CHECK"), with_prev.to_string().as_bytes()).unwrap();
            assert_error(&out, 100, "198.18.0.0/15", &format!("{ver} CHECK after route deletion"));
        }

        // STATUS and GC are 1.1.0 operations.
        if *ver == "1.1.0" {
            let status_env = [("CNI_COMMAND", "STATUS"), ("CNI_PATH", "/usr/lib/cni")];
            let out = run_shim(&status_env, conf.to_string().as_bytes()).unwrap();
            assert_eq!(out.code, 0, "STATUS: {}", out.stdout);
            let mut gc = conf.clone();
            gc["cni.dev/valid-attachments"] = serde_json::json!([{ "containerID": cid, "ifname": "eth0" }]);
            let gc_env = [("CNI_COMMAND", "GC"), ("CNI_PATH", "/usr/lib/cni")];
            let out = run_shim(&gc_env, gc.to_string().as_bytes()).unwrap();
            assert_eq!(out.code, 0, "GC: {}", out.stdout);
            assert_eq!(host_veths(&e.node).len(), 1, "GC kept the valid attachment");
        }

        // VERSION is answered by the shim.
        let out = run_shim(&[("CNI_COMMAND", "VERSION")], conf.to_string().as_bytes()).unwrap();
        assert_eq!(out.code, 0);
        let v: Value = out.json().unwrap();
        for s in ["0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
            assert!(v["supportedVersions"].as_array().unwrap().iter().any(|x| x == s), "{v}");
        }

        // DEL, twice, and once more without a netns: always success, nothing left.
        for env_netns in [netns.as_str(), netns.as_str(), ""] {
            let mut env = env_for("DEL");
            env[2].1 = env_netns;
            let out = run_shim(&env, conf.to_string().as_bytes()).unwrap();
            assert_eq!(out.code, 0, "{ver} DEL: {}", out.stdout);
        }
        assert!(host_veths(&e.node).is_empty(), "{:?}", host_veths(&e.node));
        assert!(!pod.links().iter().any(|l| l == "eth0"));
        assert_eq!(e.binder.attachment_records(), 0);
    }

    // GC removes what is not listed as valid.
    let pod = Netns::new("kcp").unwrap();
    let uid = format!("uid-gc-{}", std::process::id());
    e.alloc.upsert(bridge_vif(
        "node-c",
        "default",
        "gc",
        &uid,
        (&format!("10.79.{o}.50/24"), &format!("10.79.{o}.1")),
        None,
        "kuryr0",
    ));
    let netns = pod.path().display().to_string();
    let args = cni_args("gc", &uid);
    let conf = e.binder.netconf("1.1.0", "kuryr");
    let env = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "ctr-gc"),
        ("CNI_NETNS", netns.as_str()),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/usr/lib/cni"),
        ("CNI_ARGS", args.as_str()),
    ];
    assert_eq!(run_shim(&env, conf.to_string().as_bytes()).unwrap().code, 0);
    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = serde_json::json!([]);
    let out = run_shim(&[("CNI_COMMAND", "GC"), ("CNI_PATH", "/usr/lib/cni")], gc.to_string().as_bytes()).unwrap();
    assert_eq!(out.code, 0, "GC: {}", out.stdout);
    assert!(host_veths(&e.node).is_empty(), "GC left {:?}", host_veths(&e.node));
    assert_eq!(e.binder.attachment_records(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_specs_code_and_leaves_nothing() {
    let e = env().await;
    let pod = Netns::new("kcp").unwrap();
    let uid = format!("uid-bad-{}", std::process::id());
    let o = std::process::id() % 200 + 20;
    e.alloc.upsert(bridge_vif(
        "node-c",
        "default",
        "bad",
        &uid,
        (&format!("10.80.{o}.10/24"), &format!("10.80.{o}.1")),
        None,
        "kuryr0",
    ));
    let netns = pod.path().display().to_string();
    let args = cni_args("bad", &uid);
    let conf = e.binder.netconf("1.0.0", "kuryr").to_string();
    let full: Vec<(&str, &str)> = vec![
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "ctr-bad"),
        ("CNI_NETNS", netns.as_str()),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/usr/lib/cni"),
        ("CNI_ARGS", args.as_str()),
    ];
    let check_clean = |what: &str| {
        assert!(host_veths(&e.node).is_empty(), "{what}: host veths left: {:?}", host_veths(&e.node));
        assert_eq!(e.binder.attachment_records(), 0, "{what}: records left");
    };

    // CNI_PATH is optional for ADD in CNI 1.1 (required only for GC).
    for missing in ["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"] {
        let env: Vec<_> = full.iter().copied().filter(|(k, _)| *k != missing).collect();
        let out = run_shim(&env, conf.as_bytes()).unwrap();
        assert_error(&out, 4, missing, &format!("without {missing}"));
        check_clean(missing);
    }
    let out = run_shim(&full, b"{ this is not json").unwrap();
    assert_error(&out, 6, "", "unparsable stdin");
    check_clean("unparsable stdin");

    let bad_version = conf.replace("\"1.0.0\"", "\"9.9.9\"");
    let out = run_shim(&full, bad_version.as_bytes()).unwrap();
    assert_error(&out, 1, "9.9.9", "unsupported cniVersion");
    check_clean("unsupported cniVersion");

    let mut env = full.clone();
    env[2].1 = "/var/run/netns/kuryr-no-such-netns";
    let out = run_shim(&env, conf.as_bytes()).unwrap();
    assert_error(&out, 4, "kuryr-no-such-netns", "missing netns");
    check_clean("missing netns");

    pod.exec(&["ip", "link", "add", "eth0", "type", "veth", "peer", "name", "squat0"]).unwrap();
    let out = run_shim(&full, conf.as_bytes()).unwrap();
    assert_error(&out, 4, "eth0", "interface already present");
    check_clean("interface already present");
    pod.exec(&["ip", "link", "del", "eth0"]).unwrap();

    let mut big: Value = serde_json::from_str(&conf).unwrap();
    big["padding"] = Value::String("x".repeat(2 << 20));
    let out = run_shim(&full, big.to_string().as_bytes()).unwrap();
    assert_error(&out, 7, "oversized", "oversized config");
    check_clean("oversized config");

    // After all that, a good ADD still works and DEL cleans it.
    let out = run_shim(&full, conf.as_bytes()).unwrap();
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, e.binder.logs());
    let mut del = full.clone();
    del[0].1 = "DEL";
    assert_eq!(run_shim(&del, conf.as_bytes()).unwrap().code, 0);
    check_clean("final DEL");
}
