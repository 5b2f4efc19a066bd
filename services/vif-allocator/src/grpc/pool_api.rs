//! The PoolManager gRPC service: list, show, populate and free the Neutron backend's port pools
//! (in place of Kuryr's unix-socket pool manager). With the embedded backend every call answers
//! UNIMPLEMENTED; with Neutron, UNAVAILABLE until the pools were recovered. With replicas
//! sharing the nodes, each lists and frees its own nodes' pools, and a call naming another
//! replica's node is refused with UNAVAILABLE and that replica's address (the
//! `kuryr-shard-owner` trailer), as the binders' calls are.

use std::sync::{Arc, OnceLock};

use kuryr_proto::allocator::v1::pool_manager_server::PoolManager;
use kuryr_proto::allocator::v1::{
    FreePoolRequest, FreePoolResponse, ListPoolsRequest, ListPoolsResponse, Pool, PoolKey, PopulatePoolRequest,
};
use kuryr_runtime::validate::is_dns_subdomain;
use tonic::{Request, Response, Status};

use crate::backend::neutron::NeutronBackend;
use crate::backend::neutron::pool::{self, PoolView};
use crate::error::{ClusterError, chain};

/// Most free ports one PopulatePool may ask for (the pool's `--pool-max` caps it further).
pub const MAX_POPULATE: u32 = 100;

/// Whether a Node exists: `None` while the allocator does not know yet.
pub type NodeCheck = Arc<dyn Fn(&str) -> Option<bool> + Send + Sync>;

/// The Neutron backend, once it is connected (the server starts before that).
pub type BackendCell = Arc<OnceLock<Arc<NeutronBackend>>>;

const NO_POOLS: &str =
    "port pools belong to the Neutron backend; this kuryr-vif-allocator runs the embedded IPAM, which has none";

/// The PoolManager service.
#[derive(Clone)]
pub struct PoolApi {
    /// `None` with the embedded backend.
    backend: Option<BackendCell>,
    /// PopulatePool makes ports only for nodes that exist.
    nodes: Option<NodeCheck>,
}

impl std::fmt::Debug for PoolApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolApi").field("backend", &self.backend).finish_non_exhaustive()
    }
}

impl PoolApi {
    /// The service of an allocator with the embedded backend: everything UNIMPLEMENTED.
    pub fn embedded() -> Self {
        Self { backend: None, nodes: None }
    }

    /// The service of the Neutron backend in `cell`; PopulatePool asks `nodes` whether the node
    /// exists.
    pub fn neutron(cell: BackendCell, nodes: NodeCheck) -> Self {
        Self { backend: Some(cell), nodes: Some(nodes) }
    }

    /// INVALID_ARGUMENT naming the node unless it exists; UNAVAILABLE while that is not known.
    fn node_exists(&self, node: &str) -> Result<(), Status> {
        let known = self.nodes.as_ref().and_then(|check| check(node));
        match known {
            Some(true) => Ok(()),
            Some(false) => Err(Status::invalid_argument(format!("key.node_name: there is no Node `{node}`"))),
            None => Err(Status::unavailable("the allocator does not know the cluster's nodes yet; try again shortly")),
        }
    }

    fn backend(&self) -> Result<&Arc<NeutronBackend>, Status> {
        let cell = self.backend.as_ref().ok_or_else(|| Status::unimplemented(NO_POOLS))?;
        cell.get()
            .filter(|b| b.is_recovered())
            .ok_or_else(|| Status::unavailable("the Neutron ports are not recovered yet; try again shortly"))
    }
}

/// Checks a pool key of a request (`field` names it), completing empty parts with the
/// backend's own.
fn key_of(backend: &NeutronBackend, field: &str, key: Option<&PoolKey>) -> Result<pool::PoolKey, Status> {
    let key = key.ok_or_else(|| Status::invalid_argument(format!("{field}: required")))?;
    let node = key.node_name.trim();
    if node.is_empty() {
        return Err(Status::invalid_argument(format!("{field}.node_name: required")));
    }
    if !is_dns_subdomain(node) {
        return Err(Status::invalid_argument(format!("{field}.node_name: `{node}` is not a valid node name")));
    }
    if key.security_groups.iter().any(|s| s.trim().is_empty()) {
        return Err(Status::invalid_argument(format!("{field}.security_groups: empty id in the list")));
    }
    Ok(backend.complete_key(node, key.project_id.trim(), key.network_id.trim(), &key.security_groups))
}

