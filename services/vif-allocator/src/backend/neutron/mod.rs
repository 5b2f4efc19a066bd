//! The Neutron VIF backend: every pod gets a Neutron port — `device_owner` (`compute:kuryr`),
//! `device_id` = the pod's uid, `binding:host_id` = its node, the project, the security groups,
//! fixed IPs from the pod subnets (IPv4 and IPv6) and the tag `kuryr.openstack.org/cluster=<id>`
//! — and the VIF is that port ([`vif`]): MAC, addresses, gateways, MTU, and the `ovs` binding
//! with the port id as `iface-id`.
//!
//! **Pools** ([`pool`]): ports are created ahead per (node, project, network, security groups)
//! in bulk, so a pod's allocation is one port update (`device_id`, `name`) instead of a create.
//! A pool is refilled in the background when it falls below its minimum; a pod that finds its
//! pool empty gets a port created on its path. Released ports are recycled (`device_id`
//! cleared, security groups reset) and handed out again once Neutron sees them unplugged.
//!
//! **Readiness**: a VIF the binder reports plugged is READY only once Neutron says the port is
//! ACTIVE. With a transport URL ([`events`]) that comes from Neutron's own push of the port over
//! RabbitMQ, mapped here by port id to the waiting pod ([`NeutronBackend::on_port_event`]), with
//! a slow batched read of ports waiting too long as the safety net ([`status`]); without one,
//! or while the broker is unreachable, one poller reads the status of every watched port in
//! batched list calls (`?id=..&id=..`), backing off while nothing changes.
//!
//! **No duplicates, no leaks.** Before the allocator serves, [`NeutronBackend::recover`] lists
//! every port tagged for the cluster and rebuilds the pools and who holds what, so a pod whose
//! port was assigned just before a crash gets the same port again. A pod with no port in the
//! inventory is looked up by `device_id` in Neutron before a port is created for it (a create
//! whose answer was lost). Ports held by pods that no longer exist are handed to the controller
//! for cleanup ([`NeutronBackend::holders`]); ports that failed to bind are deleted.

pub mod attach;
mod backend;
pub mod config;
pub mod events;
mod inventory;
pub mod metrics;
pub mod namespaces;
pub mod pool;
mod ports;
mod push;
pub mod shards;
pub mod status;
pub mod trunk;
pub mod vif;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use kuryr_openstack::neutron::{Neutron, Port, PortCreate};
use kuryr_openstack::{Client, Filter};
use kuryr_runtime::Shutdown;
use tokio::sync::{Notify, Semaphore, mpsc};
use tracing::Instrument as _;

use self::config::NeutronArgs;
use self::events::decode::PortEvent;
use self::events::{EventMetrics, Link, PortEventSink, PortEvents};
use self::metrics::{NeutronMetrics, PoolLabels, ReasonLabels};
use self::namespaces::NamespaceNetworks;
use self::namespaces::k8s::NamespaceKube;
use self::pool::{Inventory, Limits, Place, PoolKey, PoolView};
use self::ports::{InFlight, port_name, recycled};
use self::vif::{SubnetInfo, VifShape};
use crate::backend::VifBackend;
use crate::core::{PodKey, VifRecord};
use crate::error::ClusterError;

/// Port deletions in flight at once when a pool is freed.
const DELETE_CONCURRENCY: usize = 8;

/// A VIF the status poller found ACTIVE.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadyVif {
    /// The pod.
    pub pod_uid: String,
    /// Its port.
    pub vif_id: String,
}

/// A plugged port waiting for ACTIVE.
#[derive(Clone, Debug)]
struct Watched {
    pod_uid: String,
    since: Instant,
    /// The port's revision when the pod got it: a pushed port of this revision or older says
    /// nothing about the pod's plug.
    revision: Option<u64>,
}

/// What the event side keeps besides the watched ports.
#[derive(Debug, Default)]
struct EventState {
    /// Port id → the newest revision pushed, for the ports of the inventory: older and repeated
    /// pushes are stale.
    revisions: HashMap<String, u64>,
    /// Ports pushed ACTIVE for the pod holding them before their plug was reported: port id →
    /// (revision, pod uid).
    early: HashMap<String, (u64, String)>,
}

/// The event side of readiness.
#[derive(Debug)]
struct EventSide {
    link: tokio::sync::watch::Receiver<Link>,
    resync: Duration,
    metrics: EventMetrics,
    state: Mutex<EventState>,
    /// The consumer, until [`NeutronBackend::spawn`] runs it.
    consumer: Mutex<Option<PortEvents>>,
}

/// The receiving ends the backend's tasks and the allocator consume.
#[derive(Debug)]
pub struct Channels {
    /// VIFs found ACTIVE, for the controller to mark READY.
    pub ready: mpsc::UnboundedReceiver<ReadyVif>,
    /// Pools to refill, for [`NeutronBackend::spawn`].
    pub refill: mpsc::UnboundedReceiver<PoolKey>,
}

