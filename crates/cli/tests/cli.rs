//! What an operator meets first: start-up errors, help texts, log formats.

use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_backstop");

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("the binary runs")
}

#[test]
fn an_invalid_rust_log_is_a_one_line_start_up_error() {
    // `load` would otherwise send to this target: the error must come before anything starts.
    let out = run(
        &["load", "--target", "http://127.0.0.1:9", "--duration", "1s"],
        &[("RUST_LOG", "backstop=loud")],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: invalid RUST_LOG \"backstop=loud\""),
        "{stderr}"
    );
}

#[test]
fn a_bad_log_format_is_refused() {
    let out = run(&["--log-format", "xml", "psp"], &[]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("json") && stderr.contains("text"),
        "{stderr}"
    );
}

/// The first log line of `backstop [global...] psp` on a free port; the child is stopped after.
fn first_psp_log_line(global: &[&str]) -> String {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(BIN)
        .args(global)
        .args(["psp", "--listen", "127.0.0.1:0"])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let mut line = String::new();
    let read = BufReader::new(child.stderr.take().unwrap()).read_line(&mut line);
    let _ = child.kill();
    let _ = child.wait();
    read.expect("a log line");
    line
}

#[test]
fn logs_are_json_off_a_terminal_and_text_on_request() {
    let json = first_psp_log_line(&[]);
    let event: serde_json::Value = serde_json::from_str(&json).expect("a pipe gets JSON");
    assert_eq!(event["fields"]["message"], "starting psp", "{json}");
    let text = first_psp_log_line(&["--log-format", "text"]);
    assert!(
        serde_json::from_str::<serde_json::Value>(&text).is_err(),
        "{text}"
    );
    assert!(
        text.contains("INFO") && text.contains("starting psp"),
        "{text}"
    );
    assert!(
        !text.contains('\x1b'),
        "no colours off a terminal: {text:?}"
    );
    let chosen = first_psp_log_line(&["--log-format", "json"]);
    assert!(
        serde_json::from_str::<serde_json::Value>(&chosen).is_ok(),
        "{chosen}"
    );
}
