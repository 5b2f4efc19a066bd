//! Configuration the way OpenStack users already write it: a cloud from `clouds.yaml` (merged with
//! `secure.yaml`), or the `OS_*` environment variables, plus a direct-endpoint mode (`auth_type:
//! none`) for deployments that run Neutron and Octavia without Keystone.
//!
//! The environment is passed in as a map ([`ConfigSource::env`]) rather than read from the
//! process: callers hand over `std::env::vars()`, tests hand over exactly what they mean.
//!
//! Which cloud: the explicit name ([`ConfigSource::cloud`], a command-line flag) or else `OS_CLOUD`
//! picks an entry of `clouds.yaml`. Without a name, the `OS_*` variables describe the cloud when
//! any of them is set; otherwise a `clouds.yaml` holding exactly one cloud is used. A named cloud
//! is taken from the file alone, as the OpenStack command-line tools do.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use reqwest::Url;
use serde::Deserialize;
use serde_json::Value;

use crate::service::ServiceType;

/// Where configuration comes from.
#[derive(Clone, Debug, Default)]
pub struct ConfigSource {
    /// The cloud to use, from a command-line flag; overrides `OS_CLOUD`.
    pub cloud: Option<String>,
    /// The environment (`OS_*` variables, `HOME`).
    pub env: HashMap<String, String>,
    /// The working directory searched for `./clouds.yaml`; `None` skips that location.
    pub cwd: Option<PathBuf>,
    /// Replaces the standard search path for `clouds.yaml` when set (tests; packaging).
    pub clouds_files: Option<Vec<PathBuf>>,
    /// Replaces the standard search path for `secure.yaml` when set.
    pub secure_files: Option<Vec<PathBuf>>,
}

impl ConfigSource {
    /// The process environment and working directory.
    pub fn from_process(cloud: Option<String>) -> Self {
        Self {
            cloud,
            env: std::env::vars().collect(),
            cwd: std::env::current_dir().ok(),
            clouds_files: None,
            secure_files: None,
        }
    }

    fn var(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(|v| v.trim()).filter(|v| !v.is_empty())
    }

    /// The `clouds.yaml` locations in the order they are tried: `OS_CLIENT_CONFIG_FILE`,
    /// `./clouds.yaml`, `~/.config/openstack/clouds.yaml`, `/etc/openstack/clouds.yaml`.
    pub fn clouds_search_path(&self) -> Vec<PathBuf> {
        match &self.clouds_files {
            Some(files) => files.clone(),
            None => self.search_path("OS_CLIENT_CONFIG_FILE", "clouds.yaml"),
        }
    }

    /// The `secure.yaml` locations, tried like [`Self::clouds_search_path`]
    /// (`OS_CLIENT_SECURE_FILE` first).
    pub fn secure_search_path(&self) -> Vec<PathBuf> {
        match &self.secure_files {
            Some(files) => files.clone(),
            None => self.search_path("OS_CLIENT_SECURE_FILE", "secure.yaml"),
        }
    }

    fn search_path(&self, var: &str, file: &str) -> Vec<PathBuf> {
        let mut path = Vec::new();
        if let Some(f) = self.var(var) {
            path.push(PathBuf::from(f));
        }
        if let Some(cwd) = &self.cwd {
            path.push(cwd.join(file));
        }
        if let Some(home) = self.var("HOME") {
            path.push(Path::new(home).join(".config/openstack").join(file));
        }
        path.push(Path::new("/etc/openstack").join(file));
        path
    }
}

/// A configuration that cannot be used, naming the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{origin}: missing {field}: {hint}")]
    Missing { origin: String, field: &'static str, hint: &'static str },
    #[error("{origin}: invalid {field} {value:?}: {reason}")]
    Invalid { origin: String, field: &'static str, value: String, reason: String },
    #[error("cloud {cloud:?} not found in {}{}", file.display(), list_clouds(known))]
    UnknownCloud { cloud: String, file: PathBuf, known: Vec<String> },
    #[error("cloud {cloud:?} requested but no clouds.yaml found (searched {})", list_paths(searched))]
    NoCloudsFile { cloud: String, searched: Vec<PathBuf> },
    #[error(
        "no OpenStack cloud configured: set OS_CLOUD (or the cloud flag) to an entry of clouds.yaml, or OS_AUTH_URL \
         and the other OS_* variables{}",
        list_clouds(known)
    )]
    NothingConfigured { known: Vec<String> },
    #[error("reading {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("parsing {}: {source}", path.display())]
    Parse { path: PathBuf, source: Box<serde_saphyr::Error> },
}

