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
use serde_json::Value;

use crate::service::ServiceType;

mod flags;
mod raw;

pub use flags::{CloudFlags, check_tag_flag};
#[cfg(feature = "clap")]
pub use flags::{ClusterIdArgs, NeutronCloudArgs};

use raw::RawCloud;

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
    /// A command-line flag's value ([`CloudFlags`]).
    #[error("{flag} {reason}")]
    Flag { flag: &'static str, reason: String },
    /// The cloud the flags point to (clouds.yaml, `OS_*`) cannot be used.
    #[error("OpenStack configuration (--os-cloud, clouds.yaml, OS_*): {0}")]
    Cloud(Box<ConfigError>),
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

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
