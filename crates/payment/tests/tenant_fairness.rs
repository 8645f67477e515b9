//! A noisy merchant does not get a quiet one refused, over real sockets: with 16 places in the
//! gate and a PSP answering in 100 ms, merchant `noisy` runs 60 clients back to back while
//! merchant `quiet` sends its payments one after another from two clients, far below its
//! share. Every quiet payment is created and no quiet connection is pushed away, on HTTP/1.1
//! and on gRPC (HTTP/2), while the noisy merchant is refused and pushed.
//!
//! Counted, not timed: the quiet clients start once the noisy merchant has been refused (the
//! overload is there), send a fixed number of payments, and the noisy clients stop once the
//! quiet ones are done and push-away has closed one of their connections (a bound on their
//! count keeps a broken build from running for ever). Shedding counts as sustained from the
//! 20th request of an hour-long window with any refusal, and every open connection may be
//! pushed each second, so that a quiet connection would be pushed at its first answer if the
//! listener picked it.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use backstop::admission::SheddingConfig;
use backstop_payment::config::ApiKey;
use backstop_payment::grpc::proto::ChargeRequest;
use backstop_payment::grpc::proto::payment_client::PaymentClient;
use support::{Harness, body};
use tokio::sync::Notify;
use tonic::transport::{Channel, Endpoint};

/// Places in the gate (`--max-inflight`).
const LIMIT: usize = 16;
const NOISY_CLIENTS: usize = 60;
const QUIET_CLIENTS: usize = 2;
/// Payments each quiet client sends, one after another.
const QUIET_PAYMENTS: usize = 15;
/// Bound on the noisy payments, so that a test that cannot end still ends.
const NOISY_BOUND: usize = 20_000;
/// Every payment's budget: the quiet ones never run out of it waiting their turn.
const BUDGET: Duration = Duration::from_secs(30);

async fn start() -> Harness {
    let h = Harness::start_with(|c| {
        c.max_inflight = LIMIT;
        c.api_keys = vec![
            ApiKey::parse("noisy=key-noisy").unwrap(),
            ApiKey::parse("quiet=key-quiet").unwrap(),
        ];
        // The gate, not the per-merchant rate, is what the noisy merchant runs into.
        c.tenant_rate = std::num::NonZeroU32::new(1_000_000).unwrap();
        c.tenant_burst = std::num::NonZeroU32::new(1_000_000).unwrap();
        c.shedding = SheddingConfig {
            threshold: 0.0,
            sustain: Duration::ZERO,
            window: Duration::from_secs(3600),
            ..SheddingConfig::default()
        };
        c.push_away = Some(1.0);
    })
    .await;
    h.latency(Duration::from_millis(100));
    h
}

/// What the noisy clients saw, shared between them.
#[derive(Default)]
struct Noisy {
    sent: AtomicUsize,
    refused: AtomicUsize,
    closed: AtomicUsize,
    /// Set once the quiet clients are done.
    stop: AtomicBool,
    /// Notified at the first refusal.
    overloaded: Notify,
}

impl Noisy {
    fn running(&self) -> bool {
        !(self.stop.load(Ordering::Acquire) && self.closed.load(Ordering::Acquire) > 0)
            && self.sent.fetch_add(1, Ordering::AcqRel) < NOISY_BOUND
    }

    fn saw(&self, refused: bool, closed: bool) {
        if closed {
            self.closed.fetch_add(1, Ordering::AcqRel);
        }
        if refused && self.refused.fetch_add(1, Ordering::AcqRel) == 0 {
            self.overloaded.notify_one();
        }
    }

    async fn until_overloaded(&self) {
        let notified = self.overloaded.notified();
        if self.refused.load(Ordering::Acquire) == 0 {
            notified.await;
        }
    }

    /// Stops the noisy clients (the quiet ones are done) and waits for them.
    async fn stop(&self, workers: Vec<tokio::task::JoinHandle<()>>) {
        self.stop.store(true, Ordering::Release);
        for w in workers {
            w.await.unwrap();
        }
    }

    /// The noisy tenant was refused and had connections pushed away.
    fn assert_refused_and_pushed(&self) {
        let (refused, closed) = (
            self.refused.load(Ordering::Acquire),
            self.closed.load(Ordering::Acquire),
        );
        assert!(
            refused > 0 && closed > 0,
            "{refused} refused, {closed} closed"
        );
    }
}

