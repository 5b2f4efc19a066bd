//! The NetworkPolicy part of the Neutron chaos run: kuryr-policy `--backend neutron` reaching
//! Neutron through the same fault proxy as the allocators, enforcing a NetworkPolicy on the churned
//! pods with security groups. The pods alternate between `app=a` and `app=b`; one policy isolates
//! the ingress of `app=a` (a default deny: a security group with no ingress rule), and at every
//! other fault it is deleted and another created under a new name. kuryr-policy is killed
//! (kill -9, started again) and stopped among the other process faults.
//!
//! Read from Neutron directly: a security group of kuryr-policy's (tagged for the cluster and as
//! kuryr-policy's) whose NetworkPolicy does not exist is a leak, two for one policy a duplicate
//! (during the run once they last over the grace period); at the end, every live `app=a` pod's
//! port holds the current policy's group and no `app=b` pod's port holds a policy group
//! (otherwise the policy is not what the pod gets: counted as unreachable).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_openstack::Filter;
use kuryr_openstack::neutron::Port;
use serde_json::json;

use super::invariants::Kind;
use crate::neutron::{NeutronCluster, Svc, spawn};

/// The tag on every group kuryr-policy creates, besides the cluster's.
const OWNER_TAG: &str = "kuryr.openstack.org/owner=kuryr-policy";
/// The tag naming a group's NetworkPolicy.
const POLICY_TAG: &str = "kuryr.openstack.org/networkpolicy=";

/// The label value of the pod named `p<i>`: `a` for even `i`, `b` for odd.
pub fn app_of(pod_name: &str) -> &'static str {
    let i: usize = pod_name.trim_start_matches('p').parse().unwrap_or(0);
    if i.is_multiple_of(2) { "a" } else { "b" }
}

/// kuryr-policy under chaos.
#[derive(Debug)]
pub struct PolicyChaos {
    /// The running kuryr-policy.
    pub svc: Svc,
    args: Vec<String>,
    namespace: String,
    cluster_tag: String,
    /// The NetworkPolicy of the run now.
    current: String,
    /// Policies deleted during the run.
    deleted: BTreeSet<String>,
    next: usize,
}

impl PolicyChaos {
    /// Starts kuryr-policy `--backend neutron` with `clouds` (whose `kuryr` cloud goes through the
    /// proxy) and `--cluster-id cluster_id`, and creates the first policy in `namespace`.
    pub async fn start(
        c: &NeutronCluster,
        watcher: &Svc,
        clouds: &Path,
        cluster_id: &str,
        namespace: &str,
    ) -> Result<Self> {
        let extra: Vec<String> =
            ["--cluster-id", cluster_id, "--instance", "policy-chaos"].iter().map(ToString::to_string).collect();
        let mut args = c.policy_args(watcher, &extra).await?;
        let at = args.iter().position(|a| a == "--clouds-yaml").context("no --clouds-yaml among the flags")?;
        args[at + 1] = clouds.display().to_string();
        let svc = spawn("kuryr-policy", args.clone(), c.dir.path())?;
        svc.wait_ready(Duration::from_secs(120)).await.context("kuryr-policy ready")?;
        let mut p = Self {
            svc,
            args,
            namespace: namespace.to_string(),
            cluster_tag: format!("kuryr.openstack.org/cluster={cluster_id}"),
            current: String::new(),
            deleted: BTreeSet::new(),
            next: 0,
        };
        p.current = p.create(&c.admin).await?;
        Ok(p)
    }

    /// kill -9, then started again with the same flags.
    pub async fn kill(&mut self, c: &NeutronCluster) -> Result<()> {
        self.svc.proc.kill().await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        self.svc = spawn("kuryr-policy", self.args.clone(), c.dir.path())?;
        Ok(())
    }

    fn api(&self, admin: &kube::Client) -> Api<NetworkPolicy> {
        Api::namespaced(admin.clone(), &self.namespace)
    }

