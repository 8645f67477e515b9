//! `backstop serve --config FILE`, `BACKSTOP_*` variables and `--print-config`, as an operator
//! runs them: precedence flag > environment > file > default, unknown keys and bad values
//! refused with the file and key named, secrets never printed, the printed settings usable as
//! a config file, and a service started from a file running with the file's settings.

#[path = "support/serve_process.rs"]
mod serve_process;
#[path = "../../backstop/tests/support/services.rs"]
mod services;

use std::path::Path;
use std::process::Output;

use serve_process::{BIN, serve_command};

/// `backstop ARGS` with only the variables in `env` set among `BACKSTOP_*` ones.
fn run(args: &[&str], env: &[(&str, &str)], dir: &Path) -> Output {
    let mut command = std::process::Command::new(BIN);
    command.current_dir(dir).args(args);
    for (name, _) in std::env::vars() {
        if name.starts_with("BACKSTOP_") || name == "OTEL_EXPORTER_OTLP_ENDPOINT" {
            command.env_remove(name);
        }
    }
    command.envs(env.iter().copied());
    command.output().expect("backstop runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The printed line of `key`: its value and where it came from.
fn setting(printed: &str, key: &str) -> (String, String) {
    let line = printed
        .lines()
        .find(|l| l.starts_with(&format!("{key} = ")))
        .unwrap_or_else(|| panic!("no `{key}` in\n{printed}"));
    let (value, source) = line.split_once(" # ").expect("a source comment");
    let value = value.trim_end().trim_start_matches(&format!("{key} = "));
    (value.to_owned(), source.to_owned())
}

const FILE: &str = r#"
max-inflight = 64
tenant-rate = 5
tenant-burst = 50
store = "postgres://app:s3cret@127.0.0.1:5432/test?password=pw-2nd"
api-key = ["acme=file-key-1", "globex=file-key-2"]
no-slow-start = true
drain-timeout = "3s"
"#;

#[test]
fn a_flag_beats_its_variable_which_beats_the_file_which_beats_the_default() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("backstop.toml"), FILE).unwrap();
    let out = run(
        &[
            "serve",
            "--config",
            "backstop.toml",
            "--tenant-rate",
            "7",
            "--print-config",
        ],
        &[
            ("BACKSTOP_MAX_INFLIGHT", "32"),
            ("BACKSTOP_TENANT_RATE", "9"),
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let printed = stdout(&out);
    assert_eq!(
        setting(&printed, "tenant-rate"),
        ("7".into(), "command line".into())
    );
    assert_eq!(
        setting(&printed, "max-inflight"),
        ("32".into(), "environment (BACKSTOP_MAX_INFLIGHT)".into())
    );
    assert_eq!(
        setting(&printed, "tenant-burst"),
        ("50".into(), "config file".into())
    );
    assert_eq!(
        setting(&printed, "no-slow-start"),
        ("true".into(), "config file".into())
    );
    assert_eq!(
        setting(&printed, "http"),
        ("\"127.0.0.1:8081\"".into(), "default".into())
    );
    // The file can also be named by the environment.
    let out = run(
        &["serve", "--print-config"],
        &[("BACKSTOP_CONFIG", "backstop.toml")],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        setting(&stdout(&out), "max-inflight"),
        ("64".into(), "config file".into())
    );
}

#[test]
fn secrets_are_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("backstop.toml"), FILE).unwrap();
    let out = run(
        &["serve", "--config", "backstop.toml", "--print-config"],
        &[("BACKSTOP_API_KEYS", "initech=env-key-3")],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let printed = stdout(&out);
    for secret in ["s3cret", "pw-2nd", "file-key-1", "file-key-2", "env-key-3"] {
        assert!(!printed.contains(secret), "{secret} printed:\n{printed}");
    }
    assert_eq!(
        setting(&printed, "store").0,
        "\"postgres://app:***@127.0.0.1:5432/test?password=***\""
    );
    assert!(
        printed.contains("# merchants with API keys (from every source): acme, globex, initech"),
        "{printed}"
    );
}

#[test]
fn the_printed_settings_read_back_as_the_same_settings() {
    let dir = tempfile::tempdir().unwrap();
    let file = "max-inflight = 64\nqueue-target = \"7ms\"\nfault-abort-percent = 2.5\n\
                redis = \"redis://127.0.0.1:6379/3\"\nno-slow-start = true\n";
    std::fs::write(dir.path().join("first.toml"), file).unwrap();
    let first = run(
        &["serve", "--config", "first.toml", "--print-config"],
        &[],
        dir.path(),
    );
    assert!(first.status.success(), "{}", stderr(&first));
    std::fs::write(dir.path().join("second.toml"), &first.stdout).unwrap();
    let second = run(
        &["serve", "--config", "second.toml", "--print-config"],
        &[],
        dir.path(),
    );
    assert!(second.status.success(), "{}", stderr(&second));
    let values = |printed: &str| -> Vec<String> {
        printed
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split(" # ").next().unwrap_or(l).trim_end().to_owned())
            .collect()
    };
    assert_eq!(values(&stdout(&first)), values(&stdout(&second)));
    assert_eq!(setting(&stdout(&second), "queue-target").0, "\"7ms\"");
    assert_eq!(
        setting(&stdout(&second), "fault-abort-percent").0,
        "\"2.5\""
    );
}

