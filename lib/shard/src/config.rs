//! The flags of a sharded service and what they resolve to.

use std::time::Duration;

use kuryr_runtime::ListenAddr;
use kuryr_runtime::config::parse_duration;

use crate::hash::fnv1a64;

/// Most shards a service may be split into.
pub const MAX_SHARDS: u32 = 1024;

/// Flags every sharded service flattens into its configuration.
#[derive(Clone, Debug, clap::Args)]
pub struct ShardArgs {
    /// Shards the work is split into, owned by the replicas through Kubernetes Leases (one per
    /// shard, plus one per live replica). 0: no Leases, this replica does all the work (a
    /// single replica that needs no RBAC for Leases).
    #[arg(long, env = "KURYR_SHARDS", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(0..=i64::from(MAX_SHARDS)))]
    pub shards: u32,

    /// Namespace of the Leases; $POD_NAMESPACE when unset, else `kuryr-system`.
    #[arg(long, env = "KURYR_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,

    /// How long a Lease holds without renewal. Renewed every fifth of it; a replica that dies
    /// loses its shards to the others within this duration (plus one renewal interval).
    #[arg(long, env = "KURYR_LEASE_DURATION", default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,

    /// This replica's identity in the Leases (unique among replicas, stable across restarts of
    /// the same replica): $POD_NAME when unset, else `<hostname>-<pid>`.
    #[arg(long, env = "KURYR_REPLICA_ID")]
    pub replica_id: Option<String>,

    /// The `HOST:PORT` where other components reach this replica's gRPC API, written into its
    /// Leases so that work can be routed to a shard's owner: $POD_IP with the first TCP listen
    /// port when unset, else the first TCP listen address (or the host name for 0.0.0.0 / ::).
    #[arg(long, env = "KURYR_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,
}

/// The resolved configuration of a shard set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardConfig {
    /// Names the Leases: `<service>-shard-<i>`, `<service>-member-<identity>`.
    pub service: String,
    /// The number of shards (0: unsharded).
    pub shards: u32,
    /// The Leases' namespace.
    pub namespace: String,
    /// The Lease duration.
    pub duration: Duration,
    /// This replica's identity.
    pub identity: String,
    /// This replica's endpoint.
    pub endpoint: String,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// A DNS-1123 label: what a namespace must be.
fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Whether `s` is `HOST:PORT` (`[v6]:PORT` for IPv6).
fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else { return false };
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    !host.is_empty() && !host.contains('/') && port.parse::<u16>().is_ok_and(|p| p > 0)
}

fn join(host: &str, port: u16) -> String {
    if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// The object-name form of an identity: lower-case letters, digits, `-` and `.`, at most 63
/// characters; an identity that had to be changed gets its hash appended so that two
/// identities never share a name.
pub fn name_part(identity: &str) -> String {
    let clean: String = identity
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c.to_ascii_lowercase() } else { '-' })
        .collect();
    let clean = clean.trim_matches(|c| c == '-' || c == '.').to_string();
    if clean == identity && !clean.is_empty() && clean.len() <= 63 {
        return clean;
    }
    let mut short: String = clean.chars().take(46).collect();
    short = short.trim_end_matches(['-', '.']).to_string();
    let hash = format!("{:016x}", fnv1a64(identity.as_bytes()));
    if short.is_empty() { hash } else { format!("{short}-{hash}") }
}

impl ShardArgs {
    /// Resolves the flags for `service` (its Lease name prefix), whose gRPC API listens on
    /// `listen`.
    pub fn resolve(&self, service: &str, listen: &[ListenAddr]) -> anyhow::Result<ShardConfig> {
        anyhow::ensure!(self.shards <= MAX_SHARDS, "--shards {}: at most {MAX_SHARDS}", self.shards);
        anyhow::ensure!(
            self.lease_duration >= Duration::from_secs(1),
            "--lease-duration {:?}: at least 1s (Leases count whole seconds)",
            self.lease_duration
        );
        let namespace = self.lease_namespace.clone().or_else(|| env("POD_NAMESPACE")).unwrap_or("kuryr-system".into());
        anyhow::ensure!(is_label(&namespace), "--lease-namespace `{namespace}`: not a valid namespace name");
        let identity = self
            .replica_id
            .clone()
            .or_else(|| env("POD_NAME"))
            .unwrap_or_else(|| format!("{}-{}", hostname(), std::process::id()));
        anyhow::ensure!(
            !identity.trim().is_empty() && identity.len() <= 253 && !identity.chars().any(char::is_control),
            "--replica-id `{identity}`: 1 to 253 printable characters"
        );
        let tcp = listen.iter().find_map(|l| match l {
            ListenAddr::Tcp { host, port } => Some((host.clone(), *port)),
            ListenAddr::Unix(_) => None,
        });
        let endpoint = match (&self.advertise_address, env("POD_IP"), tcp) {
            (Some(a), _, _) => a.trim().to_string(),
            (None, Some(ip), Some((_, port))) => join(&ip, port),
            (None, None, Some((host, port))) => {
                let unspecified = host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified());
                join(&if unspecified { hostname() } else { host }, port)
            }
            (None, _, None) => String::new(),
        };
        // Unsharded, nobody is routed here by a Lease: the endpoint is not needed.
        if self.shards > 0 {
            anyhow::ensure!(
                !endpoint.is_empty(),
                "--advertise-address is needed: no TCP --listen address to derive the endpoint from"
            );
            anyhow::ensure!(is_host_port(&endpoint), "--advertise-address `{endpoint}`: expected HOST:PORT");
        }
        Ok(ShardConfig {
            service: service.to_string(),
            shards: self.shards,
            namespace,
            duration: self.lease_duration,
            identity,
            endpoint,
        })
    }
}

