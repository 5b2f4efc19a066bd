//! The CNI 1.1 data model shared by the `kuryr-cni` shim and `kuryr-binder`.
//!
//! - [`NetConf`]: the network configuration on stdin (spec fields plus kuryr's `binderSocket`,
//!   `timeoutSeconds`, `logFile`), with `prevResult` read from any supported layout.
//! - [`CniArgs`]: `CNI_ARGS` (`K8S_POD_NAMESPACE`, `K8S_POD_NAME`, `K8S_POD_UID`, ...).
//! - [`Command`] and the environment each operation requires; [`validate_container_id`],
//!   [`validate_ifname`].
//! - [`CniResult`]: a version-neutral result, [rendered](CniResult::render) in the exact layout of
//!   0.3.0, 0.3.1, 0.4.0, 1.0.0 or 1.1.0.
//! - [`CniError`] and the well-known [`code`]s; [`version_result`] for VERSION.
//! - With the `proto` feature: conversions to and from `kuryr.binder.v1` and `tonic::Status`.
//!
//! Every failure is a [`CniError`] carrying the code the spec prescribes, so the shim prints what
//! it gets and the binder returns what it gets, with no second guessing of codes.
//!
//! # Why not a CNI crate from crates.io
//!
//! The Rust CNI crates (`rscni`, `cni-plugin`, `cni`) each model one result layout or one
//! version family, parse only the layout they print, and bring dependencies (async runtimes, IP
//! network crates, logging frameworks) into a binary that the runtime executes for every pod and
//! that must stay small and start fast. We need every supported version's exact layout on output,
//! every layout on input (a `prevResult` arrives in whichever version the runtime chose), and one
//! error type whose codes travel unchanged through gRPC. That is a few hundred lines on serde, so
//! it is written here.

mod args;
mod cidr;
mod command;
mod error;
mod netconf;
#[cfg(feature = "proto")]
mod proto;
mod result;
mod version;

pub use args::{CniArgs, keys as args_keys};
pub use cidr::{IpCidr, ParseCidrError};
pub use command::{Command, MAX_IFNAME_LEN, env, validate_container_id, validate_ifname};
pub use error::{CniError, PLUGIN_SPECIFIC_MIN, code};
pub use netconf::{
    DEFAULT_BINDER_SOCKET, DEFAULT_TIMEOUT_SECONDS, MAX_CONFIG_BYTES, MAX_TIMEOUT_SECONDS, NON_ADD_TIMEOUT_CAP_SECONDS,
    NetConf, ValidAttachment,
};
pub use result::{CniResult, Dns, Interface, InvalidResult, IpConfig, Route};
pub use version::{CniVersion, SUPPORTED_VERSIONS, requested_version, version_result};
