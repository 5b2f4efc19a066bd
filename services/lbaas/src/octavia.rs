//! The Octavia backend: every Service load balancer is a real Octavia load balancer.
//!
//! **Shape** ([`crate::octavia_plan`]): one load balancer per Service (VIP = the cluster IP),
//! a listener and a named pool per port, members = the ready endpoints, tags naming the cluster,
//! the Service and its uid.
//!
//! **Changes** are made one at a time per load balancer (the controller runs one reconcile per
//! Service at a time; within it each change waits for ACTIVE before the next): a new Service is
//! one fully-populated create; an endpoint change is one batch member update (`PUT
//! .../members`) per pool whose members changed; listeners and pools are added or removed as
//! ports come and go. Waiting for ACTIVE polls on a schedule learnt from the last settle times of
//! the same kind and size of change ([`crate::octavia_poll`]), never a fixed sleep. A load
//! balancer busy with someone else's change (PENDING_*, or 409 "immutable") is waited for, then
//! retried by the controller's backoff; one in ERROR is deleted (cascade) and created again.
//!
//! **What is trusted**: after a change, lbaas keeps the tree it built (ids, members) in memory,
//! so the next endpoint change costs the member update and the polls only. A reconcile at an
//! unchanged generation (the periodic drift pass, a restart) reads the tree back from Octavia and
//! repairs whatever differs: a load balancer, listener or pool deleted behind lbaas' back is
//! created again. Any failure drops the memory, so the retry starts from what Octavia holds.
//!
//! **Recovery**: nothing is remembered across restarts; the first reconcile of each Service finds
//! its load balancer by tags (cluster + Service uid) and adopts it, deleting duplicates. The
//! maintenance pass deletes load balancers of this cluster whose Service has no record any more.
//!
//! **Shards** ([`crate::shards`]): only the Services of served shards are touched. Before every
//! change lbaas checks that the Service's shard is still served here; once it moved, the
//! reconcile stops between two changes (the load balancer is never left PENDING by lbaas, only
//! short of the remaining changes) and the new owner, having forgotten what it knew of the
//! shard, adopts the load balancer by tags and finishes it. Repair and orphan removal look only
//! at load balancers of served shards: one of another shard is not an orphan. Gaining shards
//! runs an orphan pass at once.
//!
//! **type=LoadBalancer**: with `--floating-network-id`, a Neutron floating IP on the VIP port
//! ([`crate::octavia_fip`]) is the Service's ingress; without it, the VIP is.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kuryr_openstack::config::AuthConfig;
use kuryr_openstack::neutron::Neutron;
use kuryr_openstack::octavia::{LoadBalancer, Octavia, ProvisioningStatus, SessionPersistence};
use kuryr_openstack::{
    ApiRequest, Client, ClientOptions, CloudConfig, ConfigSource, Error as OsError, Filter, ServiceType,
};
use kuryr_proto::lbaas::v1::LoadBalancerSpec;
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::backend::{Backend, BackendError, Maintenance, Observed};
use crate::controller::locked;
use crate::octavia_metrics::{OctaviaMetrics, Tally};
use crate::octavia_plan::{
    self as plan, DesiredLb, DesiredListener, ObservedListener, ObservedPool, ObservedTree, Shape, Step,
};
use crate::octavia_poll::Pacer;
use crate::shards::Shards;

/// The backend's name in records and messages.
pub const NAME: &str = "octavia";

/// Octavia backend configuration.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct OctaviaArgs {
    /// The cloud of clouds.yaml to use (else $OS_CLOUD, else the OS_* variables).
    #[arg(long = "os-cloud", env = "KURYR_OS_CLOUD")]
    pub os_cloud: Option<String>,

    /// Octavia's URL, for a deployment without Keystone (Octavia with auth_strategy = noauth);
    /// the cloud configuration is not read then.
    #[arg(long, env = "KURYR_OCTAVIA_URL")]
    pub octavia_url: Option<String>,

    /// Neutron's URL, without Keystone, next to --octavia-url (floating IPs).
    #[arg(long, env = "KURYR_NEUTRON_URL")]
    pub neutron_url: Option<String>,

    /// The project that owns the load balancers, with --octavia-url (sent as X-Project-Id).
    #[arg(long = "os-project-id", env = "KURYR_OS_PROJECT_ID")]
    pub project_id: Option<String>,

    /// The subnet VIPs are allocated on (the Service subnet). Required with --backend octavia.
    #[arg(long, env = "KURYR_VIP_SUBNET_ID")]
    pub vip_subnet_id: Option<String>,

    /// The VIP network, when the subnet alone does not say.
    #[arg(long, env = "KURYR_VIP_NETWORK_ID")]
    pub vip_network_id: Option<String>,

    /// The subnet members are reached on; unset, Octavia reaches them from the VIP subnet.
    #[arg(long, env = "KURYR_MEMBER_SUBNET_ID")]
    pub member_subnet_id: Option<String>,

    /// The external network floating IPs of type=LoadBalancer Services come from; without it
    /// their ingress is the VIP.
    #[arg(long, env = "KURYR_FLOATING_NETWORK_ID")]
    pub floating_network_id: Option<String>,

    /// lbaas creates each VIP port in Neutron (the cluster IP on the VIP subnet, on
    /// --vip-network-id) and hands it to Octavia, instead of letting Octavia allocate it;
    /// deleted after the load balancer.
    #[arg(long, env = "KURYR_VIP_PORT_PRECREATE")]
    pub vip_port_precreate: bool,

    /// The Octavia provider (amphora, ovn, ...); Octavia's default when unset.
    #[arg(long = "octavia-provider", env = "KURYR_OCTAVIA_PROVIDER")]
    pub provider: Option<String>,

    /// This cluster's name, in load balancer names and ownership tags: load balancers tagged with
    /// another cluster are never touched.
    #[arg(long, env = "KURYR_CLUSTER_NAME", default_value = "kubernetes")]
    pub cluster_name: String,

    /// How often every load balancer is read back and repaired (deleted listeners, pools or
    /// whole load balancers), and orphans removed.
    #[arg(long, env = "KURYR_DRIFT_INTERVAL", default_value = "60s",
          value_parser = kuryr_runtime::config::parse_duration)]
    pub drift_interval: Duration,

    /// How long one change may stay PENDING before the reconcile gives up (and is retried).
    #[arg(long = "octavia-active-timeout", env = "KURYR_OCTAVIA_ACTIVE_TIMEOUT", default_value = "300s",
          value_parser = kuryr_runtime::config::parse_duration)]
    pub active_timeout: Duration,
}

