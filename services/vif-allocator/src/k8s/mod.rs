//! The allocator's side of the Kubernetes API: its custom resources ([`crd`]), the
//! [`crate::cluster::Cluster`] against a real API server ([`api`]), the watch of address blocks
//! that keeps the node routes current ([`blocks`]), and the further interfaces'
//! NetworkAttachmentDefinitions ([`attach`]).

pub mod api;
pub mod attach;
pub mod blocks;
pub mod crd;
