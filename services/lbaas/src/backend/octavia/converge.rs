//! Converging one Service's load balancer: adopt what exists (by tags) or create it, read its
//! tree, apply the planned steps, and give a type=LoadBalancer Service its floating IP.

use super::*;

impl Inner {
    /// Brings the load balancer of `key` to `spec`.
    pub(super) async fn converge(
        &self,
        key: &str,
        spec: &LoadBalancerSpec,
        t: &mut Tally,
    ) -> Result<Known, BackendError> {
        let want = plan::desired(key, spec, &self.shape).map_err(|m| {
            fail(
                "invalid",
                m.clone(),
                Some(Observed { provisioning_status: "ERROR".into(), message: m, ..Default::default() }),
            )
        })?;
        let cached = locked(&self.known).get(key).filter(|k| k.uid == spec.uid).cloned();
        if cached.is_none() {
            // Another Service of that name may have left a load balancer that was never cleaned up.
            let stale = locked(&self.known).remove(key);
            if let Some(old) = stale {
                self.still_mine(key)?;
                self.delete_lb(&old.lb_id, t).await?;
            }
        }
        // A change of the spec trusts what lbaas built; the same generation again is a check.
        let mut known = match cached.filter(|k| k.generation != spec.generation) {
            Some(k) => k,
            None => match self.adopt(&want, &spec.uid, t).await? {
                Some(k) => k,
                None => self.create(&want, &spec.uid, t).await?,
            },
        };
        if canonical(&known.vip_address) != canonical(&want.vip_address) {
            tracing::info!(
                service = key,
                lb = known.lb_id,
                have = known.vip_address,
                want = want.vip_address,
                "the VIP changed: replacing the load balancer"
            );
            self.still_mine(key)?;
            self.delete_lb(&known.lb_id, t).await?;
            known = self.create(&want, &spec.uid, t).await?;
        }
        for step in plan::plan(&want, &known.tree) {
            match self.apply(&known.lb_id, &want, step, &mut known.tree, t).await {
                Ok(()) => {}
                Err(Applied::LbError) => {
                    // ERROR after our change: Octavia takes no other; replace the whole tree
                    // with one create (which checks that it ends ACTIVE).
                    tracing::warn!(service = key, lb = known.lb_id, "load balancer went to ERROR: replacing it");
                    self.still_mine(key)?;
                    self.delete_lb(&known.lb_id, t).await?;
                    known = self.create(&want, &spec.uid, t).await?;
                    break;
                }
                Err(Applied::Failed(e)) => return Err(e),
            }
        }
        known.generation = spec.generation;
        self.ensure_ingress(key, spec, &want, &mut known, t).await?;
        Ok(known)
    }

    /// Finds the load balancer of `uid` by its tags and takes it over as it is: waits out a
    /// pending change, replaces an ERROR one, deletes duplicates, and reads its tree.
    pub(super) async fn adopt(
        &self,
        want: &DesiredLb,
        uid: &str,
        t: &mut Tally,
    ) -> Result<Option<Known>, BackendError> {
        let filter = self.filter_tags(&[plan::cluster_tag(&self.shape.cluster), format!("{}{uid}", plan::TAG_UID)]);
        t.calls += 1;
        let mut found =
            self.octavia.list_load_balancers(&filter).await.map_err(|e| os_fail("listing load balancers", &e, None))?;
        found.retain(|lb| {
            lb.provisioning_status != ProvisioningStatus::PendingDelete
                && lb.provisioning_status != ProvisioningStatus::Deleted
        });
        // Prefer a working one; any other is a duplicate (a create whose answer was lost).
        found.sort_by_key(|lb| match lb.provisioning_status {
            ProvisioningStatus::Active => 0,
            s if s.is_pending() => 1,
            _ => 2,
        });
        let mut found = found.into_iter();
        let Some(lb) = found.next() else { return Ok(None) };
        for dup in found {
            tracing::warn!(lb = dup.id, keep = lb.id, name = want.name, "duplicate load balancer: deleting it");
            self.still_mine_for(want)?;
            self.delete_lb(&dup.id, t).await?;
        }
        let settled =
            if lb.provisioning_status.is_pending() { self.wait_settled(&lb.id, "", 0, t).await? } else { Some(lb) };
        let lb = match settled {
            Some(lb) if lb.provisioning_status == ProvisioningStatus::Active => lb,
            Some(lb) => {
                tracing::warn!(lb = lb.id, name = want.name, status = ?lb.provisioning_status,
                    "load balancer in ERROR: deleting it to create it again");
                self.still_mine_for(want)?;
                self.delete_lb(&lb.id, t).await?;
                return Ok(None);
            }
            None => return Ok(None),
        };
        let tree = self.read_tree(&lb.id, t).await?;
        Ok(Some(Known {
            uid: uid.to_string(),
            lb_id: lb.id.clone(),
            vip_address: lb.vip_address.clone().unwrap_or_default(),
            vip_port_id: lb.vip_port_id.clone(),
            generation: 0,
            tree,
            fip: None,
        }))
    }

