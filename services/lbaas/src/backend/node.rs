//! The embedded node dataplane: each spec published to the [`LbLog`] that `WatchLoadBalancers`
//! streams to every node's binder, which programs nftables. A load balancer is `PROGRAMMED` at
//! the generation published.

use crate::core::lb::LoadBalancerSpec;

use super::{Backend, BackendError, LbLog, Observed, PROGRAMMED};

/// The embedded node dataplane: specs streamed to every binder.
#[derive(Clone, Debug)]
pub struct NodeBackend {
    log: LbLog,
}

impl NodeBackend {
    /// Publishes into `log`.
    pub fn new(log: LbLog) -> Self {
        Self { log }
    }
}

impl Backend for NodeBackend {
    fn name(&self) -> &'static str {
        "node"
    }

    fn recover(&self, specs: Vec<(String, LoadBalancerSpec)>) {
        let mut log = kuryr_stream::log::lock(&self.log);
        for (key, spec) in specs {
            log.upsert(key, spec);
        }
    }

    async fn ensure(&self, key: &str, spec: &LoadBalancerSpec) -> Result<Observed, BackendError> {
        kuryr_stream::log::lock(&self.log).upsert(key.to_string(), spec.clone());
        Ok(Observed {
            provisioning_status: PROGRAMMED.into(),
            observed_generation: spec.generation,
            ..Default::default()
        })
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        kuryr_stream::log::lock(&self.log).remove(&key.to_string());
        Ok(())
    }

    fn mirror(&self, key: &str, spec: Option<LoadBalancerSpec>) {
        let mut log = kuryr_stream::log::lock(&self.log);
        let key = key.to_string();
        match spec {
            // An older generation of the same Service never replaces a newer one; an equal spec
            // records nothing (the log compares), so an owner change is silent on the stream.
            Some(spec) => {
                let stale = log.get(&key).is_some_and(|cur| cur.uid == spec.uid && cur.generation > spec.generation);
                if !stale {
                    log.upsert(key, spec);
                }
            }
            None => {
                log.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kuryr_stream::{Epoch, Log};

    use super::*;

    fn spec(uid: &str, generation: u64, vip: &str) -> LoadBalancerSpec {
        LoadBalancerSpec {
            namespace: "ns".into(),
            name: "web".into(),
            uid: uid.into(),
            vips: vec![vip.into()],
            generation,
            ..Default::default()
        }
    }

    #[test]
    fn mirrored_records_never_go_back_and_repeat_nothing() {
        let log: LbLog = Log::new(Epoch::random(), 64).shared();
        kuryr_stream::log::lock(&log).set_ready();
        let b = NodeBackend::new(log.clone());
        let rev = || kuryr_stream::log::lock(&log).revision();
        b.mirror("ns/web", Some(spec("u1", 3, "10.96.0.1")));
        assert_eq!(rev(), 1);
        // The same spec again (a new owner publishing what the old one did): nothing streamed.
        b.mirror("ns/web", Some(spec("u1", 3, "10.96.0.1")));
        assert_eq!(rev(), 1);
        // An older generation of the same Service arriving late: ignored.
        b.mirror("ns/web", Some(spec("u1", 2, "10.96.0.9")));
        assert_eq!(kuryr_stream::log::lock(&log).get(&"ns/web".to_string()).unwrap().generation, 3);
        // Newer, or a Service re-created under the name (any generation): applied.
        b.mirror("ns/web", Some(spec("u1", 4, "10.96.0.2")));
        b.mirror("ns/web", Some(spec("u2", 1, "10.96.0.3")));
        assert_eq!(rev(), 3);
        assert_eq!(kuryr_stream::log::lock(&log).get(&"ns/web".to_string()).unwrap().uid, "u2");
        b.mirror("ns/web", None);
        assert!(kuryr_stream::log::lock(&log).get(&"ns/web".to_string()).is_none());
        assert_eq!(rev(), 4);
    }
}
