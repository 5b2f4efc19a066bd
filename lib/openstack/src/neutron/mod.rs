//! Neutron (`network` in the catalog): ports, networks, subnets, subnet pools, routers, floating IPs,
//! security groups and their rules (created in bulk), tags, trunks and their subports.

mod trunk;
mod types;

pub use trunk::*;
pub use types::*;

use http::Method;

use crate::client::Client;
use crate::error::Error;
use crate::filter::{Filter, MAX_IDS_PER_LIST};
use crate::resource::{Resources, gone_is_false, has_id};
use crate::service::ServiceType;
use crate::transport::ApiRequest;
use crate::{Wrap, path_segment, require_id};

const NET: ServiceType = ServiceType::Network;

/// Entries asked for per page of a list. Neutron caps pages at its own `max` anyway; 1000 keeps
/// each answer under a few MB while listing a few thousand ports in a handful of calls.
const PAGE_SIZE: usize = 1000;

/// The Neutron API.
#[derive(Clone, Debug)]
pub struct Neutron {
    client: Client,
}

impl Client {
    /// Neutron.
    pub fn network(&self) -> Neutron {
        Neutron::new(self.clone())
    }
}

impl Neutron {
    pub(crate) fn new(client: Client) -> Self {
        Self { client }
    }

    // ---- ports ----

    /// Creates one port.
    pub async fn create_port(&self, mut port: PortCreate) -> Result<Port, Error> {
        fill_project(&mut port.project_id, &self.client);
        let created = self.create("ports.create", "/ports", "port", &port).await?;
        let mut created = vec![created];
        self.ensure_tags(std::slice::from_ref(&port), &mut created).await?;
        Ok(created.remove(0))
    }

    /// Creates ports in one atomic bulk call: all or none. An empty list sends nothing.
    pub async fn create_ports(&self, mut ports: Vec<PortCreate>) -> Result<Vec<Port>, Error> {
        if ports.is_empty() {
            return Ok(Vec::new());
        }
        for p in &mut ports {
            fill_project(&mut p.project_id, &self.client);
        }
        let req = ApiRequest::with_json(NET, "ports.create_bulk", Method::POST, "/ports", &Wrap::new("ports", &ports))?;
        let mut created: Vec<Port> = self.client.json_field::<Vec<Port>>(req, "ports").await?;
        if created.len() != ports.len() {
            return Err(Error::InvalidRequest(format!(
                "ports.create_bulk: asked for {} ports, Neutron returned {}",
                ports.len(),
                created.len()
            )));
        }
        self.ensure_tags(&ports, &mut created).await?;
        Ok(created)
    }

    /// Neutron takes tags in a create only with the ML2 extension driver
    /// `tag_ports_during_bulk_creation`, and silently drops them without it: tags asked for but
    /// missing from the answer are set with one more call per port.
    async fn ensure_tags(&self, asked: &[PortCreate], created: &mut [Port]) -> Result<(), Error> {
        for (spec, port) in asked.iter().zip(created.iter_mut()) {
            let Some(tags) = spec.tags.as_ref().filter(|t| !t.is_empty()) else { continue };
            if tags.iter().all(|t| port.tags.contains(t)) {
                continue;
            }
            tracing::debug!(port = %port.id, "tags not applied at creation, setting them");
            port.tags = self.set_tags(TaggedResource::Port, &port.id, tags).await?;
        }
        Ok(())
    }

    pub async fn get_port(&self, id: &str) -> Result<Port, Error> {
        self.get("ports.show", "/ports", id, "port").await
    }

    /// Every port matching `filter`, following pages.
    pub async fn list_ports(&self, filter: &Filter) -> Result<Vec<Port>, Error> {
        self.list("ports.list", "/ports", "ports", filter).await
    }

    /// The ports among `ids` (that still exist) that also match `filter`, in as few calls as the
    /// URL length allows: how the status of many ports is read at once.
    pub async fn list_ports_by_ids(&self, ids: &[String], filter: &Filter) -> Result<Vec<Port>, Error> {
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(MAX_IDS_PER_LIST) {
            let f = filter.clone().ids(chunk.iter().map(String::as_str));
            out.extend(self.list_ports(&f).await?);
        }
        Ok(out)
    }

