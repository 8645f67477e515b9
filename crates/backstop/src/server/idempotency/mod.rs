//! Idempotency at the RPC layer: one key, one effect, one stored answer.
//!
//! [`IdempotencyLayer`] is the innermost server layer. For each request of a *keyed* method
//! (its policy in the [`MethodPolicies`](crate::policy::MethodPolicies) table given to
//! [`IdempotencyLayer::policies`] is `Keyed`, looked up by the route the application's router
//! matched when known, see [`IdempotencyLayer::matched_path_from`]) it:
//!
//! 1. requires exactly one `Idempotency-Key` header (a bare token or a quoted Structured Field
//!    string): 400 `missing_idempotency_key` / `invalid_idempotency_key` (also for two header
//!    lines, even equal ones: the field cannot be repeated, and no line is picked over another);
//! 2. buffers the body up to a cap (1 MiB unless set), checking `Content-Length` before reading
//!    anything: 413 `body_too_large`;
//! 3. fingerprints `"METHOD path"` and the body's canonical JSON: 400 `invalid_body` when the
//!    body is not JSON (unless the layer takes [any body](IdempotencyLayer::any_body): then
//!    its bytes);
//! 4. claims `(tenant, key)` in the [`Store`] — records are scoped by the [`Tenant`] extension,
//!    so one tenant's key can never replay another tenant's response — and answers by the claim:
//!    - **claimed**: runs the inner service with the rebuilt body and the [`IdempotencyKey`],
//!      the request's [`Fingerprint`], the [`Lease`] and the [`Phases`] as request extensions
//!      (the handler uses the key as its request key). Then a
//!      2xx answer is stored (status, the headers that matter, body byte for byte) and returned,
//!      or, when its body is larger than the route keeps, streamed and stored without its body
//!      (see [below](#answers-too-large-to-keep));
//!      a retryable failure (5xx, 429, 409 with `Retry-After`) marks the record failed so the
//!      same key can run again; any other answer (a client mistake), or one the handler marked
//!      [`NothingDone`] (it refused before doing anything), releases the record so nothing is
//!      left behind;
//!    - **replay**: the stored status, headers and body, plus `Idempotent-Replayed: true`;
//!    - **conflict**: 409 `idempotency_key_reused` with `fingerprint_prefix`, the first 8 hex of
//!      the *original* request's fingerprint (the IETF draft says 422 and Stripe 400; 409 is
//!      what the other "this key is taken" answers already use);
//!    - **in progress**: 409 `request_in_progress` with `Retry-After`. Behind the
//!      [`IntakeLayer`] (as in [`ServerStack`](crate::server::ServerStack)) the request first
//!      waits, holding no gate permit, for the running attempt's outcome and has it replayed;
//!      it gets this answer only when its own deadline comes first.
//!
//! Steps 1 to 3 run in the [`IntakeLayer`], before the gate, when it is in front; this layer
//! then takes what it read from a request extension.
//!
//! # Answers too large to keep
//!
//! An answer is kept for replay up to its method's
//! [`max_replay_body`](crate::policy::MethodPolicy::max_replay_body), else the layer's
//! ([`IdempotencyLayer::max_replay_body`], 1 MiB unless set). The layer reads a successful
//! answer's body up to that bound, and not at all when its size is known to be larger (a
//! `Content-Length` over it). An answer within the bound is stored whole and replayed byte
//! for byte. A larger one is passed on as it comes, the part already read first, so that a
//! request holds at most the bound plus the frames in flight whatever the handler (or an
//! upstream) sends; when its body ends, the record is completed with its status, its stored
//! headers and a marker instead of the body ([`StoredResponse::withheld`]). A retry with the
//! key then gets a definite answer, and nothing runs again:
//!
//! - HTTP: the original status and stored headers (less those that describe the body:
//!   `Content-*`, `ETag`, `Last-Modified`), `Idempotent-Replayed: true`, and an
//!   `application/problem+json` body with code `replay_body_too_large` and `max_replay_body`
//!   (the bound, in bytes): the request was carried out, and its answer cannot be sent again;
//! - gRPC: `ALREADY_EXISTS` with the same words.
//!
//! How the streamed body ends decides the record:
//!
//! - read to its end: completed as above; a gRPC answer by the `grpc-status` of its trailers,
//!   which come last (a code other than `OK` fails or releases the record as usual);
//! - failed midway (the handler's stream or the connection to an upstream broke): the answer
//!   never arrived whole, as when a body fails within the bound: on a
//!   [`Takeover::Refuse`] route the record stays running and a retry learns
//!   `outcome_unknown` when its lease ends; elsewhere it is marked failed;
//! - dropped by a caller that went away: an HTTP answer's status already said what happened,
//!   so its record is completed with the marker all the same, on a task of its own (the
//!   record never waits for a caller to read to the end); a gRPC answer's status never came,
//!   so its record ends as that of a request cut off before it answered (see below).
//!
//! While the body streams the record is running: a retry meanwhile waits for it, or gets
//! `request_in_progress`. A body that streams for longer than the lease is a run that
//! outlasts its lease, as a slow handler would be: a retry after the lease ended takes the key
//! over (on a `Refuse` route, `outcome_unknown`), and the first run's completion is then
//! refused by the fencing token.
//!
//! ```
//! use axum::{Router, routing::post};
//! use backstop::idempotency::MemoryStore;
//! use backstop::policy::{Idempotency, KEY_TTL_SYNC, MethodPolicies, MethodPolicy};
//! use backstop::server::ServerStack;
//! use http::Method;
//!
//! // An export answers up to a few MiB: keep 64 KiB of it for replay, stream the rest.
//! let export = MethodPolicy::builder("Export", Idempotency::Keyed)
//!     .key_ttl(KEY_TTL_SYNC)
//!     .max_replay_body(64 * 1024)
//!     .build();
//! let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
//!     .route(Method::POST, "/v1/exports", export)
//!     .validated()
//!     .unwrap();
//! let app: Router = Router::new()
//!     .route("/v1/exports", post(|| async { "id,amount\n1,100\n" }))
//!     .layer(ServerStack::new("exports", MemoryStore::new()).policies(policies).into_layer());
//! ```
//!
//! # gRPC
//!
//! A keyed route may be a gRPC method (`POST /payment.v1.Payment/Charge`); a request whose
//! `Content-Type` is `application/grpc` goes the same way, with these differences:
//!
//! - the key is the metadata `idempotency-key` (the same header);
//! - the body is one length-prefixed message, read by [`read_unary`]: a length prefix
//!   above the message cap (4 MiB unless set) is `RESOURCE_EXHAUSTED` as soon as the prefix
//!   arrives, before any of the message is buffered; a message whose compressed flag is set
//!   while the request names no `grpc-encoding` is `INTERNAL` (as gRPC requires), answered
//!   here before the claim rather than by the service's codec after it; a message compressed
//!   with an encoding the service does not accept is refused by its codec (`UNIMPLEMENTED`
//!   with a `grpc-accept-encoding` leaving it out, which this layer cannot know beforehand),
//!   and that answer releases the record: no handler saw the request;
//! - the fingerprint is SHA-256 of `"POST /package.Service/Method"`, a newline and the
//!   message's protobuf bytes as sent. Not a decoded-and-canonicalized form: this layer
//!   does not know the message types. Protobuf encoders write fields in number order and
//!   omit proto3 defaults, so a client re-sending the same message sends the same bytes; two
//!   encodings of equal messages that differ (an explicit default, unknown fields, another
//!   compression) are a key reuse with other parameters, never a silent replay;
//! - the answer is classified by its `grpc-status` (in the head of a trailers-only answer,
//!   else in the trailers) by the same rule as HTTP: `OK` is stored (head, message and
//!   trailers), retryable codes mark the record failed, others release it;
//! - refusals are trailers-only gRPC answers (see [`Protocol`]): `INVALID_ARGUMENT` (key),
//!   `FAILED_PRECONDITION` (key reused), `ABORTED` + `grpc-retry-pushback-ms` (in progress);
//!   a replay is the stored answer with `idempotent-replayed: true` in its head metadata and
//!   the stored trailers (`grpc-status` included) byte for byte. Trailers are kept in the
//!   store's header list under the name `trailer:<name>`, which no HTTP header can have.
//!
//! If the request's future is dropped while its claim is in flight (the client went away, or
//! the deadline layer cut it), the claim runs to its end on a spawned task and, if it was taken,
//! is released: a backend may commit a claim after its caller stopped listening, and the
//! request did nothing. If it is dropped after the claim, before it answered, a guard ends the
//! record from a spawned task by the route's [`Takeover`]: `Rerun`, failed; `Resume`, released
//! if no phase began, else failed; either way a retry can take over at once instead of waiting
//! for the lease to run out. On a `Refuse` route (the default) the record stays running, since
//! the run may have performed its effect: a retry learns `outcome_unknown` when the lease ends
//! (before that, `request_in_progress` by its own deadline). A request whose deadline has
//! passed, or that has less
//! time left than [`IdempotencyLayer::min_time_left`], claims nothing (504
//! `deadline_exceeded`), and a store that gives up because the request's deadline passed
//! ([`StoreError::DeadlineExceeded`]) is answered the same; only a store that fails is 503
//! `store_unavailable`.
//!
//! The lease is the route's lease (5 s unless set) or the request's time left,
//! whichever is longer, plus twice the instances' clock skew bound
//! ([`IdempotencyLayer::max_clock_skew`], 250 ms unless set): while the first attempt may still
//! be running, a retry gets `request_in_progress` rather than a second concurrent execution,
//! even from an instance whose clock runs ahead.
//!
//! Requests refused before they start (deadline, rate limit, overload) never reach this layer,
//! so their keys stay unused. Claims are counted in `idempotency_claims_total{result}` with
//! `result` one of `claimed`, `replay`, `conflict`, `in_progress`.
//!
//! [`Tenant`]: crate::server::tenant::Tenant
//! [`Lease`]: crate::idempotency::Lease

