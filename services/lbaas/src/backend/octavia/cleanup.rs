//! Removing load balancers (a Service's, or one found twice), and the background maintenance:
//! drift repair and garbage collection of load balancers whose Service is gone, for the shards
//! served here.

use super::*;

/// How often garbage collection looks whether the Services are known yet.
const SETTLE_POLL: Duration = Duration::from_millis(100);

impl Inner {
    /// Deletes a load balancer with everything in it and waits until it is gone.
    pub(super) async fn delete_lb(&self, id: &str, t: &mut Tally) -> Result<(), BackendError> {
        // Immutable while PENDING: wait that out first (the client would retry 409 only briefly).
        match self.wait_settled(id, "", 0, t).await? {
            None => return Ok(()),
            Some(lb) if lb.provisioning_status == ProvisioningStatus::Deleted => return Ok(()),
            Some(_) => {}
        }
        t.calls += 1;
        t.changes += 1;
        match self.octavia.delete_load_balancer(id, true).await {
            Ok(_) => {}
            Err(e) => return Err(os_fail("deleting the load balancer", &e, Some(id))),
        }
        self.metrics.changed("lb_delete");
        match self.wait_settled(id, "", 0, t).await? {
            None => Ok(()),
            Some(lb) if lb.provisioning_status == ProvisioningStatus::Deleted => Ok(()),
            Some(lb) => Err(fail(
                "error_state",
                format!("load balancer {id} is {:?} after a cascade delete", lb.provisioning_status),
                None,
            )),
        }
    }

    /// Removes every load balancer (and floating IP) of the Service `key`, whatever its uid.
    pub(super) async fn delete_service(&self, key: &str, t: &mut Tally) -> Result<(), BackendError> {
        let filter = self.filter_tags(&[plan::cluster_tag(&self.shape.cluster), format!("{}{key}", plan::TAG_SERVICE)]);
        t.calls += 1;
        let found =
            self.octavia.list_load_balancers(&filter).await.map_err(|e| os_fail("listing load balancers", &e, None))?;
        for lb in found {
            self.delete_lb(&lb.id, t).await?;
            tracing::info!(service = key, lb = lb.id, "load balancer deleted (cascade)");
        }
        if self.floating_network_id.is_some() {
            crate::backend::octavia::fip::delete(&self.neutron, &self.shape.cluster, key)
                .await
                .map_err(|e| os_fail("deleting the floating IP", &e, None))?;
        }
        if self.vip_port_precreate {
            crate::backend::octavia::fip::delete_vip_ports(&self.neutron, &self.shape.cluster, key)
                .await
                .map_err(|e| os_fail("deleting the VIP port", &e, None))?;
        }
        Ok(())
    }

    /// Garbage collection at start and when shards are gained, drift repair every interval,
    /// until shutdown.
    pub(super) async fn maintenance(self: Arc<Self>, ctx: Maintenance) {
        let mut first = true;
        let mut next_repair = Instant::now() + self.drift_interval;
        loop {
            let mut repair = false;
            if !first {
                tokio::select! {
                    () = tokio::time::sleep_until(next_repair) => {
                        repair = true;
                        next_repair = Instant::now() + self.drift_interval;
                    }
                    () = ctx.kick.notified() => {}
                    () = ctx.shutdown.clone().wait() => return,
                }
            }
            first = false;
            tokio::select! {
                () = self.maintenance_pass(&ctx, repair) => {}
                () = ctx.shutdown.clone().wait() => return,
            }
        }
    }

    pub(super) async fn maintenance_pass(&self, ctx: &Maintenance, repair: bool) {
        // An orphan is told from a Service not reconciled yet by the Services: known first.
        while !locked(&ctx.view).settled() {
            tokio::time::sleep(SETTLE_POLL).await;
        }
        let mut t = Tally::default();
        let filter = self.filter_tags(&[plan::cluster_tag(&self.shape.cluster)]);
        t.calls += 1;
        let lbs = match self.octavia.list_load_balancers(&filter).await {
            Ok(l) => l,
            Err(e) => {
                self.metrics.maintenance_failed();
                tracing::warn!(
                    error = chain(&e),
                    "listing this cluster's load balancers failed; next pass in {:?}",
                    self.drift_interval
                );
                return;
            }
        };
        // Listed first, records read after: a load balancer is only created once its record is in.
        let wanted: HashMap<String, String> = locked(&ctx.records)
            .iter()
            .filter(|(_, r)| r.spec.backend == NAME)
            .map(|(k, r)| (k.clone(), r.spec.service_uid.clone()))
            .collect();
        for lb in &lbs {
            let owner = plan::owner(&lb.tags);
            let verdict = collect(
                owner.as_ref(),
                lb.provisioning_status == ProvisioningStatus::PendingDelete,
                &wanted,
                &*ctx.serves,
                |key, uid| locked(&ctx.view).holds(key, uid),
            );
            match verdict {
                Verdict::Keep => {}
                Verdict::Reconcile(key) => (ctx.enqueue)(&key),
                Verdict::Delete => {
                    tracing::info!(lb = lb.id, name = lb.name, owner = ?owner, "deleting a load balancer whose Service is gone");
                    if let Err(e) = self.delete_lb(&lb.id, &mut t).await {
                        self.metrics.maintenance_failed();
                        tracing::warn!(lb = lb.id, error = chain(&e), "deleting an orphaned load balancer failed");
                    } else {
                        self.metrics.orphans_deleted.inc();
                    }
                }
            }
        }
        if repair {
            // Every Service is reconciled at its generation: each reads its tree back and
            // repairs what was changed or deleted behind lbaas' back.
            for key in wanted.keys() {
                (ctx.enqueue)(key);
            }
            self.metrics.drift_passes.inc();
        }
    }
}

