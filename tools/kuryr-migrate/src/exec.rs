//! Observing and applying: reads Kuryr's resources and what they point at, derives each
//! object's remaining steps with [`crate::plan`], prints them, and (unless `--dry-run`) applies
//! them one by one.
//!
//! Test hook: with `KURYR_MIGRATE_CRASH_AFTER=<k>` the process exits abruptly (status 70,
//! nothing cleaned up) right after its k-th applied step: how the suite proves that a run
//! interrupted at any step is finished by the next one.

use std::collections::HashSet;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Resource;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kuryr_openstack::neutron::{Neutron, Port, TaggedResource};
use kuryr_openstack::octavia::Octavia;
use kuryr_openstack::{Client, ClientOptions, Filter};
use kuryr_vif_allocator::backend::neutron::vif::VifShape;
use kuryr_vif_allocator::k8s::crd::{PodVif, PodVifSpec, VifState};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::Args;
use crate::kuryr::{self, Kind, KuryrLoadBalancer, KuryrPort};
use crate::plan::{self, FipFacts, LbFacts, LbStep, Owner, PodFacts, PodStep, PortFacts, ServiceFacts, Target};

/// One line of the plan or report, on stdout.
macro_rules! say {
    ($($t:tt)*) => { crate::report(&mut std::io::stdout(), &format!($($t)*)) };
}

/// Exit status of the crash hook.
pub const CRASH_STATUS: i32 = 70;

/// Bound on one load balancer leaving PENDING after its tags change.
const LB_SETTLE: Duration = Duration::from_secs(300);

/// What a run found and did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// KuryrPorts looked at.
    pub pods: usize,
    /// KuryrLoadBalancers looked at.
    pub services: usize,
    /// Kuryr pool ports found untagged.
    pub pool_ports: usize,
    /// Steps planned (dry run) or applied.
    pub steps: usize,
    /// Objects that cannot be migrated as they are (reasons printed).
    pub blocked: usize,
    /// KuryrNetworks and KuryrNetworkPolicies left in place.
    pub kept: usize,
}

impl Summary {
    /// The last line a run prints.
    pub fn line(&self, dry_run: bool) -> String {
        let (head, verb) = if dry_run { ("plan", "to do") } else { ("migrated", "done") };
        format!(
            "{head}: {} pods, {} services, {} pool ports; {} steps {verb}, {} blocked, {} kept",
            self.pods, self.services, self.pool_ports, self.steps, self.blocked, self.kept
        )
    }
}

struct Migrator<'a> {
    args: &'a Args,
    kube: kube::Client,
    neutron: Neutron,
    octavia: Octavia,
    shape: VifShape,
    tag: String,
    applied: usize,
    crash_after: Option<usize>,
    summary: Summary,
}

/// Runs the migration (or prints its plan) and returns what it found and did.
pub async fn run(args: &Args) -> anyhow::Result<Summary> {
    // The ports it hands over must look like the allocator's: the same checks on the same flags.
    args.ports.validate()?;
    let kube = kuryr_runtime::kube_client(args.kubeconfig.as_deref()).await?;
    let client =
        Client::new(&args.cloud()?, ClientOptions::default(), Arc::new(kuryr_openstack::Metrics::unregistered()))?;
    let neutron = client.network();
    let shape = pod_shape(args, &neutron).await?;
    let pod_vifs: Api<PodVif> = Api::all(kube.clone());
    match pod_vifs.list(&ListParams::default().limit(1)).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {
            anyhow::bail!("the PodVif CRD (podvifs.kuryr.openstack.org) is not installed: apply deploy/crds/ first")
        }
        Err(e) => return Err(anyhow::Error::new(e).context("listing PodVifs")),
    }
    let crash_after = match std::env::var("KURYR_MIGRATE_CRASH_AFTER") {
        Ok(v) => Some(v.parse().with_context(|| format!("KURYR_MIGRATE_CRASH_AFTER={v:?}: not a number"))?),
        Err(_) => None,
    };
    let mut m = Migrator {
        args,
        kube,
        octavia: client.load_balancer(),
        neutron,
        shape,
        tag: args.ports.cluster.tag(),
        applied: 0,
        crash_after,
        summary: Summary::default(),
    };
    m.pods().await?;
    if !args.skip_pool_ports {
        m.pool_ports().await?;
    }
    m.services().await?;
    m.kept().await?;
    Ok(m.summary)
}

/// The allocator's VIF shape of the pod network, read as the allocator reads it.
async fn pod_shape(args: &Args, neutron: &Neutron) -> anyhow::Result<VifShape> {
    VifShape::read(neutron, &args.pod_network_id, &args.pod_subnet_ids, &args.ports.ovs_bridge).await
}

