//! Plays kubelet for one node of a test cluster — the part of kubelet that matters to a network
//! plugin: it watches the pods bound to its node (`spec.nodeName`, there is no scheduler), runs
//! each one's sandbox through CRI (containerd then calls `kuryr-cni`), reports the sandbox's
//! addresses in the pod's status the way kubelet does, and on deletion stops and removes the
//! sandbox (CNI DEL) before deleting the pod with grace period 0. What stays in the API after
//! that is up to the pod's finalizers (the allocator's, until it released the VIF).
//!
//! A failing RunPodSandbox is retried with backoff and reported as a Warning Event
//! `FailedCreatePodSandBox` whose message carries the CNI error, as `kubectl describe pod` shows
//! it on a real node. Optionally the pod's containers run too (every one from the runtime's local
//! busybox image, with the pod's command), so that `kubectl get pods` shows them ready. Container
//! ports with a `hostPort` become the sandbox's port mappings, as kubelet makes them.
//!
//! Timings kept per pod ([`PodRecord`]): from the kubelet first seeing the pod to RunPodSandbox
//! returning — the pod's network is plugged and ready then — and the RunPodSandbox call alone.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_cri::v1::{
    ContainerFilter, ContainerState, ListContainersRequest, ListPodSandboxRequest, PodSandboxFilter, PodSandboxState,
    PortMapping, Protocol,
};
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, watcher};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::cri::Cri;

/// First retry delay after a failed RunPodSandbox or teardown; doubles up to [`MAX_BACKOFF`].
/// (kubelet starts at 10 s; a test wants to see the recovery sooner.)
const INITIAL_BACKOFF: Duration = Duration::from_millis(500);
/// Longest retry delay.
const MAX_BACKOFF: Duration = Duration::from_secs(8);
/// A pod annotated so (any value) gets a Running status without addresses, as a real kubelet
/// reports it between the sandbox coming up and its next status sync: to show what holds in that
/// window.
pub const STATUS_WITHOUT_ADDRESSES: &str = "kuryr-tests/status-without-addresses";
/// The label CRI sandboxes carry with their pod's uid (set by [`Cri::pod_sandbox_config`]).
const UID_LABEL: &str = "io.kubernetes.pod.uid";
/// The command of a container whose pod spec gives none (the busybox image's default is `sh`,
/// which would exit at once).
const DEFAULT_COMMAND: [&str; 2] = ["sleep", "1000000"];

/// What a kubelet needs to know about its node.
#[derive(Debug, Clone)]
pub struct KubeletOptions {
    /// The Node's name; pods with this `spec.nodeName` are this kubelet's.
    pub node_name: String,
    /// The node's addresses (`status.hostIP`/`hostIPs`).
    pub host_ips: Vec<IpAddr>,
    /// `Some(image)`: after the sandbox, run the pod's containers, all from the runtime's local
    /// busybox image, named `image` in the status. `None`: sandboxes only.
    pub containers: Option<String>,
}

/// Where a pod is, from this kubelet's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodPhase {
    /// Seen; the sandbox is not running yet (or RunPodSandbox is failing and being retried).
    Starting,
    /// The sandbox runs and the status says so.
    Running,
    /// Deletion requested: the sandbox is being (or has been) stopped and removed.
    Terminating,
    /// Gone from the API and from the runtime.
    Gone,
}

/// One pod handled by this kubelet.
#[derive(Debug, Clone)]
pub struct PodRecord {
    /// metadata.namespace.
    pub namespace: String,
    /// metadata.name.
    pub name: String,
    /// metadata.uid.
    pub uid: String,
    /// Where it is.
    pub phase: PodPhase,
    /// The running sandbox.
    pub sandbox_id: Option<String>,
    /// The sandbox's network namespace.
    pub netns: Option<PathBuf>,
    /// The sandbox's addresses, primary first.
    pub ips: Vec<IpAddr>,
    /// RunPodSandbox calls made.
    pub attempts: u32,
    /// The last failure (RunPodSandbox or teardown), as reported in the Event.
    pub last_error: Option<String>,
    /// From the kubelet first seeing the pod to RunPodSandbox returning successfully.
    pub network_ready: Option<Duration>,
    /// The successful RunPodSandbox call alone (includes CNI ADD).
    pub sandbox_call: Option<Duration>,
    /// When the kubelet first saw the pod.
    pub first_seen: Instant,
}

