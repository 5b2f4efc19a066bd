use super::*;

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

const CLOUDS: &str = r#"
clouds:
  prod:
    auth:
      auth_url: https://keystone.example:5000
      username: kuryr
      project_name: k8s
      user_domain_name: Default
      project_domain_id: default
    region_name: RegionOne
    interface: internal
    identity_api_version: 3
    cacert: /etc/ssl/cloud-ca.pem
  appcred:
    auth_type: v3applicationcredential
    auth:
      auth_url: https://keystone.example/identity/v3/
      application_credential_id: ac-1
      application_credential_secret: s3cr3t
    verify: false
  direct:
    auth_type: none
    auth:
      project_id: 0123abcd
    network_endpoint_override: http://127.0.0.1:9696
    load_balancer_endpoint_override: http://127.0.0.1:9876
"#;

const SECURE: &str = r#"
clouds:
  prod:
    auth:
      password: from-secure-yaml
"#;

fn doc(s: &str) -> Value {
    serde_saphyr::from_str(s).unwrap()
}

#[test]
fn clouds_yaml_merged_with_secure_yaml() {
    let c = CloudConfig::from_clouds_yaml("prod", Path::new("clouds.yaml"), &doc(CLOUDS), Some(&doc(SECURE))).unwrap();
    assert_eq!(c.origin, "cloud \"prod\" (clouds.yaml)");
    let AuthConfig::Password { auth_url, user, password, project } = &c.auth else { panic!("{c:?}") };
    assert_eq!(auth_url.as_str(), "https://keystone.example:5000/v3");
    assert_eq!(user, &UserRef::Name { name: "kuryr".into(), domain: DomainRef::Name("Default".into()) });
    assert_eq!(password, "from-secure-yaml");
    assert_eq!(project, &ProjectScope::Name { name: "k8s".into(), domain: DomainRef::Id("default".into()) });
    assert_eq!(c.region_name.as_deref(), Some("RegionOne"));
    assert_eq!(c.interface, Interface::Internal);
    assert_eq!(c.tls.cacert.as_deref(), Some(Path::new("/etc/ssl/cloud-ca.pem")));
    assert!(!c.tls.insecure);
    // The secret never shows in debug output.
    assert!(!format!("{c:?}").contains("from-secure-yaml"));
}

#[test]
fn application_credential_and_direct_endpoints() {
    let c = CloudConfig::from_clouds_yaml("appcred", Path::new("c.yaml"), &doc(CLOUDS), None).unwrap();
    let AuthConfig::ApplicationCredential { auth_url, credential } = &c.auth else { panic!("{c:?}") };
    assert_eq!(auth_url.as_str(), "https://keystone.example/identity/v3");
    assert_eq!(credential, &AppCredential::Id { id: "ac-1".into(), secret: "s3cr3t".into() });
    assert!(c.tls.insecure);
    assert!(!format!("{c:?}").contains("s3cr3t"));

    let c = CloudConfig::from_clouds_yaml("direct", Path::new("c.yaml"), &doc(CLOUDS), None).unwrap();
    assert_eq!(c.auth, AuthConfig::NoAuth { project_id: Some("0123abcd".into()) });
    assert_eq!(c.endpoint_overrides[&ServiceType::Network].as_str(), "http://127.0.0.1:9696/");
    assert_eq!(c.endpoint_overrides[&ServiceType::LoadBalancer].as_str(), "http://127.0.0.1:9876/");
}

#[test]
fn unknown_cloud_lists_the_known_ones() {
    let e = CloudConfig::from_clouds_yaml("nope", Path::new("/x/clouds.yaml"), &doc(CLOUDS), None).unwrap_err();
    assert_eq!(e.to_string(), "cloud \"nope\" not found in /x/clouds.yaml (clouds defined: appcred, direct, prod)");
}

