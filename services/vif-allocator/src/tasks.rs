//! The Neutron backend's background work that involves the controller: VIFs marked READY as
//! their ports turn ACTIVE, and ports of pods that no longer exist handed to cleanup (each
//! round also auditing this replica's ports and deleting further ports of pods that are gone).

use std::sync::Arc;
use std::time::Duration;

use kuryr_runtime::Shutdown;

use crate::backend::VifBackend as _;
use crate::backend::neutron::{self, NeutronBackend};
use crate::controller::{Controller, view_lock};
use crate::error;
use crate::k8s::api::KubeCluster;
use crate::ready::{Condition, Readiness};

/// Marks VIFs READY as the status poller finds their ports ACTIVE; a VIF whose state could not
/// be recorded is watched again (and so retried).
pub(crate) async fn mark_ready(
    controller: Arc<Controller<KubeCluster>>,
    backend: Arc<NeutronBackend>,
    mut ready: tokio::sync::mpsc::UnboundedReceiver<neutron::ReadyVif>,
    shutdown: Shutdown,
) {
    loop {
        let r = tokio::select! {
            r = ready.recv() => match r { Some(r) => r, None => return },
            () = shutdown.clone().wait() => return,
        };
        let (ctl, b) = (controller.clone(), backend.clone());
        tokio::spawn(async move {
            if let Err(e) = ctl.mark_ready(&r.pod_uid, &r.vif_id).await {
                tracing::warn!(uid = %r.pod_uid, vif = %r.vif_id, error = %error::chain(&e),
                    "could not record READY; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                b.watch_ready(&r.pod_uid, &r.vif_id, true);
            }
        });
    }
}

/// Hands ports held by pods the allocator does not know (deleted while no allocator ran, or
/// before their PodVif existed) to the controller's cleanup, once the watcher's snapshot is in
/// and then every `interval`.
pub(crate) async fn collect_orphans(
    controller: Arc<Controller<KubeCluster>>,
    backend: Arc<NeutronBackend>,
    readiness: Readiness,
    interval: Duration,
    shutdown: Shutdown,
) {
    let mut ran_once = false;
    loop {
        let wait = if ran_once { interval } else { Duration::from_secs(1) };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shutdown.clone().wait() => return,
        }
        if !readiness.holds(Condition::Watcher) {
            continue;
        }
        if ran_once && let Err(e) = backend.audit().await {
            tracing::warn!(error = %error::chain(&e), "reading this replica's ports from Neutron failed; retried next round");
        }
        ran_once = true;
        // Further ports (listed before the view is read: a port made for a pod the view holds
        // then is that pod's, and a pod gone from the view has been cleaned up).
        match backend.extra_ports().await {
            Ok(ports) => {
                let gone: Vec<_> = {
                    let view = view_lock(controller.view());
                    ports.into_iter().filter(|(_, uid)| view.get(uid).is_none()).collect()
                };
                if !gone.is_empty() {
                    backend.delete_orphan_extras(&gone).await;
                }
            }
            Err(e) => {
                tracing::warn!(error = %error::chain(&e), "listing the further ports failed; retried next round");
            }
        }
        let orphans: Vec<_> = {
            let holders = backend.holders();
            let view = view_lock(controller.view());
            // Only on this replica's nodes: the others' owners collect theirs.
            holders.into_iter().filter(|(k, node)| view.get(&k.uid).is_none() && controller.serves(node)).collect()
        };
        for (key, node) in orphans {
            tracing::info!(uid = %key.uid, pod = %format!("{}/{}", key.namespace, key.name), node,
                "port held by a pod that no longer exists; cleaning up");
            if key.name.is_empty() {
                if let Err(e) = backend.release(&key, &node).await {
                    tracing::warn!(uid = %key.uid, error = %error::chain(&e), "releasing an orphaned port failed");
                }
            } else {
                controller.adopt_orphan(key, &node);
            }
        }
    }
}
