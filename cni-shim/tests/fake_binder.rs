//! The shim against a scripted `kuryr.binder.v1.Cni` server on a temporary unix socket: how it
//! renders the binder's result in each cniVersion, passes the binder's CNI errors through, maps
//! plain gRPC failures, and gives up at its deadline. The fake stands in for the binder only to
//! test the shim's side of the contract.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Run, config, env_for, shim};
use kuryr_cni_types::CniError;
use kuryr_proto::binder::v1 as pb;
use kuryr_proto::binder::v1::cni_server::{Cni, CniServer};
use serde_json::{Value, json};
use tonic::{Request, Response, Status};

/// What the fake saw.
#[derive(Debug, Default)]
struct Seen {
    requests: Vec<(&'static str, pb::CniRequest)>,
    status: Vec<pb::StatusRequest>,
    gc: Vec<pb::GcRequest>,
}

#[derive(Clone, Debug, Default)]
struct FakeBinder {
    seen: Arc<Mutex<Seen>>,
}

/// The scripted behaviours, chosen by container id.
const OK: &str = "ok";
const DETAILED: &str = "detailed";
const SLOW: &str = "slow";
const BAD_RESULT: &str = "bad-result";

fn fixed_result() -> pb::CniResult {
    pb::CniResult {
        interfaces: vec![
            pb::Interface {
                name: "tapabc123-45".into(),
                mac: "fe:16:3e:00:00:01".into(),
                mtu: 1450,
                sandbox: String::new(),
            },
            pb::Interface {
                name: "eth0".into(),
                mac: "fa:16:3e:12:34:56".into(),
                mtu: 1450,
                sandbox: "/var/run/netns/cni-test".into(),
            },
        ],
        ips: vec![
            pb::IpConfig { address: "10.0.0.5/24".into(), gateway: "10.0.0.1".into(), interface: Some(1) },
            pb::IpConfig { address: "fd00::5/64".into(), gateway: "fd00::1".into(), interface: Some(1) },
        ],
        routes: vec![pb::Route { dst: "0.0.0.0/0".into(), gw: "10.0.0.1".into() }],
        dns: Some(pb::Dns {
            nameservers: vec!["10.0.0.2".into()],
            domain: String::new(),
            search: vec!["default.svc.cluster.local".into()],
            options: vec![],
        }),
    }
}

impl FakeBinder {
    fn record(&self, op: &'static str, r: &pb::CniRequest) {
        self.seen.lock().expect("lock").requests.push((op, r.clone()));
    }
}

#[tonic::async_trait]
impl Cni for FakeBinder {
    async fn add(&self, req: Request<pb::CniRequest>) -> Result<Response<pb::CniResult>, Status> {
        let r = req.into_inner();
        self.record("ADD", &r);
        match r.container_id.as_str() {
            OK => Ok(Response::new(fixed_result())),
            DETAILED => {
                // The gRPC code says one thing; the CNI error in the details is what counts.
                let e = CniError::new(107, "VIF of pod default/web-0 is not ACTIVE").with_details("port abc: DOWN");
                Err(Status::with_details(tonic::Code::Unavailable, "ignored", e.to_status_details().into()))
            }
            SLOW => {
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok(Response::new(fixed_result()))
            }
            BAD_RESULT => {
                let mut res = fixed_result();
                res.ips[0].address = "10.0.0.5".into();
                Ok(Response::new(res))
            }
            _ => Err(Status::internal("unexpected container id")),
        }
    }

    async fn del(&self, req: Request<pb::CniRequest>) -> Result<Response<pb::DelResponse>, Status> {
        self.record("DEL", req.get_ref());
        Ok(Response::new(pb::DelResponse {}))
    }

    async fn check(&self, req: Request<pb::CniRequest>) -> Result<Response<pb::CheckResponse>, Status> {
        self.record("CHECK", req.get_ref());
        Err(Status::failed_precondition("shim version `x` does not match binder version `y`"))
    }

    async fn status(&self, req: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        self.seen.lock().expect("lock").status.push(req.into_inner());
        Err(Status::unavailable("the VIF stream is not live"))
    }

    async fn gc(&self, req: Request<pb::GcRequest>) -> Result<Response<pb::GcResponse>, Status> {
        self.seen.lock().expect("lock").gc.push(req.into_inner());
        Ok(Response::new(pb::GcResponse {
            removed: vec![pb::Attachment { container_id: "old".into(), ifname: "eth0".into() }],
        }))
    }

    async fn version(&self, _: Request<pb::VersionRequest>) -> Result<Response<pb::VersionResponse>, Status> {
        Err(Status::internal("the shim answers VERSION itself"))
    }
}

/// A fake binder serving on `dir/binder.sock` until the returned runtime is dropped.
fn serve(dir: &Path) -> (tokio::runtime::Runtime, PathBuf, FakeBinder) {
    let sock = dir.join("binder.sock");
    let fake = FakeBinder::default();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let listener = rt.block_on(async { tokio::net::UnixListener::bind(&sock) }).expect("bind the fake binder");
    let svc = CniServer::new(fake.clone());
    rt.spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
            .await
    });
    (rt, sock, fake)
}

fn with_container(cmd: &'static str, id: &'static str) -> Vec<(&'static str, &'static str)> {
    let mut env = env_for(cmd);
    env.retain(|(k, _)| *k != "CNI_CONTAINERID");
    env.push(("CNI_CONTAINERID", id));
    env
}

