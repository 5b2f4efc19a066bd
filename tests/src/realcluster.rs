//! A cluster of real nodes — real kubelets on containerd, kube-scheduler, the full
//! kube-controller-manager, no kube-proxy — with kuryr installed on it the way a user installs it:
//! `kubectl apply -k` of a `deploy/` overlay, its images imported into every node's runtime.
//!
//! `tests/env/cluster/up.sh` builds the nodes (network + mount namespaces, see its header) and the
//! control plane inside the first node; this module owns the cluster's lifetime, gives the host a
//! way into its API ([`NetnsForwarder`] on 127.0.0.1, the certificate names that address too), and
//! installs the network: kuryr ([`RealCluster::install_kuryr`]) or, for comparisons, the reference
//! plugins (`CLUSTER_CNI=bridge`, [`NodeCni::Bridge`]); then the cluster DNS
//! ([`RealCluster::install_dns`]), which runs as pods on that network.
//!
//! [`RealCluster::shutdown`] (or drop, best effort) runs `down.sh`, which leaves nothing behind;
//! `KURYR_KEEP_STATE=1` keeps the state directory (logs, configuration) for debugging.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::process::Command;

use crate::forward::NetnsForwarder;
use crate::kube::client_from_kubeconfig;
use crate::services::{tool_path, wait_until};
use crate::util::{env_script, parse_env_file, repo_root, run_command as run};

/// Where kuryr's objects live.
pub const SYSTEM_NAMESPACE: &str = "kuryr-system";
/// The cluster DNS Service's address (kubelet's `clusterDNS`).
pub const CLUSTER_DNS: &str = "10.96.0.10";
/// Bound on kubectl calls.
const KUBECTL_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on the network becoming ready after install (images are local; pods start in seconds).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(300);

/// The CNI the nodes start with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NodeCni {
    /// None: the nodes stay NotReady until a network plugin is installed (kuryr).
    #[default]
    None,
    /// The reference plugins (bridge + host-local + portmap), the peer for comparisons.
    Bridge,
}

/// How to build a cluster.
#[derive(Debug, Clone)]
pub struct RealClusterOptions {
    /// Nodes (the first one is also the control plane).
    pub nodes: usize,
    /// 1..=250: distinguishes concurrent clusters (netns names, underlay addresses).
    pub id: u8,
    /// The CNI the nodes start with.
    pub cni: NodeCni,
    /// OCI image-layout tars imported into every node (the sandbox image among them).
    pub images: Vec<PathBuf>,
    /// The pod sandbox image's name.
    pub sandbox_image: String,
    /// The state directory; a fresh one under /tmp when `None`.
    pub state_dir: Option<PathBuf>,
}

impl Default for RealClusterOptions {
    fn default() -> Self {
        Self {
            nodes: 2,
            id: u8::try_from(std::process::id() % 200 + 20).unwrap_or(20),
            cni: NodeCni::None,
            images: Vec::new(),
            sandbox_image: "registry.k8s.io/pause:3.10.1".into(),
            state_dir: None,
        }
    }
}

/// One node.
#[derive(Debug, Clone)]
pub struct RealNode {
    /// The Node object's name.
    pub name: String,
    /// Its InternalIP (IPv4) and its IPv6 underlay address.
    pub ip4: Ipv4Addr,
    pub ip6: IpAddr,
    /// Its network namespace's name (under /var/run/netns).
    pub netns: String,
    /// Its mount namespace (a file for `nsenter --mount`).
    pub mountns: PathBuf,
    /// Its containerd's socket.
    pub containerd: PathBuf,
    /// Its directory (kubelet and containerd state, the node's private paths under `root/`).
    pub dir: PathBuf,
}

impl RealNode {
    /// The `nsenter` arguments that enter this node (network and mount namespaces).
    pub fn enter_args(&self) -> Vec<String> {
        vec![format!("--net=/var/run/netns/{}", self.netns), format!("--mount={}", self.mountns.display())]
    }

