//! `make bench-kubelet`: pod created → Running with the real kubelet and kube-scheduler, kuryr
//! against the reference plugins on the same cluster in one run.
//!
//! One cluster of real nodes ([`RealCluster`]: kubelet on containerd, kube-scheduler, the full
//! controller manager) starts with the reference plugins (bridge + host-local + portmap). Arm 1
//! creates `BENCH_KUBELET_PODS` pods (default 300) at `BENCH_KUBELET_RATE` pods/s (default 20),
//! unpinned (the scheduler places them), and measures, per pod, from just before its create
//! request to the moment a watch sees it Running; then deletes them and waits until they are gone.
//! The reference configuration is then removed from the nodes and kuryr installed from
//! `deploy/overlays/embedded` as pods (its binders write their CNI configuration); arm 2 repeats
//! the same workload. Both arms use the same API server, scheduler, kubelets and runtimes, one after
//! the other, so the ratio says what the network plugin costs; the reference arm runs without
//! kuryr's control plane on the machine, so any load that adds counts against kuryr.
//!
//! Where the time goes is printed beside it: the CPU seconds each group of processes spent during
//! each arm (from the first create to the last pod Running: utime + stime of every process, with
//! the children it reaped — the CNI plugins count towards containerd, which runs them), and the
//! requests the API server served (`apiserver_request_total`), per arm, and the Events recorded
//! meanwhile by type, reason and the kind and namespace of their object (a probe failing under
//! load, a sandbox retried: what the request counts alone do not say).
//!
//! Goal: kuryr p99 ≤ 1 s and ≤ 1.1× the reference.
#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Container, Event as CoreEvent, Namespace, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::watcher::{self, Event, watcher};
use kuryr_tests::apirequests::{Requests, apiserver_requests, requests_between};
use kuryr_tests::conformance::kuryr_image;
use kuryr_tests::procstat::CpuSnapshot;
use kuryr_tests::realcluster::{NodeCni, RealCluster, RealClusterOptions};
use kuryr_tests::services::bin_path;
use kuryr_tests::stats::Stats;
use kuryr_tests::util::{env_script, parse_env_file, repo_root};

