//! kuryr-binder: the per-node daemon behind the `kuryr-cni` shim.
//!
//! It follows the allocator's `WatchVifs` stream for its node ([`vifs`]), serves the CNI
//! operations (`kuryr.binder.v1.Cni`, [`cni`]) on a unix socket, plugs VIFs into pod network
//! namespaces ([`plug`], on dedicated threads: [`netns`]) and records what it plugged
//! ([`attachments`]) so that it can restart while pods run. It is NOT_SERVING until its VIF
//! stream is live, and again whenever the stream is down or silent for longer than
//! `--stream-idle-timeout`. It programs pods' host ports ([`hostport`]) and, with `--lbaas`, the
//! node's Service dataplane from kuryr-lbaas's load balancer stream ([`lb`]) and, with `--policy`,
//! the node's NetworkPolicy rules from kuryr-policy's stream ([`policy`]), all in the node's
//! nftables table `inet kuryr` ([`table`]); its health does not depend on the latter two.

pub mod attachments;
pub mod cni;
pub mod cniconf;
pub mod hostport;
pub mod lb;
pub mod metrics;
pub mod netns;
pub mod noderoutes;
pub mod plug;
pub mod policy;
pub mod spec;
pub mod table;
pub mod upstream;
pub mod vifs;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kuryr_proto::binder::v1::cni_server::CniServer;
use kuryr_proto::service_names;
use kuryr_runtime::auth::local::LocalCallers;
use kuryr_runtime::auth::{AccountRef, Rules};
use kuryr_runtime::config::parse_duration;
use kuryr_runtime::follow::FollowArgs;
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime, Services};

/// The binder's version; the shim must send the same.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The largest CNI request accepted.
pub const MAX_REQUEST: usize = kuryr_cni_types::MAX_CONFIG_BYTES + 64 * 1024;

/// The CNI specification versions served.
pub const SUPPORTED_CNI_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// Command-line configuration.
#[derive(Clone, Debug, Parser)]
#[command(name = "kuryr-binder", version, about = "Plugs pod VIFs on this node; serves the kuryr-cni shim.")]
pub struct Config {
    /// gRPC listen addresses: unix:/path, comma-separated or repeated. The shim talks to the
    /// unix socket (created mode 0600); CNI calls on it are admitted only from root and
    /// `--cni-allow-uid`/`--cni-allow-gid`, by the kernel's peer credentials. TCP addresses are
    /// refused here.
    #[arg(long, env = "KURYR_BINDER_LISTEN", value_delimiter = ',', default_value = "unix:/run/kuryr/binder.sock")]
    pub listen: Vec<ListenAddr>,

    /// Also serve on this TCP address (HOST:PORT), for tools on other hosts. Off by default:
    /// the runtime needs only the unix socket. Calls on it are authenticated as the services'
    /// are (`--auth`): a ServiceAccount token checked with TokenReview (`--kubeconfig`), and the
    /// CNI operations only for `--cni-tcp-accounts`; health and reflection stay open.
    #[arg(long, env = "KURYR_BINDER_TCP_LISTEN")]
    pub tcp_listen: Option<ListenAddr>,

    /// The ServiceAccounts (`namespace:name`, comma-separated) that may call the CNI operations
    /// over `--tcp-listen`; none by default.
    #[arg(long, env = "KURYR_CNI_TCP_ACCOUNTS", value_delimiter = ',')]
    pub cni_tcp_accounts: Vec<AccountRef>,

    /// More uids whose processes may call the CNI operations on the unix socket (root always
    /// may), comma-separated. They also need access to the socket file, which is 0600 root.
    #[arg(long, env = "KURYR_CNI_ALLOW_UID", value_delimiter = ',')]
    pub cni_allow_uid: Vec<u32>,

    /// Primary gids whose processes may call the CNI operations on the unix socket,
    /// comma-separated (see --cni-allow-uid).
    #[arg(long, env = "KURYR_CNI_ALLOW_GID", value_delimiter = ',')]
    pub cni_allow_gid: Vec<u32>,

    /// HTTP address for Prometheus metrics (/metrics) and probes (/livez, /readyz).
    #[arg(long, env = "KURYR_BINDER_METRICS_LISTEN", default_value = "0.0.0.0:9631")]
    pub metrics_listen: ListenAddr,

    /// The VIF allocator to follow: HOST:PORT, http://HOST:PORT, unix:/path, or
    /// k8s:[NAMESPACE/]SERVICE:PORT (the Service's ready endpoints, found through the Kubernetes
    /// API: no cluster DNS needed).
    #[arg(long, env = "KURYR_ALLOCATOR", default_value = "127.0.0.1:9610")]
    pub allocator: String,

