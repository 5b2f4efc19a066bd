use serde_json::json;

use super::*;

fn cidr(s: &str) -> IpCidr {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A dual-stack pod with a host end, carrying every field some version knows.
fn sample() -> CniResult {
    CniResult {
        interfaces: vec![
            Interface {
                name: "tap0a1b2c3d-4e".into(),
                mac: Some("fe:16:3e:00:00:01".into()),
                mtu: Some(1450),
                ..Interface::default()
            },
            Interface {
                name: "eth0".into(),
                mac: Some("fa:16:3e:12:34:56".into()),
                mtu: Some(1450),
                sandbox: Some("/var/run/netns/cni-1234".into()),
                socket_path: Some("/run/vhost/sock0".into()),
                pci_id: Some("0000:00:05.0".into()),
            },
        ],
        ips: vec![
            IpConfig { address: cidr("10.0.0.5/24"), gateway: Some(ip("10.0.0.1")), interface: Some(1) },
            IpConfig { address: cidr("fd00::5/64"), gateway: Some(ip("fd00::1")), interface: Some(1) },
            IpConfig { address: cidr("192.168.7.7/32"), gateway: None, interface: None },
        ],
        routes: vec![
            Route::new(cidr("0.0.0.0/0"), Some(ip("10.0.0.1"))),
            Route {
                mtu: Some(1400),
                advmss: Some(1360),
                priority: Some(10),
                table: Some(0),
                scope: Some(253),
                ..Route::new(cidr("fd00:1::/64"), None)
            },
        ],
        dns: Dns {
            nameservers: vec!["10.0.0.2".into()],
            domain: Some("cluster.local".into()),
            search: vec!["default.svc.cluster.local".into()],
            options: vec!["ndots:5".into()],
        },
    }
}

fn dns_json() -> Value {
    json!({
        "nameservers": ["10.0.0.2"],
        "domain": "cluster.local",
        "search": ["default.svc.cluster.local"],
        "options": ["ndots:5"],
    })
}

fn expected(version: &str) -> Value {
    let old = version.starts_with("0.");
    let new11 = version == "1.1.0";
    let (ips, interfaces, routes) = if old {
        (
            json!([
                {"version": "4", "address": "10.0.0.5/24", "gateway": "10.0.0.1", "interface": 1},
                {"version": "6", "address": "fd00::5/64", "gateway": "fd00::1", "interface": 1},
                {"version": "4", "address": "192.168.7.7/32"},
            ]),
            json!([
                {"name": "tap0a1b2c3d-4e", "mac": "fe:16:3e:00:00:01"},
                {"name": "eth0", "mac": "fa:16:3e:12:34:56", "sandbox": "/var/run/netns/cni-1234"},
            ]),
            json!([{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}, {"dst": "fd00:1::/64"}]),
        )
    } else if !new11 {
        (
            json!([
                {"address": "10.0.0.5/24", "gateway": "10.0.0.1", "interface": 1},
                {"address": "fd00::5/64", "gateway": "fd00::1", "interface": 1},
                {"address": "192.168.7.7/32"},
            ]),
            json!([
                {"name": "tap0a1b2c3d-4e", "mac": "fe:16:3e:00:00:01"},
                {"name": "eth0", "mac": "fa:16:3e:12:34:56", "sandbox": "/var/run/netns/cni-1234"},
            ]),
            json!([{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}, {"dst": "fd00:1::/64"}]),
        )
    } else {
        (
            json!([
                {"address": "10.0.0.5/24", "gateway": "10.0.0.1", "interface": 1},
                {"address": "fd00::5/64", "gateway": "fd00::1", "interface": 1},
                {"address": "192.168.7.7/32"},
            ]),
            json!([
                {"name": "tap0a1b2c3d-4e", "mac": "fe:16:3e:00:00:01", "mtu": 1450},
                {
                    "name": "eth0", "mac": "fa:16:3e:12:34:56", "mtu": 1450,
                    "sandbox": "/var/run/netns/cni-1234", "socketPath": "/run/vhost/sock0", "pciID": "0000:00:05.0",
                },
            ]),
            json!([
                {"dst": "0.0.0.0/0", "gw": "10.0.0.1"},
                {"dst": "fd00:1::/64", "mtu": 1400, "advmss": 1360, "priority": 10, "table": 0, "scope": 253},
            ]),
        )
    };
    json!({"cniVersion": version, "interfaces": interfaces, "ips": ips, "routes": routes, "dns": dns_json()})
}

#[test]
fn renders_the_exact_layout_of_each_version() {
    for v in CniVersion::ALL {
        assert_eq!(sample().render(v), expected(v.as_str()), "{v}");
    }
}

/// What survives a trip through `version`: the 1.1.0-only fields are dropped before 1.1.0.
fn as_seen_in(version: CniVersion) -> CniResult {
    let mut r = sample();
    if !version.has_1_1_fields() {
        for i in &mut r.interfaces {
            i.mtu = None;
            i.socket_path = None;
            i.pci_id = None;
        }
        for rt in &mut r.routes {
            *rt = Route::new(rt.dst, rt.gw);
        }
    }
    r
}

#[test]
fn parses_every_layout_back() {
    for v in CniVersion::ALL {
        let parsed = CniResult::from_value(&sample().render(v)).unwrap();
        assert_eq!(parsed, as_seen_in(v), "{v}");
        let bytes = serde_json::to_vec(&sample().render(v)).unwrap();
        assert_eq!(CniResult::from_slice(&bytes).unwrap(), as_seen_in(v), "{v}");
    }
}

#[test]
fn converts_between_versions() {
    // A 0.4.0 prevResult rendered as 1.0.0 loses `version` and nothing else.
    let old = CniResult::from_value(&expected("0.4.0")).unwrap();
    assert_eq!(old.render(CniVersion::V1_0_0), expected("1.0.0"));
}

#[test]
fn empty_fields_are_left_out() {
    let r = CniResult {
        interfaces: vec![Interface {
            name: "eth0".into(),
            mac: Some(String::new()),
            mtu: Some(0),
            sandbox: None,
            socket_path: Some(String::new()),
            pci_id: None,
        }],
        dns: Dns { domain: Some(String::new()), ..Dns::default() },
        ..CniResult::default()
    };
    for v in CniVersion::ALL {
        assert_eq!(r.render(v), json!({"cniVersion": v.as_str(), "interfaces": [{"name": "eth0"}]}), "{v}");
    }
    assert_eq!(CniResult::default().render(CniVersion::V0_3_1), json!({"cniVersion": "0.3.1"}));
}

#[test]
fn parses_the_spec_example_prev_result() {
    let prev = json!({
        "ips": [{"version": "4", "address": "10.0.0.5/32", "interface": 2}],
        "interfaces": [
            {"name": "cni0", "mac": "00:11:22:33:44:55"},
            {"name": "veth3243", "mac": "55:44:33:22:11:11"},
            {"name": "eth0", "mac": "99:88:77:66:55:44", "sandbox": "/var/run/netns/blue"},
        ],
        "dns": {"nameservers": ["10.1.0.1"]},
        "someoneElsesField": {"ignored": true},
    });
    let r = CniResult::from_value(&prev).unwrap();
    assert_eq!(r.interfaces.len(), 3);
    assert_eq!(r.interfaces[2].sandbox.as_deref(), Some("/var/run/netns/blue"));
    assert_eq!(r.ips, vec![IpConfig { address: cidr("10.0.0.5/32"), gateway: None, interface: Some(2) }]);
    assert_eq!(r.dns.nameservers, vec!["10.1.0.1".to_string()]);
    // An IPAM-style result: no interfaces at all.
    let ipam = CniResult::from_value(&json!({"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.5/24"}]})).unwrap();
    assert_eq!(ipam.ips[0].interface, None);
    // Null fields and empty gateways read as absent.
    let nulls = json!({"interfaces": null, "ips": [{"address": "10.0.0.5/24", "gateway": ""}], "dns": null});
    assert_eq!(CniResult::from_value(&nulls).unwrap().ips[0].gateway, None);
}

