//! The OpenStack test environment itself, proven with plain HTTP: a real Keystone issues tokens
//! for password and application-credential auth and refuses a wrong secret; a real Neutron binds a
//! port to the agent's host and turns it ACTIVE once it is plugged into `br-int`; a real Octavia
//! takes a load balancer to ACTIVE and cascade-deletes it. Every OpenStack backend test builds on
//! these guarantees.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use kuryr_tests::openstack::{KeystoneCredentials, NeutronNode, OpenStackEnv, Service};
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};

/// Per HTTP call; the services answer in well under a second unless the machine is overloaded.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

fn client() -> Client {
    Client::builder().timeout(CALL_TIMEOUT).build().unwrap()
}

/// POST /v3/auth/tokens; returns the status, the token id (header) and the token body.
async fn issue_token(http: &Client, auth_url: &str, auth: Value) -> (StatusCode, Option<String>, Value) {
    let resp = http.post(format!("{auth_url}/auth/tokens")).json(&json!({ "auth": auth })).send().await.unwrap();
    let status = resp.status();
    let token = resp.headers().get("X-Subject-Token").map(|v| v.to_str().unwrap().to_string());
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    (status, token, body)
}

fn password_auth(ks: &KeystoneCredentials, password: &str) -> Value {
    json!({
        "identity": {
            "methods": ["password"],
            "password": { "user": { "name": ks.username, "domain": { "name": "Default" }, "password": password } }
        },
        "scope": { "project": { "name": ks.project_name, "domain": { "name": "Default" } } }
    })
}

fn app_cred_auth(id: &str, secret: &str) -> Value {
    json!({
        "identity": {
            "methods": ["application_credential"],
            "application_credential": { "id": id, "secret": secret }
        }
    })
}

/// The public URL of the catalog entry of `service_type`, if any.
fn catalog_url(token: &Value, service_type: &str) -> Option<String> {
    token["token"]["catalog"].as_array()?.iter().find(|s| s["type"] == service_type).and_then(|s| {
        s["endpoints"].as_array()?.iter().find(|e| e["interface"] == "public")?["url"].as_str().map(str::to_string)
    })
}

/// Password and application-credential tokens, a refused wrong secret, token validation, and the
/// catalog's identity entry. Returns a password token body for further catalog checks.
async fn check_keystone(ks: &KeystoneCredentials) -> Value {
    let http = client();

    let (status, token, body) = issue_token(&http, &ks.auth_url, password_auth(ks, &ks.password)).await;
    assert_eq!(status, StatusCode::CREATED, "password auth: {body}");
    let token = token.expect("password auth: no X-Subject-Token");
    assert_eq!(body["token"]["project"]["id"], ks.project_id.as_str(), "password token scope: {body}");
    assert_eq!(body["token"]["user"]["id"], ks.user_id.as_str());
    assert!(body["token"]["roles"].as_array().unwrap().iter().any(|r| r["name"] == "member"), "roles: {body}");
    assert_eq!(catalog_url(&body, "identity").as_deref(), Some(ks.auth_url.as_str()), "catalog: {body}");

    let (status, _, body) = issue_token(&http, &ks.auth_url, password_auth(ks, "not-the-password")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "a wrong password must be refused: {body}");

    let (status, ac_token, ac_body) = issue_token(
        &http,
        &ks.auth_url,
        app_cred_auth(&ks.application_credential_id, &ks.application_credential_secret),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "application credential auth: {ac_body}");
    assert!(ac_token.is_some());
    assert_eq!(ac_body["token"]["methods"], json!(["application_credential"]));
    assert_eq!(ac_body["token"]["application_credential"]["id"], ks.application_credential_id.as_str());
    assert_eq!(ac_body["token"]["project"]["id"], ks.project_id.as_str(), "bound to the project: {ac_body}");

    let (status, _, body) =
        issue_token(&http, &ks.auth_url, app_cred_auth(&ks.application_credential_id, "wrong-secret")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "a wrong application credential secret: {body}");

    // The token is valid for Keystone itself (validation) and names its owner.
    let resp = http
        .get(format!("{}/auth/tokens", ks.auth_url))
        .header("X-Auth-Token", &token)
        .header("X-Subject-Token", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let resp =
        http.get(format!("{}/auth/catalog", ks.auth_url)).header("X-Auth-Token", "garbage").send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "a garbage token must be refused");

    let (_, _, body) = issue_token(&http, &ks.auth_url, password_auth(ks, &ks.password)).await;
    body
}

