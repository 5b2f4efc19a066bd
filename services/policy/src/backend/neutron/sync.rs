//! The reconciler: converges Neutron to the latest [`Desired`] state with the fewest calls.
//!
//! It keeps what it knows Neutron holds (owned groups with their rules, the pods' ports' groups)
//! and, per pass, sends only the differences: a missing group is created (and tagged: Neutron
//! 29 takes tags in the creation of ports only — its `tag-creation` extension leaves
//! `security_groups.tags` with `allow_post: False` —, so tagging is a second call), a group's
//! missing rules go in one bulk call and its stale rules are deleted one by one
//! (after the new ones exist, so that traffic that stays allowed is never cut), a port is updated
//! only when its groups change, and groups no live policy owns are deleted after the ports left
//! them. What it knows is read from Neutron at start, after any failure (a timed-out call may
//! have been applied) and every `--neutron-resync`: one list of the owned groups with their
//! rules, one list of the untagged groups carrying this cluster's [`marker`] in their
//! description (orphans, see below) and one list of the ports by id.
//!
//! **Orphans**: a pass cancelled (or a process killed) between a group's creation and its
//! tagging leaves a group no tag filter finds. Every group is therefore created with a
//! description that starts with [`marker`] (the cluster and owner tags), which Neutron stores in
//! the creation request itself; a group with that description but without the owner tag is an
//! orphan and is deleted like any other garbage (no port can use it: ports are given a group
//! only after it is tagged and known).
//!
//! Failures are retried with exponential backoff (100 ms to 30 s), logged with what failed, and
//! counted (`kuryr_policy_neutron_errors_total{operation}`); the rest of a pass goes on.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use kuryr_openstack::neutron::{Neutron, PortUpdate, SecurityGroup, SecurityGroupCreate};
use kuryr_openstack::{Error, Filter};
use kuryr_policy_core::PolicyKey;
use kuryr_runtime::Shutdown;
use tokio::sync::watch;

pub use super::metrics::{NeutronMetrics, OpLabels};
use super::rules::{self, Direction, Selection, SgRule};
use super::vifs::Vifs;
use super::{Desired, OWNER_TAG, policy_tag};

/// The ceiling of the first delay after a failed pass (the shared backoff with jitter); it
/// doubles up to [`RETRY_MAX`].
pub const RETRY_MIN: Duration = Duration::from_millis(100);
/// The longest delay between failed passes.
pub const RETRY_MAX: Duration = Duration::from_secs(30);

/// The desired state as handed over: a generation (counting changes) and the state; `None`
/// until the watcher's first snapshot is compiled (nothing is touched before).
pub type DesiredState = Option<(u64, Arc<Desired>)>;

/// A group's id and rules as Neutron holds them (rule id → meaning).
#[derive(Clone, Debug)]
struct Group {
    id: String,
    rules: BTreeMap<String, Option<SgRule>>,
}

impl Group {
    fn of(g: &SecurityGroup) -> Self {
        Self {
            id: g.id.clone(),
            rules: g.security_group_rules.iter().map(|r| (r.id.clone(), SgRule::from_neutron(r))).collect(),
        }
    }
}

/// What a group is for.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Owner {
    Open(Direction),
    Policy(PolicyKey),
}

/// What the reconciler knows Neutron holds.
#[derive(Debug, Default)]
struct Known {
    groups: BTreeMap<Owner, Group>,
    /// Owned groups nothing wants (duplicates, unknown policies): deleted.
    garbage: BTreeSet<String>,
    /// Port id → its groups, sorted.
    ports: HashMap<String, Vec<String>>,
}

/// The reconciler's configuration and state.
#[derive(Debug)]
pub struct Reconciler {
    pub neutron: Neutron,
    pub cluster_tag: String,
    pub resync: Duration,
    pub concurrency: usize,
    pub metrics: NeutronMetrics,
    pub desired: watch::Receiver<DesiredState>,
    pub vifs: watch::Receiver<Option<Vifs>>,
    known: Option<Known>,
}

