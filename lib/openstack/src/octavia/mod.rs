//! Octavia (`load-balancer` in the catalog): load balancers, listeners, pools, members.
//!
//! Every change is retried on 409, which Octavia answers while the load balancer is PENDING_*:
//! the change was refused, not half-done, so repeating it is safe even for a POST. Waiting for
//! ACTIVE between changes is the caller's ([`Octavia::wait_load_balancer`] helps).

mod types;

pub use types::*;

use std::time::Duration;

use http::Method;
use tokio::time::Instant;

use crate::client::Client;
use crate::error::{Call, Error};
use crate::filter::Filter;
use crate::resource::{Resources, gone_is_false, has_id};
use crate::service::ServiceType;
use crate::transport::ApiRequest;
use crate::{Wrap, require_id};

const LB: ServiceType = ServiceType::LoadBalancer;

/// Octavia's default `pagination_max_limit`.
const PAGE_SIZE: usize = 1000;

/// The Octavia API.
#[derive(Clone, Debug)]
pub struct Octavia {
    client: Client,
}

impl Client {
    /// Octavia.
    pub fn load_balancer(&self) -> Octavia {
        Octavia::new(self.clone())
    }
}

impl Octavia {
    pub(crate) fn new(client: Client) -> Self {
        Self { client }
    }

    // ---- load balancers ----

    /// Creates a load balancer; with listeners (each with a named default pool and its members)
    /// the whole tree is built in one call.
    pub async fn create_load_balancer(&self, mut lb: LoadBalancerCreate) -> Result<LoadBalancer, Error> {
        if lb.project_id.is_none() {
            lb.project_id = self.client.body_project_id();
        }
        for l in &lb.listeners {
            if l.default_pool.as_ref().is_some_and(|p| p.name.is_none()) {
                return Err(Error::InvalidRequest(format!(
                    "listener {}/{:?}: a pool in a fully-populated create needs a name",
                    l.protocol_port, l.protocol
                )));
            }
        }
        self.create("loadbalancers.create", "/lbaas/loadbalancers", "loadbalancer", &lb).await
    }

    pub async fn get_load_balancer(&self, id: &str) -> Result<LoadBalancer, Error> {
        self.get("loadbalancers.show", "/lbaas/loadbalancers", id, "loadbalancer").await
    }

    /// Replaces a load balancer's tags (a PUT of `tags` alone); the load balancer goes through
    /// PENDING_UPDATE, so wait for ACTIVE before the next change.
    pub async fn set_load_balancer_tags(&self, id: &str, tags: &[String]) -> Result<LoadBalancer, Error> {
        let path = format!("/lbaas/loadbalancers/{}", require_id("loadbalancer", id)?);
        let body = serde_json::json!({ "tags": tags });
        let req =
            ApiRequest::with_json(LB, "loadbalancers.update", Method::PUT, path, &Wrap::new("loadbalancer", &body))?
                .retry_on_conflict();
        self.client.json_field(req, "loadbalancer").await
    }

    /// Load balancers matching `filter` (tags, name, vip_address, project_id, ...).
    pub async fn list_load_balancers(&self, filter: &Filter) -> Result<Vec<LoadBalancer>, Error> {
        self.list("loadbalancers.list", "/lbaas/loadbalancers", "loadbalancers", filter).await
    }

    /// Deletes a load balancer, with everything in it when `cascade`; `Ok(false)` if it was
    /// already gone.
    pub async fn delete_load_balancer(&self, id: &str, cascade: bool) -> Result<bool, Error> {
        let path = format!("/lbaas/loadbalancers/{}", require_id("load balancer", id)?);
        let mut req = ApiRequest::delete(LB, "loadbalancers.delete", path).retry_on_conflict();
        if cascade {
            req = req.query("cascade", "true");
        }
        gone_is_false(self.client.send(req).await)
    }

