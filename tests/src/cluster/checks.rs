//! Checks of what a cluster converged to, shared by the end-to-end suites. Each returns an error
//! naming the first thing that is wrong, so a test can poll it ([`wait_until`]) while the
//! services converge and print the last reason when they do not.
//!
//! - [`wait_running`]: the pods of a namespace Running, with the addresses their sandboxes have;
//! - [`allocations`]: the allocator's records agree with the pods, cluster-wide — every running
//!   pod's addresses are its PodVif's and allocated to its uid in a block of its node, no address
//!   is held twice, no allocation without a live PodVif (a leak), no PodVif without its pod;
//! - [`node_state`]: on every node exactly one sandbox, one host veth and one attachment record
//!   per pod (nothing duplicated, nothing left from a failed attempt);
//! - [`reachable`]: pods answer pings within and across nodes;
//! - [`wait_released`]: after every pod was deleted, nothing is left anywhere.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kuryr_vif_allocator::k8s::crd::{AddressBlock, PodVif};

use super::Cluster;
use super::reach;
use crate::kubelet::PodPhase;
use crate::services::wait_until;

/// Pings in flight at once (each is a short-lived `nsenter` + `ping`).
const PINGS_AT_ONCE: usize = 12;

/// A pod Running on a node of the cluster, as the API and its node's kubelet see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningPod {
    /// metadata.name.
    pub name: String,
    /// metadata.uid.
    pub uid: String,
    /// spec.nodeName.
    pub node: String,
    /// status.podIPs, primary first (the sandbox has the same).
    pub ips: Vec<IpAddr>,
    /// The sandbox's network namespace.
    pub netns: PathBuf,
}

/// Waits until the pods of `namespace` are exactly `expected` (no more, none being deleted), all
/// Running with addresses that their sandboxes have too; returns them sorted by name.
pub async fn wait_running(
    cluster: &Cluster,
    namespace: &str,
    expected: usize,
    timeout: Duration,
) -> Result<Vec<RunningPod>> {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), namespace);
    wait_until(&format!("{expected} pods Running in {namespace}"), timeout, || async {
        let list = pods.list(&ListParams::default()).await?.items;
        let mut out = Vec::new();
        let mut waiting = Vec::new();
        for p in &list {
            match running(cluster, namespace, p) {
                Ok(r) => out.push(r),
                Err(e) => waiting.push(format!("{e:#}")),
            }
        }
        ensure!(
            waiting.is_empty() && out.len() == expected,
            "{}/{expected} Running ({} pods in the API); not yet: {}",
            out.len(),
            list.len(),
            waiting.join("; ")
        );
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    })
    .await
}

/// `pod` if it is Running with addresses, not being deleted, and its kubelet's sandbox agrees.
fn running(cluster: &Cluster, namespace: &str, pod: &Pod) -> Result<RunningPod> {
    let name = pod.metadata.name.clone().context("a pod without a name")?;
    ensure!(pod.metadata.deletion_timestamp.is_none(), "{name} is being deleted");
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).with_context(|| format!("{name}: no node"))?;
    let status = pod.status.as_ref().with_context(|| format!("{name}: no status"))?;
    ensure!(status.phase.as_deref() == Some("Running"), "{name}: phase {:?}", status.phase);
    let ips: Vec<IpAddr> = status.pod_ips.iter().flatten().map(|i| i.ip.parse()).collect::<Result<_, _>>()?;
    ensure!(!ips.is_empty(), "{name}: Running without podIPs");
    let kubelet = cluster.kubelets().iter().find(|k| k.node() == node).with_context(|| format!("no kubelet {node}"))?;
    let rec = kubelet.pod(namespace, &name).with_context(|| format!("{name}: unknown to the kubelet of {node}"))?;
    ensure!(rec.phase == PodPhase::Running, "{name}: {:?} for the kubelet", rec.phase);
    ensure!(rec.ips == ips, "{name}: the sandbox has {:?}, the status says {ips:?}", rec.ips);
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    ensure!(rec.uid == uid, "{name}: the kubelet runs uid {}, the API has {uid}", rec.uid);
    let netns = rec.netns.with_context(|| format!("{name}: the sandbox has no netns"))?;
    Ok(RunningPod { name, uid, node, ips, netns })
}

/// What [`allocations`] counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocationSummary {
    /// Pods in the API.
    pub pods: usize,
    /// PodVifs.
    pub pod_vifs: usize,
    /// Addresses allocated across all AddressBlocks.
    pub addresses: usize,
    /// AddressBlocks.
    pub blocks: usize,
}

