//! The compiler's input: the parts of Pods, Namespaces and `networking.k8s.io/v1`
//! NetworkPolicies that decide what may talk to what, as plain Rust values.
//!
//! The types keep the API's meaning, including where "empty" and "absent" differ and where they
//! do not (each field says which). Whoever converts API objects into them (the future
//! kuryr-policy service, from the watcher's stream) applies the API server's defaults first: a
//! port's protocol is TCP when unset, and a NetworkPolicy's `policyTypes` may be left empty to
//! mean the default ([`NetworkPolicy::effective_types`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

/// Labels of a pod or namespace.
pub type Labels = BTreeMap<String, String>;

/// The label every namespace carries with its own name (set by the API server since Kubernetes
/// 1.21, and added by the compiler when a namespace is not known yet, so that policies selecting
/// namespaces by name work from the first pod on).
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// A pod by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for PodKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A NetworkPolicy by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKey {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for PolicyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The transport protocols a NetworkPolicy port can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// Every protocol, in order.
    pub const ALL: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

    /// The IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// The lower-case name, as nftables and /etc/protocols spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }

    /// The protocol of an IP protocol number, if it is one of the three.
    pub fn from_number(n: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.number() == n)
    }

    /// Parses the API's spelling (`TCP`, `UDP`, `SCTP`) or nftables' (`tcp`, ...).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str().eq_ignore_ascii_case(s))
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One `ports[]` entry of a pod's container: only named ones matter to policies.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerPort {
    /// `name`; names are unique within a container, and a name used by two containers of one pod
    /// resolves to both.
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

/// A pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
    pub labels: Labels,
    /// `spec.nodeName`; empty while unscheduled.
    pub node: String,
    /// `status.podIPs`. The caller leaves it empty for pods that no longer hold their addresses
    /// (phase Succeeded or Failed), whose addresses may already belong to another pod.
    pub ips: Vec<IpAddr>,
    /// The containers' ports with a name (named ports in policies resolve to these).
    pub ports: Vec<ContainerPort>,
    /// `spec.hostNetwork`: the pod shares its node's addresses. Policies neither isolate it nor
    /// select it as a peer (the API leaves both unspecified); its traffic is the node's.
    pub host_network: bool,
}

impl Pod {
    pub fn key(&self) -> PodKey {
        PodKey { namespace: self.namespace.clone(), name: self.name.clone() }
    }

    /// Whether policies can see this pod at all: it has addresses of its own.
    pub fn has_own_addresses(&self) -> bool {
        !self.host_network && !self.ips.is_empty()
    }
}

/// A namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Namespace {
    pub name: String,
    pub labels: Labels,
}

/// A `matchExpressions` operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

/// One `matchExpressions` entry.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    /// Must be non-empty for In and NotIn and empty otherwise (the API validates it; an In with
    /// no values matches nothing here).
    pub values: BTreeSet<String>,
}

/// A `metav1.LabelSelector`. The empty selector (no labels, no expressions) matches everything;
/// whether a selector is present at all is expressed by `Option<LabelSelector>` where the API
/// makes a difference.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelSelector {
    pub match_labels: Labels,
    pub match_expressions: Vec<Requirement>,
}

/// `policyTypes` entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyType {
    Ingress,
    Egress,
}

/// A NetworkPolicy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetworkPolicy {
    pub namespace: String,
    pub name: String,
    /// `spec.podSelector`: the pods of the policy's namespace it applies to; empty selects every
    /// pod of the namespace.
    pub pod_selector: LabelSelector,
    /// `spec.policyTypes`; empty means the API's default ([`Self::effective_types`]).
    pub policy_types: Vec<PolicyType>,
    /// `spec.ingress`; absent and empty mean the same: no ingress is allowed (when the policy
    /// is of type Ingress).
    pub ingress: Vec<Rule>,
    /// `spec.egress`; absent and empty mean the same: no egress is allowed (when the policy is
    /// of type Egress).
    pub egress: Vec<Rule>,
}

impl NetworkPolicy {
    pub fn key(&self) -> PolicyKey {
        PolicyKey { namespace: self.namespace.clone(), name: self.name.clone() }
    }

    /// The directions this policy isolates its pods in: `policyTypes`, or when it is empty the
    /// API's default — Ingress always, Egress when there is at least one egress rule.
    pub fn effective_types(&self) -> (bool, bool) {
        if self.policy_types.is_empty() {
            (true, !self.egress.is_empty())
        } else {
            (self.policy_types.contains(&PolicyType::Ingress), self.policy_types.contains(&PolicyType::Egress))
        }
    }

    /// What the API server would refuse, as `field: problem` lines. The compiler never trusts
    /// such parts: a peer or port it cannot make sense of matches nothing (fail closed).
    pub fn validate(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (dir, rules) in [("ingress", &self.ingress), ("egress", &self.egress)] {
            let peers = if dir == "ingress" { "from" } else { "to" };
            for (i, rule) in rules.iter().enumerate() {
                for (j, peer) in rule.peers.iter().enumerate() {
                    if let Some(why) = peer.problem() {
                        out.push(format!("spec.{dir}[{i}].{peers}[{j}]: {why}"));
                    }
                }
                for (j, port) in rule.ports.iter().enumerate() {
                    if let Some(why) = port.problem() {
                        out.push(format!("spec.{dir}[{i}].ports[{j}]: {why}"));
                    }
                }
            }
        }
        out
    }
}

