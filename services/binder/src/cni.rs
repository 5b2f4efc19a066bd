//! The CNI operations, served to the `kuryr-cni` shim over `kuryr.binder.v1.Cni`.
//!
//! Every failure is a gRPC status whose details carry a `CniError` with the CNI code the shim
//! prints, so codes are decided here, where the cause is known, not guessed from status codes.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kuryr_proto::allocator::v1::{BindingDriver as ProtoDriver, ReportPluggedRequest, Vif};
use kuryr_proto::binder::v1 as pb;
use tonic::{Request, Response, Status};

use ipnet::IpNet;
use kuryr_cni_types::{CniError, code};

use crate::attachments::{Attachment, Attachments};
use crate::metrics::CniMetrics;
use crate::plug::{self, BindingDriver, PlugError, PlugSpec};
use crate::vifs::{self, VifCache, Wait};

/// How long DEL waits for the allocator to take its unplugged report.
const UNPLUG_REPORT_TIMEOUT: Duration = Duration::from_secs(2);

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
    pub metrics: CniMetrics,
    /// Bridges already made ready with these gateway addresses, so that ADD does not redo it
    /// (a netlink round on a thread of its own) for every pod.
    pub bridges_ready: Arc<Mutex<HashSet<BridgeKey>>>,
}

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

fn plug_failure(e: PlugError, what: &str) -> CniError {
    match &e {
        PlugError::NetnsMissing { .. } | PlugError::IfnameExists { .. } => {
            CniError::new(code::INVALID_ENVIRONMENT, format!("{what}: {e}"))
        }
        _ => CniError::new(code::IO, format!("{what}: {e}")).with_details(format!("{e:?}")),
    }
}

/// The binding driver of a VIF.
fn driver_of(vif: &Vif, pod_uid: &str) -> CniResult<BindingDriver> {
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
        }),
    }
}

/// Records what ADD has done so far and undoes it if ADD does not finish — on an error, and
/// also when the shim gives up and the request is dropped mid-way.
struct AddGuard {
    svc: Option<CniService>,
    att: Attachment,
    netns: PathBuf,
    driver: BindingDriver,
    /// Set once plugging succeeded: only then is there an interface of ours to remove (a failed
    /// plug has undone itself, and the pod's `ifname` may belong to someone else).
    plugged: bool,
    reported: bool,
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
        });
    }
}

