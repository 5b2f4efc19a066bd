//! The CNI operations, served to the `kuryr-cni` shim over `kuryr.binder.v1.Cni`.
//!
//! Every failure is a gRPC status whose details carry a `CniError` with the CNI code the shim
//! prints, so codes are decided here, where the cause is known, not guessed from status codes.

mod extra;
mod ops;
mod report;
mod result;
mod server;

use result::result_for;
pub use server::check_shim_version;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kuryr_proto::allocator::v1::{BindingDriver as ProtoDriver, ReportPluggedRequest, Vif};
use kuryr_proto::binder::v1 as pb;
use tonic::{Request, Response, Status};

use ipnet::IpNet;
use kuryr_cni_types::{CniError, code};

use crate::attachments::{Attachment, Attachments, KeyGuard, KeyLocks, State};
use crate::metrics::{CniMetrics, Steps};
use crate::netns::NetnsError;
use crate::plug::{self, BindingDriver, PlugError, PlugSpec};
use crate::vifs::{self, VifCache, Wait};

/// CHECK found the attachment differing from what ADD set up (a plugin-specific code).
pub const ATTACHMENT_DIFFERS: u32 = code::PLUGIN_SPECIFIC_MIN;

type CniResult<T> = Result<T, CniError>;

/// A bridge and the gateway addresses it holds.
type BridgeKey = (String, Vec<IpNet>);

/// The binder's CNI service.
#[derive(Clone, Debug)]
pub struct CniService {
    pub node: String,
    pub vifs: VifCache,
    pub attachments: Attachments,
    /// Pods' host ports in the node's nftables table.
    pub hostports: crate::hostport::HostPorts,
    pub allocator: crate::upstream::Allocator,
    /// How long ADD waits for the VIF to appear, and then to become ready.
    pub vif_wait: Duration,
    /// The OVS database to talk to (ovs-vsctl --db), for the `ovs` binding.
    pub ovs_db: Option<String>,
    /// How VIFs on a VLAN of the node's uplink (nested pods) are plugged.
    pub nested: plug::vlan::NestedPlug,
    pub metrics: CniMetrics,
    /// Bridges already made ready with these gateway addresses, so that ADD does not redo it
    /// (a netlink round on a thread of its own) for every pod.
    pub bridges_ready: Arc<Mutex<HashSet<BridgeKey>>>,
    /// One lock per attachment: operations on one container interface never overlap.
    pub locks: KeyLocks,
}

/// How long a report to the allocator may take when nothing waits on its answer (DEL, GC, a
/// rollback): the allocator learns of deleted pods from Kubernetes anyway, so a hung or
/// partitioned allocator must not hold up the runtime.
const UNPLUG_REPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest single plug report; ADD retries within its own deadline.
const PLUG_REPORT_TIMEOUT: Duration = Duration::from_secs(5);

fn required<'a>(var: &str, value: &'a str) -> CniResult<&'a str> {
    if value.is_empty() {
        return Err(CniError::new(code::INVALID_ENVIRONMENT, format!("{var} is required")));
    }
    Ok(value)
}

fn parse_conf(bytes: &[u8]) -> CniResult<kuryr_cni_types::NetConf> {
    kuryr_cni_types::NetConf::parse(bytes)
}

fn netns_path(netns: &str) -> Option<PathBuf> {
    (!netns.is_empty()).then(|| PathBuf::from(netns))
}

pub(crate) fn plug_failure(e: PlugError, what: &str) -> CniError {
    match &e {
        PlugError::NetnsMissing { .. }
        | PlugError::IfnameExists { .. }
        | PlugError::Netns(NetnsError::NotAPod { .. } | NetnsError::NotANetns { .. }) => {
            CniError::new(code::INVALID_ENVIRONMENT, format!("{what}: {e}"))
        }
        _ => CniError::new(code::IO, format!("{what}: {e}")).with_details(format!("{e:?}")),
    }
}

