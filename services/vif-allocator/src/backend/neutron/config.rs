//! The Neutron backend's flags, and the OpenStack client they describe.

use std::sync::Arc;
use std::time::Duration;

use kuryr_openstack::config::{ClusterIdArgs, NeutronCloudArgs};
use kuryr_openstack::{Client, ClientOptions};

use super::namespaces::config::NamespaceArgs;
use super::pool::Limits;

/// How the pods' ports are marked and plugged: flags of the allocator that kuryr-migrate takes
/// too, so that the ports it hands over look like the allocator's own.
#[derive(Clone, Debug, clap::Args)]
pub struct PortArgs {
    #[command(flatten)]
    pub cluster: ClusterIdArgs,

    /// `device_owner` of the pods' ports.
    #[arg(long, env = "KURYR_DEVICE_OWNER", default_value = "compute:kuryr")]
    pub device_owner: String,

    /// The Open vSwitch integration bridge on the nodes that binders plug ports into.
    #[arg(long, env = "KURYR_OVS_BRIDGE", default_value = "br-int")]
    pub ovs_bridge: String,
}

impl PortArgs {
    /// Checks the three flags, naming the one at fault.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.cluster.validate()?;
        anyhow::ensure!(!self.device_owner.is_empty(), "--device-owner: must not be empty");
        anyhow::ensure!(
            !self.ovs_bridge.is_empty() && self.ovs_bridge.len() <= 15,
            "--ovs-bridge {:?}: 1-15 characters",
            self.ovs_bridge
        );
        Ok(())
    }
}

/// Flags of `--backend neutron`.
#[derive(Clone, Debug, clap::Args)]
pub struct NeutronArgs {
    #[command(flatten)]
    pub cloud: NeutronCloudArgs,

    /// The Neutron network pods' ports are created on.
    #[arg(long, env = "KURYR_POD_NETWORK_ID")]
    pub pod_network_id: Option<String>,

    /// The pod subnets (at most one per IP family is usual: dual-stack), comma-separated; every
    /// subnet of the network when unset.
    #[arg(long, env = "KURYR_POD_SUBNET_IDS", value_delimiter = ',')]
    pub pod_subnet_ids: Vec<String>,

    /// Security groups of the pods' ports, comma-separated; the project's default group when
    /// unset.
    #[arg(long, env = "KURYR_SECURITY_GROUPS", value_delimiter = ',')]
    pub security_groups: Vec<String>,

    #[command(flatten)]
    pub ports: PortArgs,

    /// Refill a node's pool when its spare ports fall below this.
    #[arg(long, env = "KURYR_POOL_MIN", default_value_t = 5)]
    pub pool_min: u32,

    /// Ports created per refill (one bulk call); 0 turns pools off: a port is created for each
    /// pod and deleted on release.
    #[arg(long, env = "KURYR_POOL_BATCH", default_value_t = 10)]
    pub pool_batch: u32,

    /// Most spare ports kept per pool (released ports beyond it are deleted; PopulatePool stops
    /// there too); 0 lifts the cap, so that a node's pool may hold any number of ports.
    #[arg(long, env = "KURYR_POOL_MAX", default_value_t = 50)]
    pub pool_max: u32,

    /// Bulk port creations in flight at once, over all pools.
    #[arg(long, env = "KURYR_POOL_BULK_CONCURRENCY", default_value_t = 4,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub pool_bulk_concurrency: usize,

    /// Interval of the batched status reads while plugged ports wait for ACTIVE (one read covers
    /// every waiting port): how late, at most, a pod learns that its port is ACTIVE.
    #[arg(long, env = "KURYR_STATUS_POLL_MIN", default_value = "100ms", value_parser = kuryr_runtime::config::parse_duration)]
    pub status_poll_min: Duration,

    /// Longest wait between two batched status reads (the backoff's cap).
    #[arg(long, env = "KURYR_STATUS_POLL_MAX", default_value = "2s", value_parser = kuryr_runtime::config::parse_duration)]
    pub status_poll_max: Duration,