    /// Polls the load balancer until it leaves PENDING_* (backing off from 200 ms to 2 s), and
    /// returns it as it then is (ACTIVE or ERROR). [`Error::NotFound`] when it disappears (a
    /// finished delete); [`Error::Timeout`] if still pending after `timeout`.
    pub async fn wait_load_balancer(&self, id: &str, timeout: Duration) -> Result<LoadBalancer, Error> {
        let deadline = Instant::now() + timeout;
        let mut polls = kuryr_stream::Backoff::new("octavia-wait", Duration::from_millis(200), Duration::from_secs(2))
            .with_factor(1.5)
            .with_jitter(kuryr_stream::Jitter::Equal);
        loop {
            let lb = self.get_load_balancer(id).await?;
            if !lb.provisioning_status.is_pending() {
                return Ok(lb);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { call: Call { service: LB, operation: "loadbalancers.wait" }, timeout });
            }
            tokio::time::sleep(polls.next_delay("pending").min(deadline - now)).await;
        }
    }

    // ---- listeners ----

    pub async fn create_listener(&self, listener: &ListenerCreate) -> Result<Listener, Error> {
        if listener.loadbalancer_id.is_none() {
            return Err(Error::InvalidRequest("listener create: loadbalancer_id is required".into()));
        }
        self.create("listeners.create", "/lbaas/listeners", "listener", listener).await
    }

    pub async fn get_listener(&self, id: &str) -> Result<Listener, Error> {
        self.get("listeners.show", "/lbaas/listeners", id, "listener").await
    }

    pub async fn list_listeners(&self, filter: &Filter) -> Result<Vec<Listener>, Error> {
        self.list("listeners.list", "/lbaas/listeners", "listeners", filter).await
    }

    pub async fn delete_listener(&self, id: &str) -> Result<bool, Error> {
        self.delete("listeners.delete", "/lbaas/listeners", id).await
    }

    // ---- pools ----

    pub async fn create_pool(&self, pool: &PoolCreate) -> Result<Pool, Error> {
        if pool.listener_id.is_none() && pool.loadbalancer_id.is_none() {
            return Err(Error::InvalidRequest("pool create: listener_id or loadbalancer_id is required".into()));
        }
        self.create("pools.create", "/lbaas/pools", "pool", pool).await
    }

    pub async fn get_pool(&self, id: &str) -> Result<Pool, Error> {
        self.get("pools.show", "/lbaas/pools", id, "pool").await
    }

    pub async fn list_pools(&self, filter: &Filter) -> Result<Vec<Pool>, Error> {
        self.list("pools.list", "/lbaas/pools", "pools", filter).await
    }

    pub async fn delete_pool(&self, id: &str) -> Result<bool, Error> {
        self.delete("pools.delete", "/lbaas/pools", id).await
    }

    // ---- members ----

    pub async fn create_member(&self, pool_id: &str, member: &MemberCreate) -> Result<Member, Error> {
        let path = format!("/lbaas/pools/{}/members", require_id("pool", pool_id)?);
        self.create("members.create", &path, "member", member).await
    }

    pub async fn list_members(&self, pool_id: &str, filter: &Filter) -> Result<Vec<Member>, Error> {
        let path = format!("/lbaas/pools/{}/members", require_id("pool", pool_id)?);
        self.list("members.list", &path, "members", filter).await
    }

    pub async fn delete_member(&self, pool_id: &str, member_id: &str) -> Result<bool, Error> {
        let path = format!("/lbaas/pools/{}/members", require_id("pool", pool_id)?);
        self.delete("members.delete", &path, member_id).await
    }

    /// Sets the pool's whole member list in one call: members are matched by address and port,
    /// missing ones created, absent ones deleted. Octavia accepts it (202) and applies it in
    /// the background; wait for the load balancer to be ACTIVE again.
    pub async fn replace_members(&self, pool_id: &str, members: &[MemberCreate]) -> Result<(), Error> {
        let path = format!("/lbaas/pools/{}/members", require_id("pool", pool_id)?);
        let req = ApiRequest::with_json(LB, "members.replace", Method::PUT, path, &Wrap::new("members", &members))?
            .retry_on_conflict();
        self.client.send(req).await.map(drop)
    }
}

impl Resources for Octavia {
    const SERVICE: ServiceType = LB;
    const PAGE_SIZE: usize = PAGE_SIZE;
    const RETRY_ON_CONFLICT: bool = true;

    fn client(&self) -> &Client {
        &self.client
    }
}

has_id!(LoadBalancer, Listener, Pool, Member);

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