/// Checks the allocator's records against the pods, in every namespace:
///
/// - every Running pod with addresses has a PodVif of its uid whose VIF has exactly the pod's
///   addresses, each allocated to the pod's uid in an AddressBlock of the pod's node;
/// - no address is held by two pods (in the status or in the blocks);
/// - every allocation in every block belongs to a PodVif that exists, of the same uid, whose VIF
///   carries that address — anything else is a leak;
/// - every PodVif belongs to a pod that exists, of the same uid.
pub async fn allocations(client: &kube::Client) -> Result<AllocationSummary> {
    let pods = Api::<Pod>::all(client.clone()).list(&ListParams::default()).await?.items;
    let vifs = Api::<PodVif>::all(client.clone()).list(&ListParams::default()).await?.items;
    let blocks = Api::<AddressBlock>::all(client.clone()).list(&ListParams::default()).await?.items;

    let key = |ns: &Option<String>, name: &Option<String>| {
        format!("{}/{}", ns.as_deref().unwrap_or_default(), name.as_deref().unwrap_or_default())
    };
    let pod_uids: HashMap<String, String> = pods
        .iter()
        .map(|p| (key(&p.metadata.namespace, &p.metadata.name), p.metadata.uid.clone().unwrap_or_default()))
        .collect();
    // PodVif by namespace/name → (pod uid, its VIF's addresses without prefix length).
    let mut vif_ips: HashMap<String, (String, Vec<String>)> = HashMap::new();
    for v in &vifs {
        let k = key(&v.metadata.namespace, &v.metadata.name);
        match pod_uids.get(&k) {
            Some(uid) if *uid == v.spec.pod_uid => {}
            Some(uid) => bail!("PodVif {k} is of pod uid {}, but the pod {k} has uid {uid}", v.spec.pod_uid),
            None => bail!("PodVif {k} (pod uid {}) has no pod", v.spec.pod_uid),
        }
        let ips = v
            .vif()
            .map(|vif| vif.ips.iter().map(|i| i.address.split('/').next().unwrap_or_default().to_string()).collect())
            .unwrap_or_default();
        vif_ips.insert(k, (v.spec.pod_uid.clone(), ips));
    }
    // Allocation by address → (block node, pod key, uid).
    let mut allocated: BTreeMap<String, (String, String, String)> = BTreeMap::new();
    for b in &blocks {
        for (ip, a) in b.status.iter().flat_map(|s| &s.allocations) {
            let k = format!("{}/{}", a.namespace, a.name);
            let prev = allocated.insert(ip.clone(), (b.spec.node.clone(), k.clone(), a.uid.clone()));
            ensure!(prev.is_none(), "{ip} is allocated in two AddressBlocks ({prev:?} and {k})");
            match vif_ips.get(&k) {
                Some((uid, ips)) if *uid == a.uid && ips.contains(ip) => {}
                Some((uid, ips)) => bail!(
                    "leak: {ip} in block {} ({}) is allocated to {k} uid {}, whose PodVif (uid {uid}) has {ips:?}",
                    b.spec.cidr,
                    b.spec.node,
                    a.uid
                ),
                None => bail!(
                    "leak: {ip} in block {} ({}) is allocated to {k} uid {}, which has no PodVif",
                    b.spec.cidr,
                    b.spec.node,
                    a.uid
                ),
            }
        }
    }
    let mut holders: HashMap<IpAddr, String> = HashMap::new();
    for p in &pods {
        let k = key(&p.metadata.namespace, &p.metadata.name);
        let status = p.status.as_ref();
        if status.and_then(|s| s.phase.as_deref()) != Some("Running") {
            continue;
        }
        let ips: Vec<String> = status.iter().flat_map(|s| s.pod_ips.iter().flatten()).map(|i| i.ip.clone()).collect();
        if ips.is_empty() {
            continue;
        }
        let (uid, node) =
            (p.metadata.uid.clone().unwrap_or_default(), p.spec.as_ref().and_then(|s| s.node_name.clone()));
        let (_, recorded) =
            vif_ips.get(&k).with_context(|| format!("{k} is Running with {ips:?} but has no PodVif"))?;
        ensure!(*recorded == ips, "{k}: the status has {ips:?}, its PodVif {recorded:?}");
        for ip in &ips {
            let (block_node, _, holder) =
                allocated.get(ip).with_context(|| format!("{k}: {ip} is allocated in no AddressBlock"))?;
            ensure!(*holder == uid, "{k}: {ip} is allocated to uid {holder}, the pod is {uid}");
            ensure!(Some(block_node) == node.as_ref(), "{k} on {node:?}: {ip} is in a block of {block_node}");
            if let Some(other) = holders.insert(ip.parse()?, k.clone()) {
                bail!("{ip} is held by both {other} and {k}");
            }
        }
    }
    Ok(AllocationSummary { pods: pods.len(), pod_vifs: vifs.len(), addresses: allocated.len(), blocks: blocks.len() })
}

