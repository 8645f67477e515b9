//! Server for the HTTP overhead benchmark (`bench/http.sh`): one trivial JSON route served
//! three ways so a load generator can compare them in one run.
//!
//! `cargo run --release -p backstop --example http_bench_server -- MODE [DB_PATH]`, where MODE is
//! - `bare`: plain axum, the baseline;
//! - `stack`: the server stack without idempotency (deadline, metrics, tenant, rate limit, gate);
//! - `keyed`: the full stack, the route `Keyed` on a SQLite store (WAL, `synchronous=FULL`,
//!   group commit) at DB_PATH;
//! - `keyed_normal`: `keyed` with `synchronous=NORMAL` (no fsync on COMMIT; not durable):
//!   what the rest costs without the sync;
//! - `keyed_inline`: `keyed` with SQLite's own checkpoints inside the writer's COMMIT instead
//!   of the background checkpointer: what the latter saves;
//! - `keyed_memory`: the same on the in-memory store (not durable; isolates the layer's cost);
//! - `keyed_postgres` (with `--features postgres`): the same on the PostgreSQL store with its
//!   defaults, DB_PATH being the URL (`postgres://user@host/db?options=-c%20search_path%3DS`);
//! - `deadline`, `metrics`, `rate_limit`, `gate`: one layer alone, to attribute the cost;
//! - `handrolled`, `handrolled_normal`: what a team would write by hand instead: axum and
//!   rusqlite, one `Mutex<Connection>` (WAL; `synchronous=FULL`, or `NORMAL`), autocommit per
//!   statement: look the key up, insert it `running`, run the handler, store the answer. The
//!   same table shape and the same answers as `keyed`, none of its batching.
//!
//! Prints `listening on ADDR` once it accepts connections (port chosen by the OS), and in
//! the SQLite `keyed` modes, on SIGTERM, how many write jobs the SQLite writer committed in how many
//! transactions.
use std::time::Duration;

use axum::{Json, Router, http::StatusCode, routing::post};
use std::num::{NonZeroU32, NonZeroUsize};

use backstop::admission::{Gate, KeyedTokenBucket, Quota};
use backstop::clock::{Clock, SystemClock};
use backstop::db::sqlite::{SqliteOptions, Synchronous};
use backstop::idempotency::MemoryStore;
use backstop::idempotency::sqlite::SqliteStore;
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
use backstop::server::{DeadlineLayer, GateLayer, MetricsLayer, RateLimitLayer, ServerStack};
use http::Method;
use serde_json::Value;

/// The allocator the `backstop` binary ships with, so the bench measures what is served.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Quotas far above what the load reaches: the bench measures the cost of the checks.
fn buckets() -> KeyedTokenBucket {
    let quota = Quota::per_second(NonZeroU32::MAX, NonZeroU32::MAX);
    KeyedTokenBucket::new(quota, NonZeroUsize::new(10_000).expect("non-zero"))
}

fn gate() -> Gate {
    Gate::new(4096, Duration::from_millis(1))
}

