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
        let name = format!("klb{:x}", std::process::id());
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
    Service {
        key: ServiceKey { namespace: "default".into(), name: name.into() },
        uid: format!("uid-{name}"),
        generation: 1,
        vips: vec![vip.parse().unwrap(), format!("fd00:96::{}", vip.rsplit('.').next().unwrap()).parse().unwrap()],
        listeners: vec![
            Listener {
                proto: Proto::Tcp,
                port: 80,
                backends: backends.iter().map(|(a, p)| Backend { addr: a.parse().unwrap(), port: *p }).collect(),
            },
            Listener { proto: Proto::Udp, port: 53, backends: vec![] },
        ],
        affinity,
    }
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
