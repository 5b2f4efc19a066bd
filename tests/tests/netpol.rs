//! NetworkPolicy end to end, everything real: the API server, kube-controller-manager's
//! EndpointSlice controller, kuryr-watcher, kuryr-vif-allocator, kuryr-lbaas and kuryr-policy
//! under their ServiceAccounts, two nodes whose binders follow kuryr-policy (and kuryr-lbaas) and
//! program nftables in the node's namespace. Each pod runs `kuryr-test-echo` in its network
//! namespace, answering TCP and UDP on both address families; clients connect from other pods'
//! namespaces, on the same node and across nodes, and every expectation is waited for as traffic:
//! a connection is allowed when it is answered, denied when it is rejected (the policy's
//! `reject`, seen by the client as unreachable or prohibited — not a timeout, which could be
//! anything).
//!
//! - no policy: everything flows;
//! - an ingress policy by pod selector with a named TCP port and a numeric UDP port: its peers
//!   get in on those ports only, over IPv4 and IPv6, from both nodes; others are rejected;
//! - the policy edited to admit a namespace by label; the namespace's label changed; a pod's label
//!   changed: each is enforced;
//! - an egress policy on the clients: only the allowed destination and port, replies flowing;
//! - through a Service ClusterIP, the connection is judged by the pod it reaches (after DNAT);
//! - the node itself (as a kubelet probe) still reaches an isolated pod;
//! - the policies deleted: everything flows again;
//! - a port rule naming only a protocol: every port of it;
//! - a binder restarted: the rules stay and are reconciled, not rebuilt from nothing;
//! - a pod deleted while isolated: its address leaves the rules, and the pod that gets the
//!   address next is judged by its own labels;
//! - each policy's status: a `Compiled` Event on the NetworkPolicy naming the nodes enforcing
//!   it, a `Warning UnresolvedNamedPort` for a named port its pod does not declare; the metrics
//!   of rules, set elements and status Events move.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kuryr_tests::cluster::checks::{self, RunningPod};
use kuryr_tests::cluster::svc;
use kuryr_tests::cluster::{Cluster, ClusterOptions, run_scenario};
use kuryr_tests::echo::{self, EchoServer, Proto};
use kuryr_tests::metrics::Scrape;
use kuryr_tests::objects;
use kuryr_tests::services::grpcurl;

const NS_A: &str = "np-a";
const NS_B: &str = "np-b";
/// Every pod's echo port (TCP and UDP); the policies allow it.
const PORT: u16 = 8080;
/// A second port on the server; no policy allows it.
const OTHER_PORT: u16 = 9090;
/// Bound on pods Running.
const RUNNING_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on a change being enforced on the nodes.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn network_policies_are_enforced_on_real_traffic() {
    let opts = ClusterOptions {
        nodes: 2,
        services: true,
        policy: true,
        // Small IPv4 blocks, so that a released address comes back after a few pods.
        ipv4_block_prefix: Some(28),
        ..ClusterOptions::default()
    };
    let run = async |c: &mut Cluster| {
        let mut world = World::default();
        scenario(c, &mut world).await
    };
    run_scenario("netpol", opts, run).await.unwrap_or_else(|e| panic!("{e:#}"));
}

/// A pod a policy selects is judged from the moment its VIF is recorded, not from the kubelet's
/// status report: here the server's status never gets addresses (the window a real kubelet
/// leaves between the sandbox coming up and its next status sync, held open), and the policy
/// holds for it all the same — denied to others, open to its peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_is_isolated_before_its_status_has_addresses() {
    let opts = ClusterOptions { nodes: 1, policy: true, ..ClusterOptions::default() };
    let run = async |c: &mut Cluster| {
        let mut world = World::default();
        status_without_addresses(c, &mut world).await
    };
    run_scenario("netpol-status-without-addresses", opts, run).await.unwrap_or_else(|e| panic!("{e:#}"));
}

