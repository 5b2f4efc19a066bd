//! The Neutron security-group backend of kuryr-policy (`--backend neutron`): NetworkPolicy
//! enforced by Neutron on the pods' ports, as Kuryr did, with the fewest calls.
//!
//! **What it creates** (every object tagged `kuryr.openstack.org/cluster=<--cluster-id>` and
//! [`OWNER_TAG`], so that what is left over is found):
//! - one security group per NetworkPolicy, tagged `kuryr.openstack.org/networkpolicy=<ns>/<name>`,
//!   holding the policy's rules in each direction it isolates, with remote IP prefixes computed by
//!   the compiler (selected pods' addresses, `ipBlock` minus `except` as the fewest CIDRs),
//!   protocols and port ranges ([`rules`]). A direction with no rule is a default deny;
//! - two shared groups per cluster, `open-ingress` and `open-egress` (every address, both
//!   families), tagged `kuryr.openstack.org/open=ingress|egress`.
//!
//! **Where they go**: a pod selected by policies gets their groups on its Neutron port (the
//! port id of its PodVif's VIF record), plus the open group of each direction none of them
//! isolates — Neutron ORs a port's groups, which is NetworkPolicy's union; a pod no policy
//! selects gets back the groups recorded at allocation (the project's default or the
//! allocator's `--security-groups`). Released pool ports are reset by the allocator.
//!
//! **How**: the compiler's per-policy view becomes a [`Desired`] state ([`desired`]), handed
//! over a watch channel (a burst of changes coalesces); the reconciler ([`sync`]) converges
//! Neutron to the latest one by diffing desired against what it knows Neutron holds: rules
//! created with one bulk call per group, only changed rules deleted, a port updated only when
//! its groups change, groups of deleted policies deleted. Failures are retried with backoff
//! (re-reading Neutron first), logged and counted; a periodic resync re-reads every owned group
//! (drift) and removes groups no live policy owns (garbage).

pub mod metrics;
pub mod rules;
pub mod sync;
pub mod vifs;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kuryr_policy_core::{Compiler, PodKey, PolicyKey};

use self::rules::SgRule;

/// The tag on everything this backend creates, besides the cluster tag.
pub const OWNER_TAG: &str = "kuryr.openstack.org/owner=kuryr-policy";

/// The tag naming a group's NetworkPolicy.
pub fn policy_tag(p: &PolicyKey) -> String {
    format!("kuryr.openstack.org/networkpolicy={}/{}", p.namespace, p.name)
}

/// Flags of `--backend neutron`.
#[derive(Clone, Debug, clap::Args)]
pub struct NeutronArgs {
    #[command(flatten)]
    pub cloud: kuryr_openstack::config::NeutronCloudArgs,

    #[command(flatten)]
    pub cluster: kuryr_openstack::config::ClusterIdArgs,

    /// Deadline of one Neutron request.
    #[arg(long, env = "KURYR_NEUTRON_TIMEOUT", default_value = "30s", value_parser = kuryr_runtime::config::parse_duration)]
    pub neutron_timeout: Duration,

    /// How often every owned security group is read again from Neutron (rules changed behind
    /// kuryr-policy's back are put back) and groups of policies that no longer exist are deleted.
    #[arg(long, env = "KURYR_NEUTRON_RESYNC", default_value = "5m", value_parser = kuryr_runtime::config::parse_duration)]
    pub neutron_resync: Duration,

    /// Port updates in flight at once.
    #[arg(long, env = "KURYR_NEUTRON_PORT_CONCURRENCY", default_value_t = 8,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub neutron_port_concurrency: usize,
}

impl NeutronArgs {
    /// Checks the flags, naming the one at fault.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.cluster.validate()?;
        self.cloud.validate()?;
        anyhow::ensure!(self.neutron_resync >= Duration::from_secs(1), "--neutron-resync: at least 1s");
        Ok(())
    }

    /// The OpenStack client, recording into `metrics`.
    pub fn client(&self, metrics: std::sync::Arc<kuryr_openstack::Metrics>) -> anyhow::Result<kuryr_openstack::Client> {
        use kuryr_openstack::ClientOptions;
        let cloud = self.cloud.flags(&[]).resolve()?;
        let options = ClientOptions { timeout: self.neutron_timeout, ..ClientOptions::default() };
        Ok(kuryr_openstack::Client::new(&cloud, options, metrics)?)
    }
}

