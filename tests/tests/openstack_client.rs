//! kuryr-openstack against the real services: Keystone password and application-credential
//! authentication (from clouds.yaml and from OS_* variables), one token shared by many calls and
//! concurrent callers, a revoked token replaced after one 401, and wrong secrets reported as
//! authentication errors; Neutron ports (single, bulk, batched reads by id, guarded updates,
//! tags, typed errors), per-namespace networks with a router and floating IPs; Octavia load
//! balancers created fully populated, members replaced in one batch, cascade deleted.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kuryr_openstack::neutron::{
    FixedIp, FloatingIpAssociation, FloatingIpCreate, NetworkCreate, PortCreate, PortUpdate, RouterInterface,
    SubnetCreate, TaggedResource,
};
use kuryr_openstack::octavia::{
    LbAlgorithm, ListenerCreate, LoadBalancerCreate, MemberCreate, PoolCreate, Protocol, ProvisioningStatus,
};
use kuryr_openstack::{Client, ClientOptions, CloudConfig, ConfigSource, Error, Filter, Metrics};
use kuryr_tests::openstack::{OpenStackEnv, Service};
use kuryr_tests::topology;
use kuryr_tests::util::parse_env_file;

fn options() -> ClientOptions {
    // The services answer in well under a second; a loaded machine can be much slower.
    ClientOptions { timeout: Duration::from_secs(60), ..ClientOptions::default() }
}

/// A cloud of the environment's clouds.yaml, found the way users point tools at it.
fn cloud(env: &OpenStackEnv, name: &str) -> CloudConfig {
    let vars = HashMap::from([("OS_CLIENT_CONFIG_FILE".to_string(), env.clouds_yaml().display().to_string())]);
    let source = ConfigSource { cloud: Some(name.into()), env: vars, secure_files: Some(vec![]), ..Default::default() };
    CloudConfig::load(&source).unwrap()
}

fn client(config: &CloudConfig) -> Client {
    Client::new(config, options(), Arc::new(Metrics::unregistered())).unwrap()
}

