//! End to end with the embedded backend, everything real: the API server, kuryr-watcher and
//! kuryr-vif-allocator under their ServiceAccounts, two nodes (containerd + kuryr-cni +
//! kuryr-binder in their own network namespaces, joined by an underlay bridge) each run by the
//! test kubelet. Pods created through the API get distinct addresses from the PodNetwork, their
//! status shows them, they reach each other within and across nodes over IPv4 and IPv6, a pod
//! whose CNI ADD fails (its node's binder is down) gets a FailedCreatePodSandBox Event and starts
//! once the binder is back, and deleting them returns everything: pods gone (finalizers removed), no PodVif, no allocation in
//! any AddressBlock, no host-side veth on any node. The services' metrics are scraped before,
//! during and after: CNI calls by operation and code (an ADD with a missing netns counted with
//! its code), latency histograms, network-ready latency, allocations and releases, the IPAM's
//! API calls and addresses per node, queue depths and the watcher's index move as they must.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kuryr_tests::cluster::checks;
use kuryr_tests::cluster::reach::{self, PodEndpoint, Summary};
use kuryr_tests::cluster::{Cluster, ClusterOptions, run_scenario};
use kuryr_tests::metrics::Scrape;
use kuryr_tests::objects;
use kuryr_tests::services::wait_until;
use kuryr_tests::shim::run_shim;
use kuryr_vif_allocator::core::ipam::ipnet::IpNet;
use kuryr_vif_allocator::k8s::crd::{AddressBlock, PodVif};

const NAMESPACE: &str = "e2e";
const PODS_PER_NODE: usize = 4;
const V4_CIDR: &str = "10.244.0.0/16";
const V6_CIDR: &str = "fd00:10:244::/56";
/// Bound on all pods Running; each normally takes well under a second.
const RUNNING_TIMEOUT: Duration = Duration::from_secs(90);
/// Bound on everything being released after the pods are deleted.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pods_get_pool_addresses_reach_each_other_across_nodes_and_release_everything() {
    let opts =
        ClusterOptions { nodes: 2, network_cidrs: vec![V4_CIDR.into(), V6_CIDR.into()], ..ClusterOptions::default() };
    run_scenario("e2e", opts, async |c| scenario(c).await).await.unwrap_or_else(|e| panic!("{e:#}"));
}

