//! The cloud as written (a `clouds.yaml` entry, or the `OS_*` variables), before validation:
//! loose scalars (`"true"`, `3`, `"3"`) accepted where the OpenStack tools accept them, then
//! checked field by field into a [`CloudConfig`], each error naming the field and the value.

use std::collections::{BTreeMap, HashMap};

use reqwest::Url;
use serde::Deserialize;

use super::*;

/// A `clouds.yaml` entry (or the environment) before validation. Values are strings, booleans or
/// numbers as users write them; validation turns them into [`CloudConfig`].
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawCloud {
    auth_type: Option<String>,
    auth: RawAuth,
    region_name: Option<String>,
    interface: Option<String>,
    identity_api_version: Option<Scalar>,
    cacert: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    verify: Option<Scalar>,
    insecure: Option<Scalar>,
    network_endpoint_override: Option<String>,
    load_balancer_endpoint_override: Option<String>,
    identity_endpoint_override: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawAuth {
    auth_url: Option<String>,
    username: Option<String>,
    user_id: Option<String>,
    password: Option<String>,
    project_name: Option<String>,
    project_id: Option<String>,
    tenant_name: Option<String>,
    tenant_id: Option<String>,
    user_domain_name: Option<String>,
    user_domain_id: Option<String>,
    project_domain_name: Option<String>,
    project_domain_id: Option<String>,
    domain_name: Option<String>,
    domain_id: Option<String>,
    application_credential_id: Option<String>,
    application_credential_name: Option<String>,
    application_credential_secret: Option<String>,
}

/// A YAML scalar that users write as a string, number or boolean (`verify: "false"`, `3`, `"3"`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Scalar {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

impl Scalar {
    fn text(&self) -> String {
        match self {
            Self::Bool(b) => b.to_string(),
            Self::Int(i) => i.to_string(),
            Self::Float(f) => f.to_string(),
            Self::Str(s) => s.trim().to_string(),
        }
    }

    fn as_bool(&self) -> Option<bool> {
        match self {
            Self::Bool(b) => Some(*b),
            Self::Int(i) => Some(*i != 0),
            Self::Float(_) => None,
            Self::Str(s) => parse_bool(s),
        }
    }
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

impl RawCloud {
    pub(super) fn from_env(env: &HashMap<String, String>) -> Self {
        let get = |k: &str| env.get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        Self {
            auth_type: get("OS_AUTH_TYPE"),
            auth: RawAuth {
                auth_url: get("OS_AUTH_URL"),
                username: get("OS_USERNAME"),
                user_id: get("OS_USER_ID"),
                password: get("OS_PASSWORD"),
                project_name: get("OS_PROJECT_NAME"),
                project_id: get("OS_PROJECT_ID"),
                tenant_name: get("OS_TENANT_NAME"),
                tenant_id: get("OS_TENANT_ID"),
                user_domain_name: get("OS_USER_DOMAIN_NAME"),
                user_domain_id: get("OS_USER_DOMAIN_ID"),
                project_domain_name: get("OS_PROJECT_DOMAIN_NAME"),
                project_domain_id: get("OS_PROJECT_DOMAIN_ID"),
                domain_name: get("OS_DOMAIN_NAME"),
                domain_id: get("OS_DOMAIN_ID"),
                application_credential_id: get("OS_APPLICATION_CREDENTIAL_ID"),
                application_credential_name: get("OS_APPLICATION_CREDENTIAL_NAME"),
                application_credential_secret: get("OS_APPLICATION_CREDENTIAL_SECRET"),
            },
            region_name: get("OS_REGION_NAME"),
            interface: get("OS_INTERFACE").or_else(|| get("OS_ENDPOINT_TYPE")),
            identity_api_version: get("OS_IDENTITY_API_VERSION").map(Scalar::Str),
            cacert: get("OS_CACERT"),
            cert: get("OS_CERT"),
            key: get("OS_KEY"),
            verify: None,
            insecure: get("OS_INSECURE").map(Scalar::Str),
            network_endpoint_override: get("OS_NETWORK_ENDPOINT_OVERRIDE"),
            load_balancer_endpoint_override: get("OS_LOAD_BALANCER_ENDPOINT_OVERRIDE"),
            identity_endpoint_override: None,
        }
    }

    pub(super) fn validate(self, origin: String) -> Result<CloudConfig, ConfigError> {
        let o = &origin;
        let invalid = |field: &'static str, value: &str, reason: &str| ConfigError::Invalid {
            origin: o.clone(),
            field,
            value: value.to_string(),
            reason: reason.to_string(),
        };
        let missing = |field: &'static str, hint: &'static str| ConfigError::Missing { origin: o.clone(), field, hint };

        if let Some(v) = &self.identity_api_version {
            let t = v.text();
            if t != "3" && t != "3.0" {
                return Err(invalid("identity_api_version", &t, "only Keystone v3 is supported"));
            }
        }
        let interface = match &self.interface {
            None => Interface::default(),
            Some(s) => {
                Interface::parse(s).ok_or_else(|| invalid("interface", s, "expected public, internal or admin"))?
            }
        };
        let region_name = self.region_name.clone().filter(|r| !r.trim().is_empty());

        let mut insecure = false;
        if let Some(v) = &self.verify {
            insecure = !v.as_bool().ok_or_else(|| invalid("verify", &v.text(), "expected true or false"))?;
        }
        if let Some(v) = &self.insecure {
            insecure |= v.as_bool().ok_or_else(|| invalid("insecure", &v.text(), "expected true or false"))?;
        }
        let client_cert = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => Some((PathBuf::from(c), PathBuf::from(k))),
            (Some(_), None) => return Err(missing("key", "a client certificate (cert) needs its private key")),
            (None, Some(_)) => return Err(missing("cert", "a client key (key) needs its certificate")),
            (None, None) => None,
        };
        let tls = TlsConfig { cacert: self.cacert.as_deref().map(PathBuf::from), client_cert, insecure };

        let mut endpoint_overrides = BTreeMap::new();
        for (service, field, value) in [
            (ServiceType::Network, "network_endpoint_override", &self.network_endpoint_override),
            (ServiceType::LoadBalancer, "load_balancer_endpoint_override", &self.load_balancer_endpoint_override),
            (ServiceType::Identity, "identity_endpoint_override", &self.identity_endpoint_override),
        ] {
            if let Some(v) = value.as_deref().filter(|v| !v.trim().is_empty()) {
                endpoint_overrides.insert(service, parse_http_url(v).map_err(|r| invalid(field, v, &r))?);
            }
        }

        let a = self.auth;
        let auth_type = self.auth_type.as_deref().map(|t| t.trim().to_ascii_lowercase());
        let auth_type = match auth_type.as_deref() {
            Some("none" | "noauth" | "no_auth") => "none",
            Some("password" | "v3password") => "password",
            Some("v3applicationcredential" | "applicationcredential" | "application_credential") => "appcred",
            Some(other) => {
                return Err(invalid(
                    "auth_type",
                    other,
                    "supported: password (v3password), v3applicationcredential, none",
                ));
            }
            // Like the OpenStack tools: a secret of an application credential selects that method.
            None if a.application_credential_secret.is_some() || a.application_credential_id.is_some() => "appcred",
            None => "password",
        };

        let auth = if auth_type == "none" {
            if !endpoint_overrides.contains_key(&ServiceType::Network)
                && !endpoint_overrides.contains_key(&ServiceType::LoadBalancer)
            {
                return Err(missing(
                    "network_endpoint_override",
                    "auth_type none needs the service URLs: network_endpoint_override and/or \
                     load_balancer_endpoint_override (OS_NETWORK_ENDPOINT_OVERRIDE, OS_LOAD_BALANCER_ENDPOINT_OVERRIDE)",
                ));
            }
            AuthConfig::NoAuth { project_id: a.project_id.or(a.tenant_id) }
        } else {
            let url =
                a.auth_url.as_deref().ok_or_else(|| missing("auth.auth_url", "the Keystone URL (OS_AUTH_URL)"))?;
            let auth_url = keystone_v3_url(url).map_err(|r| invalid("auth.auth_url", url, &r))?;
            let default_domain =
                a.domain_id.clone().map(DomainRef::Id).or_else(|| a.domain_name.clone().map(DomainRef::Name));
            let user_domain = a
                .user_domain_id
                .clone()
                .map(DomainRef::Id)
                .or_else(|| a.user_domain_name.clone().map(DomainRef::Name))
                .or_else(|| default_domain.clone());
            let user = match (&a.user_id, &a.username) {
                (Some(id), _) => Some(UserRef::Id(id.clone())),
                (None, Some(name)) => Some(UserRef::Name {
                    name: name.clone(),
                    domain: user_domain.ok_or_else(|| {
                        missing(
                            "auth.user_domain_name",
                            "a user given by name needs its domain (user_domain_name or user_domain_id, \
                             OS_USER_DOMAIN_NAME)",
                        )
                    })?,
                }),
                (None, None) => None,
            };
            if auth_type == "appcred" {
                let secret = a.application_credential_secret.ok_or_else(|| {
                    missing("auth.application_credential_secret", "the secret (OS_APPLICATION_CREDENTIAL_SECRET)")
                })?;
                let credential = match (a.application_credential_id, a.application_credential_name) {
                    (Some(id), _) => AppCredential::Id { id, secret },
                    (None, Some(name)) => AppCredential::Name {
                        name,
                        secret,
                        user: user.ok_or_else(|| {
                            missing(
                                "auth.username",
                                "an application credential given by name needs its owner (username and \
                                 user_domain_name, or user_id)",
                            )
                        })?,
                    },
                    (None, None) => {
                        return Err(missing(
                            "auth.application_credential_id",
                            "the credential's id or name (OS_APPLICATION_CREDENTIAL_ID / _NAME)",
                        ));
                    }
                };
                AuthConfig::ApplicationCredential { auth_url, credential }
            } else {
                let user = user.ok_or_else(|| missing("auth.username", "the user (OS_USERNAME or OS_USER_ID)"))?;
                let password = a.password.ok_or_else(|| missing("auth.password", "the password (OS_PASSWORD)"))?;
                let project_domain = a
                    .project_domain_id
                    .clone()
                    .map(DomainRef::Id)
                    .or_else(|| a.project_domain_name.clone().map(DomainRef::Name))
                    .or(default_domain);
                let project = match (a.project_id.or(a.tenant_id), a.project_name.or(a.tenant_name)) {
                    (Some(id), _) => ProjectScope::Id(id),
                    (None, Some(name)) => ProjectScope::Name {
                        name,
                        domain: project_domain.ok_or_else(|| {
                            missing(
                                "auth.project_domain_name",
                                "a project given by name needs its domain (project_domain_name or \
                                 project_domain_id, OS_PROJECT_DOMAIN_NAME)",
                            )
                        })?,
                    },
                    (None, None) => {
                        return Err(missing(
                            "auth.project_name",
                            "a project to scope the token to (project_name or project_id, OS_PROJECT_NAME): \
                             unscoped tokens carry no service catalog",
                        ));
                    }
                };
                AuthConfig::Password { auth_url, user, password, project }
            }
        };
        Ok(CloudConfig { origin, auth, region_name, interface, tls, endpoint_overrides })
    }
}

fn parse_http_url(s: &str) -> Result<Url, String> {
    let url = Url::parse(s.trim()).map_err(|e| e.to_string())?;
    match url.scheme() {
        "http" | "https" if url.host().is_some() => Ok(url),
        "http" | "https" => Err("no host".into()),
        other => Err(format!("scheme {other:?} is not http or https")),
    }
}

/// The Keystone v3 base URL for an `auth_url` as users write it: `https://k/identity`,
/// `https://k:5000/v3`, `https://k:5000/v3/`.
fn keystone_v3_url(s: &str) -> Result<Url, String> {
    let url = parse_http_url(s)?;
    let path = url.path().trim_end_matches('/').to_string();
    if path.ends_with("/v2.0") {
        return Err("Keystone v2.0 is not supported; use the v3 URL".into());
    }
    let path = if path.ends_with("/v3") { path } else { format!("{path}/v3") };
    let mut url = url;
    url.set_path(&path);
    Ok(url)
}