    /// kuryr-lbaas, whose load balancer specs this node programs into nftables (embedded
    /// backend): the same forms as --allocator. Without it no Service rules are programmed (and
    /// none are removed).
    #[arg(long, env = "KURYR_LBAAS")]
    pub lbaas: Option<String>,

    /// kuryr-policy, whose compiled NetworkPolicy for this node the binder programs into
    /// nftables: the same forms as --allocator. Without it no policy is enforced on this node
    /// (and rules programmed before stay as they are).
    #[arg(long, env = "KURYR_POLICY")]
    pub policy: Option<String>,

    /// The kubeconfig used to find k8s: targets and to check the tokens of callers on
    /// `--tcp-listen` (TokenReview); in-cluster configuration (or $KUBECONFIG) when unset. Not
    /// read unless a target is a k8s: one or --tcp-listen is set.
    #[arg(long, env = "KURYR_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// This node's name as Kubernetes knows it; defaults to the host name.
    #[arg(long, env = "KURYR_NODE_NAME")]
    pub node_name: Option<String>,

    /// Where the binder's records (attachments, the NetworkPolicy rules programmed) are kept
    /// across its restarts. They describe kernel state (veths, namespaces, nftables) that does
    /// not survive a reboot either, so a tmpfs is their home: under `/run` they go with the
    /// reboot, and each ADD's two record writes cost ~0.04 ms instead of ~1 ms on ext4.
    #[arg(long, env = "KURYR_BINDER_STATE_DIR", default_value = "/run/kuryr/binder")]
    pub state_dir: PathBuf,

    /// How long ADD waits for the pod's VIF to appear, and again for it to become ready, before
    /// answering "try again later" (CNI code 11). The runtime's own sandbox timeout is ~4 min.
    #[arg(long, env = "KURYR_VIF_WAIT_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub vif_wait_timeout: Duration,

    /// Write the runtime's CNI configuration (a conflist naming `kuryr-cni` and this binder's unix
    /// socket) to this path once the binder can serve ADDs, e.g.
    /// `/etc/cni/net.d/10-kuryr.conflist`; not written when unset.
    #[arg(long, env = "KURYR_CNI_CONFLIST")]
    pub cni_conflist: Option<PathBuf>,

