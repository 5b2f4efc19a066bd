//! Servers and clients in network namespaces that tell who answered and whom they saw: the
//! `kuryr-test-echo` binary (`src/bin/kuryr-test-echo.rs`) run with `nsenter --net`. A server
//! answers TCP connections and UDP datagrams on one port with `NAME PEER-ADDRESS`, so a test sees
//! which member a Service, node port or host port chose and whether the client's address was kept
//! (externalTrafficPolicy Local) or masqueraded on the way.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};

use crate::services::bin_path;

/// TCP, UDP or SCTP (SCTP only where the kernel has it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
}

impl Proto {
    fn arg(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }
}

/// A running server; killed on drop.
#[derive(Debug)]
pub struct EchoServer {
    _child: Child,
}

/// Starts a server named `name` on `port` (TCP and UDP, both families) inside `netns`.
pub fn serve(netns: &Path, name: &str, port: u16) -> Result<EchoServer> {
    let child = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg("--")
        .arg(bin_path("kuryr-test-echo")?)
        .args(["serve", name, &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("starting kuryr-test-echo")?;
    Ok(EchoServer { _child: child })
}

/// Who answered, and the client address it saw.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Answer {
    pub name: String,
    pub peer: IpAddr,
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (saw {})", self.name, self.peer)
    }
}

/// One request from inside `netns` to `addr:port`: the answer, or why there was none
/// (`refused`, `timeout`, ...).
pub async fn ask(netns: &Path, proto: Proto, addr: IpAddr, port: u16) -> Result<Answer, String> {
    let bin = bin_path("kuryr-test-echo").map_err(|e| e.to_string())?;
    let out = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg("--")
        .arg(bin)
        .args([proto.arg(), &addr.to_string(), &port.to_string(), "2"])
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    match (words.next(), words.next().and_then(|p| p.parse().ok())) {
        (Some(name), Some(peer)) => Ok(Answer { name: name.to_string(), peer }),
        _ => Err(format!("unexpected answer {text:?}")),
    }
}

/// `n` requests in a row: the answers by who answered and whom they saw (failures under
/// `error: <reason>`).
pub async fn answers(netns: &Path, proto: Proto, addr: IpAddr, port: u16, n: usize) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for _ in 0..n {
        let key = match ask(netns, proto, addr, port).await {
            Ok(a) => a.to_string(),
            Err(e) => format!("error: {e}"),
        };
        *seen.entry(key).or_insert(0) += 1;
    }
    seen
}

/// Repeats rounds of `n` requests (protocol, address and port) until every answer of a round satisfies `ok` and, together,
/// they come from exactly the servers `names`; returns that round's answers. Fails with the last
/// round after `timeout`.
pub async fn wait_answers(
    netns: &Path,
    (proto, addr, port): (Proto, IpAddr, u16),
    n: usize,
    names: &[&str],
    ok: impl Fn(&Answer) -> bool,
    timeout: Duration,
) -> Result<Vec<Answer>> {
    let deadline = Instant::now() + timeout;
    let mut want: Vec<&str> = names.to_vec();
    want.sort_unstable();
    want.dedup();
    loop {
        let mut got = Vec::new();
        let mut errors = Vec::new();
        for _ in 0..n {
            match ask(netns, proto, addr, port).await {
                Ok(a) => got.push(a),
                Err(e) => errors.push(e),
            }
        }
        let mut seen: Vec<&str> = got.iter().map(|a| a.name.as_str()).collect();
        seen.sort_unstable();
        seen.dedup();
        if errors.is_empty() && seen == want && got.iter().all(&ok) {
            return Ok(got);
        }
        if Instant::now() >= deadline {
            let shown: Vec<String> = got.iter().map(ToString::to_string).collect();
            bail!(
                "{n} {proto:?} requests to {addr}:{port} from {}: answers {shown:?}, errors {errors:?}; want each of {want:?}",
                netns.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until a request from inside `netns` to `addr:port` fails with `reason` (`refused`,
/// `timeout`, ...), i.e. no rule sends it anywhere any more.
pub async fn wait_failing(
    netns: &Path,
    proto: Proto,
    addr: IpAddr,
    port: u16,
    reason: &str,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        match ask(netns, proto, addr, port).await {
            Err(e) if e.contains(reason) => return Ok(()),
            other => {
                if Instant::now() >= deadline {
                    bail!("{proto:?} {addr}:{port} from {}: {other:?}, want {reason}", netns.display());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
