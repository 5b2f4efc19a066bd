//! Kuryr-Kubernetes 10.0.0's own controller (`kuryr-k8s-controller` from its venv, built by
//! `tests/env/openstack/setup.sh kuryr`) against a [`NeutronCluster`]: the real kube-apiserver,
//! Keystone, Neutron and, when started with it, Octavia (found in Keystone's catalog). Its
//! configuration is Kuryr's documented one for that setup (neutron VIF driver, ports pool);
//! [`KuryrConfig`] adds its load-balancer handlers and their settings.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result};
use kube::core::{ApiResource, GroupVersionKind};

use kuryr_openstack::Filter;

use crate::neutron::NeutronCluster;
use crate::services::wait_until;
use crate::util::{free_port, repo_root};

/// Kuryr's venv (`$KURYR_OPENSTACK_CACHE/kuryr`, default under `/var/cache/kuryr-rs/openstack`).
pub fn venv() -> PathBuf {
    let cache = std::env::var_os("KURYR_OPENSTACK_CACHE")
        .map_or_else(|| PathBuf::from("/var/cache/kuryr-rs/openstack"), PathBuf::from);
    cache.join("kuryr")
}

/// Builds (or finds up to date) Kuryr's venv and CRD manifests.
pub fn setup() -> Result<()> {
    let out = std::process::Command::new("bash")
        .arg(repo_root().join("tests/env/openstack/setup.sh"))
        .arg("kuryr")
        .output()
        .context("running tests/env/openstack/setup.sh kuryr")?;
    anyhow::ensure!(out.status.success(), "setup.sh kuryr failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// Applies Kuryr's CRDs (`openstack.org/v1`) to the cluster.
pub async fn apply_crds(c: &NeutronCluster) -> Result<()> {
    for entry in std::fs::read_dir(venv().join("share/kuryr-crds")).context("Kuryr's CRD manifests")? {
        c.kube.apply_file(&entry?.path()).await?;
    }
    Ok(())
}

/// A Kuryr resource (`openstack.org/v1`) by kind and plural.
pub fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("openstack.org", "v1", kind), plural)
}

/// What varies between runs of Kuryr's controller.
#[derive(Clone, Debug)]
pub struct KuryrConfig {
    /// `[kubernetes] enabled_handlers`.
    pub handlers: String,
    /// `[neutron_defaults] service_subnet`: the Neutron subnet holding the Services' cluster IPs.
    pub service_subnet: Option<String>,
    /// Further sections, appended as they are (e.g. `[octavia_defaults]`).
    pub extra: String,
    /// `[kubernetes] vif_pool_driver`: `neutron` (ports pool) or `noop` (a port created per pod).
    pub vif_pool_driver: String,
    /// `[vif_pool] ports_pool_min` and `ports_pool_batch`.
    pub pool_min: u32,
    pub pool_batch: u32,
    /// `[DEFAULT] debug`.
    pub debug: bool,
}

impl Default for KuryrConfig {
    fn default() -> Self {
        Self {
            handlers: "vif,kuryrport".into(),
            service_subnet: None,
            extra: String::new(),
            vif_pool_driver: "neutron".into(),
            pool_min: 2,
            pool_batch: 3,
            debug: true,
        }
    }
}

/// Kuryr's controller, stopped (its whole process group) when dropped.
#[derive(Debug)]
pub struct KuryrController {
    child: std::process::Child,
    log: PathBuf,
}

/// The project's `default` security group (Neutron makes it when the project first asks).
pub async fn default_security_group(c: &NeutronCluster, project: &str) -> Result<String> {
    let url = format!("{}/v2.0/security-groups?project_id={project}&name=default", c.neutron_url);
    let resp = reqwest::Client::new().get(&url).header("X-Project-Id", project).send().await?;
    let body: serde_json::Value = resp.error_for_status()?.json().await?;
    body["security_groups"][0]["id"].as_str().map(str::to_string).context("no default security group")
}

impl KuryrController {
    /// Writes `dir/kuryr.conf` and starts the controller, logging into `dir`.
    pub async fn start(c: &NeutronCluster, dir: &Path, k: &KuryrConfig) -> Result<KuryrController> {
        let ks = c.os.keystone().context("Kuryr needs Keystone")?;
        let pki = c.kube.state_dir().join("pki");
        let sg = default_security_group(c, &ks.project_id).await?;
        let (health, metrics) = (free_port()?, free_port()?);
        let service_subnet = k.service_subnet.as_ref().map(|s| format!("service_subnet = {s}\n")).unwrap_or_default();
        let conf = format!(
            "[DEFAULT]\ndebug = {debug}\nuse_stderr = true\nlock_path = {locks}\n\n\
             [kubernetes]\napi_root = {api}\nssl_client_crt_file = {pki}/admin.crt\nssl_client_key_file = {pki}/admin.key\n\
             ssl_ca_crt_file = {pki}/ca.crt\nssl_verify_server_crt = true\ntoken_file =\n\
             pod_vif_driver = neutron-vif\nvif_pool_driver = {pool_driver}\nenabled_handlers = {handlers}\n\
             pod_subnets_driver = default\npod_security_groups_driver = default\nport_debug = true\n\
             controller_ha = false\nwatch_reconcile_period = 0\n\n\
             [neutron]\nauth_type = password\nauth_url = {auth}\nusername = {user}\npassword = {pass}\n\
             project_name = {project}\nuser_domain_name = Default\nproject_domain_name = Default\nregion_name = {region}\n\n\
             [neutron_defaults]\nproject = {project_id}\npod_subnet = {subnet}\npod_security_groups = {sg}\n\
             ovs_bridge = br-int\n{service_subnet}\n\
             [vif_pool]\nports_pool_min = {pool_min}\nports_pool_batch = {pool_batch}\nports_pool_max = 0\nports_pool_update_frequency = 5\n\n\
             [health_server]\nport = {health}\n\n[prometheus_exporter]\ncontroller_exporter_port = {metrics}\n\n{extra}",
            debug = k.debug,
            pool_driver = k.vif_pool_driver,
            pool_min = k.pool_min,
            pool_batch = k.pool_batch,
            locks = dir.join("locks").display(),
            api = c.kube.apiserver_url(),
            pki = pki.display(),
            handlers = k.handlers,
            auth = ks.auth_url,
            user = ks.username,
            pass = ks.password,
            project = ks.project_name,
            region = ks.region,
            project_id = ks.project_id,
            subnet = c.net.subnet_v4_id,
            extra = k.extra,
        );
        std::fs::create_dir_all(dir.join("locks"))?;
        let conf_path = dir.join("kuryr.conf");
        std::fs::write(&conf_path, conf)?;
        let log = dir.join("kuryr-controller.log");
        let file = std::fs::File::create(&log)?;
        use std::os::unix::process::CommandExt as _;
        let child = std::process::Command::new(venv().join("bin/kuryr-k8s-controller"))
            .arg("--config-file")
            .arg(&conf_path)
            // requests lets these override the CA Kuryr sets on its session: the apiserver's
            // certificate would then fail verification.
            .env_remove("REQUESTS_CA_BUNDLE")
            .env_remove("CURL_CA_BUNDLE")
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .process_group(0)
            .spawn()
            .context("starting kuryr-k8s-controller")?;
        Ok(KuryrController { child, log })
    }