async fn echo(Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    (StatusCode::CREATED, Json(body))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "bare".into());
    let db = args.next().unwrap_or_else(|| "bench-http.db".into());
    // Record metrics for real, as a served process would.
    let handle = backstop::observe::with_duration_buckets(
        metrics_exporter_prometheus::PrometheusBuilder::new(),
    )
    .install_recorder()?;
    // As `backstop serve` does every 5 s: drains the histograms' sample buffers.
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_secs(5));
            handle.run_upkeep();
        }
    });

    let router = Router::new().route("/v1/payments", post(echo));
    let options = SqliteOptions {
        // `keyed_normal` bounds what durability costs: no fsync on COMMIT.
        synchronous: if mode == "keyed_normal" {
            Synchronous::Normal
        } else {
            Synchronous::Full
        },
        background_checkpoint: mode != "keyed_inline",
        ..SqliteOptions::default()
    };
    // The SQLite store only where a mode serves from it (`keyed_postgres`' DB_PATH is a URL).
    let store = if matches!(
        mode.as_str(),
        "stack" | "keyed" | "keyed_normal" | "keyed_inline"
    ) {
        let store = SqliteStore::open(&db, options).await?;
        // The sealed windows' summaries, built before serving as a long-running service has
        // them: the measured seconds are its steady state.
        store.upkeep(SystemClock.now_ms()).await?;
        Some(store)
    } else {
        None
    };
    let writer = matches!(mode.as_str(), "keyed" | "keyed_normal" | "keyed_inline")
        .then(|| store.as_ref().map(|s| s.db().clone()))
        .flatten();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            term.recv().await;
            if let Some(stats) = writer.map(|db| db.stats()) {
                println!(
                    "sqlite: {} jobs in {} transactions",
                    stats.jobs, stats.transactions
                );
            }
            std::process::exit(0);
        }
    });
    let sqlite_stack = || {
        let store = store.clone().expect("opened for this mode");
        ServerStack::new("bench", store)
            .tenant_buckets(buckets())
            .gate(gate())
    };
    let app = match mode.as_str() {
        "bare" => router,
        "stack" => router.layer(sqlite_stack().into_layer()),
        "keyed" | "keyed_normal" | "keyed_inline" => {
            router.layer(sqlite_stack().policies(keyed_payments()).into_layer())
        }
        // The same on the in-memory store: the idempotency layer's own cost, without SQLite.
        "keyed_memory" => router.layer(
            ServerStack::new("bench", MemoryStore::new())
                .tenant_buckets(buckets())
                .gate(gate())
                .policies(keyed_payments())
                .into_layer(),
        ),
        #[cfg(feature = "postgres")]
        "keyed_postgres" => {
            use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
            let store = PostgresStore::connect(&db, PostgresOptions::default()).await?;
            // As for SQLite: the summaries built before serving.
            store.summarise().await?;
            router.layer(
                ServerStack::new("bench", store)
                    .tenant_buckets(buckets())
                    .gate(gate())
                    .policies(keyed_payments())
                    .into_layer(),
            )
        }
        // One layer alone, to attribute the stack's cost.
        "deadline" => router.layer(DeadlineLayer::default()),
        "metrics" => router.layer(MetricsLayer::new("bench")),
        "rate_limit" => router.layer(RateLimitLayer::new(buckets())),
        "gate" => router.layer(GateLayer::new(gate())),
        "handrolled" | "handrolled_normal" => handrolled::router(&db, mode == "handrolled_normal")?,
        other => {
            return Err(format!(
                "unknown mode {other:?}: bare | stack | keyed | keyed_normal | keyed_inline | keyed_memory | \
             deadline | metrics | rate_limit | gate | handrolled | handrolled_normal | \
             keyed_postgres (with --features postgres)"
            )
            .into());
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// The baseline a team would write by hand: see the module docs.
/// `POST /v1/payments` keyed, its answers kept for the payments TTL.
fn keyed_payments() -> MethodPolicies {
    let pay = MethodPolicy::builder("Pay", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .build();
    MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build()).route(
        Method::POST,
        "/v1/payments",
        pay,
    )
}

mod handrolled {
    use std::sync::{Arc, Mutex, PoisonError};

    use axum::Router;
    use axum::body::Bytes;
    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode, header};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use rusqlite::{Connection, OptionalExtension, params};
    use sha2::{Digest, Sha256};

    type Db = Arc<Mutex<Connection>>;

    pub(crate) fn router(path: &str, normal: bool) -> Result<Router, rusqlite::Error> {
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", if normal { "NORMAL" } else { "FULL" })?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS idempotency (
                 key TEXT PRIMARY KEY,
                 fingerprint BLOB NOT NULL,
                 status TEXT NOT NULL,
                 response BLOB,
                 created_at INTEGER NOT NULL
             )",
        )?;
        let db: Db = Arc::new(Mutex::new(conn));
        Ok(Router::new()
            .route("/v1/payments", post(pay))
            .with_state(db))
    }

    fn now_ms() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64)
    }

    async fn pay(State(db): State<Db>, headers: HeaderMap, body: Bytes) -> Response {
        let Some(key) = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
        else {
            return (StatusCode::BAD_REQUEST, "missing Idempotency-Key").into_response();
        };
        if serde_json::from_slice::<serde_json::Value>(&body).is_err() {
            return (StatusCode::BAD_REQUEST, "invalid JSON").into_response();
        }
        let fingerprint = Sha256::digest(&body).to_vec();
        let answer =
            tokio::task::spawn_blocking(move || handle(&db, &key, &fingerprint, body)).await;
        match answer {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
            Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        }
    }

    /// One statement per lock, each its own transaction, as a first version would do it.
    fn handle(
        db: &Db,
        key: &str,
        fingerprint: &[u8],
        body: Bytes,
    ) -> Result<Response, rusqlite::Error> {
        let lock = || db.lock().unwrap_or_else(PoisonError::into_inner);
        let seen: Option<(Vec<u8>, String, Option<Vec<u8>>)> = lock()
            .query_row(
                "SELECT fingerprint, status, response FROM idempotency WHERE key = ?1",
                params![key],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        match seen {
            Some((stored, _, _)) if stored != fingerprint => {
                return Ok((StatusCode::CONFLICT, "idempotency key reused").into_response());
            }
            Some((_, status, Some(response))) if status == "succeeded" => {
                return Ok(created(response));
            }
            Some(_) => return Ok((StatusCode::CONFLICT, "in progress").into_response()),
            None => {}
        }
        let inserted = lock().execute(
            "INSERT INTO idempotency (key, fingerprint, status, created_at)
             VALUES (?1, ?2, 'running', ?3) ON CONFLICT (key) DO NOTHING",
            params![key, fingerprint, now_ms()],
        )?;
        if inserted == 0 {
            return Ok((StatusCode::CONFLICT, "in progress").into_response());
        }
        // The handler: the same echo as the other modes.
        let response = body.to_vec();
        lock().execute(
            "UPDATE idempotency SET status = 'succeeded', response = ?1 WHERE key = ?2",
            params![response, key],
        )?;
        Ok(created(response))
    }

    fn created(body: Vec<u8>) -> Response {
        (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}