#[tokio::test]
async fn keystone_password_and_application_credentials_tokens_reused_and_renewed() {
    let t0 = Instant::now();
    let env = OpenStackEnv::start(&[Service::Keystone]).await.unwrap();
    eprintln!("keystone up in {:?}", t0.elapsed());
    let ks = env.keystone().unwrap();

    // Password, from clouds.yaml: one authentication for many calls.
    let c = client(&cloud(&env, "kuryr"));
    for _ in 0..5 {
        let projects = c.identity().auth_projects().await.unwrap();
        assert!(projects.iter().any(|p| p.id == ks.project_id && p.name == ks.project_name), "{projects:?}");
    }
    assert_eq!(c.authentications(), 1);
    assert_eq!(c.project_id().await.unwrap().as_deref(), Some(ks.project_id.as_str()));
    assert_eq!(c.metrics().requests("identity", "auth.projects", "GET", "200"), 5);
    assert_eq!(c.metrics().requests("identity", "auth.tokens", "POST", "201"), 1);

    // Concurrent first calls share one authentication.
    let c2 = client(&cloud(&env, "kuryr"));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let c2 = c2.clone();
        tasks.spawn(async move { c2.identity().auth_projects().await.map(|p| p.len()) });
    }
    while let Some(r) = tasks.join_next().await {
        assert!(r.unwrap().unwrap() >= 1);
    }
    assert_eq!(c2.authentications(), 1);

    // A revoked token: the next call gets 401 once, authenticates again and succeeds.
    let token = c.token().await.unwrap().unwrap();
    let resp = reqwest::Client::new()
        .delete(format!("{}/auth/tokens", ks.auth_url))
        .header("X-Auth-Token", &token)
        .header("X-Subject-Token", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 204, "revoking the token");
    c.identity().auth_projects().await.unwrap();
    assert_eq!(c.authentications(), 2);
    assert_eq!(c.metrics().requests("identity", "auth.projects", "GET", "401"), 1);
    assert_ne!(c.token().await.unwrap().unwrap(), token);

    // Application credential, from clouds.yaml: the token is bound to the credential's project.
    let ac = client(&cloud(&env, "kuryr-appcred"));
    assert_eq!(ac.project_id().await.unwrap().as_deref(), Some(ks.project_id.as_str()));
    ac.identity().auth_projects().await.unwrap();
    assert_eq!(ac.authentications(), 1);

    // OS_* variables, as an openrc file sets them.
    let openrc = std::fs::read_to_string(env.openrc()).unwrap().replace("export ", "");
    let vars: HashMap<String, String> = parse_env_file(&openrc).into_iter().collect();
    let from_env = CloudConfig::load(&ConfigSource { env: vars.clone(), ..Default::default() }).unwrap();
    assert_eq!(from_env.origin, "OS_* environment");
    let e = client(&from_env);
    assert_eq!(e.project_id().await.unwrap().as_deref(), Some(ks.project_id.as_str()));

    // Wrong secrets: an authentication error carrying Keystone's 401, not retried.
    let mut bad = vars.clone();
    bad.insert("OS_PASSWORD".into(), "not-the-password".into());
    let c = client(&CloudConfig::from_env(&bad).unwrap());
    let err = c.identity().auth_projects().await.unwrap_err();
    assert!(matches!(&err, Error::Auth(inner) if matches!(**inner, Error::Unauthorized(_))), "{err:?}");
    assert_eq!(c.metrics().requests("identity", "auth.tokens", "POST", "401"), 1);
    let mut bad = HashMap::new();
    for (k, v) in [
        ("OS_AUTH_URL", ks.auth_url.as_str()),
        ("OS_APPLICATION_CREDENTIAL_ID", ks.application_credential_id.as_str()),
        ("OS_APPLICATION_CREDENTIAL_SECRET", "wrong"),
    ] {
        bad.insert(k.to_string(), v.to_string());
    }
    let err = client(&CloudConfig::from_env(&bad).unwrap()).authenticate().await.unwrap_err();
    assert_eq!(err.status().map(|s| s.as_u16()), Some(401), "{err:?}");

    // Without Neutron in the catalog, asking for it names what is missing.
    let c = client(&cloud(&env, "kuryr"));
    let err = c.network().list_ports(&Default::default()).await.unwrap_err();
    assert!(matches!(err, Error::NoEndpoint { .. }), "{err:?}");
}

/// A client for Neutron and/or Octavia without Keystone, acting in `project`.
fn direct_client(env: &OpenStackEnv, project: &str) -> Client {
    let mut vars = HashMap::from([
        ("OS_AUTH_TYPE".to_string(), "none".to_string()),
        ("OS_PROJECT_ID".to_string(), project.to_string()),
    ]);
    if let Some(url) = env.neutron_url() {
        vars.insert("OS_NETWORK_ENDPOINT_OVERRIDE".into(), url.into());
    }
    if let Some(url) = env.octavia_url() {
        vars.insert("OS_LOAD_BALANCER_ENDPOINT_OVERRIDE".into(), url.into());
    }
    client(&CloudConfig::from_env(&vars).unwrap())
}

/// A name no other test run uses (tags select this run's resources).
fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

