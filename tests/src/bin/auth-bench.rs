//! What authenticating calls between kuryr's services costs, measured against a real
//! kube-apiserver: a gRPC server with the runtime's auth layer in front of a method that answers
//! at once (GetVif: NOT_FOUND), called over loopback TCP
//!
//! - with `--auth=none` (the floor: no check at all),
//! - with a ServiceAccount token already checked (the cost of nearly every call: a SHA-256 of
//!   the token and a map lookup),
//! - with a token seen for the first time (a TokenReview round trip to the API server; once per
//!   token per `--auth-cache-ttl`),
//!
//! and the gate alone, without the network, for a checked token. Prints a table.
//!
//! ```sh
//! cargo run --release -p kuryr-tests --bin auth-bench    # AUTH_BENCH_CALLS (default 2000)
//! ```
#![allow(clippy::print_stdout)] // a report whose output is the point

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kuryr_proto::allocator::v1::vif_allocator_client::VifAllocatorClient;
use kuryr_proto::allocator::v1::vif_allocator_server::{VifAllocator, VifAllocatorServer};
use kuryr_proto::allocator::v1::{
    GetVifRequest, ReportPluggedRequest, ReportPluggedResponse, Vif, WatchVifsRequest, WatchVifsResponse,
};
use kuryr_runtime::auth::token::{Accounts, TokenReviewer};
use kuryr_runtime::auth::{AccountRef, AuthLayer, Call, Gate, Insecure, Peer, Rules};
use kuryr_tests::kube::KubeEnv;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

/// Answers GetVif at once; nothing else is called.
struct Nothing;

#[tonic::async_trait]
impl VifAllocator for Nothing {
    type WatchVifsStream = tokio_stream::Empty<Result<WatchVifsResponse, Status>>;
    async fn watch_vifs(&self, _: Request<WatchVifsRequest>) -> Result<Response<Self::WatchVifsStream>, Status> {
        Err(Status::unimplemented("bench"))
    }
    async fn report_plugged(
        &self,
        _: Request<ReportPluggedRequest>,
    ) -> Result<Response<ReportPluggedResponse>, Status> {
        Err(Status::unimplemented("bench"))
    }
    async fn get_vif(&self, _: Request<GetVifRequest>) -> Result<Response<Vif>, Status> {
        Err(Status::not_found("bench"))
    }
}

/// Serves [`Nothing`] behind `gate` on a free loopback port; its address.
async fn serve(gate: Arc<dyn Gate>) -> Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tonic::transport::Server::builder()
        .layer(AuthLayer(gate))
        .add_service(VifAllocatorServer::new(Nothing))
        .serve_with_incoming(TcpListenerStream::new(listener));
    tokio::spawn(server);
    Ok(addr.to_string())
}

/// Latencies of `n` sequential GetVif calls with `token` (none when empty).
async fn calls(addr: &str, token: &str, n: usize) -> Result<Vec<Duration>> {
    let mut c = VifAllocatorClient::new(kuryr_tests::auth::channel(addr, token)?);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let e = c.get_vif(GetVifRequest { pod_uid: "x".into() }).await.err().context("GetVif succeeded")?;
        anyhow::ensure!(e.code() == tonic::Code::NotFound, "the call was refused: {e}");
        out.push(t.elapsed());
    }
    Ok(out)
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn row(what: &str, v: &mut [Duration]) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!("| {what} | {} | {:.0} | {:.0} | {:.0} |", v.len(), us(pct(v, 0.5)), us(pct(v, 0.9)), us(pct(v, 0.99)));
}

#[tokio::main]
async fn main() -> Result<()> {
    let n: usize = std::env::var("AUTH_BENCH_CALLS").ok().map(|v| v.parse()).transpose()?.unwrap_or(2000);
    let kube = KubeEnv::start().await?;
    kube.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: kuryr-system\n").await?;
    let binder = AccountRef::new("kuryr-system", "kuryr-binder");
    let rules = Rules::new().allow("kuryr.allocator.v1.VifAllocator", &["GetVif"], &[binder]);
    let reviewer =
        Arc::new(TokenReviewer::new(Some(kube.kubeconfig_path().to_path_buf()), "kuryr", Duration::from_secs(300)));
    let accounts = Arc::new(Accounts::new(reviewer, rules));
    let insecure = serve(Arc::new(Insecure)).await?;
    let checked = serve(accounts.clone()).await?;
    let token = kube.kuryr_token("kuryr-system", "kuryr-binder", None).await?;

    println!("| calls | n | p50 µs | p90 µs | p99 µs |");
    println!("|---|---|---|---|---|");
    // Warm both connections first.
    calls(&insecure, "", 50).await?;
    calls(&checked, &token, 50).await?;
    row("--auth=none", &mut calls(&insecure, "", n).await?);
    row("token, already checked", &mut calls(&checked, &token, n).await?);
    // First calls with fresh tokens: each costs a TokenReview.
    let fresh = 50;
    let mut first = Vec::with_capacity(fresh);
    for _ in 0..fresh {
        let t = kube.kuryr_token("kuryr-system", "kuryr-binder", None).await?;
        first.push(calls(&checked, &t, 1).await?[0]);
    }
    row("token, first call (TokenReview)", &mut first);
    // The gate alone for a checked token: no network, no HTTP/2.
    let mut gate = Vec::with_capacity(n);
    for _ in 0..n {
        let call = Call {
            path: "/kuryr.allocator.v1.VifAllocator/GetVif".into(),
            authorization: Some(format!("Bearer {token}").parse()?),
            peer: Peer::Other,
        };
        let t = Instant::now();
        accounts.admit(call).await?;
        gate.push(t.elapsed());
    }
    row("the gate alone, checked token", &mut gate);
    Ok(())
}
