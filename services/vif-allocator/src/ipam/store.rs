//! The IPAM on the Kubernetes API: blocks are [`AddressBlock`] objects, allocations live in their
//! status.
//!
//! # Why two allocators can never hand out one address
//!
//! An address is handed out only after a write of its block's status succeeded, and that write
//! is a `replace_status` carrying the `resourceVersion` of the block as read. The API server
//! (etcd compare-and-swap underneath) accepts it only if nobody wrote the block since; otherwise
//! it answers 409 Conflict and this store re-reads and recomputes (jittered exponential backoff,
//! bounded by [`StoreConfig::max_retries`]). Two allocators that picked the same free address
//! from the same version of a block therefore cannot both succeed. Block claims are safe the same
//! way: a block's object name is derived from its CIDR, so claiming is a `create` that exactly
//! one allocator wins (`AlreadyExists` for the rest), and a block's spec is immutable (a CEL
//! rule in the CRD), so its owner never changes under an allocator's feet.
//!
//! Within one process, writers to one node's blocks take a per-(network, node) async lock, so
//! that a burst of local requests queues instead of conflicting with itself; conflicts then only
//! come from other processes. The lock is an optimisation, never the safety argument.
//!
//! # Idempotency
//!
//! Allocations are keyed by pod uid. Allocating for a pod that already holds an address of a
//! family in one of the node's blocks returns that address; releasing removes every address the
//! uid holds and is a no-op when it holds none. A pod's MAC is a function of its address, so a
//! repeated allocation yields the same VIF. Callers pass the pod's `spec.nodeName`, which never
//! changes once set; only the node's blocks are read on the allocation path.
//!
//! # Cost
//!
//! An allocation reads the PodNetwork and the node's blocks (a field selector on the
//! selectable fields `spec.network` and `spec.node`, so the cost does not grow with the cluster)
//! and writes one block status per family. Only a block claim, `release` without a node, and
//! `node_blocks` list the whole network.

mod error;
mod types;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};

use super::ipnet::IpNet;
use super::{Block, MacAddr, NetworkPlan, PlanError, Pool, block_name};
use crate::crd::{AddressBlock, AddressBlockSpec, BlockAllocation, PodNetwork, PodNetworkSpec, PodNetworkStatus};

pub use error::StoreError;
pub use types::{Allocation, AssignedAddress, PodKey, StoreConfig, StoreStats, backoff_delay};

use error::{check_network_name, check_non_empty, is_retryable, kube_err};
use types::{Counters, bump};

/// Longest network name: block names append `-` and the CIDR (at most 43 characters, a full
/// IPv6 address and `/128`) and must stay within the 253 characters of an object name.
pub const MAX_NETWORK_NAME: usize = 253 - 44;

/// Serialises one process's writes to one node's blocks of one network.
type NodeLock = Arc<tokio::sync::Mutex<()>>;

/// The IPAM kept in Kubernetes custom resources.
#[derive(Debug)]
pub struct IpamStore {
    networks: Api<PodNetwork>,
    blocks: Api<AddressBlock>,
    config: StoreConfig,
    counters: Counters,
    /// Per (network, node): serialises this process's writes to one node's blocks.
    locks: Mutex<HashMap<(String, String), NodeLock>>,
}

/// A block object whose CIDR parsed.
struct Parsed {
    block: Block,
    obj: AddressBlock,
}

impl Parsed {
    fn name(&self) -> String {
        self.obj.name_any()
    }

    /// The next free pod address of the block, searching on from its last allocation.
    fn free_address(&self) -> Option<IpAddr> {
        let status = self.obj.status.as_ref();
        let used: BTreeSet<IpAddr> =
            status.map(|s| s.allocations.keys().filter_map(|k| k.parse().ok()).collect()).unwrap_or_default();
        let after = status.and_then(|s| s.last_allocated.as_deref()).and_then(|s| s.parse().ok());
        self.block.next_free(&used, after)
    }