fn list_clouds(known: &[String]) -> String {
    if known.is_empty() { String::new() } else { format!(" (clouds defined: {})", known.join(", ")) }
}

fn list_paths(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// Which catalog interface endpoints are taken from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Interface {
    #[default]
    Public,
    Internal,
    Admin,
}

impl Interface {
    /// Parses `public`, `internal`, `admin`, also in the older `publicURL` spelling.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().trim_end_matches("url") {
            "public" => Some(Self::Public),
            "internal" => Some(Self::Internal),
            "admin" => Some(Self::Admin),
            _ => None,
        }
    }

    /// The name used in the Keystone catalog.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Public => "public",
            Self::Internal => "internal",
            Self::Admin => "admin",
        }
    }
}

/// A domain, by id or by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DomainRef {
    Id(String),
    Name(String),
}

/// A user, by id or by name within a domain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UserRef {
    Id(String),
    Name { name: String, domain: DomainRef },
}

/// The project a password token is scoped to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProjectScope {
    Id(String),
    Name { name: String, domain: DomainRef },
}

/// An application credential, by id, or by name together with its owner.
#[derive(Clone, PartialEq, Eq)]
pub enum AppCredential {
    Id { id: String, secret: String },
    Name { name: String, user: UserRef, secret: String },
}

impl fmt::Debug for AppCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Id { id, .. } => f.debug_struct("Id").field("id", id).field("secret", &"<redacted>").finish(),
            Self::Name { name, user, .. } => {
                f.debug_struct("Name").field("name", name).field("user", user).field("secret", &"<redacted>").finish()
            }
        }
    }
}

/// How requests are authenticated.
#[derive(Clone, PartialEq, Eq)]
pub enum AuthConfig {
    /// Keystone v3 password authentication, scoped to a project.
    Password { auth_url: Url, user: UserRef, password: String, project: ProjectScope },
    /// Keystone v3 application credential (its project scope is part of the credential).
    ApplicationCredential { auth_url: Url, credential: AppCredential },
    /// No Keystone: endpoints are configured directly, and the project (if any) is sent in request
    /// bodies (`project_id`) and as the `X-Project-Id` header, as Neutron and Octavia expect with
    /// `auth_strategy = noauth`.
    NoAuth { project_id: Option<String> },
}

impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Password { auth_url, user, project, .. } => f
                .debug_struct("Password")
                .field("auth_url", &auth_url.as_str())
                .field("user", user)
                .field("password", &"<redacted>")
                .field("project", project)
                .finish(),
            Self::ApplicationCredential { auth_url, credential } => f
                .debug_struct("ApplicationCredential")
                .field("auth_url", &auth_url.as_str())
                .field("credential", credential)
                .finish(),
            Self::NoAuth { project_id } => f.debug_struct("NoAuth").field("project_id", project_id).finish(),
        }
    }
}

/// TLS settings for every endpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// A PEM bundle of CA certificates trusted in addition to the built-in roots (`cacert`, `OS_CACERT`).
    pub cacert: Option<PathBuf>,
    /// A client certificate and its key, PEM (`cert`/`key`, `OS_CERT`/`OS_KEY`).
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// Skip server certificate verification (`verify: false`, `insecure: true`, `OS_INSECURE`).
    pub insecure: bool,
}

/// A validated cloud configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloudConfig {
    /// Where it came from: `cloud "name" (path)` or `OS_* environment`, used in messages.
    pub origin: String,
    pub auth: AuthConfig,
    /// The region endpoints are taken from; any region when unset.
    pub region_name: Option<String>,
    pub interface: Interface,
    pub tls: TlsConfig,
    /// Endpoints that bypass the catalog (`network_endpoint_override`, ...); in no-auth mode these
    /// are the only endpoints.
    pub endpoint_overrides: BTreeMap<ServiceType, Url>,
}

