//! What the client stack and the server stack cost per call on their own, without a network:
//! each wraps a trivial in-process service, and the bare service is measured in the same run.
//!
//! The transport benchmark (`rpc_overhead` in the payment crate) says how much of a loopback
//! RPC the stacks take; this one says where, and profiles cleanly.
//!
//! `cargo bench -p backstop --bench stacks`

use std::alloc::System;
use std::convert::Infallible;
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::{Duration, Instant};

use backstop::admission::{Gate, KeyedTokenBucket, Quota};
use backstop::client::replay::ReplayBody;
use backstop::client::{ClientStack, Destination};
use backstop::idempotency::MemoryStore;
use backstop::policy::{Idempotency, MethodPolicies, MethodPolicy};
use backstop::server::{ServerStack, ServerStackBody};
use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{Method, Request, Response};
use http_body_util::Full;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tower::{Layer, ServiceExt, service_fn};

/// Counts heap allocations, so the report can say how many each call makes.
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Installs the Prometheus recorder once, as `backstop serve` does: the stacks' metric handles
/// are then registered and cached as in production, rather than rebuilt for the no-op recorder.
fn install_recorder() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let handle = backstop::observe::with_duration_buckets(
            metrics_exporter_prometheus::PrometheusBuilder::new(),
        )
        .install_recorder()
        .expect("no other recorder");
        // As `backstop serve` does every 5 s: drains the histograms' sample buffers.
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(5));
                handle.run_upkeep();
            }
        });
    });
}

/// Heap allocations per call of `call`, averaged over 1,000 calls after a warm-up.
fn allocations_per_call<F, Fut>(runtime: &tokio::runtime::Runtime, call: F) -> f64
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    runtime.block_on(async {
        for _ in 0..100 {
            call().await;
        }
        let region = Region::new(GLOBAL);
        for _ in 0..1000 {
            call().await;
        }
        let change = region.change();
        (change.allocations + change.reallocations) as f64 / 1000.0
    })
}

const BODY: &[u8] = br#"{"order_id":"o-1","amount_cents":100}"#;

fn request() -> Request<Full<Bytes>> {
    Request::post("http://bench/v1/echo")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(BODY)))
        .expect("valid request")
}

/// Runs `iters` calls of `call` one after another on a current-thread runtime.
fn run<F, Fut>(runtime: &tokio::runtime::Runtime, iters: u64, call: F) -> Duration
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    runtime.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            call().await;
        }
        start.elapsed()
    })
}

fn client(c: &mut Criterion) {
    install_recorder();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("client_stack");

    let bare = service_fn(|_r: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
    });
    let call_bare = || async {
        let response = bare.oneshot(request()).await.expect("bare");
        assert!(response.status().is_success());
    };
    eprintln!(
        "client_stack/bare: {:.1} allocations per call",
        allocations_per_call(&runtime, call_bare)
    );
    group.bench_function("bare", |b| {
        b.iter_custom(|iters| run(&runtime, iters, call_bare))
    });

    let transport = service_fn(|_r: Request<ReplayBody<Full<Bytes>>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
    });
    for (name, hedging) in [("stack", false), ("stack_hedging", true)] {
        let destination = Destination::new("bench");
        let contract = MethodPolicy::builder("Echo", Idempotency::Safe)
            .timeout(Duration::from_secs(10))
            .hedging(hedging)
            .build();
        let stack = ClientStack::builder(&destination, contract)
            .build()
            .expect("valid stack")
            .layer(transport);
        let call_stack = || async {
            let response = stack.clone().oneshot(request()).await.expect("stack");
            assert!(response.status().is_success());
        };
        eprintln!(
            "client_stack/{name}: {:.1} allocations per call",
            allocations_per_call(&runtime, call_stack)
        );
        group.bench_function(name, |b| {
            b.iter_custom(|iters| run(&runtime, iters, call_stack))
        });
    }
    group.finish();
}

