//! Port pools, as bookkeeping: every port this cluster owns in Neutron is in exactly one place —
//! free in a pool, recycling (released, waiting for Neutron to see it unplugged before it is
//! handed out again), or in use by a pod (keyed by pod uid). Pure: no Neutron calls here, so
//! the arithmetic (when to refill, whether a released port is kept) is tested on its own.
//!
//! Pools are keyed by (node, project, network, security-group set), as Kuryr's were: a port is
//! bound to its node (`binding:host_id`) when created, so it can only serve pods of that node.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

use kuryr_openstack::neutron::Port;

/// Which pool a port belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey {
    /// The node (`binding:host_id`).
    pub node: String,
    /// The owning project.
    pub project: String,
    /// The network.
    pub network: String,
    /// The security groups, sorted; empty means the project's default group.
    pub security_groups: Vec<String>,
}

impl PoolKey {
    /// A key with its security groups sorted and deduplicated.
    pub fn new(node: &str, project: &str, network: &str, mut security_groups: Vec<String>) -> Self {
        security_groups.sort();
        security_groups.dedup();
        Self { node: node.into(), project: project.into(), network: network.into(), security_groups }
    }
}

/// How big pools are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Refill when free + recycling + being created falls below this.
    pub min: u32,
    /// Ports created per refill; 0 turns pools off (a port per pod, deleted on release).
    pub batch: u32,
    /// Most ports kept out of use per pool (free + recycling); 0: no cap.
    pub max: u32,
}

impl Limits {
    /// Whether ports are pooled at all.
    pub fn pooling(&self) -> bool {
        self.batch > 0
    }
}

#[derive(Debug, Default)]
struct PoolState {
    free: VecDeque<Port>,
    /// Port id → (port, released at).
    recycling: HashMap<String, (Port, Instant)>,
    /// Ports asked of Neutron and not yet answered.
    creating: u32,
}

impl PoolState {
    fn spare(&self) -> u32 {
        u32::try_from(self.free.len() + self.recycling.len()).unwrap_or(u32::MAX).saturating_add(self.creating)
    }
}

/// Where a port of the inventory is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Place {
    /// Released, waiting to be seen unplugged: its pool and revision at release.
    Recycling(PoolKey, Option<u64>),
    /// Held by a pod: its uid and the port's revision at assignment.
    Held(String, Option<u64>),
    /// Free in a pool.
    Free,
}

/// A pool as the pool API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolView {
    /// Which pool.
    pub key: PoolKey,
    /// Free port ids, next to be handed out first.
    pub free: Vec<String>,
    /// Ports released and waiting to be seen unplugged.
    pub recycling: u32,
    /// Ports in use by pods.
    pub in_use: u32,
    /// Ports being created.
    pub creating: u32,
}

/// How many removed ports the inventory remembers for [`Inventory::absorb_unknown`]; a listing
/// of Neutron older than that many removals is not absorbed at all.
const REMOVALS_KEPT: usize = 4096;

/// Every port the allocator owns.
#[derive(Debug, Default)]
pub struct Inventory {
    pools: BTreeMap<PoolKey, PoolState>,
    /// Pod uid → (pool, port).
    in_use: HashMap<String, (PoolKey, Port)>,
    /// The latest ports removed from here (taken, released, drained for deletion, forgotten),
    /// each with its sequence number: what a listing of Neutron begun before them may still
    /// name, and must not bring back.
    removed: VecDeque<(u64, String)>,
    /// The sequence number of the latest removal.
    removals: u64,
    /// Ports out of the pools whose change in Neutron is in flight (hand-out, release,
    /// deletion): a listing may still name them as they were before.
    in_flight: std::collections::HashSet<String>,
}

impl Inventory {
    /// The port a pod holds.
    pub fn held(&self, pod_uid: &str) -> Option<&Port> {
        self.in_use.get(pod_uid).map(|(_, p)| p)
    }

    /// Takes the oldest free port of a pool. Its hand-out in Neutron is in flight from now until
    /// [`Inventory::changed`]: a listing begun meanwhile may still name it free.
    pub fn take(&mut self, key: &PoolKey) -> Option<Port> {
        let port = self.pools.get_mut(key)?.free.pop_front()?;
        self.note_removed(&port.id);
        self.in_flight.insert(port.id.clone());
        Some(port)
    }

