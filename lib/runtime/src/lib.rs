//! How every kuryr service runs.
//!
//! - [`config`]: flags shared by all services (logging, shutdown grace), durations.
//! - [`listen`]: `--listen HOST:PORT` or `unix:/path` (sockets created mode 0600).
//! - [`server`]: [`Runtime`]: serve gRPC with grpc.health.v1 and reflection v1 + v1alpha on every
//!   listener, Prometheus metrics over HTTP, graceful shutdown with a bounded drain.
//! - [`health`]: readiness per service; [`deps`]: NOT_SERVING while a dependency is unreachable.
//! - [`metrics`]: the registry, per-call gRPC metrics with millisecond buckets.
//! - [`client`]: channels to other services over TCP or unix sockets.

pub mod client;
pub mod config;
pub mod deps;
pub mod health;
pub mod listen;
pub mod metrics;
pub mod server;
pub mod shutdown;
pub mod telemetry;

pub use config::CommonArgs;
pub use health::Health;
pub use listen::ListenAddr;
pub use server::Runtime;
pub use shutdown::Shutdown;
