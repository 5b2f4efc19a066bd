//! Where the port events come from, configured as Neutron's own messaging is: the transport URL
//! (`rabbit://user:pass@host:5672,user:pass@host2:5672/vhost`, oslo.messaging's format) from a
//! flag or variable, or read from Neutron's configuration files mounted into the pod
//! (`[DEFAULT] transport_url`, `[oslo_messaging_rabbit] ssl`, `ssl_ca_file`, `ssl_cert_file`,
//! `ssl_key_file`, `amqp_durable_queues`, `rabbit_transient_quorum_queue`); flags override the
//! files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Flags of the port events (`--backend neutron`).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct EventArgs {
    /// RabbitMQ transport URL of Neutron's RPC bus, as in neutron.conf (`[DEFAULT]
    /// transport_url`): `rabbit://USER:PASS@HOST:5672[,USER:PASS@HOST2:5672]/VHOST`. With it (or
    /// --neutron-config-files) a pod's port is known ACTIVE from Neutron's push of the port
    /// (`neutron-vo-Port-<version>_fanout`), not by polling.
    #[arg(long, env = "KURYR_NEUTRON_TRANSPORT_URL", hide_env_values = true)]
    pub neutron_transport_url: Option<String>,

    /// Neutron's configuration files (comma-separated, later ones win, as with neutron-server's
    /// --config-file): the transport URL and the `[oslo_messaging_rabbit]` TLS and queue options
    /// are read from them, e.g. the neutron.conf of a Secret mounted at /etc/neutron.
    #[arg(long, env = "KURYR_NEUTRON_CONFIG_FILES", value_delimiter = ',')]
    pub neutron_config_files: Vec<PathBuf>,

    /// TLS to RabbitMQ (oslo.messaging's `ssl`); default from the configuration files, else off.
    #[arg(long, env = "KURYR_NEUTRON_AMQP_SSL", num_args = 0..=1, default_missing_value = "true")]
    pub neutron_amqp_ssl: Option<bool>,

    /// CA certificates (PEM) the broker's certificate is checked against (`ssl_ca_file`); the
    /// host's CA bundle when unset.
    #[arg(long, env = "KURYR_NEUTRON_AMQP_CA_FILE")]
    pub neutron_amqp_ca_file: Option<PathBuf>,

    /// Client certificate (PEM) for brokers that ask for one (`ssl_cert_file`).
    #[arg(long, env = "KURYR_NEUTRON_AMQP_CERT_FILE")]
    pub neutron_amqp_cert_file: Option<PathBuf>,

    /// Its private key (PEM, `ssl_key_file`).
    #[arg(long, env = "KURYR_NEUTRON_AMQP_KEY_FILE")]
    pub neutron_amqp_key_file: Option<PathBuf>,

    /// Make the allocator's event queue durable (a fixed name per --cluster-id and --instance,
    /// removed by the broker after an hour unused) instead of exclusive and deleted with the
    /// connection. Default: Neutron's `amqp_durable_queues` from the configuration files, else
    /// off. Durable suits brokers whose policies expect durable queues; events missed while the
    /// allocator is away are caught by the reconciling read either way.
    #[arg(long, env = "KURYR_NEUTRON_EVENTS_QUEUE_DURABLE", num_args = 0..=1, default_missing_value = "true")]
    pub neutron_events_queue_durable: Option<bool>,

    /// Versions of Neutron's Port object to subscribe to (`neutron-vo-Port-<v>_fanout`, one
    /// exchange per version), as a list with ranges: `1.11` or `1.4-1.15` (the default covers
    /// Neutron releases from Queens on, and some to come).
    #[arg(long, env = "KURYR_NEUTRON_EVENTS_PORT_VERSIONS", default_value = "1.4-1.15")]
    pub neutron_events_port_versions: String,

    /// With events: how often ports that have waited for ACTIVE longer than this are read from
    /// Neutron anyway (the safety net for a lost event). Every port waiting is also read once
    /// after each (re)connection to the broker; while the broker is unreachable, ports are
    /// polled as without events (--status-poll-min).
    #[arg(long, env = "KURYR_NEUTRON_EVENTS_RESYNC_INTERVAL", default_value = "10s",
          value_parser = kuryr_runtime::config::parse_duration)]
    pub neutron_events_resync_interval: Duration,
}

