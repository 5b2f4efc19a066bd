//! The little of Keystone's own API the system needs beyond tokens: which projects the
//! credentials reach (a startup check that the configuration works).

use serde::Deserialize;

use crate::client::Client;
use crate::error::Error;
use crate::service::ServiceType;
use crate::transport::ApiRequest;

/// A project the token's user can act in.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Project {
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub domain_id: Option<String>,
    #[serde(default)]
    pub enabled: bool,
}

/// Keystone (`identity` in the catalog).
#[derive(Clone, Debug)]
pub struct Identity {
    client: Client,
}

impl Client {
    /// Keystone's own API.
    pub fn identity(&self) -> Identity {
        Identity::new(self.clone())
    }
}

impl Identity {
    pub(crate) fn new(client: Client) -> Self {
        Self { client }
    }

    /// `GET /v3/auth/projects`: the projects the current token's user can scope to.
    pub async fn auth_projects(&self) -> Result<Vec<Project>, Error> {
        let req = ApiRequest::get(ServiceType::Identity, "auth.projects", "/auth/projects");
        self.client.json_field(req, "projects").await
    }
}