async fn status_without_addresses(c: &Cluster, w: &mut World) -> Result<()> {
    const NS: &str = "np-quiet";
    let client = c.client();
    objects::create_namespace(&client, NS).await?;
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), NS);
    policies.create(&PostParams::default(), &server_ingress(vec![])).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let node = c.nodes()[0].name.clone();
    for (name, app) in [("client", "client"), ("other", "other")] {
        pods.create(&PostParams::default(), &pod(name, &node, app)).await?;
    }
    w.refresh(c, NS, 2).await?;

    let mut server = pod("server", &node, "server");
    server.metadata.annotations =
        Some([(kuryr_tests::kubelet::STATUS_WITHOUT_ADDRESSES.to_string(), "true".to_string())].into());
    pods.create(&PostParams::default(), &server).await?;
    let kubelet = &c.kubelets()[0];
    let rec = kuryr_tests::services::wait_until("the server's sandbox running", RUNNING_TIMEOUT, || async {
        let r = kubelet.pod(NS, "server").context("not seen by the kubelet yet")?;
        anyhow::ensure!(r.phase == kuryr_tests::kubelet::PodPhase::Running, "phase {:?}", r.phase);
        anyhow::ensure!(!r.ips.is_empty(), "no sandbox addresses");
        Ok(r)
    })
    .await?;
    let status = pods.get("server").await?.status.unwrap_or_default();
    anyhow::ensure!(
        status.phase.as_deref() == Some("Running") && status.pod_ips.unwrap_or_default().is_empty(),
        "the server's status was to be Running without addresses (phase {:?})",
        status.phase
    );
    let netns = rec.netns.clone().context("the server's sandbox has no netns")?;
    w.servers.push(echo::serve(&netns, "server", PORT)?);
    w.servers.push(echo::serve(&netns, "server", OTHER_PORT)?);
    w.running.insert(
        format!("{NS}/server"),
        RunningPod { name: "server".into(), uid: rec.uid.clone(), node: node.clone(), ips: rec.ips.clone(), netns },
    );

    let (srv, cl, oth) = ("np-quiet/server", "np-quiet/client", "np-quiet/other");
    use Proto::{Tcp, Udp};
    w.check(
        "a server without addresses in its status: isolated by its VIF's",
        &[
            (oth, srv, Tcp, PORT, Denied),
            (oth, srv, Udp, PORT, Denied),
            (cl, srv, Tcp, PORT, Allowed),
            (cl, srv, Udp, PORT, Allowed),
            (cl, srv, Tcp, OTHER_PORT, Denied),
        ],
    )
    .await?;
    let ips = pods.get("server").await?.status.and_then(|s| s.pod_ips).unwrap_or_default();
    anyhow::ensure!(ips.is_empty(), "the server's status got addresses during the check: {ips:?}");
    Ok(())
}

/// SCTP on live traffic: a policy admitting SCTP on the echo port from `client` only. Needs the
/// kernel's SCTP (module `sctp`, listed in /proc/net/protocols), which the machines this suite
/// runs on lack; SCTP rules are compiled and programmed (unit tests of the compiler and of the
/// rendering) either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "this kernel has no SCTP (no sctp module; SCTP absent from /proc/net/protocols)"]
async fn sctp_policies_are_enforced_on_real_traffic() {
    let protocols = std::fs::read_to_string("/proc/net/protocols").unwrap_or_default();
    assert!(
        protocols.lines().any(|l| l.starts_with("SCTP")),
        "the kernel has no SCTP: `modprobe sctp` first (SCTP absent from /proc/net/protocols)"
    );
    let opts = ClusterOptions { nodes: 2, policy: true, ..ClusterOptions::default() };
    let cluster = Cluster::start(opts).await.unwrap_or_else(|e| panic!("starting the cluster: {e:#}"));
    let mut world = World::default();
    let outcome = async {
        let client = cluster.client();
        objects::create_namespace(&client, NS_A).await?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), NS_A);
        let (node1, node2) = (cluster.nodes()[0].name.clone(), cluster.nodes()[1].name.clone());
        for (name, node, app) in [("server", &node1, "server"), ("client", &node2, "client"), ("other", &node2, "other")] {
            pods.create(&PostParams::default(), &pod(name, node, app)).await?;
        }
        world.refresh(&cluster, NS_A, 3).await?;
        let (srv, cl, oth) = ("np-a/server", "np-a/client", "np-a/other");
        world.check("no policy: SCTP flows", &[(oth, srv, Proto::Sctp, PORT, Allowed)]).await?;
        let sctp = policy(serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "sctp-from-client"},
            "spec": {"podSelector": {"matchLabels": {"app": "server"}},
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}], "ports": [{"protocol": "SCTP", "port": PORT}]}]}
        }));
        Api::<NetworkPolicy>::namespaced(client.clone(), NS_A).create(&PostParams::default(), &sctp).await?;
        world
            .check(
                "SCTP admitted from client only",
                &[
                    (cl, srv, Proto::Sctp, PORT, Allowed),
                    (oth, srv, Proto::Sctp, PORT, Denied),
                    (cl, srv, Proto::Sctp, OTHER_PORT, Denied),
                    (cl, srv, Proto::Tcp, PORT, Denied),
                ],
            )
            .await
    }
    .await;
    if outcome.is_err() {
        eprintln!("{}", cluster.logs());
    }
    drop(world);
    let shutdown = cluster.shutdown().await;
    outcome.unwrap_or_else(|e| panic!("{e:#}"));
    shutdown.unwrap_or_else(|e| panic!("{e:#}"));
}

