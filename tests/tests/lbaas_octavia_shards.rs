//! Two kuryr-lbaas replicas with `--backend octavia` splitting the Services through Kubernetes
//! Leases (8 shards, 3 s Leases), each under the `kuryr-lbaas` ServiceAccount, fed by a real
//! kuryr-watcher, against a real kube-apiserver and a real Octavia (API + worker, amphora provider
//! with the no-op drivers, tests/env/openstack). Everything is read back from Octavia's own API.
//!
//! A burst of Services; half-way, while load balancers are being created, kill -9 of one replica.
//! The other holds every shard within the Lease duration plus one renewal interval, adopts what
//! the dead one left by tags and finishes it: every Service ends with exactly one load balancer,
//! ACTIVE, with its listener, pool and members, recorded in its ServiceLoadBalancer — nothing left
//! half-built, nothing duplicated, no orphan. Deleting the Services deletes their load balancers.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::future::join_all;
use k8s_openapi::api::core::v1::Service;
use kube::api::{DeleteParams, ListParams};
use kuryr_lbaas::k8s::crd::ServiceLoadBalancer;
use kuryr_proto::service_names::LOAD_BALANCERS;
use kuryr_tests::control::{ControlPlane, Watcher, shard_holders};
use kuryr_tests::octavia::OctaviaReader;
use kuryr_tests::openstack::{OctaviaLbaas, Service as OsService};
use kuryr_tests::services::wait_until;
use kuryr_tests::sut::{self, Sut};
use kuryr_tests::util::unique_id;

const NS: &str = "lbos";
const SHARDS: u32 = 8;
const LEASE: Duration = Duration::from_secs(3);
/// A fifth of the Lease duration: the renewal interval.
const TICK: Duration = Duration::from_millis(600);
/// Room for the API calls of a round and for this test's polling on a loaded machine.
const SLACK: Duration = Duration::from_secs(1);
/// Services in the burst: Octavia takes seconds per load balancer.
const BURST: usize = 16;
/// Bound on the convergence of the whole burst through Octavia on a loaded machine.
const CONVERGE: Duration = Duration::from_secs(240);
const PHASE_TIMEOUT: Duration = Duration::from_secs(90);
const FINALIZER: &str = "kuryr.openstack.org/lbaas";
/// The project owning the load balancers (Octavia runs with noauth: any id will do).
const PROJECT: &str = "7c1d9e2f4b3a4d5c8e6f2a3b4c5d6e7f";
/// Any id is a VIP subnet for the no-op network driver.
const VIP_SUBNET: &str = "8e2f6b3d-0c4e-4d8f-9a1b-2c3d4e5f6a7b";

fn logs(replicas: &[&Sut]) -> String {
    sut::logs(replicas, 80)
}

fn start_watcher(c: &ControlPlane) -> Watcher {
    c.watcher(None, &[]).unwrap()
}

fn start_lbaas(c: &ControlPlane, watcher: &Watcher, octavia: &OctaviaLbaas, id: &str) -> Sut {
    let shards = SHARDS.to_string();
    let lease = format!("{}s", LEASE.as_secs());
    let mut extra = octavia.args();
    // This suite follows the finalizer's life on ClusterIP Services too.
    extra.extend(["--service-finalizer", "all", "--shards", &shards, "--lease-duration", &lease]);
    c.lbaas(watcher, id, &extra).unwrap()
}

async fn holders(c: &ControlPlane) -> BTreeMap<u32, String> {
    shard_holders(&c.admin, "kuryr-lbaas").await.unwrap_or_default().into_iter().map(|(i, (h, _))| (i, h)).collect()
}

async fn wait_serving(r: &Sut) {
    r.wait_serving(LOAD_BALANCERS, PHASE_TIMEOUT).await.unwrap();
}

fn members(i: usize) -> Vec<String> {
    (0..2).map(|j| format!("10.244.{}.{}", i % 250, 20 + j)).collect()
}

