//! `cnitool` (libcni's own driver: conflist, result cache, prevResult, CHECK) driving `kuryr-cni`
//! and the binder: add, check, a deleted route caught by check, del (twice), status, gc.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use kuryr_tests::binder::Binder;
use kuryr_tests::netns::Netns;
use kuryr_tests::services::{bin_path, tool_path};
use kuryr_tests::vifserver::{ScriptedAllocator, bridge_vif};

fn cnitool(op: &str, conf_dir: &std::path::Path, bin_dir: &std::path::Path, netns: &str, args: &str) -> (bool, String) {
    let out = Command::new(tool_path("cnitool").unwrap())
        .args([op, "kuryr", netns])
        .env("NETCONFPATH", conf_dir)
        .env("CNI_PATH", bin_dir)
        .env("CNI_ARGS", args)
        .env("CNI_IFNAME", "eth0")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cnitool_add_check_del() {
    let dir = tempfile::tempdir().unwrap();
    let alloc = ScriptedAllocator::new(true);
    let server = alloc.serve_unix(&dir.path().join("alloc.sock")).await.unwrap();
    let node = Netns::new("ktn").unwrap();
    let binder = Binder::start("node-t", &node.path(), &server.target, &[]).await.unwrap();
    let bin_dir = dir.path().join("bin");
    let conf_dir = dir.path().join("conf");
    std::fs::create_dir_all(&bin_dir).unwrap();
    std::fs::create_dir_all(&conf_dir).unwrap();
    std::os::unix::fs::symlink(bin_path("kuryr-cni").unwrap(), bin_dir.join("kuryr-cni")).unwrap();
    let mut plugin = binder.netconf("1.1.0", "kuryr");
    plugin.as_object_mut().unwrap().remove("cniVersion");
    plugin.as_object_mut().unwrap().remove("name");
    let conflist = serde_json::json!({"cniVersion": "1.1.0", "name": "kuryr", "plugins": [plugin]});
    std::fs::write(conf_dir.join("10-kuryr.conflist"), conflist.to_string()).unwrap();

    let pod = Netns::new("ktp").unwrap();
    let uid = format!("uid-cnitool-{}", std::process::id());
    let o = std::process::id() % 200 + 20;
    let vif = bridge_vif(
        "node-t",
        "default",
        "tool",
        &uid,
        (&format!("10.81.{o}.10/24"), &format!("10.81.{o}.1")),
        None,
        "kuryr0",
    );
    alloc.upsert(vif.clone());
    let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=tool;K8S_POD_UID={uid}");
    let netns = pod.path().display().to_string();

    let (ok, out) = cnitool("add", &conf_dir, &bin_dir, &netns, &args);
    assert!(ok, "add: {out}\n{}", binder.logs());
    assert!(out.contains(&vif.ips[0].address), "add result: {out}");
    let addrs = pod.exec(&["ip", "-o", "addr", "show", "eth0"]).unwrap();
    assert!(addrs.contains(&vif.ips[0].address), "{addrs}");

    let (ok, out) = cnitool("check", &conf_dir, &bin_dir, &netns, &args);
    assert!(ok, "check: {out}\n{}", binder.logs());

    pod.exec(&["ip", "route", "del", "198.18.0.0/15"]).unwrap();
    let (ok, out) = cnitool("check", &conf_dir, &bin_dir, &netns, &args);
    assert!(!ok, "check passed with a route missing: {out}");
    assert!(out.contains("198.18.0.0/15"), "check does not name the missing route: {out}");

    let (ok, out) = cnitool("status", &conf_dir, &bin_dir, &netns, &args);
    assert!(ok, "status: {out}");

    for _ in 0..2 {
        let (ok, out) = cnitool("del", &conf_dir, &bin_dir, &netns, &args);
        assert!(ok, "del: {out}\n{}", binder.logs());
    }
    assert!(!pod.links().iter().any(|l| l == "eth0"));
    assert!(!node.links().iter().any(|l| l.starts_with("kv")), "{:?}", node.links());
    assert_eq!(binder.attachment_records(), 0);
}
