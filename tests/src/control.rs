//! The control plane that the allocator and lbaas suites (and `octavia-bench`) put one service
//! under test into: a real kube-apiserver ([`KubeEnv`]) with the namespace `kuryr-system` and the
//! suite's own, the CRDs of `deploy/crds/` (the service's waited for until Established), the
//! RBAC of `deploy/rbac/watcher.yaml` and of the service (with `admission.yaml`'s policy), and a
//! kubeconfig per ServiceAccount, so
//! that both the watcher and the service run with exactly the rights they are deployed with.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use kuryr_tests::control::{ControlPlane, Served};
//! let c = ControlPlane::start(Served::Lbaas, "lb").await?;
//! let watcher = c.watcher(None, &[])?;
//! // kuryr-lbaas --kubeconfig c.kubeconfig --watcher watcher.addr ...
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

use crate::cluster::{
    ALLOCATOR_ACCOUNT, BINDER_ACCOUNT, LBAAS_ACCOUNT, POLICY_ACCOUNT, SYSTEM_NAMESPACE, WATCHER_ACCOUNT,
};
use crate::kube::KubeEnv;
use crate::openstack::OpenStackEnv;
use crate::services::ServiceProcess;
use crate::sut::{self, Sut};
use crate::util::{free_port, repo_root};

/// The service a control plane is set up for.
#[derive(Clone, Copy, Debug)]
pub enum Served {
    /// kuryr-vif-allocator: `deploy/rbac/vif-allocator.yaml` and its CRDs.
    Allocator,
    /// kuryr-lbaas: `deploy/rbac/lbaas.yaml` and its CRD.
    Lbaas,
    /// kuryr-policy: `deploy/rbac/policy.yaml` (no CRD).
    Policy,
}

impl Served {
    /// Its ServiceAccount in `kuryr-system`.
    fn account(self) -> &'static str {
        match self {
            Self::Allocator => ALLOCATOR_ACCOUNT,
            Self::Lbaas => LBAAS_ACCOUNT,
            Self::Policy => POLICY_ACCOUNT,
        }
    }

    /// Its RBAC manifest, relative to the repository root.
    fn rbac(self) -> &'static str {
        match self {
            Self::Allocator => "deploy/rbac/vif-allocator.yaml",
            Self::Lbaas => "deploy/rbac/lbaas.yaml",
            Self::Policy => "deploy/rbac/policy.yaml",
        }
    }

    /// The CRDs it needs, as the service crate lists them.
    fn crds(self) -> Vec<(&'static str, CustomResourceDefinition)> {
        match self {
            Self::Allocator => kuryr_vif_allocator::k8s::crd::crds(),
            Self::Lbaas => kuryr_lbaas::k8s::crd::crds(),
            Self::Policy => Vec::new(),
        }
    }
}

/// The API server set up for one service; dropping it stops the API server.
pub struct ControlPlane {
    /// The API server.
    pub env: KubeEnv,
    /// Cluster admin.
    pub admin: kube::Client,
    /// Where the processes started for the test log.
    pub dir: tempfile::TempDir,
    /// kuryr-watcher's ServiceAccount credentials.
    pub watcher_kubeconfig: PathBuf,
    /// The served service's ServiceAccount credentials.
    pub kubeconfig: PathBuf,
    /// A token of the binders' ServiceAccount for the kuryr audience, bound to no node: what the
    /// suites' binder-like clients send (WatchVifs, ReportPlugged, WatchLoadBalancers).
    pub binder_token: String,
    /// The suite's namespace.
    pub ns: String,
}

/// A kuryr-watcher process with its gRPC and metrics addresses.
#[derive(Debug)]
pub struct Watcher {
    /// The process (killed on drop).
    pub proc: ServiceProcess,
    /// `127.0.0.1:port`, as given to `--watcher`.
    pub addr: String,
    /// `http://127.0.0.1:port/metrics`.
    pub metrics_url: String,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("env", &self.env)
            .field("dir", &self.dir)
            .field("watcher_kubeconfig", &self.watcher_kubeconfig)
            .field("kubeconfig", &self.kubeconfig)
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Starts an API server and sets it up for `served` with the namespace `ns`.
    pub async fn start(served: Served, ns: &str) -> Result<Self> {
        Self::on(KubeEnv::start().await?, served, ns).await
    }