impl OctaviaArgs {
    /// The cloud to talk to: direct endpoints with --octavia-url, else clouds.yaml / OS_*.
    pub fn cloud_config(&self) -> anyhow::Result<CloudConfig> {
        let Some(octavia) = &self.octavia_url else {
            return Ok(CloudConfig::load(&ConfigSource::from_process(self.os_cloud.clone()))?);
        };
        let project = self
            .project_id
            .clone()
            .filter(|p| !p.trim().is_empty())
            .ok_or_else(|| anyhow::anyhow!("--os-project-id is required with --octavia-url"))?;
        let parse = |flag: &str, url: &str| {
            reqwest::Url::parse(url).map_err(|e| anyhow::anyhow!("{flag} {url:?} is not a URL: {e}"))
        };
        let mut overrides = std::collections::BTreeMap::new();
        overrides.insert(ServiceType::LoadBalancer, parse("--octavia-url", octavia)?);
        if let Some(n) = &self.neutron_url {
            overrides.insert(ServiceType::Network, parse("--neutron-url", n)?);
        }
        Ok(CloudConfig {
            origin: "--octavia-url".into(),
            auth: AuthConfig::NoAuth { project_id: Some(project) },
            region_name: None,
            interface: Default::default(),
            tls: Default::default(),
            endpoint_overrides: overrides,
        })
    }

    fn shape(&self) -> anyhow::Result<Shape> {
        let vip_subnet_id = self
            .vip_subnet_id
            .clone()
            .filter(|s| !s.trim().is_empty())
            .ok_or_else(|| anyhow::anyhow!("--vip-subnet-id is required with --backend octavia"))?;
        anyhow::ensure!(!self.cluster_name.trim().is_empty(), "--cluster-name must not be empty");
        anyhow::ensure!(
            !self.vip_port_precreate || self.vip_network_id.is_some(),
            "--vip-port-precreate needs --vip-network-id"
        );
        anyhow::ensure!(
            !self.cluster_name.contains(','),
            "--cluster-name must not contain a comma (tags are filtered as comma lists)"
        );
        Ok(Shape {
            cluster: self.cluster_name.clone(),
            vip_subnet_id,
            vip_network_id: self.vip_network_id.clone(),
            vip_port_id: None,
            member_subnet_id: self.member_subnet_id.clone(),
            provider: self.provider.clone(),
        })
    }
}

/// What lbaas knows of one Service's load balancer after converging it.
#[derive(Clone, Debug)]
struct Known {
    uid: String,
    lb_id: String,
    vip_address: String,
    vip_port_id: Option<String>,
    /// The spec generation it converged to.
    generation: u64,
    tree: ObservedTree,
    /// The floating IP, when it has one: (id, address).
    fip: Option<(String, String)>,
}

/// The Octavia backend; cheap to clone.
#[derive(Clone, Debug)]
pub struct OctaviaBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: Client,
    octavia: Octavia,
    neutron: Neutron,
    shape: Shape,
    floating_network_id: Option<String>,
    vip_port_precreate: bool,
    active_timeout: Duration,
    drift_interval: Duration,
    metrics: OctaviaMetrics,
    /// When to poll for ACTIVE, learnt from recent changes.
    pacer: Pacer,
    known: Mutex<HashMap<String, Known>>,
    /// The Services this replica may change.
    shards: Shards,
}

/// A failure, with what to record.
fn fail(reason: &'static str, message: impl Into<String>, seen: Option<Observed>) -> BackendError {
    BackendError { backend: NAME, reason, message: message.into(), observed: seen }
}

/// An OpenStack error while `doing`; 409 is "busy" (an immutable load balancer).
fn os_fail(doing: &str, e: &OsError, lb: Option<&str>) -> BackendError {
    let reason = match e {
        OsError::Conflict(_) => "busy",
        OsError::NotFound(_) => "gone",
        e if e.is_transient() => "unavailable",
        _ => "rejected",
    };
    let status = if reason == "busy" { "PENDING_UPDATE" } else { "ERROR" };
    let seen = Observed {
        provisioning_status: status.into(),
        backend_id: lb.unwrap_or_default().to_string(),
        message: format!("{doing}: {e}"),
        ..Default::default()
    };
    fail(reason, format!("{doing}: {}", chain(e)), Some(seen))
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    crate::controller::chain(e)
}