/// Starts the backend (the reconciler); returns where the publisher hands the desired state, and
/// the sink that takes the pods' ports from kuryr-policy's PodVif watch. With several replicas
/// only one writes to Neutron: the one holding shard 0 of `ownership` (every replica when
/// unsharded).
pub fn start(
    config: &crate::Config,
    rt: &mut kuryr_runtime::Runtime,
    ownership: tokio::sync::watch::Receiver<std::sync::Arc<kuryr_shard::Ownership>>,
) -> anyhow::Result<(Enforcer, vifs::PortSink)> {
    let args = &config.neutron;
    args.validate()?;
    let os_metrics = kuryr_openstack::Metrics::register(rt.registry());
    let client = args.client(os_metrics)?;
    let metrics = sync::NeutronMetrics::register(rt.registry());
    let (desired_tx, desired_rx) = tokio::sync::watch::channel(None);
    let (vifs_tx, vifs_rx) = tokio::sync::watch::channel(None);
    let (plain_tx, mut plain_rx) = tokio::sync::watch::channel(vifs::Vifs::default());
    let shutdown = rt.shutdown();
    // The reconciler starts on the first complete list of PodVifs.
    tokio::spawn(async move {
        while plain_rx.changed().await.is_ok() {
            let v = plain_rx.borrow_and_update().clone();
            vifs_tx.send_replace(Some(v));
        }
    });
    let generation = metrics.desired_generation.clone();
    let mut watched = desired_rx.clone();
    tokio::spawn(async move {
        while watched.changed().await.is_ok() {
            if let Some((g, _)) = &*watched.borrow_and_update() {
                generation.set(*g as i64);
            }
        }
    });
    let (neutron, tag) = (client.network(), args.cluster.tag());
    let (resync, concurrency) = (args.neutron_resync, args.neutron_port_concurrency);
    tracing::info!(cluster = tag, "Neutron security-group backend");
    let reconciler = move || {
        sync::Reconciler::new(
            neutron.clone(),
            tag.clone(),
            resync,
            concurrency,
            metrics.clone(),
            desired_rx.clone(),
            vifs_rx.clone(),
        )
    };
    tokio::spawn(lead(ownership, shutdown, reconciler));
    Ok((Enforcer(desired_tx), vifs::PortSink::new(plain_tx)))
}

/// Where the publisher hands the compiled state: the desired Neutron state is computed from it
/// ([`desired`]) and handed to the reconciler when it changed.
#[derive(Debug)]
pub struct Enforcer(tokio::sync::watch::Sender<sync::DesiredState>);

impl crate::core::Enforcer for Enforcer {
    fn compiled(&self, compiler: &Compiler) {
        let desired = desired(compiler);
        self.0.send_if_modified(|cur| match cur {
            Some((_, d)) if **d == desired => false,
            _ => {
                let generation = cur.as_ref().map_or(1, |(g, _)| g + 1);
                *cur = Some((generation, std::sync::Arc::new(desired)));
                true
            }
        });
    }
}

/// Whether this replica writes to Neutron under `o`.
fn leads(o: &kuryr_shard::Ownership) -> bool {
    !o.sharded() || o.owns_shard(0)
}

/// Runs a reconciler from `make` while this replica holds shard 0, so that two replicas never
/// converge Neutron against each other; a new holder starts by reading Neutron again.
async fn lead(
    mut ownership: tokio::sync::watch::Receiver<std::sync::Arc<kuryr_shard::Ownership>>,
    shutdown: kuryr_runtime::shutdown::Shutdown,
    make: impl Fn() -> sync::Reconciler,
) {
    loop {
        while !leads(&ownership.borrow_and_update()) {
            if ownership.changed().await.is_err() {
                return;
            }
        }
        tracing::info!("holding shard 0: this replica converges Neutron's security groups");
        let mut task = tokio::spawn(make().run(shutdown.clone()));
        loop {
            tokio::select! {
                _ = &mut task => return,
                changed = ownership.changed() => {
                    if changed.is_err() {
                        // The ownership can no longer change: keep converging until shutdown.
                        let _ = task.await;
                        return;
                    }
                    if !leads(&ownership.borrow_and_update()) {
                        break;
                    }
                }
            }
        }
        task.abort();
        tracing::info!("lost shard 0: another replica converges Neutron's security groups");
    }
}

