use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::*;
use crate::testserver::{Reply, TestServer};

async fn octavia(
    handler: impl Fn(&crate::testserver::Recorded, &str) -> Reply + Send + Sync + 'static,
) -> (TestServer, Octavia) {
    let (server, client) = crate::testserver::with_client(ServiceType::LoadBalancer, handler).await;
    (server, client.load_balancer())
}

fn member(address: &str) -> MemberCreate {
    MemberCreate { address: address.into(), protocol_port: 8080, ..Default::default() }
}

#[test]
fn fully_populated_create_shape() {
    let mut pool = PoolCreate::new(Protocol::Tcp, LbAlgorithm::RoundRobin);
    pool.name = Some("default/web:80/TCP".into());
    pool.session_persistence = Some(SessionPersistence {
        kind: "SOURCE_IP".into(),
        cookie_name: None,
        persistence_timeout: None,
        persistence_granularity: None,
    });
    pool.members = vec![member("10.0.0.5"), member("fd00::5")];
    let mut listener = ListenerCreate::new(Protocol::Tcp, 80);
    listener.name = Some("default/web:80/TCP".into());
    listener.default_pool = Some(pool);
    let lb = LoadBalancerCreate {
        name: Some("default/web".into()),
        vip_subnet_id: Some("svc-subnet".into()),
        vip_address: Some("10.96.0.10".into()),
        tags: vec!["kuryr".into()],
        listeners: vec![listener],
        ..Default::default()
    };
    assert_eq!(
        serde_json::to_value(&lb).unwrap(),
        json!({
            "name": "default/web", "vip_subnet_id": "svc-subnet", "vip_address": "10.96.0.10", "tags": ["kuryr"],
            "listeners": [{
                "name": "default/web:80/TCP", "protocol": "TCP", "protocol_port": 80,
                "default_pool": {
                    "name": "default/web:80/TCP", "protocol": "TCP", "lb_algorithm": "ROUND_ROBIN",
                    "session_persistence": {"type": "SOURCE_IP"},
                    "members": [{"address": "10.0.0.5", "protocol_port": 8080}, {"address": "fd00::5", "protocol_port": 8080}],
                },
            }],
        })
    );
}

#[test]
fn statuses_and_unknown_values_parse() {
    let lb: LoadBalancer = serde_json::from_value(json!({
        "id": "lb", "provisioning_status": "PENDING_UPDATE", "operating_status": "OFFLINE",
        "listeners": [{"id": "l1"}], "pools": [], "vip_address": "198.51.100.1"
    }))
    .unwrap();
    assert!(lb.provisioning_status.is_pending());
    assert_eq!(lb.listeners, [IdRef { id: "l1".into() }]);
    let l: Listener = serde_json::from_value(json!({
        "id": "l", "protocol": "PROMETHEUS", "protocol_port": 9100, "provisioning_status": "SOMETHING_NEW"
    }))
    .unwrap();
    assert_eq!(l.protocol, Protocol::Other);
    assert_eq!(l.provisioning_status, ProvisioningStatus::Unknown);
    assert!(!ProvisioningStatus::Error.is_pending() && !ProvisioningStatus::Active.is_pending());
}

#[tokio::test]
async fn batch_members_cascade_delete_and_wait() {
    let polls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let p = polls.clone();
    let (server, o) = octavia(move |r, _| match (r.method.as_str(), r.path.as_str()) {
        ("PUT", "/v2/lbaas/pools/pool-1/members") => Reply::empty(202),
        ("DELETE", "/v2/lbaas/loadbalancers/lb-1") => Reply::empty(204),
        ("GET", "/v2/lbaas/loadbalancers/lb-1") => {
            let status =
                if p.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 2 { "PENDING_UPDATE" } else { "ACTIVE" };
            Reply::json(200, json!({"loadbalancer": {"id": "lb-1", "provisioning_status": status}}))
        }
        ("GET", "/v2/lbaas/loadbalancers/lb-2") => {
            Reply::json(200, json!({"loadbalancer": {"id": "lb-2", "provisioning_status": "PENDING_CREATE"}}))
        }
        ("GET", "/v2/lbaas/loadbalancers") => Reply::json(200, json!({"loadbalancers": [], "loadbalancers_links": []})),
        _ => Reply::json(404, json!({"faultcode": "Client", "faultstring": "not found"})),
    })
    .await;
    o.replace_members("pool-1", &[member("10.0.0.5"), member("10.0.0.6")]).await.unwrap();
    assert!(o.delete_load_balancer("lb-1", true).await.unwrap());
    assert!(!o.delete_load_balancer("lb-3", false).await.unwrap());
    let lb = o.wait_load_balancer("lb-1", Duration::from_secs(10)).await.unwrap();
    assert_eq!(lb.provisioning_status, ProvisioningStatus::Active);
    let e = o.wait_load_balancer("lb-2", Duration::from_millis(300)).await.unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    o.list_load_balancers(&Filter::new().tags(&["kuryr", "cluster=a"])).await.unwrap();
    let e = o.create_listener(&ListenerCreate::new(Protocol::Udp, 53)).await.unwrap_err();
    assert!(matches!(e, Error::InvalidRequest(_)));

    let reqs = server.requests();
    assert_eq!(
        reqs[0].json(),
        json!({"members": [{"address": "10.0.0.5", "protocol_port": 8080}, {"address": "10.0.0.6", "protocol_port": 8080}]})
    );
    assert_eq!(reqs[0].header("x-project-id"), Some("proj"));
    assert_eq!(reqs[1].query, "cascade=true");
    assert_eq!(reqs[2].query, "");
    assert_eq!(polls.load(std::sync::atomic::Ordering::SeqCst), 3);
    let list = reqs.iter().find(|r| r.path == "/v2/lbaas/loadbalancers").unwrap();
    assert_eq!(list.query, "tags=kuryr%2Ccluster%3Da&limit=1000");
}