/// One HTTP payment as `key`: its status and whether the answer closes the connection.
async fn pay_http(http: &reqwest::Client, base: &str, key: &str, id: &str) -> (u16, bool) {
    let response = http
        .post(format!("{base}/v1/payments"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .header("idempotency-key", id)
        .header("grpc-timeout", format!("{}S", BUDGET.as_secs()))
        .body(body(&format!("order-{id}"), 100))
        .send()
        .await
        .expect("the service answers");
    let close = response
        .headers()
        .get(reqwest::header::CONNECTION)
        .is_some_and(|v| v == "close");
    let status = response.status().as_u16();
    let _ = response.bytes().await;
    (status, close)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .timeout(BUDGET * 2)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noisy_merchant_does_not_get_a_quiet_one_refused_over_http() {
    let h = start().await;
    let noisy = Arc::new(Noisy::default());
    let workers: Vec<_> = (0..NOISY_CLIENTS)
        .map(|w| {
            let (noisy, base) = (Arc::clone(&noisy), h.base.clone());
            tokio::spawn(async move {
                let http = client();
                let mut i = 0;
                while noisy.running() {
                    let (status, closed) =
                        pay_http(&http, &base, "key-noisy", &format!("n-{w}-{i}")).await;
                    noisy.saw(status == 503, closed);
                    i += 1;
                }
            })
        })
        .collect();
    noisy.until_overloaded().await;
    let quiet: Vec<_> = (0..QUIET_CLIENTS)
        .map(|c| {
            let base = h.base.clone();
            tokio::spawn(async move {
                let http = client();
                let mut answers = Vec::new();
                for i in 0..QUIET_PAYMENTS {
                    answers.push(pay_http(&http, &base, "key-quiet", &format!("q-{c}-{i}")).await);
                }
                answers
            })
        })
        .collect();
    let mut answers = Vec::new();
    for q in quiet {
        answers.extend(q.await.unwrap());
    }
    noisy.stop(workers).await;
    assert_eq!(answers.len(), QUIET_CLIENTS * QUIET_PAYMENTS);
    assert!(
        answers
            .iter()
            .all(|&(status, closed)| status == 201 && !closed),
        "every quiet payment is created on the connection it came on: {answers:?}"
    );
    noisy.assert_refused_and_pushed();
}

/// Counts the connections a channel opens.
fn counting_channel(addr: std::net::SocketAddr, connects: Arc<AtomicUsize>) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_with_connector_lazy(tower::service_fn(move |_uri| {
            let connects = Arc::clone(&connects);
            async move {
                connects.fetch_add(1, Ordering::AcqRel);
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                tcp.set_nodelay(true)?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tcp))
            }
        }))
}

/// One gRPC charge as `key`: whether it succeeded, else the status code.
async fn charge(channel: &Channel, key: &str, id: &str) -> Result<(), tonic::Code> {
    let mut request = tonic::Request::new(ChargeRequest {
        order_id: format!("order-{id}"),
        amount_cents: 100,
        currency: String::new(),
    });
    request.set_timeout(BUDGET);
    let metadata = request.metadata_mut();
    metadata.insert("idempotency-key", id.parse().unwrap());
    metadata.insert("authorization", format!("Bearer {key}").parse().unwrap());
    PaymentClient::new(channel.clone())
        .charge(request)
        .await
        .map(drop)
        .map_err(|status| status.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noisy_merchant_does_not_get_a_quiet_one_refused_over_grpc() {
    let h = start().await;
    let addr = h.server.grpc_addr();
    let noisy = Arc::new(Noisy::default());
    let workers: Vec<_> = (0..NOISY_CLIENTS)
        .map(|w| {
            let noisy = Arc::clone(&noisy);
            tokio::spawn(async move {
                let connects = Arc::new(AtomicUsize::new(0));
                let channel = counting_channel(addr, Arc::clone(&connects));
                let mut i = 0;
                while noisy.running() {
                    let before = connects.load(Ordering::Acquire);
                    let answer = charge(&channel, "key-noisy", &format!("n-{w}-{i}")).await;
                    // A GOAWAY shows as the next charge opening a new connection.
                    let reconnected = i > 0 && connects.load(Ordering::Acquire) > before;
                    noisy.saw(answer == Err(tonic::Code::Unavailable), reconnected);
                    i += 1;
                }
            })
        })
        .collect();
    noisy.until_overloaded().await;
    let quiet: Vec<_> = (0..QUIET_CLIENTS)
        .map(|c| {
            tokio::spawn(async move {
                let connects = Arc::new(AtomicUsize::new(0));
                let channel = counting_channel(addr, Arc::clone(&connects));
                let mut answers = Vec::new();
                for i in 0..QUIET_PAYMENTS {
                    answers.push(charge(&channel, "key-quiet", &format!("q-{c}-{i}")).await);
                }
                (answers, connects.load(Ordering::Acquire))
            })
        })
        .collect();
    let mut answers = Vec::new();
    let mut connects = Vec::new();
    for q in quiet {
        let (a, c) = q.await.unwrap();
        answers.extend(a);
        connects.push(c);
    }
    noisy.stop(workers).await;
    assert_eq!(answers.len(), QUIET_CLIENTS * QUIET_PAYMENTS);
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    assert_eq!(
        connects, [1; QUIET_CLIENTS],
        "each quiet client kept its one connection"
    );
    noisy.assert_refused_and_pushed();
}
