//! The OpenStack test environment itself, proven with plain HTTP: a real Keystone issues tokens
//! for password and application-credential auth and refuses a wrong secret; a real Neutron binds a
//! port to the agent's host and turns it ACTIVE once it is plugged into `br-int`; a real Octavia
//! takes a load balancer to ACTIVE and cascade-deletes it. Every OpenStack backend test builds on
//! these guarantees.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use kuryr_tests::openstack::{KeystoneCredentials, OpenStackEnv, Service};
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
    let pids: Vec<u32> = ["MARIADB_PID", "KEYSTONE_PID"]
        .iter()
        .map(|k| env.env_value(k).unwrap_or_else(|| panic!("{k} missing")).parse().unwrap())
        .collect();
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
