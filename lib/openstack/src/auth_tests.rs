use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::*;
use crate::config::CloudConfig;
use crate::error::Error;
use crate::filter::Filter;
use crate::metrics::Metrics;
use crate::policy::RetryConfig;
use crate::testserver::{Recorded, Reply, TestServer, keystone_token};
use crate::{Client, ClientOptions};

fn password_config(base: &str) -> CloudConfig {
    CloudConfig {
        origin: "test".into(),
        auth: AuthConfig::Password {
            auth_url: Url::parse(&format!("{base}/identity/v3")).unwrap(),
            user: UserRef::Name { name: "kuryr".into(), domain: DomainRef::Name("Default".into()) },
            password: "secret".into(),
            project: ProjectScope::Name { name: "k8s".into(), domain: DomainRef::Id("default".into()) },
        },
        region_name: Some("RegionOne".into()),
        interface: Interface::Public,
        tls: Default::default(),
        endpoint_overrides: BTreeMap::new(),
    }
}

fn fast_options() -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(5),
        retry: RetryConfig {
            max_attempts: 4,
            base_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(20),
        },
        ..ClientOptions::default()
    }
}

fn client(config: &CloudConfig, options: ClientOptions) -> Client {
    Client::new(config, options, Arc::new(Metrics::unregistered())).unwrap()
}

fn is_auth(r: &Recorded) -> bool {
    r.path == "/identity/v3/auth/tokens"
}

fn port_list() -> Reply {
    Reply::json(200, serde_json::json!({"ports": []}))
}

#[tokio::test]
async fn a_token_is_reused_and_the_catalog_endpoint_used() {
    let server = TestServer::start(|r, base| {
        if is_auth(r) { keystone_token("tok-1", base, Duration::from_secs(3600)) } else { port_list() }
    })
    .await;
    let c = client(&password_config(&server.url), fast_options());
    for _ in 0..5 {
        c.network().list_ports(&Filter::new()).await.unwrap();
    }
    assert_eq!(c.authentications(), 1);
    assert_eq!(c.metrics().authentications_ok(), 1);
    let reqs = server.requests();
    let auth = &reqs[0];
    assert_eq!(auth.method, Method::POST);
    assert_eq!(
        auth.json(),
        serde_json::json!({"auth": {
            "identity": {"methods": ["password"], "password": {"user": {"name": "kuryr", "domain": {"name": "Default"}, "password": "secret"}}},
            "scope": {"project": {"name": "k8s", "domain": {"id": "default"}}},
        }})
    );
    let lists: Vec<_> = reqs.iter().filter(|r| !is_auth(r)).collect();
    assert_eq!(lists.len(), 5);
    for r in lists {
        assert_eq!(r.path, "/networking/v2.0/ports");
        assert_eq!(r.header("x-auth-token"), Some("tok-1"));
        assert_eq!(r.query, "limit=1000");
    }
    assert_eq!(c.project_id().await.unwrap().as_deref(), Some("proj-1"));
}

#[tokio::test]
async fn concurrent_callers_share_one_authentication() {
    let server = TestServer::start(|r, base| {
        if is_auth(r) {
            keystone_token("tok-1", base, Duration::from_secs(3600)).delayed(Duration::from_millis(200))
        } else {
            port_list()
        }
    })
    .await;
    let c = client(&password_config(&server.url), fast_options());
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let c = c.clone();
        tasks.spawn(async move { c.network().list_ports(&Filter::new()).await.map(|p| p.len()) });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap().unwrap();
    }
    assert_eq!(server.count("POST", "/auth/tokens"), 1);
    assert_eq!(server.count("GET", "/ports"), 20);
}

#[tokio::test]
async fn a_revoked_token_is_replaced_once() {
    let auths = Arc::new(AtomicUsize::new(0));
    let a = auths.clone();
    let server = TestServer::start(move |r, base| {
        if is_auth(r) {
            let n = a.fetch_add(1, Ordering::SeqCst) + 1;
            return keystone_token(&format!("tok-{n}"), base, Duration::from_secs(3600));
        }
        match r.header("x-auth-token") {
            Some("tok-1") => Reply::json(
                401,
                serde_json::json!({"error": {"code": 401, "title": "Unauthorized", "message": "revoked"}}),
            ),
            _ => port_list(),
        }
    })
    .await;
    let c = client(&password_config(&server.url), fast_options());
    c.network().list_ports(&Filter::new()).await.unwrap();
    c.network().list_ports(&Filter::new()).await.unwrap();
    assert_eq!(c.authentications(), 2);
    let tokens: Vec<_> = server
        .requests()
        .iter()
        .filter(|r| !is_auth(r))
        .map(|r| r.header("x-auth-token").unwrap().to_string())
        .collect();
    assert_eq!(tokens, ["tok-1", "tok-2", "tok-2"]);
}