#[test]
fn environment_variables() {
    let c = CloudConfig::from_env(&env(&[
        ("OS_AUTH_URL", "http://10.0.0.5/identity"),
        ("OS_USERNAME", "admin"),
        ("OS_PASSWORD", "pw"),
        ("OS_PROJECT_ID", "p-1"),
        ("OS_USER_DOMAIN_ID", "default"),
        ("OS_REGION_NAME", "RegionTwo"),
        ("OS_INTERFACE", "publicURL"),
        ("OS_INSECURE", "true"),
        ("OS_CACERT", "/ca.pem"),
    ]))
    .unwrap();
    assert_eq!(c.origin, "OS_* environment");
    assert_eq!(
        c.auth,
        AuthConfig::Password {
            auth_url: Url::parse("http://10.0.0.5/identity/v3").unwrap(),
            user: UserRef::Name { name: "admin".into(), domain: DomainRef::Id("default".into()) },
            password: "pw".into(),
            project: ProjectScope::Id("p-1".into()),
        }
    );
    assert_eq!(c.region_name.as_deref(), Some("RegionTwo"));
    assert_eq!(c.interface, Interface::Public);
    assert!(c.tls.insecure);

    // OS_DOMAIN_NAME is the default for both user and project domains; an application
    // credential by name is selected by its secret alone.
    let c = CloudConfig::from_env(&env(&[
        ("OS_AUTH_URL", "https://k:5000/v3"),
        ("OS_USERNAME", "kuryr"),
        ("OS_DOMAIN_NAME", "Default"),
        ("OS_APPLICATION_CREDENTIAL_NAME", "kuryr-ac"),
        ("OS_APPLICATION_CREDENTIAL_SECRET", "sec"),
    ]))
    .unwrap();
    assert_eq!(
        c.auth,
        AuthConfig::ApplicationCredential {
            auth_url: Url::parse("https://k:5000/v3").unwrap(),
            credential: AppCredential::Name {
                name: "kuryr-ac".into(),
                user: UserRef::Name { name: "kuryr".into(), domain: DomainRef::Name("Default".into()) },
                secret: "sec".into(),
            },
        }
    );

    let c = CloudConfig::from_env(&env(&[
        ("OS_AUTH_TYPE", "none"),
        ("OS_PROJECT_ID", "p"),
        ("OS_NETWORK_ENDPOINT_OVERRIDE", "http://127.0.0.1:9696"),
    ]))
    .unwrap();
    assert_eq!(c.auth, AuthConfig::NoAuth { project_id: Some("p".into()) });
    assert!(!c.endpoint_overrides.contains_key(&ServiceType::LoadBalancer));
}

#[test]
fn errors_name_the_field() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("OS_AUTH_TYPE", "password")], "OS_* environment: missing auth.auth_url: the Keystone URL (OS_AUTH_URL)"),
        (&[("OS_AUTH_URL", "http://k/v3"), ("OS_PASSWORD", "x"), ("OS_PROJECT_ID", "p")], "missing auth.username"),
        (
            &[("OS_AUTH_URL", "http://k/v3"), ("OS_USERNAME", "u"), ("OS_PROJECT_ID", "p")],
            "missing auth.user_domain_name",
        ),
        (
            &[("OS_AUTH_URL", "http://k/v3"), ("OS_USER_ID", "u"), ("OS_PROJECT_ID", "p")],
            "missing auth.password: the password (OS_PASSWORD)",
        ),
        (&[("OS_AUTH_URL", "http://k/v3"), ("OS_USER_ID", "u"), ("OS_PASSWORD", "x")], "missing auth.project_name"),
        (
            &[("OS_AUTH_URL", "http://k/v3"), ("OS_USER_ID", "u"), ("OS_PASSWORD", "x"), ("OS_PROJECT_NAME", "p")],
            "missing auth.project_domain_name",
        ),
        (
            &[("OS_AUTH_URL", "keystone:5000")],
            "invalid auth.auth_url \"keystone:5000\": scheme \"keystone\" is not http or https",
        ),
        (
            &[("OS_AUTH_URL", "http://k/v2.0")],
            "invalid auth.auth_url \"http://k/v2.0\": Keystone v2.0 is not supported",
        ),
        (&[("OS_AUTH_URL", "http://k"), ("OS_INTERFACE", "private")], "invalid interface \"private\""),
        (&[("OS_AUTH_URL", "http://k"), ("OS_IDENTITY_API_VERSION", "2")], "invalid identity_api_version \"2\""),
        (&[("OS_AUTH_URL", "http://k"), ("OS_INSECURE", "maybe")], "invalid insecure \"maybe\""),
        (&[("OS_AUTH_URL", "http://k"), ("OS_CERT", "/c.pem")], "missing key"),
        (&[("OS_AUTH_TYPE", "token")], "invalid auth_type \"token\""),
        (&[("OS_AUTH_TYPE", "none")], "missing network_endpoint_override"),
        (
            &[("OS_AUTH_TYPE", "none"), ("OS_NETWORK_ENDPOINT_OVERRIDE", "ftp://x")],
            "invalid network_endpoint_override \"ftp://x\"",
        ),
        (
            &[("OS_AUTH_URL", "http://k"), ("OS_APPLICATION_CREDENTIAL_ID", "ac")],
            "missing auth.application_credential_secret",
        ),
        (
            &[
                ("OS_AUTH_URL", "http://k"),
                ("OS_APPLICATION_CREDENTIAL_NAME", "ac"),
                ("OS_APPLICATION_CREDENTIAL_SECRET", "s"),
            ],
            "missing auth.username: an application credential given by name needs its owner",
        ),
    ];
    for (vars, want) in cases {
        let e = CloudConfig::from_env(&env(vars)).unwrap_err().to_string();
        assert!(e.contains(want), "{vars:?}: got {e:?}, want {want:?}");
    }
}