/// A running kubelet; stops (its watch and every pod worker) when dropped. Sandboxes stay: the
/// node's own teardown removes them.
#[derive(Debug)]
pub struct Kubelet {
    node: String,
    records: Records,
    task: tokio::task::JoinHandle<()>,
}

type Records = Arc<Mutex<BTreeMap<String, PodRecord>>>;

impl Kubelet {
    /// Starts watching the node's pods with `client` and running them on `cri`.
    pub fn start(client: kube::Client, cri: Cri, opts: KubeletOptions) -> Kubelet {
        let records = Records::default();
        let node = opts.node_name.clone();
        let ctx = Arc::new(Ctx { client, cri, opts, records: records.clone(), events: Mutex::default() });
        let task = tokio::spawn(run(ctx).instrument(tracing::info_span!("kubelet", node)));
        Kubelet { node, records, task }
    }

    /// The node this kubelet runs.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Every pod this kubelet has handled (including ones already gone), by namespace and name.
    pub fn pods(&self) -> Vec<PodRecord> {
        let mut v: Vec<PodRecord> = lock(&self.records).values().cloned().collect();
        v.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        v
    }

    /// The current (not gone) record of pod `namespace/name`.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<PodRecord> {
        lock(&self.records)
            .values()
            .find(|r| r.namespace == namespace && r.name == name && r.phase != PodPhase::Gone)
            .cloned()
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Shared by the watch loop and the pod workers.
struct Ctx {
    client: kube::Client,
    cri: Cri,
    opts: KubeletOptions,
    records: Records,
    /// Events already posted, to count repeats instead of posting new ones (as kubelet's
    /// recorder aggregates): (uid, reason, message) → (event name, count).
    events: Mutex<HashMap<EventKey, (String, i32)>>,
}

/// (pod uid, reason, message).
type EventKey = (String, String, String);

/// Identifies a pod across its updates.
#[derive(Debug, Clone)]
struct PodId {
    namespace: String,
    name: String,
    uid: String,
}

impl PodId {
    fn of(pod: &Pod) -> Option<PodId> {
        Some(PodId {
            namespace: pod.metadata.namespace.clone()?,
            name: pod.metadata.name.clone()?,
            uid: pod.metadata.uid.clone()?,
        })
    }
}

/// The watch loop: one worker per pod uid, fed the pod's latest state (`None`: gone from the API).
async fn run(ctx: Arc<Ctx>) {
    let api: Api<Pod> = Api::all(ctx.client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={}", ctx.opts.node_name));
    let mut stream = std::pin::pin!(watcher(api, config).default_backoff());
    let mut pods: HashMap<String, watch::Sender<Option<Pod>>> = HashMap::new();
    let mut workers = JoinSet::new();
    let mut relisted: Option<HashSet<String>> = None;
    while let Some(event) = stream.next().await {
        match event {
            Err(error) => tracing::warn!(%error, "watching pods (retrying)"),
            Ok(watcher::Event::Init) => relisted = Some(HashSet::new()),
            Ok(watcher::Event::InitApply(pod)) => {
                if let (Some(seen), Some(uid)) = (relisted.as_mut(), pod.metadata.uid.clone()) {
                    seen.insert(uid);
                }
                ctx.apply(pod, &mut pods, &mut workers);
            }
            // Pods deleted while the watch was down are missing from the new list.
            Ok(watcher::Event::InitDone) => {
                if let Some(seen) = relisted.take() {
                    pods.retain(|uid, tx| {
                        let keep = seen.contains(uid);
                        if !keep {
                            tx.send_replace(None);
                        }
                        keep
                    });
                }
            }
            Ok(watcher::Event::Apply(pod)) => ctx.apply(pod, &mut pods, &mut workers),
            Ok(watcher::Event::Delete(pod)) => {
                if let Some(tx) = pod.metadata.uid.as_ref().and_then(|uid| pods.remove(uid)) {
                    tx.send_replace(None);
                }
            }
        }
        while workers.try_join_next().is_some() {}
    }
}

impl Ctx {
    fn apply(
        self: &Arc<Self>,
        pod: Pod,
        pods: &mut HashMap<String, watch::Sender<Option<Pod>>>,
        workers: &mut JoinSet<()>,
    ) {
        let Some(id) = PodId::of(&pod) else { return };
        if let Some(tx) = pods.get(&id.uid) {
            tx.send_replace(Some(pod));
            return;
        }
        if pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false) {
            tracing::warn!(pod = id.name, "hostNetwork pods are not run by this kubelet");
            return;
        }
        lock(&self.records).insert(
            id.uid.clone(),
            PodRecord {
                namespace: id.namespace.clone(),
                name: id.name.clone(),
                uid: id.uid.clone(),
                phase: PodPhase::Starting,
                sandbox_id: None,
                netns: None,
                ips: Vec::new(),
                attempts: 0,
                last_error: None,
                network_ready: None,
                sandbox_call: None,
                first_seen: Instant::now(),
            },
        );
        let (tx, rx) = watch::channel(Some(pod));
        pods.insert(id.uid.clone(), tx);
        let span = tracing::info_span!("pod", ns = id.namespace, name = id.name);
        workers.spawn(self.clone().worker(id, rx).instrument(span));
    }

    fn update(&self, uid: &str, f: impl FnOnce(&mut PodRecord)) {
        if let Some(r) = lock(&self.records).get_mut(uid) {
            f(r);
        }
    }

    /// Drives one pod: start (with retries) until running; on deletion tear down and delete.
    async fn worker(self: Arc<Self>, id: PodId, mut rx: watch::Receiver<Option<Pod>>) {
        let (mut running, mut terminated) = (false, false);
        let mut backoff = INITIAL_BACKOFF;
        loop {
            let pod = rx.borrow_and_update().clone();
            match pod {
                None => {
                    if !terminated {
                        self.terminate(&id, false).await;
                    }
                    self.update(&id.uid, |r| r.phase = PodPhase::Gone);
                    return;
                }
                Some(p) if p.metadata.deletion_timestamp.is_some() => {
                    if !terminated {
                        self.terminate(&id, true).await;
                        terminated = true;
                    }
                }
                Some(p) if !running => match self.start(&id, &p).await {
                    Ok(()) => running = true,
                    Err(e) => {
                        let message = cri_message(&e);
                        tracing::warn!(error = message, "RunPodSandbox failed; retrying in {backoff:?}");
                        self.update(&id.uid, |r| r.last_error = Some(message.clone()));
                        self.warn(&id, "FailedCreatePodSandBox", &format!("Failed to create pod sandbox: {message}"))
                            .await;
                        tokio::select! {
                            () = tokio::time::sleep(backoff) => {}
                            changed = rx.changed() => if changed.is_err() && rx.borrow().is_some() { return },
                        }
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        continue;
                    }
                },
                Some(_) => {}
            }
            // An error means the sender is gone: after a final `None` (handled above) or because
            // the kubelet is stopping.
            if rx.changed().await.is_err() && rx.borrow().is_some() {
                return;
            }
        }
    }

    /// One start attempt: clean up what failed attempts left, RunPodSandbox, read its addresses,
    /// run the containers, report the pod Running.
    async fn start(&self, id: &PodId, pod: &Pod) -> Result<()> {
        self.update(&id.uid, |r| r.attempts += 1);
        // As kubelet does before retrying: a sandbox of this pod that is not ready is left from a
        // failed attempt (its CNI DEL may have failed too); a ready one is adopted.
        let mut adopted = None;
        for sb in self.sandboxes_of(&id.uid).await? {
            if adopted.is_none() && sb.state == PodSandboxState::SandboxReady as i32 {
                adopted = Some(sb.id);
            } else {
                self.cri.stop_pod_sandbox(&sb.id).await?;
                self.cri.remove_pod_sandbox(&sb.id).await?;
            }
        }
        let started_at = Timestamp::now();
        let t = Instant::now();
        let sandbox = match adopted {
            Some(sb) => sb,
            None => {
                let mut config = self.cri.pod_sandbox_config(&id.name, &id.namespace, &id.uid);
                config.port_mappings = port_mappings(pod);
                self.cri.run_pod_sandbox_with(config).await?
            }
        };
        let call = t.elapsed();
        let ready = Instant::now();
        let status = self.cri.pod_sandbox_status(&sandbox).await?;
        self.update(&id.uid, |r| {
            r.network_ready = Some(ready.duration_since(r.first_seen));
            r.sandbox_call = Some(call);
            r.sandbox_id = Some(sandbox.clone());
            r.netns = status.netns_path.clone();
            r.ips = status.ips.clone();
            r.last_error = None;
        });
        let containers = self.run_containers(id, pod, &sandbox).await;
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &id.namespace);
        let without = pod.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(STATUS_WITHOUT_ADDRESSES));
        let reported: &[IpAddr] = if without { &[] } else { &status.ips };
        let patch = json!({ "status": self.running_status(started_at, reported, &containers) });
        api.patch_status(&id.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .context("reporting the pod Running")?;
        self.update(&id.uid, |r| r.phase = PodPhase::Running);
        Ok(())
    }

