//! One node's batch: every request queued for the node when its lock came free, served with one
//! status write per touched block (group commit) instead of one write per request.
//!
//! A batch starts from this process's copy of the node's blocks ([`Cached`]), not from a fresh
//! list. That is safe because nothing is decided on the copy alone: a new address is handed out
//! only after a write carrying the copy's resourceVersion succeeded, which proves the copy was
//! current; a 409 drops the copy, and the batch re-lists and computes again. The two answers
//! that involve no write are confirmed by a list made during the batch instead: "the pod already
//! holds this address" (allocation) and "the pod holds nothing here" (release).
//!
//! A dual-stack batch writes its IPv4 and IPv6 blocks together when it can (the plain case: room
//! in every family, no pod holding anything yet); a pod whose two writes do not both succeed is
//! served again one family at a time, after what was written for it is given back.

use std::net::IpAddr;
use std::time::Instant;

use kube::api::PostParams;
use tokio::sync::oneshot;

use super::assign::{self, Parsed, Removal, Want};
use super::error::fail_rest;
use super::types::{Allocation, AssignedAddress, bump};
use super::{IpamStore, StoreError, is_retryable, kube_err};
use crate::core::PodKey;
use crate::core::ipam::{MacAddr, NetworkPlan, PlanError, Pool};
use crate::k8s::crd::AddressBlock;

/// What one caller asks of a node's batch, with where the answer goes.
#[derive(Debug)]
pub(super) enum Op {
    /// Addresses for a pod.
    Allocate(PodKey, oneshot::Sender<Result<Allocation, StoreError>>),
    /// Free the addresses of a pod uid: every one, or only those listed.
    Release(String, Option<Vec<IpAddr>>, oneshot::Sender<Result<bool, StoreError>>),
}

/// This process's copy of one node's blocks: as last listed, plus every successful write since.
#[derive(Debug)]
pub(super) struct Cached {
    blocks: Vec<Parsed>,
    listed: Instant,
}

/// Serves `ops` for `node`; the caller holds the node's lock, which guards `cache`. Every op
/// gets its answer. Dropped half-way (the caller was cancelled), the unanswered ops' callers
/// see their channel closed and queue again; the copy stays usable (it only ever holds what
/// was read or written).
pub(super) async fn run(store: &IpamStore, network: &str, node: &str, ops: Vec<Op>, cache: &mut Option<Cached>) {
    bump(&store.counters.batches);
    let started = Instant::now();
    let mut pods: Vec<PodKey> = Vec::new();
    let mut alloc_replies: Vec<Vec<oneshot::Sender<Result<Allocation, StoreError>>>> = Vec::new();
    let mut removals: Vec<Removal> = Vec::new();
    let mut release_replies: Vec<Vec<oneshot::Sender<Result<bool, StoreError>>>> = Vec::new();
    for op in ops {
        // The same pod twice in one batch is served once.
        match op {
            Op::Allocate(pod, tx) => match pods.iter().position(|p| p.uid == pod.uid) {
                Some(i) => alloc_replies[i].push(tx),
                None => {
                    pods.push(pod);
                    alloc_replies.push(vec![tx]);
                }
            },
            Op::Release(uid, only, tx) => {
                let removal = Removal { uid, only };
                match removals.iter().position(|r| *r == removal) {
                    Some(i) => release_replies[i].push(tx),
                    None => {
                        removals.push(removal);
                        release_replies.push(vec![tx]);
                    }
                }
            }
        }
    }
    let mut batch = Batch { store, network, node, fresh: false, retries: 0 };

    // Releases first: they never depend on this batch's allocations.
    if !removals.is_empty() {
        let outcomes = batch.remove(cache, &removals).await;
        for (outcome, replies) in outcomes.into_iter().zip(release_replies) {
            if matches!(outcome, Ok(true)) {
                bump(&store.counters.releases);
            }
            for tx in replies {
                let _ = tx.send(outcome.clone());
            }
        }
    }

    if !pods.is_empty() {
        let outcomes = match store.plan(network).await {
            Ok(plan) => batch.allocate(cache, plan, &pods).await,
            Err(e) => vec![Err(e); pods.len()],
        };
        for (outcome, replies) in outcomes.into_iter().zip(alloc_replies) {
            match &outcome {
                Ok(a) if a.existing => bump(&store.counters.existing),
                Ok(_) => bump(&store.counters.allocations),
                Err(_) => {}
            }
            for tx in replies {
                let _ = tx.send(outcome.clone());
            }
        }
    }
    if let Some(cached) = cache.as_ref() {
        store.metrics.node_blocks(network, node, &cached.blocks);
    }
    tracing::debug!(
        network,
        node,
        allocations = pods.len(),
        releases = removals.len(),
        listed = batch.fresh,
        elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
        "IPAM batch done"
    );
}

