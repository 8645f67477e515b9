//! HTTP side of the simulator: the axum router, its handlers, and the accept loop that can
//! really drop a connection.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Extension, Query, State};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;
use tower::ServiceExt;

use backstop::deadline::{GRPC_TIMEOUT, decode_grpc_timeout};
use backstop::server::listen::{ConnectionInfo, ListenConfig, Listener};

use super::faults::{Fault, FaultControl, Faults};
use super::listing::{Listing, PageQuery};
use super::store::{
    ChargeOutcome, ChargeStore, NewCharge, NewRefund, RefundOutcome, StoreError, VoidOutcome,
};
use super::{
    ChargePage, ChargeRequest, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, RefundRequest, TRACEPARENT,
    Void, VoidStatus,
};

/// Largest request body read (charge requests and fault settings are tiny).
const MAX_BODY: usize = 64 * 1024;
/// Longest accepted reference and `traceparent`.
const MAX_REFERENCE: usize = 255;
const MAX_TRACEPARENT: usize = 512;
/// Commit-then-timeout answers this long after the caller's deadline ...
const PAST_DEADLINE: Duration = Duration::from_secs(1);
/// ... or after this long when the caller sent no deadline ...
const HOLD_WITHOUT_DEADLINE: Duration = Duration::from_secs(30);
/// ... and never holds a request longer than this.
const MAX_HOLD: Duration = Duration::from_secs(600);
/// How long shutdown waits for in-flight requests before closing their connections.
const DRAIN: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub(super) struct AppState {
    pub(super) store: ChargeStore,
    pub(super) faults: FaultControl,
    pub(super) shutdown: watch::Receiver<bool>,
}

/// Request extension: closing it drops the connection without an answer.
#[derive(Debug, Clone)]
struct ConnKill(ConnectionInfo);

fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/charges", get(list_charges).post(create_charge))
        .route("/v1/voids", axum::routing::post(void_effect_key))
        .route("/v1/refunds", axum::routing::post(create_refund))
        .route("/admin/faults", get(get_faults).put(put_faults))
        .route("/healthz", get(healthz))
        .fallback(not_found)
        .with_state(state)
}

/// Serves `listener` until `stop` resolves, then stops accepting, wakes held requests, lets
/// in-flight requests end (at most [`DRAIN`]) and closes the remaining connections.
pub(super) async fn run(
    listener: TcpListener,
    state: AppState,
    shutdown_tx: watch::Sender<bool>,
    stop: impl Future<Output = ()>,
) {
    let router = router(state);
    let service = tower::service_fn(move |mut req: Request<Incoming>| {
        if let Some(connection) = req.extensions().get::<ConnectionInfo>().cloned() {
            req.extensions_mut().insert(ConnKill(connection));
        }
        router.clone().oneshot(req)
    });
    let mut limits = ListenConfig::default();
    limits.drain_timeout = DRAIN;
    let stop = async move {
        stop.await;
        // Wakes held requests: they drop their connection instead of answering.
        let _ = shutdown_tx.send(true);
    };
    Listener::new("psp", listener, limits)
        .serve(service, stop)
        .await;
}

async fn wait_shutdown(shutdown: &mut watch::Receiver<bool>) {
    // A dropped sender also means shutdown.
    let _ = shutdown.wait_for(|stopping| *stopping).await;
}

/// Sleeps until `until`; false when shutdown came first.
async fn hold(shutdown: &watch::Receiver<bool>, until: Instant) -> bool {
    let mut shutdown = shutdown.clone();
    tokio::select! {
        () = tokio::time::sleep_until(until) => true,
        () = wait_shutdown(&mut shutdown) => false,
    }
}

/// When a charge request that arrived at `arrived`, with `in_flight` charge requests being
/// handled (itself included), is answered: `None` at once, `Some(None)` beyond any instant
/// representable.
fn wake_at(faults: &Faults, arrived: Instant, in_flight: usize) -> Option<Option<Instant>> {
    if let Some(until) = faults.hold_until.filter(|until| *until > arrived) {
        return Some(Some(until));
    }
    let mut latency = faults.latency;
    let knee = faults.slow_above as usize;
    if knee > 0 && in_flight > knee {
        latency = latency.mul_f64((in_flight as f64 / knee as f64).powi(2));
    }
    (!latency.is_zero()).then(|| arrived.checked_add(latency))
}

