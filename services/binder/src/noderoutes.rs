//! Keeps the node's routes to other nodes' pod blocks in step with the NODE_ROUTES events of the
//! VIF stream (embedded backend: cross-node reachability without an overlay).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use kuryr_runtime::Shutdown;

use crate::plug::routes::{desired_routes, enable_forwarding, sync_node_routes};
use crate::vifs::VifCache;

/// Runs until shutdown: after every change of the cache, recomputes the wanted routes and, when
/// they differ from what was last programmed, makes the kernel's match. A failed sync is retried.
pub async fn run(cache: VifCache, node: String, shutdown: Shutdown) {
    let mut rx = cache.subscribe();
    let mut applied: Option<BTreeSet<(IpNet, IpAddr)>> = None;
    loop {
        let nodes = cache.node_routes();
        // Only program routes from a complete view: during a resync (after RESET) the set is partial.
        if cache.is_live() {
            let others: Vec<_> = nodes.iter().filter(|n| n.node_name != node).collect();
            let (desired, skipped) = desired_routes(others.iter().map(|n| (n.node_ips.as_slice(), n.cidrs.as_slice())));
            for s in skipped {
                tracing::warn!(route = s, "node route skipped");
            }
            if applied.as_ref() != Some(&desired) {
                let result = async {
                    if !desired.is_empty() {
                        enable_forwarding()?;
                    }
                    sync_node_routes(desired.clone()).await
                }
                .await;
                match result {
                    Ok((added, deleted)) => {
                        tracing::info!(routes = desired.len(), added, deleted, "node routes programmed");
                        applied = Some(desired);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "programming node routes failed; retrying");
                        tokio::select! {
                            () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                            () = shutdown.clone().wait() => return,
                        }
                    }
                }
            }
        }
        tokio::select! {
            r = rx.changed() => if r.is_err() { return },
            () = shutdown.clone().wait() => return,
        }
    }
}
