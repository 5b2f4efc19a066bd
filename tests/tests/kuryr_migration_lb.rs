//! Migration from Kuryr-Kubernetes, the load-balancer half, on the real services: Kuryr-
//! Kubernetes 10.0.0's own controller (its venv, `tests/env/openstack/setup.sh kuryr`) with its
//! load-balancer handlers (`service`, `endpoints`, `kuryrloadbalancer`) makes a Service's Octavia
//! load balancer against the real kube-apiserver, Keystone, Neutron and Octavia (API + worker,
//! amphora provider with the no-op compute/network/amphora drivers, tests/env/openstack) with
//! its documented Octavia settings (`[neutron_defaults] service_subnet`, `[octavia_defaults]
//! member_mode = L2`, `enforce_sg_rules = false`); it is stopped, `kuryr-migrate` hands the load
//! balancer over, and kuryr-rs' lbaas (Octavia backend) adopts it.
//!
//! 1. Kuryr networks three pods and, for a Service with a TCP and a UDP port and two of the pods
//!    as endpoints, creates the load balancer, a listener and a pool per port and their members,
//!    recorded in its KuryrLoadBalancer;
//! 2. `--dry-run` lists the Service with its load balancer and changes nothing;
//! 3. a run killed right after lbaas' finalizer went on the Service (before Kuryr's came off),
//!    then a full run, converges: the load balancer carries lbaas' ownership tags, Kuryr's
//!    finalizers and the KuryrLoadBalancer are gone, Octavia's objects unchanged; a further run
//!    is a no-op;
//! 4. lbaas adopts it: the same load balancer, listener and pool ids, its record ACTIVE; since
//!    Kuryr stopped, Octavia's API (its own request log) received no listener or pool creation
//!    and one load balancer creation, that of the API server's own Service `default/kubernetes`
//!    (which Kuryr skips and lbaas serves); an endpoint change (one pod out, another in) is
//!    converged into both pools' members; deleting the Service removes the load balancer and
//!    leaves nothing of it in Octavia.
//!
//! What the environment, not Kuryr, lacks: Octavia's network driver is the no-op one here, so no
//! Neutron VIP port is made for a load balancer, while Kuryr looks the VIP port up in Neutron
//! right after creating the load balancer (`_get_vip_port(...).id`, an AttributeError on `None`
//! without one) and clears its security groups. The suite makes that port beforehand — the
//! cluster IP on the Service subnet, `device_owner` `Octavia`, as Octavia's allowed-address-pairs
//! driver would — and removes it at the end, as that driver does when the load balancer goes.
//! Kubelet and the endpoint controllers do not run: the suite sets the pods' `status.podIP` (which
//! Kuryr's member handling looks pods up by) and writes the Service's Endpoints (what Kuryr
//! watches) and EndpointSlice (what kuryr-rs watches) as those controllers would.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use k8s_openapi::api::core::v1::{Endpoints, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kuryr_lbaas::k8s::crd::ServiceLoadBalancer;
use kuryr_openstack::Filter;
use kuryr_openstack::neutron::{FixedIp, PortCreate};
use kuryr_proto::service_names::LOAD_BALANCERS;
use kuryr_tests::kuryr_controller::{self as kuryr, KuryrConfig, KuryrController, Migrate};
use kuryr_tests::neutron::NeutronCluster;
use kuryr_tests::openstack::OctaviaLbaas;
use kuryr_tests::services::wait_until;
use kuryr_tests::sut;
use kuryr_tests::topology;
use serde_json::{Value, json};

const NS: &str = "legacy-lb";
const SVC: &str = "web";
/// The Service's cluster IP: in the API server's Service range (10.96.0.0/16).
const CLUSTER_IP: &str = "10.96.20.10";
/// lbaas' `--cluster-name` (and kuryr-migrate's).
const CLUSTER_NAME: &str = "migrated-lb";
/// The pods' ports behind the Service's `http` (TCP 80) and `dns` (UDP 53).
const HTTP_PORT: u16 = 8080;
const DNS_PORT: u16 = 5353;
/// Bound on what goes through Neutron, Octavia or Kuryr (a loaded machine).
const SLOW: Duration = Duration::from_secs(300);
const KURYR_SERVICE_FINALIZER: &str = "kuryr.openstack.org/service-finalizer";