async fn create_charge(
    State(state): State<AppState>,
    Extension(kill): Extension<ConnKill>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let arrived = Instant::now();
    let budget = grpc_timeout(&headers)?;
    let deadline = budget.and_then(|budget| arrived.checked_add(budget));
    let effect_key = effect_key(&headers)?;
    let request: ChargeRequest = read_json(&headers, body).await?;
    validate(&request)?;
    let traceparent = headers
        .get(TRACEPARENT)
        .and_then(|value| value.to_str().ok())
        .filter(|value| !value.is_empty() && value.len() <= MAX_TRACEPARENT)
        .map(str::to_owned);

    let fault = state.faults.draw();
    // Held until the answer is sent: a slow call counts against `slow_above` while it waits.
    let charging = state.faults.charging();
    let faults = state.faults.faults();
    if let Some(wake) = wake_at(&faults, arrived, charging.in_flight) {
        match (deadline, wake) {
            (Some(deadline), wake) if wake.is_none_or(|wake| deadline <= wake) => {
                // The caller gives up before we would answer: do not start the charge.
                if hold(&state.shutdown, deadline).await {
                    return Err(problem(
                        StatusCode::GATEWAY_TIMEOUT,
                        "deadline_exceeded",
                        "the deadline passed before the charge could start; nothing was charged",
                    ));
                }
                return Err(shutting_down());
            }
            (_, wake) => {
                let wake = wake.unwrap_or_else(|| arrived + MAX_HOLD);
                if !hold(&state.shutdown, wake).await {
                    return Err(shutting_down());
                }
            }
        }
    }
    match fault {
        Fault::Error => {
            return Err(problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "psp_error",
                "injected error; nothing was charged",
            ));
        }
        Fault::Unavailable => {
            return Err(problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "psp_unavailable",
                "injected unavailability; nothing was charged",
            )
            .retry_after(faults.pushback.unwrap_or(Duration::from_secs(1))));
        }
        Fault::None | Fault::CommitThenTimeout | Fault::CommitThenDrop => {}
    }

    let new = NewCharge {
        effect_key,
        reference: request.reference,
        amount_cents: request.amount_cents,
        currency: request.currency,
        budget_ms: budget.map(|budget| i64::try_from(budget.as_millis()).unwrap_or(i64::MAX)),
        traceparent,
    };
    let outcome = state.store.charge(new).await.map_err(store_failed)?;
    let (status, charge, replayed) = match outcome {
        ChargeOutcome::Created(charge) => (StatusCode::CREATED, charge, false),
        ChargeOutcome::Replayed(charge) => (StatusCode::OK, charge, true),
        ChargeOutcome::Voided => {
            return Err(problem(
                StatusCode::GONE,
                "effect_key_voided",
                "this Idempotency-Key was voided; nothing was charged",
            ));
        }
        ChargeOutcome::Conflict(charge) => {
            tracing::info!(
                effect_key = %charge.effect_key,
                charge_id = %charge.charge_id,
                "psp charge refused: effect key reused with other parameters"
            );
            return Err(problem(
                StatusCode::CONFLICT,
                "idempotency_key_reused",
                "this Idempotency-Key was used with another reference, amount or currency",
            ));
        }
    };
    tracing::info!(
        charge_id = %charge.charge_id,
        effect_key = %charge.effect_key,
        reference = %charge.reference,
        amount_cents = charge.amount_cents,
        replayed,
        fault = fault.as_str(),
        budget_ms = budget.map(|budget| budget.as_millis() as u64),
        "psp charge"
    );

    match fault {
        Fault::CommitThenDrop => {
            kill.0.close();
            // The connection task drops this future together with the connection.
            return std::future::pending().await;
        }
        Fault::CommitThenTimeout => {
            let until = deadline
                .and_then(|deadline| deadline.checked_add(PAST_DEADLINE))
                .unwrap_or_else(|| arrived + HOLD_WITHOUT_DEADLINE)
                .min(arrived + MAX_HOLD);
            if !hold(&state.shutdown, until).await {
                // Shutting down while holding: the caller never gets an answer.
                kill.0.close();
                return std::future::pending().await;
            }
        }
        Fault::None | Fault::Error | Fault::Unavailable => {}
    }

    let mut response = (status, axum::Json(charge)).into_response();
    if replayed {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(response)
}

