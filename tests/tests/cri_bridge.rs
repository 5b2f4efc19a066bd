//! containerd + CRI + the reference `bridge`/`host-local` CNI plugins: the baseline the Kuryr CNI
//! path is compared against, and the proof that the CRI test environment works.
//!
//! Two pod sandboxes are run through CRI exactly as kubelet runs them; each must get an address
//! from the test's subnet (read back through PodSandboxStatus), reach the other over the bridge,
//! and be gone after StopPodSandbox + RemovePodSandbox, network namespace included.
//!
//! Needs root, containerd, runc and /usr/lib/cni (see /work/shared/RECIPES.md).
#![allow(clippy::unwrap_used)]

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::time::{Duration, Instant};

use kuryr_tests::cri::{Containerd, ContainerdOptions};

const REFERENCE_CNI: &str = "/usr/lib/cni";

/// A /24 in 10.244.0.0/16 per test process and test. The bridge lives in containerd's private
/// network namespace, so concurrent runs could even share one; distinct ones make mix-ups visible.
fn subnet_octet(test: u32) -> u8 {
    u8::try_from((std::process::id() * 2 + test) % 250).unwrap() + 1
}

/// A containerd whose CRI uses the reference bridge plugin on 10.244.`octet`.0/24.
async fn containerd_with_bridge(octet: u8) -> Containerd {
    let t = Instant::now();
    let ctd = Containerd::start(ContainerdOptions::default()).await.unwrap();
    let timings = ctd.timings();
    eprintln!(
        "containerd up in {:?} (ready {:?}, image import {:?}, CRI ready {:?}); netns {}",
        t.elapsed(),
        timings.containerd_ready,
        timings.image_import,
        timings.cri_ready,
        ctd.netns()
    );
    write_bridge_conflist(&ctd, octet);
    ctd.cri().wait_network_ready().await.unwrap();
    ctd
}

fn write_bridge_conflist(ctd: &Containerd, octet: u8) {
    for plugin in ["bridge", "host-local"] {
        std::os::unix::fs::symlink(Path::new(REFERENCE_CNI).join(plugin), ctd.cni_bin_dir().join(plugin)).unwrap();
    }
    // host-local keeps its leases in a private dataDir, not the host's /var/lib/cni/networks.
    let ipam_dir = ctd.scratch_dir().join("ipam");
    let conflist = serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "kuryr-test-bridge",
        "plugins": [{
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": true,
            "ipMasq": false,
            "hairpinMode": true,
            "ipam": {
                "type": "host-local",
                "ranges": [[{ "subnet": format!("10.244.{octet}.0/24") }]],
                "routes": [{ "dst": "0.0.0.0/0" }],
                "dataDir": ipam_dir,
            }
        }]
    });
    std::fs::write(ctd.cni_conf_dir().join("10-bridge.conflist"), serde_json::to_vec_pretty(&conflist).unwrap())
        .unwrap();
}

