//! ReportPlugged to the allocator after ADD plugged a VIF.
//!
//! A VIF the backend must confirm (a Neutron port, READY once Neutron reports it ACTIVE) is
//! reported in line: ADD waits for the answer and then for READY. A VIF the backend makes READY
//! as soon as it is plugged (`Vif.ready_when_plugged`, the embedded IPAM's) has nothing to wait
//! for: ADD answers once it is plugged and recorded (state Ready, `report_pending`), and the
//! report follows in the background, retried with the shared backoff until it is delivered. Each
//! attempt runs under the attachment's lock, so a DEL's unplugged report can never overtake it;
//! a DEL (or a new ADD) that came first ends it. A binder that exits with a report pending
//! delivers it at its next start ([`CniService::recover`]).

use std::time::{Duration, Instant};

use kuryr_cni_types::{CniError, code};
use kuryr_proto::allocator::v1::{ReportPluggedRequest, Vif};
use tonic::Status;

use super::{CniResult, CniService, PLUG_REPORT_TIMEOUT};
use crate::attachments::{Attachment, State};

/// The longest single attempt of a background report: it holds the attachment's lock, so a DEL
/// waits for it at most this long.
const BACKGROUND_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

fn plugged_request(att: &Attachment, node: &str) -> ReportPluggedRequest {
    ReportPluggedRequest {
        pod_uid: att.pod_uid.clone(),
        vif_id: att.vif_id.clone(),
        node_name: node.to_string(),
        plugged: true,
        host_ifname: att.host_ifname.clone(),
    }
}

impl CniService {
    /// Reports the attachment plugged; returns the VIF as the allocator has it after the report.
    pub(super) async fn report_plugged(&self, att: &Attachment, deadline: Instant) -> CniResult<Option<Vif>> {
        let req = plugged_request(att, &self.node);
        let mut backoff =
            kuryr_stream::Backoff::new("binder-report-plugged", Duration::from_millis(50), Duration::from_secs(1));
        loop {
            let limit = deadline.saturating_duration_since(Instant::now()).min(PLUG_REPORT_TIMEOUT);
            let mut call = tonic::Request::new(req.clone());
            call.set_timeout(limit);
            let mut client = self.allocator.client();
            let sent = tokio::time::timeout(limit, client.report_plugged(call)).await;
            match sent.unwrap_or_else(|_| Err(Status::deadline_exceeded("the allocator did not answer in time"))) {
                Ok(resp) => return Ok(resp.into_inner().vif),
                Err(s) if s.code() == tonic::Code::NotFound => {
                    return Err(CniError::new(
                        code::UNKNOWN_CONTAINER,
                        format!("the allocator no longer has a VIF for pod {}/{}", att.pod_namespace, att.pod_name),
                    ));
                }
                Err(s)
                    if Instant::now() + backoff.last_ceiling().max(Duration::from_millis(50)) < deadline
                        && matches!(
                            s.code(),
                            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Aborted
                        ) =>
                {
                    tracing::warn!(pod_uid = att.pod_uid, code = ?s.code(), error = s.message(), "plugged report failed; retrying");
                    let reason = match s.code() {
                        tonic::Code::Unavailable => "unavailable",
                        tonic::Code::Aborted => "aborted",
                        _ => "deadline",
                    };
                    let delay = backoff.next_delay(reason).min(deadline.saturating_duration_since(Instant::now()));
                    tokio::time::sleep(delay).await;
                }
                Err(s) => {
                    return Err(CniError::new(
                        code::TRY_AGAIN_LATER,
                        format!("cannot report the VIF plugged to the allocator: {}: {}", s.code(), s.message()),
                    ));
                }
            }
        }
    }

    /// Delivers the plugged report of attachment `container_id`/`ifname` in a task of its own
    /// (see the module's documentation).
    pub(super) fn report_in_background(&self, container_id: &str, ifname: &str) {
        let (svc, container_id, ifname) = (self.clone(), container_id.to_string(), ifname.to_string());
        tokio::spawn(async move { svc.deliver_pending_report(&container_id, &ifname).await });
    }

    async fn deliver_pending_report(&self, container_id: &str, ifname: &str) {
        let mut backoff =
            kuryr_stream::Backoff::new("binder-report-plugged", Duration::from_millis(50), Duration::from_secs(5));
        loop {
            let failure = {
                let _key = self.locks.lock(container_id, ifname).await;
                // Gone (DEL), replaced (a new ADD) or delivered already: nothing left to do.
                let Some(mut att) =
                    self.attachments.get(container_id, ifname).filter(|a| a.state == State::Ready && a.report_pending)
                else {
                    return;
                };
                let mut call = tonic::Request::new(plugged_request(&att, &self.node));
                call.set_timeout(BACKGROUND_ATTEMPT_TIMEOUT);
                let mut client = self.allocator.client();
                let sent = tokio::time::timeout(BACKGROUND_ATTEMPT_TIMEOUT, client.report_plugged(call)).await;
                match sent.unwrap_or_else(|_| Err(Status::deadline_exceeded("the allocator did not answer in time"))) {
                    Err(s) if !matches!(s.code(), tonic::Code::NotFound | tonic::Code::FailedPrecondition) => s,
                    answer => {
                        if let Err(s) = answer {
                            // The allocator no longer has this VIF for this pod on this node: the
                            // pod is going (its DEL follows) or was moved; asking again cannot help.
                            tracing::warn!(
                                container = container_id,
                                pod = format!("{}/{}", att.pod_namespace, att.pod_name),
                                code = ?s.code(),
                                error = s.message(),
                                "the allocator refused the plugged report; not retrying"
                            );
                        }
                        att.report_pending = false;
                        if let Err(e) = self.attachments.put(&att) {
                            // Delivered; only a restart would repeat it, which is harmless.
                            tracing::error!(container = container_id, error = %e, "cannot record the report delivered");
                        }
                        return;
                    }
                }
            };
            let reason = match failure.code() {
                tonic::Code::Unavailable => "unavailable",
                tonic::Code::DeadlineExceeded => "deadline",
                _ => "error",
            };
            let delay = backoff.next_delay(reason);
            tracing::warn!(
                container = container_id,
                code = ?failure.code(),
                error = failure.message(),
                retry_in_ms = delay.as_millis(),
                "plugged report not delivered; retrying"
            );
            tokio::time::sleep(delay).await;
        }
    }

    /// Restarts the background reports that a previous run of the binder left pending.
    pub(super) fn resume_pending_reports(&self) {
        for att in self.attachments.filter(|a| a.state == State::Ready && a.report_pending) {
            tracing::info!(container = att.container_id, ifname = att.ifname, "delivering a pending plugged report");
            self.report_in_background(&att.container_id, &att.ifname);
        }
    }
}
