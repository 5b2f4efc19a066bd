//! The watch of AddressBlocks that keeps the index's node routes current: which node owns which
//! block, for the blocks of every PodNetwork — the pods' primary one and the networks of their
//! further interfaces ([`crate::core::attach`]), whose blocks need routes between nodes just the
//! same.
//!
//! The watch is of metadata only: allocations rewrite block statuses all the time, while what a
//! route needs (`spec.node`, `spec.cidr`) is written once, at the block's creation. A block new to
//! this replica (a name, uid or generation not seen before) is read once, by name; a deleted one is
//! dropped; all of them are listed only when the watch starts over and its set differs from what is
//! known. So a block claimed on one node costs every replica one read of that block, whatever the
//! number of blocks in the cluster.

use std::collections::BTreeMap;

use futures::StreamExt as _;
use kube::api::{Api, ListParams, PartialObjectMeta};
use kube::runtime::{WatchStreamExt as _, watcher};
use kuryr_runtime::{Shutdown, retry};

use crate::index::{SharedIndex, lock};
use crate::k8s::crd::AddressBlock;

/// Page size when listing the blocks.
const PAGE: u32 = 500;

/// What the watch tells apart: a block of the same name made again (another uid), or its spec
/// changed (another generation), is read again.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Version {
    uid: String,
    generation: i64,
}

impl Version {
    fn of(meta: &kube::api::ObjectMeta) -> Self {
        Self { uid: meta.uid.clone().unwrap_or_default(), generation: meta.generation.unwrap_or(0) }
    }
}

/// A block as a route needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Placed {
    version: Version,
    node: String,
    cidr: String,
}

impl Placed {
    fn of(b: &AddressBlock) -> Self {
        Self { version: Version::of(&b.metadata), node: b.spec.node.clone(), cidr: b.spec.cidr.clone() }
    }
}

/// The blocks known, by name.
#[derive(Debug, Default)]
struct Known(BTreeMap<String, Placed>);

impl Known {
    /// Whether `name` at `version` is known as it is.
    fn has(&self, name: &str, version: &Version) -> bool {
        self.0.get(name).is_some_and(|p| p.version == *version)
    }

    /// Whether the known blocks are exactly `listed`.
    fn is(&self, listed: &BTreeMap<String, Version>) -> bool {
        self.0.len() == listed.len() && listed.iter().all(|(n, v)| self.has(n, v))
    }

    /// The CIDRs by owning node.
    fn by_node(&self) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for p in self.0.values() {
            out.entry(p.node.clone()).or_default().push(p.cidr.clone());
        }
        out
    }
}