    fn holder(&self, uid: &str) -> Option<IpAddr> {
        let status = self.obj.status.as_ref()?;
        status.allocations.iter().find(|(_, a)| a.uid == uid).and_then(|(ip, _)| ip.parse().ok())
    }
}

impl IpamStore {
    /// A store with the default configuration.
    pub fn new(client: Client) -> IpamStore {
        IpamStore::with_config(client, StoreConfig::default())
    }

    /// A store with `config`.
    pub fn with_config(client: Client, config: StoreConfig) -> IpamStore {
        IpamStore {
            networks: Api::all(client.clone()),
            blocks: Api::all(client),
            config,
            counters: Counters::default(),
            locks: Mutex::new(HashMap::new()),
        }
    }

    /// Counters since the store was made (conflicts show optimistic concurrency at work).
    pub fn stats(&self) -> StoreStats {
        self.counters.snapshot()
    }

    /// Creates or updates (server-side apply) the PodNetwork `name` after validating `spec`,
    /// then refreshes its status.
    pub async fn ensure_network(&self, name: &str, spec: &PodNetworkSpec) -> Result<PodNetwork, StoreError> {
        check_network_name(name)?;
        spec.plan().map_err(|source| StoreError::InvalidNetwork { network: name.to_string(), source })?;
        let params = PatchParams::apply(&self.config.field_manager).force();
        let applied = self
            .networks
            .patch(name, &params, &Patch::Apply(&PodNetwork::new(name, spec.clone())))
            .await
            .map_err(kube_err(format!("applying PodNetwork {name}")))?;
        self.refresh_network_status(name).await?;
        Ok(applied)
    }

    /// Recomputes a PodNetwork's status: its block count and the `Ready` condition.
    pub async fn refresh_network_status(&self, network: &str) -> Result<PodNetworkStatus, StoreError> {
        let net = self.get_network(network).await?;
        let blocks = self.list_blocks(network, None).await?;
        let (ok, reason, message) = match net.spec.plan() {
            Ok(_) => ("True", "Valid", None),
            Err(e) => ("False", "InvalidSpec", Some(e.to_string())),
        };
        let old = net.status.as_ref().and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
        let since = match old {
            Some(c) if c.status == ok => c.last_transition_time.clone(),
            _ => Time(k8s_openapi::jiff::Timestamp::now()),
        };
        let status = PodNetworkStatus {
            allocated_blocks: u32::try_from(blocks.len()).unwrap_or(u32::MAX),
            conditions: vec![Condition {
                type_: "Ready".to_string(),
                status: ok.to_string(),
                reason: reason.to_string(),
                message: message.clone().unwrap_or_default(),
                last_transition_time: since,
                observed_generation: net.metadata.generation,
            }],
            message,
        };
        // Spelled out so that an absent message is sent as null, which a merge patch deletes.
        let patch = Patch::Merge(serde_json::json!({ "status": {
            "allocatedBlocks": status.allocated_blocks,
            "conditions": status.conditions,
            "message": status.message,
        }}));
        self.networks
            .patch_status(network, &PatchParams::default(), &patch)
            .await
            .map_err(kube_err(format!("updating the status of PodNetwork {network}")))?;
        Ok(status)
    }

