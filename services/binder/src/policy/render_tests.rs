#![allow(clippy::unwrap_used)]

use kuryr_proto::policy::v1::{AddressPort, PortBox};

use super::*;
use crate::policy::state::Isolation;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn state() -> Desired {
    let g = PeerGroup {
        id: "i00000000000000a1".into(),
        addresses: vec!["10.0.2.1".into(), "fd00::2:1".into()],
        ranges: vec![AddressRange { first: "192.168.0.0".into(), last: "192.168.0.255".into() }],
        ports: vec![AddressPort { address: "10.0.2.2".into(), protocol: Protocol::Tcp as i32, port: 80 }],
        boxes: vec![PortBox {
            addresses: Some(AddressRange { first: "fd00::".into(), last: "fd00::ff".into() }),
            protocol: Protocol::Udp as i32,
            first_port: 5000,
            last_port: 5010,
        }],
        policies: vec!["ns/p".into()],
    };
    let mut d = Desired::default();
    d.groups.insert(g.id.clone(), g);
    d.isolations.insert(ip("10.0.1.1"), Isolation { ingress: Some("i00000000000000a1".into()), egress: None });
    d
}

fn elems<'a>(r: &'a Rendered, set: &str) -> Vec<&'a str> {
    r.sets[set].1.iter().map(String::as_str).collect()
}

#[test]
fn a_group_is_a_chain_and_eight_sets_and_an_isolation_is_a_map_element() {
    let (r, warnings) = render(&state());
    assert!(warnings.is_empty(), "{warnings:?}");
    let id = "pol/i00000000000000a1";
    assert_eq!(elems(&r, &format!("{id}/a4")), ["10.0.2.1"]);
    assert_eq!(elems(&r, &format!("{id}/a6")), ["fd00::2:1"]);
    assert_eq!(elems(&r, &format!("{id}/n4")), ["192.168.0.0-192.168.0.255"]);
    assert_eq!(elems(&r, &format!("{id}/p4")), ["10.0.2.2 . tcp . 80"]);
    assert_eq!(elems(&r, &format!("{id}/r6")), ["fd00::-fd00::ff . udp . 5000-5010"]);
    assert_eq!(elems(&r, "pol_ingress4"), [format!("10.0.1.1 : jump {id}")]);
    assert_eq!(elems(&r, "pol_self4"), ["10.0.1.1 . 10.0.1.1"]);
    assert!(elems(&r, "pol_egress4").is_empty());
    let rules = &r.chains[id];
    assert_eq!(rules[0], format!("ip saddr @{id}/a4 return"), "ingress peers are sources");
    assert_eq!(rules.last().unwrap(), "reject with icmpx admin-prohibited");
    assert_eq!(r.sets.len(), 6 + 8);
}

#[test]
fn a_peer_joining_a_group_is_one_element_and_a_pod_moving_is_one_map_key() {
    let (old, _) = render(&state());
    let mut d = state();
    d.groups.get_mut("i00000000000000a1").unwrap().addresses.push("10.0.2.9".into());
    let (new, _) = render(&d);
    let mut script = String::new();
    diff(&mut script, &old, &new, false);
    assert_eq!(script, "add element inet kuryr pol/i00000000000000a1/a4 { 10.0.2.9 }\n");

    // The pod's ingress moves to another group: the group's chain and sets are created, its
    // map key is replaced (deleted, then added, in one transaction), the old group goes.
    let mut d2 = d.clone();
    let mut g = d2.groups.remove("i00000000000000a1").unwrap();
    g.id = "i00000000000000b2".into();
    d2.groups.insert(g.id.clone(), g);
    d2.isolations.insert(ip("10.0.1.1"), Isolation { ingress: Some("i00000000000000b2".into()), egress: None });
    let (newer, _) = render(&d2);
    let mut script = String::new();
    diff(&mut script, &new, &newer, false);
    let lines: Vec<&str> = script.lines().collect();
    let pos =
        |needle: &str| lines.iter().position(|l| l.contains(needle)).unwrap_or_else(|| panic!("{needle}: {script}"));
    assert!(pos("add chain inet kuryr pol/i00000000000000b2") < pos("add element inet kuryr pol_ingress4"));
    assert!(pos("delete element inet kuryr pol_ingress4") < pos("add element inet kuryr pol_ingress4"));
    assert!(pos("add element inet kuryr pol_ingress4") < pos("delete chain inet kuryr pol/i00000000000000a1"));
    assert!(
        pos("delete chain inet kuryr pol/i00000000000000a1") < pos("delete set inet kuryr pol/i00000000000000a1/a4")
    );
    let mut none = String::new();
    diff(&mut none, &newer, &newer, false);
    assert!(none.is_empty(), "{none}");
}