impl OctaviaBackend {
    /// The backend for `args`, its client's metrics and its own registered in `registry`;
    /// changing only the load balancers of the Services `shards` serves.
    pub fn new(args: &OctaviaArgs, registry: &mut Registry, shards: Shards) -> anyhow::Result<Self> {
        let shape = args.shape()?;
        let cloud = args.cloud_config()?;
        let os_metrics = kuryr_openstack::Metrics::register(registry);
        let client = Client::new(&cloud, ClientOptions::default(), os_metrics)?;
        tracing::info!(cloud = cloud.origin, cluster = shape.cluster, vip_subnet = shape.vip_subnet_id,
            floating_network = ?args.floating_network_id, "Octavia backend");
        Ok(Self {
            inner: Arc::new(Inner {
                octavia: client.load_balancer(),
                neutron: client.network(),
                client,
                shape,
                floating_network_id: args.floating_network_id.clone().filter(|s| !s.is_empty()),
                vip_port_precreate: args.vip_port_precreate,
                active_timeout: args.active_timeout,
                drift_interval: args.drift_interval,
                metrics: OctaviaMetrics::register(registry),
                pacer: Pacer::default(),
                known: Mutex::default(),
                shards,
            }),
        })
    }
}

impl Backend for OctaviaBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn recover(&self, _specs: Vec<(String, LoadBalancerSpec)>) {
        // Nothing to restore in memory: the first reconcile of each Service adopts its load
        // balancer by tags, and the maintenance pass removes orphans.
    }

    async fn ensure(&self, key: &str, spec: &LoadBalancerSpec) -> Result<Observed, BackendError> {
        let started = Instant::now();
        let mut t = Tally::default();
        let result = self.inner.converge(key, spec, &mut t).await;
        self.inner.metrics.reconciled(&t, started.elapsed(), result.is_ok());
        match result {
            Ok(known) => {
                let members: usize =
                    known.tree.listeners.iter().filter_map(|l| l.pool.as_ref()).map(|p| p.members.len()).sum();
                let ingress = match (&known.fip, spec.service_type.as_str()) {
                    (Some((_, ip)), _) => ip.clone(),
                    (None, "LoadBalancer") => known.vip_address.clone(),
                    _ => String::new(),
                };
                if t.changes > 0 {
                    tracing::info!(
                        service = key,
                        lb = known.lb_id,
                        generation = spec.generation,
                        changes = t.changes,
                        calls = t.calls,
                        octavia_ms = t.waited.as_millis() as u64,
                        total_ms = started.elapsed().as_millis() as u64,
                        "Octavia load balancer converged"
                    );
                }
                let observed = Observed {
                    provisioning_status: "ACTIVE".into(),
                    observed_generation: spec.generation,
                    backend_id: known.lb_id.clone(),
                    ingress_ip: ingress,
                    message: format!("{} listeners, {members} members", known.tree.listeners.len()),
                };
                locked(&self.inner.known).insert(key.to_string(), known);
                Ok(observed)
            }
            Err(e) => {
                locked(&self.inner.known).remove(key);
                Err(e)
            }
        }
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        let mut t = Tally::default();
        locked(&self.inner.known).remove(key);
        let r = self.inner.delete_service(key, &mut t).await;
        if t.changes > 0 {
            tracing::info!(service = key, calls = t.calls, "Octavia load balancer deleted");
        }
        r
    }

    fn forget(&self, which: &dyn Fn(&str) -> bool) {
        locked(&self.inner.known).retain(|k, _| !which(k));
    }

    fn maintain(&self, ctx: Maintenance) {
        let inner = self.inner.clone();
        tokio::spawn(
            async move { inner.maintenance(ctx).await }.instrument(tracing::info_span!("octavia-maintenance")),
        );
    }
}

impl Inner {
    fn filter_tags(&self, tags: &[String]) -> Filter {
        Filter::new().tags(tags)
    }

    /// `Ok` while the shard of the Service `key` is served here: checked before every change.
    fn still_mine(&self, key: &str) -> Result<(), Moved> {
        if self.shards.serves(key) { Ok(()) } else { Err(Moved(key.to_string())) }
    }

    /// [`Inner::still_mine`] for the Service whose load balancer `want` is.
    fn still_mine_for(&self, want: &DesiredLb) -> Result<(), Moved> {
        match plan::owner(&want.tags) {
            Some((key, _)) => self.still_mine(&key),
            None => Ok(()),
        }
    }