fn expected(version: &str) -> Value {
    let (ips, interfaces) = if version.starts_with("0.") {
        (
            json!([
                {"version": "4", "address": "10.0.0.5/24", "gateway": "10.0.0.1", "interface": 1},
                {"version": "6", "address": "fd00::5/64", "gateway": "fd00::1", "interface": 1},
            ]),
            json!([
                {"name": "tapabc123-45", "mac": "fe:16:3e:00:00:01"},
                {"name": "eth0", "mac": "fa:16:3e:12:34:56", "sandbox": "/var/run/netns/cni-test"},
            ]),
        )
    } else {
        let mtu = |i: Value| {
            let mut i = i;
            if version == "1.1.0" {
                i["mtu"] = json!(1450);
            }
            i
        };
        (
            json!([
                {"address": "10.0.0.5/24", "gateway": "10.0.0.1", "interface": 1},
                {"address": "fd00::5/64", "gateway": "fd00::1", "interface": 1},
            ]),
            json!([
                mtu(json!({"name": "tapabc123-45", "mac": "fe:16:3e:00:00:01"})),
                mtu(json!({"name": "eth0", "mac": "fa:16:3e:12:34:56", "sandbox": "/var/run/netns/cni-test"})),
            ]),
        )
    };
    json!({
        "cniVersion": version,
        "interfaces": interfaces,
        "ips": ips,
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}],
        "dns": {"nameservers": ["10.0.0.2"], "search": ["default.svc.cluster.local"]},
    })
}

#[test]
fn add_renders_the_result_in_the_requested_version() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, sock, fake) = serve(dir.path());
    for v in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let conf = config(v, &sock, 10);
        let r = shim(&with_container("ADD", OK), conf.as_bytes());
        assert_eq!(r.status, 0, "{r:?}");
        assert_eq!(r.json(), expected(v), "{v}");
        // The request carried the shim's version, the environment and the config byte for byte.
        let seen = fake.seen.lock().unwrap();
        let (op, req) = seen.requests.last().unwrap();
        assert_eq!(*op, "ADD");
        assert_eq!(req.shim_version, env!("CARGO_PKG_VERSION"));
        assert_eq!(
            (req.container_id.as_str(), req.netns.as_str(), req.ifname.as_str(), req.cni_path.as_str()),
            (OK, "/var/run/netns/cni-test", "eth0", "/opt/cni/bin")
        );
        assert!(req.cni_args.contains("K8S_POD_UID=u-1"), "{req:?}");
        assert_eq!(req.config, conf.as_bytes());
    }
}

#[test]
fn cni_error_in_status_details_passes_through_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, sock, _fake) = serve(dir.path());
    let r = shim(&with_container("ADD", DETAILED), config("0.4.0", &sock, 10).as_bytes());
    assert_eq!(r.status, 1);
    assert_eq!(
        r.json(),
        json!({"cniVersion": "0.4.0", "code": 107, "msg": "VIF of pod default/web-0 is not ACTIVE", "details": "port abc: DOWN"})
    );
}

#[test]
fn plain_grpc_failures_are_mapped() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, sock, fake) = serve(dir.path());
    // FAILED_PRECONDITION (a version mismatch) → 1, with the binder's message.
    let r = shim(&with_container("CHECK", OK), config("1.1.0", &sock, 10).as_bytes());
    r.assert_error(1, "shim version `x` does not match binder version `y`");
    // UNAVAILABLE on STATUS → 50.
    let r = shim(&[("CNI_COMMAND", "STATUS")], config("1.1.0", &sock, 10).as_bytes());
    r.assert_error(50, "the VIF stream is not live");
    assert_eq!(fake.seen.lock().unwrap().status[0].shim_version, env!("CARGO_PKG_VERSION"));
    // An unusable result is an error, not a half-printed result.
    let r = shim(&with_container("ADD", BAD_RESULT), config("1.1.0", &sock, 10).as_bytes());
    r.assert_error(5, "kuryr-binder returned an unusable result: invalid CNI result: ips[0]: address");
}

#[test]
fn del_and_gc_print_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, sock, fake) = serve(dir.path());
    let mut env = with_container("DEL", OK);
    env.retain(|(k, _)| *k != "CNI_NETNS");
    let r = shim(&env, config("1.1.0", &sock, 10).as_bytes());
    assert_eq!((r.status, r.stdout.as_str()), (0, ""), "{r:?}");
    assert_eq!(fake.seen.lock().unwrap().requests.last().unwrap().1.netns, "");

    let gc = json!({
        "cniVersion": "1.1.0", "name": "kuryr", "type": "kuryr-cni", "binderSocket": sock,
        "cni.dev/valid-attachments": [{"containerID": "abc123", "ifname": "eth0"}],
    })
    .to_string();
    let r = shim(&[("CNI_COMMAND", "GC"), ("CNI_PATH", "/opt/cni/bin")], gc.as_bytes());
    assert_eq!((r.status, r.stdout.as_str()), (0, ""), "{r:?}");
    assert!(r.stderr.contains("GC removed container old interface eth0"), "{r:?}");
    assert_eq!(fake.seen.lock().unwrap().gc[0].config, gc.as_bytes());
}

#[test]
fn a_binder_that_does_not_answer_is_cut_off_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, sock, _fake) = serve(dir.path());
    let r: Run = shim(&with_container("ADD", SLOW), config("1.0.0", &sock, 1).as_bytes());
    // Whichever fires first: the shim's own timer, or the binder's enforcement of the deadline the
    // shim sent (tonic reports it as CANCELLED).
    let v = r.assert_error(11, "ADD");
    let msg = v["msg"].as_str().unwrap();
    assert!(msg.contains("did not finish ADD within 1s") || msg.contains("cancelled ADD"), "{msg}");
    assert!(r.took >= Duration::from_millis(900) && r.took < Duration::from_secs(3), "took {:?}", r.took);
}
