//! The live service against its own OpenAPI document, with a property-based API tester:
//! schemathesis (Python) reads `GET /openapi.json`, generates requests from it (valid ones,
//! boundary values, invalid ones, sequences) and checks every answer against the document:
//! documented status, headers, content type and body schema; schema-valid requests accepted;
//! invalid ones refused; undeclared methods answered 405. One more check of ours
//! (`tests/interop/schemathesis_hooks.py`): no input makes the service answer a 5xx other
//! than the documented 503 and 504 refusals.
//!
//! The same rules as `grpc_interop.rs`: `.ci/run` installs schemathesis and sets
//! `BACKSTOP_REQUIRE_INTEROP=1`, so there a missing `python3` or module fails the test;
//! elsewhere it is reported loudly and the test passes. The run is seeded, so a failure
//! reproduces.

#[path = "../../backstop/tests/support/python.rs"]
mod python;
mod support;

use std::num::NonZeroU32;
use std::path::PathBuf;

use python::{output_of, python_ready, python3};
use support::Harness;

#[tokio::test]
async fn every_answer_matches_the_openapi_document() {
    if !python_ready(
        "schemathesis",
        "the OpenAPI contract test",
        "schemathesis==4.32.5",
    )
    .await
    {
        return;
    }
    // Quotas out of the way: a 429 is documented, but the run should reach the handlers.
    let h = Harness::start_with(|c| {
        c.tenant_rate = NonZeroU32::new(1_000_000).unwrap();
        c.tenant_burst = NonZeroU32::new(1_000_000).unwrap();
    })
    .await;
    let hooks = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop");
    let stdout = output_of(
        "schemathesis (answers that do not match the document)",
        python3()
            .args([
                "-c",
                "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
                "run",
                &format!("{}/openapi.json", h.base),
                "--checks",
                "all",
                // Replaced by `only_refusals_are_5xx`: a 504 for a budget too small to pay is the
                // contract, not a server error.
                "--exclude-checks",
                "not_a_server_error",
                "--max-examples",
                "60",
                "--seed",
                "20261205",
                "--request-timeout",
                "20",
            ])
            .env("PYTHONPATH", &hooks)
            .env("SCHEMATHESIS_HOOKS", "schemathesis_hooks")
            .env("NO_COLOR", "1"),
    )
    .await;
    assert!(stdout.contains("No issues found"), "{stdout}");
}
