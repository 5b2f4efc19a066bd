//! Real OpenStack services for one test: Keystone, Neutron (API, RPC server, ML2/OVS agent on a
//! private Open vSwitch) and Octavia (API and worker with the no-op drivers), started on loopback
//! by `tests/env/openstack/up.sh` into a private state directory and stopped (by pid) when
//! dropped. Any subset can be started; MariaDB and RabbitMQ come along as needed.
//!
//! The venvs are built on first use (`tests/env/openstack/setup.sh`, pinned sets, cached under
//! `/var/cache/kuryr-rs/openstack`), as are the migrated database schemas, so only the first start
//! on a machine pays for them.
//!
//! Neutron and Octavia run with `auth_strategy = noauth`: no token is needed and every caller is
//! admin; the owner of what is created comes from `project_id` in the body (Neutron, Octavia) or
//! the `X-Project-Id` header (Octavia). Started together with Keystone, both are in its catalog.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use kuryr_tests::openstack::{OpenStackEnv, Service};
//! let env = OpenStackEnv::start(&[Service::Keystone]).await?;
//! let ks = env.keystone().expect("started with keystone");
//! println!("{} {} {}", ks.auth_url, ks.username, env.clouds_yaml().display());
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::process::Command;

use crate::util::{parse_env_file, repo_root};

/// Bound on `up.sh`. Warm, Keystone alone is up in 15–40 s and all three in about a minute on a
/// loaded 2-core machine; the first run on a machine also builds the venvs and migrates the
/// databases from scratch.
const UP_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// Bound on stopping or starting one process (stopping waits up to 5 s before KILL).
const CTL_TIMEOUT: Duration = Duration::from_secs(60);

/// One of the services `up.sh` can start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// Keystone under uWSGI, with a project, a user and an application credential.
    Keystone,
    /// The Neutron API, neutron-rpc-server and one node: OVS + the ML2/OVS agent.
    Neutron,
    /// The Octavia API and worker, amphora provider with no-op drivers.
    Octavia,
}

impl Service {
    /// The name `up.sh` takes.
    pub fn name(self) -> &'static str {
        match self {
            Service::Keystone => "keystone",
            Service::Neutron => "neutron",
            Service::Octavia => "octavia",
        }
    }
}

/// What a client needs to authenticate against the environment's Keystone.
#[derive(Debug, Clone)]
pub struct KeystoneCredentials {
    /// `http://127.0.0.1:<port>/v3`.
    pub auth_url: String,
    /// The region of every catalog entry.
    pub region: String,
    /// The bootstrap admin (user `admin`, project `admin`, domain `Default`).
    pub admin_password: String,
    /// The project Kuryr's resources belong to (`kuryr`), its id.
    pub project_name: String,
    pub project_id: String,
    /// A user with the `member` role on that project, in domain `Default`.
    pub username: String,
    pub user_id: String,
    pub password: String,
    /// An application credential of that user, bound to that project.
    pub application_credential_id: String,
    pub application_credential_secret: String,
}

/// The Neutron node: where the agent runs and ports bind.
#[derive(Debug, Clone)]
pub struct NeutronNode {
    /// The agent's host: the `binding:host_id` to give ports that should bind here.
    pub host: String,
    /// The network namespace that ovs-vswitchd, its datapath and the agent live in.
    pub netns: String,
    /// `OVS_RUNDIR` of this node's Open vSwitch (`db.sock`, the daemons' control sockets).
    pub ovs_rundir: PathBuf,
    /// The integration bridge ports are plugged into (`br-int`).
    pub integration_bridge: String,
}

impl NeutronNode {
    /// `/var/run/netns/<netns>`.
    pub fn netns_path(&self) -> PathBuf {
        PathBuf::from("/var/run/netns").join(&self.netns)
    }

    /// `unix:<rundir>/db.sock`, the value for `ovs-vsctl --db=`.
    pub fn ovsdb(&self) -> String {
        format!("unix:{}", self.ovs_rundir.join("db.sock").display())
    }
}

/// The pod network `up.sh` creates with Neutron, owned by the `kuryr` project.
#[derive(Debug, Clone)]
pub struct PodNetwork {
    pub project_id: String,
    pub network_id: String,
    pub subnet_v4_id: String,
    pub subnet_v4_cidr: String,
    pub subnet_v6_id: String,
    pub subnet_v6_cidr: String,
}

/// Running OpenStack services with their state directory (configs, logs, pid files, the
/// databases). Dropping it stops everything and removes the directory, unless
/// `KURYR_KEEP_STATE=1` is set.
#[derive(Debug)]
pub struct OpenStackEnv {
    state_dir: PathBuf,
    env: Vec<(String, String)>,
    keep_state: bool,
}

