//! How every kuryr service runs.
//!
//! - [`config`]: flags shared by all services (logging, shutdown grace), durations.
//! - [`listen`]: `--listen HOST:PORT` or `unix:/path` (sockets created mode 0600).
//! - [`server`]: [`Runtime`]: serve gRPC with grpc.health.v1 and reflection v1 + v1alpha on every
//!   listener, Prometheus metrics over HTTP, graceful shutdown with a bounded drain.
//! - [`health`]: readiness per service; [`deps`]: NOT_SERVING while a dependency is unreachable.
//! - [`metrics`]: the registry, per-call gRPC metrics with millisecond buckets, [`metric_set!`]
//!   (a struct of metrics declared once: field, name and help together).
//! - [`client`]: channels to other services over TCP or unix sockets; [`follow`]: streams between
//!   services at the gRPC edge (heartbeat and idle-timeout flags, the watcher's Subscribe as a
//!   source for the one follower of `kuryr_stream::follow`).
//! - [`auth`]: who may call what: unix peer credentials, ServiceAccount tokens, per-method rules.
//! - [`readiness`]: SERVING while every one of a service's named conditions holds.
//! - [`validate`]: request checks at the gRPC edge (names, resume points, node-bound callers).
//! - [`retry`](mod@retry): start-up steps retried with backoff until they succeed or shutdown.
//! - `k8s` (feature `kube`): a Kubernetes client from a kubeconfig or the environment;
//!   `discover`: `k8s:NAMESPACE/SERVICE:PORT` targets, balanced over the Service's ready endpoints
//!   (no cluster DNS needed).

pub mod auth;
pub mod client;
pub mod config;
pub mod deps;
#[cfg(feature = "kube")]
pub mod discover;
pub mod follow;
pub mod health;
#[cfg(feature = "kube")]
pub mod k8s;
pub mod listen;
pub mod metrics;
pub mod readiness;
pub mod retry;
pub mod server;
pub mod shutdown;
pub mod telemetry;
pub mod validate;

pub use config::CommonArgs;
pub use health::Health;
#[cfg(feature = "kube")]
pub use k8s::{kube_client, watch_config};
pub use listen::ListenAddr;
pub use retry::retry;
pub use server::{Runtime, Services};
pub use shutdown::Shutdown;
