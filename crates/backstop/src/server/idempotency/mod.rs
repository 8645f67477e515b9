//! Idempotency at the RPC layer: one key, one effect, one stored answer (seed 2.4).
//!
//! [`IdempotencyLayer`] is the innermost server layer. For each *keyed* route (declared with
//! [`IdempotencyLayer::keyed`]) it:
//!
//! 1. requires an `Idempotency-Key` header (a bare token or a quoted Structured Field string):
//!    400 `missing_idempotency_key` / `invalid_idempotency_key`;
//! 2. buffers the body up to a cap (1 MiB unless set), checking `Content-Length` before reading
//!    anything: 413 `body_too_large`;
//! 3. fingerprints `"METHOD path"` and the body's canonical JSON: 400 `invalid_body` when the
//!    body is not JSON;
//! 4. claims `(tenant, key)` in the [`Store`] — records are scoped by the [`Tenant`] extension,
//!    so one tenant's key can never replay another tenant's response — and answers by the claim:
//!    - **claimed**: runs the inner service with the rebuilt body and the [`IdempotencyKey`] and
//!      [`Lease`] as request extensions (the handler uses the key as its request key). Then a
//!      2xx answer is stored (status, the headers that matter, body byte for byte) and returned;
//!      a retryable failure (5xx, 429, 409 with `Retry-After`) marks the record failed so the
//!      same key can run again; any other answer (a client mistake) releases the record so
//!      nothing is written;
//!    - **replay**: the stored status, headers and body, plus `Idempotent-Replayed: true`;
//!    - **conflict**: 409 `idempotency_key_reused` with `fingerprint_prefix`, the first 8 hex of
//!      the *original* request's fingerprint (seed 2.4.2; the IETF draft says 422 and Stripe 400,
//!      DESIGN section 7 explains the choice of 409);
//!    - **in progress**: 409 `request_in_progress` with `Retry-After`.
//!
//! If the claimed request's future is dropped before it answered (the client went away, or the
//! deadline layer cut it) a guard marks the record failed from a spawned task, so a retry can
//! take over at once instead of waiting for the lease to run out.
//!
//! The lease is the route's lease (5 s unless set) or the request's remaining deadline budget,
//! whichever is longer: while the first attempt may still be running, a retry gets
//! `request_in_progress` rather than a second concurrent execution.
//!
//! Requests refused before they start (deadline, rate limit, overload) never reach this layer,
//! so their keys stay unused. Claims are counted in `idempotency_claims_total{result}` with
//! `result` one of `claimed`, `replay`, `conflict`, `in_progress`.
//!
//! [`Tenant`]: crate::server::tenant::Tenant
//! [`Lease`]: crate::idempotency::Lease

pub mod future;
mod layer;

pub use self::layer::IdempotencyLayer;

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;

use self::future::ResponseFuture;
use self::layer::Shared;
use super::metrics::Route;
use super::problem::Problem;
use super::tenant::Tenant;
use crate::clock::Clock;
use crate::deadline::Deadline;
use crate::idempotency::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Lease, Store, StoredResponse,
};
use crate::observe::{self, label};
use crate::status::{Code, Status, problem};

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header marking a replayed answer.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Problem code of a keyed request whose body is not JSON (or could not be read): 400.
pub const INVALID_BODY: &str = "invalid_body";

/// Problem code when the idempotency store cannot be reached: 503 + Retry-After.
pub const STORE_UNAVAILABLE: &str = "store_unavailable";

/// Default cap on a keyed request's body.
pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;

/// Default claim lease (seed 2.4.3).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(5);

/// Retry-After sent when the store cannot be reached.
const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Lease and TTL of a keyed route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyedRoute {
    ttl: Duration,
    lease: Duration,
}

/// Deduplicates requests on keyed routes; see the [module docs](self).
pub struct Idempotency<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: std::fmt::Debug, St> std::fmt::Debug for Idempotency<S, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St> Idempotency<S, St> {
    fn new(inner: S, shared: Arc<Shared<St>>) -> Self {
        Self { inner, shared }
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let Some(route) = self
            .shared
            .route_for(request.method(), request.uri().path())
        else {
            return ResponseFuture::passthrough(self.inner.call(request));
        };
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        // The store's waits (a connection, a lock) are bounded by the request's deadline.
        let deadline = request.extensions().get::<Deadline>().copied();
        let flow = keyed(self.shared.clone(), route, inner, request);
        ResponseFuture::keyed(match deadline {
            Some(deadline) => Box::pin(deadline.scope(flow)),
            None => Box::pin(flow),
        })
    }
}