#[test]
fn unknown_keys_and_bad_values_are_refused_naming_the_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    for (body, expected) in [
        ("max-inflihgt = 64\n", "unknown key `max-inflihgt`"),
        (
            "max-inflight = \"lots\"\n",
            "`max-inflight`: invalid value 'lots'",
        ),
        ("max-inflight = [1, 2]\n", "`max-inflight` takes one value"),
        (
            "no-slow-start = \"yes\"\n",
            "`no-slow-start` is true or false",
        ),
        ("api-key = [1]\n", "`api-key` is a list of strings"),
        ("drain-timeout = \"11m\"\n", "`drain-timeout`"),
        ("[server]\nhttp = \"x\"\n", "unknown key `server`"),
        ("max-inflight = \n", "not TOML"),
    ] {
        std::fs::write(dir.path().join("bad.toml"), body).unwrap();
        let out = run(&["serve", "--config", "bad.toml"], &[], dir.path());
        assert_eq!(out.status.code(), Some(2), "{body}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains("config file bad.toml"), "{body}: {err}");
        assert!(err.contains(expected), "{body}: {err}");
    }
    let out = run(&["serve", "--config", "missing.toml"], &[], dir.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("config file missing.toml: cannot read it"));
    // Nothing was started: no store file was created by the refused runs.
    assert!(!dir.path().join("backstop.db").exists());
}

#[tokio::test]
async fn a_service_started_from_a_file_runs_with_its_settings() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("pay.db");
    std::fs::write(
        dir.path().join("backstop.toml"),
        format!(
            "max-inflight = 48\nstore = {:?}\nlimit = \"adaptive\"\nmin-inflight = 4\n",
            store.display().to_string()
        ),
    )
    .unwrap();
    let mut command = serve_command();
    command
        .current_dir(dir.path())
        .args(["--config", "backstop.toml"]);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let process = serve_process::spawn(command, &http).await;
    let log = process.listening.clone();
    assert_eq!(log["fields"]["max_inflight"], 48, "{log}");
    assert_eq!(log["fields"]["limit"], "adaptive", "{log}");
    assert!(store.exists(), "the file's store was opened");
}