    /// Brings the load balancer of `key` to `spec`.
    async fn converge(&self, key: &str, spec: &LoadBalancerSpec, t: &mut Tally) -> Result<Known, BackendError> {
        let want = plan::desired(key, spec, &self.shape).map_err(|m| {
            fail(
                "invalid",
                m.clone(),
                Some(Observed { provisioning_status: "ERROR".into(), message: m, ..Default::default() }),
            )
        })?;
        let cached = locked(&self.known).get(key).filter(|k| k.uid == spec.uid).cloned();
        if cached.is_none() {
            // Another Service of that name may have left a load balancer that was never cleaned up.
            let stale = locked(&self.known).remove(key);
            if let Some(old) = stale {
                self.still_mine(key)?;
                self.delete_lb(&old.lb_id, t).await?;
            }
        }
        // A change of the spec trusts what lbaas built; the same generation again is a check.
        let mut known = match cached.filter(|k| k.generation != spec.generation) {
            Some(k) => k,
            None => match self.adopt(&want, &spec.uid, t).await? {
                Some(k) => k,
                None => self.create(&want, &spec.uid, t).await?,
            },
        };
        if canonical(&known.vip_address) != canonical(&want.vip_address) {
            tracing::info!(
                service = key,
                lb = known.lb_id,
                have = known.vip_address,
                want = want.vip_address,
                "the VIP changed: replacing the load balancer"
            );
            self.still_mine(key)?;
            self.delete_lb(&known.lb_id, t).await?;
            known = self.create(&want, &spec.uid, t).await?;
        }
        for step in plan::plan(&want, &known.tree) {
            match self.apply(&known.lb_id, &want, step, &mut known.tree, t).await {
                Ok(()) => {}
                Err(Applied::LbError) => {
                    // ERROR after our change: Octavia takes no other; replace the whole tree
                    // with one create (which checks that it ends ACTIVE).
                    tracing::warn!(service = key, lb = known.lb_id, "load balancer went to ERROR: replacing it");
                    self.still_mine(key)?;
                    self.delete_lb(&known.lb_id, t).await?;
                    known = self.create(&want, &spec.uid, t).await?;
                    break;
                }
                Err(Applied::Failed(e)) => return Err(e),
            }
        }
        known.generation = spec.generation;
        self.ensure_ingress(key, spec, &want, &mut known, t).await?;
        Ok(known)
    }

    /// Finds the load balancer of `uid` by its tags and takes it over as it is: waits out a
    /// pending change, replaces an ERROR one, deletes duplicates, and reads its tree.
    async fn adopt(&self, want: &DesiredLb, uid: &str, t: &mut Tally) -> Result<Option<Known>, BackendError> {
        let filter = self.filter_tags(&[plan::cluster_tag(&self.shape.cluster), format!("{}{uid}", plan::TAG_UID)]);
        t.calls += 1;
        let mut found =
            self.octavia.list_load_balancers(&filter).await.map_err(|e| os_fail("listing load balancers", &e, None))?;
        found.retain(|lb| {
            lb.provisioning_status != ProvisioningStatus::PendingDelete
                && lb.provisioning_status != ProvisioningStatus::Deleted
        });
        // Prefer a working one; any other is a duplicate (a create whose answer was lost).
        found.sort_by_key(|lb| match lb.provisioning_status {
            ProvisioningStatus::Active => 0,
            s if s.is_pending() => 1,
            _ => 2,
        });
        let mut found = found.into_iter();
        let Some(lb) = found.next() else { return Ok(None) };
        for dup in found {
            tracing::warn!(lb = dup.id, keep = lb.id, name = want.name, "duplicate load balancer: deleting it");
            self.still_mine_for(want)?;
            self.delete_lb(&dup.id, t).await?;
        }
        let settled =
            if lb.provisioning_status.is_pending() { self.wait_settled(&lb.id, "", 0, t).await? } else { Some(lb) };
        let lb = match settled {
            Some(lb) if lb.provisioning_status == ProvisioningStatus::Active => lb,
            Some(lb) => {
                tracing::warn!(lb = lb.id, name = want.name, status = ?lb.provisioning_status,
                    "load balancer in ERROR: deleting it to create it again");
                self.still_mine_for(want)?;
                self.delete_lb(&lb.id, t).await?;
                return Ok(None);
            }
            None => return Ok(None),
        };
        let tree = self.read_tree(&lb.id, t).await?;
        Ok(Some(Known {
            uid: uid.to_string(),
            lb_id: lb.id.clone(),
            vip_address: lb.vip_address.clone().unwrap_or_default(),
            vip_port_id: lb.vip_port_id.clone(),
            generation: 0,
            tree,
            fip: None,
        }))
    }

    /// Listeners, pools and members of a load balancer as Octavia holds them.
    async fn read_tree(&self, lb_id: &str, t: &mut Tally) -> Result<ObservedTree, BackendError> {
        let by_lb = Filter::new().eq("loadbalancer_id", lb_id);
        t.calls += 2;
        let mut listeners =
            self.octavia.list_listeners(&by_lb).await.map_err(|e| os_fail("listing listeners", &e, Some(lb_id)))?;
        let mut pools = self.octavia.list_pools(&by_lb).await.map_err(|e| os_fail("listing pools", &e, Some(lb_id)))?;
        // The filter is the server's; never act on another load balancer's objects.
        listeners.retain(|l| l.loadbalancers.iter().any(|r| r.id == lb_id));
        pools.retain(|p| p.loadbalancers.iter().any(|r| r.id == lb_id));
        let mut tree = ObservedTree::default();
        let defaults: BTreeSet<&str> = listeners.iter().filter_map(|l| l.default_pool_id.as_deref()).collect();
        for p in &pools {
            if !defaults.contains(p.id.as_str()) {
                tree.stray_pools.push(p.id.clone());
            }
        }
        for l in &listeners {
            let pool = match l.default_pool_id.as_deref().and_then(|id| pools.iter().find(|p| p.id == id)) {
                Some(p) => {
                    t.calls += 1;
                    let members = self
                        .octavia
                        .list_members(&p.id, &Filter::new())
                        .await
                        .map_err(|e| os_fail("listing members", &e, Some(lb_id)))?;
                    Some(ObservedPool {
                        id: p.id.clone(),
                        persistence: p.session_persistence.clone(),
                        members: ObservedPool::member_set(
                            members.iter().map(|m| (m.address.as_str(), m.protocol_port)),
                        ),
                    })
                }
                None => None,
            };
            tree.listeners.push(ObservedListener {
                id: l.id.clone(),
                protocol: l.protocol,
                port: l.protocol_port,
                pool,
            });
        }
        Ok(tree)
    }