#[test]
fn search_path_and_cloud_selection() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    let cwd = dir.path().join("work");
    std::fs::create_dir_all(home.join(".config/openstack")).unwrap();
    std::fs::create_dir_all(&cwd).unwrap();
    std::fs::write(home.join(".config/openstack/clouds.yaml"), CLOUDS).unwrap();
    std::fs::write(home.join(".config/openstack/secure.yaml"), SECURE).unwrap();
    let source = |vars: &[(&str, &str)], cloud: Option<&str>| {
        let mut e = env(vars);
        e.insert("HOME".into(), home.display().to_string());
        ConfigSource {
            cloud: cloud.map(str::to_string),
            env: e,
            cwd: Some(cwd.clone()),
            clouds_files: None,
            secure_files: None,
        }
    };

    let s = source(&[], None);
    assert_eq!(
        s.clouds_search_path(),
        vec![
            cwd.join("clouds.yaml"),
            home.join(".config/openstack/clouds.yaml"),
            PathBuf::from("/etc/openstack/clouds.yaml")
        ]
    );
    // OS_CLOUD picks an entry; the flag wins over OS_CLOUD.
    let c = CloudConfig::load(&source(&[("OS_CLOUD", "prod")], None)).unwrap();
    assert!(matches!(&c.auth, AuthConfig::Password { password, .. } if password == "from-secure-yaml"));
    let c = CloudConfig::load(&source(&[("OS_CLOUD", "prod")], Some("direct"))).unwrap();
    assert!(matches!(c.auth, AuthConfig::NoAuth { .. }));
    // Without a name, OS_* variables describe the cloud; with neither, several clouds are ambiguous.
    let c = CloudConfig::load(&source(
        &[("OS_AUTH_TYPE", "none"), ("OS_LOAD_BALANCER_ENDPOINT_OVERRIDE", "http://o")],
        None,
    ))
    .unwrap();
    assert_eq!(c.origin, "OS_* environment");
    let e = CloudConfig::load(&source(&[], None)).unwrap_err();
    assert!(
        e.to_string().contains("no OpenStack cloud configured") && e.to_string().contains("appcred, direct, prod"),
        "{e}"
    );

    // ./clouds.yaml comes before the home one; OS_CLIENT_CONFIG_FILE before both.
    std::fs::write(
        cwd.join("clouds.yaml"),
        "clouds:\n  only:\n    auth_type: none\n    network_endpoint_override: http://n\n",
    )
    .unwrap();
    let c = CloudConfig::load(&source(&[], None)).unwrap();
    assert!(c.origin.starts_with("cloud \"only\""), "{}", c.origin);
    let custom = dir.path().join("custom.yaml");
    std::fs::write(&custom, "clouds:\n  mine: {auth_type: none, load_balancer_endpoint_override: 'http://o'}\n")
        .unwrap();
    let e =
        CloudConfig::load(&source(&[("OS_CLIENT_CONFIG_FILE", custom.to_str().unwrap()), ("OS_CLOUD", "prod")], None))
            .unwrap_err();
    assert!(e.to_string().starts_with("cloud \"prod\" not found in"), "{e}");

    std::fs::write(&custom, "clouds: [").unwrap();
    let e = CloudConfig::load(&source(&[("OS_CLIENT_CONFIG_FILE", custom.to_str().unwrap()), ("OS_CLOUD", "x")], None))
        .unwrap_err();
    assert!(matches!(e, ConfigError::Parse { .. }), "{e}");

    let none = ConfigSource {
        cloud: Some("x".into()),
        clouds_files: Some(vec![dir.path().join("missing.yaml")]),
        ..Default::default()
    };
    let e = CloudConfig::load(&none).unwrap_err();
    assert!(e.to_string().starts_with("cloud \"x\" requested but no clouds.yaml found"), "{e}");
}

#[test]
fn yaml_scalars_as_users_write_them() {
    let y = doc(
        "clouds:\n  c:\n    auth_type: none\n    network_endpoint_override: http://n\n    verify: 'no'\n    identity_api_version: '3'\n",
    );
    let c = CloudConfig::from_clouds_yaml("c", Path::new("c"), &y, None).unwrap();
    assert!(c.tls.insecure);
    let y =
        doc("clouds:\n  c:\n    auth_type: none\n    network_endpoint_override: http://n\n    interface: [public]\n");
    let e = CloudConfig::from_clouds_yaml("c", Path::new("c"), &y, None).unwrap_err();
    assert!(e.to_string().contains("invalid cloud"), "{e}");
}