    /// Runs `argv` on this node (in its namespaces) and returns stdout; fails with both streams.
    pub async fn exec(&self, argv: &[&str]) -> Result<String> {
        let mut cmd = Command::new("nsenter");
        cmd.args(self.enter_args()).arg("--").args(argv);
        run(cmd, None, KUBECTL_TIMEOUT).await.with_context(|| format!("on {}: {argv:?}", self.name))
    }

    /// A path on this node (its private `root/` for the per-node paths, the host's otherwise).
    pub fn path(&self, on_node: &str) -> PathBuf {
        let rel = on_node.trim_start_matches('/');
        for private in ["etc/cni/net.d", "opt/cni/bin", "run/kuryr", "var/lib/kuryr", "var/log"] {
            if rel == private || rel.starts_with(&format!("{private}/")) {
                return self.dir.join("root").join(rel);
            }
        }
        PathBuf::from(on_node)
    }
}

/// A running cluster.
pub struct RealCluster {
    state: PathBuf,
    env: HashMap<String, String>,
    nodes: Vec<RealNode>,
    forwarder: NetnsForwarder,
    host_kubeconfig: PathBuf,
    client: kube::Client,
    started_in: Duration,
    stopped: bool,
}

impl std::fmt::Debug for RealCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealCluster").field("state", &self.state).field("nodes", &self.nodes).finish_non_exhaustive()
    }
}