    /// One fully-populated create; waits for ACTIVE.
    async fn create(&self, want: &DesiredLb, uid: &str, t: &mut Tally) -> Result<Known, BackendError> {
        self.still_mine_for(want)?;
        let mut body = want.create_body(&self.shape);
        if self.vip_port_precreate {
            let network = self.shape.vip_network_id.clone().unwrap_or_default();
            let port = crate::octavia_fip::ensure_vip_port(
                &self.neutron,
                &network,
                &self.shape.vip_subnet_id,
                &want.vip_address,
                &want.name,
                &want.tags,
            )
            .await
            .map_err(|e| os_fail("creating the VIP port", &e, None))?;
            body.vip_port_id = Some(port.id);
        }
        t.calls += 1;
        t.changes += 1;
        let accepted = Instant::now();
        let lb = self
            .octavia
            .create_load_balancer(body)
            .await
            .map_err(|e| os_fail("creating the load balancer", &e, None))?;
        self.metrics.changed("lb_create");
        tracing::info!(lb = lb.id, name = want.name, listeners = want.listeners.len(), "load balancer created");
        let lb = match self.wait_settled(&lb.id, "lb_create", want.member_count(), t).await? {
            Some(lb) if lb.provisioning_status == ProvisioningStatus::Active => lb,
            Some(lb) => {
                // Left for the next attempt to replace (adopt deletes an ERROR load balancer).
                return Err(fail(
                    "error_state",
                    format!("load balancer {} went to {:?} after create", lb.id, lb.provisioning_status),
                    Some(Observed {
                        provisioning_status: "ERROR".into(),
                        backend_id: lb.id,
                        message: "ERROR after create; replacing it".into(),
                        ..Default::default()
                    }),
                ));
            }
            None => return Err(fail("gone", format!("load balancer {} disappeared while being created", lb.id), None)),
        };
        tracing::debug!(lb = lb.id, took_ms = accepted.elapsed().as_millis() as u64, "created load balancer ACTIVE");
        // The ids of what the create built: one list; members and persistence are as asked.
        t.calls += 1;
        let listeners = self
            .octavia
            .list_listeners(&Filter::new().eq("loadbalancer_id", lb.id.as_str()))
            .await
            .map_err(|e| os_fail("listing listeners", &e, Some(&lb.id)))?;
        let mut tree = ObservedTree::default();
        for l in listeners.into_iter().filter(|l| l.loadbalancers.iter().any(|r| r.id == lb.id)) {
            let w = want.listeners.iter().find(|w| w.protocol == l.protocol && w.port == l.protocol_port);
            let pool = match (l.default_pool_id, w) {
                (Some(id), Some(w)) => Some(built_pool(id, w)),
                _ => None,
            };
            tree.listeners.push(ObservedListener { id: l.id, protocol: l.protocol, port: l.protocol_port, pool });
        }
        Ok(Known {
            uid: uid.to_string(),
            lb_id: lb.id.clone(),
            vip_address: lb.vip_address.clone().unwrap_or_else(|| want.vip_address.clone()),
            vip_port_id: lb.vip_port_id.clone(),
            generation: 0,
            tree,
            fip: None,
        })
    }

