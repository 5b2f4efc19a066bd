//! Port status from Neutron's own events: a RabbitMQ consumer of Neutron's push of ports.
//!
//! **Which events, and why.** Neutron announces a port's changes in three ways; only one of
//! them carries the change that matters here, the L2 agent wiring the port (DOWN → ACTIVE):
//! - the notifications topic (`port.update.end` with `[oslo_messaging_notifications] driver =
//!   messagingv2`) is sent by the API for API requests only: measured on Neutron 29, a port's
//!   create gives `port.create.end` (DOWN) and its turning ACTIVE gives nothing at all;
//! - `network-vif-plugged` is an HTTP call to the one compute endpoint of the Keystone catalog
//!   (Nova's `os-server-external-events`), not something a second party can subscribe to;
//! - the push of versioned objects to the agents (`neutron-vo-Port-<version>_fanout`, an RPC
//!   cast `push` on a fanout exchange of Neutron's RPC bus) is sent after every committed port
//!   change, including the status set by `update_device_up`, with the port's `revision_number`,
//!   `device_id`, `device_owner` and bindings. Each subscriber gets its own queue, so nothing is
//!   taken from the agents. This is what the allocator consumes.
//!
//! **The connection.** One connection to the first broker of the transport URL that answers
//! (the others in turn, with capped exponential backoff and jitter between rounds), TLS when
//! configured, heartbeats every 30 s. The queue — exclusive and deleted with the connection,
//! or durable with a fixed name when configured — is bound to the fanout exchange of every
//! Port version configured (declared with Neutron's attributes: a declaration is idempotent);
//! messages are consumed without acknowledgements (the safety read covers a lost one). The
//! link's state (`connected`, and an epoch that grows with each connection) is published for
//! the status reader: it reads every waiting port once after each (re)connection, and polls as
//! without events while the link is down.
//!
//! **Mapping** is the backend's ([`crate::backend::neutron::NeutronBackend::on_port_event`]): by port id
//! to the pod waiting for it, ordered by revision, checked against the pod's uid.

pub mod config;
pub mod decode;

use std::sync::Arc;
use std::time::Duration;

use amqprs::callbacks::{ChannelCallback, ConnectionCallback};
use amqprs::channel::{
    BasicConsumeArguments, BasicQosArguments, Channel, ExchangeDeclareArguments, QueueBindArguments,
    QueueDeclareArguments,
};
use amqprs::connection::{Connection, OpenConnectionArguments};
use amqprs::tls::TlsAdaptor;
use amqprs::{Ack, BasicProperties, Cancel, Close, CloseChannel, FieldTable, FieldValue, Nack, Return};
use kuryr_runtime::Shutdown;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::watch;

use self::config::{BrokerHost, EventConfig, TlsFiles};
use self::decode::PortEvent;
pub use kuryr_runtime::metrics::labels::ResultLabels;

/// Heartbeat asked of the broker: a silent broker is given up after about twice this.
const HEARTBEAT_SECS: u16 = 30;
/// Bound on connecting and setting up the queue.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// A durable queue unused this long is removed by the broker (x-expires).
const DURABLE_QUEUE_EXPIRY_MS: i32 = 3_600_000;
/// Backoff between connection rounds.
const BACKOFF_MIN: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The link to the broker as the status reader sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Link {
    /// Consuming now.
    pub connected: bool,
    /// Grows by one at each successful connection.
    pub epoch: u64,
}

kuryr_runtime::metric_set! {
    /// Metrics of the event link; cheap to clone.
    pub struct EventMetrics {
        /// 1 while consuming.
        pub connected: Gauge
            => "kuryr_allocator_neutron_events_connected", "1 while Neutron's port events are consumed from RabbitMQ";
        /// Connection attempts by result (`ok`, `failed`).
        pub connections: Family<ResultLabels, Counter>
            => "kuryr_allocator_neutron_events_connections", "Connections to RabbitMQ by result (ok, failed)";
        /// Consumed messages by result (`decoded`, `undecodable`, `not_push`).
        pub messages: Family<ResultLabels, Counter>
            => "kuryr_allocator_neutron_events_messages", "Messages consumed by result (decoded, undecodable, not_push)";
        /// Pushed ports by what the allocator made of them: `ready` (a waiting port turned ACTIVE),
        /// `pending` (a waiting port, not ACTIVE), `early` (ACTIVE before its plug was reported),
        /// `recycled` (a released port seen unplugged), `gone` (a waiting port deleted), `stale`
        /// (an older or repeated revision, or another pod's), `foreign` (not a port of this
        /// allocator's).
        pub ports: Family<ResultLabels, Counter>
            => "kuryr_allocator_neutron_events_ports",
            "Pushed ports by outcome (ready, pending, early, recycled, gone, stale, foreign)";
    }
}