fn server(c: &mut Criterion) {
    install_recorder();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("server_stack");
    let handler = service_fn(|_r: Request<axum::body::Body>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::from("{}")))
    });
    let request = || request().map(axum::body::Body::new);
    let call_bare = || async {
        let response = handler.oneshot(request()).await.expect("bare");
        assert!(response.status().is_success());
    };
    eprintln!(
        "server_stack/bare: {:.1} allocations per call",
        allocations_per_call(&runtime, call_bare)
    );
    group.bench_function("bare", |b| {
        b.iter_custom(|iters| run(&runtime, iters, call_bare))
    });

    // Limits far above the offered load: this measures the layers, not their refusals.
    let quota = Quota::per_second(
        NonZeroU32::new(100_000_000).expect("non-zero"),
        NonZeroU32::new(100_000_000).expect("non-zero"),
    );
    let stack = ServerStack::new("bench", MemoryStore::new())
        .tenant_buckets(KeyedTokenBucket::new(
            quota,
            NonZeroUsize::new(1024).expect("non-zero"),
        ))
        .gate(Gate::new(100_000, Duration::from_millis(1)))
        // The route named in the metrics, as a service's table names it.
        .policies(
            MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build()).route(
                Method::POST,
                "/v1/echo",
                MethodPolicy::builder("Echo", Idempotency::Unsafe).build(),
            ),
        )
        .into_layer()
        // The same handler, taking the body the stack hands on.
        .layer(service_fn(
            |_r: Request<ServerStackBody<axum::body::Body>>| async {
                Ok::<_, Infallible>(Response::new(axum::body::Body::from("{}")))
            },
        ));
    let call_stack = || async {
        let response = stack.clone().oneshot(request()).await.expect("stack");
        assert!(response.status().is_success());
    };
    eprintln!(
        "server_stack/stack: {:.1} allocations per call",
        allocations_per_call(&runtime, call_stack)
    );
    group.bench_function("stack", |b| {
        b.iter_custom(|iters| run(&runtime, iters, call_stack))
    });
    group.finish();
}

/// Runs `iters` calls spread over 32 tasks on a two-worker runtime, each call through a fresh
/// clone of `svc` (as a generated gRPC client clones its channel per call): what contention on
/// shared state (budget, breaker, margin, reference counts) adds to the single-thread figures.
fn run_concurrent<S>(runtime: &tokio::runtime::Runtime, iters: u64, svc: S) -> Duration
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<Full<Bytes>>>
        + Clone
        + Send
        + 'static,
    S::Error: std::fmt::Debug,
    S::Future: Send,
{
    const TASKS: u64 = 32;
    runtime.block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let svc = svc.clone();
                tokio::spawn(async move {
                    for _ in 0..iters.div_ceil(TASKS) {
                        let response = svc.clone().oneshot(request()).await.expect("call");
                        assert!(response.status().is_success());
                        // Like a network answer, each call gives the other tasks a turn.
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task");
        }
        start.elapsed()
    })
}

fn client_concurrent(c: &mut Criterion) {
    install_recorder();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("client_stack_2_threads");
    // A buffered transport, as a tonic `Channel` is.
    let (bare, stack) = runtime.block_on(async {
        let bare = tower::buffer::Buffer::new(
            service_fn(|_r: Request<Full<Bytes>>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
            }),
            1024,
        );
        let transport = tower::buffer::Buffer::new(
            service_fn(|_r: Request<ReplayBody<Full<Bytes>>>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
            }),
            1024,
        );
        let contract = MethodPolicy::builder("Echo", Idempotency::Safe)
            .timeout(Duration::from_secs(10))
            .build();
        let stack = ClientStack::builder(&Destination::new("bench"), contract)
            .build()
            .expect("valid stack")
            .layer(transport);
        (bare, stack)
    });
    group.bench_function("bare", |b| {
        b.iter_custom(|iters| run_concurrent(&runtime, iters, bare.clone()))
    });
    group.bench_function("stack", |b| {
        b.iter_custom(|iters| run_concurrent(&runtime, iters, stack.clone()))
    });
    group.finish();
}

criterion_group!(benches, client, client_concurrent, server);
criterion_main!(benches);
