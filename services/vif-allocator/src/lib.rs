//! kuryr-vif-allocator: gives every scheduled pod that is not on the host network a VIF, records
//! pod → VIF in the Kubernetes API, and streams each node's VIFs to that node's binder.
//!
//! It subscribes to the watcher and reports NOT_SERVING while the watcher is unreachable.

pub mod crd;
pub mod ipam;

use clap::Parser;
use kuryr_proto::allocator::v1::pool_manager_server::{PoolManager, PoolManagerServer};
use kuryr_proto::allocator::v1::vif_allocator_server::{VifAllocator, VifAllocatorServer};
use kuryr_proto::allocator::v1::{
    FreePoolRequest, FreePoolResponse, GetVifRequest, ListPoolsRequest, ListPoolsResponse, Pool, PoolKey,
    PopulatePoolRequest, ReportPluggedRequest, ReportPluggedResponse, Vif, WatchVifsRequest, WatchVifsResponse,
};
use kuryr_proto::service_names;
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime};
use tonic::{Request, Response, Status};

/// Command-line configuration.
#[derive(Clone, Debug, Parser)]
#[command(name = "kuryr-vif-allocator", version, about = "Allocates pod VIFs and streams them to binders.")]
pub struct Config {
    /// gRPC listen addresses, comma-separated or repeated: HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_ALLOCATOR_LISTEN", value_delimiter = ',', default_value = "0.0.0.0:9610")]
    pub listen: Vec<ListenAddr>,

    /// HTTP address for Prometheus metrics (/metrics) and probes (/livez, /readyz).
    #[arg(long, env = "KURYR_ALLOCATOR_METRICS_LISTEN", default_value = "0.0.0.0:9611")]
    pub metrics_listen: ListenAddr,

    /// The watcher to subscribe to: HOST:PORT, http://HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_WATCHER", default_value = "127.0.0.1:9600")]
    pub watcher: String,

    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the allocator until SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let rt = Runtime::new("kuryr-vif-allocator", &config.common)?;
    let watcher = kuryr_runtime::client::channel(&config.watcher)?;
    for svc in [service_names::VIF_ALLOCATOR, service_names::POOL_MANAGER] {
        let ch = watcher.clone();
        kuryr_runtime::deps::spawn_probe(rt.health(), svc, "kuryr-watcher", rt.shutdown(), move || {
            kuryr_runtime::client::check_serving(ch.clone(), service_names::WATCHER)
        });
    }
    let routes =
        tonic::service::Routes::new(VifAllocatorServer::new(Allocator)).add_service(PoolManagerServer::new(Pools));
    rt.serve(routes, &config.listen, Some(&config.metrics_listen)).await
}

#[derive(Debug)]
struct Allocator;

fn required(field: &str, value: &str) -> Result<(), Status> {
    if value.trim().is_empty() {
        return Err(Status::invalid_argument(format!("{field}: required")));
    }
    Ok(())
}

#[tonic::async_trait]
impl VifAllocator for Allocator {
    type WatchVifsStream = tokio_stream::Empty<Result<WatchVifsResponse, Status>>;

    async fn watch_vifs(&self, req: Request<WatchVifsRequest>) -> Result<Response<Self::WatchVifsStream>, Status> {
        required("node_name", &req.get_ref().node_name)?;
        Err(Status::unimplemented("WatchVifs is not implemented in this version of kuryr-vif-allocator"))
    }

    async fn report_plugged(
        &self,
        req: Request<ReportPluggedRequest>,
    ) -> Result<Response<ReportPluggedResponse>, Status> {
        let r = req.get_ref();
        required("pod_uid", &r.pod_uid)?;
        required("vif_id", &r.vif_id)?;
        required("node_name", &r.node_name)?;
        Err(Status::unimplemented("ReportPlugged is not implemented in this version of kuryr-vif-allocator"))
    }

    async fn get_vif(&self, req: Request<GetVifRequest>) -> Result<Response<Vif>, Status> {
        required("pod_uid", &req.get_ref().pod_uid)?;
        Err(Status::unimplemented("GetVif is not implemented in this version of kuryr-vif-allocator"))
    }
}

/// Port pools belong to the Neutron backend; until it exists every call says so.
#[derive(Debug)]
struct Pools;

const NO_POOLS: &str =
    "port pools belong to the Neutron backend, which this version of kuryr-vif-allocator does not have";

#[tonic::async_trait]
impl PoolManager for Pools {
    async fn list_pools(&self, _: Request<ListPoolsRequest>) -> Result<Response<ListPoolsResponse>, Status> {
        Err(Status::unimplemented(NO_POOLS))
    }
    async fn show_pool(&self, _: Request<PoolKey>) -> Result<Response<Pool>, Status> {
        Err(Status::unimplemented(NO_POOLS))
    }
    async fn populate_pool(&self, _: Request<PopulatePoolRequest>) -> Result<Response<Pool>, Status> {
        Err(Status::unimplemented(NO_POOLS))
    }
    async fn free_pool(&self, _: Request<FreePoolRequest>) -> Result<Response<FreePoolResponse>, Status> {
        Err(Status::unimplemented(NO_POOLS))
    }
}
