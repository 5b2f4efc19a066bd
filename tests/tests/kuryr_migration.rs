//! Migration from Kuryr-Kubernetes, on the real services: Kuryr-Kubernetes 10.0.0's own
//! controller (from its venv, `tests/env/openstack/setup.sh kuryr`) gives pods Neutron ports
//! against the real kube-apiserver, Keystone and Neutron (API, RPC, ML2/OVS agent), with its
//! documented configuration (neutron VIF driver, ports pool); it is stopped, `kuryr-migrate`
//! hands its state to kuryr-rs, and kuryr-rs' allocator (Neutron backend) and binder take over.
//!
//! 1. Kuryr networks two pods: KuryrPorts with VIFs, ports bound to node-1, pool ports made;
//! 2. `--dry-run` prints the plan and changes nothing;
//! 3. a run killed after its third step (the crash hook), then a full run, converges: ports
//!    tagged, PodVifs recording them, the allocator's finalizer on the pods, Kuryr's finalizers
//!    and KuryrPorts gone; a further run is a no-op;
//! 4. the allocator and a binder start: a CNI ADD for a migrated pod returns Kuryr's port —
//!    same id, MAC and address — ACTIVE; a new pod is networked from Kuryr's former pool ports;
//!    the pods ping each other; not one port was created in Neutron since Kuryr stopped
//!    (POST /v2.0/ports in the Neutron API's own log) and no port was deleted;
//! 5. deleting a migrated pod frees its port the way the allocator frees its own.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::core::ApiResource;
use kuryr_openstack::Filter;
use kuryr_tests::kuryr_controller::{self, KuryrConfig, KuryrController, Migrate};
use kuryr_tests::netns::Netns;
use kuryr_tests::neutron::{AllocatorOptions, CniPod, NeutronCluster};
use kuryr_tests::services::wait_until;
use kuryr_vif_allocator::k8s::crd::{PodVif, VifState};

const NS: &str = "legacy";
/// Bound on what goes through Neutron and its agent, or through Kuryr (a loaded machine).
const SLOW: Duration = Duration::from_secs(240);
const QUICK: Duration = Duration::from_secs(60);
const CLUSTER_ID: &str = "migrated";

fn kuryr_port_resource() -> ApiResource {
    kuryr_controller::resource("KuryrPort", "kuryrports")
}

/// `POST /v2.0/ports` requests the Neutron API received after `since` (seconds since the epoch).
fn port_posts_since(c: &NeutronCluster, since: u64) -> Vec<String> {
    let log = c.os.state_dir().join("logs/neutron-api.log");
    kuryr_controller::requests_since(&log, "POST", "/v2.0/ports ", since).unwrap()
}

/// `kuryr-migrate` with this suite's cluster flags and `extra`.
fn migrate(c: &NeutronCluster, extra: &[&str], crash_after: Option<usize>) -> Migrate {
    let mut args = vec!["--cluster-id", CLUSTER_ID];
    args.extend_from_slice(extra);
    kuryr_controller::migrate(c, &args, crash_after).unwrap()
}

/// What Kuryr recorded for a pod: (port id, MAC, IPv4 address), once it has.
fn kuryr_vif(kp: &DynamicObject) -> Option<(String, String, String)> {
    let vif = &kp.data["status"]["vifs"]["eth0"]["vif"]["versioned_object.data"];
    let id = vif["id"].as_str()?.to_string();
    let mac = vif["address"].as_str()?.to_string();
    let subnet = &vif["network"]["versioned_object.data"]["subnets"]["versioned_object.data"]["objects"][0];
    let ip = subnet["versioned_object.data"]["ips"]["versioned_object.data"]["objects"][0]["versioned_object.data"]
        ["address"]
        .as_str()?
        .to_string();
    Some((id, mac, ip))
}

fn ipv4_of(result: &serde_json::Value) -> String {
    let ips = result["ips"].as_array().unwrap();
    let a = ips.iter().map(|i| i["address"].as_str().unwrap()).find(|a| !a.contains(':')).unwrap();
    a.split('/').next().unwrap().to_string()
}

