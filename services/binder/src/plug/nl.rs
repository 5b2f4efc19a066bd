//! Thin rtnetlink helpers used by the plugging code. Each [`Nl`] owns a netlink socket opened by
//! the current thread, so it works in whatever namespace that thread was in when it opened it;
//! [`in_netns`] runs a closure with such a socket for a given namespace, on a namespace worker
//! (`crate::netns`).
//!
//! A namespace worker keeps, between jobs, a current-thread runtime ([`block_on`]) and a
//! netlink socket in the binder's own namespace ([`host`]). A socket in a pod's namespace is
//! opened by a short visit there ([`Nl::open_in`]: enter, open, come back) and lives only as long
//! as the job ([`scoped`]), so no socket outlives its use and holds a pod's namespace alive.

use std::cell::{OnceCell, RefCell};
use std::fs::File;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use futures::future::Either;
use futures::{StreamExt as _, TryStreamExt};
use ipnet::IpNet;
use nix::errno::Errno;
use rtnetlink::packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_ECHO, NLM_F_EXCL, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags};
use rtnetlink::packet_route::link::{
    AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InfoBridgePort, InfoKind, InfoPortData, InfoPortKind, LinkAttribute,
    LinkFlags, LinkInfo, LinkMessage,
};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};

use super::{PlugError, Route};

/// Runs `f` with a netlink socket inside `netns` (the binder's own namespace for `None`), on a
/// namespace worker. The socket for `netns` is opened by a visit and closed when `f` is done;
/// the thread itself stays at home while `f` runs.
pub(crate) async fn in_netns<T, F, Fut>(netns: Option<PathBuf>, f: F) -> Result<T, PlugError>
where
    F: FnOnce(Nl) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, PlugError>>,
    T: Send + 'static,
{
    crate::netns::on_worker(move || {
        block_on(async move {
            match netns {
                None => f(host()?).await,
                Some(path) => {
                    let file = crate::netns::open(&path)?;
                    let (conn, nl) = Nl::open_in(&file, &path)?;
                    drop(file);
                    scoped(conn, f(nl)).await
                }
            }
        })
    })
    .await?
}

thread_local! {
    /// This thread's runtime for netlink work, built at first use and kept with the thread.
    static RUNTIME: OnceCell<tokio::runtime::Runtime> = const { OnceCell::new() };
    /// This thread's socket in the binder's own namespace, and the task driving it.
    static HOST: RefCell<Option<(Nl, tokio::task::JoinHandle<()>)>> = const { RefCell::new(None) };
}

/// Runs a future to completion on this thread's current-thread runtime (built at first use and
/// kept: a namespace worker reuses it for every job). Only for dedicated threads that are not
/// already inside a runtime.
pub(crate) fn block_on<T>(fut: impl Future<Output = Result<T, PlugError>>) -> Result<T, PlugError> {
    RUNTIME.with(|cell| {
        let rt = match cell.get() {
            Some(rt) => rt,
            None => {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|source| PlugError::Io { op: "build a runtime for netlink work", source })?;
                cell.get_or_init(|| rt)
            }
        };
        rt.block_on(fut)
    })
}

/// This thread's netlink socket in the binder's own namespace: opened at first use (inside
/// [`block_on`]) and kept, reopened if its connection ended. Refused when the thread is not in
/// the binder's namespace, so that it can never be opened anywhere else.
pub(crate) fn host() -> Result<Nl, PlugError> {
    HOST.with(|cell| {
        let mut cell = cell.borrow_mut();
        if let Some((nl, task)) = cell.as_ref()
            && !task.is_finished()
        {
            return Ok(nl.clone());
        }
        if !crate::netns::at_home() {
            return Err(PlugError::Io {
                op: "open a netlink socket in the binder's namespace",
                source: std::io::Error::other("the thread is not in the binder's network namespace"),
            });
        }
        let (conn, handle, _) =
            rtnetlink::new_connection().map_err(|source| PlugError::Io { op: "open a netlink socket", source })?;
        let nl = Nl { handle, label: "host".to_string() };
        *cell = Some((nl.clone(), tokio::spawn(conn)));
        Ok(nl)
    })
}

