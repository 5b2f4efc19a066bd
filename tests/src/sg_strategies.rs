//! Two ways to express one NetworkPolicy in Neutron security groups, driven directly against the
//! real Neutron + ML2/OVS agent (`openvswitch` firewall driver) on the same plugged pods, for
//! `make bench-netpol-neutron`:
//!
//! - [`Strategy::Prefix`] (what kuryr-policy does): a group per policy with two rules (IPv4 /32,
//!   IPv6 /128) per peer address; a peer joining is one bulk rule creation, a peer leaving is the
//!   deletion of its two rules (Neutron has no bulk delete).
//! - [`Strategy::RemoteGroup`]: a group per policy whose two rules (IPv4, IPv6) name a selector
//!   group (`remote_group_id`) that the peers' ports are members of; a peer joining or leaving is
//!   one update of its port.
//!
//! The targets' ports carry a group without ingress rules (denied unless a policy group admits)
//! and, while the policy exists, the policy's group; the peers' ports carry an open-egress group.
//! For each change (policy created with N peers, one peer joins, one leaves, policy deleted) the
//! Neutron calls are counted by construction (every call this module makes), the API time is
//! from the first call to the last answer, and the enforcement time is observed on the datapath:
//! fresh one-packet IPv4 pings (a new ICMP id each, so a new connection for conntrack) launched
//! every [`PROBE_EVERY`] from a peer's namespace to the first target, the time being the launch
//! of the first probe that sees the new verdict (answered, or unanswered within
//! [`PROBE_WAIT`]).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::{StreamExt, TryStreamExt};
use kuryr_openstack::neutron::{Neutron, PortUpdate, SecurityGroupCreate, SecurityGroupRuleCreate};
use tokio::task::JoinSet;

use crate::neutron::PluggedPod;
use crate::services::wait_until;

/// How often a probe is launched while waiting for a verdict to change.
pub const PROBE_EVERY: Duration = Duration::from_millis(25);
/// How long a probe waits for its answer before it counts as blocked.
pub const PROBE_WAIT: Duration = Duration::from_millis(1000);
/// Port updates in flight at once (as kuryr-policy's backend does).
const PORTS_IN_FLIGHT: usize = 8;

/// How a policy's peers are expressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Rules with the peers' addresses as remote IP prefixes.
    Prefix,
    /// Rules naming a selector group the peers' ports are members of.
    RemoteGroup,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Prefix => "remote prefixes",
            Strategy::RemoteGroup => "remote group",
        }
    }
}

/// The change kinds measured, in order.
pub const KINDS: [&str; 4] = ["policy created", "a peer joins", "a peer leaves", "policy deleted"];

/// One measured change.
#[derive(Clone, Copy, Debug)]
pub struct Change {
    /// Neutron calls made (counted by construction).
    pub calls: usize,
    /// From the first call to the last answer.
    pub api: Duration,
    /// From the first call to the first probe launched that saw the new verdict.
    pub enforced: Duration,
}

/// The pods and the fixed groups of the measurement.
#[derive(Debug)]
pub struct Bench<'a> {
    pub neutron: &'a Neutron,
    pub project: String,
    /// The targets: the policy selects them (the first one is probed).
    pub targets: &'a [PluggedPod],
    /// The peers: a policy over `n` peers uses the first `n`, and peer `n` joins and leaves.
    pub peers: &'a [PluggedPod],
    /// No ingress rule (Neutron's default egress rules): the targets' base group.
    deny: String,
    /// The same, for the peers (open egress, nothing in unless a reply).
    egress: String,
}

/// What a live policy left in Neutron, for the next changes.
struct Live {
    group: String,
    selector: Option<String>,
    joined_rules: Vec<String>,
}