/// `CNI_NETNS` as a pod's network namespace: a namespace file, neither the binder's own nor
/// the host's (code 4 otherwise, naming it).
fn pod_netns(netns: &Path) -> CniResult<()> {
    crate::netns::check_pod(netns).map_err(|e| match e {
        NetnsError::NotFound { .. } | NetnsError::NotANetns { .. } | NetnsError::NotAPod { .. } => {
            CniError::new(code::INVALID_ENVIRONMENT, format!("CNI_NETNS: {e}"))
        }
        e => CniError::new(code::IO, format!("CNI_NETNS: {e}")).with_details(format!("{e:?}")),
    })
}

/// Whether the sandbox of an attachment still has its namespace.
fn netns_alive(att: &Attachment) -> bool {
    !att.netns.is_empty() && crate::netns::check_pod(Path::new(&att.netns)).is_ok()
}

/// The binding driver an attachment was plugged with, from its record.
pub(crate) fn driver_of_record(att: &Attachment) -> BindingDriver {
    match att.driver.as_str() {
        "ovs" => BindingDriver::Ovs {
            bridge: att.bridge.clone(),
            iface_id: att.vif_id.clone(),
            attached_mac: String::new(),
            vm_uuid: att.pod_uid.clone(),
            vlan: None,
        },
        // The VLAN id is not needed to remove the device.
        "vlan" => BindingDriver::Vlan { uplink: att.bridge.clone(), vlan: 0 },
        _ => BindingDriver::Bridge { bridge: att.bridge.clone() },
    }
}

/// The binding driver of a VIF.
fn driver_of(vif: &Vif, pod_uid: &str, nested: &plug::vlan::NestedPlug) -> CniResult<BindingDriver> {
    let b = vif.binding.clone().unwrap_or_default();
    match b.driver() {
        ProtoDriver::Bridge | ProtoDriver::Unspecified => {
            Ok(BindingDriver::Bridge { bridge: if b.bridge.is_empty() { "kuryr0".into() } else { b.bridge } })
        }
        ProtoDriver::Ovs => Ok(BindingDriver::Ovs {
            bridge: if b.bridge.is_empty() { "br-int".into() } else { b.bridge },
            iface_id: vif.vif_id.clone(),
            attached_mac: vif.mac.clone(),
            vm_uuid: pod_uid.to_string(),
            vlan: None,
        }),
        ProtoDriver::Vlan => nested.driver(vif, pod_uid, b.vlan_id).map_err(|e| CniError::new(code::INVALID_CONFIG, e)),
    }
}

/// Records what ADD has done so far and undoes it if ADD does not finish — on an error, and
/// also when the shim gives up and the request is dropped mid-way. The attachment's lock goes
/// with the rollback, so a retried ADD starts only once it is done.
///
/// This is the in-process rollback. It does not run when the binder dies mid-ADD (a crash,
/// `kill -9`, or a panic in a release build, whose profile aborts): then the record, written
/// in state [`State::Adding`] before anything was made, is rolled back at the next start
/// ([`CniService::recover`]).
struct AddGuard {
    svc: Option<CniService>,
    att: Attachment,
    netns: PathBuf,
    driver: BindingDriver,
    /// Set once plugging succeeded: only then is there an interface of ours to remove (a failed
    /// plug has undone itself, and the pod's `ifname` may belong to someone else).
    plugged: bool,
    reported: bool,
    key: Option<KeyGuard>,
}

impl AddGuard {
    fn disarm(mut self) {
        self.svc = None;
    }
}

impl Drop for AddGuard {
    fn drop(&mut self) {
        let Some(svc) = self.svc.take() else { return };
        let (att, netns, driver, plugged, reported) =
            (self.att.clone(), self.netns.clone(), self.driver.clone(), self.plugged, self.reported);
        let key = self.key.take();
        tracing::info!(
            container = att.container_id,
            pod = format!("{}/{}", att.pod_namespace, att.pod_name),
            "rolling back a failed ADD"
        );
        // Drop cannot await: finish the rollback in a task of its own.
        tokio::spawn(async move {
            if plugged {
                svc.teardown(&att, Some(netns), driver, reported).await;
            } else if let Err(e) = svc.attachments.remove(&att.container_id, &att.ifname) {
                tracing::error!(container = att.container_id, error = %e, "cannot remove the attachment record");
            }
            drop(key);
        });
    }
}

