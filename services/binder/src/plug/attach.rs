//! Plugging and unplugging a veth pair, with a rollback guard for failures part-way.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use kuryr_runtime::telemetry::error_chain;
use nix::errno::Errno;
use rtnetlink::packet_route::link::{InfoData, InfoKind, InfoVeth, LinkMessage};
use rtnetlink::{LinkBridge, LinkMessageBuilder, LinkUnspec, LinkVeth};
use tokio::sync::oneshot;

use super::nl::{self, Nl, in_netns};
use super::{BindingDriver, PlugError, PlugSpec, Plugged, format_mac, ovs};
use crate::metrics::Steps;

/// Plugs one pod interface (see the module documentation of [`crate::plug`]); returns what it
/// made.
///
/// Steps: create the veth pair with the pod end born inside the pod's namespace, already named
/// `ifname` and carrying the MAC and MTU, so no other namespace ever sees it, and the host end
/// born up and (for a Linux bridge) already enslaved; only if the kernel refuses a name, find
/// out which — `ifname` taken in the pod (→ [`PlugError::IfnameExists`]), or a stale host end of
/// the same name (an interrupted earlier ADD of this attachment), removed before trying again;
/// put a bridge port in hairpin mode; in the pod turn IPv6 DAD off for `ifname`, bring `lo` and
/// `ifname` up, add the addresses (IPv6 without DAD), the routes and the default routes; for OVS
/// finally add the host end as a port.
///
/// The work runs on one namespace worker (`crate::netns`) with one netlink socket in each
/// namespace: the worker's own in the host's, kept between jobs, and one opened in the pod's for
/// this job. Whatever it created is undone if any step fails, or if the caller stopped waiting
/// before the result could be handed over; also if the job panics in a build that unwinds
/// (tests). Release builds abort on panic (`panic = "abort"`): there the binder's next start
/// rolls the ADD back from its attachment record, written before this runs
/// (`crate::cni::CniService::recover`).
pub async fn plug(spec: &PlugSpec, ovs_db: Option<&str>) -> Result<Plugged, PlugError> {
    Ok(plug_timed(spec, ovs_db).await?.0)
}

/// [`plug`], also returning the time of each step (the worker's own, and `dispatch`: handing
/// the job to the worker and the answer back).
pub async fn plug_timed(spec: &PlugSpec, ovs_db: Option<&str>) -> Result<(Plugged, Steps), PlugError> {
    let mac = spec.validate()?;
    let (spec, ovs_db) = (spec.clone(), ovs_db.map(str::to_string));
    let started = Instant::now();
    let (tx, rx) = oneshot::channel();
    crate::netns::submit(move || {
        let mut steps = Steps::start();
        let mut undo = Rollback::default();
        match nl::block_on(plug_steps(&spec, mac, ovs_db.as_deref(), &mut undo, &mut steps)) {
            Ok(plugged) => match tx.send(Ok((plugged, steps))) {
                Ok(()) => undo.disarm(),
                Err(_) => tracing::warn!(
                    container_id = %spec.container_id,
                    ifname = %spec.ifname,
                    "caller gone before the plug result was delivered; rolling back"
                ),
            },
            Err(e) => {
                // Undo first, so that the caller sees the error only once nothing is left.
                drop(undo);
                let _ = tx.send(Err(e));
            }
        }
    })?;
    let (plugged, mut steps) = rx.await.map_err(|_| PlugError::ThreadDied)??;
    // What the worker did not measure: handing the job over and the answer back.
    let on_worker: Duration = steps.iter().map(|(_, d)| d).sum();
    steps.add("dispatch", started.elapsed().saturating_sub(on_worker));
    Ok((plugged, steps))
}

async fn plug_steps(
    spec: &PlugSpec,
    mac: [u8; 6],
    ovs_db: Option<&str>,
    undo: &mut Rollback,
    steps: &mut Steps,
) -> Result<Plugged, PlugError> {
    // Held open until the pod's socket is open and the veth created: the kernel moves the peer
    // through this descriptor, and the worker visits the namespace through it.
    let netns_file = crate::netns::open(&spec.netns)?;
    // Checked on the descriptor that is used below, so the path cannot be swapped in between.
    crate::netns::check_pod_file(&netns_file, &spec.netns)?;
    steps.mark("netns_check");
    // A netlink socket stays in the namespace it was opened in: the worker visits the pod's only
    // to open one there, and otherwise stays in the host's, so that ovs-vsctl and the rollback
    // run there.
    let (conn, pod) = Nl::open_in(&netns_file, &spec.netns)?;
    let host = nl::host()?;
    steps.mark("netns_entry");
    nl::scoped(conn, plug_with(spec, mac, ovs_db, undo, steps, &netns_file, &pod, &host)).await
}

