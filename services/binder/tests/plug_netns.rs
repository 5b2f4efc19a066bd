//! The plugging layer against the real kernel: network namespaces made with `ip netns add`, veth
//! pairs, a Linux bridge. Needs root; everything it creates carries this process's id and is
//! removed by guards, also when an assertion fails.

mod common;

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use common::*;
use ipnet::IpNet;
use kuryr_binder::plug::{self, BindingDriver, IpConfig, PlugError, PlugSpec, Route};

fn net(s: &str) -> IpNet {
    s.parse().expect("a CIDR")
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an IP address")
}

/// One test's subnet pair, distinct per process so that concurrent runs do not overlap.
struct Subnets {
    v4: String,
    v6: String,
}

impl Subnets {
    fn new() -> Self {
        // From 1: `fd00:…:0::1` would be printed `fd00:…::1`, and the addresses' checks miss it.
        static NEXT: AtomicU32 = AtomicU32::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        Subnets { v4: format!("10.{}.{}", 100 + pid % 100, n % 256), v6: format!("fd00:{:x}:{n:x}", pid % 0xffff) }
    }

    fn gw4(&self) -> String {
        format!("{}.1", self.v4)
    }

    fn gw6(&self) -> String {
        format!("{}::1", self.v6)
    }
}

fn spec(ns: &Netns, nets: &Subnets, host_octet: u8, driver: BindingDriver) -> PlugSpec {
    let container_id = format!("{}-{host_octet}", ns.name);
    PlugSpec {
        host_ifname: plug::host_ifname(&container_id, "eth0"),
        container_id,
        netns: ns.path(),
        ifname: "eth0".into(),
        mac: format!("02:42:ac:{:02x}:00:{host_octet:02x}", std::process::id() % 256),
        mtu: 1400,
        ips: vec![
            IpConfig { address: net(&format!("{}.{host_octet}/24", nets.v4)), gateway: Some(ip(&nets.gw4())) },
            IpConfig { address: net(&format!("{}::{host_octet:x}/64", nets.v6)), gateway: Some(ip(&nets.gw6())) },
        ],
        routes: vec![],
        driver,
    }
}

/// Two pods' namespaces and specs (octets `octet` and `octet + 1`, each changed by `tweak`) on a
/// bridge of their own; the host links are removed when it is dropped.
struct TwoPods {
    links: HostLinks,
    a: Netns,
    b: Netns,
    bridge: String,
    nets: Subnets,
    driver: BindingDriver,
    spec_a: PlugSpec,
    spec_b: PlugSpec,
}

fn two_pods(bridge_prefix: &str, octet: u8, tweak: fn(&mut PlugSpec)) -> TwoPods {
    let (a, b) = (Netns::new("kt-"), Netns::new("kt-"));
    let bridge = unique(bridge_prefix);
    let nets = Subnets::new();
    let driver = BindingDriver::Bridge { bridge: bridge.clone() };
    let (mut spec_a, mut spec_b) = (spec(&a, &nets, octet, driver.clone()), spec(&b, &nets, octet + 1, driver.clone()));
    tweak(&mut spec_a);
    tweak(&mut spec_b);
    let links = HostLinks(vec![bridge.clone(), spec_a.host_ifname.clone(), spec_b.host_ifname.clone()]);
    TwoPods { links, a, b, bridge, nets, driver, spec_a, spec_b }
}

/// A missing prerequisite fails the test with the reason; it never passes without running.
macro_rules! require_root {
    () => {
        assert!(is_root(), "prerequisite missing: these tests need root for network namespaces");
    };
}

