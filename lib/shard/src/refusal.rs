//! What a replica answers for a key another replica serves: UNAVAILABLE saying why, and, when the
//! owner is known, its endpoint in the `kuryr-shard-owner` trailer so that the client reconnects
//! there. One answer for every sharded service (the allocator's WatchVifs, kuryr-policy's
//! WatchPolicies).

use tonic::Status;
use tonic::metadata::{MetadataMap, MetadataValue};

use crate::Ownership;

/// The trailer naming the owner's endpoint in a refusal.
pub const OWNER_METADATA: &str = "kuryr-shard-owner";

/// The UNAVAILABLE telling a client of `service` that `node` is not served here now.
pub fn refusal(own: &Ownership, node: &str, service: &str) -> Status {
    let shard = own.shard_of(node).unwrap_or(0);
    match own.owner_of(node) {
        Some(o) if own.owns(node) => Status::unavailable(format!(
            "node {node} (shard {shard}) was just taken over by this replica ({}); retry in a moment",
            o.identity
        )),
        // Its Lease still names this replica, which let the shard go (released, or not renewed
        // in time): no redirect to itself; the next holder is known within a round.
        Some(o) if o.identity == own.identity => Status::unavailable(format!(
            "node {node} (shard {shard}) is being let go by this replica ({}); retry in a moment",
            o.identity
        )),
        Some(o) => {
            let endpoint = o.endpoint.clone().unwrap_or_default();
            let msg = format!(
                "node {node} is served by {service} replica {} at {} (shard {shard}); reconnect there",
                o.identity,
                if endpoint.is_empty() { "an unknown address" } else { endpoint.as_str() }
            );
            let mut md = MetadataMap::new();
            if let Ok(v) = MetadataValue::try_from(endpoint.as_str())
                && !endpoint.is_empty()
            {
                md.insert(OWNER_METADATA, v);
            }
            Status::with_metadata(tonic::Code::Unavailable, msg, md)
        }
        None if !own.ready => Status::unavailable(format!("{service} does not know its shards yet")),
        None => Status::unavailable(format!(
            "node {node} (shard {shard}) has no owner right now; another replica takes it over within the Lease duration"
        )),
    }
}
