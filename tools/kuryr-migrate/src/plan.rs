//! The migration of one object as a state machine: from what is observed now (Kubernetes,
//! Neutron, Octavia) the steps still to do, in order. Pure: every rule is unit-tested.
//!
//! Each step's "done" is a fact that can be read back (a tag on the port, a PodVif recording
//! the port, a finalizer present or absent, an object gone), never a note the tool kept. So a
//! run that died after any step is resumed by running again: the observation shows which steps
//! took effect and only the others are planned. Kuryr's bookkeeping goes last — its finalizers
//! only once kuryr-rs' record is in place, its resource only after its finalizers — so there is
//! no moment at which neither system would clean up after a deleted pod or Service.

use std::fmt;

/// A pod's migration step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodStep {
    /// Tag the Neutron port with the allocator's cluster tag: the allocator's recovery then
    /// counts it as the pod's port (it already carries `device_id` = the pod's uid).
    TagPort,
    /// Create the pod's PodVif (if missing) and record the port as its VIF.
    RecordVif,
    /// Put the allocator's finalizer on the pod.
    AddFinalizer,
    /// Take Kuryr's finalizer off the pod.
    ReleasePodFinalizer,
    /// Take the finalizers off the KuryrPort.
    ReleaseKuryrPortFinalizers,
    /// Delete the KuryrPort.
    DeleteKuryrPort,
}

/// A Service's migration step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LbStep {
    /// Add lbaas' ownership tags (cluster, Service, uid) to the Octavia load balancer: lbaas
    /// adopts a load balancer so tagged as its own, listeners, pools and members included.
    TagLoadBalancer,
    /// Add the same tags to the Service's floating IP: lbaas (with `--floating-network-id`) finds
    /// a floating IP so tagged and keeps it as the Service's ingress instead of making another.
    TagFloatingIp,
    /// Put lbaas' finalizer on the Service.
    AddFinalizer,
    /// Take Kuryr's finalizer off the Service.
    ReleaseServiceFinalizer,
    /// Take the finalizers off the KuryrLoadBalancer.
    ReleaseKlbFinalizers,
    /// Delete the KuryrLoadBalancer.
    DeleteKlb,
}

impl fmt::Display for PodStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PodStep::TagPort => "tag the port",
            PodStep::RecordVif => "record the PodVif",
            PodStep::AddFinalizer => "add the allocator's pod finalizer",
            PodStep::ReleasePodFinalizer => "remove Kuryr's pod finalizer",
            PodStep::ReleaseKuryrPortFinalizers => "remove the KuryrPort's finalizers",
            PodStep::DeleteKuryrPort => "delete the KuryrPort",
        })
    }
}

impl fmt::Display for LbStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LbStep::TagLoadBalancer => "tag the load balancer",
            LbStep::TagFloatingIp => "tag the floating IP",
            LbStep::AddFinalizer => "add lbaas' Service finalizer",
            LbStep::ReleaseServiceFinalizer => "remove Kuryr's Service finalizer",
            LbStep::ReleaseKlbFinalizers => "remove the KuryrLoadBalancer's finalizers",
            LbStep::DeleteKlb => "delete the KuryrLoadBalancer",
        })
    }
}

/// What is known of a pod or Service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owner {
    /// Its uid.
    pub uid: String,
    /// `metadata.finalizers`.
    pub finalizers: Vec<String>,
    /// Being deleted (no finalizer can be added any more).
    pub deleting: bool,
}

impl Owner {
    fn has(&self, f: &str) -> bool {
        self.finalizers.iter().any(|x| x == f)
    }
}

/// What is known of a pod's Neutron port.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortFacts {
    /// `device_id`.
    pub device_id: String,
    /// `device_owner`.
    pub device_owner: String,
    /// The network.
    pub network_id: String,
    /// The MAC, lower-case.
    pub mac: String,
    /// Carries the allocator's cluster tag.
    pub tagged: bool,
    /// `binding:vif_type` is `binding_failed` or there is no host.
    pub unbound: bool,
}