/// `POST /v1/voids`: settles the effect key for good (see [`ChargeStore::void`]).
async fn void_effect_key(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let effect_key = effect_key(&headers)?;
    let outcome = state
        .store
        .void(effect_key.clone())
        .await
        .map_err(store_failed)?;
    let void = match outcome {
        VoidOutcome::Voided => Void {
            effect_key,
            status: VoidStatus::Voided,
            charge: None,
        },
        VoidOutcome::Charged(charge) => Void {
            effect_key,
            status: VoidStatus::Charged,
            charge: Some(charge),
        },
    };
    tracing::info!(effect_key = %void.effect_key, status = ?void.status, "psp void");
    Ok(axum::Json(void).into_response())
}

async fn list_charges(
    State(state): State<AppState>,
    params: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Response, Problem> {
    let Query(pairs) = params.map_err(|rejection| {
        problem(
            StatusCode::BAD_REQUEST,
            "invalid_query",
            rejection.body_text(),
        )
    })?;
    let listing = PageQuery::parse(&pairs)
        .map_err(|error| problem(StatusCode::BAD_REQUEST, error.code(), error.to_string()))?;
    match listing {
        Listing::Plain { reference } => {
            let charges = state.store.list(reference).await.map_err(store_failed)?;
            Ok(axum::Json(charges).into_response())
        }
        Listing::Page(query) => {
            let (data, has_more) = state.store.page(query).await.map_err(store_failed)?;
            let next_starting_after = has_more
                .then(|| data.last().map(|charge| charge.charge_id.clone()))
                .flatten();
            Ok(axum::Json(ChargePage {
                data,
                has_more,
                next_starting_after,
            })
            .into_response())
        }
    }
}

/// `POST /v1/refunds`: gives money back on a charge, once per `Idempotency-Key`.
async fn create_refund(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let idempotency_key = effect_key(&headers)?;
    let request: RefundRequest = read_json(&headers, body).await?;
    if request.amount_cents <= 0 {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_amount",
            "amount_cents must be a positive integer",
        ));
    }
    if request.charge_id.is_empty() || request.charge_id.len() > MAX_REFERENCE {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_charge_id",
            format!("charge_id must be 1 to {MAX_REFERENCE} bytes"),
        ));
    }
    let outcome = state
        .store
        .refund(NewRefund {
            idempotency_key,
            charge_id: request.charge_id,
            amount_cents: request.amount_cents,
        })
        .await
        .map_err(store_failed)?;
    let (status, refund, replayed) = match outcome {
        RefundOutcome::Created(refund, charge) => {
            tracing::info!(
                refund_id = %refund.refund_id,
                charge_id = %charge.charge_id,
                amount_cents = refund.amount_cents,
                amount_refunded_cents = charge.amount_refunded_cents,
                "psp refund"
            );
            (StatusCode::CREATED, refund, false)
        }
        RefundOutcome::Replayed(refund) => (StatusCode::OK, refund, true),
        RefundOutcome::Conflict(_) => {
            return Err(problem(
                StatusCode::CONFLICT,
                "idempotency_key_reused",
                "this Idempotency-Key was used for a refund of another charge or amount",
            ));
        }
        RefundOutcome::NoSuchCharge => {
            return Err(problem(
                StatusCode::NOT_FOUND,
                "charge_not_found",
                "no charge has this charge_id; nothing was refunded",
            ));
        }
        RefundOutcome::ExceedsCharge { remaining_cents } => {
            return Err(problem(
                StatusCode::CONFLICT,
                "refund_exceeds_charge",
                format!(
                    "the amount is more than the {remaining_cents} left to refund on this \
                     charge; nothing was refunded"
                ),
            ));
        }
    };
    let mut response = (status, axum::Json(refund)).into_response();
    if replayed {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(response)
}

fn store_failed(error: StoreError) -> Problem {
    tracing::error!(
        error = %error,
        source = ?std::error::Error::source(&error),
        "psp store failed"
    );
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "store_error",
        "the PSP store failed; nothing was charged or refunded",
    )
}

/// Wire form of the fault settings (`PUT`/`GET /admin/faults`).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultSettings {
    #[serde(default)]
    latency_ms: u64,
    #[serde(default)]
    error_rate: f64,
    #[serde(default)]
    unavailable_rate: f64,
    #[serde(default)]
    commit_then_timeout_rate: f64,
    #[serde(default)]
    commit_then_drop_rate: f64,
    #[serde(default)]
    next: Vec<Fault>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
}