impl ShardConfig {
    /// How often Leases are renewed and the others' looked at: a fifth of the duration.
    pub fn tick(&self) -> Duration {
        self.duration / 5
    }

    /// The Lease of shard `i`.
    pub fn shard_lease(&self, i: u32) -> String {
        format!("{}-shard-{i}", self.service)
    }

    /// The shard a Lease name is for, if it is one of this service's shard Leases.
    pub fn shard_index(&self, name: &str) -> Option<u32> {
        let i: u32 = name.strip_prefix(&self.service)?.strip_prefix("-shard-")?.parse().ok()?;
        (i < self.shards && self.shard_lease(i) == name).then_some(i)
    }

    /// The membership Lease of `identity`.
    pub fn member_lease(&self, identity: &str) -> String {
        format!("{}-member-{}", self.service, name_part(identity))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Flags {
        #[command(flatten)]
        shard: ShardArgs,
    }

    fn args(extra: &[&str]) -> ShardArgs {
        Flags::try_parse_from(std::iter::once("x").chain(extra.iter().copied())).unwrap().shard
    }

    #[test]
    fn flags_resolve() {
        let listen: Vec<ListenAddr> = vec!["unix:/tmp/a.sock".parse().unwrap(), "127.0.0.1:9610".parse().unwrap()];
        let c = args(&["--replica-id", "alloc-0", "--lease-namespace", "kube-system"])
            .resolve("kuryr-vif-allocator", &listen)
            .unwrap();
        assert_eq!(
            (c.shards, c.namespace.as_str(), c.duration, c.identity.as_str(), c.endpoint.as_str()),
            (16, "kube-system", Duration::from_secs(15), "alloc-0", "127.0.0.1:9610")
        );
        assert_eq!(c.tick(), Duration::from_secs(3));
        assert_eq!(c.shard_lease(3), "kuryr-vif-allocator-shard-3");
        assert_eq!(c.shard_index("kuryr-vif-allocator-shard-3"), Some(3));
        assert_eq!(c.shard_index("kuryr-vif-allocator-shard-16"), None, "beyond --shards");
        assert_eq!(c.shard_index("kuryr-vif-allocator-shard-03"), None);
        assert_eq!(c.shard_index("kuryr-lbaas-shard-3"), None);
        assert_eq!(c.member_lease("alloc-0"), "kuryr-vif-allocator-member-alloc-0");
        let c = args(&["--advertise-address", "[fd00::1]:9610", "--lease-duration", "3s", "--shards", "0"])
            .resolve("s", &listen)
            .unwrap();
        assert_eq!((c.endpoint.as_str(), c.shards, c.tick()), ("[fd00::1]:9610", 0, Duration::from_millis(600)));
    }

    #[test]
    fn bad_flags_are_named() {
        let listen: Vec<ListenAddr> = vec!["127.0.0.1:9610".parse().unwrap()];
        let e = args(&["--lease-duration", "500ms"]).resolve("s", &listen).unwrap_err();
        assert!(e.to_string().contains("--lease-duration"), "{e}");
        let e = args(&["--lease-namespace", "Bad_NS"]).resolve("s", &listen).unwrap_err();
        assert!(e.to_string().contains("--lease-namespace"), "{e}");
        let e = args(&["--advertise-address", "nohost"]).resolve("s", &listen).unwrap_err();
        assert!(e.to_string().contains("--advertise-address"), "{e}");
        let unix: Vec<ListenAddr> = vec!["unix:/tmp/a.sock".parse().unwrap()];
        let e = args(&["--replica-id", "x"]).resolve("s", &unix).unwrap_err();
        assert!(e.to_string().contains("--advertise-address"), "{e}");
        assert!(Flags::try_parse_from(["x", "--shards", "5000"]).is_err());
    }

    #[test]
    fn identities_become_object_names() {
        assert_eq!(name_part("alloc-0"), "alloc-0");
        let odd = name_part("Host_Name/1234");
        assert!(odd.starts_with("host-name-1234-") && odd.len() <= 63, "{odd}");
        assert_ne!(name_part("a_b"), name_part("a/b"), "distinct identities, distinct names");
        assert!(name_part(&"x".repeat(200)).len() <= 63);
    }
}
