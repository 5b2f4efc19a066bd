//! What each VLAN id of a node's trunk carries (reserved, a pod's subport, a spare one, another
//! client's), the lowest free ids, and where each pod's subport is.

use std::collections::{BTreeMap, HashMap};

use kuryr_openstack::neutron::{Port, SubPort};

/// The VLAN ids a subport may take.
pub(super) const VLAN_MIN: u16 = 1;
pub(super) const VLAN_MAX: u16 = 4094;

/// What a VLAN id of a trunk carries.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Slot {
    /// Being added (a pod's or a refill's port).
    Reserved,
    /// This cluster's port, held by a pod.
    Held(String, Box<Port>),
    /// This cluster's spare port.
    Free(Box<Port>),
    /// Another client's subport.
    Foreign(String),
}

/// One trunk.
#[derive(Clone, Debug, Default)]
pub(super) struct TrunkState {
    pub(super) parent_port: String,
    /// The parent port's addresses: how the trunk is matched to a node.
    pub(super) parent_ips: Vec<String>,
    pub(super) slots: BTreeMap<u16, Slot>,
    /// A refill runs.
    pub(super) filling: bool,
}

impl TrunkState {
    pub(super) fn free_vlan(&self) -> Option<u16> {
        (VLAN_MIN..=VLAN_MAX).find(|v| !self.slots.contains_key(v))
    }

    pub(super) fn spare(&self) -> u32 {
        let n = self.slots.values().filter(|s| matches!(s, Slot::Free(_))).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Takes the spare port on the lowest VLAN id, leaving the id reserved.
    pub(super) fn take_free(&mut self) -> Option<(u16, Port)> {
        let vlan = self.slots.iter().find(|(_, s)| matches!(s, Slot::Free(_))).map(|(v, _)| *v)?;
        match self.slots.insert(vlan, Slot::Reserved) {
            Some(Slot::Free(p)) => Some((vlan, *p)),
            _ => None,
        }
    }

    /// Reserves `n` free VLAN ids.
    pub(super) fn reserve(&mut self, n: usize) -> Vec<u16> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let Some(v) = self.free_vlan() else { break };
            self.slots.insert(v, Slot::Reserved);
            out.push(v);
        }
        out
    }

    /// Learns the trunk's subports as Neutron lists them: ids of other clients' subports are
    /// marked foreign (ours are known already).
    pub(super) fn learn(&mut self, subports: &[SubPort]) {
        for s in subports {
            let Ok(vlan) = u16::try_from(s.segmentation_id) else { continue };
            self.slots.entry(vlan).or_insert_with(|| Slot::Foreign(s.port_id.clone()));
        }
    }
}

/// Where a pod's subport is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct HeldAt {
    pub(super) trunk: String,
    pub(super) vlan: u16,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) trunks: HashMap<String, TrunkState>,
    /// Node → trunk id, once found.
    pub(super) nodes: HashMap<String, String>,
    /// Pod uid → its subport.
    pub(super) held: HashMap<String, HeldAt>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn port(id: &str) -> Box<Port> {
        Box::new(Port { id: id.into(), ..Port::default() })
    }

    #[test]
    fn vlan_ids_are_the_lowest_unused_and_foreign_ones_are_avoided() {
        let mut t = TrunkState::default();
        t.learn(&[SubPort::vlan("vm-own", 1), SubPort::vlan("other", 3)]);
        assert_eq!(t.reserve(3), [2, 4, 5]);
        t.slots.insert(2, Slot::Free(port("a")));
        t.slots.insert(4, Slot::Held("uid".into(), port("b")));
        assert_eq!(t.spare(), 1);
        assert_eq!(t.take_free().map(|(v, p)| (v, p.id)), Some((2, "a".to_string())));
        assert_eq!(t.slots.get(&2), Some(&Slot::Reserved), "taken ids stay reserved");
        assert!(t.take_free().is_none());
        // Known ids are not overwritten by what a listing says.
        t.learn(&[SubPort::vlan("b", 4)]);
        assert!(matches!(t.slots.get(&4), Some(Slot::Held(..))));
    }

    #[test]
    fn a_full_trunk_reserves_what_is_left() {
        let mut t = TrunkState::default();
        for v in VLAN_MIN..=VLAN_MAX - 2 {
            t.slots.insert(v, Slot::Foreign(format!("p{v}")));
        }
        assert_eq!(t.reserve(5), [4093, 4094]);
        assert_eq!(t.free_vlan(), None);
    }
}
