//! The binder writes the runtime's CNI configuration itself, and only once it can serve ADDs: no
//! conflist while the allocator is unreachable, a conflist naming `kuryr-cni` and the binder's
//! socket as soon as the VIF stream is live — and that conflist works with libcni's cnitool.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kuryr_tests::netns::Netns;
use kuryr_tests::services::{ServiceProcess, wait_until};
use kuryr_tests::vifserver::ScriptedAllocator;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflist_is_written_only_once_the_binder_can_serve() {
    let dir = tempfile::tempdir().unwrap();
    let node = Netns::new("kcf").unwrap();
    let alloc_sock = dir.path().join("alloc.sock");
    let binder_sock = dir.path().join("binder.sock");
    let conflist = dir.path().join("net.d").join("10-kuryr.conflist");
    let args: Vec<String> = [
        "--listen",
        &format!("unix:{}", binder_sock.display()),
        "--metrics-listen",
        "127.0.0.1:9631",
        "--allocator",
        &format!("unix:{}", alloc_sock.display()),
        "--node-name",
        "node-c",
        "--state-dir",
        &dir.path().join("state").display().to_string(),
        "--cni-conflist",
        &conflist.display().to_string(),
        // As for a runtime whose libcni speaks 1.1.0 (the default, 1.0.0, is for containerd
        // 1.6/1.7): STATUS, checked below with the written file, exists from 1.1.0 on.
        "--cni-conflist-version",
        "1.1.0",
        "--shutdown-grace",
        "2s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let proc = ServiceProcess::spawn_in_netns("kuryr-binder", &args, dir.path(), Some(&node.path())).unwrap();

    // The allocator is not there: the binder serves health but not CNI, and writes nothing.
    wait_until("the binder's socket", Duration::from_secs(20), || async {
        anyhow::ensure!(binder_sock.exists(), "no socket yet");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", proc.logs()));
    // The later event: the binder tried the allocator and found it down (its follower says so once).
    wait_until("the binder's failed attempt at the allocator", Duration::from_secs(20), || async {
        anyhow::ensure!(proc.logs().contains("unavailable; reconnecting with backoff"), "no failed attempt logged yet");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", proc.logs()));
    assert!(!conflist.exists(), "conflist written before the VIF stream was live\n{}", proc.logs());
    assert!(
        !conflist.parent().unwrap().exists() || std::fs::read_dir(conflist.parent().unwrap()).unwrap().count() == 0
    );

    // The allocator comes up: the stream turns live and the conflist appears, complete.
    let alloc = ScriptedAllocator::new(true);
    let _server = alloc.serve_unix(&alloc_sock).await.unwrap();
    wait_until("the conflist", Duration::from_secs(30), || async {
        anyhow::ensure!(conflist.exists(), "not yet");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", proc.logs()));
    let conf: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&conflist).unwrap()).unwrap();
    assert_eq!(conf["name"], "kuryr");
    assert_eq!(conf["cniVersion"], "1.1.0");
    assert_eq!(conf["plugins"][0]["type"], "kuryr-cni");
    assert_eq!(conf["plugins"][0]["binderSocket"], binder_sock.display().to_string());
    // The runtime passes pods' host ports only to plugins declaring the capability.
    assert_eq!(conf["plugins"][0]["capabilities"], serde_json::json!({"portMappings": true}));
    let entries: Vec<_> =
        std::fs::read_dir(conflist.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(entries.len(), 1, "temporary files left: {entries:?}");

    // The runtime's view: STATUS through the real shim with exactly this file answers success.
    let shim = kuryr_tests::services::bin_path("kuryr-cni").unwrap();
    let plugin = serde_json::json!({
        "cniVersion": conf["cniVersion"],
        "name": conf["name"],
        "type": "kuryr-cni",
        "binderSocket": conf["plugins"][0]["binderSocket"],
    });
    let out = tokio::task::spawn_blocking(move || {
        use std::io::Write as _;
        let mut child = std::process::Command::new(&shim)
            .env("CNI_COMMAND", "STATUS")
            .env("CNI_PATH", shim.parent().unwrap())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(plugin.to_string().as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "STATUS with the written configuration: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        proc.logs()
    );
    drop(proc);
}