/// A pod of the batch and what it has so far.
struct PodState<'p> {
    pod: &'p PodKey,
    /// One address per family done so far, in the plan's order.
    got: Vec<AssignedAddress>,
    /// Entries this batch wrote for the pod: undone if a later family fails.
    written: Vec<IpAddr>,
    error: Option<StoreError>,
}

impl PodState<'_> {
    fn has(&self, pool: &Pool) -> bool {
        self.got.iter().any(|a| a.block.family() == pool.family())
    }

    fn pending(&self, pool: &Pool) -> bool {
        self.error.is_none() && !self.has(pool)
    }
}

struct Batch<'a> {
    store: &'a IpamStore,
    network: &'a str,
    node: &'a str,
    /// The node's blocks were listed during this batch.
    fresh: bool,
    /// Conflicts and lost claims so far in the current step.
    retries: u32,
}

impl Batch<'_> {
    /// The node's blocks: the copy, unless there is none, it is older than the TTL, or `fresh`
    /// is asked for and this batch has not listed yet.
    async fn blocks<'c>(&mut self, cache: &'c mut Option<Cached>, fresh: bool) -> Result<&'c Cached, StoreError> {
        let ttl = self.store.config.blocks_ttl;
        let cached = match cache.take() {
            Some(c) if c.listed.elapsed() <= ttl && (self.fresh || !fresh) => c,
            _ => {
                let blocks = self.store.list_blocks(self.network, Some(self.node)).await?;
                self.fresh = true;
                Cached { blocks, listed: Instant::now() }
            }
        };
        Ok(cache.insert(cached))
    }

    /// Writes new statuses, all at once; each result in `objects`' order.
    async fn write(&self, objects: Vec<(String, AddressBlock)>) -> Vec<Result<AddressBlock, kube::Error>> {
        let pp = PostParams::default();
        let writes = objects.iter().map(|(name, obj)| {
            bump(&self.store.counters.block_writes);
            self.store.api("write_block_status", self.store.blocks.replace_status(name, &pp, obj))
        });
        futures::future::join_all(writes).await
    }

    /// Puts a written block into the copy.
    fn keep(cache: &mut Option<Cached>, index: usize, obj: AddressBlock) -> Result<(), StoreError> {
        let parsed = Parsed::new(obj)?;
        if let Some(slot) = cache.as_mut().and_then(|c| c.blocks.get_mut(index)) {
            *slot = parsed;
        }
        Ok(())
    }

    async fn back_off(&mut self) -> Result<(), StoreError> {
        self.store.back_off(&mut self.retries, self.network, self.node).await
    }

    /// Carries out `removals`; per removal whether it freed anything.
    async fn remove(&mut self, cache: &mut Option<Cached>, removals: &[Removal]) -> Vec<Result<bool, StoreError>> {
        self.retries = 0;
        let mut outcome: Vec<Option<Result<bool, StoreError>>> = vec![None; removals.len()];
        let mut released = vec![false; removals.len()];
        let mut pending: Vec<usize> = (0..removals.len()).collect();
        while !pending.is_empty() {
            let (objects, served) = {
                let cached = match self.blocks(cache, false).await {
                    Ok(c) => c,
                    Err(e) => return fail_rest(outcome, released, &e),
                };
                // "Holds nothing" must come from a read made now.
                if !self.fresh && pending.iter().any(|&r| !removals[r].found_in(&cached.blocks)) {
                    if let Err(e) = self.blocks(cache, true).await {
                        return fail_rest(outcome, released, &e);
                    }
                    continue;
                }
                let refs: Vec<&Removal> = pending.iter().map(|&r| &removals[r]).collect();
                let drafts = assign::remove(&cached.blocks, &refs);
                let objects: Vec<(String, AddressBlock)> =
                    drafts.iter().map(|(d, _)| (cached.blocks[d.index].name(), d.object(&cached.blocks))).collect();
                let served: Vec<(usize, Vec<usize>)> =
                    drafts.into_iter().map(|(d, s)| (d.index, s.into_iter().map(|i| pending[i]).collect())).collect();
                (objects, served)
            };
            let names: Vec<String> = objects.iter().map(|(n, _)| n.clone()).collect();
            let results = self.write(objects).await;
            let mut retry = Vec::new();
            let mut conflict = false;
            for (((index, served), result), name) in served.into_iter().zip(results).zip(names) {
                match result {
                    Ok(obj) => {
                        if let Err(e) = Self::keep(cache, index, obj) {
                            *cache = None;
                            for r in served {
                                outcome[r] = Some(Err(e.clone()));
                            }
                            continue;
                        }
                        for r in served {
                            released[r] = true;
                        }
                    }
                    Err(e) if is_retryable(&e) => {
                        bump(&self.store.counters.conflicts);
                        conflict = true;
                        retry.extend(served);
                    }
                    Err(e) => {
                        let e = kube_err(format!("removing pods from address block {name}"))(e);
                        for r in served {
                            outcome[r] = Some(Err(e.clone()));
                        }
                    }
                }
            }
            retry.sort_unstable();
            retry.dedup();
            pending = retry;
            if conflict {
                *cache = None;
                if let Err(e) = self.back_off().await {
                    return fail_rest(outcome, released, &e);
                }
            }
        }
        outcome.into_iter().zip(released).map(|(o, r)| o.unwrap_or(Ok(r))).collect()
    }

    /// Addresses for `pods`, one per pool of `plan`, IPv4 first.
    async fn allocate(
        &mut self,
        cache: &mut Option<Cached>,
        mut plan: NetworkPlan,
        pods: &[PodKey],
    ) -> Vec<Result<Allocation, StoreError>> {
        let mut states: Vec<PodState<'_>> =
            pods.iter().map(|pod| PodState { pod, got: Vec::new(), written: Vec::new(), error: None }).collect();
        let pools: Vec<Pool> = plan.pools().copied().collect();
        if pools.len() > 1 {
            self.retries = 0;
            if let Err(e) = self.all_families(cache, &pools, &mut states).await {
                // The families one by one below read again and report what still fails.
                tracing::debug!(network = self.network, node = self.node, error = %e,
                    "allocating every family at once failed; one by one instead");
            }
        }
        for pool in pools {
            self.retries = 0;
            if let Err(e) = self.family(cache, &mut plan, pool, &mut states).await {
                for s in states.iter_mut().filter(|s| s.pending(&pool)) {
                    s.error = Some(e.clone());
                }
            }
        }

        // Undo only what this batch wrote for pods that failed; addresses found already
        // recorded may be in use by a running pod.
        let undo: Vec<Removal> = states
            .iter()
            .filter(|s| s.error.is_some())
            .filter(|s| !s.written.is_empty())
            .map(|s| Removal { uid: s.pod.uid.clone(), only: Some(s.written.clone()) })
            .collect();
        if !undo.is_empty() {
            for (removal, outcome) in undo.iter().zip(self.remove(cache, &undo).await) {
                if let Err(e) = outcome {
                    tracing::warn!(network = self.network, node = self.node, pod = %removal.uid, error = %e,
                        "could not roll back a partial allocation; release the pod to free it");
                }
            }
        }

        states
            .into_iter()
            .map(|s| {
                if let Some(e) = s.error {
                    return Err(e);
                }
                let pairs: Vec<_> = s.got.iter().map(|a| (a.block, a.address)).collect();
                let vif = plan.vif(&pairs).ok_or_else(|| StoreError::InvalidNetwork {
                    network: self.network.to_string(),
                    source: PlanError::NoCidr,
                })?;
                Ok(Allocation {
                    network: self.network.into(),
                    node: self.node.into(),
                    pod: s.pod.clone(),
                    vif_id: format!("{}/{}", self.network, pairs[0].1),
                    vif,
                    existing: s.written.is_empty(),
                    addresses: s.got,
                })
            })
            .collect()
    }

    /// Every family for every pod of the batch at once, with the blocks' writes sent together:
    /// one round trip to the API server instead of one per family (dual-stack networks). Only
    /// the plain case is served here — the node's copy has room in every family and no pod of
    /// the batch holds an address yet; anything else, and any pod whose writes did not all
    /// succeed, is left to [`family`](Self::family) one family at a time. A pod is served
    /// whole or not at all: what was written for a pod whose other write lost a conflict is
    /// given back first, so that its entries' MAC (derived from its IPv4 address) stays one.
    async fn all_families(
        &mut self,
        cache: &mut Option<Cached>,
        pools: &[Pool],
        states: &mut [PodState<'_>],
    ) -> Result<(), StoreError> {
        let cached = self.blocks(cache, false).await?;
        let plain = states.iter().all(|s| {
            s.got.is_empty()
                && s.error.is_none()
                && pools.iter().all(|pool| assign::holding(&cached.blocks, pool, &s.pod.uid).is_none())
        }) && pools.iter().all(|pool| assign::free_in_pool(&cached.blocks, pool) >= states.len() as u128);
        if !plain {
            return Ok(());
        }
        // Per pod, per pool in the plan's order: the block index and the new address.
        let mut placed: Vec<Vec<(usize, AssignedAddress)>> = vec![Vec::new(); states.len()];
        let mut objects: Vec<(usize, String, AddressBlock)> = Vec::new();
        for pool in pools {
            let wants: Vec<Want<'_>> = states
                .iter()
                .zip(&placed)
                .map(|(s, p)| Want { pod: s.pod, mac: p.first().map(|(_, a)| MacAddr::for_address(a.address)) })
                .collect();
            let (got, drafts) = assign::assign(&cached.blocks, pool, &wants);
            for (slot, g) in placed.iter_mut().zip(got) {
                let Some((b, address)) = g else { return Ok(()) };
                let p = &cached.blocks[b];
                slot.push((b, AssignedAddress { block_name: p.name(), block: p.block, address }));
            }
            objects.extend(drafts.iter().map(|d| (d.index, cached.blocks[d.index].name(), d.object(&cached.blocks))));
        }
        let indexes: Vec<usize> = objects.iter().map(|(i, _, _)| *i).collect();
        let results = self.write(objects.into_iter().map(|(_, n, o)| (n, o)).collect()).await;
        // Per written block: `None` when it was written, `Some(None)` when it lost a conflict,
        // `Some(Some(e))` when it failed for good.
        let mut outcomes: Vec<(usize, Option<Option<StoreError>>)> = Vec::new();
        let mut conflict = false;
        for (index, result) in indexes.into_iter().zip(results) {
            let outcome = match result {
                Ok(obj) => {
                    Self::keep(cache, index, obj)?;
                    None
                }
                Err(e) if is_retryable(&e) => {
                    bump(&self.store.counters.conflicts);
                    conflict = true;
                    Some(None)
                }
                Err(e) => {
                    let name = cache.as_ref().and_then(|c| c.blocks.get(index)).map(Parsed::name).unwrap_or_default();
                    Some(Some(kube_err(format!("recording addresses in address block {name}"))(e)))
                }
            };
            outcomes.push((index, outcome));
        }
        let outcome = |b: usize| outcomes.iter().find(|(i, _)| *i == b).and_then(|(_, o)| o.clone());
        let mut undo: Vec<Removal> = Vec::new();
        for (state, slot) in states.iter_mut().zip(placed) {
            let written: Vec<IpAddr> =
                slot.iter().filter(|(b, _)| outcome(*b).is_none()).map(|(_, a)| a.address).collect();
            let failure = slot.iter().find_map(|(b, _)| outcome(*b).flatten());
            let lost = slot.iter().any(|(b, _)| matches!(outcome(*b), Some(None)));
            if let Some(e) = failure {
                // Failed: what was written is undone with the batch's other failures.
                state.written = written;
                state.error = Some(e);
            } else if lost {
                // Lost a conflict only: give back what was written; the pod is served again.
                if !written.is_empty() {
                    undo.push(Removal { uid: state.pod.uid.clone(), only: Some(written) });
                }
            } else {
                state.written = written;
                state.got = slot.into_iter().map(|(_, a)| a).collect();
            }
        }
        if conflict {
            *cache = None;
        }
        if !undo.is_empty() {
            for (removal, outcome) in undo.iter().zip(self.remove(cache, &undo).await) {
                if let Err(e) = outcome {
                    // Left in the blocks, the address is found held by the pod and kept.
                    tracing::warn!(network = self.network, node = self.node, pod = %removal.uid, error = %e,
                        "could not give back an address of an allocation that lost a conflict");
                }
            }
        }
        if conflict {
            self.back_off().await?;
        }
        Ok(())
    }

    /// One family for every pod of the batch that lacks it: its existing address, or a new one.
    async fn family(
        &mut self,
        cache: &mut Option<Cached>,
        plan: &mut NetworkPlan,
        mut pool: Pool,
        states: &mut [PodState<'_>],
    ) -> Result<(), StoreError> {
        loop {
            let pending: Vec<usize> = (0..states.len()).filter(|&i| states[i].pending(&pool)).collect();
            if pending.is_empty() {
                return Ok(());
            }
            let cached = self.blocks(cache, false).await?;
            // "Already holds" answers without a write, so it must come from a read made now.
            if !self.fresh
                && pending.iter().any(|&i| assign::holding(&cached.blocks, &pool, &states[i].pod.uid).is_some())
            {
                self.blocks(cache, true).await?;
                continue;
            }
            let mut need = take_holders(&cached.blocks, &pool, states, pending);
            if need.is_empty() {
                return Ok(());
            }
            if self.make_room(cache, plan, &mut pool, need.len() as u128).await? {
                // Re-read: pods may hold addresses in blocks not seen before.
                let cached = self.blocks(cache, false).await?;
                need = take_holders(&cached.blocks, &pool, states, need);
            }

            let (objects, placed) = {
                let cached = self.blocks(cache, false).await?;
                let wants: Vec<Want<'_>> = need
                    .iter()
                    .map(|&i| Want {
                        pod: states[i].pod,
                        mac: states[i].got.first().map(|a| MacAddr::for_address(a.address)),
                    })
                    .collect();
                let (got, drafts) = assign::assign(&cached.blocks, &pool, &wants);
                // (pod, block index, the new address as the pod will hold it)
                let mut placed: Vec<(usize, usize, AssignedAddress)> = Vec::new();
                for (&i, g) in need.iter().zip(got) {
                    match g {
                        Some((b, address)) => {
                            let p = &cached.blocks[b];
                            placed.push((i, b, AssignedAddress { block_name: p.name(), block: p.block, address }));
                        }
                        None => states[i].error = Some(self.exhausted(&pool)),
                    }
                }
                let objects: Vec<(usize, String, AddressBlock)> =
                    drafts.iter().map(|d| (d.index, cached.blocks[d.index].name(), d.object(&cached.blocks))).collect();
                (objects, placed)
            };
            if objects.is_empty() {
                return Ok(());
            }
            let written: Vec<(usize, String)> = objects.iter().map(|(i, n, _)| (*i, n.clone())).collect();
            let results = self.write(objects.into_iter().map(|(_, n, o)| (n, o)).collect()).await;
            let mut conflict = false;
            for ((index, name), result) in written.into_iter().zip(results) {
                let mine = placed.iter().filter(|(_, b, _)| *b == index);
                match result {
                    Ok(obj) => {
                        Self::keep(cache, index, obj)?;
                        for (i, _, assigned) in mine {
                            states[*i].written.push(assigned.address);
                            states[*i].got.push(assigned.clone());
                        }
                    }
                    Err(e) if is_retryable(&e) => {
                        bump(&self.store.counters.conflicts);
                        conflict = true;
                    }
                    Err(e) => {
                        let e = kube_err(format!("recording addresses in address block {name}"))(e);
                        for (i, _, _) in mine {
                            states[*i].error = Some(e.clone());
                        }
                    }
                }
            }
            if conflict {
                *cache = None;
                self.back_off().await?;
            }
        }
    }

    /// Makes the node's blocks of `pool` hold `need` free addresses if the network has room,
    /// claiming blocks as needed; short of room, what fits gets in and the rest is exhausted.
    /// Returns whether it re-read the node's blocks.
    async fn make_room(
        &mut self,
        cache: &mut Option<Cached>,
        plan: &mut NetworkPlan,
        pool: &mut Pool,
        need: u128,
    ) -> Result<bool, StoreError> {
        let mut reread = false;
        loop {
            if assign::free_in_pool(&self.blocks(cache, false).await?.blocks, pool) >= need {
                return Ok(reread);
            }
            // Claim under the spec as it is now: blocks of an outdated size could overlap blocks
            // claimed under the new one.
            let now = self.store.fresh_plan(self.network).await?;
            if let Some(p) = now.pool(pool.family()) {
                *pool = *p;
                *plan = now.clone();
            }
            // Another allocator may have claimed a block for this node meanwhile: a second
            // claim would waste a block.
            let all = self.store.list_blocks(self.network, None).await?;
            let mine: Vec<Parsed> = all.iter().filter(|p| p.obj.spec.node == self.node).cloned().collect();
            let free = assign::free_in_pool(&mine, pool);
            *cache = Some(Cached { blocks: mine, listed: Instant::now() });
            self.fresh = true;
            reread = true;
            if free >= need {
                return Ok(reread);
            }
            let taken: Vec<_> = all.iter().map(|p| p.block).collect();
            let Some(free_block) = pool.first_free_block(&taken) else {
                return Ok(reread);
            };
            match self.store.claim(self.network, self.node, free_block).await? {
                Some(obj) => {
                    let parsed = Parsed::new(obj)?;
                    if let Some(c) = cache.as_mut() {
                        c.blocks.push(parsed);
                        assign::sort(&mut c.blocks);
                    }
                }
                None => self.back_off().await?,
            }
        }
    }

    fn exhausted(&self, pool: &Pool) -> StoreError {
        StoreError::Exhausted {
            network: self.network.to_string(),
            cidr: pool.cidr(),
            node: self.node.to_string(),
            block_prefix: pool.block_prefix(),
        }
    }
}

/// Records the addresses of `pool`'s family that pods of `candidates` already hold in `blocks`;
/// returns the pods still without one.
fn take_holders(blocks: &[Parsed], pool: &Pool, states: &mut [PodState<'_>], candidates: Vec<usize>) -> Vec<usize> {
    candidates
        .into_iter()
        .filter(|&i| match assign::holding(blocks, pool, &states[i].pod.uid) {
            Some((b, address)) => {
                let p = &blocks[b];
                states[i].got.push(AssignedAddress { block_name: p.name(), block: p.block, address });
                false
            }
            None => true,
        })
        .collect()
}
