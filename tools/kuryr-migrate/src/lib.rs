//! `kuryr-migrate`: hands a Kuryr-Kubernetes deployment over to kuryr-rs without recreating
//! its OpenStack resources. Run it with Kuryr's controller stopped and before kuryr-rs' allocator
//! and lbaas start (or while they run: both pick up what it records).
//!
//! - **Pods** (KuryrPort): the pod's Neutron port — same id, MAC, addresses, binding — becomes
//!   its kuryr-rs VIF: the port gets the allocator's cluster tag (the allocator's recovery then
//!   counts it as held by the pod, whose uid is its `device_id` already), a PodVif records it,
//!   the allocator's finalizer goes on the pod; then Kuryr's finalizers come off and the
//!   KuryrPort is deleted.
//! - **Pool ports**: Kuryr's free pool ports (`kuryr-pool-port`, no device) on the pod network
//!   get the cluster tag and so join the allocator's pools at its next start.
//! - **Services** (KuryrLoadBalancer): the Octavia load balancer gets lbaas' ownership tags (and,
//!   with `--floating-network-id`, so does the floating IP of a type=LoadBalancer Service);
//!   lbaas adopts a load balancer so tagged with its listeners, pools and members, changing
//!   only what differs from the Service. lbaas' finalizer goes on the Service, Kuryr's comes off,
//!   the KuryrLoadBalancer is deleted.
//! - **KuryrNetwork, KuryrNetworkPolicy**: listed, not migrated (see the operator guide).
//!
//! Each object is migrated by the state machine of [`plan`]: its steps are derived from what is
//! observed, so a run that was interrupted anywhere is finished by running again, and a run
//! with nothing left to do changes nothing. `--dry-run` prints the plan only.
//!
//! Crate placement: the tool reads and writes the records of two services (the allocator's
//! PodVifs and port tags, lbaas' load balancer tags), so it sits above both, in `tools/`, using
//! their published types and constants rather than teaching either service about Kuryr.

pub mod exec;
pub mod kuryr;
pub mod plan;

use std::path::PathBuf;

use kuryr_openstack::config::NeutronCloudArgs;
use kuryr_openstack::{CloudConfig, ServiceType};
use kuryr_vif_allocator::backend::neutron::config::PortArgs;

/// Writes one line of output (the plan, the report). A closed stdout or stderr is no reason to
/// stop a migration half-way, so a failed write is ignored.
pub fn report(out: &mut dyn std::io::Write, line: &str) {
    let _ = writeln!(out, "{line}");
}

/// The command line.
#[derive(Clone, Debug, clap::Parser)]
#[command(name = "kuryr-migrate", about = "Hands Kuryr-Kubernetes' ports and load balancers to kuryr-rs.")]
pub struct Args {
    /// Print the plan (every object and its remaining steps) and change nothing.
    #[arg(long)]
    pub dry_run: bool,

    /// The kubeconfig; else in-cluster, else $KUBECONFIG.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    #[command(flatten)]
    pub cloud: NeutronCloudArgs,

    /// Octavia's URL for a deployment without Keystone (with --neutron-url and --project-id).
    #[arg(long, env = "KURYR_OCTAVIA_URL")]
    pub octavia_url: Option<String>,

    /// The allocator's pod network (its --pod-network-id): ports elsewhere are not migrated.
    #[arg(long, env = "KURYR_POD_NETWORK_ID")]
    pub pod_network_id: String,

    /// The allocator's pod subnets (its --pod-subnet-ids), comma-separated; every subnet of the
    /// network when unset. VIFs are recorded exactly as the allocator would record them.
    #[arg(long, env = "KURYR_POD_SUBNET_IDS", value_delimiter = ',')]
    pub pod_subnet_ids: Vec<String>,

    /// The allocator's --cluster-id, --device-owner and --ovs-bridge.
    #[command(flatten)]
    pub ports: PortArgs,

    /// lbaas' --cluster-name (its load balancer tags).
    #[arg(long, env = "KURYR_CLUSTER_NAME", default_value = "kubernetes")]
    pub cluster_name: String,

    /// lbaas' --service-finalizer: which Services get lbaas' finalizer in place of Kuryr's
    /// (`load-balancer`: type LoadBalancer only; `all`; `none`). Load balancers of Services
    /// without it are still removed by lbaas should the Service go (orphans by tag).
    #[arg(long, env = "KURYR_SERVICE_FINALIZER", value_enum, default_value = "load-balancer")]
    pub service_finalizer: kuryr_lbaas::controller::FinalizerPolicy,

    /// lbaas' --floating-network-id: the floating IPs Kuryr gave type=LoadBalancer Services on
    /// this network get lbaas' tags, and lbaas keeps them as the Services' ingress. Unset, they
    /// are left in place, not adopted (lbaas without the flag would remove a tagged one).
    #[arg(long, env = "KURYR_FLOATING_NETWORK_ID")]
    pub floating_network_id: Option<String>,

    /// Leave Kuryr's free pool ports alone (they are tagged into the allocator's pools by
    /// default).
    #[arg(long)]
    pub skip_pool_ports: bool,

    /// Log filter (tracing's EnvFilter syntax).
    #[arg(long, env = "KURYR_LOG", default_value = "info")]
    pub log: String,
}

impl Args {
    /// The OpenStack cloud: direct endpoints with --neutron-url/--octavia-url, else clouds.yaml.
    pub fn cloud(&self) -> anyhow::Result<CloudConfig> {
        Ok(self.cloud.flags(&[("--octavia-url", &self.octavia_url, ServiceType::LoadBalancer)]).resolve()?)
    }
}