#[tokio::test]
async fn two_pods_on_a_bridge_talk_over_ipv4_and_ipv6() {
    require_root!();
    let TwoPods { links: _links, a, b, bridge, nets, driver, spec_a, spec_b } = two_pods("ktb", 10, |_| {});

    let gateways = spec_a.gateway_addresses();
    plug::ensure_bridge(&bridge, &gateways).await.unwrap();
    plug::ensure_bridge(&bridge, &gateways).await.expect("ensure_bridge is idempotent");
    let br = ok("ip", &["addr", "show", "dev", &bridge]);
    assert!(br.contains(&format!("{}/24", nets.gw4())) && br.contains(&format!("{}/64", nets.gw6())), "{br}");

    let plugged_a = plug::plug(&spec_a, None).await.unwrap();
    let plugged_b = plug::plug(&spec_b, None).await.unwrap();
    assert_eq!(plugged_b.sandbox_mac, spec_b.mac);
    assert_eq!(plugged_a.sandbox_mac, spec_a.mac);
    assert_eq!(
        (plugged_a.host_ifname.as_str(), plugged_a.sandbox_ifname.as_str()),
        (spec_a.host_ifname.as_str(), "eth0")
    );
    assert_eq!(plugged_a.mtu, 1400);
    assert_eq!(plugged_a.sandbox, a.path());
    assert_ne!(plugged_a.host_mac, plugged_a.sandbox_mac);

    // What the kernel says, through iproute2.
    let (_, link) = a.ip(&["link", "show", "dev", "eth0"]);
    assert!(link.contains(&format!("link/ether {}", spec_a.mac)), "{link}");
    assert!(link.contains("mtu 1400") && link.contains("state UP"), "{link}");
    let (_, lo) = a.ip(&["link", "show", "dev", "lo"]);
    assert!(lo.contains(",UP"), "lo is not up: {lo}");
    let (_, addrs) = a.ip(&["addr", "show", "dev", "eth0"]);
    assert!(addrs.contains(&format!("inet {}.10/24", nets.v4)), "{addrs}");
    assert!(addrs.contains(&format!("inet6 {}::a/64", nets.v6)), "{addrs}");
    assert!(!addrs.contains("tentative"), "IPv6 address still under DAD: {addrs}");
    // The link-local address is the one the kernel would make from the MAC, and usable at once.
    let link_local = eui64_link_local(&spec_a.mac);
    assert!(addrs.contains(&format!("inet6 {link_local}/64 scope link nodad")), "{addrs}");
    assert_eq!(addrs.matches("scope link").count(), 1, "one link-local address: {addrs}");
    let (_, routes4) = a.ip(&["route", "show"]);
    assert!(routes4.contains(&format!("default via {} dev eth0", nets.gw4())), "{routes4}");
    let (_, routes6) = a.ip(&["-6", "route", "show"]);
    assert!(routes6.contains(&format!("default via {} dev eth0", nets.gw6())), "{routes6}");
    let host = ok("ip", &["link", "show", "dev", &spec_a.host_ifname]);
    assert!(
        host.contains(&format!("master {bridge}")) && host.contains("mtu 1400") && host.contains("state UP"),
        "{host}"
    );
    // The host end has no IPv6 of its own: no address, none to be made when it comes up.
    let host6 = ok("ip", &["-6", "addr", "show", "dev", &spec_a.host_ifname]);
    assert!(!host6.contains("inet6"), "{host6}");
    let host_details = ok("ip", &["-d", "link", "show", "dev", &spec_a.host_ifname]);
    assert!(host_details.contains("addrgenmode none"), "{host_details}");
    // In hairpin mode as plugged (a pod may reach itself through a Service): no sweep runs here.
    let port = ok("bridge", &["-d", "link", "show", "dev", &spec_a.host_ifname]);
    assert!(port.contains("hairpin on"), "{port}");
    // The host end's MAC as reported (from the kernel's echo of the creation) is the kernel's.
    assert_eq!(plugged_a.host_mac, link_mac(&spec_a.host_ifname), "host end MAC");

    // Traffic: pod to pod in both families, pod to gateway.
    let (pinged, out) = a.ping(&[&format!("{}.11", nets.v4)]);
    assert!(pinged, "IPv4 ping a -> b failed: {out}");
    let (pinged, out) = b.ping(&["-6", &format!("{}::a", nets.v6)]);
    assert!(pinged, "IPv6 ping b -> a failed: {out}");
    let (pinged, out) = a.ping(&[&nets.gw4()]);
    assert!(pinged, "IPv4 ping a -> gateway failed: {out}");
    let (pinged, out) = b.ping(&["-6", &format!("{link_local}%eth0")]);
    assert!(pinged, "IPv6 link-local ping b -> a failed: {out}");

    // CHECK: clean, then a removed default route is named.
    let observed = plug::inspect(a.path(), "eth0").await.unwrap();
    assert_eq!(plug::diff(&spec_a, &observed), Vec::<String>::new(), "{observed:?}");
    assert!(observed.up);
    a.ip(&["route", "del", "default"]);
    let observed = plug::inspect(a.path(), "eth0").await.unwrap();
    assert_eq!(plug::diff(&spec_a, &observed), vec![format!("missing route 0.0.0.0/0 via {}", nets.gw4())]);
    a.ip(&["link", "set", "eth0", "mtu", "1300"]);
    let observed = plug::inspect(a.path(), "eth0").await.unwrap();
    assert!(plug::diff(&spec_a, &observed).contains(&"MTU 1400 != 1300".to_string()));
    assert!(matches!(plug::inspect(a.path(), "eth9").await, Err(PlugError::LinkNotFound { .. })));

    // GC support.
    let listed = plug::list_host_links(plug::HOST_IFNAME_PREFIX).await.unwrap();
    assert!(listed.contains(&spec_a.host_ifname) && listed.contains(&spec_b.host_ifname), "{listed:?}");
    assert!(plug::link_exists(Some(a.path()), "eth0").await.unwrap());
    assert!(plug::link_exists(None, &spec_a.host_ifname).await.unwrap());

    // DEL, twice; then with the namespace gone and with an empty path.
    for _ in 0..2 {
        plug::unplug(Some(a.path()), "eth0", &spec_a.host_ifname, &driver, None).await.unwrap();
    }
    assert!(!host_link_exists(&spec_a.host_ifname));
    assert!(!a.ip(&["link", "show", "dev", "eth0"]).0);
    let b_path = b.path();
    drop(b);
    plug::unplug(Some(b_path.clone()), "eth0", &spec_b.host_ifname, &driver, None).await.unwrap();
    plug::unplug(Some(PathBuf::new()), "eth0", &spec_b.host_ifname, &driver, None).await.unwrap();
    assert!(!host_link_exists(&spec_b.host_ifname));
    assert!(matches!(plug::link_exists(Some(b_path), "eth0").await, Err(PlugError::NetnsMissing { .. })));
}