pub(crate) mod bounded;
pub mod coverage;
pub mod future;
pub mod intake;
mod layer;
mod phases;
mod settled;

pub use self::intake::IntakeLayer;
pub use self::layer::IdempotencyLayer;
pub use self::phases::Phases;
pub use crate::server::body::{RequestBody, ResponseBody};
pub use crate::server::select::MatchedPathFn;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;

use self::bounded::{Read, Tail, Withheld};
use self::future::ResponseFuture;
use self::layer::Shared;
use super::grpc::{GRPC_ENCODING, PREFIX_LEN, check_compression, encoding_refused, read_unary};
use super::metrics::Route;
use super::problem::{Problem, Protocol, grpc_status};
use super::tenant::Tenant;
use crate::clock::Clock;
use crate::deadline::Deadline;
use crate::idempotency::protocol;
use crate::idempotency::{
    BODY_WITHHELD, Claim, ClaimRequest, Ending, Fingerprint, IdempotencyKey, Lease, PriorRun,
    Store, StoreError, StoredResponse,
};
use crate::policy::Takeover;
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

/// Default claim lease.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(5);

/// Default least time a keyed request must have left to be claimed (see
/// [`IdempotencyLayer::min_time_left`]): the gate's default minimal service time.
pub const DEFAULT_MIN_TIME_LEFT: Duration = crate::server::DEFAULT_MIN_SERVICE;

