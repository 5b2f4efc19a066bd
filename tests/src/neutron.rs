//! kuryr-vif-allocator with `--backend neutron` among the real parts, for suites and benches: a
//! real kube-apiserver, Keystone and Neutron (API, RPC server, ML2/OVS agent on a private
//! userspace Open vSwitch) from [`OpenStackEnv`], the CRDs and RBAC of `deploy/`, the Neutron
//! node as a Kubernetes Node, and helpers to run kuryr-watcher, kuryr-vif-allocator (the
//! `kuryr` user's password from clouds.yaml, as a deployment would) and a kuryr-binder in the
//! node's network namespace plugging into its `br-int`. CNI is driven by executing the
//! `kuryr-cni` shim as a runtime does.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use kuryr_tests::neutron::{AllocatorOptions, NeutronCluster};
//! let c = NeutronCluster::start(&["pods"]).await?;
//! let watcher = c.watcher()?;
//! let alloc = c.allocator(&watcher, &AllocatorOptions::default())?;
//! alloc.wait_ready(std::time::Duration::from_secs(120)).await?;
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kuryr_openstack::config::{AuthConfig, Interface, TlsConfig};
use kuryr_openstack::neutron::{Neutron, SecurityGroupCreate, SecurityGroupRuleCreate};
use kuryr_openstack::{Client, ClientOptions, CloudConfig, ServiceType};
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::{GetVifRequest, Vif};
use serde_json::json;

use crate::binder::Binder;
use crate::kube::KubeEnv;
pub use crate::metrics::{metric, metric_sum};
use crate::netns::Netns;
use crate::openstack::{NeutronNode, OpenStackEnv, PodNetwork, Service};
use crate::services::{ServiceProcess, wait_until};
use crate::shim::{ShimOutput, run_shim};
use crate::sut::Sut;
use crate::util::{free_port, repo_root};

/// The namespace the services' accounts live in.
pub const SYSTEM_NAMESPACE: &str = "kuryr-system";

/// Bound on changes that go through Neutron and its agent (ACTIVE takes 1–3 s unloaded, much
/// more on a machine busy building).
pub const SLOW: Duration = Duration::from_secs(180);

/// The tag kuryr-vif-allocator puts on the Neutron resources of the cluster `cluster_id`.
pub fn cluster_tag(cluster_id: &str) -> String {
    format!("kuryr.openstack.org/cluster={cluster_id}")
}

/// Everything up: API server, Keystone, Neutron and its node, the Kubernetes side prepared.
pub struct NeutronCluster {
    pub os: OpenStackEnv,
    pub kube: KubeEnv,
    /// An admin client of the API server.
    pub admin: kube::Client,
    /// Logs and sockets of the services started here.
    pub dir: tempfile::TempDir,
    watcher_kubeconfig: PathBuf,
    allocator_kubeconfig: PathBuf,
    /// The Neutron node (agent host, its netns and OVS).
    pub node: NeutronNode,
    /// The pod network made by `up.sh`, owned by the `kuryr` project.
    pub net: PodNetwork,
    /// A Neutron client (no token: Neutron runs with `noauth`, every caller is admin).
    pub neutron: Neutron,
    /// Neutron's base URL (`http://127.0.0.1:<port>`).
    pub neutron_url: String,
    /// A token of `kuryr-pool-manager` for the kuryr audience: the suites' calls to the
    /// allocator (GetVif, PoolManager) go as the pool manager an operator would be.
    pub pool_manager_token: String,
}

impl std::fmt::Debug for NeutronCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NeutronCluster")
            .field("os", &self.os)
            .field("kube", &self.kube)
            .field("node", &self.node)
            .field("net", &self.net)
            .field("neutron_url", &self.neutron_url)
            .finish_non_exhaustive()
    }
}