async fn create_burst(c: &ControlPlane, range: std::ops::Range<usize>) {
    join_all(range.map(|i| async move { c.create_web_service(&format!("svc-{i}"), &members(i)).await.unwrap() })).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_burst_leaves_no_load_balancer_half_built_or_duplicated() {
    let started = Instant::now();
    let (c, _os, octavia_url) = ControlPlane::lbaas_with_openstack(NS, &[OsService::Octavia]).await.unwrap();
    let c = &c;
    eprintln!("API server and Octavia up in {:?}", started.elapsed());
    let api = OctaviaReader::new(&octavia_url, PROJECT).unwrap();
    let cluster_name = format!("t{}", unique_id());

    let octavia = OctaviaLbaas {
        url: octavia_url.clone(),
        project: PROJECT.into(),
        vip_subnet: Some(VIP_SUBNET.into()),
        cluster_name: cluster_name.clone(),
        drift_interval: "5s".into(),
        active_timeout: "30s".into(),
    };
    let watcher = start_watcher(c);
    let mut a = start_lbaas(c, &watcher, &octavia, "lbo-a");
    let b = start_lbaas(c, &watcher, &octavia, "lbo-b");
    wait_serving(&a).await;
    wait_serving(&b).await;
    wait_until("the shards split between the replicas", PHASE_TIMEOUT, || async {
        let h = holders(c).await;
        let of = |id: &str| h.values().filter(|h| *h == id).count();
        anyhow::ensure!(h.len() == SHARDS as usize && of("lbo-a") == 4 && of("lbo-b") == 4, "held: {h:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&[&a, &b])));

    // The burst; half-way, once lbo-a is in the middle of creating load balancers, kill -9.
    create_burst(c, 0..BURST / 2).await;
    wait_until("lbo-a creating load balancers", PHASE_TIMEOUT, || async {
        anyhow::ensure!(a.proc.logs().contains("load balancer created"), "not yet");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&[&a, &b])));
    a.proc.kill().await.unwrap();
    let killed = Instant::now();
    let (takeover, ()) = tokio::join!(
        async {
            wait_until("lbo-b holding every shard", PHASE_TIMEOUT, || async {
                let h = holders(c).await;
                anyhow::ensure!(h.len() == SHARDS as usize && h.values().all(|id| id == "lbo-b"), "held: {h:?}");
                Ok(killed.elapsed())
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", b.proc.logs()))
        },
        create_burst(c, BURST / 2..BURST)
    );
    eprintln!("kill -9 of lbo-a mid-create → lbo-b holds all {SHARDS} shards after {takeover:?}");
    assert!(
        takeover <= LEASE + TICK + SLACK,
        "takeover took {takeover:?}, more than the Lease duration {LEASE:?} + one renewal {TICK:?} (+{SLACK:?})"
    );

    // Every Service: one load balancer, ACTIVE, with its listener and members, the one its record
    // names; no other load balancer of this cluster in the namespace.
    let names: BTreeSet<String> = (0..BURST).map(|i| format!("svc-{i}")).collect();
    let converged = wait_until("one ACTIVE, complete load balancer per Service, recorded", CONVERGE, || async {
        let records = c.api::<ServiceLoadBalancer>().list(&ListParams::default()).await?.items;
        let mut recorded = BTreeMap::new();
        for r in &records {
            let name = r.metadata.name.clone().unwrap_or_default();
            sut::active_at_generation(r).with_context(|| name.clone())?;
            recorded.insert(name, r.status.as_ref().and_then(|s| s.backend_id.clone()).unwrap_or_default());
        }
        let have: BTreeSet<String> = recorded.keys().cloned().collect();
        anyhow::ensure!(have == names, "{} of {} Services recorded", have.len(), names.len());
        for s in c.api::<Service>().list(&ListParams::default()).await?.items {
            let fin = s.metadata.finalizers.unwrap_or_default();
            anyhow::ensure!(fin.iter().any(|f| f == FINALIZER), "{:?} has no finalizer", s.metadata.name);
        }
        let lbs = api.by_service(&cluster_name).await?;
        for (name, id) in &recorded {
            let of = lbs.get(&format!("{NS}/{name}")).cloned().unwrap_or_default();
            let ids: Vec<&str> = of.iter().filter_map(|l| l["id"].as_str()).collect();
            anyhow::ensure!(ids == [id.as_str()], "{name}: load balancers {ids:?}, recorded {id}");
            anyhow::ensure!(of[0]["provisioning_status"] == "ACTIVE", "{name}: {}", of[0]);
            let i: usize = name.trim_start_matches("svc-").parse()?;
            let want = vec![("TCP:80".to_string(), members(i).iter().map(|m| format!("{m}:8080")).collect::<Vec<_>>())];
            let tree = api.tree(id).await?;
            anyhow::ensure!(tree == want, "{name}: {tree:?}");
        }
        let strays: Vec<&String> = lbs
            .keys()
            .filter(|k| k.starts_with(&format!("{NS}/")) && !recorded.contains_key(&k[NS.len() + 1..]))
            .collect();
        anyhow::ensure!(strays.is_empty(), "load balancers of no Service: {strays:?}");
        Ok(lbs.values().map(Vec::len).sum::<usize>())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&[&b])));
    eprintln!(
        "{BURST} Services: one complete ACTIVE load balancer each ({converged} in the cluster) {:?} after the kill",
        killed.elapsed()
    );

    // Deleting them deletes their load balancers; the finalizer goes last.
    let dp = DeleteParams::default();
    join_all(names.iter().map(|n| {
        let (api, dp) = (c.api::<Service>(), &dp);
        async move { api.delete(n, dp).await.unwrap() }
    }))
    .await;
    wait_until("every Service, record and load balancer gone", CONVERGE, || async {
        anyhow::ensure!(c.api::<Service>().list(&ListParams::default()).await?.items.is_empty(), "Services left");
        anyhow::ensure!(
            c.api::<ServiceLoadBalancer>().list(&ListParams::default()).await?.items.is_empty(),
            "records left"
        );
        let lbs = api.by_service(&cluster_name).await?;
        let left: Vec<&String> = lbs.keys().filter(|k| k.starts_with(&format!("{NS}/"))).collect();
        anyhow::ensure!(left.is_empty(), "load balancers left: {left:?}");
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&[&b])));
}
