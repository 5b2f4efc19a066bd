//! Per-namespace networks (`--neutron-namespace-subnets`), Kuryr's namespace-subnet driver done
//! over: instead of one pod network, every namespace with pods gets its own Neutron network, a
//! subnet from each configured subnet pool and an interface on the configured router (so pods
//! of different namespaces still reach each other, through it).
//!
//! **Made on demand** ([`NamespaceNetworks::ensure`]), by the first pod of a namespace that needs
//! a port, one namespace at a time: the finalizer on the Namespace first (from then on the
//! namespace cannot disappear before its network is removed), the NamespaceNetwork record, then
//! the Neutron resources, each looked up by its tags before it is created ([`neutron`]), then the
//! record's status. Pools stay keyed by (node, project, network, security groups), so each
//! namespace network has pools of its own.
//!
//! **Removed with the namespace** ([`NeutronBackend::reconcile_namespace`], driven by the
//! watcher's namespace stream in [`follow`]): once the namespace is being deleted no port is
//! made on its network any more and released ports are deleted rather than pooled; once no pod
//! holds a port on it, the free and recycling pool ports are deleted, the router interfaces
//! removed, the subnets and the network deleted, then the record and the finalizer. Failures are
//! retried with backoff and told as Warning Events on the Namespace and in metrics.
//!
//! **Restarts**: the records in the Ready phase, matched with Neutron's tagged networks and
//! subnets, are loaded before any pod is served ([`NamespaceNetworks::load`]); anything else is
//! found again by tags when next needed.

pub mod config;
pub mod follow;
pub mod k8s;
pub mod metrics;
pub mod neutron;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use futures::StreamExt as _;
use kuryr_openstack::Filter;
use tokio::sync::mpsc;

use self::config::NamespaceArgs;
use self::k8s::NamespaceKube;
use self::metrics::NamespaceMetrics;
use self::neutron::{NamespaceNeutron, PoolRef, Provisioned, tagged_namespace};
use super::vif::{SubnetInfo, VifShape};
use super::{DELETE_CONCURRENCY, NeutronBackend, guard, neutron_err};
use crate::error::{ClusterError, chain};
use crate::k8s::crd::{NamespaceNetworkPhase, NamespaceNetworkStatus, NamespaceSubnet};

/// What PodVifs name as their network when each namespace has its own: the record's
/// `networkId` names the namespace's Neutron network.
pub const NETWORK_LABEL: &str = "neutron-namespaces";
/// Bound on waiting for a namespace network's pool ports in flight before removing it (the
/// removal is retried with backoff after it).
const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// A namespace network pods are served from.
#[derive(Clone, Debug)]
struct Entry {
    shape: VifShape,
    /// The namespace is being deleted: no new ports, released ones are deleted.
    deleting: bool,
}

#[derive(Debug, Default)]
struct State {
    /// Namespace → its network, once made (or loaded).
    nets: HashMap<String, Entry>,
    /// Namespace → being deleted, as the watcher streams them.
    seen: HashMap<String, bool>,
    /// The watcher's namespace snapshot is in.
    live: bool,
}

/// The registry and the makers of namespace networks.
#[derive(Debug)]
pub struct NamespaceNetworks {
    neutron: NamespaceNeutron,
    kube: NamespaceKube,
    bridge: String,
    state: Mutex<State>,
    /// One provisioning or cleanup per namespace at a time.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Namespaces whose cleanup may be able to go on (a port was released).
    wake: mpsc::UnboundedSender<String>,
    wake_rx: Mutex<Option<mpsc::UnboundedReceiver<String>>>,
    metrics: NamespaceMetrics,
}

/// What a namespace reconcile came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NamespaceOutcome {
    /// Nothing (more) to do.
    Done,
    /// Being deleted, but pods still hold ports on the network: try again when one is released.
    Waiting(usize),
}