#[tokio::test]
async fn keystone_alone_issues_password_and_application_credential_tokens() {
    let t0 = Instant::now();
    let env = OpenStackEnv::start(&[Service::Keystone]).await.unwrap();
    eprintln!("keystone up in {:?}", t0.elapsed());
    let ks = env.keystone().expect("keystone credentials in the env file");
    assert!(env.neutron_url().is_none() && env.octavia_url().is_none());
    let token = check_keystone(&ks).await;
    assert_eq!(catalog_url(&token, "network"), None, "no Neutron was started: {token}");

    // The files a user points their tools at.
    let clouds = std::fs::read_to_string(env.clouds_yaml()).unwrap();
    for needle in ["kuryr-appcred:", &ks.application_credential_id, &ks.auth_url, "v3applicationcredential"] {
        assert!(clouds.contains(needle), "clouds.yaml lacks {needle}:\n{clouds}");
    }
    let openrc = std::fs::read_to_string(env.openrc()).unwrap();
    assert!(openrc.contains(&format!("export OS_AUTH_URL={}", ks.auth_url)), "{openrc}");

    // down.sh (run on drop) must leave none of the processes behind.
    let pids = env_pids(&env, &["MARIADB_PID", "KEYSTONE_PID"]);
    let state = env.state_dir().to_path_buf();
    drop(env);
    assert_gone(&pids);
    assert!(!state.exists(), "state dir {} left behind", state.display());
}

/// Whether a process still runs (a zombie waiting for its reaper does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

fn assert_gone(pids: &[u32]) {
    let still: Vec<u32> = pids.iter().copied().filter(|&p| running(p)).collect();
    assert!(still.is_empty(), "processes {still:?} still running after down.sh");
}