fn settings(control: &FaultControl) -> FaultSettings {
    let faults = control.faults();
    FaultSettings {
        latency_ms: u64::try_from(faults.latency.as_millis()).unwrap_or(u64::MAX),
        error_rate: faults.error_rate,
        unavailable_rate: faults.unavailable_rate,
        commit_then_timeout_rate: faults.commit_then_timeout_rate,
        commit_then_drop_rate: faults.commit_then_drop_rate,
        next: control.scripted(),
        seed: None,
    }
}

async fn get_faults(State(state): State<AppState>) -> Response {
    axum::Json(settings(&state.faults)).into_response()
}

async fn put_faults(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let wanted: FaultSettings = read_json(&headers, body).await?;
    let faults = Faults {
        latency: Duration::from_millis(wanted.latency_ms),
        error_rate: wanted.error_rate,
        unavailable_rate: wanted.unavailable_rate,
        commit_then_timeout_rate: wanted.commit_then_timeout_rate,
        commit_then_drop_rate: wanted.commit_then_drop_rate,
        ..Faults::default()
    };
    if let Err(error) = state.faults.apply(faults, wanted.next, wanted.seed) {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_faults",
            error.to_string(),
        ));
    }
    tracing::info!(
        latency_ms = wanted.latency_ms,
        error_rate = faults.error_rate,
        unavailable_rate = faults.unavailable_rate,
        commit_then_timeout_rate = faults.commit_then_timeout_rate,
        commit_then_drop_rate = faults.commit_then_drop_rate,
        scripted = state.faults.scripted().len(),
        "psp faults set"
    );
    Ok(axum::Json(settings(&state.faults)).into_response())
}

async fn healthz() -> Response {
    axum::Json(serde_json::json!({ "status": "ok" })).into_response()
}

async fn not_found() -> Problem {
    problem(StatusCode::NOT_FOUND, "not_found", "no such route")
}

fn shutting_down() -> Problem {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "shutting_down",
        "the PSP is shutting down; nothing was charged",
    )
    .retry_after_one_second()
}

/// An RFC 9457 problem with a stable `code`, answered as `application/problem+json`.
#[derive(Debug)]
struct Problem {
    status: StatusCode,
    code: &'static str,
    detail: String,
    /// Whole seconds sent as `Retry-After`, if any.
    retry_after: Option<u64>,
}

fn problem(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Problem {
    Problem {
        status,
        code,
        detail: detail.into(),
        retry_after: None,
    }
}

impl Problem {
    fn retry_after_one_second(self) -> Self {
        self.retry_after(Duration::from_secs(1))
    }

    /// `Retry-After` in whole seconds, at least one.
    fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after.as_secs().max(1));
        self
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "type": "about:blank",
            "title": self.status.canonical_reason().unwrap_or("Error"),
            "status": self.status.as_u16(),
            "code": self.code,
            "detail": self.detail,
        });
        let mut response = (
            self.status,
            [(CONTENT_TYPE, "application/problem+json")],
            body.to_string(),
        )
            .into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// The `Idempotency-Key`: exactly one header, 1 to 255 visible ASCII characters, bare or as a
/// quoted Structured Field string (same syntax as the payment service accepts).
fn effect_key(headers: &HeaderMap) -> Result<String, Problem> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "missing_idempotency_key",
            "exactly one Idempotency-Key header (the effect key) is required",
        ));
    };
    let raw = value.as_bytes();
    let key = match raw {
        [b'"', inner @ .., b'"'] if !inner.contains(&b'"') && !inner.contains(&b'\\') => inner,
        _ => raw,
    };
    if key.is_empty() || key.len() > 255 || !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
            "Idempotency-Key must be 1 to 255 visible ASCII characters",
        ));
    }
    // Visible ASCII is UTF-8.
    Ok(String::from_utf8_lossy(key).into_owned())
}