impl NamespaceNetworks {
    /// Checks the subnet pools and the router in Neutron, naming the flag at fault.
    pub async fn connect(
        args: &NamespaceArgs,
        neutron: kuryr_openstack::neutron::Neutron,
        project: &str,
        cluster_tag: &str,
        bridge: &str,
        kube: NamespaceKube,
        metrics: NamespaceMetrics,
    ) -> anyhow::Result<NamespaceNetworks> {
        let mut pools = Vec::new();
        for (flag, id, version) in args.pools() {
            let pool = neutron.get_subnetpool(&id).await.map_err(|e| match e {
                e if e.is_not_found() => anyhow::anyhow!("{flag} {id}: no such Neutron subnet pool"),
                e => anyhow::anyhow!("reading Neutron subnet pool {id}: {e}"),
            })?;
            anyhow::ensure!(
                pool.ip_version == version,
                "{flag} {id}: an IPv{} subnet pool, not IPv{version}",
                pool.ip_version
            );
            pools.push(PoolRef { id, ip_version: version });
        }
        let router = args.neutron_router.clone().unwrap_or_default().trim().to_string();
        neutron.get_router(&router).await.map_err(|e| match e {
            e if e.is_not_found() => anyhow::anyhow!("--neutron-router {router}: no such Neutron router"),
            e => anyhow::anyhow!("reading Neutron router {router}: {e}"),
        })?;
        tracing::info!(?pools, router, "per-namespace networks");
        let (wake, wake_rx) = mpsc::unbounded_channel();
        Ok(NamespaceNetworks {
            neutron: NamespaceNeutron {
                neutron,
                project: project.to_string(),
                cluster_tag: cluster_tag.to_string(),
                router,
                pools,
            },
            kube,
            bridge: bridge.to_string(),
            state: Mutex::default(),
            locks: Mutex::default(),
            wake,
            wake_rx: Mutex::new(Some(wake_rx)),
            metrics,
        })
    }

    /// Loads the networks recorded Ready whose Neutron network and subnets still carry their
    /// tags; returns how many.
    pub async fn load(&self) -> Result<usize, ClusterError> {
        let records = self.kube.list_records().await?;
        let tag = std::slice::from_ref(&self.neutron.cluster_tag);
        let nets = self
            .neutron
            .neutron
            .list_networks(&Filter::new().tags(tag))
            .await
            .map_err(neutron_err("listing the cluster's networks"))?;
        let subnets = self
            .neutron
            .neutron
            .list_subnets(&Filter::new().tags(tag))
            .await
            .map_err(neutron_err("listing the cluster's subnets"))?;
        let mut loaded = 0;
        for rec in records {
            let st = rec.status.clone().unwrap_or_default();
            let (Some(NamespaceNetworkPhase::Ready), Some(net_id)) = (st.phase, st.network_id.as_deref()) else {
                continue;
            };
            let ns = rec.spec.namespace.as_str();
            let Some(net) = nets.iter().find(|n| n.id == net_id && tagged_namespace(&n.tags) == Some(ns)) else {
                continue;
            };
            let mine: Vec<_> = st
                .subnets
                .iter()
                .filter_map(|s| subnets.iter().find(|x| x.id == s.id && x.network_id == net.id))
                .collect();
            if mine.len() != self.neutron.pools.len() {
                continue;
            }
            let infos: Result<Vec<SubnetInfo>, String> = mine.iter().map(|s| SubnetInfo::from_subnet(s)).collect();
            let Ok(infos) = infos else { continue };
            let shape = self.shape(net.id.clone(), infos, net.mtu);
            guard(&self.state).nets.insert(ns.to_string(), Entry { shape, deleting: false });
            loaded += 1;
        }
        self.gauge();
        Ok(loaded)
    }

    fn shape(&self, network_id: String, subnets: Vec<SubnetInfo>, mtu: Option<u32>) -> VifShape {
        VifShape { network_id, subnets, mtu: mtu.unwrap_or(1500), bridge: self.bridge.clone() }
    }

