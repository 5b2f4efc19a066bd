//! Readiness: grpc.health.v1 statuses per service, plus the overall status ("") that is SERVING
//! only when every registered service is. The same state answers the metrics server's `/readyz`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// A cloneable handle to set each service's readiness.
#[derive(Clone, Debug)]
pub struct Health {
    reporter: HealthReporter,
    state: Arc<Mutex<BTreeMap<String, bool>>>,
}

impl Health {
    pub(crate) fn new(reporter: HealthReporter) -> Self {
        Self { reporter, state: Arc::default() }
    }

    /// Registers a service, NOT_SERVING until [`Health::set_serving`].
    pub async fn register(&self, service: &str) {
        self.set(service, false).await;
    }

    /// Marks a service ready.
    pub async fn set_serving(&self, service: &str) {
        self.set(service, true).await;
    }

    /// Marks a service not ready (a dependency is unreachable, or shutdown began).
    pub async fn set_not_serving(&self, service: &str) {
        self.set(service, false).await;
    }

    /// Marks every service not ready (at shutdown).
    pub async fn set_all_not_serving(&self) {
        let names: Vec<String> = self.lock().keys().cloned().collect();
        for n in names {
            self.set(&n, false).await;
        }
    }

    /// Whether every registered service is serving.
    pub fn all_serving(&self) -> bool {
        let s = self.lock();
        !s.is_empty() && s.values().all(|v| *v)
    }

    /// Each service and whether it serves.
    pub fn snapshot(&self) -> BTreeMap<String, bool> {
        self.lock().clone()
    }

    async fn set(&self, service: &str, serving: bool) {
        let (changed, overall) = {
            let mut s = self.lock();
            let changed = s.insert(service.to_string(), serving) != Some(serving);
            (changed, !s.is_empty() && s.values().all(|v| *v))
        };
        if changed {
            tracing::info!(service, serving, "readiness changed");
        }
        let status = |b| if b { ServingStatus::Serving } else { ServingStatus::NotServing };
        self.reporter.set_service_status(service, status(serving)).await;
        self.reporter.set_service_status("", status(overall)).await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, bool>> {
        // The map holds plain booleans; a panic elsewhere cannot leave it inconsistent.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