fn open_tag(d: Direction) -> String {
    format!("kuryr.openstack.org/open={}", d.as_str())
}

/// The start of the description of every group this cluster's kuryr-policy creates: what finds
/// a group whose tagging never happened.
/// At most 242 characters (`--cluster-id` has at most 200).
pub fn marker(cluster_tag: &str) -> String {
    format!("kuryr-policy[{cluster_tag}]")
}

/// A group's description: the marker, then `text`, cut to Neutron's 255 characters.
fn describe(cluster_tag: &str, text: &str) -> String {
    format!("{} {text}", marker(cluster_tag)).chars().take(DESCRIPTION_MAX).collect()
}

/// Neutron's longest description.
const DESCRIPTION_MAX: usize = 255;

/// Sorts the listed groups: `owned` (listed by the owner tags) become the known group of the
/// owner their tag names, or garbage (duplicates, unknown policies); `untagged` (listed without
/// the owner tag) are garbage when their description starts with this cluster's `marker`.
fn classify(
    owned: &[SecurityGroup],
    untagged: &[SecurityGroup],
    by_tag: &HashMap<String, Owner>,
    marker: &str,
) -> Known {
    let mut known = Known::default();
    for g in owned {
        match g.tags.iter().find_map(|t| by_tag.get(t)) {
            Some(owner) if !known.groups.contains_key(owner) => {
                known.groups.insert(owner.clone(), Group::of(g));
            }
            _ => {
                known.garbage.insert(g.id.clone());
            }
        }
    }
    for g in untagged {
        let ours = g.description.starts_with(marker);
        if ours && !g.tags.iter().any(|t| t == OWNER_TAG) {
            tracing::warn!(
                group = g.id,
                name = g.name,
                "untagged security group of this cluster found (its creation was cut short): deleting it"
            );
            known.garbage.insert(g.id.clone());
        }
    }
    known
}

impl Reconciler {
    pub fn new(
        neutron: Neutron,
        cluster_tag: String,
        resync: Duration,
        concurrency: usize,
        metrics: NeutronMetrics,
        desired: watch::Receiver<DesiredState>,
        vifs: watch::Receiver<Option<Vifs>>,
    ) -> Self {
        Self { neutron, cluster_tag, resync, concurrency, metrics, desired, vifs, known: None }
    }

    /// Converges until shutdown.
    pub async fn run(mut self, shutdown: Shutdown) {
        let mut backoff = kuryr_stream::Backoff::new("policy-neutron", RETRY_MIN, RETRY_MAX);
        let mut next_resync = tokio::time::Instant::now() + self.resync;
        loop {
            let state = self.desired.borrow_and_update().clone();
            let vifs = self.vifs.borrow_and_update().clone();
            if let (Some((generation, desired)), Some(vifs)) = (state, vifs) {
                let started = Instant::now();
                let result = tokio::select! {
                    r = self.pass(&desired, &vifs) => r,
                    () = shutdown.clone().wait() => return,
                };
                match result {
                    Ok(changed) => {
                        if changed {
                            self.metrics.converge.observe(started.elapsed().as_secs_f64());
                        }
                        self.metrics.applied_generation.set(generation as i64);
                        backoff.reset();
                    }
                    Err(errors) => {
                        let reason = errors.first().map_or("unknown", |(operation, _)| *operation);
                        let delay = backoff.next_delay(reason);
                        for (operation, e) in &errors {
                            self.metrics.errors.get_or_create(&OpLabels { operation }).inc();
                            tracing::warn!(operation, error = %e, retry_in = ?delay, "Neutron security groups not converged");
                        }
                        // A call that failed may still have been applied: read Neutron again.
                        self.known = None;
                        tokio::select! {
                            () = tokio::time::sleep(delay) => {}
                            () = shutdown.clone().wait() => return,
                        }
                        continue;
                    }
                }
            }
            tokio::select! {
                r = self.desired.changed() => if r.is_err() { return },
                r = self.vifs.changed() => if r.is_err() { return },
                () = tokio::time::sleep_until(next_resync) => {
                    next_resync = tokio::time::Instant::now() + self.resync;
                    self.known = None;
                }
                () = shutdown.clone().wait() => return,
            }
        }
    }

