//! Finding another kuryr service without cluster DNS (feature `kube`).
//!
//! kuryr's control plane runs on the host network and must come up before the pod network — and so
//! before cluster DNS, which runs in pods — exists. A target `k8s:[NAMESPACE/]SERVICE:PORT` names a
//! Kubernetes Service instead of an address: the client watches that Service's EndpointSlices and
//! balances calls over its ready endpoints, adding and removing them as the slices change (the way
//! Calico's nodes find Typha). `PORT` is the Service port's name (`grpc`) or number; `NAMESPACE`
//! defaults to the client's namespace (in a pod: its own). Every other target form is handed to
//! [`crate::client::channel`] unchanged.
//!
//! Calls made while the Service has no ready endpoint wait for one (within their deadline). The
//! watch is restarted with backoff after errors, so an API server outage only freezes the set of
//! endpoints that was last seen.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use kube::runtime::{WatchStreamExt, watcher as watch};
use tonic::transport::channel::Change;
use tonic::transport::{Channel, Endpoint};

/// The prefix of a target that names a Kubernetes Service.
pub const SCHEME: &str = "k8s:";
/// The label EndpointSlices carry with their Service's name.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Endpoint changes buffered between the watch and the balancer.
const CHANGES: usize = 64;
/// First retry delay when no Kubernetes client can be built; doubles up to 30 s.
const CLIENT_RETRY_MIN: Duration = Duration::from_millis(500);
const CLIENT_RETRY_MAX: Duration = Duration::from_secs(30);

/// A Service port: by name or by number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortRef {
    /// `spec.ports[].name`.
    Name(String),
    /// The port number the endpoints listen on.
    Number(u16),
}

/// A parsed `k8s:[NAMESPACE/]SERVICE:PORT` target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceTarget {
    /// `None`: the client's default namespace.
    pub namespace: Option<String>,
    /// The Service's name.
    pub service: String,
    /// Which of its ports.
    pub port: PortRef,
}

impl fmt::Display for ServiceTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(SCHEME)?;
        if let Some(ns) = &self.namespace {
            write!(f, "{ns}/")?;
        }
        match &self.port {
            PortRef::Name(n) => write!(f, "{}:{n}", self.service),
            PortRef::Number(n) => write!(f, "{}:{n}", self.service),
        }
    }
}

/// Why a `k8s:` target does not parse.
#[derive(Debug, thiserror::Error)]
#[error("`{target}`: {why} (expected k8s:[NAMESPACE/]SERVICE:PORT, PORT a port name or number)")]
pub struct ParseError {
    target: String,
    why: &'static str,
}

impl FromStr for ServiceTarget {
    type Err = ParseError;

    fn from_str(target: &str) -> Result<Self, Self::Err> {
        let err = |why| ParseError { target: target.to_string(), why };
        let rest = target.strip_prefix(SCHEME).ok_or_else(|| err("does not start with k8s:"))?;
        let rest = rest.strip_prefix("//").unwrap_or(rest);
        let (name, port) = rest.rsplit_once(':').ok_or_else(|| err("no :PORT"))?;
        let (namespace, service) = match name.split_once('/') {
            Some((ns, svc)) => (Some(ns), svc),
            None => (None, name),
        };
        let dns_label = |s: &str| {
            !s.is_empty()
                && s.len() <= 63
                && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !s.starts_with('-')
                && !s.ends_with('-')
        };
        if let Some(ns) = namespace
            && !dns_label(ns)
        {
            return Err(err("the namespace is not a DNS label"));
        }
        if !dns_label(service) {
            return Err(err("the Service name is not a DNS label"));
        }
        let port = if port.bytes().all(|b| b.is_ascii_digit()) {
            match port.parse::<u16>() {
                Ok(n) if n > 0 => PortRef::Number(n),
                _ => return Err(err("the port number is out of range")),
            }
        } else if dns_label(port) {
            PortRef::Name(port.to_string())
        } else {
            return Err(err("the port is neither a number nor a port name"));
        };
        Ok(Self { namespace: namespace.map(str::to_string), service: service.to_string(), port })
    }
}

