//! Compiles `proto/payment/v1/payment.proto` with the `protoc` vendored by
//! `protoc-bin-vendored`: building needs no system protoc. The file descriptor set goes to
//! `$OUT_DIR/payment_v1_descriptor.bin`, for server reflection (`src/grpc/health.rs`).

use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let proto = root.join("payment/v1/payment.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // Undecodable request messages are INVALID_ARGUMENT, not tonic's INTERNAL (see
    // src/grpc/codec.rs).
    let descriptors = Path::new(&std::env::var("OUT_DIR")?).join("payment_v1_descriptor.bin");
    tonic_prost_build::configure()
        .file_descriptor_set_path(descriptors)
        .codec_path("crate::grpc::codec::PaymentCodec")
        .compile_with_config(config, &[proto], &[root])?;
    Ok(())
}
