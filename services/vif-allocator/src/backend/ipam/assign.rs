//! The pure part of a batch: given a node's blocks as last read, which addresses a set of pods
//! gets and which entries a set of releases removes, as new block statuses. No API calls here;
//! [`super::batch`] writes what this computes, and computes it again from a fresh read when a
//! write loses to another allocator.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use kube::ResourceExt;

use super::StoreError;
use crate::core::PodKey;
use crate::core::ipam::{Block, MacAddr, Pool};
use crate::k8s::crd::{AddressBlock, AddressBlockStatus, BlockAllocation};

/// A block object whose CIDR parsed.
#[derive(Clone, Debug)]
pub(super) struct Parsed {
    pub(super) block: Block,
    pub(super) obj: AddressBlock,
}

impl Parsed {
    /// Parses the block's CIDR; a block that does not parse stops the network (allocating
    /// around it could overlap it).
    pub(super) fn new(obj: AddressBlock) -> Result<Parsed, StoreError> {
        let block =
            Block::parse(&obj.spec.cidr).map_err(|source| StoreError::CorruptBlock { name: obj.name_any(), source })?;
        Ok(Parsed { block, obj })
    }

    pub(super) fn name(&self) -> String {
        self.obj.name_any()
    }

    /// The address `uid` holds in this block, if any.
    pub(super) fn holder(&self, uid: &str) -> Option<IpAddr> {
        let status = self.obj.status.as_ref()?;
        status.allocations.iter().find(|(_, a)| a.uid == uid).and_then(|(ip, _)| ip.parse().ok())
    }

    /// Whether `uid` holds `address` in this block.
    pub(super) fn holds(&self, uid: &str, address: IpAddr) -> bool {
        self.obj.status.as_ref().is_some_and(|s| {
            s.allocations.iter().any(|(ip, a)| a.uid == uid && ip.parse::<IpAddr>().is_ok_and(|ip| ip == address))
        })
    }

    /// The recorded addresses (entries whose key does not parse are ignored, as before).
    fn used(&self) -> BTreeSet<IpAddr> {
        self.obj
            .status
            .as_ref()
            .map(|s| s.allocations.keys().filter_map(|k| k.parse().ok()).collect())
            .unwrap_or_default()
    }

    fn last_allocated(&self) -> Option<IpAddr> {
        self.obj.status.as_ref().and_then(|s| s.last_allocated.as_deref()).and_then(|s| s.parse().ok())
    }

    /// How many pod addresses are still free.
    pub(super) fn free(&self) -> u128 {
        let taken = self.used().into_iter().filter(|ip| self.block.is_pod_address(*ip)).count() as u128;
        self.block.capacity().saturating_sub(taken)
    }
}

/// Sorts blocks by CIDR, the order addresses are handed out in.
pub(super) fn sort(blocks: &mut [Parsed]) {
    blocks.sort_by_key(|p| p.block);
}

/// Free pod addresses in the blocks of `pool` (blocks outside the current CIDR keep their pods
/// but get no more).
pub(super) fn free_in_pool(blocks: &[Parsed], pool: &Pool) -> u128 {
    blocks.iter().filter(|p| pool.cidr().contains(&p.block.cidr())).map(Parsed::free).sum()
}

/// The address of `pool`'s family that `uid` holds in any of `blocks`, with the block's index.
pub(super) fn holding(blocks: &[Parsed], pool: &Pool, uid: &str) -> Option<(usize, IpAddr)> {
    blocks
        .iter()
        .enumerate()
        .filter(|(_, p)| p.block.family() == pool.family())
        .find_map(|(i, p)| p.holder(uid).map(|ip| (i, ip)))
}

/// A new status for the block at `index` of the node's blocks.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Draft {
    pub(super) index: usize,
    pub(super) status: AddressBlockStatus,
}

impl Draft {
    /// The block object to write: as read (so it carries the resourceVersion it was computed
    /// from) with the new status.
    pub(super) fn object(&self, blocks: &[Parsed]) -> AddressBlock {
        let mut obj = blocks[self.index].obj.clone();
        obj.status = Some(self.status.clone());
        obj
    }
}

/// One pod to give an address of a pool's family, with the MAC its entry records (that of its
/// IPv4 address when it has one; `None`: derive it from the new address).
pub(super) struct Want<'a> {
    pub(super) pod: &'a PodKey,
    pub(super) mac: Option<MacAddr>,
}