/// The knobs of the allocator that suites and benches vary; the rest is fixed.
#[derive(Clone, Debug)]
pub struct AllocatorOptions {
    /// `--cluster-id` (the ports' tag is `kuryr.openstack.org/cluster=<id>`).
    pub cluster_id: String,
    /// `--pool-min`.
    pub pool_min: u32,
    /// `--pool-batch` (0: pools off).
    pub pool_batch: u32,
    /// `--status-poll-min`, when not the allocator's default.
    pub status_poll_min: Option<String>,
    /// `--instance`.
    pub instance: String,
    /// `--log`.
    pub log: String,
    /// Further flags.
    pub extra: Vec<String>,
}

impl Default for AllocatorOptions {
    fn default() -> Self {
        Self {
            cluster_id: "e2e".into(),
            pool_min: 3,
            pool_batch: 4,
            status_poll_min: None,
            instance: "alloc-neutron".into(),
            log: "info,kuryr_vif_allocator=debug".into(),
            extra: Vec::new(),
        }
    }
}

impl AllocatorOptions {
    /// The tag on the ports this allocator makes.
    pub fn cluster_tag(&self) -> String {
        cluster_tag(&self.cluster_id)
    }
}

/// A service process with its addresses.
#[derive(Debug)]
pub struct Svc {
    pub proc: ServiceProcess,
    /// `127.0.0.1:<port>` (gRPC).
    pub addr: String,
    /// The unix socket (how the binder in the node's namespace reaches the allocator).
    pub sock: PathBuf,
    /// `http://127.0.0.1:<port>` (`/metrics`, `/readyz`).
    pub metrics_url: String,
    /// What [`Svc::channel`]'s calls carry: for an allocator the pool manager's token
    /// ([`NeutronCluster::pool_manager_token`]: reads VIFs, manages pools).
    pub token: String,
}

impl Svc {
    /// The gRPC and metrics ports (to start it again at the same endpoints: [`spawn_on`]).
    pub fn ports(&self) -> Result<(u16, u16)> {
        let port = |a: &str| a.rsplit(':').next().unwrap_or_default().parse::<u16>();
        Ok((port(&self.addr).context("gRPC port")?, port(&self.metrics_url).context("metrics port")?))
    }