    /// The last 40 lines of its log above DEBUG.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.contains(" DEBUG ")).collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The controller's process id (the leader of its process group).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Kills its process group.
    pub fn stop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        let pgid = self.child.id().to_string();
        let _ = std::process::Command::new("kill").args(["-KILL", "--", &format!("-{pgid}")]).status();
        let _ = self.child.wait();
    }
}

impl Drop for KuryrController {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The requests of a uWSGI request log (`logs/<name>.log` of the OpenStack environment) with
/// `method` whose line contains `fragment` (e.g. `/lbaas/pools =>`: the path's end, whatever the
/// API version prefix), started after `since` (seconds since the epoch). A line carries the time
/// its request started (it is logged when it completes).
pub fn requests_since(log: &Path, method: &str, fragment: &str, since: u64) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
    let needle = format!("] {method} ");
    let mut out = Vec::new();
    for l in text.lines().filter(|l| l.contains(&needle) && l.contains(fragment)) {
        let started = l
            .split("} [")
            .nth(1)
            .and_then(|r| r.split(&format!("] {method}")).next())
            .with_context(|| format!("no start time in {l:?}"))?;
        let date = std::process::Command::new("date").args(["-d", started, "+%s"]).output()?;
        let at: u64 =
            String::from_utf8_lossy(&date.stdout).trim().parse().with_context(|| format!("date -d {started:?}"))?;
        if at > since {
            out.push(l.to_string());
        }
    }
    Ok(out)
}

/// One run of `kuryr-migrate`: its exit status and output.
#[derive(Debug)]
pub struct Migrate {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Migrate {
    /// The last line printed (the summary).
    pub fn last_line(&self) -> &str {
        self.stdout.lines().last().unwrap_or_default()
    }
}

/// Runs `kuryr-migrate` against `c` (kubeconfig, clouds.yaml, the `kuryr` cloud, the pod network
/// and both subnets) with `args`; `crash_after` sets its crash hook (`KURYR_MIGRATE_CRASH_AFTER`).
pub fn migrate(c: &NeutronCluster, args: &[&str], crash_after: Option<usize>) -> Result<Migrate> {
    let mut cmd = std::process::Command::new(crate::services::bin_path("kuryr-migrate")?);
    cmd.arg("--kubeconfig")
        .arg(c.kube.kubeconfig_path())
        .arg("--clouds-yaml")
        .arg(c.os.clouds_yaml())
        .args(["--os-cloud", "kuryr", "--pod-network-id", &c.net.network_id])
        .args(["--pod-subnet-ids", &format!("{},{}", c.net.subnet_v4_id, c.net.subnet_v6_id)])
        .args(args)
        .env_remove("KURYR_MIGRATE_CRASH_AFTER");
    if let Some(k) = crash_after {
        cmd.env("KURYR_MIGRATE_CRASH_AFTER", k.to_string());
    }
    let out = cmd.output().context("running kuryr-migrate")?;
    let m = Migrate {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    eprintln!("kuryr-migrate {args:?} (crash after {crash_after:?}) → {}\n{}", m.code, m.stdout);
    Ok(m)
}

/// Waits until Kuryr's pool on the pod network of `c` holds at least `min` free ports. Kuryr tops
/// its pool up after each pod; once at its minimum it creates no more, so that stopping it then
/// leaves no port creation in flight.
pub async fn wait_pool_minimum(c: &NeutronCluster, min: usize, timeout: std::time::Duration) -> Result<()> {
    let pool_filter = Filter::new().network_id(&c.net.network_id).device_owner("compute:kuryr");
    wait_until(&format!("Kuryr's pool to be at its minimum ({min} free ports)"), timeout, || async {
        let ports = c.neutron.list_ports(&pool_filter).await?;
        let free = ports.iter().filter(|p| p.device_id.is_empty() && p.name == "kuryr-pool-port").count();
        anyhow::ensure!(free >= min, "{free} free pool ports");
        Ok(())
    })
    .await
}

/// Seconds since the epoch, now.
pub fn epoch_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
