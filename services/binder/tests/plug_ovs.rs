//! The OVS binding against a real Open vSwitch: a private ovsdb-server and ovs-vswitchd with the
//! userspace (netdev) datapath, `br-int`, two pods plugged into it that ping each other.
//!
//! The whole scenario runs inside a private "node" network namespace (entered with the binder's
//! own `run_in_netns`): ovs-vswitchd, its datapath's tap devices, `br-int` and the veth host ends
//! all live there, so concurrent runs and the real host never see each other's names. Needs
//! root and Open vSwitch (`make setup` installs it); without either it fails, naming what is missing.

mod common;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ipnet::IpNet;
use kuryr_binder::netns::{NetnsError, run_in_netns};
use kuryr_binder::plug::{self, BindingDriver, IpConfig, PlugError, PlugSpec};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const SCHEMA: &str = "/usr/share/openvswitch/vswitch.ovsschema";

/// Where a program is, looking at PATH and the sbin directories.
fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// A private ovsdb-server + ovs-vswitchd, stopped (bridges deleted, datapath removed, daemons
/// ended by pid) on drop. Must be started and dropped in the node namespace.
struct Ovs {
    dir: tempfile::TempDir,
    ovsdb_server: Child,
    vswitchd: Option<Child>,
    bridges: Vec<String>,
}

impl Ovs {
    fn rundir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    /// The `--db` value for this instance.
    fn db(&self) -> String {
        format!("unix:{}", self.rundir().join("db.sock").display())
    }

    /// A command with this instance's OVS_* directories in its environment (never in ours).
    fn command(&self, program: &str) -> Command {
        ovs_command(self.dir.path(), program)
    }

    fn vsctl(&self, args: &[&str]) -> (bool, String) {
        let db = format!("--db={}", self.db());
        run_cmd(self.command("ovs-vsctl").arg(db).arg("--timeout=10").args(args))
    }