    /// The VIF this allocator holds for pod `uid`, once it has one that `accept` takes (asked
    /// with [`Svc::token`]); the error carries the allocator's log.
    pub async fn wait_vif_where(&self, uid: &str, timeout: Duration, accept: fn(&Vif) -> Result<()>) -> Result<Vif> {
        let c = VifAllocatorClient::new(self.channel()?);
        wait_until(&format!("a VIF for pod {uid}"), timeout, || {
            let mut c = c.clone();
            async move {
                let v = c.get_vif(GetVifRequest { pod_uid: uid.into() }).await?.into_inner();
                accept(&v)?;
                Ok(v)
            }
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\n{}", self.proc.logs()))
    }

    /// [`Svc::wait_vif_where`] taking any VIF.
    pub async fn wait_vif(&self, uid: &str, timeout: Duration) -> Result<Vif> {
        self.wait_vif_where(uid, timeout, |_| Ok(())).await
    }

    /// The text of `/metrics`.
    pub async fn metrics(&self) -> Result<String> {
        let url = format!("{}/metrics", self.metrics_url);
        let resp = reqwest::get(&url).await.with_context(|| format!("GET {url}"))?;
        Ok(resp.error_for_status()?.text().await?)
    }

    /// Waits until `/readyz` answers 200.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let url = format!("{}/readyz", self.metrics_url);
        wait_until("the service to be ready", timeout, || async {
            let resp = reqwest::get(&url).await?;
            let code = resp.status();
            anyhow::ensure!(code.is_success(), "{code} {}", resp.text().await.unwrap_or_default());
            Ok(())
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\n{}", self.proc.logs()))
    }

    /// A gRPC channel to the service whose calls carry [`Svc::token`].
    pub fn channel(&self) -> Result<kuryr_runtime::auth::client::PeerChannel> {
        crate::auth::channel(&self.addr, &self.token)
    }
}

/// Starts `bin` with `args` plus its listen, metrics and shutdown flags, logging into `dir`.
/// The socket path is the same across restarts: a binder keeps dialling it.
pub fn spawn(bin: &str, args: Vec<String>, dir: &Path) -> Result<Svc> {
    spawn_on(bin, args, dir, free_port()?, free_port()?)
}

/// [`spawn`] on the given gRPC and metrics ports: a restart at the same endpoints (a sharded
/// replica's advertised address).
pub fn spawn_on(bin: &str, mut args: Vec<String>, dir: &Path, port: u16, mport: u16) -> Result<Svc> {
    let sock = dir.join(format!("{bin}.sock"));
    let addr = format!("127.0.0.1:{port}");
    args.extend([
        "--listen".into(),
        format!("unix:{},{addr}", sock.display()),
        "--metrics-listen".into(),
        format!("127.0.0.1:{mport}"),
        "--shutdown-grace".into(),
        "3s".into(),
    ]);
    let proc = ServiceProcess::spawn(bin, &args, dir)?;
    Ok(Svc { proc, addr, sock, metrics_url: format!("http://127.0.0.1:{mport}"), token: String::new() })
}

impl NeutronCluster {
    /// Starts Keystone, Neutron and the API server (together), creates `kuryr-system` and
    /// `namespaces`, the CRDs, the watcher's and allocator's RBAC and credentials, and the Node
    /// of the Neutron agent's host.
    pub async fn start(namespaces: &[&str]) -> Result<Self> {
        Self::start_with_env(namespaces, &[], &[]).await
    }

    /// [`NeutronCluster::start`] with Octavia too (API and worker, amphora provider with the
    /// no-op drivers), in Keystone's catalog beside Neutron.
    pub async fn start_with_octavia(namespaces: &[&str]) -> Result<Self> {
        Self::start_with_env(namespaces, &[Service::Octavia], &[]).await
    }

    /// [`NeutronCluster::start`] with the agent enforcing security groups: the `openvswitch`
    /// firewall driver (OpenFlow and conntrack on the userspace datapath) instead of `noop`.
    pub async fn start_with_firewall(namespaces: &[&str]) -> Result<Self> {
        Self::start_with_env(namespaces, &[], &[("NEUTRON_FIREWALL_DRIVER", "openvswitch")]).await
    }

    /// [`NeutronCluster::start`] with more Neutron nodes, hosts `extra_hosts` (each a network
    /// namespace with its own Open vSwitch and ML2/OVS agent, so that ports bound to it bind),
    /// each also a Kubernetes Node (InternalIP 192.168.50.2, .3, ...).
    pub async fn start_with_nodes(namespaces: &[&str], extra_hosts: &[&str]) -> Result<Self> {
        let hosts = extra_hosts.join(",");
        let c = Self::start_with_env(namespaces, &[], &[("NEUTRON_EXTRA_AGENT_HOSTS", &hosts)]).await?;
        let nodes: Api<Node> = Api::all(c.admin.clone());
        for (i, host) in extra_hosts.iter().enumerate() {
            let meta = ObjectMeta { name: Some((*host).into()), ..Default::default() };
            nodes.create(&PostParams::default(), &Node { metadata: meta, ..Default::default() }).await?;
            let ip = format!("192.168.50.{}", i + 2);
            let status = json!({"status": {"addresses": [{"type": "InternalIP", "address": ip}]}});
            nodes.patch_status(host, &PatchParams::default(), &Patch::Merge(status)).await?;
        }
        Ok(c)
    }

    async fn start_with_env(namespaces: &[&str], more: &[Service], vars: &[(&str, &str)]) -> Result<Self> {
        let services: Vec<Service> =
            [Service::Keystone, Service::Neutron].into_iter().chain(more.iter().copied()).collect();
        let (os, kube) = tokio::join!(OpenStackEnv::start_with_env(&services, vars), KubeEnv::start());
        let (os, kube) = (os?, kube?);
        let admin = kube.client().await?;
        let pp = PostParams::default();
        let api: Api<Namespace> = Api::all(admin.clone());
        for n in std::iter::once(&SYSTEM_NAMESPACE).chain(namespaces) {
            let meta = ObjectMeta { name: Some((*n).into()), ..Default::default() };
            api.create(&pp, &Namespace { metadata: meta, ..Default::default() })
                .await
                .with_context(|| format!("creating namespace {n}"))?;
        }
        for entry in std::fs::read_dir(repo_root().join("deploy/crds"))? {
            let path = entry?.path();
            let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
            if name.starts_with("kuryr.openstack.org_") && name.ends_with(".yaml") {
                kube.apply_file(&path).await?;
            }
        }
        kube.apply_file(&repo_root().join("deploy/rbac/watcher.yaml")).await?;
        kube.apply_file(&repo_root().join("deploy/rbac/vif-allocator.yaml")).await?;
        let watcher_kubeconfig = kube.service_account_kubeconfig(SYSTEM_NAMESPACE, "kuryr-watcher").await?;
        let allocator_kubeconfig = kube.service_account_kubeconfig(SYSTEM_NAMESPACE, "kuryr-vif-allocator").await?;
        let node = os.neutron_node().context("Neutron runs but its node is not in the env file")?;
        let nodes: Api<Node> = Api::all(admin.clone());
        let meta = ObjectMeta { name: Some(node.host.clone()), ..Default::default() };
        nodes.create(&pp, &Node { metadata: meta, ..Default::default() }).await?;
        let status = json!({"status": {"addresses": [{"type": "InternalIP", "address": "192.168.50.1"}]}});
        nodes.patch_status(&node.host, &PatchParams::default(), &Patch::Merge(status)).await?;
        let neutron_url = os.neutron_url().context("no NEUTRON_URL")?.to_string();
        let cloud = CloudConfig {
            origin: "test".into(),
            auth: AuthConfig::NoAuth { project_id: None },
            region_name: None,
            interface: Interface::default(),
            tls: TlsConfig::default(),
            endpoint_overrides: [(ServiceType::Network, neutron_url.parse()?)].into(),
        };
        let client = Client::new(&cloud, ClientOptions::default(), Arc::new(kuryr_openstack::Metrics::unregistered()))?;
        let net = os.pod_network().context("no pod network in the env file")?;
        let pool_manager_token = kube.kuryr_token(SYSTEM_NAMESPACE, crate::cluster::POOL_MANAGER_ACCOUNT, None).await?;
        Ok(Self {
            os,
            kube,
            admin,
            dir: tempfile::tempdir()?,
            watcher_kubeconfig,
            allocator_kubeconfig,
            node,
            net,
            neutron: client.network(),
            neutron_url,
            pool_manager_token,
        })
    }

    /// Starts kuryr-watcher under its service account.
    pub fn watcher(&self) -> Result<Svc> {
        let args = vec!["--kubeconfig".into(), self.watcher_kubeconfig.display().to_string()];
        spawn("kuryr-watcher", args, self.dir.path())
    }

    /// Starts kuryr-policy `--backend neutron` under its service account (its RBAC applied
    /// here), as the `kuryr` user from clouds.yaml, with `extra` flags.
    pub async fn policy(&self, watcher: &Svc, extra: &[String]) -> Result<Svc> {
        let args = self.policy_args(watcher, extra).await?;
        spawn("kuryr-policy", args, self.dir.path())
    }

    /// [`Self::policy`]'s command line (its RBAC applied and its kubeconfig written here).
    pub async fn policy_args(&self, watcher: &Svc, extra: &[String]) -> Result<Vec<String>> {
        self.kube.apply_file(&repo_root().join("deploy/rbac/policy.yaml")).await?;
        let kubeconfig = self.kube.service_account_kubeconfig(SYSTEM_NAMESPACE, crate::cluster::POLICY_ACCOUNT).await?;
        let mut args = self.openstack_service_args(&kubeconfig, watcher);
        args.extend(extra.iter().cloned());
        Ok(args)
    }

    /// Starts kuryr-vif-allocator `--backend neutron` on the pod network (both subnets),
    /// authenticating as the `kuryr` user from clouds.yaml.
    pub fn allocator(&self, watcher: &Svc, o: &AllocatorOptions) -> Result<Svc> {
        let args = self.allocator_args(watcher, o);
        Ok(Svc { token: self.pool_manager_token.clone(), ..spawn("kuryr-vif-allocator", args, self.dir.path())? })
    }

    /// The flags [`NeutronCluster::allocator`] starts an allocator with (before its listen,
    /// metrics and shutdown flags).
    pub fn allocator_args(&self, watcher: &Svc, o: &AllocatorOptions) -> Vec<String> {
        let mut args = self.allocator_base_args(watcher);
        let subnets = format!("{},{}", self.net.subnet_v4_id, self.net.subnet_v6_id);
        let pool_min = o.pool_min.to_string();
        let pool_batch = o.pool_batch.to_string();
        args.extend(
            [
                "--pod-network-id",
                &self.net.network_id,
                "--pod-subnet-ids",
                &subnets,
                "--cluster-id",
                &o.cluster_id,
                "--pool-min",
                &pool_min,
                "--pool-batch",
                &pool_batch,
                "--instance",
                &o.instance,
                "--log",
                &o.log,
            ]
            .map(str::to_string),
        );
        // Orphans (and, sharded, the audit of this replica's ports) every 3 s unless the suite
        // chose otherwise.
        if !o.extra.iter().any(|a| a == "--orphan-gc-interval") {
            args.extend(["--orphan-gc-interval".into(), "3s".into()]);
        }
        if let Some(min) = &o.status_poll_min {
            args.extend(["--status-poll-min".into(), min.clone()]);
        }
        args.extend(o.extra.iter().cloned());
        args
    }

    /// kuryr-lbaas (replica `lb-1`) on Octavia as `o` says, following `watcher`, with its
    /// ServiceAccount's RBAC and kubeconfig, `extra` flags before the Octavia ones; not yet
    /// waited for.
    pub async fn lbaas(&self, watcher: &Svc, o: &crate::openstack::OctaviaLbaas, extra: &[&str]) -> Result<Sut> {
        let mut with_id = vec!["--instance", "lb-1", "--replica-id", "lb-1"];
        with_id.extend_from_slice(extra);
        self.lbaas_as(watcher, o, "lb-1", &with_id).await
    }

    /// kuryr-lbaas as [`Self::lbaas`], known to the test as `id`, with `extra` flags (its
    /// `--instance` and `--replica-id` among them when it is a replica).
    pub async fn lbaas_as(
        &self,
        watcher: &Svc,
        o: &crate::openstack::OctaviaLbaas,
        id: &str,
        extra: &[&str],
    ) -> Result<Sut> {
        self.kube.apply_file(&repo_root().join("deploy/rbac/lbaas.yaml")).await?;
        let kubeconfig = self.kube.service_account_kubeconfig(SYSTEM_NAMESPACE, "kuryr-lbaas").await?;
        let mut args: Vec<String> = vec!["--kubeconfig".into(), kubeconfig.display().to_string()];
        args.extend(["--watcher", &watcher.addr].map(str::to_string));
        args.extend(extra.iter().map(ToString::to_string));
        args.extend(o.args().into_iter().map(str::to_string));
        Sut::spawn("kuryr-lbaas", &args, self.dir.path(), id)
    }

    /// The flags of an allocator of this cluster that every suite shares — its kubeconfig, the
    /// watcher, `--backend neutron`, clouds.yaml and the `kuryr` cloud — for suites that choose
    /// the network flags themselves (per-namespace networks).
    pub fn allocator_base_args(&self, watcher: &Svc) -> Vec<String> {
        self.openstack_service_args(&self.allocator_kubeconfig, watcher)
    }

    /// A kuryr service on Neutron: `kubeconfig`, the watcher, `--backend neutron`, clouds.yaml and
    /// the `kuryr` cloud.
    fn openstack_service_args(&self, kubeconfig: &Path, watcher: &Svc) -> Vec<String> {
        let kubeconfig = kubeconfig.display().to_string();
        let clouds = self.os.clouds_yaml().display().to_string();
        ["--kubeconfig", &kubeconfig, "--watcher", &watcher.addr, "--backend", "neutron"]
            .into_iter()
            .chain(["--clouds-yaml", &clouds, "--os-cloud", "kuryr"])
            .map(str::to_string)
            .collect()
    }

    /// Starts a kuryr-binder for the Neutron node, inside its network namespace, on its OVS,
    /// following `allocator` over its unix socket; ADD waits at most `vif_wait`.
    pub async fn binder(&self, allocator: &Svc, vif_wait: Duration, extra: &[String]) -> Result<Binder> {
        self.binder_to(&format!("unix:{}", allocator.sock.display()), vif_wait, extra).await
    }

    /// [`NeutronCluster::binder`] following the allocator at `target` (any `--allocator` form
    /// reachable from the node's namespace).
    pub async fn binder_to(&self, target: &str, vif_wait: Duration, extra: &[String]) -> Result<Binder> {
        let token =
            self.kube.kuryr_token_file(SYSTEM_NAMESPACE, crate::cluster::BINDER_ACCOUNT, Some(&self.node.host)).await?;
        let mut args = vec![
            "--ovs-db".into(),
            self.node.ovsdb(),
            "--vif-wait-timeout".into(),
            secs(vif_wait),
            "--auth-token-file".into(),
            token.display().to_string(),
        ];
        args.extend(extra.iter().cloned());
        Binder::start(&self.node.host, &self.node.netns_path(), target, &args).await
    }

    /// A pod on the Neutron node.
    pub fn pod(&self, name: &str) -> Pod {
        crate::objects::pod(name).node(&self.node.host).build()
    }

    /// Creates pod `namespace/name` on the Neutron node with `labels`, plugs it into `br-int`
    /// through `binder` (CNI ADD by the shim, as a runtime does: the agent binds its port and
    /// programs its flows) and reports its addresses in its status, as the kubelet does.
    pub async fn plug_pod(
        &self,
        allocator: &Svc,
        binder: &Arc<Binder>,
        namespace: &str,
        name: &str,
        labels: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<PluggedPod> {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), namespace);
        let mut p = self.pod(name);
        p.metadata.labels = Some(labels.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect());
        let uid = pods.create(&PostParams::default(), &p).await?.metadata.uid.context("a pod without uid")?;
        let vif = allocator.wait_vif(&uid, timeout).await?;
        let netns = Arc::new(Netns::new(&format!("np{}", &uid[..4]))?);
        let cni = CniPod { namespace: namespace.into(), name: name.into(), uid: uid.clone(), netns };
        let (p, b) = (cni.clone(), binder.clone());
        let out = tokio::task::spawn_blocking(move || p.run("ADD", &b, None, timeout)).await??;
        anyhow::ensure!(out.code == 0, "ADD {name}: {} {}\n{}", out.stdout, out.stderr, binder.logs());
        let result = out.json()?;
        let ip = |v6: bool| -> Result<String> {
            let ips = result["ips"].as_array().context("no ips in the CNI result")?;
            let a = ips
                .iter()
                .filter_map(|i| i["address"].as_str())
                .find(|a| a.contains(':') == v6)
                .with_context(|| format!("no IPv{} address in {ips:?}", if v6 { 6 } else { 4 }))?;
            Ok(a.split('/').next().unwrap_or_default().to_string())
        };
        let (v4, v6) = (ip(false)?, ip(true)?);
        let status = json!({"status": {"phase": "Running", "podIP": v4, "podIPs": [{"ip": v4}, {"ip": v6}]}});
        pods.patch_status(name, &PatchParams::default(), &Patch::Merge(status)).await?;
        Ok(PluggedPod { name: name.into(), port: vif.vif_id, v4, v6, cni })
    }

    /// Creates the security group `pods` of the pod network's project, which lets in every address
    /// of the pod subnets (and everything out); its id.
    pub async fn pods_security_group(&self) -> Result<String> {
        let project = &self.net.project_id;
        let group =
            SecurityGroupCreate { name: "pods".into(), project_id: Some(project.clone()), ..Default::default() };
        let group = self.neutron.create_security_group(group).await.context("creating the pods group")?.id;
        let rule = |prefix: &str, eth: &str| SecurityGroupRuleCreate {
            security_group_id: group.clone(),
            direction: "ingress".into(),
            ethertype: eth.into(),
            remote_ip_prefix: Some(prefix.into()),
            project_id: Some(project.clone()),
            ..Default::default()
        };
        let rules = vec![rule(&self.net.subnet_v4_cidr, "IPv4"), rule(&self.net.subnet_v6_cidr, "IPv6")];
        self.neutron.create_security_group_rules(rules).await.context("letting the pod subnets in")?;
        Ok(group)
    }

    /// Sets the port quota of `project` (`PUT /v2.0/quotas/<project>`); -1 is unlimited.
    pub async fn set_port_quota(&self, project: &str, ports: i64) -> Result<()> {
        let url = format!("{}/v2.0/quotas/{project}", self.neutron_url);
        let resp = reqwest::Client::new()
            .put(&url)
            .json(&json!({"quota": {"port": ports}}))
            .send()
            .await
            .with_context(|| format!("PUT {url}"))?;
        let code = resp.status();
        anyhow::ensure!(code.is_success(), "PUT {url}: {code} {}", resp.text().await.unwrap_or_default());
        Ok(())
    }

    /// Neutron's RPC transport URL (`rabbit://openstack:<password>@127.0.0.1:<port>/`), over TLS
    /// (the broker's TLS listener) when `tls`.
    pub fn transport_url(&self, tls: bool) -> Result<String> {
        let url = self.os.env_value("TRANSPORT_URL").context("no TRANSPORT_URL in the env file")?;
        if !tls {
            return Ok(url.to_string());
        }
        let plain = self.os.env_value("RABBITMQ_AMQP_PORT").context("no RABBITMQ_AMQP_PORT")?;
        let tls_port = self.os.env_value("RABBITMQ_AMQPS_PORT").context("no RABBITMQ_AMQPS_PORT")?;
        Ok(url.replace(&format!(":{plain}/"), &format!(":{tls_port}/")))
    }

    /// Writes the neutron.conf an operator would mount for the allocator's port events: Neutron's
    /// `[DEFAULT] transport_url` and, with `tls`, `[oslo_messaging_rabbit] ssl` and `ssl_ca_file`
    /// for the broker's TLS listener. Returns its path.
    pub fn events_config(&self, tls: bool) -> Result<PathBuf> {
        let mut text = format!("[DEFAULT]\ncore_plugin = ml2\ntransport_url = {}\n", self.transport_url(tls)?);
        if tls {
            let ca = self.os.env_value("RABBITMQ_CA_FILE").context("no RABBITMQ_CA_FILE")?;
            text.push_str(&format!("[oslo_messaging_rabbit]\nssl = true\nssl_ca_file = {ca}\n"));
        }
        let path = self.dir.path().join(if tls { "neutron-tls.conf" } else { "neutron.conf" });
        std::fs::write(&path, text)?;
        Ok(path)
    }

    /// The ML2 extension aliases Neutron announces (`GET /v2.0/extensions`).
    pub async fn neutron_extensions(&self) -> Result<Vec<String>> {
        let url = format!("{}/v2.0/extensions", self.neutron_url);
        let body: serde_json::Value = reqwest::get(&url).await?.error_for_status()?.json().await?;
        Ok(body["extensions"]
            .as_array()
            .map(|a| a.iter().filter_map(|e| e["alias"].as_str().map(str::to_string)).collect())
            .unwrap_or_default())
    }
}

fn secs(d: Duration) -> String {
    format!("{}s", d.as_secs().max(1))
}

/// A pod as the runtime knows it when it calls CNI: its name, uid and network namespace.
#[derive(Clone, Debug)]
pub struct CniPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub netns: Arc<Netns>,
}

impl CniPod {
    /// Executes the shim for this pod as a runtime does; `prev` is the `prevResult` (CHECK).
    pub fn run(
        &self,
        op: &str,
        binder: &Binder,
        prev: Option<&serde_json::Value>,
        timeout: Duration,
    ) -> Result<ShimOutput> {
        self.run_at(op, &binder.socket, prev, timeout)
    }