/// One broker of a transport URL.
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerHost {
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// Port, 5672 unless given.
    pub port: u16,
    /// User (oslo.messaging's default `guest` when the URL has none).
    pub username: String,
    /// Password.
    pub password: String,
}

impl std::fmt::Debug for BrokerHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        write!(f, "{}@{}", self.username, self.display())
    }
}

impl BrokerHost {
    /// `host:port` (`[v6]:port`).
    pub fn display(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// A parsed transport URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportUrl {
    /// The brokers, tried in turn.
    pub hosts: Vec<BrokerHost>,
    /// The virtual host (`/` when the URL names none).
    pub virtual_host: String,
    /// `?ssl=` in the URL, if present.
    pub ssl: Option<bool>,
}

fn percent_decode(s: &str, what: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3).ok_or_else(|| format!("{what}: a '%' not followed by two hex digits"))?;
            let b = u8::from_str_radix(hex, 16).map_err(|_| format!("{what}: bad escape %{hex}"))?;
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{what}: not UTF-8 once unescaped"))
}

fn parse_bool(v: &str, what: &str) -> Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        other => Err(format!("{what}: {other:?} is not a boolean")),
    }
}

impl TransportUrl {
    /// Parses oslo.messaging's transport URL for RabbitMQ; errors say what is wrong, never
    /// the password.
    pub fn parse(url: &str) -> Result<Self, String> {
        let url = url.trim();
        let (scheme, rest) = url.split_once("://").ok_or("no scheme (expected rabbit://...)")?;
        let scheme = scheme.strip_prefix("kombu+").unwrap_or(scheme);
        if scheme != "rabbit" && scheme != "amqp" {
            return Err(format!("scheme {scheme:?}: only RabbitMQ (rabbit://) carries Neutron's port events here"));
        }
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (netloc, path) = match rest.split_once('/') {
            Some((n, p)) => (n, p),
            None => (rest, ""),
        };
        let virtual_host = percent_decode(path, "the virtual host")?;
        let virtual_host = if virtual_host.is_empty() { "/".to_string() } else { virtual_host };
        let mut hosts = Vec::new();
        for (i, entry) in netloc.split(',').filter(|h| !h.is_empty()).enumerate() {
            let what = format!("host {}", i + 1);
            let (creds, hostport) = match entry.rsplit_once('@') {
                Some((c, h)) => (Some(c), h),
                None => (None, entry),
            };
            let (username, password) = match creds.map(|c| c.split_once(':').unwrap_or((c, ""))) {
                Some((u, p)) => (percent_decode(u, &what)?, percent_decode(p, &what)?),
                None => ("guest".to_string(), "guest".to_string()),
            };
            let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
                let (h, after) = v6.split_once(']').ok_or_else(|| format!("{what}: unclosed '['"))?;
                (h.to_string(), after.strip_prefix(':'))
            } else {
                match hostport.rsplit_once(':') {
                    Some((h, p)) => (h.to_string(), Some(p)),
                    None => (hostport.to_string(), None),
                }
            };
            if host.is_empty() {
                return Err(format!("{what}: no host name"));
            }
            let port = match port {
                Some(p) => p.parse::<u16>().map_err(|_| format!("{what}: port {p:?} is not a port number"))?,
                None => 5672,
            };
            hosts.push(BrokerHost { host, port, username, password });
        }
        if hosts.is_empty() {
            return Err("no broker host".into());
        }
        let mut ssl = None;
        for pair in query.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if k == "ssl" {
                ssl = Some(parse_bool(v, "?ssl=")?);
            }
        }
        Ok(TransportUrl { hosts, virtual_host, ssl })
    }
}

/// The `[section] key = value` pairs of oslo.config files (sections and keys as written; the
/// `DEFAULT` section is `DEFAULT`). Later files and later lines win.
pub fn read_ini(files: &[PathBuf]) -> Result<HashMap<(String, String), String>, String> {
    let mut out = HashMap::new();
    for path in files {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        parse_ini_into(&text, path, &mut out)?;
    }
    Ok(out)
}