    async fn create(&mut self, admin: &kube::Client) -> Result<String> {
        let name = format!("np{}", self.next);
        self.next += 1;
        let np: NetworkPolicy = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Ingress"]},
        }))?;
        self.api(admin).create(&PostParams::default(), &np).await.with_context(|| format!("creating {name}"))?;
        Ok(name)
    }

    /// Deletes the policy and creates another; says which.
    pub async fn rotate(&mut self, admin: &kube::Client) -> Result<String> {
        let old = self.current.clone();
        self.api(admin).delete(&old, &DeleteParams::default()).await.with_context(|| format!("deleting {old}"))?;
        self.deleted.insert(old.clone());
        self.current = self.create(admin).await?;
        Ok(format!("{old} → {}", self.current))
    }

    /// kuryr-policy's groups by the `<namespace>/<name>` of their policy (the shared open groups
    /// are left out).
    async fn groups(&self, c: &NeutronCluster) -> Result<BTreeMap<String, Vec<String>>> {
        let tags = [self.cluster_tag.clone(), OWNER_TAG.to_string()];
        let groups = c.neutron.list_security_groups(&Filter::new().tags(&tags)).await.context("listing groups")?;
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for g in groups {
            if let Some(policy) = g.tags.iter().find_map(|t| t.strip_prefix(POLICY_TAG)) {
                out.entry(policy.to_string()).or_default().push(g.id);
            }
        }
        Ok(out)
    }

    /// Leaks and duplicates now, keyed for [`super::invariants::Lasting`].
    pub async fn problems(&self, c: &NeutronCluster) -> Result<Vec<(String, Kind, String)>> {
        let existing: BTreeSet<String> = Api::<NetworkPolicy>::all(c.admin.clone())
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .map(|p| format!("{}/{}", p.metadata.namespace.unwrap_or_default(), p.metadata.name.unwrap_or_default()))
            .collect();
        let mut out = Vec::new();
        for (policy, ids) in self.groups(c).await? {
            if !existing.contains(&policy) {
                let line = format!("security groups {ids:?} of NetworkPolicy {policy}, which does not exist");
                out.push((format!("sg-leak {policy}"), Kind::Leak, line));
            } else if ids.len() > 1 {
                out.push((
                    format!("sg-dup {policy}"),
                    Kind::Duplicate,
                    format!("{policy} has security groups {ids:?}"),
                ));
            }
        }
        Ok(out)
    }

    /// Everything [`Self::problems`] finds, and each live pod's port against the policy: `ports`
    /// are the live pods' ports by pod name.
    pub async fn final_problems(&self, c: &NeutronCluster, ports: &[(String, &Port)]) -> Result<Vec<(Kind, String)>> {
        let mut out: Vec<(Kind, String)> = self.problems(c).await?.into_iter().map(|(_, k, l)| (k, l)).collect();
        let groups = self.groups(c).await?;
        let current = format!("{}/{}", self.namespace, self.current);
        let Some([group]) = groups.get(&current).map(Vec::as_slice) else {
            out.push((
                Kind::Unreachable,
                format!("NetworkPolicy {current} has security groups {:?}", groups.get(&current)),
            ));
            return Ok(out);
        };
        let policy_groups: BTreeSet<&String> = groups.values().flatten().collect();
        for (pod, port) in ports {
            let held: Vec<&String> = port.security_groups.iter().filter(|g| policy_groups.contains(g)).collect();
            let ok = match app_of(pod) {
                "a" => held == [group],
                _ => held.is_empty(),
            };
            if !ok {
                let line = format!(
                    "{pod} (app={}): port {} holds policy groups {held:?}, want the policy's {group} only for app=a",
                    app_of(pod),
                    port.id
                );
                out.push((Kind::Unreachable, line));
            }
        }
        for name in &self.deleted {
            if self.api(&c.admin).get_opt(name).await?.is_some() {
                out.push((Kind::Leak, format!("NetworkPolicy {}/{name} deleted but still there", self.namespace)));
            }
        }
        Ok(out)
    }
}
