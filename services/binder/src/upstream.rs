//! Which allocator replica this node talks to. Allocator replicas split the nodes between them
//! (shards owned through Kubernetes Leases); a replica asked about a node it does not serve
//! answers UNAVAILABLE with the owner's `HOST:PORT` in the `kuryr-shard-owner` trailer. The
//! binder then talks to that owner — for its VIF stream and its plug reports — until the owner
//! cannot be reached, when it falls back to `--allocator` (which routes to any replica).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_runtime::auth::client::{Credentials, PeerChannel, with_credentials};

/// The gRPC metadata an allocator replica names a node's owner in.
pub const OWNER_METADATA: &str = "kuryr-shard-owner";

#[derive(Debug)]
struct Current {
    /// The owner's endpoint, when following a redirect; `None`: `--allocator`.
    owner: Option<String>,
    channel: PeerChannel,
}

/// A sharded service's replica this node follows (the same redirects): kuryr-policy's too.
pub type Upstream = Allocator;

/// The allocator this node follows; cheap to clone.
#[derive(Clone, Debug)]
pub struct Allocator {
    default: PeerChannel,
    current: Arc<Mutex<Current>>,
    /// What calls to an owner followed by redirect carry, as those to `default` do.
    credentials: Credentials,
}

impl Allocator {
    /// Talks to `default` (`--allocator`) until redirected; every call carries `credentials`.
    pub fn new(default: tonic::transport::Channel, credentials: Credentials) -> Self {
        let default = with_credentials(default, credentials.clone());
        let current = Current { owner: None, channel: default.clone() };
        Self { default, current: Arc::new(Mutex::new(current)), credentials }
    }

    fn lock(&self) -> MutexGuard<'_, Current> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A client of the allocator to talk to now.
    pub fn client(&self) -> VifAllocatorClient<PeerChannel> {
        VifAllocatorClient::new(self.lock().channel.clone())
    }

    /// The channel to talk to now (for clients of other services than the allocator).
    pub fn channel(&self) -> PeerChannel {
        self.lock().channel.clone()
    }

    /// The owner followed, if any (`None`: `--allocator`).
    pub fn owner(&self) -> Option<String> {
        self.lock().owner.clone()
    }

    /// Follows the redirect in `status`, if it names an owner other than the current one;
    /// returns the owner when it did.
    pub fn redirect(&self, status: &tonic::Status) -> Option<String> {
        let owner = status.metadata().get(OWNER_METADATA)?.to_str().ok()?.trim().to_string();
        let mut cur = self.lock();
        if owner.is_empty() || cur.owner.as_deref() == Some(owner.as_str()) {
            return None;
        }
        match kuryr_runtime::client::channel(&owner) {
            Ok(channel) => {
                let channel = with_credentials(channel, self.credentials.clone());
                *cur = Current { owner: Some(owner.clone()), channel };
                Some(owner)
            }
            Err(e) => {
                tracing::warn!(owner, error = %e, "the allocator named an unusable owner address; ignoring it");
                None
            }
        }
    }

    /// Back to `--allocator`; returns whether an owner was followed until now.
    pub fn fall_back(&self) -> bool {
        let mut cur = self.lock();
        let was = cur.owner.take().is_some();
        cur.channel = self.default.clone();
        was
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use tonic::metadata::MetadataMap;

    use super::*;

    fn redirect_to(endpoint: &str) -> tonic::Status {
        let mut md = MetadataMap::new();
        md.insert(OWNER_METADATA, endpoint.parse().unwrap());
        tonic::Status::with_metadata(tonic::Code::Unavailable, "elsewhere", md)
    }

    #[tokio::test]
    async fn follows_redirects_and_falls_back() {
        let a = Allocator::new(kuryr_runtime::client::channel("127.0.0.1:1").unwrap(), Credentials::None);
        assert_eq!(a.owner(), None);
        assert_eq!(a.redirect(&tonic::Status::unavailable("no trailer")), None);
        assert_eq!(a.redirect(&redirect_to("127.0.0.1:2")).as_deref(), Some("127.0.0.1:2"));
        assert_eq!(a.owner().as_deref(), Some("127.0.0.1:2"));
        assert_eq!(a.redirect(&redirect_to("127.0.0.1:2")), None, "already there");
        assert!(a.fall_back());
        assert!(!a.fall_back());
        assert_eq!(a.owner(), None);
    }
}