#[test]
fn the_packaged_config_is_valid_and_keeps_the_state_in_the_state_directory() {
    // deploy/debian/backstop.toml, installed as /etc/backstop/backstop.toml: the systemd unit
    // starts `serve --config` with it, so a key `serve` refuses would stop the service.
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/debian/backstop.toml");
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        &[
            "serve",
            "--config",
            config.to_str().expect("a UTF-8 path"),
            "--print-config",
        ],
        &[],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let printed = stdout(&out);
    assert_eq!(
        setting(&printed, "store"),
        (
            "\"/var/lib/backstop/backstop.db\"".into(),
            "config file".into()
        )
    );
    assert_eq!(
        setting(&printed, "http"),
        ("\"127.0.0.1:8081\"".into(), "config file".into())
    );
    assert!(!dir.path().join("backstop.db").exists());
}

const POLICIES: &str = r#"
[[policies.route]]
match = "POST /v1/payments"
timeout = "20s"
key_ttl = "30d"
rate_class = "charges"

[policies.rate_class.charges]
rate = 1
burst = 1
"#;

#[tokio::test]
async fn the_files_policies_table_is_the_one_the_service_runs_by() {
    policies_in_effect("").await;
}

#[tokio::test]
async fn a_rate_class_of_the_files_table_is_shared_through_redis() {
    if !services::redis() {
        return;
    }
    let prefix = format!("serve-config-{}-{}:", std::process::id(), rand_suffix());
    policies_in_effect(&format!(
        "redis = {:?}\nredis-prefix = {prefix:?}\n",
        services::redis_url()
    ))
    .await;
    // The class's buckets are Redis's, under the prefix and the class's name.
    let client = redis::Client::open(services::redis_url()).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}class:charges:*"))
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(
        !keys.is_empty(),
        "no bucket of class charges under {prefix}"
    );
}

/// A suffix that keeps two runs of the suite apart in a shared Redis.
fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// A service started from a file holding `settings` and [`POLICIES`] refuses a merchant's
/// second payment by the `charges` class, and not its reads.
async fn policies_in_effect(settings: &str) {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("pay.db");
    std::fs::write(
        dir.path().join("backstop.toml"),
        format!(
            "store = {:?}\n{settings}{POLICIES}",
            store.display().to_string()
        ),
    )
    .unwrap();
    let mut command = serve_command();
    command
        .current_dir(dir.path())
        .args(["--config", "backstop.toml"]);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let process = serve_process::spawn(command, &http).await;
    let pay = |key: &'static str| {
        http.post(format!("{}/v1/payments", process.base))
            .header("idempotency-key", key)
            .json(&serde_json::json!({"order_id": key, "amount_cents": 100}))
            .send()
    };
    // The `charges` class holds one payment per merchant (burst 1, one a second): the first
    // is served, the next one is refused before its handler runs, with the wait named.
    let first = pay("policy-1").await.unwrap();
    assert_eq!(first.status(), 201, "{:?}", first.text().await);
    let second = pay("policy-2").await.unwrap();
    assert_eq!(second.status(), 429);
    assert!(second.headers().contains_key("retry-after"));
    // Reads spend the default class, untouched by the file.
    let read = http
        .get(format!("{}/v1/payments/pi_unknown", process.base))
        .send()
        .await
        .unwrap();
    assert_ne!(read.status(), 429);
}

#[test]
fn the_printed_policies_read_back_as_the_same_table() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("first.toml"), POLICIES).unwrap();
    let first = run(
        &["serve", "--config", "first.toml", "--print-config"],
        &[],
        dir.path(),
    );
    assert!(first.status.success(), "{}", stderr(&first));
    let printed = stdout(&first);
    for want in ["#   ", "Charge", "charges", "30d "] {
        assert!(printed.contains(want), "{want} missing from\n{printed}");
    }
    std::fs::write(dir.path().join("second.toml"), &first.stdout).unwrap();
    let second = run(
        &["serve", "--config", "second.toml", "--print-config"],
        &[],
        dir.path(),
    );
    assert!(second.status.success(), "{}", stderr(&second));
    // The settings (now from the file) and the table in effect are the same.
    let table = |printed: &str| -> Vec<String> {
        printed
            .lines()
            .filter(|l| !l.starts_with('#') || l.starts_with("#   "))
            .map(|l| l.split(" # ").next().unwrap_or(l).trim_end().to_owned())
            .collect()
    };
    assert_eq!(table(&stdout(&first)), table(&stdout(&second)));
}

