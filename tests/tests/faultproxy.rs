//! The fault proxy ([`kuryr_tests::faultproxy`]) does each fault it is asked for, seen from a
//! client through real HTTP: in front of a small counting upstream (the proxy's subject is the
//! traffic, not OpenStack), every fault at rate 1 in turn, then none. What the upstream saw tells
//! forwarded requests from refused ones: a 503, a 409 and a timeout never reach it, a slow answer
//! and a lost POST answer do (the object is created; its creator never hears of it).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use kuryr_tests::faultproxy::{FaultProxy, FaultRates, FaultTiming};

/// An upstream that counts the requests it got and answers 201 with a body naming the count.
async fn upstream() -> (String, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(AtomicU64::new(0));
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let s = s.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let n = s.fetch_add(1, Ordering::SeqCst) + 1;
                    async move {
                        let body = format!("{{\"n\": {n}, \"path\": \"{}\"}}", req.uri());
                        let mut resp = hyper::Response::new(Full::new(Bytes::from(body)));
                        *resp.status_mut() = hyper::StatusCode::CREATED;
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    (url, seen)
}

fn only(f: impl FnOnce(&mut FaultRates)) -> FaultRates {
    let mut r = FaultRates::NONE;
    f(&mut r);
    r
}

#[tokio::test]
async fn each_fault_is_injected_as_asked() {
    let (up, seen) = upstream().await;
    let timing = FaultTiming { hang: Duration::from_secs(3), slow: Duration::from_millis(700) };
    let proxy = FaultProxy::start(&up, FaultRates::NONE, timing, 1).await.unwrap();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(1)).build().unwrap();
    let post = || http.post(format!("{}/v2.0/ports?x=1", proxy.url())).body("{}").send();

    // No fault: forwarded, path and query kept, the upstream's status and body back.
    let r = post().await.unwrap();
    assert_eq!(r.status(), 201);
    assert!(r.text().await.unwrap().contains("/v2.0/ports?x=1"));
    assert_eq!(seen.load(Ordering::SeqCst), 1);

    // 503, not forwarded.
    proxy.set_rates(only(|r| r.server_error = 1.0));
    assert_eq!(post().await.unwrap().status(), 503);
    assert_eq!(seen.load(Ordering::SeqCst), 1, "a 503 must not reach the upstream");

    // 409 to a write, not forwarded; a read is not given a 409.
    proxy.set_rates(only(|r| r.conflict = 1.0));
    assert_eq!(post().await.unwrap().status(), 409);
    assert_eq!(http.get(format!("{}/v2.0/ports", proxy.url())).send().await.unwrap().status(), 201);
    assert_eq!(seen.load(Ordering::SeqCst), 2, "the 409 must not reach the upstream, the GET must");

    // Timeout: held past the client's own timeout, not forwarded.
    proxy.set_rates(only(|r| r.timeout = 1.0));
    let e = post().await.unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 2, "a timed-out request must not reach the upstream");

    // Slow: forwarded, answered late.
    proxy.set_rates(only(|r| r.slow = 1.0));
    let t = Instant::now();
    let r = post().await.unwrap();
    assert_eq!(r.status(), 201);
    assert!(t.elapsed() >= Duration::from_millis(700), "answered after {:?}", t.elapsed());
    assert_eq!(seen.load(Ordering::SeqCst), 3);

    // Lost answer: the POST is forwarded (the upstream creates), the client gets no answer.
    proxy.set_rates(only(|r| r.lost_answer = 1.0));
    let e = post().await.unwrap_err();
    assert!(!e.is_status(), "no answer expected: {e:?}");
    assert_eq!(seen.load(Ordering::SeqCst), 4, "the lost POST must have reached the upstream");
    // ... but only a POST's answer is lost.
    assert_eq!(http.put(format!("{}/v2.0/ports/a", proxy.url())).send().await.unwrap().status(), 201);
    assert_eq!(seen.load(Ordering::SeqCst), 5);

    let c = proxy.counts();
    assert_eq!((c.requests, c.server_error, c.conflict, c.timeout, c.slow, c.lost_answer), (8, 1, 1, 1, 1, 1), "{c}");
}

#[tokio::test]
async fn faults_come_at_about_their_rate() {
    let (up, seen) = upstream().await;
    let rates = FaultRates { server_error: 0.2, lost_answer: 0.2, ..FaultRates::NONE };
    let proxy = FaultProxy::start(&up, rates, FaultTiming::default(), 42).await.unwrap();
    let http = reqwest::Client::new();
    let (mut ok, mut e503, mut lost) = (0, 0, 0);
    for _ in 0..300 {
        match http.post(format!("{}/x", proxy.url())).send().await {
            Ok(r) if r.status() == 201 => ok += 1,
            Ok(r) if r.status() == 503 => e503 += 1,
            Ok(r) => panic!("unexpected {}", r.status()),
            Err(_) => lost += 1,
        }
    }
    let c = proxy.counts();
    assert_eq!((c.server_error, c.lost_answer), (e503, lost), "{c}");
    assert!((30..=90).contains(&e503) && (30..=90).contains(&lost), "{ok} ok, {e503} 503, {lost} lost of 300");
    assert_eq!(seen.load(Ordering::SeqCst), ok + lost, "lost answers were forwarded, 503s were not");
}