/// Drives `work` with the connection `conn` of its socket, and closes the socket when `work` is
/// done: the connection is dropped here, not left to a task.
pub(crate) async fn scoped<T>(
    conn: impl Future<Output = ()>,
    work: impl Future<Output = Result<T, PlugError>>,
) -> Result<T, PlugError> {
    match futures::future::select(std::pin::pin!(work), std::pin::pin!(conn)).await {
        Either::Left((r, _)) => r,
        Either::Right(((), _)) => Err(PlugError::Io {
            op: "keep a netlink socket open",
            source: std::io::Error::other("the netlink connection ended"),
        }),
    }
}

/// The `RTM_NEWLINK` message that turns hairpin mode on for the bridge port `index`.
/// `RTM_SETLINK` ignores port settings; `RTM_NEWLINK` on the existing link applies them.
pub(crate) fn hairpin_port(index: u32) -> LinkMessage {
    LinkUnspec::new_with_index(index).append_extra_attribute(hairpin()).build()
}

/// A Linux bridge port's data with hairpin mode on (frames may leave through the port they came
/// in on).
fn hairpin() -> LinkAttribute {
    LinkAttribute::LinkInfo(vec![
        LinkInfo::PortKind(InfoPortKind::Bridge),
        LinkInfo::PortData(InfoPortData::BridgePort(vec![InfoBridgePort::HairpinMode(true)])),
    ])
}

/// The `RTM_NEWLINK` message with a link's settings that the kernel does not take with its
/// creation: as a Linux bridge's port (`bridge_port`) hairpin mode (see `crate::lb::hairpin`), and,
/// when `no_link_local`, no IPv6 link-local address of the kernel's making (`addrgenmode none`).
/// `RTM_NEWLINK` on an existing link applies port data, then everything `RTM_SETLINK` does.
pub(crate) fn settings_message(index: u32, bridge_port: bool, no_link_local: bool) -> LinkMessage {
    let mut msg = LinkUnspec::new_with_index(index);
    if bridge_port {
        msg = msg.append_extra_attribute(hairpin());
    }
    if no_link_local {
        msg = msg.append_extra_attribute(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(vec![
            AfSpecInet6::AddrGenMode(In6AddrGenMode::None),
        ])]));
    }
    msg.build()
}

/// The IPv6 link-local address the kernel would give an interface with this MAC (modified
/// EUI-64, RFC 4291 appendix A), in `fe80::/64`.
pub(crate) fn link_local(mac: [u8; 6]) -> IpNet {
    let [a, b, c, d, e, f] = mac;
    let addr = Ipv6Addr::new(
        0xfe80,
        0,
        0,
        0,
        u16::from_be_bytes([a ^ 0x02, b]),
        u16::from_be_bytes([c, 0xff]),
        u16::from_be_bytes([0xfe, d]),
        u16::from_be_bytes([e, f]),
    );
    IpNet::V6(ipnet::Ipv6Net::new_assert(addr, 64))
}

/// The errno of a netlink error reply, if that is what the error is.
pub(crate) fn errno(e: &rtnetlink::Error) -> Option<Errno> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| Errno::from_raw(-c.get())),
        _ => None,
    }
}

/// A netlink connection in the namespace of the thread that opened it.
#[derive(Clone, Debug)]
pub(crate) struct Nl {
    handle: Handle,
    /// "host" or the namespace path, for error messages.
    label: String,
}

impl Nl {
    /// Opens a netlink socket in the current thread's namespace. Must be called inside a tokio
    /// runtime, which drives the connection.
    pub(crate) fn connect(label: String) -> Result<Self, PlugError> {
        let (conn, handle, _) =
            rtnetlink::new_connection().map_err(|source| PlugError::Io { op: "open a netlink socket", source })?;
        tokio::spawn(conn);
        Ok(Nl { handle, label })
    }