#[test]
fn a_policies_table_the_service_cannot_run_by_is_refused_before_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    for (body, expected) in [
        (
            "[[policies.route]]\nmatch = \"POST /v1/payments\"\nidempotency = \"unsafe\"\n",
            "route POST /v1/payments is keyed by the service's handler and stays so",
        ),
        (
            "[[policies.route]]\nmatch = \"DELETE /v1/payments/{intent_id}\"\n",
            "the service has no such entry",
        ),
        (
            "[[policies.route]]\nmatch = \"POST /v1/payments\"\ntimeot = \"1s\"\n",
            "unknown field `timeot`",
        ),
        ("policies = 3\n", "`policies` is a table"),
    ] {
        std::fs::write(dir.path().join("bad.toml"), body).unwrap();
        let out = run(&["serve", "--config", "bad.toml"], &[], dir.path());
        assert_eq!(out.status.code(), Some(2), "{body}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains("config file bad.toml"), "{body}: {err}");
        assert!(err.contains(expected), "{body}: {err}");
    }
    assert!(!dir.path().join("backstop.db").exists());
}

/// SIGHUP reads the file's `[policies]` again: a valid table is in effect for the next
/// requests, a refused one leaves the table in effect as it was.
#[tokio::test]
async fn sighup_reloads_the_policies_and_a_refused_file_keeps_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("pay.db");
    let file = dir.path().join("backstop.toml");
    let write = |policies: &str| {
        std::fs::write(
            &file,
            format!("store = {:?}\n{policies}", store.display().to_string()),
        )
        .unwrap();
    };
    write("");
    let mut command = serve_command();
    command
        .current_dir(dir.path())
        .args(["--config", "backstop.toml"]);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut process = serve_process::spawn(command, &http).await;
    let pid = process.child.id().expect("running").to_string();
    let base = process.base.clone();
    let mut n = 0;
    let mut pay = || {
        n += 1;
        // No grpc-timeout: the budget is the policy's timeout.
        http.post(format!("{base}/v1/payments"))
            .header("idempotency-key", format!("reload-{n}"))
            .json(&serde_json::json!({"order_id": format!("reload-{n}"), "amount_cents": 100}))
            .send()
    };
    assert_eq!(pay().await.unwrap().status(), 201);

    // A budget of 1 ms cannot be served: such a payment is refused before its handler runs.
    write("[[policies.route]]\nmatch = \"POST /v1/payments\"\ntimeout = \"1ms\"\n");
    hangup(&pid, &mut process.logs, "policies reloaded").await;
    let refused = pay().await.unwrap();
    assert!(!refused.status().is_success(), "{}", refused.status());

    write("[[policies.route]]\nmatch = \"POST /v1/payments\"\nidempotency = \"unsafe\"\n");
    let line = hangup(&pid, &mut process.logs, "policy reload refused").await;
    assert!(line.contains("stays so"), "{line}");
    assert!(
        !pay().await.unwrap().status().is_success(),
        "the 1 ms table is still in effect"
    );

    write("[[policies.route]]\nmatch = \"POST /v1/payments\"\ntimeout = \"10s\"\n");
    hangup(&pid, &mut process.logs, "policies reloaded").await;
    assert_eq!(pay().await.unwrap().status(), 201);
}

/// Sends SIGHUP to `pid` and waits for the log line holding `expect`.
async fn hangup(
    pid: &str,
    logs: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    expect: &str,
) -> String {
    let status = std::process::Command::new("kill")
        .args(["-HUP", pid])
        .status()
        .unwrap();
    assert!(status.success());
    loop {
        let line = tokio::time::timeout(std::time::Duration::from_secs(60), logs.recv())
            .await
            .expect("the service logs the reload")
            .expect("the service runs");
        if line.contains(expect) {
            return line;
        }
    }
}
