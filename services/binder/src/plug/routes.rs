//! Routes to other nodes' pod blocks (embedded backend): each block via its node's address,
//! programmed in the binder's own (node) namespace, plus IP forwarding so that the node routes
//! between its bridge and the network between nodes.
//!
//! The routes carry a protocol number of their own ([`ROUTE_PROTOCOL`]), so a restarted binder
//! finds the routes it programmed before and removes the stale ones without touching any other.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;

use super::PlugError;
use super::nl::in_netns;

/// The route protocol marking kuryr's node routes (`ip route show proto 75`). Values up to 4
/// belong to the kernel and the routing daemons registered in iproute2's rt_protos use others;
/// 75 ("K") is unassigned.
pub const ROUTE_PROTOCOL: u8 = 75;

/// Makes the node's kuryr routes exactly `desired`: adds or replaces those missing or changed,
/// deletes those no longer wanted. Returns (added or replaced, deleted).
pub async fn sync_node_routes(desired: BTreeSet<(IpNet, IpAddr)>) -> Result<(usize, usize), PlugError> {
    in_netns(None, move |nl| async move {
        let current = nl.routes_with_protocol(ROUTE_PROTOCOL).await?;
        let have: BTreeSet<(IpNet, IpAddr)> =
            current.iter().filter_map(|(r, _)| r.gw.map(|gw| (r.dst.trunc(), gw))).collect();
        let mut deleted = 0;
        for (r, msg) in current {
            let keep = r.gw.is_some_and(|gw| desired.contains(&(r.dst.trunc(), gw)));
            if !keep {
                nl.delete_route(msg, &r).await?;
                deleted += 1;
            }
        }
        let mut added = 0;
        for (dst, gw) in &desired {
            if !have.contains(&(dst.trunc(), *gw)) {
                nl.replace_route_via(*dst, *gw, ROUTE_PROTOCOL).await?;
                added += 1;
            }
        }
        Ok((added, deleted))
    })
    .await
}

/// Turns on IPv4 and IPv6 forwarding in the binder's namespace (the node's). Writing the sysctl
/// files affects the namespace of the writing process, which is the binder's.
pub fn enable_forwarding() -> Result<(), PlugError> {
    for (path, v) in [("/proc/sys/net/ipv4/ip_forward", "1"), ("/proc/sys/net/ipv6/conf/all/forwarding", "1")] {
        let cur = std::fs::read_to_string(path).unwrap_or_default();
        if cur.trim() != v {
            std::fs::write(path, v).map_err(|source| PlugError::Io { op: "enable IP forwarding", source })?;
        }
    }
    Ok(())
}

/// The route set wanted for other nodes' blocks: each CIDR via the first address of the same
/// family among that node's addresses. CIDRs with no address of their family are skipped.
pub fn desired_routes<'a>(
    nodes: impl IntoIterator<Item = (&'a [String], &'a [String])>,
) -> (BTreeSet<(IpNet, IpAddr)>, Vec<String>) {
    let mut out = BTreeSet::new();
    let mut skipped = Vec::new();
    for (node_ips, cidrs) in nodes {
        let ips: Vec<IpAddr> = node_ips.iter().filter_map(|s| s.parse().ok()).collect();
        for c in cidrs {
            let Ok(net) = c.parse::<IpNet>() else {
                skipped.push(format!("{c}: not a CIDR"));
                continue;
            };
            match ips.iter().find(|ip| ip.is_ipv4() == matches!(net, IpNet::V4(_))) {
                Some(gw) => {
                    out.insert((net.trunc(), *gw));
                }
                None => skipped.push(format!("{c}: the node has no address of that family")),
            }
        }
    }
    (out, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_pair_blocks_with_same_family_node_addresses() {
        let ips = vec!["172.30.0.11".to_string(), "fd00:30::11".to_string()];
        let cidrs = vec!["10.244.1.0/24".to_string(), "fd00:10:244::100/120".to_string(), "bogus".to_string()];
        let (set, skipped) = desired_routes([(ips.as_slice(), cidrs.as_slice())]);
        assert!(set.contains(&("10.244.1.0/24".parse().unwrap(), "172.30.0.11".parse().unwrap())));
        assert!(set.contains(&("fd00:10:244::100/120".parse().unwrap(), "fd00:30::11".parse().unwrap())));
        assert_eq!(skipped.len(), 1);
        let v4only = vec!["172.30.0.12".to_string()];
        let (set, skipped) = desired_routes([(v4only.as_slice(), cidrs[..2].as_ref())]);
        assert_eq!(set.len(), 1);
        assert_eq!(skipped.len(), 1, "{skipped:?}");
    }
}