/// Everything observed for one KuryrPort.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFacts {
    /// The uid the KuryrPort names.
    pub kuryr_uid: String,
    /// The port id Kuryr recorded (none: Kuryr never gave the pod a port).
    pub port_id: Option<String>,
    /// The MAC Kuryr recorded.
    pub kuryr_mac: String,
    /// The KuryrPort's finalizers.
    pub kp_finalizers: Vec<String>,
    /// The pod, if it exists.
    pub pod: Option<Owner>,
    /// The port, if Neutron has it.
    pub port: Option<PortFacts>,
    /// The PodVif of that name: (its pod uid, the VIF id it records).
    pub pod_vif: Option<(String, Option<String>)>,
}

/// The allocator's settings a migrated port has to match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The pod network.
    pub network_id: String,
    /// `device_owner` of the allocator's ports.
    pub device_owner: String,
}

/// The steps left for one pod, or why it cannot be migrated as it is.
pub fn pod_steps(
    f: &PodFacts,
    target: &Target,
    kuryr_pod_finalizer: &str,
    our_finalizer: &str,
) -> Result<Vec<PodStep>, String> {
    let pod = f.pod.as_ref().filter(|p| p.uid == f.kuryr_uid).ok_or_else(|| {
        format!(
            "pod {} is gone: Kuryr's resources are left as they are (start Kuryr to clean up, or delete them)",
            f.kuryr_uid
        )
    })?;
    let mut steps = Vec::new();
    if let Some(port_id) = &f.port_id {
        let port = f.port.as_ref().ok_or_else(|| format!("port {port_id} is not in Neutron any more"))?;
        if port.device_id != f.kuryr_uid {
            return Err(format!("port {port_id} belongs to device {:?}, not to the pod", port.device_id));
        }
        if port.network_id != target.network_id {
            return Err(format!(
                "port {port_id} is on network {}, not on the pod network {}",
                port.network_id, target.network_id
            ));
        }
        if port.device_owner != target.device_owner {
            return Err(format!(
                "port {port_id} has device_owner {:?}; the allocator's is {:?} (--device-owner)",
                port.device_owner, target.device_owner
            ));
        }
        if port.unbound {
            return Err(format!("port {port_id} is not bound to a host (binding failed)"));
        }
        if !f.kuryr_mac.is_empty() && port.mac != f.kuryr_mac {
            return Err(format!("port {port_id} has MAC {}, Kuryr recorded {}", port.mac, f.kuryr_mac));
        }
        if !port.tagged {
            steps.push(PodStep::TagPort);
        }
        match &f.pod_vif {
            Some((uid, _)) if *uid != f.kuryr_uid => {
                return Err(format!("a PodVif of that name belongs to another pod ({uid})"));
            }
            Some((_, Some(vif))) if vif == port_id => {}
            Some((_, Some(vif))) => return Err(format!("the PodVif already records another VIF ({vif})")),
            _ => steps.push(PodStep::RecordVif),
        }
    }
    // Without a port from Kuryr, the allocator gives the pod one (and finds one Kuryr created
    // but never recorded by its device_id); only Kuryr's bookkeeping is left to remove.
    if !pod.deleting && !pod.has(our_finalizer) {
        steps.push(PodStep::AddFinalizer);
    }
    if pod.has(kuryr_pod_finalizer) {
        steps.push(PodStep::ReleasePodFinalizer);
    }
    if !f.kp_finalizers.is_empty() {
        steps.push(PodStep::ReleaseKuryrPortFinalizers);
    }
    steps.push(PodStep::DeleteKuryrPort);
    Ok(steps)
}

/// What is known of a Service's Octavia load balancer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LbFacts {
    /// Its VIP.
    pub vip: String,
    /// It carries every one of lbaas' tags for the Service.
    pub tagged: bool,
    /// PENDING_* (immutable now).
    pub pending: bool,
}

/// What is known of the floating IP Kuryr gave a type=LoadBalancer Service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FipFacts {
    /// Its id.
    pub id: String,
    /// Its external network.
    pub network_id: String,
    /// It carries every one of lbaas' tags for the Service.
    pub tagged: bool,
    /// Kuryr took it from the Service's `loadBalancerIP` (allocated by the user): Kuryr never
    /// deletes those, lbaas would delete it with the Service once adopted.
    pub user_allocated: bool,
}