impl EventMetrics {
    /// Counts a pushed port's outcome.
    pub fn port(&self, result: &'static str) {
        self.ports.get_or_create(&ResultLabels { result }).inc();
    }

    fn count(family: &Family<ResultLabels, Counter>, result: &'static str) {
        family.get_or_create(&ResultLabels { result }).inc();
    }
}

/// Where decoded ports go.
pub trait PortEventSink: Send + Sync + 'static {
    /// Acts on one pushed port.
    fn on_port_event(&self, event: &PortEvent);
}

/// The consumer: connects, consumes, reconnects; publishes the [`Link`].
pub struct PortEvents {
    config: EventConfig,
    queue_name: String,
    connection_name: String,
    tls: Option<tokio_rustls::TlsConnector>,
    link: watch::Sender<Link>,
    metrics: EventMetrics,
}

impl std::fmt::Debug for PortEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortEvents")
            .field("config", &self.config)
            .field("queue_name", &self.queue_name)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

/// Builds the TLS client configuration: the CA file's certificates (else the host's bundle),
/// the client certificate when given; errors name the file.
pub(crate) fn tls_connector(files: &TlsFiles) -> anyhow::Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    match &files.ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|e| anyhow::anyhow!("TLS to RabbitMQ: CA file {}: {e}", path.display()))?;
            anyhow::ensure!(!certs.is_empty(), "TLS to RabbitMQ: CA file {}: no certificate in it", path.display());
            for c in certs {
                roots.add(c).map_err(|e| anyhow::anyhow!("TLS to RabbitMQ: CA file {}: {e}", path.display()))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            anyhow::ensure!(added > 0, "TLS to RabbitMQ: no CA file given and no CA certificate found on the host");
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| anyhow::anyhow!("TLS to RabbitMQ: {e}"))?
        .with_root_certificates(roots);
    let config = match &files.client {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|e| anyhow::anyhow!("TLS to RabbitMQ: client certificate {}: {e}", cert.display()))?;
            let key = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| anyhow::anyhow!("TLS to RabbitMQ: client key {}: {e}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| anyhow::anyhow!("TLS to RabbitMQ: client certificate and key: {e}"))?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// Logs what the broker tells the connection (closing it, blocking it).
struct ConnectionLog;

#[async_trait::async_trait]
impl ConnectionCallback for ConnectionLog {
    async fn close(&mut self, _c: &Connection, close: Close) -> Result<(), amqprs::error::Error> {
        tracing::warn!(reason = %close, "RabbitMQ closed the connection");
        Ok(())
    }
    async fn blocked(&mut self, _c: &Connection, reason: String) {
        tracing::warn!(reason, "RabbitMQ blocked the connection");
    }
    async fn unblocked(&mut self, _c: &Connection) {}
    async fn secret_updated(&mut self, _c: &Connection) {}
}

/// Logs what the broker tells the channel.
struct ChannelLog;

#[async_trait::async_trait]
impl ChannelCallback for ChannelLog {
    async fn close(&mut self, _c: &Channel, close: CloseChannel) -> Result<(), amqprs::error::Error> {
        tracing::warn!(reason = %close, "RabbitMQ closed the channel");
        Ok(())
    }
    async fn cancel(&mut self, _c: &Channel, _cancel: Cancel) -> Result<(), amqprs::error::Error> {
        tracing::warn!("RabbitMQ cancelled the consumer");
        Ok(())
    }
    async fn flow(&mut self, _c: &Channel, active: bool) -> Result<bool, amqprs::error::Error> {
        Ok(active)
    }
    async fn publish_ack(&mut self, _c: &Channel, _ack: Ack) {}
    async fn publish_nack(&mut self, _c: &Channel, _nack: Nack) {}
    async fn publish_return(&mut self, _c: &Channel, _r: Return, _p: BasicProperties, _content: Vec<u8>) {}
}

/// Why a connection ended.
enum Ended {
    Shutdown,
    Lost(String),
}

impl PortEvents {
    /// The consumer of `config`; `cluster` and `instance` name the queue and the connection.
    pub fn new(config: EventConfig, cluster: &str, instance: &str, metrics: EventMetrics) -> anyhow::Result<Self> {
        let tls = config.tls.as_ref().map(tls_connector).transpose()?;
        let clean = |s: &str| -> String {
            s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).take(80).collect()
        };
        let queue_name = if config.durable_queue {
            format!("kuryr-port-events.{}.{}", clean(cluster), clean(instance))
        } else {
            format!("kuryr-port-events.{}.{}.{:016x}", clean(cluster), clean(instance), fastrand::u64(..))
        };
        Ok(Self {
            config,
            queue_name,
            connection_name: format!("kuryr-vif-allocator {instance}"),
            tls,
            link: watch::Sender::new(Link::default()),
            metrics,
        })
    }

    /// The link's state, for the status reader.
    pub fn link(&self) -> watch::Receiver<Link> {
        self.link.subscribe()
    }

    /// The queue's name.
    pub fn queue_name(&self) -> &str {
        &self.queue_name
    }

    /// Consumes until shutdown, reconnecting with backoff; never returns early.
    pub async fn run(self, sink: Arc<dyn PortEventSink>, shutdown: Shutdown) {
        let hosts = self.config.url.hosts.clone();
        let mut backoff = kuryr_stream::Backoff::new("neutron-events", BACKOFF_MIN, BACKOFF_MAX);
        let mut down_since: Option<std::time::Instant> = None;
        let mut next = 0usize;
        tracing::info!(origin = %self.config.origin, brokers = ?hosts, vhost = %self.config.url.virtual_host,
            tls = self.tls.is_some(), queue = %self.queue_name, durable = self.config.durable_queue,
            exchanges = self.config.exchanges.len(), "consuming Neutron's port events");
        loop {
            for i in 0..hosts.len() {
                let host = &hosts[(next + i) % hosts.len()];
                let ended = tokio::select! {
                    r = self.session(host, &*sink, &mut down_since, &mut backoff) => r,
                    () = shutdown.clone().wait() => Ended::Shutdown,
                };
                self.set_link(false);
                match ended {
                    Ended::Shutdown => return,
                    Ended::Lost(why) => {
                        if down_since.is_none() {
                            tracing::warn!(broker = %host.display(), error = %why,
                                "Neutron's port events unavailable; polling port status until RabbitMQ is back");
                            down_since = Some(std::time::Instant::now());
                        } else {
                            tracing::debug!(broker = %host.display(), error = %why, "RabbitMQ still unavailable");
                        }
                        next = (next + i + 1) % hosts.len();
                    }
                }
            }
            tokio::select! {
                () = backoff.sleep("broker-lost") => {}
                () = shutdown.clone().wait() => return,
            }
        }
    }

    fn set_link(&self, connected: bool) {
        self.link.send_if_modified(|l| {
            let changed = l.connected != connected;
            l.connected = connected;
            if connected {
                l.epoch += 1;
            }
            changed || connected
        });
        self.metrics.connected.set(i64::from(connected));
    }

    /// One connection: set up, consume until it breaks.
    async fn session(
        &self,
        host: &BrokerHost,
        sink: &dyn PortEventSink,
        down_since: &mut Option<std::time::Instant>,
        backoff: &mut kuryr_stream::Backoff,
    ) -> Ended {
        let setup = tokio::time::timeout(CONNECT_TIMEOUT, self.connect(host)).await;
        let (conn, channel, mut rx) = match setup {
            Ok(Ok(parts)) => parts,
            Ok(Err(e)) => {
                EventMetrics::count(&self.metrics.connections, "failed");
                return Ended::Lost(e);
            }
            Err(_) => {
                EventMetrics::count(&self.metrics.connections, "failed");
                return Ended::Lost(format!("no answer within {CONNECT_TIMEOUT:?}"));
            }
        };
        EventMetrics::count(&self.metrics.connections, "ok");
        match down_since.take() {
            Some(t) => tracing::info!(broker = %host.display(), after = ?t.elapsed(), "Neutron's port events back"),
            None => {
                tracing::info!(broker = %host.display(), queue = %self.queue_name, "subscribed to Neutron's port events")
            }
        }
        backoff.reset();
        self.set_link(true);
        // Subscribed once, at its first poll below: a notification is never missed between
        // two messages. The periodic check covers one sent before that first poll.
        let ended = {
            let failure = conn.listen_network_io_failure();
            tokio::pin!(failure);
            let mut check = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    m = rx.recv() => match m {
                        Some(m) => self.handle(m.content.as_deref().unwrap_or_default(), sink),
                        None => break Ended::Lost("the consumer ended (connection or channel closed)".into()),
                    },
                    failed = &mut failure => {
                        break Ended::Lost(if failed { "network I/O failure".into() } else { "connection closed".into() });
                    }
                    _ = check.tick() => if !conn.is_open() || !channel.is_open() {
                        break Ended::Lost("connection or channel no longer open".into());
                    },
                }
            }
        };
        // Best effort: the connection is usually gone already.
        drop(channel);
        let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
        ended
    }

    fn handle(&self, body: &[u8], sink: &dyn PortEventSink) {
        match decode::decode(body) {
            Ok(ports) => {
                EventMetrics::count(&self.metrics.messages, "decoded");
                for p in &ports {
                    sink.on_port_event(p);
                }
            }
            Err(decode::DecodeError::NotPush(method)) => {
                EventMetrics::count(&self.metrics.messages, "not_push");
                tracing::debug!(method, "message on the port exchanges that is not a push; skipped");
            }
            Err(e) => {
                EventMetrics::count(&self.metrics.messages, "undecodable");
                tracing::warn!(error = %e, bytes = body.len(), "undecodable message on the port exchanges; skipped");
            }
        }
    }

    async fn connect(
        &self,
        host: &BrokerHost,
    ) -> Result<(Connection, Channel, tokio::sync::mpsc::UnboundedReceiver<amqprs::channel::ConsumerMessage>), String>
    {
        let e = |what: &str| {
            let what = what.to_string();
            move |err: amqprs::error::Error| format!("{what}: {err}")
        };
        let mut args = OpenConnectionArguments::new(&host.host, host.port, &host.username, &host.password);
        args.virtual_host(&self.config.url.virtual_host)
            .heartbeat(HEARTBEAT_SECS)
            .connection_name(&self.connection_name);
        if let Some(connector) = &self.tls {
            args.tls_adaptor(TlsAdaptor::new(connector.clone(), host.host.clone()));
        }
        let conn = Connection::open(&args.finish()).await.map_err(e(&format!("connecting to {}", host.display())))?;
        conn.register_callback(ConnectionLog).await.map_err(e("registering the connection callback"))?;
        let channel = conn.open_channel(None).await.map_err(e("opening a channel"))?;
        channel.register_callback(ChannelLog).await.map_err(e("registering the channel callback"))?;
        let mut queue = QueueDeclareArguments::new(&self.queue_name);
        if self.config.durable_queue {
            let mut table = FieldTable::new();
            let key = "x-expires".try_into().map_err(|_| "x-expires".to_string())?;
            table.insert(key, FieldValue::I(DURABLE_QUEUE_EXPIRY_MS));
            queue.durable(true).arguments(table);
        } else {
            queue.exclusive(true).auto_delete(true);
        }
        channel.queue_declare(queue.finish()).await.map_err(e(&format!("declaring queue {}", self.queue_name)))?;
        for exchange in &self.config.exchanges {
            // As oslo.messaging declares it for the agents: fanout, auto-delete, durable only
            // with rabbit_transient_quorum_queue.
            let mut x = ExchangeDeclareArguments::new(exchange, "fanout");
            x.durable = self.config.durable_exchanges;
            x.auto_delete = true;
            channel.exchange_declare(x).await.map_err(e(&format!(
                "declaring exchange {exchange} (fanout, auto-delete, durable={}: as Neutron's \
                 rabbit_transient_quorum_queue has it)",
                self.config.durable_exchanges
            )))?;
            channel
                .queue_bind(QueueBindArguments::new(&self.queue_name, exchange, ""))
                .await
                .map_err(e(&format!("binding to {exchange}")))?;
        }
        channel.basic_qos(BasicQosArguments::new(0, 256, false)).await.map_err(e("setting the prefetch"))?;
        let mut consume = BasicConsumeArguments::new(&self.queue_name, "");
        consume.no_ack = true;
        let (_tag, rx) = channel.basic_consume_rx(consume).await.map_err(e("consuming"))?;
        Ok((conn, channel, rx))
    }
}