/// What a probe should find.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Allowed,
    Denied,
}
use Want::{Allowed, Denied};

/// The pods and their echo servers.
#[derive(Default)]
struct World {
    running: BTreeMap<String, RunningPod>,
    servers: Vec<EchoServer>,
    /// How long each enforced change took to show in traffic, by step.
    took: Vec<(String, Duration)>,
}

impl World {
    fn pod(&self, name: &str) -> &RunningPod {
        &self.running[name]
    }

    fn netns(&self, name: &str) -> PathBuf {
        self.pod(name).netns.clone()
    }

    fn ip(&self, name: &str, v4: bool) -> IpAddr {
        self.pod(name).ips.iter().copied().find(|ip| ip.is_ipv4() == v4).unwrap()
    }

    /// Adds the Running pods of `namespace` (`expected` of them) and starts echo servers in the
    /// new ones.
    async fn refresh(&mut self, c: &Cluster, namespace: &str, expected: usize) -> Result<()> {
        for p in checks::wait_running(c, namespace, expected, RUNNING_TIMEOUT).await? {
            let key = format!("{namespace}/{}", p.name);
            if self.running.get(&key).is_none_or(|old| old.uid != p.uid) {
                self.servers.push(echo::serve(&p.netns, &p.name, PORT)?);
                self.servers.push(echo::serve(&p.netns, &p.name, OTHER_PORT)?);
            }
            self.running.insert(key, p);
        }
        Ok(())
    }

    /// Waits until a connection from `from` to `to` (both `namespace/name`) over `proto`, on
    /// both families, is as `want`; returns how long that took.
    async fn expect(&self, from: &str, to: &str, proto: Proto, port: u16, want: Want) -> Result<Duration> {
        let mut longest = Duration::ZERO;
        for v4 in [true, false] {
            let addr = self.ip(to, v4);
            longest = longest.max(
                expect_at(&self.netns(from), addr, proto, port, want)
                    .await
                    .with_context(|| format!("{from} → {to} ({addr}) {proto:?}:{port}"))?,
            );
        }
        Ok(longest)
    }

    /// Checks a list of expectations; records the longest wait under `step`.
    async fn check(&mut self, step: &str, cases: &[(&str, &str, Proto, u16, Want)]) -> Result<()> {
        let mut longest = Duration::ZERO;
        for (from, to, proto, port, want) in cases {
            longest = longest.max(self.expect(from, to, *proto, *port, *want).await.context(step.to_string())?);
        }
        eprintln!("  {step}: {} expectations hold (enforced within {longest:?})", cases.len() * 2);
        self.took.push((step.to_string(), longest));
        Ok(())
    }
}

