//! kuryr-lbaas: turns Services and their EndpointSlices into load balancers — Octavia load
//! balancers in OpenStack, or LB specs streamed to every node's binder for the nftables dataplane.
//!
//! It subscribes to the watcher and reports NOT_SERVING while the watcher is unreachable.

use clap::Parser;
use kuryr_proto::lbaas::v1::load_balancers_server::{LoadBalancers, LoadBalancersServer};
use kuryr_proto::lbaas::v1::{
    GetLoadBalancerRequest, ListLoadBalancersRequest, ListLoadBalancersResponse, LoadBalancer,
    WatchLoadBalancersRequest, WatchLoadBalancersResponse,
};
use kuryr_proto::service_names;
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime};
use tonic::{Request, Response, Status};

/// Command-line configuration.
#[derive(Clone, Debug, Parser)]
#[command(name = "kuryr-lbaas", version, about = "Turns Kubernetes Services into load balancers.")]
pub struct Config {
    /// gRPC listen addresses, comma-separated or repeated: HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_LBAAS_LISTEN", value_delimiter = ',', default_value = "0.0.0.0:9620")]
    pub listen: Vec<ListenAddr>,

    /// HTTP address for Prometheus metrics (/metrics) and probes (/livez, /readyz).
    #[arg(long, env = "KURYR_LBAAS_METRICS_LISTEN", default_value = "0.0.0.0:9621")]
    pub metrics_listen: ListenAddr,

    /// The watcher to subscribe to: HOST:PORT, http://HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_WATCHER", default_value = "127.0.0.1:9600")]
    pub watcher: String,

    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs lbaas until SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let rt = Runtime::new("kuryr-lbaas", &config.common)?;
    let watcher = kuryr_runtime::client::channel(&config.watcher)?;
    kuryr_runtime::deps::spawn_probe(
        rt.health(),
        service_names::LOAD_BALANCERS,
        "kuryr-watcher",
        rt.shutdown(),
        move || kuryr_runtime::client::check_serving(watcher.clone(), service_names::WATCHER),
    );
    let routes = tonic::service::Routes::new(LoadBalancersServer::new(Lbaas));
    rt.serve(routes, &config.listen, Some(&config.metrics_listen)).await
}

#[derive(Debug)]
struct Lbaas;

#[tonic::async_trait]
impl LoadBalancers for Lbaas {
    type WatchLoadBalancersStream = tokio_stream::Empty<Result<WatchLoadBalancersResponse, Status>>;

    async fn watch_load_balancers(
        &self,
        _: Request<WatchLoadBalancersRequest>,
    ) -> Result<Response<Self::WatchLoadBalancersStream>, Status> {
        Err(Status::unimplemented("WatchLoadBalancers is not implemented in this version of kuryr-lbaas"))
    }

    async fn get_load_balancer(&self, req: Request<GetLoadBalancerRequest>) -> Result<Response<LoadBalancer>, Status> {
        let r = req.get_ref();
        if r.namespace.is_empty() {
            return Err(Status::invalid_argument("namespace: required"));
        }
        if r.name.is_empty() {
            return Err(Status::invalid_argument("name: required"));
        }
        Err(Status::unimplemented("GetLoadBalancer is not implemented in this version of kuryr-lbaas"))
    }

    async fn list_load_balancers(
        &self,
        _: Request<ListLoadBalancersRequest>,
    ) -> Result<Response<ListLoadBalancersResponse>, Status> {
        Err(Status::unimplemented("ListLoadBalancers is not implemented in this version of kuryr-lbaas"))
    }
}
