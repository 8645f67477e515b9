//! Where the load goes and how one attempt is sent: `POST /v1/payments` over HTTP.

use std::time::Duration;

use backstop::deadline::Deadline;
use backstop::status::{Code, Status, problem};
use http::StatusCode;
use serde::Deserialize;

/// Largest pushback honoured from a `Retry-After` (a server cannot park the driver for hours).
const MAX_PUSHBACK: Duration = Duration::from_secs(60);

/// Largest error body read to find its problem `code`.
const MAX_ERROR_BODY: usize = 16 * 1024;

/// The service under load.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// The payment service's HTTP JSON API at this base URL (`http://host:port`).
    Http { base: String },
}

impl Target {
    /// Parses `http://host:port` (`grpc://` once the gRPC client exists).
    pub(crate) fn parse(s: &str) -> Result<Target, String> {
        let url = reqwest::Url::parse(s).map_err(|e| format!("invalid target URL {s:?}: {e}"))?;
        match url.scheme() {
            "http" => {
                if url.host_str().is_none() {
                    return Err(format!("target {s:?} has no host"));
                }
                Ok(Target::Http {
                    base: s.trim_end_matches('/').to_owned(),
                })
            }
            other => Err(format!(
                "unsupported target scheme {other:?} in {s:?}: use http://HOST:PORT"
            )),
        }
    }

    /// The URL as given.
    pub(crate) fn name(&self) -> &str {
        match self {
            Target::Http { base } => base,
        }
    }
}

/// What one attempt carries.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Send<'a> {
    pub(crate) order_id: &'a str,
    pub(crate) amount_cents: u64,
    pub(crate) idempotency_key: &'a str,
    /// Attempt number (1 for the first); later attempts send `grpc-previous-rpc-attempts`.
    pub(crate) attempt: u32,
    /// Sent as `grpc-timeout`, so the server stops when the caller does.
    pub(crate) deadline: Deadline,
}

/// An HTTP client for the target (one connection pool shared by all requests).
#[derive(Debug, Clone)]
pub(crate) struct HttpClient {
    client: reqwest::Client,
    payments_url: String,
    api_key: Option<String>,
}

impl HttpClient {
    pub(crate) fn new(base: &str, api_key: Option<String>) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true)
            .build()?;
        Ok(Self {
            client,
            payments_url: format!("{base}/v1/payments"),
            api_key,
        })
    }

    /// Sends one attempt and classifies its answer (DESIGN section 3). A 409 is told apart by
    /// its problem `code`: `request_in_progress` is retryable, a reused key or another
    /// order's key is not.
    pub(crate) async fn send(&self, s: Send<'_>) -> Result<(), Status> {
        let Ok(timeout) = s.deadline.to_grpc_timeout() else {
            return Err(Status::new(
                Code::DeadlineExceeded,
                "no budget left to send the attempt",
            ));
        };
        let mut request = self
            .client
            .post(&self.payments_url)
            .header("idempotency-key", s.idempotency_key)
            .header("grpc-timeout", timeout)
            .json(&serde_json::json!({
                "order_id": s.order_id,
                "amount_cents": s.amount_cents,
                "currency": "USD",
            }));
        if s.attempt > 1 {
            request = request.header("grpc-previous-rpc-attempts", (s.attempt - 1).to_string());
        }
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let mut response = match request.send().await {
            Ok(r) => r,
            Err(e) if e.is_timeout() => {
                return Err(Status::new(Code::DeadlineExceeded, "no answer in time"));
            }
            Err(e) if e.is_connect() => {
                return Err(Status::new(Code::Unavailable, "cannot connect"));
            }
            Err(_) => {
                return Err(Status::new(
                    Code::Unavailable,
                    "the connection failed before an answer",
                ));
            }
        };
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let pushback = retry_after(response.headers());
        let body = read_bounded(&mut response).await;
        let mut answer = classify(status, problem_code(&body));
        if let Some(p) = pushback {
            answer = answer.with_pushback(p);
        }
        Err(answer)
    }
}

/// The status of an error answer: the HTTP table, with 409 refined by the problem code.
fn classify(status: StatusCode, problem_code: Option<String>) -> Status {
    let code = match (status.as_u16(), problem_code.as_deref()) {
        (409, Some(problem::IDEMPOTENCY_KEY_REUSED)) => Code::FailedPrecondition,
        (409, Some(problem::ORDER_CONFLICT)) => Code::AlreadyExists,
        _ => Code::from_http(status),
    };
    Status::new(code, format!("answered {status}")).with_http_status(status)
}

#[derive(Deserialize)]
struct Problem {
    code: Option<String>,
}

fn problem_code(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<Problem>(body).ok()?.code
}

/// Delta-seconds `Retry-After`, bounded. An HTTP-date or garbage is ignored (then the backoff
/// decides).
fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    let v = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    let secs: u64 = v.trim().parse().ok()?;
    Some(Duration::from_secs(secs).min(MAX_PUSHBACK))
}

async fn read_bounded(response: &mut reqwest::Response) -> Vec<u8> {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        if body.len() + chunk.len() > MAX_ERROR_BODY {
            break;
        }
        body.extend_from_slice(&chunk);
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_or_say_why_not() {
        assert!(matches!(
            Target::parse("http://127.0.0.1:8081/"),
            Ok(Target::Http { base }) if base == "http://127.0.0.1:8081"
        ));
        assert!(Target::parse("ftp://x").unwrap_err().contains("scheme"));
        assert!(Target::parse("not a url").unwrap_err().contains("invalid"));
    }

    #[test]
    fn conflicts_are_told_apart_by_problem_code() {
        let s = |code: &str| classify(StatusCode::CONFLICT, Some(code.to_owned())).code();
        assert_eq!(s(problem::REQUEST_IN_PROGRESS), Code::Aborted);
        assert_eq!(s(problem::IDEMPOTENCY_KEY_REUSED), Code::FailedPrecondition);
        assert_eq!(s(problem::ORDER_CONFLICT), Code::AlreadyExists);
        assert_eq!(
            classify(StatusCode::SERVICE_UNAVAILABLE, None).code(),
            Code::Unavailable
        );
        assert_eq!(
            problem_code(br#"{"code":"overloaded"}"#).as_deref(),
            Some("overloaded")
        );
        assert_eq!(problem_code(b"not json"), None);
    }

    #[test]
    fn retry_after_is_bounded() {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, "999999".parse().unwrap());
        assert_eq!(retry_after(&h), Some(MAX_PUSHBACK));
        h.insert(http::header::RETRY_AFTER, "2".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert(http::header::RETRY_AFTER, "-1".parse().unwrap());
        assert_eq!(retry_after(&h), None);
    }
}
