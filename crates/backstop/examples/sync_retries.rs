//! Retries that sleep holding a connection: a pool of 50 connections whose calls retry twice,
//! a second apart, serves about 50 / (1 + 2) ~ 16 requests per second, however many the
//! service could take.
//!
//! `cargo run -p backstop --example sync_retries` runs two clients for 31 seconds of tokio's
//! paused clock (virtual time: the run takes well under a second and its figures are the same
//! on every machine) against a service whose every call takes 1/3 s and which fails the first
//! two attempts of each request (503). Both are offered 40 requests per second and have 50
//! connections; both make 3 attempts per request, 1 s apart. The rates are counted over the
//! last 21 seconds, once the first requests have gone through.
//!
//! - **sync:** the retry loop of many SDKs: a connection is taken for the request and held
//!   through every attempt and every sleep between them. A request holds it 1 s calling and
//!   2 s sleeping: 50 / 3 ~ 16.7 requests per second.
//! - **backstop:** the library's client stack with `Destination::max_in_flight(50)`: a call
//!   slot is held for one attempt and given back during the backoff, so a request holds one
//!   for its 1 s of calls only: a ceiling of 50 requests per second, so all 40 offered are
//!   served.
//!
//! It prints both rates and exits non-zero unless the sync loop serves 15.5 to 17.5 requests
//! per second and the client stack 38 to 40.5 (the offered rate).
use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use backstop::client::replay::ReplayBody;
use backstop::client::{ClientStack, Destination};
use backstop::policy::{Idempotency, MethodPolicy};
use backstop::retry::{Backoff, Jitter, RetryBudget};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::sync::Semaphore;
use tokio::time::{Instant, sleep};
use tower::{ServiceExt, service_fn};

/// Connections in the pool (call slots for the client stack).
const POOL: usize = 50;
/// Requests offered per second: more than the sync loop's ceiling, less than the stack's.
const OFFERED: u64 = 40;
/// How long the load runs...
const RUN: Duration = Duration::from_secs(31);
/// ...and from when the requests served are counted: 21 s, seven of the sync loop's 3 s cycles.
const COUNT_FROM: Duration = Duration::from_secs(10);
/// Each call's time at the service.
const CALL: Duration = Duration::from_millis(333);
/// The sleep between two attempts.
const BACKOFF: Duration = Duration::from_secs(1);
/// Attempts per request: every request needs all three.
const ATTEMPTS: u32 = 3;

/// The service: 1/3 s per call, 503 for a request's first two attempts, 200 for its third
/// (the attempt number is 1 + the caller's `grpc-previous-rpc-attempts`).
async fn call(previous: u32) -> StatusCode {
    sleep(CALL).await;
    if previous + 1 < ATTEMPTS {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

/// Offers [`OFFERED`] requests per second for [`RUN`], each run by `request`; the requests
/// served per second from [`COUNT_FROM`] to the end of the run.
async fn offer<F, Fut>(request: F) -> f64
where
    F: Fn() -> Fut,
    Fut: Future<Output = bool> + Send + 'static,
{
    let served = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let (from, end) = (start + COUNT_FROM, start + RUN);
    let mut tick = tokio::time::interval(Duration::from_secs(1) / OFFERED as u32);
    while tick.tick().await < end {
        let (served, done) = (served.clone(), request());
        tokio::spawn(async move {
            if done.await && (from..=end).contains(&Instant::now()) {
                served.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    served.load(Ordering::Relaxed) as f64 / (RUN - COUNT_FROM).as_secs_f64()
}

/// A sync retry loop: the connection is held from the first attempt to the last.
async fn sync_client() -> f64 {
    let pool = Arc::new(Semaphore::new(POOL));
    offer(|| {
        let pool = pool.clone();
        async move {
            let _connection = pool.acquire_owned().await.expect("the pool stays open");
            for previous in 0..ATTEMPTS {
                if call(previous).await.is_success() {
                    return true;
                }
                if previous + 1 < ATTEMPTS {
                    sleep(BACKOFF).await;
                }
            }
            false
        }
    })
    .await
}

/// The library's client stack with [`POOL`] call slots. The retry budget, storm alarm and
/// breaker are opened wide: here every request needs its retries, and the question is only
/// what the client holds while it waits to send them.
async fn backstop_client() -> f64 {
    let dest = Destination::new("service")
        .max_in_flight(NonZeroUsize::new(POOL))
        .budget(RetryBudget::unlimited())
        .storm_alarm(None)
        .breaker(None);
    let policy = MethodPolicy::builder("Read", Idempotency::Safe)
        .timeout(Duration::from_secs(60))
        .max_attempts(ATTEMPTS)
        .backoff(Backoff::new(BACKOFF, BACKOFF, Jitter::None, Duration::ZERO).expect("a backoff"))
        .build();
    let transport = service_fn(|request: Request<ReplayBody<Full<Bytes>>>| async move {
        let previous = request
            .headers()
            .get("grpc-previous-rpc-attempts")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(0);
        let mut response = Response::new(Full::new(Bytes::new()));
        *response.status_mut() = call(previous).await;
        Ok::<_, Infallible>(response)
    });
    let svc = ClientStack::builder(&dest, policy)
        .build()
        .expect("a client stack")
        .layer(transport);
    offer(|| {
        let svc = svc.clone();
        async move {
            let request = Request::get("http://service/read")
                .body(Full::new(Bytes::new()))
                .expect("a request");
            svc.oneshot(request)
                .await
                .is_ok_and(|r| r.status().is_success())
        }
    })
    .await
}

#[tokio::main(flavor = "current_thread", start_paused = true)]
async fn main() {
    let sync = sync_client().await;
    println!(
        "sync retries (a connection held through the sleeps): {sync:.1} requests/s (50 / (1 + 2) = 16.7)"
    );
    let backstop = backstop_client().await;
    println!(
        "backstop (a call slot per attempt, none while sleeping): {backstop:.1} requests/s (all {OFFERED} offered: below 50 / 1 = 50)"
    );
    if !(15.5..=17.5).contains(&sync) || !(38.0..=40.5).contains(&backstop) {
        eprintln!("expected 15.5 to 17.5 and 38 to 40.5 requests/s");
        std::process::exit(1);
    }
    println!(
        "ok: the sync loop serves a third of what the same pool serves when sleeps hold nothing"
    );
}
