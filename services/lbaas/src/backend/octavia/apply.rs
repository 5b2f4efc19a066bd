//! Applying planned steps to Octavia, one change at a time: each change is followed by a wait
//! until the load balancer is ACTIVE again ([`super::poll`]), and its outcome told apart
//! (ACTIVE, ERROR, or the call failed).

use super::*;

impl Inner {
    /// Makes one change and waits for ACTIVE, updating `tree` to match.
    pub(super) async fn apply(
        &self,
        lb_id: &str,
        want: &DesiredLb,
        step: Step,
        tree: &mut ObservedTree,
        t: &mut Tally,
    ) -> Result<(), Applied> {
        let kind = step.kind();
        let failed = |doing: &str, e: OsError| Applied::Failed(os_fail(doing, &e, Some(lb_id)));
        self.still_mine_for(want).map_err(|m| Applied::Failed(m.into()))?;
        t.calls += 1;
        t.changes += 1;
        // Members added and removed: Octavia's work, and so the poll schedule, grows with it.
        let mut size = 0;
        match step {
            Step::DeletePool { id } => {
                self.octavia.delete_pool(&id).await.map_err(|e| failed("deleting a pool", e))?;
                tree.stray_pools.retain(|p| *p != id);
                for l in &mut tree.listeners {
                    if l.pool.as_ref().is_some_and(|p| p.id == id) {
                        l.pool = None;
                    }
                }
            }
            Step::DeleteListener { id, name } => {
                self.octavia.delete_listener(&id).await.map_err(|e| failed(&format!("deleting listener {name}"), e))?;
                tree.listeners.retain(|l| l.id != id);
            }
            Step::CreateListener(w) => {
                // Octavia 19 fails (500) on a default pool inside a single listener create: the
                // listener first, then its pool (and members) as the next changes.
                let mut body = w.listener_create(&want.tags, Some(lb_id.to_string()));
                body.default_pool = None;
                let l = self
                    .octavia
                    .create_listener(&body)
                    .await
                    .map_err(|e| failed(&format!("creating listener {}", w.name), e))?;
                tree.listeners.push(ObservedListener {
                    id: l.id.clone(),
                    protocol: l.protocol,
                    port: l.protocol_port,
                    pool: None,
                });
                self.metrics.changed(kind);
                self.settle_change(lb_id, kind, 0, t).await?;
                let step = Step::CreatePool { listener_id: l.id, listener: w };
                return Box::pin(self.apply(lb_id, want, step, tree, t)).await;
            }
            Step::CreatePool { listener_id, listener: w } => {
                // Octavia 19 fails (500) on members inside a single pool create: the pool first,
                // then its members as a second change.
                let mut body = w.pool_create(&want.tags, Some(listener_id.clone()));
                body.members.clear();
                let p = self
                    .octavia
                    .create_pool(&body)
                    .await
                    .map_err(|e| failed(&format!("creating pool {}", w.name), e))?;
                let mut pool = built_pool(p.id.clone(), &w);
                pool.members.clear();
                if let Some(l) = tree.listeners.iter_mut().find(|l| l.id == listener_id) {
                    l.pool = Some(pool);
                }
                if !w.members.is_empty() {
                    self.metrics.changed(kind);
                    self.settle_change(lb_id, kind, 0, t).await?;
                    let step = Step::ReplaceMembers { pool_id: p.id, name: w.name.clone(), members: w.members.clone() };
                    return Box::pin(self.apply(lb_id, want, step, tree, t)).await;
                }
            }
            Step::UpdatePersistence { pool_id, persistence } => {
                self.update_persistence(&pool_id, persistence.as_ref())
                    .await
                    .map_err(|e| failed("updating a pool", e))?;
                if let Some(p) = tree.listeners.iter_mut().filter_map(|l| l.pool.as_mut()).find(|p| p.id == pool_id) {
                    p.persistence = persistence;
                }
            }
            Step::ReplaceMembers { pool_id, name, members } => {
                self.octavia
                    .replace_members(&pool_id, &members)
                    .await
                    .map_err(|e| failed(&format!("updating the members of {name}"), e))?;
                let new = ObservedPool::member_set(members.iter().map(|m| (m.address.as_str(), m.protocol_port)));
                match tree.listeners.iter_mut().filter_map(|l| l.pool.as_mut()).find(|p| p.id == pool_id) {
                    Some(p) => {
                        size = p.members.symmetric_difference(&new).count();
                        p.members = new;
                    }
                    None => size = new.len(),
                }
            }
        }
        self.metrics.changed(kind);
        self.settle_change(lb_id, kind, size, t).await
    }

