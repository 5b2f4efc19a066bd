//! The OpenStack client of kuryr-rs: Keystone v3 authentication, Neutron and Octavia.
//!
//! - [`config`]: `clouds.yaml` / `secure.yaml` / `OS_*` configuration, validated with errors that
//!   name the field at fault, and a no-Keystone mode with direct endpoints.
//! - [`Client`]: every call goes through tower layers — retries with exponential backoff and
//!   jitter ([`policy`]), the session (endpoint from the catalog, token, one re-authentication on
//!   401), a concurrency limit, per-attempt Prometheus [`metrics`], and a timeout.
//! - [`neutron`] and [`octavia`]: typed resource clients; [`Error`] tells callers what happened
//!   (not found, conflict, quota, unavailable...).
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use kuryr_openstack::{Client, ClientOptions, CloudConfig, ConfigSource, Filter, Metrics};
//! let config = CloudConfig::load(&ConfigSource::from_process(None))?;
//! let client = Client::new(&config, ClientOptions::default(), std::sync::Arc::new(Metrics::unregistered()))?;
//! let ports = client.network().list_ports(&Filter::new().device_owner("compute:kuryr")).await?;
//! # Ok(()) }
//! ```

pub mod auth;
pub mod client;
pub mod config;
pub mod error;
pub mod filter;
pub mod identity;
pub mod metrics;
pub mod neutron;
pub mod octavia;
pub mod policy;
mod resource;
pub mod service;
pub mod transport;

#[cfg(test)]
mod testserver;

pub use client::{Client, ClientOptions};
pub use config::{CloudConfig, ConfigError, ConfigSource};
pub use error::{Error, Fault};
pub use filter::Filter;
pub use metrics::Metrics;
pub use policy::RetryConfig;
pub use service::ServiceType;
pub use transport::{ApiRequest, ApiResponse};

use serde::Serialize;

/// An id as a URL path segment, refusing the empty id (which would turn `GET /ports/{id}` into a
/// list of every port).
pub(crate) fn require_id(kind: &str, id: &str) -> Result<String, Error> {
    if id.trim().is_empty() {
        return Err(Error::InvalidRequest(format!("empty {kind} id")));
    }
    Ok(path_segment(id))
}

/// Percent-encodes everything but RFC 3986 unreserved characters, so a tag like `a/b` stays one
/// path segment.
pub(crate) fn path_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Resources whose lists are paged by id.
pub(crate) trait HasId {
    fn id(&self) -> &str;
}

/// `{"<key>": value}`, the envelope of every Neutron and Octavia request body.
pub(crate) struct Wrap<'a, B> {
    key: &'static str,
    value: &'a B,
}

impl<'a, B> Wrap<'a, B> {
    pub fn new(key: &'static str, value: &'a B) -> Self {
        Self { key, value }
    }
}

impl<B: Serialize> Serialize for Wrap<'_, B> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(1))?;
        m.serialize_entry(self.key, self.value)?;
        m.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_encoded_and_empty_ids_refused() {
        assert_eq!(path_segment("kuryr.cluster=a/b c"), "kuryr.cluster%3Da%2Fb%20c");
        assert_eq!(require_id("port", "6f1c-4e").unwrap(), "6f1c-4e");
        let e = require_id("port", " ").unwrap_err();
        assert_eq!(e.to_string(), "invalid request: empty port id");
    }
}
