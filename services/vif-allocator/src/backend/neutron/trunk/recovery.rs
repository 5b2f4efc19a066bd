//! What a trunk holds after a restart, and keeping it true: recovery from Neutron's trunks and
//! subport ports, status pushes, the collector of stray subport ports, and the views the pool
//! API and the orphan collection read.

use super::*;

impl Nested {
    /// Rebuilds the trunks' state from Neutron; `recorded` (pod uid → port id) decides which
    /// port a pod keeps should it hold two.
    pub async fn recover(&self, recorded: &HashMap<String, String>) -> Result<Recovered, ClusterError> {
        let trunks = self.neutron.list_trunks(&Filter::new()).await.map_err(neutron_err("listing the trunks"))?;
        let filter = Filter::new().device_owner(DEVICE_OWNER).tags(std::slice::from_ref(&self.tag));
        let mut ports =
            self.neutron.list_ports(&filter).await.map_err(neutron_err("listing the cluster's subports"))?;
        ports.sort_by_key(|p| recorded.get(&p.device_id) != Some(&p.id));
        let parents: Vec<String> = trunks.iter().map(|t| t.port_id.clone()).collect();
        let parent_ports = if parents.is_empty() {
            Vec::new()
        } else {
            self.neutron
                .list_ports_by_ids(&parents, &Filter::new().fields(&["id", "fixed_ips"]))
                .await
                .map_err(neutron_err("reading the trunks' parent ports"))?
        };
        let mut on_trunk: HashMap<String, (String, u16)> = HashMap::new();
        let mut state = State::default();
        for t in &trunks {
            let parent_ips = parent_ports
                .iter()
                .find(|p| p.id == t.port_id)
                .map(|p| p.fixed_ips.iter().filter_map(|f| f.ip_address.clone()).collect())
                .unwrap_or_default();
            let mut ts = TrunkState { parent_port: t.port_id.clone(), parent_ips, ..TrunkState::default() };
            for s in &t.sub_ports {
                if let Ok(v) = u16::try_from(s.segmentation_id) {
                    on_trunk.insert(s.port_id.clone(), (t.id.clone(), v));
                    ts.slots.insert(v, Slot::Foreign(s.port_id.clone()));
                }
            }
            state.trunks.insert(t.id.clone(), ts);
        }
        let mut summary = Recovered::default();
        let mut doomed: Vec<(Option<String>, String)> = Vec::new();
        for p in ports {
            let Some((trunk, vlan)) = on_trunk.get(&p.id).cloned() else {
                doomed.push((None, p.id.clone()));
                continue;
            };
            let slot = if p.device_id.is_empty() && !self.limits.pooling() {
                // A spare subport with pools off (a kill before its pod's uid was set on it).
                doomed.push((Some(trunk), p.id.clone()));
                continue;
            } else if p.device_id.is_empty() {
                summary.free += 1;
                Slot::Free(Box::new(p))
            } else if state.held.contains_key(&p.device_id) {
                doomed.push((Some(trunk), p.id.clone()));
                continue;
            } else {
                summary.in_use += 1;
                state.held.insert(p.device_id.clone(), HeldAt { trunk: trunk.clone(), vlan });
                Slot::Held(p.device_id.clone(), Box::new(p))
            };
            if let Some(ts) = state.trunks.get_mut(&trunk) {
                ts.slots.insert(vlan, slot);
            }
        }
        *guard(&self.state) = state;
        for (trunk, port) in doomed {
            tracing::warn!(port, trunk = ?trunk, "deleting a subport port found at recovery (not on a trunk, or a pod's second)");
            match trunk {
                Some(t) => self.remove_and_delete(&t, &port).await?,
                None => {
                    self.neutron.delete_port(&port).await.map_err(neutron_err(format!("deleting port {port}")))?;
                }
            }
            summary.deleted += 1;
        }
        Ok(summary)
    }

    /// Whether the pod holds `port` and it was last seen ACTIVE (a subport is ACTIVE once its
    /// trunk is wired: the pod's plug inside the VM does not change it).
    pub fn active_for(&self, pod_uid: &str, port: &str) -> bool {
        self.held(pod_uid).is_some_and(|(p, _)| p.id == port && p.is_active())
    }

    /// Records a pushed status of a known subport (newer revisions only); returns the pod
    /// holding it (empty for a spare one), `None` when the port is not known.
    pub fn note_status(&self, port: &str, status: Option<&str>, revision: Option<u64>) -> Option<String> {
        let mut st = guard(&self.state);
        for t in st.trunks.values_mut() {
            for slot in t.slots.values_mut() {
                let (holder, p) = match slot {
                    Slot::Held(uid, p) => (uid.clone(), p),
                    Slot::Free(p) => (String::new(), p),
                    _ => continue,
                };
                if p.id != port {
                    continue;
                }
                let newer = match (revision, p.revision_number) {
                    (Some(r), Some(known)) => r > known,
                    _ => true,
                };
                if newer && let Some(s) = status {
                    p.status = s.to_string();
                    if revision.is_some() {
                        p.revision_number = revision;
                    }
                }
                return Some(holder);
            }
        }
        None
    }

