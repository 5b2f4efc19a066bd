//! The host port writer's bookkeeping, with an `nft` stand-in that records each transaction (and
//! fails when told to). `services/binder/tests/lb_nft.rs` applies the same scripts to a real
//! kernel.

use std::path::PathBuf;

use super::mapping::{PortMapping, Protocol};
use super::*;

fn mapping(host_ip: Option<&str>, port: u16, protocol: Protocol) -> PortMapping {
    PortMapping { host_port: port, container_port: 8080, protocol, host_ip: host_ip.map(|h| h.parse().unwrap()) }
}

fn att(id: &str, ips: &[&str], mappings: Vec<PortMapping>) -> Attachment {
    Attachment {
        container_id: id.into(),
        ifname: "eth0".into(),
        netns: String::new(),
        host_ifname: String::new(),
        pod_uid: String::new(),
        pod_namespace: "ns".into(),
        pod_name: id.into(),
        vif_id: String::new(),
        driver: "bridge".into(),
        bridge: "kxtest-nobr".into(),
        ips: ips.iter().map(|a| a.parse().unwrap()).collect(),
        port_mappings: mappings,
        state: crate::attachments::State::Ready,
        host_mac: String::new(),
        sandbox_mac: String::new(),
        primary: None,
        report_pending: false,
    }
}

/// An `nft` that appends each script to a log, separated, and fails while a flag file exists.
struct FakeNft {
    dir: tempfile::TempDir,
}

impl FakeNft {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "#!/bin/sh\nif [ -e {d}/fail ]; then cat >/dev/null; echo 'Error: no' >&2; exit 1; fi\ncat >> {d}/log\necho '----' >> {d}/log\n",
            d = dir.path().display()
        );
        let path = dir.path().join("nft");
        std::fs::write(&path, script).unwrap();
        std::process::Command::new("chmod").args(["+x", &path.display().to_string()]).status().unwrap();
        Self { dir }
    }

    fn nft(&self) -> Nft {
        Nft::new(self.dir.path().join("nft").display().to_string())
    }

    /// The writer under test, its sysctls in a directory of the test's.
    fn host_ports(&self) -> HostPorts {
        let sys = self.dir.path().join("sys");
        std::fs::create_dir_all(sys.join("net/ipv4/conf/kxtest-nobr")).unwrap();
        std::fs::create_dir_all(sys.join("net/ipv6/conf/all")).unwrap();
        HostPorts::with_proc_sys(self.nft(), sys)
    }

    fn sysctl(&self, key: &str) -> String {
        std::fs::read_to_string(self.dir.path().join("sys").join(key)).unwrap_or_default()
    }

    fn fail(&self, on: bool) {
        let flag: PathBuf = self.dir.path().join("fail");
        if on {
            std::fs::write(flag, "").unwrap();
        } else {
            let _ = std::fs::remove_file(flag);
        }
    }

    /// The transactions so far, and forgets them.
    fn take(&self) -> Vec<String> {
        let log = self.dir.path().join("log");
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        text.split("----\n").filter(|t| !t.is_empty()).map(str::to_string).collect()
    }
}

#[test]
fn entries_per_family_and_host_ip() {
    let ms = [
        mapping(Some("127.0.0.1"), 54321, Protocol::Tcp),
        mapping(Some("172.30.0.10"), 54321, Protocol::Udp),
        mapping(None, 8443, Protocol::Sctp),
        mapping(Some("fd00::10"), 80, Protocol::Tcp),
    ];
    let shown: Vec<String> = entries(&ms, &["10.0.0.5".parse().unwrap(), "fd00:1::5".parse().unwrap()])
        .iter()
        .map(|e| format!("{} {} : {}", e.map, e.key, e.value))
        .collect();
    assert_eq!(
        shown,
        [
            "hostports4 127.0.0.1 . tcp . 54321 : 10.0.0.5 . 8080",
            "hostports4 172.30.0.10 . udp . 54321 : 10.0.0.5 . 8080",
            "hostports_any4 sctp . 8443 : 10.0.0.5 . 8080",
            "hostports_any6 sctp . 8443 : fd00:1::5 . 8080",
            "hostports6 fd00::10 . tcp . 80 : fd00:1::5 . 8080",
        ]
    );
    assert!(entries(&ms, &[]).is_empty(), "a pod without addresses gets nothing");
    assert!(reachable_on_localhost(&ms[..1], &["10.0.0.5".parse().unwrap()]));
    assert!(reachable_on_localhost(&ms[2..3], &["10.0.0.5".parse().unwrap()]), "any address includes 127.0.0.1");
    assert!(!reachable_on_localhost(&ms[1..2], &["10.0.0.5".parse().unwrap()]));
    assert!(!reachable_on_localhost(&ms[..1], &["fd00:1::5".parse().unwrap()]));
}

