use super::super::model::{Backend, Listener, Proto, Service, ServiceKey};
use super::*;

fn backend(a: &str, port: u16) -> Backend {
    Backend { addr: a.parse().unwrap(), port }
}

fn svc(backends: Vec<Backend>, affinity: Option<u32>) -> Service {
    Service {
        key: ServiceKey { namespace: "default".into(), name: "web".into() },
        uid: "u".into(),
        generation: 1,
        vips: vec!["10.96.0.10".parse().unwrap(), "fd00:96::10".parse().unwrap()],
        listeners: vec![Listener { proto: Proto::Tcp, port: 80, backends }],
        affinity,
    }
}

fn lines(s: &str) -> Vec<&str> {
    s.lines().collect()
}

#[test]
fn members_are_spread_evenly_per_family() {
    let r = render(&svc(vec![backend("10.0.0.1", 8080), backend("10.0.0.2", 8080), backend("fd00::1", 8080)], None));
    assert_eq!(
        r.elements,
        vec![
            Element {
                set: "services4",
                key: "10.96.0.10 . tcp . 80".into(),
                verdict: Some("goto svc/default/web/tcp/80/v4".into())
            },
            Element {
                set: "services6",
                key: "fd00:96::10 . tcp . 80".into(),
                verdict: Some("goto svc/default/web/tcp/80/v6".into())
            },
        ]
    );
    assert_eq!(
        r.chains["svc/default/web/tcp/80/v4"],
        [
            "numgen random mod 2 vmap { 0 : goto ep/default/web/tcp/80/10.0.0.1/8080, 1 : goto ep/default/web/tcp/80/10.0.0.2/8080 }"
        ]
    );
    assert_eq!(r.chains["svc/default/web/tcp/80/v6"], ["goto ep/default/web/tcp/80/fd00..1/8080"]);
    assert_eq!(r.chains["ep/default/web/tcp/80/10.0.0.2/8080"], ["meta l4proto tcp dnat ip to 10.0.0.2:8080"]);
    assert_eq!(r.chains["ep/default/web/tcp/80/fd00..1/8080"], ["meta l4proto tcp dnat ip6 to [fd00::1]:8080"]);
    assert_eq!(r.chains.len(), 5);
    assert!(r.sets.is_empty());
}

#[test]
fn a_family_without_members_is_rejected() {
    let r = render(&svc(vec![backend("10.0.0.1", 8080)], None));
    assert!(r.elements.contains(&Element { set: "noep6", key: "fd00:96::10 . tcp . 80".into(), verdict: None }));
    let r = render(&svc(vec![], None));
    assert!(r.chains.is_empty());
    assert_eq!(
        r.elements.iter().map(|e| (e.set, e.verdict.is_some())).collect::<Vec<_>>(),
        [("noep4", false), ("noep6", false)]
    );
}

#[test]
fn affinity_checks_recent_clients_first_and_records_them() {
    let r = render(&svc(vec![backend("10.0.0.1", 8080), backend("10.0.0.2", 9090)], Some(30)));
    let aff1 = "aff/default/web/tcp/80/10.0.0.1/8080";
    assert_eq!(
        r.chains["svc/default/web/tcp/80/v4"],
        [
            format!("ip saddr @{aff1} goto ep/default/web/tcp/80/10.0.0.1/8080"),
            "ip saddr @aff/default/web/tcp/80/10.0.0.2/9090 goto ep/default/web/tcp/80/10.0.0.2/9090".into(),
            "numgen random mod 2 vmap { 0 : goto ep/default/web/tcp/80/10.0.0.1/8080, 1 : goto ep/default/web/tcp/80/10.0.0.2/9090 }".into(),
        ]
    );
    assert_eq!(
        r.chains["ep/default/web/tcp/80/10.0.0.1/8080"],
        [format!("update @{aff1} {{ ip saddr }}"), "meta l4proto tcp dnat ip to 10.0.0.1:8080".into()]
    );
    assert_eq!(r.sets[aff1], AffinitySet { ipv6: false, timeout: 30 });
    assert_eq!(r.sets[aff1].to_string(), "{ type ipv4_addr; flags dynamic,timeout; timeout 30s; }");
}