    /// Opens a netlink socket in the namespace open as `file` (from `path`): the thread enters it
    /// for the one call that creates the socket and comes back. Returns the connection to drive
    /// (see [`scoped`]) and the handle. Must be called inside a tokio runtime.
    pub(crate) fn open_in(file: &File, path: &Path) -> Result<(impl Future<Output = ()> + use<>, Self), PlugError> {
        let socket = crate::netns::visit(file, path, rtnetlink::new_connection)?;
        let (conn, handle, _) = socket.map_err(|source| PlugError::Io { op: "open a netlink socket", source })?;
        Ok((conn, Nl { handle, label: path.display().to_string() }))
    }

    /// Maps a netlink error to [`PlugError::Netlink`] naming `op` and this namespace.
    pub(crate) fn fail(&self, op: String) -> impl FnOnce(rtnetlink::Error) -> PlugError {
        let op = format!("{op} in {}", self.label);
        move |source| PlugError::Netlink { op, source }
    }

    /// The link called `name`, or `None`.
    pub(crate) async fn link(&self, name: &str) -> Result<Option<LinkMessage>, PlugError> {
        let mut links = self.handle.link().get().match_name(name).execute();
        match links.try_next().await {
            Ok(link) => Ok(link),
            Err(e) if errno(&e) == Some(Errno::ENODEV) => Ok(None),
            Err(e) => Err(self.fail(format!("look up link {name}"))(e)),
        }
    }

    /// The index of the link called `name`, or [`PlugError::LinkNotFound`].
    pub(crate) async fn require(&self, name: &str) -> Result<LinkMessage, PlugError> {
        self.link(name)
            .await?
            .ok_or_else(|| PlugError::LinkNotFound { netns: self.label.clone(), ifname: name.to_string() })
    }

    /// Names of all links.
    pub(crate) async fn link_names(&self) -> Result<Vec<String>, PlugError> {
        let links: Vec<LinkMessage> =
            self.handle.link().get().execute().try_collect().await.map_err(self.fail("list links".into()))?;
        Ok(links.iter().filter_map(link_name).map(str::to_string).collect())
    }

    /// Creates a link (`RTM_NEWLINK` with `NLM_F_EXCL`).
    pub(crate) async fn add_link(&self, msg: LinkMessage) -> Result<(), rtnetlink::Error> {
        self.handle.link().add(msg).execute().await
    }