/// How policies select one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodSelection {
    /// The selecting policies.
    pub policies: Vec<PolicyKey>,
    /// Whether one of them isolates ingress, egress.
    pub ingress: bool,
    pub egress: bool,
}

/// What Neutron must hold: each policy's rules, and how policies select each pod (pods no
/// policy selects are absent).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    pub policies: BTreeMap<PolicyKey, BTreeSet<SgRule>>,
    pub pods: BTreeMap<PodKey, PodSelection>,
}

/// The desired Neutron state of everything the compiler holds.
pub fn desired(compiler: &Compiler) -> Desired {
    let mut out = Desired::default();
    for key in compiler.policy_keys() {
        let Some(p) = compiler.policy_peers(&key) else { continue };
        for pod in &p.pods {
            let s = out.pods.entry(pod.clone()).or_default();
            s.policies.push(key.clone());
            s.ingress |= p.ingress.is_some();
            s.egress |= p.egress.is_some();
        }
        out.policies.insert(key, rules::desired_rules(p.ingress.as_ref(), p.egress.as_ref()));
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_policy_core::{LabelSelector, NetworkPolicy, Peer, Pod, PolicyType, Rule};

    use super::*;

    fn pod(name: &str, ip: &str, app: &str) -> Pod {
        Pod {
            namespace: "ns".into(),
            name: name.into(),
            labels: [("app".to_string(), app.to_string())].into(),
            node: "n1".into(),
            ips: vec![ip.parse().unwrap()],
            ..Default::default()
        }
    }

    fn selector(app: &str) -> LabelSelector {
        LabelSelector { match_labels: [("app".to_string(), app.to_string())].into(), match_expressions: vec![] }
    }

    #[test]
    fn only_the_holder_of_shard_0_writes_to_neutron() {
        use kuryr_shard::Ownership;
        assert!(leads(&Ownership::everything("a")), "unsharded: every replica");
        let mut o = Ownership::pending("a", 4);
        assert!(!leads(&o), "nothing held yet");
        o.owned = [1, 2].into();
        assert!(!leads(&o), "shard 0 is another replica's");
        o.owned.insert(0);
        assert!(leads(&o));
    }

    #[test]
    fn policies_become_groups_and_pods_their_selections() {
        let mut c = Compiler::new();
        c.upsert_pod(pod("a", "10.0.0.1", "web"));
        c.upsert_pod(pod("b", "10.0.0.2", "db"));
        // Default deny of ingress for everything in ns.
        c.upsert_policy(NetworkPolicy { namespace: "ns".into(), name: "deny".into(), ..Default::default() });
        // db may be reached from web, and may reach nothing.
        c.upsert_policy(NetworkPolicy {
            namespace: "ns".into(),
            name: "db".into(),
            pod_selector: selector("db"),
            policy_types: vec![PolicyType::Ingress, PolicyType::Egress],
            ingress: vec![Rule {
                peers: vec![Peer::Pods { namespace_selector: None, pod_selector: Some(selector("web")) }],
                ports: vec![],
            }],
            egress: vec![],
        });
        let d = desired(&c);
        let deny = PolicyKey { namespace: "ns".into(), name: "deny".into() };
        let db = PolicyKey { namespace: "ns".into(), name: "db".into() };
        assert!(d.policies[&deny].is_empty(), "default deny: a group without rules");
        assert_eq!(d.policies[&db].len(), 1);
        let a = &d.pods[&PodKey { namespace: "ns".into(), name: "a".into() }];
        assert_eq!((a.policies.clone(), a.ingress, a.egress), (vec![deny.clone()], true, false));
        let b = &d.pods[&PodKey { namespace: "ns".into(), name: "b".into() }];
        assert_eq!((b.policies.clone(), b.ingress, b.egress), (vec![db, deny], true, true));
    }
}
