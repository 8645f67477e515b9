//! The clients of a chaos run: each logical payment is a new order with its own key, sent
//! (same key, same body) until a final answer, to whichever instance is up.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::time::Instant;

use super::check::{Attempt, Payment};
use super::fleet::Addresses;

/// First pause after an answer that says "try again" without a Retry-After.
const BACKOFF_FIRST: Duration = Duration::from_millis(50);
/// Longest pause between two attempts of one payment.
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Longest Retry-After honoured (a longer one is clamped, the run is bounded).
const RETRY_AFTER_MAX: Duration = Duration::from_secs(10);

/// What the clients send.
#[derive(Debug, Clone)]
pub(crate) struct Workload {
    /// Logical payments.
    pub(crate) payments: usize,
    /// Clients at once.
    pub(crate) concurrency: usize,
    /// Budget of each attempt, sent as `grpc-timeout`.
    pub(crate) timeout: Duration,
    /// Prefix of the order ids and keys (unique per run).
    pub(crate) run_id: String,
    /// Seed of the clients' choices (instance, jitter).
    pub(crate) seed: u64,
    /// When the whole workload gives up.
    pub(crate) deadline: Instant,
    /// Where each payment is POSTed.
    pub(crate) path: String,
    /// Headers added to every payment request.
    pub(crate) headers: Vec<(String, String)>,
    /// Whether 500 `outcome_unknown` is a final answer (a proxy's key whose forward may have
    /// run: it never changes) rather than one to try again.
    pub(crate) outcome_unknown_is_final: bool,
}

/// Runs the workload against `addresses` and returns every payment with its attempts.
pub(crate) async fn run(
    workload: Workload,
    addresses: Addresses,
    started: Instant,
    progress: Arc<AtomicUsize>,
) -> Vec<Payment> {
    let http = client(workload.timeout);
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for client_index in 0..workload.concurrency.max(1) {
        let (workload, addresses, http, next, progress) = (
            workload.clone(),
            addresses.clone(),
            http.clone(),
            next.clone(),
            progress.clone(),
        );
        clients.spawn(async move {
            let mut rng =
                StdRng::seed_from_u64(workload.seed ^ (client_index as u64).rotate_left(32));
            let mut done = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= workload.payments {
                    return done;
                }
                let payment = pay(&workload, n, &addresses, &http, started, &mut rng).await;
                progress.fetch_add(1, Ordering::Relaxed);
                done.push((n, payment));
            }
        });
    }
    let mut all: Vec<(usize, Payment)> = clients.join_all().await.into_iter().flatten().collect();
    all.sort_by_key(|(n, _)| *n);
    all.into_iter().map(|(_, payment)| payment).collect()
}

/// The HTTP client of the workload and the checks: loopback, no proxy, an overall timeout
/// above the attempt's budget (a killed instance resets its connections at once; this only
/// bounds a hung one).
pub(crate) fn client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(timeout + Duration::from_secs(5))
        .build()
        .unwrap_or_default()
}

/// The body of payment `n`.
pub(crate) fn body(order_id: &str) -> String {
    serde_json::json!({"order_id": order_id, "amount_cents": 500, "currency": "USD"}).to_string()
}

/// `grpc-timeout` for `budget` (milliseconds, at least 1).
pub(crate) fn grpc_timeout(budget: Duration) -> String {
    format!("{}m", budget.as_millis().clamp(1, 99_999_999))
}

/// How an answer leaves a payment.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// Final: acknowledged, or refused for good.
    Final,
    /// Try again (same key) after at least this long.
    Retry(Option<Duration>),
}

/// What `status` (with `body` and `Retry-After`) means for the payment.
fn classify(
    status: Option<u16>,
    body: &str,
    retry_after: Option<Duration>,
    outcome_unknown_is_final: bool,
) -> Next {
    match status {
        Some(200 | 201) => Next::Final,
        Some(500)
            if outcome_unknown_is_final
                && problem_code(body).as_deref() == Some("outcome_unknown") =>
        {
            Next::Final
        }
        // Another attempt with the key is still running (here or on a killed instance whose
        // lease has not expired): come back.
        Some(409) if problem_code(body).as_deref() == Some("request_in_progress") => {
            Next::Retry(retry_after)
        }
        // Rate limited (429), timed out or unavailable (5xx), request timeout (408), no
        // answer: the same key again is safe.
        Some(408 | 429) | Some(500..=599) | None => Next::Retry(retry_after),
        Some(_) => Next::Final,
    }
}

/// The `code` of a problem document.
fn problem_code(body: &str) -> Option<String> {
    let json: serde_json::Value = serde_json::from_str(body).ok()?;
    json["code"].as_str().map(str::to_owned)
}

