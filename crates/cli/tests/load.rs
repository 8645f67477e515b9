//! `backstop load` as a real process against real servers on loopback: every logical request
//! charged once against a healthy service, and the retry ratio against a dead one (the naive
//! preset triples the load, the budget keeps it near its ratio). The `backstop` policy runs the
//! library's client stack, so its hedges, transparent retries and breaker show up in the report
//! too.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use backstop_payment::config::{Config, StoreLocation};
use backstop_payment::grpc::proto::payment_server::{Payment, PaymentServer};
use backstop_payment::grpc::proto::{ChargeRequest, ChargeResponse, GetChargeRequest};
use backstop_payment::server::Server;
use serde_json::Value;
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_backstop");

/// Runs `backstop load ... --json` and returns its summary.
async fn load(target: &str, extra: &[&str]) -> Value {
    let out = Command::new(BIN)
        .args(["load", "--target", target, "--json"])
        // Generous: the assertions count requests, they never time them.
        .args(["--timeout", "30s", "--concurrency", "100000"])
        .args(extra)
        .output()
        .await
        .expect("backstop load runs");
    assert!(
        out.status.success(),
        "load failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON summary on stdout")
}

/// The payment service on a SQLite store in `dir`, with its embedded PSP, on free ports.
async fn payment_server(dir: &tempfile::TempDir) -> Server {
    let mut config = Config::new(StoreLocation::Sqlite(dir.path().join("pay.db")));
    config.http = "127.0.0.1:0".parse().unwrap();
    config.grpc = "127.0.0.1:0".parse().unwrap();
    Server::bind(config).await.unwrap()
}

