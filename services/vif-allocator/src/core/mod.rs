//! The pure part of the allocator: its domain types and the logic over them, with no Kubernetes
//! client, no gRPC server and no backend.
//!
//! - [`vif`]: a pod ([`PodKey`]) and the VIF it was given ([`VifRecord`], [`VifState`]; [`Vif`] as
//!   handed to binders), and a node's routes ([`NodeRoutes`]).
//! - [`ipam`]: carving a PodNetwork's CIDRs into node blocks, choosing addresses, MACs and the
//!   VIF shape of the embedded IPAM.
//! - [`attach`]: the pod annotation that asks for further interfaces, and the network-status
//!   annotation written back.

pub mod attach;
pub mod ipam;
pub mod vif;

pub use vif::{AttachedRecord, NodeRoutes, PodKey, Vif, VifBinding, VifIp, VifRecord, VifRoute, VifState};