/// Waits until a connection from `netns` to `addr:port` is as `want`.
async fn expect_at(netns: &std::path::Path, addr: IpAddr, proto: Proto, port: u16, want: Want) -> Result<Duration> {
    let t = Instant::now();
    loop {
        let got = echo::ask(netns, proto, addr, port).await;
        let ok = match (&got, want) {
            (Ok(_), Allowed) => true,
            // The policy's reject (ICMP administratively prohibited: EHOSTUNREACH over IPv4,
            // EACCES over IPv6), and nothing else, counts as denied.
            (Err(e), Denied) => e.contains("unreachable") || e.contains("prohibited"),
            _ => false,
        };
        if ok {
            return Ok(t.elapsed());
        }
        if t.elapsed() > CONVERGE_TIMEOUT {
            bail!("want {want:?}, still {got:?} after {CONVERGE_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn pod(name: &str, node: &str, app: &str) -> Pod {
    objects::pod(name)
        .node(node)
        .label("app", app)
        .grace(1)
        .port(Some("http"), "TCP", PORT, None)
        .port(Some("echo-udp"), "UDP", PORT, None)
        .build()
}

fn policy(json: serde_json::Value) -> NetworkPolicy {
    serde_json::from_value(json).unwrap()
}

/// `server` admits `app=client` pods of its namespace on the named TCP port and on UDP 8080.
fn server_ingress(extra_peers: Vec<serde_json::Value>) -> NetworkPolicy {
    let mut from = vec![serde_json::json!({"podSelector": {"matchLabels": {"app": "client"}}})];
    from.extend(extra_peers);
    policy(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "server-ingress"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "server"}},
            "ingress": [{"from": from, "ports": [{"port": "http"}, {"protocol": "UDP", "port": PORT}]}]
        }
    }))
}

async fn label_namespace(client: &kube::Client, name: &str, team: &str) -> Result<()> {
    let patch = serde_json::json!({"metadata": {"labels": {"team": team}}});
    Api::<Namespace>::all(client.clone()).patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(())
}

async fn label_pod(pods: &Api<Pod>, name: &str, app: &str) -> Result<()> {
    let patch = serde_json::json!({"metadata": {"labels": {"app": app}}});
    pods.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(())
}

