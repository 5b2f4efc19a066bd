use super::super::model::{Backend, Listener, Proto, Service, ServiceKey};
use super::*;

fn backend(a: &str, port: u16) -> Backend {
    Backend { addr: a.parse().unwrap(), port }
}

fn svc(backends: Vec<Backend>, affinity: Option<u32>) -> Service {
    Service::cluster_ip(
        ServiceKey { namespace: "default".into(), name: "web".into() },
        vec!["10.96.0.10".parse().unwrap(), "fd00:96::10".parse().unwrap()],
        vec![Listener::new(Proto::Tcp, 80, backends)],
        affinity,
    )
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
    s.listeners.push(Listener::new(Proto::Sctp, 9, vec![backend("10.0.0.1", 9)]));
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

/// A NodePort Service with external IPs: p1 (10.0.0.1) runs on this node, p2 (10.0.0.2) and the
/// IPv6 member elsewhere.
fn node_port_svc(external_local: bool, internal_local: bool) -> Service {
    let mut l = Listener::new(
        Proto::Tcp,
        80,
        vec![backend("10.0.0.1", 8080), backend("10.0.0.2", 8080), backend("fd00::2", 8080)],
    );
    l.node_port = Some(30080);
    l.local = vec![backend("10.0.0.1", 8080)];
    let mut s = svc(vec![], None);
    s.listeners = vec![l];
    s.external = vec!["192.0.2.1".parse().unwrap(), "2001:db8::1".parse().unwrap()];
    s.external_local = external_local;
    s.internal_local = internal_local;
    s
}

fn element(r: &Rendered, set: &str, key: &str) -> Option<String> {
    r.elements.iter().find(|e| e.set == set && e.key == key).map(|e| e.verdict.clone().unwrap_or_default())
}

#[test]
fn node_ports_and_external_addresses_enter_through_the_external_chain() {
    let r = render(&node_port_svc(false, false));
    assert_eq!(element(&r, "nodeports4", "tcp . 30080").as_deref(), Some("goto ext/default/web/tcp/80/v4"));
    assert_eq!(element(&r, "nodeports6", "tcp . 30080").as_deref(), Some("goto ext/default/web/tcp/80/v6"));
    assert_eq!(element(&r, "services4", "192.0.2.1 . tcp . 80").as_deref(), Some("goto ext/default/web/tcp/80/v4"));
    assert_eq!(element(&r, "services6", "2001:db8::1 . tcp . 80").as_deref(), Some("goto ext/default/web/tcp/80/v6"));
    // The cluster IP does not: no masquerading of internal traffic.
    assert_eq!(element(&r, "services4", "10.96.0.10 . tcp . 80").as_deref(), Some("goto svc/default/web/tcp/80/v4"));
    // externalTrafficPolicy Cluster: masquerade, then any member.
    assert_eq!(
        r.chains["ext/default/web/tcp/80/v4"],
        ["meta mark set meta mark | 0x00008000 goto svc/default/web/tcp/80/v4"]
    );
    assert!(r.chains.keys().all(|c| !c.starts_with("local/")), "nothing uses local chains: {:?}", r.chains.keys());
    assert_eq!(r.elements.len(), 6, "{:?}", r.elements);
}

#[test]
fn external_traffic_policy_local_keeps_the_source_and_short_circuits_the_node_and_its_pods() {
    let r = render(&node_port_svc(true, false));
    assert_eq!(
        r.chains["ext/default/web/tcp/80/v4"],
        [
            "fib saddr type local meta mark set meta mark | 0x00008000 goto svc/default/web/tcp/80/v4",
            "iifname @pod_ifaces goto svc/default/web/tcp/80/v4",
            "goto local/default/web/tcp/80/v4",
        ]
    );
    assert_eq!(r.chains["local/default/web/tcp/80/v4"], ["goto ep/default/web/tcp/80/10.0.0.1/8080"]);
    // No member of the family here: dropped (not rejected: the Service has members elsewhere).
    assert_eq!(r.chains["local/default/web/tcp/80/v6"], ["drop"]);
    assert!(r.chains["svc/default/web/tcp/80/v4"][0].starts_with("numgen random mod 2 "));
    assert_eq!(element(&r, "services4", "10.96.0.10 . tcp . 80").as_deref(), Some("goto svc/default/web/tcp/80/v4"));
}

#[test]
fn internal_traffic_policy_local_sends_cluster_ips_to_local_members() {
    let r = render(&node_port_svc(false, true));
    assert_eq!(element(&r, "services4", "10.96.0.10 . tcp . 80").as_deref(), Some("goto local/default/web/tcp/80/v4"));
    assert_eq!(element(&r, "services6", "fd00:96::10 . tcp . 80").as_deref(), Some("goto local/default/web/tcp/80/v6"));
    assert_eq!(r.chains["local/default/web/tcp/80/v6"], ["drop"]);
    // External traffic still goes to every member.
    assert_eq!(
        r.chains["ext/default/web/tcp/80/v4"],
        ["meta mark set meta mark | 0x00008000 goto svc/default/web/tcp/80/v4"]
    );
}

#[test]
fn node_ports_without_members_are_rejected_and_only_in_the_cluster_ip_families() {
    let mut s = node_port_svc(true, false);
    s.listeners[0].backends.clear();
    s.listeners[0].local.clear();
    let r = render(&s);
    assert!(r.chains.is_empty(), "{:?}", r.chains);
    let mut got: Vec<(&str, &str)> = r.elements.iter().map(|e| (e.set, e.key.as_str())).collect();
    got.sort();
    assert_eq!(
        got,
        [
            ("noep4", "10.96.0.10 . tcp . 80"),
            ("noep4", "192.0.2.1 . tcp . 80"),
            ("noep6", "2001:db8::1 . tcp . 80"),
            ("noep6", "fd00:96::10 . tcp . 80"),
            ("noep_nodeports4", "tcp . 30080"),
            ("noep_nodeports6", "tcp . 30080"),
        ]
    );
    // A single-stack IPv4 Service answers its node port on IPv4 only, but its IPv6 external
    // address all the same.
    let mut s = node_port_svc(false, false);
    s.vips.truncate(1);
    let r = render(&s);
    assert!(element(&r, "nodeports4", "tcp . 30080").is_some());
    assert!(element(&r, "nodeports6", "tcp . 30080").is_none(), "{:?}", r.elements);
    assert_eq!(element(&r, "services6", "2001:db8::1 . tcp . 80").as_deref(), Some("goto ext/default/web/tcp/80/v6"));
}

#[test]
fn tcp_and_udp_on_the_same_port_and_node_port_are_separate() {
    let mut s = node_port_svc(false, false);
    let mut udp = s.listeners[0].clone();
    udp.proto = Proto::Udp;
    s.listeners.push(udp);
    let r = render(&s);
    assert_eq!(element(&r, "nodeports4", "udp . 30080").as_deref(), Some("goto ext/default/web/udp/80/v4"));
    assert_eq!(element(&r, "nodeports4", "tcp . 30080").as_deref(), Some("goto ext/default/web/tcp/80/v4"));
    assert_eq!(r.chains["ep/default/web/udp/80/10.0.0.2/8080"], ["meta l4proto udp dnat ip to 10.0.0.2:8080"]);
}

#[test]
fn affinity_holds_for_node_ports_and_local_members_share_the_member_chains() {
    let mut s = node_port_svc(true, false);
    s.affinity = Some(10);
    let r = render(&s);
    let aff = "aff/default/web/tcp/80/10.0.0.1/8080";
    assert_eq!(
        r.chains["local/default/web/tcp/80/v4"],
        [
            format!("ip saddr @{aff} goto ep/default/web/tcp/80/10.0.0.1/8080"),
            "goto ep/default/web/tcp/80/10.0.0.1/8080".into()
        ]
    );
    assert_eq!(r.sets[aff], AffinitySet { ipv6: false, timeout: 10 });
    assert_eq!(r.chains["ep/default/web/tcp/80/10.0.0.1/8080"][0], format!("update @{aff} {{ ip saddr }}"));
}

#[test]
fn a_type_change_is_a_delta_of_the_service_alone() {
    // ClusterIP → NodePort: the node port and its chain appear; back: they go.
    let cluster_ip = render(&svc(vec![backend("10.0.0.1", 8080)], None));
    let mut np = svc(vec![backend("10.0.0.1", 8080)], None);
    np.listeners[0].node_port = Some(30080);
    let node_port = render(&np);
    let mut out = String::new();
    delta(&mut out, &[(&cluster_ip, &node_port)]);
    assert!(out.contains("add chain inet kuryr ext/default/web/tcp/80/v4\n"), "{out}");
    assert!(out.contains("add element inet kuryr nodeports4 { tcp . 30080 : goto ext/default/web/tcp/80/v4 }\n"));
    let mut out = String::new();
    delta(&mut out, &[(&node_port, &cluster_ip)]);
    let l = lines(&out);
    let del_elem = l.iter().position(|x| *x == "delete element inet kuryr nodeports4 { tcp . 30080 }").unwrap();
    let del_chain = l.iter().position(|x| *x == "delete chain inet kuryr ext/default/web/tcp/80/v4").unwrap();
    assert!(del_elem < del_chain, "{out}");
}

#[test]
fn the_skeleton_dispatches_host_ports_then_services_then_node_ports() {
    let mut out = String::new();
    crate::table::skeleton(&mut out);
    let l = lines(&out);
    let pos = |s: &str| l.iter().position(|x| *x == s).unwrap_or_else(|| panic!("{s:?} not in\n{out}"));
    let hp = pos("add rule inet kuryr nat_prerouting jump hostports");
    let svcs = pos("add rule inet kuryr nat_prerouting jump services");
    let vips = pos("add rule inet kuryr services ip daddr . meta l4proto . th dport vmap @services4");
    let nps = pos(
        "add rule inet kuryr services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @nodeports4",
    );
    assert!(hp < svcs && vips < nps);
    for want in [
        "add rule inet kuryr nat_output jump hostports",
        "add rule inet kuryr hostports dnat ip to ip daddr . meta l4proto . th dport map @hostports4",
        "add rule inet kuryr hostports meta nfproto ipv4 fib daddr type local dnat ip to meta l4proto . th dport map @hostports_any4",
        "add rule inet kuryr filter_prerouting iifname != \"lo\" ip daddr 127.0.0.0/8 drop",
        "add rule inet kuryr filter_output meta l4proto . th dport @noep_nodeports6 ip6 daddr != ::1 fib daddr type local goto no_endpoints",
        "add rule inet kuryr nat_postrouting ct status dnat ip saddr 127.0.0.0/8 masquerade",
        "add set inet kuryr pod_ifaces { type ifname; }",
    ] {
        pos(want);
    }
    // The guard against martian loopback traffic sits before everything else of its hook.
    assert!(
        pos("add rule inet kuryr filter_prerouting iifname != \"lo\" ip daddr 127.0.0.0/8 drop")
            < pos("add rule inet kuryr filter_prerouting ip daddr . meta l4proto . th dport @noep4 goto no_endpoints")
    );
}
