//! The cloud a service's command line describes: direct endpoints for a deployment without
//! Keystone (`--neutron-url`, `--octavia-url`; requests carry no token), else a cloud of
//! clouds.yaml (`--os-cloud`, `--clouds-yaml`) or the `OS_*` variables.

use std::collections::BTreeMap;
use std::path::Path;

use super::{AuthConfig, CloudConfig, ConfigError, ConfigSource, Interface, TlsConfig};
use crate::service::ServiceType;

/// What a command line says about the cloud.
#[derive(Clone, Debug, Default)]
pub struct CloudFlags<'a> {
    /// `--os-cloud`: the cloud of clouds.yaml; else `OS_CLOUD`, else the `OS_*` variables, else
    /// a clouds.yaml with a single cloud.
    pub os_cloud: Option<&'a str>,
    /// `--clouds-yaml`: the file to read instead of the standard search path.
    pub clouds_yaml: Option<&'a Path>,
    /// The direct endpoints given, as `(flag, URL, service)`: any of them replaces the cloud.
    pub endpoints: Vec<(&'static str, &'a str, ServiceType)>,
    /// `--project-id`: the project owning what is created through direct endpoints.
    pub project_id: Option<&'a str>,
}

impl CloudFlags<'_> {
    /// The cloud, or an error naming the flag (or the configuration) at fault.
    pub fn resolve(&self) -> Result<CloudConfig, ConfigError> {
        if !self.endpoints.is_empty() {
            let mut overrides = BTreeMap::new();
            for (flag, url, service) in &self.endpoints {
                let parsed = url.parse().map_err(|e| ConfigError::Flag { flag, reason: format!("{url:?}: {e}") })?;
                overrides.insert(*service, parsed);
            }
            return Ok(CloudConfig {
                origin: self.endpoints.iter().map(|(flag, ..)| *flag).collect::<Vec<_>>().join("/"),
                auth: AuthConfig::NoAuth { project_id: self.project_id.map(str::to_string) },
                region_name: None,
                interface: Interface::default(),
                tls: TlsConfig::default(),
                endpoint_overrides: overrides,
            });
        }
        let mut source = ConfigSource::from_process(self.os_cloud.map(str::to_string));
        if let Some(path) = self.clouds_yaml {
            if !path.is_file() {
                return Err(ConfigError::Flag {
                    flag: "--clouds-yaml",
                    reason: format!("{}: no such file", path.display()),
                });
            }
            source.clouds_files = Some(vec![path.to_path_buf()]);
        }
        CloudConfig::load(&source).map_err(|e| ConfigError::Cloud(Box::new(e)))
    }
}

/// Checks a flag whose value becomes part of a Neutron tag (`kuryr.openstack.org/cluster=<value>`):
/// 1-200 printable characters without commas, so that the tag fits Neutron's 255 and can be
/// used in filters.
pub fn check_tag_flag(flag: &'static str, value: &str) -> Result<(), ConfigError> {
    if value.is_empty() || value.contains(',') || value.len() > 200 || value.chars().any(char::is_control) {
        return Err(ConfigError::Flag {
            flag,
            reason: format!("{value:?}: 1-200 printable characters without commas (it becomes a Neutron tag)"),
        });
    }
    Ok(())
}

/// `--cluster-id`, the same flag for every tool that tags or finds the cluster's Neutron
/// resources (the allocator's ports, kuryr-policy's security groups, kuryr-migrate).
#[cfg(feature = "clap")]
#[derive(Clone, Debug, clap::Args)]
pub struct ClusterIdArgs {
    /// Names this cluster in the tag `kuryr.openstack.org/cluster=<id>` on the Neutron resources
    /// kuryr creates (the allocator's ports, kuryr-policy's security groups): what recovery and
    /// garbage collection look for. The same id for the allocator, kuryr-policy and
    /// kuryr-migrate; distinct per cluster sharing a project.
    #[arg(long, env = "KURYR_CLUSTER_ID", default_value = "kubernetes")]
    pub cluster_id: String,
}

#[cfg(feature = "clap")]
impl ClusterIdArgs {
    /// Checks that the id fits a tag ([`check_tag_flag`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_tag_flag("--cluster-id", &self.cluster_id)
    }

    /// The tag `kuryr.openstack.org/cluster=<id>` marking the cluster's Neutron resources.
    pub fn tag(&self) -> String {
        format!("kuryr.openstack.org/cluster={}", self.cluster_id)
    }
}