    /// Deadline of one Neutron request.
    #[arg(long, env = "KURYR_NEUTRON_TIMEOUT", default_value = "30s", value_parser = kuryr_runtime::config::parse_duration)]
    pub neutron_timeout: Duration,

    #[command(flatten)]
    pub namespaces: NamespaceArgs,

    #[command(flatten)]
    pub events: super::events::config::EventArgs,

    #[command(flatten)]
    pub nested: super::trunk::NestedArgs,
}

impl NeutronArgs {
    /// The pool limits.
    pub fn limits(&self) -> Limits {
        Limits { min: self.pool_min, batch: self.pool_batch, max: self.pool_max }
    }

    /// Checks what can be checked before anything is contacted, naming the flag at fault.
    pub fn validate(&self) -> anyhow::Result<()> {
        let network = self.pod_network_id.as_deref().unwrap_or_default();
        self.namespaces.validate(!network.trim().is_empty() || !self.pod_subnet_ids.is_empty())?;
        anyhow::ensure!(
            self.namespaces.neutron_namespace_subnets || !network.trim().is_empty(),
            "--pod-network-id is required with --backend neutron (or --neutron-namespace-subnets)"
        );
        for (flag, values) in [("--pod-subnet-ids", &self.pod_subnet_ids), ("--security-groups", &self.security_groups)]
        {
            anyhow::ensure!(values.iter().all(|v| !v.trim().is_empty()), "{flag}: empty id in the list");
        }
        self.ports.validate()?;
        anyhow::ensure!(
            !(self.nested.nested_trunks && self.namespaces.neutron_namespace_subnets),
            "--nested-trunks and --neutron-namespace-subnets cannot be combined (subports are on the pod network)"
        );
        anyhow::ensure!(
            self.pool_max == 0 || self.pool_max >= self.pool_min,
            "--pool-max {} is below --pool-min {}",
            self.pool_max,
            self.pool_min
        );
        anyhow::ensure!(
            self.status_poll_min > Duration::ZERO && self.status_poll_min <= self.status_poll_max,
            "--status-poll-min must be positive and at most --status-poll-max"
        );
        if let Some(tls) = self.events.resolve()?.and_then(|c| c.tls) {
            // Certificates and keys are read now: a bad one fails the start, not every connection.
            super::events::tls_connector(&tls)?;
        }
        self.cloud.validate()?;
        Ok(())
    }

    /// The OpenStack client, recording into `metrics`.
    pub fn client(&self, metrics: Arc<kuryr_openstack::Metrics>) -> anyhow::Result<Client> {
        let cloud = self.cloud.flags(&[]).resolve()?;
        let options = ClientOptions { timeout: self.neutron_timeout, ..ClientOptions::default() };
        Ok(Client::new(&cloud, options, metrics)?)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::PortArgs;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        ports: PortArgs,
    }

    fn parse(args: &[&str]) -> PortArgs {
        match Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())) {
            Ok(cli) => cli.ports,
            Err(e) => panic!("{args:?}: {e}"),
        }
    }

    #[test]
    fn the_defaults_are_valid_and_tag_the_cluster() {
        let ports = parse(&[]);
        assert!(ports.validate().is_ok());
        assert_eq!(ports.cluster.tag(), "kuryr.openstack.org/cluster=kubernetes");
        assert_eq!((ports.device_owner.as_str(), ports.ovs_bridge.as_str()), ("compute:kuryr", "br-int"));
    }

    #[test]
    fn each_bad_flag_is_named() {
        for (args, flag) in [
            (&["--cluster-id", "a,b"][..], "--cluster-id"),
            (&["--device-owner", ""][..], "--device-owner"),
            (&["--ovs-bridge", "a-bridge-name-too-long"][..], "--ovs-bridge"),
        ] {
            let e = parse(args).validate().err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.starts_with(flag), "{args:?}: {e:?}");
        }
    }
}
