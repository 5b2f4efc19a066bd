//! Fuzzing the binder's request handling: the `kuryr.binder.v1.Cni` methods called with requests
//! whose every field is fuzzed — the configuration and `CNI_ARGS` from the seeds in
//! `fuzz/corpus/` mutated by `fuzz/mutate.rs`, container ids, interface names and netns paths
//! from hostile and random values, the shim version mostly right. Whatever comes in, no call may
//! panic or hang, and every failure must carry the CNI error (code and message) that the shim
//! prints as the spec's error object.
//!
//! The binder runs here in-process, in a network namespace of its own (so a fuzzed DEL or GC can
//! touch nothing of the machine's), with no VIF stream: an ADD that gets through validation waits
//! the short `vif_wait` and answers "try again later". Property tests with proptest, run by
//! `cargo test` (2,000 cases by default; `PROPTEST_CASES`).
#![allow(clippy::unwrap_used)]

#[path = "../../../fuzz/mutate.rs"]
mod mutate;

use std::time::Duration;

use kuryr_binder::attachments::Attachments;
use kuryr_binder::cni::CniService;
use kuryr_binder::hostport::HostPorts;
use kuryr_binder::lb::nft::Nft;
use kuryr_binder::metrics::CniMetrics;
use kuryr_binder::upstream::Allocator;
use kuryr_cni_types::{CniError, Command as Op};
use kuryr_proto::binder::v1::cni_server::Cni;
use kuryr_proto::binder::v1::{CniRequest, GcRequest, StatusRequest, VersionRequest};
use kuryr_runtime::auth::client::Credentials;
use mutate::{apply, case, corpus};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tonic::{Request, Status};

/// Bound on any one call: ADD waits for a VIF for `vif_wait` at most, the rest do local work.
const CALL_BOUND: Duration = Duration::from_secs(10);

fn hostile_path() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("/proc/self/ns/net".to_string()),
        Just("/proc/1/ns/net".to_string()),
        Just("/proc/thread-self/ns/net".to_string()),
        Just("/proc/self/ns/mnt".to_string()),
        Just("/dev/null".to_string()),
        Just("/".to_string()),
        Just("/var/run/netns/../../../etc/passwd".to_string()),
        Just("relative/netns".to_string()),
        "/[a-z/.]{0,30}",
        ".{0,40}",
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("eth0".to_string()),
        Just("lo".to_string()),
        Just("..".to_string()),
        Just("kv0123456789ab".to_string()),
        Just("x".repeat(300)),
        "[a-zA-Z0-9_.:/-]{0,20}",
        ".{0,20}",
    ]
}

fn shim_version() -> impl Strategy<Value = String> {
    prop_oneof![8 => Just(env!("CARGO_PKG_VERSION").to_string()), 1 => ".{0,12}"]
}

/// The operation to call with a fuzzed request.
fn op() -> impl Strategy<Value = Op> {
    prop_oneof![Just(Op::Add), Just(Op::Del), Just(Op::Check), Just(Op::Status), Just(Op::Gc), Just(Op::Version)]
}

fn service(dir: &std::path::Path) -> CniService {
    let mut registry = prometheus_client::registry::Registry::default();
    let channel = kuryr_runtime::client::channel("unix:/nonexistent/kuryr-fuzz/allocator.sock").unwrap();
    CniService {
        node: "fuzz".into(),
        vifs: Default::default(),
        attachments: Attachments::open(&dir.join("attachments")).unwrap(),
        // The real nft, in the test's own network namespace.
        hostports: HostPorts::new(Nft::default()),
        allocator: Allocator::new(channel, Credentials::None),
        vif_wait: Duration::from_millis(20),
        ovs_db: Some("unix:/nonexistent/kuryr-fuzz/db.sock".into()),
        nested: Default::default(),
        metrics: CniMetrics::register(&mut registry),
        bridges_ready: Default::default(),
        locks: Default::default(),
    }
}

/// A failure must carry its CNI error.
fn carries_cni_error(what: &str, s: &Status) -> Result<(), TestCaseError> {
    let e: Option<CniError> = CniError::from_status(s);
    let e = e.ok_or_else(|| TestCaseError::fail(format!("{what}: {s:?} carries no CNI error")))?;
    prop_assert!(e.code != 0 && !e.msg.is_empty(), "{}: {:?}", what, e);
    Ok(())
}

async fn call(svc: &CniService, op: Op, r: CniRequest) -> Result<(), Status> {
    match op {
        Op::Add => Cni::add(svc, Request::new(r)).await.map(drop),
        Op::Del => Cni::del(svc, Request::new(r)).await.map(drop),
        Op::Check => Cni::check(svc, Request::new(r)).await.map(drop),
        Op::Status => {
            let req = StatusRequest { shim_version: r.shim_version, config: r.config };
            Cni::status(svc, Request::new(req)).await.map(drop)
        }
        Op::Gc => {
            Cni::gc(svc, Request::new(GcRequest { shim_version: r.shim_version, config: r.config })).await.map(drop)
        }
        Op::Version => Cni::version(svc, Request::new(VersionRequest { shim_version: r.shim_version })).await.map(drop),
    }
}

#[test]
fn any_request_is_answered_in_time_with_a_cni_error_or_success() {
    // A network namespace of its own for this thread, and so for the runtime's threads and the
    // binder's netlink threads, all started from it.
    let outcome = std::thread::spawn(|| {
        if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
            return Err(format!("this test needs a network namespace of its own (CAP_SYS_ADMIN): {e}"));
        }
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let svc = rt.block_on(async { service(dir.path()) });
        let configs = corpus("config");
        let args: Vec<Vec<u8>> = corpus("cni-args")
            .iter()
            .flat_map(|f| f.split(|b| *b == b'\n').map(<[u8]>::to_vec).collect::<Vec<_>>())
            .collect();
        let strategy = (op(), shim_version(), name(), hostile_path(), name(), case(6), case(4), name());
        let mut runner = TestRunner::new(Config { cases: 2000, failure_persistence: None, ..Config::default() });
        let result =
            runner.run(&strategy, |(op, shim_version, container_id, netns, ifname, config, cni_args, path)| {
                let r = CniRequest {
                    shim_version,
                    container_id,
                    netns,
                    ifname,
                    cni_args: String::from_utf8_lossy(&apply(&args, cni_args.0, &cni_args.1)).into_owned(),
                    cni_path: path,
                    config: apply(&configs, config.0, &config.1),
                };
                let what = format!("{op:?} {r:?}");
                let answered = rt.block_on(async { tokio::time::timeout(CALL_BOUND, call(&svc, op, r)).await });
                match answered {
                    Err(_) => Err(TestCaseError::fail(format!("{what}: no answer within {CALL_BOUND:?}"))),
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(s)) => carries_cni_error(&what, &s),
                }
            });
        Ok(result.map_err(|e| e.to_string()))
    })
    .join()
    .expect("the fuzzing thread panicked: a request made the binder panic");
    match outcome {
        Err(prerequisite) => panic!("{prerequisite}"),
        Ok(Err(failure)) => panic!("{failure}"),
        Ok(Ok(())) => {}
    }
}
