//! Cost of the retry primitives on the hot path: a budget deposit + withdrawal (one thread and
//! contended by several) and a backoff delay.
//!
//! `cargo bench -p backstop --bench retry`

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use backstop::retry::{Backoff, Jitter, RetryBudget};
use criterion::{Criterion, criterion_group, criterion_main};
use rand::{SeedableRng, rngs::SmallRng};

fn budget(c: &mut Criterion) {
    let mut group = c.benchmark_group("retry_budget");
    let b = RetryBudget::new(0.1, 20).expect("valid budget");
    group.bench_function("deposit_then_try_withdraw", |bench| {
        bench.iter(|| {
            b.deposit();
            black_box(b.try_withdraw())
        })
    });

    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    group.bench_function(
        format!("deposit_then_try_withdraw_{threads}_threads"),
        |bench| {
            bench.iter_custom(|iters| {
                let shared = RetryBudget::new(0.1, 20).expect("valid budget");
                let barrier = Arc::new(Barrier::new(threads));
                let handles: Vec<_> = (0..threads)
                    .map(|_| {
                        let b = shared.clone();
                        let barrier = Arc::clone(&barrier);
                        std::thread::spawn(move || {
                            barrier.wait();
                            let start = Instant::now();
                            for _ in 0..iters {
                                b.deposit();
                                black_box(b.try_withdraw());
                            }
                            start.elapsed()
                        })
                    })
                    .collect();
                // Wall time per operation pair as seen by one thread while all contend.
                handles
                    .into_iter()
                    .map(|h| h.join().expect("bench thread"))
                    .max()
                    .unwrap_or(Duration::ZERO)
            })
        },
    );
    group.finish();
}

fn backoff(c: &mut Criterion) {
    let mut group = c.benchmark_group("backoff_delay");
    let mut rng = SmallRng::seed_from_u64(1);
    for jitter in [
        Jitter::None,
        Jitter::Full,
        Jitter::Equal,
        Jitter::Decorrelated,
    ] {
        let b = Backoff::default().with_jitter(jitter);
        let mut prev = Duration::ZERO;
        let mut retry = 0u32;
        group.bench_function(jitter.as_str(), |bench| {
            bench.iter(|| {
                prev = b.delay(black_box(retry % 8), prev, &mut rng);
                retry = retry.wrapping_add(1);
                prev
            })
        });
    }
    group.finish();
}

criterion_group!(benches, budget, backoff);
criterion_main!(benches);
