//! The Lease objects a round writes and what it reads of them: the labels and annotations,
//! a new Lease, a Lease renewed or taken.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;

use crate::config::ShardConfig;
use crate::plan::LeaseView;

/// The annotation holding the holder's endpoint, on shard and membership Leases.
pub const ENDPOINT_ANNOTATION: &str = "kuryr.openstack.org/endpoint";
/// The annotation of a membership Lease holding the replica's number of shards.
pub const SHARDS_ANNOTATION: &str = "kuryr.openstack.org/shards";
/// The annotation of a membership Lease saying how its holder keeps its shard Leases alive:
/// [`RENEWAL_BY_MEMBERSHIP`] (through the membership Lease, see [`crate::plan`]); replicas of
/// earlier versions do not write it and renew every shard Lease every round.
pub const RENEWAL_ANNOTATION: &str = "kuryr.openstack.org/shard-renewal";
/// The value of [`RENEWAL_ANNOTATION`] of replicas that renew their shards through their
/// membership.
pub const RENEWAL_BY_MEMBERSHIP: &str = "membership";
/// The label naming the service a Lease belongs to (the one list of a round selects on it).
pub const SET_LABEL: &str = "kuryr.openstack.org/shard-set";
/// The label telling shard Leases (`shard`) from membership Leases (`member`).
pub const ROLE_LABEL: &str = "kuryr.openstack.org/shard-role";

/// The role label's value on membership Leases.
pub(super) const MEMBER: &str = "member";
/// The role label's value on shard Leases.
pub(super) const SHARD: &str = "shard";

pub(super) fn now_micro() -> MicroTime {
    MicroTime(Timestamp::now())
}

pub(super) fn duration_seconds(d: Duration) -> i32 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(secs).unwrap_or(i32::MAX)
}

/// What a round reads of a Lease.
pub(super) fn view_of(l: &Lease) -> LeaseView {
    let spec = l.spec.clone().unwrap_or_default();
    LeaseView {
        holder: spec.holder_identity.filter(|h| !h.is_empty()),
        endpoint: l.metadata.annotations.as_ref().and_then(|a| a.get(ENDPOINT_ANNOTATION)).cloned(),
        renewed: spec.renew_time.map(|t| SystemTime::from(t.0)),
        duration: Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(0).max(1)).unwrap_or(1)),
        version: l.metadata.resource_version.clone().unwrap_or_default(),
    }
}

/// Whether a membership Lease says its holder keeps its shard Leases alive through it.
pub(super) fn renews_shards(l: &Lease) -> bool {
    l.metadata.annotations.as_ref().and_then(|a| a.get(RENEWAL_ANNOTATION)).map(String::as_str)
        == Some(RENEWAL_BY_MEMBERSHIP)
}

/// The annotations of this replica's membership Lease.
fn member_annotations(config: &ShardConfig, annotations: &mut BTreeMap<String, String>) {
    annotations.insert(SHARDS_ANNOTATION.to_string(), config.shards.to_string());
    annotations.insert(RENEWAL_ANNOTATION.to_string(), RENEWAL_BY_MEMBERSHIP.to_string());
}

/// A new Lease of `config`'s set, `role` [`MEMBER`] or [`SHARD`], held by `holder`.
pub(super) fn fresh(config: &ShardConfig, name: &str, role: &str, holder: Option<&str>) -> Lease {
    let now = now_micro();
    let mut annotations = BTreeMap::from([(ENDPOINT_ANNOTATION.to_string(), config.endpoint.clone())]);
    if role == MEMBER {
        member_annotations(config, &mut annotations);
    }
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(config.namespace.clone()),
            labels: Some(BTreeMap::from([
                (SET_LABEL.to_string(), config.service.clone()),
                (ROLE_LABEL.to_string(), role.to_string()),
            ])),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: holder.map(str::to_string),
            lease_duration_seconds: Some(duration_seconds(config.duration)),
            acquire_time: Some(now.clone()),
            renew_time: Some(now),
            lease_transitions: Some(0),
            ..Default::default()
        }),
    }
}

/// `l` renewed by this replica (taken, when `take`).
pub(super) fn renewed(config: &ShardConfig, mut l: Lease, take: bool) -> Lease {
    let now = now_micro();
    let spec = l.spec.get_or_insert_with(Default::default);
    let me = config.identity.clone();
    if take && spec.holder_identity.as_deref() != Some(me.as_str()) {
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        spec.acquire_time = Some(now.clone());
    }
    spec.holder_identity = Some(me);
    spec.renew_time = Some(now);
    spec.lease_duration_seconds = Some(duration_seconds(config.duration));
    l.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(ENDPOINT_ANNOTATION.to_string(), config.endpoint.clone());
    l
}

/// This replica's membership Lease `l` renewed (and claimed, if another identity held it).
pub(super) fn member_renewed(config: &ShardConfig, l: Lease) -> Lease {
    let mut l = renewed(config, l, true);
    member_annotations(config, l.metadata.annotations.get_or_insert_with(Default::default));
    l
}
