//! What every kuryr service that streams state needs, free of kube and tonic:
//!
//! - [`log`]: keyed state (the current value per key) plus a bounded history of the changes
//!   between them, numbered by a revision that only grows. A change is recorded only when a
//!   value really changed.
//! - [`epoch`]: resume points `"<epoch>-<revision>"`. The epoch is random per process, so a point
//!   handed out by another replica, or before a restart, never matches and leads to RESET and a
//!   fresh snapshot.
//! - [`feed`]: one task per subscriber that sends a snapshot (or nothing, when resuming), then
//!   the history from its cursor on. Subscribers read the one shared history by revision, so
//!   memory does not grow with their number; a subscriber so far behind that its cursor left the
//!   history gets RESET and a fresh snapshot on the same stream.
//! - [`queue`]: a keyed work queue: work on one key is serial, different keys run in parallel,
//!   only the latest state matters, failures are retried with capped, jittered backoff.
//!
//! The services encode the events into their own gRPC messages (see [`feed::Subscriber`]).

pub mod epoch;
pub mod feed;
pub mod log;
pub mod queue;

pub use epoch::Epoch;
pub use feed::{Event, How, Subscriber};
pub use log::{Change, Delta, Lagged, Log, NotReady, SharedLog, Start};
pub use queue::{Outcome, WorkQueue};