#[test]
fn udp_and_sctp_listeners_match_their_protocol() {
    let mut s = svc(vec![backend("10.0.0.1", 53)], None);
    s.listeners[0].proto = Proto::Udp;
    s.listeners.push(Listener { proto: Proto::Sctp, port: 9, backends: vec![backend("10.0.0.1", 9)] });
    let r = render(&s);
    assert_eq!(r.chains["ep/default/web/udp/80/10.0.0.1/53"], ["meta l4proto udp dnat ip to 10.0.0.1:53"]);
    assert_eq!(r.chains["ep/default/web/sctp/9/10.0.0.1/9"], ["meta l4proto sctp dnat ip to 10.0.0.1:9"]);
    assert!(r.elements.iter().any(|e| e.key == "10.96.0.10 . sctp . 9"));
}

#[test]
fn the_longest_names_fit_the_kernel() {
    let mut s = svc(vec![backend("ffff:ffff:ffff:ffff:ffff:ffff:ffff:fff1", 65535)], Some(10));
    s.key = ServiceKey { namespace: "n".repeat(63), name: "s".repeat(63) };
    s.vips = vec!["fd00::1".parse().unwrap()];
    s.listeners[0].proto = Proto::Sctp;
    s.listeners[0].port = 65535;
    let r = render(&s);
    for name in r.chains.keys().chain(r.sets.keys()) {
        assert!(name.len() <= MAX_NAME, "{} bytes: {name}", name.len());
        assert!(is_service_object(name), "{name}");
    }
}

#[test]
fn a_delta_drops_references_before_deleting_and_leaves_other_services_alone() {
    let old = render(&svc(vec![backend("10.0.0.1", 8080), backend("10.0.0.2", 8080)], Some(30)));
    let new = render(&svc(vec![backend("10.0.0.2", 8080), backend("10.0.0.3", 8080)], Some(60)));
    let mut out = String::new();
    delta(&mut out, &[(&old, &new)]);
    let l = lines(&out);
    let pos = |s: &str| l.iter().position(|x| *x == s).unwrap_or_else(|| panic!("{s:?} not in\n{out}"));
    let del_elem = pos("delete element inet kuryr services4 { 10.96.0.10 . tcp . 80 }");
    let flush_svc = pos("flush chain inet kuryr svc/default/web/tcp/80/v4");
    let flush_gone = pos("flush chain inet kuryr ep/default/web/tcp/80/10.0.0.1/8080");
    let del_gone = pos("delete chain inet kuryr ep/default/web/tcp/80/10.0.0.1/8080");
    let del_gone_set = pos("delete set inet kuryr aff/default/web/tcp/80/10.0.0.1/8080");
    let replace_set = pos("delete set inet kuryr aff/default/web/tcp/80/10.0.0.2/8080");
    let add_set = pos(
        "add set inet kuryr aff/default/web/tcp/80/10.0.0.2/8080 { type ipv4_addr; flags dynamic,timeout; timeout 60s; }",
    );
    let add_chain = pos("add chain inet kuryr ep/default/web/tcp/80/10.0.0.3/8080");
    let add_rule = pos(
        "add rule inet kuryr ep/default/web/tcp/80/10.0.0.3/8080 update @aff/default/web/tcp/80/10.0.0.3/8080 { ip saddr }",
    );
    let add_elem = pos("add element inet kuryr services4 { 10.96.0.10 . tcp . 80 : goto svc/default/web/tcp/80/v4 }");
    assert!(del_elem < flush_svc && flush_svc < del_gone && flush_gone < del_gone && del_gone < del_gone_set);
    assert!(flush_svc < replace_set && replace_set < add_set && add_chain < add_rule && add_rule < add_elem);
    assert!(!out.contains("add table"), "a delta does not touch the skeleton:\n{out}");
    // The kept member's chain is refilled, not deleted.
    assert!(!out.contains("delete chain inet kuryr ep/default/web/tcp/80/10.0.0.2/8080"));
    assert!(!out.contains("delete chain inet kuryr svc/"));

    // Deleting a Service removes exactly what it owned.
    let mut out = String::new();
    delta(&mut out, &[(&new, &Rendered::default())]);
    let deleted: BTreeSet<&str> = lines(&out)
        .iter()
        .filter_map(|l| l.strip_prefix("delete chain inet kuryr ").or_else(|| l.strip_prefix("delete set inet kuryr ")))
        .collect();
    let owned: BTreeSet<&str> = new.chains.keys().chain(new.sets.keys()).map(String::as_str).collect();
    assert_eq!(deleted, owned);
    assert!(!out.contains("add "), "{out}");
}