#[tokio::test]
async fn a_token_refused_twice_is_unauthorized() {
    let server = TestServer::start(|r, base| {
        if is_auth(r) {
            keystone_token("tok", base, Duration::from_secs(3600))
        } else {
            Reply::json(401, serde_json::json!({"error": {"code": 401, "title": "Unauthorized", "message": "no"}}))
        }
    })
    .await;
    let c = client(&password_config(&server.url), fast_options());
    let e = c.network().get_port("p1").await.unwrap_err();
    assert!(matches!(e, Error::Unauthorized(_)), "{e:?}");
    assert_eq!(server.count("GET", "/ports/p1"), 2);
    assert_eq!(server.count("POST", "/auth/tokens"), 2);
}

#[tokio::test]
async fn a_token_is_renewed_before_it_expires() {
    let auths = Arc::new(AtomicUsize::new(0));
    let a = auths.clone();
    let server = TestServer::start(move |r, base| {
        if is_auth(r) {
            let n = a.fetch_add(1, Ordering::SeqCst) + 1;
            keystone_token(&format!("tok-{n}"), base, Duration::from_secs(2))
        } else {
            port_list()
        }
    })
    .await;
    // Margin 300 s but lifetime 2 s: renewed at half life, 1 s.
    let c = client(&password_config(&server.url), fast_options());
    c.network().list_ports(&Filter::new()).await.unwrap();
    c.network().list_ports(&Filter::new()).await.unwrap();
    assert_eq!(c.authentications(), 1);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    c.network().list_ports(&Filter::new()).await.unwrap();
    assert_eq!(c.authentications(), 2);
    let last = server.requests().into_iter().next_back().unwrap();
    assert_eq!(last.header("x-auth-token"), Some("tok-2"));
}