    /// Makes one change and waits for ACTIVE, updating `tree` to match.
    async fn apply(
        &self,
        lb_id: &str,
        want: &DesiredLb,
        step: Step,
        tree: &mut ObservedTree,
        t: &mut Tally,
    ) -> Result<(), Applied> {
        let kind = step.kind();
        let failed = |doing: &str, e: OsError| Applied::Failed(os_fail(doing, &e, Some(lb_id)));
        self.still_mine_for(want).map_err(|m| Applied::Failed(m.into()))?;
        t.calls += 1;
        t.changes += 1;
        // Members added and removed: Octavia's work, and so the poll schedule, grows with it.
        let mut size = 0;
        match step {
            Step::DeletePool { id } => {
                self.octavia.delete_pool(&id).await.map_err(|e| failed("deleting a pool", e))?;
                tree.stray_pools.retain(|p| *p != id);
                for l in &mut tree.listeners {
                    if l.pool.as_ref().is_some_and(|p| p.id == id) {
                        l.pool = None;
                    }
                }
            }
            Step::DeleteListener { id, name } => {
                self.octavia.delete_listener(&id).await.map_err(|e| failed(&format!("deleting listener {name}"), e))?;
                tree.listeners.retain(|l| l.id != id);
            }
            Step::CreateListener(w) => {
                // Octavia 19 fails (500) on a default pool inside a single listener create: the
                // listener first, then its pool (and members) as the next changes.
                let mut body = w.listener_create(&want.tags, Some(lb_id.to_string()));
                body.default_pool = None;
                let l = self
                    .octavia
                    .create_listener(&body)
                    .await
                    .map_err(|e| failed(&format!("creating listener {}", w.name), e))?;
                tree.listeners.push(ObservedListener {
                    id: l.id.clone(),
                    protocol: l.protocol,
                    port: l.protocol_port,
                    pool: None,
                });
                self.metrics.changed(kind);
                self.settle_change(lb_id, kind, 0, t).await?;
                let step = Step::CreatePool { listener_id: l.id, listener: w };
                return Box::pin(self.apply(lb_id, want, step, tree, t)).await;
            }
            Step::CreatePool { listener_id, listener: w } => {
                // Octavia 19 fails (500) on members inside a single pool create: the pool first,
                // then its members as a second change.
                let mut body = w.pool_create(&want.tags, Some(listener_id.clone()));
                body.members.clear();
                let p = self
                    .octavia
                    .create_pool(&body)
                    .await
                    .map_err(|e| failed(&format!("creating pool {}", w.name), e))?;
                let mut pool = built_pool(p.id.clone(), &w);
                pool.members.clear();
                if let Some(l) = tree.listeners.iter_mut().find(|l| l.id == listener_id) {
                    l.pool = Some(pool);
                }
                if !w.members.is_empty() {
                    self.metrics.changed(kind);
                    self.settle_change(lb_id, kind, 0, t).await?;
                    let step = Step::ReplaceMembers { pool_id: p.id, name: w.name.clone(), members: w.members.clone() };
                    return Box::pin(self.apply(lb_id, want, step, tree, t)).await;
                }
            }
            Step::UpdatePersistence { pool_id, persistence } => {
                self.update_persistence(&pool_id, persistence.as_ref())
                    .await
                    .map_err(|e| failed("updating a pool", e))?;
                if let Some(p) = tree.listeners.iter_mut().filter_map(|l| l.pool.as_mut()).find(|p| p.id == pool_id) {
                    p.persistence = persistence;
                }
            }
            Step::ReplaceMembers { pool_id, name, members } => {
                self.octavia
                    .replace_members(&pool_id, &members)
                    .await
                    .map_err(|e| failed(&format!("updating the members of {name}"), e))?;
                let new = ObservedPool::member_set(members.iter().map(|m| (m.address.as_str(), m.protocol_port)));
                match tree.listeners.iter_mut().filter_map(|l| l.pool.as_mut()).find(|p| p.id == pool_id) {
                    Some(p) => {
                        size = p.members.symmetric_difference(&new).count();
                        p.members = new;
                    }
                    None => size = new.len(),
                }
            }
        }
        self.metrics.changed(kind);
        self.settle_change(lb_id, kind, size, t).await
    }

    /// Waits for the load balancer to be ACTIVE after a change of `kind`.
    async fn settle_change(&self, lb_id: &str, kind: &'static str, size: usize, t: &mut Tally) -> Result<(), Applied> {
        match self.wait_settled(lb_id, kind, size, t).await.map_err(Applied::Failed)? {
            Some(lb) if lb.provisioning_status == ProvisioningStatus::Active => Ok(()),
            Some(_) => Err(Applied::LbError),
            None => {
                Err(Applied::Failed(fail("gone", format!("load balancer {lb_id} was deleted during a change"), None)))
            }
        }
    }

    async fn update_persistence(&self, pool_id: &str, p: Option<&SessionPersistence>) -> Result<(), OsError> {
        let body = serde_json::json!({"pool": {"session_persistence": p}});
        let req = ApiRequest::with_json(
            ServiceType::LoadBalancer,
            "pools.update",
            reqwest::Method::PUT,
            format!("/lbaas/pools/{pool_id}"),
            &body,
        )?
        .retry_on_conflict();
        self.client.send(req).await.map(drop)
    }

    /// Polls the load balancer until it leaves PENDING_*: `Some` as it then is (ACTIVE or
    /// ERROR), `None` when it is gone. `kind` labels the time-to-ACTIVE metric (empty: not ours);
    /// with `size` (members added and removed) it picks the learnt poll schedule.
    async fn wait_settled(
        &self,
        id: &str,
        kind: &'static str,
        size: usize,
        t: &mut Tally,
    ) -> Result<Option<LoadBalancer>, BackendError> {
        let started = Instant::now();
        let deadline = started + self.active_timeout;
        let mut schedule = self.pacer.schedule(kind, size);
        tokio::time::sleep(schedule.first().min(self.active_timeout)).await;
        let mut last_poll = started;
        let mut first_poll = true;
        loop {
            t.calls += 1;
            let polled = Instant::now();
            let lb = match self.octavia.get_load_balancer(id).await {
                Ok(lb) => lb,
                Err(OsError::NotFound(_)) => return Ok(None),
                Err(e) => {
                    t.waited += started.elapsed();
                    return Err(os_fail("waiting for the load balancer", &e, Some(id)));
                }
            };
            if !lb.provisioning_status.is_pending() {
                let took = started.elapsed();
                t.waited += took;
                if !kind.is_empty() {
                    self.metrics.settled(kind, took, polled.duration_since(last_poll));
                    if lb.provisioning_status == ProvisioningStatus::Active {
                        self.pacer.observe(kind, size, polled.duration_since(started), first_poll);
                    }
                }
                return Ok(Some(lb));
            }
            last_poll = polled;
            first_poll = false;
            let now = Instant::now();
            if now >= deadline {
                t.waited += started.elapsed();
                let status = format!("{:?}", lb.provisioning_status);
                return Err(fail(
                    "timeout",
                    format!("load balancer {id} still {status} after {:?}", self.active_timeout),
                    Some(Observed {
                        provisioning_status: screaming(&status),
                        backend_id: id.to_string(),
                        message: format!(
                            "waiting for Octavia: still {} after {:?}",
                            screaming(&status),
                            self.active_timeout
                        ),
                        ..Default::default()
                    }),
                ));
            }
            tokio::time::sleep(schedule.next_gap().min(deadline - now)).await;
        }
    }

