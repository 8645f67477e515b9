//! PostgreSQL store throughput: claim + complete pairs per second at a given concurrency.
//!
//! `bench/postgres.sh` runs this beside pgbench executing the same two statements; alone:
//!
//! ```text
//! cargo bench -p backstop --features postgres --bench postgres_store -- \
//!     --clients 32 --seconds 10 --mode batched    # or batched-matched, autocommit
//! ```
//!
//! Prints one line: `store mode=batched clients=32 pairs=... seconds=... pairs_per_s=...`.
//! Runs in the schema `bench_store` of `BACKSTOP_BENCH_POSTGRES`
//! (default `postgres://postgres@127.0.0.1:5432/test`), emptied first.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use backstop::db::postgres::tokio_postgres;
use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
use backstop::idempotency::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Store, StoredResponse,
};
use bytes::Bytes;

const T0: i64 = 1_700_000_000_000;
const SCHEMA: &str = "bench_store";
/// The body pgbench's script stores too (`bench/postgres_claim_complete.sql`).
const BODY: &[u8] =
    br#"{"id":"pi_0123456789","status":"succeeded","amount_cents":1000,"currency":"USD"}"#;

struct Args {
    clients: usize,
    seconds: u64,
    mode: String,
}

fn args() -> Args {
    let mut out = Args {
        clients: 32,
        seconds: 10,
        mode: "batched".to_owned(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--clients" => out.clients = it.next().and_then(|v| v.parse().ok()).unwrap_or(32),
            "--seconds" => out.seconds = it.next().and_then(|v| v.parse().ok()).unwrap_or(10),
            "--mode" => out.mode = it.next().unwrap_or_default(),
            // `cargo bench` passes `--bench`; anything else is ignored too.
            _ => {}
        }
    }
    out
}

#[tokio::main]
async fn main() {
    let args = args();
    let url = std::env::var("BACKSTOP_BENCH_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let (admin, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect to PostgreSQL");
    tokio::spawn(connection);
    admin
        .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        .await
        .expect("create schema");

    let mut config: tokio_postgres::Config = url.parse().expect("URL");
    config.options(format!("-c search_path={SCHEMA}"));
    let env = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    };
    let store = PostgresStore::connect_with(
        config,
        PostgresOptions {
            // batched: the store's defaults (tunable here). batched-matched: batching on, one
            // connection and one writer per caller, as pgbench has. autocommit: batching off,
            // one connection and one writer per caller.
            group_commit: args.mode != "autocommit",
            max_connections: env("BACKSTOP_BENCH_CONNECTIONS").unwrap_or(
                if args.mode == "batched" {
                    PostgresOptions::default().max_connections
                } else {
                    args.clients
                },
            ),
            writers: env("BACKSTOP_BENCH_WRITERS").unwrap_or(if args.mode == "batched" {
                PostgresOptions::default().writers
            } else {
                args.clients
            }),
            ..PostgresOptions::default()
        },
    )
    .await
    .expect("open store");
    admin
        .batch_execute(&format!("TRUNCATE {SCHEMA}.idempotency_key; CHECKPOINT"))
        .await
        .expect("empty the table");

    let fingerprint = Fingerprint::of_bytes("POST /v1/payments", b"{}");
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Bytes::from_static(BODY),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let pairs = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..args.clients)
        .map(|client| {
            let (store, fingerprint, response) = (store.clone(), fingerprint, response.clone());
            let (stop, pairs) = (Arc::clone(&stop), Arc::clone(&pairs));
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let req = ClaimRequest {
                        scope: "bench".into(),
                        key: IdempotencyKey::new(format!("{client}-{n}")).expect("key"),
                        fingerprint,
                        lease: Duration::from_secs(5),
                        ttl: Duration::from_secs(24 * 3600),
                        now_ms: T0,
                    };
                    let Claim::Claimed(lease) = store.claim(req).await.expect("claim") else {
                        panic!("fresh keys are always claimed");
                    };
                    store
                        .complete(&lease, response.clone(), T0)
                        .await
                        .expect("complete");
                    pairs.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("bench task");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let pairs = pairs.load(Ordering::Relaxed);
    let stats = store.writer_stats();
    println!(
        "store mode={} clients={} pairs={pairs} seconds={elapsed:.2} pairs_per_s={:.0} statements_per_round_trip={:.1}",
        args.mode,
        args.clients,
        pairs as f64 / elapsed,
        stats.jobs as f64 / stats.batches.max(1) as f64,
    );
}
