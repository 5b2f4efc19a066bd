//! Which objects a subscription wants: its kinds and its filter, already validated.

use kuryr_proto::watcher::v1::object::Body;
use kuryr_proto::watcher::v1::{Kind, Object};

/// Every kind the watcher serves, in the order snapshots send them: namespaces and nodes first
/// (what the rest refers to), then services before their endpoint slices, then pods and policies.
pub const KINDS: [Kind; 6] =
    [Kind::Namespace, Kind::Node, Kind::Service, Kind::EndpointSlice, Kind::Pod, Kind::NetworkPolicy];

/// The position of a kind in [`KINDS`]; `None` for `KIND_UNSPECIFIED`.
pub fn slot(kind: Kind) -> Option<usize> {
    KINDS.iter().position(|k| *k == kind)
}

/// Whether objects of `kind` live in a namespace.
pub fn namespaced(kind: Kind) -> bool {
    matches!(kind, Kind::Pod | Kind::Service | Kind::EndpointSlice | Kind::NetworkPolicy)
}

/// The label value naming a kind in metrics and logs.
pub fn kind_label(kind: Kind) -> &'static str {
    match kind {
        Kind::Unspecified => "unspecified",
        Kind::Pod => "pod",
        Kind::Service => "service",
        Kind::EndpointSlice => "endpointslice",
        Kind::Namespace => "namespace",
        Kind::NetworkPolicy => "networkpolicy",
        Kind::Node => "node",
    }
}

/// A subscription's kinds and filter. Every set field must match; a field that does not apply
/// to a kind is ignored for that kind (as the contract says).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector {
    /// Indexed like [`KINDS`].
    kinds: [bool; KINDS.len()],
    /// Pods with this `spec.nodeName`, and the Node of this name.
    pub node_name: Option<String>,
    /// Namespaced objects in this namespace.
    pub namespace: Option<String>,
    /// Leave out host-network pods.
    pub exclude_host_network: bool,
}

impl Selector {
    /// A selector for `kinds` with an empty filter. `KIND_UNSPECIFIED` is ignored.
    pub fn new(kinds: impl IntoIterator<Item = Kind>) -> Self {
        let mut s = Self::default();
        for k in kinds {
            if let Some(i) = slot(k) {
                s.kinds[i] = true;
            }
        }
        s
    }

    /// Whether the subscription wants objects of `kind`.
    pub fn wants_kind(&self, kind: Kind) -> bool {
        slot(kind).is_some_and(|i| self.kinds[i])
    }

    /// The wanted kinds, in snapshot order.
    pub fn kinds(&self) -> impl Iterator<Item = Kind> + '_ {
        KINDS.iter().copied().filter(|k| self.wants_kind(*k))
    }

    /// Whether `obj` belongs to the subscription.
    pub fn matches(&self, obj: &Object) -> bool {
        let Ok(kind) = Kind::try_from(obj.kind) else { return false };
        if !self.wants_kind(kind) {
            return false;
        }
        if let Some(ns) = &self.namespace
            && namespaced(kind)
            && obj.namespace != *ns
        {
            return false;
        }
        match (&obj.body, kind) {
            (Some(Body::Pod(pod)), _) => {
                if self.node_name.as_ref().is_some_and(|n| pod.node_name != *n) {
                    return false;
                }
                !(self.exclude_host_network && pod.host_network)
            }
            (_, Kind::Node) => self.node_name.as_ref().is_none_or(|n| obj.name == *n),
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use kuryr_proto::watcher::v1::Pod;

    use super::*;

    fn pod(ns: &str, name: &str, node: &str, host: bool) -> Object {
        Object {
            kind: Kind::Pod as i32,
            namespace: ns.into(),
            name: name.into(),
            body: Some(Body::Pod(Pod { node_name: node.into(), host_network: host, ..Default::default() })),
            ..Default::default()
        }
    }

    fn cluster(kind: Kind, name: &str) -> Object {
        Object { kind: kind as i32, name: name.into(), ..Default::default() }
    }

    #[test]
    fn empty_filter_matches_the_wanted_kinds_only() {
        let s = Selector::new([Kind::Pod, Kind::Unspecified]);
        assert!(s.matches(&pod("a", "p", "", false)));
        assert!(!s.matches(&cluster(Kind::Node, "n1")));
        assert_eq!(s.kinds().collect::<Vec<_>>(), [Kind::Pod]);
        assert!(!Selector::new([]).matches(&pod("a", "p", "n", false)));
    }

    #[test]
    fn node_filter_narrows_pods_and_nodes_but_not_services() {
        let mut s = Selector::new(KINDS);
        s.node_name = Some("n1".into());
        assert!(s.matches(&pod("a", "p", "n1", false)));
        assert!(!s.matches(&pod("a", "p", "n2", false)));
        assert!(!s.matches(&pod("a", "p", "", false)), "unscheduled pods are on no node");
        assert!(s.matches(&cluster(Kind::Node, "n1")));
        assert!(!s.matches(&cluster(Kind::Node, "n2")));
        let svc = Object { kind: Kind::Service as i32, namespace: "a".into(), name: "s".into(), ..Default::default() };
        assert!(s.matches(&svc));
    }

    #[test]
    fn namespace_filter_ignores_cluster_scoped_kinds() {
        let mut s = Selector::new(KINDS);
        s.namespace = Some("a".into());
        assert!(s.matches(&pod("a", "p", "n1", false)));
        assert!(!s.matches(&pod("b", "p", "n1", false)));
        assert!(s.matches(&cluster(Kind::Namespace, "b")));
        assert!(s.matches(&cluster(Kind::Node, "n9")));
    }

    #[test]
    fn host_network_pods_can_be_left_out() {
        let mut s = Selector::new([Kind::Pod]);
        assert!(s.matches(&pod("a", "p", "n1", true)));
        s.exclude_host_network = true;
        assert!(!s.matches(&pod("a", "p", "n1", true)));
        assert!(s.matches(&pod("a", "p", "n1", false)));
    }
}
