//! Running a service: bind every listener first (fail fast, before any work), serve the service's
//! gRPC routes together with health and reflection on each, serve metrics over HTTP, and on
//! SIGTERM mark everything NOT_SERVING, stop accepting, and drain within a bound. Reflection
//! lists and describes exactly what the binary serves ([`Services`]), plus health and itself.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use prometheus_client::registry::Registry;
use prost::Message as _;
use tokio::task::JoinSet;
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

use crate::auth::{AuthLayer, DenyAll, Gate};
use crate::config::CommonArgs;
use crate::health::Health;
use crate::listen::{Bound, ListenAddr};
use crate::metrics::{GrpcMetrics, GrpcMetricsLayer, methods_of, serve_http};
use crate::shutdown::{self, Shutdown, ShutdownTrigger};

/// The gRPC services a binary serves: their routes, and their names for reflection. Start from
/// `Services::default()` (none) and add each with [`Services::with`].
#[derive(Debug, Default)]
pub struct Services {
    routes: Routes,
    names: Vec<&'static str>,
}

impl Services {
    /// Adds another service.
    #[must_use]
    pub fn with<S>(mut self, svc: S) -> Self
    where
        S: tower::Service<http::Request<tonic::body::Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.routes = self.routes.add_service(svc);
        self.names.push(S::NAME);
        self
    }

    /// The fully-qualified names of the services.
    pub fn names(&self) -> &[&'static str] {
        &self.names
    }
}

/// A service being started: its metrics registry, readiness, and shutdown signal. Register
/// metrics and spawn background work, then call [`Runtime::serve`].
#[derive(Debug)]
pub struct Runtime {
    name: &'static str,
    grace: Duration,
    registry: Registry,
    health: Health,
    health_server: HealthServer<HealthService>,
    trigger: Arc<ShutdownTrigger>,
    /// Who may call the service's own methods; nobody until [`Runtime::set_gate`].
    gate: Arc<dyn Gate>,
}

impl Runtime {
    /// Sets up logging and the shared state. `name` is the binary name, used in logs and as the
    /// metrics prefix-free `service` label.
    pub fn new(name: &'static str, common: &CommonArgs) -> anyhow::Result<Self> {
        crate::telemetry::init_logging(common)?;
        let reporter = HealthReporter::new();
        let health_server = HealthServer::new(HealthService::from_health_reporter(reporter.clone()));
        let (trigger, _) = shutdown::channel();
        Ok(Self {
            name,
            grace: common.shutdown_grace,
            registry: Registry::default(),
            health: Health::new(reporter),
            health_server,
            trigger: Arc::new(trigger),
            gate: Arc::new(DenyAll),
        })
    }

    /// [`Runtime::new`] with the gate of `common`'s `--auth`: the accounts `rules` name, their
    /// tokens checked with the API server of `kubeconfig` (in-cluster when `None`).
    #[cfg(feature = "kube")]
    pub fn gated(
        name: &'static str,
        common: &CommonArgs,
        kubeconfig: Option<std::path::PathBuf>,
        rules: crate::auth::Rules,
    ) -> anyhow::Result<Self> {
        let mut rt = Self::new(name, common)?;
        let gate = common.auth.gate(kubeconfig, rules, rt.registry());
        rt.set_gate(gate);
        Ok(rt)
    }