    /// The `cniVersion` of the written conflist (--cni-conflist): 1.0.0 works with every current
    /// runtime (containerd 1.6/1.7 refuse 1.1.0); 1.1.0 enables STATUS and GC where the runtime's
    /// libcni supports them.
    #[arg(long, env = "KURYR_CNI_CONFLIST_VERSION", default_value = cniconf::DEFAULT_VERSION,
        value_parser = parse_cni_version)]
    pub cni_conflist_version: String,

    /// The OVS database for the `ovs` binding (passed to ovs-vsctl --db), e.g.
    /// unix:/run/openvswitch/db.sock; ovs-vsctl's default when unset.
    #[arg(long, env = "KURYR_OVS_DB")]
    pub ovs_db: Option<String>,

    /// Nested pods (VIFs on a VLAN of the VM's uplink).
    #[command(flatten)]
    pub nested: plug::vlan::NestedArgs,

    /// How the VIF and load balancer streams are read.
    #[command(flatten)]
    pub follow: FollowArgs,

    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the binder until SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    if let Some(tcp) = config.listen.iter().find(|l| matches!(l, ListenAddr::Tcp { .. })) {
        anyhow::bail!(
            "--listen {tcp}: the binder serves CNI on unix sockets only; anyone on the node (or in a \
             hostNetwork pod) can reach a TCP port. --tcp-listen serves TCP with authentication"
        );
    }
    if let Some(unix @ ListenAddr::Unix(_)) = &config.tcp_listen {
        anyhow::bail!("--tcp-listen {unix}: takes HOST:PORT; unix sockets go in --listen");
    }
    let mut rt = Runtime::new("kuryr-binder", &config.common)?;
    let local = LocalCallers::new(config.cni_allow_uid.clone(), config.cni_allow_gid.clone());
    let gate = match &config.tcp_listen {
        Some(_) => {
            let rules = Rules::new().allow(
                service_names::CNI,
                &["Add", "Del", "Check", "Status", "Gc", "Version"],
                &config.cni_tcp_accounts,
            );
            local.with_remote(config.common.auth.gate(config.kubeconfig.clone(), rules, rt.registry()))
        }
        None => local,
    };
    rt.set_gate(Arc::new(gate));
    let credentials = config.common.auth.credentials();
    let node = match config.node_name.clone() {
        Some(n) => n,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")?.trim().to_string(),
    };
    anyhow::ensure!(!node.is_empty(), "--node-name is empty and the host name is unknown");
    let attachments = attachments::Attachments::open(&config.state_dir.join("attachments"))
        .map_err(|e| anyhow::anyhow!("--state-dir {}: {e}", config.state_dir.display()))?;
    let hostports = hostport::HostPorts::new(lb::nft::Nft::default())
        .with_metrics(hostport::metrics::HostPortMetrics::register(rt.registry()));
    // Before serving, so that no DEL can race the restore of what the records hold.
    match hostports.restore(&attachments.all()).await {
        Ok(n) => tracing::info!(host_ports = n, "host ports restored from the attachment records"),
        Err(e) => tracing::error!(error = %e, "cannot program host ports; retried with the next pod change"),
    }
    let allocator = upstream::Allocator::new(
        kuryr_runtime::discover::channel(&config.allocator, config.kubeconfig.clone())
            .map_err(|e| anyhow::anyhow!("--allocator: {e}"))?,
        credentials.clone(),
    );
    let vifs = vifs::VifCache::default();
    let binder_id = format!("{node}/{}", std::process::id());
    tracing::info!(node, allocator = config.allocator, "binder starting");
    let follower = vifs::follower(allocator.clone(), node.clone(), binder_id, config.follow.config());
    tokio::spawn(vifs.clone().follow(follower, rt.health(), service_names::CNI, rt.shutdown()));
    tokio::spawn(noderoutes::run(vifs.clone(), node.clone(), rt.shutdown()));
    // Pods reaching themselves through a Service or a host port need it, with or without lbaas.
    tokio::spawn(lb::hairpin::run(vifs.clone(), rt.shutdown()));
    if let Some(path) = &config.cni_conflist {
        let socket = config.listen.iter().find_map(|l| match l {
            ListenAddr::Unix(p) => Some(p.clone()),
            ListenAddr::Tcp { .. } => None,
        });
        let socket =
            socket.ok_or_else(|| anyhow::anyhow!("--cni-conflist needs a unix:/path in --listen for kuryr-cni"))?;
        tokio::spawn(cniconf::write_when_live(
            vifs.clone(),
            path.clone(),
            socket,
            config.cni_conflist_version.clone(),
            rt.shutdown(),
        ));
    }
    if let Some(target) = &config.lbaas {
        let lbaas = kuryr_runtime::discover::peer("lbaas", target, config.kubeconfig.clone(), credentials.clone())?;
        tracing::info!(lbaas = target, "Service dataplane enabled");
        lb::Dataplane::new(lb::metrics::LbMetrics::register(rt.registry()), lb::nft::Nft::default(), &node).spawn(
            lbaas,
            format!("binder/{node}"),
            config.follow.config(),
            rt.shutdown(),
        );
    }
    if let Some(target) = &config.policy {
        let channel = kuryr_runtime::discover::channel(target, config.kubeconfig.clone())
            .map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
        let upstream = upstream::Upstream::new(channel, credentials.clone());
        tracing::info!(policy = target, "NetworkPolicy dataplane enabled");
        policy::Dataplane::new(
            policy::metrics::PolicyMetrics::register(rt.registry()),
            lb::nft::Nft::default(),
            &node,
            &config.state_dir,
        )
        .spawn(upstream, format!("binder/{node}"), config.follow.config(), rt.shutdown());
    }
    let service = cni::CniService {
        node,
        vifs,
        attachments,
        hostports,
        allocator,
        vif_wait: config.vif_wait_timeout,
        ovs_db: config.ovs_db.clone(),
        nested: config.nested.plug(),
        metrics: metrics::CniMetrics::register(rt.registry()),
        bridges_ready: Default::default(),
        locks: Default::default(),
    };
    // ADDs the previous run died in are undone before (or, per attachment, instead of) any
    // new operation on them: each takes its attachment's lock.
    tokio::spawn({
        let service = service.clone();
        async move { service.recover().await }
    });
    // A request carries the network configuration (at most 1 MiB, as the shim enforces) and a
    // few short strings.
    let cni = CniServer::new(service).max_decoding_message_size(MAX_REQUEST);
    let listen: Vec<ListenAddr> = config.listen.iter().chain(&config.tcp_listen).cloned().collect();
    rt.serve(Services::default().with(cni), &listen, Some(&config.metrics_listen)).await
}

/// A `cniVersion` this plugin speaks (the error lists the supported ones).
fn parse_cni_version(s: &str) -> Result<String, String> {
    kuryr_cni_types::CniVersion::parse(s).map(|v| v.as_str().to_string()).map_err(|e| e.msg.clone())
}