fn in_subnet(ip: IpAddr, octet: u8) -> bool {
    matches!(ip, IpAddr::V4(v4) if v4.octets()[..3] == [10, 244, octet])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_pods_get_addresses_reach_each_other_and_go_away() {
    let octet = subnet_octet(0);
    let ctd = containerd_with_bridge(octet).await;
    let cri = ctd.cri();
    let tags = cri.list_image_tags().await.unwrap();
    assert!(tags.iter().any(|t| t == "localhost/kuryr/pause:1"), "images: {tags:?}");

    // --- first pod ----------------------------------------------------------------------------
    let t = Instant::now();
    let a = cri.run_pod_sandbox("pod-a", "default", "00000000-0000-0000-0000-00000000000a").await.unwrap();
    eprintln!("RunPodSandbox (bridge) took {:?}", t.elapsed());
    let a_status = cri.pod_sandbox_status(&a).await.unwrap();
    assert!(a_status.ready, "sandbox a not ready: {a_status:?}");
    assert_eq!(a_status.ips.len(), 1, "sandbox a IPs: {:?}", a_status.ips);
    let a_ip = a_status.ips[0];
    assert!(in_subnet(a_ip, octet), "{a_ip} not in 10.244.{octet}.0/24");
    let a_netns = a_status.netns_path.clone().expect("sandbox a netns path");
    assert!(a_netns.exists(), "{} missing", a_netns.display());
    // eth0 inside the sandbox carries exactly the address CRI reported.
    let out = cri
        .exec_in_sandbox_netns(&a, &["ip", "-4", "-o", "addr", "show", "dev", "eth0"], Duration::from_secs(10))
        .await
        .unwrap();
    let addrs = String::from_utf8_lossy(&out.stdout);
    assert!(addrs.contains(&format!("inet {a_ip}/24")), "eth0 in sandbox a: {addrs}");

    // --- second pod, with a busybox container -------------------------------------------------
    let b = cri.run_pod_sandbox("pod-b", "default", "00000000-0000-0000-0000-00000000000b").await.unwrap();
    let b_status = cri.pod_sandbox_status(&b).await.unwrap();
    let b_ip = b_status.ips[0];
    assert!(in_subnet(b_ip, octet), "{b_ip} not in 10.244.{octet}.0/24");
    assert_ne!(a_ip, b_ip);

    // From b's network namespace (a host ping), and from inside a container of b (busybox ping
    // through CRI ExecSync), a answers.
    assert!(cri.ping_from_sandbox(&b, a_ip, 2).await.unwrap(), "{b} cannot ping {a_ip}");
    let t = Instant::now();
    let c = cri.run_busybox(&b, "pinger", &["sleep", "3600"]).await.unwrap();
    eprintln!("CreateContainer + StartContainer took {:?}", t.elapsed());
    let (code, stdout, stderr) =
        cri.exec_sync(&c, &["ping", "-c", "1", "-W", "2", &a_ip.to_string()], Duration::from_secs(10)).await.unwrap();
    assert_eq!(code, 0, "busybox ping: {stdout}{stderr}");

    // The check can fail: an address nobody holds does not answer.
    let nobody = IpAddr::V4(Ipv4Addr::new(10, 244, octet, 250));
    assert!(!cri.ping_from_sandbox(&b, nobody, 1).await.unwrap(), "{nobody} answered");

    // --- teardown through CRI -----------------------------------------------------------------
    let t = Instant::now();
    cri.remove_container(&c, 0).await.unwrap();
    for id in [&a, &b] {
        cri.stop_pod_sandbox(id).await.unwrap();
        cri.remove_pod_sandbox(id).await.unwrap();
    }
    eprintln!("container + 2 sandboxes stopped and removed in {:?}", t.elapsed());
    assert!(cri.list_pod_sandboxes().await.unwrap().is_empty());
    assert!(cri.list_container_ids().await.unwrap().is_empty());
    assert!(!a_netns.exists(), "{} outlived its sandbox", a_netns.display());
    // host-local released both leases on CNI DEL.
    let leases: Vec<_> = std::fs::read_dir(ctd.scratch_dir().join("ipam/kuryr-test-bridge"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("10.244."))
        .collect();
    assert!(leases.is_empty(), "leases left: {leases:?}");

    let netns = ctd.netns().to_string();
    let state = ctd.env()["STATE_DIR"].clone();
    let t = Instant::now();
    ctd.shutdown().await.unwrap();
    eprintln!("containerd shut down in {:?}", t.elapsed());
    assert!(!Path::new("/var/run/netns").join(&netns).exists());
    assert!(!Path::new(&state).exists());
}

/// A test that fails half-way drops its `Containerd` with pods still running: the drop must still
/// leave no process, network namespace, mount or state directory behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_containerd_with_live_pods_leaves_nothing_behind() {
    let ctd = containerd_with_bridge(subnet_octet(1)).await;
    let cri = ctd.cri();
    let pod = cri.run_pod_sandbox("pod-left", "default", "00000000-0000-0000-0000-0000000000ff").await.unwrap();
    cri.run_busybox(&pod, "sleeper", &["sleep", "3600"]).await.unwrap();
    let pod_netns = cri.pod_sandbox_status(&pod).await.unwrap().netns_path.unwrap();
    let netns = ctd.netns().to_string();
    let state = ctd.env()["STATE_DIR"].clone();
    let address = ctd.address().to_string_lossy().into_owned();
    assert!(pod_netns.exists());

    let t = Instant::now();
    drop(ctd);
    eprintln!("drop with a live pod took {:?}", t.elapsed());

    assert!(!pod_netns.exists(), "{} left", pod_netns.display());
    assert!(!Path::new("/var/run/netns").join(&netns).exists(), "{netns} left");
    // KURYR_KEEP_STATE=1 keeps the state directory on purpose (and unmounted).
    if std::env::var_os("KURYR_KEEP_STATE").is_none_or(|v| v != "1") {
        assert!(!Path::new(&state).exists(), "{state} left");
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&state), "mounts left under {state}");
    for entry in std::fs::read_dir("/proc").unwrap() {
        let path = entry.unwrap().path().join("cmdline");
        let Ok(cmdline) = std::fs::read(&path) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        assert!(!cmdline.contains(&address), "process left: {cmdline}");
    }
}