#[allow(clippy::too_many_arguments)]
async fn plug_with(
    spec: &PlugSpec,
    mac: [u8; 6],
    ovs_db: Option<&str>,
    undo: &mut Rollback,
    steps: &mut Steps,
    netns_file: &File,
    pod: &Nl,
    host: &Nl,
) -> Result<Plugged, PlugError> {
    let (ifname, host_ifname) = (spec.ifname.as_str(), spec.host_ifname.as_str());
    let controller = match &spec.driver {
        BindingDriver::Bridge { bridge } => Some(bridge_index(host, bridge).await?),
        BindingDriver::Ovs { .. } => None,
        BindingDriver::Vlan { uplink, vlan } => {
            // No veth: the pod's interface is a VLAN device of the uplink, born in the pod.
            let (index, uplink_mac) =
                super::vlan::add_kernel_vlan(spec, mac, uplink, *vlan, netns_file, pod, host).await?;
            undo.pod_link = Some((spec.netns.clone(), ifname.to_string()));
            steps.mark("nl_vlan");
            configure_sandbox(pod, spec, mac, index, steps).await?;
            return Ok(Plugged {
                host_ifname: uplink.clone(),
                host_mac: uplink_mac,
                sandbox_ifname: ifname.to_string(),
                sandbox_mac: format_mac(&mac),
                sandbox: spec.netns.clone(),
                mtu: spec.mtu,
            });
        }
    };
    steps.mark("nl_bridge");

    let veth = || {
        let mut peer = LinkUnspec::new_with_name(ifname).address(mac.to_vec()).setns_by_fd(netns_file.as_raw_fd());
        // The host end is born down: it comes up below, with its port settings and without IPv6.
        let mut veth = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth).name(host_ifname);
        if spec.mtu > 0 {
            peer = peer.mtu(spec.mtu);
            veth = veth.mtu(spec.mtu);
        }
        if let Some(index) = controller {
            veth = veth.controller(index);
        }
        veth.set_info_data(InfoData::Veth(InfoVeth::Peer(peer.build()))).build()
    };
    let create =
        || host.fail(format!("create veth pair {host_ifname} <-> {ifname} (peer in {})", spec.netns.display()));
    let echoed = match host.add_link_echoed(veth()).await {
        Ok(echoed) => echoed,
        // A name is taken, in the pod or on the host: only now look at which.
        Err(e) if nl::errno(&e) == Some(Errno::EEXIST) => {
            if pod.link(ifname).await?.is_some() {
                return Err(PlugError::IfnameExists { netns: spec.netns.clone(), ifname: ifname.to_string() });
            }
            if host.delete(host_ifname).await? {
                tracing::warn!(host_ifname, container_id = %spec.container_id, "removed a stale host interface");
            }
            host.add_link_echoed(veth()).await.map_err(create())?
        }
        Err(e) => return Err(create()(e)),
    };
    undo.host_link = Some(host_ifname.to_string());
    steps.mark("nl_veth");

    // The host end as the kernel echoed it, read back only from a kernel that does not echo. It
    // names its peer's index; a lookup in the pod only when it does not (the two indexes are
    // equal, which the kernel does not report).
    let host_link = match echoed.filter(|l| nl::link_name(l) == Some(host_ifname)) {
        Some(link) => link,
        None => host.require(host_ifname).await?,
    };
    let index = match nl::link_peer(&host_link) {
        Some(i) => i,
        None => pod.require(ifname).await?.header.index,
    };
    steps.mark("nl_readback");
    // Up, as a bridge port in hairpin mode before the pod can send anything (a pod may reach
    // itself through a Service or its own host port, `crate::lb::hairpin`), and with no IPv6 of
    // its own: a port carries the pod's traffic and needs no address, and without a link-local
    // one the kernel has no duplicate address detection, router solicitations or MLD reports to
    // run for it.
    host.up_without_link_local(host_link.header.index, host_ifname, controller.is_some()).await?;
    steps.mark("nl_host_up");
    configure_sandbox(pod, spec, mac, index, steps).await?;

    if let BindingDriver::Ovs { bridge, iface_id, attached_mac, vm_uuid, vlan } = &spec.driver {
        // Armed before running: a timed-out ovs-vsctl may still have added the port.
        undo.ovs_port = Some((ovs_db.map(str::to_string), host_ifname.to_string()));
        let mut args = ovs::add_port(bridge, host_ifname, iface_id, attached_mac, vm_uuid);
        if let Some(tag) = vlan {
            args.extend(["--".into(), "set".into(), "Port".into(), host_ifname.into(), format!("tag={tag}")]);
        }
        ovs::vsctl(ovs_db, &args).await?;
        steps.mark("ovs");
    }

    Ok(Plugged {
        host_ifname: host_ifname.to_string(),
        host_mac: nl::link_mac(&host_link).map(format_mac).unwrap_or_default(),
        sandbox_ifname: ifname.to_string(),
        sandbox_mac: format_mac(&mac),
        sandbox: spec.netns.clone(),
        // Both ends are created with the same MTU (the spec's, or the kernel's default).
        mtu: nl::link_mtu(&host_link).unwrap_or_default(),
    })
}