async fn scenario(cluster: &mut Cluster, w: &mut World) -> Result<()> {
    let client = cluster.client();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for (ns, team) in [(NS_A, "a"), (NS_B, "b")] {
        let n = Namespace {
            metadata: ObjectMeta {
                name: Some(ns.into()),
                labels: Some([("team".to_string(), team.to_string())].into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        namespaces.create(&PostParams::default(), &n).await?;
    }
    let pods_a: Api<Pod> = Api::namespaced(client.clone(), NS_A);
    let pods_b: Api<Pod> = Api::namespaced(client.clone(), NS_B);
    let policies_a: Api<NetworkPolicy> = Api::namespaced(client.clone(), NS_A);
    let (node1, node2) = (cluster.nodes()[0].name.clone(), cluster.nodes()[1].name.clone());
    for (name, node, app) in [
        ("server", &node1, "server"),
        ("client", &node1, "client"),
        ("client2", &node2, "client"),
        ("other", &node2, "other"),
    ] {
        pods_a.create(&PostParams::default(), &pod(name, node, app)).await?;
    }
    pods_b.create(&PostParams::default(), &pod("outsider", &node2, "client")).await?;
    w.refresh(cluster, NS_A, 4).await?;
    w.refresh(cluster, NS_B, 1).await?;
    let (srv, cl, cl2, oth, out) = ("np-a/server", "np-a/client", "np-a/client2", "np-a/other", "np-b/outsider");
    use Proto::{Tcp, Udp};

    w.check(
        "no policy: everything flows",
        &[
            (cl, srv, Tcp, PORT, Allowed),
            (oth, srv, Tcp, PORT, Allowed),
            (out, srv, Udp, PORT, Allowed),
            (cl, srv, Tcp, OTHER_PORT, Allowed),
        ],
    )
    .await?;

    policies_a.create(&PostParams::default(), &server_ingress(vec![])).await?;
    w.check(
        "ingress by pod selector, named TCP port and UDP port",
        &[
            (cl, srv, Tcp, PORT, Allowed),
            (cl2, srv, Tcp, PORT, Allowed),
            (cl, srv, Udp, PORT, Allowed),
            (cl2, srv, Udp, PORT, Allowed),
            (cl, srv, Tcp, OTHER_PORT, Denied),
            (cl, srv, Udp, OTHER_PORT, Denied),
            (oth, srv, Tcp, PORT, Denied),
            (oth, srv, Udp, PORT, Denied),
            (out, srv, Tcp, PORT, Denied),
            // The isolated pod may still start connections (ingress only), and others are open.
            (srv, oth, Tcp, PORT, Allowed),
            (oth, cl, Tcp, PORT, Allowed),
        ],
    )
    .await?;

    // Its status, on the NetworkPolicy: compiled, enforced where the server runs.
    let note = format!("compiled; enforced on 1 node ({node1}) for 1 pod");
    wait_event(&client, NS_A, "server-ingress", "Compiled", &note).await?;

    // The node itself, as a kubelet probe would: from the node's namespace to the pod.
    let host = cluster.node(&node1).context("node-1")?.node.netns_path();
    for v4 in [true, false] {
        expect_at(&host, w.ip(srv, v4), Tcp, OTHER_PORT, Allowed)
            .await
            .context("the node reaching its isolated pod (kubelet probes)")?;
    }

    let edited = server_ingress(vec![serde_json::json!({
        "namespaceSelector": {"matchLabels": {"team": "b"}},
        "podSelector": {"matchLabels": {"app": "client"}}
    })]);
    let pp = PatchParams::apply("netpol-test").force();
    policies_a.patch("server-ingress", &pp, &Patch::Apply(&edited)).await?;
    w.check(
        "policy edited: namespace selector with pod selector",
        &[(out, srv, Tcp, PORT, Allowed), (out, srv, Udp, PORT, Allowed), (oth, srv, Tcp, PORT, Denied)],
    )
    .await?;

    label_namespace(&client, NS_B, "c").await?;
    w.check("namespace label changed", &[(out, srv, Tcp, PORT, Denied), (cl, srv, Tcp, PORT, Allowed)]).await?;
    label_namespace(&client, NS_B, "b").await?;
    w.check("namespace label changed back", &[(out, srv, Tcp, PORT, Allowed)]).await?;

    label_pod(&pods_a, "other", "client").await?;
    w.check("pod label changed to a selected one", &[(oth, srv, Tcp, PORT, Allowed)]).await?;
    label_pod(&pods_a, "other", "other").await?;
    w.check("pod label changed back", &[(oth, srv, Tcp, PORT, Denied)]).await?;

    let egress = policy(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "client-egress"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "client"}},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "server"}}}], "ports": [{"protocol": "TCP", "port": PORT}]}]
        }
    }));
    policies_a.create(&PostParams::default(), &egress).await?;
    w.check(
        "egress: only the server's TCP port, replies flowing",
        &[
            (cl, srv, Tcp, PORT, Allowed),
            (cl2, srv, Tcp, PORT, Allowed),
            (cl, srv, Udp, PORT, Denied),
            (cl, oth, Tcp, PORT, Denied),
            (cl2, oth, Udp, PORT, Denied),
            (oth, cl, Tcp, PORT, Allowed),
        ],
    )
    .await?;

    // Through a Service: judged by the pod the ClusterIP leads to.
    let services: Api<Service> = Api::namespaced(client.clone(), NS_A);
    let svc_spec = Service {
        metadata: ObjectMeta { name: Some("server".into()), ..ObjectMeta::default() },
        spec: Some(ServiceSpec {
            selector: Some([("app".to_string(), "server".to_string())].into()),
            ports: Some(vec![ServicePort {
                name: Some("tcp".into()),
                protocol: Some("TCP".into()),
                port: 80,
                target_port: Some(IntOrString::Int(i32::from(PORT))),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    };
    services.create(&PostParams::default(), &svc_spec).await?;
    let (vip, _) = svc::cluster_ip(&client, NS_A, "server").await?;
    let t = Instant::now();
    expect_at(&w.netns(cl2), vip, Tcp, 80, Allowed).await.context("client2 → ClusterIP")?;
    expect_at(&w.netns(oth), vip, Tcp, 80, Denied).await.context("other → ClusterIP")?;
    expect_at(&w.netns(out), vip, Tcp, 80, Allowed).await.context("outsider → ClusterIP")?;
    eprintln!("  ClusterIP {vip}:80 judged after DNAT ({:?})", t.elapsed());

    // A binder killed (-9): the rules stay in force while it is down; restarted, it reconciles
    // from its record of what it programmed instead of replacing the rules.
    cluster.node_mut(&node1).context("node-1")?.node.binder.kill().await?;
    w.check("binder killed: rules stay", &[(oth, srv, Tcp, PORT, Denied), (cl, srv, Tcp, PORT, Allowed)]).await?;
    cluster.node_mut(&node1).context("node-1")?.node.binder.restart().await?;
    w.check("binder restarted", &[(oth, srv, Tcp, PORT, Denied), (cl, srv, Tcp, PORT, Allowed)]).await?;
    let log = cluster.node(&node1).context("node-1")?.node.binder_logs();
    kuryr_tests::services::wait_until("the restarted binder to reconcile", CONVERGE_TIMEOUT, || async {
        let log = cluster.node(&node1).context("node-1")?.node.binder_logs();
        anyhow::ensure!(log.contains("NetworkPolicy rules programmed"), "not programmed yet");
        Ok(())
    })
    .await?;
    let log = cluster.node(&node1).context("node-1")?.node.binder_logs() + &log;
    anyhow::ensure!(
        log.contains("policy rules of the previous run found") && !log.contains("kind=\"replace\""),
        "the restarted binder did not reconcile from its record:\n{log}"
    );

    policies_a.delete("client-egress", &DeleteParams::default()).await?;
    policies_a.delete("server-ingress", &DeleteParams::default()).await?;
    w.check(
        "policies deleted: everything flows again",
        &[
            (oth, srv, Tcp, PORT, Allowed),
            (oth, srv, Udp, PORT, Allowed),
            (cl, oth, Tcp, PORT, Allowed),
            (cl, srv, Tcp, OTHER_PORT, Allowed),
        ],
    )
    .await?;

    // A port rule naming only a protocol: every port of it, from everyone.
    let udp_only = policy(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "udp-only"},
        "spec": {"podSelector": {"matchLabels": {"app": "server"}}, "ingress": [{"ports": [{"protocol": "UDP"}]}]}
    }));
    policies_a.create(&PostParams::default(), &udp_only).await?;
    w.check(
        "every port of one protocol",
        &[
            (out, srv, Udp, PORT, Allowed),
            (cl, srv, Udp, OTHER_PORT, Allowed),
            (cl, srv, Tcp, PORT, Denied),
            (oth, srv, Tcp, OTHER_PORT, Denied),
        ],
    )
    .await?;
    policies_a.delete("udp-only", &DeleteParams::default()).await?;

    ip_reuse(cluster, w, &pods_a, &policies_a, &node1).await?;

    status(cluster, &policies_a, &node1).await?;

    metrics(cluster).await?;
    eprintln!("enforcement times (client-side, including ICMP error rate limits on denials):");
    for (step, took) in &w.took {
        eprintln!("  {took:>12?}  {step}");
    }
    Ok(())
}

/// Every binder programmed without a failed transaction; kuryr-policy streams to both. Prints
/// how long programming took on the nodes and publishing in kuryr-policy.
async fn metrics(cluster: &Cluster) -> Result<()> {
    const PROGRAM: &str = "kuryr_binder_policy_program_seconds";
    for n in cluster.nodes() {
        let m = Scrape::in_netns(&n.node.netns_path(), "127.0.0.1:9631").await?;
        let failed = m.sum("kuryr_binder_policy_transactions_total", &[("result", "error")]);
        anyhow::ensure!(failed == 0.0, "{}: {failed} failed policy transactions", n.name);
        anyhow::ensure!(m.value("kuryr_binder_policy_synced", &[])? == 1.0, "{}: not in sync", n.name);
        let (count, sum) = (m.count(PROGRAM, &[]), m.hist_sum(PROGRAM, &[]));
        anyhow::ensure!(count > 0.0, "{}: nothing programmed", n.name);
        eprintln!(
            "  {}: {count} policy transactions, mean {:.1} ms from stream event to nft done",
            n.name,
            sum / count * 1e3
        );
    }
    let p = Scrape::http(&cluster.policy().context("kuryr-policy")?.metrics).await?;
    anyhow::ensure!(p.value("kuryr_policy_watch_subscribers", &[])? == 2.0, "kuryr-policy: subscribers");
    let (count, sum) = (p.count("kuryr_policy_publish_seconds", &[]), p.hist_sum("kuryr_policy_publish_seconds", &[]));
    eprintln!("  kuryr-policy: {count} publications, mean {:.2} ms compile + publish", sum / count.max(1.0) * 1e3);
    Ok(())
}

/// The Event on NetworkPolicy `namespace/name` with `reason` whose note contains `note` appears.
async fn wait_event(client: &kube::Client, namespace: &str, name: &str, reason: &str, note: &str) -> Result<()> {
    let events: Api<Event> = Api::namespaced(client.clone(), namespace);
    kuryr_tests::services::wait_until(
        &format!("a {reason} Event on NetworkPolicy {name}"),
        CONVERGE_TIMEOUT,
        || async {
            let all = events.list(&ListParams::default()).await?.items;
            let on: Vec<&Event> = all
                .iter()
                .filter(|e| {
                    e.regarding.as_ref().is_some_and(|r| {
                        r.kind.as_deref() == Some("NetworkPolicy") && r.name.as_deref() == Some(name) && r.uid.is_some()
                    })
                })
                .collect();
            let found = on.iter().any(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.reporting_controller.as_deref() == Some("kuryr-policy")
                    && e.note.as_deref().is_some_and(|n| n.contains(note))
            });
            let seen: Vec<String> = on.iter().map(|e| format!("{:?}: {:?}", e.reason, e.note)).collect();
            anyhow::ensure!(found, "Events on it so far: {seen:?}");
            Ok(())
        },
    )
    .await
}

