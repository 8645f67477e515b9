//! Idempotency store throughput: claim + complete pairs per second on a SQLite file.
//!
//! One run measures, on the same machine and disk, each writer mode with 64 concurrent
//! callers, every caller claiming a fresh key and completing it:
//! - autocommit (`group_commit: false`, one transaction per claim and per completion) with
//!   `synchronous=FULL` and `NORMAL`;
//! - group commit (one transaction per batch of queued jobs) with `FULL` and `NORMAL`.
//!
//! `cargo bench -p backstop --bench store` (env `BENCH_SECS`, default 5, seconds per case;
//! `BENCH_CALLERS`, default 64).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use backstop::db::sqlite::{SqliteOptions, Synchronous};
use backstop::idempotency::sqlite::SqliteStore;
use backstop::idempotency::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Store, StoredResponse,
};
use bytes::Bytes;

struct Case {
    name: &'static str,
    synchronous: Synchronous,
    group_commit: bool,
}

struct Outcome {
    pairs_per_sec: f64,
    jobs_per_txn: f64,
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn run(case: &Case, callers: usize, secs: u64) -> Outcome {
    let dir = tempfile::tempdir().expect("tempdir");
    let options = SqliteOptions {
        synchronous: case.synchronous,
        group_commit: case.group_commit,
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(dir.path().join("bench.db"), options)
        .await
        .expect("open store");
    let fingerprint = Fingerprint::of_json(
        "POST /v1/payments",
        br#"{"order_id":"o-1","amount_cents":1999,"currency":"EUR"}"#,
    )
    .expect("json");
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Bytes::from_static(br#"{"intent_id":"pi_0123456789","status":"succeeded"}"#),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let pairs = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let (store, response) = (store.clone(), response.clone());
            let (stop, measuring, pairs) = (stop.clone(), measuring.clone(), pairs.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let now_ms = 1_700_000_000_000 + i as i64;
                    let req = ClaimRequest {
                        scope: "bench".into(),
                        key: IdempotencyKey::new(format!("c{caller}-{i}")).expect("key"),
                        fingerprint,
                        lease: Duration::from_secs(5),
                        ttl: Duration::from_secs(86_400),
                        now_ms,
                    };
                    let Claim::Claimed(lease) = store.claim(req).await.expect("claim") else {
                        panic!("fresh key not claimed");
                    };
                    store
                        .complete(&lease, response.clone(), now_ms + 1)
                        .await
                        .expect("complete");
                    if measuring.load(Ordering::Relaxed) {
                        pairs.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    // Warm up (file growth, statement caches), then measure.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = store.db().stats();
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let after = store.db().stats();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("caller");
    }
    let txns = (after.transactions - before.transactions).max(1);
    Outcome {
        pairs_per_sec: pairs.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
        jobs_per_txn: (after.jobs - before.jobs) as f64 / txns as f64,
    }
}

fn main() {
    let secs = env_or("BENCH_SECS", 5);
    let callers = env_or("BENCH_CALLERS", 64) as usize;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let cases = [
        Case {
            name: "autocommit, synchronous=FULL",
            synchronous: Synchronous::Full,
            group_commit: false,
        },
        Case {
            name: "autocommit, synchronous=NORMAL",
            synchronous: Synchronous::Normal,
            group_commit: false,
        },
        Case {
            name: "group commit, synchronous=FULL",
            synchronous: Synchronous::Full,
            group_commit: true,
        },
        Case {
            name: "group commit, synchronous=NORMAL",
            synchronous: Synchronous::Normal,
            group_commit: true,
        },
    ];
    println!(
        "SQLite idempotency store: claim+complete pairs/s, {callers} concurrent callers, {secs} s per case (WAL, file in a tempdir)"
    );
    let mut results = Vec::new();
    for case in &cases {
        let out = runtime.block_on(run(case, callers, secs));
        println!(
            "{:<34} {:>10.0} pairs/s   {:>6.1} jobs/transaction",
            case.name, out.pairs_per_sec, out.jobs_per_txn
        );
        results.push(out.pairs_per_sec);
    }
    println!(
        "group commit FULL / autocommit FULL = {:.1}x (target >= 4x)",
        results[2] / results[0]
    );
    println!(
        "group commit FULL / autocommit NORMAL = {:.1}x",
        results[2] / results[1]
    );
}