/// Configures the pod end (index `index`, MAC `mac`) through the pod's netlink socket. `lo`, the
/// link and the addresses go out back to back (the kernel takes them in any order); the routes
/// follow one at a time, as each may need the link up, an address, or a route before it.
///
/// The link-local address is added too, like the others without duplicate address detection,
/// instead of being left to the kernel (`addrgenmode none`): it is the one the kernel would make
/// from the MAC, usable as soon as ADD returns, as a pod must be able to talk at once. (Switching
/// DAD off in the pod's `default` settings instead takes a write under `/proc/sys/net`, whose
/// lookups grow with the number of namespaces on the node.) It goes beside the routes, which do
/// not need it: the kernel's work for each new address holds the RTNL lock, and the requests sent
/// right after an address wait for it (docs/benchmarks.md). Addresses come from IPAM and are
/// unique by construction; a namespace without IPv6 gets none.
async fn configure_sandbox(
    pod: &Nl,
    spec: &PlugSpec,
    mac: [u8; 6],
    index: u32,
    steps: &mut Steps,
) -> Result<(), PlugError> {
    let ifname = spec.ifname.as_str();
    let addresses = futures::future::try_join_all(spec.ips.iter().map(|ip| pod.add_address(index, ifname, ip.address)));
    let (lo, ipv6, addresses) =
        futures::join!(pod.set_up(LOOPBACK_INDEX, "lo"), pod.up_without_link_local(index, ifname, false), addresses);
    lo?;
    addresses?;
    let ipv6 = ipv6?;
    steps.mark("nl_up_addr");
    let routes = async {
        for route in &spec.all_routes() {
            pod.add_route(index, ifname, route).await?;
        }
        Ok::<_, PlugError>(())
    };
    let link_local = async { if ipv6 { pod.add_address(index, ifname, nl::link_local(mac)).await } else { Ok(()) } };
    let (routes, link_local) = futures::join!(routes, link_local);
    routes?;
    link_local?;
    steps.mark("nl_routes");
    Ok(())
}

/// The loopback device's index, the same in every network namespace.
const LOOPBACK_INDEX: u32 = 1;

/// The index of the Linux bridge `name`: one lookup when it exists and is up, otherwise
/// [`ensure_bridge_with`] (it was deleted or taken down behind our back, or is not a bridge).
async fn bridge_index(nl: &Nl, name: &str) -> Result<u32, PlugError> {
    match nl.link(name).await? {
        Some(link) if nl::link_kind(&link) == Some(&InfoKind::Bridge) && nl::link_up(&link) => Ok(link.header.index),
        _ => ensure_bridge_with(nl, name, &[]).await,
    }
}