impl CniService {
    /// Unplugs an attachment and forgets it; every step tolerates what is already gone.
    async fn teardown(&self, att: &Attachment, netns: Option<PathBuf>, driver: BindingDriver, report: bool) {
        self.teardown_timed(att, netns, driver, report, &mut Steps::start()).await;
    }

    /// [`CniService::teardown`], timing its steps into `steps`.
    async fn teardown_timed(
        &self,
        att: &Attachment,
        netns: Option<PathBuf>,
        driver: BindingDriver,
        report: bool,
        steps: &mut Steps,
    ) {
        let netns = netns.filter(|p| p.exists());
        if att.primary.is_none() {
            self.teardown_extras(att, netns.clone()).await;
        }
        if let Err(e) = plug::unplug(netns, &att.ifname, &att.host_ifname, &driver, self.ovs_db.as_deref()).await {
            tracing::warn!(container = att.container_id, error = %e, "unplug failed");
        }
        steps.mark("unplug");
        if report && !att.pod_uid.is_empty() && att.primary.is_none() {
            let req = ReportPluggedRequest {
                pod_uid: att.pod_uid.clone(),
                vif_id: att.vif_id.clone(),
                node_name: self.node.clone(),
                plugged: false,
                host_ifname: att.host_ifname.clone(),
            };
            let mut call = tonic::Request::new(req);
            call.set_timeout(UNPLUG_REPORT_TIMEOUT);
            let mut client = self.allocator.client();
            let sent = tokio::time::timeout(UNPLUG_REPORT_TIMEOUT, client.report_plugged(call)).await;
            if let Err(e) = sent.unwrap_or_else(|_| Err(Status::deadline_exceeded("no answer"))) {
                // The allocator learns of the pod's deletion from Kubernetes anyway; the report only
                // speeds it up, so it is not worth failing (or holding up) DEL over.
                tracing::debug!(pod_uid = att.pod_uid, code = ?e.code(), "unplugged report not delivered");
            }
            steps.mark("report");
        }
        if let Err(e) = self.hostports.remove(&att.container_id, &att.ifname).await {
            // The record goes anyway: the next change rebuilds the host ports from the records
            // still wanted, without this one.
            tracing::warn!(container = att.container_id, error = %e, "removing host ports failed");
        }
        steps.mark("hostports");
        if let Err(e) = self.attachments.remove(&att.container_id, &att.ifname) {
            tracing::error!(container = att.container_id, error = %e, "cannot remove the attachment record");
        }
        steps.mark("record");
    }