/// Every object of a Kuryr kind; none when its CRD is not installed.
async fn list_kind(kube: &kube::Client, kind: Kind) -> anyhow::Result<Vec<DynamicObject>> {
    let api: Api<DynamicObject> = Api::all_with(kube.clone(), &kind.resource());
    match api.list(&ListParams::default()).await {
        Ok(l) => Ok(l.items),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Vec::new()),
        Err(e) => Err(anyhow::Error::new(e).context(format!("listing {}s", kind.name()))),
    }
}

fn owner<K: Resource>(o: &K) -> Owner {
    let m = o.meta();
    Owner {
        uid: m.uid.clone().unwrap_or_default(),
        finalizers: m.finalizers.clone().unwrap_or_default(),
        deleting: m.deletion_timestamp.is_some(),
    }
}

/// Sets an object's finalizers to `edit(current)`, over the version read (a concurrent edit is
/// read again, not overwritten). Nothing when the object is gone or nothing changes.
async fn edit_finalizers<K>(api: &Api<K>, name: &str, edit: impl Fn(&[String]) -> Vec<String>) -> anyhow::Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    for _ in 0..5 {
        let Some(obj) = api.get_opt(name).await? else { return Ok(()) };
        let current = obj.meta().finalizers.clone().unwrap_or_default();
        let new = edit(&current);
        if new == current {
            return Ok(());
        }
        let rv = obj.meta().resource_version.clone().unwrap_or_default();
        let patch = json!({"metadata": {"finalizers": new, "resourceVersion": rv}});
        match api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::bail!("{name}: finalizers changed under us five times in a row")
}

