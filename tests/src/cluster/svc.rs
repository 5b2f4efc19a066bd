//! Services on a running cluster, seen the way a user would check them: TCP connections from
//! inside a pod's network namespace to a Service's ClusterIP and port, and who answered; the
//! EndpointSlices the controller wrote; each node's nftables table `inet kuryr`.
//!
//! Backends answer with their own pod name: their container is busybox
//! `nc -ll -p PORT -e /bin/hostname` ([`echo_command`]), and CRI gives every sandbox the pod's
//! name as its hostname. Clients are `busybox nc` run from the host inside the client pod's
//! network namespace (like `ping` in [`super::reach`]).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};

use super::ClusterNode;

/// Bound on one client connection (connect and read the answer).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The container command of a backend answering every TCP connection on `port` with its pod
/// name (the hostname CRI gives the sandbox), then closing it.
pub fn echo_command(port: u16) -> Vec<String> {
    ["nc", "-ll", "-p", &port.to_string(), "-e", "/bin/hostname"].iter().map(ToString::to_string).collect()
}

/// One TCP connection from inside `netns` to `addr:port`; the first line answered.
pub async fn connect(netns: &Path, addr: IpAddr, port: u16) -> Result<String> {
    let out = tokio::time::timeout(
        CONNECT_TIMEOUT + Duration::from_secs(2),
        tokio::process::Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .args(["--", "busybox", "nc", "-w", &CONNECT_TIMEOUT.as_secs().to_string()])
            .arg(addr.to_string())
            .arg(port.to_string())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .with_context(|| format!("connecting to {addr}:{port} took too long"))?
    .context("running nsenter busybox nc")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let answer = stdout.lines().next().unwrap_or_default().trim().to_string();
    if out.status.success() && !answer.is_empty() {
        return Ok(answer);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let why = stderr.trim().rsplit(": ").next().unwrap_or_default();
    bail!("{addr}:{port}: {}", if why.is_empty() { "no answer" } else { why })
}

/// Who answered `n` connections in a row (failures counted under `error: <reason>`).
pub async fn answers(netns: &Path, addr: IpAddr, port: u16, n: usize) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for _ in 0..n {
        let who = connect(netns, addr, port).await.unwrap_or_else(|e| format!("error: {e:#}"));
        *seen.entry(who).or_insert(0) += 1;
    }
    seen
}

/// Repeats rounds of `n` connections until a round is answered by exactly `want` (each at least
/// once, nobody else, no failure), or `timeout` passes; returns the last round.
pub async fn wait_answers(
    netns: &Path,
    addr: IpAddr,
    port: u16,
    n: usize,
    want: &[&str],
    timeout: Duration,
) -> Result<BTreeMap<String, usize>> {
    let deadline = Instant::now() + timeout;
    loop {
        let got = answers(netns, addr, port, n).await;
        if got.keys().map(String::as_str).eq(sorted(want).iter().copied()) {
            return Ok(got);
        }
        if Instant::now() >= deadline {
            bail!("{n} connections to {addr}:{port} were answered by {got:?}; want each of {want:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn sorted<'a>(v: &[&'a str]) -> Vec<&'a str> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.dedup();
    v
}

/// `answers` as one line: `web-0 ×7, web-1 ×6`.
pub fn describe(answers: &BTreeMap<String, usize>) -> String {
    answers.iter().map(|(who, n)| format!("{who} ×{n}")).collect::<Vec<_>>().join(", ")
}

/// The node's nftables table `inet kuryr` (empty when there is none).
pub async fn nft_table(node: &ClusterNode) -> String {
    node.node.exec(&["nft", "list", "table", "inet", "kuryr"]).await.unwrap_or_default()
}

/// Waits until `pred` holds for the table of every node in `nodes`; the error shows the first
/// node's table that did not satisfy it.
pub async fn wait_tables(
    nodes: &[ClusterNode],
    what: &str,
    timeout: Duration,
    pred: impl Fn(&str) -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut failing = None;
        for n in nodes {
            let t = nft_table(n).await;
            if !pred(&t) {
                failing = Some((n.name.clone(), t));
                break;
            }
        }
        let Some((node, table)) = failing else { return Ok(()) };
        if Instant::now() >= deadline {
            bail!("timed out waiting for {what} on {node}; its table inet kuryr:\n{table}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// True when `table` holds `ip` as a whole address (not as a prefix of a longer one).
pub fn table_has(table: &str, ip: IpAddr) -> bool {
    // What may not touch an address: for IPv4 digits and dots (`10.0.0.5:8080` is fine), for
    // IPv6 hex digits and colons (`[fd00::5]:8080` is fine).
    let part_of: fn(char) -> bool = match ip {
        IpAddr::V4(_) => |c| c.is_ascii_digit() || c == '.',
        IpAddr::V6(_) => |c| c.is_ascii_hexdigit() || c == ':',
    };
    let ip = ip.to_string();
    table.match_indices(&ip).any(|(i, _)| {
        let after = table[i + ip.len()..].chars().next();
        let before = table[..i].chars().next_back();
        !before.is_some_and(part_of) && !after.is_some_and(part_of)
    })
}

/// A Service's first ClusterIP and its ports.
pub async fn cluster_ip(client: &kube::Client, namespace: &str, name: &str) -> Result<(IpAddr, Vec<u16>)> {
    let svc = Api::<Service>::namespaced(client.clone(), namespace).get(name).await?;
    let spec = svc.spec.context("Service without spec")?;
    let ip = spec.cluster_ip.as_deref().context("Service without a ClusterIP")?;
    let ip: IpAddr = ip.parse().with_context(|| format!("ClusterIP {ip:?}"))?;
    let ports = spec.ports.iter().flatten().filter_map(|p| u16::try_from(p.port).ok()).collect();
    Ok((ip, ports))
}

/// The ready endpoint addresses of a Service, from its EndpointSlices (label
/// `kubernetes.io/service-name`), as (address, pod name).
pub async fn ready_endpoints(client: &kube::Client, namespace: &str, service: &str) -> Result<Vec<(IpAddr, String)>> {
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={service}")))
        .await?
        .items;
    let mut out = Vec::new();
    for s in slices {
        for e in s.endpoints {
            if e.conditions.as_ref().and_then(|c| c.ready) != Some(true) {
                continue;
            }
            let pod = e.target_ref.as_ref().and_then(|r| r.name.clone()).unwrap_or_default();
            out.extend(e.addresses.iter().filter_map(|a| a.parse().ok()).map(|a| (a, pod.clone())));
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_matches_whole_addresses_only() {
        let t = "ip daddr 10.96.0.10 tcp dport 80 dnat ip to 10.244.1.5:8080, dnat ip6 to [fd00::1]:8080, fd00::12";
        assert!(table_has(t, "10.96.0.10".parse().unwrap()));
        assert!(table_has(t, "10.244.1.5".parse().unwrap()));
        assert!(!table_has(t, "10.96.0.1".parse().unwrap()));
        assert!(!table_has(t, "10.244.1.50".parse().unwrap()));
        assert!(table_has(t, "fd00::1".parse().unwrap()));
        assert!(table_has(t, "fd00::12".parse().unwrap()));
        assert!(!table_has(t, "fd00::".parse().unwrap()));
    }
}