    /// The ids of every port the state knows (held or spare).
    pub(super) fn known_ports(&self) -> HashSet<String> {
        let busy = guard(&self.busy).clone();
        let st = guard(&self.state);
        let known: HashSet<String> = st
            .trunks
            .values()
            .flat_map(|t| t.slots.values())
            .filter_map(|s| match s {
                Slot::Held(_, p) | Slot::Free(p) => Some(p.id.clone()),
                _ => None,
            })
            .collect();
        known.union(&busy).cloned().collect()
    }

    /// One round of the stray collector: the cluster's subport ports the state does not know
    /// (with the trunk each is on, if any). Those that were already `suspects` are removed from
    /// their trunk and deleted; returns the new suspects.
    pub(super) async fn collect_round(&self, suspects: &HashSet<String>) -> Result<HashSet<String>, ClusterError> {
        let filter = Filter::new().device_owner(DEVICE_OWNER).tags(std::slice::from_ref(&self.tag)).fields(&["id"]);
        let ports = self.neutron.list_ports(&filter).await.map_err(neutron_err("listing the cluster's subports"))?;
        let known = self.known_ports();
        let unknown: HashSet<String> = ports.into_iter().map(|p| p.id).filter(|id| !known.contains(id)).collect();
        if unknown.is_empty() {
            return Ok(unknown);
        }
        let doomed: Vec<&String> = unknown.iter().filter(|id| suspects.contains(*id)).collect();
        if doomed.is_empty() {
            return Ok(unknown);
        }
        let trunks = self.neutron.list_trunks(&Filter::new()).await.map_err(neutron_err("listing the trunks"))?;
        for id in doomed {
            // Known by now (a slow allocation finished): not a stray.
            if self.known_ports().contains(id) {
                continue;
            }
            let trunk = trunks.iter().find(|t| t.sub_ports.iter().any(|s| &s.port_id == id));
            tracing::warn!(port = %id, trunk = ?trunk.map(|t| &t.id), "deleting a stray subport port (a call of an earlier allocator completed late)");
            match trunk {
                Some(t) => self.remove_and_delete(&t.id, id).await?,
                None => {
                    self.neutron.delete_port(id).await.map_err(neutron_err(format!("deleting port {id}")))?;
                }
            }
        }
        Ok(unknown)
    }

    /// Runs the stray collector until shutdown.
    pub async fn collect_strays(self: Arc<Self>, shutdown: Shutdown) {
        let mut suspects = HashSet::new();
        loop {
            tokio::select! {
                () = tokio::time::sleep(STRAY_PERIOD) => {}
                () = shutdown.clone().wait() => return,
            }
            match self.collect_round(&suspects).await {
                Ok(s) => suspects = s,
                Err(e) => tracing::warn!(error = %crate::error::chain(&e), "collecting stray subports failed"),
            }
        }
    }

    /// Every pod holding a subport: (pod, node); the node is empty while its trunk is not
    /// matched to a node's addresses.
    pub fn holders(&self) -> Vec<(PodKey, String)> {
        let all_ips = self.node_ips.get().map(|f| f()).unwrap_or_default();
        let st = guard(&self.state);
        let node_of = |trunk: &str| -> String {
            if let Some((n, _)) = st.nodes.iter().find(|(_, t)| *t == trunk) {
                return n.clone();
            }
            let ips = st.trunks.get(trunk).map(|t| t.parent_ips.clone()).unwrap_or_default();
            all_ips
                .iter()
                .find(|(_, a)| a.iter().any(|ip| ips.contains(ip)))
                .map(|(n, _)| n.clone())
                .unwrap_or_default()
        };
        st.held
            .iter()
            .filter_map(|(uid, at)| {
                let Slot::Held(_, port) = st.trunks.get(&at.trunk)?.slots.get(&at.vlan)? else { return None };
                let (ns, name) = port.name.split_once('/').unwrap_or(("", ""));
                Some((PodKey::new(ns, name, uid), node_of(&at.trunk)))
            })
            .collect()
    }

    /// Every trunk known, with this cluster's subports.
    pub fn views(&self) -> Vec<TrunkView> {
        let st = guard(&self.state);
        let mut out: Vec<TrunkView> = st
            .trunks
            .iter()
            .map(|(id, t)| {
                let pick = |held: bool| -> BTreeMap<u16, String> {
                    t.slots
                        .iter()
                        .filter_map(|(v, s)| match s {
                            Slot::Held(_, p) if held => Some((*v, p.id.clone())),
                            Slot::Free(p) if !held => Some((*v, p.id.clone())),
                            _ => None,
                        })
                        .collect()
                };
                TrunkView { trunk: id.clone(), parent_port: t.parent_port.clone(), held: pick(true), free: pick(false) }
            })
            .collect();
        out.sort_by(|a, b| a.trunk.cmp(&b.trunk));
        out
    }

    /// VLAN ids in use per trunk (any client's), for checks.
    pub fn used_vlans(&self, trunk: &str) -> BTreeSet<u16> {
        guard(&self.state).trunks.get(trunk).map(|t| t.slots.keys().copied().collect()).unwrap_or_default()
    }
}