async fn pay(
    workload: &Workload,
    n: usize,
    addresses: &Addresses,
    http: &reqwest::Client,
    started: Instant,
    rng: &mut StdRng,
) -> Payment {
    let order_id = format!("{}-{n}", workload.run_id);
    let key = format!("key-{order_id}");
    let body = body(&order_id);
    let mut payment = Payment {
        order_id,
        key,
        attempts: Vec::new(),
        final_after_ms: None,
        lookup: None,
        replay: None,
        charges: Vec::new(),
    };
    let first = Instant::now();
    let mut backoff = BACKOFF_FIRST;
    while Instant::now() < workload.deadline {
        let instances = addresses.len().max(1);
        let instance = rng.random_range(0..instances);
        // The instance drawn is down (killed, restarting): another one, or wait for it.
        let Some((instance, base)) = (0..instances)
            .map(|i| (instance + i) % instances)
            .find_map(|i| addresses.get(i).map(|base| (i, base)))
        else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let sent = Instant::now();
        let mut request = http
            .post(format!("{base}{}", workload.path))
            .header("content-type", "application/json")
            .header("idempotency-key", &payment.key)
            .header("grpc-timeout", grpc_timeout(workload.timeout));
        for (name, value) in &workload.headers {
            request = request.header(name, value);
        }
        let answer = request.body(body.clone()).send().await;
        let (status, text, retry_after) = match answer {
            Ok(response) => {
                let status = response.status().as_u16();
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
                match response.text().await {
                    Ok(text) => (Some(status), text, retry_after),
                    // The status came, the body did not: as good as no answer.
                    Err(error) => (None, format!("answer cut: {error}"), None),
                }
            }
            Err(error) => (None, error_text(&error), None),
        };
        payment.attempts.push(Attempt {
            at_ms: millis(sent - started),
            instance,
            took_ms: millis(sent.elapsed()),
            status,
            body: text,
        });
        match classify(
            status,
            &payment.attempts[payment.attempts.len() - 1].body,
            retry_after,
            workload.outcome_unknown_is_final,
        ) {
            Next::Final => {
                payment.final_after_ms = Some(millis(first.elapsed()));
                break;
            }
            Next::Retry(retry_after) => {
                // Full jitter on the exponential pause; the server's Retry-After is a floor.
                let jittered = backoff.mul_f64(rng.random_range(0.5..1.0));
                let wait =
                    retry_after.map_or(jittered, |after| after.min(RETRY_AFTER_MAX).max(jittered));
                backoff = (backoff * 2).min(BACKOFF_MAX);
                let wake = (Instant::now() + wait).min(workload.deadline);
                tokio::time::sleep_until(wake).await;
            }
        }
    }
    payment
}

/// A request error with its causes, on one line.
fn error_text(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Whole milliseconds of `d`.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classify_serve(status: Option<u16>, body: &str, retry_after: Option<Duration>) -> Next {
        classify(status, body, retry_after, false)
    }

    #[test]
    fn what_is_final_and_what_is_retried() {
        assert_eq!(classify_serve(Some(201), "{}", None), Next::Final);
        assert_eq!(classify_serve(Some(200), "{}", None), Next::Final);
        assert_eq!(classify_serve(Some(402), "{}", None), Next::Final);
        assert_eq!(classify_serve(Some(422), "{}", None), Next::Final);
        let after = Some(Duration::from_secs(3));
        let in_progress = r#"{"code":"request_in_progress"}"#;
        assert_eq!(
            classify_serve(Some(409), in_progress, after),
            Next::Retry(after)
        );
        let conflict = r#"{"code":"order_conflict"}"#;
        assert_eq!(classify_serve(Some(409), conflict, None), Next::Final);
        assert_eq!(classify_serve(Some(503), "", after), Next::Retry(after));
        assert_eq!(classify_serve(Some(504), "{}", None), Next::Retry(None));
        assert_eq!(classify_serve(Some(429), "{}", None), Next::Retry(None));
        assert_eq!(classify_serve(None, "reset", None), Next::Retry(None));
        let unknown = r#"{"code":"outcome_unknown"}"#;
        assert_eq!(classify_serve(Some(500), unknown, None), Next::Retry(None));
        assert_eq!(classify(Some(500), unknown, None, true), Next::Final);
        assert_eq!(classify(Some(500), "{}", None, true), Next::Retry(None));
    }

    #[test]
    fn the_budget_is_sent_in_milliseconds() {
        assert_eq!(grpc_timeout(Duration::from_secs(2)), "2000m");
        assert_eq!(grpc_timeout(Duration::ZERO), "1m");
    }
}