    /// The registry to add the service's own metrics to.
    pub fn registry(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The readiness handle.
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// Puts every call but health and reflection through `gate` (the default refuses them all).
    pub fn set_gate(&mut self, gate: Arc<dyn Gate>) {
        self.gate = gate;
    }

    /// The shutdown signal, for background tasks and long-lived streams.
    pub fn shutdown(&self) -> Shutdown {
        self.trigger.signal()
    }

    /// A handle that begins shutdown, as SIGTERM does (for tests and fatal errors).
    pub fn shutdown_trigger(&self) -> Arc<ShutdownTrigger> {
        self.trigger.clone()
    }

    /// Serves `services` plus grpc.health.v1 and server reflection (v1 and v1alpha) on every
    /// address in `listen`, and metrics on `metrics_listen`, until SIGTERM/SIGINT or the trigger.
    pub async fn serve(
        self,
        services: Services,
        listen: &[ListenAddr],
        metrics_listen: Option<&ListenAddr>,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(!listen.is_empty(), "no --listen address given");
        let mut bound = Vec::with_capacity(listen.len());
        for addr in listen {
            bound.push(addr.bind().await.with_context(|| format!("cannot listen on {addr}"))?);
        }
        let metrics_bound = match metrics_listen {
            Some(addr @ ListenAddr::Tcp { .. }) => {
                match addr.bind().await.with_context(|| format!("cannot serve metrics on {addr}"))? {
                    Bound::Tcp(l) => Some(l),
                    Bound::Unix(..) => None,
                }
            }
            Some(addr) => anyhow::bail!("--metrics-listen {addr}: metrics are served over TCP only"),
            None => None,
        };

        let mut registry = self.registry;
        let grpc_metrics = GrpcMetrics::register(&mut registry, methods_of(DESCRIPTOR_SETS));
        registry.register(
            kuryr_stream::backoff::METRIC,
            kuryr_stream::backoff::METRIC_HELP,
            kuryr_stream::backoff::retries().clone(),
        );
        let registry = Arc::new(registry);
        let routes = with_standard_services(services, self.health_server)?;
        let shutdown = self.trigger.signal();
        let mut tasks = JoinSet::new();
        let mut sockets = Vec::new();
        for b in bound {
            let local = b.local_addr();
            tracing::info!(service = self.name, listen = %local, "serving gRPC");
            let server = tonic::transport::Server::builder()
                .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
                .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
                .tcp_keepalive(Some(KEEPALIVE_INTERVAL))
                .http2_max_header_list_size(MAX_HEADER_LIST)
                .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
                .layer(GrpcMetricsLayer(grpc_metrics.clone()))
                .layer(AuthLayer(self.gate.clone()))
                .add_routes(routes.clone());
            let signal = shutdown.clone().wait();
            match b {
                Bound::Tcp(l) => {
                    tasks.spawn(async move {
                        server
                            .serve_with_incoming_shutdown(TcpListenerStream::new(l), signal)
                            .await
                            .map_err(|e| (local, e))
                    });
                }
                Bound::Unix(l, path) => {
                    sockets.push(path);
                    tasks.spawn(async move {
                        server
                            .serve_with_incoming_shutdown(UnixListenerStream::new(l), signal)
                            .await
                            .map_err(|e| (local, e))
                    });
                }
            }
        }
        if let Some(l) = metrics_bound {
            let local = l.local_addr().ok();
            tracing::info!(service = self.name, listen = ?local, "serving metrics");
            let (reg, health, sig) = (registry.clone(), self.health.clone(), shutdown.clone());
            tokio::spawn(async move {
                if let Err(e) = serve_http(l, reg, health, sig).await {
                    tracing::error!(error = %e, "metrics server failed");
                }
            });
        }

        // Run until a signal, the trigger, or a server failing.
        let reason = tokio::select! {
            sig = shutdown::os_signal() => sig.map(str::to_string).unwrap_or_else(|e| format!("signal handler failed: {e}")),
            () = shutdown.clone().wait() => "shutdown requested".to_string(),
            Some(res) = tasks.join_next() => match res {
                Ok(Err((addr, e))) => format!("server on {addr} failed: {e}"),
                Ok(Ok(())) => "a server stopped".to_string(),
                Err(e) => format!("a server task failed: {e}"),
            },
        };
        tracing::info!(service = self.name, %reason, grace = ?self.grace, "shutting down");
        self.health.set_all_not_serving().await;
        self.trigger.trigger();
        let drained = tokio::time::timeout(self.grace, async { while tasks.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            tracing::warn!(service = self.name, grace = ?self.grace, "drain did not finish in time; exiting anyway");
            tasks.abort_all();
        }
        for s in sockets {
            let _ = std::fs::remove_file(s);
        }
        Ok(())
    }
}

/// The contracts every server knows of, for the metric labels of known methods: kuryr's own,
/// health and reflection.
const DESCRIPTOR_SETS: &[&[u8]] = &[
    kuryr_proto::FILE_DESCRIPTOR_SET,
    tonic_health::pb::FILE_DESCRIPTOR_SET,
    tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
    tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
];

/// Server-side HTTP/2 PINGs: a client that stops answering is dropped with its streams.
const KEEPALIVE_INTERVAL: Duration = crate::client::KEEPALIVE_INTERVAL;
const KEEPALIVE_TIMEOUT: Duration = crate::client::KEEPALIVE_TIMEOUT;
/// Headers of one request, all told. A ServiceAccount token is 1–2 KiB.
const MAX_HEADER_LIST: u32 = 16 * 1024;
/// Streams open at once on one connection; a binder holds two, a service a handful.
const MAX_CONCURRENT_STREAMS: u32 = 256;
/// The largest health or reflection request: a service name, a symbol.
pub const MAX_STANDARD_REQUEST: usize = 16 * 1024;

/// The service names health and reflection add.
const HEALTH: &str = "grpc.health.v1.Health";
const REFLECTION: [&str; 2] = ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"];

/// Adds health and both reflection versions. Reflection lists the binary's own services, health
/// and itself, and describes only the contracts of those services: grpcurl on the allocator shows
/// the allocator's API, not the watcher's.
fn with_standard_services(services: Services, health: HealthServer<HealthService>) -> anyhow::Result<Routes> {
    let contracts = contracts_of(kuryr_proto::FILE_DESCRIPTOR_SET, services.names())?;
    let builder = || {
        let mut b = tonic_reflection::server::Builder::configure()
            .register_file_descriptor_set(contracts.clone())
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET);
        for name in services.names().iter().chain([&HEALTH]).chain(&REFLECTION) {
            b = b.with_service_name(*name);
        }
        b
    };
    let v1 = builder().build_v1().context("building reflection v1")?.max_decoding_message_size(MAX_STANDARD_REQUEST);
    let v1alpha = builder()
        .build_v1alpha()
        .context("building reflection v1alpha")?
        .max_decoding_message_size(MAX_STANDARD_REQUEST);
    let health = health.max_decoding_message_size(MAX_STANDARD_REQUEST);
    Ok(services.routes.add_service(health).add_service(v1).add_service(v1alpha))
}

/// The files of the encoded descriptor set `encoded` that define the packages of `services`
/// (`package.Service` names), with the files they import.
fn contracts_of(encoded: &[u8], services: &[&str]) -> anyhow::Result<prost_types::FileDescriptorSet> {
    let all = prost_types::FileDescriptorSet::decode(encoded).context("decoding the kuryr descriptor set")?;
    let packages: BTreeSet<&str> = services.iter().filter_map(|s| s.rsplit_once('.').map(|(p, _)| p)).collect();
    let mut wanted: BTreeSet<String> =
        all.file.iter().filter(|f| packages.contains(f.package())).map(|f| f.name().to_string()).collect();
    loop {
        let imports: Vec<String> = all
            .file
            .iter()
            .filter(|f| wanted.contains(f.name()))
            .flat_map(|f| f.dependency.iter().cloned())
            .filter(|d| !wanted.contains(d))
            .collect();
        if imports.is_empty() {
            break;
        }
        wanted.extend(imports);
    }
    let file = all.file.into_iter().filter(|f| wanted.contains(f.name())).collect();
    Ok(prost_types::FileDescriptorSet { file })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn reflection_describes_only_the_served_contracts() {
        let packages = |names: &[&str]| -> Vec<String> {
            let set = contracts_of(kuryr_proto::FILE_DESCRIPTOR_SET, names).unwrap();
            set.file.iter().map(|f| f.package().to_string()).collect()
        };
        assert_eq!(packages(&["kuryr.watcher.v1.Watcher"]), ["kuryr.watcher.v1"]);
        assert_eq!(
            packages(&["kuryr.allocator.v1.VifAllocator", "kuryr.allocator.v1.PoolManager"]),
            ["kuryr.allocator.v1"]
        );
        assert_eq!(packages(&["kuryr.binder.v1.Cni"]), ["kuryr.binder.v1"]);
        assert!(packages(&[]).is_empty());
    }
}