/// The whole keyed-route flow.
async fn keyed<S, St, ReqBody, ResBody>(
    shared: Arc<Shared<St>>,
    route: KeyedRoute,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
    ReqBody: Body<Data = Bytes> + From<Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + From<Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let (mut head, body) = request.into_parts();
    let labels = Route::from_extensions(&head.extensions);

    let key = match head.headers.get(IDEMPOTENCY_KEY) {
        None => {
            return Ok(bad_request(
                problem::MISSING_IDEMPOTENCY_KEY,
                "this route requires an Idempotency-Key header",
            ));
        }
        Some(value) => match value.to_str().ok().map(IdempotencyKey::parse) {
            Some(Ok(key)) => key,
            _ => {
                return Ok(bad_request(
                    problem::INVALID_IDEMPOTENCY_KEY,
                    "Idempotency-Key must be 1 to 255 visible ASCII characters",
                ));
            }
        },
    };

    // Refuse an announced oversized body before reading a byte of it.
    let announced = head
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|len| len > shared.max_body as u64) {
        return Ok(too_large(shared.max_body));
    }
    let body = match Limited::new(body, shared.max_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => return Ok(too_large(shared.max_body)),
        Err(_) => {
            return Ok(bad_request(
                INVALID_BODY,
                "the request body could not be read",
            ));
        }
    };

    let operation = format!("{} {}", head.method, head.uri.path());
    let Ok(fingerprint) = Fingerprint::of_json(&operation, &body) else {
        return Ok(bad_request(INVALID_BODY, "the request body must be JSON"));
    };

    let lease_for = match head.extensions.get::<Deadline>() {
        Some(deadline) => route.lease.max(deadline.remaining()),
        None => route.lease,
    };
    let claim = ClaimRequest {
        scope: Tenant::from_extensions(&head.extensions).to_owned(),
        key: key.clone(),
        fingerprint,
        lease: lease_for,
        ttl: route.ttl,
        now_ms: shared.clock.now_ms(),
    };
    let claim = match shared.store.claim(claim).await {
        Ok(claim) => claim,
        Err(error) => {
            tracing::error!(target: "backstop::server", %error, "idempotency claim failed");
            return Ok(store_unavailable());
        }
    };

    count_claim(&labels, claim.as_str());
    let lease = match claim {
        Claim::Claimed(lease) => lease,
        Claim::Replay(stored) => return Ok(replay(stored)),
        Claim::Conflict { fingerprint_prefix } => {
            return Ok(
                Problem::new(StatusCode::CONFLICT, problem::IDEMPOTENCY_KEY_REUSED)
                    .detail("this Idempotency-Key was already used with other parameters")
                    .with("fingerprint_prefix", fingerprint_prefix)
                    .into_response(),
            );
        }
        Claim::InProgress { retry_after } => {
            let status = Status::new(
                Code::Aborted,
                "a request with this Idempotency-Key is still running",
            )
            .with_problem(problem::REQUEST_IN_PROGRESS)
            .with_pushback(retry_after);
            return Ok(Problem::from_status(&status).into_response());
        }
    };

    // From here on the record is ours: it must end completed, failed or released.
    let mut guard = FailOnDrop {
        store: shared.store.clone(),
        clock: shared.clock.clone(),
        lease: Some(lease.clone()),
    };
    head.extensions.insert(key);
    head.extensions.insert(lease.clone());
    let result = inner
        .call(Request::from_parts(head, ReqBody::from(body)))
        .await;

    let response = match result {
        Ok(response) => response,
        Err(error) => {
            fail(&shared, &lease).await;
            guard.disarm();
            return Err(error);
        }
    };

    match after(&response) {
        After::Complete => {
            let (parts, body) = response.into_parts();
            // The body error is dropped before any await: it need not be `Send`.
            let collected = body.collect().await.ok().map(|c| c.to_bytes());
            let body = match collected {
                Some(body) => body,
                None => {
                    fail(&shared, &lease).await;
                    guard.disarm();
                    let status = Status::new(Code::Internal, "the response body failed");
                    return Ok(Problem::from_status(&status).into_response());
                }
            };
            let stored = StoredResponse {
                status: parts.status.as_u16(),
                headers: stored_headers(&parts.headers, &shared.stored_headers),
                body: body.clone(),
            };
            // The guard stays armed: if this future is dropped mid-complete, the answer never
            // reached the client, and the fencing token makes the guard's `fail` a no-op
            // (`LeaseLost`) should the completion have been written after all.
            if let Err(error) = shared
                .store
                .complete(&lease, stored, shared.clock.now_ms())
                .await
            {
                tracing::error!(target: "backstop::server", %error, "idempotency complete failed");
            }
            guard.disarm();
            Ok(Response::from_parts(parts, ResBody::from(body)))
        }
        After::Fail => {
            fail(&shared, &lease).await;
            guard.disarm();
            Ok(response)
        }
        After::Release => {
            if let Err(error) = shared.store.release(&lease).await {
                tracing::warn!(target: "backstop::server", %error, "idempotency release failed");
            }
            guard.disarm();
            Ok(response)
        }
    }
}