impl CloudConfig {
    /// Loads and validates the configuration `source` selects.
    pub fn load(source: &ConfigSource) -> Result<Self, ConfigError> {
        let name = source.cloud.clone().or_else(|| source.var("OS_CLOUD").map(str::to_string));
        let clouds = find_file(&source.clouds_search_path());
        match (name, clouds) {
            (Some(name), None) => Err(ConfigError::NoCloudsFile { cloud: name, searched: source.clouds_search_path() }),
            (Some(name), Some(path)) => {
                let doc = read_yaml(&path)?;
                let secure = find_file(&source.secure_search_path()).map(|p| read_yaml(&p)).transpose()?;
                Self::from_clouds_yaml(&name, &path, &doc, secure.as_ref())
            }
            (None, clouds) => {
                if env_configured(&source.env) {
                    return Self::from_env(&source.env);
                }
                let Some(path) = clouds else { return Err(ConfigError::NothingConfigured { known: vec![] }) };
                let doc = read_yaml(&path)?;
                let known = cloud_names(&doc);
                match known.as_slice() {
                    [only] => {
                        let secure = find_file(&source.secure_search_path()).map(|p| read_yaml(&p)).transpose()?;
                        Self::from_clouds_yaml(only, &path, &doc, secure.as_ref())
                    }
                    _ => Err(ConfigError::NothingConfigured { known }),
                }
            }
        }
    }

    /// The cloud `name` of a parsed `clouds.yaml` document, merged with `secure.yaml` if given.
    pub fn from_clouds_yaml(
        name: &str,
        path: &Path,
        clouds: &Value,
        secure: Option<&Value>,
    ) -> Result<Self, ConfigError> {
        let origin = format!("cloud {name:?} ({})", path.display());
        let Some(entry) = clouds.get("clouds").and_then(|c| c.get(name)) else {
            return Err(ConfigError::UnknownCloud {
                cloud: name.to_string(),
                file: path.to_path_buf(),
                known: cloud_names(clouds),
            });
        };
        let mut entry = entry.clone();
        if let Some(extra) = secure.and_then(|s| s.get("clouds")).and_then(|c| c.get(name)) {
            merge(&mut entry, extra);
        }
        let raw: RawCloud = serde_json::from_value(entry).map_err(|e| ConfigError::Invalid {
            origin: origin.clone(),
            field: "cloud",
            value: name.to_string(),
            reason: e.to_string(),
        })?;
        raw.validate(origin)
    }

    /// The cloud the `OS_*` variables describe.
    pub fn from_env(env: &HashMap<String, String>) -> Result<Self, ConfigError> {
        RawCloud::from_env(env).validate("OS_* environment".to_string())
    }
}

fn env_configured(env: &HashMap<String, String>) -> bool {
    ["OS_AUTH_URL", "OS_AUTH_TYPE", "OS_NETWORK_ENDPOINT_OVERRIDE", "OS_LOAD_BALANCER_ENDPOINT_OVERRIDE"]
        .iter()
        .any(|k| env.get(*k).is_some_and(|v| !v.trim().is_empty()))
}

fn find_file(paths: &[PathBuf]) -> Option<PathBuf> {
    paths.iter().find(|p| p.is_file()).cloned()
}

fn read_yaml(path: &Path) -> Result<Value, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
    serde_saphyr::from_str(&text).map_err(|source| ConfigError::Parse { path: path.into(), source: Box::new(source) })
}

/// The clouds a `clouds.yaml` document defines, in name order.
fn cloud_names(doc: &Value) -> Vec<String> {
    doc.get("clouds").and_then(Value::as_object).map(|m| m.keys().cloned().collect()).unwrap_or_default()
}

/// Deep-merges `extra` into `base` (mappings merged key by key, anything else replaced).
fn merge(base: &mut Value, extra: &Value) {
    match (base, extra) {
        (Value::Object(b), Value::Object(e)) => {
            for (k, v) in e {
                match b.get_mut(k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (b, e) => *b = e.clone(),
    }
}

/// A `clouds.yaml` entry (or the environment) before validation. Values are strings, booleans or
/// numbers as users write them; validation turns them into [`CloudConfig`].
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawCloud {
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
    fn from_env(env: &HashMap<String, String>) -> Self {
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

    fn validate(self, origin: String) -> Result<CloudConfig, ConfigError> {
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

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
