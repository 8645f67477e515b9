//! Where the load goes, and how the naive policy sends one attempt: `POST /v1/payments` over
//! HTTP, or `payment.v1.Payment/Charge` over gRPC. (The `backstop` policy sends through the
//! library's client stack instead: [`super::stack`].)

use backstop::client::classify;
use backstop::deadline::Deadline;
use backstop::status::{Code, Status, problem};
use backstop_payment::grpc::proto::ChargeRequest;
use backstop_payment::grpc::proto::payment_client::PaymentClient;
use backstop_payment::service::answer::ORDER_CONFLICT;
use http::StatusCode;
use serde::Deserialize;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

/// Largest error body read to find its problem `code`.
const MAX_ERROR_BODY: usize = 16 * 1024;

/// The targets `load` can drive, said in every refusal of a target.
const SCHEMES: &str = "use http://HOST:PORT (the HTTP JSON API, e.g. http://127.0.0.1:8081) or \
grpc://HOST:PORT (the gRPC API, e.g. grpc://127.0.0.1:50051)";

/// The service under load.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// The payment service's HTTP JSON API at this base URL (`http://host:port`).
    Http { base: String },
    /// The payment service's gRPC API (`grpc://host:port`), reached over h2c at `endpoint`.
    Grpc { name: String, endpoint: String },
}

impl Target {
    /// Parses `http://host:port` or `grpc://host:port`.
    pub(crate) fn parse(s: &str) -> Result<Target, String> {
        // `127.0.0.1:8081` is a relative URL to the URL parser and `localhost:8081` one with
        // the scheme `localhost`: either way the scheme is what is missing.
        if !s.contains("://") {
            return Err(format!("target {s:?} has no scheme: {SCHEMES}"));
        }
        let url = reqwest::Url::parse(s).map_err(|e| format!("invalid target URL {s:?}: {e}"))?;
        if !matches!(url.scheme(), "http" | "grpc") {
            return Err(format!(
                "unsupported target scheme {:?} in {s:?}: {SCHEMES}",
                url.scheme()
            ));
        }
        let Some(host) = url.host_str() else {
            return Err(format!("target {s:?} has no host"));
        };
        if url.scheme() == "http" {
            return Ok(Target::Http {
                base: s.trim_end_matches('/').to_owned(),
            });
        }
        let Some(port) = url.port() else {
            return Err(format!("gRPC target {s:?} needs a port"));
        };
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        Ok(Target::Grpc {
            name: s.trim_end_matches('/').to_owned(),
            endpoint: format!("http://{host}:{port}"),
        })
    }

    /// The URL as given.
    pub(crate) fn name(&self) -> &str {
        match self {
            Target::Http { base } => base,
            Target::Grpc { name, .. } => name,
        }
    }