/// Default bound on how far an instance's wall clock may be from true time.
pub const DEFAULT_MAX_CLOCK_SKEW: Duration = Duration::from_millis(250);

/// Prefix of a stored trailer's name in [`StoredResponse::headers`].
pub const TRAILER_PREFIX: &str = "trailer:";

/// Retry-After sent when the store cannot be reached.
const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Lease and TTL of a keyed route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyedRoute {
    ttl: Duration,
    lease: Duration,
    takeover: Takeover,
    max_replay_body: usize,
}

/// Deduplicates requests on keyed routes; see the [module docs](self).
pub struct IdempotencyService<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S: Clone, St> Clone for IdempotencyService<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: std::fmt::Debug, St> std::fmt::Debug for IdempotencyService<S, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St> IdempotencyService<S, St> {
    fn new(inner: S, shared: Arc<Shared<St>>) -> Self {
        Self { inner, shared }
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S, St>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let Some(route) = self.shared.route_of(&request) else {
            return ResponseFuture::passthrough(self.inner.call(request.map(RequestBody::inner)));
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
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    St: Store,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let (mut head, body) = request.into_parts();
    let labels = Route::from_extensions(&head.extensions);
    let protocol = Protocol::of(&head.headers);

    // Read before the gate by the intake, or here when this layer is used on its own.
    let prepared = match head.extensions.remove::<Prepared>() {
        Some(prepared) => prepared,
        None => match prepare(&shared, &head, body).await {
            Ok(prepared) => prepared,
            Err(refusal) => return Ok(refusal),
        },
    };
    let Prepared {
        key,
        fingerprint,
        body,
    } = prepared;

    // Budget checks come before any write: a request out of time, or with less left than a
    // keyed request needs to claim and run, claims nothing.
    if let Some(deadline) = head.extensions.get::<Deadline>() {
        if deadline.expired() || deadline.remaining() < shared.min_time_left() {
            return Ok(deadline_exceeded(protocol));
        }
    }
    let lease_for = protocol::lease_for(
        route.lease,
        head.extensions.get::<Deadline>().map(Deadline::remaining),
        shared.max_clock_skew,
    );
    let claim = ClaimRequest {
        scope: Tenant::from_extensions(&head.extensions).to_owned(),
        key: key.clone(),
        fingerprint,
        lease: lease_for,
        ttl: route.ttl,
        now_ms: shared.clock.now_ms(),
    };
    // A route whose handler commits a phase before its effect claims without waiting for a
    // sync: that phase's commit makes the claim durable too.
    let deferred = route.takeover != Takeover::Refuse;
    let claim = match ClaimInFlight::new(shared.clone(), claim, deferred, route.takeover).await {
        Ok(claim) => claim,
        // The request's own budget ran out before the store was reached: its deadline, not a
        // store failure (nothing was written).
        Err(StoreError::DeadlineExceeded) => {
            tracing::debug!(target: "backstop::server", "deadline passed before the claim");
            return Ok(deadline_exceeded(protocol));
        }
        Err(error) => {
            tracing::error!(target: "backstop::server", %error, "idempotency claim failed");
            return Ok(store_unavailable(protocol));
        }
    };

    labels.count_claim(claim.as_str());
    let lease = match claim {
        Claim::Claimed(lease) => lease,
        Claim::Replay(stored) => return Ok(replay(stored)),
        Claim::Conflict { fingerprint_prefix } => {
            return Ok(
                Problem::new(StatusCode::CONFLICT, problem::IDEMPOTENCY_KEY_REUSED)
                    .grpc_code(Code::FailedPrecondition)
                    .detail("this Idempotency-Key was already used with other parameters")
                    .with("fingerprint_prefix", fingerprint_prefix)
                    .into_response_for(protocol),
            );
        }
        Claim::InProgress { retry_after } => {
            let status = Status::new(
                Code::Aborted,
                "a request with this Idempotency-Key is still running",
            )
            .with_problem(problem::REQUEST_IN_PROGRESS)
            .with_pushback(retry_after);
            let mut response: Response<ResponseBody<ResBody>> =
                Problem::from_status(&status).into_response_for(protocol);
            // Tells the intake (outside the gate) to wait for the running attempt's outcome,
            // and hands it back the request to send again, so it need not keep a copy.
            head.extensions.insert(Prepared {
                key,
                fingerprint,
                body,
            });
            response
                .extensions_mut()
                .insert(InProgress(Arc::new(Mutex::new(Some(head)))));
            return Ok(response);
        }
    };

    // From here on the record is ours: it must end completed, failed or released.
    if lease
        .resume
        .as_ref()
        .is_some_and(|resume| resume.prior == PriorRun::Abandoned)
        && route.takeover == Takeover::Refuse
    {
        return Ok(outcome_unknown(&shared, &lease, protocol).await);
    }
    let phases = Phases::new(shared.store.clone(), lease.clone());
    // A compressed gRPC message the service's codec cannot decode is refused before any
    // handler sees it: kept to recognize that refusal.
    let encoding = match protocol {
        Protocol::Grpc => head.headers.get(GRPC_ENCODING).cloned(),
        Protocol::Http => None,
    };
    head.extensions.insert(key);
    // The request's parameters as the claim compared them: a handler that keeps its own record
    // of the request (a payment intent) stores this instead of hashing the body again.
    head.extensions.insert(fingerprint);
    head.extensions.insert(lease.clone());
    head.extensions.insert(phases.clone());
    let mut guard = FailOnDrop {
        shared: &shared,
        lease: Some(&lease),
        // A run cut off mid-handler may have performed its effect: on a route that refuses to
        // repeat one, its record stays running, and a retry learns `outcome_unknown` when the
        // lease ends.
        abandon: route.takeover == Takeover::Refuse,
        // On a route whose handler commits a phase before its effect, a run cut off before
        // any phase did nothing: its key is released, not marked failed.
        phases: (route.takeover == Takeover::Resume).then_some(&phases),
    };
    let result = inner
        .call(Request::from_parts(head, RequestBody::buffered(body)))
        .await;

    let response = match result {
        Ok(response) => response,
        // The handler may have performed its effect before it failed: on a route that refuses
        // to repeat one, the guard leaves the record running (a retry learns `outcome_unknown`
        // when the lease ends); elsewhere the record is failed.
        Err(error) => {
            if !guard.abandon {
                end(&shared, &lease, &phases, Ending::Fail).await;
            }
            guard.disarm();
            return Err(error);
        }
    };

    let decision = match protocol {
        // A trailers-only answer says its code in the head; an answer with a message says it
        // in the trailers, read below before anything is stored.
        Protocol::Grpc => match grpc_status(response.headers()) {
            Some(code) => after_code(code),
            None if response.status().is_success() => After::Complete,
            None => after(&response),
        },
        Protocol::Http => after(&response),
    };
    // A handler that commits its phases before its effect and answered without one did
    // nothing, and neither did one (or a layer below this one) that marked its answer
    // `NothingDone`, nor a request whose compression the service's codec refused before
    // decoding it: whatever it answered, the key stays unused.
    // A run that took over a record holding an earlier run's recovery point never releases it:
    // the point (and the effect key it was committed under) must outlive this run.
    let nothing_done = phases.recovery_point().is_none()
        && (response.extensions().get::<NothingDone>().is_some()
            || encoding_refused(encoding.as_ref(), response.headers())
            || (route.takeover == Takeover::Resume && !phases.began()));
    let decision = match decision {
        After::Fail if nothing_done => After::Release,
        decision => decision,
    };
    match decision {
        After::Complete => {
            let (parts, body) = response.into_parts();
            let (trailers, body) = match bounded::read(body, route.max_replay_body).await {
                Read::Whole { data, trailers } => (trailers, data),
                // Too large to keep: passed on as it comes, and the record ended when it ends
                // (or when its caller drops it), without the body.
                Read::Over { read, rest } => {
                    let withheld = Withheld {
                        shared: shared.clone(),
                        lease: lease.clone(),
                        phases: phases.clone(),
                        status: parts.status.as_u16(),
                        headers: stored_headers(&parts.headers, &shared.stored_headers),
                        protocol,
                        limit: route.max_replay_body,
                        takeover: route.takeover,
                        nothing_done,
                    };
                    guard.disarm();
                    let tail = Tail::new(read, rest, Box::new(withheld));
                    return Ok(Response::from_parts(parts, ResponseBody::streamed(tail)));
                }
                Read::Failed => {
                    // As for a handler error: the effect may have happened.
                    if !guard.abandon {
                        end(&shared, &lease, &phases, Ending::Fail).await;
                    }
                    guard.disarm();
                    let status = Status::new(Code::Internal, "the response body failed");
                    return Ok(Problem::from_status(&status).into_response_for(protocol));
                }
            };
            if protocol.is_grpc() {
                let code = trailers
                    .as_ref()
                    .and_then(grpc_status)
                    .unwrap_or(Code::Unknown);
                if code != Code::Ok {
                    let ending = match after_code(code) {
                        After::Fail if !nothing_done => Ending::Fail,
                        _ => Ending::Release,
                    };
                    end(&shared, &lease, &phases, ending).await;
                    guard.disarm();
                    return Ok(Response::from_parts(
                        parts,
                        ResponseBody::buffered(body, trailers),
                    ));
                }
            }
            let mut headers = stored_headers(&parts.headers, &shared.stored_headers);
            if let Some(trailers) = &trailers {
                for (name, value) in trailers {
                    if let Ok(value) = value.to_str() {
                        headers.push((format!("{TRAILER_PREFIX}{name}"), value.to_owned()));
                    }
                }
            }
            let stored = StoredResponse {
                status: parts.status.as_u16(),
                headers,
                body: body.clone(),
            };
            // The guard stays armed: if this future is dropped mid-complete, the answer never
            // reached the client, and the fencing token makes the guard's `fail` a no-op
            // (`LeaseLost`) should the completion have been written after all.
            end(&shared, &lease, &phases, Ending::Complete(stored)).await;
            guard.disarm();
            Ok(Response::from_parts(
                parts,
                ResponseBody::buffered(body, trailers),
            ))
        }
        After::Fail => {
            end(&shared, &lease, &phases, Ending::Fail).await;
            guard.disarm();
            Ok(response.map(ResponseBody::inner))
        }
        After::Release => {
            end(&shared, &lease, &phases, Ending::Release).await;
            guard.disarm();
            Ok(response.map(ResponseBody::inner))
        }
    }
}

/// Ends the record as `ending` says, with the writes the handler gave
/// [`Phases::on_finish`] in the same transaction, and wakes this instance's waiters.
async fn end<St: Store>(shared: &Shared<St>, lease: &Lease, phases: &Phases<St>, ending: Ending) {
    let now_ms = shared.clock.now_ms();
    let what = match &ending {
        Ending::Complete(_) => "complete",
        Ending::Fail => "fail",
        Ending::Release => "release",
    };
    let result = match (phases.take_finish(), ending) {
        (Some(writes), ending) => shared.store.finish(lease, ending, now_ms, writes).await,
        (None, Ending::Complete(stored)) => shared.store.complete(lease, stored, now_ms).await,
        (None, Ending::Fail) => shared.store.fail(lease, now_ms).await,
        (None, Ending::Release) => shared.store.release(lease).await,
    };
    if let Err(error) = result {
        tracing::error!(target: "backstop::server", %error, what, "idempotency record not ended");
    }
    shared.settled.settle(&lease.scope, &lease.key);
}

/// The answer to a retry that took over a run which never answered, on a route that refuses
/// to repeat an effect that may have happened: stored as the key's answer, so every later
/// retry gets it too, and nothing runs.
async fn outcome_unknown<St: Store, B: From<Bytes>>(
    shared: &Shared<St>,
    lease: &Lease,
    protocol: Protocol,
) -> Response<B> {
    let status = Status::new(
        Code::Unknown,
        "an earlier attempt with this Idempotency-Key stopped before it answered; whether its \
         effect happened is unknown, and it is not run again",
    )
    .with_problem(problem::OUTCOME_UNKNOWN);
    let response: Response<Bytes> = Problem::from_status(&status).into_response_for(protocol);
    let (parts, body) = response.into_parts();
    let stored = StoredResponse {
        status: parts.status.as_u16(),
        headers: stored_headers(&parts.headers, &shared.stored_headers),
        body: body.clone(),
    };
    if let Err(error) = shared
        .store
        .complete(lease, stored, shared.clock.now_ms())
        .await
    {
        tracing::error!(target: "backstop::server", %error, "idempotency complete failed");
    }
    shared.settled.settle(&lease.scope, &lease.key);
    tracing::warn!(
        target: "backstop::server",
        scope = %lease.scope,
        key = %lease.key,
        "abandoned run taken over: answered outcome_unknown"
    );
    Response::from_parts(parts, B::from(body))
}

/// What a keyed request brings to its claim: its key, its fingerprint and its whole body.
///
/// The intake reads it before the gate and hands it to [`IdempotencyService`] as a request extension,
/// so the body is read once, and without holding a gate permit.
#[derive(Clone)]
struct Prepared {
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    body: Bytes,
}

/// Marks a `request_in_progress` refusal for the intake, with the request's head (its
/// [`Prepared`] body inside) for the intake to send again once the running attempt settles.
#[derive(Clone)]
struct InProgress(Arc<Mutex<Option<http::request::Parts>>>);

impl InProgress {
    /// The request's head, taken (once).
    fn take(&self) -> Option<http::request::Parts> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

/// A response extension saying that the answer was given before anything was done: the
/// handler (or a layer between it and [`IdempotencyService`]) refused the request before any write
/// or effect, e.g. because its time left could not cover the downstream call.
///
/// A keyed request's record is then released whatever the status, instead of being marked
/// failed for a retryable answer (a 504, a 503): the refusal leaves no record behind. Only the
/// code that refuses knows that nothing happened, so only it sets this; the layer never
/// guesses it from a status. A success is stored as usual.
///
/// ```
/// use backstop::server::idempotency::NothingDone;
/// use http::{Response, StatusCode};
///
/// let mut refusal = Response::new(String::from("no time left for the downstream call"));
/// *refusal.status_mut() = StatusCode::GATEWAY_TIMEOUT;
/// refusal.extensions_mut().insert(NothingDone);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NothingDone;

/// Reads the key, the body (bounded by the route's caps) and the fingerprint of a keyed
/// request, or the refusal that answers it.
async fn prepare<St, ReqBody, B>(
    shared: &Shared<St>,
    head: &http::request::Parts,
    body: ReqBody,
) -> Result<Prepared, Response<B>>
where
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    B: From<Bytes>,
{
    let protocol = Protocol::of(&head.headers);
    let key =
        key_of(&head.headers).map_err(|(code, detail)| bad_request(code, detail, protocol))?;
    let body = read_body(shared, head, body, protocol).await?;
    // The operation is `"METHOD path"`, hashed from its parts.
    let (verb, path) = (head.method.as_str(), head.uri.path());
    let fingerprint = match protocol {
        // `read_body` checked the frame: the message follows its prefix.
        Protocol::Grpc => Fingerprint::of_bytes_operation(verb, path, &body[PREFIX_LEN..]),
        Protocol::Http => match Fingerprint::of_json_operation(verb, path, &body) {
            Ok(fingerprint) => fingerprint,
            // Not JSON: its bytes, when the layer takes any body. No JSON body's canonical
            // form is a body that is not JSON, so the two never collide.
            Err(_) if shared.any_body => Fingerprint::of_bytes_operation(verb, path, &body),
            Err(_) => {
                return Err(bad_request(
                    INVALID_BODY,
                    "the request body must be JSON",
                    protocol,
                ));
            }
        },
    };
    Ok(Prepared {
        key,
        fingerprint,
        body,
    })
}

/// A request's whole body within the caps: for gRPC exactly one framed message (its length
/// prefix checked before the message is read), for HTTP at most `max_body` bytes (an
/// announced larger `Content-Length` refused before a byte is read). `protocol` is the
/// request's, [`Protocol::of`] its headers.
async fn read_body<St, ReqBody, B>(
    shared: &Shared<St>,
    head: &http::request::Parts,
    body: ReqBody,
    protocol: Protocol,
) -> Result<Bytes, Response<B>>
where
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    B: From<Bytes>,
{
    match protocol {
        Protocol::Grpc => match read_unary(body, shared.max_message)
            .await
            .and_then(|message| check_compression(&message, &head.headers).map(|()| message))
        {
            Ok(message) => Ok(message.framed().clone()),
            Err(status) => Err(Problem::from_status(&status).into_response_for(protocol)),
        },
        Protocol::Http => {
            let announced = head
                .headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if announced.is_some_and(|len| len > shared.max_body as u64) {
                return Err(too_large(shared.max_body));
            }
            match Limited::new(body, shared.max_body).collect().await {
                Ok(collected) => Ok(collected.to_bytes()),
                Err(e) if e.is::<LengthLimitError>() => Err(too_large(shared.max_body)),
                Err(_) => Err(bad_request(
                    INVALID_BODY,
                    "the request body could not be read",
                    protocol,
                )),
            }
        }
    }
}

/// The request's one `Idempotency-Key`, or the problem code and detail refusing it.
///
/// The header is a Structured Field Item, which cannot be repeated: two header lines (even
/// equal ones) are refused rather than one of them picked.
fn key_of(headers: &HeaderMap) -> Result<IdempotencyKey, (&'static str, &'static str)> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Err((
            problem::MISSING_IDEMPOTENCY_KEY,
            "this route requires an Idempotency-Key header",
        ));
    };
    if values.next().is_some() {
        return Err((
            problem::INVALID_IDEMPOTENCY_KEY,
            "send exactly one Idempotency-Key header",
        ));
    }
    match value.to_str().ok().map(IdempotencyKey::parse) {
        Some(Ok(key)) => Ok(key),
        _ => Err((
            problem::INVALID_IDEMPOTENCY_KEY,
            "Idempotency-Key must be 1 to 255 visible ASCII characters",
        )),
    }
}

/// A store's claim, boxed so that it can be handed to another task.
type PendingClaim = Pin<Box<dyn Future<Output = Result<Claim, StoreError>> + Send>>;

/// A claim that runs to its end even when the request is dropped while it is in flight (the
/// deadline layer cut it, or the client went away).
///
/// A backend may commit a claim after its caller stopped listening (a statement already sent,
/// a group commit already under way). Dropping that future would leave a `running` record
/// nobody owns, refusing the client's retry with `request_in_progress` until the lease ends.
/// Instead, a dropped `ClaimInFlight` hands the claim to a spawned task, which releases the
/// key if the claim inserted the record: the request did nothing, so it leaves nothing behind.
/// A claim that took a record over is not released, which would delete the run before it.
struct ClaimInFlight<St: Store> {
    shared: Arc<Shared<St>>,
    claim: Option<PendingClaim>,
    takeover: Takeover,
}

impl<St: Store> ClaimInFlight<St> {
    fn new(
        shared: Arc<Shared<St>>,
        request: ClaimRequest,
        deferred: bool,
        takeover: Takeover,
    ) -> Self {
        let store = shared.store.clone();
        let claim: PendingClaim = if deferred {
            Box::pin(async move { store.claim_deferred(request).await })
        } else {
            Box::pin(async move { store.claim(request).await })
        };
        Self {
            shared,
            claim: Some(claim),
            takeover,
        }
    }
}

// The boxed claim is pinned on the heap; nothing else is ever pinned.
impl<St: Store> Unpin for ClaimInFlight<St> {}

impl<St: Store> Future for ClaimInFlight<St> {
    type Output = Result<Claim, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let claim = self
            .claim
            .as_mut()
            .expect("ClaimInFlight polled after it completed");
        let outcome = std::task::ready!(claim.as_mut().poll(cx));
        self.claim = None;
        Poll::Ready(outcome)
    }
}