/// Undoes a partly done [`plug`] when dropped, unless disarmed. Runs on the plugging thread,
/// where blocking is harmless; the netlink work goes to a helper thread with its own runtime, so
/// the guard also works while unwinding inside the plugging thread's runtime (where panics
/// unwind; a release build aborts instead and recovers at its next start).
#[derive(Debug, Default)]
struct Rollback {
    /// The host end we created; deleting it deletes the pod end with it.
    host_link: Option<String>,
    /// The OVS port we (may have) added: `(db, port)`.
    ovs_port: Option<(Option<String>, String)>,
    /// An interface we created in a pod with no host end (a kernel VLAN device): `(netns, name)`.
    pod_link: Option<(PathBuf, String)>,
}

impl Rollback {
    fn disarm(mut self) {
        self.host_link = None;
        self.ovs_port = None;
        self.pod_link = None;
    }
}

impl Drop for Rollback {
    fn drop(&mut self) {
        if let Some((db, port)) = self.ovs_port.take()
            && let Err(error) = ovs::vsctl_blocking(db.as_deref(), &ovs::del_port(&port))
        {
            tracing::error!(port = %port, error = %error_chain(&error), "rollback: cannot remove the OVS port");
        }
        if let Some((netns, name)) = self.pod_link.take() {
            let result = std::thread::scope(|s| {
                s.spawn(|| {
                    nl::block_on(async {
                        let file = crate::netns::open(&netns)?;
                        let (conn, pod) = Nl::open_in(&file, &netns)?;
                        nl::scoped(conn, pod.delete(&name)).await
                    })
                })
                .join()
            });
            match result {
                Ok(Ok(_)) => tracing::info!(ifname = %name, "rollback: removed the pod's VLAN device"),
                Ok(Err(error)) => {
                    tracing::error!(ifname = %name, error = %error_chain(&error), "rollback: cannot remove the pod's VLAN device")
                }
                Err(_) => tracing::error!(ifname = %name, "rollback: the cleanup thread panicked"),
            }
        }
        if let Some(name) = self.host_link.take() {
            let result = std::thread::scope(|s| {
                s.spawn(|| nl::block_on(async { Nl::connect("host".to_string())?.delete(&name).await })).join()
            });
            match result {
                Ok(Ok(_)) => tracing::info!(host_ifname = %name, "rollback: removed the veth pair"),
                Ok(Err(error)) => {
                    tracing::error!(host_ifname = %name, error = %error_chain(&error), "rollback: cannot remove the veth pair")
                }
                Err(_) => tracing::error!(host_ifname = %name, "rollback: the cleanup thread panicked"),
            }
        }
    }
}

/// Removes what [`plug`] made; success when it is already gone, when the namespace is gone or
/// `netns` is empty, and when repeated.
///
/// Deleting the host end deletes the pod end with it. A veth called `ifname` still present in
/// the pod afterwards (its host end renamed behind our back) is deleted too. For OVS the port
/// is removed with `--if-exists`. A `netns` that is the binder's own or the host's is refused
/// ([`crate::netns::NetnsError::NotAPod`]) before anything is touched.
pub async fn unplug(
    netns: Option<PathBuf>,
    ifname: &str,
    host_ifname: &str,
    driver: &BindingDriver,
    ovs_db: Option<&str>,
) -> Result<(), PlugError> {
    // The pod side is only ever looked at in a pod's namespace: never in the binder's or the
    // host's, whatever the caller passed. A namespace that is gone needs nothing done there.
    let netns = match netns.filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => match crate::netns::check_pod(&p) {
            Ok(()) => Some(p),
            Err(e) if e.is_gone() => None,
            Err(e) => return Err(e.into()),
        },
        None => None,
    };
    // One job: the host end through the worker's own socket; the pod only visited when that
    // found nothing to delete (deleting the host end deletes the pod end with it).
    let (host_name, pod_name) = (host_ifname.to_string(), ifname.to_string());
    in_netns(None, move |host| async move {
        let removed = !host_name.is_empty() && host.delete(&host_name).await?;
        let (Some(netns), false, false) = (netns, removed, pod_name.is_empty()) else { return Ok(()) };
        let leftover = async {
            let file = crate::netns::open(&netns)?;
            let (conn, pod) = Nl::open_in(&file, &netns)?;
            drop(file);
            nl::scoped(conn, async {
                match pod.link(&pod_name).await? {
                    // A veth whose host end is gone, or a VLAN device (no host end at all).
                    Some(link) if matches!(nl::link_kind(&link), Some(&InfoKind::Veth | &InfoKind::Vlan)) => {
                        pod.delete(&pod_name).await
                    }
                    _ => Ok(false),
                }
            })
            .await
        };
        match leftover.await {
            Ok(_) => Ok(()),
            Err(e) if e.is_netns_gone() => Ok(()),
            Err(e) => Err(e),
        }
    })
    .await?;
    if let BindingDriver::Ovs { .. } = driver
        && !host_ifname.is_empty()
    {
        ovs::vsctl(ovs_db, &ovs::del_port(host_ifname)).await?;
    }
    Ok(())
}

