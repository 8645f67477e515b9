//! Interop with the reference gRPC implementation: `tests/interop/grpcio_client.py` (Python
//! `grpcio`, stubs generated from the repository's .proto by `grpcio-tools`) against a live
//! service.
//!
//! `.ci/run` installs the Python packages and sets `BACKSTOP_REQUIRE_INTEROP=1`: there a missing
//! `python3` or `grpcio` fails the test. Elsewhere it is reported loudly and the test passes,
//! so a machine without Python can still run `cargo test`.

#[path = "../../backstop/tests/support/python.rs"]
mod python;
mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use backstop_payment::grpc::proto::ChargeRequest;
use backstop_payment::grpc::proto::payment_client::PaymentClient;
use python::{output_of, python_ready, python3};
use support::Harness;

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the script with `args`; panics with its output unless it exits 0.
async fn run_script(h: &Harness, args: &[&str]) -> String {
    let script = manifest_dir().join("tests/interop/grpcio_client.py");
    let proto_root = manifest_dir().join("../../proto");
    output_of(
        "grpcio client",
        python3()
            .arg(&script)
            .arg("--proto-root")
            .arg(&proto_root)
            .arg("--target")
            .arg(h.server.grpc_addr().to_string())
            .args(args),
    )
    .await
}

#[tokio::test]
async fn grpcio_client_charges_with_deadlines_and_metadata() {
    if !python_ready(
        "grpc, grpc_tools",
        "gRPC interop",
        "grpcio==1.85.1 grpcio-tools==1.85.1",
    )
    .await
    {
        return;
    }
    let h = Harness::start().await;
    let out = run_script(&h, &["basic"]).await;
    assert!(out.contains("basic: ok"), "{out}");
    assert_eq!(h.charges("py-order-1").await.len(), 1, "charged once");
    assert!(h.charges("py-order-3").await.is_empty());
}

#[tokio::test]
async fn grpcio_retry_policy_honours_our_pushback() {
    if !python_ready(
        "grpc, grpc_tools",
        "gRPC interop",
        "grpcio==1.85.1 grpcio-tools==1.85.1",
    )
    .await
    {
        return;
    }
    let h = Arc::new(Harness::start_with(|c| c.lease = Duration::from_secs(1)).await);
    h.latency(Duration::from_millis(1500));
    // The first attempt holds the key while the PSP is slow; its lease is its deadline.
    let first = {
        let h = Arc::clone(&h);
        tokio::spawn(async move {
            let mut client = PaymentClient::connect(format!("http://{}", h.server.grpc_addr()))
                .await
                .unwrap();
            let mut request = tonic::Request::new(ChargeRequest {
                order_id: "py-order-retry".into(),
                amount_cents: 700,
                currency: String::new(),
            });
            request
                .metadata_mut()
                .insert("idempotency-key", "py-retry-key".parse().unwrap());
            request.set_timeout(Duration::from_millis(2500));
            client.charge(request).await
        })
    };
    while h.idempotency_rows().await < 1 {
        tokio::task::yield_now().await;
    }
    let out = run_script(
        &h,
        &[
            "retry",
            "--key",
            "py-retry-key",
            "--order",
            "py-order-retry",
        ],
    )
    .await;
    assert!(out.contains("retry: ok"), "{out}");
    let first = first.await.unwrap().expect("the first attempt succeeds");
    assert_eq!(first.into_inner().status, "succeeded");
    assert_eq!(h.charges("py-order-retry").await.len(), 1, "charged once");
}
