//! Decisions per second of [`RedisTokenBucket`] against a running Redis: `TASKS` concurrent
//! tasks (default 50), each taking `TOTAL / TASKS` decisions one after the other (no
//! pipelining within a task), for tenants drawn from `KEYSPACE` (default 10,000) ids shaped
//! like redis-benchmark's `__rand_int__` (twelve digits). `bench/redis.sh` runs it beside
//! `redis-benchmark` sending the same script by EVALSHA.
//!
//! ```sh
//! cargo run --release -p backstop --features redis --example redis_bucket_bench
//! ```
//!
//! Environment: `REDIS_URL` (redis://127.0.0.1:6379), `TOTAL` (200000), `TASKS` (50),
//! `CONNECTIONS` (multiplexed connections, 1), `KEYSPACE` (10000), `RATE` (per tenant and
//! second, 1000), `BURST` (100), `PREFIX` (bench:rl:). Prints one line:
//! `decisions=N seconds=S decisions_per_sec=R allowed=A`.

use std::num::{NonZeroU32, NonZeroUsize};
use std::str::FromStr;
use std::time::Instant;

use backstop::admission::Quota;
use backstop::admission::redis::{RedisConfig, RedisTokenBucket};
use rand::RngExt;

fn env<T: FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url: String = env("REDIS_URL", "redis://127.0.0.1:6379".to_owned());
    let total: usize = env("TOTAL", 200_000);
    let tasks: usize = env("TASKS", 50);
    let connections: NonZeroUsize = env("CONNECTIONS", NonZeroUsize::MIN);
    let keyspace: u64 = env("KEYSPACE", 10_000);
    let rate: NonZeroU32 = env("RATE", NonZeroU32::new(1_000).unwrap());
    let burst: NonZeroU32 = env("BURST", NonZeroU32::new(100).unwrap());
    let prefix: String = env("PREFIX", "bench:rl:".to_owned());

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let config = RedisConfig::new(&url)?
            .prefix(prefix)
            .connections(connections);
        let bucket = RedisTokenBucket::new(&config, Quota::per_second(rate, burst))?;
        // Connect and load the script before the clock starts.
        let _ = bucket.check("warm-up").await?;

        let per_task = total / tasks;
        let started = Instant::now();
        let mut handles = Vec::with_capacity(tasks);
        for _ in 0..tasks {
            let bucket = bucket.clone();
            handles.push(tokio::spawn(async move {
                let mut allowed = 0usize;
                let mut tenant = String::with_capacity(12);
                for _ in 0..per_task {
                    tenant.clear();
                    let id = rand::rng().random_range(0..keyspace);
                    std::fmt::Write::write_fmt(&mut tenant, format_args!("{id:012}"))
                        .expect("writing to a String");
                    if bucket.check(&tenant).await?.is_ok() {
                        allowed += 1;
                    }
                }
                Ok::<_, backstop::admission::redis::RedisLimitError>(allowed)
            }));
        }
        let mut allowed = 0;
        for handle in handles {
            allowed += handle.await??;
        }
        let seconds = started.elapsed().as_secs_f64();
        let decisions = per_task * tasks;
        println!(
            "decisions={decisions} seconds={seconds:.3} decisions_per_sec={:.0} allowed={allowed}",
            decisions as f64 / seconds
        );
        Ok(())
    })
}