    /// Starts the API server set up for kuryr-lbaas with the namespace `ns` and, side by side (both
    /// take seconds), OpenStack's `services` (Octavia among them); with Octavia's URL.
    pub async fn lbaas_with_openstack(
        ns: &str,
        services: &[crate::openstack::Service],
    ) -> Result<(Self, OpenStackEnv, String)> {
        let (c, os) = tokio::join!(Self::start(Served::Lbaas, ns), OpenStackEnv::start(services));
        let (c, os) = (c?, os?);
        let octavia_url = os.octavia_url().context("no Octavia in the OpenStack environment")?.to_string();
        Ok((c, os, octavia_url))
    }

    /// Sets `env` up for `served`: the namespaces `kuryr-system` and `ns`, all CRDs (the
    /// service's Established on return), the watcher's and the service's RBAC and credentials.
    pub async fn on(env: KubeEnv, served: Served, ns: &str) -> Result<Self> {
        let admin = env.client().await?;
        for n in [SYSTEM_NAMESPACE, ns] {
            crate::objects::create_namespace(&admin, n).await?;
        }
        let names: Vec<String> = served.crds().into_iter().filter_map(|(_, c)| c.metadata.name).collect();
        env.install_crds(&names).await?;
        env.apply_file(&repo_root().join("deploy/rbac/watcher.yaml")).await?;
        env.apply_file(&repo_root().join(served.rbac())).await?;
        // What RBAC cannot narrow: the service may change only finalizers of what it patches.
        env.apply_file(&repo_root().join("deploy/rbac/admission.yaml")).await?;
        let watcher_kubeconfig = env.service_account_kubeconfig(SYSTEM_NAMESPACE, WATCHER_ACCOUNT).await?;
        let kubeconfig = env.service_account_kubeconfig(SYSTEM_NAMESPACE, served.account()).await?;
        let binder_token = env.kuryr_token(SYSTEM_NAMESPACE, BINDER_ACCOUNT, None).await?;
        Ok(Self { env, admin, dir: tempfile::tempdir()?, watcher_kubeconfig, kubeconfig, binder_token, ns: ns.into() })
    }

    /// The API of `K` in the suite's namespace, as cluster admin.
    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = kube::core::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.admin.clone(), &self.ns)
    }

    /// A Service `name` in the suite's namespace on port 80, whose one IPv4 EndpointSlice
    /// (`name-1`) lists `members` on 8080, ready.
    pub async fn create_web_service(&self, name: &str, members: &[String]) -> Result<()> {
        let svc = sut::service(name, json!({"ports": [{"port": 80, "targetPort": 8080}]}))?;
        self.api::<Service>().create(&PostParams::default(), &svc).await?;
        self.put_web_members(name, members).await
    }

    /// Sets the members of [`Self::create_web_service`]'s Service `name`.
    pub async fn put_web_members(&self, name: &str, members: &[String]) -> Result<()> {
        let endpoints: Vec<Value> = members.iter().map(|a| sut::ready_endpoint(a)).collect();
        let ports = json!([{"port": 8080, "protocol": "TCP"}]);
        let slice = sut::slice(&format!("{name}-1"), name, "IPv4", ports, json!(endpoints))?;
        sut::put_slice(&self.api(), slice).await
    }

    /// Starts a kuryr-lbaas replica `id` under its ServiceAccount, following `watcher`, with
    /// `extra` flags. `id` is both its instance (Events) and its replica identity (Leases): as a
    /// pod name would be, a restart after kill -9 is the same replica and takes its shard Leases
    /// back at once instead of waiting for them to expire. Logs at debug unless `extra` sets
    /// `--log`.
    pub fn lbaas(&self, watcher: &Watcher, id: &str, extra: &[&str]) -> Result<Sut> {
        let mut args: Vec<String> = vec![
            "--kubeconfig".into(),
            self.kubeconfig.display().to_string(),
            "--watcher".into(),
            watcher.addr.clone(),
            "--instance".into(),
            id.into(),
            "--replica-id".into(),
            id.into(),
        ];
        if !extra.contains(&"--log") {
            args.extend(["--log".into(), "info,kuryr_lbaas=debug,kuryr_shard=debug".into()]);
        }
        args.extend(extra.iter().map(ToString::to_string));
        Sut::spawn("kuryr-lbaas", &args, self.dir.path(), id)
    }

    /// kuryr-vif-allocator's first arguments with the embedded IPAM: its credentials, following
    /// `watcher`, the pod network `network` over 10.244.0.0/16 in /26 IPv4 blocks.
    pub fn allocator_args(&self, watcher: &Watcher, network: &str) -> Vec<String> {
        let kubeconfig = self.kubeconfig.display().to_string();
        let args = ["--kubeconfig", &kubeconfig, "--watcher", &watcher.addr, "--network", network];
        let ipam = ["--network-cidrs", "10.244.0.0/16", "--ipv4-block-prefix", "26"];
        args.iter().chain(&ipam).map(ToString::to_string).collect()
    }

    /// Starts kuryr-watcher under its ServiceAccount, listening on `addr` (a free port when
    /// `None`, the old address to restart it) and metrics on a free port, with `extra` flags.
    pub fn watcher(&self, addr: Option<&str>, extra: &[&str]) -> Result<Watcher> {
        let addr = match addr {
            Some(a) => a.to_string(),
            None => format!("127.0.0.1:{}", free_port()?),
        };
        let mport = free_port()?;
        let mut args = vec![
            "--kubeconfig".to_string(),
            self.watcher_kubeconfig.display().to_string(),
            "--listen".into(),
            addr.clone(),
            "--metrics-listen".into(),
            format!("127.0.0.1:{mport}"),
        ];
        args.extend(extra.iter().map(ToString::to_string));
        let proc = ServiceProcess::spawn("kuryr-watcher", &args, self.dir.path())?;
        Ok(Watcher { proc, addr, metrics_url: format!("http://127.0.0.1:{mport}/metrics") })
    }
}

