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
use std::process::Stdio;

use backstop_payment::config::ApiKey;
use python::python_ready;
use support::Harness;
use tokio::process::Command;

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
    let out = Command::new("python3")
        .arg(&script)
        .arg("--target")
        .arg(h.server.grpc_addr().to_string())
        .stdin(Stdio::null())
        // grpcio must not route loopback calls through a proxy from the environment.
        .env("no_grpc_proxy", "*")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .env_remove("grpc_proxy")
        .output()
        .await
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "grpcio health/reflection client failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("health: ok"), "{stdout}");
    assert!(stdout.contains("reflection: ok"), "{stdout}");
}