/// Polls `probe` every 250 ms until it returns `Some`, or panics after `timeout` naming `what`.
async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn get_json(http: &Client, url: &str) -> (StatusCode, Value) {
    let resp = http.get(url).send().await.unwrap();
    let status = resp.status();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// Runs a command inside the Neutron node's network namespace and returns its stdout.
fn in_node(node: &NeutronNode, argv: &[&str]) -> String {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={}", node.netns_path().display()))
        .args(argv)
        .env("OVS_RUNDIR", &node.ovs_rundir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{argv:?} in {}: {}", node.netns, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn vsctl(node: &NeutronNode, args: &[&str]) -> String {
    let db = format!("--db={}", node.ovsdb());
    let mut argv = vec!["ovs-vsctl", db.as_str(), "--timeout=30"];
    argv.extend_from_slice(args);
    in_node(node, &argv)
}

/// Keystone and Neutron together: Neutron is in the catalog; a port bound to the agent's host
/// gets `vif_type=ovs` and an address from each pod subnet, turns ACTIVE when plugged into
/// `br-int` the way the binder plugs it, and DOWN when unplugged; a port for a host without an
/// agent fails to bind.
#[tokio::test]
async fn neutron_binds_ports_to_the_agent_and_activates_them_when_plugged() {
    let t0 = Instant::now();
    let env = OpenStackEnv::start(&[Service::Keystone, Service::Neutron]).await.unwrap();
    eprintln!("keystone + neutron up in {:?}", t0.elapsed());
    let ks = env.keystone().unwrap();
    let neutron = env.neutron_url().unwrap().to_string();
    let node = env.neutron_node().unwrap();
    let net = env.pod_network().unwrap();
    assert_eq!(net.project_id, ks.project_id, "the pod network belongs to the kuryr project");
    let token = check_keystone(&ks).await;
    assert_eq!(catalog_url(&token, "network").as_deref(), Some(neutron.as_str()), "catalog: {token}");
    let http = client();

    // The agent reports itself alive on the node's host.
    let (status, agents) =
        get_json(&http, &format!("{neutron}/v2.0/agents?binary=neutron-openvswitch-agent&host={}", node.host)).await;
    assert_eq!(status, StatusCode::OK, "{agents}");
    assert_eq!(agents["agents"][0]["alive"], true, "agent: {agents}");

    let create = |host: String, name: &'static str| {
        let http = http.clone();
        let url = format!("{neutron}/v2.0/ports");
        let body = json!({ "port": {
            "name": name, "network_id": net.network_id, "project_id": net.project_id,
            "binding:host_id": host, "device_owner": "compute:kuryr", "device_id": format!("pod-{name}"),
        }});
        async move {
            let resp = http.post(url).json(&body).send().await.unwrap();
            assert_eq!(resp.status(), StatusCode::CREATED);
            resp.json::<Value>().await.unwrap()["port"].clone()
        }
    };

    let port = create(node.host.clone(), "bound").await;
    let id = port["id"].as_str().unwrap().to_string();
    let mac = port["mac_address"].as_str().unwrap().to_string();
    assert_eq!(port["binding:vif_type"], "ovs", "bound by the openvswitch mechanism driver: {port}");
    assert_eq!(port["binding:host_id"], node.host.as_str());
    assert_eq!(port["status"], "DOWN", "not plugged yet: {port}");
    let subnets: Vec<&str> =
        port["fixed_ips"].as_array().unwrap().iter().map(|f| f["subnet_id"].as_str().unwrap()).collect();
    assert!(subnets.contains(&net.subnet_v4_id.as_str()) && subnets.contains(&net.subnet_v6_id.as_str()), "{port}");

    // Plugged the way the binder's OVS driver does: a port on br-int carrying the Neutron port's
    // id and MAC in external_ids.
    let iface = format!("tp{}", &id[..8]);
    let started = Instant::now();
    vsctl(
        &node,
        &[
            "add-port",
            &node.integration_bridge,
            &iface,
            "--",
            "set",
            "Interface",
            &iface,
            "type=internal",
            &format!("external_ids:iface-id={id}"),
            &format!("external_ids:attached-mac={mac}"),
            "external_ids:iface-status=active",
        ],
    );
    let port_url = format!("{neutron}/v2.0/ports/{id}");
    wait_for("the plugged port to turn ACTIVE", Duration::from_secs(90), || {
        let (http, url) = (http.clone(), port_url.clone());
        async move {
            let (_, body) = get_json(&http, &url).await;
            (body["port"]["status"] == "ACTIVE").then_some(())
        }
    })
    .await;
    eprintln!("port ACTIVE {:?} after plugging", started.elapsed());
    // The agent tagged the port with the network's local VLAN: it really programmed br-int.
    let tag = vsctl(&node, &["get", "Port", &iface, "tag"]);
    assert!(tag.trim().parse::<u16>().is_ok(), "no local VLAN tag on {iface}: {tag}");

    vsctl(&node, &["del-port", &node.integration_bridge, &iface]);
    wait_for("the unplugged port to turn DOWN", Duration::from_secs(90), || {
        let (http, url) = (http.clone(), port_url.clone());
        async move {
            let (_, body) = get_json(&http, &url).await;
            (body["port"]["status"] == "DOWN").then_some(())
        }
    })
    .await;

    // No agent on that host: the binding fails.
    let orphan = create("no-such-node".to_string(), "unbound").await;
    assert_eq!(orphan["binding:vif_type"], "binding_failed", "{orphan}");

    for port in [&id, orphan["id"].as_str().unwrap()] {
        let resp = http.delete(format!("{neutron}/v2.0/ports/{port}")).send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::NO_CONTENT);
        assert_eq!(get_json(&http, &format!("{neutron}/v2.0/ports/{port}")).await.0, StatusCode::NOT_FOUND);
    }

    let pids = env_pids(&env, &["NEUTRON_API_PID", "NEUTRON_RPC_PID", "NEUTRON_AGENT_PID", "OVS_VSWITCHD_PID"]);
    let netns = node.netns_path();
    drop(env);
    assert_gone(&pids);
    assert!(!netns.exists(), "network namespace {} left behind", netns.display());
}