    /// Runs the pod's containers (when configured); one status JSON each.
    async fn run_containers(&self, id: &PodId, pod: &Pod, sandbox: &str) -> Vec<serde_json::Value> {
        let Some(image) = &self.opts.containers else { return Vec::new() };
        // Containers a previous attempt already started in this (adopted) sandbox are kept.
        let filter = ContainerFilter { pod_sandbox_id: sandbox.to_string(), ..ContainerFilter::default() };
        let existing: HashMap<String, String> =
            match self.cri.runtime().list_containers(ListContainersRequest { filter: Some(filter) }).await {
                Ok(r) => r
                    .into_inner()
                    .containers
                    .into_iter()
                    .filter(|c| c.state == ContainerState::ContainerRunning as i32)
                    .filter_map(|c| Some((c.metadata?.name, c.id)))
                    .collect(),
                Err(_) => HashMap::new(),
            };
        let mut out = Vec::new();
        for c in pod.spec.iter().flat_map(|s| &s.containers) {
            let mut argv: Vec<&str> = c.command.iter().chain(&c.args).flatten().map(String::as_str).collect();
            if argv.is_empty() {
                argv = DEFAULT_COMMAND.to_vec();
            }
            let now = Time(Timestamp::now());
            let started = match existing.get(&c.name) {
                Some(cid) => Ok(cid.clone()),
                None => self.cri.run_busybox(sandbox, &c.name, &argv).await,
            };
            out.push(match started {
                Ok(cid) => json!({
                    "name": c.name, "image": image, "imageID": image, "containerID": format!("containerd://{cid}"),
                    "ready": true, "started": true, "restartCount": 0, "state": { "running": { "startedAt": now } },
                }),
                Err(e) => {
                    let message = cri_message(&e);
                    self.warn(id, "Failed", &format!("Error: {message}")).await;
                    json!({
                        "name": c.name, "image": image, "imageID": "", "ready": false, "started": false,
                        "restartCount": 0, "state": { "waiting": { "reason": "CreateContainerError", "message": message } },
                    })
                }
            });
        }
        out
    }

