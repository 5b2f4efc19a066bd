//! What every kuryr service that streams state needs, free of kube and tonic:
//!
//! - [`log`]: keyed state (the current value per key) plus a bounded history of the changes
//!   between them, numbered by a revision that only grows. A change is recorded only when a
//!   value really changed.
//! - [`epoch`]: resume points `"<epoch>-<revision>"`. The epoch is random per process, so a point
//!   handed out by another replica, or before a restart, never matches and leads to RESET and a
//!   fresh snapshot.
//! - [`feed`]: one task per subscriber that sends a snapshot (or, when resuming, only
//!   SNAPSHOT_COMPLETE), then the history from its cursor on, with heartbeats while there is
//!   nothing to send. Subscribers read the one shared history by revision, so memory does not
//!   grow with their number; a subscriber so far behind that its cursor left the history gets
//!   RESET and a fresh snapshot on the same stream.
//! - [`follow`]: the other end: one follower per stream that resumes after breaks, handles
//!   RESET, drops a stream silent for longer than its idle timeout, and reconnects with jittered
//!   backoff.
//! - [`backoff`]: the one retry backoff (exponential, full jitter) and the process-wide count of
//!   retries by component and reason.
//! - [`queue`]: a keyed work queue: work on one key is serial, different keys run in parallel,
//!   only the latest state matters, failures are retried with capped, jittered backoff.
//!
//! The core is generic over keys and values and knows nothing of kube, tonic or protobuf: the
//! services encode the events into their own gRPC messages (see [`feed::Subscriber`]) and read
//! them back at the gRPC edge (see [`follow::Source`]).

pub mod backoff;
pub mod epoch;
pub mod feed;
pub mod follow;
pub mod log;
pub mod queue;

pub use backoff::{Backoff, Jitter};
pub use epoch::Epoch;
pub use feed::{Event, How, Options, Subscriber};
pub use follow::{FollowConfig, Followed, Follower, Mark, Source};
pub use log::{Change, Delta, Lagged, Log, LogHandle, NotReady, SharedLog, Start};
pub use queue::{Outcome, WorkQueue};
