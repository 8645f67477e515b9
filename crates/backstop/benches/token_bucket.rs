//! Decision cost of backstop's token buckets against governor's, in one run.
//!
//! Groups:
//! - `direct/*`, `keyed/*`: a full `check()`, clock read included. Each limiter reads its own
//!   default clock (both: the time-stamp counter through quanta); governor is also run on
//!   tokio's clock (what backstop reads in tests on paused time), for comparison.
//! - `frozen/*`: the decision alone, the clock frozen (backstop: a fixed `now_ns` passed to
//!   `check_at`; governor: its `FakeRelativeClock`, and a clock returning one fixed
//!   `std::time::Instant`).
//! - `clock/*`: the cost of each clock read on its own.
//!
//! `allow` runs under a quota that always admits (the healthy case: one CAS per decision);
//! `deny` under an exhausted one (a load and a compare). Keyed runs cycle over 1 000 tenants.
//!
//! Run: `cargo bench -p backstop --bench token_bucket`

use std::hint::black_box;
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use backstop::admission::{KeyedTokenBucket, Quota, TokenBucket};
use criterion::{Criterion, criterion_group, criterion_main};
use governor::clock::FakeRelativeClock;
use governor::{Quota as GovQuota, RateLimiter};

/// governor frozen at one `std::time::Instant`.
#[derive(Debug, Clone)]
struct FrozenStdClock(std::time::Instant);

impl governor::clock::Clock for FrozenStdClock {
    type Instant = std::time::Instant;

    fn now(&self) -> std::time::Instant {
        black_box(self.0)
    }
}

/// governor reading tokio's clock.
#[derive(Debug, Clone, Default)]
struct TokioClock;

impl governor::clock::Clock for TokioClock {
    type Instant = std::time::Instant;

    fn now(&self) -> std::time::Instant {
        tokio::time::Instant::now().into_std()
    }
}

const TENANTS: usize = 1_000;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

/// (path, rate per second, burst)
const PATHS: [(&str, u32, u32); 2] = [("allow", 1_000_000_000, 1_000_000), ("deny", 1, 1)];

fn ours(rate: u32, burst: u32) -> TokenBucket {
    TokenBucket::new(nz(rate), nz(burst))
}

fn theirs(rate: u32, burst: u32) -> GovQuota {
    GovQuota::per_second(nz(rate)).allow_burst(nz(burst))
}

fn direct(c: &mut Criterion) {
    let mut group = c.benchmark_group("direct");
    for (path, rate, burst) in PATHS {
        let bucket = ours(rate, burst);
        group.bench_function(format!("{path}/backstop"), |b| {
            b.iter(|| black_box(bucket.check().is_ok()))
        });
        let gov = RateLimiter::direct(theirs(rate, burst));
        group.bench_function(format!("{path}/governor"), |b| {
            b.iter(|| black_box(gov.check().is_ok()))
        });
        let gov = RateLimiter::direct_with_clock(theirs(rate, burst), TokioClock);
        group.bench_function(format!("{path}/governor_tokio_clock"), |b| {
            b.iter(|| black_box(gov.check().is_ok()))
        });
    }
    group.finish();
}

fn keyed(c: &mut Criterion) {
    let tenants: Vec<String> = (0..TENANTS).map(|i| format!("tenant-{i:04}")).collect();
    let mut group = c.benchmark_group("keyed");
    for (path, rate, burst) in PATHS {
        let quota = Quota::per_second(nz(rate), nz(burst));
        let bucket =
            KeyedTokenBucket::new(quota, NonZeroUsize::new(10 * TENANTS).expect("non-zero"));
        let mut i = 0;
        group.bench_function(format!("{path}/backstop"), |b| {
            b.iter(|| {
                i = (i + 1) % TENANTS;
                black_box(bucket.check(&tenants[i]).is_ok())
            })
        });
        let gov = RateLimiter::<String, _, _>::keyed(theirs(rate, burst));
        group.bench_function(format!("{path}/governor"), |b| {
            b.iter(|| {
                i = (i + 1) % TENANTS;
                black_box(gov.check_key(&tenants[i]).is_ok())
            })
        });
        let gov =
            RateLimiter::<String, _, _, _>::dashmap_with_clock(theirs(rate, burst), TokioClock);
        group.bench_function(format!("{path}/governor_tokio_clock"), |b| {
            b.iter(|| {
                i = (i + 1) % TENANTS;
                black_box(gov.check_key(&tenants[i]).is_ok())
            })
        });
    }
    group.finish();
}

fn frozen(c: &mut Criterion) {
    let mut group = c.benchmark_group("frozen");
    // Short runs: with time frozen, `allow` only lasts while the 2^32-token burst does.
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));
    for (path, rate, burst) in [("allow", u32::MAX, u32::MAX), ("deny", 1, 1)] {
        let bucket = ours(rate, burst);
        let now_ns = bucket.clock().now_ns();
        group.bench_function(format!("{path}/backstop"), |b| {
            b.iter(|| black_box(bucket.check_at(black_box(now_ns)).is_ok()))
        });
        let gov = RateLimiter::direct_with_clock(theirs(rate, burst), FakeRelativeClock::default());
        group.bench_function(format!("{path}/governor"), |b| {
            b.iter(|| black_box(gov.check().is_ok()))
        });
        let gov = RateLimiter::direct_with_clock(
            theirs(rate, burst),
            FrozenStdClock(std::time::Instant::now()),
        );
        group.bench_function(format!("{path}/governor_std_instant"), |b| {
            b.iter(|| black_box(gov.check().is_ok()))
        });
    }
    group.finish();
}

/// What reading each clock costs, to split a full check into clock and decision.
fn clocks(c: &mut Criterion) {
    use governor::clock::Clock;
    let mut group = c.benchmark_group("clock");
    let ours = backstop::clock::MonotonicClock::new();
    group.bench_function("backstop_monotonic_clock_now", |b| {
        b.iter(|| black_box(ours.now_ns()))
    });
    group.bench_function("tokio_instant_now", |b| {
        b.iter(|| black_box(tokio::time::Instant::now()))
    });
    group.bench_function("std_instant_now", |b| {
        b.iter(|| black_box(std::time::Instant::now()))
    });
    let quanta = governor::clock::DefaultClock::default();
    group.bench_function("governor_default_clock_now", |b| {
        b.iter(|| black_box(quanta.now()))
    });
    group.finish();
}

criterion_group!(benches, direct, keyed, frozen, clocks);
criterion_main!(benches);