/// `tests/env/openstack/<name>`.
fn script(name: &str) -> PathBuf {
    repo_root().join("tests/env/openstack").join(name)
}

impl OpenStackEnv {
    /// Starts the given services (and what they need) on free loopback ports and waits until each
    /// answers. A watchdog tied to this process stops them even if the test binary dies without
    /// running `Drop`.
    pub async fn start(services: &[Service]) -> Result<OpenStackEnv> {
        Self::start_with_env(services, &[]).await
    }

    /// [`OpenStackEnv::start`] with more environment for `up.sh` (e.g.
    /// `NEUTRON_FIREWALL_DRIVER=openvswitch`: the agent enforces security groups).
    pub async fn start_with_env(services: &[Service], vars: &[(&str, &str)]) -> Result<OpenStackEnv> {
        if services.is_empty() {
            bail!("OpenStackEnv::start: no service given");
        }
        let (state_dir, keep_state) = crate::util::state_dir("kuryr-os-")?;
        let mut env = OpenStackEnv { state_dir, env: Vec::new(), keep_state };
        let mut cmd = Command::new("bash");
        cmd.arg(script("up.sh"))
            .arg(&env.state_dir)
            .args(services.iter().map(|s| s.name()))
            .env("OS_UP_OWNER_PID", std::process::id().to_string())
            .envs(vars.iter().copied())
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let out = tokio::time::timeout(UP_TIMEOUT, cmd.output())
            .await
            .with_context(|| format!("tests/env/openstack/up.sh did not finish within {UP_TIMEOUT:?}"))?
            .context("running tests/env/openstack/up.sh")?;
        if !out.status.success() {
            bail!(
                "starting OpenStack ({}) with tests/env/openstack/up.sh failed ({}):\n{}",
                services.iter().map(|s| s.name()).collect::<Vec<_>>().join(", "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = std::fs::read_to_string(env.state_dir.join("env")).context("reading the env file of up.sh")?;
        env.env = parse_env_file(&text);
        Ok(env)
    }

    /// The state directory (`logs/`, `pids/`, per-service configs, `clouds.yaml`, `env`).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// A value of the env file written by `up.sh` (`NEUTRON_URL`, `OS_AUTH_URL`, `*_PID`, ...).
    pub fn env_value(&self, key: &str) -> Option<&str> {
        self.env.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    fn required(&self, key: &str) -> Result<String> {
        self.env_value(key).map(str::to_string).with_context(|| format!("{key} missing from the env file"))
    }

    /// `clouds.yaml` with the clouds `admin`, `kuryr` (password), `kuryr-appcred` (application
    /// credential) when Keystone runs, and `noauth` (direct endpoints) when Neutron or Octavia do.
    pub fn clouds_yaml(&self) -> PathBuf {
        self.state_dir.join("clouds.yaml")
    }

    /// `openrc`: `OS_*` variables of the `kuryr` user (only when Keystone runs).
    pub fn openrc(&self) -> PathBuf {
        self.state_dir.join("openrc")
    }

    /// Keystone's URL and the credentials made at start, when Keystone runs.
    pub fn keystone(&self) -> Option<KeystoneCredentials> {
        let get = |k: &str| self.required(k).ok();
        Some(KeystoneCredentials {
            auth_url: get("OS_AUTH_URL")?,
            region: get("OS_REGION_NAME")?,
            admin_password: get("OS_ADMIN_PASSWORD")?,
            project_name: get("OS_PROJECT_NAME")?,
            project_id: get("OS_PROJECT_ID")?,
            username: get("OS_USERNAME")?,
            user_id: get("OS_USER_ID")?,
            password: get("OS_PASSWORD")?,
            application_credential_id: get("OS_APPLICATION_CREDENTIAL_ID")?,
            application_credential_secret: get("OS_APPLICATION_CREDENTIAL_SECRET")?,
        })
    }

    /// The Neutron API's base URL (`http://127.0.0.1:<port>`, paths start with `/v2.0`).
    pub fn neutron_url(&self) -> Option<&str> {
        self.env_value("NEUTRON_URL")
    }

    /// The Octavia API's base URL (`http://127.0.0.1:<port>`, paths start with `/v2`).
    pub fn octavia_url(&self) -> Option<&str> {
        self.env_value("OCTAVIA_URL")
    }

    /// The node the Neutron agent runs on, when Neutron runs.
    pub fn neutron_node(&self) -> Option<NeutronNode> {
        Some(NeutronNode {
            host: self.env_value("NEUTRON_AGENT_HOST")?.to_string(),
            netns: self.env_value("NEUTRON_NODE_NETNS")?.to_string(),
            ovs_rundir: PathBuf::from(self.env_value("OVS_RUNDIR")?),
            integration_bridge: self.env_value("NEUTRON_INTEGRATION_BRIDGE")?.to_string(),
        })
    }

    /// The pod network and its subnets, when Neutron runs.
    pub fn pod_network(&self) -> Option<PodNetwork> {
        let get = |k: &str| self.env_value(k).map(str::to_string);
        Some(PodNetwork {
            project_id: get("POD_PROJECT_ID")?,
            network_id: get("POD_NETWORK_ID")?,
            subnet_v4_id: get("POD_SUBNET_V4_ID")?,
            subnet_v4_cidr: get("POD_SUBNET_V4_CIDR")?,
            subnet_v6_id: get("POD_SUBNET_V6_ID")?,
            subnet_v6_cidr: get("POD_SUBNET_V6_CIDR")?,
        })
    }

    /// The processes of this environment in start order (`mariadb`, `rabbitmq`, `keystone`,
    /// `neutron-api`, `neutron-rpc`, `neutron-agent`, `octavia-api`, `octavia-worker`, ...).
    pub fn process_names(&self) -> Vec<String> {
        std::fs::read_to_string(self.state_dir.join("start-order"))
            .map(|t| t.lines().map(str::to_string).collect())
            .unwrap_or_default()
    }

    /// The current pid of a process of this environment (it changes when it is started again).
    pub fn pid(&self, name: &str) -> Option<u32> {
        std::fs::read_to_string(self.state_dir.join("pids").join(format!("{name}.pid"))).ok()?.trim().parse().ok()
    }

    /// Stops one process (TERM, KILL after a bound), e.g. `neutron-api` for a fault test.
    pub async fn stop_process(&self, name: &str) -> Result<()> {
        self.ctl("stop", name).await.map(|_| ())
    }

    /// Kills one process at once with SIGKILL, as a crash would.
    pub async fn kill_process(&self, name: &str) -> Result<()> {
        self.ctl("kill", name).await.map(|_| ())
    }

    /// Starts a stopped process again with the same command line, port and state; returns its
    /// pid. It is running, not necessarily ready: poll its API.
    pub async fn start_process(&self, name: &str) -> Result<u32> {
        let out = self.ctl("start", name).await?;
        out.trim().parse().with_context(|| format!("ctl.sh start {name} printed {out:?}, not a pid"))
    }

    async fn ctl(&self, action: &str, name: &str) -> Result<String> {
        let out = Command::new("bash")
            .arg(script("ctl.sh"))
            .arg(&self.state_dir)
            .args([action, name])
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(CTL_TIMEOUT, out)
            .await
            .with_context(|| format!("ctl.sh {action} {name} did not finish within {CTL_TIMEOUT:?}"))?
            .with_context(|| format!("running ctl.sh {action} {name}"))?;
        if !out.status.success() {
            bail!("ctl.sh {action} {name} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The last `lines` lines of `logs/<name>.log` (for assertion messages).
    pub fn log_tail(&self, name: &str, lines: usize) -> String {
        let path = self.state_dir.join("logs").join(format!("{name}.log"));
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let all: Vec<&str> = text.lines().collect();
                all[all.len().saturating_sub(lines)..].join("\n")
            }
            Err(e) => format!("(cannot read {}: {e})", path.display()),
        }
    }
}

impl Drop for OpenStackEnv {
    fn drop(&mut self) {
        crate::util::run_down_script(&script("down.sh"), "openstack/down.sh", &self.state_dir, self.keep_state);
    }
}

/// kuryr-lbaas' flags for `--backend octavia` against an environment's Octavia.
#[derive(Clone, Debug)]
pub struct OctaviaLbaas {
    /// Octavia's endpoint ([`OpenStackEnv::octavia_url`]).
    pub url: String,
    /// The project owning the load balancers (Octavia runs with noauth: any id will do).
    pub project: String,
    /// The VIP subnet (any id for the no-op network driver); `None` leaves the flag to the caller.
    pub vip_subnet: Option<String>,
    /// Tags the load balancers, so that a suite finds its own.
    pub cluster_name: String,
    /// `--drift-interval`.
    pub drift_interval: String,
    /// `--octavia-active-timeout`.
    pub active_timeout: String,
}

impl OctaviaLbaas {
    /// The flags.
    pub fn args(&self) -> Vec<&str> {
        let mut args = vec![
            "--backend",
            "octavia",
            "--octavia-url",
            &self.url,
            "--os-project-id",
            &self.project,
            "--cluster-name",
            &self.cluster_name,
            "--drift-interval",
            &self.drift_interval,
            "--octavia-active-timeout",
            &self.active_timeout,
        ];
        if let Some(subnet) = &self.vip_subnet {
            args.extend(["--vip-subnet-id", subnet]);
        }
        args
    }
}
