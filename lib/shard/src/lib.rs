//! Splitting a service's work between its replicas through Kubernetes Leases
//! (coordination.k8s.io/v1), so that any number of replicas run at once, each doing its part,
//! and a replica that dies has its part taken over by the others.
//!
//! - **Shards** ([`hash`]): a key (a node name for VIFs, `namespace/name` for load balancers)
//!   belongs to shard `fnv1a64(key) % shards`.
//! - **Leases** ([`lease`]), in one namespace: `<service>-shard-<i>` per shard, held by the
//!   replica working on it, and `<service>-member-<identity>` per live replica. Both carry the
//!   holder's gRPC endpoint in the annotation `kuryr.openstack.org/endpoint`, so that others can
//!   route a shard's work to its owner.
//! - **Rounds**, every fifth of the Lease duration: the service's Leases read from a watch
//!   (listed instead when the watch does not show the replica's own last write); the
//!   membership renewed, which keeps the replica's shards alive too (a shard Lease is written
//!   when it is taken, released, or worked on again after a restart or a fence, so a steady
//!   round costs one write whatever the number of shards); free or expired ones
//!   taken up to the fair share `ceil(shards / live replicas)`; shards beyond it released (work
//!   stops first), so a new replica gets work promptly ([`plan`]). Every write carries the
//!   resourceVersion read, so two replicas never both win a Lease. While a live replica of an
//!   earlier version (which renewed every shard Lease every round, and judges them so) is about,
//!   the held shard Leases are renewed every round as well.
//! - **Fencing by time**: a shard whose holder's membership was not renewed within the duration
//!   minus one renewal interval is let go at once, before any other replica may take it; so is
//!   one whose confirming write lost a race.
//! - **Shutdown**: everything is released and the membership Lease deleted, so the others take
//!   over at once instead of after a duration.
//!
//! The service reads the [`Ownership`] from a watch channel ([`ShardHandle::ownership`]):
//! which shards it owns, and who owns every other one. With `--shards 0` nothing runs, no
//! Lease is written, and the replica owns everything.
//! A service joins through [`Joining`]: it is built with Joining's channel before it has a
//! Kubernetes client, joins once it has one, and waits for the release at shutdown.

pub mod config;
pub mod hash;
pub mod joining;
pub mod lease;
pub mod metrics;
pub mod ownership;
pub mod plan;
pub mod refusal;
pub mod served;

pub use config::{ShardArgs, ShardConfig};
pub use hash::shard_of;
pub use joining::Joining;
pub use lease::{ENDPOINT_ANNOTATION, ShardHandle, start};
pub use metrics::ShardMetrics;
pub use ownership::{Owner, Ownership};
pub use refusal::{OWNER_METADATA, refusal};
pub use served::Served;