    /// Listeners, pools and members of a load balancer as Octavia holds them.
    pub(super) async fn read_tree(&self, lb_id: &str, t: &mut Tally) -> Result<ObservedTree, BackendError> {
        let by_lb = Filter::new().eq("loadbalancer_id", lb_id);
        t.calls += 2;
        let mut listeners =
            self.octavia.list_listeners(&by_lb).await.map_err(|e| os_fail("listing listeners", &e, Some(lb_id)))?;
        let mut pools = self.octavia.list_pools(&by_lb).await.map_err(|e| os_fail("listing pools", &e, Some(lb_id)))?;
        // The filter is the server's; never act on another load balancer's objects.
        listeners.retain(|l| l.loadbalancers.iter().any(|r| r.id == lb_id));
        pools.retain(|p| p.loadbalancers.iter().any(|r| r.id == lb_id));
        let mut tree = ObservedTree::default();
        let defaults: BTreeSet<&str> = listeners.iter().filter_map(|l| l.default_pool_id.as_deref()).collect();
        for p in &pools {
            if !defaults.contains(p.id.as_str()) {
                tree.stray_pools.push(p.id.clone());
            }
        }
        for l in &listeners {
            let pool = match l.default_pool_id.as_deref().and_then(|id| pools.iter().find(|p| p.id == id)) {
                Some(p) => {
                    t.calls += 1;
                    let members = self
                        .octavia
                        .list_members(&p.id, &Filter::new())
                        .await
                        .map_err(|e| os_fail("listing members", &e, Some(lb_id)))?;
                    Some(ObservedPool {
                        id: p.id.clone(),
                        persistence: p.session_persistence.clone(),
                        members: ObservedPool::member_set(
                            members.iter().map(|m| (m.address.as_str(), m.protocol_port)),
                        ),
                    })
                }
                None => None,
            };
            tree.listeners.push(ObservedListener {
                id: l.id.clone(),
                protocol: l.protocol,
                port: l.protocol_port,
                pool,
            });
        }
        Ok(tree)
    }