impl<'a> Bench<'a> {
    /// Creates the base groups and puts the targets' and peers' ports in them, then waits until
    /// the first peer is blocked from the first target.
    pub async fn new(
        neutron: &'a Neutron,
        project: &str,
        targets: &'a [PluggedPod],
        peers: &'a [PluggedPod],
        timeout: Duration,
    ) -> Result<Self> {
        let group = |name: &str| SecurityGroupCreate {
            name: name.into(),
            project_id: Some(project.into()),
            ..Default::default()
        };
        let deny = neutron.create_security_group(group("sgbench-targets")).await?.id;
        let egress = neutron.create_security_group(group("sgbench-peers")).await?.id;
        let b = Self { neutron, project: project.into(), targets, peers, deny, egress };
        b.set_groups(b.targets.iter(), &[&b.deny]).await?;
        b.set_groups(b.peers.iter(), &[&b.egress]).await?;
        let target = b.target()?;
        wait_until("the first peer to be blocked from the first target", timeout, || async {
            let (from, to) = (b.peers.first().context("no peers")?.clone(), target.clone());
            let r = tokio::task::spawn_blocking(move || from.ping_within(&to, PROBE_WAIT)).await?;
            anyhow::ensure!(r.is_err(), "still answered");
            Ok(())
        })
        .await?;
        Ok(b)
    }

    fn target(&self) -> Result<String> {
        Ok(self.targets.first().context("no targets")?.v4.clone())
    }

    /// Sets the security groups of each pod's port (in flight [`PORTS_IN_FLIGHT`] at once); one
    /// call per port.
    async fn set_groups<'p>(&self, pods: impl Iterator<Item = &'p PluggedPod>, groups: &[&str]) -> Result<usize> {
        let update = PortUpdate {
            security_groups: Some(groups.iter().map(|g| (*g).to_string()).collect()),
            ..Default::default()
        };
        let ports: Vec<String> = pods.map(|p| p.port.clone()).collect();
        let n = ports.len();
        futures::stream::iter(ports)
            .map(|port| {
                let update = &update;
                async move { self.neutron.update_port(&port, update, None).await.with_context(|| format!("port {port}")) }
            })
            .buffer_unordered(PORTS_IN_FLIGHT)
            .try_collect::<Vec<_>>()
            .await?;
        Ok(n)
    }

    fn prefix_rules(&self, group: &str, peers: &[PluggedPod]) -> Vec<SecurityGroupRuleCreate> {
        peers
            .iter()
            .flat_map(|p| [(format!("{}/32", p.v4), "IPv4"), (format!("{}/128", p.v6), "IPv6")])
            .map(|(prefix, eth)| SecurityGroupRuleCreate {
                security_group_id: group.into(),
                direction: "ingress".into(),
                ethertype: eth.into(),
                remote_ip_prefix: Some(prefix),
                project_id: Some(self.project.clone()),
                ..Default::default()
            })
            .collect()
    }

    fn group_rules(&self, group: &str, selector: &str) -> Vec<SecurityGroupRuleCreate> {
        ["IPv4", "IPv6"]
            .into_iter()
            .map(|eth| SecurityGroupRuleCreate {
                security_group_id: group.into(),
                direction: "ingress".into(),
                ethertype: eth.into(),
                remote_group_id: Some(selector.into()),
                project_id: Some(self.project.clone()),
                ..Default::default()
            })
            .collect()
    }

    async fn create_group(&self, name: &str) -> Result<String> {
        let g = SecurityGroupCreate { name: name.into(), project_id: Some(self.project.clone()), ..Default::default() };
        Ok(self.neutron.create_security_group(g).await?.id)
    }

    /// One round over `n` peers: the four changes of [`KINDS`], in order, for `s`.
    pub async fn round(&self, s: Strategy, n: usize, tag: &str, timeout: Duration) -> Result<[Change; 4]> {
        anyhow::ensure!(self.peers.len() > n, "{n} peers and one joining need {} peer pods", n + 1);
        let (first, last, joiner) = (&self.peers[0], &self.peers[n - 1], &self.peers[n]);
        let target = self.target()?;

        // Created: the probes of the first and the last peer run alongside the calls.
        let t0 = Instant::now();
        let probes = (probe(first, &target, true, t0, timeout), probe(last, &target, true, t0, timeout));
        let calls = async {
            let mut calls = 0;
            let (group, selector) = match s {
                Strategy::Prefix => {
                    let group = self.create_group(&format!("sgbench-{tag}")).await?;
                    self.neutron.create_security_group_rules(self.prefix_rules(&group, &self.peers[..n])).await?;
                    calls += 2;
                    (group, None)
                }
                Strategy::RemoteGroup => {
                    let selector = self.create_group(&format!("sgbench-{tag}-peers")).await?;
                    calls += 1 + self.set_groups(self.peers[..n].iter(), &[&self.egress, &selector]).await?;
                    let group = self.create_group(&format!("sgbench-{tag}")).await?;
                    self.neutron.create_security_group_rules(self.group_rules(&group, &selector)).await?;
                    calls += 2;
                    (group, Some(selector))
                }
            };
            calls += self.set_groups(self.targets.iter(), &[&self.deny, &group]).await?;
            anyhow::Ok((calls, t0.elapsed(), Live { group, selector, joined_rules: Vec::new() }))
        };
        let ((calls, api, mut live), (a, b)) = tokio::try_join!(calls, async { tokio::try_join!(probes.0, probes.1) })?;
        let created = Change { calls, api, enforced: a.max(b) };

        // A peer joins.
        let t0 = Instant::now();
        let calls = async {
            match s {
                Strategy::Prefix => {
                    let rules = self
                        .neutron
                        .create_security_group_rules(self.prefix_rules(&live.group, std::slice::from_ref(joiner)))
                        .await?;
                    live.joined_rules = rules.into_iter().map(|r| r.id).collect();
                }
                Strategy::RemoteGroup => {
                    let selector = live.selector.as_deref().context("no selector group")?;
                    self.set_groups(std::iter::once(joiner), &[&self.egress, selector]).await?;
                }
            }
            anyhow::Ok((1, t0.elapsed()))
        };
        let ((calls, api), enforced) = tokio::try_join!(calls, probe(joiner, &target, true, t0, timeout))?;
        let joined = Change { calls, api, enforced };

        // The peer leaves.
        let t0 = Instant::now();
        let calls = async {
            let mut calls = 0;
            match s {
                Strategy::Prefix => {
                    for r in std::mem::take(&mut live.joined_rules) {
                        self.neutron.delete_security_group_rule(&r).await?;
                        calls += 1;
                    }
                }
                Strategy::RemoteGroup => calls += self.set_groups(std::iter::once(joiner), &[&self.egress]).await?,
            }
            anyhow::Ok((calls, t0.elapsed()))
        };
        let ((calls, api), enforced) = tokio::try_join!(calls, probe(joiner, &target, false, t0, timeout))?;
        let left = Change { calls, api, enforced };

        // Deleted: the targets leave the group, then it goes (and a selector group with it).
        let t0 = Instant::now();
        let calls = async {
            let mut calls = self.set_groups(self.targets.iter(), &[&self.deny]).await?;
            self.neutron.delete_security_group(&live.group).await?;
            calls += 1;
            if let Some(selector) = &live.selector {
                calls += self.set_groups(self.peers[..n].iter(), &[&self.egress]).await?;
                self.neutron.delete_security_group(selector).await?;
                calls += 1;
            }
            anyhow::Ok((calls, t0.elapsed()))
        };
        let ((calls, api), enforced) = tokio::try_join!(calls, probe(first, &target, false, t0, timeout))?;
        let deleted = Change { calls, api, enforced };
        Ok([created, joined, left, deleted])
    }
}

