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
//! that a burst of local requests is batched instead of conflicting with itself; conflicts then
//! only come from other processes. The lock is an optimisation, never the safety argument.
//!
//! # Idempotency
//!
//! Allocations are keyed by pod uid. Allocating for a pod that already holds an address of a
//! family in one of the node's blocks returns that address; releasing removes every address the
//! uid holds (or only the listed ones: [`IpamStore::release_addresses`]) and is a no-op when it
//! holds none. Blocks are separate objects, so two allocators racing for one pod can each record
//! an address for it in a different block; the pod's PodVif settles which one stays (see
//! `crate::controller`). A pod's MAC is a function of its address, so a
//! repeated allocation yields the same VIF. Callers pass the pod's `spec.nodeName`, which never
//! changes once set; only the node's blocks are read on the allocation path. An answer that
//! involves no write ("already holds", "holds nothing") always comes from a fresh read.
//!
//! # Batches (group commit)
//!
//! Requests for one node queue; whoever gets the node's lock serves everything queued (up to
//! [`StoreConfig::max_batch`]) in one batch: one status write per touched block and family, so
//! that a burst of allocations costs a few writes instead of one per pod. A batch works from this
//! process's last copy of the node's blocks instead of listing them per request; see
//! `batch.rs` for why a stale copy can cost a retry but never a duplicate. The PodNetwork is read
//! at most every [`StoreConfig::network_ttl`], outside the lock. Only a block claim, `release`
//! without a node, and `node_blocks` list the whole network.

mod assign;
mod batch;
mod error;
mod metrics;
mod types;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use tokio::sync::oneshot;

use crate::core::PodKey;
use crate::core::ipam::ipnet::IpNet;
use crate::core::ipam::{Block, NetworkPlan, block_name};
use crate::k8s::crd::{AddressBlock, AddressBlockSpec, PodNetwork, PodNetworkSpec, PodNetworkStatus};

pub use error::StoreError;
pub use metrics::{IpamMetrics, error_reason};
pub use types::{Allocation, AssignedAddress, StoreConfig, StoreStats, backoff_delay};

use assign::Parsed;
use batch::{Cached, Op};
use error::{check_network_name, check_non_empty, is_retryable, kube_err};
use types::{Counters, bump};

/// Longest network name: block names append `-` and the CIDR (at most 43 characters, a full
/// IPv6 address and `/128`) and must stay within the 253 characters of an object name.
pub const MAX_NETWORK_NAME: usize = 253 - 44;

/// One node's requests and blocks, per (network, node).
#[derive(Debug, Default)]
struct NodeState {
    /// Requests waiting for the next batch.
    queue: Mutex<Vec<Op>>,
    /// The node's lock: its holder runs the batch and owns the copy of the node's blocks.
    blocks: tokio::sync::Mutex<Option<Cached>>,
}

/// A network's plan as last read, and when.
type PlanSlot = Arc<tokio::sync::Mutex<Option<(Result<NetworkPlan, StoreError>, Instant)>>>;

/// The IPAM kept in Kubernetes custom resources.
#[derive(Debug)]
pub struct IpamStore {
    networks: Api<PodNetwork>,
    blocks: Api<AddressBlock>,
    config: StoreConfig,
    counters: Counters,
    /// API call latency and errors, addresses per node.
    metrics: IpamMetrics,
    /// Per (network, node): the queue, the lock and the copy of the blocks.
    nodes: Mutex<HashMap<(String, String), Arc<NodeState>>>,
    /// Per network: the plan as last read (one read at a time per network).
    plans: Mutex<HashMap<String, PlanSlot>>,
}