impl<St: Store> Drop for ClaimInFlight<St> {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (shared, takeover) = (self.shared.clone(), self.takeover);
        runtime.spawn(async move {
            let Ok(Claim::Claimed(lease)) = claim.await else {
                return;
            };
            match &lease.resume {
                // The claim inserted the record: nothing happened under it.
                None => release(&shared, &lease).await,
                // A takeover of a run that may have performed its effect, on a route that
                // never repeats one: left running, as that run's own drop guard left it, so a
                // retry still learns `outcome_unknown` when the lease ends.
                Some(resume)
                    if resume.prior == PriorRun::Abandoned && takeover == Takeover::Refuse => {}
                // Any other takeover: a release would delete the run before it (its recovery
                // point, its effect key); failed, the next claim takes it over as it is.
                Some(_) => fail(&shared, &lease).await,
            }
        });
    }
}

async fn release<St: Store>(shared: &Shared<St>, lease: &Lease) {
    if let Err(error) = shared.store.release(lease).await {
        tracing::warn!(target: "backstop::server", %error, "idempotency release failed");
    }
    shared.settled.settle(&lease.scope, &lease.key);
}

/// What a gRPC code does to the record: the HTTP rule applied to the code's HTTP status
/// (`ABORTED` is retryable, like a 409 with `Retry-After`).
fn after_code(code: Code) -> After {
    let status = code.http_status();
    if code == Code::Ok {
        After::Complete
    } else if code == Code::Aborted
        || status.is_server_error()
        || status == StatusCode::TOO_MANY_REQUESTS
    {
        After::Fail
    } else {
        After::Release
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
    shared.settled.settle(&lease.scope, &lease.key);
}

/// Marks the record failed if the flow is dropped while it owns the lease (or, with
/// `abandon`, leaves it running for its lease to end; with `phases` and no phase begun,
/// releases it).
struct FailOnDrop<'a, St: Store> {
    shared: &'a Arc<Shared<St>>,
    lease: Option<&'a Lease>,
    abandon: bool,
    phases: Option<&'a Phases<St>>,
}