    pub async fn add(&self, r: &pb::CniRequest) -> CniResult<pb::CniResult> {
        let start = Instant::now();
        let mut steps = Steps::start();
        let container_id = required("CNI_CONTAINERID", &r.container_id)?;
        let netns = required("CNI_NETNS", &r.netns)?;
        let ifname = required("CNI_IFNAME", &r.ifname)?;
        let conf = parse_conf(&r.config)?;
        let port_mappings = crate::hostport::mapping::from_runtime_config(conf.runtime_config.as_ref())
            .map_err(|e| CniError::new(code::INVALID_CONFIG, e))?;
        let args = kuryr_cni_types::CniArgs::parse(&r.cni_args)?;
        let netns = PathBuf::from(netns);
        pod_netns(&netns)?;
        let pod_uid = args.pod_uid().map(str::to_string).ok_or_else(|| {
            CniError::new(code::INVALID_ENVIRONMENT, "CNI_ARGS lacks K8S_POD_UID: kuryr matches pods to VIFs by UID")
        })?;
        let pod = format!("{}/{}", args.pod_namespace().unwrap_or("?"), args.pod_name().unwrap_or("?"));
        // A deadline past what the clock can hold is no deadline.
        let deadline = start.checked_add(self.vif_wait).unwrap_or(start + Duration::from_secs(86_400 * 365));
        steps.mark("checks");

        let key = self.locks.lock(container_id, ifname).await;
        steps.mark("lock");
        if let Some(existing) = self.attachments.get(container_id, ifname) {
            match existing.state {
                // The runtime retrying an ADD that succeeded: the same answer, the record untouched.
                State::Ready => return self.repeat_add(&existing, &pod_uid, &netns, ifname),
                // An earlier ADD whose rollback did not finish (it failed): finish it first.
                State::Adding => {
                    let old = PathBuf::from(&existing.netns);
                    self.teardown(&existing, Some(old), driver_of_record(&existing), true).await;
                }
            }
        }
        let mut att = Attachment {
            container_id: container_id.to_string(),
            ifname: ifname.to_string(),
            netns: netns.display().to_string(),
            host_ifname: plug::host_ifname(container_id, ifname),
            pod_uid: pod_uid.clone(),
            pod_namespace: args.pod_namespace().unwrap_or_default().to_string(),
            pod_name: args.pod_name().unwrap_or_default().to_string(),
            vif_id: String::new(),
            driver: "bridge".into(),
            bridge: String::new(),
            ips: Vec::new(),
            port_mappings,
            state: State::Adding,
            host_mac: String::new(),
            sandbox_mac: String::new(),
            primary: None,
            report_pending: false,
        };
        // Claim the pod before anything else, in one step with the check, so that two ADDs can
        // never both take one pod's VIF: a pod attached under another container whose sandbox
        // still exists is refused; one whose sandbox is gone is stale and cleaned up.
        let stale = match self.attachments.claim(&att, netns_alive) {
            Ok(stale) => stale,
            Err(live) => {
                return Err(CniError::new(
                    code::INVALID_ENVIRONMENT,
                    format!(
                        "pod {pod} ({pod_uid}) is already attached as container {} interface {} in {}; \
                         DEL that attachment first",
                        live.container_id, live.ifname, live.netns
                    ),
                ));
            }
        };
        let mut guard = AddGuard {
            svc: Some(self.clone()),
            att: att.clone(),
            netns: netns.clone(),
            driver: BindingDriver::Bridge { bridge: String::new() },
            plugged: false,
            reported: false,
            key: Some(key),
        };
        steps.mark("claim");
        for old in stale {
            tracing::info!(container = old.container_id, pod, "removing the attachment of a sandbox that is gone");
            let _old_key = self.locks.lock(&old.container_id, &old.ifname).await;
            self.teardown(&old, None, driver_of_record(&old), true).await;
        }

        steps.skip();
        let waiting = self.metrics.waiting("vif");
        let found = self.vifs.wait_for(&pod_uid, self.vif_wait, |v| vifs::pluggable(v) || vifs::failed(v)).await;
        drop(waiting);
        let vif = match found {
            Wait::Vif(v) if vifs::failed(&v) => {
                return Err(CniError::new(
                    code::TRY_AGAIN_LATER,
                    format!("the allocator cannot give pod {pod} ({pod_uid}) its interfaces: {}", v.message),
                ));
            }
            Wait::Vif(v) => v,
            Wait::Gone => {
                return Err(CniError::new(code::UNKNOWN_CONTAINER, format!("pod {pod} ({pod_uid}) no longer exists")));
            }
            Wait::TimedOut(_) => {
                return Err(CniError::new(
                    code::TRY_AGAIN_LATER,
                    format!("no VIF for pod {pod} ({pod_uid}) within {:?}", self.vif_wait),
                ));
            }
        };
        let vif_known = start.elapsed();
        steps.mark("vif_lookup");
        let driver = driver_of(&vif, &pod_uid, &self.nested)?;
        let spec = PlugSpec::from_vif(container_id, &netns, ifname, &vif, driver.clone())
            .map_err(|e| CniError::new(code::IO, format!("the VIF of pod {pod} is unusable: {e}")))?;
        att.host_ifname.clone_from(&spec.host_ifname);
        att.vif_id.clone_from(&vif.vif_id);
        att.driver = match driver {
            BindingDriver::Bridge { .. } => "bridge",
            BindingDriver::Ovs { .. } => "ovs",
            BindingDriver::Vlan { .. } => "vlan",
        }
        .into();
        att.bridge = match &driver {
            BindingDriver::Bridge { bridge } | BindingDriver::Ovs { bridge, .. } => bridge.clone(),
            BindingDriver::Vlan { uplink, .. } => uplink.clone(),
        };
        att.ips = spec.ips.iter().map(|ip| ip.address.addr()).collect();
        // Recorded before plugging: a crash from here on leaves a record that the next start
        // (or DEL, or GC) acts on.
        self.attachments
            .put(&att)
            .map_err(|e| CniError::new(code::IO, format!("cannot record the attachment: {e}")))?;
        guard.att = att.clone();
        guard.driver = driver.clone();
        steps.mark("record");

        let t_plug = Instant::now();
        let bridge_key = match &driver {
            BindingDriver::Bridge { bridge } => Some((bridge.clone(), spec.gateway_addresses())),
            BindingDriver::Ovs { .. } | BindingDriver::Vlan { .. } => None,
        };
        if let Some(key) = &bridge_key
            && !self.bridges_ready.lock().unwrap_or_else(PoisonError::into_inner).contains(key)
        {
            plug::ensure_bridge(&key.0, &key.1).await.map_err(|e| plug_failure(e, "preparing the node bridge"))?;
            self.bridges_ready.lock().unwrap_or_else(PoisonError::into_inner).insert(key.clone());
            steps.mark("bridge");
        }
        let plugged = match plug::plug_timed(&spec, self.ovs_db.as_deref()).await {
            Ok((p, plug_steps)) => {
                steps.extend(&plug_steps);
                steps.skip();
                p
            }
            Err(e) => {
                // The bridge may be what is wrong (deleted behind our back): check it next time.
                if let Some(key) = &bridge_key {
                    self.bridges_ready.lock().unwrap_or_else(PoisonError::into_inner).remove(key);
                }
                return Err(plug_failure(e, "plugging"));
            }
        };
        let plug_took = t_plug.elapsed();
        guard.plugged = true;
        // The pod's host ports (and its bridge among the pods' interfaces) before ADD returns:
        // the runtime reports the pod running right after.
        if let Err(e) = self.hostports.set(&att).await {
            if !att.port_mappings.is_empty() {
                return Err(CniError::new(code::IO, format!("programming the host ports of pod {pod}: {e}")));
            }
            tracing::warn!(pod, error = %e, "cannot add the pod's bridge to the table's pod interfaces");
        }
        steps.mark("hostports");
        let mut extras = self.plug_extras(&att, &vif, &netns).await?;
        if !extras.is_empty() {
            steps.mark("extras");
        }
        // A VIF the backend makes READY once plugged (the embedded IPAM's) has nothing to wait
        // for: ADD answers now and the report follows in the background (report.rs).
        let t_ready;
        let vif = if vif.ready_when_plugged {
            att.report_pending = true;
            t_ready = Instant::now();
            vif
        } else {
            guard.reported = true;
            let reported = self.report_plugged(&att, deadline).await?;
            steps.mark("report");
            t_ready = Instant::now();
            let remaining = deadline.saturating_duration_since(t_ready);
            // The allocator's answer carries the VIF after the report: when it is ready already,
            // there is nothing to wait for on the stream.
            let ready_now = reported.filter(|v| v.vif_id == vif.vif_id && vifs::ready(v));
            let wait = match ready_now {
                Some(v) => Wait::Vif(Box::new(v)),
                None => {
                    let _waiting = self.metrics.waiting("ready");
                    self.vifs.wait_for(&pod_uid, remaining, vifs::ready).await
                }
            };
            match wait {
                Wait::Vif(v) => v,
                Wait::Gone => {
                    return Err(CniError::new(
                        code::UNKNOWN_CONTAINER,
                        format!("pod {pod} ({pod_uid}) no longer exists"),
                    ));
                }
                Wait::TimedOut(v) => {
                    let state = v.map(|v| v.state().as_str_name().to_string()).unwrap_or_else(|| "gone".into());
                    return Err(CniError::new(
                        code::TRY_AGAIN_LATER,
                        format!("the VIF of pod {pod} did not become ready within {:?} (state {state})", self.vif_wait),
                    ));
                }
            }
        };
        att.state = State::Ready;
        att.host_mac.clone_from(&plugged.host_mac);
        att.sandbox_mac.clone_from(&plugged.sandbox_mac);
        let ready_wait = t_ready.elapsed();
        steps.mark("ready_wait");
        self.extras_ready(&mut extras)?;
        self.attachments
            .put(&att)
            .map_err(|e| CniError::new(code::IO, format!("cannot record the attachment: {e}")))?;
        guard.disarm();
        steps.mark("record_ready");
        if att.report_pending {
            self.report_in_background(container_id, ifname);
        }
        self.metrics.observe_vif_wait(vif_known);
        self.metrics.observe_ready_wait(ready_wait);
        self.metrics.observe_steps("ADD", &steps);
        tracing::info!(
            pod,
            container = container_id,
            took_ms = start.elapsed().as_secs_f64() * 1e3,
            vif_wait_ms = vif_known.as_secs_f64() * 1e3,
            plug_ms = plug_took.as_secs_f64() * 1e3,
            ready_wait_ms = ready_wait.as_secs_f64() * 1e3,
            steps = steps.render(),
            "ADD done"
        );
        let mut result = result_for(&vif, ifname, &netns, &plugged);
        extra::append_results(&mut result, &extras);
        Ok(result)
    }

