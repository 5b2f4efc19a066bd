//! Joining the shard set from a service's start-up. The service is built, and answers, before
//! it has a Kubernetes client: it is built with the ownership channel of a [`Joining`] (all
//! shards when unsharded, none yet otherwise), and once the client exists [`Joining::join`]
//! starts the shard set and copies what it learns into that channel. At shutdown
//! [`Joining::released`] waits for the Leases to be given up, so the other replicas take over
//! at once.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kuryr_runtime::Shutdown;
use kuryr_runtime::metrics::Registry;
use tokio::sync::watch;

use crate::config::ShardConfig;
use crate::lease::{ShardHandle, start};
use crate::metrics::ShardMetrics;
use crate::ownership::Ownership;

/// How long shutdown waits for the shard Leases to be released.
pub const RELEASE_WAIT: Duration = Duration::from_secs(6);

/// A replica's way into the shard set; cheap to clone.
#[derive(Clone, Debug)]
pub struct Joining {
    config: ShardConfig,
    metrics: ShardMetrics,
    ownership: watch::Sender<Arc<Ownership>>,
    handle: Arc<OnceLock<ShardHandle>>,
}

impl Joining {
    /// Registers the shard metrics; the receiver is what the service follows.
    pub fn new(config: ShardConfig, registry: &mut Registry) -> (Self, watch::Receiver<Arc<Ownership>>) {
        let initial = if config.shards == 0 {
            Ownership::everything(&config.identity)
        } else {
            Ownership::pending(&config.identity, config.shards)
        };
        let (ownership, rx) = watch::channel(Arc::new(initial));
        let metrics = ShardMetrics::register(registry);
        (Self { config, metrics, ownership, handle: Arc::default() }, rx)
    }

    /// Whether the work is split at all (`--shards` above 0).
    pub fn sharded(&self) -> bool {
        self.config.shards > 0
    }

    /// Starts the shard set with `client` when sharded (else nothing: everything stays this
    /// replica's), copying its ownership into the channel the service follows. Called once,
    /// from the service's start-up.
    pub fn join(&self, client: kube::Client, shutdown: Shutdown) {
        if !self.sharded() {
            return;
        }
        let handle = start(client, self.config.clone(), self.metrics.clone(), shutdown);
        let (mut from, to) = (handle.ownership(), self.ownership.clone());
        tokio::spawn(async move {
            loop {
                to.send_replace(from.borrow_and_update().clone());
                if from.changed().await.is_err() {
                    return;
                }
            }
        });
        let _ = self.handle.set(handle);
    }

    /// After shutdown: waits, up to [`RELEASE_WAIT`], for the shard set (if it was joined) to
    /// release its Leases.
    pub async fn released(&self) {
        if let Some(h) = self.handle.get() {
            let _ = tokio::time::timeout(RELEASE_WAIT, h.stopped()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(shards: u32) -> ShardConfig {
        ShardConfig {
            service: "kuryr-test".into(),
            shards,
            namespace: "kuryr-system".into(),
            duration: Duration::from_secs(15),
            identity: "replica-a".into(),
            endpoint: "127.0.0.1:1".into(),
        }
    }

    #[tokio::test]
    async fn unsharded_owns_everything_and_has_nothing_to_release() {
        let mut registry = Registry::default();
        let (joining, rx) = Joining::new(config(0), &mut registry);
        assert!(!joining.sharded());
        assert_eq!(**rx.borrow(), Ownership::everything("replica-a"));
        // Released at once: there is no shard set to wait for.
        let released = tokio::time::timeout(Duration::from_millis(100), joining.released()).await;
        assert!(released.is_ok());
        assert!(joining.handle.get().is_none());
    }

    #[test]
    fn sharded_starts_with_no_shard_owned() {
        let mut registry = Registry::default();
        let (joining, rx) = Joining::new(config(4), &mut registry);
        assert!(joining.sharded());
        assert_eq!(**rx.borrow(), Ownership::pending("replica-a", 4));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap_or_default();
        assert!(text.contains("kuryr_shards_owned"), "{text}");
    }
}