/// What garbage collection does with one load balancer of this cluster.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Its Service's (recorded), another replica's, or being deleted already.
    Keep,
    /// Its Service is here without a record yet (a load balancer made before this lbaas ran, or
    /// Kuryr's adopted by a migration): its reconcile decides.
    Reconcile(String),
    /// Its Service is gone (or it names none).
    Delete,
}

/// The verdict on a load balancer owned by `owner` (`(namespace/name, uid)` from its tags),
/// given the recorded Services (`wanted`: key → uid), the keys this replica serves, and which
/// Services the watcher's complete snapshot holds.
fn collect(
    owner: Option<&(String, String)>,
    pending_delete: bool,
    wanted: &HashMap<String, String>,
    serves: &dyn Fn(&str) -> bool,
    holds: impl Fn(&str, &str) -> bool,
) -> Verdict {
    // Only in served shards: a load balancer of another replica's shard is not an orphan (one
    // without an owner tag belongs to the shard of the empty key).
    if !serves(owner.map_or("", |(key, _)| key.as_str())) {
        return Verdict::Keep;
    }
    match owner {
        Some((key, uid)) if wanted.get(key) == Some(uid) => Verdict::Keep,
        Some((key, uid)) if holds(key, uid) => Verdict::Reconcile(key.clone()),
        _ if pending_delete => Verdict::Keep,
        _ => Verdict::Delete,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(key: &str, uid: &str) -> (String, String) {
        (key.to_string(), uid.to_string())
    }

    #[test]
    fn garbage_collection_deletes_only_what_no_service_holds() {
        let wanted = HashMap::from([("ns/recorded".to_string(), "u1".to_string())]);
        let all = |_: &str| true;
        let present = |key: &str, uid: &str| (key, uid) == ("ns/adopted", "u2") || (key, uid) == ("ns/recorded", "u1");
        let verdict = |o: Option<&(String, String)>, pending: bool| collect(o, pending, &wanted, &all, present);

        let (recorded, adopted, gone) = (owner("ns/recorded", "u1"), owner("ns/adopted", "u2"), owner("ns/gone", "u3"));
        assert_eq!(verdict(Some(&recorded), false), Verdict::Keep);
        // A record-less load balancer of a Service that is there: its reconcile decides.
        assert_eq!(verdict(Some(&adopted), false), Verdict::Reconcile("ns/adopted".into()));
        // The Service is gone, or its name is now another Service's (another uid).
        assert_eq!(verdict(Some(&gone), false), Verdict::Delete);
        assert_eq!(verdict(Some(&owner("ns/recorded", "old-uid")), false), Verdict::Delete);
        assert_eq!(verdict(None, false), Verdict::Delete);
        // Already being deleted: nothing to do.
        assert_eq!(verdict(Some(&gone), true), Verdict::Keep);
    }

    #[test]
    fn garbage_collection_leaves_other_replicas_shards_alone() {
        let wanted = HashMap::new();
        let only_a = |key: &str| key.starts_with("a/");
        let nothing = |_: &str, _: &str| false;
        let (mine, theirs) = (owner("a/svc", "u"), owner("b/svc", "u"));
        assert_eq!(collect(Some(&mine), false, &wanted, &only_a, nothing), Verdict::Delete);
        assert_eq!(collect(Some(&theirs), false, &wanted, &only_a, nothing), Verdict::Keep);
        // No owner tag: the shard of the empty key, not served here.
        assert_eq!(collect(None, false, &wanted, &only_a, nothing), Verdict::Keep);
    }
}
