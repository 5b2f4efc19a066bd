//! The call to kuryr-binder: one connection over its unix socket, one RPC, one deadline, no
//! retries. The runtime retries when told to (code 11); a shim that retried on its own would only
//! hide a binder that is down behind the runtime's longer timeout.

use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use kuryr_cni_types::{CniError, CniResult, Command, NetConf, code};
use kuryr_proto::binder::v1::cni_client::CniClient;
use kuryr_proto::binder::v1::{CniRequest, GcRequest, StatusRequest};
use tonic::codegen::http;

use crate::Invocation;
use crate::log::Log;

/// The shim's version; the binder refuses any other (FAILED_PRECONDITION → code 1).
pub const SHIM_VERSION: &str = env!("CARGO_PKG_VERSION");

/// What went wrong talking to the binder, before the CNI code is chosen.
#[derive(Debug)]
enum CallError {
    /// The socket could not be connected (absent, refused, permission).
    Connect(io::Error),
    /// Connected, but no HTTP/2 connection came up.
    Transport(hyper::Error),
    /// The binder answered with a failure.
    Status(tonic::Status),
    /// The deadline passed.
    Timeout(Duration),
}

/// Where one call's time went, as the shim measured it: building its runtime, connecting to the
/// binder (socket and HTTP/2 connection), and the call itself (sending the request to the answer,
/// the binder's work included).
#[derive(Clone, Copy, Debug, Default)]
pub struct Hops {
    pub runtime: Duration,
    pub connect: Duration,
    pub call: Duration,
}

/// Runs `inv.command` on the binder at `conf.binder_socket` within `conf.timeout(..)`; for ADD,
/// returns the result rendered in the configuration's `cniVersion`. `hops` gets the time of each
/// part.
pub fn call(
    conf: &NetConf,
    inv: &Invocation,
    config: &[u8],
    log: &Log,
    hops: &mut Hops,
) -> Result<Option<String>, CniError> {
    let t = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| CniError::io(format!("cannot start the I/O runtime: {e}")))?;
    hops.runtime = t.elapsed();
    let deadline = conf.timeout(inv.command);
    let socket = conf.binder_socket.as_path();
    let answer = rt.block_on(async {
        match tokio::time::timeout(deadline, rpc(socket, inv, config, deadline, log, hops)).await {
            Ok(r) => r,
            Err(_) => Err(CallError::Timeout(deadline)),
        }
    });
    let result = answer.map_err(|e| to_cni_error(e, inv.command, socket))?;
    let Some(result) = result else { return Ok(None) };
    let result = CniResult::try_from(&result)
        .map_err(|e| CniError::io(format!("kuryr-binder returned an unusable result: {e}")))?;
    Ok(Some(result.render(conf.cni_version).to_string()))
}

async fn rpc(
    socket: &Path,
    inv: &Invocation,
    config: &[u8],
    deadline: Duration,
    log: &Log,
    hops: &mut Hops,
) -> Result<Option<kuryr_proto::binder::v1::CniResult>, CallError> {
    let started = Instant::now();
    let mut client = connect(socket).await?;
    hops.connect = started.elapsed();
    // Tell the binder how long we wait, so it can give up (and clean up) rather than finish for
    // nobody.
    let remaining = deadline.saturating_sub(started.elapsed());
    let attachment = || CniRequest {
        shim_version: SHIM_VERSION.to_string(),
        container_id: inv.container_id.clone(),
        netns: inv.netns.clone(),
        ifname: inv.ifname.clone(),
        cni_args: inv.args.clone(),
        cni_path: inv.path.clone(),
        config: config.to_vec(),
    };
    let res = match inv.command {
        Command::Add => Some(client.add(timed(attachment(), remaining)).await.map_err(CallError::Status)?.into_inner()),
        Command::Del => client.del(timed(attachment(), remaining)).await.map(|_| None).map_err(CallError::Status)?,
        Command::Check => {
            client.check(timed(attachment(), remaining)).await.map(|_| None).map_err(CallError::Status)?
        }
        Command::Status => {
            let msg = StatusRequest { shim_version: SHIM_VERSION.to_string(), config: config.to_vec() };
            client.status(timed(msg, remaining)).await.map(|_| None).map_err(CallError::Status)?
        }
        Command::Gc => {
            let msg = GcRequest { shim_version: SHIM_VERSION.to_string(), config: config.to_vec() };
            let removed = client.gc(timed(msg, remaining)).await.map_err(CallError::Status)?.into_inner().removed;
            for a in removed {
                log.line(format_args!("GC removed container {} interface {}", a.container_id, a.ifname));
            }
            None
        }
        // Answered locally; never sent.
        Command::Version => None,
    };
    hops.call = started.elapsed().saturating_sub(hops.connect);
    Ok(res)
}