/// Locks a map that holds plain collections; a panic elsewhere leaves it consistent.
fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
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
            metrics: IpamMetrics::default(),
            nodes: Mutex::new(HashMap::new()),
            plans: Mutex::new(HashMap::new()),
        }
    }

    /// The store recording into `metrics` (registered by the caller) instead of its own.
    pub fn with_metrics(mut self, metrics: IpamMetrics) -> IpamStore {
        self.metrics = metrics;
        self
    }

    /// Counters since the store was made (conflicts show optimistic concurrency at work).
    pub fn stats(&self) -> StoreStats {
        self.counters.snapshot()
    }

    /// The store's metrics (API calls by operation, errors by reason, addresses per node).
    pub fn metrics(&self) -> &IpamMetrics {
        &self.metrics
    }

    /// Makes one Kubernetes API call, timed and counted as `operation`.
    async fn api<T>(
        &self,
        operation: &'static str,
        call: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, kube::Error> {
        let start = Instant::now();
        let result = call.await;
        self.metrics.call(operation, start.elapsed(), result.as_ref().err());
        result
    }

    /// Creates or updates (server-side apply) the PodNetwork `name` after validating `spec`,
    /// then refreshes its status.
    pub async fn ensure_network(&self, name: &str, spec: &PodNetworkSpec) -> Result<PodNetwork, StoreError> {
        check_network_name(name)?;
        spec.plan().map_err(|source| StoreError::InvalidNetwork { network: name.to_string(), source })?;
        let params = PatchParams::apply(&self.config.field_manager).force();
        let patch = Patch::Apply(PodNetwork::new(name, spec.clone()));
        let applied = self
            .api("apply_network", self.networks.patch(name, &params, &patch))
            .await
            .map_err(kube_err(format!("applying PodNetwork {name}")))?;
        *self.plan_slot(name).lock().await = None;
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
        self.api("update_network_status", self.networks.patch_status(network, &PatchParams::default(), &patch))
            .await
            .map_err(kube_err(format!("updating the status of PodNetwork {network}")))?;
        Ok(status)
    }

    /// Gives `pod` on `node` one address per family of `network` from the node's blocks,
    /// claiming a free block of the network when the node's blocks are full. Idempotent: a pod
    /// that already holds addresses gets them back. On failure nothing this call recorded is
    /// left behind. Concurrent calls for one node are served together (see the module docs).
    pub async fn allocate(&self, network: &str, node: &str, pod: &PodKey) -> Result<Allocation, StoreError> {
        check_pod_on_node(network, node, &pod.uid)?;
        // Outside the node's lock, and from the cache: a missing or invalid network is refused
        // here, before queueing.
        self.plan(network).await?;
        self.submit(network, node, |tx| Op::Allocate(pod.clone(), tx)).await
    }

    /// Frees every address `pod_uid` holds in `network`. Returns whether anything was freed;
    /// releasing an unknown pod is not an error. Reads every block of the network; see
    /// [`release_on_node`](Self::release_on_node) when the pod's node is known.
    pub async fn release(&self, network: &str, pod_uid: &str) -> Result<bool, StoreError> {
        check_network_name(network)?;
        check_non_empty("pod uid", pod_uid)?;
        let mut nodes: Vec<String> = self
            .list_blocks(network, None)
            .await?
            .into_iter()
            .filter(|p| p.holder(pod_uid).is_some())
            .map(|p| p.obj.spec.node.clone())
            .collect();
        nodes.sort();
        nodes.dedup();
        let mut released = false;
        for node in nodes {
            released |= self.release_on_node(network, &node, pod_uid).await?;
        }
        Ok(released)
    }

    /// [`release`](Self::release), reading only `node`'s blocks.
    pub async fn release_on_node(&self, network: &str, node: &str, pod_uid: &str) -> Result<bool, StoreError> {
        check_pod_on_node(network, node, pod_uid)?;
        self.submit(network, node, |tx| Op::Release(pod_uid.to_string(), None, tx)).await
    }

    /// Frees only `addresses` of what `pod_uid` holds in `node`'s blocks (those it does not hold
    /// are left alone). Returns whether anything was freed.
    pub async fn release_addresses(
        &self,
        network: &str,
        node: &str,
        pod_uid: &str,
        addresses: &[IpAddr],
    ) -> Result<bool, StoreError> {
        check_pod_on_node(network, node, pod_uid)?;
        if addresses.is_empty() {
            return Ok(false);
        }
        self.submit(network, node, |tx| Op::Release(pod_uid.to_string(), Some(addresses.to_vec()), tx)).await
    }

    /// Whether `pod_uid` holds every one of `addresses` (at least one) in `node`'s blocks, as
    /// listed now: a fresh read, never this process's copy.
    pub async fn holds(
        &self,
        network: &str,
        node: &str,
        pod_uid: &str,
        addresses: &[IpAddr],
    ) -> Result<bool, StoreError> {
        check_pod_on_node(network, node, pod_uid)?;
        if addresses.is_empty() {
            return Ok(false);
        }
        let blocks = self.list_blocks(network, Some(node)).await?;
        Ok(addresses.iter().all(|ip| blocks.iter().any(|b| b.holds(pod_uid, *ip))))
    }

    /// Queues a request for the node and waits for its answer, serving the queue itself when it
    /// gets the node's lock first.
    async fn submit<T>(
        &self,
        network: &str,
        node: &str,
        op: impl Fn(oneshot::Sender<Result<T, StoreError>>) -> Op,
    ) -> Result<T, StoreError> {
        let state = self.node_state(network, node);
        loop {
            let (tx, mut rx) = oneshot::channel();
            locked(&state.queue).push(op(tx));
            // Until the answer comes: whoever holds the lock serves the queue, ours included.
            let answer = loop {
                tokio::select! {
                    biased;
                    answer = &mut rx => break answer,
                    mut blocks = state.blocks.lock() => {
                        let ops: Vec<Op> = {
                            let mut queue = locked(&state.queue);
                            let n = queue.len().min(self.config.max_batch.max(1));
                            queue.drain(..n).collect()
                        };
                        if !ops.is_empty() {
                            batch::run(self, network, node, ops, &mut blocks).await;
                        }
                    }
                }
            };
            match answer {
                Ok(result) => return result,
                // The batch that held the request was dropped half-way (its caller was
                // cancelled): ask again; every operation is idempotent.
                Err(_) => continue,
            }
        }
    }

    /// Creates the block object; the object when created, `None` when another allocator
    /// created it first.
    async fn claim(&self, network: &str, node: &str, block: Block) -> Result<Option<AddressBlock>, StoreError> {
        let name = block_name(network, &block);
        let obj = AddressBlock {
            metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() },
            spec: AddressBlockSpec { network: network.into(), cidr: block.to_string(), node: node.into() },
            status: None,
        };
        let params = PostParams { field_manager: Some(self.config.field_manager.clone()), ..Default::default() };
        match self.api("create_block", self.blocks.create(&params, &obj)).await {
            Ok(created) => {
                bump(&self.counters.blocks_claimed);
                tracing::info!(network, node, block = %block, "claimed address block");
                if let Err(e) = self.refresh_network_status(network).await {
                    tracing::warn!(network, error = %e, "could not update the PodNetwork status after a block claim");
                }
                Ok(Some(created))
            }
            Err(kube::Error::Api(s)) if s.is_already_exists() => {
                let Some(existing) = self
                    .api("get_block", self.blocks.get_opt(&name))
                    .await
                    .map_err(kube_err(format!("reading address block {name}")))?
                else {
                    // Created and deleted again in between: simply look again.
                    return Ok(None);
                };
                if existing.spec.network != network || existing.spec.cidr != block.to_string() {
                    return Err(StoreError::NameCollision { name, network: network.into(), cidr: block });
                }
                bump(&self.counters.claim_races);
                Ok(None)
            }
            Err(e) => Err(kube_err(format!("creating address block {name}"))(e)),
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

    /// The network's validated plan, read at most every [`StoreConfig::network_ttl`]. Missing
    /// networks and failed reads are not remembered.
    async fn plan(&self, network: &str) -> Result<NetworkPlan, StoreError> {
        let slot = self.plan_slot(network);
        let mut cached = slot.lock().await;
        if let Some((plan, at)) = cached.as_ref()
            && at.elapsed() <= self.config.network_ttl
        {
            return plan.clone();
        }
        let plan = self.read_plan(network).await;
        *cached = remembered(&plan);
        plan
    }

    /// The plan as the API holds it now (remembered for later calls as well).
    async fn fresh_plan(&self, network: &str) -> Result<NetworkPlan, StoreError> {
        let slot = self.plan_slot(network);
        let mut cached = slot.lock().await;
        let plan = self.read_plan(network).await;
        *cached = remembered(&plan);
        plan
    }

    async fn read_plan(&self, network: &str) -> Result<NetworkPlan, StoreError> {
        let net = self.get_network(network).await?;
        net.spec.plan().map_err(|source| StoreError::InvalidNetwork { network: network.to_string(), source })
    }

    async fn get_network(&self, network: &str) -> Result<PodNetwork, StoreError> {
        self.api("get_network", self.networks.get_opt(network))
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
        bump(&self.counters.block_lists);
        let params = ListParams::default().fields(&selector);
        let list = self
            .api("list_blocks", self.blocks.list(&params))
            .await
            .map_err(kube_err(format!("listing address blocks ({selector})")))?;
        let mut parsed = list.items.into_iter().map(Parsed::new).collect::<Result<Vec<_>, _>>()?;
        assign::sort(&mut parsed);
        Ok(parsed)
    }

    fn node_state(&self, network: &str, node: &str) -> Arc<NodeState> {
        locked(&self.nodes).entry((network.to_string(), node.to_string())).or_default().clone()
    }

    fn plan_slot(&self, network: &str) -> PlanSlot {
        locked(&self.plans).entry(network.to_string()).or_default().clone()
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

/// What a plan read leaves in the cache: a plan, or the verdict that the spec is invalid (which
/// only a spec change cures); nothing after a missing network or a failed read.
fn remembered(plan: &Result<NetworkPlan, StoreError>) -> Option<(Result<NetworkPlan, StoreError>, Instant)> {
    match plan {
        Ok(_) | Err(StoreError::InvalidNetwork { .. }) => Some((plan.clone(), Instant::now())),
        Err(_) => None,
    }
}

/// Refuses an empty or invalid network, node or pod uid, naming which.
fn check_pod_on_node(network: &str, node: &str, pod_uid: &str) -> Result<(), StoreError> {
    check_network_name(network)?;
    check_non_empty("node", node)?;
    check_non_empty("pod uid", pod_uid)
}
