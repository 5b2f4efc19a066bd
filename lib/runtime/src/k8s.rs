//! Connecting to the Kubernetes API (with the `kube` feature).

use std::path::Path;

/// Builds a Kubernetes client from a kubeconfig file, or from the environment (in-cluster
/// service account, then `$KUBECONFIG`) when none is given.
pub async fn kube_client(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
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
