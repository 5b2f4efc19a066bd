//! The pure part of kuryr-policy: the watcher's events, already converted at the edge
//! ([`crate::grpc::convert`]) into the compiler's model ([`Change`]), compiled by
//! [`kuryr_policy_core`] into each node's state and written to the log WatchPolicies streams
//! ([`publish`]), and each policy's status in words ([`status`]). No Kubernetes client, no gRPC,
//! no protobuf: everything here is unit-tested without I/O.

pub mod publish;
pub mod status;

use kuryr_policy_core::{Compiler, Namespace, NetworkPolicy, Pod};

/// The kind of a watched object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Pod,
    Namespace,
    NetworkPolicy,
    /// A kind the compiler does not read (its wire number).
    Other(i32),
}

/// A watched object by kind, namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ObjKey {
    pub kind: Kind,
    pub namespace: String,
    pub name: String,
}

/// An object as the compiler reads it.
#[derive(Clone, Debug)]
pub enum Object {
    Pod(Pod),
    Namespace(Namespace),
    /// A NetworkPolicy with its uid, or why its spec cannot be read at all.
    NetworkPolicy {
        uid: String,
        policy: Result<NetworkPolicy, String>,
    },
    /// A body that does not match its kind, or of a kind not compiled.
    Unreadable,
}

/// One event of the watcher's stream.
#[derive(Clone, Debug)]
pub enum Change {
    /// The watcher cannot resume: a new snapshot follows.
    Reset,
    /// The snapshot is complete.
    SnapshotComplete,
    /// An object was created or changed.
    Applied(ObjKey, Object),
    /// An object was deleted.
    Deleted(ObjKey),
    /// Nothing to compile (a heartbeat, an event without its object).
    None,
}

/// What is handed the compiled state after every change besides the log (the Neutron backend,
/// [`crate::backend::neutron`]).
pub trait Enforcer: std::fmt::Debug + Send + Sync {
    /// The compiler after a change of policies or pods.
    fn compiled(&self, compiler: &Compiler);
}