    /// Waits for the load balancer to be ACTIVE after a change of `kind`.
    pub(super) async fn settle_change(
        &self,
        lb_id: &str,
        kind: &'static str,
        size: usize,
        t: &mut Tally,
    ) -> Result<(), Applied> {
        match self.wait_settled(lb_id, kind, size, t).await.map_err(Applied::Failed)? {
            Some(lb) if lb.provisioning_status == ProvisioningStatus::Active => Ok(()),
            Some(_) => Err(Applied::LbError),
            None => {
                Err(Applied::Failed(fail("gone", format!("load balancer {lb_id} was deleted during a change"), None)))
            }
        }
    }

    pub(super) async fn update_persistence(
        &self,
        pool_id: &str,
        p: Option<&SessionPersistence>,
    ) -> Result<(), OsError> {
        let body = serde_json::json!({"pool": {"session_persistence": p}});
        let req = ApiRequest::with_json(
            ServiceType::LoadBalancer,
            "pools.update",
            reqwest::Method::PUT,
            format!("/lbaas/pools/{pool_id}"),
            &body,
        )?
        .retry_on_conflict();
        self.client.send(req).await.map(drop)
    }

    /// Polls the load balancer until it leaves PENDING_*: `Some` as it then is (ACTIVE or
    /// ERROR), `None` when it is gone. `kind` labels the time-to-ACTIVE metric (empty: not ours);
    /// with `size` (members added and removed) it picks the learnt poll schedule.
    pub(super) async fn wait_settled(
        &self,
        id: &str,
        kind: &'static str,
        size: usize,
        t: &mut Tally,
    ) -> Result<Option<LoadBalancer>, BackendError> {
        let started = Instant::now();
        let deadline = started + self.active_timeout;
        let mut schedule = self.pacer.schedule(kind, size);
        tokio::time::sleep(schedule.first().min(self.active_timeout)).await;
        let mut last_poll = started;
        let mut first_poll = true;
        loop {
            t.calls += 1;
            let polled = Instant::now();
            let lb = match self.octavia.get_load_balancer(id).await {
                Ok(lb) => lb,
                Err(OsError::NotFound(_)) => return Ok(None),
                Err(e) => {
                    t.waited += started.elapsed();
                    return Err(os_fail("waiting for the load balancer", &e, Some(id)));
                }
            };
            if !lb.provisioning_status.is_pending() {
                let took = started.elapsed();
                t.waited += took;
                if !kind.is_empty() {
                    self.metrics.settled(kind, took, polled.duration_since(last_poll));
                    if lb.provisioning_status == ProvisioningStatus::Active {
                        self.pacer.observe(kind, size, polled.duration_since(started), first_poll);
                    }
                }
                return Ok(Some(lb));
            }
            last_poll = polled;
            first_poll = false;
            let now = Instant::now();
            if now >= deadline {
                t.waited += started.elapsed();
                let status = format!("{:?}", lb.provisioning_status);
                return Err(fail(
                    "timeout",
                    format!("load balancer {id} still {status} after {:?}", self.active_timeout),
                    Some(Observed {
                        provisioning_status: screaming(&status),
                        backend_id: id.to_string(),
                        message: format!(
                            "waiting for Octavia: still {} after {:?}",
                            screaming(&status),
                            self.active_timeout
                        ),
                        ..Default::default()
                    }),
                ));
            }
            tokio::time::sleep(schedule.next_gap().min(deadline - now)).await;
        }
    }
}

/// Why one change did not end ACTIVE.
pub(super) enum Applied {
    /// The load balancer went to ERROR.
    LbError,
    /// The change or the wait failed.
    Failed(BackendError),
}

pub(super) fn built_pool(id: String, w: &DesiredListener) -> ObservedPool {
    ObservedPool {
        id,
        persistence: w.persistence.clone(),
        members: ObservedPool::member_set(w.members.iter().map(|m| (m.address.as_str(), m.protocol_port))),
    }
}

/// `PendingUpdate` → `PENDING_UPDATE`.
fn screaming(debug: &str) -> String {
    let mut out = String::new();
    for (i, c) in debug.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::screaming;

    #[test]
    fn statuses_are_spelled_as_octavia_spells_them() {
        assert_eq!(screaming("PendingUpdate"), "PENDING_UPDATE");
        assert_eq!(screaming("Active"), "ACTIVE");
    }
}