    /// Gives `pod` on `node` one address per family of `network` from the node's blocks,
    /// claiming a free block of the network when the node's blocks are full. Idempotent: a pod
    /// that already holds addresses gets them back. On failure nothing this call recorded is
    /// left behind.
    pub async fn allocate(&self, network: &str, node: &str, pod: &PodKey) -> Result<Allocation, StoreError> {
        check_network_name(network)?;
        check_non_empty("node", node)?;
        check_non_empty("pod uid", &pod.uid)?;
        let lock = self.node_lock(network, node);
        let _guard = lock.lock().await;
        // Read under the lock: a queue of local requests then keeps one request per node in
        // flight instead of a burst, and each sees the spec as it is when its turn comes. The
        // two reads are independent, so they go out together; the block list serves every
        // family's first attempt (a retry reads afresh).
        let (plan, mut snapshot) = tokio::try_join!(self.plan(network), self.list_blocks(network, Some(node)))?;

        let mut addresses = Vec::new();
        let mut written = Vec::new();
        let mut mac = None;
        for pool in plan.pools() {
            let (first, rest) =
                std::mem::take(&mut snapshot).into_iter().partition(|p| p.block.family() == pool.family());
            snapshot = rest;
            match self.allocate_in_pool(network, node, pod, pool, mac, first).await {
                Ok((assigned, new)) => {
                    mac.get_or_insert(MacAddr::for_address(assigned.address));
                    if new {
                        written.push(assigned.block_name.clone());
                    }
                    addresses.push(assigned);
                }
                Err(e) => {
                    // Undo only what this call wrote; addresses found already recorded may be
                    // in use by a running pod.
                    for name in &written {
                        if let Err(undo) = self.remove_locked(network, node, name, &pod.uid).await {
                            tracing::warn!(network, node, block = %name, pod = %pod.uid, error = %undo,
                                "could not roll back a partial allocation; release the pod to free it");
                        }
                    }
                    return Err(e);
                }
            }
        }
        let existing = written.is_empty();
        bump(if existing { &self.counters.existing } else { &self.counters.allocations });
        let pairs: Vec<(Block, IpAddr)> = addresses.iter().map(|a| (a.block, a.address)).collect();
        let vif = plan
            .vif(&pairs)
            .ok_or_else(|| StoreError::InvalidNetwork { network: network.to_string(), source: PlanError::NoCidr })?;
        let vif_id = format!("{network}/{}", pairs[0].1);
        Ok(Allocation {
            network: network.into(),
            node: node.into(),
            pod: pod.clone(),
            addresses,
            vif_id,
            vif,
            existing,
        })
    }