/// A request carrying the time left as its gRPC deadline.
fn timed<T>(msg: T, remaining: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(remaining);
    r
}

/// Connects once, over one HTTP/2 connection that carries the one call. The socket is dialled
/// here so that a binder that is down fails at once, with the OS's reason, and is never retried;
/// the call goes straight to the connection (no channel with its buffer and reconnects: there is
/// nothing to reconnect for one call). Keepalive as on every kuryr channel: a binder that stops
/// answering is noticed before the deadline when the deadline is long.
async fn connect(
    socket: &Path,
) -> Result<
    CniClient<
        impl tonic::client::GrpcService<
            tonic::body::Body,
            ResponseBody = hyper::body::Incoming,
            Error = tonic::Status,
            Future: Send,
        > + use<>,
    >,
    CallError,
> {
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(CallError::Connect)?;
    let (sender, connection) = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .handshake(TokioIo::new(stream))
        .await
        .map_err(CallError::Transport)?;
    // Driven beside the call; it ends when the runtime does, right after the answer.
    tokio::spawn(connection);
    let service = tower::service_fn(move |req: http::Request<tonic::body::Body>| {
        let mut sender = sender.clone();
        async move {
            sender
                .send_request(req)
                .await
                .map_err(|e| tonic::Status::unavailable(format!("the binder connection failed: {}", chain(&e))))
        }
    });
    // The origin is required by HTTP/2 but unused: the connection is already the binder's.
    Ok(CniClient::with_origin(service, http::Uri::from_static("http://kuryr-binder")))
}

/// Chooses the CNI error: the binder's own [`CniError`] when the status details carry one, and
/// otherwise a code from the gRPC code (STATUS reports unavailability as 50, the others as 11).
fn to_cni_error(e: CallError, command: Command, socket: &Path) -> CniError {
    let unavailable = if command == Command::Status { code::NOT_AVAILABLE } else { code::TRY_AGAIN_LATER };
    let unreachable = |why: String| {
        CniError::new(unavailable, format!("kuryr-binder is not reachable at {}: {why}", socket.display()))
    };
    match e {
        CallError::Connect(e) => unreachable(e.to_string()),
        CallError::Transport(e) => unreachable(chain(&e)),
        CallError::Timeout(d) => CniError::new(
            unavailable,
            format!("kuryr-binder at {} did not finish {command} within {}s", socket.display(), d.as_secs()),
        ),
        CallError::Status(s) => from_status(&s, command, socket, unavailable),
    }
}

