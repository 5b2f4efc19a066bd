//! kuryr-openstack against the real services: Keystone password and application-credential
//! authentication (from clouds.yaml and from OS_* variables), one token shared by many calls and
//! concurrent callers, a revoked token replaced after one 401, and wrong secrets reported as
//! authentication errors.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kuryr_openstack::{Client, ClientOptions, CloudConfig, ConfigSource, Error, Metrics};
use kuryr_tests::openstack::{OpenStackEnv, Service};
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