/// A policy naming a port its pod does not declare: a Warning Event says so, and the metrics
/// of the status Events, the rules and the set elements move.
async fn status(cluster: &Cluster, policies: &Api<NetworkPolicy>, node: &str) -> Result<()> {
    let policy_svc = cluster.policy().context("kuryr-policy")?;
    let before = Scrape::http(&policy_svc.metrics).await?;
    let missing = policy(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "named-missing"},
        "spec": {"podSelector": {"matchLabels": {"app": "server"}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}], "ports": [{"port": "no-such-port"}]}]}
    }));
    policies.create(&PostParams::default(), &missing).await?;
    let note = format!(
        "compiled; enforced on 1 node ({node}) for 1 pod; named port \"no-such-port\" is not declared by 1 of the 1 pod it isolates"
    );
    wait_event(&cluster.client(), NS_A, "named-missing", "UnresolvedNamedPort", &note).await?;
    let host = cluster.node(node).context("the server's node")?.node.netns_path();
    kuryr_tests::services::wait_until("the binder's rules and elements gauges", CONVERGE_TIMEOUT, || async {
        let m = Scrape::in_netns(&host, "127.0.0.1:9631").await?;
        let (rules, elements) =
            (m.value("kuryr_binder_policy_rules", &[])?, m.value("kuryr_binder_policy_elements", &[])?);
        anyhow::ensure!(rules > 0.0 && elements > 0.0, "{node}: {rules} rules, {elements} elements");
        Ok(())
    })
    .await?;
    // An Event is counted once its write is answered, which may be after the test saw it.
    let after = kuryr_tests::services::wait_until("the Warning Event counted", CONVERGE_TIMEOUT, || async {
        let after = Scrape::http(&policy_svc.metrics).await?;
        after
            .moved(&before, "kuryr_policy_status_events_total", &[("type", "Warning"), ("result", "ok")])
            .at_least(1.0)?;
        Ok(after)
    })
    .await?;
    anyhow::ensure!(
        after.sum("kuryr_policy_status_events_total", &[("result", "error")]) == 0.0,
        "status Events not written"
    );
    anyhow::ensure!(after.value("kuryr_policy_elements", &[])? > 0.0, "kuryr-policy: no set elements compiled");
    policies.delete("named-missing", &DeleteParams::default()).await?;
    eprintln!("  status Events: Compiled and UnresolvedNamedPort on the NetworkPolicies");
    Ok(())
}