/// One ingress or egress rule.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rule {
    /// `from` (ingress) or `to` (egress). Absent and empty mean the same: every peer, inside
    /// the cluster or not.
    pub peers: Vec<Peer>,
    /// `ports`. Absent and empty mean the same: every port of every protocol (ICMP included).
    pub ports: Vec<PortRule>,
}

/// A `NetworkPolicyPeer`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Peer {
    /// `podSelector` and/or `namespaceSelector`. Only the pod selector: pods of the policy's own
    /// namespace; only the namespace selector: every pod of the matching namespaces; both: the
    /// matching pods of the matching namespaces. An empty selector matches everything, an
    /// absent one is not there: `{podSelector: {}}` is every pod of the policy's namespace,
    /// `{namespaceSelector: {}}` every pod of the cluster. At least one must be present.
    Pods { namespace_selector: Option<LabelSelector>, pod_selector: Option<LabelSelector> },
    /// `ipBlock`: the addresses in `cidr` but in none of `except` (which the API requires to
    /// lie inside `cidr`). Pod addresses are addresses too: a block can match pods.
    IpBlock { cidr: IpNet, except: Vec<IpNet> },
}

impl Peer {
    fn problem(&self) -> Option<String> {
        match self {
            Peer::Pods { namespace_selector: None, pod_selector: None } => Some("must specify a peer".into()),
            Peer::Pods { .. } => None,
            Peer::IpBlock { cidr, except } => except
                .iter()
                .find(|e| !cidr.contains(*e) || *e == cidr)
                .map(|e| format!("except {e} must be strictly within cidr {cidr}")),
        }
    }
}

/// A port reference: a number or the name of a container port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PortRef {
    Number(u16),
    Name(String),
}

/// A `NetworkPolicyPort`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortRule {
    /// `protocol` (the API defaults it to TCP).
    pub protocol: Protocol,
    /// `port`; absent: every port of the protocol. A name resolves, for ingress, against the
    /// ports of the pod the policy protects; for egress, against those of the destination pod
    /// (so a named port never matches an address that is no pod's).
    pub port: Option<PortRef>,
    /// `endPort`: with a numeric `port`, the range `port..=end_port`.
    pub end_port: Option<u16>,
}

impl PortRule {
    fn problem(&self) -> Option<String> {
        match (&self.port, self.end_port) {
            (Some(PortRef::Number(0)), _) => Some("port must be between 1 and 65535".into()),
            (Some(PortRef::Name(n)), _) if n.is_empty() => Some("port name must not be empty".into()),
            (None | Some(PortRef::Name(_)), Some(_)) => Some("endPort needs a numeric port".into()),
            (Some(PortRef::Number(p)), Some(e)) if e < *p => Some(format!("endPort {e} is below port {p}")),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule_with_port(port: Option<PortRef>, end_port: Option<u16>) -> Rule {
        Rule { peers: vec![], ports: vec![PortRule { protocol: Protocol::Tcp, port, end_port }] }
    }

    #[test]
    fn default_policy_types_follow_the_api() {
        let mut p = NetworkPolicy::default();
        assert_eq!(p.effective_types(), (true, false), "ingress always");
        p.egress.push(Rule::default());
        assert_eq!(p.effective_types(), (true, true), "egress when there are egress rules");
        p.policy_types = vec![PolicyType::Egress];
        assert_eq!(p.effective_types(), (false, true), "explicit types win");
        p.ingress.push(Rule::default());
        assert_eq!(p.effective_types(), (false, true), "ingress rules without the type are ignored");
    }

    #[test]
    fn invalid_parts_are_named_by_field() {
        let p = NetworkPolicy {
            ingress: vec![
                Rule { peers: vec![Peer::Pods { namespace_selector: None, pod_selector: None }], ports: vec![] },
                rule_with_port(Some(PortRef::Number(80)), Some(79)),
            ],
            egress: vec![
                rule_with_port(Some(PortRef::Name("http".into())), Some(90)),
                rule_with_port(Some(PortRef::Number(0)), None),
                Rule {
                    peers: vec![Peer::IpBlock {
                        cidr: "10.0.0.0/24".parse().unwrap(),
                        except: vec!["10.0.1.0/24".parse().unwrap()],
                    }],
                    ports: vec![],
                },
            ],
            ..Default::default()
        };
        assert_eq!(
            p.validate(),
            [
                "spec.ingress[0].from[0]: must specify a peer",
                "spec.ingress[1].ports[0]: endPort 79 is below port 80",
                "spec.egress[0].ports[0]: endPort needs a numeric port",
                "spec.egress[1].ports[0]: port must be between 1 and 65535",
                "spec.egress[2].to[0]: except 10.0.1.0/24 must be strictly within cidr 10.0.0.0/24",
            ]
        );
    }

    #[test]
    fn protocols_round_trip() {
        for p in Protocol::ALL {
            assert_eq!(Protocol::from_number(p.number()), Some(p));
            assert_eq!(Protocol::parse(&p.as_str().to_uppercase()), Some(p));
        }
        assert_eq!(Protocol::from_number(1), None);
    }
}
