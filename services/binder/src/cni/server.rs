//! The gRPC face of the CNI service: the shim's version checked on every call, each operation
//! handed to [`CniService`], failures logged with the container they concern.

use super::*;

/// Refuses a shim of another version, so that a half-upgraded node fails loudly. The answer
/// names neither version: the caller learns that it is incompatible, not what would be.
pub fn check_shim_version(v: &str) -> Result<(), Status> {
    if v != crate::VERSION {
        let msg = "this kuryr-cni is incompatible with the kuryr-binder it called: install the kuryr-cni \
                   shipped with the binder";
        return Err(Status::from(CniError::new(code::INCOMPATIBLE_VERSION, msg)));
    }
    Ok(())
}

#[tonic::async_trait]
impl pb::cni_server::Cni for CniService {
    async fn add(&self, req: Request<pb::CniRequest>) -> Result<Response<pb::CniResult>, Status> {
        let r = req.into_inner();
        check_shim_version(&r.shim_version)?;
        let t = Instant::now();
        let res = CniService::add(self, &r).await;
        self.metrics.observe("ADD", res.as_ref().err().map(|e| e.code), t.elapsed());
        res.map(Response::new).map_err(|e| Status::from(log_failure("ADD", &r.container_id, e)))
    }

    async fn del(&self, req: Request<pb::CniRequest>) -> Result<Response<pb::DelResponse>, Status> {
        let r = req.into_inner();
        check_shim_version(&r.shim_version)?;
        let t = Instant::now();
        let res = CniService::del(self, &r).await;
        self.metrics.observe("DEL", res.as_ref().err().map(|e| e.code), t.elapsed());
        res.map(|()| Response::new(pb::DelResponse {}))
            .map_err(|e| Status::from(log_failure("DEL", &r.container_id, e)))
    }

    async fn check(&self, req: Request<pb::CniRequest>) -> Result<Response<pb::CheckResponse>, Status> {
        let r = req.into_inner();
        check_shim_version(&r.shim_version)?;
        let t = Instant::now();
        let res = CniService::check(self, &r).await;
        self.metrics.observe("CHECK", res.as_ref().err().map(|e| e.code), t.elapsed());
        res.map(|()| Response::new(pb::CheckResponse {}))
            .map_err(|e| Status::from(log_failure("CHECK", &r.container_id, e)))
    }

    async fn status(&self, req: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let r = req.into_inner();
        check_shim_version(&r.shim_version)?;
        let t = Instant::now();
        let res = parse_conf(&r.config).and_then(|_| CniService::status(self));
        self.metrics.observe("STATUS", res.as_ref().err().map(|e| e.code), t.elapsed());
        res.map(|()| Response::new(pb::StatusResponse {})).map_err(Status::from)
    }

    async fn gc(&self, req: Request<pb::GcRequest>) -> Result<Response<pb::GcResponse>, Status> {
        let r = req.into_inner();
        check_shim_version(&r.shim_version)?;
        let t = Instant::now();
        let res = CniService::gc(self, &r).await;
        self.metrics.observe("GC", res.as_ref().err().map(|e| e.code), t.elapsed());
        res.map(|removed| Response::new(pb::GcResponse { removed })).map_err(|e| Status::from(log_failure("GC", "", e)))
    }

    async fn version(&self, req: Request<pb::VersionRequest>) -> Result<Response<pb::VersionResponse>, Status> {
        check_shim_version(&req.get_ref().shim_version)?;
        Ok(Response::new(pb::VersionResponse {
            binder_version: crate::VERSION.to_string(),
            supported_cni_versions: crate::SUPPORTED_CNI_VERSIONS.iter().map(|s| s.to_string()).collect(),
        }))
    }
}

fn log_failure(op: &str, container: &str, e: CniError) -> CniError {
    tracing::warn!(op, container, code = e.code, error = e.msg, "CNI operation failed");
    e
}