/// What the answer does to the record.
#[derive(Debug, PartialEq, Eq)]
enum After {
    /// A success: store it for replay.
    Complete,
    /// A retryable failure: the same key may run again.
    Fail,
    /// A client mistake or anything else: forget the key.
    Release,
}

fn after<B>(response: &Response<B>) -> After {
    let status = response.status();
    if status.is_success() {
        After::Complete
    } else if status.is_server_error()
        || status == StatusCode::TOO_MANY_REQUESTS
        || (status == StatusCode::CONFLICT && response.headers().contains_key(header::RETRY_AFTER))
    {
        After::Fail
    } else {
        After::Release
    }
}

async fn fail<St: Store>(shared: &Shared<St>, lease: &Lease) {
    if let Err(error) = shared.store.fail(lease, shared.clock.now_ms()).await {
        tracing::warn!(target: "backstop::server", %error, "idempotency fail failed");
    }
}

/// Marks the record failed if the flow is dropped while it owns the lease.
struct FailOnDrop<St: Store> {
    store: St,
    clock: Arc<dyn Clock>,
    lease: Option<Lease>,
}

impl<St: Store> FailOnDrop<St> {
    fn disarm(&mut self) {
        self.lease = None;
    }
}

impl<St: Store> Drop for FailOnDrop<St> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.store.clone();
        let now_ms = self.clock.now_ms();
        runtime.spawn(async move {
            if let Err(error) = store.fail(&lease, now_ms).await {
                tracing::warn!(target: "backstop::server", %error, "idempotency fail after drop failed");
            }
        });
    }
}

fn stored_headers(headers: &http::HeaderMap, names: &[HeaderName]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for name in names {
        for value in headers.get_all(name) {
            if let Ok(value) = value.to_str() {
                out.push((name.as_str().to_owned(), value.to_owned()));
            }
        }
    }
    out
}

fn replay<B: From<Bytes>>(stored: StoredResponse) -> Response<B> {
    let mut response = Response::new(B::from(stored.body));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

fn count_claim(route: &Route, result: &'static str) {
    metrics::counter!(
        observe::IDEMPOTENCY_CLAIMS_TOTAL,
        label::SERVICE => route.service_label(),
        label::METHOD => route.method_label(),
        label::RESULT => result,
    )
    .increment(1);
}

fn bad_request<B: From<Bytes>>(code: &'static str, detail: &'static str) -> Response<B> {
    Problem::from_status(&Status::new(Code::InvalidArgument, detail).with_problem(code))
        .into_response()
}

fn too_large<B: From<Bytes>>(max: usize) -> Response<B> {
    Problem::new(StatusCode::PAYLOAD_TOO_LARGE, problem::BODY_TOO_LARGE)
        .detail(format!("the request body exceeds {max} bytes"))
        .into_response()
}

fn store_unavailable<B: From<Bytes>>() -> Response<B> {
    let status = Status::new(Code::Unavailable, "the idempotency store is unavailable")
        .with_problem(STORE_UNAVAILABLE)
        .with_pushback(STORE_RETRY_AFTER);
    Problem::from_status(&status).into_response()
}

#[cfg(test)]
mod tests;