    /// Reads the owned groups (with their rules) and the ports of `vifs`.
    async fn read(&self, desired: &Desired, vifs: &Vifs) -> Result<Known, Error> {
        let tags = [self.cluster_tag.clone(), OWNER_TAG.to_string()];
        let listed = self.neutron.list_security_groups(&Filter::new().tags(&tags)).await?;
        let by_tag: HashMap<String, Owner> = desired
            .policies
            .keys()
            .map(|p| (policy_tag(p), Owner::Policy(p.clone())))
            .chain([Direction::Ingress, Direction::Egress].map(|d| (open_tag(d), Owner::Open(d))))
            .collect();
        let untagged = self
            .neutron
            .list_security_groups(&Filter::new().not_tags(&[OWNER_TAG]).fields(&["id", "name", "description", "tags"]))
            .await?;
        let mut known = classify(&listed, &untagged, &by_tag, &marker(&self.cluster_tag));
        let ids: Vec<String> = vifs.values().map(|v| v.port.clone()).collect();
        if !ids.is_empty() {
            let filter = Filter::new().fields(&["id", "security_groups"]);
            for p in self.neutron.list_ports_by_ids(&ids, &filter).await? {
                let mut g = p.security_groups;
                g.sort();
                known.ports.insert(p.id, g);
            }
        }
        Ok(known)
    }

    /// One pass; `Ok(true)` if it changed something in Neutron.
    async fn pass(&mut self, desired: &Desired, vifs: &Vifs) -> Result<bool, Vec<(&'static str, Error)>> {
        let mut known = match self.known.take() {
            Some(k) => k,
            None => self.read(desired, vifs).await.map_err(|e| vec![("read", e)])?,
        };
        let mut errors = Vec::new();
        let mut changed = false;
        // Groups: the open ones, then one per policy.
        let wanted: Vec<(Owner, BTreeSet<SgRule>)> = [Direction::Ingress, Direction::Egress]
            .into_iter()
            .map(|d| (Owner::Open(d), rules::open_rules(d)))
            .chain(desired.policies.iter().map(|(p, r)| (Owner::Policy(p.clone()), r.clone())))
            .collect();
        for (owner, rules) in &wanted {
            match self.converge_group(&mut known, owner, rules).await {
                Ok(c) => changed |= c,
                Err(e) => errors.push(e),
            }
        }
        // Ports.
        match self.converge_ports(&mut known, desired, vifs).await {
            Ok(c) => changed |= c,
            Err(mut e) => errors.append(&mut e),
        }
        // Groups no live policy owns, once no port of a pod uses them.
        let stale: Vec<(Option<Owner>, String)> = known
            .groups
            .iter()
            .filter(|(o, _)| matches!(o, Owner::Policy(p) if !desired.policies.contains_key(p)))
            .map(|(o, g)| (Some(o.clone()), g.id.clone()))
            .chain(known.garbage.iter().map(|id| (None, id.clone())))
            .collect();
        for (owner, id) in stale {
            let mut deleted = self.neutron.delete_security_group(&id).await;
            if deleted.as_ref().is_err_and(Error::is_conflict) {
                // In use by a port that is no live pod's (see `release_group`): taken off, then
                // deleted at once.
                match self.release_group(&id, &known, vifs).await {
                    Ok(0) => {}
                    Ok(_) => deleted = self.neutron.delete_security_group(&id).await,
                    Err(e) => errors.push(e),
                }
            }
            match deleted {
                Ok(_) => {
                    changed = true;
                    tracing::info!(group = id, owner = ?owner, "security group deleted: no live policy owns it");
                    match owner {
                        Some(o) => known.groups.remove(&o),
                        None => known.garbage.remove(&id).then_some(Group { id, rules: BTreeMap::new() }),
                    };
                }
                Err(e) => errors.push(("group_delete", e)),
            }
        }
        self.metrics.groups.set(known.groups.len() as i64);
        self.metrics.rules.set(known.groups.values().map(|g| g.rules.len()).sum::<usize>() as i64);
        self.known = Some(known);
        if errors.is_empty() { Ok(changed) } else { Err(errors) }
    }

