//! The CNI operations besides ADD: DEL, CHECK, STATUS and GC, and the rollback at start-up of
//! the ADDs the binder died in.

use super::*;

impl CniService {
    /// Rolls back the ADDs the binder died in (records left in [`State::Adding`]); run at
    /// start-up. The runtime saw those ADDs fail and retries them or sends DEL; either way
    /// nothing half-made may stay. Then delivers the plugged reports left pending.
    pub async fn recover(&self) {
        for att in self.attachments.filter(|a| a.state == State::Adding) {
            let _key = self.locks.lock(&att.container_id, &att.ifname).await;
            let Some(att) = self.attachments.get(&att.container_id, &att.ifname).filter(|a| a.state == State::Adding)
            else {
                continue;
            };
            tracing::warn!(
                container = att.container_id,
                ifname = att.ifname,
                pod = format!("{}/{}", att.pod_namespace, att.pod_name),
                "rolling back an ADD the binder exited in"
            );
            let netns = netns_path(&att.netns);
            self.teardown(&att, netns, driver_of_record(&att), true).await;
        }
        self.resume_pending_reports();
    }

    pub async fn del(&self, r: &pb::CniRequest) -> CniResult<()> {
        let start = Instant::now();
        let mut steps = Steps::start();
        let container_id = required("CNI_CONTAINERID", &r.container_id)?;
        let ifname = required("CNI_IFNAME", &r.ifname)?;
        parse_conf(&r.config)?;
        let netns = netns_path(&r.netns);
        // A namespace that is gone is fine (DEL is idempotent); the binder's or the host's is
        // not a pod's, and DEL is refused before anything is touched.
        if let Some(p) = &netns
            && let Err(e @ NetnsError::NotAPod { .. }) = crate::netns::check_pod(p)
        {
            return Err(CniError::new(code::INVALID_ENVIRONMENT, format!("CNI_NETNS: {e}")));
        }
        steps.mark("checks");
        let _key = self.locks.lock(container_id, ifname).await;
        steps.mark("lock");
        match self.attachments.get(container_id, ifname) {
            Some(att) => {
                let driver = driver_of_record(&att);
                self.teardown_timed(&att, netns, driver, true, &mut steps).await;
                self.metrics.observe_steps("DEL", &steps);
                tracing::info!(
                    container = container_id,
                    took_ms = start.elapsed().as_secs_f64() * 1e3,
                    steps = steps.render(),
                    "DEL done"
                );
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
        pod_netns(Path::new(netns))?;
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
        let driver = driver_of(&vif, &att.pod_uid, &self.nested)?;
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
            // A further interface goes with its primary one.
            if keep(&att.container_id, att.primary.as_deref().unwrap_or(&att.ifname)) {
                known_hosts.push(att.host_ifname.clone());
                continue;
            }
            let _key = self.locks.lock(&att.container_id, &att.ifname).await;
            // Looked up again under the lock: a DEL may have removed it meanwhile.
            let Some(att) = self.attachments.get(&att.container_id, &att.ifname) else { continue };
            self.teardown(&att, netns_path(&att.netns), driver_of_record(&att), true).await;
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