fn to_proto(v: PoolView, limits: pool::Limits) -> Pool {
    Pool {
        key: Some(PoolKey {
            node_name: v.key.node,
            project_id: v.key.project,
            network_id: v.key.network,
            security_groups: v.key.security_groups,
        }),
        free_port_ids: v.free,
        in_use: v.in_use,
        min: limits.min,
        batch: limits.batch,
        max: limits.max,
    }
}

fn backend_status(e: &ClusterError) -> Status {
    match e {
        ClusterError::Neutron { source, .. } if source.is_transient() => Status::unavailable(chain(e)),
        ClusterError::Neutron { source, .. } if matches!(**source, kuryr_openstack::Error::QuotaExceeded(_)) => {
            Status::resource_exhausted(chain(e))
        }
        ClusterError::NotReady(_) => Status::unavailable(chain(e)),
        _ => Status::internal(chain(e)),
    }
}

#[tonic::async_trait]
impl PoolManager for PoolApi {
    async fn list_pools(&self, _: Request<ListPoolsRequest>) -> Result<Response<ListPoolsResponse>, Status> {
        let b = self.backend()?;
        let limits = b.limits();
        Ok(Response::new(ListPoolsResponse { pools: b.pools().into_iter().map(|v| to_proto(v, limits)).collect() }))
    }

    async fn show_pool(&self, req: Request<PoolKey>) -> Result<Response<Pool>, Status> {
        let b = self.backend()?;
        let req = req.into_inner();
        let key = key_of(b, "key", Some(&req))?;
        b.check_node(&key.node)?;
        let view = b.pool(&key).ok_or_else(|| Status::not_found(format!("no pool for {key:?}")))?;
        Ok(Response::new(to_proto(view, b.limits())))
    }

    async fn populate_pool(&self, req: Request<PopulatePoolRequest>) -> Result<Response<Pool>, Status> {
        let b = self.backend()?;
        let req = req.into_inner();
        let key = key_of(b, "key", req.key.as_ref())?;
        if req.count == 0 || req.count > MAX_POPULATE {
            return Err(Status::invalid_argument(format!("count: between 1 and {MAX_POPULATE}")));
        }
        // Ports bound to a made-up host would be made and kept for nobody.
        self.node_exists(&key.node)?;
        // Another replica's node: its pools are that replica's (the refusal names it).
        b.check_node(&key.node)?;
        if !b.serves(&key)
            && let Some(nn) = b.namespace_networks()
        {
            return Err(Status::invalid_argument(format!(
                "key: this allocator creates ports for project {} and security groups {:?} on the namespace networks \
                 (kubectl get namespacenetworks): {:?}",
                b.key_for("").project,
                b.key_for("").security_groups,
                nn.networks()
            )));
        }
        if !b.serves(&key) {
            return Err(Status::invalid_argument(format!(
                "key: this allocator creates ports only for project {}, network {} and security groups {:?}",
                b.key_for("").project,
                b.network_id(),
                b.key_for("").security_groups
            )));
        }
        let view = b.populate(&key, req.count).await.map_err(|e| backend_status(&e))?;
        Ok(Response::new(to_proto(view, b.limits())))
    }

    async fn free_pool(&self, req: Request<FreePoolRequest>) -> Result<Response<FreePoolResponse>, Status> {
        let b = self.backend()?;
        let req = req.into_inner();
        let deleted = match req.key.as_ref() {
            None => b.free(|_| true).await,
            Some(k) => {
                let key = key_of(b, "key", Some(k))?;
                b.check_node(&key.node)?;
                b.free(|kk| *kk == key).await
            }
        }
        .map_err(|e| backend_status(&e))?;
        tracing::info!(deleted, "pool ports freed");
        Ok(Response::new(FreePoolResponse { deleted }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn embedded_allocators_have_no_pools_and_neutron_ones_wait_for_recovery() {
        let api = PoolApi::embedded();
        let e = api.list_pools(Request::new(ListPoolsRequest {})).await.err();
        assert_eq!(e.map(|s| s.code()), Some(tonic::Code::Unimplemented));
        let api = PoolApi::neutron(BackendCell::default(), Arc::new(|_: &str| Some(true)));
        let e = api.free_pool(Request::new(FreePoolRequest { key: None })).await.err();
        assert_eq!(e.map(|s| s.code()), Some(tonic::Code::Unavailable));
    }

    #[test]
    fn populate_only_for_nodes_that_exist() {
        let api = PoolApi::neutron(BackendCell::default(), Arc::new(|n: &str| (n != "early").then_some(n == "node-1")));
        assert!(api.node_exists("node-1").is_ok());
        let e = api.node_exists("node-9").unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().starts_with("key.node_name:"), "{}", e.message());
        assert_eq!(api.node_exists("early").unwrap_err().code(), tonic::Code::Unavailable);
    }
}