#[tokio::test]
async fn an_ifname_already_present_is_refused_and_leaves_nothing() {
    require_root!();
    let a = Netns::new("kt-");
    let bridge = unique("ktb");
    let nets = Subnets::new();
    let driver = BindingDriver::Bridge { bridge: bridge.clone() };
    let first = spec(&a, &nets, 20, driver.clone());
    let second = spec(&a, &nets, 21, driver.clone());
    let _links = HostLinks(vec![bridge.clone(), first.host_ifname.clone(), second.host_ifname.clone()]);
    plug::plug(&first, None).await.unwrap();

    let err = plug::plug(&second, None).await.unwrap_err();
    assert!(matches!(&err, PlugError::IfnameExists { ifname, .. } if ifname == "eth0"), "{err:?}");
    assert!(err.to_string().contains("eth0"), "{err}");
    assert!(!host_link_exists(&second.host_ifname), "a host end was left behind");
    // The first pod is untouched.
    let observed = plug::inspect(a.path(), "eth0").await.unwrap();
    assert_eq!(plug::diff(&first, &observed), Vec::<String>::new());
}

#[tokio::test]
async fn a_missing_netns_is_its_own_error_and_leaves_nothing() {
    require_root!();
    let nets = Subnets::new();
    let gone = Netns::new("kt-");
    let bridge = unique("ktb");
    let spec = spec(&gone, &nets, 30, BindingDriver::Bridge { bridge: bridge.clone() });
    let _links = HostLinks(vec![bridge, spec.host_ifname.clone()]);
    drop(gone);

    let err = plug::plug(&spec, None).await.unwrap_err();
    assert!(matches!(&err, PlugError::NetnsMissing { netns } if *netns == spec.netns), "{err:?}");
    assert!(err.is_netns_gone());
    assert!(!host_link_exists(&spec.host_ifname));
}