fn from_status(s: &tonic::Status, command: Command, socket: &Path, unavailable: u32) -> CniError {
    if let Some(e) = CniError::from_status(s) {
        return e;
    }
    let details = format!("kuryr-binder answered {command} with gRPC status {:?}", s.code());
    let (code, msg) = match s.code() {
        tonic::Code::Unavailable => {
            (unavailable, format!("kuryr-binder is not reachable at {}: {}", socket.display(), s.message()))
        }
        tonic::Code::DeadlineExceeded => {
            (unavailable, format!("kuryr-binder did not finish {command} in time: {}", s.message()))
        }
        // tonic's server reports the expiry of the deadline the shim sent as CANCELLED; a binder
        // shutting down mid-call does too. Either way, trying again later is right.
        tonic::Code::Cancelled => (unavailable, format!("kuryr-binder cancelled {command}: {}", s.message())),
        tonic::Code::FailedPrecondition => (code::INCOMPATIBLE_VERSION, s.message().to_string()),
        tonic::Code::InvalidArgument => (code::INVALID_CONFIG, s.message().to_string()),
        tonic::Code::NotFound => (code::UNKNOWN_CONTAINER, s.message().to_string()),
        // The binder admits only root (and configured ids) on its socket: nothing to retry.
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => {
            (code::IO, format!("kuryr-binder refused {command}: {}", s.message()))
        }
        _ => (code::IO, format!("kuryr-binder failed {command}: {}", s.message())),
    };
    CniError::new(code, msg).with_details(details)
}

/// An error and its sources, joined: tonic's transport errors say little at the top.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(s: tonic::Status, command: Command) -> CniError {
        to_cni_error(CallError::Status(s), command, Path::new("/run/kuryr/binder.sock"))
    }

    #[test]
    fn grpc_codes_without_details() {
        use tonic::Code::*;
        let table = [
            (Unavailable, Command::Add, 11, "kuryr-binder is not reachable at /run/kuryr/binder.sock: m"),
            (Unavailable, Command::Status, 50, "kuryr-binder is not reachable at /run/kuryr/binder.sock: m"),
            (DeadlineExceeded, Command::Del, 11, "kuryr-binder did not finish DEL in time: m"),
            (DeadlineExceeded, Command::Status, 50, "kuryr-binder did not finish STATUS in time: m"),
            (Cancelled, Command::Add, 11, "kuryr-binder cancelled ADD: m"),
            (FailedPrecondition, Command::Add, 1, "m"),
            (InvalidArgument, Command::Check, 7, "m"),
            (NotFound, Command::Del, 3, "m"),
            (Internal, Command::Add, 5, "kuryr-binder failed ADD: m"),
            (PermissionDenied, Command::Del, 5, "kuryr-binder refused DEL: m"),
            (Unimplemented, Command::Gc, 5, "kuryr-binder failed GC: m"),
        ];
        for (grpc, cmd, want_code, want_msg) in table {
            let e = map(tonic::Status::new(grpc, "m"), cmd);
            assert_eq!((e.code, e.msg.as_str()), (want_code, want_msg), "{grpc:?} {cmd}");
            assert!(e.details.contains(&format!("{grpc:?}")), "{e:?}");
        }
    }

    #[test]
    fn details_win_over_the_grpc_code() {
        let carried = CniError::unknown_container("pod gone").with_details("long story");
        let s = tonic::Status::with_details(tonic::Code::Unavailable, "ignored", carried.to_status_details().into());
        let e = map(s, Command::Add);
        assert_eq!((e.code, e.msg.as_str(), e.details.as_str()), (3, "pod gone", "long story"));
    }

    #[test]
    fn connect_failures_and_timeouts() {
        let sock = Path::new("/nonexistent/b.sock");
        let e = to_cni_error(CallError::Connect(io::Error::from(io::ErrorKind::NotFound)), Command::Add, sock);
        assert_eq!(e.code, 11);
        assert!(e.msg.starts_with("kuryr-binder is not reachable at /nonexistent/b.sock: "), "{e}");
        let e =
            to_cni_error(CallError::Connect(io::Error::from(io::ErrorKind::ConnectionRefused)), Command::Status, sock);
        assert_eq!(e.code, 50);
        let e = to_cni_error(CallError::Timeout(Duration::from_secs(120)), Command::Add, sock);
        assert_eq!(
            (e.code, e.msg.as_str()),
            (11, "kuryr-binder at /nonexistent/b.sock did not finish ADD within 120s")
        );
    }
}
