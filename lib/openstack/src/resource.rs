//! The request shapes Neutron and Octavia share: `{"<singular>": {...}}` in and out,
//! `{"<plural>": [...]}` lists paged by id, and deletes for which "already gone" is no failure.

use http::Method;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::client::Client;
use crate::error::Error;
use crate::filter::Filter;
use crate::service::ServiceType;
use crate::transport::ApiRequest;
use crate::{HasId, Wrap, require_id};

/// A service API made of such resources. Its creates, reads, deletes and lists are the provided
/// methods; what differs between services is the constants.
pub(crate) trait Resources {
    /// The service: its endpoint, and the `service` label of the metrics.
    const SERVICE: ServiceType;
    /// Entries asked for per page of a list.
    const PAGE_SIZE: usize;
    /// Whether a create or delete refused with 409 is repeated (Octavia refuses changes while a
    /// load balancer is PENDING_*: the change was not made, so repeating it is safe).
    const RETRY_ON_CONFLICT: bool;

    /// The client the calls go through.
    fn client(&self) -> &Client;

    /// `req`, repeated on 409 where the service asks for it.
    fn change(req: ApiRequest) -> ApiRequest {
        if Self::RETRY_ON_CONFLICT { req.retry_on_conflict() } else { req }
    }

    /// POSTs `{"<key>": body}` to `path`, answering the `"<key>"` field of the reply.
    async fn create<B: Serialize, T: DeserializeOwned>(
        &self,
        operation: &'static str,
        path: &str,
        key: &'static str,
        body: &B,
    ) -> Result<T, Error> {
        let req = ApiRequest::with_json(Self::SERVICE, operation, Method::POST, path, &Wrap::new(key, body))?;
        self.client().json_field(Self::change(req), key).await
    }

    /// GETs `collection/id`, answering the `"<key>"` field of the reply.
    async fn get<T: DeserializeOwned>(
        &self,
        operation: &'static str,
        collection: &str,
        id: &str,
        key: &'static str,
    ) -> Result<T, Error> {
        let path = format!("{collection}/{}", require_id(key, id)?);
        self.client().json_field(ApiRequest::get(Self::SERVICE, operation, path), key).await
    }

    /// DELETEs `collection/id`: true if it was deleted, false if it was gone already.
    async fn delete(&self, operation: &'static str, collection: &str, id: &str) -> Result<bool, Error> {
        let kind = collection.rsplit('/').next().unwrap_or(collection);
        let path = format!("{collection}/{}", require_id(kind, id)?);
        gone_is_false(self.client().send(Self::change(ApiRequest::delete(Self::SERVICE, operation, path))).await)
    }

    /// Every entry of the list at `path` that `filter` selects, page by page.
    async fn list<T: DeserializeOwned + HasId>(
        &self,
        operation: &'static str,
        path: &str,
        key: &'static str,
        filter: &Filter,
    ) -> Result<Vec<T>, Error> {
        self.client().list_paged(Self::SERVICE, operation, path, key, filter, Self::PAGE_SIZE).await
    }
}

/// A delete or tag removal: gone already is not a failure, only reported.
pub(crate) fn gone_is_false<T>(r: Result<T, Error>) -> Result<bool, Error> {
    match r {
        Ok(_) => Ok(true),
        Err(e) if e.is_not_found() => Ok(false),
        Err(e) => Err(e),
    }
}

/// [`HasId`] for resource types whose id is their `id` field.
macro_rules! has_id {
    ($($t:ty),*) => { $(impl crate::HasId for $t { fn id(&self) -> &str { &self.id } })* };
}
pub(crate) use has_id;
