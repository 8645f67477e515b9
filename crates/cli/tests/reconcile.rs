//! `backstop reconcile` as a real process, against a real PSP simulator and a SQLite store
//! written by the real payment service: the dry run changes nothing, `--apply` refunds the
//! duplicate and settles the orphaned intent, a second `--apply` finds nothing; exit statuses
//! and flag errors as documented in `--help`. The same on PostgreSQL, skipped, saying so, when
//! PostgreSQL does not answer.

// The per-test PostgreSQL schema and the check that the server answers, shared with the
// library's and the payment service's tests.
#[path = "../../backstop/tests/support/postgres_schema.rs"]
mod postgres_schema;
#[path = "../../backstop/tests/support/services.rs"]
mod services;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use backstop_payment::config::{Config, PspTarget, StoreLocation};
use backstop_payment::intents::IntentStatus;
use backstop_payment::psp::{self, Charge, PspConfig, PspHandle};
use backstop_payment::reconcile::{ActionKind, Ledger};
use backstop_payment::server::Server;
use serde_json::{Value, json};
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_backstop");

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

async fn reconcile(args: &[&str]) -> Run {
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        Command::new(BIN)
            .arg("reconcile")
            .args(args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("reconcile finishes")
    .expect("the binary runs");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

async fn charges(psp: &PspHandle, order: &str) -> Vec<Charge> {
    psp.store()
        .list(Some(format!("default:{order}")))
        .await
        .unwrap()
}

/// Two orders paid through the service, then a charge for the second made at the PSP with
/// another effect key, and (on SQLite) an intent left running whose charge went through.
async fn seed(store: StoreLocation, psp: &PspHandle) {
    let sqlite = matches!(store, StoreLocation::Sqlite(_));
    let mut config = Config::new(store);
    config.http = "127.0.0.1:0".parse().unwrap();
    config.grpc = "127.0.0.1:0".parse().unwrap();
    config.psp = PspTarget::Url(psp.url());
    let server = Server::bind(config).await.expect("service starts").spawn();
    let client = http();
    for (key, order) in [("k-1", "o-1"), ("k-2", "o-2")] {
        let response = client
            .post(format!("{}/v1/payments", server.url()))
            .header("idempotency-key", key)
            .json(&json!({ "order_id": order, "amount_cents": 700 }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
    }
    let direct: &[(&str, &str)] = if sqlite {
        &[("manual-1", "o-2"), ("stuck-intent", "o-3")]
    } else {
        &[("manual-1", "o-2")]
    };
    for &(key, order) in direct {
        let response = client
            .post(format!("{}/v1/charges", psp.url()))
            .header("idempotency-key", key)
            .json(&json!({ "reference": format!("default:{order}"), "amount_cents": 700, "currency": "USD" }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
    }
    if !sqlite {
        server.shutdown().await.unwrap();
        return;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    server
        .intents()
        .db()
        .unwrap()
        .write(move |c| {
            c.execute_batch(&format!(
                "INSERT INTO payment_intent (intent_id, merchant_id, order_id, amount_cents, \
                 request_key, fingerprint, effect_key, status, psp_charge_id, created_at, \
                 currency) VALUES ('stuck-intent', 'default', 'o-3', 700, 'k-3', 'f', \
                 'stuck-intent', 'running', NULL, {now}, 'USD')"
            ))
        })
        .await
        .unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_then_apply_then_nothing_left() {
    let dir = tempfile::tempdir().unwrap();
    let psp = psp::spawn(PspConfig {
        db_path: Some(dir.path().join("psp.db")),
        ..PspConfig::default()
    })
    .await
    .unwrap();
    seed(StoreLocation::Sqlite(dir.path().join("pay.db")), &psp).await;
    let store = dir.path().join("pay.db");
    let store = store.to_str().unwrap();
    let url = psp.url();

    // The dry run (default, and explicit): two findings, exit 3, nothing changed.
    for extra in [&[][..], &["--dry-run"][..]] {
        let mut args = vec!["--store", store, "--psp", &url, "--json"];
        args.extend_from_slice(extra);
        let run = reconcile(&args).await;
        assert_eq!(run.code, Some(3), "{}{}", run.stdout, run.stderr);
        let report: Value = serde_json::from_str(&run.stdout).expect("one JSON object");
        assert_eq!(report["mode"], "dry_run");
        let mut kinds: Vec<&str> = report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["kind"].as_str().unwrap())
            .collect();
        kinds.sort_unstable();
        assert_eq!(kinds, ["duplicate_charge", "orphan_intent"], "{report:#}");
        assert_eq!(report["outcomes"], json!([]));
        // Not a terminal: no progress bar, and no log lines at the default level.
        assert_eq!(run.stderr, "");
        assert!(charges(&psp, "o-2").await.iter().all(Charge::is_live));
    }

    // The human table names the actions.
    let table = reconcile(&["--store", store, "--psp", &url]).await;
    assert_eq!(table.code, Some(3));
    assert!(
        table.stdout.contains("duplicate_charge"),
        "{}",
        table.stdout
    );
    assert!(table.stdout.contains("refund 7.00 USD"), "{}", table.stdout);
    assert!(table.stdout.contains("summary:"), "{}", table.stdout);

    // Apply: the charge made around the service is refunded, the stuck intent settled.
    let run = reconcile(&[
        "--store",
        store,
        "--psp",
        &url,
        "--apply",
        "--operator",
        "ci-operator",
        "--json",
    ])
    .await;
    assert_eq!(run.code, Some(3), "{}{}", run.stdout, run.stderr);
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(report["mode"], "apply");
    let outcomes = report["outcomes"].as_array().unwrap();
    assert_eq!(outcomes.len(), 2, "{report:#}");
    assert!(
        outcomes.iter().all(|o| o["result"] == "applied"),
        "{report:#}"
    );
    let o2 = charges(&psp, "o-2").await;
    assert_eq!(o2.iter().filter(|c| c.is_live()).count(), 1);
    let refunded = o2.iter().find(|c| !c.is_live()).unwrap();
    assert_eq!(refunded.effect_key, "manual-1");

    let ledger = Ledger::open(&StoreLocation::Sqlite(dir.path().join("pay.db")))
        .await
        .unwrap();
    let records = ledger.records().await.unwrap();
    assert_eq!(records.len(), 2);
    assert!(records.iter().all(|r| r.operator == "ci-operator"));
    let refund = records
        .iter()
        .find(|r| r.kind == ActionKind::RefundDuplicate)
        .unwrap();
    assert_eq!(refund.charge_id, refunded.charge_id);
    assert!(refund.refund_id.is_some());
    let stuck = ledger
        .intents()
        .get("default", "stuck-intent")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stuck.status, IntentStatus::Succeeded);

    // A second apply finds nothing and exits 0.
    let run = reconcile(&["--store", store, "--psp", &url, "--apply"]).await;
    assert_eq!(run.code, Some(0), "{}{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("nothing to fix"), "{}", run.stdout);
    assert_eq!(ledger.records().await.unwrap().len(), 2);
    psp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_apply_refunds_the_duplicate_and_a_second_apply_exits_0() {
    if !services::postgres() {
        return;
    }
    let schema = postgres_schema::Schema::create("reconcile_cli").await;
    let url = schema.store_url(None);
    let psp = psp::spawn(PspConfig::default()).await.unwrap();
    seed(StoreLocation::parse(&url).unwrap(), &psp).await;
    let psp_url = psp.url();

    let dry = reconcile(&["--store", &url, "--psp", &psp_url, "--json"]).await;
    assert_eq!(dry.code, Some(3), "{}{}", dry.stdout, dry.stderr);
    assert!(charges(&psp, "o-2").await.iter().all(Charge::is_live));

    let run = reconcile(&["--store", &url, "--psp", &psp_url, "--apply", "--json"]).await;
    assert_eq!(run.code, Some(3), "{}{}", run.stdout, run.stderr);
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(report["outcomes"][0]["result"], "applied", "{report:#}");
    let o2 = charges(&psp, "o-2").await;
    assert_eq!(o2.iter().filter(|c| c.is_live()).count(), 1);
    assert_eq!(schema.count("reconciliation").await, 1);

    let again = reconcile(&["--store", &url, "--psp", &psp_url, "--apply"]).await;
    assert_eq!(again.code, Some(0), "{}{}", again.stdout, again.stderr);
    assert_eq!(schema.count("reconciliation").await, 1);
    psp.shutdown().await;
}

#[tokio::test]
async fn flag_mistakes_exit_2_and_a_missing_store_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.db");
    let missing = missing.to_str().unwrap();
    for args in [
        &[
            "--store",
            missing,
            "--psp",
            "http://127.0.0.1:9",
            "--orders",
            "no-colon",
        ][..],
        &["--store", missing, "--psp", "127.0.0.1:9"][..],
        &[
            "--store",
            missing,
            "--psp",
            "http://127.0.0.1:9",
            "--since",
            "soon",
        ][..],
        &[
            "--store",
            missing,
            "--psp",
            "http://127.0.0.1:9",
            "--apply",
            "--dry-run",
        ][..],
    ] {
        let run = reconcile(args).await;
        assert_eq!(run.code, Some(2), "{args:?}: {}", run.stderr);
    }
    let run = reconcile(&["--store", missing, "--psp", "http://127.0.0.1:9"]).await;
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(run.stderr.contains("no payment store"), "{}", run.stderr);
    assert!(!Path::new(missing).exists());
}