    /// [`Nl::add_link`], asking the kernel to echo the link it created (`NLM_F_ECHO`, which
    /// Linux answers for `RTM_NEWLINK` since 6.3): the link as created, with its index, MAC and
    /// peer, without reading it back. `None` from a kernel that does not echo it.
    pub(crate) async fn add_link_echoed(&self, msg: LinkMessage) -> Result<Option<LinkMessage>, rtnetlink::Error> {
        let mut req = NetlinkMessage::from(RouteNetlinkMessage::NewLink(msg));
        req.header.flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL | NLM_F_ECHO;
        let mut handle = self.handle.clone();
        let mut answers = handle.request(req)?;
        let mut echoed = None;
        // The echo comes first; the stream ends with the kernel's acknowledgement.
        while let Some(answer) = answers.next().await {
            match answer.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => echoed = Some(link),
                NetlinkPayload::Error(e) => return Err(rtnetlink::Error::NetlinkError(e)),
                _ => {}
            }
        }
        Ok(echoed)
    }

    /// Deletes the link called `name`, by name (one request, no lookup); `Ok(false)` when there
    /// was none.
    pub(crate) async fn delete(&self, name: &str) -> Result<bool, PlugError> {
        let mut req = self.handle.link().del(0);
        req.message_mut().attributes.push(LinkAttribute::IfName(name.to_string()));
        match req.execute().await {
            Ok(()) => Ok(true),
            Err(e) if errno(&e) == Some(Errno::ENODEV) => Ok(false),
            Err(e) => Err(self.fail(format!("delete link {name}"))(e)),
        }
    }

    /// Brings a link up.
    pub(crate) async fn set_up(&self, index: u32, name: &str) -> Result<(), PlugError> {
        let msg = LinkUnspec::new_with_index(index).up().build();
        self.handle.link().set(msg).execute().await.map_err(self.fail(format!("bring {name} up")))
    }

    /// Brings link `index` up with no IPv6 link-local address of the kernel's making, and as a
    /// bridge port in hairpin mode ([`settings_message`]). The settings go first, in a request of
    /// their own, and the link comes up in the next: both are sent at once. (In one request the
    /// kernel brings the link up before it applies the IPv6 setting, and makes the address in
    /// between when the link's carrier is already on.) Returns whether the link has IPv6: a node
    /// without it (or a link whose MTU is too small for it) takes no IPv6 setting, and then only
    /// the port's are applied.
    pub(crate) async fn up_without_link_local(
        &self,
        index: u32,
        name: &str,
        bridge_port: bool,
    ) -> Result<bool, PlugError> {
        let settings = self.handle.link().set_port(settings_message(index, bridge_port, true)).execute();
        let (settings, up) = futures::join!(settings, self.set_up(index, name));
        up?;
        match settings {
            Ok(()) => Ok(true),
            Err(e) if errno(&e) == Some(Errno::EAFNOSUPPORT) => {
                if bridge_port {
                    let port = self.handle.link().set_port(settings_message(index, true, false));
                    port.execute().await.map_err(self.fail(format!("put bridge port {name} in hairpin mode")))?;
                }
                Ok(false)
            }
            Err(e) => Err(self.fail(format!("apply the settings of {name}"))(e)),
        }
    }

    /// Sets a link's MAC address. The kernel then keeps it as chosen: on a bridge this stops the
    /// address from following its ports (see [`super::attach::ensure_bridge`]).
    pub(crate) async fn set_mac(&self, index: u32, name: &str, mac: &[u8]) -> Result<(), PlugError> {
        let msg = LinkUnspec::new_with_index(index).address(mac.to_vec()).build();
        self.handle.link().set(msg).execute().await.map_err(self.fail(format!("set the MAC address of {name}")))
    }

    /// Adds an address; IPv6 ones without duplicate address detection so that they are usable
    /// at once (the address comes from IPAM, it is unique by construction). An identical address
    /// already present is fine.
    pub(crate) async fn add_address(&self, index: u32, name: &str, addr: IpNet) -> Result<(), PlugError> {
        let mut req = self.handle.address().add(index, addr.addr(), addr.prefix_len());
        if addr.addr().is_ipv6() {
            req.message_mut().attributes.push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        match req.execute().await {
            Err(e) if errno(&e) != Some(Errno::EEXIST) => Err(self.fail(format!("add address {addr} to {name}"))(e)),
            _ => Ok(()),
        }
    }

    /// The addresses on a link, all scopes.
    pub(crate) async fn addresses(&self, index: u32) -> Result<Vec<IpNet>, PlugError> {
        let msgs: Vec<_> = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(self.fail(format!("list addresses of link {index}")))?;
        Ok(msgs
            .iter()
            .filter_map(|m| {
                // For IPv4, IFA_LOCAL is the interface's own address (IFA_ADDRESS the peer's on
                // point-to-point links); IPv6 only sends IFA_ADDRESS.
                let local = m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Local(ip) => Some(*ip),
                    _ => None,
                });
                let addr = m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(ip) => Some(*ip),
                    _ => None,
                });
                IpNet::new(local.or(addr)?, m.header.prefix_len).ok()
            })
            .collect())
    }

    /// Adds a route out of the link; on-link (scope link) without a gateway. An identical route
    /// already present (e.g. the kernel's connected route) is fine.
    pub(crate) async fn add_route(&self, index: u32, name: &str, route: &Route) -> Result<(), PlugError> {
        let dst = route.dst.trunc();
        let scope = if route.gw.is_some() { RouteScope::Universe } else { RouteScope::Link };
        let msg = match (dst, route.gw) {
            (IpNet::V4(d), gw) => {
                let b = RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(d.addr(), d.prefix_len());
                match gw {
                    Some(IpAddr::V4(gw)) => b.gateway(gw),
                    _ => b,
                }
                .output_interface(index)
                .scope(scope)
                .build()
            }
            (IpNet::V6(d), gw) => {
                let b = RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(d.addr(), d.prefix_len());
                match gw {
                    Some(IpAddr::V6(gw)) => b.gateway(gw),
                    _ => b,
                }
                .output_interface(index)
                .scope(scope)
                .build()
            }
        };
        match self.handle.route().add(msg).execute().await {
            Err(e) if errno(&e) != Some(Errno::EEXIST) => Err(self.fail(format!("add route {route} dev {name}"))(e)),
            _ => Ok(()),
        }
    }

    /// Adds or replaces a main-table route to `dst` via `gw`, marked with `protocol` so that its
    /// owner can find its routes again (after a restart, say) without touching anyone else's.
    pub(crate) async fn replace_route_via(&self, dst: IpNet, gw: IpAddr, protocol: u8) -> Result<(), PlugError> {
        let dst = dst.trunc();
        let proto = RouteProtocol::from(protocol);
        let msg = match (dst, gw) {
            (IpNet::V4(d), IpAddr::V4(g)) => RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(d.addr(), d.prefix_len())
                .gateway(g)
                .protocol(proto)
                .build(),
            (IpNet::V6(d), IpAddr::V6(g)) => RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(d.addr(), d.prefix_len())
                .gateway(g)
                .protocol(proto)
                .build(),
            _ => return Err(PlugError::InvalidSpec(format!("route {dst} via {gw}: address families differ"))),
        };
        self.handle
            .route()
            .add(msg)
            .replace()
            .execute()
            .await
            .map_err(self.fail(format!("replace route {dst} via {gw}")))
    }

    /// Main-table routes carrying `protocol`, with their raw messages for deletion.
    pub(crate) async fn routes_with_protocol(&self, protocol: u8) -> Result<Vec<(Route, RouteMessage)>, PlugError> {
        Ok(self
            .all_routes()
            .await?
            .into_iter()
            .filter(|m| m.header.protocol == RouteProtocol::from(protocol))
            .filter_map(|m| Some((route_of(&m)?, m)))
            .collect())
    }

    /// Every IPv4 and IPv6 route the kernel lists (all tables).
    async fn all_routes(&self) -> Result<Vec<RouteMessage>, PlugError> {
        let mut out = Vec::new();
        for query in [RouteMessageBuilder::<Ipv4Addr>::new().build(), RouteMessageBuilder::<Ipv6Addr>::new().build()] {
            let msgs: Vec<RouteMessage> = self
                .handle
                .route()
                .get(query)
                .execute()
                .try_collect()
                .await
                .map_err(self.fail("list routes".into()))?;
            out.extend(msgs);
        }
        Ok(out)
    }

    /// Deletes a route given its message; gone already is fine.
    pub(crate) async fn delete_route(&self, msg: RouteMessage, what: &Route) -> Result<(), PlugError> {
        match self.handle.route().del(msg).execute().await {
            Err(e) if errno(&e) != Some(Errno::ESRCH) => Err(self.fail(format!("delete route {what}"))(e)),
            _ => Ok(()),
        }
    }

    /// The routes out of the link that someone configured: main table, unicast, not added by
    /// the kernel itself (connected subnets, fe80::/64, multicast live in other tables or carry
    /// `proto kernel`).
    pub(crate) async fn routes(&self, index: u32) -> Result<Vec<Route>, PlugError> {
        Ok(self.route_messages(index).await?.iter().filter_map(route_of).collect())
    }

    async fn route_messages(&self, index: u32) -> Result<Vec<RouteMessage>, PlugError> {
        let mut out = self.all_routes().await?;
        out.retain(|m| {
            let table = m.attributes.iter().find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            });
            let main = table.unwrap_or(u32::from(m.header.table)) == u32::from(RouteHeader::RT_TABLE_MAIN);
            let oif = m.attributes.iter().any(|a| matches!(a, RouteAttribute::Oif(i) if *i == index));
            main && oif && m.header.kind == RouteType::Unicast && m.header.protocol != RouteProtocol::Kernel
        });
        Ok(out)
    }
}