#[test]
fn every_port_of_a_protocol_is_the_range_from_zero() {
    // `ports: [{protocol: TCP}]` from every peer: the compiler's box of all addresses, TCP 0-65535.
    let mut d = state();
    let g = d.groups.get_mut("i00000000000000a1").unwrap();
    g.boxes = vec![PortBox {
        addresses: Some(AddressRange { first: "0.0.0.0".into(), last: "255.255.255.255".into() }),
        protocol: Protocol::Tcp as i32,
        first_port: 0,
        last_port: 65535,
    }];
    let (r, warnings) = render(&d);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(elems(&r, "pol/i00000000000000a1/r4"), ["0.0.0.0-255.255.255.255 . tcp . 0-65535"]);
}

#[test]
fn a_missing_or_unreadable_group_allows_nothing() {
    let mut d = Desired::default();
    d.isolations.insert(ip("10.0.1.1"), Isolation { ingress: None, egress: Some("e0000000000000001".into()) });
    d.isolations.insert(ip("10.0.1.2"), Isolation { ingress: Some("x; flush ruleset".into()), egress: None });
    let (r, warnings) = render(&d);
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert_eq!(elems(&r, "pol_egress4"), ["10.0.1.1 : jump pol/e0000000000000001"]);
    assert_eq!(elems(&r, "pol_ingress4"), ["10.0.1.2 : jump pol/i-invalid"]);
    assert_eq!(r.chains["pol/i-invalid"].last().unwrap(), "reject with icmpx admin-prohibited");
    assert!(r.chains["pol/e0000000000000001"][0].contains("ip daddr"), "egress peers are destinations");
}

#[test]
fn replace_refills_every_set_in_one_script_and_removes_stale_policy_objects_only() {
    let (r, _) = render(&state());
    let chains: BTreeSet<String> = ["pol/iold".to_string(), "svc/default/web".to_string()].into();
    let sets: BTreeMap<String, Option<u32>> =
        [("pol/iold/a4".to_string(), None), ("services4".to_string(), None)].into();
    let mut script = String::new();
    replace(&mut script, &r, &chains, &sets);
    assert!(script.contains("flush map inet kuryr pol_ingress4\n"));
    assert!(script.contains("add rule inet kuryr pol_forward icmpv6 type { nd-neighbor-solicit,"), "{script}");
    assert!(script.contains("add element inet kuryr pol_ingress4 { 10.0.1.1 : jump pol/i00000000000000a1 }"));
    assert!(script.contains("delete chain inet kuryr pol/iold\n"));
    assert!(script.contains("delete set inet kuryr pol/iold/a4\n"));
    assert!(!script.contains("svc/") && !script.contains("services4"), "{script}");
    assert!(!script.contains("flush table") && !script.contains("delete table"));
}

/// SCTP is compiled and rendered like TCP and UDP (this machine's kernel has no sctp module, so
/// it is not exercised on traffic): a port and a port range of SCTP become elements keyed on
/// `sctp`, IPv4 and IPv6, with nothing left out.
#[test]
fn sctp_ports_and_ranges_are_set_elements_like_tcp_and_udp() {
    let mut d = state();
    let g = d.groups.get_mut("i00000000000000a1").unwrap();
    g.ports = vec![
        AddressPort { address: "10.0.2.2".into(), protocol: Protocol::Sctp as i32, port: 9 },
        AddressPort { address: "fd00::2:2".into(), protocol: Protocol::Sctp as i32, port: 9 },
    ];
    g.boxes = vec![PortBox {
        addresses: Some(AddressRange { first: "10.1.0.0".into(), last: "10.1.255.255".into() }),
        protocol: Protocol::Sctp as i32,
        first_port: 1000,
        last_port: 2000,
    }];
    let (r, warnings) = render(&d);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(elems(&r, "pol/i00000000000000a1/p4"), ["10.0.2.2 . sctp . 9"]);
    assert_eq!(elems(&r, "pol/i00000000000000a1/p6"), ["fd00::2:2 . sctp . 9"]);
    assert_eq!(elems(&r, "pol/i00000000000000a1/r4"), ["10.1.0.0-10.1.255.255 . sctp . 1000-2000"]);
}
