//! Two kuryr-lbaas replicas splitting the Services through Kubernetes Leases, as a Deployment of
//! two runs them: each under the `kuryr-lbaas` ServiceAccount with exactly the rights of
//! `deploy/rbac/lbaas.yaml` (its Role for Leases in kuryr-system), fed by a real kuryr-watcher,
//! against a real kube-apiserver, with the node backend. Eight shards and a short Lease duration
//! (3 s, renewed every 0.6 s) keep takeover quick. A WatchLoadBalancers client on each replica
//! plays a binder connected to it.
//!
//! 1. Both replicas own shards (the Lease objects say so, with their endpoints).
//! 2. A burst of 40 Services with EndpointSlices: every Service gets its finalizer and a record
//!    PROGRAMMED at its generation; both replicas reconciled some (metrics) and followed the
//!    other's records; the stream of EACH replica carries every Service with exactly its
//!    record's spec and generation.
//! 3. A second burst of 40; half-way, kill -9 of one replica. The other holds every shard within
//!    the Lease duration plus one renewal interval of the kill (read from the Leases), every
//!    Service converges, and its stream never flapped: no LB_DELETED, and the Services it
//!    already had were not streamed again.
//! 4. The killed replica comes back: the shards are split again; its new stream gets every
//!    Service at the records' generations, and the other's stream stays silent meanwhile.
//! 5. Endpoint changes afterwards reach both streams (a higher generation, the new members).
//! 6. Deleting every Service: LB_DELETED for each on both streams, no record or finalizer left,
//!    the Services gone.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use k8s_openapi::api::core::v1::Service;
use kube::api::{DeleteParams, ListParams};
use kuryr_lbaas::k8s::crd::ServiceLoadBalancer;
use kuryr_proto::lbaas::v1::load_balancers_client::LoadBalancersClient;
use kuryr_proto::lbaas::v1::{LbEventType, LoadBalancerSpec, WatchLoadBalancersRequest};
use kuryr_proto::service_names::LOAD_BALANCERS;
use kuryr_tests::control::{ControlPlane, Served, Watcher, lease_versions, shard_holders, wait_rewritten};
use kuryr_tests::services::wait_until;
use kuryr_tests::sut::{self, Sut};

const NS: &str = "lbshards";
const SHARDS: u32 = 8;
const LEASE: Duration = Duration::from_secs(3);
/// A fifth of the Lease duration: the renewal interval.
const TICK: Duration = Duration::from_millis(600);
/// Room for the API calls of a round and for this test's polling on a loaded machine.
const SLACK: Duration = Duration::from_secs(1);
const BURST: usize = 40;
const PHASE_TIMEOUT: Duration = Duration::from_secs(90);
const FINALIZER: &str = "kuryr.openstack.org/lbaas";
const SET: &str = "kuryr-lbaas";

async fn cluster() -> ControlPlane {
    ControlPlane::start(Served::Lbaas, NS).await.unwrap()
}

fn start_watcher(c: &ControlPlane) -> Watcher {
    c.watcher(None, &[]).unwrap()
}

/// A replica named `id` (its identity in the Leases and its instance in Events).
fn start_lbaas(c: &ControlPlane, watcher: &Watcher, id: &str) -> Sut {
    let shards = SHARDS.to_string();
    let lease = format!("{}s", LEASE.as_secs());
    // This suite follows the finalizer's life on ClusterIP Services too.
    let extra = ["--service-finalizer", "all", "--shards", &shards, "--lease-duration", &lease];
    c.lbaas(watcher, id, &extra).unwrap()
}

/// Shard → holder, as the Lease objects say (held Leases only), with the holder's endpoint.
async fn holders(c: &ControlPlane) -> BTreeMap<u32, (String, String)> {
    shard_holders(&c.admin, SET).await.unwrap_or_default()
}

/// Waits until the shards are split between `replicas` as the fair share says (each holds
/// `SHARDS / replicas.len()`), every holder advertising its own address.
async fn wait_split(c: &ControlPlane, replicas: &[&Sut]) -> BTreeMap<u32, (String, String)> {
    let share = SHARDS as usize / replicas.len();
    wait_until("the shards split between the replicas", PHASE_TIMEOUT, || async {
        let h = holders(c).await;
        anyhow::ensure!(h.len() == SHARDS as usize, "held: {h:?}");
        for r in replicas {
            let mine: Vec<_> = h.values().filter(|(id, _)| *id == r.id).collect();
            anyhow::ensure!(mine.len() == share, "{} holds {} of {SHARDS}: {h:?}", r.id, mine.len());
            anyhow::ensure!(mine.iter().all(|(_, e)| *e == r.addr), "{} advertises another address: {h:?}", r.id);
        }
        Ok(h)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(replicas)))
}