/// A link message's name.
pub(crate) fn link_name(link: &LinkMessage) -> Option<&str> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.as_str()),
        _ => None,
    })
}

/// A link message's hardware address.
pub(crate) fn link_mac(link: &LinkMessage) -> Option<&[u8]> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::Address(mac) => Some(mac.as_slice()),
        _ => None,
    })
}

/// The index of a veth's peer (`IFLA_LINK`, in the peer's namespace), when the kernel reports
/// it: it leaves it out when it equals the link's own index.
pub(crate) fn link_peer(link: &LinkMessage) -> Option<u32> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::Link(i) => Some(*i),
        _ => None,
    })
}

/// A link message's MTU.
pub(crate) fn link_mtu(link: &LinkMessage) -> Option<u32> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::Mtu(m) => Some(*m),
        _ => None,
    })
}

/// Whether the link is administratively up.
pub(crate) fn link_up(link: &LinkMessage) -> bool {
    link.header.flags.contains(LinkFlags::Up)
}

/// The link's kind (`veth`, `bridge`, ...), if it has one.
pub(crate) fn link_kind(link: &LinkMessage) -> Option<&InfoKind> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
            LinkInfo::Kind(k) => Some(k),
            _ => None,
        }),
        _ => None,
    })
}

/// Destination and gateway of a route message.
fn route_of(m: &RouteMessage) -> Option<Route> {
    let ip = |a: &RouteAddress| match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    };
    let dst = m.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(d) => ip(d),
        _ => None,
    });
    let dst = match (dst, m.header.address_family) {
        (Some(d), _) => d,
        (None, rtnetlink::packet_route::AddressFamily::Inet6) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        (None, _) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    let gw = m.attributes.iter().find_map(|a| match a {
        RouteAttribute::Gateway(g) => ip(g),
        _ => None,
    });
    Some(Route { dst: IpNet::new(dst, m.header.destination_prefix_length).ok()?, gw })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_local_address_is_the_modified_eui64_of_the_mac() {
        // The universal/local bit flipped, ff:fe in the middle.
        assert_eq!(link_local([0x52, 0x54, 0x00, 0x12, 0x34, 0x56]).to_string(), "fe80::5054:ff:fe12:3456/64");
        assert_eq!(link_local([0x00, 0x00, 0x00, 0x00, 0x00, 0x01]).to_string(), "fe80::200:ff:fe00:1/64");
    }

    #[test]
    fn the_settings_message_carries_only_what_is_asked() {
        let has = |m: &LinkMessage, f: fn(&LinkAttribute) -> bool| m.attributes.iter().any(f);
        let port = |a: &LinkAttribute| matches!(a, LinkAttribute::LinkInfo(_));
        let af = |a: &LinkAttribute| matches!(a, LinkAttribute::AfSpecUnspec(_));
        let full = settings_message(7, true, true);
        assert_eq!(full.header.index, 7);
        assert!(has(&full, port) && has(&full, af));
        // Settings only: bringing the link up is a request of its own, after them.
        assert!(full.header.change_mask.is_empty() && full.header.flags.is_empty());
        assert!(!has(&settings_message(7, false, true), port));
        assert!(!has(&settings_message(7, true, false), af));
    }
}
