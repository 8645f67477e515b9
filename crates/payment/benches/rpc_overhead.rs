//! What the backstop client stack + server stack cost per call, against the same transport
//! without them, side by side in one run (issue target: >= 0.9x bare RPC/s).
//!
//! - gRPC: a trivial `payment.v1.Payment/GetCharge` (a `Safe` method) served by tonic's
//!   generated service under hyper (axum's server), called by tonic's generated client over one
//!   `Channel`; "stack" adds `ServerStack` on the server and `ClientStack` around the channel.
//! - HTTP: a trivial axum `POST /v1/echo` (`Safe`) called by a pooled hyper-util client;
//!   "stack" adds the same two stacks.
//!
//! Each run starts its own server on a loopback port and drives it closed-loop with
//! `--conns` tasks for `--secs` seconds; modes alternate within each round and the table shows
//! medians over rounds, and the median of each round's ratio against that round's bare run.
//! It also reports the process's CPU time per RPC (user + system, client and server
//! together): what the stacks cost in absolute terms on this machine.
//!
//! The process installs the Prometheus recorder `backstop serve` uses, so the stacks' metrics
//! are recorded as in production (`--no-metrics` to leave the no-op recorder), and allocates
//! with mimalloc, as the `backstop` binary does.
//!
//! ```sh
//! cargo bench -p backstop-payment --bench rpc_overhead -- --secs 5 --conns 64 --rounds 3
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use axum::serve::ListenerExt;
use backstop::admission::{KeyedTokenBucket, Quota};
use backstop::client::replay::ReplayBody;
use backstop::client::{ClientStack, Destination, connect};
use backstop::idempotency::MemoryStore;
use backstop::policy::{Idempotency, MethodPolicies, MethodPolicy};
use backstop::server::ServerStack;
use backstop_payment::grpc::proto::payment_client::PaymentClient;
use backstop_payment::grpc::proto::payment_server::{Payment, PaymentServer};
use backstop_payment::grpc::proto::{ChargeRequest, ChargeResponse, GetChargeRequest};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::Method;
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceBuilder, ServiceExt};

/// The allocator the `backstop` binary uses (see BENCHMARKS.md for the same run under glibc's).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const GET_CHARGE: &str = "/payment.v1.Payment/GetCharge";

/// The cheapest possible service: the call's cost is the stacks and the transport.
#[derive(Debug, Clone, Copy)]
struct Trivial;

#[tonic::async_trait]
impl Payment for Trivial {
    async fn charge(
        &self,
        _request: tonic::Request<ChargeRequest>,
    ) -> Result<tonic::Response<ChargeResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this benchmark"))
    }

    async fn get_charge(
        &self,
        request: tonic::Request<GetChargeRequest>,
    ) -> Result<tonic::Response<ChargeResponse>, tonic::Status> {
        Ok(tonic::Response::new(ChargeResponse {
            charge_id: "ch_1".into(),
            status: "succeeded".into(),
            amount_cents: 100,
            intent_id: request.into_inner().intent_id,
        }))
    }
}

fn server_stack() -> ServerStack<MemoryStore> {
    // Limits far above the offered load: this measures the layers' cost, not their refusals.
    let buckets = KeyedTokenBucket::new(
        Quota::per_second(
            std::num::NonZeroU32::new(100_000_000).unwrap(),
            std::num::NonZeroU32::new(100_000_000).unwrap(),
        ),
        std::num::NonZeroUsize::new(1024).unwrap(),
    );
    ServerStack::new("bench", MemoryStore::new())
        .tenant_buckets(buckets)
        .gate(backstop::admission::Gate::new(
            100_000,
            Duration::from_millis(1),
        ))
        // The methods named in the metrics, as a service's table names them.
        .policies(
            MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
                .method(GET_CHARGE, contract("GetCharge"))
                .route(Method::POST, "/v1/echo", contract("Echo")),
        )
}

fn contract(name: &str) -> MethodPolicy {
    MethodPolicy::builder(name, Idempotency::Safe)
        .timeout(Duration::from_secs(10))
        .build()
}

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // Without TCP_NODELAY small answers wait on delayed ACKs (40 ms): measure the stacks.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

fn grpc_router(stack: bool) -> Router {
    let router =
        Router::new().route_service("/payment.v1.Payment/{method}", PaymentServer::new(Trivial));
    if stack {
        router.layer(server_stack().into_layer())
    } else {
        router
    }
}

fn http_router(stack: bool) -> Router {
    let router = Router::new().route(
        "/v1/echo",
        post(|body: Bytes| async move { ([("content-type", "application/json")], body) }),
    );
    if stack {
        router.layer(server_stack().into_layer())
    } else {
        router
    }
}

/// Which sides run their backstop stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mode {
    server: bool,
    client: bool,
}