#[tokio::test]
async fn a_wrong_password_is_an_auth_error_without_retries() {
    let server = TestServer::start(|_, _| {
        Reply::json(401, serde_json::json!({"error": {"code": 401, "title": "Unauthorized", "message": "The request you have made requires authentication."}}))
    })
    .await;
    let c = client(&password_config(&server.url), fast_options());
    let e = c.authenticate().await.unwrap_err();
    let Error::Auth(inner) = &e else { panic!("{e:?}") };
    assert!(matches!(**inner, Error::Unauthorized(_)), "{inner:?}");
    assert_eq!(e.reason(), "AuthFailed");
    assert_eq!(e.status().map(|s| s.as_u16()), Some(401));
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn application_credentials_and_missing_catalog_entries() {
    let server = TestServer::start(|r, base| {
        if is_auth(r) { keystone_token("tok", base, Duration::from_secs(3600)) } else { port_list() }
    })
    .await;
    let mut config = password_config(&server.url);
    config.auth = AuthConfig::ApplicationCredential {
        auth_url: Url::parse(&format!("{}/identity/v3", server.url)).unwrap(),
        credential: AppCredential::Id { id: "ac-1".into(), secret: "s3cr3t".into() },
    };
    config.region_name = Some("RegionTwo".into());
    let c = client(&config, fast_options());
    let e = c.network().list_ports(&Filter::new()).await.unwrap_err();
    assert!(matches!(e, Error::NoEndpoint { service: ServiceType::Network, .. }), "{e:?}");
    assert_eq!(e.to_string(), "no network endpoint for interface public in region RegionTwo in the service catalog");
    assert_eq!(
        server.requests()[0].json(),
        serde_json::json!({"auth": {"identity": {"methods": ["application_credential"], "application_credential": {"id": "ac-1", "secret": "s3cr3t"}}}})
    );
    config.region_name = None;
    config.interface = Interface::Internal;
    let c = client(&config, fast_options());
    c.network().list_ports(&Filter::new()).await.unwrap();
    assert_eq!(server.requests().last().unwrap().path, "/internal/networking/v2.0/ports");
}

#[tokio::test]
async fn server_errors_are_retried_for_reads_and_not_for_creates() {
    let gets = Arc::new(AtomicUsize::new(0));
    let g = gets.clone();
    let server = TestServer::start(move |r, base| {
        if is_auth(r) {
            return keystone_token("tok", base, Duration::from_secs(3600));
        }
        if r.method == Method::GET && g.fetch_add(1, Ordering::SeqCst) < 2 {
            return Reply::empty(503);
        }
        if r.method == Method::POST {
            return Reply::json(500, serde_json::json!({"NeutronError": {"type": "Internal", "message": "boom"}}));
        }
        port_list()
    })
    .await;
    let c = client(&password_config(&server.url), fast_options());
    c.network().list_ports(&Filter::new()).await.unwrap();
    assert_eq!(server.count("GET", "/ports"), 3);
    assert_eq!(c.metrics().retries("network", "ports.list", "server_error"), 2);
    assert_eq!(c.metrics().requests("network", "ports.list", "GET", "503"), 2);
    assert_eq!(c.metrics().requests("network", "ports.list", "GET", "200"), 1);

    let e = c
        .network()
        .create_port(crate::neutron::PortCreate { network_id: "n".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e:?}");
    assert_eq!(server.count("POST", "/ports"), 1);
}

#[tokio::test]
async fn conflicts_are_retried_for_octavia_changes() {
    let posts = Arc::new(AtomicUsize::new(0));
    let p = posts.clone();
    let server = TestServer::start(move |r, base| {
        if is_auth(r) {
            return keystone_token("tok", base, Duration::from_secs(3600));
        }
        if p.fetch_add(1, Ordering::SeqCst) < 2 {
            return Reply::json(409, serde_json::json!({"faultcode": "Client", "faultstring": "Load Balancer lb is immutable and cannot be updated."}));
        }
        Reply::empty(202)
    })
    .await;
    let c = client(&password_config(&server.url), fast_options());
    c.load_balancer().replace_members("pool-1", &[]).await.unwrap();
    assert_eq!(server.count("PUT", "/load-balancer/v2/lbaas/pools/pool-1/members"), 3);
    assert_eq!(c.metrics().retries("load-balancer", "members.replace", "conflict"), 2);
}

#[tokio::test]
async fn timeouts_and_refused_connections() {
    let server = TestServer::start(|_, _| port_list().delayed(Duration::from_millis(500))).await;
    let mut config = password_config(&server.url);
    config.auth = AuthConfig::NoAuth { project_id: None };
    config.endpoint_overrides.insert(ServiceType::Network, Url::parse(&server.url).unwrap());
    let options = ClientOptions { timeout: Duration::from_millis(100), ..fast_options() };
    let c = client(&config, options);
    let e = c.network().list_ports(&Filter::new()).await.unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    assert_eq!(c.metrics().requests("network", "ports.list", "GET", "Timeout"), 4);

    // A port nothing listens on: even a create is retried (nothing was sent), then reported.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    config.endpoint_overrides.insert(ServiceType::Network, Url::parse(&url).unwrap());
    let c = client(&config, fast_options());
    let e = c
        .network()
        .create_port(crate::neutron::PortCreate { network_id: "n".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Connect { .. }), "{e:?}");
    assert!(e.is_transient());
    assert_eq!(c.metrics().retries("network", "ports.create", "connect"), 3);
}

#[tokio::test]
async fn no_auth_sends_the_project_and_never_authenticates() {
    let server = TestServer::start(|r, _| {
        if r.method == Method::POST {
            Reply::json(
                201,
                serde_json::json!({"loadbalancer": {"id": "lb-1", "provisioning_status": "PENDING_CREATE"}}),
            )
        } else {
            port_list()
        }
    })
    .await;
    let mut config = password_config(&server.url);
    config.auth = AuthConfig::NoAuth { project_id: Some("proj-9".into()) };
    config.endpoint_overrides.insert(ServiceType::Network, Url::parse(&server.url).unwrap());
    config.endpoint_overrides.insert(ServiceType::LoadBalancer, Url::parse(&format!("{}/lb/v2", server.url)).unwrap());
    let c = client(&config, fast_options());
    c.network().list_ports(&Filter::new().device_id("pod-uid")).await.unwrap();
    let lb = c.load_balancer().create_load_balancer(Default::default()).await.unwrap();
    assert!(lb.provisioning_status.is_pending());
    assert_eq!(c.authentications(), 0);
    let reqs = server.requests();
    assert_eq!(reqs[0].path, "/v2.0/ports");
    assert_eq!(reqs[0].query, "device_id=pod-uid&limit=1000");
    assert_eq!(reqs[0].header("x-project-id"), Some("proj-9"));
    assert!(reqs[0].header("x-auth-token").is_none());
    assert_eq!(reqs[1].path, "/lb/v2/lbaas/loadbalancers");
    assert_eq!(reqs[1].json(), serde_json::json!({"loadbalancer": {"project_id": "proj-9"}}));
}

#[tokio::test]
async fn the_concurrency_limit_holds() {
    let server = TestServer::start(|_, _| port_list().delayed(Duration::from_millis(50))).await;
    let mut config = password_config(&server.url);
    config.auth = AuthConfig::NoAuth { project_id: None };
    config.endpoint_overrides.insert(ServiceType::Network, Url::parse(&server.url).unwrap());
    let c = client(&config, ClientOptions { concurrency: 3, ..fast_options() });
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..12 {
        let c = c.clone();
        tasks.spawn(async move { c.network().list_ports(&Filter::new()).await.map(drop) });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap().unwrap();
    }
    assert_eq!(server.requests().len(), 12);
    assert!(server.max_in_flight() <= 3, "{}", server.max_in_flight());
    assert!(server.max_in_flight() >= 2, "{}", server.max_in_flight());
}

#[test]
fn refresh_timing() {
    let h = Duration::from_secs(3600);
    assert_eq!(refresh_after(h, Duration::from_secs(300)), Duration::from_secs(3300));
    assert_eq!(refresh_after(Duration::from_secs(60), Duration::from_secs(300)), Duration::from_secs(30));
    assert_eq!(refresh_after(h, Duration::ZERO), h);
}

#[test]
fn token_lifetime_from_keystone_timestamps() {
    let l = token_lifetime(Some("2025-01-01T10:00:00.000000Z"), "2025-01-01T11:00:00.000000Z").unwrap();
    assert_eq!(l, Duration::from_secs(3600));
    let e = token_lifetime(Some("2025-01-01T11:00:00Z"), "2025-01-01T10:00:00Z").unwrap_err();
    assert!(e.to_string().contains("before it was issued"), "{e}");
    assert!(token_lifetime(None, "yesterday").is_err());
}

#[test]
fn catalog_endpoints_by_interface_and_region() {
    let catalog: Vec<CatalogService> = serde_json::from_value(serde_json::json!([
        {"type": "network", "endpoints": [
            {"interface": "public", "region_id": "r1", "url": "https://n1.example/"},
            {"interface": "internal", "region_id": "r1", "url": "http://n1.internal:9696"},
            {"interface": "public", "region_id": "r2", "region": "r2", "url": "https://n2.example/"},
        ]},
        {"type": "load-balancer", "endpoints": [{"interface": "publicURL", "region": "r1", "url": "https://o1.example/"}]},
    ]))
    .unwrap();
    let url = |s, i, r| find_endpoint(&catalog, s, i, r).map(|u| u.to_string());
    assert_eq!(url(ServiceType::Network, Interface::Public, None).unwrap(), "https://n1.example/");
    assert_eq!(url(ServiceType::Network, Interface::Public, Some("r2")).unwrap(), "https://n2.example/");
    assert_eq!(url(ServiceType::Network, Interface::Internal, Some("r1")).unwrap(), "http://n1.internal:9696/");
    assert_eq!(url(ServiceType::LoadBalancer, Interface::Public, Some("r1")).unwrap(), "https://o1.example/");
    assert!(matches!(
        find_endpoint(&catalog, ServiceType::Network, Interface::Admin, None),
        Err(Error::NoEndpoint { service: ServiceType::Network, interface: "admin", region: None })
    ));
}

#[test]
fn application_credential_by_name_names_its_user() {
    let body = auth_request_body(&AuthConfig::ApplicationCredential {
        auth_url: Url::parse("http://k/v3").unwrap(),
        credential: AppCredential::Name { name: "kuryr".into(), user: UserRef::Id("u-1".into()), secret: "s".into() },
    })
    .unwrap();
    assert_eq!(
        body,
        serde_json::json!({"auth": {"identity": {"methods": ["application_credential"],
            "application_credential": {"name": "kuryr", "user": {"id": "u-1"}, "secret": "s"}}}})
    );
    assert!(auth_request_body(&AuthConfig::NoAuth { project_id: None }).is_none());
}