    /// Changes a port. With `if_revision`, Neutron refuses ([`Error::Conflict`], HTTP 412) if
    /// the port changed since that revision.
    pub async fn update_port(&self, id: &str, update: &PortUpdate, if_revision: Option<u64>) -> Result<Port, Error> {
        let path = format!("/ports/{}", require_id("port", id)?);
        let mut req = ApiRequest::with_json(NET, "ports.update", Method::PUT, path, &Wrap::new("port", update))?;
        if let Some(rev) = if_revision {
            let v = format!("revision_number={rev}");
            req.headers.insert(http::header::IF_MATCH, v.parse().map_err(|_| Error::InvalidRequest(v))?);
        }
        self.client.json_field::<Port>(req, "port").await
    }

    /// Deletes a port; `Ok(false)` if it was already gone.
    pub async fn delete_port(&self, id: &str) -> Result<bool, Error> {
        self.delete("ports.delete", "/ports", id).await
    }

    // ---- tags (any standard-attribute resource) ----

    /// Replaces all tags of a resource.
    pub async fn set_tags(&self, resource: TaggedResource, id: &str, tags: &[String]) -> Result<Vec<String>, Error> {
        let path = format!("/{}/{}/tags", resource.collection(), require_id(resource.singular(), id)?);
        let body = serde_json::json!({ "tags": tags });
        let req = ApiRequest::with_json(NET, "tags.replace", Method::PUT, path, &body)?;
        self.client.json_field::<Vec<String>>(req, "tags").await
    }

    /// Adds one tag (no-op if present).
    pub async fn add_tag(&self, resource: TaggedResource, id: &str, tag: &str) -> Result<(), Error> {
        let path = self.tag_path(resource, id, tag)?;
        self.client.send(ApiRequest::new(NET, "tags.add", Method::PUT, path)).await.map(drop)
    }

    /// Removes one tag; `Ok(false)` if the resource did not have it.
    pub async fn remove_tag(&self, resource: TaggedResource, id: &str, tag: &str) -> Result<bool, Error> {
        let path = self.tag_path(resource, id, tag)?;
        gone_is_false(self.client.send(ApiRequest::delete(NET, "tags.remove", path)).await)
    }

    fn tag_path(&self, resource: TaggedResource, id: &str, tag: &str) -> Result<String, Error> {
        if tag.is_empty() {
            return Err(Error::InvalidRequest("empty tag".into()));
        }
        // Neutron decodes the path before routing, so an encoded `/` still splits it: 404.
        if tag.contains('/') {
            return Err(Error::InvalidRequest(format!(
                "tag {tag:?} holds a '/', which Neutron's one-tag calls cannot take; use set_tags"
            )));
        }
        Ok(format!("/{}/{}/tags/{}", resource.collection(), require_id(resource.singular(), id)?, path_segment(tag)))
    }

    // ---- networks, subnets ----

    pub async fn create_network(&self, mut network: NetworkCreate) -> Result<Network, Error> {
        fill_project(&mut network.project_id, &self.client);
        // Neutron refuses tags in the creation of these ("not allowed in POST"): set after.
        let tags = network.tags.take().unwrap_or_default();
        let mut created: Network = self.create("networks.create", "/networks", "network", &network).await?;
        if !tags.is_empty() {
            created.tags = self.set_tags(TaggedResource::Network, &created.id, &tags).await?;
        }
        Ok(created)
    }

    pub async fn get_network(&self, id: &str) -> Result<Network, Error> {
        self.get("networks.show", "/networks", id, "network").await
    }

    pub async fn list_networks(&self, filter: &Filter) -> Result<Vec<Network>, Error> {
        self.list("networks.list", "/networks", "networks", filter).await
    }

    pub async fn delete_network(&self, id: &str) -> Result<bool, Error> {
        self.delete("networks.delete", "/networks", id).await
    }

    pub async fn create_subnet(&self, mut subnet: SubnetCreate) -> Result<Subnet, Error> {
        fill_project(&mut subnet.project_id, &self.client);
        // Neutron refuses tags in the creation of these ("not allowed in POST"): set after.
        let tags = subnet.tags.take().unwrap_or_default();
        let mut created: Subnet = self.create("subnets.create", "/subnets", "subnet", &subnet).await?;
        if !tags.is_empty() {
            created.tags = self.set_tags(TaggedResource::Subnet, &created.id, &tags).await?;
        }
        Ok(created)
    }

    pub async fn get_subnet(&self, id: &str) -> Result<Subnet, Error> {
        self.get("subnets.show", "/subnets", id, "subnet").await
    }

    pub async fn list_subnets(&self, filter: &Filter) -> Result<Vec<Subnet>, Error> {
        self.list("subnets.list", "/subnets", "subnets", filter).await
    }

