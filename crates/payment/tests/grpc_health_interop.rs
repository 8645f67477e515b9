//! Interop of `grpc.health.v1` and server reflection with the reference gRPC implementation:
//! `tests/interop/grpcio_health_reflection.py` (Python `grpcio-health-checking` and
//! `grpcio-reflection`'s `ProtoReflectionDescriptorDatabase`) against a live service that
//! requires a bearer key, sending none.
//!
//! The same rules as `grpc_interop.rs`: `.ci/run` installs the Python packages and sets
//! `BACKSTOP_REQUIRE_INTEROP=1`, so there a missing `python3` or module fails the test;
//! elsewhere it is reported loudly and the test passes.

#[path = "../../backstop/tests/support/python.rs"]
mod python;
mod support;

use std::path::PathBuf;

use backstop_payment::config::ApiKey;
use python::{output_of, python_ready, python3};
use support::Harness;

#[tokio::test]
async fn grpcio_health_checks_and_reflection_resolve_payment_charge() {
    if !python_ready(
        "grpc, grpc_health.v1.health_pb2_grpc, \
         grpc_reflection.v1alpha.proto_reflection_descriptor_database",
        "gRPC health and reflection interop",
        "grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1",
    )
    .await
    {
        return;
    }
    let h = Harness::start_with(|c| {
        c.api_keys = vec![ApiKey::parse("acme=key-acme-0001").unwrap()];
    })
    .await;
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/grpcio_health_reflection.py");
    let stdout = output_of(
        "grpcio health/reflection client",
        python3()
            .arg(&script)
            .arg("--target")
            .arg(h.server.grpc_addr().to_string()),
    )
    .await;
    assert!(stdout.contains("health: ok"), "{stdout}");
    assert!(stdout.contains("reflection: ok"), "{stdout}");
}
