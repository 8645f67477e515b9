//! The client stack balanced over a fleet of three real servers on 127.0.0.1:0: a slow replica
//! is hedged around, and a rolling restart (HTTP/2 `GOAWAY`) loses no logical call, hedged or
//! not.
//!
//! The assertions are about counts (calls, attempts, charges), never about how fast this
//! machine is: the slow replica waits far longer than a loopback round trip, and only whether a
//! call took at least that long is looked at.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use backstop::admission::{KeyedTokenBucket, Quota};
use backstop::client::connect;
use backstop::client::replay::ReplayBody;
use backstop::client::transparent::never_sent;
use backstop::client::{ClientStack, Destination};
use backstop::idempotency::MemoryStore;
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicy};
use backstop::retry::RetryBudget;
use backstop::server::ServerStack;
use bytes::Bytes;
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use support::policies::keyed;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tower::util::BoxCloneService;
use tower::{BoxError, ServiceExt, service_fn};

type Body = ReplayBody<Full<Bytes>>;

async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn uri(addr: SocketAddr) -> Uri {
    format!("http://{addr}").parse().unwrap()
}

/// Counts what the transport below the stack is asked to send (attempts, hedges and
/// transparent re-sends alike), how many of those sends failed, how many failed in a way that
/// leaves in doubt whether the server saw the request, and how many the stack dropped before
/// they ended (a hedge that lost, an attempt abandoned at its limit).
#[derive(Debug, Clone, Default)]
struct Sends {
    sent: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    in_doubt: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
}

/// Counts a send as dropped unless it is disarmed when the send ends.
struct DropCount(Option<Arc<AtomicUsize>>);

