//! What the embedded IPAM suites share: an API server with the allocator's CRDs installed, the
//! pods they allocate for, and a bound on each phase of API calls.

use std::future::Future;
use std::time::Duration;

use anyhow::Result;
use kuryr_vif_allocator::core::PodKey;
use kuryr_vif_allocator::k8s::crd;

use crate::kube::KubeEnv;

/// Bound on a whole phase of API calls; a loaded 2-core machine needs a few seconds.
pub const PHASE_TIMEOUT: Duration = Duration::from_secs(300);

/// Starts the API server and installs the committed CRD manifests of the allocator, waiting (on a
/// watch) until each is Established; with an admin client.
pub async fn cluster() -> Result<(KubeEnv, kube::Client)> {
    let env = KubeEnv::start().await?;
    let names: Vec<String> = crd::crds().into_iter().filter_map(|(_, c)| c.metadata.name).collect();
    env.install_crds(&names).await?;
    let client = env.client().await?;
    Ok((env, client))
}

/// The pod `pod-<i>` (uid `uid-<i>`) of namespace `ns1`.
pub fn pod(i: usize) -> PodKey {
    PodKey::new("ns1", format!("pod-{i}"), format!("uid-{i}"))
}

/// Awaits `fut`, panicking when it takes longer than [`PHASE_TIMEOUT`]; `what` names it.
pub async fn phase<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(PHASE_TIMEOUT, fut).await.unwrap_or_else(|_| panic!("{what} took over {PHASE_TIMEOUT:?}"))
}