    /// A client for the target (one connection pool, or one HTTP/2 channel, for all requests).
    pub(crate) fn client(&self, api_key: Option<String>) -> Result<Client, String> {
        match self {
            Target::Http { base } => HttpClient::new(base, api_key)
                .map(Client::Http)
                .map_err(|e| format!("HTTP client: {e}")),
            Target::Grpc { endpoint, .. } => GrpcClient::new(endpoint, api_key).map(Client::Grpc),
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

/// A client of the target, for either protocol.
#[derive(Debug, Clone)]
pub(crate) enum Client {
    Http(HttpClient),
    Grpc(GrpcClient),
}

impl Client {
    /// Sends one attempt and classifies its answer.
    pub(crate) async fn send(&self, s: Send<'_>) -> Result<(), Status> {
        match self {
            Client::Http(c) => c.send(s).await,
            Client::Grpc(c) => c.send(s).await,
        }
    }
}

/// A gRPC client for `payment.v1.Payment` over one lazily connected h2c channel.
#[derive(Debug, Clone)]
pub(crate) struct GrpcClient {
    client: PaymentClient<Channel>,
    authorization: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl GrpcClient {
    fn new(endpoint: &str, api_key: Option<String>) -> Result<Self, String> {
        let channel = Channel::from_shared(endpoint.to_owned())
            .map_err(|e| format!("gRPC endpoint {endpoint:?}: {e}"))?
            .tcp_nodelay(true)
            .connect_lazy();
        let authorization = api_key
            .map(|k| {
                MetadataValue::try_from(format!("Bearer {k}"))
                    .map_err(|_| "the API key is not a valid metadata value".to_owned())
            })
            .transpose()?;
        Ok(Self {
            client: PaymentClient::new(channel),
            authorization,
        })
    }

    async fn send(&self, s: Send<'_>) -> Result<(), Status> {
        let remaining = s.deadline.remaining();
        if remaining.is_zero() {
            return Err(Status::new(
                Code::DeadlineExceeded,
                "no budget left to send the attempt",
            ));
        }
        let mut request = tonic::Request::new(ChargeRequest {
            order_id: s.order_id.to_owned(),
            amount_cents: i64::try_from(s.amount_cents).unwrap_or(i64::MAX),
            currency: "USD".to_owned(),
        });
        // Sent as `grpc-timeout`.
        request.set_timeout(remaining);
        let metadata = request.metadata_mut();
        let key = MetadataValue::try_from(s.idempotency_key)
            .map_err(|_| Status::new(Code::InvalidArgument, "key is not valid metadata"))?;
        metadata.insert("idempotency-key", key);
        if s.attempt > 1 {
            metadata.insert(
                "grpc-previous-rpc-attempts",
                MetadataValue::from(s.attempt - 1),
            );
        }
        if let Some(auth) = &self.authorization {
            metadata.insert("authorization", auth.clone());
        }
        match self.client.clone().charge(request).await {
            Ok(_) => Ok(()),
            Err(status) => Err(from_tonic(&status)),
        }
    }
}

/// Our status of a gRPC error: its code, and the server's pushback read as every backstop
/// client reads it ([`classify::pushback`]: a negative or unreadable value means "do not
/// retry").
pub(crate) fn from_tonic(status: &tonic::Status) -> Status {
    let code = Code::from_i32(status.code() as i32);
    let answer = Status::new(code, status.message().to_owned());
    match classify::pushback(status.metadata().as_ref()) {
        Some(p) => answer.with_pushback(p),
        None => answer,
    }
}

/// An HTTP client for the target (one connection pool shared by all requests).
#[derive(Debug, Clone)]
pub(crate) struct HttpClient {
    client: reqwest::Client,
    payments_url: String,
    api_key: Option<String>,
}

impl HttpClient {
    fn new(base: &str, api_key: Option<String>) -> Result<Self, reqwest::Error> {
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

    /// Sends one attempt and classifies its answer. A 409 is told apart by
    /// its problem `code`: `request_in_progress` is retryable, a reused key or another
    /// order's key is not.
    async fn send(&self, s: Send<'_>) -> Result<(), Status> {
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
        let pushback = classify::pushback(response.headers());
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
        (409, Some(ORDER_CONFLICT)) => Code::AlreadyExists,
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
    use std::time::Duration;

    use super::*;

    #[test]
    fn targets_parse_or_say_why_not() {
        assert!(matches!(
            Target::parse("http://127.0.0.1:8081/"),
            Ok(Target::Http { base }) if base == "http://127.0.0.1:8081"
        ));
        assert!(matches!(
            Target::parse("grpc://127.0.0.1:50051"),
            Ok(Target::Grpc { endpoint, .. }) if endpoint == "http://127.0.0.1:50051"
        ));
        assert!(
            Target::parse("grpc://127.0.0.1")
                .unwrap_err()
                .contains("port")
        );
        assert!(Target::parse("ftp://x").unwrap_err().contains("scheme"));
        assert!(
            Target::parse("not a url")
                .unwrap_err()
                .contains("no scheme")
        );
        assert!(
            Target::parse("http://")
                .unwrap_err()
                .contains("invalid target URL")
        );
    }

    #[test]
    fn a_target_without_scheme_says_which_schemes_work() {
        for bare in ["127.0.0.1:8081", "localhost:8081", "[::1]:50051"] {
            let error = Target::parse(bare).unwrap_err();
            assert!(!error.contains("relative URL"), "{error}");
            assert!(error.contains("no scheme"), "{error}");
            assert!(error.contains("http://HOST:PORT"), "{error}");
            assert!(error.contains("grpc://HOST:PORT"), "{error}");
        }
        let error = Target::parse("https://127.0.0.1:8081").unwrap_err();
        assert!(error.contains("grpc://HOST:PORT"), "{error}");
    }

    #[test]
    fn conflicts_are_told_apart_by_problem_code() {
        let s = |code: &str| classify(StatusCode::CONFLICT, Some(code.to_owned())).code();
        assert_eq!(s(problem::REQUEST_IN_PROGRESS), Code::Aborted);
        assert_eq!(s(problem::IDEMPOTENCY_KEY_REUSED), Code::FailedPrecondition);
        assert_eq!(s(ORDER_CONFLICT), Code::AlreadyExists);
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
    fn grpc_pushback_is_read_only_when_valid() {
        let mut s = tonic::Status::unavailable("busy");
        s.metadata_mut()
            .insert("grpc-retry-pushback-ms", MetadataValue::from_static("250"));
        let ours = from_tonic(&s);
        assert_eq!(ours.code(), Code::Unavailable);
        assert_eq!(ours.pushback(), Some(Duration::from_millis(250)));
        // A negative pushback means "do not retry" (a wait no deadline covers).
        let mut s = tonic::Status::aborted("in progress");
        s.metadata_mut()
            .insert("grpc-retry-pushback-ms", MetadataValue::from_static("-5"));
        assert_eq!(from_tonic(&s).pushback(), Some(Duration::MAX));
        assert_eq!(
            from_tonic(&tonic::Status::unavailable("x")).pushback(),
            None
        );
    }
}