/// Everything observed for one KuryrLoadBalancer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceFacts {
    /// The KuryrLoadBalancer's finalizers.
    pub klb_finalizers: Vec<String>,
    /// The load balancer id Kuryr recorded.
    pub lb_id: Option<String>,
    /// The Service, if it exists.
    pub service: Option<Owner>,
    /// The Service's cluster IP.
    pub cluster_ip: Option<String>,
    /// The load balancer, if Octavia has it.
    pub lb: Option<LbFacts>,
    /// lbaas puts its finalizer on this Service (its --service-finalizer and the Service type).
    pub wants_finalizer: bool,
    /// The floating IP Kuryr recorded, if Neutron has it.
    pub fip: Option<FipFacts>,
    /// lbaas' `--floating-network-id`: floating IPs are adopted only onto it (none: not adopted,
    /// left in place).
    pub floating_network: Option<String>,
}

/// The steps left for one Service, or why it cannot be migrated now.
pub fn lb_steps(f: &ServiceFacts, kuryr_finalizer: &str, our_finalizer: &str) -> Result<Vec<LbStep>, String> {
    let svc = f.service.as_ref().ok_or(
        "the Service is gone: Kuryr's resources are left as they are (start Kuryr to clean up, or delete them)",
    )?;
    let mut steps = Vec::new();
    if let (Some(id), Some(lb)) = (&f.lb_id, &f.lb) {
        if f.cluster_ip.as_deref().is_some_and(|ip| !same_ip(ip, &lb.vip)) {
            return Err(format!(
                "load balancer {id} has VIP {}, the Service's cluster IP is {}: lbaas would replace it",
                lb.vip,
                f.cluster_ip.as_deref().unwrap_or_default()
            ));
        }
        if !lb.tagged {
            if lb.pending {
                return Err(format!("load balancer {id} is PENDING: run again once it is ACTIVE"));
            }
            steps.push(LbStep::TagLoadBalancer);
        }
    }
    if let (Some(fip), Some(network)) = (&f.fip, &f.floating_network) {
        if fip.network_id != *network {
            return Err(format!(
                "floating IP {} is on network {}, not on --floating-network-id {network}: lbaas would replace it",
                fip.id, fip.network_id
            ));
        }
        if !fip.tagged && !fip.user_allocated {
            steps.push(LbStep::TagFloatingIp);
        }
    }
    // No load balancer (never made, or deleted behind Kuryr's back): lbaas creates one.
    if f.wants_finalizer && !svc.deleting && !svc.has(our_finalizer) {
        steps.push(LbStep::AddFinalizer);
    }
    if svc.has(kuryr_finalizer) {
        steps.push(LbStep::ReleaseServiceFinalizer);
    }
    if !f.klb_finalizers.is_empty() {
        steps.push(LbStep::ReleaseKlbFinalizers);
    }
    steps.push(LbStep::DeleteKlb);
    Ok(steps)
}