const MODES: [(&str, Mode); 4] = [
    (
        "bare",
        Mode {
            server: false,
            client: false,
        },
    ),
    (
        "server stack",
        Mode {
            server: true,
            client: false,
        },
    ),
    (
        "client stack",
        Mode {
            server: false,
            client: true,
        },
    ),
    (
        "both stacks",
        Mode {
            server: true,
            client: true,
        },
    ),
];

/// What one run measured.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// Calls per second.
    rate: f64,
    /// p99 latency in ms.
    p99: f64,
    /// Calls completed.
    calls: u64,
}

/// How long a run lasts.
#[derive(Debug, Clone, Copy)]
enum Length {
    /// Until this many seconds pass.
    Secs(u64),
    /// Until each task has made this many calls: a fixed amount of work, for counting
    /// instructions per call (`bench/rpc_instructions.sh`).
    CallsPerTask(u64),
}

/// One closed-loop run: `conns` tasks calling `call` for `length`.
async fn drive<F, Fut>(conns: usize, length: Length, call: F) -> Run
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let limit = match length {
        Length::Secs(_) => u64::MAX,
        Length::CallsPerTask(n) => n,
    };
    let tasks: Vec<_> = (0..conns)
        .map(|_| {
            let (stop, call) = (stop.clone(), call.clone());
            tokio::spawn(async move {
                let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
                while !stop.load(Ordering::Relaxed) && h.len() < limit {
                    let t = Instant::now();
                    call().await;
                    h.saturating_record(t.elapsed().as_micros() as u64);
                }
                h
            })
        })
        .collect();
    if let Length::Secs(secs) = length {
        tokio::time::sleep(Duration::from_secs(secs)).await;
        stop.store(true, Ordering::Relaxed);
    }
    let mut all = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    for t in tasks {
        all.add(t.await.unwrap()).unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    Run {
        rate: all.len() as f64 / elapsed,
        p99: all.value_at_quantile(0.99) as f64 / 1000.0,
        calls: all.len(),
    }
}

async fn grpc_run(mode: Mode, conns: usize, length: Length) -> Run {
    let url = serve(grpc_router(mode.server)).await;
    let channel = tonic::transport::Channel::from_shared(url)
        .unwrap()
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap();
    let request = || GetChargeRequest {
        intent_id: "pi_1".into(),
    };
    if mode.client {
        let destination = Destination::new("bench-grpc");
        let layer = ClientStack::builder(&destination, contract("GetCharge"))
            .build()
            .unwrap();
        // The stack re-sends a replayable body; tonic's channel takes its own body type.
        let service = ServiceBuilder::new()
            .layer(layer)
            .map_request(|r: http::Request<ReplayBody<tonic::body::Body>>| {
                r.map(tonic::body::Body::new)
            })
            .service(channel);
        let client = PaymentClient::new(service);
        drive(conns, length, move || {
            let mut client = client.clone();
            async move {
                client.get_charge(request()).await.unwrap();
            }
        })
        .await
    } else {
        let client = PaymentClient::new(channel);
        drive(conns, length, move || {
            let mut client = client.clone();
            async move {
                client.get_charge(request()).await.unwrap();
            }
        })
        .await
    }
}

async fn http_run(mode: Mode, conns: usize, length: Length) -> Run {
    let url = serve(http_router(mode.server)).await;
    let uri: http::Uri = format!("{url}/v1/echo").parse().unwrap();
    let body = Bytes::from_static(br#"{"order_id":"o-1","amount_cents":100}"#);
    let request = move || {
        http::Request::post(uri.clone())
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))
            .unwrap()
    };
    if mode.client {
        let destination = Destination::new("bench-http");
        let layer = ClientStack::builder(&destination, contract("Echo"))
            .build()
            .unwrap();
        let client = layer.layer(connect::pooled::<ReplayBody<Full<Bytes>>>(false));
        drive(conns, length, move || {
            let (client, request) = (client.clone(), request.clone());
            async move {
                let response = client.oneshot(request()).await.unwrap();
                assert!(response.status().is_success());
                response.into_body().collect().await.unwrap();
            }
        })
        .await
    } else {
        let client = connect::pooled::<Full<Bytes>>(false);
        drive(conns, length, move || {
            let (mut client, request) = (client.clone(), request.clone());
            async move {
                let response = client.call(request()).await.unwrap();
                assert!(response.status().is_success());
                response.into_body().collect().await.unwrap();
            }
        })
        .await
    }
}