fn parse_ini_into(text: &str, path: &Path, out: &mut HashMap<(String, String), String>) -> Result<(), String> {
    let mut section: Option<String> = None;
    let mut last: Option<(String, String)> = None;
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim_end();
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with(';') {
            continue;
        }
        // An indented line continues the previous value (oslo.config's multi-line values).
        if line.starts_with([' ', '\t'])
            && let Some(key) = &last
        {
            if let Some(v) = out.get_mut(key) {
                v.push('\n');
                v.push_str(trimmed);
            }
            continue;
        }
        if let Some(name) = trimmed.strip_prefix('[') {
            let name =
                name.strip_suffix(']').ok_or_else(|| format!("{}:{}: unclosed section", path.display(), n + 1))?;
            section = Some(name.trim().to_string());
            last = None;
            continue;
        }
        let (k, v) = trimmed
            .split_once(['=', ':'])
            .ok_or_else(|| format!("{}:{}: expected `key = value`", path.display(), n + 1))?;
        let s = section.clone().ok_or_else(|| format!("{}:{}: a value before any [section]", path.display(), n + 1))?;
        let key = (s, k.trim().to_string());
        out.insert(key.clone(), v.trim().to_string());
        last = Some(key);
    }
    Ok(())
}

/// TLS to the broker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA bundle; the host's when unset.
    pub ca_file: Option<PathBuf>,
    /// Client certificate and key.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// The resolved event configuration.
#[derive(Clone, Debug)]
pub struct EventConfig {
    /// The brokers and virtual host.
    pub url: TransportUrl,
    /// Where the URL came from (for logs and errors).
    pub origin: String,
    /// TLS, when on.
    pub tls: Option<TlsFiles>,
    /// The allocator's queue is durable.
    pub durable_queue: bool,
    /// Neutron's fanout exchanges are durable (`rabbit_transient_quorum_queue`).
    pub durable_exchanges: bool,
    /// The exchanges to bind to.
    pub exchanges: Vec<String>,
    /// The safety read's period.
    pub resync: Duration,
}

/// `1.11`, `1.4-1.15`, `1.9,1.11-1.12` → the versions, in order.
pub fn parse_versions(spec: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let ver = |s: &str| -> Result<(u32, u32), String> {
        let (a, b) = s.trim().split_once('.').ok_or_else(|| format!("{s:?}: expected MAJOR.MINOR"))?;
        Ok((a.parse().map_err(|_| format!("{s:?}: bad major"))?, b.parse().map_err(|_| format!("{s:?}: bad minor"))?))
    };
    for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
        match part.split_once('-') {
            Some((lo, hi)) => {
                let ((ma, lo), (mb, hi)) = (ver(lo)?, ver(hi)?);
                if ma != mb || lo > hi || hi - lo > 64 {
                    return Err(format!("{part:?}: a range is MAJOR.LOW-MAJOR.HIGH, at most 64 apart"));
                }
                out.extend((lo..=hi).map(|m| format!("{ma}.{m}")));
            }
            None => {
                let (a, b) = ver(part)?;
                out.push(format!("{a}.{b}"));
            }
        }
    }
    out.dedup();
    if out.is_empty() {
        return Err("no version".into());
    }
    Ok(out)
}

impl EventArgs {
    /// Whether events are configured at all.
    pub fn enabled(&self) -> bool {
        self.neutron_transport_url.as_deref().is_some_and(|u| !u.trim().is_empty())
            || !self.neutron_config_files.is_empty()
    }