/// What recovery found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Ports held by pods.
    pub in_use: usize,
    /// Free ports (ready to hand out).
    pub free: usize,
    /// Released ports still seen ACTIVE.
    pub recycling: usize,
    /// Ports deleted: failed bindings and second ports of one pod.
    pub deleted: usize,
}

/// Where pods' ports go.
#[derive(Debug)]
enum Networks {
    /// One pod network (`--pod-network-id`).
    Fixed(VifShape),
    /// A network per namespace (`--neutron-namespace-subnets`).
    PerNamespace(Arc<NamespaceNetworks>),
}

/// The Neutron backend.
#[derive(Debug)]
pub struct NeutronBackend {
    neutron: Neutron,
    networks: Networks,
    project: String,
    /// Sorted; empty: the project's default group.
    security_groups: Vec<String>,
    /// The groups a released port is given back: `security_groups`, else the project's
    /// default group (found at start; empty if it could not be, and then released ports keep
    /// their groups).
    reset_groups: Vec<String>,
    tag: String,
    device_owner: String,
    limits: Limits,
    poll: (Duration, Duration),
    inv: Mutex<Inventory>,
    /// Port id → the pod waiting for it to turn ACTIVE.
    watched: Mutex<HashMap<String, Watched>>,
    wake: Notify,
    ready_tx: mpsc::UnboundedSender<ReadyVif>,
    refill_tx: mpsc::UnboundedSender<PoolKey>,
    /// Pools with a refill running.
    filling: Mutex<HashSet<PoolKey>>,
    bulk: Semaphore,
    recovered: AtomicBool,
    metrics: NeutronMetrics,
    /// Port status from Neutron's push, when a transport URL is configured.
    events: Option<EventSide>,
    /// Which nodes' pools are this replica's, and what the audits found ([`shards`]).
    shards: shards::ShardState,
    /// Nested pods (`--nested-trunks`): ports are subports of the nodes' trunks.
    nested: Option<Arc<trunk::Nested>>,
    /// Pods' further ports ([`attach`]).
    attached: attach::AttachState,
}

fn guard<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain collections: a panic elsewhere leaves them consistent.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn neutron_err(action: impl Into<String>) -> impl FnOnce(kuryr_openstack::Error) -> ClusterError {
    let action = action.into();
    move |source| ClusterError::Neutron { action, source: Box::new(source) }
}

impl NeutronBackend {
    /// Reads the pod network, its subnets and the project from Neutron (and Keystone), checking
    /// that they fit together; errors name the flag at fault.
    pub async fn connect(
        args: &NeutronArgs,
        client: Client,
        metrics: NeutronMetrics,
        kube: NamespaceKube,
        instance: &str,
    ) -> anyhow::Result<(NeutronBackend, Channels)> {
        let events = match args.events.resolve()? {
            Some(cfg) => {
                let resync = cfg.resync;
                let consumer = PortEvents::new(cfg, &args.ports.cluster.cluster_id, instance, metrics.events.clone())?;
                Some(EventSide {
                    link: consumer.link(),
                    resync,
                    metrics: metrics.events.clone(),
                    state: Mutex::default(),
                    consumer: Mutex::new(Some(consumer)),
                })
            }
            None => None,
        };
        let neutron = client.network();
        let project = match args.cloud.project_id.clone().filter(|p| !p.is_empty()) {
            Some(p) => p,
            None => client
                .project_id()
                .await
                .map_err(|e| anyhow::anyhow!("finding the project from Keystone: {e}"))?
                .ok_or_else(|| anyhow::anyhow!("no project: pass --project-id or use a project-scoped cloud"))?,
        };
        let networks = if args.namespaces.neutron_namespace_subnets {
            let nn = NamespaceNetworks::connect(
                &args.namespaces,
                neutron.clone(),
                &project,
                &args.ports.cluster.tag(),
                &args.ports.ovs_bridge,
                kube,
                metrics.namespaces.clone(),
            )
            .await?;
            Networks::PerNamespace(Arc::new(nn))
        } else {
            Networks::Fixed(Self::pod_network(args, &neutron).await?)
        };
        let mut security_groups = args.security_groups.clone();
        security_groups.sort();
        security_groups.dedup();
        let reset_groups = if security_groups.is_empty() {
            let filter = Filter::new().name("default").project_id(&project).fields(&["id"]);
            match neutron.list_security_groups(&filter).await {
                Ok(g) => g.into_iter().map(|g| g.id).collect(),
                Err(e) => {
                    tracing::warn!(error = %e, "the project's default security group was not found: released ports keep their groups");
                    Vec::new()
                }
            }
        } else {
            security_groups.clone()
        };
        let (ready_tx, ready) = mpsc::unbounded_channel();
        let (refill_tx, refill) = mpsc::unbounded_channel();
        tracing::info!(project, ?security_groups, ?reset_groups, limits = ?args.limits(), "Neutron backend");
        let nested = args.nested.nested_trunks.then(|| {
            let n = trunk::Nested::new(
                neutron.clone(),
                &args.ports.cluster.tag(),
                &project,
                security_groups.clone(),
                reset_groups.clone(),
                args.limits(),
            );
            Arc::new(n)
        });
        let backend = NeutronBackend {
            neutron,
            networks,
            project,
            security_groups,
            reset_groups,
            tag: args.ports.cluster.tag(),
            device_owner: if nested.is_some() { trunk::DEVICE_OWNER.into() } else { args.ports.device_owner.clone() },
            limits: args.limits(),
            poll: (args.status_poll_min, args.status_poll_max),
            inv: Mutex::default(),
            watched: Mutex::default(),
            wake: Notify::new(),
            ready_tx,
            refill_tx,
            filling: Mutex::default(),
            bulk: Semaphore::new(args.pool_bulk_concurrency),
            recovered: AtomicBool::new(false),
            metrics,
            events,
            shards: shards::ShardState::default(),
            nested,
            attached: attach::AttachState::default(),
        };
        Ok((backend, Channels { ready, refill }))
    }