impl CniService {
    /// Unplugs an attachment and forgets it; every step tolerates what is already gone.
    async fn teardown(&self, att: &Attachment, netns: Option<PathBuf>, driver: BindingDriver, report: bool) {
        let netns = netns.filter(|p| p.exists());
        if let Err(e) = plug::unplug(netns, &att.ifname, &att.host_ifname, &driver, self.ovs_db.as_deref()).await {
            tracing::warn!(container = att.container_id, error = %e, "unplug failed");
        }
        if report && !att.pod_uid.is_empty() {
            let req = ReportPluggedRequest {
                pod_uid: att.pod_uid.clone(),
                vif_id: att.vif_id.clone(),
                node_name: self.node.clone(),
                plugged: false,
                host_ifname: att.host_ifname.clone(),
            };
            // The allocator learns of the pod's deletion from Kubernetes anyway; the report only
            // speeds it up, so it is not worth failing DEL over, nor holding it up: a stopped or
            // partitioned allocator gets UNPLUG_REPORT_TIMEOUT.
            let mut client = self.allocator.client();
            match tokio::time::timeout(UNPLUG_REPORT_TIMEOUT, client.report_plugged(req)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::debug!(pod_uid = att.pod_uid, code = ?e.code(), "unplugged report not delivered")
                }
                Err(_) => tracing::debug!(pod_uid = att.pod_uid, "unplugged report not answered in time"),
            }
        }
        if let Err(e) = self.hostports.remove(&att.container_id, &att.ifname).await {
            // The record goes anyway: the next change rebuilds the host ports from the records
            // still wanted, without this one.
            tracing::warn!(container = att.container_id, error = %e, "removing host ports failed");
        }
        if let Err(e) = self.attachments.remove(&att.container_id, &att.ifname) {
            tracing::error!(container = att.container_id, error = %e, "cannot remove the attachment record");
        }
    }

    async fn report_plugged(&self, att: &Attachment, deadline: Instant) -> CniResult<()> {
        let req = ReportPluggedRequest {
            pod_uid: att.pod_uid.clone(),
            vif_id: att.vif_id.clone(),
            node_name: self.node.clone(),
            plugged: true,
            host_ifname: att.host_ifname.clone(),
        };
        let mut delay = Duration::from_millis(50);
        loop {
            match self.allocator.client().report_plugged(req.clone()).await {
                Ok(_) => return Ok(()),
                Err(s) if s.code() == tonic::Code::NotFound => {
                    return Err(CniError::new(
                        code::UNKNOWN_CONTAINER,
                        format!("the allocator no longer has a VIF for pod {}/{}", att.pod_namespace, att.pod_name),
                    ));
                }
                Err(s)
                    if Instant::now() + delay < deadline
                        && matches!(
                            s.code(),
                            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Aborted
                        ) =>
                {
                    tracing::warn!(pod_uid = att.pod_uid, code = ?s.code(), error = s.message(), "plugged report failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(1));
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

    pub async fn add(&self, r: &pb::CniRequest) -> CniResult<pb::CniResult> {
        let start = Instant::now();
        let container_id = required("CNI_CONTAINERID", &r.container_id)?;
        let netns = required("CNI_NETNS", &r.netns)?;
        let ifname = required("CNI_IFNAME", &r.ifname)?;
        let conf = parse_conf(&r.config)?;
        let port_mappings = crate::hostport::mapping::from_runtime_config(conf.runtime_config.as_ref())
            .map_err(|e| CniError::new(code::INVALID_CONFIG, e))?;
        let args = kuryr_cni_types::CniArgs::parse(&r.cni_args)?;
        let netns = PathBuf::from(netns);
        if !netns.exists() {
            return Err(CniError::new(
                code::INVALID_ENVIRONMENT,
                format!("CNI_NETNS {} does not exist", netns.display()),
            ));
        }
        let pod_uid = args.pod_uid().map(str::to_string).ok_or_else(|| {
            CniError::new(code::INVALID_ENVIRONMENT, "CNI_ARGS lacks K8S_POD_UID: kuryr matches pods to VIFs by UID")
        })?;
        let pod = format!("{}/{}", args.pod_namespace().unwrap_or("?"), args.pod_name().unwrap_or("?"));
        let deadline = start + self.vif_wait;

        let vif = match self.vifs.wait_for(&pod_uid, self.vif_wait, vifs::pluggable).await {
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
        let driver = driver_of(&vif, &pod_uid)?;
        let spec = PlugSpec::from_vif(container_id, &netns, ifname, &vif, driver.clone())
            .map_err(|e| CniError::new(code::IO, format!("the VIF of pod {pod} is unusable: {e}")))?;
        let att = Attachment {
            container_id: container_id.to_string(),
            ifname: ifname.to_string(),
            netns: netns.display().to_string(),
            host_ifname: spec.host_ifname.clone(),
            pod_uid: pod_uid.clone(),
            pod_namespace: args.pod_namespace().unwrap_or_default().to_string(),
            pod_name: args.pod_name().unwrap_or_default().to_string(),
            vif_id: vif.vif_id.clone(),
            driver: match driver {
                BindingDriver::Bridge { .. } => "bridge",
                BindingDriver::Ovs { .. } => "ovs",
            }
            .into(),
            bridge: match &driver {
                BindingDriver::Bridge { bridge } | BindingDriver::Ovs { bridge, .. } => bridge.clone(),
            },
            ips: spec.ips.iter().map(|ip| ip.address.addr()).collect(),
            port_mappings,
        };
        // Record first: a crash from here on leaves a record that DEL or GC can act on.
        self.attachments
            .put(&att)
            .map_err(|e| CniError::new(code::IO, format!("cannot record the attachment: {e}")))?;
        let mut guard = AddGuard {
            svc: Some(self.clone()),
            att: att.clone(),
            netns: netns.clone(),
            driver: driver.clone(),
            plugged: false,
            reported: false,
        };

        let t_plug = Instant::now();
        let bridge_key = match &driver {
            BindingDriver::Bridge { bridge } => Some((bridge.clone(), spec.gateway_addresses())),
            BindingDriver::Ovs { .. } => None,
        };
        if let Some(key) = &bridge_key
            && !self.bridges_ready.lock().unwrap_or_else(PoisonError::into_inner).contains(key)
        {
            plug::ensure_bridge(&key.0, &key.1).await.map_err(|e| plug_failure(e, "preparing the node bridge"))?;
            self.bridges_ready.lock().unwrap_or_else(PoisonError::into_inner).insert(key.clone());
        }
        let plugged = match plug::plug(&spec, self.ovs_db.as_deref()).await {
            Ok(p) => p,
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
        guard.reported = true;
        self.report_plugged(&att, deadline).await?;
        let t_ready = Instant::now();
        let remaining = deadline.saturating_duration_since(t_ready);
        let vif = match self.vifs.wait_for(&pod_uid, remaining, vifs::ready).await {
            Wait::Vif(v) => v,
            Wait::Gone => {
                return Err(CniError::new(code::UNKNOWN_CONTAINER, format!("pod {pod} ({pod_uid}) no longer exists")));
            }
            Wait::TimedOut(v) => {
                let state = v.map(|v| v.state().as_str_name().to_string()).unwrap_or_else(|| "gone".into());
                return Err(CniError::new(
                    code::TRY_AGAIN_LATER,
                    format!("the VIF of pod {pod} did not become ready within {:?} (state {state})", self.vif_wait),
                ));
            }
        };
        guard.disarm();
        self.metrics.observe_vif_wait(vif_known);
        let ready_wait = t_ready.elapsed();
        self.metrics.observe_ready_wait(ready_wait);
        tracing::info!(
            pod,
            container = container_id,
            took_ms = start.elapsed().as_secs_f64() * 1e3,
            vif_wait_ms = vif_known.as_secs_f64() * 1e3,
            plug_ms = plug_took.as_secs_f64() * 1e3,
            ready_wait_ms = ready_wait.as_secs_f64() * 1e3,
            "ADD done"
        );
        Ok(result_for(&vif, ifname, &netns, &plugged))
    }

    pub async fn del(&self, r: &pb::CniRequest) -> CniResult<()> {
        let container_id = required("CNI_CONTAINERID", &r.container_id)?;
        let ifname = required("CNI_IFNAME", &r.ifname)?;
        parse_conf(&r.config)?;
        let netns = netns_path(&r.netns);
        match self.attachments.get(container_id, ifname) {
            Some(att) => {
                let driver = match att.driver.as_str() {
                    "ovs" => BindingDriver::Ovs {
                        bridge: att.bridge.clone(),
                        iface_id: att.vif_id.clone(),
                        attached_mac: String::new(),
                        vm_uuid: att.pod_uid.clone(),
                    },
                    _ => BindingDriver::Bridge { bridge: att.bridge.clone() },
                };
                self.teardown(&att, netns, driver, true).await;
            }
            None => {
                // Never seen (or already deleted): still remove whatever a lost record may have left.
                let host_ifname = plug::host_ifname(container_id, ifname);
                let driver = BindingDriver::Bridge { bridge: String::new() };
                if let Err(e) =
                    plug::unplug(netns.filter(|p| p.exists()), ifname, &host_ifname, &driver, self.ovs_db.as_deref())
                        .await
                {
                    tracing::debug!(container = container_id, error = %e, "nothing to unplug");
                }
            }
        }
        Ok(())
    }

    pub async fn check(&self, r: &pb::CniRequest) -> CniResult<()> {
        let container_id = required("CNI_CONTAINERID", &r.container_id)?;
        let netns = required("CNI_NETNS", &r.netns)?;
        let ifname = required("CNI_IFNAME", &r.ifname)?;
        let conf = parse_conf(&r.config)?;
        let prev = conf.prev_result.as_ref().ok_or_else(|| {
            CniError::new(code::INVALID_CONFIG, "CHECK needs prevResult in the network configuration")
        })?;
        let att = self.attachments.get(container_id, ifname).ok_or_else(|| {
            CniError::new(
                code::UNKNOWN_CONTAINER,
                format!("no attachment of container {container_id} interface {ifname}"),
            )
        })?;
        let vif = self.vifs.get(&att.pod_uid).ok_or_else(|| {
            CniError::new(
                code::UNKNOWN_CONTAINER,
                format!("pod {}/{} has no VIF any more", att.pod_namespace, att.pod_name),
            )
        })?;
        let netns = PathBuf::from(netns);
        let driver = driver_of(&vif, &att.pod_uid)?;
        let spec = PlugSpec::from_vif(container_id, &netns, ifname, &vif, driver)
            .map_err(|e| CniError::new(code::IO, format!("the VIF is unusable: {e}")))?;
        let observed =
            plug::inspect(netns.clone(), ifname.to_string()).await.map_err(|e| plug_failure(e, "inspecting"))?;
        let mut diffs = plug::diff(&spec, &observed);
        diffs.extend(prev_result_diffs(prev, ifname, &observed));
        if !diffs.is_empty() {
            return Err(CniError::new(
                ATTACHMENT_DIFFERS,
                format!("{ifname} in {}: {}", netns.display(), diffs.join("; ")),
            ));
        }
        Ok(())
    }

    pub fn status(&self) -> CniResult<()> {
        if !self.vifs.is_live() {
            return Err(CniError::new(code::NOT_AVAILABLE, "the VIF stream from kuryr-vif-allocator is not live"));
        }
        Ok(())
    }

    pub async fn gc(&self, r: &pb::GcRequest) -> CniResult<Vec<pb::Attachment>> {
        let conf = parse_conf(&r.config)?;
        let valid = conf.valid_attachments.as_ref().ok_or_else(|| {
            CniError::new(code::INVALID_CONFIG, "GC needs cni.dev/valid-attachments in the network configuration")
        })?;
        let keep = |c: &str, i: &str| valid.iter().any(|v| v.container_id == c && v.ifname == i);
        let mut removed = Vec::new();
        let mut known_hosts = Vec::new();
        for att in self.attachments.all() {
            if keep(&att.container_id, &att.ifname) {
                known_hosts.push(att.host_ifname.clone());
                continue;
            }
            let driver = match att.driver.as_str() {
                "ovs" => BindingDriver::Ovs {
                    bridge: att.bridge.clone(),
                    iface_id: att.vif_id.clone(),
                    attached_mac: String::new(),
                    vm_uuid: att.pod_uid.clone(),
                },
                _ => BindingDriver::Bridge { bridge: att.bridge.clone() },
            };
            self.teardown(&att, netns_path(&att.netns), driver, true).await;
            removed.push(pb::Attachment { container_id: att.container_id, ifname: att.ifname });
        }
        // Host ends with no record at all (a record lost with a crashed disk, say).
        let valid_hosts: Vec<String> = valid.iter().map(|v| plug::host_ifname(&v.container_id, &v.ifname)).collect();
        let links =
            plug::list_host_links(plug::HOST_IFNAME_PREFIX).await.map_err(|e| plug_failure(e, "listing host links"))?;
        for l in links {
            if !known_hosts.contains(&l) && !valid_hosts.contains(&l) {
                let driver = BindingDriver::Bridge { bridge: String::new() };
                if let Err(e) = plug::unplug(None, "", &l, &driver, self.ovs_db.as_deref()).await {
                    tracing::warn!(link = l, error = %e, "cannot remove a leftover host link");
                } else {
                    tracing::info!(link = l, "removed a leftover host link");
                }
            }
        }
        Ok(removed)
    }
}

/// Differences between the prevResult the runtime cached and what the pod has.
fn prev_result_diffs(prev: &kuryr_cni_types::CniResult, ifname: &str, observed: &plug::Observed) -> Vec<String> {
    let mut diffs = Vec::new();
    for i in prev.interfaces.iter().filter(|i| i.sandbox.as_deref().is_some_and(|s| !s.is_empty()) && i.name == ifname)
    {
        if let Some(mac) = &i.mac
            && !mac.eq_ignore_ascii_case(&observed.mac)
        {
            diffs.push(format!("prevResult MAC {mac} but the interface has {}", observed.mac));
        }
    }
    for ip in &prev.ips {
        if !observed.addresses.iter().any(|a| a.to_string() == ip.address) {
            diffs.push(format!("prevResult address {} is missing", ip.address));
        }
    }
    diffs
}

/// The CNI result of an ADD: the host end, the pod end, addresses and routes.
fn result_for(vif: &Vif, ifname: &str, netns: &Path, plugged: &plug::Plugged) -> pb::CniResult {
    let interfaces = vec![
        pb::Interface {
            name: plugged.host_ifname.clone(),
            mac: plugged.host_mac.clone(),
            mtu: vif.mtu,
            sandbox: String::new(),
        },
        pb::Interface {
            name: ifname.to_string(),
            mac: plugged.sandbox_mac.clone(),
            mtu: vif.mtu,
            sandbox: netns.display().to_string(),
        },
    ];
    let ips = vif
        .ips
        .iter()
        .map(|ip| pb::IpConfig { address: ip.address.clone(), gateway: ip.gateway.clone(), interface: Some(1) })
        .collect();
    let mut routes = Vec::new();
    for ip in &vif.ips {
        if !ip.gateway.is_empty() {
            let dst = if ip.gateway.contains(':') { "::/0" } else { "0.0.0.0/0" };
            routes.push(pb::Route { dst: dst.into(), gw: ip.gateway.clone() });
        }
    }
    routes.extend(vif.routes.iter().map(|r| pb::Route { dst: r.destination.clone(), gw: r.gateway.clone() }));
    let dns = vif.dns.as_ref().map(|d| pb::Dns {
        nameservers: d.nameservers.clone(),
        domain: d.domain.clone(),
        search: d.search.clone(),
        options: d.options.clone(),
    });
    pb::CniResult { interfaces, ips, routes, dns }
}

/// Refuses a shim of another version, so that a half-upgraded node fails loudly.
pub fn check_shim_version(v: &str) -> Result<(), Status> {
    if v != crate::VERSION {
        let msg = format!(
            "kuryr-cni {v} does not match kuryr-binder {}: install the kuryr-cni shipped with this binder",
            crate::VERSION
        );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shim_of_another_version_is_refused_with_code_1() {
        let s = check_shim_version("0.0.0-x").unwrap_err();
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        assert_eq!(CniError::from_status(&s).unwrap().code, code::INCOMPATIBLE_VERSION);
        assert!(check_shim_version(crate::VERSION).is_ok());
    }
}