/// Makes sure the Linux bridge `name` exists in the host namespace, is up, holds `addresses`
/// (typically the pods' gateway addresses) and keeps its MAC address. Idempotent; other addresses
/// are left alone.
///
/// The MAC matters because it is the pods' gateway's: a Linux bridge whose address was never set
/// takes the lowest MAC among its ports and changes it whenever such a port comes or goes, so
/// deleting one pod (or plugging one) would silently strand every other pod of the node whose
/// neighbour cache still holds the old gateway MAC. Setting the address once — even to the one
/// it has — makes the kernel keep it; this also fixes a bridge an earlier binder left unpinned.
pub async fn ensure_bridge(name: &str, addresses: &[IpNet]) -> Result<(), PlugError> {
    super::check_ifname("bridge", name)?;
    let (name, addresses) = (name.to_string(), addresses.to_vec());
    in_netns(None, move |nl| async move {
        let index = ensure_bridge_with(&nl, &name, &addresses).await?;
        pin_mac(&nl, &nl.require(&name).await?, index, &name).await
    })
    .await
}

/// [`ensure_bridge`] on an existing connection; returns the bridge's index. A bridge it creates
/// gets its MAC pinned at once; one found existing is left as it is (see [`ensure_bridge`]).
async fn ensure_bridge_with(nl: &Nl, name: &str, addresses: &[IpNet]) -> Result<u32, PlugError> {
    let mut created = false;
    if nl.link(name).await?.is_none() {
        match nl.add_link(LinkBridge::new(name).build()).await {
            // Someone else (a concurrent ADD) created it first: fine, that one pins it.
            Err(e) if nl::errno(&e) != Some(Errno::EEXIST) => {
                return Err(nl.fail(format!("create bridge {name}"))(e));
            }
            Err(_) => {}
            Ok(()) => {
                tracing::info!(bridge = name, "created bridge");
                created = true;
            }
        }
    }
    let link = nl.require(name).await?;
    if nl::link_kind(&link) != Some(&InfoKind::Bridge) {
        return Err(PlugError::NotABridge(name.to_string()));
    }
    let index = link.header.index;
    if created {
        pin_mac(nl, &link, index, name).await?;
    }
    if !nl::link_up(&link) {
        nl.set_up(index, name).await?;
    }
    let present = nl.addresses(index).await?;
    for addr in addresses.iter().filter(|a| !present.contains(a)) {
        nl.add_address(index, name, *addr).await?;
    }
    Ok(index)
}

/// Sets the bridge's MAC address to the one it has, so that the kernel keeps it from now on.
async fn pin_mac(nl: &Nl, link: &LinkMessage, index: u32, name: &str) -> Result<(), PlugError> {
    match nl::link_mac(link) {
        Some(mac) => nl.set_mac(index, name, mac).await,
        None => Ok(()),
    }
}

/// Names of the host-namespace links starting with `prefix` (e.g. [`super::HOST_IFNAME_PREFIX`]),
/// for garbage collection of leftovers.
pub async fn list_host_links(prefix: &str) -> Result<Vec<String>, PlugError> {
    let prefix = prefix.to_string();
    in_netns(None, move |nl| async move {
        let mut names = nl.link_names().await?;
        names.retain(|n| n.starts_with(&prefix));
        names.sort();
        Ok(names)
    })
    .await
}

/// Whether a link called `name` exists in `netns` (the host's for `None`). A missing namespace
/// is an error ([`PlugError::NetnsMissing`]), not `false`.
pub async fn link_exists(netns: Option<PathBuf>, name: &str) -> Result<bool, PlugError> {
    let name = name.to_string();
    in_netns(netns, move |nl| async move { Ok(nl.link(&name).await?.is_some()) }).await
}
