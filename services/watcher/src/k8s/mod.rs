//! The Kubernetes side: one kube-runtime watcher per kind, across all namespaces, feeding the
//! index; and the Watcher service's readiness.
//!
//! A watcher re-lists by itself after 410 Gone and reconnects after a dropped connection; its
//! errors are logged, counted in `kuryr_watcher_watch_errors_total{kind}`, and retried with
//! kube-runtime's default backoff (0.8 s doubling to 30 s). Each object is reduced as it arrives
//! and the full object dropped, so what stays in memory is the index of reduced objects only
//! (plus, transiently, one list page of at most 500 full objects during a list).
//!
//! Readiness: SERVING once every kind has finished its first list and while the API answers a
//! probe made with the watches' own credentials (a one-item list of namespaces, so that an expired
//! token or revoked RBAC counts as well as an unreachable server). The probe runs every few
//! seconds, and at once whenever a watch reports an error, so that losing the API shows within
//! about a second. Subscribe keeps serving the (possibly stale) index meanwhile: consumers get the
//! deltas once the watches recover, which beats refusing them.

use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, ListParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use kuryr_proto::service_names::WATCHER;
use kuryr_runtime::{Health, Shutdown};
use serde::de::DeserializeOwned;
use tokio::sync::Notify;
use tracing::Instrument as _;

pub mod convert;

use self::convert::Reduce;
use crate::index::{SharedIndex, Update, lock};
use crate::metrics::{KindLabels, Metrics};
use crate::selector::kind_label;

/// How often a ready watcher re-checks the API; and how often while it is not.
const PROBE_EVERY: Duration = Duration::from_secs(5);
const PROBE_RETRY: Duration = Duration::from_secs(1);
/// A probe that takes longer counts as failed.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// What the watch tasks share.
#[derive(Clone, Debug)]
struct Ctx {
    index: SharedIndex,
    metrics: Metrics,
    /// Poked on every watch error, so that readiness re-probes at once.
    errors: Arc<Notify>,
    shutdown: Shutdown,
}

/// Starts the watches and the readiness loop in the background; they end at shutdown. The
/// service starts NOT_SERVING (registered by the caller).
pub fn spawn(kubeconfig: Option<PathBuf>, index: SharedIndex, metrics: Metrics, health: Health, shutdown: Shutdown) {
    let span = tracing::info_span!("kubernetes");
    tokio::spawn(
        async move {
            // Retried while no client can be built (a kubeconfig not mounted yet, say).
            let connect = || kuryr_runtime::kube_client(kubeconfig.as_deref());
            let Some(client) = kuryr_runtime::retry("building a Kubernetes client", &shutdown, connect).await else {
                return;
            };
            let ctx = Ctx { index, metrics, errors: Arc::new(Notify::new()), shutdown };
            spawn_watch::<Namespace>(Api::all(client.clone()), ctx.clone());
            spawn_watch::<Node>(Api::all(client.clone()), ctx.clone());
            spawn_watch::<Service>(Api::all(client.clone()), ctx.clone());
            spawn_watch::<EndpointSlice>(Api::all(client.clone()), ctx.clone());
            spawn_watch::<Pod>(Api::all(client.clone()), ctx.clone());
            spawn_watch::<NetworkPolicy>(Api::all(client.clone()), ctx.clone());
            readiness(client, ctx, health).await;
        }
        .instrument(span),
    );
}

fn spawn_watch<K>(api: Api<K>, ctx: Ctx)
where
    K: Reduce + kube::Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let span = tracing::info_span!("watch", kind = kind_label(K::KIND));
    tokio::spawn(watch(api, ctx).instrument(span));
}

async fn watch<K>(api: Api<K>, ctx: Ctx)
where
    K: Reduce + kube::Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let labels = KindLabels { kind: kind_label(K::KIND) };
    // Exported as 0 from the start, so that rates and alerts need no special case.
    ctx.metrics.watch_errors.get_or_create(&labels).inc_by(0);
    ctx.metrics.deltas.get_or_create(&labels).inc_by(0);
    ctx.metrics.objects.get_or_create(&labels).set(0);
    let mut events = watcher(api, kuryr_runtime::watch_config()).default_backoff().boxed();
    let mut failing = false;
    loop {
        let next = tokio::select! {
            next = events.next() => next,
            () = ctx.shutdown.clone().wait() => return,
        };
        let update = match next {
            Some(Ok(event)) => match event {
                watcher::Event::Init => Update::Restarted,
                watcher::Event::InitApply(o) => Update::Listed(o.reduce()),
                watcher::Event::InitDone => Update::ListDone,
                watcher::Event::Apply(o) => Update::Applied(o.reduce()),
                watcher::Event::Delete(o) => Update::Deleted(o.reduce()),
            },
            Some(Err(e)) => {
                ctx.metrics.watch_errors.get_or_create(&labels).inc();
                tracing::warn!(error = %e, "watch failed; retrying with backoff");
                failing = true;
                ctx.errors.notify_one();
                continue;
            }
            // The watcher stream never ends by itself.
            None => return,
        };
        if failing {
            tracing::info!("watch recovered");
            failing = false;
        }
        let done = matches!(update, Update::ListDone);
        let (recorded, len) = {
            let mut idx = lock(&ctx.index);
            (idx.apply(K::KIND, update), idx.len(K::KIND))
        };
        ctx.metrics.deltas.get_or_create(&labels).inc_by(recorded as u64);
        ctx.metrics.objects.get_or_create(&labels).set(len as i64);
        if done {
            tracing::info!(objects = len, "listed");
        }
    }
}

/// Keeps the Watcher service's health in line with sync state and API reachability.
async fn readiness(client: kube::Client, ctx: Ctx, health: Health) {
    let mut synced = lock(&ctx.index).synced();
    let probe_api: Api<Namespace> = Api::all(client);
    let mut last: Option<bool> = None;
    loop {
        let reachable =
            match tokio::time::timeout(PROBE_TIMEOUT, probe_api.list_metadata(&ListParams::default().limit(1))).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {PROBE_TIMEOUT:?}")),
            };
        let is_synced = *synced.borrow_and_update();
        let serving = is_synced && reachable.is_ok();
        if last != Some(serving) && !ctx.shutdown.is_triggered() {
            match (&reachable, is_synced) {
                (Err(e), _) => tracing::warn!(error = %e, "Kubernetes API unreachable; not serving"),
                (Ok(()), false) => tracing::info!("Kubernetes API reachable; waiting for the first lists"),
                (Ok(()), true) => tracing::info!("caches synced and API reachable; serving"),
            }
            if serving {
                health.set_serving(WATCHER).await;
            } else {
                health.set_not_serving(WATCHER).await;
            }
            last = Some(serving);
        }
        let wait = if reachable.is_ok() { PROBE_EVERY } else { PROBE_RETRY };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = ctx.errors.notified() => {}
            _ = synced.changed() => {}
            () = ctx.shutdown.clone().wait() => return,
        }
    }
}