    /// An ADD of an attachment that is live: the runtime retrying one that succeeded (as the
    /// spec allows). The answer is what the first ADD answered; the record is never touched.
    /// The same container and interface for another pod or namespace is refused (code 4).
    fn repeat_add(&self, att: &Attachment, pod_uid: &str, netns: &Path, ifname: &str) -> CniResult<pb::CniResult> {
        if att.pod_uid != pod_uid || Path::new(&att.netns) != netns {
            return Err(CniError::new(
                code::INVALID_ENVIRONMENT,
                format!(
                    "container {} interface {ifname} is already attached to pod {}/{} ({}) in {}; DEL it first",
                    att.container_id, att.pod_namespace, att.pod_name, att.pod_uid, att.netns
                ),
            ));
        }
        let vif = self.vifs.get(pod_uid).ok_or_else(|| {
            CniError::new(
                code::UNKNOWN_CONTAINER,
                format!("pod {}/{} ({pod_uid}) no longer has a VIF", att.pod_namespace, att.pod_name),
            )
        })?;
        if vif.vif_id != att.vif_id {
            return Err(CniError::new(
                code::INVALID_ENVIRONMENT,
                format!(
                    "pod {}/{} has another VIF ({}) than the one attached ({}); DEL and ADD again",
                    att.pod_namespace, att.pod_name, vif.vif_id, att.vif_id
                ),
            ));
        }
        let plugged = plug::Plugged {
            host_ifname: att.host_ifname.clone(),
            host_mac: att.host_mac.clone(),
            sandbox_ifname: ifname.to_string(),
            sandbox_mac: if att.sandbox_mac.is_empty() { vif.mac.clone() } else { att.sandbox_mac.clone() },
            sandbox: netns.to_path_buf(),
            mtu: vif.mtu,
        };
        tracing::info!(container = att.container_id, ifname, "repeated ADD: answered from the live attachment");
        let mut result = result_for(&vif, ifname, netns, &plugged);
        extra::append_results(&mut result, &self.live_extras(att, &vif, netns));
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shim_of_another_version_is_refused_with_code_1() {
        let s = check_shim_version("0.0.0-x").unwrap_err();
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        let e = CniError::from_status(&s).unwrap();
        assert_eq!(e.code, code::INCOMPATIBLE_VERSION);
        assert!(e.msg.contains("incompatible"), "{}", e.msg);
        assert!(!e.msg.contains(crate::VERSION) && !e.msg.contains("0.0.0-x"), "{}", e.msg);
        assert!(check_shim_version(crate::VERSION).is_ok());
    }
}