    /// Reads the one pod network and its subnets (`--pod-network-id`, `--pod-subnet-ids`).
    async fn pod_network(args: &NeutronArgs, neutron: &Neutron) -> anyhow::Result<VifShape> {
        let network_id = args.pod_network_id.as_deref().unwrap_or_default();
        let shape = VifShape::read(neutron, network_id, &args.pod_subnet_ids, &args.ports.ovs_bridge).await?;
        let subnets: Vec<_> = shape.subnets.iter().map(|s| s.id.as_str()).collect();
        tracing::info!(network = %shape.network_id, ?subnets, mtu = shape.mtu, "Neutron pod network");
        Ok(shape)
    }

    /// What PodVifs of this backend name as their network: the pod network's id, or
    /// [`namespaces::NETWORK_LABEL`] with a network per namespace.
    pub fn network_id(&self) -> &str {
        match &self.networks {
            Networks::Fixed(shape) => &shape.network_id,
            Networks::PerNamespace(_) => namespaces::NETWORK_LABEL,
        }
    }

    /// The pool of `node` for this allocator's project, network and security groups.
    pub fn key_for(&self, node: &str) -> PoolKey {
        self.key_on(node, self.network_id())
    }

    /// The pool of `node` on `network` for this allocator's project and security groups.
    fn key_on(&self, node: &str, network: &str) -> PoolKey {
        PoolKey::new(node, &self.project, network, self.security_groups.clone())
    }

    /// The pool key the pool API means: empty fields are this allocator's.
    pub fn complete_key(&self, node: &str, project: &str, network: &str, security_groups: &[String]) -> PoolKey {
        let pick = |v: &str, d: &str| if v.is_empty() { d.to_string() } else { v.to_string() };
        let sgs = if security_groups.is_empty() { self.security_groups.clone() } else { security_groups.to_vec() };
        PoolKey::new(node, &pick(project, &self.project), &pick(network, self.network_id()), sgs)
    }

    /// Whether `key` is a pool this allocator can create ports for.
    pub fn serves(&self, key: &PoolKey) -> bool {
        key.project == self.project
            && self.shape_of(&key.network).is_some()
            && key.security_groups == self.security_groups
    }

    /// The shape of VIFs on `network`, if pods get ports there (a namespace network being
    /// removed no longer counts).
    fn shape_of(&self, network: &str) -> Option<VifShape> {
        match &self.networks {
            Networks::Fixed(shape) => (shape.network_id == network).then(|| shape.clone()),
            Networks::PerNamespace(nn) => nn.shape_of(network),
        }
    }

    /// The shape of the pod's VIF: the pod network, or its namespace's (made if need be).
    async fn shape_for(&self, pod: &PodKey) -> Result<VifShape, ClusterError> {
        match &self.networks {
            Networks::Fixed(shape) => Ok(shape.clone()),
            Networks::PerNamespace(nn) => nn.ensure(&pod.namespace).await,
        }
    }

    /// The configured pool limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Whether recovery finished.
    pub fn is_recovered(&self) -> bool {
        self.recovered.load(Ordering::Acquire)
    }

    fn record(&self, shape: &VifShape, port: &Port) -> Result<VifRecord, ClusterError> {
        shape.record(port).map_err(ClusterError::NotReady)
    }

    /// Publishes the pool sizes, summed per node (a node has a pool per network with
    /// per-namespace networks).
    fn gauges(&self) {
        let views = guard(&self.inv).views();
        let mut sums: HashMap<(String, &'static str), i64> = HashMap::new();
        for v in views {
            for (state, n) in
                [("free", v.free.len() as i64), ("recycling", v.recycling.into()), ("in_use", v.in_use.into())]
            {
                *sums.entry((v.key.node.clone(), state)).or_default() += n;
            }
        }
        for ((node, state), n) in sums {
            self.metrics.pool_ports.get_or_create(&PoolLabels { node, state }).set(n);
        }
    }
}

#[cfg(test)]
mod event_tests;