/// Lease name → resourceVersion of every Lease of the shard set `set` in `kuryr-system`: shard
/// and membership Leases.
pub async fn lease_versions(admin: &kube::Client, set: &str) -> Result<BTreeMap<String, String>> {
    let leases: Api<Lease> = Api::namespaced(admin.clone(), SYSTEM_NAMESPACE);
    let list = leases.list(&ListParams::default().labels(&format!("kuryr.openstack.org/shard-set={set}"))).await?;
    Ok(list
        .items
        .into_iter()
        .map(|l| (l.metadata.name.unwrap_or_default(), l.metadata.resource_version.unwrap_or_default()))
        .collect())
}

/// Waits until each of the Leases `names` of the shard set `set` has been written `times` times
/// since `before` (a [`lease_versions`] read), polling; returns the versions read last.
pub async fn wait_rewritten(
    admin: &kube::Client,
    set: &str,
    names: &[String],
    before: &BTreeMap<String, String>,
    times: usize,
    timeout: std::time::Duration,
) -> Result<BTreeMap<String, String>> {
    let mut seen: BTreeMap<&str, Vec<String>> =
        names.iter().map(|n| (n.as_str(), before.get(n).cloned().into_iter().collect())).collect();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let now = lease_versions(admin, set).await?;
        for (name, versions) in &mut seen {
            if let Some(v) = now.get(*name)
                && versions.last() != Some(v)
            {
                versions.push(v.clone());
            }
        }
        let short: Vec<_> = seen.iter().filter(|(_, v)| v.len() <= times).map(|(n, _)| *n).collect();
        if short.is_empty() {
            return Ok(now);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {names:?} to be written {times} times: {short:?} were not"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Shard → (holder identity, its advertised endpoint) of the shard set `set` (`kuryr-lbaas`,
/// `kuryr-vif-allocator`), as its Lease objects in `kuryr-system` say; held Leases only.
pub async fn shard_holders(admin: &kube::Client, set: &str) -> Result<BTreeMap<u32, (String, String)>> {
    let leases: Api<Lease> = Api::namespaced(admin.clone(), SYSTEM_NAMESPACE);
    let list = leases.list(&ListParams::default().labels(&format!("kuryr.openstack.org/shard-set={set}"))).await?;
    let mut out = BTreeMap::new();
    for l in list.items {
        let name = l.metadata.name.clone().unwrap_or_default();
        let Some(i) = name.strip_prefix(&format!("{set}-shard-")).and_then(|i| i.parse().ok()) else { continue };
        let spec = l.spec.unwrap_or_default();
        if let Some(h) = spec.holder_identity.filter(|h| !h.is_empty()) {
            let endpoint =
                l.metadata.annotations.and_then(|a| a.get("kuryr.openstack.org/endpoint").cloned()).unwrap_or_default();
            out.insert(i, (h, endpoint));
        }
    }
    Ok(out)
}
