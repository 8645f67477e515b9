//! Whether `python3` with the interop packages a test drives is here: shared by the tests that
//! check backstop against Python grpcio.

use std::process::Stdio;

use tokio::process::Command;

/// Whether `python3` imports `modules` (`"grpc, grpc_tools"`). When it does not, the test is
/// skipped with a message naming `what` needs them and the `pip install` line, or fails when
/// `BACKSTOP_REQUIRE_INTEROP=1` (as CI sets it).
pub(crate) async fn python_ready(modules: &str, what: &str, install: &str) -> bool {
    let probe = Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .stdin(Stdio::null())
        .output()
        .await;
    let ready = matches!(&probe, Ok(out) if out.status.success());
    if !ready {
        let why = match &probe {
            Ok(out) => String::from_utf8_lossy(&out.stderr).into_owned(),
            Err(e) => e.to_string(),
        };
        let required = std::env::var_os("BACKSTOP_REQUIRE_INTEROP").is_some_and(|v| v == "1");
        assert!(!required, "{what} needs python3 with {modules}: {why}");
        eprintln!(
            "\n!!! SKIPPED {what}: python3 with {modules} is missing ({why}).\n\
             !!! pip install {install} to run it.\n"
        );
    }
    ready
}

/// `python3`, set up for a test against a server on loopback: stdin closed, and no proxy from
/// the environment (grpcio and HTTP clients would send loopback calls through one).
pub(crate) fn python3() -> Command {
    let mut command = Command::new("python3");
    command.stdin(Stdio::null()).env("no_grpc_proxy", "*");
    for proxy in [
        "http_proxy",
        "https_proxy",
        "grpc_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
    ] {
        command.env_remove(proxy);
    }
    command
}

/// Runs `command` and returns its standard output; panics with both outputs, naming `what`,
/// unless it exits 0.
pub(crate) async fn output_of(what: &str, command: &mut Command) -> String {
    let out = command.output().await.expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