    pub async fn delete_subnet(&self, id: &str) -> Result<bool, Error> {
        self.delete("subnets.delete", "/subnets", id).await
    }

    // ---- subnet pools ----

    pub async fn create_subnetpool(&self, mut pool: SubnetPoolCreate) -> Result<SubnetPool, Error> {
        fill_project(&mut pool.project_id, &self.client);
        self.create("subnetpools.create", "/subnetpools", "subnetpool", &pool).await
    }

    pub async fn get_subnetpool(&self, id: &str) -> Result<SubnetPool, Error> {
        self.get("subnetpools.show", "/subnetpools", id, "subnetpool").await
    }

    pub async fn delete_subnetpool(&self, id: &str) -> Result<bool, Error> {
        self.delete("subnetpools.delete", "/subnetpools", id).await
    }

    // ---- routers ----

    pub async fn create_router(&self, mut router: RouterCreate) -> Result<Router, Error> {
        fill_project(&mut router.project_id, &self.client);
        // Neutron refuses tags in the creation of these ("not allowed in POST"): set after.
        let tags = router.tags.take().unwrap_or_default();
        let mut created: Router = self.create("routers.create", "/routers", "router", &router).await?;
        if !tags.is_empty() {
            created.tags = self.set_tags(TaggedResource::Router, &created.id, &tags).await?;
        }
        Ok(created)
    }

    pub async fn get_router(&self, id: &str) -> Result<Router, Error> {
        self.get("routers.show", "/routers", id, "router").await
    }

    pub async fn list_routers(&self, filter: &Filter) -> Result<Vec<Router>, Error> {
        self.list("routers.list", "/routers", "routers", filter).await
    }

    pub async fn delete_router(&self, id: &str) -> Result<bool, Error> {
        self.delete("routers.delete", "/routers", id).await
    }

    /// Attaches a subnet or port to a router. Not repeated after an unclear failure: a second
    /// add of the same subnet is refused by Neutron.
    pub async fn add_router_interface(
        &self,
        router_id: &str,
        what: &RouterInterface,
    ) -> Result<RouterInterfaceInfo, Error> {
        let path = format!("/routers/{}/add_router_interface", require_id("router", router_id)?);
        let req = ApiRequest::with_json(NET, "routers.add_interface", Method::PUT, path, what)?.idempotent(false);
        self.client.json(req).await
    }

    /// Detaches a subnet or port from a router.
    pub async fn remove_router_interface(
        &self,
        router_id: &str,
        what: &RouterInterface,
    ) -> Result<RouterInterfaceInfo, Error> {
        let path = format!("/routers/{}/remove_router_interface", require_id("router", router_id)?);
        let req = ApiRequest::with_json(NET, "routers.remove_interface", Method::PUT, path, what)?;
        self.client.json(req).await
    }

    // ---- floating IPs ----

    pub async fn create_floating_ip(&self, mut fip: FloatingIpCreate) -> Result<FloatingIp, Error> {
        fill_project(&mut fip.project_id, &self.client);
        self.create("floatingips.create", "/floatingips", "floatingip", &fip).await
    }

    pub async fn get_floating_ip(&self, id: &str) -> Result<FloatingIp, Error> {
        self.get("floatingips.show", "/floatingips", id, "floatingip").await
    }

    pub async fn list_floating_ips(&self, filter: &Filter) -> Result<Vec<FloatingIp>, Error> {
        self.list("floatingips.list", "/floatingips", "floatingips", filter).await
    }

    /// Associates the floating IP with a port, or dissociates it (`port_id: None`).
    pub async fn associate_floating_ip(&self, id: &str, assoc: &FloatingIpAssociation) -> Result<FloatingIp, Error> {
        let path = format!("/floatingips/{}", require_id("floating IP", id)?);
        let req = ApiRequest::with_json(NET, "floatingips.update", Method::PUT, path, &Wrap::new("floatingip", assoc))?;
        self.client.json_field::<FloatingIp>(req, "floatingip").await
    }

    pub async fn delete_floating_ip(&self, id: &str) -> Result<bool, Error> {
        self.delete("floatingips.delete", "/floatingips", id).await
    }

    // ---- security groups ----