/// Octavia's API read directly, as an operator would.
struct OctaviaApi {
    http: reqwest::Client,
    base: String,
    project: String,
}

impl OctaviaApi {
    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        let resp = self
            .http
            .get(format!("{}/v2/lbaas/{path}", self.base))
            .header("X-Project-Id", &self.project)
            .send()
            .await?;
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        anyhow::ensure!(status.is_success(), "GET {path}: {status} {body}");
        Ok(body)
    }

    async fn list(&self, what: &str, query: &str) -> anyhow::Result<Vec<Value>> {
        let body = self.get(&format!("{what}?{query}")).await?;
        Ok(body[what].as_array().cloned().unwrap_or_default())
    }

    /// The load balancer's tree once ACTIVE: (listener id, `PROTO:port`, pool id, sorted
    /// `address:port` members, every one ACTIVE).
    async fn tree(&self, lb: &str) -> anyhow::Result<Vec<(String, String, String, Vec<String>)>> {
        let body = self.get(&format!("loadbalancers/{lb}")).await?;
        anyhow::ensure!(body["loadbalancer"]["provisioning_status"] == "ACTIVE", "{}", body["loadbalancer"]);
        let mut out = Vec::new();
        for l in self.list("listeners", &format!("loadbalancer_id={lb}")).await? {
            let pool = l["default_pool_id"].as_str().unwrap_or_default().to_string();
            let mut members = Vec::new();
            if !pool.is_empty() {
                let body = self.get(&format!("pools/{pool}/members")).await?;
                for m in body["members"].as_array().cloned().unwrap_or_default() {
                    anyhow::ensure!(m["provisioning_status"] == "ACTIVE", "member not ACTIVE: {m}");
                    members.push(format!("{}:{}", m["address"].as_str().unwrap_or_default(), m["protocol_port"]));
                }
            }
            members.sort();
            let name = format!("{}:{}", l["protocol"].as_str().unwrap_or_default(), l["protocol_port"]);
            out.push((l["id"].as_str().unwrap_or_default().to_string(), name, pool, members));
        }
        out.sort();
        Ok(out)
    }

    /// Waits until `lb` is ACTIVE with the listeners `TCP:80` and `UDP:53` whose pools have
    /// exactly `members` (on the target ports); returns (listener id, pool id) of each.
    async fn wait_members(&self, lb: &str, members: &[&str], logs: impl Fn() -> String) -> Vec<(String, String)> {
        let on = |port: u16| {
            let mut v: Vec<String> = members.iter().map(|m| format!("{m}:{port}")).collect();
            v.sort();
            v
        };
        let want = [("TCP:80".to_string(), on(HTTP_PORT)), ("UDP:53".to_string(), on(DNS_PORT))];
        let tree = wait_until(&format!("load balancer {lb} with {want:?}"), SLOW, || async {
            let mut tree = self.tree(lb).await?;
            tree.sort_by(|a, b| a.1.cmp(&b.1));
            let have: Vec<(String, Vec<String>)> = tree.iter().map(|(_, l, _, m)| (l.clone(), m.clone())).collect();
            anyhow::ensure!(have == want, "have {tree:?}");
            Ok(tree)
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", logs()));
        tree.into_iter().map(|(l, _, p, _)| (l, p)).collect()
    }

    /// Every load balancer, listener and pool of the project (`kind/id`), DELETED ones and
    /// those of the load balancer `except` left out.
    async fn everything(&self, except: Option<&str>) -> Vec<String> {
        let mut out = Vec::new();
        for what in ["loadbalancers", "listeners", "pools"] {
            for o in self.list(what, "").await.unwrap() {
                let id = o["id"].as_str().unwrap();
                let lb = o["loadbalancers"][0]["id"].as_str().unwrap_or(id);
                if o["provisioning_status"] != "DELETED" && Some(lb) != except {
                    out.push(format!("{what}/{id}"));
                }
            }
        }
        out
    }

    /// The load balancers of the project (id, name), DELETED ones left out.
    async fn live_lbs(&self) -> Vec<(String, String)> {
        let lbs = self.list("loadbalancers", "").await.unwrap();
        lbs.iter()
            .filter(|l| l["provisioning_status"] != "DELETED")
            .map(|l| (l["id"].as_str().unwrap().to_string(), l["name"].as_str().unwrap_or_default().to_string()))
            .collect()
    }
}

/// `kuryr-migrate` with this suite's cluster flags and `extra`.
fn migrate(c: &NeutronCluster, extra: &[&str], crash_after: Option<usize>) -> Migrate {
    let mut args = vec!["--cluster-id", CLUSTER_NAME, "--cluster-name", CLUSTER_NAME, "--service-finalizer", "all"];
    args.extend_from_slice(extra);
    kuryr::migrate(c, &args, crash_after).unwrap()
}

/// The IPv4 address Kuryr recorded in a KuryrPort, once it has.
fn kuryr_ipv4(kp: &DynamicObject) -> Option<String> {
    let vif = &kp.data["status"]["vifs"]["eth0"]["vif"]["versioned_object.data"];
    let subnets = vif["network"]["versioned_object.data"]["subnets"]["versioned_object.data"]["objects"].as_array()?;
    subnets
        .iter()
        .flat_map(|s| {
            s["versioned_object.data"]["ips"]["versioned_object.data"]["objects"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|ip| ip["versioned_object.data"]["address"].as_str().map(str::to_string))
        .find(|a| !a.contains(':'))
}

/// The endpoints' ports (Endpoints and EndpointSlice spell them alike).
fn ports() -> Value {
    json!([{"name": "http", "port": HTTP_PORT, "protocol": "TCP"}, {"name": "dns", "port": DNS_PORT, "protocol": "UDP"}])
}

/// The Service's Endpoints as the endpoints controller writes them (what Kuryr watches).
fn endpoints(pods: &[(&str, String, String)]) -> Endpoints {
    let addresses: Vec<Value> = pods
        .iter()
        .map(|(name, uid, ip)| json!({"ip": ip, "targetRef": {"kind": "Pod", "namespace": NS, "name": name, "uid": uid}}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": SVC, "namespace": NS},
        "subsets": [{"addresses": addresses, "ports": ports()}],
    }))
    .unwrap()
}

/// The Service's EndpointSlice as the EndpointSlice controller writes it (what kuryr-rs watches).
fn slice(pods: &[(&str, String, String)]) -> EndpointSlice {
    let eps: Vec<Value> = pods
        .iter()
        .map(|(name, uid, ip)| {
            let mut e = sut::ready_endpoint(ip);
            e["targetRef"] = json!({"kind": "Pod", "namespace": NS, "name": name, "uid": uid});
            e
        })
        .collect();
    sut::slice(&format!("{SVC}-1"), SVC, "IPv4", ports(), Value::Array(eps)).unwrap()
}

#[tokio::test]
async fn kuryr_load_balancers_are_adopted_by_kuryr_rs_without_a_new_one() {
    kuryr::setup().unwrap();
    let c = NeutronCluster::start_with_octavia(&[NS]).await.unwrap();
    kuryr::apply_crds(&c).await.unwrap();
    let ks = c.os.keystone().unwrap();
    let octavia_url = c.os.octavia_url().unwrap().to_string();
    let octavia =
        OctaviaApi { http: reqwest::Client::new(), base: octavia_url.clone(), project: ks.project_id.clone() };
    let octavia_log = c.os.state_dir().join("logs/octavia-api.log");

    // The Service subnet: the API server's Service range, in Kuryr's project.
    let (svc_net, svc_sub) = topology::service_network(&c.neutron, Some(&ks.project_id)).await.unwrap();
    // The VIP port Octavia's network driver would make (the no-op one here makes none).
    let vip_port = c
        .neutron
        .create_port(PortCreate {
            network_id: svc_net.id.clone(),
            name: Some("octavia-lb-vip".into()),
            project_id: Some(ks.project_id.clone()),
            fixed_ips: Some(vec![FixedIp { subnet_id: Some(svc_sub.id.clone()), ip_address: Some(CLUSTER_IP.into()) }]),
            device_owner: Some("Octavia".into()),
            ..Default::default()
        })
        .await
        .unwrap();

    // 1. Kuryr networks three pods and makes the Service's load balancer.
    let config = KuryrConfig {
        handlers: "vif,kuryrport,service,endpoints,kuryrloadbalancer".into(),
        service_subnet: Some(svc_sub.id.clone()),
        extra: "[octavia_defaults]\nmember_mode = L2\nenforce_sg_rules = false\n".into(),
        ..Default::default()
    };
    let mut k = KuryrController::start(&c, c.dir.path(), &config).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(c.admin.clone(), NS);
    let kps: Api<DynamicObject> =
        Api::namespaced_with(c.admin.clone(), NS, &kuryr::resource("KuryrPort", "kuryrports"));
    let klbs: Api<DynamicObject> =
        Api::namespaced_with(c.admin.clone(), NS, &kuryr::resource("KuryrLoadBalancer", "kuryrloadbalancers"));
    let mut backends: Vec<(&str, String, String)> = Vec::new();
    for name in ["web-a", "web-b", "web-c"] {
        let mut pod = c.pod(name);
        pod.metadata.labels = Some([("app".to_string(), SVC.to_string())].into());
        let uid = pods.create(&PostParams::default(), &pod).await.unwrap().metadata.uid.unwrap();
        backends.push((name, uid, String::new()));
    }
    for (name, _, ip) in &mut backends {
        *ip = wait_until(&format!("Kuryr to give {name} a port"), SLOW, || async {
            kuryr_ipv4(&kps.get(name).await?).ok_or_else(|| anyhow::anyhow!("no VIF in the KuryrPort yet"))
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\nKuryr's log:\n{}", k.log_tail()));
        // What kubelet reports once the sandbox runs: Kuryr finds a member's pod by it.
        let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
        pods.patch_status(name, &PatchParams::default(), &Patch::Merge(status)).await.unwrap();
    }
    let services: Api<Service> = Api::namespaced(c.admin.clone(), NS);
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": SVC},
        "spec": {"clusterIP": CLUSTER_IP, "selector": {"app": SVC},
                 "ports": [{"name": "http", "port": 80, "targetPort": HTTP_PORT, "protocol": "TCP"},
                           {"name": "dns", "port": 53, "targetPort": DNS_PORT, "protocol": "UDP"}]},
    }))
    .unwrap();
    let svc_uid = services.create(&PostParams::default(), &svc).await.unwrap().metadata.uid.unwrap();
    let eps: Api<Endpoints> = Api::namespaced(c.admin.clone(), NS);
    let slices: Api<EndpointSlice> = Api::namespaced(c.admin.clone(), NS);
    eps.create(&PostParams::default(), &endpoints(&backends[..2])).await.unwrap();
    sut::put_slice(&slices, slice(&backends[..2])).await.unwrap();

    let ip = |i: usize| backends[i].2.as_str();
    let lb_id = wait_until("Kuryr to record the load balancer with its members", SLOW, || async {
        let klb = klbs.get(SVC).await?;
        let st = &klb.data["status"];
        let id = st["loadbalancer"]["id"].as_str().ok_or_else(|| anyhow::anyhow!("no load balancer: {st}"))?;
        let n = |k: &str| st[k].as_array().map_or(0, Vec::len);
        anyhow::ensure!((n("listeners"), n("pools"), n("members")) == (2, 2, 4), "{st}");
        Ok(id.to_string())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\nKuryr's log:\n{}", k.log_tail()));
    let kuryr_tree = octavia.wait_members(&lb_id, &[ip(0), ip(1)], || k.log_tail()).await;
    let lb = octavia.get(&format!("loadbalancers/{lb_id}")).await.unwrap()["loadbalancer"].clone();
    assert_eq!(lb["vip_address"], CLUSTER_IP, "{lb}");
    assert_eq!(lb["name"], format!("{NS}/{SVC}"), "Kuryr's name: {lb}");
    let fin = services.get(SVC).await.unwrap().metadata.finalizers.unwrap_or_default();
    assert!(fin.iter().any(|f| f == KURYR_SERVICE_FINALIZER), "Kuryr's Service finalizer: {fin:?}");
    // Kuryr's pool tops itself up after each pod: once at its minimum it creates no more ports.
    kuryr::wait_pool_minimum(&c, 2, SLOW).await.unwrap_or_else(|e| panic!("{e:#}\nKuryr's log:\n{}", k.log_tail()));
    k.stop();
    let stopped = kuryr::epoch_now();
    eprintln!("Kuryr stopped at {stopped}");
    // The request log sees Kuryr's own creation (its SDK's `/v2.0/lbaas/...`).
    let made = kuryr::requests_since(&octavia_log, "POST", "/lbaas/loadbalancers =>", 0).unwrap();
    assert_eq!(made.len(), 1, "Kuryr's load balancer creation in Octavia's request log: {made:#?}");
    let octavia_before = octavia.everything(None).await;

    // 2. The plan lists the Service and changes nothing.
    let dry = migrate(&c, &["--dry-run"], None);
    assert_eq!(dry.code, 0, "{}", dry.stderr);
    let line = format!(
        "service {NS}/{SVC}: load balancer {lb_id} (2 listeners, 2 pools, 4 members): tag the load balancer, \
         add lbaas' Service finalizer, remove Kuryr's Service finalizer, remove the KuryrLoadBalancer's finalizers, \
         delete the KuryrLoadBalancer"
    );
    assert!(dry.stdout.lines().any(|l| l == line), "no {line:?} in\n{}", dry.stdout);
    assert!(dry.last_line().starts_with("plan: 3 pods, 1 services, "), "{}", dry.stdout);
    let steps: usize = dry.last_line().split("; ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    let ours = kuryr_lbaas::backend::octavia::plan::tags(CLUSTER_NAME, &format!("{NS}/{SVC}"), &svc_uid);
    let tags = |lb: &Value| -> Vec<String> {
        lb["tags"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
    };
    let lb = octavia.get(&format!("loadbalancers/{lb_id}")).await.unwrap()["loadbalancer"].clone();
    assert!(!ours.iter().any(|t| tags(&lb).contains(t)), "the dry run tagged the load balancer: {lb}");
    assert!(klbs.get_opt(SVC).await.unwrap().is_some(), "the dry run deleted the KuryrLoadBalancer");

    // 3. Killed right after lbaas' finalizer went on (the Service's steps come last), then run
    //    again: converges.
    let crashed = migrate(&c, &[], Some(steps - 3));
    assert_eq!(crashed.code, 70, "the crash hook: {}", crashed.stderr);
    assert!(crashed.stderr.contains("add lbaas' Service finalizer"), "crashed elsewhere: {}", crashed.stderr);
    let fin = services.get(SVC).await.unwrap().metadata.finalizers.unwrap_or_default();
    assert!(fin.iter().any(|f| f == KURYR_SERVICE_FINALIZER), "Kuryr's finalizer went too early: {fin:?}");
    assert!(klbs.get_opt(SVC).await.unwrap().is_some(), "the KuryrLoadBalancer went too early");
    let done = migrate(&c, &[], None);
    assert_eq!(done.code, 0, "{}\n{}", done.stdout, done.stderr);
    assert_eq!(done.last_line(), "migrated: 0 pods, 1 services, 0 pool ports; 3 steps done, 0 blocked, 0 kept");
    let lb = octavia.get(&format!("loadbalancers/{lb_id}")).await.unwrap()["loadbalancer"].clone();
    for t in &ours {
        assert!(tags(&lb).contains(t), "the load balancer lacks {t}: {lb}");
    }
    let fin = services.get(SVC).await.unwrap().metadata.finalizers.unwrap_or_default();
    assert_eq!(fin, vec![kuryr_lbaas::core::view::FINALIZER.to_string()], "the Service's finalizers");
    assert!(klbs.get_opt(SVC).await.unwrap().is_none(), "the KuryrLoadBalancer is left");
    let again = migrate(&c, &[], None);
    assert_eq!(again.code, 0);
    assert_eq!(again.last_line(), "migrated: 0 pods, 0 services, 0 pool ports; 0 steps done, 0 blocked, 0 kept");
    assert_eq!(octavia.everything(None).await, octavia_before, "the migration changed Octavia's objects");

    // 4. lbaas adopts the load balancer.
    let watcher = c.watcher().unwrap();
    let o = OctaviaLbaas {
        url: octavia_url.clone(),
        project: ks.project_id.clone(),
        vip_subnet: Some(svc_sub.id.clone()),
        cluster_name: CLUSTER_NAME.into(),
        drift_interval: "3s".into(),
        active_timeout: "120s".into(),
    };
    let lbaas =
        c.lbaas(&watcher, &o, &["--log", "info,kuryr_lbaas=debug", "--service-finalizer", "all"]).await.unwrap();
    lbaas.wait_serving(LOAD_BALANCERS, SLOW).await.unwrap();
    let records: Api<ServiceLoadBalancer> = Api::namespaced(c.admin.clone(), NS);
    let record = sut::wait_record_active(&records, SVC, SLOW)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)))
        .status
        .unwrap_or_default();
    assert_eq!(record.backend_id.as_deref(), Some(lb_id.as_str()), "lbaas recorded another load balancer");
    let adopted = octavia.wait_members(&lb_id, &[ip(0), ip(1)], || lbaas.logs_tail(60)).await;
    assert_eq!(adopted, kuryr_tree, "a listener or pool was replaced");
    // lbaas, unlike Kuryr (which skips it), also serves the API server's own Service
    // `default/kubernetes`: that one load balancer is new, made in one fully-populated call
    // (no listener or pool of its own). Nothing else was created.
    let kubernetes_lb = format!("{CLUSTER_NAME}/default/kubernetes");
    let lbs = wait_until("lbaas' load balancer of default/kubernetes", SLOW, || async {
        let lbs = octavia.live_lbs().await;
        anyhow::ensure!(lbs.iter().any(|(_, n)| *n == kubernetes_lb), "{lbs:?}");
        Ok(lbs)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));
    let others: Vec<&(String, String)> = lbs.iter().filter(|(id, n)| *n != kubernetes_lb && *id != lb_id).collect();
    assert!(others.is_empty(), "load balancers besides Kuryr's and default/kubernetes': {lbs:?}");
    let kubernetes_id = lbs.iter().find(|(_, n)| *n == kubernetes_lb).map(|(id, _)| id.clone()).unwrap();
    let created = |what: &str| kuryr::requests_since(&octavia_log, "POST", &format!("/lbaas/{what} =>"), stopped);
    let check_created = || {
        let all = kuryr::requests_since(&octavia_log, "POST", "/lbaas/", 0).unwrap();
        assert_eq!(
            created("loadbalancers").unwrap().len(),
            1,
            "load balancers created since Kuryr stopped (at {stopped}): {all:#?}"
        );
        for what in ["listeners", "pools"] {
            assert_eq!(
                created(what).unwrap(),
                Vec::<String>::new(),
                "{what} created since Kuryr stopped (at {stopped})"
            );
        }
    };
    check_created();

    // An endpoint change: web-a out, web-c in.
    let new_backends = [backends[1].clone(), backends[2].clone()];
    sut::put_slice(&slices, slice(&new_backends)).await.unwrap();
    let after = octavia.wait_members(&lb_id, &[ip(1), ip(2)], || lbaas.logs_tail(60)).await;
    assert_eq!(after, kuryr_tree, "the endpoint change replaced a listener or pool");
    check_created();

    // Deleting the Service removes the load balancer; nothing is left in Octavia.
    services.delete(SVC, &DeleteParams::default()).await.unwrap();
    slices.delete(&format!("{SVC}-1"), &DeleteParams::default()).await.unwrap();
    eps.delete(SVC, &DeleteParams::default()).await.unwrap();
    wait_until("the Service gone and nothing left in Octavia", SLOW, || async {
        anyhow::ensure!(services.get_opt(SVC).await?.is_none(), "the Service is still there (finalizer)");
        let left = octavia.everything(Some(&kubernetes_id)).await;
        anyhow::ensure!(left.is_empty(), "left in Octavia: {left:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", lbaas.logs_tail(60)));
    assert!(records.get_opt(SVC).await.unwrap().is_none(), "lbaas' record is left");
    // Only the VIP port made for Octavia's no-op network driver is on the Service network;
    // removed as that driver would with the load balancer.
    let on_svc_net = c.neutron.list_ports(&Filter::new().network_id(&svc_net.id)).await.unwrap();
    let ids: Vec<&str> = on_svc_net.iter().map(|p| p.id.as_str()).collect();
    assert_eq!(ids, vec![vip_port.id.as_str()], "ports on the Service network");
    c.neutron.delete_port(&vip_port.id).await.unwrap();
    drop(watcher);
}