    fn note_removed(&mut self, port_id: &str) {
        self.removals += 1;
        self.removed.push_back((self.removals, port_id.to_string()));
        if self.removed.len() > REMOVALS_KEPT {
            self.removed.pop_front();
        }
    }

    /// A change of a port in Neutron begins (its release or deletion; a hand-out begins with
    /// [`Inventory::take`]): until it ends ([`Inventory::changed`]) a listing that names the
    /// port is not taken back, whatever it shows of it.
    pub fn changing(&mut self, port_id: &str) {
        self.in_flight.insert(port_id.to_string());
    }

    /// A port's change in Neutron ended (done or failed): it counts as removed now, for a
    /// listing begun while it was in flight.
    pub fn changed(&mut self, port_id: &str) {
        self.in_flight.remove(port_id);
        self.note_removed(port_id);
    }

    /// The sequence number of the latest removal: taken before listing Neutron, it tells
    /// [`Inventory::absorb_unknown`] which removals the listing may not have seen.
    pub fn removals(&self) -> u64 {
        self.removals
    }

    /// Puts a port back at the head of a pool (a hand-out that failed part-way).
    pub fn untake(&mut self, key: &PoolKey, port: Port) {
        self.pools.entry(key.clone()).or_default().free.push_front(port);
    }

    /// Adds a free port to a pool.
    pub fn put_free(&mut self, key: &PoolKey, port: Port) {
        self.pools.entry(key.clone()).or_default().free.push_back(port);
    }

    /// Adds a released port, to be handed out once Neutron no longer reports it ACTIVE.
    pub fn put_recycling(&mut self, key: &PoolKey, port: Port, now: Instant) {
        self.pools.entry(key.clone()).or_default().recycling.insert(port.id.clone(), (port, now));
    }

    /// Every recycling port: (pool, port id, released at).
    pub fn recycling(&self) -> Vec<(PoolKey, String, Instant)> {
        self.pools
            .iter()
            .flat_map(|(k, s)| s.recycling.iter().map(move |(id, (_, at))| (k.clone(), id.clone(), *at)))
            .collect()
    }

    /// A recycling port was seen unplugged: it is free again. Returns whether it was recycling.
    pub fn recycled(&mut self, key: &PoolKey, port_id: &str) -> bool {
        let Some(state) = self.pools.get_mut(key) else { return false };
        match state.recycling.remove(port_id) {
            Some((port, _)) => {
                state.free.push_back(port);
                true
            }
            None => false,
        }
    }

    /// Forgets a recycling port (deleted, or gone from Neutron).
    pub fn drop_recycling(&mut self, key: &PoolKey, port_id: &str) -> Option<Port> {
        let (port, _) = self.pools.get_mut(key)?.recycling.remove(port_id)?;
        self.note_removed(&port.id);
        Some(port)
    }

    /// Records that `pod_uid` holds `port`. Returns the port it held before, if another one.
    pub fn assign(&mut self, pod_uid: &str, key: &PoolKey, port: Port) -> Option<Port> {
        let before = self.in_use.insert(pod_uid.to_string(), (key.clone(), port.clone()));
        self.pools.entry(key.clone()).or_default();
        before.map(|(_, p)| p).filter(|p| p.id != port.id)
    }

    /// The pod no longer holds its port; returns it with its pool.
    pub fn unassign(&mut self, pod_uid: &str) -> Option<(PoolKey, Port)> {
        let (key, port) = self.in_use.remove(pod_uid)?;
        self.note_removed(&port.id);
        Some((key, port))
    }

    /// Where a port is, for a pushed port event: the pool of a recycling port with its revision
    /// at release, or the pod holding it with its revision at assignment, or `Free`; `None`
    /// when the port is not this allocator's.
    pub fn place(&self, port_id: &str) -> Option<Place> {
        for (k, s) in &self.pools {
            if let Some((p, _)) = s.recycling.get(port_id) {
                return Some(Place::Recycling(k.clone(), p.revision_number));
            }
        }
        if let Some((uid, (_, p))) = self.in_use.iter().find(|(_, (_, p))| p.id == port_id) {
            return Some(Place::Held(uid.clone(), p.revision_number));
        }
        self.pools.values().any(|s| s.free.iter().any(|p| p.id == port_id)).then_some(Place::Free)
    }