/// Octavia alone: a fully populated load balancer reaches ACTIVE through the real worker with its
/// listener, pool and member, and a cascade delete removes it.
#[tokio::test]
async fn octavia_takes_a_load_balancer_to_active_and_cascade_deletes_it() {
    let t0 = Instant::now();
    let env = OpenStackEnv::start(&[Service::Octavia]).await.unwrap();
    eprintln!("octavia up in {:?}", t0.elapsed());
    assert!(env.keystone().is_none() && env.neutron_url().is_none());
    let octavia = env.octavia_url().unwrap().to_string();
    let http = client();
    let project = "0f7a6c7e5e0b4f6f9d1b2a3c4d5e6f70";
    let lbs = format!("{octavia}/v2/lbaas/loadbalancers");

    // noauth still wants a project.
    let resp = http.post(&lbs).json(&json!({"loadbalancer": {"vip_subnet_id": "x"}})).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);

    let body = json!({ "loadbalancer": {
        "name": "svc-demo",
        // Any id will do with the no-op network driver.
        "vip_subnet_id": "3c9e1b52-8a1f-4f0e-9a59-0c3b6c7d2e11",
        "listeners": [{
            "name": "tcp-80", "protocol": "TCP", "protocol_port": 80,
            "default_pool": {
                "name": "tcp-80-pool", "protocol": "TCP", "lb_algorithm": "ROUND_ROBIN",
                "members": [{ "address": "10.100.0.10", "protocol_port": 8080 }]
            }
        }]
    }});
    let resp = http.post(&lbs).header("X-Project-Id", project).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    let lb: Value = resp.json().await.unwrap();
    let id = lb["loadbalancer"]["id"].as_str().unwrap().to_string();
    assert_eq!(lb["loadbalancer"]["provisioning_status"], "PENDING_CREATE", "{lb}");
    assert_eq!(lb["loadbalancer"]["project_id"], project);

    let lb_url = format!("{lbs}/{id}");
    let started = Instant::now();
    let active = wait_for("the load balancer to turn ACTIVE", Duration::from_secs(120), || {
        let (http, url) = (http.clone(), lb_url.clone());
        async move {
            let (_, body) = get_json(&http, &url).await;
            let status = &body["loadbalancer"]["provisioning_status"];
            assert_ne!(status, "ERROR", "{body}");
            (status == "ACTIVE").then_some(body)
        }
    })
    .await;
    eprintln!("load balancer ACTIVE {:?} after create", started.elapsed());
    assert!(!active["loadbalancer"]["vip_address"].as_str().unwrap_or_default().is_empty(), "{active}");

    let (_, listeners) = get_json(&http, &format!("{octavia}/v2/lbaas/listeners?loadbalancer_id={id}")).await;
    assert_eq!(listeners["listeners"][0]["protocol_port"], 80, "{listeners}");
    let pool_id = listeners["listeners"][0]["default_pool_id"].as_str().unwrap().to_string();
    let (_, members) = get_json(&http, &format!("{octavia}/v2/lbaas/pools/{pool_id}/members")).await;
    assert_eq!(members["members"][0]["address"], "10.100.0.10", "{members}");
    assert_eq!(members["members"][0]["provisioning_status"], "ACTIVE", "{members}");

    // A load balancer with children is only deleted with cascade.
    let resp = http.delete(&lb_url).header("X-Project-Id", project).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let resp = http.delete(format!("{lb_url}?cascade=true")).header("X-Project-Id", project).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::NO_CONTENT);
    wait_for("the load balancer to be gone", Duration::from_secs(120), || {
        let (http, url) = (http.clone(), lb_url.clone());
        async move {
            let (status, body) = get_json(&http, &url).await;
            (status == StatusCode::NOT_FOUND || body["loadbalancer"]["provisioning_status"] == "DELETED").then_some(())
        }
    })
    .await;

    // A fault test's tools: the API stopped answers nothing; started again, it serves the same
    // state on the same port.
    let names = env.process_names();
    for expected in ["mariadb", "rabbitmq", "octavia-api", "octavia-worker"] {
        assert!(names.iter().any(|n| n == expected), "{expected} not in {names:?}");
    }
    env.stop_process("octavia-api").await.unwrap();
    assert!(http.get(&lbs).header("X-Project-Id", project).send().await.is_err(), "the stopped API still answers");
    let pid = env.start_process("octavia-api").await.unwrap();
    assert_eq!(env.pid("octavia-api"), Some(pid));
    let listed = wait_for("the API started again to answer", Duration::from_secs(120), || {
        let (http, url) = (http.clone(), lbs.clone());
        async move {
            let resp = http.get(url).header("X-Project-Id", project).send().await.ok()?;
            (resp.status() == StatusCode::OK).then_some(resp.json::<Value>().await.ok()?)
        }
    })
    .await;
    assert_eq!(listed["loadbalancers"].as_array().map(Vec::len), Some(0), "{listed}");

    let pids = env_pids(&env, &["OCTAVIA_WORKER_PID", "RABBITMQ_PID", "MARIADB_PID"]);
    let pids = [pids, vec![pid]].concat();
    drop(env);
    assert_gone(&pids);
}

fn env_pids(env: &OpenStackEnv, keys: &[&str]) -> Vec<u32> {
    keys.iter().map(|k| env.env_value(k).unwrap_or_else(|| panic!("{k} missing")).parse().unwrap()).collect()
}
