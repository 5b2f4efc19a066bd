//! What a replica owns, as published to the service after every round that changed something.

use std::collections::BTreeSet;

use crate::hash::shard_of;

/// The holder of a shard, as its Lease names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    /// The replica's identity (holderIdentity).
    pub identity: String,
    /// Its gRPC endpoint `HOST:PORT` (the `kuryr.openstack.org/endpoint` annotation), when given.
    pub endpoint: Option<String>,
}

/// Which shards this replica owns and who owns the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    /// The number of shards; 0: no sharding, this replica owns every key.
    pub shards: u32,
    /// This replica's identity.
    pub identity: String,
    /// Whether the first round is done (always true without sharding). Before it, this replica
    /// owns nothing and knows no owners.
    pub ready: bool,
    /// The shards this replica works on now.
    pub owned: BTreeSet<u32>,
    /// The holder of every shard whose Lease is held and not expired, by shard (as of the last
    /// round; this replica's own shards included).
    pub owners: Vec<Option<Owner>>,
}

impl Ownership {
    /// No sharding: everything is owned, at once.
    pub fn everything(identity: &str) -> Self {
        Self { shards: 0, identity: identity.to_string(), ready: true, owned: BTreeSet::new(), owners: Vec::new() }
    }

    /// Before the first round of a sharded replica: nothing owned yet.
    pub fn pending(identity: &str, shards: u32) -> Self {
        Self {
            shards,
            identity: identity.to_string(),
            ready: false,
            owned: BTreeSet::new(),
            owners: vec![None; shards as usize],
        }
    }

    /// Whether the replica is sharded at all.
    pub fn sharded(&self) -> bool {
        self.shards > 0
    }

    /// The shard of `key` (`None` without sharding).
    pub fn shard_of(&self, key: &str) -> Option<u32> {
        shard_of(key, self.shards)
    }

    /// Whether this replica owns shard `i` (every shard without sharding).
    pub fn owns_shard(&self, i: u32) -> bool {
        !self.sharded() || self.owned.contains(&i)
    }

    /// Whether this replica owns `key`'s shard.
    pub fn owns(&self, key: &str) -> bool {
        self.shard_of(key).is_none_or(|i| self.owned.contains(&i))
    }

    /// Who owns `key`'s shard, when known (`None` without sharding, or when unowned).
    pub fn owner_of(&self, key: &str) -> Option<&Owner> {
        self.shard_of(key).and_then(|i| self.owners.get(i as usize)).and_then(Option::as_ref)
    }

    /// The shards owned here that `before` did not own.
    pub fn gained_since(&self, before: &Ownership) -> BTreeSet<u32> {
        self.owned.difference(&before.owned).copied().collect()
    }

    /// The shards `before` owned that are no longer owned here.
    pub fn lost_since(&self, before: &Ownership) -> BTreeSet<u32> {
        before.owned.difference(&self.owned).copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsharded_owns_everything() {
        let o = Ownership::everything("me");
        assert!(o.ready && o.owns("any") && o.owns_shard(7));
        assert_eq!(o.owner_of("any"), None);
    }

    #[test]
    fn owners_by_key() {
        let mut o = Ownership::pending("me", 4);
        assert!(!o.ready && !o.owns("n1"));
        let i = o.shard_of("n1").unwrap_or(0);
        o.owners[i as usize] = Some(Owner { identity: "b".into(), endpoint: Some("10.0.0.2:9610".into()) });
        assert_eq!(o.owner_of("n1").and_then(|w| w.endpoint.as_deref()), Some("10.0.0.2:9610"));
        let before = o.clone();
        o.owned.insert(i);
        assert!(o.owns("n1"));
        assert_eq!(o.gained_since(&before), [i].into());
        assert_eq!(before.lost_since(&o), [i].into());
    }
}