/// Addresses for `wants` from the node's `blocks` of `pool`, lowest block first, each block
/// searching on from its last allocation (see [`Block::next_free`]). Returns per want the
/// block index and address (`None` when the blocks are full) and the drafts to write.
pub(super) fn assign(blocks: &[Parsed], pool: &Pool, wants: &[Want<'_>]) -> (Vec<Option<(usize, IpAddr)>>, Vec<Draft>) {
    let mut got = Vec::with_capacity(wants.len());
    let mut open: HashMap<usize, (BTreeSet<IpAddr>, Option<IpAddr>, AddressBlockStatus)> = HashMap::new();
    let candidates: Vec<usize> = (0..blocks.len()).filter(|&i| pool.cidr().contains(&blocks[i].block.cidr())).collect();
    let mut from = 0;
    for want in wants {
        let mut found = None;
        while let Some(&i) = candidates.get(from) {
            let (used, last, status) = open.entry(i).or_insert_with(|| {
                (blocks[i].used(), blocks[i].last_allocated(), blocks[i].obj.status.clone().unwrap_or_default())
            });
            let Some(address) = blocks[i].block.next_free(used, *last) else {
                // Full: later wants skip it too.
                from += 1;
                continue;
            };
            used.insert(address);
            *last = Some(address);
            status.allocations.insert(
                address.to_string(),
                BlockAllocation {
                    namespace: want.pod.namespace.clone(),
                    name: want.pod.name.clone(),
                    uid: want.pod.uid.clone(),
                    mac: want.mac.unwrap_or_else(|| MacAddr::for_address(address)).to_string(),
                },
            );
            status.used = u32::try_from(status.allocations.len()).unwrap_or(u32::MAX);
            status.last_allocated = Some(address.to_string());
            found = Some((i, address));
            break;
        }
        got.push(found);
    }
    let mut drafts: Vec<Draft> = open
        .into_iter()
        .filter(|(i, _)| got.iter().any(|g| g.is_some_and(|(b, _)| b == *i)))
        .map(|(index, (_, _, status))| Draft { index, status })
        .collect();
    drafts.sort_by_key(|d| d.index);
    (got, drafts)
}

/// What a release removes: every address of `uid` in the node's blocks, or only the listed
/// ones of them (undoing part of a failed allocation, giving back a duplicate). Blocks never
/// overlap, so an address names its block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Removal {
    pub(super) uid: String,
    pub(super) only: Option<Vec<IpAddr>>,
}

impl Removal {
    fn matches(&self, ip: &str, holder: &BlockAllocation) -> bool {
        holder.uid == self.uid
            && self.only.as_ref().is_none_or(|only| ip.parse::<IpAddr>().is_ok_and(|ip| only.contains(&ip)))
    }

    /// Whether any of `blocks` holds something this removal takes away.
    pub(super) fn found_in(&self, blocks: &[Parsed]) -> bool {
        blocks
            .iter()
            .any(|p| p.obj.status.as_ref().is_some_and(|s| s.allocations.iter().any(|(ip, a)| self.matches(ip, a))))
    }
}

/// The drafts that carry out `removals` on `blocks`, and per draft which removals it serves.
pub(super) fn remove(blocks: &[Parsed], removals: &[&Removal]) -> Vec<(Draft, Vec<usize>)> {
    let mut out = Vec::new();
    for (index, p) in blocks.iter().enumerate() {
        let Some(status) = p.obj.status.as_ref() else { continue };
        let mut served = Vec::new();
        let mut next = status.clone();
        next.allocations.retain(|ip, a| {
            let hit = removals.iter().position(|r| r.matches(ip, a));
            if let Some(r) = hit
                && !served.contains(&r)
            {
                served.push(r);
            }
            hit.is_none()
        });
        if served.is_empty() {
            continue;
        }
        next.used = u32::try_from(next.allocations.len()).unwrap_or(u32::MAX);
        out.push((Draft { index, status: next }, served));
    }
    out
}

#[cfg(test)]
mod tests {
    use kube::api::ObjectMeta;

    use super::*;
    use crate::core::ipam::ipnet::IpNet;
    use crate::k8s::crd::AddressBlockSpec;

    fn block(cidr: &str, entries: &[(&str, &str)], last: Option<&str>) -> Parsed {
        let allocations = entries
            .iter()
            .map(|(ip, uid)| {
                let holder = BlockAllocation {
                    namespace: "ns".into(),
                    name: format!("pod-{uid}"),
                    uid: (*uid).into(),
                    mac: "0a:58:00:00:00:00".into(),
                };
                ((*ip).to_string(), holder)
            })
            .collect();
        let obj = AddressBlock {
            metadata: ObjectMeta {
                name: Some(format!("net-{cidr}").replace(['.', '/', ':'], "-")),
                ..Default::default()
            },
            spec: AddressBlockSpec { network: "net".into(), cidr: cidr.into(), node: "n".into() },
            status: Some(AddressBlockStatus {
                allocations,
                used: entries.len() as u32,
                last_allocated: last.map(Into::into),
            }),
        };
        Parsed::new(obj).unwrap()
    }

    fn pool(cidr: &str, prefix: u8) -> Pool {
        Pool::new(cidr.parse::<IpNet>().unwrap(), prefix).unwrap()
    }