    fn gauge(&self) {
        let n = guard(&self.state).nets.values().filter(|e| !e.deleting).count();
        self.metrics.networks.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    fn lock_of(&self, namespace: &str) -> Arc<tokio::sync::Mutex<()>> {
        guard(&self.locks).entry(namespace.to_string()).or_default().clone()
    }

    /// The Open vSwitch bridge pods' ports are plugged into.
    pub fn bridge(&self) -> &str {
        &self.bridge
    }

    /// The shape of VIFs on `network`, if it is a namespace network in service.
    pub fn shape_of(&self, network: &str) -> Option<VifShape> {
        guard(&self.state).nets.values().find(|e| e.shape.network_id == network && !e.deleting).map(|e| e.shape.clone())
    }

    /// The namespace of a network known here.
    fn namespace_of(&self, network: &str) -> Option<(String, bool)> {
        guard(&self.state)
            .nets
            .iter()
            .find(|(_, e)| e.shape.network_id == network)
            .map(|(ns, e)| (ns.clone(), e.deleting))
    }

    /// Every namespace network: namespace → network id.
    pub fn networks(&self) -> BTreeMap<String, String> {
        guard(&self.state).nets.iter().map(|(ns, e)| (ns.clone(), e.shape.network_id.clone())).collect()
    }

    /// A port on `network` was given back: a cleanup waiting for it may go on.
    pub fn released(&self, network: &str) {
        if let Some((ns, true)) = self.namespace_of(network) {
            let _ = self.wake.send(ns);
        }
    }

    fn refuse_deleting(namespace: &str) -> ClusterError {
        ClusterError::NotReady(format!("namespace {namespace} is being deleted; its network takes no new ports"))
    }

    /// The shape of VIFs of pods in `namespace`, making its network first if need be.
    pub async fn ensure(&self, namespace: &str) -> Result<VifShape, ClusterError> {
        if let Some(shape) = self.known(namespace)? {
            return Ok(shape);
        }
        let lock = self.lock_of(namespace);
        let _held = lock.lock().await;
        if let Some(shape) = self.known(namespace)? {
            return Ok(shape);
        }
        match self.provision(namespace).await {
            Ok((shape, uid)) => {
                guard(&self.state).nets.insert(namespace.to_string(), Entry { shape: shape.clone(), deleting: false });
                self.gauge();
                self.metrics.done("create");
                let cidrs: Vec<String> = shape.subnets.iter().map(|s| s.cidr.to_string()).collect();
                let note = format!(
                    "network {} with subnets {} on router {}",
                    shape.network_id,
                    cidrs.join(", "),
                    self.neutron.router
                );
                tracing::info!(namespace, network = %shape.network_id, ?cidrs, "namespace network ready");
                self.kube.event(namespace, &uid, false, "NamespaceNetworkReady", "Create", note).await;
                Ok(shape)
            }
            Err(e) => {
                self.metrics.failed("create", e.reason());
                let msg = chain(&e);
                tracing::warn!(namespace, error = msg, "making the namespace's network failed; retried with its pods");
                if !matches!(e, ClusterError::NotReady(_)) {
                    let status = NamespaceNetworkStatus {
                        phase: Some(NamespaceNetworkPhase::Failed),
                        message: Some(msg.clone()),
                        ..Default::default()
                    };
                    let _ = self.kube.write_status(namespace, &status).await;
                    let uid = self.kube.namespace(namespace).await.ok().flatten().map(|m| m.uid).unwrap_or_default();
                    self.kube.event(namespace, &uid, true, "NamespaceNetworkFailed", "Create", msg).await;
                }
                Err(e)
            }
        }
    }

    /// The namespace's network if it is in service; an error if the namespace is being deleted.
    fn known(&self, namespace: &str) -> Result<Option<VifShape>, ClusterError> {
        let st = guard(&self.state);
        if st.seen.get(namespace) == Some(&true) {
            return Err(Self::refuse_deleting(namespace));
        }
        match st.nets.get(namespace) {
            Some(e) if e.deleting => Err(Self::refuse_deleting(namespace)),
            Some(e) => Ok(Some(e.shape.clone())),
            None => Ok(None),
        }
    }

    async fn provision(&self, namespace: &str) -> Result<(VifShape, String), ClusterError> {
        let meta = self
            .kube
            .namespace(namespace)
            .await?
            .ok_or_else(|| ClusterError::NotReady(format!("namespace {namespace} does not exist")))?;
        if meta.deleting {
            return Err(Self::refuse_deleting(namespace));
        }
        if !meta.has_finalizer() {
            self.kube.add_finalizer(namespace, &meta).await?;
        }
        let record = self.kube.ensure_record(namespace, &meta.uid).await?;
        if record.status.as_ref().and_then(|s| s.phase).is_none() {
            let status = NamespaceNetworkStatus { phase: Some(NamespaceNetworkPhase::Creating), ..Default::default() };
            self.kube.write_status(namespace, &status).await?;
        }
        let Provisioned { network, subnets } = self.neutron.ensure(namespace).await?;
        let infos = subnets
            .iter()
            .map(|(s, _, _)| SubnetInfo::from_subnet(s))
            .collect::<Result<Vec<_>, _>>()
            .map_err(ClusterError::NotReady)?;
        let status = NamespaceNetworkStatus {
            phase: Some(NamespaceNetworkPhase::Ready),
            network_id: Some(network.id.clone()),
            subnets: subnets
                .iter()
                .map(|(s, pool, port)| NamespaceSubnet {
                    id: s.id.clone(),
                    cidr: s.cidr.clone(),
                    subnet_pool_id: pool.clone(),
                    router_port_id: port.clone(),
                })
                .collect(),
            router_id: Some(self.neutron.router.clone()),
            message: None,
        };
        self.kube.write_status(namespace, &status).await?;
        Ok((self.shape(network.id, infos, network.mtu), meta.uid))
    }

    /// Takes the stream's view of one namespace; returns whether it should be reconciled
    /// (being deleted or gone, and something of it may exist).
    fn observe(&self, namespace: &str, deleting: Option<bool>) -> bool {
        let mut st = guard(&self.state);
        match deleting {
            Some(d) => {
                st.seen.insert(namespace.to_string(), d);
                d
            }
            None => {
                st.seen.remove(namespace);
                true
            }
        }
    }

    /// Hands the receiver of cleanup wake-ups to the follower (once).
    fn take_wake(&self) -> Option<mpsc::UnboundedReceiver<String>> {
        guard(&self.wake_rx).take()
    }
}

impl NeutronBackend {
    /// The namespace networks, when each namespace has its own.
    pub fn namespace_networks(&self) -> Option<&Arc<NamespaceNetworks>> {
        match &self.networks {
            super::Networks::PerNamespace(n) => Some(n),
            super::Networks::Fixed(_) => None,
        }
    }