/// Whether `target` names a Kubernetes Service (`k8s:...`).
pub fn is_service_target(target: &str) -> bool {
    target.starts_with(SCHEME)
}

/// A channel to `target`: for `k8s:` targets, balanced over the Service's ready endpoints, found
/// with a Kubernetes client built from `kubeconfig` (or the environment, in a pod); otherwise
/// [`crate::client::channel`]. Must be called within a tokio runtime: the endpoint watch runs as
/// a task of its own, for as long as the channel (or a clone of it) is alive.
pub fn channel(target: &str, kubeconfig: Option<PathBuf>) -> anyhow::Result<Channel> {
    if !is_service_target(target) {
        return crate::client::channel(target);
    }
    let service: ServiceTarget = target.parse()?;
    let (channel, changes) = Channel::balance_channel::<SocketAddr>(CHANGES);
    tokio::spawn(async move {
        let mut backoff = kuryr_stream::Backoff::new("discover", CLIENT_RETRY_MIN, CLIENT_RETRY_MAX);
        let client = loop {
            match crate::kube_client(kubeconfig.as_deref()).await {
                Ok(c) => break c,
                Err(e) => {
                    let delay = backoff.next_delay("kube-client");
                    tracing::warn!(target = %service, error = %e, retry_in = ?delay,
                        "no Kubernetes client to discover the service with");
                    tokio::time::sleep(delay).await;
                }
            }
        };
        follow(client, service, changes).await;
    });
    Ok(channel)
}

/// A channel to the peer that the flag `--{flag}` names (see [`channel`]), every call carrying
/// `credentials`; an unusable target is an error that names the flag.
pub fn peer(
    flag: &str,
    target: &str,
    kubeconfig: Option<PathBuf>,
    credentials: crate::auth::client::Credentials,
) -> anyhow::Result<crate::auth::client::PeerChannel> {
    let channel = channel(target, kubeconfig).map_err(|e| anyhow::anyhow!("--{flag}: {e}"))?;
    Ok(crate::auth::client::with_credentials(channel, credentials))
}

/// Like [`channel`], with a client the caller already has.
pub fn channel_with(target: &str, client: kube::Client) -> anyhow::Result<Channel> {
    if !is_service_target(target) {
        return crate::client::channel(target);
    }
    let service: ServiceTarget = target.parse()?;
    let (channel, changes) = Channel::balance_channel::<SocketAddr>(CHANGES);
    tokio::spawn(follow(client, service, changes));
    Ok(channel)
}

/// Watches the Service's EndpointSlices and feeds the balancer the difference each time the set
/// of ready endpoints changes. Returns when the balancer is gone (every channel clone dropped).
async fn follow(
    client: kube::Client,
    service: ServiceTarget,
    changes: tokio::sync::mpsc::Sender<Change<SocketAddr, Endpoint>>,
) {
    let namespace = service.namespace.clone().unwrap_or_else(|| client.default_namespace().to_string());
    let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client, &namespace);
    // Watch calls shorter than the client's read timeout (a quiet Service is not a dead server).
    let config = crate::watch_config().labels(&format!("{SERVICE_NAME_LABEL}={}", service.service));
    let mut events = watch(api, config).default_backoff().boxed();
    let mut slices = Slices::default();
    let mut current: BTreeSet<SocketAddr> = BTreeSet::new();
    while let Some(ev) = events.next().await {
        match ev {
            Ok(ev) => {
                if !slices.apply(ev, &service.port) {
                    continue;
                }
            }
            Err(e) => {
                tracing::warn!(target = %service, error = %e, "watching the service's EndpointSlices");
                continue;
            }
        }
        let next = slices.endpoints();
        let (removed, added) = diff(&current, &next);
        for addr in removed {
            if changes.send(Change::Remove(addr)).await.is_err() {
                return;
            }
        }
        for addr in added {
            // The same connect timeout, call deadline and keepalive as any other kuryr channel.
            let endpoint = match crate::client::endpoint(&format!("http://{addr}")) {
                Ok(e) => e.tcp_nodelay(true),
                Err(e) => {
                    tracing::warn!(target = %service, %addr, error = %e, "unusable endpoint");
                    continue;
                }
            };
            if changes.send(Change::Insert(addr, endpoint)).await.is_err() {
                return;
            }
        }
        if next != current {
            let list = next.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
            tracing::info!(target = %service, endpoints = list, "service endpoints changed");
        }
        current = next;
    }
}