    /// [`CniPod::run`] against the binder listening on `socket`.
    pub fn run_at(
        &self,
        op: &str,
        socket: &std::path::Path,
        prev: Option<&serde_json::Value>,
        timeout: Duration,
    ) -> Result<ShimOutput> {
        let container = format!("c-{}", self.uid);
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={container};K8S_POD_UID={}",
            self.namespace, self.name, self.uid
        );
        let netns_path = self.netns.path().display().to_string();
        let env = [
            ("CNI_COMMAND", op),
            ("CNI_CONTAINERID", container.as_str()),
            ("CNI_NETNS", netns_path.as_str()),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
            ("CNI_ARGS", args.as_str()),
        ];
        let mut conf = json!({
            "cniVersion": "1.1.0", "name": "kuryr", "type": "kuryr-cni",
            "binderSocket": socket, "timeoutSeconds": timeout.as_secs().max(1),
        });
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        run_shim(&env, conf.to_string().as_bytes())
    }
}

/// A pod plugged by [`NeutronCluster::plug_pod`]: its Neutron port, addresses and network
/// namespace.
#[derive(Clone, Debug)]
pub struct PluggedPod {
    pub name: String,
    /// The Neutron port's id.
    pub port: String,
    pub v4: String,
    pub v6: String,
    pub cni: CniPod,
}

