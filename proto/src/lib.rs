//! The gRPC contracts between the kuryr services, generated from `proto/kuryr/**.proto`.
//!
//! One module per service package (`kuryr.<service>.v1`). [`FILE_DESCRIPTOR_SET`] holds every
//! contract, encoded, for server reflection: `grpcurl` can list and call everything without the
//! `.proto` files.

#![allow(missing_debug_implementations, clippy::all, clippy::pedantic, rust_2018_idioms)]

/// The watcher: Kubernetes objects fanned out over `Subscribe` streams.
pub mod watcher {
    pub mod v1 {
        tonic::include_proto!("kuryr.watcher.v1");
    }
}

/// The VIF allocator: per-node VIF streams, plug reports, port pools.
pub mod allocator {
    pub mod v1 {
        tonic::include_proto!("kuryr.allocator.v1");
    }
}

/// kuryr-lbaas: load balancer specs for the node dataplane and LB status.
pub mod lbaas {
    pub mod v1 {
        tonic::include_proto!("kuryr.lbaas.v1");
    }
}

/// The binder: the CNI operations served to the `kuryr-cni` shim.
pub mod binder {
    pub mod v1 {
        tonic::include_proto!("kuryr.binder.v1");
    }
}

/// kuryr-policy: each node's compiled NetworkPolicy.
pub mod policy {
    pub mod v1 {
        tonic::include_proto!("kuryr.policy.v1");
    }
}

/// The encoded `FileDescriptorSet` of every kuryr contract, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("kuryr_descriptor");

/// Fully-qualified gRPC service names, as health checks and reflection know them.
pub mod service_names {
    pub const WATCHER: &str = "kuryr.watcher.v1.Watcher";
    pub const VIF_ALLOCATOR: &str = "kuryr.allocator.v1.VifAllocator";
    pub const POOL_MANAGER: &str = "kuryr.allocator.v1.PoolManager";
    pub const LOAD_BALANCERS: &str = "kuryr.lbaas.v1.LoadBalancers";
    pub const CNI: &str = "kuryr.binder.v1.Cni";
    pub const POLICIES: &str = "kuryr.policy.v1.Policies";
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    #[test]
    fn descriptor_set_holds_every_service() {
        let fds = prost_types::FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).expect("decodes");
        let mut services = Vec::new();
        for file in &fds.file {
            for s in &file.service {
                services.push(format!("{}.{}", file.package(), s.name()));
            }
        }
        for want in [
            service_names::WATCHER,
            service_names::VIF_ALLOCATOR,
            service_names::POOL_MANAGER,
            service_names::LOAD_BALANCERS,
            service_names::CNI,
            service_names::POLICIES,
        ] {
            assert!(services.iter().any(|s| s == want), "{want} missing from {services:?}");
        }
    }

    #[test]
    fn every_field_and_message_is_documented() {
        // The contracts promise a comment on every message, field, enum value and RPC; protox
        // keeps source info, so check it here instead of in review.
        let fds = protox::compile(
            [
                "kuryr/watcher/v1/watcher.proto",
                "kuryr/allocator/v1/allocator.proto",
                "kuryr/lbaas/v1/lbaas.proto",
                "kuryr/binder/v1/binder.proto",
                "kuryr/policy/v1/policy.proto",
            ],
            [env!("CARGO_MANIFEST_DIR")],
        )
        .expect("protos compile");
        let mut undocumented = Vec::new();
        for file in &fds.file {
            let Some(info) = &file.source_code_info else {
                panic!("{} has no source info", file.name());
            };
            for (i, msg) in file.message_type.iter().enumerate() {
                let path = [4, i as i32];
                if !has_comment(info, &path) && !msg.name().ends_with("Request") && !msg.name().ends_with("Response") {
                    undocumented.push(format!("{}: message {}", file.name(), msg.name()));
                }
                for (j, f) in msg.field.iter().enumerate() {
                    if !has_comment(info, &[4, i as i32, 2, j as i32]) {
                        undocumented.push(format!("{}: field {}.{}", file.name(), msg.name(), f.name()));
                    }
                }
            }
            for (i, e) in file.enum_type.iter().enumerate() {
                if !has_comment(info, &[5, i as i32]) {
                    undocumented.push(format!("{}: enum {}", file.name(), e.name()));
                }
                for (j, v) in e.value.iter().enumerate() {
                    // The zero value of every enum is the conventional "not set" marker.
                    if v.number() != 0 && !has_comment(info, &[5, i as i32, 2, j as i32]) {
                        undocumented.push(format!("{}: value {}.{}", file.name(), e.name(), v.name()));
                    }
                }
            }
            for (i, svc) in file.service.iter().enumerate() {
                if !has_comment(info, &[6, i as i32]) {
                    undocumented.push(format!("{}: service {}", file.name(), svc.name()));
                }
                for (j, m) in svc.method.iter().enumerate() {
                    if !has_comment(info, &[6, i as i32, 2, j as i32]) {
                        undocumented.push(format!("{}: rpc {}.{}", file.name(), svc.name(), m.name()));
                    }
                }
            }
        }
        assert!(undocumented.is_empty(), "undocumented: {undocumented:#?}");
    }

    fn has_comment(info: &prost_types::SourceCodeInfo, path: &[i32]) -> bool {
        info.location.iter().any(|l| {
            l.path == path
                && (l.leading_comments.as_deref().is_some_and(|c| !c.trim().is_empty())
                    || l.trailing_comments.as_deref().is_some_and(|c| !c.trim().is_empty()))
        })
    }
}