/// Bound on one arm's pods all Running after the last create.
const RUNNING_TIMEOUT: Duration = Duration::from_secs(300);

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::main]
async fn main() -> Result<()> {
    let pods: usize = env_or("BENCH_KUBELET_PODS", 300);
    let rate: f64 = env_or("BENCH_KUBELET_RATE", 20.0);
    let nodes: usize = env_or("BENCH_KUBELET_NODES", 2);
    println!(
        "kubelet-bench: pod created → Running, {pods} pods at {rate}/s over {nodes} real nodes, reference vs kuryr\n"
    );

    let images_dir = repo_root().join("target/kuryr-images");
    let listing = std::process::Command::new("bash")
        .arg(env_script("images/build.sh"))
        .arg(&images_dir)
        .output()
        .context("tests/env/images/build.sh")?;
    anyhow::ensure!(listing.status.success(), "images/build.sh: {}", String::from_utf8_lossy(&listing.stderr));
    let env: HashMap<String, String> =
        parse_env_file(&std::fs::read_to_string(images_dir.join("images.env"))?).into_iter().collect();
    let get = |k: &str| env.get(k).cloned().with_context(|| format!("images.env lacks {k}"));
    let bin_dir = bin_path("kuryr-binder")?.parent().map(PathBuf::from).context("binary directory")?;
    let kuryr = kuryr_image(&bin_dir, &images_dir).await?;
    let busybox = get("BUSYBOX_IMAGE")?;

    let t = Instant::now();
    let cluster = RealCluster::start(RealClusterOptions {
        nodes,
        cni: NodeCni::Bridge,
        images: vec![get("PAUSE_TAR")?.into(), get("BUSYBOX_TAR")?.into(), kuryr],
        sandbox_image: get("PAUSE_IMAGE")?,
        ..RealClusterOptions::default()
    })
    .await?;
    cluster.wait_nodes_ready().await?;
    println!("cluster of {nodes} real nodes with the reference plugins up in {:.1} s", t.elapsed().as_secs_f64());

    let result = async {
        let reference = arm(&cluster, "bench-reference", &busybox, pods, rate).await.context("reference arm")?;
        println!("  reference: {}", line(&reference.stats));

        // Switch the nodes to kuryr: the reference configuration goes, kuryr's binders write theirs.
        for n in cluster.nodes() {
            std::fs::remove_file(n.path("/etc/cni/net.d/10-bridge.conflist"))
                .with_context(|| format!("removing the reference conflist of {}", n.name))?;
        }
        let t = Instant::now();
        cluster.install_kuryr("embedded", "").await?;
        println!("  kuryr installed from deploy/overlays/embedded, nodes Ready in {:.1} s", t.elapsed().as_secs_f64());
        let kuryr = arm(&cluster, "bench-kuryr", &busybox, pods, rate).await.context("kuryr arm")?;
        println!("  kuryr:     {}", line(&kuryr.stats));
        Ok::<_, anyhow::Error>((reference, kuryr))
    }
    .await;
    let down = cluster.shutdown().await;
    let (reference, kuryr) = result?;
    down?;

    println!("\n  {:<28} {:>10} {:>10} {:>8}", "CPU seconds during the arm", "reference", "kuryr", "ratio");
    let groups: BTreeSet<&String> = reference.cpu.keys().chain(kuryr.cpu.keys()).collect();
    let of = |a: &Arm, g: &str| a.cpu.get(g).copied().unwrap_or(0.0);
    for g in groups {
        let (r, k) = (of(&reference, g), of(&kuryr, g));
        if r < 0.05 && k < 0.05 {
            continue;
        }
        let ratio = if r > 0.0 { format!("{:.2}x", k / r) } else { "-".into() };
        println!("  {g:<28} {r:>10.1} {k:>10.1} {ratio:>8}");
    }
    let (rt, kt) = (reference.cpu.values().sum::<f64>(), kuryr.cpu.values().sum::<f64>());
    println!("  {:<28} {rt:>10.1} {kt:>10.1} {:>7.2}x", "all processes", kt / rt.max(f64::MIN_POSITIVE));
    let (rq, kq) = (reference.requests.values().sum::<f64>(), kuryr.requests.values().sum::<f64>());
    println!("  {:<28} {rq:>10.0} {kq:>10.0} {:>7.2}x", "API requests served", kq / rq.max(1.0));
    requests_table(&reference.requests, &kuryr.requests, pods);
    events_table(&reference.events, &kuryr.events);
    let (reference, kuryr) = (reference.stats, kuryr.stats);

    println!("\n  {:<28} {:>8} {:>8} {:>8} {:>8} {:>8}", "pod created → Running (ms)", "n", "p50", "p90", "p99", "max");
    for (name, s) in [("reference (bridge+host-local)", &reference), ("kuryr", &kuryr)] {
        println!("  {:<28} {:>8} {:>8.0} {:>8.0} {:>8.0} {:>8.0}", name, s.n, s.p50, s.p90, s.p99, s.max);
    }
    let (r50, r99) = (kuryr.p50 / reference.p50, kuryr.p99 / reference.p99);
    println!("  {:<28} {:>8} {:>7.2}x {:>8} {:>7.2}x", "ratio kuryr/reference", "", r50, "", r99);
    println!(
        "\ngoal: kuryr p99 ≤ 1000 ms ({}) and ≤ 1.1× the reference ({})",
        if kuryr.p99 <= 1000.0 { "met" } else { "missed" },
        if r99 <= 1.1 { "met" } else { "missed" }
    );
    println!("ratio kuryr/reference: p50 {r50:.2}x  p99 {r99:.2}x");
    Ok(())
}

