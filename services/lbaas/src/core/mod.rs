//! The pure part of lbaas: what a Service's load balancer should be ([`spec`], as a [`lb`]
//! spec) and the view of Services and EndpointSlices ([`input`]) it is computed from ([`view`]).
//! No Kubernetes client, no gRPC server, no backend, no protobuf: the edges convert the
//! `kuryr.watcher.v1` / `kuryr.lbaas.v1` messages to and from these types, and everything here
//! is unit-tested without I/O.

pub mod input;
pub mod lb;
pub mod spec;
pub mod view;

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks a mutex of plain collections; a panic elsewhere cannot leave them inconsistent.
pub fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An error and its causes on one line, for logs and Events.
pub use kuryr_runtime::telemetry::error_chain as chain;