    /// Deletes a load balancer with everything in it and waits until it is gone.
    async fn delete_lb(&self, id: &str, t: &mut Tally) -> Result<(), BackendError> {
        // Immutable while PENDING: wait that out first (the client would retry 409 only briefly).
        match self.wait_settled(id, "", 0, t).await? {
            None => return Ok(()),
            Some(lb) if lb.provisioning_status == ProvisioningStatus::Deleted => return Ok(()),
            Some(_) => {}
        }
        t.calls += 1;
        t.changes += 1;
        match self.octavia.delete_load_balancer(id, true).await {
            Ok(_) => {}
            Err(e) => return Err(os_fail("deleting the load balancer", &e, Some(id))),
        }
        self.metrics.changed("lb_delete");
        match self.wait_settled(id, "", 0, t).await? {
            None => Ok(()),
            Some(lb) if lb.provisioning_status == ProvisioningStatus::Deleted => Ok(()),
            Some(lb) => Err(fail(
                "error_state",
                format!("load balancer {id} is {:?} after a cascade delete", lb.provisioning_status),
                None,
            )),
        }
    }

    /// Removes every load balancer (and floating IP) of the Service `key`, whatever its uid.
    async fn delete_service(&self, key: &str, t: &mut Tally) -> Result<(), BackendError> {
        let filter = self.filter_tags(&[plan::cluster_tag(&self.shape.cluster), format!("{}{key}", plan::TAG_SERVICE)]);
        t.calls += 1;
        let found =
            self.octavia.list_load_balancers(&filter).await.map_err(|e| os_fail("listing load balancers", &e, None))?;
        for lb in found {
            self.delete_lb(&lb.id, t).await?;
            tracing::info!(service = key, lb = lb.id, "load balancer deleted (cascade)");
        }
        if self.floating_network_id.is_some() {
            crate::octavia_fip::delete(&self.neutron, &self.shape.cluster, key)
                .await
                .map_err(|e| os_fail("deleting the floating IP", &e, None))?;
        }
        if self.vip_port_precreate {
            crate::octavia_fip::delete_vip_ports(&self.neutron, &self.shape.cluster, key)
                .await
                .map_err(|e| os_fail("deleting the VIP port", &e, None))?;
        }
        Ok(())
    }

    /// The Service's ingress: a floating IP on the VIP port for type=LoadBalancer when a
    /// floating network is configured; none otherwise (and any left from before is removed).
    async fn ensure_ingress(
        &self,
        key: &str,
        spec: &LoadBalancerSpec,
        want: &DesiredLb,
        known: &mut Known,
        _t: &mut Tally,
    ) -> Result<(), BackendError> {
        let Some(network) = &self.floating_network_id else { return Ok(()) };
        if spec.service_type != "LoadBalancer" {
            if known.fip.take().is_some() || known.generation == 0 {
                crate::octavia_fip::delete(&self.neutron, &self.shape.cluster, key)
                    .await
                    .map_err(|e| os_fail("deleting the floating IP", &e, Some(&known.lb_id)))?;
            }
            return Ok(());
        }
        let port = known.vip_port_id.clone().filter(|p| !p.is_empty()).ok_or_else(|| {
            fail("no_vip_port", format!("load balancer {} has no VIP port for a floating IP", known.lb_id), None)
        })?;
        let fip = crate::octavia_fip::ensure(&self.neutron, network, &want.tags, &port, &known.vip_address)
            .await
            .map_err(|e| os_fail("giving the VIP a floating IP", &e, Some(&known.lb_id)))?;
        known.fip = Some((fip.id, fip.floating_ip_address));
        Ok(())
    }

    /// Garbage collection at start and when shards are gained, drift repair every interval,
    /// until shutdown.
    async fn maintenance(self: Arc<Self>, ctx: Maintenance) {
        let mut first = true;
        let mut next_repair = Instant::now() + self.drift_interval;
        loop {
            let mut repair = false;
            if !first {
                tokio::select! {
                    () = tokio::time::sleep_until(next_repair) => {
                        repair = true;
                        next_repair = Instant::now() + self.drift_interval;
                    }
                    () = ctx.kick.notified() => {}
                    () = ctx.shutdown.clone().wait() => return,
                }
            }
            first = false;
            tokio::select! {
                () = self.maintenance_pass(&ctx, repair) => {}
                () = ctx.shutdown.clone().wait() => return,
            }
        }
    }

