//! The Octavia backend: every Service load balancer is a real Octavia load balancer.
//!
//! **Shape** ([`crate::backend::octavia::plan`]): one load balancer per Service (VIP = the cluster IP),
//! a listener and a named pool per port, members = the ready endpoints, tags naming the cluster,
//! the Service and its uid.
//!
//! **Changes** are made one at a time per load balancer (the controller runs one reconcile per
//! Service at a time; within it each change waits for ACTIVE before the next): a new Service is
//! one fully-populated create; an endpoint change is one batch member update (`PUT
//! .../members`) per pool whose members changed; listeners and pools are added or removed as
//! ports come and go. Waiting for ACTIVE polls on a schedule learnt from the last settle times of
//! the same kind and size of change ([`crate::backend::octavia::poll`]), never a fixed sleep. A load
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
//! ([`crate::backend::octavia::fip`]) is the Service's ingress; without it, the VIP is.

mod apply;
mod cleanup;
mod converge;
pub mod fip;
pub mod metrics;
pub mod plan;
pub mod poll;

use self::apply::{Applied, built_pool};

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::core::lb::LoadBalancerSpec;
use kuryr_openstack::config::CloudFlags;
use kuryr_openstack::neutron::Neutron;
use kuryr_openstack::octavia::{LoadBalancer, Octavia, ProvisioningStatus, SessionPersistence};
use kuryr_openstack::{ApiRequest, Client, ClientOptions, CloudConfig, Error as OsError, Filter, ServiceType};
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tracing::Instrument as _;

use self::metrics::{OctaviaMetrics, Tally};
use self::plan::{DesiredLb, DesiredListener, ObservedListener, ObservedPool, ObservedTree, Shape, Step};
use self::poll::Pacer;
use crate::backend::{Backend, BackendError, Maintenance, Observed};
use crate::core::{chain, locked};
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
        let mut flags = CloudFlags { os_cloud: self.os_cloud.as_deref(), ..CloudFlags::default() };
        if let Some(octavia) = &self.octavia_url {
            anyhow::ensure!(
                self.project_id.as_deref().is_some_and(|p| !p.trim().is_empty()),
                "--os-project-id is required with --octavia-url"
            );
            flags.project_id = self.project_id.as_deref();
            flags.endpoints.push(("--octavia-url", octavia, ServiceType::LoadBalancer));
            if let Some(neutron) = &self.neutron_url {
                flags.endpoints.push(("--neutron-url", neutron, ServiceType::Network));
            }
        }
        Ok(flags.resolve()?)
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
}

/// The Service's shard is served by another replica now (its key).
#[derive(Debug)]
struct Moved(String);

impl From<Moved> for BackendError {
    fn from(m: Moved) -> Self {
        fail("moved", format!("the shard of Service {} is served by another replica now; it takes over", m.0), None)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::Parser;

    use kuryr_openstack::config::AuthConfig;

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
}