fn same_ip(a: &str, b: &str) -> bool {
    match (a.parse::<std::net::IpAddr>(), b.parse::<std::net::IpAddr>()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// The finalizers with `f` added (kept in order).
pub fn with(finalizers: &[String], f: &str) -> Vec<String> {
    let mut v = finalizers.to_vec();
    if !v.iter().any(|x| x == f) {
        v.push(f.to_string());
    }
    v
}

/// The finalizers without `f`.
pub fn without(finalizers: &[String], f: &str) -> Vec<String> {
    finalizers.iter().filter(|x| *x != f).cloned().collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const KF: &str = "kuryr/pod";
    const OURS: &str = "ours/vif";

    fn target() -> Target {
        Target { network_id: "net".into(), device_owner: "compute:kuryr".into() }
    }

    /// A pod Kuryr fully handled, nothing migrated yet.
    fn fresh() -> PodFacts {
        PodFacts {
            kuryr_uid: "u1".into(),
            port_id: Some("p1".into()),
            kuryr_mac: "fa:16:3e:00:00:01".into(),
            kp_finalizers: vec!["kuryr/kp".into()],
            pod: Some(Owner { uid: "u1".into(), finalizers: vec![KF.into()], deleting: false }),
            port: Some(PortFacts {
                device_id: "u1".into(),
                device_owner: "compute:kuryr".into(),
                network_id: "net".into(),
                mac: "fa:16:3e:00:00:01".into(),
                tagged: false,
                unbound: false,
            }),
            pod_vif: None,
        }
    }

    #[test]
    fn a_fresh_pod_takes_every_step_in_order() {
        use PodStep::*;
        assert_eq!(
            pod_steps(&fresh(), &target(), KF, OURS).unwrap(),
            vec![TagPort, RecordVif, AddFinalizer, ReleasePodFinalizer, ReleaseKuryrPortFinalizers, DeleteKuryrPort]
        );
    }

    #[test]
    fn each_step_done_is_seen_and_not_planned_again() {
        use PodStep::*;
        let mut f = fresh();
        f.port.as_mut().unwrap().tagged = true;
        assert_eq!(pod_steps(&f, &target(), KF, OURS).unwrap()[0], RecordVif);
        f.pod_vif = Some(("u1".into(), Some("p1".into())));
        assert_eq!(pod_steps(&f, &target(), KF, OURS).unwrap()[0], AddFinalizer);
        f.pod.as_mut().unwrap().finalizers.push(OURS.into());
        assert_eq!(pod_steps(&f, &target(), KF, OURS).unwrap()[0], ReleasePodFinalizer);
        f.pod.as_mut().unwrap().finalizers = vec![OURS.into()];
        assert_eq!(pod_steps(&f, &target(), KF, OURS).unwrap(), vec![ReleaseKuryrPortFinalizers, DeleteKuryrPort]);
        f.kp_finalizers.clear();
        assert_eq!(pod_steps(&f, &target(), KF, OURS).unwrap(), vec![DeleteKuryrPort]);
    }

    #[test]
    fn a_pod_vif_created_but_not_yet_recorded_is_recorded() {
        let mut f = fresh();
        f.pod_vif = Some(("u1".into(), None));
        assert!(pod_steps(&f, &target(), KF, OURS).unwrap().contains(&PodStep::RecordVif));
    }

    #[test]
    fn mismatches_block_the_pod_with_a_reason() {
        type Change = Box<dyn Fn(&mut PodFacts)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|f| f.pod = None), "is gone"),
            (Box::new(|f| f.pod.as_mut().unwrap().uid = "u2".into()), "is gone"),
            (Box::new(|f| f.port = None), "not in Neutron"),
            (Box::new(|f| f.port.as_mut().unwrap().device_id = "other".into()), "belongs to device"),
            (Box::new(|f| f.port.as_mut().unwrap().network_id = "n2".into()), "not on the pod network"),
            (Box::new(|f| f.port.as_mut().unwrap().device_owner = "compute:nova".into()), "--device-owner"),
            (Box::new(|f| f.port.as_mut().unwrap().unbound = true), "not bound"),
            (Box::new(|f| f.port.as_mut().unwrap().mac = "fa:16:3e:00:00:09".into()), "MAC"),
            (Box::new(|f| f.pod_vif = Some(("u9".into(), None))), "another pod"),
            (Box::new(|f| f.pod_vif = Some(("u1".into(), Some("p9".into())))), "another VIF"),
        ];
        for (change, why) in cases {
            let mut f = fresh();
            change(&mut f);
            let e = pod_steps(&f, &target(), KF, OURS).unwrap_err();
            assert!(e.contains(why), "{e:?} should say {why:?}");
        }
    }

    #[test]
    fn a_pod_kuryr_gave_no_port_only_loses_kuryr_bookkeeping() {
        let mut f = fresh();
        f.port_id = None;
        f.port = None;
        use PodStep::*;
        assert_eq!(
            pod_steps(&f, &target(), KF, OURS).unwrap(),
            vec![AddFinalizer, ReleasePodFinalizer, ReleaseKuryrPortFinalizers, DeleteKuryrPort]
        );
    }

    #[test]
    fn a_deleting_pod_gets_no_new_finalizer() {
        let mut f = fresh();
        f.pod.as_mut().unwrap().deleting = true;
        assert!(!pod_steps(&f, &target(), KF, OURS).unwrap().contains(&PodStep::AddFinalizer));
    }

    fn service() -> ServiceFacts {
        ServiceFacts {
            klb_finalizers: vec!["kuryr/klb".into()],
            lb_id: Some("lb1".into()),
            service: Some(Owner { uid: "s1".into(), finalizers: vec![KF.into()], deleting: false }),
            cluster_ip: Some("10.96.0.10".into()),
            lb: Some(LbFacts { vip: "10.96.0.10".into(), tagged: false, pending: false }),
            wants_finalizer: true,
            fip: None,
            floating_network: None,
        }
    }

    #[test]
    fn a_service_is_tagged_then_handed_over() {
        use LbStep::*;
        let mut f = service();
        assert_eq!(
            lb_steps(&f, KF, OURS).unwrap(),
            vec![TagLoadBalancer, AddFinalizer, ReleaseServiceFinalizer, ReleaseKlbFinalizers, DeleteKlb]
        );
        f.lb.as_mut().unwrap().tagged = true;
        f.service.as_mut().unwrap().finalizers = vec![OURS.into()];
        f.klb_finalizers.clear();
        assert_eq!(lb_steps(&f, KF, OURS).unwrap(), vec![DeleteKlb]);
    }

    #[test]
    fn a_floating_ip_is_tagged_only_onto_lbaas_floating_network() {
        use LbStep::*;
        let mut f = service();
        f.fip = Some(FipFacts { id: "f1".into(), network_id: "ext".into(), tagged: false, user_allocated: false });
        // Without --floating-network-id it is left in place.
        assert!(!lb_steps(&f, KF, OURS).unwrap().contains(&TagFloatingIp));
        f.floating_network = Some("ext".into());
        assert_eq!(lb_steps(&f, KF, OURS).unwrap()[..2], [TagLoadBalancer, TagFloatingIp]);
        f.fip.as_mut().unwrap().tagged = true;
        assert!(!lb_steps(&f, KF, OURS).unwrap().contains(&TagFloatingIp));
        f.fip.as_mut().unwrap().tagged = false;
        f.fip.as_mut().unwrap().user_allocated = true;
        assert!(!lb_steps(&f, KF, OURS).unwrap().contains(&TagFloatingIp), "the user's own is never adopted");
        f.floating_network = Some("other".into());
        assert!(lb_steps(&f, KF, OURS).unwrap_err().contains("--floating-network-id"));
    }

    #[test]
    fn a_service_lbaas_puts_no_finalizer_on_gets_none() {
        let mut f = service();
        f.wants_finalizer = false;
        assert!(!lb_steps(&f, KF, OURS).unwrap().contains(&LbStep::AddFinalizer));
    }

    #[test]
    fn a_service_without_a_load_balancer_is_left_to_lbaas_to_create() {
        let mut f = service();
        f.lb = None;
        assert!(!lb_steps(&f, KF, OURS).unwrap().contains(&LbStep::TagLoadBalancer));
    }

    #[test]
    fn services_are_blocked_when_gone_pending_or_on_another_vip() {
        let mut f = service();
        f.service = None;
        assert!(lb_steps(&f, KF, OURS).unwrap_err().contains("gone"));
        let mut f = service();
        f.lb.as_mut().unwrap().pending = true;
        assert!(lb_steps(&f, KF, OURS).unwrap_err().contains("PENDING"));
        let mut f = service();
        f.cluster_ip = Some("10.96.0.11".into());
        assert!(lb_steps(&f, KF, OURS).unwrap_err().contains("replace"));
    }

    #[test]
    fn finalizer_edits_keep_the_others() {
        let f = vec!["a".to_string(), "b".to_string()];
        assert_eq!(with(&f, "c"), vec!["a", "b", "c"]);
        assert_eq!(with(&f, "a"), vec!["a", "b"]);
        assert_eq!(without(&f, "a"), vec!["b"]);
    }
}
