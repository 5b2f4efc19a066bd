//! The pure part of kuryr-policy: the watcher's events, already converted at the edge
//! ([`crate::grpc::convert`]) into the compiler's model ([`Change`]), compiled by
//! [`kuryr_policy_core`] into each node's state and written to the log WatchPolicies streams
//! ([`publish`]), and each policy's status in words ([`status`]). No Kubernetes client, no gRPC,
//! no protobuf: everything here is unit-tested without I/O.

pub mod publish;
pub mod status;

use std::collections::HashMap;
use std::net::IpAddr;

use kuryr_policy_core::{Compiler, Namespace, NetworkPolicy, Pod, PodKey};

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
    Pod(WatchedPod),
    Namespace(Namespace),
    /// A NetworkPolicy with its uid, or why its spec cannot be read at all.
    NetworkPolicy {
        uid: String,
        policy: Result<NetworkPolicy, String>,
    },
    /// A body that does not match its kind, or of a kind not compiled.
    Unreadable,
}

/// A pod as watched: the compiler's view (addresses from `status.podIPs`), its uid, and whether
/// it finished.
#[derive(Clone, Debug)]
pub struct WatchedPod {
    pub pod: Pod,
    pub uid: String,
    /// Phase Succeeded or Failed: its addresses may already be another pod's, so it has none
    /// (not even its VIF's).
    pub finished: bool,
}

/// A pod's addresses as its VIF record (the allocator's PodVif) holds them. They count for a
/// pod of that uid while its status has none yet: the kubelet reports a pod's addresses only
/// after its sandbox is up, and a pod a policy selects is isolated from the moment its VIF is
/// recorded, not from that later report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VifAddresses {
    /// The pod the VIF was allocated to.
    pub uid: String,
    /// Primary interface addresses.
    pub ips: Vec<IpAddr>,
}

/// A change of the recorded VIFs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VifChange {
    /// Every recorded VIF (a complete list), replacing what was known.
    Listed(HashMap<PodKey, VifAddresses>),
    /// One pod's VIF recorded or changed.
    Set(PodKey, VifAddresses),
    /// One pod's VIF record gone.
    Gone(PodKey),
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
