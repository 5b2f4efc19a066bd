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

pub mod config;
pub mod events;
pub mod metrics;
pub mod namespaces;
pub mod pool;
pub mod status;
pub mod vif;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use kuryr_openstack::neutron::{FixedIp, Neutron, Port, PortCreate, PortUpdate};
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
use self::vif::{SubnetInfo, VifShape};
use crate::backend::VifBackend;
use crate::cluster::ClusterError;
use crate::crd::VifRecord;
use crate::ipam::store::PodKey;

/// Most ports asked for in one bulk create: Neutron handles a bulk as one transaction, and
/// measured here it is no faster per port than single creates beyond a few dozen.
const BULK_MAX: u32 = 50;

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
                let consumer = PortEvents::new(cfg, &args.cluster_id, instance, metrics.events.clone())?;
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
        let project = match args.project_id.clone().filter(|p| !p.is_empty()) {
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
                &args.cluster_tag(),
                &args.ovs_bridge,
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
        let backend = NeutronBackend {
            neutron,
            networks,
            project,
            security_groups,
            reset_groups,
            tag: args.cluster_tag(),
            device_owner: args.device_owner.clone(),
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
        };
        Ok((backend, Channels { ready, refill }))
    }

    /// Reads the one pod network and its subnets (`--pod-network-id`, `--pod-subnet-ids`).
    async fn pod_network(args: &NeutronArgs, neutron: &Neutron) -> anyhow::Result<VifShape> {
        let network_id = args.pod_network_id.clone().unwrap_or_default();
        let network = neutron.get_network(&network_id).await.map_err(|e| match e {
            e if e.is_not_found() => anyhow::anyhow!("--pod-network-id {network_id}: no such Neutron network"),
            e => anyhow::anyhow!("reading Neutron network {network_id}: {e}"),
        })?;
        let subnet_ids =
            if args.pod_subnet_ids.is_empty() { network.subnets.clone() } else { args.pod_subnet_ids.clone() };
        anyhow::ensure!(
            !subnet_ids.is_empty(),
            "Neutron network {network_id} has no subnet; create one or pass --pod-subnet-ids"
        );
        let mut subnets = Vec::new();
        for id in &subnet_ids {
            let s = neutron.get_subnet(id).await.map_err(|e| match e {
                e if e.is_not_found() => anyhow::anyhow!("--pod-subnet-ids: no such Neutron subnet {id}"),
                e => anyhow::anyhow!("reading Neutron subnet {id}: {e}"),
            })?;
            anyhow::ensure!(
                s.network_id == network_id,
                "--pod-subnet-ids: subnet {id} is on network {}, not on --pod-network-id {network_id}",
                s.network_id
            );
            subnets.push(SubnetInfo::from_subnet(&s).map_err(|e| anyhow::anyhow!(e))?);
        }
        let shape = VifShape { network_id, subnets, mtu: network.mtu.unwrap_or(1500), bridge: args.ovs_bridge.clone() };
        tracing::info!(network = %shape.network_id, subnets = ?subnet_ids, mtu = shape.mtu, "Neutron pod network");
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

    fn port_create(&self, shape: &VifShape, node: &str, pod: Option<&PodKey>) -> PortCreate {
        PortCreate {
            network_id: shape.network_id.clone(),
            name: pod.map(port_name),
            project_id: Some(self.project.clone()),
            fixed_ips: Some(
                shape.subnets.iter().map(|s| FixedIp { subnet_id: Some(s.id.clone()), ip_address: None }).collect(),
            ),
            device_id: pod.map(|p| p.uid.clone()),
            device_owner: Some(self.device_owner.clone()),
            binding_host_id: Some(node.to_string()),
            security_groups: (!self.security_groups.is_empty()).then(|| self.security_groups.clone()),
            admin_state_up: Some(true),
            tags: Some(vec![self.tag.clone()]),
            ..PortCreate::default()
        }
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

    async fn delete_port(&self, id: &str, why: &'static str) -> Result<(), ClusterError> {
        self.neutron.delete_port(id).await.map_err(neutron_err(format!("deleting port {id}")))?;
        self.metrics.deleted(why);
        Ok(())
    }

    /// The pod's port from a pool, if a free one can be had.
    async fn take_from_pool(&self, pod: &PodKey, key: &PoolKey) -> Result<Option<Port>, ClusterError> {
        loop {
            let Some(port) = guard(&self.inv).take(key) else { return Ok(None) };
            let update =
                PortUpdate { device_id: Some(pod.uid.clone()), name: Some(port_name(pod)), ..PortUpdate::default() };
            match self.neutron.update_port(&port.id, &update, None).await {
                Ok(p) if p.binding_failed() => {
                    tracing::warn!(port = %p.id, node = %key.node, "pool port failed to bind; deleting it");
                    let _ = self.delete_port(&p.id, "binding_failed").await;
                }
                Ok(p) => return Ok(Some(p)),
                Err(e) if e.is_not_found() => {
                    tracing::warn!(port = %port.id, "pool port deleted behind our back; taking the next");
                }
                Err(e) => {
                    guard(&self.inv).untake(key, port.clone());
                    return Err(neutron_err(format!("assigning pool port {} to the pod", port.id))(e));
                }
            }
        }
    }

    /// The pod's port created on its allocation path, after making sure none exists already
    /// (a create whose answer was lost, a port assigned before a crash and not yet tagged).
    async fn create_for(
        &self,
        shape: &VifShape,
        pod: &PodKey,
        node: &str,
    ) -> Result<(Port, &'static str), ClusterError> {
        let filter = Filter::new().network_id(&shape.network_id).device_id(&pod.uid);
        let mut found = self
            .neutron
            .list_ports(&filter)
            .await
            .map_err(neutron_err(format!("looking up the port of pod {}", pod.uid)))?;
        found.retain(|p| p.device_owner == self.device_owner);
        if let Some(existing) = found.first().cloned() {
            for extra in &found[1..] {
                tracing::warn!(port = %extra.id, uid = %pod.uid, "second port for one pod; deleting it");
                self.delete_port(&extra.id, "duplicate").await?;
            }
            if !existing.tags.contains(&self.tag) {
                // The whole list in one request: the cluster tag holds a `/`, which Neutron's
                // one-tag call (the tag in the URL path) cannot take.
                let mut tags = existing.tags.clone();
                tags.push(self.tag.clone());
                self.neutron
                    .set_tags(kuryr_openstack::neutron::TaggedResource::Port, &existing.id, &tags)
                    .await
                    .map_err(neutron_err(format!("tagging port {}", existing.id)))?;
            }
            return Ok((existing, "existing"));
        }
        let port = self
            .neutron
            .create_port(self.port_create(shape, node, Some(pod)))
            .await
            .map_err(neutron_err(format!("creating a port for pod {}/{} on {node}", pod.namespace, pod.name)))?;
        self.metrics.created("add", 1);
        if port.binding_failed() {
            self.delete_port(&port.id, "binding_failed").await?;
            return Err(ClusterError::BindingFailed { port: port.id, host: node.to_string() });
        }
        Ok((port, "add"))
    }

    /// Creates `n` ports into a pool, in bulk calls of at most a batch, a bounded number at
    /// once over all pools. Returns how many joined the pool.
    async fn create_into_pool(&self, key: &PoolKey, n: u32) -> Result<u32, ClusterError> {
        if n == 0 {
            return Ok(0);
        }
        let Some(shape) = self.shape_of(&key.network) else { return Ok(0) };
        let shape = &shape;
        guard(&self.inv).creating(key, n);
        let chunk = self.limits.batch.clamp(1, BULK_MAX);
        let mut sizes = Vec::new();
        let mut left = n;
        while left > 0 {
            let c = left.min(chunk);
            sizes.push(c);
            left -= c;
        }
        let calls = sizes.into_iter().map(|c| async move {
            let result = async {
                let _permit = self.bulk.acquire().await.map_err(|_| ClusterError::NotReady("shutting down".into()))?;
                let specs = (0..c).map(|_| self.port_create(shape, &key.node, None)).collect();
                self.neutron
                    .create_ports(specs)
                    .await
                    .map_err(neutron_err(format!("creating {c} ports for the pool of {}", key.node)))
            }
            .await;
            guard(&self.inv).created(key, c);
            let ports = result?;
            self.metrics.created("pool", ports.len() as u64);
            let mut joined = 0;
            for p in ports {
                if p.binding_failed() {
                    tracing::warn!(port = %p.id, node = %key.node, "new pool port failed to bind; deleting it");
                    let _ = self.delete_port(&p.id, "binding_failed").await;
                } else {
                    guard(&self.inv).put_free(key, p);
                    joined += 1;
                }
            }
            Ok::<u32, ClusterError>(joined)
        });
        let results = futures::future::join_all(calls).await;
        self.gauges();
        let mut joined = 0;
        let mut first_err = None;
        for r in results {
            match r {
                Ok(j) => joined += j,
                Err(e) if first_err.is_none() => first_err = Some(e),
                Err(_) => {}
            }
        }
        match first_err {
            Some(e) if joined == 0 => Err(e),
            Some(e) => {
                tracing::warn!(pool = %key.node, joined, error = %crate::cluster::chain(&e), "some pool creations failed");
                Ok(joined)
            }
            None => Ok(joined),
        }
    }

    /// Rebuilds the inventory from Neutron: every port of the network with this cluster's tag.
    /// `recorded` (pod uid → port id, from the PodVifs) decides which port a pod keeps should
    /// it hold two; the other is deleted, as are ports that failed to bind.
    pub async fn recover(&self, recorded: &HashMap<String, String>) -> Result<Recovered, ClusterError> {
        let mut filter = Filter::new();
        if let Networks::Fixed(shape) = &self.networks {
            filter = filter.network_id(&shape.network_id);
        }
        let filter = filter.device_owner(&self.device_owner).tags(std::slice::from_ref(&self.tag));
        let mut ports = self.neutron.list_ports(&filter).await.map_err(neutron_err("listing the cluster's ports"))?;
        // The recorded port of a pod first, so that it is the one kept.
        ports.sort_by_key(|p| recorded.get(&p.device_id) != Some(&p.id));
        let now = Instant::now();
        let mut inv = Inventory::default();
        let mut doomed: Vec<(String, &'static str)> = Vec::new();
        let mut summary = Recovered::default();
        for p in ports {
            let sgs = if self.security_groups.is_empty() { Vec::new() } else { p.security_groups.clone() };
            let node = p.binding_host_id.clone().unwrap_or_default();
            let project = p.project_id.clone().filter(|s| !s.is_empty()).unwrap_or_else(|| self.project.clone());
            let key = PoolKey::new(&node, &project, &p.network_id, sgs);
            if p.binding_failed() || node.is_empty() {
                doomed.push((p.id.clone(), "binding_failed"));
            } else if !p.device_id.is_empty() {
                if inv.held(&p.device_id).is_some() {
                    doomed.push((p.id.clone(), "duplicate"));
                } else {
                    inv.assign(&p.device_id.clone(), &key, p);
                    summary.in_use += 1;
                }
            } else if p.is_active() {
                inv.put_recycling(&key, p, now);
                summary.recycling += 1;
            } else {
                inv.put_free(&key, p);
                summary.free += 1;
            }
        }
        *guard(&self.inv) = inv;
        for (id, why) in doomed {
            tracing::warn!(port = %id, why, "deleting a port found at recovery");
            self.delete_port(&id, why).await?;
            summary.deleted += 1;
        }
        self.recovered.store(true, Ordering::Release);
        self.gauges();
        self.wake.notify_one();
        Ok(summary)
    }

    /// Every pod holding a port: (pod, node). The namespace and name come from the port's name
    /// (`<namespace>/<name>`), empty when it does not have that form.
    pub fn holders(&self) -> Vec<(PodKey, String)> {
        guard(&self.inv)
            .holders()
            .map(|(uid, key, port)| {
                let (ns, name) = port.name.split_once('/').unwrap_or(("", ""));
                (PodKey::new(ns, name, uid), key.node.clone())
            })
            .collect()
    }

    /// Every pool.
    pub fn pools(&self) -> Vec<PoolView> {
        guard(&self.inv).views()
    }

    /// One pool.
    pub fn pool(&self, key: &PoolKey) -> Option<PoolView> {
        guard(&self.inv).view(key)
    }

    /// Creates ports until the pool has `count` spare ones (within its maximum); returns the pool.
    pub async fn populate(&self, key: &PoolKey, count: u32) -> Result<PoolView, ClusterError> {
        let n = guard(&self.inv).top_up(key, count, self.limits);
        let joined = self.create_into_pool(key, n).await?;
        tracing::info!(node = %key.node, asked = count, created = joined, "pool populated");
        let view = guard(&self.inv).view(key);
        Ok(view.unwrap_or_else(|| PoolView {
            key: key.clone(),
            free: Vec::new(),
            recycling: 0,
            in_use: 0,
            creating: 0,
        }))
    }

    /// Deletes the free ports of the pools `which` selects; returns how many were deleted.
    /// Ports whose deletion failed go back to their pool, and the first failure is returned.
    pub async fn free(&self, which: impl Fn(&PoolKey) -> bool) -> Result<u32, ClusterError> {
        let drained = guard(&self.inv).drain_free(which);
        let results: Vec<_> = futures::stream::iter(drained)
            .map(|(key, port)| async move {
                let r = self.delete_port(&port.id, "freed").await;
                (key, port, r)
            })
            .buffer_unordered(DELETE_CONCURRENCY)
            .collect()
            .await;
        let mut deleted = 0;
        let mut first_err = None;
        for (key, port, r) in results {
            match r {
                Ok(()) => deleted += 1,
                Err(e) => {
                    guard(&self.inv).put_free(&key, port);
                    first_err.get_or_insert(e);
                }
            }
        }
        self.gauges();
        match first_err {
            Some(e) => Err(e),
            None => Ok(deleted),
        }
    }

    /// Runs the background work — the status poller, pool refills, and handing READY VIFs to
    /// `on_ready` — until shutdown.
    pub fn spawn(self: &Arc<Self>, refill: mpsc::UnboundedReceiver<PoolKey>, shutdown: Shutdown) {
        if let Some(consumer) = self.events.as_ref().and_then(|e| guard(&e.consumer).take()) {
            let sink: Arc<dyn PortEventSink> = self.clone();
            let sd = shutdown.clone();
            tokio::spawn(async move { consumer.run(sink, sd).await }.instrument(tracing::info_span!("port-events")));
        }
        let this = self.clone();
        let sd = shutdown.clone();
        tokio::spawn(async move { this.poll_status(sd).await }.instrument(tracing::info_span!("port-status")));
        let this = self.clone();
        tokio::spawn(async move { this.refills(refill, shutdown).await }.instrument(tracing::info_span!("pools")));
    }

    async fn refills(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<PoolKey>, shutdown: Shutdown) {
        loop {
            let key = tokio::select! {
                k = rx.recv() => match k { Some(k) => k, None => return },
                () = shutdown.clone().wait() => return,
            };
            if !guard(&self.filling).insert(key.clone()) {
                continue;
            }
            let this = self.clone();
            let span = tracing::info_span!("refill", node = %key.node);
            tokio::spawn(
                async move {
                    let mut backoff =
                        kuryr_stream::Backoff::new("pool-refill", Duration::from_millis(500), Duration::from_secs(30));
                    // A pool of a network no longer served (a namespace's, being removed) is not refilled.
                    while this.serves(&key) {
                        let n = guard(&this.inv).refill(&key, this.limits);
                        if n == 0 {
                            break;
                        }
                        match this.create_into_pool(&key, n).await {
                            Ok(joined) => {
                                tracing::info!(created = joined, "pool refilled");
                                if joined == 0 {
                                    break;
                                }
                            }
                            Err(e) => {
                                let reason = e.reason();
                                this.metrics.refill_failures.get_or_create(&ReasonLabels { reason }).inc();
                                let delay = backoff.next_delay(reason);
                                tracing::warn!(error = %crate::cluster::chain(&e), reason, retry_in = ?delay,
                                    "pool refill failed");
                                tokio::time::sleep(delay).await;
                            }
                        }
                    }
                    guard(&this.filling).remove(&key);
                }
                .instrument(span),
            );
        }
    }

    /// Chain for the channel of READY VIFs (the status poller sends, the allocator receives).
    fn send_ready(&self, pod_uid: String, vif_id: String) {
        let _ = self.ready_tx.send(ReadyVif { pod_uid, vif_id });
    }

    /// A watched port is ACTIVE (`source`: `event`, `poll` or `safety`): the pod's VIF is ready.
    fn port_active(&self, port: &str, w: &Watched, source: &'static str) {
        let after = w.since.elapsed();
        self.metrics.active_latency.observe(after.as_secs_f64());
        self.metrics.ready_source(source);
        tracing::debug!(port, uid = %w.pod_uid, after_ms = after.as_millis() as u64, source, "port ACTIVE");
        self.send_ready(w.pod_uid.clone(), port.to_string());
    }

    /// Whether readiness comes from events and the broker is consumed right now; the link's
    /// epoch with it.
    fn event_link(&self) -> Option<Link> {
        self.events.as_ref().map(|e| *e.link.borrow())
    }

    /// Forgets event bookkeeping of ports no longer in the inventory.
    fn prune_event_state(&self) {
        let Some(side) = &self.events else { return };
        let ours = guard(&self.inv).port_ids();
        let mut st = guard(&side.state);
        st.revisions.retain(|id, _| ours.contains(id));
        st.early.retain(|id, _| ours.contains(id));
    }
}

/// Whether `rev` is newer than `floor` (unknown revisions are taken as newer: a push without one
/// is acted on, as the safety read would).
fn newer(rev: Option<u64>, floor: Option<u64>) -> bool {
    match (rev, floor) {
        (Some(r), Some(f)) => r > f,
        _ => true,
    }
}

impl PortEventSink for NeutronBackend {
    /// Maps a pushed port to what waits for it: the pod whose plugged port it is (READY once
    /// ACTIVE), a released port waiting to be seen unplugged (free again), a held port not yet
    /// reported plugged (remembered). A push older than or as old as what is known of the port
    /// (by revision), or naming another device than the waiting pod, changes nothing; ports
    /// that are not this allocator's are skipped.
    fn on_port_event(&self, ev: &PortEvent) {
        let Some(side) = &self.events else { return };
        let m = &side.metrics;
        if ev.device_owner.as_deref().is_some_and(|o| !o.is_empty() && o != self.device_owner) {
            return m.port("foreign");
        }
        let watched = guard(&self.watched).get(&ev.id).cloned();
        let place = if watched.is_some() { None } else { guard(&self.inv).place(&ev.id) };
        if watched.is_none() && place.is_none() {
            return m.port("foreign");
        }
        {
            let mut st = guard(&side.state);
            let known = st.revisions.get(&ev.id).copied();
            let floor = match (&watched, &place) {
                (Some(w), _) => w.revision,
                (None, Some(Place::Recycling(_, r) | Place::Held(_, r))) => *r,
                _ => None,
            };
            if !newer(ev.revision, known.max(floor)) {
                return m.port("stale");
            }
            // A push naming another device than the pod is not about this assignment: it moves
            // nothing, not even the revision the next pushes are ordered by.
            let holder = match (&watched, &place) {
                (Some(w), _) => Some(w.pod_uid.as_str()),
                (None, Some(Place::Held(uid, _))) => Some(uid.as_str()),
                _ => None,
            };
            if let (Some(h), Some(d)) = (holder, ev.device_id.as_deref())
                && !ev.deleted
                && d != h
            {
                return m.port("stale");
            }
            if let Some(r) = ev.revision {
                st.revisions.insert(ev.id.clone(), r);
            }
        }
        if let Some(w) = watched {
            if ev.deleted {
                let removed = {
                    let mut g = guard(&self.watched);
                    g.get(&ev.id).is_some_and(|now| now.pod_uid == w.pod_uid) && g.remove(&ev.id).is_some()
                };
                if removed {
                    tracing::warn!(port = %ev.id, uid = %w.pod_uid, "a plugged port was deleted from Neutron; no longer waiting for it");
                }
                return m.port("gone");
            }
            if !ev.is_active() {
                return m.port("pending");
            }
            let still = {
                let mut g = guard(&self.watched);
                let same = g.get(&ev.id).is_some_and(|now| now.pod_uid == w.pod_uid);
                if same {
                    g.remove(&ev.id);
                }
                same
            };
            if still {
                self.port_active(&ev.id, &w, "event");
                return m.port("ready");
            }
            return m.port("stale");
        }
        match place {
            Some(Place::Recycling(key, _)) => {
                if ev.deleted {
                    guard(&self.inv).drop_recycling(&key, &ev.id);
                    self.gauges();
                    m.port("gone");
                } else if ev.is_active() {
                    m.port("pending");
                } else if guard(&self.inv).recycled(&key, &ev.id) {
                    self.gauges();
                    m.port("recycled");
                } else {
                    m.port("pending");
                }
            }
            Some(Place::Held(uid, _)) => {
                // Both locks, in watch_ready's order: the plug report may have come meanwhile.
                let mut g = guard(&self.watched);
                if let Some(w) = g.get(&ev.id).cloned() {
                    if ev.is_active() && w.pod_uid == uid {
                        g.remove(&ev.id);
                        drop(g);
                        self.port_active(&ev.id, &w, "event");
                        return m.port("ready");
                    }
                    return m.port("pending");
                }
                let mut st = guard(&side.state);
                match ev.revision {
                    Some(rev) if ev.is_active() => {
                        st.early.insert(ev.id.clone(), (rev, uid));
                        m.port("early");
                    }
                    _ => {
                        st.early.remove(&ev.id);
                        m.port("pending");
                    }
                }
            }
            Some(Place::Free) | None => m.port("idle"),
        }
    }
}

/// The name of a pod's port: `<namespace>/<name>`, what orphan collection reads back.
fn port_name(pod: &PodKey) -> String {
    format!("{}/{}", pod.namespace, pod.name)
}

impl VifBackend for NeutronBackend {
    fn name(&self) -> &'static str {
        vif::BACKEND
    }

    async fn allocate(&self, pod: &PodKey, node: &str) -> Result<VifRecord, ClusterError> {
        if !self.is_recovered() {
            return Err(ClusterError::NotReady("the Neutron ports are still being recovered".into()));
        }
        let held = guard(&self.inv).held(&pod.uid).cloned();
        if let Some(port) = held {
            let shape = match self.shape_of(&port.network_id) {
                Some(s) => s,
                None => self.shape_for(pod).await?,
            };
            return self.record(&shape, &port);
        }
        let shape = self.shape_for(pod).await?;
        let key = self.key_on(node, &shape.network_id);
        let (port, source) = match self.take_from_pool(pod, &key).await? {
            Some(p) => (p, "pool"),
            None => self.create_for(&shape, pod, node).await?,
        };
        let record = self.record(&shape, &port);
        guard(&self.inv).assign(&pod.uid, &key, port);
        self.metrics.source(source);
        let _ = self.refill_tx.send(key);
        self.gauges();
        record
    }

    async fn release(&self, pod: &PodKey, _node: &str) -> Result<bool, ClusterError> {
        let (taken, keep) = {
            let mut inv = guard(&self.inv);
            let taken = inv.unassign(&pod.uid);
            let keep = taken.as_ref().is_some_and(|(k, _)| inv.keeps(k, self.limits) && self.serves(k));
            (taken, keep)
        };
        let Some((key, port)) = taken else { return Ok(false) };
        guard(&self.watched).remove(&port.id);
        let outcome = if keep {
            let update = PortUpdate {
                device_id: Some(String::new()),
                name: Some(String::new()),
                // Back to the pool's groups (kuryr-policy's Neutron backend may have changed
                // them): the configured ones, else the project's default group.
                security_groups: (!self.reset_groups.is_empty()).then(|| self.reset_groups.clone()),
                ..PortUpdate::default()
            };
            match self.neutron.update_port(&port.id, &update, None).await {
                Ok(p) => {
                    guard(&self.inv).put_recycling(&key, p, Instant::now());
                    self.metrics.recycles.inc();
                    self.wake.notify_one();
                    Ok(())
                }
                Err(e) if e.is_not_found() => Ok(()),
                Err(e) => Err(neutron_err(format!("recycling port {}", port.id))(e)),
            }
        } else {
            match self.delete_port(&port.id, "released").await {
                Err(ClusterError::Neutron { source, .. }) if source.is_not_found() => Ok(()),
                other => other,
            }
        };
        if let Err(e) = outcome {
            guard(&self.inv).assign(&pod.uid, &key, port);
            return Err(e);
        }
        self.gauges();
        if let Some(nn) = self.namespace_networks() {
            nn.released(&key.network);
        }
        Ok(true)
    }

    async fn holds(&self, pod: &PodKey, _node: &str, record: &VifRecord) -> Result<bool, ClusterError> {
        let filter = Filter::new().device_id(&pod.uid);
        let ports = self
            .neutron
            .list_ports(&filter)
            .await
            .map_err(neutron_err(format!("looking up the ports of pod {}", pod.uid)))?;
        Ok(ports.iter().any(|p| p.id == record.vif_id && p.device_owner == self.device_owner))
    }

    async fn discard(&self, pod: &PodKey, node: &str, ours: &VifRecord, keep: &VifRecord) -> Result<(), ClusterError> {
        if ours.vif_id == keep.vif_id {
            return Ok(());
        }
        // The kept port becomes the pod's here too, so that releasing the pod deletes it even
        // when the allocator that made it is gone (a shard handover).
        let filter = Filter::new().device_id(&pod.uid);
        let kept = self
            .neutron
            .list_ports(&filter)
            .await
            .map_err(neutron_err(format!("looking up the ports of pod {}", pod.uid)))?
            .into_iter()
            .find(|p| p.id == keep.vif_id);
        // Deleted first: should that fail, the pod still holds ours here and a retry comes back.
        match self.delete_port(&ours.vif_id, "lost_to_record").await {
            Err(ClusterError::Neutron { source, .. }) if source.is_not_found() => {}
            other => other?,
        }
        guard(&self.watched).remove(&ours.vif_id);
        {
            let mut inv = guard(&self.inv);
            if inv.held(&pod.uid).is_some_and(|p| p.id == ours.vif_id) {
                inv.unassign(&pod.uid);
            }
            if let Some(port) = kept {
                let key = self.key_on(node, &port.network_id);
                inv.assign(&pod.uid, &key, port);
            }
        }
        self.gauges();
        tracing::info!(uid = %pod.uid, port = %ours.vif_id, kept = %keep.vif_id, "deleted a port that lost to the VIF on record");
        Ok(())
    }

    fn ready_when_plugged(&self) -> bool {
        false
    }

    fn watch_ready(&self, pod_uid: &str, vif_id: &str, watch: bool) {
        if !watch {
            guard(&self.watched).remove(vif_id);
            if let Some(side) = &self.events {
                guard(&side.state).early.remove(vif_id);
            }
            return;
        }
        let revision = guard(&self.inv).held(pod_uid).filter(|p| p.id == vif_id).and_then(|p| p.revision_number);
        let w = Watched { pod_uid: pod_uid.to_string(), since: Instant::now(), revision };
        // The watched ports' lock held throughout (then the event state's, as on_port_event
        // takes them): a push is either remembered as early here or sees the port watched.
        let mut g = guard(&self.watched);
        // Pushed ACTIVE for this pod before its plug was reported: ready at once.
        if let Some(side) = &self.events {
            let early = guard(&side.state).early.remove(vif_id);
            if let Some((rev, uid)) = early
                && uid == pod_uid
                && newer(Some(rev), revision)
            {
                g.remove(vif_id);
                drop(g);
                self.port_active(vif_id, &w, "event");
                return;
            }
        }
        g.insert(vif_id.to_string(), w);
        drop(g);
        self.wake.notify_one();
    }
}

#[cfg(test)]
mod event_tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_openstack::config::{AuthConfig, Interface, TlsConfig};
    use kuryr_openstack::{CloudConfig, ServiceType};

    use super::events::ResultLabels;
    use super::*;

    const OWNER: &str = "compute:kuryr";

    /// A backend with events whose Neutron is never called here.
    fn backend() -> (NeutronBackend, mpsc::UnboundedReceiver<ReadyVif>, tokio::sync::watch::Sender<Link>) {
        let cloud = CloudConfig {
            origin: "test".into(),
            auth: AuthConfig::NoAuth { project_id: Some("p".into()) },
            region_name: None,
            interface: Interface::default(),
            tls: TlsConfig::default(),
            endpoint_overrides: [(ServiceType::Network, "http://127.0.0.1:9".parse().unwrap())].into(),
        };
        let client = Client::new(
            &cloud,
            kuryr_openstack::ClientOptions::default(),
            Arc::new(kuryr_openstack::Metrics::unregistered()),
        )
        .unwrap();
        let (ready_tx, ready) = mpsc::unbounded_channel();
        let (refill_tx, _) = mpsc::unbounded_channel();
        let link = tokio::sync::watch::Sender::new(Link { connected: true, epoch: 1 });
        let metrics = NeutronMetrics::default();
        let b = NeutronBackend {
            neutron: client.network(),
            networks: Networks::Fixed(VifShape {
                network_id: "net".into(),
                subnets: Vec::new(),
                mtu: 1500,
                bridge: "br-int".into(),
            }),
            project: "p".into(),
            security_groups: Vec::new(),
            reset_groups: Vec::new(),
            tag: "t".into(),
            device_owner: OWNER.into(),
            limits: Limits { min: 0, batch: 0, max: 0 },
            poll: (Duration::from_millis(100), Duration::from_secs(2)),
            inv: Mutex::default(),
            watched: Mutex::default(),
            wake: Notify::new(),
            ready_tx,
            refill_tx,
            filling: Mutex::default(),
            bulk: Semaphore::new(1),
            recovered: AtomicBool::new(true),
            events: Some(EventSide {
                link: link.subscribe(),
                resync: Duration::from_secs(10),
                metrics: metrics.events.clone(),
                state: Mutex::default(),
                consumer: Mutex::new(None),
            }),
            metrics,
        };
        (b, ready, link)
    }

    fn port(id: &str, revision: u64) -> Port {
        Port { id: id.into(), revision_number: Some(revision), device_owner: OWNER.into(), ..Port::default() }
    }

    fn ev(id: &str, status: &str, revision: u64, device_id: &str) -> PortEvent {
        PortEvent {
            id: id.into(),
            status: Some(status.into()),
            revision: Some(revision),
            device_id: Some(device_id.into()),
            device_owner: Some(OWNER.into()),
            hosts: vec!["node-1".into()],
            deleted: false,
        }
    }

    fn count(b: &NeutronBackend, result: &'static str) -> u64 {
        b.metrics.events.ports.get_or_create(&ResultLabels { result }).get()
    }

    #[test]
    fn a_watched_port_is_ready_only_on_a_newer_active_push_naming_its_pod() {
        let (b, mut ready, _link) = backend();
        let key = PoolKey::new("node-1", "p", "net", Vec::new());
        guard(&b.inv).assign("uid-1", &key, port("p1", 5));
        b.watch_ready("uid-1", "p1", true);

        let mut foreign = ev("vm-port", "ACTIVE", 1, "server-1");
        foreign.device_owner = Some("compute:nova".into());
        b.on_port_event(&foreign);
        b.on_port_event(&ev("other-kuryr-port", "ACTIVE", 3, "x"));
        assert_eq!(count(&b, "foreign"), 2);

        b.on_port_event(&ev("p1", "ACTIVE", 5, "uid-1"));
        b.on_port_event(&ev("p1", "ACTIVE", 4, "old-pod"));
        assert_eq!(count(&b, "stale"), 2, "revisions up to the assignment's say nothing of this plug");
        b.on_port_event(&ev("p1", "ACTIVE", 10_000, "old-pod"));
        assert_eq!(count(&b, "stale"), 3, "another pod's port state");
        b.on_port_event(&ev("p1", "DOWN", 7, "uid-1"));
        b.on_port_event(&ev("p1", "DOWN", 7, "uid-1"));
        b.on_port_event(&ev("p1", "ACTIVE", 6, "uid-1"));
        assert_eq!((count(&b, "pending"), count(&b, "stale")), (1, 5), "a repeat and an older push are stale");
        assert!(ready.try_recv().is_err(), "nothing marked ready so far");
        assert!(guard(&b.watched).contains_key("p1"));

        b.on_port_event(&ev("p1", "ACTIVE", 8, "uid-1"));
        assert_eq!(ready.try_recv().unwrap(), ReadyVif { pod_uid: "uid-1".into(), vif_id: "p1".into() });
        assert!(!guard(&b.watched).contains_key("p1"));
        b.on_port_event(&ev("p1", "ACTIVE", 8, "uid-1"));
        assert!(ready.try_recv().is_err(), "a duplicate marks nothing twice");
        assert_eq!(b.metrics.ready_sources.get_or_create(&metrics::SourceLabels { source: "event" }).get(), 1);
    }

    #[test]
    fn active_before_the_plug_report_counts_unless_a_newer_push_took_it_back() {
        let (b, mut ready, _link) = backend();
        let key = PoolKey::new("node-1", "p", "net", Vec::new());
        guard(&b.inv).assign("uid-4", &key, port("p4", 3));
        guard(&b.inv).assign("uid-5", &key, port("p5", 3));
        // p4: ACTIVE then DOWN, delivered out of order.
        b.on_port_event(&ev("p4", "DOWN", 5, "uid-4"));
        b.on_port_event(&ev("p4", "ACTIVE", 4, "uid-4"));
        // p5: ACTIVE.
        b.on_port_event(&ev("p5", "ACTIVE", 4, "uid-5"));
        assert_eq!(count(&b, "early"), 1);
        b.watch_ready("uid-4", "p4", true);
        assert!(ready.try_recv().is_err(), "p4 was last seen DOWN");
        b.watch_ready("uid-5", "p5", true);
        assert_eq!(ready.try_recv().unwrap(), ReadyVif { pod_uid: "uid-5".into(), vif_id: "p5".into() });
        assert!(guard(&b.watched).contains_key("p4") && !guard(&b.watched).contains_key("p5"));
    }

    #[test]
    fn released_ports_are_free_again_when_pushed_unplugged_and_deletions_stop_the_wait() {
        let (b, mut ready, _link) = backend();
        let key = PoolKey::new("node-1", "p", "net", Vec::new());
        guard(&b.inv).put_recycling(&key, port("p2", 9), Instant::now());
        b.on_port_event(&ev("p2", "DOWN", 8, ""));
        assert_eq!(guard(&b.inv).recycling().len(), 1, "a push older than the release");
        b.on_port_event(&ev("p2", "ACTIVE", 10, ""));
        assert_eq!(guard(&b.inv).recycling().len(), 1, "still plugged");
        b.on_port_event(&ev("p2", "DOWN", 11, ""));
        assert!(guard(&b.inv).recycling().is_empty());
        assert_eq!(guard(&b.inv).view(&key).unwrap().free, ["p2"]);
        assert_eq!(count(&b, "recycled"), 1);
        b.on_port_event(&ev("p2", "DOWN", 12, ""));
        assert_eq!(count(&b, "idle"), 1, "a free port's push changes nothing");

        guard(&b.inv).assign("uid-3", &key, port("p3", 2));
        b.watch_ready("uid-3", "p3", true);
        let mut gone = ev("p3", "DOWN", 3, "uid-3");
        gone.status = None;
        gone.deleted = true;
        b.on_port_event(&gone);
        assert!(!guard(&b.watched).contains_key("p3"));
        assert!(ready.try_recv().is_err());
        assert_eq!(count(&b, "gone"), 1);
    }
}