    fn pods(n: usize) -> Vec<PodKey> {
        (0..n).map(|i| PodKey::new("ns", format!("p{i}"), format!("u{i}"))).collect()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_batch_fills_blocks_in_order_with_one_draft_per_block() {
        // /29: five pod addresses .2-.6; the first block has two taken and searches on after .3.
        let blocks = vec![
            block("10.0.0.0/29", &[("10.0.0.2", "a"), ("10.0.0.3", "b")], Some("10.0.0.3")),
            block("10.0.0.8/29", &[], None),
            block("10.9.0.0/29", &[], None),
        ];
        let pool = pool("10.0.0.0/24", 29);
        assert_eq!(free_in_pool(&blocks, &pool), 8, "the block outside the pool's CIDR gets no more pods");
        let keys = pods(9);
        let wants: Vec<Want<'_>> = keys.iter().map(|pod| Want { pod, mac: None }).collect();
        let (got, drafts) = assign(&blocks, &pool, &wants);
        let addresses: Vec<Option<String>> = got.iter().map(|g| g.map(|(_, a)| a.to_string())).collect();
        let want: Vec<Option<String>> = ["10.0.0.4", "10.0.0.5", "10.0.0.6", "10.0.0.10", "10.0.0.11"]
            .iter()
            .chain(&["10.0.0.12", "10.0.0.13", "10.0.0.14"])
            .map(|s| Some(s.to_string()))
            .chain([None])
            .collect();
        assert_eq!(addresses, want, "the ninth pod does not fit");
        assert_eq!(drafts.len(), 2);
        assert_eq!((drafts[0].index, drafts[0].status.used), (0, 5));
        assert_eq!(drafts[0].status.last_allocated.as_deref(), Some("10.0.0.6"));
        assert_eq!(drafts[0].status.allocations["10.0.0.4"].uid, "u0");
        assert_eq!(drafts[0].status.allocations["10.0.0.4"].mac, "0a:58:0a:00:00:04");
        assert_eq!((drafts[1].index, drafts[1].status.used), (1, 5));
        // The drafts are new statuses on the objects as read: the read's resourceVersion goes along.
        assert_eq!(drafts[1].object(&blocks).spec.cidr, "10.0.0.8/29");
        // Nothing was handed out twice.
        let distinct: BTreeSet<_> = got.iter().flatten().map(|(_, a)| *a).collect();
        assert_eq!(distinct.len(), 8);
    }

    #[test]
    fn next_fit_wraps_and_entries_carry_the_given_mac() {
        let blocks = vec![block("fd00::/125", &[("fd00::2", "a"), ("fd00::7", "b")], Some("fd00::7"))];
        let pool = pool("fd00::/120", 125);
        let keys = pods(1);
        let mac = MacAddr::for_address(ip("10.1.2.3"));
        let (got, drafts) = assign(&blocks, &pool, &[Want { pod: &keys[0], mac: Some(mac) }]);
        assert_eq!(got, [Some((0, ip("fd00::3")))]);
        assert_eq!(drafts[0].status.allocations["fd00::3"].mac, "0a:58:0a:01:02:03");
        assert_eq!(holding(&blocks, &pool, "b"), Some((0, ip("fd00::7"))));
        assert_eq!(holding(&blocks, &pool, "u0"), None);
    }

    #[test]
    fn removals_take_every_address_of_a_uid_or_only_the_listed_ones() {
        let blocks = vec![
            block("10.0.0.0/29", &[("10.0.0.2", "a"), ("10.0.0.3", "b")], None),
            block("fd00::/125", &[("fd00::2", "a"), ("fd00::3", "c")], None),
        ];
        let all_of_a = Removal { uid: "a".into(), only: None };
        let one_of_c = Removal { uid: "c".into(), only: Some(vec![ip("fd00::3")]) };
        let not_held = Removal { uid: "b".into(), only: Some(vec![ip("10.0.0.4"), ip("fd00::3")]) };
        let unknown = Removal { uid: "z".into(), only: None };
        assert!(all_of_a.found_in(&blocks) && one_of_c.found_in(&blocks));
        assert!(!not_held.found_in(&blocks) && !unknown.found_in(&blocks));
        let drafts = remove(&blocks, &[&all_of_a, &one_of_c, &not_held, &unknown]);
        assert_eq!(drafts.len(), 2);
        let (d0, served0) = &drafts[0];
        assert_eq!((d0.index, served0.as_slice(), d0.status.used), (0, &[0][..], 1));
        assert!(d0.status.allocations.contains_key("10.0.0.3"));
        let (d1, served1) = &drafts[1];
        assert_eq!((d1.index, d1.status.used), (1, 0));
        assert_eq!(served1.iter().copied().collect::<BTreeSet<_>>(), BTreeSet::from([0, 1]));
    }
}