impl<St: Store> FailOnDrop<'_, St> {
    fn disarm(&mut self) {
        self.lease = None;
    }
}

impl<St: Store> Drop for FailOnDrop<'_, St> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        if self.abandon {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let shared = self.shared.clone();
        let lease = lease.clone();
        if self
            .phases
            .is_some_and(|phases| !phases.began() && phases.recovery_point().is_none())
        {
            runtime.spawn(async move { release(&shared, &lease).await });
        } else {
            runtime.spawn(async move { fail(&shared, &lease).await });
        }
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

pub(super) fn replay<B>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    if let Some(limit) = stored.body_withheld() {
        return replay_withheld(&stored, limit);
    }
    let mut headers = HeaderMap::new();
    let mut trailers = HeaderMap::new();
    for (name, value) in &stored.headers {
        let (map, name) = match name.strip_prefix(TRAILER_PREFIX) {
            Some(name) => (&mut trailers, name),
            None => (&mut headers, name.as_str()),
        };
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            map.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let trailers = (!trailers.is_empty()).then_some(trailers);
    let mut response = Response::new(ResponseBody::buffered(stored.body, trailers));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    *response.headers_mut() = headers;
    response
}

/// The answer to a retry of a request that was carried out and whose answer's body was over
/// the bound kept for replay: its status and headers (less those that describe the body it
/// no longer has), with a `replay_body_too_large` problem naming the bound as the body; for
/// gRPC, `ALREADY_EXISTS` with the same words.
fn replay_withheld<B>(stored: &StoredResponse, limit: u64) -> Response<ResponseBody<B>> {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let grpc = stored.headers.iter().any(|(name, value)| {
        name.eq_ignore_ascii_case("content-type") && value.starts_with("application/grpc")
    });
    let problem = Problem::new(status, problem::REPLAY_BODY_TOO_LARGE)
        .title("Answer too large to replay")
        .detail(format!(
            "the request with this Idempotency-Key was carried out and answered {}; its body \
             was larger than the {limit} bytes kept for replay, so it cannot be sent again, \
             and the request is not run again",
            status.as_u16()
        ))
        .with("max_replay_body", limit);
    let mut response: Response<ResponseBody<B>> = if grpc {
        problem
            .grpc_code(Code::AlreadyExists)
            .outcome(crate::status::Outcome::of_code(Code::AlreadyExists))
            .into_grpc_response()
    } else {
        problem.into_http_response()
    };
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        // The trailers and the marker stay in the store; the headers that describe the body
        // would describe one that is not sent.
        let lower = name.to_ascii_lowercase();
        let describes_body =
            lower.starts_with("content-") || lower == "etag" || lower == "last-modified";
        if lower.starts_with(TRAILER_PREFIX) || lower == BODY_WITHHELD || describes_body {
            continue;
        }
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

fn bad_request<B: From<Bytes>>(
    code: &'static str,
    detail: &'static str,
    protocol: Protocol,
) -> Response<B> {
    Problem::from_status(&Status::new(Code::InvalidArgument, detail).with_problem(code))
        .into_response_for(protocol)
}

fn too_large<B: From<Bytes>>(max: usize) -> Response<B> {
    Problem::new(StatusCode::PAYLOAD_TOO_LARGE, problem::BODY_TOO_LARGE)
        .detail(format!("the request body exceeds {max} bytes"))
        .into_http_response()
}

fn deadline_exceeded<B: From<Bytes>>(protocol: Protocol) -> Response<B> {
    let status = Status::new(
        Code::DeadlineExceeded,
        "the deadline passed before the request could start",
    )
    .with_problem(problem::DEADLINE_EXCEEDED);
    Problem::from_status(&status).into_response_for(protocol)
}

fn store_unavailable<B: From<Bytes>>(protocol: Protocol) -> Response<B> {
    let status = Status::new(Code::Unavailable, "the idempotency store is unavailable")
        .with_problem(STORE_UNAVAILABLE)
        .with_pushback(STORE_RETRY_AFTER);
    Problem::from_status(&status).into_response_for(protocol)
}

#[cfg(test)]
mod tests;