/// What is returned by [`diff`]: (removed, added).
fn diff(current: &BTreeSet<SocketAddr>, next: &BTreeSet<SocketAddr>) -> (Vec<SocketAddr>, Vec<SocketAddr>) {
    (current.difference(next).copied().collect(), next.difference(current).copied().collect())
}

/// The ready endpoints of each EndpointSlice, by slice name; the set being re-listed is kept
/// apart until the list is complete, so a re-list never empties the balancer in between.
#[derive(Debug, Default)]
struct Slices {
    live: BTreeMap<String, Vec<SocketAddr>>,
    relist: Option<BTreeMap<String, Vec<SocketAddr>>>,
}

impl Slices {
    /// Applies one watch event; returns whether the live set may have changed.
    fn apply(&mut self, ev: Event<EndpointSlice>, port: &PortRef) -> bool {
        match ev {
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            Event::InitApply(s) => {
                if let Some(r) = self.relist.as_mut() {
                    r.insert(name_of(&s), ready_endpoints(&s, port));
                }
                false
            }
            Event::InitDone => {
                self.live = self.relist.take().unwrap_or_default();
                true
            }
            Event::Apply(s) => {
                self.live.insert(name_of(&s), ready_endpoints(&s, port));
                true
            }
            Event::Delete(s) => {
                self.live.remove(&name_of(&s));
                true
            }
        }
    }

    fn endpoints(&self) -> BTreeSet<SocketAddr> {
        self.live.values().flatten().copied().collect()
    }
}

fn name_of(s: &EndpointSlice) -> String {
    s.metadata.name.clone().unwrap_or_default()
}

