//! Hairpin mode on the pods' bridge ports, so that a pod can reach a Service whose chosen member
//! is the pod itself, or its own host port. It runs whether or not the binder programs Services.
//!
//! Where `br_netfilter` is loaded (kubeadm nodes require it), a pod's packet to a VIP is DNAT'd
//! while it is still being bridged, and when the new destination sits behind the same bridge the
//! frame is bridged on to it instead of routed. For a pod talking to itself that means sending
//! the frame back out the port it came in on, which a bridge only does for ports in hairpin
//! mode; otherwise it is dropped. The masquerade of [`super::render()`] then makes the reply come
//! back through the node. Without `br_netfilter` hairpin mode changes nothing.
//!
//! The binder puts each port it plugs into hairpin mode as part of the ADD (`crate::plug`), so a
//! pod can reach itself from its first packet. This task covers the ports it did not plug: those
//! of pods plugged before the binder started (by an older version, or before a restart that lost
//! the setting with a recreated bridge). It sweeps every port of the bridges the VIFs of this
//! node use — found by their controller — when the binder starts and whenever that set of
//! bridges changes, not after every change of the VIF cache: a sweep reads every link of the
//! node, and a node with a hundred pods would otherwise read them all for each pod event.

use std::collections::BTreeSet;

use futures::TryStreamExt;
use kuryr_proto::allocator::v1::BindingDriver;
use kuryr_runtime::Shutdown;
use nix::errno::Errno;
use rtnetlink::packet_route::link::{InfoBridgePort, InfoPortData, LinkAttribute, LinkInfo, LinkMessage};

use crate::vifs::VifCache;

/// Runs until shutdown: whenever the set of bridges the VIF cache's VIFs use changes (at start,
/// once the first VIFs are known), puts every port of those bridges that is not yet in hairpin
/// mode into it. A sweep that fails is tried again with the next change of the cache.
pub async fn run(cache: VifCache, shutdown: Shutdown) {
    let (conn, handle, _) = match rtnetlink::new_connection() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot open a netlink socket; hairpin mode not managed");
            return;
        }
    };
    tokio::spawn(conn);
    let mut rx = cache.subscribe();
    let mut swept = BTreeSet::new();
    loop {
        let bridges = bridges(&cache);
        if bridges != swept {
            // No bridge left (no VIF on one): nothing to read the links for.
            match if bridges.is_empty() { Ok(()) } else { ensure(&handle, &bridges).await } {
                Ok(()) => swept = bridges,
                Err(e) => tracing::warn!(error = %e, "setting hairpin mode on bridge ports failed"),
            }
        }
        tokio::select! {
            r = rx.changed() => if r.is_err() { return },
            () = shutdown.clone().wait() => return,
        }
    }
}

/// The Linux bridges the cached VIFs are plugged into.
fn bridges(cache: &VifCache) -> BTreeSet<String> {
    cache.filter_map(|v| {
        v.binding
            .as_ref()
            .filter(|b| b.driver() == BindingDriver::Bridge && !b.bridge.is_empty())
            .map(|b| b.bridge.clone())
    })
}

fn name(link: &LinkMessage) -> Option<&str> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.as_str()),
        _ => None,
    })
}

fn controller(link: &LinkMessage) -> Option<u32> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::Controller(c) => Some(*c),
        _ => None,
    })
}

/// Whether a bridge port's link carries hairpin mode on.
fn hairpin(link: &LinkMessage) -> bool {
    link.attributes.iter().any(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().any(|i| match i {
            LinkInfo::PortData(InfoPortData::BridgePort(attrs)) => {
                attrs.iter().any(|x| matches!(x, InfoBridgePort::HairpinMode(true)))
            }
            _ => false,
        }),
        _ => false,
    })
}

async fn ensure(handle: &rtnetlink::Handle, bridges: &BTreeSet<String>) -> Result<(), rtnetlink::Error> {
    let links: Vec<LinkMessage> = handle.link().get().execute().try_collect().await?;
    let wanted: BTreeSet<u32> =
        links.iter().filter(|l| name(l).is_some_and(|n| bridges.contains(n))).map(|l| l.header.index).collect();
    for link in links.iter().filter(|l| controller(l).is_some_and(|c| wanted.contains(&c)) && !hairpin(l)) {
        let msg = crate::plug::hairpin_port(link.header.index);
        match handle.link().set_port(msg).execute().await {
            Ok(()) => tracing::debug!(port = name(link), "hairpin mode on"),
            // The port went away meanwhile (the pod was deleted).
            Err(rtnetlink::Error::NetlinkError(e))
                if e.code.map(|c| Errno::from_raw(-c.get())) == Some(Errno::ENODEV) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