    /// The status kubelet reports for a running pod.
    fn running_status(
        &self,
        started: Timestamp,
        ips: &[IpAddr],
        containers: &[serde_json::Value],
    ) -> serde_json::Value {
        let now = Time(Timestamp::now());
        let ready = containers.iter().all(|c| c["ready"] == true);
        let cond = |t: &str, ok: bool| json!({ "type": t, "status": if ok { "True" } else { "False" }, "lastProbeTime": null, "lastTransitionTime": now });
        let host_ips: Vec<_> = self.opts.host_ips.iter().map(|ip| json!({ "ip": ip })).collect();
        let mut status = json!({
            "phase": "Running",
            "hostIP": self.opts.host_ips.first(),
            "hostIPs": host_ips,
            "podIP": ips.first(),
            "podIPs": ips.iter().map(|ip| json!({ "ip": ip })).collect::<Vec<_>>(),
            "startTime": Time(started),
            "conditions": [
                cond("PodReadyToStartContainers", true),
                cond("Initialized", true),
                cond("Ready", ready),
                cond("ContainersReady", ready),
                cond("PodScheduled", true),
            ],
        });
        if !containers.is_empty() {
            status["containerStatuses"] = json!(containers);
        }
        status
    }

    /// Stops and removes the pod's sandboxes (retrying until CRI succeeds: a pod whose network
    /// could not be torn down must not be deleted), then, if the pod is still in the API,
    /// deletes it with grace period 0 and a uid precondition, as kubelet's status manager does.
    async fn terminate(&self, id: &PodId, delete: bool) {
        self.update(&id.uid, |r| r.phase = PodPhase::Terminating);
        let mut backoff = INITIAL_BACKOFF;
        loop {
            match self.remove_sandboxes(&id.uid).await {
                Ok(()) => break,
                Err(e) => {
                    let message = cri_message(&e);
                    self.update(&id.uid, |r| r.last_error = Some(message.clone()));
                    self.warn(id, "FailedKillPod", &format!("error killing pod: {message}")).await;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        self.update(&id.uid, |r| {
            r.sandbox_id = None;
            r.netns = None;
        });
        if delete {
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &id.namespace);
            let dp = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions { uid: Some(id.uid.clone()), resource_version: None }),
                ..DeleteParams::default()
            };
            match api.delete(&id.name, &dp).await {
                Ok(_) => {}
                // Already gone, or the name now belongs to a new pod.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(error) => tracing::warn!(%error, "deleting the pod"),
            }
        }
    }

