//! Compiles `proto/payment/v1/payment.proto` with the `protoc` vendored by
//! `protoc-bin-vendored`: building needs no system protoc.

use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let proto = root.join("payment/v1/payment.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // Undecodable request messages are INVALID_ARGUMENT, not tonic's INTERNAL (see
    // src/grpc/codec.rs).
    tonic_prost_build::configure()
        .codec_path("crate::grpc::codec::PaymentCodec")
        .compile_with_config(config, &[proto], &[root])?;
    Ok(())
}