/// Every record in the namespace, by Service name, as streamed; waits until `names` are all
/// there (and nothing else), each PROGRAMMED at its generation, with the finalizer on its
/// Service, and `svc-<i>` with the members `want(i)`. A record PROGRAMMED at its generation may
/// still be the one from before the Service's EndpointSlice (or its change) reached lbaas, so the
/// members are waited for too: only an update that never arrives fails.
async fn converged(
    c: &ControlPlane,
    names: &BTreeSet<String>,
    want: impl Fn(usize) -> Vec<String>,
    replicas: &[&Sut],
) -> BTreeMap<String, LoadBalancerSpec> {
    wait_until("every Service's record PROGRAMMED at its generation, with the finalizer", PHASE_TIMEOUT, || async {
        let records = c.api::<ServiceLoadBalancer>().list(&ListParams::default()).await?.items;
        let mut out = BTreeMap::new();
        for r in records {
            let name = r.metadata.name.clone().unwrap_or_default();
            let generation = r.metadata.generation.unwrap_or(0);
            let st = r.status.clone().unwrap_or_default();
            anyhow::ensure!(
                st.provisioning_status.as_deref() == Some("PROGRAMMED") && st.observed_generation == Some(generation),
                "{name}: {st:?} at generation {generation}"
            );
            let spec = LoadBalancerSpec::from(&r.spec.to_spec(NS, &name, u64::try_from(generation)?));
            if let Some(i) = name.strip_prefix("svc-").and_then(|i| i.parse::<usize>().ok()) {
                let addrs: Vec<String> = spec
                    .listeners
                    .iter()
                    .filter_map(|l| l.pool.as_ref())
                    .flat_map(|p| p.members.iter().map(|m| m.address.clone()))
                    .collect();
                anyhow::ensure!(addrs == want(i), "{name} has members {addrs:?}, want {:?}", want(i));
            }
            out.insert(name.clone(), spec);
        }
        let have: BTreeSet<String> = out.keys().cloned().collect();
        anyhow::ensure!(have == *names, "records of {} Services, want {}", have.len(), names.len());
        let services = c.api::<Service>().list(&ListParams::default()).await?.items;
        for s in &services {
            let fin = s.metadata.finalizers.clone().unwrap_or_default();
            let name = s.metadata.name.clone().unwrap_or_default();
            anyhow::ensure!(fin.iter().any(|f| f == FINALIZER), "{name} has no finalizer: {fin:?}");
        }
        Ok(out)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(replicas)))
}

fn logs(replicas: &[&Sut]) -> String {
    sut::logs(replicas, 200)
}

async fn wait_serving(r: &Sut) {
    r.wait_serving(LOAD_BALANCERS, PHASE_TIMEOUT).await.unwrap();
}

/// One event as a binder saw it.
#[derive(Clone, Debug)]
struct Seen {
    kind: LbEventType,
    key: String,
}

/// What one WatchLoadBalancers client saw, applied the way a binder applies it.
#[derive(Debug, Default)]
struct StreamState {
    specs: BTreeMap<String, LoadBalancerSpec>,
    events: Vec<Seen>,
    live: bool,
    ended: Option<String>,
}

type Shared = Arc<Mutex<StreamState>>;