impl RealCluster {
    /// Brings the cluster up (see the module documentation). Nodes are registered, NotReady
    /// unless [`NodeCni::Bridge`].
    pub async fn start(opts: RealClusterOptions) -> Result<Self> {
        let t0 = Instant::now();
        let state = match &opts.state_dir {
            Some(d) => {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
                d.clone()
            }
            None => tempfile::Builder::new().prefix("kuryr-rc-").tempdir_in("/tmp")?.keep(),
        };
        let images = opts.images.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" ");
        let mut cmd = Command::new("bash");
        cmd.arg(env_script("cluster/up.sh"))
            .arg(&state)
            .env("CLUSTER_NODES", opts.nodes.to_string())
            .env("CLUSTER_ID", opts.id.to_string())
            .env(
                "CLUSTER_CNI",
                match opts.cni {
                    NodeCni::None => "none",
                    NodeCni::Bridge => "bridge",
                },
            )
            .env("CLUSTER_IMAGES", images)
            .env("CLUSTER_SANDBOX_IMAGE", &opts.sandbox_image)
            .env("CLUSTER_OWNER_PID", std::process::id().to_string());
        run(cmd, None, Duration::from_secs(900)).await.context("tests/env/cluster/up.sh")?;
        let env: HashMap<String, String> =
            parse_env_file(&std::fs::read_to_string(state.join("env")).context("reading the cluster's env file")?)
                .into_iter()
                .collect();
        let get = |k: &str| env.get(k).cloned().with_context(|| format!("the cluster's env file lacks {k}"));
        let mut nodes = Vec::new();
        for i in 1..=opts.nodes {
            nodes.push(RealNode {
                name: get(&format!("NODE{i}_NAME"))?,
                ip4: get(&format!("NODE{i}_IP4"))?.parse()?,
                ip6: get(&format!("NODE{i}_IP6"))?.parse()?,
                netns: get(&format!("NODE{i}_NETNS"))?,
                mountns: get(&format!("NODE{i}_MOUNTNS"))?.into(),
                containerd: get(&format!("NODE{i}_CONTAINERD"))?.into(),
                dir: get(&format!("NODE{i}_DIR"))?.into(),
            });
        }
        let api_host: IpAddr = get("APISERVER_HOST")?.parse()?;
        let api_port: u16 = get("APISERVER_PORT")?.parse()?;
        let cp_netns = PathBuf::from("/var/run/netns").join(get("CONTROL_PLANE_NETNS")?);
        let forwarder = NetnsForwarder::start(&cp_netns, SocketAddr::new(api_host, api_port)).await?;
        let internal = std::fs::read_to_string(get("KUBECONFIG")?)?;
        let host_kubeconfig = state.join("kubeconfig");
        std::fs::write(
            &host_kubeconfig,
            internal.replace(&format!("https://{api_host}:{api_port}"), &format!("https://{}", forwarder.local_addr())),
        )?;
        let client = client_from_kubeconfig(&host_kubeconfig).await?;
        Ok(Self { state, env, nodes, forwarder, host_kubeconfig, client, started_in: t0.elapsed(), stopped: false })
    }

    /// An admin client (through the forwarder).
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The admin kubeconfig for the host (server `https://127.0.0.1:<forwarder port>`), valid as
    /// long as this process runs.
    pub fn kubeconfig(&self) -> &Path {
        &self.host_kubeconfig
    }

    /// The admin kubeconfig for use inside the nodes' namespaces (the API server's own address).
    pub fn internal_kubeconfig(&self) -> PathBuf {
        self.env.get("KUBECONFIG").map(PathBuf::from).unwrap_or_else(|| self.state.join("admin.kubeconfig"))
    }

    /// The API server's address as the nodes see it.
    pub fn apiserver(&self) -> SocketAddr {
        self.forwarder.target()
    }

    /// The control-plane node's network namespace (where the API server listens).
    pub fn control_plane_netns(&self) -> &str {
        self.env.get("CONTROL_PLANE_NETNS").map(String::as_str).unwrap_or_default()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RealNode] {
        &self.nodes
    }

    /// The state directory (logs under `logs/`, per-node state under `nodes/`).
    pub fn state_dir(&self) -> &Path {
        &self.state
    }

    /// How long [`RealCluster::start`] took.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// `kubectl` (the pinned one from the tools directory) as admin; returns stdout.
    pub async fn kubectl(&self, args: &[&str]) -> Result<String> {
        let mut cmd = Command::new(tool_path("kubectl")?);
        cmd.arg(format!("--kubeconfig={}", self.host_kubeconfig.display())).args(args);
        run(cmd, None, KUBECTL_TIMEOUT).await
    }

    /// `kubectl apply -f -` with `manifests` on stdin.
    pub async fn apply_yaml(&self, manifests: &str) -> Result<String> {
        let mut cmd = Command::new(tool_path("kubectl")?);
        cmd.arg(format!("--kubeconfig={}", self.host_kubeconfig.display())).args(["apply", "-f", "-"]);
        run(cmd, Some(manifests.as_bytes()), KUBECTL_TIMEOUT).await
    }

    /// Installs kuryr from the overlay `deploy/overlays/<overlay>` as a user would, with the
    /// API server's address filled in (the overlay's `apiserver.env`: there is no kube-proxy to
    /// serve the `kubernetes` Service before kuryr does) and `extra_patches` (kustomize patch
    /// entries, YAML list items) added; then waits until every kuryr workload is ready and every
    /// node reports Ready. The `kuryr-rs` image must have been imported (see [`RealClusterOptions::images`]).
    pub async fn install_kuryr(&self, overlay: &str, extra_patches: &str) -> Result<()> {
        let dir = self.state.join("kuryr-install");
        std::fs::create_dir_all(&dir)?;
        let target = repo_root().join("deploy/overlays").join(overlay);
        anyhow::ensure!(target.join("kustomization.yaml").is_file(), "{} is not an overlay", target.display());
        let api = self.apiserver();
        let kustomization = format!(
            "# Generated: {overlay} with this cluster's API server address.\n\
             apiVersion: kustomize.config.k8s.io/v1beta1\n\
             kind: Kustomization\n\
             resources:\n  - {}\n\
             configMapGenerator:\n  - name: kuryr-apiserver\n    namespace: {SYSTEM_NAMESPACE}\n    behavior: replace\n    literals:\n\
             \x20     - KUBERNETES_SERVICE_HOST={}\n      - KUBERNETES_SERVICE_PORT={}\n\
             {}",
            relative_path(&dir, &target).display(),
            api.ip(),
            api.port(),
            if extra_patches.trim().is_empty() { String::new() } else { format!("patches:\n{extra_patches}\n") },
        );
        std::fs::write(dir.join("kustomization.yaml"), kustomization)?;
        let dir_s = dir.to_str().context("path is not UTF-8")?;
        self.kubectl(&["apply", "-k", dir_s]).await.context("kubectl apply -k (kuryr)")?;
        self.wait_rollout(
            SYSTEM_NAMESPACE,
            &[
                "daemonset/kuryr-binder",
                "deployment/kuryr-watcher",
                "deployment/kuryr-vif-allocator",
                "deployment/kuryr-lbaas",
                "deployment/kuryr-policy",
            ],
        )
        .await?;
        self.wait_nodes_ready().await
    }

    /// Waits until every named workload (`kind/name`) in `namespace` has rolled out.
    pub async fn wait_rollout(&self, namespace: &str, workloads: &[&str]) -> Result<()> {
        let timeout = format!("{}s", INSTALL_TIMEOUT.as_secs());
        for w in workloads {
            if let Err(e) = self.kubectl(&["-n", namespace, "rollout", "status", w, "--timeout", &timeout]).await {
                let pods = self.kubectl(&["-n", namespace, "get", "pods", "-o", "wide"]).await.unwrap_or_default();
                let events = self
                    .kubectl(&["-n", namespace, "get", "events", "--sort-by=.lastTimestamp"])
                    .await
                    .unwrap_or_default();
                // Taints and conditions name why a pod stays Pending (disk or memory pressure,
                // a node not Ready).
                let nodes = self
                    .kubectl(&[
                        "get",
                        "nodes",
                        "-o",
                        "custom-columns=NAME:.metadata.name,TAINTS:.spec.taints[*].key,\
                         TRUE_CONDITIONS:.status.conditions[?(@.status==\"True\")].type",
                    ])
                    .await
                    .unwrap_or_default();
                bail!(
                    "{w} did not roll out: {e:#}\n---- pods ----\n{pods}\n---- events ----\n{events}\n\
                     ---- nodes ----\n{nodes}"
                );
            }
        }
        Ok(())
    }

    /// Waits until every node is Ready (its runtime's network is ready, i.e. a CNI is installed).
    pub async fn wait_nodes_ready(&self) -> Result<()> {
        let timeout = format!("{}s", INSTALL_TIMEOUT.as_secs());
        self.kubectl(&["wait", "--for=condition=Ready", "nodes", "--all", "--timeout", &timeout])
            .await
            .map(|_| ())
            .context("nodes Ready")
    }

    /// The cluster DNS (CoreDNS, `image`) as a Deployment in kube-system behind the Service
    /// `kube-dns` at [`CLUSTER_DNS`] — pods on the cluster's network, reached through its
    /// Service dataplane, like everything else. Waits until it is rolled out.
    pub async fn install_dns(&self, image: &str) -> Result<()> {
        let manifest = std::fs::read_to_string(env_script("cluster/coredns.yaml"))?
            .replace("@COREDNS_IMAGE@", image)
            .replace("@CLUSTER_DNS@", CLUSTER_DNS);
        self.apply_yaml(&manifest).await.context("applying CoreDNS")?;
        self.wait_rollout("kube-system", &["deployment/coredns"]).await
    }

    /// The network namespace of a running pod, as a path the host can enter
    /// (`/proc/<pid>/ns/net` of its first running container: pod network namespaces are mounted
    /// inside their node's mount namespace only).
    pub async fn pod_netns(&self, namespace: &str, name: &str) -> Result<PathBuf> {
        let pod = kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(self.client(), namespace)
            .get(name)
            .await
            .with_context(|| format!("reading pod {namespace}/{name}"))?;
        let node_name = pod.spec.as_ref().and_then(|s| s.node_name.clone()).context("the pod is not scheduled")?;
        let node = self.nodes.iter().find(|n| n.name == node_name).with_context(|| format!("no node {node_name}"))?;
        let ids: Vec<String> = pod
            .status
            .iter()
            .flat_map(|s| s.container_statuses.iter().flatten())
            .filter(|c| c.state.as_ref().is_some_and(|st| st.running.is_some()))
            .filter_map(|c| c.container_id.as_deref()?.strip_prefix("containerd://").map(str::to_string))
            .collect();
        anyhow::ensure!(!ids.is_empty(), "pod {namespace}/{name} has no running container");
        let mut cmd = Command::new("ctr");
        cmd.arg("--address").arg(&node.containerd).args(["-n", "k8s.io", "tasks", "ls"]);
        let tasks = run(cmd, None, KUBECTL_TIMEOUT).await?;
        for line in tasks.lines().skip(1) {
            let mut cols = line.split_whitespace();
            if let (Some(id), Some(pid)) = (cols.next(), cols.next())
                && ids.iter().any(|c| c == id)
                && pid.parse::<u32>().is_ok_and(|p| p > 0)
            {
                return Ok(PathBuf::from(format!("/proc/{pid}/ns/net")));
            }
        }
        bail!("no running task of pod {namespace}/{name} on {node_name}")
    }

    /// Waits until `f` succeeds; see [`wait_until`].
    pub async fn wait<T, F, Fut>(&self, what: &str, timeout: Duration, f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        wait_until(what, timeout, f).await
    }

    /// The last lines of a component's log (`kube-apiserver`, `kubelet-1`, `containerd-2`, ...).
    pub fn log_tail(&self, name: &str, lines: usize) -> String {
        let text = std::fs::read_to_string(self.state.join("logs").join(format!("{name}.log"))).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Stops everything (`down.sh`); the state directory is removed unless `KURYR_KEEP_STATE=1`.
    pub async fn shutdown(mut self) -> Result<()> {
        self.stopped = true;
        let mut cmd = Command::new("bash");
        cmd.arg(env_script("cluster/down.sh")).arg(&self.state);
        if !keep_state() {
            cmd.arg("--purge");
        }
        run(cmd, None, Duration::from_secs(180)).await.context("tests/env/cluster/down.sh")?;
        Ok(())
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        if self.stopped {
            return;
        }
        let mut cmd = std::process::Command::new("bash");
        cmd.arg(env_script("cluster/down.sh")).arg(&self.state);
        if !keep_state() {
            cmd.arg("--purge");
        }
        match cmd.output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => {
                eprintln!("cluster/down.sh {} failed: {}", self.state.display(), String::from_utf8_lossy(&out.stderr))
            }
            Err(e) => eprintln!("running cluster/down.sh {}: {e}", self.state.display()),
        }
    }
}