impl PluggedPod {
    /// One ICMP echo from the pod's namespace to `to` (a fresh `ping` process: a new ICMP id, so
    /// a new connection for conntrack), answered within `wait` (fractions of a second allowed).
    pub fn ping_within(&self, to: &str, wait: Duration) -> Result<()> {
        let fam = if to.contains(':') { "-6" } else { "-4" };
        let w = format!("{:.3}", wait.as_secs_f64());
        self.cni.netns.exec(&["ping", fam, "-n", "-c", "1", "-W", &w, to]).map(drop)
    }

    /// [`PluggedPod::ping_within`] a second.
    pub fn ping(&self, to: &str) -> Result<()> {
        self.ping_within(to, Duration::from_secs(1))
    }
}

/// kuryr-policy's Neutron calls so far (`openstack_requests_total{service="network"}`) and the
/// generations of its desired and applied Neutron state.
pub async fn policy_counters(policy: &Svc) -> Result<(f64, i64, i64)> {
    let text = policy.metrics().await?;
    let calls = metric_sum(&text, "openstack_requests_total", &[r#"service="network""#]);
    let desired = metric(&text, "kuryr_policy_neutron_desired_generation") as i64;
    let applied = metric(&text, "kuryr_policy_neutron_applied_generation") as i64;
    Ok((calls, desired, applied))
}

/// One change to kuryr-policy's Neutron backend, measured: Neutron calls made and time from the
/// change to Neutron converged.
#[derive(Clone, Debug)]
pub struct PolicyChange {
    pub calls: f64,
    pub took: Duration,
}

/// Runs `change` and waits until kuryr-policy reports Neutron converged on a desired state newer
/// than before it (`applied == desired`); returns the calls made meanwhile.
pub async fn measure_policy_change<F: std::future::Future<Output = Result<()>>>(
    policy: &Svc,
    timeout: Duration,
    change: F,
) -> Result<PolicyChange> {
    let (before, gen_before, _) = policy_counters(policy).await?;
    let t = std::time::Instant::now();
    change.await?;
    wait_until("Neutron converged", timeout, || async {
        let (_, desired, applied) = policy_counters(policy).await?;
        anyhow::ensure!(desired > gen_before && applied == desired, "desired {desired}, applied {applied}");
        Ok(())
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e:#}\n{}", policy.proc.logs()))?;
    let took = t.elapsed();
    let (after, _, _) = policy_counters(policy).await?;
    Ok(PolicyChange { calls: after - before, took })
}