/// The API requests of the two arms side by side, by (verb, resource), the largest differences
/// first: which requests the network plugin added (or saved), per pod.
fn requests_table(reference: &Requests, kuryr: &Requests, pods: usize) {
    let per_pod = |n: f64| n / pods.max(1) as f64;
    let keys: BTreeSet<&(String, String)> = reference.keys().chain(kuryr.keys()).collect();
    let mut rows: Vec<(&(String, String), f64, f64)> = keys
        .into_iter()
        .map(|k| (k, reference.get(k).copied().unwrap_or(0.0), kuryr.get(k).copied().unwrap_or(0.0)))
        .collect();
    rows.sort_by(|a, b| (b.2 - b.1).abs().total_cmp(&(a.2 - a.1).abs()).then_with(|| a.0.cmp(b.0)));
    println!(
        "\n  {:<44} {:>10} {:>10} {:>14}",
        "API requests by verb and resource", "reference", "kuryr", "kuryr − ref/pod"
    );
    for ((verb, resource), r, k) in rows.into_iter().take(20) {
        println!("  {:<44} {r:>10.0} {k:>10.0} {:>+14.2}", format!("{verb} {resource}"), per_pod(k - r));
    }
}

fn line(s: &Stats) -> String {
    format!("{} pods, p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms", s.n, s.p50, s.p99, s.max)
}

/// What one arm measured.
struct Arm {
    /// Pod created → Running, ms.
    stats: Stats,
    /// CPU seconds by process group, first create → last pod Running.
    cpu: BTreeMap<String, f64>,
    /// Requests the API server served meanwhile, by (verb, resource).
    requests: Requests,
    /// Events recorded meanwhile (counted with their repeats), by [`event_key`].
    events: BTreeMap<String, i64>,
}

/// Every Event's uid → (key, count): its repeats raise the count of one Event.
async fn event_counts(client: &kube::Client, arm_namespace: &str) -> Result<HashMap<String, (String, i64)>> {
    let list = Api::<CoreEvent>::all(client.clone()).list(&ListParams::default()).await.context("listing Events")?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|e| {
            let uid = e.metadata.uid.clone()?;
            // Repeats raise `count` (core/v1) or `series.count` (events.k8s.io/v1).
            let repeats = e.count.max(e.series.as_ref().and_then(|s| s.count)).unwrap_or(1).max(1);
            Some((uid, (event_key(&e, arm_namespace), i64::from(repeats))))
        })
        .collect())
}

/// `type reason (kind in namespace)`, the arm's own namespace as `bench`.
fn event_key(e: &CoreEvent, arm_namespace: &str) -> String {
    let ns = e.involved_object.namespace.as_deref().unwrap_or("-");
    let ns = if ns == arm_namespace { "bench" } else { ns };
    format!(
        "{} {} ({} in {ns})",
        e.type_.as_deref().unwrap_or("-"),
        e.reason.as_deref().unwrap_or("-"),
        e.involved_object.kind.as_deref().unwrap_or("-")
    )
}

/// The Events recorded between two [`event_counts`] reads, by key.
fn events_between(
    before: &HashMap<String, (String, i64)>,
    after: &HashMap<String, (String, i64)>,
) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    for (uid, (key, n)) in after {
        let earlier = before.get(uid).map_or(0, |(_, n)| *n);
        if *n > earlier {
            *out.entry(key.clone()).or_insert(0) += n - earlier;
        }
    }
    out
}

/// The Events of the two arms side by side, the largest differences first.
fn events_table(reference: &BTreeMap<String, i64>, kuryr: &BTreeMap<String, i64>) {
    let keys: BTreeSet<&String> = reference.keys().chain(kuryr.keys()).collect();
    let mut rows: Vec<(&String, i64, i64)> = keys
        .into_iter()
        .map(|k| (k, reference.get(k).copied().unwrap_or(0), kuryr.get(k).copied().unwrap_or(0)))
        .collect();
    rows.sort_by(|a, b| (b.2 - b.1).abs().cmp(&(a.2 - a.1).abs()).then_with(|| a.0.cmp(b.0)));
    println!("\n  {:<60} {:>10} {:>10}", "Events during the arm (with repeats)", "reference", "kuryr");
    for (key, r, k) in rows.into_iter().take(20) {
        println!("  {key:<60} {r:>10} {k:>10}");
    }
}

/// The group a process's CPU counts in, by its command name.
fn group(comm: &str) -> String {
    match comm {
        c if c.starts_with("kuryr-") => c.to_string(),
        c if c.starts_with("kube-controller") => "kube-controller-manager".into(),
        c if c.starts_with("containerd-shim") => "containerd-shim".into(),
        "kube-apiserver" | "etcd" | "kubelet" | "kube-scheduler" | "containerd" | "coredns" => comm.to_string(),
        c if c.starts_with("kubelet-bench") => "this benchmark".into(),
        _ => "other".into(),
    }
}