    /// Takes the group `id`, which no live policy owns, off the ports that still hold it and are
    /// not a live pod's port: a pod deleted while a policy change was being applied can have its
    /// port released to the allocator's pool and only then given the group, which then keeps
    /// Neutron from deleting it. Only the groups this backend owns are removed from such a port
    /// (the allocator gives a pool port the pool's groups back when it hands it out). Returns
    /// how many ports were changed.
    async fn release_group(&self, id: &str, known: &Known, vifs: &Vifs) -> Result<usize, (&'static str, Error)> {
        let filter = Filter::new().eq("security_groups", id).fields(&["id", "device_id", "security_groups"]);
        let holders = self.neutron.list_ports(&filter).await.map_err(|e| ("read", e))?;
        let live: BTreeSet<&str> = vifs.values().map(|v| v.port.as_str()).collect();
        let owned: BTreeSet<&str> =
            known.groups.values().map(|g| g.id.as_str()).chain(known.garbage.iter().map(String::as_str)).collect();
        let mut changed = 0;
        for p in holders.iter().filter(|p| !live.contains(p.id.as_str())) {
            let keep: Vec<String> =
                p.security_groups.iter().filter(|g| *g != id && !owned.contains(g.as_str())).cloned().collect();
            let update = PortUpdate { security_groups: Some(keep.clone()), ..PortUpdate::default() };
            match self.neutron.update_port(&p.id, &update, None).await {
                Ok(_) => {
                    tracing::info!(group = id, port = p.id, device = p.device_id, groups = ?keep, "a group of a gone policy taken off a port that is no live pod's");
                    self.metrics.port_updates.inc();
                    changed += 1;
                }
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(("port_update", e)),
            }
        }
        Ok(changed)
    }

    /// Creates the group of `owner` if missing and converges its rules: new ones in one bulk
    /// call first, then stale ones deleted.
    async fn converge_group(
        &self,
        known: &mut Known,
        owner: &Owner,
        rules: &BTreeSet<SgRule>,
    ) -> Result<bool, (&'static str, Error)> {
        let mut changed = false;
        if !known.groups.contains_key(owner) {
            let (name, description, tag) = match owner {
                Owner::Open(d) => (
                    format!("kuryr-open-{}", d.as_str()),
                    describe(
                        &self.cluster_tag,
                        &format!("every {} traffic, for pods no policy isolates that way", d.as_str()),
                    ),
                    open_tag(*d),
                ),
                Owner::Policy(p) => (
                    format!("kuryr-np-{}-{}", p.namespace, p.name),
                    describe(&self.cluster_tag, &format!("NetworkPolicy {}/{}", p.namespace, p.name)),
                    policy_tag(p),
                ),
            };
            let create = SecurityGroupCreate {
                name,
                description: Some(description),
                project_id: None,
                tags: Some(vec![self.cluster_tag.clone(), OWNER_TAG.to_string(), tag]),
            };
            let g = self.neutron.create_security_group(create).await.map_err(|e| ("group_create", e))?;
            tracing::info!(group = g.id, ?owner, "security group created");
            known.groups.insert(owner.clone(), Group::of(&g));
            changed = true;
        }
        let Some(group) = known.groups.get_mut(owner) else { return Ok(changed) };
        let (create, delete) = rules::diff(rules, &group.rules);
        if !create.is_empty() {
            let bodies = create.iter().map(|r| r.create(&group.id)).collect();
            let made = self.neutron.create_security_group_rules(bodies).await.map_err(|e| ("rule_create", e))?;
            for r in made {
                group.rules.insert(r.id.clone(), SgRule::from_neutron(&r));
            }
            changed = true;
        }
        for id in delete {
            self.neutron.delete_security_group_rule(&id).await.map_err(|e| ("rule_delete", e))?;
            group.rules.remove(&id);
            changed = true;
        }
        Ok(changed)
    }