/// An isolated pod is deleted; pods are created on its node until one gets its IPv4 address back;
/// that pod, not selected by any policy, is reachable.
async fn ip_reuse(
    cluster: &Cluster,
    w: &mut World,
    pods: &Api<Pod>,
    policies: &Api<NetworkPolicy>,
    node: &str,
) -> Result<()> {
    let deny = policy(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "locked"},
        "spec": {"podSelector": {"matchLabels": {"app": "locked"}}, "policyTypes": ["Ingress"]}
    }));
    policies.create(&PostParams::default(), &deny).await?;
    pods.create(&PostParams::default(), &pod("locked", node, "locked")).await?;
    w.refresh(cluster, NS_A, 5).await?;
    w.check("deny-all ingress", &[("np-a/client", "np-a/locked", Proto::Tcp, PORT, Denied)]).await?;
    let old = w.ip("np-a/locked", true);
    // What grpcurl shows of the node's compiled policy: the pod isolated by the policy's group.
    // It is the binders' to read, each (with its node-bound token) its own node's only.
    let policy_svc = cluster.policy().context("kuryr-policy")?;
    let get = "kuryr.policy.v1.Policies/GetNodePolicy";
    let body = format!(r#"{{"node_name":"{node}"}}"#);
    let (ok, out) = grpcurl(&["-plaintext", "-d", &body, &policy_svc.tcp, get]).await?;
    anyhow::ensure!(!ok && out.contains("Unauthenticated"), "GetNodePolicy without a token: {out}");
    let own = cluster.kube().kuryr_token("kuryr-system", "kuryr-binder", Some(node)).await?;
    let [h, own] = kuryr_tests::auth::grpcurl_header(&own);
    let (ok, out) = grpcurl(&["-plaintext", &h, &own, "-d", &body, &policy_svc.tcp, get]).await?;
    anyhow::ensure!(ok && out.contains(&format!("\"{old}\"")) && out.contains("np-a/locked"), "GetNodePolicy: {out}");
    let other = cluster.nodes().iter().map(|n| n.name.clone()).find(|n| n != node).context("a second node")?;
    let other = cluster.kube().kuryr_token("kuryr-system", "kuryr-binder", Some(&other)).await?;
    let [h, other] = kuryr_tests::auth::grpcurl_header(&other);
    let (ok, out) = grpcurl(&["-plaintext", &h, &other, "-d", &body, &policy_svc.tcp, get]).await?;
    anyhow::ensure!(!ok && out.contains("PermissionDenied"), "another node's binder reading {node}'s policy: {out}");
    let (ok, out) = grpcurl(&["-plaintext", &h, &own, "-d", "{}", &policy_svc.tcp, get]).await?;
    anyhow::ensure!(!ok && out.contains("InvalidArgument") && out.contains("node_name"), "empty node_name: {out}");
    pods.delete("locked", &DeleteParams::default()).await?;
    w.running.remove("np-a/locked");
    let mut expected = 4;
    checks::wait_running(cluster, NS_A, expected, RUNNING_TIMEOUT).await?;
    for i in 0..16 {
        let name = format!("fresh-{i}");
        pods.create(&PostParams::default(), &pod(&name, node, "fresh")).await?;
        expected += 1;
        w.refresh(cluster, NS_A, expected).await?;
        if w.ip(&format!("{NS_A}/{name}"), true) == old {
            let took = expect_at(&w.netns("np-a/client"), old, Proto::Tcp, PORT, Allowed)
                .await
                .with_context(|| format!("{name} got {old}, the deleted isolated pod's address"))?;
            eprintln!("  {name} reuses {old} and is reachable ({took:?})");
            return Ok(());
        }
    }
    bail!("no new pod got {old} back after 16 pods")
}