#[test]
fn rejects_invalid_results() {
    let table = [
        (json!({"ips": [{"address": "10.0.0.5"}]}), "ips[0]: address"),
        (json!({"ips": [{"version": "6", "address": "10.0.0.5/24"}]}), "ips[0]: version \"6\""),
        (json!({"ips": [{"address": "10.0.0.5/24", "gateway": "fd00::1"}]}), "ips[0]: gateway: fd00::1 is IPv6"),
        (json!({"ips": [{"address": "10.0.0.5/24", "gateway": "nope"}]}), "ips[0]: gateway: \"nope\""),
        (json!({"ips": [{"address": "10.0.0.5/24", "interface": 0}]}), "interface index 0 is out of range"),
        (json!({"routes": [{"dst": "0.0.0.0/0", "gw": "fd00::1"}]}), "routes[0]: gw"),
        (json!({"routes": [{"gw": "10.0.0.1"}]}), "missing field `dst`"),
        (json!({"interfaces": [{"mac": "00:11:22:33:44:55"}]}), "missing field `name`"),
        (json!({"interfaces": [{"name": "eth0", "mtu": -1}]}), "invalid value"),
        (json!([]), "not a JSON object"),
        (json!([null, null, null, null]), "not a JSON object"),
        (json!({"ips": "x"}), "invalid type"),
    ];
    for (input, want) in table {
        let e = CniResult::from_value(&input).unwrap_err();
        assert!(e.to_string().contains(want), "{input}: {e}");
    }
    assert!(CniResult::from_slice(b"{").is_err());
}