    /// One fully-populated create; waits for ACTIVE.
    pub(super) async fn create(&self, want: &DesiredLb, uid: &str, t: &mut Tally) -> Result<Known, BackendError> {
        self.still_mine_for(want)?;
        let mut body = want.create_body(&self.shape);
        if self.vip_port_precreate {
            let network = self.shape.vip_network_id.clone().unwrap_or_default();
            let port = crate::backend::octavia::fip::ensure_vip_port(
                &self.neutron,
                &network,
                &self.shape.vip_subnet_id,
                &want.vip_address,
                &want.name,
                &want.tags,
            )
            .await
            .map_err(|e| os_fail("creating the VIP port", &e, None))?;
            body.vip_port_id = Some(port.id);
        }
        t.calls += 1;
        t.changes += 1;
        let accepted = Instant::now();
        let lb = self
            .octavia
            .create_load_balancer(body)
            .await
            .map_err(|e| os_fail("creating the load balancer", &e, None))?;
        self.metrics.changed("lb_create");
        tracing::info!(lb = lb.id, name = want.name, listeners = want.listeners.len(), "load balancer created");
        let lb = match self.wait_settled(&lb.id, "lb_create", want.member_count(), t).await? {
            Some(lb) if lb.provisioning_status == ProvisioningStatus::Active => lb,
            Some(lb) => {
                // Left for the next attempt to replace (adopt deletes an ERROR load balancer).
                return Err(fail(
                    "error_state",
                    format!("load balancer {} went to {:?} after create", lb.id, lb.provisioning_status),
                    Some(Observed {
                        provisioning_status: "ERROR".into(),
                        backend_id: lb.id,
                        message: "ERROR after create; replacing it".into(),
                        ..Default::default()
                    }),
                ));
            }
            None => return Err(fail("gone", format!("load balancer {} disappeared while being created", lb.id), None)),
        };
        tracing::debug!(lb = lb.id, took_ms = accepted.elapsed().as_millis() as u64, "created load balancer ACTIVE");
        // The ids of what the create built: one list; members and persistence are as asked.
        t.calls += 1;
        let listeners = self
            .octavia
            .list_listeners(&Filter::new().eq("loadbalancer_id", lb.id.as_str()))
            .await
            .map_err(|e| os_fail("listing listeners", &e, Some(&lb.id)))?;
        let mut tree = ObservedTree::default();
        for l in listeners.into_iter().filter(|l| l.loadbalancers.iter().any(|r| r.id == lb.id)) {
            let w = want.listeners.iter().find(|w| w.protocol == l.protocol && w.port == l.protocol_port);
            let pool = match (l.default_pool_id, w) {
                (Some(id), Some(w)) => Some(built_pool(id, w)),
                _ => None,
            };
            tree.listeners.push(ObservedListener { id: l.id, protocol: l.protocol, port: l.protocol_port, pool });
        }
        Ok(Known {
            uid: uid.to_string(),
            lb_id: lb.id.clone(),
            vip_address: lb.vip_address.clone().unwrap_or_else(|| want.vip_address.clone()),
            vip_port_id: lb.vip_port_id.clone(),
            generation: 0,
            tree,
            fip: None,
        })
    }

    /// The Service's ingress: a floating IP on the VIP port for type=LoadBalancer when a
    /// floating network is configured; none otherwise (and any left from before is removed).
    pub(super) async fn ensure_ingress(
        &self,
        key: &str,
        spec: &LoadBalancerSpec,
        want: &DesiredLb,
        known: &mut Known,
        _t: &mut Tally,
    ) -> Result<(), BackendError> {
        let Some(network) = &self.floating_network_id else { return Ok(()) };
        if spec.service_type != "LoadBalancer" {
            if known.fip.take().is_some() || known.generation == 0 {
                crate::backend::octavia::fip::delete(&self.neutron, &self.shape.cluster, key)
                    .await
                    .map_err(|e| os_fail("deleting the floating IP", &e, Some(&known.lb_id)))?;
            }
            return Ok(());
        }
        let port = known.vip_port_id.clone().filter(|p| !p.is_empty()).ok_or_else(|| {
            fail("no_vip_port", format!("load balancer {} has no VIP port for a floating IP", known.lb_id), None)
        })?;
        let fip = crate::backend::octavia::fip::ensure(&self.neutron, network, &want.tags, &port, &known.vip_address)
            .await
            .map_err(|e| os_fail("giving the VIP a floating IP", &e, Some(&known.lb_id)))?;
        known.fip = Some((fip.id, fip.floating_ip_address));
        Ok(())
    }
}

fn canonical(addr: &str) -> String {
    addr.parse::<std::net::IpAddr>().map(|a| a.to_string()).unwrap_or_else(|_| addr.to_string())
}