    fn vsctl_ok(&self, args: &[&str]) -> String {
        let (success, text) = self.vsctl(args);
        assert!(success, "ovs-vsctl {} failed: {text}", args.join(" "));
        text
    }

    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        for d in ["run", "db", "log", "etc"] {
            std::fs::create_dir(dir.path().join(d)).expect("mkdir");
        }
        let db_file = dir.path().join("db/conf.db");
        let (created, out) = run_cmd(ovs_command(dir.path(), "ovsdb-tool").arg("create").arg(&db_file).arg(SCHEMA));
        assert!(created, "ovsdb-tool create: {out}");
        let run_dir = dir.path().join("run");
        let ovsdb_server = ovs_command(dir.path(), "ovsdb-server")
            .arg(&db_file)
            .arg(format!("--remote=punix:{}", run_dir.join("db.sock").display()))
            .arg(format!("--pidfile={}", run_dir.join("ovsdb-server.pid").display()))
            .arg(format!("--log-file={}", dir.path().join("log/ovsdb-server.log").display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start ovsdb-server");
        let mut ovs = Ovs { dir, ovsdb_server, vswitchd: None, bridges: Vec::new() };
        wait_for(&run_dir.join("db.sock"), "ovsdb-server's socket");
        ovs.vsctl_ok(&["--no-wait", "init"]);
        let vswitchd = ovs
            .command("ovs-vswitchd")
            .arg(ovs.db())
            .arg(format!("--pidfile={}", run_dir.join("ovs-vswitchd.pid").display()))
            .arg(format!("--log-file={}", ovs.dir.path().join("log/ovs-vswitchd.log").display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start ovs-vswitchd");
        ovs.vswitchd = Some(vswitchd);
        wait_for(&run_dir.join("ovs-vswitchd.pid"), "ovs-vswitchd's pidfile");
        ovs
    }

    /// Adds a userspace-datapath bridge; ovs-vsctl waits until ovs-vswitchd has made it.
    fn add_bridge(&mut self, name: &str) {
        self.bridges.push(name.to_string());
        self.vsctl_ok(&["add-br", name, "--", "set", "Bridge", name, "datapath_type=netdev"]);
    }

    /// A column of an Interface's `external_ids`, unquoted.
    fn external_id(&self, iface: &str, key: &str) -> String {
        let v = self.vsctl_ok(&["get", "Interface", iface, &format!("external_ids:{key}")]);
        v.trim().trim_matches('"').to_string()
    }

    fn ports(&self, bridge: &str) -> Vec<String> {
        self.vsctl_ok(&["list-ports", bridge]).lines().map(str::to_string).collect()
    }

    /// `ovs-appctl -t <daemon>`; the daemon's pidfile is found through OVS_RUNDIR.
    fn appctl(&self, daemon: &str, args: &[&str]) -> (bool, String) {
        run_cmd(self.command("ovs-appctl").arg("-t").arg(daemon).args(args))
    }
}

impl Drop for Ovs {
    fn drop(&mut self) {
        for b in &self.bridges {
            let _ = self.vsctl(&["--if-exists", "del-br", b]);
        }
        // Without this the netdev datapath's tap devices outlive ovs-vswitchd.
        let _ = self.appctl("ovs-vswitchd", &["dpctl/del-dp", "netdev@ovs-netdev"]);
        let _ = self.appctl("ovs-vswitchd", &["exit"]);
        if let Some(mut v) = self.vswitchd.take() {
            stop(&mut v, Duration::from_secs(5));
        }
        let _ = self.appctl("ovsdb-server", &["exit"]);
        stop(&mut self.ovsdb_server, Duration::from_secs(5));
    }
}

fn ovs_command(dir: &Path, program: &str) -> Command {
    let mut c = Command::new(find(program).unwrap_or_else(|| PathBuf::from(program)));
    c.env("OVS_RUNDIR", dir.join("run"))
        .env("OVS_DBDIR", dir.join("db"))
        .env("OVS_LOGDIR", dir.join("log"))
        .env("OVS_SYSCONFDIR", dir.join("etc"));
    c
}

/// Ends a daemon we started: waits `grace` for it to exit on its own, then SIGKILL by its pid.
fn stop(child: &mut Child, grace: Duration) {
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn wait_for(path: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !path.exists() {
        assert!(Instant::now() < deadline, "timed out waiting for {what} ({})", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn spec(pod: &Netns, n: u8, db_bridge: &str) -> PlugSpec {
    let container_id = format!("{}-ovs", pod.name);
    let pid = std::process::id();
    let net = |s: String| s.parse::<IpNet>().expect("a CIDR");
    let ip = |s: String| s.parse::<IpAddr>().expect("an IP address");
    PlugSpec {
        host_ifname: plug::host_ifname(&container_id, "eth0"),
        container_id,
        netns: pod.path(),
        ifname: "eth0".into(),
        mac: format!("fa:16:3e:{:02x}:00:{n:02x}", pid % 256),
        mtu: 1450,
        ips: vec![
            IpConfig { address: net(format!("10.77.0.{n}/24")), gateway: Some(ip("10.77.0.1".into())) },
            IpConfig { address: net(format!("fd00:77::{n:x}/64")), gateway: Some(ip("fd00:77::1".into())) },
        ],
        routes: vec![],
        driver: BindingDriver::Ovs {
            bridge: db_bridge.into(),
            iface_id: format!("port-{n}"),
            attached_mac: format!("fa:16:3e:{:02x}:00:{n:02x}", pid % 256),
            vm_uuid: format!("pod-uid-{n}"),
            vlan: None,
        },
    }
}

/// Runs inside the node namespace, on the thread `run_in_netns` made for it.
async fn scenario() {
    let mut ovs = Ovs::start();
    ovs.add_bridge("br-int");
    let db = ovs.db();
    let db = Some(db.as_str());
    let (a, b, c) = (Netns::new("kt-"), Netns::new("kt-"), Netns::new("kt-"));
    let (spec_a, spec_b) = (spec(&a, 10, "br-int"), spec(&b, 11, "br-int"));

    let plugged_a = plug::plug(&spec_a, db).await.expect("plug pod a");
    let plugged_b = plug::plug(&spec_b, db).await.expect("plug pod b");
    assert_eq!((plugged_a.sandbox_mac.as_str(), plugged_b.mtu), (spec_a.mac.as_str(), 1450));

    let ports = ovs.ports("br-int");
    assert!(ports.contains(&spec_a.host_ifname) && ports.contains(&spec_b.host_ifname), "{ports:?}");
    let h = &spec_a.host_ifname;
    assert_eq!(ovs.external_id(h, "iface-id"), "port-10");
    assert_eq!(ovs.external_id(h, "attached-mac"), spec_a.mac);
    assert_eq!(ovs.external_id(h, "iface-status"), "active");
    assert_eq!(ovs.external_id(h, "vm-uuid"), "pod-uid-10");
    let ofport = ovs.vsctl_ok(&["get", "Interface", h, "ofport"]);
    assert!(ofport.trim().parse::<i32>().is_ok_and(|p| p > 0), "ovs-vswitchd did not open {h}: ofport {ofport}");
    let host = ok("ip", &["link", "show", "dev", h]);
    assert!(host.contains("mtu 1450") && host.contains("state UP"), "{host}");
    let observed = plug::inspect(a.path(), "eth0").await.expect("inspect pod a");
    assert_eq!(plug::diff(&spec_a, &observed), Vec::<String>::new());

    // Through the userspace datapath, both families.
    let (pinged, out) = a.ping(&["10.77.0.11"]);
    assert!(pinged, "IPv4 ping a -> b through br-int failed: {out}");
    let (pinged, out) = b.ping(&["-6", "fd00:77::a"]);
    assert!(pinged, "IPv6 ping b -> a through br-int failed: {out}");

    // A failing ovs-vsctl (no such bridge) is the last step of plug: everything is rolled back.
    let spec_c = spec(&c, 12, "br-missing");
    let err = plug::plug(&spec_c, db).await.expect_err("plug onto a missing bridge");
    assert!(matches!(&err, PlugError::Ovs { args, .. } if args.contains("br-missing")), "{err:?}");
    assert!(!run("ip", &["link", "show", "dev", &spec_c.host_ifname]).0, "rollback left the host end");
    assert!(!c.exec(&["ip", "link", "show", "dev", "eth0"]).0, "rollback left the pod end");
    assert!(!ovs.vsctl_ok(&["list", "Interface"]).contains(&spec_c.host_ifname), "rollback left the OVS row");

    // DEL removes the port and the pair; again is fine.
    for _ in 0..2 {
        plug::unplug(Some(a.path()), "eth0", &spec_a.host_ifname, &spec_a.driver, db).await.expect("unplug pod a");
    }
    assert!(!ovs.ports("br-int").contains(&spec_a.host_ifname));
    assert!(!run("ip", &["link", "show", "dev", &spec_a.host_ifname]).0);
    // With the pod's namespace already gone.
    let b_path = b.path();
    drop(b);
    plug::unplug(Some(b_path), "eth0", &spec_b.host_ifname, &spec_b.driver, db)
        .await
        .expect("unplug pod b, netns gone");
    assert_eq!(ovs.ports("br-int"), Vec::<String>::new());

    drop(ovs);
    let taps = ok("ip", &["-o", "link", "show", "type", "tun"]);
    assert!(taps.trim().is_empty(), "tap devices left behind after stopping OVS: {taps}");
}

#[tokio::test]
async fn two_pods_on_br_int_talk_through_userspace_ovs() {
    assert!(is_root(), "prerequisite missing: this test needs root for network namespaces");
    let missing: Vec<_> = ["ovs-vswitchd", "ovsdb-server", "ovsdb-tool", "ovs-vsctl", "ovs-appctl"]
        .into_iter()
        .filter(|p| find(p).is_none())
        .collect();
    assert!(
        missing.is_empty() && Path::new(SCHEMA).exists(),
        "prerequisite missing: Open vSwitch is not installed (missing {missing:?} or {SCHEMA}); `make setup` installs it"
    );
    let node = Netns::new("kt-node-");
    run_in_netns::<_, _, BoxError>(Some(node.path()), || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(scenario());
        Ok(())
    })
    .await
    .unwrap_or_else(|e| match e.downcast_ref::<NetnsError>() {
        Some(NetnsError::ThreadDied) => panic!("the scenario failed (its panic message is above)"),
        _ => panic!("{e}"),
    });
}
