//! The store's plain types: what goes in, what comes out, tuning and counters.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::core::PodKey;
use crate::core::ipam::{Block, VifConfig};

/// One address a pod holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssignedAddress {
    /// The AddressBlock object it is recorded in.
    pub block_name: String,
    /// The block.
    pub block: Block,
    /// The address.
    pub address: IpAddr,
}

/// What [`IpamStore::allocate`](super::IpamStore::allocate) hands out: the pod's addresses (one per family of the network)
/// and the VIF built from them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// The PodNetwork.
    pub network: String,
    /// The node whose blocks the addresses come from.
    pub node: String,
    /// The pod.
    pub pod: PodKey,
    /// IPv4 first.
    pub addresses: Vec<AssignedAddress>,
    /// `<network>/<first address>`: changes whenever the pod's address changes.
    pub vif_id: String,
    /// MAC, addresses with the block prefix and gateways, MTU, routes, bridge.
    pub vif: VifConfig,
    /// True when every address was already recorded for this pod (nothing was written).
    pub existing: bool,
}

/// Tuning of the store.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Retries (after conflicts or lost block claims) before an operation gives up with
    /// [`StoreError::Contention`](super::StoreError::Contention). With the per-node lock only other processes conflict, so each
    /// round has a fair chance; 40 rounds of up to `backoff_cap` is seconds of contention.
    pub max_retries: u32,
    /// First backoff ceiling; doubles per retry. A status write takes a few milliseconds, so
    /// waiting about that long lets the winner finish before the loser re-reads.
    pub backoff_base: Duration,
    /// Largest backoff ceiling.
    pub backoff_cap: Duration,
    /// Field manager for server-side apply and creates.
    pub field_manager: String,
    /// How long this process trusts its last copy of a node's blocks before listing them again.
    /// The copy is only ever a starting point: every write carries the resourceVersion it was
    /// computed from, so a stale copy costs a 409 and a re-list, never a duplicate address. What
    /// the age bounds is how long a block that another process claimed for the node stays
    /// unseen here (it only matters for a pod allocated by two processes at once).
    pub blocks_ttl: Duration,
    /// How long a PodNetwork as read serves allocations; a spec change reaches them within this
    /// time (block claims always read the spec afresh).
    pub network_ttl: Duration,
    /// Most requests one node's batch takes; the rest wait for the next batch.
    pub max_batch: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            max_retries: 40,
            backoff_base: Duration::from_millis(4),
            backoff_cap: Duration::from_millis(250),
            field_manager: "kuryr-vif-allocator".to_string(),
            blocks_ttl: Duration::from_secs(5),
            network_ttl: Duration::from_secs(2),
            max_batch: 128,
        }
    }
}

/// Counters since the store was made; see [`IpamStore::stats`](super::IpamStore::stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// `allocate` calls that recorded at least one new address.
    pub allocations: u64,
    /// `allocate` calls answered entirely from existing records.
    pub existing: u64,
    /// `release` calls that removed something.
    pub releases: u64,
    /// Status writes refused because the block changed since it was read (409), or vanished.
    pub conflicts: u64,
    /// Blocks this store created.
    pub blocks_claimed: u64,
    /// Block creates lost to another allocator (`AlreadyExists`).
    pub claim_races: u64,
    /// Batches: runs of queued requests for one node served together.
    pub batches: u64,
    /// Block status writes, successful or not.
    pub block_writes: u64,
    /// Lists of a node's or the network's blocks.
    pub block_lists: u64,
}

/// The live counters behind [`StoreStats`].
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) allocations: AtomicU64,
    pub(super) existing: AtomicU64,
    pub(super) releases: AtomicU64,
    pub(super) conflicts: AtomicU64,
    pub(super) blocks_claimed: AtomicU64,
    pub(super) claim_races: AtomicU64,
    pub(super) batches: AtomicU64,
    pub(super) block_writes: AtomicU64,
    pub(super) block_lists: AtomicU64,
}

pub(super) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    pub(super) fn snapshot(&self) -> StoreStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StoreStats {
            allocations: get(&self.allocations),
            existing: get(&self.existing),
            releases: get(&self.releases),
            conflicts: get(&self.conflicts),
            blocks_claimed: get(&self.blocks_claimed),
            claim_races: get(&self.claim_races),
            batches: get(&self.batches),
            block_writes: get(&self.block_writes),
            block_lists: get(&self.block_lists),
        }
    }
}

/// Equal-jitter exponential backoff ([`kuryr_stream::Jitter::Equal`] under the shared
/// backoff's ceiling, doubling from `base` per retry up to `cap`), counted in
/// `kuryr_retries_total{component="ipam-store",reason="conflict"}`. The random half spreads out
/// allocators that lost the same race; the fixed half keeps a loser from re-reading before the
/// winner wrote.
pub fn backoff_delay(retry: u32, base: Duration, cap: Duration) -> Duration {
    kuryr_stream::backoff::count("ipam-store", "conflict");
    let ceiling = kuryr_stream::backoff::ceiling(retry.saturating_add(1), base, cap);
    kuryr_stream::Jitter::Equal.apply(ceiling, fastrand::f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter_up_to_the_cap() {
        let base = Duration::from_millis(4);
        let cap = Duration::from_millis(250);
        for retry in 1..30 {
            let ceiling = (base * 2u32.pow(retry.min(16))).min(cap);
            for _ in 0..50 {
                let d = backoff_delay(retry, base, cap);
                let ceiling = ceiling + Duration::from_micros(1); // (f32 steps)
                assert!(
                    d >= ceiling / 2 - Duration::from_micros(1) && d <= ceiling,
                    "retry {retry}: {d:?} outside {:?}..={ceiling:?}",
                    ceiling / 2
                );
            }
        }
    }
}