    /// One family: the pod's existing address, or a new one. Returns whether it was written now.
    /// `first` is the node's blocks of the family as just read, for the first attempt.
    async fn allocate_in_pool(
        &self,
        network: &str,
        node: &str,
        pod: &PodKey,
        pool: &Pool,
        mac: Option<MacAddr>,
        first: Vec<Parsed>,
    ) -> Result<(AssignedAddress, bool), StoreError> {
        let mut retries = 0;
        let mut first = Some(first);
        'fresh: loop {
            let blocks: Vec<Parsed> = match first.take() {
                Some(blocks) => blocks,
                None => self.family_blocks(network, Some(node), pool).await?,
            };

            if let Some((p, address)) = blocks.iter().find_map(|p| p.holder(&pod.uid).map(|ip| (p, ip))) {
                return Ok((AssignedAddress { block_name: p.name(), block: p.block, address }, false));
            }

            // Blocks outside the current CIDR (the spec changed) keep their pods but get no more.
            for p in blocks.iter().filter(|p| pool.cidr().contains(&p.block.cidr())) {
                let Some(address) = p.free_address() else { continue };

                let mut updated = p.obj.clone();
                let status = updated.status.get_or_insert_with(Default::default);
                status.allocations.insert(
                    address.to_string(),
                    BlockAllocation {
                        namespace: pod.namespace.clone(),
                        name: pod.name.clone(),
                        uid: pod.uid.clone(),
                        mac: mac.unwrap_or_else(|| MacAddr::for_address(address)).to_string(),
                    },
                );
                status.used = u32::try_from(status.allocations.len()).unwrap_or(u32::MAX);
                status.last_allocated = Some(address.to_string());
                // `updated` carries the resourceVersion we read: the write succeeds only if the
                // block is unchanged since, which is what makes the address ours alone.
                let name = p.name();
                match self.blocks.replace_status(&name, &PostParams::default(), &updated).await {
                    Ok(_) => return Ok((AssignedAddress { block_name: name, block: p.block, address }, true)),
                    Err(e) if is_retryable(&e) => {
                        bump(&self.counters.conflicts);
                        self.back_off(&mut retries, network, node).await?;
                        continue 'fresh;
                    }
                    Err(e) => return Err(kube_err(format!("recording {address} in address block {name}"))(e)),
                }
            }

            // The node's blocks are full: claim the lowest block that overlaps no block of the
            // network (any node, any size). But first look at the node's blocks in this newer
            // read: another allocator may have claimed one for the node since, and a second
            // claim would waste a block.
            let all = self.family_blocks(network, None, pool).await?;
            let has_room = |p: &Parsed| pool.cidr().contains(&p.block.cidr()) && p.free_address().is_some();
            if all.iter().any(|p| p.obj.spec.node == node && has_room(p)) {
                first = Some(all.into_iter().filter(|p| p.obj.spec.node == node).collect());
                continue;
            }
            let taken: Vec<Block> = all.iter().map(|p| p.block).collect();
            let Some(free) = pool.first_free_block(&taken) else {
                return Err(StoreError::Exhausted {
                    network: network.to_string(),
                    cidr: pool.cidr(),
                    node: node.to_string(),
                    block_prefix: pool.block_prefix(),
                });
            };
            if !self.claim(network, node, free).await? {
                self.back_off(&mut retries, network, node).await?;
            }
        }
    }

    /// Creates the block object; `false` when another allocator created it first.
    async fn claim(&self, network: &str, node: &str, block: Block) -> Result<bool, StoreError> {
        let name = block_name(network, &block);
        let obj = AddressBlock {
            metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() },
            spec: AddressBlockSpec { network: network.into(), cidr: block.to_string(), node: node.into() },
            status: None,
        };
        let params = PostParams { field_manager: Some(self.config.field_manager.clone()), ..Default::default() };
        match self.blocks.create(&params, &obj).await {
            Ok(_) => {
                bump(&self.counters.blocks_claimed);
                tracing::info!(network, node, block = %block, "claimed address block");
                if let Err(e) = self.refresh_network_status(network).await {
                    tracing::warn!(network, error = %e, "could not update the PodNetwork status after a block claim");
                }
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.is_already_exists() => {
                let Some(existing) =
                    self.blocks.get_opt(&name).await.map_err(kube_err(format!("reading address block {name}")))?
                else {
                    // Created and deleted again in between: simply look again.
                    return Ok(false);
                };
                if existing.spec.network != network || existing.spec.cidr != block.to_string() {
                    return Err(StoreError::NameCollision { name, network: network.into(), cidr: block });
                }
                bump(&self.counters.claim_races);
                Ok(false)
            }
            Err(e) => Err(kube_err(format!("creating address block {name}"))(e)),
        }
    }

    /// Frees every address `pod_uid` holds in `network`. Returns whether anything was freed;
    /// releasing an unknown pod is not an error. Reads every block of the network; see
    /// [`release_on_node`](Self::release_on_node) when the pod's node is known.
    pub async fn release(&self, network: &str, pod_uid: &str) -> Result<bool, StoreError> {
        self.release_from(network, None, pod_uid).await
    }

    /// [`release`](Self::release), reading only `node`'s blocks.
    pub async fn release_on_node(&self, network: &str, node: &str, pod_uid: &str) -> Result<bool, StoreError> {
        check_non_empty("node", node)?;
        self.release_from(network, Some(node), pod_uid).await
    }

    async fn release_from(&self, network: &str, node: Option<&str>, pod_uid: &str) -> Result<bool, StoreError> {
        check_network_name(network)?;
        check_non_empty("pod uid", pod_uid)?;
        let holders: Vec<(String, String)> = self
            .list_blocks(network, node)
            .await?
            .into_iter()
            .filter(|p| p.holder(pod_uid).is_some())
            .map(|p| (p.name(), p.obj.spec.node.clone()))
            .collect();
        let mut released = false;
        for (name, node) in holders {
            let lock = self.node_lock(network, &node);
            let _guard = lock.lock().await;
            released |= self.remove_locked(network, &node, &name, pod_uid).await?;
        }
        if released {
            bump(&self.counters.releases);
        }
        Ok(released)
    }

    /// Removes the uid's entries from one block; the caller holds the node's lock.
    async fn remove_locked(&self, network: &str, node: &str, name: &str, uid: &str) -> Result<bool, StoreError> {
        let mut retries = 0;
        loop {
            let read = self.blocks.get_opt(name).await.map_err(kube_err(format!("reading address block {name}")))?;
            let Some(mut obj) = read else { return Ok(false) };
            let Some(status) = obj.status.as_mut() else { return Ok(false) };
            let before = status.allocations.len();
            status.allocations.retain(|_, a| a.uid != uid);
            if status.allocations.len() == before {
                return Ok(false);
            }
            status.used = u32::try_from(status.allocations.len()).unwrap_or(u32::MAX);
            match self.blocks.replace_status(name, &PostParams::default(), &obj).await {
                Ok(_) => return Ok(true),
                Err(e) if is_retryable(&e) => {
                    bump(&self.counters.conflicts);
                    self.back_off(&mut retries, network, node).await?;
                }
                Err(e) => return Err(kube_err(format!("removing pod {uid} from address block {name}"))(e)),
            }
        }
    }

    /// The blocks of `network` by owning node, for routes between nodes.
    pub async fn node_blocks(&self, network: &str) -> Result<BTreeMap<String, Vec<IpNet>>, StoreError> {
        check_network_name(network)?;
        let mut by_node: BTreeMap<String, Vec<IpNet>> = BTreeMap::new();
        for p in self.list_blocks(network, None).await? {
            by_node.entry(p.obj.spec.node.clone()).or_default().push(p.block.cidr());
        }
        Ok(by_node)
    }

    /// The network's validated plan.
    async fn plan(&self, network: &str) -> Result<NetworkPlan, StoreError> {
        let net = self.get_network(network).await?;
        net.spec.plan().map_err(|source| StoreError::InvalidNetwork { network: network.to_string(), source })
    }

    async fn get_network(&self, network: &str) -> Result<PodNetwork, StoreError> {
        self.networks
            .get_opt(network)
            .await
            .map_err(kube_err(format!("reading PodNetwork {network}")))?
            .ok_or_else(|| StoreError::NetworkNotFound(network.to_string()))
    }

    /// The blocks of the network (of one node, if given), sorted by CIDR. A list without a
    /// resourceVersion is a consistent read, so after a conflict the retry sees the write that
    /// beat it.
    async fn list_blocks(&self, network: &str, node: Option<&str>) -> Result<Vec<Parsed>, StoreError> {
        let mut selector = format!("spec.network={network}");
        if let Some(node) = node {
            selector.push_str(&format!(",spec.node={node}"));
        }
        let list = self
            .blocks
            .list(&ListParams::default().fields(&selector))
            .await
            .map_err(kube_err(format!("listing address blocks ({selector})")))?;
        let mut parsed = Vec::with_capacity(list.items.len());
        for obj in list.items {
            let block = Block::parse(&obj.spec.cidr)
                .map_err(|source| StoreError::CorruptBlock { name: obj.name_any(), source })?;
            parsed.push(Parsed { block, obj });
        }
        parsed.sort_by_key(|p| p.block);
        Ok(parsed)
    }

    /// [`list_blocks`](Self::list_blocks) of one pool's family.
    async fn family_blocks(&self, network: &str, node: Option<&str>, pool: &Pool) -> Result<Vec<Parsed>, StoreError> {
        let mut blocks = self.list_blocks(network, node).await?;
        blocks.retain(|p| p.block.family() == pool.family());
        Ok(blocks)
    }

    fn node_lock(&self, network: &str, node: &str) -> NodeLock {
        // A poisoned map only means another thread panicked mid-insert; the map is still valid.
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.entry((network.to_string(), node.to_string())).or_default().clone()
    }

    async fn back_off(&self, retries: &mut u32, network: &str, node: &str) -> Result<(), StoreError> {
        if *retries >= self.config.max_retries {
            return Err(StoreError::Contention { network: network.into(), node: node.into(), retries: *retries });
        }
        *retries += 1;
        tokio::time::sleep(backoff_delay(*retries, self.config.backoff_base, self.config.backoff_cap)).await;
        Ok(())
    }
}