/// Every charge the PSP at `psp_url` holds.
async fn psp_charges(psp_url: &str) -> Vec<Value> {
    reqwest::get(format!("{psp_url}/v1/charges"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn every_logical_request_is_one_order_charged_once(protocol: &str) {
    let dir = tempfile::tempdir().unwrap();
    let server = payment_server(&dir).await;
    let psp_url = server.psp_url().to_owned();
    let target = match protocol {
        "grpc" => format!("grpc://{}", server.grpc_addr()),
        _ => server.url(),
    };
    let server = server.spawn();

    let s = load(&target, &["--rate", "200", "--duration", "1s"]).await;
    assert_eq!(s["logical_requests"], 200, "{s}");
    assert_eq!(s["skipped"], 0, "{s}");
    assert_eq!(s["unsent"], 0, "{s}");
    assert_eq!(s["outcomes"]["ok"], 200, "{s}");
    assert_eq!(s["retries"], 0, "{s}");
    assert_eq!(s["policy"], "backstop");
    assert_eq!(s["latency_ms"][0]["attempt"], "1");

    let charges = psp_charges(&psp_url).await;
    assert_eq!(charges.len(), 200, "one charge per logical request");
    let mut orders: Vec<_> = charges.iter().map(|c| c["reference"].clone()).collect();
    orders.sort_by_key(|o| o.to_string());
    orders.dedup();
    assert_eq!(orders.len(), 200, "no order charged twice");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_load_charges_every_order_once() {
    every_logical_request_is_one_order_charged_once("http").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_load_charges_every_order_once() {
    every_logical_request_is_one_order_charged_once("grpc").await;
}

/// A dependency that answers every request 503 without a Retry-After.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_up_requests_are_sent_but_left_out_of_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let server = payment_server(&dir).await;
    let (psp_url, target) = (server.psp_url().to_owned(), server.url());
    let server = server.spawn();

    let s = load(
        &target,
        &["--rate", "100", "--warmup", "500ms", "--duration", "1s"],
    )
    .await;
    assert_eq!(s["logical_requests"], 100, "{s}");
    assert_eq!(s["outcomes"]["ok"], 100, "{s}");
    assert_eq!(s["latency_ms"][0]["count"], 100, "{s}");
    assert_eq!(
        psp_charges(&psp_url).await.len(),
        150,
        "the 50 warm-up payments were sent and charged too"
    );
    server.shutdown().await.unwrap();
}

async fn dead_service() -> (String, Arc<AtomicU64>) {
    let hits = Arc::new(AtomicU64::new(0));
    let counted = hits.clone();
    let app = Router::new().route(
        "/v1/payments",
        post(move || {
            let hits = counted.clone();
            async move {
                hits.fetch_add(1, Ordering::Relaxed);
                StatusCode::SERVICE_UNAVAILABLE
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), hits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_without_a_budget_triple_the_load_on_a_dead_dependency() {
    let (url, hits) = dead_service().await;
    let n = 1000;
    let args = ["--rate", "2000", "--duration", "500ms"];

    let naive = load(&url, &[&args[..], &["--policy", "naive"]].concat()).await;
    assert_eq!(naive["logical_requests"], n, "{naive}");
    assert_eq!(naive["retries"], 2 * n, "{naive}");
    assert_eq!(naive["retry_ratio"], 2.0);
    assert_eq!(hits.swap(0, Ordering::Relaxed), 3 * n);

    let budgeted = load(&url, &[&args[..], &["--no-storm-alarm"]].concat()).await;
    // Shown with --nocapture: the figures BENCHMARKS.md quotes.
    eprintln!("naive: {naive}\nbudgeted: {budgeted}");
    assert_eq!(budgeted["logical_requests"], n, "{budgeted}");
    // Budget: ratio 0.1 of logical requests plus a burst of 20.
    let retries = budgeted["retries"].as_u64().unwrap();
    assert!(retries <= n / 10 + 20, "{budgeted}");
    assert!(budgeted["retry_ratio"].as_f64().unwrap() <= 0.12);
    assert!(
        budgeted["stop_reasons"]["budget_exhausted"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(hits.swap(0, Ordering::Relaxed), n + retries);

    // Issue 15, item 5: the storm alarm (on by default) stops retrying once the retries asked
    // for pass 0.2 per logical request: at most 1.02 attempts per logical request.
    let alarmed = load(&url, &args).await;
    eprintln!("storm alarm: {alarmed}");
    assert_eq!(alarmed["logical_requests"], n, "{alarmed}");
    let attempts = alarmed["attempts"].as_u64().unwrap();
    assert!(attempts * 100 <= n * 102, "{alarmed}");
    assert!(
        alarmed["stop_reasons"]["storm"].as_u64().unwrap() > 0,
        "{alarmed}"
    );
    assert_eq!(alarmed["storm_alarm"]["level"], "tripped", "{alarmed}");
    assert_eq!(hits.load(Ordering::Relaxed), attempts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_stops_sending_to_a_dead_dependency() {
    let (url, hits) = dead_service().await;
    let n = 500;
    let s = load(&url, &["--rate", "500", "--duration", "1s", "--breaker"]).await;
    assert_eq!(s["logical_requests"], n, "{s}");
    // The default breaker opens after 20 failures in its window and stays open for 5 s,
    // longer than the run: from then on logical requests are refused without being sent.
    assert!(
        s["stop_reasons"]["circuit_open"].as_u64().unwrap() > 0,
        "{s}"
    );
    assert!(s["unsent"].as_u64().unwrap() > 0, "{s}");
    let sent = hits.load(Ordering::Relaxed);
    assert!(sent < n, "{sent} sends: {s}");
    // The report counts what was sent, not what the breaker refused.
    assert_eq!(s["attempts"], sent, "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_that_never_reached_the_server_are_sent_again_transparently() {
    for scheme in ["http", "grpc"] {
        // A port nobody listens on: every connection is refused.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let s = load(
            &format!("{scheme}://{addr}"),
            &["--rate", "20", "--duration", "1s"],
        )
        .await;
        eprintln!("{scheme}, nobody listening: {s}");
        assert_eq!(s["logical_requests"], 20, "{s}");
        assert_eq!(s["outcomes"]["retryable"], 20, "{s}");
        // The budget (burst 20) pays for the first re-sends at least; each is a send of its
        // own, not a retry.
        let resent = s["transparent_retries"].as_u64().unwrap();
        assert!(resent > 0, "{s}");
        let retries = s["retries"].as_u64().unwrap();
        assert_eq!(
            s["attempts"].as_u64().unwrap(),
            20 + retries + resent,
            "{s}"
        );
    }
}

/// How long a stalled request waits unless the client gives up on it first: far longer than
/// any p95 of this run, so only a hedge gets its logical request answered before it ends.
const STALL: Duration = Duration::from_secs(20);

/// The payment service as a fleet whose one slow replica stalls the first copy of every
/// [`STALL_EVERY`]-th key after [`WARM_UP`] keys (a copy with a key seen before, a hedge, is
/// served by a fast replica). Counts the keys seen twice, and those of them that stalled.
#[derive(Debug, Clone, Default)]
struct SlowReplica {
    keys: Arc<Mutex<HashSet<String>>>,
    stalled: Arc<Mutex<HashSet<String>>>,
    copies: Arc<AtomicU64>,
    copies_of_stalled: Arc<AtomicU64>,
}

/// Keys answered at once before any stalls, enough for the client's latency window (20
/// samples) to know its p95.
const WARM_UP: usize = 100;
const STALL_EVERY: usize = 25;

impl SlowReplica {
    async fn charge(&self, key: String) {
        let stall = {
            let mut keys = self.keys.lock().unwrap();
            let first = keys.insert(key.clone());
            if !first {
                self.copies.fetch_add(1, Ordering::SeqCst);
                if self.stalled.lock().unwrap().contains(&key) {
                    self.copies_of_stalled.fetch_add(1, Ordering::SeqCst);
                }
            }
            let n = keys.len();
            let stall = first && n > WARM_UP && n % STALL_EVERY == 0;
            if stall {
                self.stalled.lock().unwrap().insert(key);
            }
            stall
        };
        if stall {
            // Ends early when the client drops the request (it got the hedge's answer).
            tokio::time::sleep(STALL).await;
        }
    }
}

#[tonic::async_trait]
impl Payment for SlowReplica {
    async fn charge(
        &self,
        request: tonic::Request<ChargeRequest>,
    ) -> Result<tonic::Response<ChargeResponse>, tonic::Status> {
        let key = request
            .metadata()
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        self.charge(key).await;
        Ok(tonic::Response::new(ChargeResponse {
            charge_id: "ch_1".into(),
            status: "succeeded".into(),
            amount_cents: request.into_inner().amount_cents,
            intent_id: "pi_1".into(),
        }))
    }

    async fn get_charge(
        &self,
        _request: tonic::Request<GetChargeRequest>,
    ) -> Result<tonic::Response<ChargeResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this test"))
    }
}

/// Serves `replica` over HTTP and gRPC; returns the target for `scheme`.
async fn serve_slow_replica(replica: &SlowReplica, scheme: &str) -> String {
    let app = match scheme {
        "grpc" => Router::new().route_service(
            "/payment.v1.Payment/{method}",
            PaymentServer::new(replica.clone()),
        ),
        _ => {
            let replica = replica.clone();
            Router::new().route(
                "/v1/payments",
                post(move |headers: HeaderMap| {
                    let replica = replica.clone();
                    async move {
                        let key = headers
                            .get("idempotency-key")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .to_owned();
                        replica.charge(key).await;
                        StatusCode::CREATED
                    }
                }),
            )
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("{scheme}://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_replica_is_hedged_around_with_the_same_key() {
    for scheme in ["http", "grpc"] {
        let replica = SlowReplica::default();
        let target = serve_slow_replica(&replica, scheme).await;
        // Hedges only after 1 s: the stalled requests (20 s) are, while a fast request slowed
        // by a loaded machine is not hedged and does not spend the budget the stalled ones
        // need (at the p95 alone, 30-odd such hedges once emptied it before the first stall).
        let s = load(
            &target,
            &["--rate", "200", "--duration", "1s", "--hedge-delay", "1s"],
        )
        .await;
        eprintln!("{scheme}, one slow replica: {s}");
        assert_eq!(s["logical_requests"], 200, "{s}");
        assert_eq!(s["outcomes"]["ok"], 200, "{s}");
        assert_eq!(s["retries"], 0, "{s}");
        // Four requests stalled; a copy of at least one came with the same key, sent by the
        // stack as a hedge, and answered the logical request: the stalled attempt was
        // cancelled. (Not "all four": a fast request slower than the p95 may be hedged too,
        // and hedges spend the budget the stalled ones would use.)
        let hedges = s["hedges"].as_u64().unwrap();
        assert!(hedges > 0, "{s}");
        assert!(replica.copies_of_stalled.load(Ordering::SeqCst) > 0, "{s}");
        // Only hedges make copies (a hedge whose race was already over may not arrive).
        assert!(replica.copies.load(Ordering::SeqCst) <= hedges, "{s}");
        assert!(
            s["attempt_outcomes"]["cancelled"].as_u64().unwrap() > 0,
            "{s}"
        );
        assert_eq!(replica.keys.lock().unwrap().len(), 200);
    }
}

#[tokio::test]
async fn bad_flags_are_refused_with_a_reason() {
    for (args, needle) in [
        (&["--target", "ftp://x"][..], "scheme"),
        (&["--target", "http://127.0.0.1:1", "--rate", "0"], "rate"),
        (
            &["--target", "http://127.0.0.1:1", "--duration", "soon"],
            "duration",
        ),
        (
            &["--target", "http://127.0.0.1:1", "--policy", "wild"],
            "wild",
        ),
    ] {
        let out = Command::new(BIN)
            .arg("load")
            .args(args)
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_series_adds_up_to_the_summary() {
    let (url, hits) = dead_service().await;
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("series.csv");
    let csv_arg = csv.to_str().unwrap();
    let naive = load(
        &url,
        &[
            "--rate",
            "400",
            "--duration",
            "1s",
            "--policy",
            "naive",
            "--series",
            csv_arg,
        ],
    )
    .await;
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("t_s,originals,retries,hedges,ok,rejected,timeout,failed,p50_ms,p99_ms")
    );
    let mut sums = [0u64; 7];
    for line in lines {
        let fields: Vec<&str> = line.split(',').collect();
        assert_eq!(fields.len(), 10, "{line}");
        for (sum, field) in sums.iter_mut().zip(&fields[1..8]) {
            *sum += field.parse::<u64>().unwrap();
        }
    }
    let [originals, retries, hedges, ok, rejected, timeout, failed] = sums;
    assert_eq!(originals, 400, "{text}");
    assert_eq!(retries, naive["retries"].as_u64().unwrap(), "{text}");
    assert_eq!(hedges, 0);
    assert_eq!(originals + retries, hits.load(Ordering::Relaxed));
    assert_eq!(ok + rejected + timeout + failed, 400, "{text}");

    // A path that cannot be written is refused before any request is sent.
    let out = Command::new(BIN)
        .args([
            "load",
            "--target",
            &url,
            "--series",
            "/nonexistent/dir/s.csv",
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot write --series"));
    assert_eq!(originals + retries, hits.load(Ordering::Relaxed));
}
