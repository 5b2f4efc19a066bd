//! Compile time for 1,000 NetworkPolicies over 2,000 pods (20 namespaces of 100 pods on 20
//! nodes, 50 policies per namespace of the kinds clusters use: default deny, DNS egress,
//! app-to-app on named ports, team namespaces, monitoring, ipBlock egress, expressions), then
//! the cost of single changes. Prints its figures; `cargo bench -p kuryr-policy-core`.
//! `BENCH_ROUNDS` sets the number of single changes of each kind (default 200).
#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kuryr_policy_core::{
    Compiler, ContainerPort, LabelSelector, Labels, Namespace, NetworkPolicy, NodePolicy, Operator, Peer, Pod,
    PolicyType, PortRef, PortRule, Protocol, Requirement, Rule,
};

const NAMESPACES: usize = 20;
const PODS_PER_NS: usize = 100;
const NODES: usize = 20;
const APPS: usize = 10;

fn labels(pairs: &[(&str, String)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

fn sel(pairs: &[(&str, String)]) -> LabelSelector {
    LabelSelector { match_labels: labels(pairs), match_expressions: vec![] }
}

fn ns_name(i: usize) -> String {
    format!("ns-{i:02}")
}

fn pod(ns: usize, i: usize, app: usize) -> Pod {
    Pod {
        namespace: ns_name(ns),
        name: format!("pod-{i:03}"),
        labels: labels(&[
            ("app", format!("app-{app}")),
            ("tier", if app < APPS / 2 { "front" } else { "back" }.into()),
            ("version", format!("v{}", i % 2 + 1)),
        ]),
        node: format!("node-{:02}", (ns * PODS_PER_NS + i) % NODES),
        ips: vec![
            format!("10.{}.{}.{}", 64 + ns, i / 250, i % 250 + 1).parse().unwrap(),
            format!("fd00:{:x}::{:x}", ns + 1, i + 1).parse().unwrap(),
        ],
        ports: vec![
            ContainerPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 },
            ContainerPort { name: "metrics".into(), protocol: Protocol::Tcp, port: 9090 },
        ],
        host_network: false,
    }
}

fn port(p: Protocol, n: u16) -> PortRule {
    PortRule { protocol: p, port: Some(PortRef::Number(n)), end_port: None }
}

fn named(n: &str) -> PortRule {
    PortRule { protocol: Protocol::Tcp, port: Some(PortRef::Name(n.into())), end_port: None }
}

fn pods_peer(ns: Option<LabelSelector>, pods: Option<LabelSelector>) -> Peer {
    Peer::Pods { namespace_selector: ns, pod_selector: pods }
}

fn policies(ns: usize) -> Vec<NetworkPolicy> {
    let n = ns_name(ns);
    let mk = |name: String, target: LabelSelector| NetworkPolicy {
        namespace: n.clone(),
        name,
        pod_selector: target,
        ..Default::default()
    };
    let mut out = Vec::new();
    let mut deny = mk("default-deny".into(), LabelSelector::everything());
    deny.policy_types = vec![PolicyType::Ingress, PolicyType::Egress];
    out.push(deny);
    let mut dns = mk("dns".into(), LabelSelector::everything());
    dns.egress = vec![Rule {
        peers: vec![pods_peer(Some(sel(&[("kubernetes.io/metadata.name", ns_name(0))])), None)],
        ports: vec![port(Protocol::Udp, 53), port(Protocol::Tcp, 53)],
    }];
    out.push(dns);
    for app in 0..APPS {
        let me = sel(&[("app", format!("app-{app}"))]);
        let mut p = mk(format!("app-{app}-from-caller"), me.clone());
        p.ingress = vec![Rule {
            peers: vec![pods_peer(None, Some(sel(&[("app", format!("app-{}", (app + APPS - 1) % APPS))])))],
            ports: vec![named("http")],
        }];
        out.push(p);
        let mut p = mk(format!("app-{app}-from-team"), me.clone());
        p.ingress = vec![Rule {
            peers: vec![pods_peer(Some(sel(&[("team", format!("team-{}", app % 5))])), Some(me.clone()))],
            ports: vec![port(Protocol::Tcp, 8080)],
        }];
        out.push(p);
        let mut p = mk(format!("app-{app}-monitoring"), me.clone());
        p.ingress = vec![Rule {
            peers: vec![pods_peer(Some(sel(&[("purpose", "monitoring".into())])), None)],
            ports: vec![named("metrics")],
        }];
        out.push(p);
        let mut p = mk(format!("app-{app}-egress"), me.clone());
        p.egress = vec![
            Rule {
                peers: vec![pods_peer(None, Some(sel(&[("app", format!("app-{}", (app + 1) % APPS))])))],
                ports: vec![named("http")],
            },
            Rule {
                peers: vec![Peer::IpBlock {
                    cidr: "0.0.0.0/0".parse().unwrap(),
                    except: vec!["10.0.0.0/8".parse().unwrap(), "192.168.0.0/16".parse().unwrap()],
                }],
                ports: vec![port(Protocol::Tcp, 443)],
            },
        ];
        out.push(p);
    }
    for k in 0..8 {
        let mut p = mk(
            format!("expr-{k}"),
            LabelSelector {
                match_labels: Labels::new(),
                match_expressions: vec![Requirement {
                    key: "app".into(),
                    operator: Operator::In,
                    values: [format!("app-{k}"), format!("app-{}", k + 1)].into(),
                }],
            },
        );
        p.ingress = vec![Rule {
            peers: vec![
                pods_peer(
                    Some(LabelSelector {
                        match_labels: Labels::new(),
                        match_expressions: vec![Requirement {
                            key: "env".into(),
                            operator: Operator::NotIn,
                            values: ["prod".to_string()].into(),
                        }],
                    }),
                    Some(sel(&[("tier", "front".into())])),
                ),
                Peer::IpBlock { cidr: format!("172.{}.0.0/16", 16 + k).parse().unwrap(), except: vec![] },
            ],
            ports: vec![PortRule { protocol: Protocol::Tcp, port: Some(PortRef::Number(8000)), end_port: Some(8100) }],
        }];
        out.push(p);
    }
    out
}

fn namespace(i: usize, env: &str) -> Namespace {
    let mut l = labels(&[("team", format!("team-{}", i % 5)), ("env", env.into())]);
    if i == 1 {
        l.insert("purpose".into(), "monitoring".into());
    }
    Namespace { name: ns_name(i), labels: l }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn summary(name: &str, mut times: Vec<Duration>, elements: &[usize], nodes: &[usize]) {
    times.sort();
    let p = |q: f64| ms(times[((times.len() as f64 - 1.0) * q) as usize]);
    let avg = |v: &[usize]| v.iter().sum::<usize>() as f64 / v.len().max(1) as f64;
    println!(
        "{name:<34} p50 {:>7.3} ms  p99 {:>7.3} ms  max {:>7.3} ms  | nodes {:>4.1}  elements changed {:>7.1}",
        p(0.5),
        p(0.99),
        p(1.0),
        avg(nodes),
        avg(elements)
    );
}

/// Applies one change and brings every node's state up to date, as the policy service would
/// before streaming deltas: the nodes reported changed are recomputed and diffed.
fn settle(c: &mut Compiler, states: &mut BTreeMap<String, NodePolicy>) -> (Duration, usize, usize) {
    let t = Instant::now();
    let changed = c.take_changed_nodes();
    let mut elements = 0;
    for n in &changed {
        let new = c.node_policy(n);
        let old = states.get(n).cloned().unwrap_or_default();
        elements += old.diff(&new).element_changes();
        states.insert(n.clone(), new);
    }
    (t.elapsed(), elements, changed.len())
}

fn main() {
    let rounds: usize = std::env::var("BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let mut c = Compiler::new();
    let t = Instant::now();
    for i in 0..NAMESPACES {
        c.upsert_namespace(namespace(i, if i % 2 == 0 { "prod" } else { "dev" }));
    }
    for ns in 0..NAMESPACES {
        for i in 0..PODS_PER_NS {
            c.upsert_pod(pod(ns, i, i % APPS));
        }
    }
    let pods_loaded = t.elapsed();
    let t = Instant::now();
    for ns in 0..NAMESPACES {
        for p in policies(ns) {
            c.upsert_policy(p);
        }
    }
    let policies_loaded = t.elapsed();
    let t = Instant::now();
    let mut states = BTreeMap::new();
    for n in c.take_changed_nodes() {
        states.insert(n.clone(), c.node_policy(&n));
    }
    let first = t.elapsed();
    let stats = c.stats();
    let elements: usize = states.values().map(NodePolicy::elements).sum();
    let node_elements: Vec<usize> = states.values().map(NodePolicy::elements).collect();
    println!(
        "{} pods, {} policies, {} namespaces, {} nodes: {} selectors, {} groups",
        stats.pods, stats.policies, NAMESPACES, NODES, stats.selectors, stats.groups
    );
    println!(
        "full compile: {:.1} ms (pods {:.1} ms, policies {:.1} ms, all {} node states {:.1} ms)",
        ms(pods_loaded + policies_loaded + first),
        ms(pods_loaded),
        ms(policies_loaded),
        states.len(),
        ms(first)
    );
    println!(
        "node state: {:.0} set elements per node on average (max {}), {} in all",
        elements as f64 / states.len() as f64,
        node_elements.iter().max().unwrap_or(&0),
        elements
    );

    // Single changes.
    let mut lcg = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: usize| {
        lcg = lcg.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((lcg >> 33) % n as u64) as usize
    };
    let (mut times, mut elems, mut nodes) = (vec![], vec![], vec![]);
    for _ in 0..rounds {
        let (ns, i) = (next(NAMESPACES), next(PODS_PER_NS));
        let t = Instant::now();
        c.upsert_pod(pod(ns, i, next(APPS)));
        let (d, e, n) = settle(&mut c, &mut states);
        times.push(t.elapsed().max(d));
        elems.push(e);
        nodes.push(n);
    }
    summary("pod label change", std::mem::take(&mut times), &std::mem::take(&mut elems), &std::mem::take(&mut nodes));
    for _ in 0..rounds {
        let (ns, i) = (next(NAMESPACES), next(PODS_PER_NS));
        let t = Instant::now();
        c.remove_pod(&pod(ns, i, 0).key());
        settle(&mut c, &mut states);
        c.upsert_pod(pod(ns, i, next(APPS)));
        let (_, e, n) = settle(&mut c, &mut states);
        times.push(t.elapsed());
        elems.push(e);
        nodes.push(n);
    }
    summary(
        "pod deleted and re-created",
        std::mem::take(&mut times),
        &std::mem::take(&mut elems),
        &std::mem::take(&mut nodes),
    );
    for k in 0..rounds {
        let ns = next(NAMESPACES);
        let mut p = policies(ns).swap_remove(2 + next(APPS * 4));
        if let Some(r) = p.ingress.first_mut().or(p.egress.first_mut()) {
            r.ports.push(port(Protocol::Tcp, 10_000 + k as u16));
        }
        let t = Instant::now();
        c.upsert_policy(p);
        let (_, e, n) = settle(&mut c, &mut states);
        times.push(t.elapsed());
        elems.push(e);
        nodes.push(n);
    }
    summary(
        "policy edited (a port added)",
        std::mem::take(&mut times),
        &std::mem::take(&mut elems),
        &std::mem::take(&mut nodes),
    );
    for k in 0..rounds {
        let i = next(NAMESPACES);
        let t = Instant::now();
        c.upsert_namespace(namespace(i, if k % 2 == 0 { "prod" } else { "dev" }));
        let (_, e, n) = settle(&mut c, &mut states);
        times.push(t.elapsed());
        elems.push(e);
        nodes.push(n);
    }
    summary("namespace label change", times, &elems, &nodes);
}