    /// Creates a security group (with the rules Neutron adds to every new group), then sets its
    /// tags: Neutron refuses them in the creation ("Attribute 'tags' not allowed in POST").
    pub async fn create_security_group(&self, mut group: SecurityGroupCreate) -> Result<SecurityGroup, Error> {
        fill_project(&mut group.project_id, &self.client);
        let tags = group.tags.take().unwrap_or_default();
        let mut created: SecurityGroup =
            self.create("security_groups.create", "/security-groups", "security_group", &group).await?;
        if !tags.is_empty() {
            match self.set_tags(TaggedResource::SecurityGroup, &created.id, &tags).await {
                Ok(t) => created.tags = t,
                Err(e) => {
                    // An untagged group would never be found again by its owner: remove it.
                    if let Err(d) = self.delete_security_group(&created.id).await {
                        tracing::warn!(group = %created.id, error = %d, "untagged security group left behind");
                    }
                    return Err(e);
                }
            }
        }
        Ok(created)
    }

    pub async fn get_security_group(&self, id: &str) -> Result<SecurityGroup, Error> {
        self.get("security_groups.show", "/security-groups", id, "security_group").await
    }

    /// Every security group matching `filter` (with their rules unless `fields=` says otherwise).
    pub async fn list_security_groups(&self, filter: &Filter) -> Result<Vec<SecurityGroup>, Error> {
        self.list("security_groups.list", "/security-groups", "security_groups", filter).await
    }

    /// Deletes a security group; `Ok(false)` if it was already gone. Neutron refuses
    /// ([`Error::Conflict`]) while a port still uses it.
    pub async fn delete_security_group(&self, id: &str) -> Result<bool, Error> {
        self.delete("security_groups.delete", "/security-groups", id).await
    }

    /// Every security group rule matching `filter`.
    pub async fn list_security_group_rules(&self, filter: &Filter) -> Result<Vec<SecurityGroupRule>, Error> {
        self.list("security_group_rules.list", "/security-group-rules", "security_group_rules", filter).await
    }

    /// Creates rules in one atomic bulk call (`POST /security-group-rules` with a list): all or
    /// none. An empty list sends nothing. Not repeated after an unclear failure (a rule that was
    /// created is refused the second time as a duplicate): the caller re-reads and diffs.
    pub async fn create_security_group_rules(
        &self,
        mut rules: Vec<SecurityGroupRuleCreate>,
    ) -> Result<Vec<SecurityGroupRule>, Error> {
        if rules.is_empty() {
            return Ok(Vec::new());
        }
        for r in &mut rules {
            fill_project(&mut r.project_id, &self.client);
        }
        let body = Wrap::new("security_group_rules", &rules);
        let req = ApiRequest::with_json(
            NET,
            "security_group_rules.create_bulk",
            Method::POST,
            "/security-group-rules",
            &body,
        )?;
        let created: Vec<SecurityGroupRule> = self.client.json_field(req, "security_group_rules").await?;
        if created.len() != rules.len() {
            return Err(Error::InvalidRequest(format!(
                "security_group_rules.create_bulk: asked for {} rules, Neutron returned {}",
                rules.len(),
                created.len()
            )));
        }
        Ok(created)
    }

    /// Deletes one rule (Neutron has no bulk delete); `Ok(false)` if it was already gone.
    pub async fn delete_security_group_rule(&self, id: &str) -> Result<bool, Error> {
        self.delete("security_group_rules.delete", "/security-group-rules", id).await
    }
}

impl Resources for Neutron {
    const SERVICE: ServiceType = NET;
    const PAGE_SIZE: usize = PAGE_SIZE;
    const RETRY_ON_CONFLICT: bool = false;

    fn client(&self) -> &Client {
        &self.client
    }
}

/// Resources that carry tags (Neutron's standard attributes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaggedResource {
    Port,
    Network,
    Subnet,
    Router,
    FloatingIp,
    SecurityGroup,
}

impl TaggedResource {
    fn collection(self) -> &'static str {
        match self {
            Self::Port => "ports",
            Self::Network => "networks",
            Self::Subnet => "subnets",
            Self::Router => "routers",
            Self::FloatingIp => "floatingips",
            Self::SecurityGroup => "security-groups",
        }
    }

    fn singular(self) -> &'static str {
        match self {
            Self::Port => "port",
            Self::Network => "network",
            Self::Subnet => "subnet",
            Self::Router => "router",
            Self::FloatingIp => "floating IP",
            Self::SecurityGroup => "security group",
        }
    }
}

has_id!(Port, Network, Subnet, SubnetPool, Router, FloatingIp, SecurityGroup, SecurityGroupRule);

fn fill_project(project_id: &mut Option<String>, client: &Client) {
    if project_id.is_none() {
        *project_id = client.body_project_id();
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