fn keep_state() -> bool {
    std::env::var_os("KURYR_KEEP_STATE").is_some_and(|v| v == "1")
}

/// `to` relative to the directory `from` (both absolute): kustomize resolves resources relative
/// to the kustomization.
fn relative_path(from: &Path, to: &Path) -> PathBuf {
    let (f, t): (Vec<_>, Vec<_>) = (from.components().collect(), to.components().collect());
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..f.len() {
        out.push("..");
    }
    for c in &t[common..] {
        out.push(c.as_os_str());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_climb_to_the_common_ancestor() {
        assert_eq!(
            relative_path(Path::new("/tmp/kuryr-rc-1/kuryr-install"), Path::new("/work/main/deploy/overlays/embedded")),
            PathBuf::from("../../../work/main/deploy/overlays/embedded")
        );
        assert_eq!(relative_path(Path::new("/a/b"), Path::new("/a/b/c")), PathBuf::from("c"));
    }

    #[test]
    fn node_paths_map_the_private_ones_only() {
        let n = RealNode {
            name: "n".into(),
            ip4: Ipv4Addr::LOCALHOST,
            ip6: IpAddr::V4(Ipv4Addr::LOCALHOST),
            netns: "x".into(),
            mountns: "/m".into(),
            containerd: "/c".into(),
            dir: "/d".into(),
        };
        assert_eq!(
            n.path("/etc/cni/net.d/10-kuryr.conflist"),
            PathBuf::from("/d/root/etc/cni/net.d/10-kuryr.conflist")
        );
        assert_eq!(n.path("/run/kuryr"), PathBuf::from("/d/root/run/kuryr"));
        assert_eq!(n.path("/run/kuryrx"), PathBuf::from("/run/kuryrx"));
        assert_eq!(n.path("/usr/bin/nft"), PathBuf::from("/usr/bin/nft"));
    }
}
