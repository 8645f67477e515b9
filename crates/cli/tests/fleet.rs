//! Three `backstop serve` processes sharing one PostgreSQL schema, one Redis and one PSP: one
//! key sent to all of them charges once, an instance killed with SIGKILL mid-load and restarted
//! loses no request and charges no order twice, and a tenant's rate limit holds across the
//! fleet, not per instance.
//!
//! PostgreSQL is 127.0.0.1:5432 (database `test`, or `BACKSTOP_TEST_POSTGRES`) and Redis
//! 127.0.0.1:6379 (or `BACKSTOP_TEST_REDIS`); each test has its own schema and key prefix.
//! The tests are skipped, saying so, when either does not answer.

// The per-test PostgreSQL schema and the check that the servers answer, shared with the
// library's and the payment service's tests.
#[path = "../../backstop/tests/support/postgres_schema.rs"]
mod postgres_schema;
#[path = "support/serve_process.rs"]
mod serve_process;
#[path = "../../backstop/tests/support/services.rs"]
mod services;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backstop::client::connect::{self, HttpClient};
use backstop::client::replay::ReplayBody;
use backstop::client::{ClientStack, Destination};
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicy};
use backstop::retry::RetryBudget;
use backstop_payment::psp::{self, PspConfig, PspHandle};
use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use serve_process::{ServeProcess, serve_command};
use tokio::sync::Semaphore;
use tower::util::BoxCloneService;
use tower::{BoxError, ServiceExt};

use postgres_schema::{Schema, unique};

/// Whether PostgreSQL and Redis both answer; each one that does not says so.
fn services_ready() -> bool {
    let postgres = services::postgres();
    let redis = services::redis();
    postgres && redis
}

/// What every instance of one fleet shares.
struct Fleet {
    store: String,
    redis_prefix: String,
    psp: String,
    extra: Vec<String>,
}