    async fn sandboxes_of(&self, uid: &str) -> Result<Vec<k8s_cri::v1::PodSandbox>> {
        let filter = PodSandboxFilter {
            label_selector: HashMap::from([(UID_LABEL.to_string(), uid.to_string())]),
            ..PodSandboxFilter::default()
        };
        let resp = self.cri.runtime().list_pod_sandbox(ListPodSandboxRequest { filter: Some(filter) }).await?;
        Ok(resp.into_inner().items)
    }

    async fn remove_sandboxes(&self, uid: &str) -> Result<()> {
        for sb in self.sandboxes_of(uid).await? {
            self.cri.stop_pod_sandbox(&sb.id).await?;
            self.cri.remove_pod_sandbox(&sb.id).await?;
        }
        Ok(())
    }

    /// Posts a Warning Event about the pod, or counts a repeat of the same one.
    async fn warn(&self, id: &PodId, reason: &str, message: &str) {
        let api: Api<Event> = Api::namespaced(self.client.clone(), &id.namespace);
        let key = (id.uid.clone(), reason.to_string(), message.to_string());
        let now = Time(Timestamp::now());
        let seen = lock(&self.events).get(&key).cloned();
        let result = match seen {
            Some((name, count)) => {
                let patch = json!({ "count": count + 1, "lastTimestamp": now });
                let r = api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await;
                lock(&self.events).insert(key, (name, count + 1));
                r.map(drop)
            }
            None => {
                let name = format!("{}.{:x}", id.name, now.0.as_nanosecond());
                let event = Event {
                    metadata: ObjectMeta { name: Some(name.clone()), ..ObjectMeta::default() },
                    involved_object: ObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        name: Some(id.name.clone()),
                        namespace: Some(id.namespace.clone()),
                        uid: Some(id.uid.clone()),
                        ..ObjectReference::default()
                    },
                    reason: Some(reason.into()),
                    message: Some(message.into()),
                    type_: Some("Warning".into()),
                    count: Some(1),
                    first_timestamp: Some(now.clone()),
                    last_timestamp: Some(now),
                    source: Some(EventSource {
                        component: Some("kubelet".into()),
                        host: Some(self.opts.node_name.clone()),
                    }),
                    reporting_component: Some("kubelet".into()),
                    reporting_instance: Some(self.opts.node_name.clone()),
                    ..Event::default()
                };
                let r = api.create(&PostParams::default(), &event).await;
                lock(&self.events).insert(key, (name, 1));
                r.map(drop)
            }
        };
        if let Err(error) = result {
            tracing::warn!(%error, reason, "posting an Event");
        }
    }
}

/// The runtime's own message for a failed CRI call (for RunPodSandbox it ends with the CNI
/// plugin's error), or the whole error chain when the failure was not a CRI status.
/// The sandbox's port mappings, as kubelet derives them: every container port with a host port
/// (containerd passes them to the CNI plugin as `runtimeConfig.portMappings`).
pub fn port_mappings(pod: &Pod) -> Vec<PortMapping> {
    let ports = pod.spec.iter().flat_map(|s| &s.containers).flat_map(|c| c.ports.iter().flatten());
    ports
        .filter(|p| p.host_port.is_some_and(|h| h > 0))
        .map(|p| PortMapping {
            protocol: match p.protocol.as_deref() {
                Some("UDP") => Protocol::Udp,
                Some("SCTP") => Protocol::Sctp,
                _ => Protocol::Tcp,
            } as i32,
            container_port: p.container_port,
            host_port: p.host_port.unwrap_or(0),
            host_ip: p.host_ip.clone().unwrap_or_default(),
        })
        .collect()
}

fn cri_message(e: &anyhow::Error) -> String {
    e.chain()
        .find_map(|c| c.downcast_ref::<tonic::Status>())
        .map(|s| s.message().to_string())
        .unwrap_or_else(|| format!("{e:#}"))
}