/// The slice's ready endpoints on `port`: an endpoint whose `ready` condition is absent counts as
/// ready (the API's convention); one not ready, or terminating, does not.
fn ready_endpoints(slice: &EndpointSlice, port: &PortRef) -> Vec<SocketAddr> {
    let number = match port {
        PortRef::Number(n) => Some(*n),
        PortRef::Name(name) => slice
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok()),
    };
    let Some(number) = number else { return Vec::new() };
    slice
        .endpoints
        .iter()
        .filter(|e| {
            let c = e.conditions.as_ref();
            c.and_then(|c| c.ready).unwrap_or(true) && !c.and_then(|c| c.terminating).unwrap_or(false)
        })
        .flat_map(|e| e.addresses.iter())
        .filter_map(|a| a.parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, number))
        .collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::discovery::v1::{Endpoint as SliceEndpoint, EndpointConditions, EndpointPort};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    #[test]
    fn parses_targets() {
        let t: ServiceTarget = "k8s:kuryr-system/kuryr-vif-allocator:grpc".parse().unwrap();
        assert_eq!(t.namespace.as_deref(), Some("kuryr-system"));
        assert_eq!(t.service, "kuryr-vif-allocator");
        assert_eq!(t.port, PortRef::Name("grpc".into()));
        assert_eq!(t.to_string(), "k8s:kuryr-system/kuryr-vif-allocator:grpc");
        let t: ServiceTarget = "k8s:kuryr-watcher:9600".parse().unwrap();
        assert_eq!((t.namespace, t.port), (None, PortRef::Number(9600)));
        let t: ServiceTarget = "k8s://lbaas:grpc".parse().unwrap();
        assert_eq!(t.service, "lbaas");
    }

    #[test]
    fn rejects_bad_targets_naming_the_part() {
        for (bad, why) in [
            ("k8s:svc", "no :PORT"),
            ("k8s:Svc:grpc", "Service name"),
            ("k8s:ns/:grpc", "Service name"),
            ("k8s:NS/svc:grpc", "namespace"),
            ("k8s:svc:0", "out of range"),
            ("k8s:svc:70000", "out of range"),
            ("k8s:svc:gr_pc", "neither"),
            ("svc:grpc", "k8s:"),
        ] {
            let e = bad.parse::<ServiceTarget>().unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }

    fn slice(name: &str, eps: &[(&str, Option<bool>, Option<bool>)]) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() },
            address_type: "IPv4".into(),
            ports: Some(vec![
                EndpointPort { name: Some("metrics".into()), port: Some(9611), ..EndpointPort::default() },
                EndpointPort { name: Some("grpc".into()), port: Some(9610), ..EndpointPort::default() },
            ]),
            endpoints: eps
                .iter()
                .map(|(ip, ready, terminating)| SliceEndpoint {
                    addresses: vec![(*ip).into()],
                    conditions: Some(EndpointConditions { ready: *ready, terminating: *terminating, serving: None }),
                    ..SliceEndpoint::default()
                })
                .collect(),
        }
    }

    fn addrs(list: &[&str]) -> BTreeSet<SocketAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn ready_endpoints_by_port_name_and_number() {
        let s =
            slice("a", &[("10.0.0.1", Some(true), None), ("10.0.0.2", None, None), ("10.0.0.3", Some(false), None)]);
        let by_name: BTreeSet<_> = ready_endpoints(&s, &PortRef::Name("grpc".into())).into_iter().collect();
        assert_eq!(by_name, addrs(&["10.0.0.1:9610", "10.0.0.2:9610"]));
        let by_number: BTreeSet<_> = ready_endpoints(&s, &PortRef::Number(7)).into_iter().collect();
        assert_eq!(by_number, addrs(&["10.0.0.1:7", "10.0.0.2:7"]));
        assert!(ready_endpoints(&s, &PortRef::Name("nope".into())).is_empty());
        let t = slice("b", &[("10.0.0.4", Some(true), Some(true))]);
        assert!(ready_endpoints(&t, &PortRef::Name("grpc".into())).is_empty(), "terminating is not ready");
    }

    #[test]
    fn a_relist_replaces_the_set_only_when_complete() {
        let port = PortRef::Name("grpc".into());
        let mut s = Slices::default();
        assert!(s.apply(Event::Apply(slice("a", &[("10.0.0.1", None, None)])), &port));
        assert!(s.apply(Event::Apply(slice("b", &[("10.0.0.2", None, None)])), &port));
        assert_eq!(s.endpoints(), addrs(&["10.0.0.1:9610", "10.0.0.2:9610"]));
        // A re-list in progress leaves the live set alone.
        assert!(!s.apply(Event::Init, &port));
        assert!(!s.apply(Event::InitApply(slice("b", &[("10.0.0.3", None, None)])), &port));
        assert_eq!(s.endpoints(), addrs(&["10.0.0.1:9610", "10.0.0.2:9610"]));
        assert!(s.apply(Event::InitDone, &port));
        assert_eq!(s.endpoints(), addrs(&["10.0.0.3:9610"]));
        assert!(s.apply(Event::Delete(slice("b", &[])), &port));
        assert!(s.endpoints().is_empty());
    }

    #[test]
    fn diff_names_what_left_and_what_came() {
        let (removed, added) = diff(&addrs(&["10.0.0.1:1", "10.0.0.2:1"]), &addrs(&["10.0.0.2:1", "[fd00::1]:1"]));
        assert_eq!(removed, vec!["10.0.0.1:1".parse::<SocketAddr>().unwrap()]);
        assert_eq!(added, vec!["[fd00::1]:1".parse::<SocketAddr>().unwrap()]);
    }
}