/// Every block, by name.
async fn list_all(api: &Api<AddressBlock>) -> anyhow::Result<Known> {
    let mut known = Known::default();
    let mut params = ListParams::default().limit(PAGE);
    loop {
        let page = api.list(&params).await?;
        for b in &page.items {
            if let Some(name) = &b.metadata.name {
                known.0.insert(name.clone(), Placed::of(b));
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(known),
        }
    }
}

/// Keeps the index's address blocks in line with the cluster's until `shutdown`.
pub async fn follow_blocks(client: kube::Client, index: SharedIndex, shutdown: Shutdown) {
    let meta: Api<PartialObjectMeta<AddressBlock>> = Api::all(client.clone());
    let api: Api<AddressBlock> = Api::all(client);
    let mut events = watcher::watcher(meta, kuryr_runtime::watch_config()).default_backoff().boxed();
    let mut known = Known::default();
    let mut relist: Option<BTreeMap<String, Version>> = None;
    loop {
        let next = tokio::select! {
            n = events.next() => n,
            () = shutdown.clone().wait() => return,
        };
        let changed = match next {
            Some(Ok(watcher::Event::Init)) => {
                relist = Some(BTreeMap::new());
                false
            }
            Some(Ok(watcher::Event::InitApply(m))) => {
                if let (Some(r), Some(n)) = (relist.as_mut(), m.metadata.name.clone()) {
                    r.insert(n, Version::of(&m.metadata));
                }
                false
            }
            Some(Ok(watcher::Event::InitDone)) => {
                if known.is(&relist.take().unwrap_or_default()) {
                    false
                } else {
                    // Events after the list bring what changes after it.
                    let Some(all) = retry("listing the address blocks", &shutdown, || list_all(&api)).await else {
                        return;
                    };
                    known = all;
                    true
                }
            }
            Some(Ok(watcher::Event::Apply(m))) => {
                let Some(name) = m.metadata.name.clone() else { continue };
                if known.has(&name, &Version::of(&m.metadata)) {
                    continue;
                }
                let read = retry("reading an address block", &shutdown, || async {
                    api.get_opt(&name).await.map_err(|e| anyhow::anyhow!("reading address block {name}: {e}"))
                })
                .await;
                match read {
                    None => return,
                    Some(Some(b)) => {
                        let placed = Placed::of(&b);
                        known.0.insert(name, placed.clone()) != Some(placed)
                    }
                    // Deleted meanwhile: its Delete event follows.
                    Some(None) => false,
                }
            }
            Some(Ok(watcher::Event::Delete(m))) => m.metadata.name.is_some_and(|n| known.0.remove(&n).is_some()),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "address block watch failed; retrying with backoff");
                false
            }
            None => return,
        };
        if changed {
            let blocks = known.by_node();
            tracing::info!(blocks = known.0.len(), nodes = blocks.len(), "address blocks changed");
            lock(&index).set_blocks(blocks);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placed(uid: &str, generation: i64, node: &str, cidr: &str) -> Placed {
        Placed { version: Version { uid: uid.into(), generation }, node: node.into(), cidr: cidr.into() }
    }

    #[test]
    fn a_block_made_again_or_edited_is_not_known_as_it_is() {
        let known = Known(BTreeMap::from([("b1".to_string(), placed("u1", 1, "n1", "10.0.0.0/26"))]));
        assert!(known.has("b1", &Version { uid: "u1".into(), generation: 1 }));
        assert!(!known.has("b1", &Version { uid: "u2".into(), generation: 1 }), "made again under the same name");
        assert!(!known.has("b1", &Version { uid: "u1".into(), generation: 2 }), "its spec edited");
        assert!(!known.has("b2", &Version { uid: "u1".into(), generation: 1 }));
    }

    #[test]
    fn a_listing_matches_only_the_same_blocks_at_the_same_versions() {
        let known = Known(BTreeMap::from([
            ("b1".to_string(), placed("u1", 1, "n1", "10.0.0.0/26")),
            ("b2".to_string(), placed("u2", 1, "n2", "10.0.0.64/26")),
        ]));
        let v = |uid: &str| Version { uid: uid.into(), generation: 1 };
        let same = BTreeMap::from([("b1".to_string(), v("u1")), ("b2".to_string(), v("u2"))]);
        assert!(known.is(&same));
        let fewer = BTreeMap::from([("b1".to_string(), v("u1"))]);
        assert!(!known.is(&fewer));
        let remade = BTreeMap::from([("b1".to_string(), v("u1")), ("b2".to_string(), v("u3"))]);
        assert!(!known.is(&remade));
        assert!(!Known::default().is(&same));
        assert!(Known::default().is(&BTreeMap::new()));
    }

    #[test]
    fn blocks_are_grouped_by_their_node() {
        let known = Known(BTreeMap::from([
            ("a".to_string(), placed("u1", 1, "n1", "10.0.0.0/26")),
            ("b".to_string(), placed("u2", 1, "n2", "10.0.0.64/26")),
            ("c".to_string(), placed("u3", 1, "n1", "fd00::/120")),
        ]));
        let by_node = known.by_node();
        assert_eq!(by_node.len(), 2);
        assert_eq!(by_node["n1"], vec!["10.0.0.0/26".to_string(), "fd00::/120".to_string()]);
        assert_eq!(by_node["n2"], vec!["10.0.0.64/26".to_string()]);
    }
}