    /// Brings a namespace's network in line with the namespace: nothing while it lives; once it
    /// is being deleted (or gone), its removal, after the last port held on it is released.
    pub async fn reconcile_namespace(&self, namespace: &str) -> Result<NamespaceOutcome, ClusterError> {
        let Some(nn) = self.namespace_networks() else { return Ok(NamespaceOutcome::Done) };
        let lock = nn.lock_of(namespace);
        let _held = lock.lock().await;
        let (seen, live) = {
            let st = guard(&nn.state);
            (st.seen.get(namespace).copied(), st.live)
        };
        match seen {
            Some(false) => return Ok(NamespaceOutcome::Done),
            None if !live => return Ok(NamespaceOutcome::Done),
            _ => {}
        }
        let meta = nn.kube.namespace(namespace).await?;
        if meta.as_ref().is_some_and(|m| !m.deleting) {
            // Re-created meanwhile (or the stream is behind): nothing to remove.
            return Ok(NamespaceOutcome::Done);
        }
        // One replica removes namespace networks: the holder of shard 0 ([`super::shards`]).
        // The others look again later while the namespace is there, in case they become it.
        if !self.leads() {
            return Ok(if meta.is_some() { NamespaceOutcome::Waiting(0) } else { NamespaceOutcome::Done });
        }
        let known = guard(&nn.state).nets.get(namespace).map(|e| e.shape.network_id.clone());
        if known.is_none() && meta.as_ref().is_some_and(|m| !m.has_finalizer()) {
            return Ok(NamespaceOutcome::Done);
        }
        if let Some(e) = guard(&nn.state).nets.get_mut(namespace) {
            e.deleting = true;
        }
        nn.gauge();
        // What Neutron has under the namespace's tags, besides what is known here (a network
        // made before a restart and never loaded).
        let mut nets: Vec<String> = nn.neutron.networks(namespace).await?.into_iter().map(|n| n.id).collect();
        if let Some(net) = &known
            && !nets.contains(net)
        {
            nets.push(net.clone());
        }
        if nets.is_empty() {
            // Nothing in Neutron (already removed, or never made): only the record and the
            // finalizer may be left.
            nn.kube.delete_record(namespace).await?;
            if let Some(m) = meta.as_ref().filter(|m| m.has_finalizer()) {
                nn.kube.remove_finalizer(namespace, m).await?;
            }
            guard(&nn.state).nets.remove(namespace);
            nn.gauge();
            return Ok(NamespaceOutcome::Done);
        }
        {
            let mut held = guard(&self.inv).holders().filter(|(_, k, _)| nets.contains(&k.network)).count();
            if held == 0 && self.sharded() {
                // Pods on the other replicas' nodes hold ports this one does not know.
                held = self.held_in_neutron(&nets).await?;
            }
            if held > 0 {
                tracing::info!(namespace, networks = ?nets, held, "namespace being deleted; waiting for its pods' ports");
                let waiting = NamespaceNetworkStatus {
                    phase: Some(NamespaceNetworkPhase::Deleting),
                    message: Some(format!("waiting for {held} pods to release their ports")),
                    ..Default::default()
                };
                nn.kube.write_status(namespace, &waiting).await?;
                return Ok(NamespaceOutcome::Waiting(held));
            }
        }
        let started = std::time::Instant::now();
        let deleting = NamespaceNetworkStatus {
            phase: Some(NamespaceNetworkPhase::Deleting),
            network_id: known.clone(),
            ..Default::default()
        };
        nn.kube.write_status(namespace, &deleting).await?;
        for net in &nets {
            self.drop_network_ports(net).await?;
            if self.sharded() {
                // The other replicas' pool ports on it too.
                self.delete_unheld_on(net).await?;
            }
        }
        let removed = nn.neutron.remove(namespace).await?;
        nn.kube.delete_record(namespace).await?;
        if let Some(m) = nn.kube.namespace(namespace).await? {
            nn.kube.remove_finalizer(namespace, &m).await?;
        }
        guard(&nn.state).nets.remove(namespace);
        guard(&nn.locks).remove(namespace);
        nn.gauge();
        nn.metrics.done("delete");
        nn.metrics.cleanup_seconds.observe(started.elapsed().as_secs_f64());
        tracing::info!(namespace, networks = ?removed, "namespace network removed");
        Ok(NamespaceOutcome::Done)
    }