impl DropCount {
    /// The send ended: not dropped.
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for DropCount {
    fn drop(&mut self) {
        if let Some(dropped) = self.0.take() {
            dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Sends {
    fn sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }

    fn failed(&self) -> usize {
        self.failed.load(Ordering::SeqCst)
    }

    fn in_doubt(&self) -> usize {
        self.in_doubt.load(Ordering::SeqCst)
    }

    fn dropped(&self) -> usize {
        self.dropped.load(Ordering::SeqCst)
    }
}

type SendFuture = Pin<Box<dyn Future<Output = Result<http::Response<Incoming>, BoxError>> + Send>>;

/// The three endpoints behind the p2c balancer, with every send counted.
fn balanced_fleet(
    http2_only: bool,
    addrs: &[SocketAddr],
    sends: &Sends,
) -> BoxCloneService<Request<Body>, http::Response<Incoming>, BoxError> {
    let endpoints = connect::endpoints(
        connect::pooled::<Body>(http2_only),
        addrs.iter().map(|a| uri(*a)),
    )
    .unwrap();
    let balanced = connect::balanced(endpoints, 256);
    let sends = sends.clone();
    BoxCloneService::new(service_fn(move |request: Request<Body>| {
        let (balanced, sends) = (balanced.clone(), sends.clone());
        sends.sent.fetch_add(1, Ordering::SeqCst);
        let send: SendFuture = Box::pin(balanced.oneshot(request));
        let unfinished = DropCount(Some(sends.dropped.clone()));
        let counted: SendFuture = Box::pin(async move {
            let result = send.await;
            unfinished.disarm();
            if let Err(error) = &result {
                sends.failed.fetch_add(1, Ordering::SeqCst);
                if !never_sent(&**error) {
                    sends.in_doubt.fetch_add(1, Ordering::SeqCst);
                }
            }
            result
        });
        counted
    }))
}

/// Runs `calls` logical calls, `concurrency` at a time, and returns how long each took. Every
/// call must succeed.
async fn drive<S, F, R>(svc: S, calls: usize, concurrency: usize, request: F) -> Vec<Duration>
where
    S: tower::Service<Request<Full<Bytes>>, Response = http::Response<R>> + Clone + Send + 'static,
    S::Error: std::fmt::Debug + Send,
    S::Future: Send,
    R: http_body::Body + Send,
    R::Data: Send,
    R::Error: std::fmt::Debug,
    F: Fn(usize) -> Request<Full<Bytes>> + Clone + Send + Sync + 'static,
{
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<JoinHandle<Vec<Duration>>> = (0..concurrency)
        .map(|_| {
            let (svc, next, request) = (svc.clone(), next.clone(), request.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= calls {
                        return latencies;
                    }
                    let started = Instant::now();
                    let response = svc.clone().oneshot(request(i)).await.unwrap();
                    let status = response.status();
                    let body = response.into_body().collect().await.unwrap().to_bytes();
                    latencies.push(started.elapsed());
                    assert!(status.is_success(), "call {i}: {status} {body:?}");
                }
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(calls);
    for worker in workers {
        latencies.extend(worker.await.unwrap());
    }
    latencies
}

/// The nearest-rank `q` quantile.
fn quantile(latencies: &[Duration], q: f64) -> Duration {
    let mut sorted = latencies.to_vec();
    sorted.sort();
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// How long the slow replica holds one request in [`SLOW_EVERY`]: far longer than a loopback
/// round trip, even on a loaded machine.
const SLOW: Duration = Duration::from_millis(500);
/// The slow replica delays one of every this many requests it serves.
const SLOW_EVERY: usize = 8;

/// Three replicas of a `GetCharge` endpoint; the first holds one request in [`SLOW_EVERY`] for
/// [`SLOW`] once `armed`. Returns their addresses and how many requests the first delayed.
async fn replicas(armed: &Arc<AtomicBool>) -> (Vec<SocketAddr>, Arc<AtomicUsize>) {
    let delayed = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(AtomicUsize::new(0));
    let mut addrs = Vec::new();
    for replica in 0..3 {
        let (armed, delayed, served) = (armed.clone(), delayed.clone(), served.clone());
        let app = Router::new().route(
            "/v1/charges/{id}",
            get(move || async move {
                if replica == 0 && armed.load(Ordering::SeqCst) {
                    let n = served.fetch_add(1, Ordering::SeqCst);
                    if n % SLOW_EVERY == SLOW_EVERY - 1 {
                        delayed.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(SLOW).await;
                    }
                }
                "found"
            }),
        );
        addrs.push(serve(app).await);
    }
    (addrs, delayed)
}

/// What one run of [`hedging_run`] measured.
#[derive(Debug)]
struct Run {
    latencies: Vec<Duration>,
    /// Logical calls that took at least [`SLOW`].
    slow_calls: usize,
    /// Requests the slow replica delayed.
    delayed: usize,
    /// Sends beyond one per logical call (hedges, retries, transparent re-sends).
    extra_sends: usize,
}

/// Calls made before the slow replica turns slow: more than the latency window holds.
const WARM_UP: usize = 300;

/// Warms up, then runs `calls` calls over three fresh replicas, hedged or not.
async fn hedging_run(hedging: bool, calls: usize, concurrency: usize) -> Run {
    let armed = Arc::new(AtomicBool::new(false));
    let (addrs, delayed) = replicas(&armed).await;
    let sends = Sends::default();
    let transport = balanced_fleet(false, &addrs, &sends);
    let contract = MethodPolicy::builder("GetCharge", Idempotency::Safe)
        .timeout(Duration::from_secs(10))
        .hedging(hedging)
        .build();
    // Hedging alone is compared with no hedging: the attempt limit, which would also abandon
    // and retry the delayed requests (the delay is far past the loopback round trips), is off.
    let psp = Destination::new("psp").attempt_limit(None);
    let svc = ClientStack::builder(&psp, contract)
        .build()
        .unwrap()
        .layer(transport);
    let get = |i: usize| {
        Request::get(format!("http://psp/v1/charges/ch_{i}"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    // Learn the usual latency under this load while every replica is fast (a full window, so
    // that the p95 is the loaded one).
    drive(svc.clone(), WARM_UP, concurrency, get).await;
    let warm_up_sends = sends.sent();

    armed.store(true, Ordering::SeqCst);
    let latencies = drive(svc, calls, concurrency, get).await;
    let slow_calls = latencies.iter().filter(|l| **l >= SLOW).count();
    Run {
        slow_calls,
        latencies,
        delayed: delayed.load(Ordering::SeqCst),
        extra_sends: sends.sent() - warm_up_sends - calls,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hedging_cuts_p99_with_one_slow_replica_of_three() {
    const CALLS: usize = 400;
    const CONCURRENCY: usize = 24;

    let plain = hedging_run(false, CALLS, CONCURRENCY).await;
    let hedged = hedging_run(true, CALLS, CONCURRENCY).await;
    let (p99_plain, p99_hedged) = (
        quantile(&plain.latencies, 0.99),
        quantile(&hedged.latencies, 0.99),
    );
    eprintln!(
        "without hedging: {} slow calls, {} delayed, {} extra sends, p50 {:?} p99 {:?}",
        plain.slow_calls,
        plain.delayed,
        plain.extra_sends,
        quantile(&plain.latencies, 0.5),
        p99_plain
    );
    eprintln!(
        "with hedging: {} slow calls, {} delayed, {} extra sends, p50 {:?} p99 {:?}",
        hedged.slow_calls,
        hedged.delayed,
        hedged.extra_sends,
        quantile(&hedged.latencies, 0.5),
        p99_hedged
    );

    // Without hedging every delayed request is a slow call, and there are enough of them to
    // set the p99.
    assert_eq!(plain.extra_sends, 0);
    assert!(
        plain.slow_calls >= plain.delayed,
        "{} slow calls, {} delayed",
        plain.slow_calls,
        plain.delayed
    );
    assert!(plain.slow_calls * 100 > CALLS, "{} slow", plain.slow_calls);
    assert!(p99_plain >= SLOW);

    // With hedging the slow replica delays as often, but the calls no longer wait for it: at
    // most 1% of them are slow, so the p99 is under the delay. (A few may be: the balancer
    // can send the hedge to the slow replica too, and it may be that request's turn to wait.)
    assert!(hedged.delayed > 0);
    assert!(
        hedged.slow_calls * 100 <= CALLS,
        "{} slow calls with hedging, {} without",
        hedged.slow_calls,
        plain.slow_calls
    );
    assert!(p99_hedged < SLOW);

    // At most ~6% extra attempts, plus the budget's burst (hedges spend the destination's retry
    // budget).
    let burst = RetryBudget::default().available() as usize;
    assert!(
        hedged.extra_sends <= CALLS * 6 / 100 + burst,
        "{} extra sends for {CALLS} calls",
        hedged.extra_sends
    );
}

/// An HTTP/2 (h2c) server on `listener`, counting the connections it accepts in `connections`,
/// until `stop` fires; then it stops accepting, sends `GOAWAY` on every connection, lets the
/// streams it accepted finish, and returns.
fn serve_h2(
    listener: TcpListener,
    app: Router,
    connections: Arc<AtomicUsize>,
) -> (oneshot::Sender<()>, JoinHandle<()>) {
    let (stop, mut stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let graceful = GracefulShutdown::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((socket, _)) = accepted else { continue };
                    connections.fetch_add(1, Ordering::SeqCst);
                    let service = TowerToHyperService::new(app.clone());
                    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(socket), service);
                    let conn = graceful.watch(conn);
                    tokio::spawn(async move {
                        let _ = conn.await;
                    });
                }
                _ = &mut stopped => break,
            }
        }
        drop(listener);
        graceful.shutdown().await;
    });
    (stop, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_with_goaway_loses_no_logical_request_without_hedging() {
    rolling_restart(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_with_goaway_loses_no_logical_request_with_hedging() {
    rolling_restart(true).await;
}

/// Restarts each of three HTTP/2 replicas in turn under 300 keyed calls through the client
/// stack, hedged or not, and checks that every call succeeded and took effect once.
async fn rolling_restart(hedging: bool) {
    const CALLS: usize = 300;
    const CONCURRENCY: usize = 16;

    // Three replicas of the payment endpoint behind the real server stack, sharing one
    // idempotency store as replicas of one service share their database. Each effect is
    // counted by key.
    let store = MemoryStore::new();
    let charges: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let app = {
        let charges = charges.clone();
        let handler = move |headers: HeaderMap| {
            let charges = charges.clone();
            async move {
                // Long enough that streams are in flight when a replica is told to go away.
                tokio::time::sleep(Duration::from_millis(5)).await;
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                *charges.lock().unwrap().entry(key).or_insert(0) += 1;
                (StatusCode::CREATED, "charged")
            }
        };
        // The default per-tenant rate limit would refuse this load; it is not under test.
        let unlimited = NonZeroU32::new(1_000_000).unwrap();
        let server = ServerStack::new("payments", store.clone())
            .tenant_buckets(KeyedTokenBucket::new(
                Quota::per_second(unlimited, unlimited),
                NonZeroUsize::new(16).unwrap(),
            ))
            .policies(keyed(&[(Method::POST, "/v1/payments")]));
        Router::new()
            .route("/v1/payments", post(handler))
            .layer(server.into_layer())
    };
    let mut addrs = Vec::new();
    let mut servers = Vec::new();
    for _ in 0..3 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(listener.local_addr().unwrap());
        servers.push(Some(serve_h2(listener, app.clone(), Arc::default())));
    }

    let sends = Sends::default();
    let transport = balanced_fleet(true, &addrs, &sends);
    let contract = MethodPolicy::builder("Charge", Idempotency::Keyed)
        .timeout(Duration::from_secs(10))
        .key_ttl(KEY_TTL_PAYMENTS)
        .hedging(hedging)
        .build();
    // Each restart fails at once every send queued on that replica (up to CONCURRENCY, each
    // sent again once), and a send racing the replica's close can be in doubt and retried: the
    // default burst of 20 is sized for steady traffic, not for three restarts within 300
    // calls, so this destination's budget covers what the restarts cost.
    let payments = Destination::new("payments")
        .budget(RetryBudget::new(0.1, u32::try_from(CALLS).unwrap()).unwrap());
    // A restart can strand an attempt: neither answered, failed, nor sent again. Traced three
    // times (a few runs in a thousand: 9 restarts, 1,200 calls, four runs at once on two cores,
    // before the attempt limit): hyper-util's pool handed an idle HTTP/2 connection to one or
    // two sends just after that connection had received the replica's first GOAWAY (last
    // stream id 2^31-1); hyper's dispatcher for it then shut down. Sends queued on a dispatcher
    // that shuts down are normally cancelled and sent again by hyper-util on a new connection
    // (19 times in one such run); a send that lands in its queue as the dispatcher drops it is
    // held there by the very pooled handle that waits for its answer. Hedged, such an attempt
    // is overtaken by the hedge after the p95; unhedged, the destination's attempt limit
    // abandons it after half the 10 s deadline and retries it with the same key in the other
    // half. Either way the call succeeds.
    let svc = ClientStack::builder(&payments, contract)
        .build()
        .unwrap()
        .layer(transport);

    // Counts finished calls so the restarts happen while calls are in flight.
    let (done_tx, mut done) = watch::channel(0usize);
    let done_tx = Arc::new(done_tx);
    let counted = {
        let done_tx = done_tx.clone();
        service_fn(move |request: Request<Full<Bytes>>| {
            let done_tx = done_tx.clone();
            let call: SendFuture = Box::pin(futures_util::TryFutureExt::map_err(
                svc.clone().oneshot(request),
                BoxError::from,
            ));
            let counted: SendFuture = Box::pin(async move {
                let result = call.await;
                done_tx.send_modify(|n| *n += 1);
                result
            });
            counted
        })
    };
    let charge = |i: usize| {
        Request::post("http://payments/v1/payments")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(
                r#"{{"order_id":"o-{i}","amount_cents":100}}"#
            ))))
            .unwrap()
    };
    let load = tokio::spawn(drive(counted, CALLS, CONCURRENCY, charge));

    // Restart each replica in turn, on the same port, under load, counting the connections
    // the restarted replicas accept.
    let reconnects = Arc::new(AtomicUsize::new(0));
    for (i, addr) in addrs.iter().enumerate() {
        done.wait_for(|n| *n >= (i + 1) * CALLS / 4).await.unwrap();
        let (stop, task) = servers[i].take().unwrap();
        stop.send(()).unwrap();
        task.await.unwrap();
        let listener = TcpListener::bind(addr).await.unwrap();
        servers[i] = Some(serve_h2(listener, app.clone(), reconnects.clone()));
    }
    let latencies = load.await.unwrap();
    assert_eq!(latencies.len(), CALLS);

    // Every call succeeded (`drive` checks), each with its own key, and no key took effect
    // twice.
    let charges = charges.lock().unwrap();
    eprintln!(
        "hedging {hedging}: {} sends ({} failed, {} of them in doubt, {} dropped unfinished) for \
         {CALLS} calls",
        sends.sent(),
        sends.failed(),
        sends.in_doubt(),
        sends.dropped()
    );
    assert_eq!(charges.len(), CALLS);
    let twice: Vec<_> = charges.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "charged more than once: {twice:?}");
    assert!(charges.keys().all(|k| !k.is_empty()));
    // The restarts were felt by the transport, and hidden by the stack: the client dialled
    // the restarted replicas again, and what failed on the way either provably never reached a
    // server (refused connections while a replica was down, streams above a GOAWAY's last id)
    // and was sent again without counting as an attempt, or raced the replica's close (a write
    // that met the closed socket, or an attempt stranded and abandoned at its limit) and was
    // retried with its key, which the store turned into a replay, never a second charge
    // (checked above). A restart can also go unnoticed but for the new connection, when every
    // stream on the old one was answered before its GOAWAY: so only the reconnects are
    // asserted (more than 200 calls follow the first restart, spread over three replicas).
    assert!(reconnects.load(Ordering::SeqCst) > 0);
}

mod support {
    pub(crate) mod policies;
}