/// The flags of a service that talks to Neutron: its cloud, or Neutron's URL without Keystone.
#[cfg(feature = "clap")]
#[derive(Clone, Debug, Default, clap::Args)]
pub struct NeutronCloudArgs {
    /// The cloud of clouds.yaml to use (Keystone password or application credential); else
    /// `OS_CLOUD`, else the `OS_*` variables, else a clouds.yaml with a single cloud.
    #[arg(long, env = "KURYR_OS_CLOUD")]
    pub os_cloud: Option<String>,

    /// The clouds.yaml to read, instead of the standard search path (`OS_CLIENT_CONFIG_FILE`,
    /// `./clouds.yaml`, `~/.config/openstack/`, `/etc/openstack/`).
    #[arg(long, env = "KURYR_CLOUDS_YAML")]
    pub clouds_yaml: Option<std::path::PathBuf>,

    /// Neutron's URL for deployments without Keystone (e.g. `http://neutron:9696`): requests
    /// carry no token and `--project-id` owns what is created. Replaces the cloud configuration.
    #[arg(long, env = "KURYR_NEUTRON_URL")]
    pub neutron_url: Option<String>,

    /// The project owning what is created in Neutron (the pods' ports, the security groups); by
    /// default the project of the Keystone token. Required with --neutron-url.
    #[arg(long, env = "KURYR_PROJECT_ID")]
    pub project_id: Option<String>,
}

#[cfg(feature = "clap")]
impl NeutronCloudArgs {
    /// Checks what can be checked without the cloud: a project to own what is created when
    /// there is no Keystone token to take it from.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.neutron_url.is_some() && self.project_id.as_deref().is_none_or(|p| p.trim().is_empty()) {
            return Err(ConfigError::Flag {
                flag: "--project-id",
                reason: "is required with --neutron-url (no Keystone token to take it from)".into(),
            });
        }
        Ok(())
    }

    /// The flags as [`CloudFlags`], with `extra` direct endpoints next to `--neutron-url`.
    pub fn flags<'a>(&'a self, extra: &[(&'static str, &'a Option<String>, ServiceType)]) -> CloudFlags<'a> {
        let neutron = [("--neutron-url", &self.neutron_url, ServiceType::Network)];
        CloudFlags {
            os_cloud: self.os_cloud.as_deref(),
            clouds_yaml: self.clouds_yaml.as_deref(),
            endpoints: neutron.iter().chain(extra).filter_map(|(f, u, s)| Some((*f, u.as_deref()?, *s))).collect(),
            project_id: self.project_id.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_flag_takes_printable_values_without_commas() {
        assert!(check_tag_flag("--cluster-id", "kubernetes").is_ok());
        assert!(check_tag_flag("--cluster-id", &"x".repeat(200)).is_ok());
        for bad in ["", "a,b", "a\nb", &"x".repeat(201)] {
            let e = check_tag_flag("--cluster-id", bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.starts_with(&format!("--cluster-id {bad:?}: 1-200 printable")), "{bad:?}: {e:?}");
        }
    }

    #[test]
    fn direct_endpoints_replace_the_cloud_and_name_a_bad_url() {
        let flags = CloudFlags {
            endpoints: vec![
                ("--neutron-url", "http://127.0.0.1:9696", ServiceType::Network),
                ("--octavia-url", "http://127.0.0.1:9876", ServiceType::LoadBalancer),
            ],
            project_id: Some("p1"),
            ..CloudFlags::default()
        };
        let cloud = flags.resolve().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cloud.origin, "--neutron-url/--octavia-url");
        assert_eq!(cloud.auth, AuthConfig::NoAuth { project_id: Some("p1".into()) });
        assert_eq!(cloud.endpoint_overrides[&ServiceType::Network].as_str(), "http://127.0.0.1:9696/");
        let bad = CloudFlags {
            endpoints: vec![("--neutron-url", "not a url", ServiceType::Network)],
            ..CloudFlags::default()
        };
        let e = bad.resolve().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.starts_with("--neutron-url \"not a url\": "), "{e}");
    }

    #[test]
    fn a_missing_clouds_yaml_is_named() {
        let flags = CloudFlags { clouds_yaml: Some(Path::new("/nonexistent/clouds.yaml")), ..CloudFlags::default() };
        let e = flags.resolve().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(e, "--clouds-yaml /nonexistent/clouds.yaml: no such file");
    }
}
