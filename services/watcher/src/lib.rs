//! kuryr-watcher: the only reader of the Kubernetes API for the objects kuryr cares about.
//!
//! It watches pods, services, endpointslices, namespaces, network policies and nodes, keeps an
//! in-memory index of what consumers need, and streams it over `kuryr.watcher.v1.Watcher/Subscribe`.
//! It reports NOT_SERVING while the Kubernetes API is unreachable.

use std::path::PathBuf;

use clap::Parser;
use kuryr_proto::service_names;
use kuryr_proto::watcher::v1::watcher_server::{Watcher, WatcherServer};
use kuryr_proto::watcher::v1::{Kind, SubscribeRequest, SubscribeResponse};
use kuryr_runtime::{CommonArgs, ListenAddr, Runtime};
use tonic::{Request, Response, Status};

/// Command-line configuration.
#[derive(Clone, Debug, Parser)]
#[command(name = "kuryr-watcher", version, about = "Streams Kubernetes objects to the other kuryr services.")]
pub struct Config {
    /// gRPC listen addresses, comma-separated or repeated: HOST:PORT or unix:/path.
    #[arg(long, env = "KURYR_WATCHER_LISTEN", value_delimiter = ',', default_value = "0.0.0.0:9600")]
    pub listen: Vec<ListenAddr>,

    /// HTTP address for Prometheus metrics (/metrics) and probes (/livez, /readyz).
    #[arg(long, env = "KURYR_WATCHER_METRICS_LISTEN", default_value = "0.0.0.0:9601")]
    pub metrics_listen: ListenAddr,

    /// Kubeconfig file; when unset, the in-cluster service account (or $KUBECONFIG) is used.
    #[arg(long, env = "KURYR_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the watcher until SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let rt = Runtime::new("kuryr-watcher", &config.common)?;
    let kubeconfig = config.kubeconfig.clone();
    kuryr_runtime::deps::spawn_probe(rt.health(), service_names::WATCHER, "kubernetes-api", rt.shutdown(), move || {
        let kubeconfig = kubeconfig.clone();
        async move {
            let client = kube_client(kubeconfig.as_deref()).await?;
            let v = client.apiserver_version().await?;
            tracing::debug!(version = %v.git_version, "kubernetes API reachable");
            Ok(())
        }
    });
    let routes = tonic::service::Routes::new(WatcherServer::new(WatcherService));
    rt.serve(routes, &config.listen, Some(&config.metrics_listen)).await
}

/// Builds a Kubernetes client from a kubeconfig file, or from the environment when none is given.
pub async fn kube_client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    // kube's rustls needs a process-wide crypto provider; installing twice is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("reading kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// The Subscribe service.
#[derive(Debug)]
struct WatcherService;

#[tonic::async_trait]
impl Watcher for WatcherService {
    type SubscribeStream = tokio_stream::Empty<Result<SubscribeResponse, Status>>;

    async fn subscribe(&self, req: Request<SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        let req = req.into_inner();
        validate(&req)?;
        Err(Status::unimplemented("Subscribe is not implemented in this version of kuryr-watcher"))
    }
}

fn validate(req: &SubscribeRequest) -> Result<(), Status> {
    if req.kinds.is_empty() {
        return Err(Status::invalid_argument("kinds: at least one kind is required"));
    }
    for k in &req.kinds {
        match Kind::try_from(*k) {
            Ok(Kind::Unspecified) => return Err(Status::invalid_argument("kinds: KIND_UNSPECIFIED is not a kind")),
            Ok(_) => {}
            Err(_) => return Err(Status::invalid_argument(format!("kinds: {k} is not a known kind"))),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscribe_requests_are_validated() {
        let mut r = SubscribeRequest::default();
        assert_eq!(validate(&r).unwrap_err().code(), tonic::Code::InvalidArgument);
        r.kinds = vec![0];
        assert!(validate(&r).unwrap_err().message().contains("KIND_UNSPECIFIED"));
        r.kinds = vec![99];
        assert!(validate(&r).unwrap_err().message().contains("99"));
        r.kinds = vec![Kind::Pod as i32];
        assert!(validate(&r).is_ok());
    }
}