#[tokio::test]
async fn neutron_ports_networks_routers_and_floating_ips() {
    let env = OpenStackEnv::start(&[Service::Keystone, Service::Neutron]).await.unwrap();
    let net = env.pod_network().unwrap();
    let node = env.neutron_node().unwrap();
    let c = direct_client(&env, &net.project_id);
    let n = c.network();
    let tag = unique("kuryr-test");

    // One port, bound to the agent's host, dual-stack, tagged at creation.
    let spec = |device: &str| PortCreate {
        network_id: net.network_id.clone(),
        fixed_ips: Some(vec![
            FixedIp { subnet_id: Some(net.subnet_v4_id.clone()), ip_address: None },
            FixedIp { subnet_id: Some(net.subnet_v6_id.clone()), ip_address: None },
        ]),
        device_owner: Some("compute:kuryr".into()),
        device_id: Some(device.into()),
        binding_host_id: Some(node.host.clone()),
        tags: Some(vec![tag.clone()]),
        ..Default::default()
    };
    let first = n.create_port(spec("pod-0")).await.unwrap();
    assert_eq!(first.project_id.as_deref(), Some(net.project_id.as_str()));
    assert_eq!(first.fixed_ips.len(), 2, "{first:?}");
    assert_eq!(first.binding_vif_type.as_deref(), Some("ovs"), "bound to the live agent: {first:?}");
    assert!(!first.binding_failed());
    assert_eq!(first.tags, std::slice::from_ref(&tag));

    // Bulk: all in one call, distinct addresses.
    let bulk = n.create_ports((1..=5).map(|i| spec(&format!("pod-{i}"))).collect()).await.unwrap();
    assert_eq!(bulk.len(), 5);
    assert_eq!(c.metrics().requests("network", "ports.create_bulk", "POST", "201"), 1);
    let mut ids: Vec<String> = bulk.iter().map(|p| p.id.clone()).collect();
    ids.push(first.id.clone());
    let mut addrs: Vec<String> =
        bulk.iter().chain([&first]).flat_map(|p| p.fixed_ips.iter()).filter_map(|f| f.ip_address.clone()).collect();
    addrs.sort();
    addrs.dedup();
    assert_eq!(addrs.len(), 12);

    // Batched status reads: 6 real ids among 60 unknown ones, in two list calls.
    let mut asked: Vec<String> = (0..60).map(|i| format!("00000000-0000-4000-8000-{i:012}")).collect();
    asked.extend(ids.iter().cloned());
    let found = n.list_ports_by_ids(&asked, &Filter::new().fields(&["status", "device_id"])).await.unwrap();
    assert_eq!(found.len(), 6);
    assert!(found.iter().all(|p| p.status == "DOWN"), "{found:?}");
    assert_eq!(c.metrics().requests("network", "ports.list", "GET", "200"), 2);
    let tagged = n.list_ports(&Filter::new().tags(&[&tag])).await.unwrap();
    assert_eq!(tagged.len(), 6);
    let one = n.list_ports(&Filter::new().tags(&[&tag]).device_id("pod-3")).await.unwrap();
    assert_eq!(one.len(), 1);

    // A guarded update (releasing to a pool), then one with a stale revision.
    let p = n.get_port(&first.id).await.unwrap();
    let release = PortUpdate {
        device_id: Some(String::new()),
        name: Some("available".into()),
        security_groups: Some(vec![]),
        ..Default::default()
    };
    let updated = n.update_port(&p.id, &release, p.revision_number).await.unwrap();
    assert_eq!((updated.device_id.as_str(), updated.name.as_str()), ("", "available"));
    assert!(updated.security_groups.is_empty());
    let err = n.update_port(&p.id, &release, p.revision_number).await.unwrap_err();
    assert!(matches!(err, Error::Conflict(_)), "stale revision: {err:?}");

    // Tags.
    n.add_tag(TaggedResource::Port, &p.id, "pooled").await.unwrap();
    assert_eq!(n.get_port(&p.id).await.unwrap().tags.len(), 2);
    assert!(n.remove_tag(TaggedResource::Port, &p.id, "pooled").await.unwrap());
    assert!(!n.remove_tag(TaggedResource::Port, &p.id, "pooled").await.unwrap());
    let tags = n.set_tags(TaggedResource::Port, &p.id, &[tag.clone(), "x".into()]).await.unwrap();
    assert_eq!(tags.len(), 2);

    // Typed errors from Neutron's own faults.
    let err = n
        .create_port(PortCreate { network_id: "00000000-0000-4000-8000-000000000000".into(), ..Default::default() })
        .await
        .unwrap_err();
    let Error::NotFound(fault) = &err else { panic!("{err:?}") };
    assert_eq!(fault.kind.as_deref(), Some("NetworkNotFound"), "{fault}");
    let mut bad = spec("pod-x");
    bad.fixed_ips =
        Some(vec![FixedIp { subnet_id: Some(net.subnet_v4_id.clone()), ip_address: Some("not-an-ip".into()) }]);
    let err = n.create_port(bad).await.unwrap_err();
    assert!(matches!(err, Error::BadRequest(_)), "{err:?}");
    assert!(err.to_string().contains("not-an-ip"), "{err}");

    // Through Keystone's catalog too (Neutron runs without auth, so the owner goes in the body).
    let via_catalog = client(&cloud(&env, "kuryr"));
    let seen = via_catalog.network().list_ports(&Filter::new().tags(&[&tag])).await.unwrap();
    assert_eq!(seen.len(), 6);

    for id in &ids {
        assert!(n.delete_port(id).await.unwrap());
    }
    assert!(!n.delete_port(&ids[0]).await.unwrap());
    assert!(n.get_port(&ids[0]).await.unwrap_err().is_not_found());
    assert!(n.list_ports(&Filter::new().tags(&[&tag])).await.unwrap().is_empty());

    // A per-namespace network behind a router, and a floating IP from an external network.
    let ns_net = n
        .create_network(NetworkCreate {
            name: Some(format!("{tag}-ns")),
            tags: Some(vec![tag.clone()]),
            ..Default::default()
        })
        .await
        .unwrap();
    let ns_sub = n
        .create_subnet(SubnetCreate {
            network_id: ns_net.id.clone(),
            ip_version: 4,
            cidr: Some("10.77.0.0/24".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let (ext, ext_sub) = topology::external_network(&n, &format!("{tag}-ext")).await.unwrap();
    assert!(ext.external);
    let router = topology::router_to(&n, &format!("{tag}-router"), &ext.id).await.unwrap();
    let iface = n.add_router_interface(&router.id, &RouterInterface::SubnetId(ns_sub.id.clone())).await.unwrap();
    assert_eq!(iface.subnet_id.as_deref(), Some(ns_sub.id.as_str()));
    let vip = n.create_port(PortCreate { network_id: ns_net.id.clone(), ..Default::default() }).await.unwrap();
    let fip = n
        .create_floating_ip(FloatingIpCreate {
            floating_network_id: ext.id.clone(),
            port_id: Some(vip.id.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(fip.port_id.as_deref(), Some(vip.id.as_str()));
    assert!(fip.floating_ip_address.starts_with("203.0.113."), "{fip:?}");
    let fip = n
        .associate_floating_ip(&fip.id, &FloatingIpAssociation { port_id: None, fixed_ip_address: None })
        .await
        .unwrap();
    assert_eq!(fip.port_id, None);
    assert_eq!(n.list_floating_ips(&Filter::new().eq("floating_network_id", ext.id.clone())).await.unwrap().len(), 1);
    assert!(n.delete_floating_ip(&fip.id).await.unwrap());
    assert!(n.delete_port(&vip.id).await.unwrap());
    n.remove_router_interface(&router.id, &RouterInterface::SubnetId(ns_sub.id.clone())).await.unwrap();
    assert!(n.delete_router(&router.id).await.unwrap());
    for (subnet, network) in [(&ns_sub.id, &ns_net.id), (&ext_sub.id, &ext.id)] {
        assert!(n.delete_subnet(subnet).await.unwrap());
        assert!(n.delete_network(network).await.unwrap());
    }
    assert!(n.get_network(&ns_net.id).await.unwrap_err().is_not_found());
}

fn member(address: &str, port: u16) -> MemberCreate {
    MemberCreate { address: address.into(), protocol_port: port, ..Default::default() }
}

#[tokio::test]
async fn octavia_fully_populated_batch_members_and_cascade_delete() {
    let env = OpenStackEnv::start(&[Service::Octavia]).await.unwrap();
    let project = "6d4c3a1f0e5b4b8e9a7f2c1d0b3e4f5a";
    let c = direct_client(&env, project);
    let o = c.load_balancer();
    let tag = unique("kuryr-test");
    let wait = Duration::from_secs(120);

    let mut pool = PoolCreate::new(Protocol::Tcp, LbAlgorithm::RoundRobin);
    pool.name = Some("default/web:80".into());
    pool.members = vec![member("10.0.0.5", 8080), member("10.0.0.6", 8080)];
    let mut listener = ListenerCreate::new(Protocol::Tcp, 80);
    listener.name = Some("default/web:80".into());
    listener.default_pool = Some(pool);
    let lb = o
        .create_load_balancer(LoadBalancerCreate {
            name: Some("default/web".into()),
            vip_subnet_id: Some("3f0a4b5c-1d2e-4f60-8a9b-0c1d2e3f4a5b".into()),
            vip_address: Some("10.96.0.10".into()),
            tags: vec![tag.clone()],
            listeners: vec![listener],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(lb.project_id.as_deref(), Some(project));
    let lb = o.wait_load_balancer(&lb.id, wait).await.unwrap();
    assert_eq!(lb.provisioning_status, ProvisioningStatus::Active, "{lb:?}");
    assert_eq!(lb.vip_address.as_deref(), Some("10.96.0.10"));
    assert_eq!(lb.listeners.len(), 1);
    let listener = o.get_listener(&lb.listeners[0].id).await.unwrap();
    assert_eq!((listener.protocol, listener.protocol_port), (Protocol::Tcp, 80));
    let pool_id = listener.default_pool_id.clone().unwrap();
    let members = o.list_members(&pool_id, &Filter::new()).await.unwrap();
    let mut addrs: Vec<_> = members.iter().map(|m| (m.address.clone(), m.protocol_port)).collect();
    addrs.sort();
    assert_eq!(addrs, [("10.0.0.5".to_string(), 8080), ("10.0.0.6".to_string(), 8080)]);
    let listed = o.list_load_balancers(&Filter::new().tags(&[&tag])).await.unwrap();
    assert_eq!(listed.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(), [lb.id.as_str()]);

    // Endpoints changed: one batch call sets the whole member list.
    let next = [member("10.0.0.6", 8080), member("10.0.0.7", 8080), member("fd00::7", 8080)];
    o.replace_members(&pool_id, &next).await.unwrap();
    // While that is applied the load balancer is immutable: this change waits its turn (409s
    // are retried) or lands after it.
    let mut second = ListenerCreate::new(Protocol::Udp, 53);
    second.loadbalancer_id = Some(lb.id.clone());
    let created = o.create_listener(&second).await;
    let lb_now = o.wait_load_balancer(&lb.id, wait).await.unwrap();
    assert_eq!(lb_now.provisioning_status, ProvisioningStatus::Active);
    match created {
        Ok(l) => assert_eq!(l.protocol_port, 53),
        Err(e) => panic!(
            "second listener: {e:?} (409 retries: {})",
            c.metrics().retries("load-balancer", "listeners.create", "conflict")
        ),
    }
    let mut addrs: Vec<_> =
        o.list_members(&pool_id, &Filter::new()).await.unwrap().into_iter().map(|m| m.address).collect();
    addrs.sort();
    assert_eq!(addrs, ["10.0.0.6", "10.0.0.7", "fd00::7"]);
    assert_eq!(c.metrics().requests("load-balancer", "members.replace", "PUT", "202"), 1);

    // A load balancer with children is not deleted without cascade; with it, everything goes.
    let err = o.delete_load_balancer(&lb.id, false).await.unwrap_err();
    assert!(matches!(err, Error::BadRequest(_)), "{err:?}");
    assert!(o.delete_load_balancer(&lb.id, true).await.unwrap());
    let deadline = Instant::now() + wait;
    loop {
        match o.get_load_balancer(&lb.id).await {
            Err(e) if e.is_not_found() => break,
            Ok(l) if l.provisioning_status == ProvisioningStatus::Deleted => break,
            Ok(l) => assert!(Instant::now() < deadline, "still {:?}", l.provisioning_status),
            Err(e) => panic!("{e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(o.list_load_balancers(&Filter::new().tags(&[&tag])).await.unwrap().is_empty());
    assert!(o.get_pool(&pool_id).await.unwrap_err().is_not_found());
}