    /// Deletes the free and recycling pool ports on `network`, and forgets its pools. Ports
    /// being created for those pools land first (bounded by [`SETTLE_TIMEOUT`]): one landing
    /// after the drain would stay in a forgotten pool, naming a port the network's removal
    /// deletes.
    async fn drop_network_ports(&self, network: &str) -> Result<(), ClusterError> {
        let settle_until = std::time::Instant::now() + SETTLE_TIMEOUT;
        while guard(&self.inv).creating_for(|k| k.network == network) > 0 {
            if std::time::Instant::now() >= settle_until {
                return Err(ClusterError::NotReady(format!(
                    "pool ports for network {network} still being created after {SETTLE_TIMEOUT:?}"
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let mut doomed: Vec<(super::PoolKey, kuryr_openstack::neutron::Port)> =
            guard(&self.inv).drain_free(|k| k.network == network);
        {
            let mut inv = guard(&self.inv);
            for (key, id, _) in inv.recycling() {
                if key.network == network
                    && let Some(p) = inv.drop_recycling(&key, &id)
                {
                    doomed.push((key, p));
                }
            }
        }
        let results: Vec<_> = futures::stream::iter(doomed)
            .map(|(key, port)| async move {
                let r = self.delete_port(&port.id, "namespace_deleted").await;
                (key, port, r)
            })
            .buffer_unordered(DELETE_CONCURRENCY)
            .collect()
            .await;
        let mut first_err = None;
        for (key, port, r) in results {
            if let Err(e) = r {
                guard(&self.inv).put_free(&key, port);
                first_err.get_or_insert(e);
            }
        }
        if first_err.is_none() {
            guard(&self.inv).forget_pools(|k| k.network == network);
        }
        self.gauges();
        first_err.map_or(Ok(()), Err)
    }

    /// Reports a failed namespace reconcile: log, metric, Warning Event on the namespace.
    pub async fn namespace_failed(&self, namespace: &str, e: &ClusterError) {
        let Some(nn) = self.namespace_networks() else { return };
        nn.metrics.failed("delete", e.reason());
        let msg = chain(e);
        tracing::warn!(namespace, error = msg, "removing the namespace's network failed; retrying with backoff");
        let failed = NamespaceNetworkStatus {
            phase: Some(NamespaceNetworkPhase::Deleting),
            message: Some(msg.clone()),
            ..Default::default()
        };
        let _ = nn.kube.write_status(namespace, &failed).await;
        let uid = nn.kube.namespace(namespace).await.ok().flatten().map(|m| m.uid).unwrap_or_default();
        nn.kube.event(namespace, &uid, true, "NamespaceNetworkCleanupFailed", "Delete", msg).await;
    }
}