async fn scenario(cluster: &mut Cluster) -> Result<()> {
    let client = cluster.client();
    let pods = objects::namespace_with_pods(&client, NAMESPACE).await?;
    let metrics_before = Metrics::scrape(cluster).await?;

    // Pods bound to their nodes (there is no scheduler), created through the API.
    let t = Instant::now();
    let mut wanted = BTreeMap::new();
    for (n, node) in cluster.nodes().iter().enumerate() {
        for i in 0..PODS_PER_NODE {
            let name = format!("p{}-{i}", n + 1);
            pods.create(&PostParams::default(), &pod(&name, &node.name)).await?;
            wanted.insert(name, node.name.clone());
        }
    }
    let running = wait_until("every pod Running with its addresses", RUNNING_TIMEOUT, || async {
        let list = pods.list(&ListParams::default()).await?.items;
        let ready = list.iter().filter(|p| is_running(p)).count();
        ensure!(ready == wanted.len(), "{ready}/{} Running", wanted.len());
        Ok(list)
    })
    .await
    .map_err(|e| {
        anyhow::anyhow!("{e:#}\nkubelets: {:#?}", cluster.kubelets().iter().map(|k| k.pods()).collect::<Vec<_>>())
    })?;
    eprintln!("{} pods Running after {:?}", running.len(), t.elapsed());

    // Addresses: one per family from the PodNetwork, all distinct, as the sandbox has them, and
    // the node's address as hostIP.
    let (v4_net, v6_net): (IpNet, IpNet) = (V4_CIDR.parse()?, V6_CIDR.parse()?);
    let mut seen = HashSet::new();
    let mut endpoints = Vec::new();
    for p in &running {
        let name = p.metadata.name.clone().unwrap_or_default();
        let node = &wanted[&name];
        let status = p.status.as_ref().context("no status")?;
        let ips: Vec<IpAddr> = status.pod_ips.iter().flatten().map(|i| i.ip.parse()).collect::<Result<_, _>>()?;
        ensure!(ips.len() == 2, "{name}: podIPs {ips:?}, want one IPv4 and one IPv6");
        ensure!(v4_net.contains(&ips[0]) && v6_net.contains(&ips[1]), "{name}: {ips:?} not in {V4_CIDR} / {V6_CIDR}");
        ensure!(status.pod_ip.as_deref() == Some(&*ips[0].to_string()), "{name}: podIP {:?}", status.pod_ip);
        for ip in &ips {
            ensure!(seen.insert(*ip), "{ip} handed out twice (second time to {name})");
        }
        let host = cluster.node(node).context("node")?;
        ensure!(status.host_ip.as_deref() == Some(&*host.ips[0].to_string()), "{name}: hostIP {:?}", status.host_ip);
        let kubelet = cluster.kubelets().iter().find(|k| k.node() == node).context("kubelet")?;
        let rec = kubelet.pod(NAMESPACE, &name).context("the kubelet has no record")?;
        ensure!(rec.ips == ips, "{name}: sandbox has {:?}, status says {ips:?}", rec.ips);
        eprintln!(
            "{name} on {node}: {ips:?}, network ready {:?} after first seen (RunPodSandbox {:?}, {} attempt(s))",
            rec.network_ready.unwrap_or_default(),
            rec.sandbox_call.unwrap_or_default(),
            rec.attempts
        );
        endpoints.push(PodEndpoint { pod: name, node: node.clone(), netns: rec.netns.context("no netns")?, ips });
    }

    // The allocator's records agree: a PodVif per pod with the same addresses, and each address
    // allocated to the pod's uid in an AddressBlock of the pod's node.
    let vifs: Api<PodVif> = Api::namespaced(client.clone(), NAMESPACE);
    let blocks: Api<AddressBlock> = Api::all(client.clone());
    let all_blocks = blocks.list(&ListParams::default()).await?.items;
    for p in &running {
        let name = p.metadata.name.clone().unwrap_or_default();
        let uid = p.metadata.uid.clone().unwrap_or_default();
        let vif = vifs.get(&name).await.with_context(|| format!("PodVif {name}"))?;
        let vif_ips: Vec<String> = vif
            .vif()
            .map(|v| v.ips.iter().map(|i| i.address.split('/').next().unwrap_or_default().to_string()).collect())
            .unwrap_or_default();
        let status_ips: Vec<String> =
            p.status.iter().flat_map(|s| s.pod_ips.iter().flatten()).map(|i| i.ip.clone()).collect();
        ensure!(vif_ips == status_ips, "{name}: PodVif {vif_ips:?} vs status {status_ips:?}");
        for ip in &status_ips {
            let block = all_blocks
                .iter()
                .find(|b| b.status.as_ref().is_some_and(|s| s.allocations.get(ip).is_some_and(|a| a.uid == uid)))
                .with_context(|| format!("{name}: {ip} is allocated to its uid in no AddressBlock"))?;
            ensure!(
                block.spec.node == wanted[&name],
                "{name}: {ip} is in block {} of {}",
                block.spec.cidr,
                block.spec.node
            );
        }
    }

    // The services' metrics moved with those pods. A binder answers ADD of an embedded VIF before
    // reporting it plugged (in the background), and the allocator counts the ReportPlugged call
    // and the pod's READY latency only then: wait for them rather than reading them once.
    wait_until("the metrics to show every pod started", RUNNING_TIMEOUT, || async {
        let m = Metrics::scrape(cluster).await?;
        m.check_pods_started(&metrics_before, cluster, PODS_PER_NODE)
    })
    .await?;
    cni_failure_is_counted(cluster).await?;

    // Reachability: every pod pings every other pod, IPv4 and IPv6, within and across nodes.
    let t = Instant::now();
    let pings = reach::ping_all(&endpoints).await;
    let summary = Summary::of(&pings);
    eprintln!("{} pings in {:?}: {summary}", pings.len(), t.elapsed());
    for p in pings.iter().filter(|p| p.first_failure.is_some()) {
        let (from, to) = (&endpoints[p.from].pod, &endpoints[p.to].pod);
        eprintln!("{from} → {to} ({}) answered only on a second try: {:?}", p.ip, p.first_failure);
    }
    let n = PODS_PER_NODE;
    let local = 2 * n * (n - 1);
    let remote = 2 * n * n;
    ensure!(
        summary.v4_local.1 == local
            && summary.v4_remote.1 == remote
            && summary.v6_local.1 == local
            && summary.v6_remote.1 == remote,
        "unexpected ping counts: {summary}"
    );
    if let Some(p) = pings.iter().find(|p| !p.ok) {
        anyhow::bail!(
            "{summary}; first failure: {} → {} ({}): {}",
            endpoints[p.from].pod,
            endpoints[p.to].pod,
            p.ip,
            p.output
        );
    }
    // The check can fail: an address of the pool that no pod holds does not answer.
    let unused: IpAddr = "10.244.255.254".parse()?;
    ensure!(!seen.contains(&unused), "{unused} is in use");
    let (answered, _) = reach::ping(&endpoints[0].netns, unused).await;
    ensure!(!answered, "an unallocated address answered a ping");

    // A failing RunPodSandbox is retried with backoff and reported as an Event carrying the CNI
    // error: with node-2's binder down, kuryr-cni fails fast; once it is back the pod starts.
    let node2 = cluster.nodes()[1].name.clone();
    cluster.node_mut(&node2).context("node-2")?.node.binder.stop().await?;
    pods.create(&PostParams::default(), &pod("late", &node2)).await?;
    let events: Api<Event> = Api::namespaced(client.clone(), NAMESPACE);
    let event = wait_until("a FailedCreatePodSandBox event", RUNNING_TIMEOUT, || async {
        let list = events.list(&ListParams::default().fields("involvedObject.name=late")).await?.items;
        list.into_iter().find(|e| e.reason.as_deref() == Some("FailedCreatePodSandBox")).context("none yet")
    })
    .await?;
    let message = event.message.unwrap_or_default();
    ensure!(message.contains(r#"plugin type="kuryr-cni" failed (add)"#), "event message: {message}");
    ensure!(event.type_.as_deref() == Some("Warning"), "event type {:?}", event.type_);
    cluster.node_mut(&node2).context("node-2")?.node.binder.restart().await?;
    wait_until("the late pod Running", RUNNING_TIMEOUT, || async {
        ensure!(is_running(&pods.get("late").await?), "not Running");
        Ok(())
    })
    .await?;
    let kubelet2 = cluster.kubelets().iter().find(|k| k.node() == node2).context("kubelet")?;
    let late = kubelet2.pod(NAMESPACE, "late").context("no record of the late pod")?;
    ensure!(late.attempts >= 2, "late pod started after {} attempt(s)", late.attempts);
    eprintln!("late: failed with {message:?}, Running after {} attempts", late.attempts);
    wanted.insert("late".to_string(), node2);

    // Deletion: the kubelets tear the sandboxes down and delete the pods; the allocator releases
    // the VIFs and removes its finalizer.
    let metrics_deleting = Metrics::scrape(cluster).await?;
    let t = Instant::now();
    for name in wanted.keys() {
        pods.delete(name, &DeleteParams::default()).await?;
    }
    wait_until("every pod gone from the API", RELEASE_TIMEOUT, || async {
        let left: Vec<_> = pods.list(&ListParams::default()).await?.items.into_iter().map(|p| p.metadata).collect();
        ensure!(
            left.is_empty(),
            "still there: {:?}",
            left.iter().map(|m| (&m.name, &m.finalizers)).collect::<Vec<_>>()
        );
        Ok(())
    })
    .await?;
    eprintln!("pods gone {:?} after deletion", t.elapsed());
    // Nothing left: finalizers gone, no PodVif, no allocation, no veth, sandbox or record.
    checks::wait_released(cluster, RELEASE_TIMEOUT).await?;
    // The metrics followed: DELs, releases, no address used, queues drained.
    let all = wanted.len() as f64;
    let metrics_after = wait_until("the metrics to show every pod released", RELEASE_TIMEOUT, || async {
        let m = Metrics::scrape(cluster).await?;
        m.check_pods_released(&metrics_deleting, &metrics_before, cluster, all)?;
        Ok(m)
    })
    .await?;
    eprintln!(
        "metrics: {} allocations, {} releases, {} IPAM block writes, successful ADD mean {:.1} ms in the binders",
        metrics_after.allocator.sum("kuryr_allocator_allocations_total", &[]),
        metrics_after.allocator.sum("kuryr_allocator_releases_total", &[]),
        metrics_after.allocator.count(IPAM_CALLS, &[("operation", "write_block_status")]),
        metrics_after.mean_add_ms()
    );
    Ok(())
}

const IPAM_CALLS: &str = "kuryr_allocator_ipam_api_request_duration_seconds";
const ADD_OK: &[(&str, &str)] = &[("op", "ADD"), ("code", "0")];
const DEL_OK: &[(&str, &str)] = &[("op", "DEL"), ("code", "0")];

/// What the watcher, the allocator and each node's binder expose at one moment.
struct Metrics {
    watcher: Scrape,
    allocator: Scrape,
    /// By node name; a binder listens on its node's own loopback.
    binders: BTreeMap<String, Scrape>,
}

impl Metrics {
    async fn scrape(cluster: &Cluster) -> Result<Metrics> {
        let mut binders = BTreeMap::new();
        for n in cluster.nodes() {
            binders.insert(n.name.clone(), Scrape::in_netns(&n.node.netns_path(), "127.0.0.1:9631").await?);
        }
        Ok(Metrics {
            watcher: Scrape::http(&cluster.watcher().metrics).await?,
            allocator: Scrape::http(&cluster.allocator().metrics).await?,
            binders,
        })
    }

    fn binder(&self, node: &str) -> Result<&Scrape> {
        self.binders.get(node).with_context(|| format!("no scrape of {node}'s binder"))
    }

    /// `per_node` pods were started on every node since `before`.
    fn check_pods_started(&self, before: &Metrics, cluster: &Cluster, per_node: usize) -> Result<()> {
        let per_node = per_node as f64;
        let all = per_node * cluster.nodes().len() as f64;
        for n in cluster.nodes() {
            let (b, a) = (before.binder(&n.name)?, self.binder(&n.name)?);
            let ctx = || format!("binder of {}", n.name);
            a.moved(b, "kuryr_cni_requests_total", ADD_OK).at_least(per_node).with_context(ctx)?;
            a.moved_count(b, "kuryr_cni_request_duration_seconds", ADD_OK).at_least(per_node).with_context(ctx)?;
            a.moved_count(b, "kuryr_cni_add_vif_wait_seconds", &[]).at_least(per_node).with_context(ctx)?;
            a.moved_count(b, "kuryr_cni_add_ready_wait_seconds", &[]).at_least(per_node).with_context(ctx)?;
            // The pods' addresses, as the allocator's IPAM last wrote them: one per pod and
            // family in the node's blocks, and the rest of the blocks free.
            for family in ["ipv4", "ipv6"] {
                let labels = [("node", n.name.as_str()), ("family", family), ("state", "used")];
                let used = self.allocator.value("kuryr_allocator_ipam_addresses", &labels)?;
                ensure!(used == per_node, "{}: {used} {family} addresses used, want {per_node}", n.name);
                let labels = [("node", n.name.as_str()), ("family", family), ("state", "free")];
                ensure!(self.allocator.value("kuryr_allocator_ipam_addresses", &labels)? > 0.0);
            }
        }
        let (b, a) = (&before.allocator, &self.allocator);
        a.moved(b, "kuryr_allocator_allocations_total", &[]).exactly(all)?;
        a.moved_count(b, "kuryr_allocator_vif_ready_seconds", &[]).exactly(all)?;
        a.moved_count(b, "kuryr_allocator_pod_ready_seconds", &[]).at_least(all)?;
        let plugged = [("method", "ReportPlugged"), ("code", "OK")];
        a.moved(b, "grpc_server_handled_total", &plugged).at_least(all)?;
        // The embedded backend's API calls: batched status writes, reads of the node's blocks.
        a.moved_count(b, IPAM_CALLS, &[("operation", "write_block_status")]).at_least(1.0)?;
        ensure!(a.count(IPAM_CALLS, &[("operation", "list_blocks")]) >= 1.0, "no list_blocks call recorded");
        ensure!(a.value("kuryr_allocator_vifs", &[])? == all, "kuryr_allocator_vifs");
        ensure!(a.has("kuryr_allocator_queue_depth"), "no kuryr_allocator_queue_depth");
        // The watcher indexes the pods and streams them to the allocator.
        let (b, a) = (&before.watcher, &self.watcher);
        ensure!(a.value("kuryr_watcher_objects", &[("kind", "pod")])? >= all, "kuryr_watcher_objects{{kind=pod}}");
        ensure!(a.value("kuryr_watcher_subscribers", &[])? >= 1.0, "no watcher subscriber");
        a.moved(b, "kuryr_watcher_deltas_total", &[("kind", "pod")]).at_least(all)?;
        Ok(())
    }

    /// Every one of `all` pods was torn down (since `deleting`) and released (since `before`).
    fn check_pods_released(&self, deleting: &Metrics, before: &Metrics, cluster: &Cluster, all: f64) -> Result<()> {
        let mut dels = 0.0;
        for n in cluster.nodes() {
            let (d, a) = (deleting.binder(&n.name)?, self.binder(&n.name)?);
            dels += a.moved(d, "kuryr_cni_requests_total", DEL_OK).delta();
            let failed = a.moved(d, "kuryr_cni_requests_total", &[("op", "DEL")]).delta()
                - a.moved(d, "kuryr_cni_requests_total", DEL_OK).delta();
            ensure!(failed == 0.0, "{}: {failed} DELs failed", n.name);
            a.moved_count(d, "kuryr_cni_request_duration_seconds", DEL_OK)
                .at_least(1.0)
                .with_context(|| n.name.clone())?;
            for family in ["ipv4", "ipv6"] {
                let labels = [("node", n.name.as_str()), ("family", family), ("state", "used")];
                let used = self.allocator.value("kuryr_allocator_ipam_addresses", &labels)?;
                ensure!(used == 0.0, "{}: {used} {family} addresses still used", n.name);
            }
        }
        ensure!(dels >= all, "{dels} successful DELs for {all} pods");
        let a = &self.allocator;
        a.moved(&before.allocator, "kuryr_allocator_releases_total", &[]).exactly(all)?;
        ensure!(a.value("kuryr_allocator_vifs", &[])? == 0.0, "VIFs still held");
        ensure!(a.value("kuryr_allocator_queue_depth", &[])? == 0.0, "allocator queue not drained");
        ensure!(a.value("kuryr_allocator_queue_failing", &[])? == 0.0, "allocator reconciles still failing");
        let pods_before = before.watcher.value("kuryr_watcher_objects", &[("kind", "pod")])?;
        let pods_now = self.watcher.value("kuryr_watcher_objects", &[("kind", "pod")])?;
        ensure!(pods_now == pods_before, "the watcher holds {pods_now} pods, {pods_before} before the test");
        Ok(())
    }

    /// Mean successful ADD time over every binder, in milliseconds.
    fn mean_add_ms(&self) -> f64 {
        let (mut sum, mut count) = (0.0, 0.0);
        for b in self.binders.values() {
            sum += b.hist_sum("kuryr_cni_request_duration_seconds", ADD_OK);
            count += b.count("kuryr_cni_request_duration_seconds", ADD_OK);
        }
        if count > 0.0 { sum / count * 1e3 } else { 0.0 }
    }
}

/// An ADD whose netns does not exist fails with CNI code 4 and is counted with that code (and
/// its latency) in the binder.
async fn cni_failure_is_counted(cluster: &Cluster) -> Result<()> {
    let node = &cluster.nodes()[0];
    let before = Scrape::in_netns(&node.node.netns_path(), "127.0.0.1:9631").await?;
    let conf = serde_json::json!({
        "cniVersion": "1.1.0", "name": "kuryr", "type": "kuryr-cni", "binderSocket": node.node.binder.socket,
    });
    let env = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "metrics-failing-add"),
        ("CNI_NETNS", "/var/run/netns/kuryr-no-such-netns"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
        ("CNI_ARGS", "K8S_POD_NAMESPACE=e2e;K8S_POD_NAME=ghost;K8S_POD_UID=00000000-0000-0000-0000-000000000000"),
    ];
    let out = run_shim(&env, conf.to_string().as_bytes())?;
    ensure!(out.code != 0, "an ADD into a missing netns succeeded: {}", out.stdout);
    let code = out.json()?["code"].as_u64().context("no CNI error code")?;
    ensure!(code == 4, "an ADD into a missing netns failed with code {code}: {}", out.stdout);
    let after = Scrape::in_netns(&node.node.netns_path(), "127.0.0.1:9631").await?;
    let failed = [("op", "ADD"), ("code", "4")];
    after.moved(&before, "kuryr_cni_requests_total", &failed).exactly(1.0)?;
    after.moved_count(&before, "kuryr_cni_request_duration_seconds", &failed).at_least(1.0)?;
    after.moved(&before, "kuryr_cni_requests_total", ADD_OK).exactly(0.0)?;
    Ok(())
}

fn pod(name: &str, node: &str) -> Pod {
    objects::pod(name).namespace(NAMESPACE).node(node).build()
}

fn is_running(p: &Pod) -> bool {
    p.status
        .as_ref()
        .is_some_and(|s| s.phase.as_deref() == Some("Running") && s.pod_ips.as_ref().is_some_and(|v| !v.is_empty()))
}