async fn ping(from: &Netns, to: &str) {
    wait_until(&format!("{} to reach {to}", from.name), QUICK, || async {
        from.exec(&["ping", "-4", "-n", "-c", "1", "-W", "2", to]).map(drop)
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn kuryr_ports_are_handed_to_kuryr_rs_without_a_new_port() {
    kuryr_controller::setup().unwrap();
    let c = NeutronCluster::start(&[NS]).await.unwrap();
    kuryr_controller::apply_crds(&c).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(c.admin.clone(), NS);
    let kps: Api<DynamicObject> = Api::namespaced_with(c.admin.clone(), NS, &kuryr_port_resource());
    let vifs: Api<PodVif> = Api::namespaced(c.admin.clone(), NS);

    // 1. Kuryr networks two pods.
    let mut kuryr = KuryrController::start(&c, c.dir.path(), &KuryrConfig::default()).await.unwrap();
    let mut old = Vec::new();
    for name in ["old-a", "old-b"] {
        let made = pods.create(&PostParams::default(), &c.pod(name)).await.unwrap();
        old.push((name, made.metadata.uid.unwrap()));
    }
    let mut kuryr_ports = Vec::new();
    for (name, uid) in &old {
        let vif = wait_until(&format!("Kuryr to give {name} a port"), SLOW, || async {
            let kp = kps.get(name).await?;
            kuryr_vif(&kp).ok_or_else(|| anyhow::anyhow!("no VIF in the KuryrPort yet"))
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\nKuryr's log:\n{}", kuryr.log_tail()));
        let port = c.neutron.get_port(&vif.0).await.unwrap();
        assert_eq!(&port.device_id, uid, "Kuryr's port of {name} names the pod");
        assert_eq!(port.binding_host_id.as_deref(), Some(c.node.host.as_str()));
        assert_eq!(port.binding_vif_type.as_deref(), Some("ovs"), "Kuryr's port of {name} is bound");
        kuryr_ports.push(vif);
    }
    // Kuryr keeps pool ports too. Once its pool is at its minimum it creates no more, so that
    // stopping it then leaves no port creation in flight.
    let pool_filter = Filter::new().network_id(&c.net.network_id).device_owner("compute:kuryr");
    kuryr_controller::wait_pool_minimum(&c, 2, SLOW)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\nKuryr's log:\n{}", kuryr.log_tail()));
    kuryr.stop();
    let stopped = kuryr_controller::epoch_now();
    // Kuryr may have been part-way through a bulk create when stopped: settle on what exists.
    let before: BTreeSet<String> =
        c.neutron.list_ports(&pool_filter).await.unwrap().into_iter().map(|p| p.id).collect();
    let kuryr_pool: BTreeSet<String> = c
        .neutron
        .list_ports(&pool_filter)
        .await
        .unwrap()
        .into_iter()
        .filter(|p| p.device_id.is_empty())
        .map(|p| p.id)
        .collect();
    eprintln!("Kuryr made {} ports ({} free in its pool)", before.len(), kuryr_pool.len());

    // 2. The plan changes nothing.
    let dry = migrate(&c, &["--dry-run"], None);
    assert_eq!(dry.code, 0, "{}", dry.stderr);
    for (name, _) in &old {
        assert!(dry.stdout.contains(&format!("pod {NS}/{name}: port ")), "{}", dry.stdout);
    }
    assert!(
        dry.last_line().starts_with(&format!("plan: 2 pods, 0 services, {} pool ports;", kuryr_pool.len())),
        "{} free pool ports: {}",
        kuryr_pool.len(),
        dry.stdout
    );
    assert_eq!(kps.list(&Default::default()).await.unwrap().items.len(), 2, "the dry run deleted a KuryrPort");
    let tag = format!("kuryr.openstack.org/cluster={CLUSTER_ID}");
    assert!(!c.neutron.get_port(&kuryr_ports[0].0).await.unwrap().tags.contains(&tag), "the dry run tagged a port");

    // 3. Killed after its third step, then run again: converges.
    let crashed = migrate(&c, &[], Some(3));
    assert_eq!(crashed.code, 70, "the crash hook: {}", crashed.stderr);
    assert!(kps.get_opt(old[0].0).await.unwrap().is_some(), "the KuryrPort went before the rest of the pod's steps");
    let done = migrate(&c, &[], None);
    assert_eq!(done.code, 0, "{}\n{}", done.stdout, done.stderr);
    assert!(done.last_line().starts_with("migrated: "), "{}", done.stdout);
    for ((name, uid), (port_id, mac, ip)) in old.iter().zip(&kuryr_ports) {
        assert!(kps.get_opt(name).await.unwrap().is_none(), "KuryrPort {name} left");
        let pod = pods.get(name).await.unwrap();
        let fin = pod.metadata.finalizers.unwrap_or_default();
        assert!(fin.contains(&kuryr_vif_allocator::pods::FINALIZER.to_string()), "{name}: {fin:?}");
        assert!(!fin.iter().any(|f| f == "kuryr.openstack.org/pod-finalizer"), "{name}: {fin:?}");
        let pv = vifs.get(name).await.unwrap();
        assert_eq!(&pv.spec.pod_uid, uid);
        let rec = pv.vif().unwrap();
        assert_eq!((&rec.vif_id, &rec.mac), (port_id, mac), "{name}");
        assert_eq!(rec.ips[0].address.split('/').next().unwrap(), ip, "{name}");
        assert!(c.neutron.get_port(port_id).await.unwrap().tags.contains(&tag), "{name}'s port is not tagged");
    }
    let again = migrate(&c, &[], None);
    assert_eq!(again.code, 0);
    assert_eq!(again.last_line(), "migrated: 0 pods, 0 services, 0 pool ports; 0 steps done, 0 blocked, 0 kept");

    // 4. kuryr-rs takes over.
    let watcher = c.watcher().unwrap();
    let o = AllocatorOptions { cluster_id: CLUSTER_ID.into(), pool_min: 0, pool_batch: 3, ..Default::default() };
    let alloc = c.allocator(&watcher, &o).unwrap();
    alloc.wait_ready(SLOW).await.unwrap();
    let binder = Arc::new(c.binder(&alloc, SLOW, &[]).await.unwrap());
    let a = CniPod {
        namespace: NS.into(),
        name: old[0].0.into(),
        uid: old[0].1.clone(),
        netns: Arc::new(Netns::new("kma").unwrap()),
    };
    let add = {
        let (a, b) = (a.clone(), binder.clone());
        tokio::task::spawn_blocking(move || a.run("ADD", &b, None, SLOW).unwrap()).await.unwrap()
    };
    assert_eq!(add.code, 0, "ADD of the migrated pod: {} {}\n{}", add.stdout, add.stderr, binder.logs());
    let result = add.json().unwrap();
    assert_eq!(ipv4_of(&result), kuryr_ports[0].2, "the migrated pod kept its address");
    let mac = result["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|i| i["mac"].as_str().filter(|_| i["sandbox"].is_string()));
    assert_eq!(mac, Some(kuryr_ports[0].1.as_str()), "the migrated pod kept its MAC: {result}");
    assert_eq!(c.neutron.get_port(&kuryr_ports[0].0).await.unwrap().status, "ACTIVE");
    let pv = vifs.get(old[0].0).await.unwrap();
    assert_eq!((pv.vif().unwrap().vif_id.clone(), pv.state()), (kuryr_ports[0].0.clone(), VifState::Ready));

    let made = pods.create(&PostParams::default(), &c.pod("fresh")).await.unwrap();
    let fresh = CniPod {
        namespace: NS.into(),
        name: "fresh".into(),
        uid: made.metadata.uid.unwrap(),
        netns: Arc::new(Netns::new("kmf").unwrap()),
    };
    let add = {
        let (f, b) = (fresh.clone(), binder.clone());
        tokio::task::spawn_blocking(move || f.run("ADD", &b, None, SLOW).unwrap()).await.unwrap()
    };
    assert_eq!(add.code, 0, "ADD of a new pod: {} {}\n{}", add.stdout, add.stderr, binder.logs());
    let fresh_ip = ipv4_of(&add.json().unwrap());
    let fresh_pv = vifs.get("fresh").await.unwrap().spec.vif.unwrap();
    assert!(
        kuryr_pool.contains(&fresh_pv.vif_id),
        "the new pod got port {} rather than one of Kuryr's pool {kuryr_pool:?}",
        fresh_pv.vif_id
    );
    ping(&a.netns, &fresh_ip).await;
    ping(&fresh.netns, &kuryr_ports[0].2).await;
    let after: BTreeSet<String> = c.neutron.list_ports(&pool_filter).await.unwrap().into_iter().map(|p| p.id).collect();
    assert_eq!(port_posts_since(&c, stopped), Vec::<String>::new(), "ports created after Kuryr stopped");
    assert_eq!(after, before, "the set of ports changed");

    // 5. Deleting a migrated pod frees its port as the allocator frees its own.
    let del = {
        let (a, b) = (a.clone(), binder.clone());
        tokio::task::spawn_blocking(move || a.run("DEL", &b, None, SLOW).unwrap()).await.unwrap()
    };
    assert_eq!(del.code, 0, "DEL: {} {}", del.stdout, del.stderr);
    // No kubelet confirms the deletion: grace period 0, as a kubelet's final delete.
    let grace0 = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    pods.delete(old[0].0, &grace0).await.unwrap();
    let port_id = kuryr_ports[0].0.clone();
    wait_until("the migrated pod to be gone and its port freed", SLOW, || async {
        anyhow::ensure!(pods.get_opt(old[0].0).await?.is_none(), "the pod is still there (finalizer)");
        anyhow::ensure!(vifs.get_opt(old[0].0).await?.is_none(), "its PodVif is still there");
        match c.neutron.get_port(&port_id).await {
            Ok(p) => anyhow::ensure!(p.device_id.is_empty(), "port {port_id} still names device {}", p.device_id),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e.into()),
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", alloc.proc.logs()));
    assert_eq!(port_posts_since(&c, stopped), Vec::<String>::new(), "ports created after Kuryr stopped");
}