/// One arm: `pods` pods created at `rate`/s in a fresh namespace, each timed from just before its
/// create request to its first Running sighting; then all deleted and waited for.
async fn arm(cluster: &RealCluster, namespace: &str, image: &str, pods: usize, rate: f64) -> Result<Arm> {
    let client = cluster.client();
    kuryr_tests::objects::create_namespace(&client, namespace).await?;
    // The namespace's default ServiceAccount (pods wait for it otherwise).
    cluster
        .wait(&format!("the default ServiceAccount of {namespace}"), Duration::from_secs(60), || async {
            cluster.kubectl(&["-n", namespace, "get", "serviceaccount", "default"]).await.map(|_| ())
        })
        .await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let created: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let running: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let watch = {
        let (api, running) = (api.clone(), running.clone());
        tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default()).boxed();
            while let Some(ev) = events.next().await {
                let now = Instant::now();
                let pods = match ev {
                    Ok(Event::Apply(p) | Event::InitApply(p)) => vec![p],
                    _ => continue,
                };
                for p in pods {
                    let is_running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                    if let (true, Some(name)) = (is_running, p.metadata.name) {
                        running.lock().unwrap_or_else(PoisonError::into_inner).entry(name).or_insert(now);
                    }
                }
            }
        })
    };
    let interval = Duration::from_secs_f64(1.0 / rate);
    let cpu_before = CpuSnapshot::take();
    let requests_before = apiserver_requests(&client).await?;
    let events_before = event_counts(&client, namespace).await?;
    let start = Instant::now();
    let mut creates = tokio::task::JoinSet::new();
    for i in 0..pods {
        let due = start + interval.mul_f64(i as f64);
        tokio::time::sleep_until(due.into()).await;
        let (api, created) = (api.clone(), created.clone());
        let name = format!("p-{i}");
        let pod = bench_pod(&name, image);
        created.lock().unwrap_or_else(PoisonError::into_inner).insert(name.clone(), Instant::now());
        creates.spawn(async move {
            api.create(&PostParams::default(), &pod).await.map(|_| ()).with_context(|| format!("creating {name}"))
        });
    }
    while let Some(r) = creates.join_next().await {
        r??;
    }
    let deadline = Instant::now() + RUNNING_TIMEOUT;
    loop {
        let n = running.lock().unwrap_or_else(PoisonError::into_inner).len();
        if n >= pods {
            break;
        }
        if Instant::now() > deadline {
            watch.abort();
            bail!("only {n}/{pods} pods Running {RUNNING_TIMEOUT:?} after the last create");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    watch.abort();
    let cpu = cpu_before.since(&CpuSnapshot::take(), group);
    let requests: Requests =
        requests_between(&requests_before, &apiserver_requests(&client).await?).into_iter().collect();
    let events = events_between(&events_before, &event_counts(&client, namespace).await?);
    let created = created.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let running = running.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let samples: Vec<f64> = created
        .iter()
        .map(|(name, t0)| running.get(name).map_or(f64::NAN, |t| t.duration_since(*t0).as_secs_f64() * 1000.0))
        .collect();

    api.delete_collection(&DeleteParams::default().grace_period(0), &ListParams::default()).await?;
    cluster
        .wait(&format!("the pods of {namespace} to be gone"), RUNNING_TIMEOUT, || async {
            let left = api.list(&ListParams::default()).await?.items.len();
            anyhow::ensure!(left == 0, "{left} pods left");
            Ok(())
        })
        .await?;
    Api::<Namespace>::all(client.clone()).delete(namespace, &DeleteParams::default()).await?;
    Ok(Arm { stats: Stats::of(&samples).context("no samples")?, cpu, requests, events })
}

fn bench_pod(name: &str, image: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some([("app".to_string(), "bench".to_string())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            termination_grace_period_seconds: Some(0),
            containers: vec![Container {
                name: "main".into(),
                image: Some(image.into()),
                image_pull_policy: Some("IfNotPresent".into()),
                command: Some(vec!["sleep".into(), "1000000".into()]),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}
