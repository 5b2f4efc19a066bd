//! The Service ruleset against the real kernel: full syncs and per-Service deltas rendered by the
//! binder are applied with `nft -f` inside a network namespace of this test, and the table is
//! read back. Needs root.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use kuryr_binder::lb::model::{Backend, Listener, Proto, Service, ServiceKey};
use kuryr_binder::lb::nft::Nft;
use kuryr_binder::lb::render::{self, Rendered, render};

struct Netns {
    name: String,
    dir: tempfile::TempDir,
}

impl Netns {
    fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("klb{:x}-{n}", std::process::id());
        let out = Command::new("ip").args(["netns", "add", &name]).output().unwrap();
        assert!(out.status.success(), "ip netns add: {}", String::from_utf8_lossy(&out.stderr));
        Self { name, dir: tempfile::tempdir().unwrap() }
    }

    /// An `nft` that runs inside this namespace.
    fn nft(&self) -> Nft {
        let path = self.dir.path().join("nft");
        std::fs::write(&path, format!("#!/bin/sh\nexec ip netns exec {} nft \"$@\"\n", self.name)).unwrap();
        Command::new("chmod").args(["+x", &path.display().to_string()]).status().unwrap();
        Nft::new(path.display().to_string())
    }

    fn ruleset(&self) -> String {
        let out = Command::new("ip").args(["netns", "exec", &self.name, "nft", "list", "ruleset"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

fn svc(name: &str, vip: &str, backends: &[(&str, u16)], affinity: Option<u32>) -> Service {
    Service::cluster_ip(
        ServiceKey { namespace: "default".into(), name: name.into() },
        vec![vip.parse().unwrap(), format!("fd00:96::{}", vip.rsplit('.').next().unwrap()).parse().unwrap()],
        vec![
            Listener::new(
                Proto::Tcp,
                80,
                backends.iter().map(|(a, p)| Backend { addr: a.parse().unwrap(), port: *p }).collect(),
            ),
            Listener::new(Proto::Udp, 53, vec![]),
        ],
        affinity,
    )
}

#[tokio::test]
async fn full_syncs_and_deltas_apply_atomically_and_leave_nothing_stale() {
    let ns = Netns::new();
    let nft = ns.nft();
    assert!(nft.existing().await.unwrap().chains.is_empty(), "no table yet reads as empty");

    // A first full sync of two Services (dual-stack members, affinity on one).
    let a = render(&svc("a", "10.96.0.1", &[("10.0.0.1", 8080), ("10.0.0.2", 8080), ("fd00::1", 8080)], Some(60)));
    let b = render(&svc("b", "10.96.0.2", &[("10.0.0.3", 9090)], None));
    let mut script = String::new();
    render::full(&mut script, &nft.existing().await.unwrap(), &[&a, &b]);
    nft.apply(&script).await.unwrap_or_else(|e| panic!("{e}\n{script}"));
    let rs = ns.ruleset();
    for want in [
        "10.96.0.1 . tcp . 80 : goto svc/default/a/tcp/80/v4",
        "fd00:96::1 . tcp . 80 : goto svc/default/a/tcp/80/v6",
        "10.96.0.1 . udp . 53",
        "numgen random mod 2 vmap { 0 : goto ep/default/a/tcp/80/10.0.0.1/8080, 1 : goto ep/default/a/tcp/80/10.0.0.2/8080 }",
        "meta l4proto tcp dnat ip6 to [fd00::1]:8080",
        "update @aff/default/a/tcp/80/10.0.0.1/8080 { ip saddr }",
        "dnat ip to 10.0.0.3:9090",
        "masquerade",
    ] {
        assert!(rs.contains(want), "{want:?} missing from\n{rs}");
    }
    let existing = nft.existing().await.unwrap();
    assert_eq!(existing.sets.get("aff/default/a/tcp/80/10.0.0.1/8080"), Some(&Some(60)));

    // A delta of one Service: a member replaced, affinity timeout changed; b untouched.
    let a2 = render(&svc("a", "10.96.0.1", &[("10.0.0.2", 8080), ("10.0.0.4", 8080)], Some(120)));
    let mut script = String::new();
    render::delta(&mut script, &[(&a, &a2)]);
    assert!(!script.contains("default/b"), "{script}");
    nft.apply(&script).await.unwrap_or_else(|e| panic!("{e}\n{script}"));
    let rs = ns.ruleset();
    assert!(!rs.contains("10.0.0.1"), "removed member still there:\n{rs}");
    assert!(rs.contains("dnat ip to 10.0.0.4:8080") && rs.contains("dnat ip to 10.0.0.3:9090"), "{rs}");
    assert!(rs.contains("fd00:96::1 . tcp . 80"), "no IPv6 member any more: rejected\n{rs}");
    assert_eq!(nft.existing().await.unwrap().sets.get("aff/default/a/tcp/80/10.0.0.2/8080"), Some(&Some(120)));

    // A restart finds a and b in the kernel but only b is still wanted: a full sync removes a.
    let mut script = String::new();
    render::full(&mut script, &nft.existing().await.unwrap(), &[&b]);
    nft.apply(&script).await.unwrap_or_else(|e| panic!("{e}\n{script}"));
    let rs = ns.ruleset();
    assert!(!rs.contains("default/a"), "stale Service left:\n{rs}");
    assert!(rs.contains("svc/default/b/tcp/80/v4"), "{rs}");

    // Deleting the last Service leaves the skeleton only.
    let mut script = String::new();
    render::delta(&mut script, &[(&b, &Rendered::default())]);
    nft.apply(&script).await.unwrap_or_else(|e| panic!("{e}\n{script}"));
    let existing = nft.existing().await.unwrap();
    assert!(existing.chains.iter().all(|c| !render::is_service_object(c)), "{existing:?}");
    assert!(existing.sets.keys().all(|c| !render::is_service_object(c)), "{existing:?}");

    // A broken transaction changes nothing.
    let before = ns.ruleset();
    let err = nft.apply("add chain inet kuryr svc/x\nadd rule inet kuryr nosuchchain accept\n").await.unwrap_err();
    assert!(err.to_string().contains("nosuchchain") || err.to_string().contains("No such file"), "{err}");
    assert_eq!(ns.ruleset(), before);
}

/// A NodePort Service with external addresses, p1 local and p2 elsewhere.
fn node_port_svc(name: &str, vip: &str, node_port: u16, external_local: bool, internal_local: bool) -> Service {
    let mut s = svc(name, vip, &[("10.0.0.1", 8080), ("10.0.0.2", 8080), ("fd00::2", 8080)], Some(10));
    for l in &mut s.listeners {
        l.node_port = Some(node_port);
        l.local = l.backends.iter().copied().filter(|b| b.addr.to_string() == "10.0.0.1").collect();
    }
    let last = vip.rsplit('.').next().unwrap();
    s.external = vec![format!("192.0.2.{last}").parse().unwrap(), format!("2001:db8::{last}").parse().unwrap()];
    s.external_local = external_local;
    s.internal_local = internal_local;
    s
}

#[tokio::test]
async fn node_ports_external_addresses_and_host_ports_share_the_table() {
    use kuryr_binder::attachments::{Attachment, State};
    use kuryr_binder::hostport::HostPorts;
    use kuryr_binder::hostport::mapping::{PortMapping, Protocol};

    let ns = Netns::new();
    let nft = ns.nft();
    // Host ports first, as at a binder start: they create the table.
    let sys = ns.dir.path().join("sys");
    std::fs::create_dir_all(sys.join("net/ipv4/conf/kuryr0")).unwrap();
    std::fs::create_dir_all(sys.join("net/ipv6/conf/all")).unwrap();
    let hp = HostPorts::with_proc_sys(nft.clone(), sys);
    let att = |id: &str, ip: &str, host_ip: Option<&str>, protocol: Protocol| Attachment {
        container_id: id.into(),
        ifname: "eth0".into(),
        netns: String::new(),
        host_ifname: String::new(),
        pod_uid: String::new(),
        pod_namespace: "ns".into(),
        pod_name: id.into(),
        vif_id: String::new(),
        driver: "bridge".into(),
        bridge: "kuryr0".into(),
        ips: vec![ip.parse().unwrap(), "fd00:1::5".parse().unwrap()],
        port_mappings: vec![PortMapping {
            host_port: 54321,
            container_port: 8080,
            protocol,
            host_ip: host_ip.map(|h| h.parse().unwrap()),
        }],
        state: State::Ready,
        host_mac: String::new(),
        sandbox_mac: String::new(),
        primary: None,
        report_pending: false,
    };
    hp.restore(&[att("a", "10.0.0.5", Some("127.0.0.1"), Protocol::Tcp)]).await.unwrap();
    hp.set(&att("b", "10.0.0.6", Some("172.31.0.1"), Protocol::Tcp)).await.unwrap();
    hp.set(&att("c", "10.0.0.7", Some("172.31.0.1"), Protocol::Udp)).await.unwrap();
    hp.set(&att("d", "10.0.0.8", None, Protocol::Sctp)).await.unwrap();

    // Services: both traffic policies, a full sync then deltas.
    let cluster = render(&node_port_svc("np", "10.96.0.3", 30080, false, false));
    let local = render(&node_port_svc("npl", "10.96.0.4", 30081, true, true));
    let mut script = String::new();
    render::full(&mut script, &nft.existing().await.unwrap(), &[&cluster, &local]);
    nft.apply(&script).await.unwrap_or_else(|e| panic!("{e}\n{script}"));
    let rs = ns.ruleset();
    for want in [
        "127.0.0.1 . tcp . 54321 : 10.0.0.5 . 8080",
        "172.31.0.1 . tcp . 54321 : 10.0.0.6 . 8080",
        "172.31.0.1 . udp . 54321 : 10.0.0.7 . 8080",
        "sctp . 54321 : 10.0.0.8 . 8080",
        "sctp . 54321 : fd00:1::5 . 8080",
        "\"kuryr0\"",
        "tcp . 30080 : goto ext/default/np/tcp/80/v4",
        "192.0.2.3 . tcp . 80 : goto ext/default/np/tcp/80/v4",
        "2001:db8::4 . tcp . 80 : goto ext/default/npl/tcp/80/v6",
        "10.96.0.4 . tcp . 80 : goto local/default/npl/tcp/80/v4",
        "udp . 30081",
        "iifname @pod_ifaces goto svc/default/npl/tcp/80/v4",
        "fib saddr type local meta mark set meta mark | 0x00008000 goto svc/default/npl/tcp/80/v4",
        "fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @nodeports4",
        "dnat ip to ip daddr . meta l4proto . th dport map @hostports4",
        "iifname != \"lo\" ip daddr 127.0.0.0/8 drop",
    ] {
        assert!(rs.contains(want), "{want:?} missing from\n{rs}");
    }
    assert!(rs.contains("chain local/default/npl/tcp/80/v6 {\n\t\tdrop"), "{rs}");

    // A Service delta and a host port change leave each other's objects alone.
    let mut changed = node_port_svc("np", "10.96.0.3", 30080, false, false);
    changed.listeners.truncate(1);
    changed.listeners[0].node_port = Some(30090);
    let changed = render(&changed);
    let mut script = String::new();
    render::delta(&mut script, &[(&cluster, &changed)]);
    nft.apply(&script).await.unwrap_or_else(|e| panic!("{e}\n{script}"));
    hp.remove("b", "eth0").await.unwrap();
    let rs = ns.ruleset();
    assert!(rs.contains("tcp . 30090 : goto ext/default/np/tcp/80/v4") && !rs.contains("30080"), "{rs}");
    assert!(!rs.contains("10.0.0.6 . 8080") && rs.contains("10.0.0.7 . 8080"), "{rs}");
    // A full Service sync keeps the host ports; a host port rebuild keeps the Services.
    let mut script = String::new();
    render::full(&mut script, &nft.existing().await.unwrap(), &[&local]);
    nft.apply(&script).await.unwrap_or_else(|e| panic!("{e}\n{script}"));
    hp.restore(&[att("a", "10.0.0.5", Some("127.0.0.1"), Protocol::Tcp)]).await.unwrap();
    let rs = ns.ruleset();
    assert!(!rs.contains("default/np/") && rs.contains("default/npl/"), "{rs}");
    assert!(rs.contains("10.0.0.5 . 8080") && !rs.contains("10.0.0.7 . 8080"), "{rs}");
}