/// Follows WatchLoadBalancers of `addr` in the background, from a snapshot.
fn follow(addr: String, who: &str, token: &str) -> Shared {
    let token = token.to_string();
    let state: Shared = Arc::default();
    let s = state.clone();
    let subscriber = format!("test/{who}");
    tokio::spawn(async move {
        let req = WatchLoadBalancersRequest { resume_from: String::new(), subscriber };
        let opened = wait_until("WatchLoadBalancers", PHASE_TIMEOUT, || async {
            let mut c = LoadBalancersClient::new(kuryr_tests::auth::channel(&addr, &token)?);
            Ok(c.watch_load_balancers(req.clone()).await?.into_inner())
        })
        .await;
        let mut stream = match opened {
            Ok(s) => s,
            Err(e) => {
                s.lock().unwrap().ended = Some(format!("{e:#}"));
                return;
            }
        };
        loop {
            let msg = stream.message().await;
            if matches!(&msg, Ok(Some(ev)) if ev.r#type() == LbEventType::Heartbeat) {
                continue;
            }
            let mut st = s.lock().unwrap();
            let ev = match msg {
                Ok(Some(ev)) => ev,
                Ok(None) => {
                    st.ended = Some("ended".into());
                    return;
                }
                Err(e) => {
                    st.ended = Some(e.to_string());
                    return;
                }
            };
            let spec = ev.spec.clone().unwrap_or_default();
            let key = format!("{}/{}", spec.namespace, spec.name);
            match ev.r#type() {
                LbEventType::Reset => {
                    st.specs.clear();
                    st.live = false;
                }
                LbEventType::SnapshotComplete => st.live = true,
                LbEventType::LbApplied => {
                    st.specs.insert(key.clone(), spec.clone());
                }
                LbEventType::LbDeleted => {
                    st.specs.remove(&key);
                }
                LbEventType::Unspecified | LbEventType::Heartbeat => continue,
            }
            let live = st.live;
            if live {
                st.events.push(Seen { kind: ev.r#type(), key });
            }
        }
    });
    state
}

/// Waits until the stream `s` holds exactly `want` of the test namespace (by Service name, specs and
/// generations).
async fn stream_matches(s: &Shared, who: &str, want: &BTreeMap<String, LoadBalancerSpec>, replicas: &[&Sut]) {
    let want: BTreeMap<String, LoadBalancerSpec> =
        want.iter().map(|(n, spec)| (format!("{NS}/{n}"), spec.clone())).collect();
    wait_until(&format!("{who}'s stream to carry every Service as recorded"), PHASE_TIMEOUT, || async {
        let st = s.lock().unwrap();
        anyhow::ensure!(st.ended.is_none(), "the stream ended: {:?}", st.ended);
        anyhow::ensure!(st.live, "no snapshot yet");
        // This namespace's: `default/kubernetes` has a load balancer too.
        let have: BTreeSet<&String> = st.specs.keys().filter(|k| k.starts_with(&format!("{NS}/"))).collect();
        let keys: BTreeSet<&String> = want.keys().collect();
        anyhow::ensure!(have == keys, "{} Services streamed, {} recorded", have.len(), keys.len());
        for (k, spec) in &want {
            anyhow::ensure!(st.specs.get(k) == Some(spec), "{k}: streamed {:?}, recorded {spec:?}", st.specs.get(k));
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(replicas)));
}

fn members(i: usize, round: usize) -> Vec<String> {
    (0..2).map(|j| format!("10.244.{}.{}", (i + round * 7) % 250, 10 + j)).collect()
}

async fn create_burst(c: &ControlPlane, range: std::ops::Range<usize>) {
    join_all(range.map(|i| async move { c.create_web_service(&format!("svc-{i}"), &members(i, 0)).await.unwrap() }))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_split_services_and_take_over_without_flaps() {
    let c = &cluster().await;
    let watcher = start_watcher(c);
    let mut a = start_lbaas(c, &watcher, "lb-a");
    let b = start_lbaas(c, &watcher, "lb-b");
    wait_serving(&a).await;
    wait_serving(&b).await;

    // 1. Both own shards, each advertising its own address.
    let split = wait_split(c, &[&a, &b]).await;
    eprintln!("shards: {split:?}");
    // The Leases are written before the replica has loaded the shards it took: wait for both
    // metrics to catch up rather than reading them once.
    for r in [&a, &b] {
        wait_until(&format!("{} owning and serving its share", r.id), PHASE_TIMEOUT, || async {
            let m = r.scrape().await.unwrap();
            let owned = m.value("kuryr_shards_owned", &[]).unwrap_or(-1.0);
            let served = m.value("kuryr_lbaas_shards_served", &[]).unwrap_or(-1.0);
            let share = f64::from(SHARDS / 2);
            anyhow::ensure!(owned == share && served == share, "owned {owned}, served {served}, share {share}");
            Ok(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&[&a, &b])));
    }

    // 2. A burst of Services: split between the replicas, streamed by both.
    let wa = follow(a.addr.clone(), "a", &c.binder_token);
    let wb = follow(b.addr.clone(), "b", &c.binder_token);
    let started = Instant::now();
    create_burst(c, 0..BURST).await;
    let mut names: BTreeSet<String> = (0..BURST).map(|i| format!("svc-{i}")).collect();
    let recorded = converged(c, &names, |i| members(i, 0), &[&a, &b]).await;
    eprintln!("burst of {BURST} Services recorded and PROGRAMMED in {:?}", started.elapsed());
    stream_matches(&wa, "lb-a", &recorded, &[&a, &b]).await;
    stream_matches(&wb, "lb-b", &recorded, &[&a, &b]).await;
    // A reconcile is timed once it has written its record, which may be after the test saw the
    // record: wait for the count rather than reading it once.
    let scrapes = wait_until("every Service's reconcile timed", PHASE_TIMEOUT, || async {
        let scrapes = [a.scrape().await?, b.scrape().await?];
        let applied: f64 =
            scrapes.iter().map(|m| m.count("kuryr_lbaas_reconcile_seconds", &[("result", "applied")])).sum();
        anyhow::ensure!(applied >= BURST as f64, "{applied} reconciles for {BURST} Services");
        Ok(scrapes)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&[&a, &b])));
    let mut applied = 0.0;
    for (r, m) in [&a, &b].into_iter().zip(scrapes) {
        let mine = m.count("kuryr_lbaas_reconcile_seconds", &[("result", "applied")]);
        let mirrored = m.sum("kuryr_lbaas_records_mirrored_total", &[]);
        eprintln!("{}: {mine} reconciles applied, {mirrored} records of the other's shards followed", r.id);
        assert!(mine > 0.0, "{} reconciled nothing", r.id);
        assert!(mirrored > 0.0, "{} followed none of the other's records", r.id);
        assert_eq!(m.sum("kuryr_lbaas_failures_total", &[]), 0.0, "{} had failures:\n{}", r.id, r.proc.logs());
        applied += mine;
    }
    assert!(applied >= BURST as f64, "{applied} reconciles for {BURST} Services");

    // 3. A second burst; half-way, kill -9 of lb-a.
    let before_b = b.scrape().await.unwrap();
    let first_burst: BTreeSet<String> = names.iter().map(|n| format!("{NS}/{n}")).collect();
    let mark_b = wb.lock().unwrap().events.len();
    create_burst(c, BURST..BURST + BURST / 2).await;
    a.proc.kill().await.unwrap();
    let killed = Instant::now();
    let (takeover, ()) = tokio::join!(
        async {
            wait_until("lb-b holding every shard", PHASE_TIMEOUT, || async {
                let h = holders(c).await;
                anyhow::ensure!(h.len() == SHARDS as usize && h.values().all(|(id, _)| id == "lb-b"), "held: {h:?}");
                Ok(killed.elapsed())
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", b.proc.logs()))
        },
        create_burst(c, BURST + BURST / 2..2 * BURST)
    );
    eprintln!("kill -9 of lb-a → lb-b holds all {SHARDS} shards after {takeover:?}");
    assert!(
        takeover <= LEASE + TICK + SLACK,
        "takeover took {takeover:?}, more than the Lease duration {LEASE:?} + one renewal {TICK:?} (+{SLACK:?})"
    );
    names.extend((BURST..2 * BURST).map(|i| format!("svc-{i}")));
    let recorded = converged(c, &names, |i| members(i, 0), &[&b]).await;
    eprintln!("second burst converged {:?} after the kill", killed.elapsed());
    stream_matches(&wb, "lb-b", &recorded, &[&b]).await;
    assert!(wa.lock().unwrap().ended.is_some(), "lb-a's stream outlived it");
    {
        let st = wb.lock().unwrap();
        let since = &st.events[mark_b..];
        let deleted: Vec<&Seen> = since.iter().filter(|e| e.kind == LbEventType::LbDeleted).collect();
        assert!(deleted.is_empty(), "the takeover flapped lb-b's stream: {deleted:?}");
        let again: Vec<&Seen> = since.iter().filter(|e| first_burst.contains(&e.key)).collect();
        assert!(again.is_empty(), "Services converged before the kill were streamed again: {again:?}");
    }
    let m = b.scrape().await.unwrap();
    assert_eq!(m.value("kuryr_shards_owned", &[]).unwrap(), f64::from(SHARDS));
    m.moved(&before_b, "kuryr_lbaas_shard_gains_total", &[]).at_least(f64::from(SHARDS / 2)).unwrap();
    m.moved(&before_b, "kuryr_shard_acquisitions_total", &[]).at_least(f64::from(SHARDS / 2)).unwrap();
    m.moved_count(&before_b, "kuryr_lbaas_reconcile_seconds", &[("result", "applied")]).at_least(1.0).unwrap();

    // 4. lb-a comes back under its name: the shards split again, its stream is complete, and
    //    lb-b's stays silent while the shards move.
    let mark_b = wb.lock().unwrap().events.len();
    let a = start_lbaas(c, &watcher, "lb-a");
    wait_serving(&a).await;
    wait_split(c, &[&a, &b]).await;
    let wa = follow(a.addr.clone(), "a2", &c.binder_token);
    stream_matches(&wa, "lb-a", &recorded, &[&a, &b]).await;
    // Whatever the rebalance would still do shows within two more rounds of both replicas: both
    // memberships written twice more, the second in a round begun after the first was done.
    let before = lease_versions(&c.admin, SET).await.unwrap();
    let memberships: Vec<String> = before.keys().filter(|n| n.contains("-member-")).cloned().collect();
    assert_eq!(memberships.len(), 2, "{before:?}");
    wait_rewritten(&c.admin, SET, &memberships, &before, 2, PHASE_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}\n{}", a.proc.logs(), b.proc.logs()));
    {
        let st = wb.lock().unwrap();
        let since = &st.events[mark_b..];
        assert!(since.is_empty(), "lb-b's stream was not silent while the shards moved: {since:?}");
    }

    // 5. Endpoint changes after all that reach both streams.
    let changed: Vec<usize> = (0..2 * BURST).step_by(8).collect();
    join_all(changed.iter().map(|&i| {
        let c = &c;
        async move { c.put_web_members(&format!("svc-{i}"), &members(i, 1)).await.unwrap() }
    }))
    .await;
    let round = |i: usize| if changed.contains(&i) { 1 } else { 0 };
    let recorded = converged(c, &names, |i| members(i, round(i)), &[&a, &b]).await;
    stream_matches(&wa, "lb-a", &recorded, &[&a, &b]).await;
    stream_matches(&wb, "lb-b", &recorded, &[&a, &b]).await;

    // 6. Deleting every Service removes its load balancer everywhere and lets it go.
    let dp = DeleteParams::default();
    join_all(names.iter().map(|n| {
        let (api, dp) = (c.api::<Service>(), &dp);
        async move { api.delete(n, dp).await.unwrap() }
    }))
    .await;
    wait_until("every Service, record and finalizer gone", PHASE_TIMEOUT, || async {
        let services = c.api::<Service>().list(&ListParams::default()).await?.items;
        let records = c.api::<ServiceLoadBalancer>().list(&ListParams::default()).await?.items;
        anyhow::ensure!(services.is_empty(), "{} Services left", services.len());
        anyhow::ensure!(records.is_empty(), "{} records left", records.len());
        Ok(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&[&a, &b])));
    stream_matches(&wa, "lb-a", &BTreeMap::new(), &[&a, &b]).await;
    stream_matches(&wb, "lb-b", &BTreeMap::new(), &[&a, &b]).await;
    for (w, who) in [(&wa, "lb-a"), (&wb, "lb-b")] {
        let st = w.lock().unwrap();
        let deleted: BTreeSet<&str> =
            st.events.iter().filter(|e| e.kind == LbEventType::LbDeleted).map(|e| e.key.as_str()).collect();
        assert_eq!(deleted.len(), names.len(), "{who}: LB_DELETED for {} of {} Services", deleted.len(), names.len());
    }
    for r in [&a, &b] {
        let m = r.scrape().await.unwrap();
        assert_eq!(m.sum("kuryr_lbaas_failures_total", &[]), 0.0, "{} had failures:\n{}", r.id, r.proc.logs());
        assert!(m.count("kuryr_lbaas_reconcile_seconds", &[("result", "deleted")]) > 0.0, "{} deleted nothing", r.id);
    }
}
