//! Compiles the `.proto` contracts with protox (a pure-Rust protobuf compiler), so building needs
//! no system `protoc`, and writes the encoded descriptor set that servers register for reflection.

use std::path::PathBuf;

use prost::Message;

const PROTOS: &[&str] = &[
    "kuryr/watcher/v1/watcher.proto",
    "kuryr/allocator/v1/allocator.proto",
    "kuryr/lbaas/v1/lbaas.proto",
    "kuryr/binder/v1/binder.proto",
    "kuryr/policy/v1/policy.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    for p in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    let fds = protox::compile(PROTOS, [&root])?;
    std::fs::write(out.join("kuryr_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
