//! Claim latency at a window boundary against mid-window: `cargo run --release -p backstop
//! --example window_boundary -- [DB_PATH | postgres://URL] [SECONDS] [CONCURRENCY]` (60 s, 64).
//!
//! **SQLite** (FULL, group commit): store time is the claims' own `now_ms`, so it can run faster
//! than the wall clock: it advances 0.5 ms per claim over 1-hour keys (150 s windows), so a
//! window goes by every 300,000 claims (about as many as a 1-hour window of a 24-hour class
//! holds at 116/s), about 10 s; a sweeper-like task calls `expire` every 60 s of store time, as
//! `serve`'s does.
//!
//! **PostgreSQL** (with `--features postgres`): the store places records by the database's own
//! clock, which cannot be hurried, so the keys are 1-minute keys, whose windows are 2.5 s wide:
//! a 60 s run crosses 24 boundaries in real time, each window sealing, being summarised and
//! (after its minute) dropped while the claims go on; `expire` runs every second.
//!
//! CONCURRENCY tasks (64) claim new random keys and complete them. Each claim's latency is filed
//! by where its store time falls in its window: the first 10 % ("boundary": a new table, an
//! empty index, the sealed window's summary being built) or the middle 80 % ("mid"). Prints
//! both p50/p99 and their ratio.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use backstop::db::sqlite::SqliteOptions;
use backstop::idempotency::sqlite::SqliteStore;
use backstop::idempotency::window::Window;
use backstop::idempotency::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Store, StoredResponse,
};

/// SQLite: store time each claim moves on, microseconds: at the ~30,000 claims/s two cores
/// take, a 150 s window goes by in about 10 s, so its first tenth is the first second.
const STEP_US: i64 = 500;
const T0: i64 = 1_700_000_000_000;

/// How the run tells time.
#[derive(Clone)]
enum StoreTime {
    /// Moved on by each claim (SQLite: the store's time is the claims' `now_ms`).
    PerClaim(Arc<AtomicI64>),
    /// The wall clock (PostgreSQL: the store's time is the database's clock).
    Wall,
}

impl StoreTime {
    /// The store time of the next claim.
    fn next(&self) -> i64 {
        match self {
            StoreTime::PerClaim(claims) => {
                T0 + claims.fetch_add(1, Ordering::Relaxed) * STEP_US / 1_000
            }
            StoreTime::Wall => wall_ms(),
        }
    }

    fn now(&self) -> i64 {
        match self {
            StoreTime::PerClaim(claims) => T0 + claims.load(Ordering::Relaxed) * STEP_US / 1_000,
            StoreTime::Wall => wall_ms(),
        }
    }
}

fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| "bench-window.db".into());
    let seconds: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(60);
    let concurrency: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(64);
    if path.starts_with("postgres://") {
        #[cfg(feature = "postgres")]
        {
            use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
            let store = PostgresStore::connect(&path, PostgresOptions::default()).await?;
            // 1-minute keys, 2.5 s windows; expire every second, as `serve --sweep-every 1s`.
            return run(
                store,
                StoreTime::Wall,
                Duration::from_secs(60),
                1_000,
                seconds,
                concurrency,
            )
            .await;
        }
        #[cfg(not(feature = "postgres"))]
        return Err("a PostgreSQL URL needs --features postgres".into());
    }
    let _ = std::fs::remove_file(&path);
    let store = SqliteStore::open(&path, SqliteOptions::default()).await?;
    // 1-hour keys, 150 s windows of store time; expire every 1/60 of a window, as `serve`'s
    // 60 s sweeps are of a 1-hour window.
    let time = StoreTime::PerClaim(Arc::new(AtomicI64::new(0)));
    let result = run(
        store,
        time,
        Duration::from_secs(3600),
        2_500,
        seconds,
        concurrency,
    )
    .await;
    let _ = std::fs::remove_file(&path);
    result
}

async fn run<S: Store + Clone + Send + Sync + 'static>(
    store: S,
    time: StoreTime,
    ttl: Duration,
    sweep_every_ms: i64,
    seconds: u64,
    concurrency: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let start = time.now();
    let end = Instant::now() + Duration::from_secs(seconds);
    let ttl_ms = ttl.as_millis() as i64;
    let sweeper = {
        let (store, time) = (store.clone(), time.clone());
        tokio::spawn(async move {
            let mut last = time.now();
            while Instant::now() < end {
                let now = time.now();
                if now - last >= sweep_every_ms {
                    last = now;
                    store.expire(now, 1_000).await.expect("expire");
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (store, time) = (store.clone(), time.clone());
            tokio::spawn(async move {
                let (mut boundary, mut mid) = (Vec::new(), Vec::new());
                let response = StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: "{}".into(),
                };
                while Instant::now() < end {
                    let now = time.next();
                    let req = ClaimRequest {
                        scope: "bench".into(),
                        key: IdempotencyKey::generate(),
                        fingerprint: Fingerprint::of_bytes("POST /", b"{}"),
                        lease: Duration::from_secs(5),
                        ttl,
                        now_ms: now,
                    };
                    let started = Instant::now();
                    let Claim::Claimed(lease) = store.claim(req).await.expect("claim") else {
                        panic!("a new key was not claimed")
                    };
                    let took = started.elapsed();
                    store
                        .complete(&lease, response.clone(), now + 1)
                        .await
                        .expect("complete");
                    let window = Window::of(ttl_ms, now);
                    let into = (now - window.start_ms()) as f64 / window.width_ms() as f64;
                    if into < 0.1 {
                        boundary.push(took);
                    } else if (0.1..0.9).contains(&into) {
                        mid.push(took);
                    }
                }
                (boundary, mid)
            })
        })
        .collect();
    let (mut boundary, mut mid) = (Vec::new(), Vec::new());
    for worker in workers {
        let (b, m) = worker.await?;
        boundary.extend(b);
        mid.extend(m);
    }
    sweeper.await?;
    let windows = (time.now() - start) / Window::of(ttl_ms, start).width_ms();
    boundary.sort();
    mid.sort();
    let pct = |v: &[Duration], p: f64| {
        v.get(((v.len() as f64 * p) as usize).min(v.len().saturating_sub(1)))
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    println!("windows_crossed {windows}");
    println!("claims_boundary {}", boundary.len());
    println!("claims_mid {}", mid.len());
    println!("boundary_p50_ms {:.3}", pct(&boundary, 0.5));
    println!("boundary_p99_ms {:.3}", pct(&boundary, 0.99));
    println!("mid_p50_ms {:.3}", pct(&mid, 0.5));
    println!("mid_p99_ms {:.3}", pct(&mid, 0.99));
    println!(
        "p99_ratio {:.2}",
        pct(&boundary, 0.99) / pct(&mid, 0.99).max(f64::MIN_POSITIVE)
    );
    Ok(())
}
