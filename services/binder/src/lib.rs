//! kuryr-binder: the per-node daemon behind the `kuryr-cni` shim.
//!
//! It serves the CNI operations (`kuryr.binder.v1.Cni`) on a unix socket, follows the allocator's
//! VIF stream for its node, and plugs VIFs into pod network namespaces. It reports NOT_SERVING
//! while the allocator is unreachable.

use clap::Parser;
use kuryr_proto::binder::v1::cni_server::{Cni, CniServer};
use kuryr_proto::binder::v1::{
    CheckResponse, CniRequest, CniResult, DelResponse, GcRequest, GcResponse, StatusRequest, StatusResponse,
    VersionRequest, VersionResponse,
};
use kuryr_proto::service_names;
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime};
use tonic::{Request, Response, Status};

/// The binder's version; the shim must send the same.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The CNI specification versions served.
pub const SUPPORTED_CNI_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// Command-line configuration.
#[derive(Clone, Debug, Parser)]
#[command(name = "kuryr-binder", version, about = "Plugs pod VIFs on this node; serves the kuryr-cni shim.")]
pub struct Config {
    /// gRPC listen addresses, comma-separated or repeated: HOST:PORT or unix:/path. The shim
    /// talks to the unix socket; the TCP address is for health checks and grpcurl.
    #[arg(
        long,
        env = "KURYR_BINDER_LISTEN",
        value_delimiter = ',',
        default_value = "unix:/run/kuryr/binder.sock,127.0.0.1:9630"
    )]
    pub listen: Vec<ListenAddr>,

    /// HTTP address for Prometheus metrics (/metrics) and probes (/livez, /readyz).
    #[arg(long, env = "KURYR_BINDER_METRICS_LISTEN", default_value = "0.0.0.0:9631")]
    pub metrics_listen: ListenAddr,

    /// The VIF allocator to follow: HOST:PORT, http://HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_ALLOCATOR", default_value = "127.0.0.1:9610")]
    pub allocator: String,

    /// This node's name as Kubernetes knows it; defaults to the host name.
    #[arg(long, env = "KURYR_NODE_NAME")]
    pub node_name: Option<String>,

    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the binder until SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let rt = Runtime::new("kuryr-binder", &config.common)?;
    let node = match config.node_name.clone() {
        Some(n) => n,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")?.trim().to_string(),
    };
    tracing::info!(node, "binder starting");
    let allocator = kuryr_runtime::client::channel(&config.allocator)?;
    kuryr_runtime::deps::spawn_probe(rt.health(), service_names::CNI, "kuryr-vif-allocator", rt.shutdown(), move || {
        kuryr_runtime::client::check_serving(allocator.clone(), service_names::VIF_ALLOCATOR)
    });
    let routes = tonic::service::Routes::new(CniServer::new(Binder));
    rt.serve(routes, &config.listen, Some(&config.metrics_listen)).await
}

#[derive(Debug)]
struct Binder;

/// Refuses a shim of another version, so that a half-upgraded node fails loudly.
fn check_shim_version(v: &str) -> Result<(), Status> {
    if v != VERSION {
        return Err(Status::failed_precondition(format!(
            "shim version `{v}` does not match binder version `{VERSION}`: install the kuryr-cni shipped with this binder"
        )));
    }
    Ok(())
}

fn not_yet(op: &str) -> Status {
    Status::unimplemented(format!("CNI {op} is not implemented in this version of kuryr-binder"))
}

#[tonic::async_trait]
impl Cni for Binder {
    async fn add(&self, req: Request<CniRequest>) -> Result<Response<CniResult>, Status> {
        check_shim_version(&req.get_ref().shim_version)?;
        Err(not_yet("ADD"))
    }

    async fn del(&self, req: Request<CniRequest>) -> Result<Response<DelResponse>, Status> {
        check_shim_version(&req.get_ref().shim_version)?;
        Err(not_yet("DEL"))
    }

    async fn check(&self, req: Request<CniRequest>) -> Result<Response<CheckResponse>, Status> {
        check_shim_version(&req.get_ref().shim_version)?;
        Err(not_yet("CHECK"))
    }

    async fn status(&self, req: Request<StatusRequest>) -> Result<Response<StatusResponse>, Status> {
        check_shim_version(&req.get_ref().shim_version)?;
        Err(not_yet("STATUS"))
    }

    async fn gc(&self, req: Request<GcRequest>) -> Result<Response<GcResponse>, Status> {
        check_shim_version(&req.get_ref().shim_version)?;
        Err(not_yet("GC"))
    }

    async fn version(&self, req: Request<VersionRequest>) -> Result<Response<VersionResponse>, Status> {
        check_shim_version(&req.get_ref().shim_version)?;
        Ok(Response::new(VersionResponse {
            binder_version: VERSION.to_string(),
            supported_cni_versions: SUPPORTED_CNI_VERSIONS.iter().map(|s| s.to_string()).collect(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shim_version_mismatch_is_failed_precondition() {
        let e = check_shim_version("0.0.1-other").unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("0.0.1-other"));
        assert!(check_shim_version(VERSION).is_ok());
    }
}