#[tokio::test]
async fn a_failure_part_way_rolls_everything_back() {
    require_root!();
    let a = Netns::new("kt-");
    let bridge = unique("ktb");
    let not_a_bridge = unique("ktv");
    let nets = Subnets::new();
    let mut unreachable = spec(&a, &nets, 40, BindingDriver::Bridge { bridge: bridge.clone() });
    // A gateway outside every connected subnet: the kernel refuses the route, after the veth,
    // the addresses and the default routes are in place.
    unreachable.routes.push(Route { dst: net("198.51.100.0/24"), gw: Some(ip("192.0.2.1")) });
    let bad_bridge = spec(&a, &nets, 41, BindingDriver::Bridge { bridge: not_a_bridge.clone() });
    let _links = HostLinks(vec![
        bridge,
        not_a_bridge.clone(),
        format!("{not_a_bridge}p"),
        unreachable.host_ifname.clone(),
        bad_bridge.host_ifname.clone(),
    ]);

    let err = plug::plug(&unreachable, None).await.unwrap_err();
    assert!(
        matches!(&err, PlugError::Netlink { op, .. } if op.contains("add route 198.51.100.0/24 via 192.0.2.1")),
        "{err:?}"
    );
    assert!(!host_link_exists(&unreachable.host_ifname), "rollback left the host end");
    assert!(!a.ip(&["link", "show", "dev", "eth0"]).0, "rollback left the pod end");

    // The last step fails: the "bridge" is a veth.
    ok("ip", &["link", "add", &not_a_bridge, "type", "veth", "peer", "name", &format!("{not_a_bridge}p")]);
    let err = plug::plug(&bad_bridge, None).await.unwrap_err();
    assert!(matches!(&err, PlugError::NotABridge(name) if *name == not_a_bridge), "{err:?}");
    assert!(!host_link_exists(&bad_bridge.host_ifname), "rollback left the host end");
    assert!(!a.ip(&["link", "show", "dev", "eth0"]).0, "rollback left the pod end");

    // Invalid requests fail before touching anything.
    let mut bad_mac = unreachable.clone();
    bad_mac.mac = "not-a-mac".into();
    assert!(matches!(plug::plug(&bad_mac, None).await, Err(PlugError::InvalidSpec(_))));
}

#[tokio::test]
async fn a_stale_host_end_from_an_interrupted_add_is_replaced() {
    require_root!();
    let a = Netns::new("kt-");
    let bridge = unique("ktb");
    let nets = Subnets::new();
    let spec = spec(&a, &nets, 50, BindingDriver::Bridge { bridge: bridge.clone() });
    let _links = HostLinks(vec![bridge, spec.host_ifname.clone(), format!("{}p", spec.host_ifname)]);
    ok("ip", &["link", "add", &spec.host_ifname, "type", "veth", "peer", "name", &format!("{}p", spec.host_ifname)]);

    plug::plug(&spec, None).await.unwrap();
    let observed = plug::inspect(a.path(), "eth0").await.unwrap();
    assert_eq!(plug::diff(&spec, &observed), Vec::<String>::new());
    assert!(!host_link_exists(&format!("{}p", spec.host_ifname)), "the stale pair was not removed");
    plug::unplug(Some(a.path()), "eth0", &spec.host_ifname, &spec.driver, None).await.unwrap();
    assert!(!host_link_exists(&spec.host_ifname));
}

/// The modified EUI-64 link-local address of `mac` (RFC 4291, appendix A), as iproute2 prints it.
fn eui64_link_local(mac: &str) -> String {
    let b: Vec<u8> = mac.split(':').map(|x| u8::from_str_radix(x, 16).expect("a MAC")).collect();
    let groups = [
        u16::from_be_bytes([b[0] ^ 0x02, b[1]]),
        u16::from_be_bytes([b[2], 0xff]),
        u16::from_be_bytes([0xfe, b[3]]),
        u16::from_be_bytes([b[4], b[5]]),
    ];
    std::net::Ipv6Addr::new(0xfe80, 0, 0, 0, groups[0], groups[1], groups[2], groups[3]).to_string()
}