#[test]
fn a_full_sync_rebuilds_from_the_desired_services_and_removes_the_rest() {
    let keep = render(&svc(vec![backend("10.0.0.1", 8080)], Some(30)));
    let mut existing = Existing::default();
    for c in ["svc/default/web/tcp/80/v4", "ep/default/web/tcp/80/10.0.0.1/8080", "svc/default/gone/tcp/80/v4"] {
        existing.chains.insert(c.into());
    }
    for c in ["nat_prerouting", "services"] {
        existing.chains.insert(c.into());
    }
    existing.sets.insert("aff/default/web/tcp/80/10.0.0.1/8080".into(), Some(30));
    existing.sets.insert("aff/default/gone/tcp/80/10.0.0.9/80".into(), Some(30));
    existing.sets.insert("services4".into(), None);
    let mut out = String::new();
    full(&mut out, &existing, &[&keep]);
    let l = lines(&out);
    assert_eq!(l[0], "add table inet kuryr");
    for want in [
        "flush map inet kuryr services4",
        "flush set inet kuryr noep6",
        "flush chain inet kuryr svc/default/gone/tcp/80/v4",
        "delete chain inet kuryr svc/default/gone/tcp/80/v4",
        "delete set inet kuryr aff/default/gone/tcp/80/10.0.0.9/80",
        "add rule inet kuryr svc/default/web/tcp/80/v4 goto ep/default/web/tcp/80/10.0.0.1/8080",
        "add rule inet kuryr filter_forward ct state new ct status dnat fib daddr . iif oif exists meta mark set meta mark | 0x00008000",
        "add rule inet kuryr nat_postrouting meta mark & 0x00008000 == 0x00008000 masquerade",
    ] {
        assert!(l.contains(&want), "{want:?} not in\n{out}");
    }
    // Kept objects are refilled, never deleted (no window without rules); the skeleton stays.
    for kept in ["svc/default/web/tcp/80/v4", "ep/default/web/tcp/80/10.0.0.1/8080", "nat_prerouting", "services"] {
        assert!(!l.contains(&format!("delete chain inet kuryr {kept}").as_str()), "{kept} deleted:\n{out}");
    }
    assert!(!out.contains("delete set inet kuryr aff/default/web/"), "{out}");
    assert!(!out.contains("services4\n") || !out.contains("delete set inet kuryr services4"));

    // A changed affinity timeout replaces the set.
    existing.sets.insert("aff/default/web/tcp/80/10.0.0.1/8080".into(), Some(99));
    let mut out = String::new();
    full(&mut out, &existing, &[&keep]);
    let l = lines(&out);
    let del = l.iter().position(|x| *x == "delete set inet kuryr aff/default/web/tcp/80/10.0.0.1/8080").unwrap();
    let add = l.iter().position(|x| x.starts_with("add set inet kuryr aff/default/web/tcp/80/10.0.0.1/8080")).unwrap();
    assert!(del < add, "{out}");
}