    /// The ids of every port held, free or recycling.
    pub fn port_ids(&self) -> std::collections::HashSet<String> {
        let pooled =
            self.pools.values().flat_map(|s| s.free.iter().map(|p| p.id.clone()).chain(s.recycling.keys().cloned()));
        pooled.chain(self.in_use.values().map(|(_, p)| p.id.clone())).collect()
    }

    /// Every pod holding a port: (pod uid, pool, port).
    pub fn holders(&self) -> impl Iterator<Item = (&str, &PoolKey, &Port)> {
        self.in_use.iter().map(|(uid, (k, p))| (uid.as_str(), k, p))
    }

    /// Marks `n` ports of a pool as being created.
    pub fn creating(&mut self, key: &PoolKey, n: u32) {
        let s = self.pools.entry(key.clone()).or_default();
        s.creating = s.creating.saturating_add(n);
    }

    /// Ports being created for the pools `which` selects.
    pub fn creating_for(&self, which: impl Fn(&PoolKey) -> bool) -> u32 {
        self.pools.iter().filter(|(k, _)| which(k)).map(|(_, s)| s.creating).sum()
    }

    /// `n` creations of a pool finished (well or not).
    pub fn created(&mut self, key: &PoolKey, n: u32) {
        if let Some(s) = self.pools.get_mut(key) {
            s.creating = s.creating.saturating_sub(n);
        }
    }

    /// How many ports to create for a pool now: a batch when its spare ports fell below the
    /// minimum, never beyond the maximum.
    pub fn refill(&self, key: &PoolKey, limits: Limits) -> u32 {
        if !limits.pooling() {
            return 0;
        }
        let spare = self.pools.get(key).map_or(0, PoolState::spare);
        if spare >= limits.min {
            return 0;
        }
        let want = limits.batch.max(limits.min - spare);
        if limits.max == 0 { want } else { want.min(limits.max.saturating_sub(spare)) }
    }

    /// How many ports to create so that a pool has `count` spare ports (the pool API's populate),
    /// never beyond the maximum.
    pub fn top_up(&self, key: &PoolKey, count: u32, limits: Limits) -> u32 {
        let spare = self.pools.get(key).map_or(0, PoolState::spare);
        let want = count.saturating_sub(spare);
        if limits.max == 0 { want } else { want.min(limits.max.saturating_sub(spare)) }
    }

    /// Whether a released port of a pool is kept (recycled) rather than deleted.
    pub fn keeps(&self, key: &PoolKey, limits: Limits) -> bool {
        limits.pooling() && (limits.max == 0 || self.pools.get(key).map_or(0, PoolState::spare) < limits.max)
    }

    /// Removes and returns every free port of the pools `which` selects.
    pub fn drain_free(&mut self, which: impl Fn(&PoolKey) -> bool) -> Vec<(PoolKey, Port)> {
        let mut out = Vec::new();
        for (k, s) in self.pools.iter_mut().filter(|(k, _)| which(k)) {
            out.extend(s.free.drain(..).map(|p| (k.clone(), p)));
        }
        for (_, p) in &out {
            self.note_removed(&p.id);
        }
        out
    }

    /// Forgets the pools `which` selects that hold nothing (no free, recycling, creating or
    /// in-use port): a namespace network that is gone.
    pub fn forget_pools(&mut self, which: impl Fn(&PoolKey) -> bool) {
        let busy: Vec<PoolKey> = self.in_use.values().map(|(k, _)| k.clone()).collect();
        self.pools.retain(|k, s| {
            !which(k) || !s.free.is_empty() || !s.recycling.is_empty() || s.creating > 0 || busy.contains(k)
        });
    }

    /// Forgets every port and pool of the nodes `which` selects (their shard went to another
    /// replica); ports being created for them are still counted until their creation ends.
    /// Returns the ids of the ports forgotten.
    pub fn forget_nodes(&mut self, which: impl Fn(&str) -> bool) -> Vec<String> {
        let mut gone: Vec<String> = Vec::new();
        self.in_use.retain(|_, (k, p)| {
            let drop = which(&k.node);
            if drop {
                gone.push(p.id.clone());
            }
            !drop
        });
        self.pools.retain(|k, s| {
            if !which(&k.node) {
                return true;
            }
            gone.extend(s.free.drain(..).map(|p| p.id).chain(s.recycling.drain().map(|(id, _)| id)));
            s.creating > 0
        });
        for id in &gone {
            self.note_removed(id);
        }
        gone
    }

