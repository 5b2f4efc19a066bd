//! The OpenStack services this client speaks to, and how their endpoints are turned into base URLs.

use reqwest::Url;

/// A service type as named in the Keystone catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ServiceType {
    /// Keystone.
    Identity,
    /// Neutron.
    Network,
    /// Octavia.
    LoadBalancer,
}

impl ServiceType {
    /// The catalog type, also the `service` label of metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Identity => "identity",
            Self::Network => "network",
            Self::LoadBalancer => "load-balancer",
        }
    }

    /// The API version segment every path of this client starts with.
    fn version_segment(self) -> &'static str {
        match self {
            Self::Identity => "v3",
            Self::Network => "v2.0",
            Self::LoadBalancer => "v2",
        }
    }

    /// The base URL API paths are appended to: the endpoint with the version segment. Catalogs
    /// list both `https://host:9696` and `https://host:9696/v2.0`; both give the same base.
    pub fn versioned_base(self, endpoint: &Url) -> Url {
        let mut url = endpoint.clone();
        let path = url.path().trim_end_matches('/').to_string();
        let version = self.version_segment();
        let path = if path.ends_with(&format!("/{version}")) { path } else { format!("{path}/{version}") };
        url.set_path(&path);
        url.set_query(None);
        url
    }
}

impl std::fmt::Display for ServiceType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versioned_base_adds_the_version_once() {
        let cases = [
            (ServiceType::Network, "http://n:9696", "http://n:9696/v2.0"),
            (ServiceType::Network, "http://n:9696/", "http://n:9696/v2.0"),
            (ServiceType::Network, "http://n:9696/v2.0/", "http://n:9696/v2.0"),
            (ServiceType::Network, "https://cloud/networking", "https://cloud/networking/v2.0"),
            (ServiceType::LoadBalancer, "http://o:9876", "http://o:9876/v2"),
            (ServiceType::LoadBalancer, "https://cloud/load-balancer/v2", "https://cloud/load-balancer/v2"),
            (ServiceType::Identity, "https://cloud/identity", "https://cloud/identity/v3"),
        ];
        for (service, endpoint, want) in cases {
            let got = service.versioned_base(&Url::parse(endpoint).unwrap());
            assert_eq!(got.as_str(), want, "{service} {endpoint}");
        }
    }
}