/// Checks every node against `pods` — which must be every pod of the cluster that is not on the
/// host network: one sandbox (ready), one host-side `kv*` veth and one attachment record per pod
/// running on the node, and nothing else.
pub async fn node_state(cluster: &Cluster, pods: &[RunningPod]) -> Result<()> {
    for node in cluster.nodes() {
        let want = pods.iter().filter(|p| p.node == node.name).count();
        let veths = host_veths(cluster, &node.name).await?;
        ensure!(veths.len() == want, "{}: {} host veths for {want} pods: {veths:?}", node.name, veths.len());
        let sandboxes = node.node.ctd.cri().list_pod_sandboxes().await?;
        ensure!(sandboxes.len() == want, "{}: {} sandboxes for {want} pods", node.name, sandboxes.len());
        let records = node.node.binder.attachment_records();
        ensure!(records == want, "{}: {records} attachment records for {want} pods", node.name);
    }
    Ok(())
}

/// The host-side pod veths (`kv*`) in node `node`'s namespace.
pub async fn host_veths(cluster: &Cluster, node: &str) -> Result<Vec<String>> {
    let node = cluster.node(node).with_context(|| format!("no node {node}"))?;
    let links = node.node.exec(&["ip", "-o", "link", "show"]).await?;
    Ok(links
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n))
        .filter(|n| n.starts_with("kv"))
        .map(String::from)
        .collect())
}

/// Every pod of `from` pings every address of every pod of `to` (itself excepted); a failure is
/// retried once (the first packet also resolves the neighbour). Returns how many pings answered.
pub async fn reachable(from: &[RunningPod], to: &[RunningPod]) -> Result<usize> {
    let jobs: Vec<(&RunningPod, &RunningPod, IpAddr)> = from
        .iter()
        .flat_map(|a| {
            to.iter().filter(move |b| b.uid != a.uid).flat_map(move |b| b.ips.iter().map(move |ip| (a, b, *ip)))
        })
        .collect();
    let results: Vec<_> = futures::stream::iter(jobs)
        .map(|(a, b, ip)| async move {
            let (mut ok, mut out) = reach::ping(&a.netns, ip).await;
            if !ok {
                (ok, out) = reach::ping(&a.netns, ip).await;
            }
            (a, b, ip, ok, out)
        })
        .buffer_unordered(PINGS_AT_ONCE)
        .collect()
        .await;
    if let Some((a, b, ip, _, out)) = results.iter().find(|r| !r.3) {
        bail!("{} ({}) → {} ({}) at {ip}: no answer: {out}", a.name, a.node, b.name, b.node);
    }
    Ok(results.len())
}

/// After every pod was deleted: waits until no pod is left in the API (finalizers removed) or
/// active for a kubelet, no PodVif, no allocation in any AddressBlock, and on every node no host
/// veth, no sandbox and no attachment record.
pub async fn wait_released(cluster: &Cluster, timeout: Duration) -> Result<()> {
    let client = cluster.client();
    let pods: Api<Pod> = Api::all(client.clone());
    let vifs: Api<PodVif> = Api::all(client.clone());
    let blocks: Api<AddressBlock> = Api::all(client.clone());
    wait_until("every pod gone and everything released", timeout, || async {
        let left: Vec<_> = pods.list(&ListParams::default()).await?.items.into_iter().map(|p| p.metadata).collect();
        ensure!(
            left.is_empty(),
            "pods still there: {:?}",
            left.iter().map(|m| (&m.namespace, &m.name, &m.finalizers)).collect::<Vec<_>>()
        );
        for k in cluster.kubelets() {
            let active: Vec<_> = k.pods().into_iter().filter(|r| r.phase != PodPhase::Gone).map(|r| r.name).collect();
            ensure!(active.is_empty(), "{}: pods not gone for the kubelet: {active:?}", k.node());
        }
        let vifs = vifs.list(&ListParams::default()).await?.items;
        ensure!(vifs.is_empty(), "PodVifs left: {:?}", vifs.iter().map(|v| &v.metadata.name).collect::<Vec<_>>());
        let blocks = blocks.list(&ListParams::default()).await?.items;
        ensure!(!blocks.is_empty(), "no AddressBlock at all");
        for b in &blocks {
            let used = b.status.as_ref().map(|s| s.allocations.len()).unwrap_or(0);
            ensure!(used == 0, "block {} still has {used} allocations: {:?}", b.spec.cidr, b.status);
        }
        node_state(cluster, &[]).await
    })
    .await
}