/// A link whose MTU is too small for IPv6 has no IPv6 settings to take: the pod's end (IPv4
/// only) is brought up without them, with no link-local address, and works.
#[tokio::test]
async fn a_link_too_small_for_ipv6_is_plugged_without_it() {
    require_root!();
    let v4_only = |s: &mut PlugSpec| {
        s.mtu = 1200;
        s.ips.retain(|c| c.address.addr().is_ipv4());
    };
    let TwoPods { links: _links, a, b, bridge, nets, driver, spec_a, spec_b } = two_pods("ktv", 20, v4_only);
    plug::ensure_bridge(&bridge, &spec_a.gateway_addresses()).await.unwrap();
    plug::plug(&spec_a, None).await.unwrap();
    plug::plug(&spec_b, None).await.unwrap();
    let (_, link) = a.ip(&["link", "show", "dev", "eth0"]);
    assert!(link.contains("mtu 1200") && link.contains("state UP"), "{link}");
    let (_, addrs) = a.ip(&["addr", "show", "dev", "eth0"]);
    assert!(addrs.contains(&format!("inet {}.20/24", nets.v4)) && !addrs.contains("inet6"), "{addrs}");
    let host = ok("ip", &["link", "show", "dev", &spec_a.host_ifname]);
    assert!(host.contains("state UP") && host.contains(&format!("master {bridge}")), "{host}");
    let (pinged, out) = a.ping(&[&format!("{}.21", nets.v4)]);
    assert!(pinged, "IPv4 ping a -> b failed: {out}");
    for (ns, s) in [(&a, &spec_a), (&b, &spec_b)] {
        plug::unplug(Some(ns.path()), "eth0", &s.host_ifname, &driver, None).await.unwrap();
    }
}

/// The bridge's MAC address, from iproute2.
fn link_mac(name: &str) -> String {
    let out = ok("ip", &["-o", "link", "show", "dev", name]);
    let mac = out.split_whitespace().skip_while(|w| *w != "link/ether").nth(1);
    mac.unwrap_or_else(|| panic!("no MAC in {out}")).to_string()
}

/// The bridge's MAC is the pods' gateway MAC, cached in their neighbour tables: it must not
/// follow the ports as pods come and go (a Linux bridge whose address was never set takes its
/// lowest port MAC). Also for a bridge that existed before the binder, e.g. one a binder without
/// this guarantee made.
#[tokio::test]
async fn the_bridge_keeps_its_mac_while_pods_come_and_go() {
    require_root!();
    for existing in [false, true] {
        let TwoPods { links: _links, a, b, bridge, driver, spec_a, spec_b, .. } = two_pods("ktm", 60, |_| {});
        if existing {
            ok("ip", &["link", "add", &bridge, "type", "bridge"]);
        }
        plug::ensure_bridge(&bridge, &spec_a.gateway_addresses()).await.unwrap();
        let mac = link_mac(&bridge);
        plug::plug(&spec_a, None).await.unwrap();
        assert_eq!(link_mac(&bridge), mac, "plugging a pod changed the bridge's MAC (existing bridge: {existing})");
        plug::plug(&spec_b, None).await.unwrap();
        assert_eq!(link_mac(&bridge), mac, "plugging a second pod changed the bridge's MAC");
        plug::unplug(Some(a.path()), "eth0", &spec_a.host_ifname, &driver, None).await.unwrap();
        assert_eq!(link_mac(&bridge), mac, "unplugging a pod changed the bridge's MAC");
        plug::unplug(Some(b.path()), "eth0", &spec_b.host_ifname, &driver, None).await.unwrap();
        assert_eq!(link_mac(&bridge), mac, "the bridge's MAC changed once empty");
    }
}