    /// Replaces what is known of the nodes `which` selects by `fresh` (read from Neutron), and
    /// keeps everything else: the pools of a gained shard as Neutron has them now.
    pub fn replace_nodes(&mut self, which: impl Fn(&str) -> bool, fresh: Inventory) {
        self.forget_nodes(&which);
        for (k, s) in fresh.pools.into_iter().filter(|(k, _)| which(&k.node)) {
            let mine = self.pools.entry(k).or_default();
            mine.free.extend(s.free);
            mine.recycling.extend(s.recycling);
        }
        for (uid, (k, p)) in fresh.in_use.into_iter().filter(|(_, (k, _))| which(&k.node)) {
            self.pools.entry(k.clone()).or_default();
            self.in_use.insert(uid, (k, p));
        }
    }

    /// Adds the ports of `fresh` (read from Neutron) that are nowhere here, for the nodes `which`
    /// selects, skipping pools with creations in flight (their ports join as the calls answer):
    /// ports a previous owner of the node's shard made or handed out after this replica read
    /// Neutron. Returns how many were added.
    ///
    /// `listed_after` is [`Inventory::removals`] as it was before Neutron was listed: a port
    /// removed here since (handed out, released, deleted), or whose change is in flight, may
    /// still be in the listing and is not taken back; if more removals happened than are
    /// remembered, nothing is absorbed this time.
    pub fn absorb_unknown(&mut self, which: impl Fn(&str) -> bool, fresh: Inventory, listed_after: u64) -> usize {
        if self.removals > listed_after && self.removed.front().is_none_or(|(seq, _)| *seq > listed_after + 1) {
            return 0;
        }
        let mut known = self.port_ids();
        known.extend(self.removed.iter().filter(|(seq, _)| *seq > listed_after).map(|(_, id)| id.clone()));
        known.extend(self.in_flight.iter().cloned());
        let busy = |inv: &Inventory, k: &PoolKey| inv.pools.get(k).is_some_and(|s| s.creating > 0);
        let mut added = 0;
        for (k, s) in fresh.pools {
            if !which(&k.node) || busy(self, &k) {
                continue;
            }
            for p in s.free.into_iter().filter(|p| !known.contains(&p.id)) {
                self.put_free(&k, p);
                added += 1;
            }
            for (_, (p, at)) in s.recycling.into_iter().filter(|(id, _)| !known.contains(id)) {
                self.put_recycling(&k, p, at);
                added += 1;
            }
        }
        for (uid, (k, p)) in fresh.in_use {
            if which(&k.node) && !known.contains(&p.id) && !self.in_use.contains_key(&uid) {
                self.assign(&uid, &k, p);
                added += 1;
            }
        }
        added
    }

    /// The nodes that have a pool or a port here.
    pub fn nodes(&self) -> std::collections::BTreeSet<String> {
        self.pools.keys().map(|k| k.node.clone()).chain(self.in_use.values().map(|(k, _)| k.node.clone())).collect()
    }

    /// One pool's view, if the pool exists.
    pub fn view(&self, key: &PoolKey) -> Option<PoolView> {
        let s = self.pools.get(key)?;
        let in_use = self.in_use.values().filter(|(k, _)| k == key).count();
        Some(PoolView {
            key: key.clone(),
            free: s.free.iter().map(|p| p.id.clone()).collect(),
            recycling: u32::try_from(s.recycling.len()).unwrap_or(u32::MAX),
            in_use: u32::try_from(in_use).unwrap_or(u32::MAX),
            creating: s.creating,
        })
    }

    /// Every pool's view.
    pub fn views(&self) -> Vec<PoolView> {
        self.pools.keys().filter_map(|k| self.view(k)).collect()
    }

    /// Ports in all: free, recycling and in use.
    pub fn total(&self) -> usize {
        self.in_use.len() + self.pools.values().map(|s| s.free.len() + s.recycling.len()).sum::<usize>()
    }
}

#[cfg(test)]
mod tests;
