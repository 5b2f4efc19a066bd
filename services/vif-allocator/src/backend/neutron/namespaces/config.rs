//! The flags of per-namespace networks.

/// Flags of `--neutron-namespace-subnets`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct NamespaceArgs {
    /// A Neutron network per namespace instead of one pod network: for each namespace with pods,
    /// a network, a subnet from `--neutron-subnet-pool` (and one from `--neutron-subnet-pool-v6`)
    /// and an interface on `--neutron-router`, tagged for the cluster and the namespace, recorded
    /// in a NamespaceNetwork and removed once the namespace is deleted (a finalizer on the
    /// namespace waits for that). Replaces --pod-network-id and --pod-subnet-ids.
    #[arg(long, env = "KURYR_NEUTRON_NAMESPACE_SUBNETS")]
    pub neutron_namespace_subnets: bool,

    /// The IPv4 subnet pool namespace subnets are allocated from (its default prefix length is
    /// the size of a namespace's subnet).
    #[arg(long, env = "KURYR_NEUTRON_SUBNET_POOL")]
    pub neutron_subnet_pool: Option<String>,

    /// An IPv6 subnet pool: each namespace also gets an IPv6 subnet from it (dual-stack pods).
    #[arg(long, env = "KURYR_NEUTRON_SUBNET_POOL_V6")]
    pub neutron_subnet_pool_v6: Option<String>,

    /// The router every namespace subnet is attached to (its gateway), so that pods of different
    /// namespaces reach each other and, through the router's gateway, the outside.
    #[arg(long, env = "KURYR_NEUTRON_ROUTER")]
    pub neutron_router: Option<String>,
}

impl NamespaceArgs {
    /// Checks the flags, naming the one at fault. `pod_network` tells whether --pod-network-id
    /// or --pod-subnet-ids was given.
    pub fn validate(&self, pod_network: bool) -> anyhow::Result<()> {
        let given = |v: &Option<String>| v.as_deref().is_some_and(|s| !s.trim().is_empty());
        if !self.neutron_namespace_subnets {
            anyhow::ensure!(
                !given(&self.neutron_subnet_pool)
                    && !given(&self.neutron_subnet_pool_v6)
                    && !given(&self.neutron_router),
                "--neutron-subnet-pool, --neutron-subnet-pool-v6 and --neutron-router need --neutron-namespace-subnets"
            );
            return Ok(());
        }
        anyhow::ensure!(
            !pod_network,
            "--pod-network-id and --pod-subnet-ids do not go with --neutron-namespace-subnets (each namespace gets \
             its own network)"
        );
        anyhow::ensure!(
            given(&self.neutron_subnet_pool),
            "--neutron-subnet-pool is required with --neutron-namespace-subnets"
        );
        anyhow::ensure!(given(&self.neutron_router), "--neutron-router is required with --neutron-namespace-subnets");
        if self.neutron_subnet_pool_v6.is_some() {
            anyhow::ensure!(given(&self.neutron_subnet_pool_v6), "--neutron-subnet-pool-v6: empty id");
        }
        Ok(())
    }

    /// The subnet pools: (flag, pool id, IP version).
    pub fn pools(&self) -> Vec<(&'static str, String, u8)> {
        let mut out = Vec::new();
        if let Some(p) = self.neutron_subnet_pool.as_deref().filter(|p| !p.trim().is_empty()) {
            out.push(("--neutron-subnet-pool", p.trim().to_string(), 4));
        }
        if let Some(p) = self.neutron_subnet_pool_v6.as_deref().filter(|p| !p.trim().is_empty()) {
            out.push(("--neutron-subnet-pool-v6", p.trim().to_string(), 6));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(on: bool, v4: Option<&str>, v6: Option<&str>, router: Option<&str>) -> NamespaceArgs {
        NamespaceArgs {
            neutron_namespace_subnets: on,
            neutron_subnet_pool: v4.map(Into::into),
            neutron_subnet_pool_v6: v6.map(Into::into),
            neutron_router: router.map(Into::into),
        }
    }

    fn err(a: &NamespaceArgs, pod_network: bool) -> String {
        a.validate(pod_network).err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn flags_are_checked_together() {
        assert!(args(false, None, None, None).validate(true).is_ok());
        assert!(err(&args(false, Some("p"), None, None), true).contains("need --neutron-namespace-subnets"));
        assert!(err(&args(true, Some("p"), None, Some("r")), true).contains("--pod-network-id"));
        assert!(err(&args(true, None, None, Some("r")), false).contains("--neutron-subnet-pool is required"));
        assert!(err(&args(true, Some("p"), None, None), false).contains("--neutron-router is required"));
        assert!(err(&args(true, Some("p"), Some(" "), Some("r")), false).contains("--neutron-subnet-pool-v6"));
        let ok = args(true, Some("p4"), Some("p6"), Some("r"));
        assert!(ok.validate(false).is_ok());
        let pools: Vec<(String, u8)> = ok.pools().into_iter().map(|(_, p, v)| (p, v)).collect();
        assert_eq!(pools, [("p4".to_string(), 4), ("p6".to_string(), 6)]);
    }
}