#[test]
fn only_plain_interface_names_reach_the_script() {
    for ok in ["kuryr0", "br-int", "cni_0", "a.b"] {
        assert!(is_ifname(ok), "{ok}");
    }
    for bad in ["", ".", "..", "../../x", "a b", "k\" }; flush ruleset", "0123456789abcdef"] {
        assert!(!is_ifname(bad), "{bad}");
    }
    let mut a = att("a", &["10.0.0.5"], Vec::new());
    a.bridge = "x\" } ; flush ruleset ; #".into();
    assert_eq!(bridge_of(&a), None);
    a.driver = "ovs".into();
    a.bridge = "br-int".into();
    assert_eq!(bridge_of(&a), None, "pods on OVS are not on a bridge of the node's");
}

#[tokio::test]
async fn restore_rebuilds_then_changes_are_deltas_and_the_newest_claim_wins() {
    let fake = FakeNft::new();
    let hp = fake.host_ports();
    let a = att("a", &["10.0.0.5"], vec![mapping(None, 8080, Protocol::Tcp)]);
    assert_eq!(hp.restore(std::slice::from_ref(&a)).await.unwrap(), 1);
    let t = fake.take();
    assert_eq!(t.len(), 1);
    assert!(t[0].starts_with("add table inet kuryr\n"), "{}", t[0]);
    for want in [
        "flush map inet kuryr hostports_any4\n",
        "flush set inet kuryr pod_ifaces\n",
        "add element inet kuryr hostports_any4 { tcp . 8080 : 10.0.0.5 . 8080 }\n",
        "add element inet kuryr pod_ifaces { \"kxtest-nobr\" }\n",
    ] {
        assert!(t[0].contains(want), "{want:?} not in\n{}", t[0]);
    }
    assert_eq!(fake.sysctl("net/ipv4/ip_forward"), "1", "forwarded from outside");
    assert_eq!(fake.sysctl("net/ipv6/conf/all/forwarding"), "1");
    assert_eq!(fake.sysctl("net/ipv4/conf/kxtest-nobr/route_localnet"), "1", "any address includes 127.0.0.1");
    assert_eq!(fake.sysctl("net/ipv4/conf/kxtest-other/route_localnet"), "");
    // Nothing to change: no transaction at all.
    hp.set(&a).await.unwrap();
    assert!(fake.take().is_empty());
    let mut plain = att("plain", &["10.0.0.6"], Vec::new());
    hp.set(&plain).await.unwrap();
    assert!(fake.take().is_empty(), "a pod without host ports on a known bridge costs no nft run");
    plain.bridge = "kxtest-other".into();
    hp.set(&plain).await.unwrap();
    assert_eq!(fake.take(), ["add element inet kuryr pod_ifaces { \"kxtest-other\" }\n"]);

    // A second claim of the same port: the newest wins; removing it hands the port back.
    let b = att("b", &["10.0.0.7", "fd00::7"], vec![mapping(None, 8080, Protocol::Tcp)]);
    hp.set(&b).await.unwrap();
    assert_eq!(
        fake.take(),
        ["delete element inet kuryr hostports_any4 { tcp . 8080 }\n\
          add element inet kuryr hostports_any4 { tcp . 8080 : 10.0.0.7 . 8080 }\n\
          add element inet kuryr hostports_any6 { tcp . 8080 : fd00::7 . 8080 }\n"]
    );
    hp.remove("b", "eth0").await.unwrap();
    assert_eq!(
        fake.take(),
        ["delete element inet kuryr hostports_any4 { tcp . 8080 }\n\
          delete element inet kuryr hostports_any6 { tcp . 8080 }\n\
          add element inet kuryr hostports_any4 { tcp . 8080 : 10.0.0.5 . 8080 }\n"]
    );
    hp.remove("b", "eth0").await.unwrap();
    assert!(fake.take().is_empty(), "removing twice is nothing");

    // A failed change is retried at once as a rebuild; a failed rebuild is an error, and the
    // next change rebuilds.
    fake.fail(true);
    let c = att("c", &["10.0.0.8"], vec![mapping(Some("127.0.0.1"), 9000, Protocol::Udp)]);
    assert!(hp.set(&c).await.is_err());
    fake.fail(false);
    hp.remove("a", "eth0").await.unwrap();
    let t = fake.take();
    assert_eq!(t.len(), 1);
    assert!(t[0].contains("flush map inet kuryr hostports4\n"), "{}", t[0]);
    assert!(t[0].contains("add element inet kuryr hostports4 { 127.0.0.1 . udp . 9000 : 10.0.0.8 . 8080 }"));
    assert!(!t[0].contains("add element inet kuryr hostports_any4"), "a's port is gone:\n{}", t[0]);
}