    /// Gives every pod's port its groups.
    async fn converge_ports(
        &self,
        known: &mut Known,
        desired: &Desired,
        vifs: &Vifs,
    ) -> Result<bool, Vec<(&'static str, Error)>> {
        let open = |d| known.groups.get(&Owner::Open(d)).map(|g| g.id.clone());
        let (Some(open_in), Some(open_out)) = (open(Direction::Ingress), open(Direction::Egress)) else {
            // Their creation failed and is reported; ports wait for them.
            return Ok(false);
        };
        // Ports first seen since the last read: one list call for all.
        let unknown: Vec<String> =
            vifs.values().map(|v| v.port.clone()).filter(|p| !known.ports.contains_key(p)).collect();
        if !unknown.is_empty() {
            let filter = Filter::new().fields(&["id", "security_groups"]);
            let found = self.neutron.list_ports_by_ids(&unknown, &filter).await.map_err(|e| vec![("read", e)])?;
            for p in found {
                let mut g = p.security_groups;
                g.sort();
                known.ports.insert(p.id, g);
            }
        }
        let live: BTreeSet<&str> = vifs.values().map(|v| v.port.as_str()).collect();
        known.ports.retain(|p, _| live.contains(p.as_str()));
        let mut updates = Vec::new();
        for (pod, vif) in vifs.iter() {
            let Some(current) = known.ports.get(&vif.port) else { continue };
            let selection = match desired.pods.get(pod) {
                Some(s) => {
                    let groups: Option<Vec<String>> = s
                        .policies
                        .iter()
                        .map(|p| known.groups.get(&Owner::Policy(p.clone())).map(|g| g.id.clone()))
                        .collect();
                    // A policy whose group could not be made yet: the pod waits (reported).
                    let Some(groups) = groups else { continue };
                    Some(Selection { groups, ingress: s.ingress, egress: s.egress })
                }
                None if vif.default_groups.is_empty() => {
                    // Nothing recorded to go back to: leave the port as it is.
                    continue;
                }
                None => None,
            };
            let want = rules::port_groups(selection.as_ref(), &open_in, &open_out, &vif.default_groups);
            if *current != want {
                updates.push((pod.clone(), vif.port.clone(), want));
            }
        }
        let changed = !updates.is_empty();
        let neutron = &self.neutron;
        let results: Vec<_> = futures::stream::iter(updates)
            .map(|(pod, port, want)| async move {
                let update = PortUpdate { security_groups: Some(want.clone()), ..PortUpdate::default() };
                let r = neutron.update_port(&port, &update, None).await;
                (pod, port, want, r)
            })
            .buffer_unordered(self.concurrency)
            .collect()
            .await;
        let mut errors = Vec::new();
        for (pod, port, want, r) in results {
            match r {
                Ok(_) => {
                    tracing::debug!(%pod, port, groups = ?want, "port security groups set");
                    self.metrics.port_updates.inc();
                    known.ports.insert(port, want);
                }
                Err(e) if e.is_not_found() => {
                    known.ports.remove(&port);
                }
                Err(e) => errors.push(("port_update", e)),
            }
        }
        if errors.is_empty() { Ok(changed) } else { Err(errors) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTER: &str = "kuryr.openstack.org/cluster=c1";

    fn key(name: &str) -> PolicyKey {
        PolicyKey { namespace: "ns".into(), name: name.into() }
    }

    fn group(id: &str, description: &str, tags: &[&str]) -> SecurityGroup {
        SecurityGroup {
            id: id.into(),
            name: format!("kuryr-np-ns-{id}"),
            description: description.into(),
            tags: tags.iter().map(|t| t.to_string()).collect(),
            ..SecurityGroup::default()
        }
    }

    fn owners(live: &[&str]) -> HashMap<String, Owner> {
        live.iter()
            .map(|n| (policy_tag(&key(n)), Owner::Policy(key(n))))
            .chain([Direction::Ingress, Direction::Egress].map(|d| (open_tag(d), Owner::Open(d))))
            .collect()
    }

    /// The crash point: a creation cut short after Neutron made the group and before the tags
    /// were set leaves exactly what the creation request held (name, description), no tags. The
    /// next read finds it by its description and collects it; nothing else is touched.
    #[test]
    fn a_group_whose_tagging_was_cut_short_is_collected() {
        let by_tag = owners(&["web"]);
        let web = policy_tag(&key("web"));
        let owned = [group("sg-web", &describe(CLUSTER, "NetworkPolicy ns/web"), &[CLUSTER, OWNER_TAG, &web])];
        let untagged = [
            // Left by the cancelled pass: same description as the one it was creating.
            group("sg-cut", &describe(CLUSTER, "NetworkPolicy ns/web"), &[]),
            // Half-tagged (the owner tag missing) still counts as ours.
            group("sg-half", &describe(CLUSTER, "every ingress traffic"), &[CLUSTER]),
            // Another cluster's, the user's, the project's default: not ours.
            group("sg-other", &describe("kuryr.openstack.org/cluster=c10", "NetworkPolicy ns/web"), &[]),
            group("sg-user", "kuryr-policy[kuryr.openstack.org/cluster=c1 is mentioned, not marked", &[]),
            group("sg-default", "Default security group", &[]),
        ];
        let known = classify(&owned, &untagged, &by_tag, &marker(CLUSTER));
        assert_eq!(known.garbage, BTreeSet::from(["sg-cut".to_string(), "sg-half".to_string()]));
        assert_eq!(known.groups.get(&Owner::Policy(key("web"))).map(|g| g.id.as_str()), Some("sg-web"));
        assert_eq!(known.groups.len(), 1);
    }

    #[test]
    fn owned_duplicates_and_groups_of_gone_policies_are_garbage() {
        let by_tag = owners(&["web"]);
        let web = policy_tag(&key("web"));
        let gone = policy_tag(&key("gone"));
        let d = describe(CLUSTER, "x");
        let owned = [
            group("sg-1", &d, &[CLUSTER, OWNER_TAG, &web]),
            group("sg-2", &d, &[CLUSTER, OWNER_TAG, &web]),
            group("sg-3", &d, &[CLUSTER, OWNER_TAG, &gone]),
        ];
        let known = classify(&owned, &[], &by_tag, &marker(CLUSTER));
        assert_eq!(known.garbage, BTreeSet::from(["sg-2".to_string(), "sg-3".to_string()]));
        assert_eq!(known.groups.get(&Owner::Policy(key("web"))).map(|g| g.id.as_str()), Some("sg-1"));
    }

    #[test]
    fn descriptions_fit_neutron_and_keep_the_whole_marker() {
        let long_cluster = format!("kuryr.openstack.org/cluster={}", "c".repeat(200));
        let d = describe(&long_cluster, &format!("NetworkPolicy {}/{}", "n".repeat(63), "p".repeat(253)));
        assert_eq!(d.chars().count(), DESCRIPTION_MAX);
        assert!(d.starts_with(&marker(&long_cluster)));
        assert!(marker(&long_cluster).chars().count() < DESCRIPTION_MAX);
    }
}
