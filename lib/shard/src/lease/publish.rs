//! What the rounds and the fence share: the shards worked on and until when, the owners the
//! Leases name; its publication as the [`Ownership`]; and the fence that stops work on a shard
//! whose membership (and Lease) was not renewed in time, whatever the rounds are doing.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kuryr_runtime::Shutdown;
use tokio::sync::watch;

use crate::config::ShardConfig;
use crate::metrics::ShardMetrics;
use crate::ownership::{Owner, Ownership};

/// What the rounds and the fence share.
#[derive(Debug)]
pub(super) struct State {
    /// Owned shards and until when each may be worked on without a renewal.
    pub(super) owned: BTreeMap<u32, Instant>,
    pub(super) owners: Vec<Option<Owner>>,
    pub(super) ready: bool,
}

/// Publishes ownership changes.
#[derive(Clone, Debug)]
pub(super) struct Publisher {
    pub(super) tx: Arc<watch::Sender<Arc<Ownership>>>,
    pub(super) state: Arc<Mutex<State>>,
    pub(super) config: Arc<ShardConfig>,
    pub(super) metrics: ShardMetrics,
}

impl Publisher {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends the state when it differs from what was last sent.
    pub(super) fn publish(&self, state: &State) {
        let mut owners = state.owners.clone();
        for &i in state.owned.keys() {
            if let Some(o) = owners.get_mut(i as usize) {
                *o = Some(Owner {
                    identity: self.config.identity.clone(),
                    endpoint: Some(self.config.endpoint.clone()),
                });
            }
        }
        let next = Ownership {
            shards: self.config.shards,
            identity: self.config.identity.clone(),
            ready: state.ready,
            owned: state.owned.keys().copied().collect(),
            owners,
        };
        self.metrics.owned.set(i64::try_from(state.owned.len()).unwrap_or(i64::MAX));
        self.tx.send_if_modified(|cur| {
            if **cur == next {
                return false;
            }
            *cur = Arc::new(next);
            true
        });
    }
}

/// Stops work on shards whose membership was not renewed in time: a shard whose holder's
/// membership Lease was renewed at `t` is worked on until `t + duration − tick` at most, so it
/// is let go at least one renewal interval before any other replica can take it (they wait a
/// whole duration from when they see the renewal).
pub(super) async fn fence(publisher: Publisher, shutdown: Shutdown) {
    let check = (publisher.config.tick() / 4).max(Duration::from_millis(20));
    loop {
        let wake = {
            let mut s = publisher.lock();
            let now = Instant::now();
            let expired: Vec<u32> = s.owned.iter().filter(|(_, until)| **until <= now).map(|(i, _)| *i).collect();
            for i in &expired {
                s.owned.remove(i);
                publisher.metrics.lost("expired");
                tracing::warn!(shard = i, "shard Lease not renewed in time; stopped working on it");
            }
            if !expired.is_empty() {
                publisher.publish(&s);
            }
            s.owned.values().min().copied().map_or(now + check, |t| t.min(now + check))
        };
        tokio::select! {
            () = tokio::time::sleep_until(wake.into()) => {}
            () = shutdown.clone().wait() => return,
        }
    }
}