impl Fleet {
    fn new(schema: &Schema, psp: &PspHandle, extra: &[&str]) -> Fleet {
        Fleet {
            store: schema.store_url(None),
            redis_prefix: unique("fleet"),
            psp: psp.url(),
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    /// Starts one instance on free ports and returns once `/healthz` answers.
    async fn start(&self) -> Serve {
        let mut command = serve_command();
        command
            .args(["--store", &self.store, "--psp", &self.psp])
            .args([
                "--redis",
                &services::redis_url(),
                "--redis-prefix",
                &self.redis_prefix,
            ])
            .args(["--instances", "3"])
            // The fleet tests judge the shared limit, not Redis failing: on a machine loaded by
            // other work a round trip may take longer than the default 100 ms, and each local
            // fallback would admit its own share on top of Redis's.
            .args(["--redis-timeout", "5s"])
            .args(&self.extra);
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client");
        let process = serve_process::spawn(command, &http).await;
        Serve {
            base: process.base.clone(),
            process,
            http,
        }
    }

    async fn start_three(&self) -> Vec<Serve> {
        let mut fleet = Vec::new();
        for _ in 0..3 {
            fleet.push(self.start().await);
        }
        fleet
    }
}

/// A running `backstop serve` child.
struct Serve {
    process: ServeProcess,
    base: String,
    http: reqwest::Client,
}

impl Serve {
    async fn post(&self, key: &str, body: &Value) -> reqwest::Result<(u16, Value, Option<u64>)> {
        let r = self
            .http
            .post(format!("{}/v1/payments", self.base))
            .header("idempotency-key", key)
            // The longest budget the service accepts: the rate test judges admission, and a
            // machine loaded by other work must not turn a slow answer into a failure.
            .header("grpc-timeout", "60S")
            .json(body)
            .send()
            .await?;
        let status = r.status().as_u16();
        let retry_after = r
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let json = r.json().await.unwrap_or(Value::Null);
        Ok((status, json, retry_after))
    }
}

impl Serve {
    /// `POST /v1/payments` requests this instance has answered, from its `/metrics`.
    async fn payments_served(&self) -> f64 {
        let text = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics text");
        text.lines()
            .filter(|l| {
                l.starts_with("rpc_server_requests_total{")
                    && l.contains("method=\"POST /v1/payments\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

async fn charges(psp: &PspHandle, order: &str) -> usize {
    psp.store()
        .list(Some(backstop_payment::psp_client::psp_reference(
            backstop_payment::config::DEFAULT_MERCHANT,
            order,
        )))
        .await
        .expect("PSP charge list")
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_sent_to_all_three_instances_is_one_intent_and_one_charge() {
    if !services_ready() {
        return;
    }
    let schema = Schema::create("fleet").await;
    let psp = psp::spawn(PspConfig::default()).await.expect("PSP");
    let fleet = Arc::new(Fleet::new(&schema, &psp, &[]).start_three().await);
    let body = json!({"order_id": "order-shared", "amount_cents": 1234});

    let mut calls = tokio::task::JoinSet::new();
    for instance in 0..3 {
        for _ in 0..8 {
            let (fleet, body) = (fleet.clone(), body.clone());
            calls.spawn(async move {
                let serve = &fleet[instance];
                // A duplicate that arrives while the first is running is told to come back.
                for _ in 0..50 {
                    let (status, json, retry_after) =
                        serve.post("key-shared", &body).await.expect("answered");
                    if status == 409 && json["code"] == "request_in_progress" {
                        let wait = retry_after.unwrap_or(1).min(1);
                        tokio::time::sleep(Duration::from_secs(wait)).await;
                        continue;
                    }
                    return (status, json);
                }
                panic!("still in progress after 50 tries");
            });
        }
    }
    let mut intents = Vec::new();
    while let Some(answer) = calls.join_next().await {
        let (status, json) = answer.expect("caller task");
        assert_eq!(status, 201, "{json}");
        assert_eq!(json["status"], "succeeded", "{json}");
        intents.push(json["intent_id"].as_str().expect("intent_id").to_owned());
    }
    assert_eq!(intents.len(), 24);
    assert!(intents.iter().all(|i| *i == intents[0]), "{intents:?}");

    // Every instance reads the same intent from the shared tables.
    for serve in fleet.iter() {
        let got = serve
            .http
            .get(format!("{}/v1/payments/{}", serve.base, intents[0]))
            .send()
            .await
            .expect("GET");
        assert_eq!(got.status(), 200);
        let json: Value = got.json().await.expect("intent JSON");
        assert_eq!(json["order_id"], "order-shared", "{json}");
    }
    assert_eq!(schema.count("payment_intent").await, 1, "one intent");
    assert_eq!(charges(&psp, "order-shared").await, 1, "one PSP charge");
}

type Body = ReplayBody<Full<Bytes>>;
type Payments = BoxCloneService<Request<Full<Bytes>>, Response<hyper::body::Incoming>, BoxError>;

/// The client stack for `POST /v1/payments`, balanced over `fleet`.
fn payments_client(fleet: &[Serve], destination: &Destination) -> Payments {
    let client: HttpClient<Body> = connect::pooled(false);
    let uris = fleet
        .iter()
        .map(|s| s.base.parse::<Uri>().expect("base URI"));
    let transport = connect::balanced(connect::endpoints(client, uris).expect("endpoints"), 1024);
    let contract = MethodPolicy::builder("CreatePayment", Idempotency::Keyed)
        .timeout(Duration::from_secs(5))
        .key_ttl(KEY_TTL_PAYMENTS)
        .build();
    let stack = ClientStack::builder(destination, contract)
        .build()
        .expect("client stack");
    BoxCloneService::new(stack.layer(transport).map_err(BoxError::from))
}

/// One logical payment: its key is fixed, and it is sent again (same key) until it succeeds.
async fn pay(client: &Mutex<Payments>, order: &str, key: &str) -> usize {
    let body = json!({"order_id": order, "amount_cents": 500}).to_string();
    for tries in 1..=60 {
        let svc = client.lock().expect("client lock").clone();
        let request = Request::post("http://payments/v1/payments")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(body.clone())))
            .expect("request");
        let mut wait = Duration::from_millis(100);
        if let Ok(response) = svc.oneshot(request).await {
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let bytes = response
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let json: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            if status == 201 {
                assert_eq!(json["status"], "succeeded", "{json}");
                return tries;
            }
            assert!(
                status == 409 || status == 429 || status >= 500,
                "{order}: {status} {json}"
            );
            // The killed instance's claims hold their lease; the server says how long.
            if let Some(secs) = retry_after {
                wait = Duration::from_secs(secs.clamp(1, 5));
            }
        }
        tokio::time::sleep(wait).await;
    }
    panic!("{order} never succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_mid_load_and_restarted_loses_nothing_and_charges_once() {
    const ORDERS: usize = 300;
    const CONCURRENCY: usize = 16;
    const KILL_AFTER: usize = 80;
    const AFTER_RESTART_FROM: usize = 200;

    if !services_ready() {
        return;
    }
    let schema = Schema::create("fleet").await;
    let psp = psp::spawn(PspConfig::default()).await.expect("PSP");
    let config = Fleet::new(&schema, &psp, &[]);
    let mut fleet = config.start_three().await;
    let destination =
        Destination::new("payments").budget(RetryBudget::new(0.5, 100).expect("budget"));
    let client = Arc::new(Mutex::new(payments_client(&fleet, &destination)));

    let done = Arc::new(AtomicUsize::new(0));
    let (restarted, wait_for_restart) = tokio::sync::oneshot::channel::<()>();
    let driver = {
        let (client, done) = (client.clone(), done.clone());
        tokio::spawn(async move {
            let gate = Arc::new(Semaphore::new(CONCURRENCY));
            let run = unique("run");
            let mut load = tokio::task::JoinSet::new();
            let mut wait_for_restart = Some(wait_for_restart);
            for n in 0..ORDERS {
                if n == AFTER_RESTART_FROM {
                    // The last ones go through the restarted instance, however slow its start.
                    let restart = wait_for_restart.take().expect("once");
                    restart.await.expect("restart signalled");
                }
                let permit = gate.clone().acquire_owned().await.expect("semaphore");
                let (client, done) = (client.clone(), done.clone());
                let (order, key) = (format!("order-{run}-{n}"), format!("key-{run}-{n}"));
                load.spawn(async move {
                    let tries = pay(&client, &order, &key).await;
                    done.fetch_add(1, Ordering::SeqCst);
                    drop(permit);
                    (order, tries)
                });
            }
            load.join_all().await
        })
    };

    while done.load(Ordering::SeqCst) < KILL_AFTER {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for serve in &fleet {
        assert!(
            serve.payments_served().await > 0.0,
            "the balancer uses all three"
        );
    }
    // The load goes on meanwhile: kill one instance outright, start it again on the same
    // store (on new ports) and, once it is up, point the balancer at the fleet as it is now.
    // Until then the balancer still picks the dead endpoint now and then.
    let mut killed = fleet.remove(1);
    killed.process.child.kill().await.expect("SIGKILL");
    let at_kill = done.load(Ordering::SeqCst);
    fleet.push(config.start().await);
    *client.lock().expect("client lock") = payments_client(&fleet, &destination);
    let at_restart = done.load(Ordering::SeqCst);
    restarted.send(()).expect("the load is running");
    let orders = driver.await.expect("load driver");
    eprintln!("killed after {at_kill} of {ORDERS} logical requests, restarted after {at_restart}");
    assert_eq!(orders.len(), ORDERS);
    assert!(
        fleet[2].payments_served().await > 0.0,
        "the restarted instance took part"
    );
    let resent = orders.iter().filter(|(_, tries)| *tries > 1).count();
    eprintln!("{resent} of {ORDERS} logical requests were sent again with their key");
    for (order, _) in &orders {
        assert_eq!(
            charges(&psp, order).await,
            1,
            "{order} charged exactly once"
        );
    }
    assert_eq!(schema.count("payment_intent").await, ORDERS as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_rate_holds_across_the_fleet_not_per_instance() {
    const RATE: u32 = 20;
    const BURST: u32 = 5;
    const OFFERED_PER_SEC: u32 = 5 * RATE;
    const SECONDS: u32 = 10;

    if !services_ready() {
        return;
    }
    let schema = Schema::create("fleet").await;
    let psp = psp::spawn(PspConfig::default()).await.expect("PSP");
    let (rate, burst) = (RATE.to_string(), BURST.to_string());
    let config = Fleet::new(
        &schema,
        &psp,
        &["--tenant-rate", &rate, "--tenant-burst", &burst],
    );
    let fleet = Arc::new(config.start_three().await);
    let run = Arc::new(unique("rate"));

    let total = OFFERED_PER_SEC * SECONDS;
    let mut ticks = tokio::time::interval(Duration::from_secs(1) / OFFERED_PER_SEC);
    let mut sent = tokio::task::JoinSet::new();
    let mut first = None;
    for n in 0..total {
        ticks.tick().await;
        first.get_or_insert_with(Instant::now);
        let (fleet, run) = (fleet.clone(), run.clone());
        sent.spawn(async move {
            let body = json!({"order_id": format!("order-{run}-{n}"), "amount_cents": 100});
            let serve = &fleet[n as usize % 3];
            let (status, json, _) = serve
                .post(&format!("key-{run}-{n}"), &body)
                .await
                .expect("answered");
            (status, json)
        });
    }
    // The window the offered load spans: on a slow machine the schedule stretches, and the
    // bucket admits for the time the load really lasted. Requests also reach the servers
    // later than they were sent, by as much as the machine is loaded: the buckets may see them
    // over a longer window, up to the last answer.
    let first = first.expect("sent");
    let window = first.elapsed().as_secs_f64();
    let (mut admitted, mut limited) = (0u32, 0u32);
    while let Some(answer) = sent.join_next().await {
        let (status, json) = answer.expect("sender task");
        match status {
            201 => admitted += 1,
            429 => limited += 1,
            other => panic!("neither admitted nor limited: {other} {json}"),
        }
    }
    let answered_within = first.elapsed().as_secs_f64();
    assert_eq!(admitted + limited, total);
    eprintln!(
        "admitted {admitted}, limited {limited}, sent over {window:.2} s, answered within \
         {answered_within:.2} s"
    );
    // Fleet-wide: at most the rate over the whole time requests could arrive, plus one burst.
    // Per instance it would be three times that: the bound tells them apart on any machine.
    let at_most = f64::from(RATE) * answered_within + f64::from(BURST);
    let per_instance = 3.0 * f64::from(RATE) * window + 3.0 * f64::from(BURST);
    let admitted_f = f64::from(admitted);
    assert!(
        admitted_f <= at_most * 1.10,
        "admitted {admitted} of {total} within {answered_within:.2} s, expected at most \
         {at_most:.0} +10% (per-instance limits would admit about {per_instance:.0})"
    );
    // And the limit does admit: offered five times over, the buckets are rarely idle (a
    // stalled machine loses the tokens of its stalls, hence the wide margin).
    assert!(
        admitted_f >= 0.5 * f64::from(RATE) * window,
        "admitted {admitted} of {total} over {window:.2} s: the limit starves the tenant"
    );
}