async fn delete_opt<K>(api: &Api<K>, name: &str) -> anyhow::Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn get_port(neutron: &Neutron, id: &str) -> anyhow::Result<Option<Port>> {
    match neutron.get_port(id).await {
        Ok(p) => Ok(Some(p)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(anyhow::Error::new(e).context(format!("reading port {id}"))),
    }
}

impl Migrator<'_> {
    /// Counts an applied step; the crash hook fires here.
    fn applied(&mut self, what: &str) {
        self.applied += 1;
        self.summary.steps += 1;
        tracing::info!(step = self.applied, "{what}");
        if self.crash_after == Some(self.applied) {
            crate::report(
                &mut std::io::stderr(),
                &format!("kuryr-migrate: KURYR_MIGRATE_CRASH_AFTER={} reached after: {what}", self.applied),
            );
            std::process::exit(CRASH_STATUS);
        }
    }

    /// Says an object's plan (its steps, or why it is blocked) and counts it. The steps to run
    /// now: none when blocked or on a dry run.
    fn announce<S: std::fmt::Display>(
        &mut self,
        who: &str,
        describe: &str,
        note: &str,
        planned: Result<Vec<S>, String>,
    ) -> Vec<S> {
        let steps = match planned {
            Ok(s) => s,
            Err(why) => {
                say!("{who}: {describe}: blocked: {why}");
                self.summary.blocked += 1;
                return Vec::new();
            }
        };
        let names: Vec<String> = steps.iter().map(ToString::to_string).collect();
        say!("{who}: {describe}: {}{note}", names.join(", "));
        if self.args.dry_run {
            self.summary.steps += steps.len();
            return Vec::new();
        }
        steps
    }

    async fn pods(&mut self) -> anyhow::Result<()> {
        for o in list_kind(&self.kube, Kind::KuryrPort).await? {
            self.summary.pods += 1;
            let kp = match KuryrPort::from_object(&o) {
                Ok(kp) => kp,
                Err(e) => {
                    say!("pod ?: blocked: {e}");
                    self.summary.blocked += 1;
                    continue;
                }
            };
            let who = format!("pod {}/{}", kp.namespace, kp.name);
            if let Err(e) = self.pod(&kp, &who).await {
                say!("{who}: failed: {e:#}");
                return Err(e.context(format!("migrating {who}")));
            }
        }
        Ok(())
    }

    async fn pod(&mut self, kp: &KuryrPort, who: &str) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.kube.clone(), &kp.namespace);
        let vifs: Api<PodVif> = Api::namespaced(self.kube.clone(), &kp.namespace);
        let kps: Api<DynamicObject> =
            Api::namespaced_with(self.kube.clone(), &kp.namespace, &Kind::KuryrPort.resource());
        let pod = pods.get_opt(&kp.name).await?;
        let port = match &kp.vif {
            Some(v) => get_port(&self.neutron, &v.port_id).await?,
            None => None,
        };
        let pod_vif = vifs.get_opt(&kp.name).await?;
        let facts = PodFacts {
            kuryr_uid: kp.pod_uid.clone(),
            port_id: kp.vif.as_ref().map(|v| v.port_id.clone()),
            kuryr_mac: kp.vif.as_ref().map(|v| v.mac.clone()).unwrap_or_default(),
            kp_finalizers: kp.finalizers.clone(),
            pod: pod.as_ref().map(owner),
            port: port.as_ref().map(|p| PortFacts {
                device_id: p.device_id.clone(),
                device_owner: p.device_owner.clone(),
                network_id: p.network_id.clone(),
                mac: p.mac_address.to_ascii_lowercase(),
                tagged: p.tags.contains(&self.tag),
                unbound: p.binding_failed() || p.binding_host_id.as_deref().unwrap_or_default().is_empty(),
            }),
            pod_vif: pod_vif.as_ref().map(|v| (v.spec.pod_uid.clone(), v.vif().map(|r| r.vif_id.clone()))),
        };
        let target =
            Target { network_id: self.shape.network_id.clone(), device_owner: self.args.ports.device_owner.clone() };
        let describe = match &kp.vif {
            Some(v) => format!("port {} ({}, {}) on {}", v.port_id, v.mac, v.ips.join(" "), kp.node),
            None => format!("no port yet, on {}", kp.node),
        };
        let extra = if kp.extra_vifs.is_empty() {
            String::new()
        } else {
            format!(" [additional interfaces not migrated: {}]", kp.extra_vifs.join(", "))
        };
        let planned = plan::pod_steps(&facts, &target, kuryr::POD_FINALIZER, kuryr_vif_allocator::pods::FINALIZER);
        let steps = self.announce(who, &describe, &extra, planned);
        for step in steps {
            match step {
                PodStep::TagPort => {
                    let Some(port) = &port else { anyhow::bail!("no port to tag") };
                    self.tag_port(port).await?;
                }
                PodStep::RecordVif => {
                    let (Some(port), Some(v)) = (&port, &kp.vif) else { anyhow::bail!("no port to record") };
                    let record = self.shape.record(port).map_err(|e| anyhow::anyhow!(e))?;
                    let state = if v.active && port.is_active() { VifState::Ready } else { VifState::Allocated };
                    self.record_vif(&vifs, kp, &record, state).await?;
                }
                PodStep::AddFinalizer => {
                    edit_finalizers(&pods, &kp.name, |f| plan::with(f, kuryr_vif_allocator::pods::FINALIZER)).await?;
                }
                PodStep::ReleasePodFinalizer => {
                    edit_finalizers(&pods, &kp.name, |f| plan::without(f, kuryr::POD_FINALIZER)).await?;
                }
                PodStep::ReleaseKuryrPortFinalizers => edit_finalizers(&kps, &kp.name, |_| Vec::new()).await?,
                PodStep::DeleteKuryrPort => delete_opt(&kps, &kp.name).await?,
            }
            self.applied(&format!("{who}: {step}"));
        }
        Ok(())
    }

    /// Adds the cluster tag to the port's tags. All tags are written in one request: Neutron's
    /// single-tag call takes the tag in the URL path, where the `/` of the cluster tag does not
    /// survive Neutron's routing (404).
    async fn tag_port(&self, port: &Port) -> anyhow::Result<()> {
        let tags = plan::with(&port.tags, &self.tag);
        self.neutron
            .set_tags(TaggedResource::Port, &port.id, &tags)
            .await
            .with_context(|| format!("tagging port {}", port.id))?;
        Ok(())
    }

    /// The PodVif as the allocator makes it (owned by the pod, labelled with the node, the port
    /// recorded in its spec by the create), with the state in its status.
    async fn record_vif(
        &self,
        api: &Api<PodVif>,
        kp: &KuryrPort,
        record: &kuryr_vif_allocator::k8s::crd::VifRecord,
        state: VifState,
    ) -> anyhow::Result<()> {
        let mut pv = PodVif::new(
            &kp.name,
            PodVifSpec {
                pod_uid: kp.pod_uid.clone(),
                pod_name: kp.name.clone(),
                node_name: kp.node.clone(),
                network: self.shape.network_id.clone(),
                vif: Some(record.clone()),
            },
        );
        pv.metadata.namespace = Some(kp.namespace.clone());
        pv.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: kp.name.clone(),
            uid: kp.pod_uid.clone(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        pv.metadata.labels = Some([("kuryr.openstack.org/node".to_string(), kp.node.clone())].into());
        let pp = PostParams { field_manager: Some("kuryr-migrate".into()), ..Default::default() };
        let existed = match api.create(&pp, &pv).await {
            Ok(_) => false,
            Err(kube::Error::Api(e)) if e.code == 409 => {
                // Made by an earlier, interrupted run (the plan checked it is this pod's, with no
                // other VIF): the VIF goes into its spec.
                let spec = json!({"spec": {"vif": record}});
                api.patch(&kp.name, &PatchParams::default(), &Patch::Merge(&spec))
                    .await
                    .with_context(|| format!("recording the VIF in PodVif {}/{}", kp.namespace, kp.name))?;
                true
            }
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!("creating PodVif {}/{}", kp.namespace, kp.name)));
            }
        };
        if existed || state != VifState::Allocated {
            // `vif: null` drops a VIF an earlier version recorded in the status.
            let status = json!({"status": {"vif": null, "state": state}});
            api.patch_status(&kp.name, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .with_context(|| format!("recording the state in PodVif {}/{}", kp.namespace, kp.name))?;
        }
        Ok(())
    }

    async fn pool_ports(&mut self) -> anyhow::Result<()> {
        let filter = Filter::new().network_id(&self.shape.network_id).device_owner(&self.args.ports.device_owner);
        let ports = self.neutron.list_ports(&filter).await.context("listing Kuryr's pool ports")?;
        for p in ports {
            if p.name != kuryr::POOL_PORT_NAME || !p.device_id.is_empty() || p.tags.contains(&self.tag) {
                continue;
            }
            if p.binding_failed() || p.binding_host_id.as_deref().unwrap_or_default().is_empty() {
                say!("pool port {}: blocked: not bound to a host", p.id);
                self.summary.blocked += 1;
                continue;
            }
            self.summary.pool_ports += 1;
            let host = p.binding_host_id.clone().unwrap_or_default();
            say!("pool port {} on {host}: {}", p.id, PodStep::TagPort);
            if self.args.dry_run {
                self.summary.steps += 1;
                continue;
            }
            self.tag_port(&p).await?;
            self.applied(&format!("pool port {}: {}", p.id, PodStep::TagPort));
        }
        Ok(())
    }

    async fn services(&mut self) -> anyhow::Result<()> {
        for o in list_kind(&self.kube, Kind::KuryrLoadBalancer).await? {
            self.summary.services += 1;
            let klb = KuryrLoadBalancer::from_object(&o);
            let who = format!("service {}/{}", klb.namespace, klb.name);
            if let Err(e) = self.service(&klb, &who).await {
                say!("{who}: failed: {e:#}");
                return Err(e.context(format!("migrating {who}")));
            }
        }
        Ok(())
    }

    async fn service(&mut self, klb: &KuryrLoadBalancer, who: &str) -> anyhow::Result<()> {
        let services: Api<Service> = Api::namespaced(self.kube.clone(), &klb.namespace);
        let klbs: Api<DynamicObject> =
            Api::namespaced_with(self.kube.clone(), &klb.namespace, &Kind::KuryrLoadBalancer.resource());
        let svc = services.get_opt(&klb.name).await?;
        let key = format!("{}/{}", klb.namespace, klb.name);
        let uid = svc.as_ref().and_then(|s| s.metadata.uid.clone()).unwrap_or_default();
        let ours = kuryr_lbaas::backend::octavia::plan::tags(&self.args.cluster_name, &key, &uid);
        let lb = match &klb.lb_id {
            Some(id) => match self.octavia.get_load_balancer(id).await {
                Ok(lb) => Some(lb),
                Err(e) if e.is_not_found() => None,
                Err(e) => return Err(anyhow::Error::new(e).context(format!("reading load balancer {id}"))),
            },
            None => None,
        };
        let fip = match &klb.floating_ip_id {
            Some(id) => match self.neutron.get_floating_ip(id).await {
                Ok(f) => Some(f),
                Err(e) if e.is_not_found() => None,
                Err(e) => return Err(anyhow::Error::new(e).context(format!("reading floating IP {id}"))),
            },
            None => None,
        };
        let facts = ServiceFacts {
            fip: fip.as_ref().map(|f| FipFacts {
                id: f.id.clone(),
                network_id: f.floating_network_id.clone(),
                tagged: ours.iter().all(|t| f.tags.contains(t)),
                user_allocated: klb.floating_ip_user,
            }),
            floating_network: self.args.floating_network_id.clone(),
            klb_finalizers: klb.finalizers.clone(),
            lb_id: klb.lb_id.clone(),
            service: svc.as_ref().map(owner),
            cluster_ip: svc.as_ref().and_then(|s| s.spec.as_ref()).and_then(|s| s.cluster_ip.clone()),
            lb: lb.as_ref().map(|lb| LbFacts {
                vip: lb.vip_address.clone().unwrap_or_default(),
                tagged: ours.iter().all(|t| lb.tags.contains(t)),
                pending: lb.provisioning_status.is_pending(),
            }),
            wants_finalizer: self.args.service_finalizer.wants(
                svc.as_ref().and_then(|s| s.spec.as_ref()).and_then(|s| s.type_.as_deref()).unwrap_or("ClusterIP"),
            ),
        };
        let (l, p, m) = klb.counts;
        let describe = match (&klb.lb_id, &lb) {
            (Some(id), Some(_)) => format!("load balancer {id} ({l} listeners, {p} pools, {m} members)"),
            (Some(id), None) => format!("load balancer {id} (gone from Octavia: lbaas creates one)"),
            (None, _) => "no load balancer yet (lbaas creates one)".to_string(),
        };
        let fip_note = match (&klb.floating_ip_id, &fip) {
            (Some(f), None) => format!(" [floating IP {f}: gone from Neutron]"),
            (Some(f), Some(_)) if klb.floating_ip_user => {
                format!(" [floating IP {f}: the Service's loadBalancerIP, left in place, not adopted]")
            }
            (Some(f), Some(_)) if self.args.floating_network_id.is_none() => {
                format!(" [floating IP {f}: left in place, not adopted (no --floating-network-id)]")
            }
            (Some(f), Some(_)) => format!(" [floating IP {f}: adopted]"),
            (None, _) => String::new(),
        };
        let planned = plan::lb_steps(&facts, kuryr::SERVICE_FINALIZER, kuryr_lbaas::core::view::FINALIZER);
        let steps = self.announce(who, &describe, &fip_note, planned);
        for step in steps {
            match step {
                LbStep::TagLoadBalancer => {
                    let Some(lb) = &lb else { anyhow::bail!("no load balancer to tag") };
                    let mut tags = lb.tags.clone();
                    let have: HashSet<String> = tags.iter().cloned().collect();
                    tags.extend(ours.iter().filter(|t| !have.contains(*t)).cloned());
                    self.octavia
                        .set_load_balancer_tags(&lb.id, &tags)
                        .await
                        .with_context(|| format!("tagging load balancer {}", lb.id))?;
                    self.octavia
                        .wait_load_balancer(&lb.id, LB_SETTLE)
                        .await
                        .with_context(|| format!("waiting for load balancer {} after tagging", lb.id))?;
                }
                LbStep::TagFloatingIp => {
                    let Some(f) = &fip else { anyhow::bail!("no floating IP to tag") };
                    let mut tags = f.tags.clone();
                    for t in &ours {
                        tags = plan::with(&tags, t);
                    }
                    self.neutron
                        .set_tags(TaggedResource::FloatingIp, &f.id, &tags)
                        .await
                        .with_context(|| format!("tagging floating IP {}", f.id))?;
                }
                LbStep::AddFinalizer => {
                    edit_finalizers(&services, &klb.name, |f| plan::with(f, kuryr_lbaas::core::view::FINALIZER))
                        .await?;
                }
                LbStep::ReleaseServiceFinalizer => {
                    edit_finalizers(&services, &klb.name, |f| plan::without(f, kuryr::SERVICE_FINALIZER)).await?;
                }
                LbStep::ReleaseKlbFinalizers => edit_finalizers(&klbs, &klb.name, |_| Vec::new()).await?,
                LbStep::DeleteKlb => delete_opt(&klbs, &klb.name).await?,
            }
            self.applied(&format!("{who}: {step}"));
        }
        Ok(())
    }

    /// KuryrNetworks and KuryrNetworkPolicies: listed, left in place.
    async fn kept(&mut self) -> anyhow::Result<()> {
        for kind in [Kind::KuryrNetwork, Kind::KuryrNetworkPolicy] {
            for o in list_kind(&self.kube, kind).await? {
                self.summary.kept += 1;
                let why = match kind {
                    Kind::KuryrNetwork => {
                        "per-namespace networks are not migrated; their ports are, when on the pod network"
                    }
                    _ => {
                        "kuryr-policy makes its own security groups from the NetworkPolicy; Kuryr's stays until removed"
                    }
                };
                say!(
                    "{} {}/{}: kept: {why}",
                    kind.name(),
                    o.metadata.namespace.as_deref().unwrap_or_default(),
                    o.metadata.name.as_deref().unwrap_or_default()
                );
            }
        }
        Ok(())
    }
}