/// CPU time this process has used so far (user + system, every thread), from `/proc/self/stat`
/// in clock ticks of 10 ms (Linux's `USER_HZ` on x86-64); `None` where that file is missing.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name may hold spaces; the fields after it are space-separated.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // As `backstop serve` does: the stacks record their metrics into a real recorder, which
    // is what they cost in production. `--no-metrics` leaves the no-op recorder.
    let metrics = (!std::env::args().any(|a| a == "--no-metrics")).then(|| {
        let handle = backstop_payment::server::prometheus_handle();
        // As the server does every 5 s: drains the histograms' sample buffers, which otherwise
        // grow with every recorded value until a scrape.
        let upkeep = handle.clone();
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(5));
                upkeep.run_upkeep();
            }
        });
        handle
    });
    let secs = arg("--secs", 5);
    let conns = arg("--conns", 64) as usize;
    let rounds = arg("--rounds", 3);
    // `--calls N`: each run makes N calls (split over the tasks) instead of lasting `--secs`.
    let length = match arg("--calls", 0) {
        0 => Length::Secs(secs),
        calls => Length::CallsPerTask(calls.div_ceil(conns as u64)),
    };
    // `--threads N`: the runtime's worker threads (default: one per core).
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = std::env::args()
        .skip_while(|a| a != "--threads")
        .nth(1)
        .and_then(|t| t.parse::<usize>().ok())
    {
        builder.worker_threads(threads);
    }
    let runtime = builder.enable_all().build().unwrap();
    println!("conns {conns}, {secs} s per run, {rounds} rounds; medians; ratio vs bare");
    println!(
        "| transport | mode | RPC/s | ratio | round ratio | p99 ms | CPU µs/RPC | CPU ratio |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    // `--only grpc|http` and `--mode N` (index into MODES) narrow a run, e.g. for profiling.
    let only = std::env::args().skip_while(|a| a != "--only").nth(1);
    let only_mode = std::env::args()
        .skip_while(|a| a != "--mode")
        .nth(1)
        .and_then(|m| m.parse::<usize>().ok());
    for transport in ["grpc", "http"] {
        if only.as_deref().is_some_and(|o| o != transport) {
            continue;
        }
        let mut results: Vec<Vec<(Run, f64)>> = vec![Vec::new(); MODES.len()];
        for round in 0..rounds {
            // Rotate which mode goes first, so drift favours none.
            for i in 0..MODES.len() {
                let m = (i + round as usize) % MODES.len();
                let (name, mode) = MODES[m];
                if only_mode.is_some_and(|o| o != m) {
                    let skipped = Run {
                        rate: f64::NAN,
                        p99: f64::NAN,
                        calls: 0,
                    };
                    results[m].push((skipped, f64::NAN));
                    continue;
                }
                let cpu_before = process_cpu();
                let result = runtime.block_on(async {
                    match transport {
                        "grpc" => grpc_run(mode, conns, length).await,
                        _ => http_run(mode, conns, length).await,
                    }
                });
                // Drain what the run recorded now, so that its CPU (and a run counted by
                // callgrind) includes the metrics' whole cost whatever the 5 s timer did.
                if let Some(handle) = &metrics {
                    handle.run_upkeep();
                }
                // CPU per call, client and server together; NaN where /proc is missing.
                let cpu = match (cpu_before, process_cpu()) {
                    (Some(before), Some(after)) if result.calls > 0 => {
                        (after - before).as_secs_f64() * 1e6 / result.calls as f64
                    }
                    _ => f64::NAN,
                };
                eprintln!(
                    "{transport} round {round} {name}: {} calls, {:.0} RPC/s, p99 {:.2} ms, {cpu:.1} µs CPU/RPC",
                    result.calls, result.rate, result.p99
                );
                results[m].push((result, cpu));
            }
        }
        let rate = |v: &[(Run, f64)]| median(v.iter().map(|r| r.0.rate).collect());
        let p99 = |v: &[(Run, f64)]| median(v.iter().map(|r| r.0.p99).collect());
        let cpu = |v: &[(Run, f64)]| median(v.iter().map(|r| r.1).collect());
        let (bare, bare_cpu) = (rate(&results[0]), cpu(&results[0]));
        // Each round's ratio against the same round's bare run, then the median: the machine's
        // speed drifts between rounds, and a ratio of runs made a few seconds apart drifts less.
        let round_ratio = |m: usize| {
            median(
                results[m]
                    .iter()
                    .zip(&results[0])
                    .map(|(run, base)| run.0.rate / base.0.rate)
                    .collect(),
            )
        };
        for (m, (name, _)) in MODES.iter().enumerate() {
            println!(
                "| {transport} | {name} | {:.0} | {:.2} | {:.2} | {:.2} | {:.1} | {:.2} |",
                rate(&results[m]),
                rate(&results[m]) / bare,
                round_ratio(m),
                p99(&results[m]),
                cpu(&results[m]),
                bare_cpu / cpu(&results[m]),
            );
        }
    }
}