/// Launches a probe from `from` to `to` every [`PROBE_EVERY`] until one sees `allowed` (answered)
/// or not (unanswered within [`PROBE_WAIT`]); returns the launch of the earliest such probe,
/// from `t0`.
pub async fn probe(from: &PluggedPod, to: &str, allowed: bool, t0: Instant, timeout: Duration) -> Result<Duration> {
    let mut probes = JoinSet::new();
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen: Option<Duration> = None;
    loop {
        tokio::select! {
            _ = tick.tick(), if seen.is_none() => {
                anyhow::ensure!(
                    t0.elapsed() < timeout,
                    "{} → {to}: still {} after {timeout:?}",
                    from.name,
                    if allowed { "blocked" } else { "answered" }
                );
                let (from, to, launched) = (from.clone(), to.to_string(), t0.elapsed());
                probes.spawn_blocking(move || (launched, from.ping_within(&to, PROBE_WAIT).is_ok()));
            }
            Some(done) = probes.join_next() => {
                let (launched, answered) = done?;
                if answered == allowed {
                    seen = Some(seen.map_or(launched, |s| s.min(launched)));
                }
                // Once a verdict is seen, earlier launches still running may beat it.
                if let Some(s) = seen && probes.is_empty() {
                    return Ok(s);
                }
            }
        }
    }
}