    /// Resolves flags and files into the configuration, or `None` without events; errors name
    /// the flag or file and key at fault.
    pub fn resolve(&self) -> anyhow::Result<Option<EventConfig>> {
        if !self.enabled() {
            return Ok(None);
        }
        let ini = read_ini(&self.neutron_config_files).map_err(|e| anyhow::anyhow!("--neutron-config-files: {e}"))?;
        let get = |s: &str, k: &str| ini.get(&(s.to_string(), k.to_string())).map(String::as_str);
        let rabbit = |k: &str| get("oslo_messaging_rabbit", k);
        let file_bool = |k: &str| -> anyhow::Result<Option<bool>> {
            rabbit(k)
                .map(|v| parse_bool(v, &format!("[oslo_messaging_rabbit] {k}")))
                .transpose()
                .map_err(|e| anyhow::anyhow!("--neutron-config-files: {e}"))
        };
        let (raw, origin) = match self.neutron_transport_url.as_deref().filter(|u| !u.trim().is_empty()) {
            Some(u) => (u.to_string(), "--neutron-transport-url".to_string()),
            None => match get("DEFAULT", "transport_url") {
                Some(u) => (u.to_string(), "[DEFAULT] transport_url of --neutron-config-files".to_string()),
                None => anyhow::bail!(
                    "--neutron-config-files {}: no [DEFAULT] transport_url (or pass --neutron-transport-url)",
                    self.neutron_config_files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(",")
                ),
            },
        };
        let url = TransportUrl::parse(&raw).map_err(|e| anyhow::anyhow!("{origin}: {e}"))?;
        let ssl = match (self.neutron_amqp_ssl, url.ssl, file_bool("ssl")?) {
            (Some(v), _, _) | (None, Some(v), _) | (None, None, Some(v)) => v,
            (None, None, None) => false,
        };
        let file_path = |k: &str| rabbit(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let ca = self.neutron_amqp_ca_file.clone().or_else(|| file_path("ssl_ca_file"));
        let cert = self.neutron_amqp_cert_file.clone().or_else(|| file_path("ssl_cert_file"));
        let key = self.neutron_amqp_key_file.clone().or_else(|| file_path("ssl_key_file"));
        let tls = if ssl {
            for (what, p) in [("CA file", &ca), ("client certificate", &cert), ("client key", &key)] {
                if let Some(p) = p {
                    anyhow::ensure!(p.is_file(), "TLS to RabbitMQ: {what} {}: no such file", p.display());
                }
            }
            let client = match (cert, key) {
                (Some(c), Some(k)) => Some((c, k)),
                (None, None) => None,
                _ => anyhow::bail!(
                    "TLS to RabbitMQ: a client certificate needs its key and the other way round \
                     (--neutron-amqp-cert-file, --neutron-amqp-key-file or ssl_cert_file, ssl_key_file)"
                ),
            };
            Some(TlsFiles { ca_file: ca, client })
        } else {
            None
        };
        let durable_queue = match self.neutron_events_queue_durable {
            Some(v) => v,
            None => file_bool("amqp_durable_queues")?.unwrap_or(false),
        };
        let durable_exchanges = file_bool("rabbit_transient_quorum_queue")?.unwrap_or(false);
        let versions = parse_versions(&self.neutron_events_port_versions)
            .map_err(|e| anyhow::anyhow!("--neutron-events-port-versions: {e}"))?;
        anyhow::ensure!(
            self.neutron_events_resync_interval >= Duration::from_secs(1),
            "--neutron-events-resync-interval: at least 1s (it is a safety net, not the way ports are seen ACTIVE)"
        );
        Ok(Some(EventConfig {
            url,
            origin,
            tls,
            durable_queue,
            durable_exchanges,
            exchanges: versions.iter().map(|v| format!("neutron-vo-Port-{v}_fanout")).collect(),
            resync: self.neutron_events_resync_interval,
        }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn transport_urls_as_oslo_writes_them() {
        let u = TransportUrl::parse(
            "rabbit://openstack:s%40cret@10.0.0.5:5672,openstack:s%40cret@[fd00::6]/neutron%2Fvh?ssl=1",
        )
        .unwrap();
        assert_eq!(u.hosts.len(), 2);
        assert_eq!((u.hosts[0].host.as_str(), u.hosts[0].port), ("10.0.0.5", 5672));
        assert_eq!(u.hosts[0].password, "s@cret");
        assert_eq!((u.hosts[1].host.as_str(), u.hosts[1].port), ("fd00::6", 5672));
        assert_eq!(u.hosts[1].display(), "[fd00::6]:5672");
        assert_eq!(u.virtual_host, "neutron/vh");
        assert_eq!(u.ssl, Some(true));
        assert!(!format!("{:?}", u.hosts[0]).contains("cret"), "the password is never shown");
        let u = TransportUrl::parse("rabbit://u:p@mq:5671/").unwrap();
        assert_eq!((u.virtual_host.as_str(), u.hosts[0].port, u.ssl), ("/", 5671, None));
        let u = TransportUrl::parse("rabbit://mq").unwrap();
        assert_eq!((u.hosts[0].username.as_str(), u.virtual_host.as_str()), ("guest", "/"));
    }

    #[test]
    fn bad_transport_urls_say_why() {
        for (url, want) in [
            ("mq:5672", "no scheme"),
            ("kafka://mq:9092/", "only RabbitMQ"),
            ("rabbit://u:p@/", "no host name"),
            ("rabbit:///", "no broker host"),
            ("rabbit://u:p@mq:99999/", "not a port number"),
            ("rabbit://u:p%zz@mq/", "bad escape"),
            ("rabbit://u:p@[fd00::1/", "unclosed"),
            ("rabbit://u:p@mq/?ssl=maybe", "not a boolean"),
        ] {
            let e = TransportUrl::parse(url).unwrap_err();
            assert!(e.contains(want), "{url}: {e}");
            assert!(!e.contains("p%zz"), "{e}");
        }
    }

    #[test]
    fn versions_lists_and_ranges() {
        assert_eq!(parse_versions("1.11").unwrap(), ["1.11"]);
        assert_eq!(parse_versions("1.9-1.11,1.13").unwrap(), ["1.9", "1.10", "1.11", "1.13"]);
        assert!(parse_versions("1.11-1.4").is_err());
        assert!(parse_versions("2.0-3.1").is_err());
        assert!(parse_versions("x").is_err());
        assert!(parse_versions("").is_err());
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn neutron_conf_gives_the_url_tls_and_queue_options_and_flags_override() {
        let dir = std::env::temp_dir().join(format!("kuryr-events-conf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = write(&dir, "ca.pem", "x");
        let base = write(
            &dir,
            "neutron.conf",
            &format!(
                "[DEFAULT]\n# comment\ncore_plugin = ml2\ntransport_url = rabbit://a:b@mq1:5672/\n\
                 [oslo_messaging_rabbit]\nssl = True\nssl_ca_file = {}\namqp_durable_queues = true\n",
                ca.display()
            ),
        );
        let over = write(&dir, "override.conf", "[DEFAULT]\ntransport_url = rabbit://c:d@mq2:5671/nv\n");
        let args = EventArgs {
            neutron_config_files: vec![base.clone(), over],
            neutron_events_port_versions: "1.11".into(),
            neutron_events_resync_interval: Duration::from_secs(10),
            ..EventArgs::default()
        };
        let c = args.resolve().unwrap().unwrap();
        assert_eq!(c.url.hosts[0].display(), "mq2:5671", "the later file wins");
        assert_eq!(c.url.virtual_host, "nv");
        assert_eq!(c.tls, Some(TlsFiles { ca_file: Some(ca.clone()), client: None }));
        assert!(c.durable_queue);
        assert!(!c.durable_exchanges);
        assert_eq!(c.exchanges, ["neutron-vo-Port-1.11_fanout"]);
        let flags = EventArgs {
            neutron_transport_url: Some("rabbit://e:f@mq3/".into()),
            neutron_amqp_ssl: Some(false),
            neutron_events_queue_durable: Some(false),
            neutron_config_files: vec![base.clone()],
            ..args.clone()
        };
        let c = flags.resolve().unwrap().unwrap();
        assert_eq!((c.url.hosts[0].host.as_str(), c.tls.is_none(), c.durable_queue), ("mq3", true, false));
        assert!(EventArgs::default().resolve().unwrap().is_none(), "no events without a URL");

        let missing = write(&dir, "no-url.conf", "[DEFAULT]\ncore_plugin = ml2\n");
        let e = EventArgs { neutron_config_files: vec![missing], ..args.clone() }.resolve().unwrap_err();
        assert!(e.to_string().contains("no [DEFAULT] transport_url"), "{e}");
        let bad = write(&dir, "bad.conf", "transport_url = x\n");
        let e = EventArgs { neutron_config_files: vec![bad], ..args.clone() }.resolve().unwrap_err();
        assert!(e.to_string().contains("before any [section]"), "{e}");
        let e = EventArgs { neutron_amqp_cert_file: Some(ca.clone()), ..args.clone() }.resolve().unwrap_err();
        assert!(e.to_string().contains("needs its key"), "{e}");
        let e = EventArgs { neutron_amqp_ca_file: Some(dir.join("nope.pem")), ..args.clone() }.resolve().unwrap_err();
        assert!(e.to_string().contains("no such file"), "{e}");
        let e = EventArgs { neutron_events_resync_interval: Duration::from_millis(100), ..args }.resolve().unwrap_err();
        assert!(e.to_string().contains("at least 1s"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