    async fn maintenance_pass(&self, ctx: &Maintenance, repair: bool) {
        let mut t = Tally::default();
        let filter = self.filter_tags(&[plan::cluster_tag(&self.shape.cluster)]);
        t.calls += 1;
        let lbs = match self.octavia.list_load_balancers(&filter).await {
            Ok(l) => l,
            Err(e) => {
                self.metrics.maintenance_failed();
                tracing::warn!(
                    error = chain(&e),
                    "listing this cluster's load balancers failed; next pass in {:?}",
                    self.drift_interval
                );
                return;
            }
        };
        // Listed first, records read after: a load balancer is only created once its record is in.
        let wanted: HashMap<String, String> = locked(&ctx.records)
            .iter()
            .filter(|(_, r)| r.spec.backend == NAME)
            .map(|(k, r)| (k.clone(), r.spec.service_uid.clone()))
            .collect();
        for lb in &lbs {
            let owner = plan::owner(&lb.tags);
            // Only in served shards: a load balancer of another replica's shard is not an orphan
            // (one without an owner tag belongs to the shard of the empty key).
            if !(ctx.serves)(owner.as_ref().map_or("", |(key, _)| key.as_str())) {
                continue;
            }
            let orphan = owner.as_ref().is_none_or(|(key, uid)| wanted.get(key) != Some(uid));
            if orphan && lb.provisioning_status != ProvisioningStatus::PendingDelete {
                tracing::info!(lb = lb.id, name = lb.name, owner = ?owner, "deleting a load balancer whose Service is gone");
                if let Err(e) = self.delete_lb(&lb.id, &mut t).await {
                    self.metrics.maintenance_failed();
                    tracing::warn!(lb = lb.id, error = chain(&e), "deleting an orphaned load balancer failed");
                } else {
                    self.metrics.orphans_deleted.inc();
                }
            }
        }
        if repair {
            // Every Service is reconciled at its generation: each reads its tree back and
            // repairs what was changed or deleted behind lbaas' back.
            for key in wanted.keys() {
                (ctx.enqueue)(key);
            }
            self.metrics.drift_passes.inc();
        }
    }
}

/// The Service's shard is served by another replica now (its key).
#[derive(Debug)]
struct Moved(String);

impl From<Moved> for BackendError {
    fn from(m: Moved) -> Self {
        fail("moved", format!("the shard of Service {} is served by another replica now; it takes over", m.0), None)
    }
}

/// Why one change did not end ACTIVE.
enum Applied {
    /// The load balancer went to ERROR.
    LbError,
    /// The change or the wait failed.
    Failed(BackendError),
}

fn built_pool(id: String, w: &DesiredListener) -> ObservedPool {
    ObservedPool {
        id,
        persistence: w.persistence.clone(),
        members: ObservedPool::member_set(w.members.iter().map(|m| (m.address.as_str(), m.protocol_port))),
    }
}

fn canonical(addr: &str) -> String {
    addr.parse::<std::net::IpAddr>().map(|a| a.to_string()).unwrap_or_else(|_| addr.to_string())
}

/// `PendingUpdate` → `PENDING_UPDATE`.
fn screaming(debug: &str) -> String {
    let mut out = String::new();
    for (i, c) in debug.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        octavia: OctaviaArgs,
    }

    #[test]
    fn direct_mode_needs_a_project_and_a_vip_subnet() {
        let cli = Cli::try_parse_from(["x", "--octavia-url", "http://127.0.0.1:9876"]).unwrap();
        assert!(cli.octavia.cloud_config().unwrap_err().to_string().contains("--os-project-id"));
        assert!(cli.octavia.shape().unwrap_err().to_string().contains("--vip-subnet-id"));
        let cli = Cli::try_parse_from([
            "x",
            "--octavia-url",
            "http://127.0.0.1:9876",
            "--os-project-id",
            "p1",
            "--vip-subnet-id",
            "s1",
            "--drift-interval",
            "2s",
            "--cluster-name",
            "c1",
        ])
        .unwrap();
        let cloud = cli.octavia.cloud_config().unwrap();
        assert_eq!(cloud.auth, AuthConfig::NoAuth { project_id: Some("p1".into()) });
        assert_eq!(cloud.endpoint_overrides[&ServiceType::LoadBalancer].as_str(), "http://127.0.0.1:9876/");
        assert_eq!(cli.octavia.drift_interval, Duration::from_secs(2));
        assert_eq!(cli.octavia.shape().unwrap().cluster, "c1");
        let bad = Cli::try_parse_from(["x", "--octavia-url", "not a url", "--os-project-id", "p"]).unwrap();
        assert!(bad.octavia.cloud_config().unwrap_err().to_string().contains("--octavia-url"));
        let comma = Cli::try_parse_from(["x", "--vip-subnet-id", "s", "--cluster-name", "a,b"]).unwrap();
        assert!(comma.octavia.shape().unwrap_err().to_string().contains("comma"));
    }

    #[test]
    fn statuses_are_spelled_as_octavia_spells_them() {
        assert_eq!(screaming("PendingUpdate"), "PENDING_UPDATE");
        assert_eq!(screaming("Active"), "ACTIVE");
    }
}