async fn read_json<T: serde::de::DeserializeOwned>(
    headers: &HeaderMap,
    body: Body,
) -> Result<T, Problem> {
    let too_large = || {
        problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the body must be at most {MAX_BODY} bytes"),
        )
    };
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|len| len > MAX_BODY as u64) {
        return Err(too_large());
    }
    let bytes: Bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(bytes) => bytes,
        Err(error) => {
            let over_limit = std::iter::successors(
                Some(&error as &(dyn std::error::Error + 'static)),
                |error| error.source(),
            )
            .any(|error| error.is::<http_body_util::LengthLimitError>());
            return Err(if over_limit {
                too_large()
            } else {
                problem(
                    StatusCode::BAD_REQUEST,
                    "unreadable_body",
                    "the request body could not be read",
                )
            });
        }
    };
    serde_json::from_slice(&bytes).map_err(|error| {
        problem(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            format!("invalid JSON body: {error}"),
        )
    })
}

fn validate(request: &ChargeRequest) -> Result<(), Problem> {
    if request.amount_cents <= 0 {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_amount",
            "amount_cents must be a positive integer",
        ));
    }
    if request.reference.is_empty() || request.reference.len() > MAX_REFERENCE {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_reference",
            format!("reference must be 1 to {MAX_REFERENCE} bytes"),
        ));
    }
    let currency = request.currency.as_bytes();
    if currency.len() != 3 || !currency.iter().all(u8::is_ascii_uppercase) {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid_currency",
            "currency must be an ISO 4217 code such as \"USD\"",
        ));
    }
    Ok(())
}

/// The caller's budget from `grpc-timeout`, if it sent one (the library's decoder, so the PSP
/// accepts exactly what the service layers accept).
fn grpc_timeout(headers: &HeaderMap) -> Result<Option<Duration>, Problem> {
    let Some(value) = headers.get(GRPC_TIMEOUT) else {
        return Ok(None);
    };
    let invalid = |detail: String| problem(StatusCode::BAD_REQUEST, "invalid_grpc_timeout", detail);
    let value = value
        .to_str()
        .map_err(|_| invalid("grpc-timeout must be ASCII".to_owned()))?;
    decode_grpc_timeout(value)
        .map(Some)
        .map_err(|error| invalid(error.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(value: &'static str) -> Result<String, StatusCode> {
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_static(value));
        effect_key(&headers).map_err(|problem| problem.status)
    }

    #[test]
    fn effect_key_bare_or_quoted() {
        assert_eq!(key_of("pi_123").unwrap(), "pi_123");
        assert_eq!(key_of("\"pi_123\"").unwrap(), "pi_123");
        assert_eq!(key_of(""), Err(StatusCode::BAD_REQUEST));
        assert_eq!(key_of("\"\""), Err(StatusCode::BAD_REQUEST));
        assert_eq!(key_of("has space"), Err(StatusCode::BAD_REQUEST));
        assert_eq!(
            effect_key(&HeaderMap::new()).map_err(|problem| problem.status),
            Err(StatusCode::BAD_REQUEST)
        );
        let mut two = HeaderMap::new();
        two.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        two.append(IDEMPOTENCY_KEY, HeaderValue::from_static("b"));
        assert_eq!(
            effect_key(&two).map_err(|problem| problem.status),
            Err(StatusCode::BAD_REQUEST)
        );
        let long = HeaderValue::from_str(&"k".repeat(256)).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, long);
        assert!(effect_key(&headers).is_err());
    }

    #[test]
    fn a_stall_releases_every_call_together_and_a_cold_one_slows_with_load() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let latency = Faults {
            latency: ms(100),
            ..Faults::default()
        };
        assert_eq!(wake_at(&Faults::default(), now, 50), None);
        assert_eq!(wake_at(&latency, now, 50), Some(Some(now + ms(100))));
        // Held until the stall ends, whatever the latency, for every arrival before it.
        let stall = Faults {
            hold_until: Some(now + ms(700)),
            ..latency
        };
        assert_eq!(wake_at(&stall, now, 1), Some(Some(now + ms(700))));
        assert_eq!(wake_at(&stall, now + ms(500), 1), Some(Some(now + ms(700))));
        assert_eq!(
            wake_at(&stall, now + ms(800), 1),
            Some(Some(now + ms(900))),
            "after the stall only the latency applies"
        );
        // Cold: sixteen times as slow with four times the knee in flight, unchanged below it.
        let cold = Faults {
            slow_above: 8,
            ..latency
        };
        assert_eq!(wake_at(&cold, now, 8), Some(Some(now + ms(100))));
        assert_eq!(wake_at(&cold, now, 32), Some(Some(now + ms(1_600))));
    }
}
