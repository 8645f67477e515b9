//! The forwarder: the service at the bottom of the server stack. It sends each request to the
//! upstream through the library's client stack
//! ([`ClientStack`](backstop::client::ClientStack): deadline, retries paid from the upstream's
//! retry budget, hedging, circuit breaker, transparent re-send of attempts that never left)
//! over pooled connections (HTTP/1.1, or HTTP/2 with prior knowledge for gRPC),
//! balanced over the upstream endpoints, and hands back its answer.
//!
//! The client stack runs each route by the routes file's policy as far as sending again is
//! safe ([`RouteTable::client_policies`](super::policy::RouteTable::client_policies)): a keyed
//! route whose upstream does not deduplicate by the effect key is sent once, whatever it
//! says; the others keep their attempts and hedging (an unsafe route retries only answers
//! that say nothing ran). The routes are those in effect when the request is forwarded
//! ([`Routes`]: replaced together with the server stack's on a reload).
//!
//! What it adds to the request: the time left minus the hop's margin (learned by the client
//! stack, at least `--margin`), in the caller's header form
//! ([`timeout_headers`](super::timeout_headers)); on a keyed route the record's effect key ([`Lease::effect_key`]: the same for every run of
//! the key), in the effect key header, which a caller can never set itself;
//! `X-Forwarded-For`, `-Host` and `-Proto`. Hop-by-hop headers are removed both ways.
//!
//! What it answers itself, as problem+json (or gRPC status):
//!
//! - 504 `deadline_exceeded` when the budget left cannot cover the margin: nothing is sent;
//! - when the caller's own request body broke on its way in (the client stack's
//!   [`Error::is_request_body`](backstop::client::Error::is_request_body)): 400
//!   `request_body_invalid` (malformed framing, cut short), 408 `request_body_timeout`, 413
//!   `body_too_large`, or nothing when the caller's connection is gone; outcome `rejected`, and
//!   never counted against the upstream (its breakers, retry budget, storm alarm, the gate's
//!   slow start and adaptive limit);
//! - when no attempt reached the upstream (the client stack's
//!   [`Error::reach`](backstop::client::Error::reach) is `NotSent`: no connection could be
//!   made, or the circuit is open): 503 `upstream_unavailable` (or `circuit_open`) +
//!   `Retry-After`, and on a keyed route the key stays unused;
//! - 502 `upstream_failed` (504 when the deadline ended the wait) when a request of a route
//!   that is not keyed was sent and no answer came back;
//! - on a keyed route, a request sent without an answer coming back is an error
//!   ([`OutcomeUnknown`]), not an answer: the idempotency layer then keeps the key's record
//!   running, so no retry forwards it again (a retry learns `outcome_unknown` when the lease
//!   ends), or, on a route whose upstream deduplicates by the effect key, marks it failed so a
//!   retry forwards it again under the same effect key. The caller gets 502
//!   `upstream_outcome_unknown` (504 `deadline_exceeded` when the deadline ended the wait).
//!
//! When the deadline passes, the attempt in flight is dropped, and with it the upstream
//! request: its HTTP/1.1 connection is closed (an HTTP/2 stream reset), so the upstream sees
//! the request cancelled.
//!
//! [`Lease::effect_key`]: backstop::idempotency::Lease::effect_key

use std::error::Error as StdError;
use std::future::Future;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use backstop::client::breaker::BreakerConfig;
use backstop::client::connect::{self, Balanced};
use backstop::client::{Destination, Error as ClientError, Reach};
use backstop::deadline::{Deadline, DeadlineExceeded, GRPC_TIMEOUT, Margin, decode_grpc_timeout};
use backstop::idempotency::postgres::PostgresStore;
use backstop::idempotency::sqlite::SqliteStore;
use backstop::idempotency::{Store, StoreError};
use backstop::server::Problem;
use backstop::server::body::ResponseBody;
use backstop::server::idempotency::{NothingDone, Phases};
use backstop::server::listen::ConnectionInfo;
use backstop::server::problem::Protocol;
use backstop::status::{Code, Status};
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use tower::{BoxError, Service, ServiceExt};

use super::endpoints;
use super::policy::RouteTable;
use super::routes::{ClientMaker, Routes};
use super::timeout_headers::{TimeoutForm, TimeoutHeaders};

/// A boxed future that can move between threads.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The body of a request on its way to the upstream.
pub(crate) type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// The upstream endpoints, balanced, over one protocol.
type Upstream = Balanced<Request<UpstreamBody>, Response<Incoming>>;

/// Default request header carrying a keyed request's effect key to the upstream.
pub(crate) const DEFAULT_EFFECT_KEY_HEADER: &str = "idempotency-effect-key";

/// Recovery point a keyed request commits before it is forwarded, on a route whose upstream
/// deduplicates by the effect key: a run that takes the key over forwards again.
pub(crate) const FORWARDED: &str = "forwarded";

/// Problem code: no connection to the upstream could be made.
pub(crate) const UPSTREAM_UNAVAILABLE: &str = "upstream_unavailable";
/// Problem code: a pass-through request was sent and no answer came back.
pub(crate) const UPSTREAM_FAILED: &str = "upstream_failed";
/// Problem code: a keyed request was sent and no answer came back.
pub(crate) const UPSTREAM_OUTCOME_UNKNOWN: &str = "upstream_outcome_unknown";

/// The client stack's destination: the `service` label of the `rpc_client_*` metrics.
pub(crate) const UPSTREAM_DESTINATION: &str = "upstream";

/// Largest request body kept to send again (a retry, a hedge): a keyed body's cap.
const REPLAY_CAP: usize = backstop::server::idempotency::DEFAULT_MAX_BODY;

/// `Retry-After` of an upstream that could not be reached.
const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How requests reach the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum UpstreamProtocol {
    /// gRPC requests over HTTP/2 with prior knowledge (h2c), the rest over HTTP/1.1.
    Auto,
    /// Everything over HTTP/1.1.
    Http1,
    /// Everything over HTTP/2 with prior knowledge (h2c).
    H2c,
}

/// A store the proxy can run on: it can commit a phase with no writes of the application's
/// own (the recovery point alone).
pub(crate) trait ProxyStore: Store {
    /// Writes that do nothing.
    fn no_writes() -> Self::Writes<()>;
}

impl ProxyStore for SqliteStore {
    fn no_writes() -> Self::Writes<()> {
        Box::new(|_| Ok(()))
    }
}

impl ProxyStore for PostgresStore {
    fn no_writes() -> Self::Writes<()> {
        Box::new(|_| Box::pin(async { Ok(()) }))
    }
}

/// A keyed request was sent to the upstream and no answer came back: its effect may have
/// happened.
#[derive(Debug, thiserror::Error)]
#[error("the upstream did not answer a keyed request it was sent")]
pub(crate) struct OutcomeUnknown {
    /// Whether the request's deadline ended the wait (else the connection broke).
    pub(crate) deadline: bool,
    #[source]
    pub(crate) source: BoxError,
}

/// Sends requests to the upstream; see the [module docs](self).
pub(crate) struct Forwarder<St> {
    routes: Routes,
    margin: Duration,
    effect_key_header: HeaderName,
    store: PhantomData<fn() -> St>,
}

impl<St> Clone for Forwarder<St> {
    fn clone(&self) -> Self {
        Self {
            routes: self.routes.clone(),
            margin: self.margin,
            effect_key_header: self.effect_key_header.clone(),
            store: PhantomData,
        }
    }
}

impl<St> std::fmt::Debug for Forwarder<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("margin", &self.margin)
            .finish_non_exhaustive()
    }
}

/// The bottom of the client stack: the balanced, pooled upstream connections, one set per
/// protocol. It writes each attempt's budget (what is left of the request's deadline minus the
/// client stack's margin) in the caller's header form.
#[derive(Clone)]
pub(crate) struct Transport {
    http1: Upstream,
    h2c: Upstream,
    protocol: UpstreamProtocol,
    timeouts: TimeoutHeaders,
    /// The client stack's margin, the one its `grpc-timeout` was computed with.
    margin: Arc<Margin>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("protocol", &self.protocol)
            .finish_non_exhaustive()
    }
}

impl<B> Service<Request<B>> for Transport
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Incoming>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Response<Incoming>, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // The balancers' readiness is awaited per attempt, bounded by its deadline.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        let form = parts
            .extensions
            .get::<TimeoutForm>()
            .cloned()
            .unwrap_or(TimeoutForm::Absent);
        // The upstream gets what is left of the deadline minus the margin, now, in the
        // caller's form. The `grpc-timeout` the client stack wrote is an upper bound too (the
        // margin may have grown since); it alone would not do, being rounded up.
        let budget = parts.extensions.get::<Deadline>().map(|deadline| {
            let left = deadline.remaining().saturating_sub(self.margin.current());
            parts
                .headers
                .get(GRPC_TIMEOUT)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| decode_grpc_timeout(v).ok())
                .map_or(left, |written| written.min(left))
        });
        match budget {
            Some(budget) => {
                if self
                    .timeouts
                    .write(&mut parts.headers, &form, budget)
                    .is_none()
                {
                    // Nothing the caller's form can carry is left: the request is not sent.
                    let exceeded = DeadlineExceeded {
                        remaining: budget,
                        margin: self.margin.current(),
                    };
                    return Box::pin(async move { Err(BoxError::from(exceeded)) });
                }
            }
            None => self.timeouts.strip(&mut parts.headers),
        }
        let http2 = match self.protocol {
            UpstreamProtocol::Auto => Protocol::of(&parts.headers).is_grpc(),
            UpstreamProtocol::Http1 => false,
            UpstreamProtocol::H2c => true,
        };
        parts.version = if http2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        let body: UpstreamBody = body.map_err(|e| -> BoxError { e.into() }).boxed_unsync();
        let upstream = if http2 {
            self.h2c.clone()
        } else {
            self.http1.clone()
        };
        Box::pin(upstream.oneshot(Request::from_parts(parts, body)))
    }
}

/// What the forwarder needs besides the upstreams.
#[derive(Debug, Clone)]
pub(crate) struct ForwardSettings {
    pub(crate) protocol: UpstreamProtocol,
    /// The routes file's table (the client stack's is made from it).
    pub(crate) table: RouteTable,
    /// The client stack's timeout (the budget is the server stack's).
    pub(crate) max_timeout: Duration,
    pub(crate) timeouts: TimeoutHeaders,
    pub(crate) margin: Duration,
    pub(crate) effect_key_header: HeaderName,
    /// How long an idle pooled connection to the upstream is kept.
    pub(crate) idle_timeout: Duration,
    /// The breaker of each endpoint, with several.
    pub(crate) endpoint_breaker: BreakerConfig,
    /// The fleet's retry switch, when followed.
    pub(crate) retry_switch: Option<backstop::retry::RetrySwitch>,
}

impl<St: ProxyStore> Forwarder<St> {
    /// A forwarder balancing over `upstreams` (each `http://HOST:PORT`) through the library's
    /// client stack. Call it inside the runtime: the balancers' workers are spawned on it.
    pub(crate) fn new(
        upstreams: &[Uri],
        settings: ForwardSettings,
    ) -> Result<Self, super::server::ProxyError> {
        // One breaker per endpoint, whichever protocol reaches it.
        let breakers = endpoints::breakers(upstreams, settings.endpoint_breaker)
            .map_err(super::server::ProxyError::Breaker)?;
        let balanced = |http2: bool| -> Upstream {
            endpoints::balanced(
                connect::pooled_idle(http2, settings.idle_timeout),
                upstreams,
                &breakers,
            )
        };
        let destination = Destination::new(UPSTREAM_DESTINATION)
            .margin_floor(settings.margin)
            .retry_switch(settings.retry_switch);
        let transport = Transport {
            http1: balanced(false),
            h2c: balanced(true),
            protocol: settings.protocol,
            timeouts: settings.timeouts,
            margin: destination.margin().clone(),
        };
        let maker = ClientMaker {
            destination,
            transport,
            replay_cap: REPLAY_CAP,
            max_timeout: settings.max_timeout,
        };
        let routes =
            Routes::new(settings.table, maker).map_err(super::server::ProxyError::Client)?;
        Ok(Self {
            routes,
            margin: settings.margin,
            effect_key_header: settings.effect_key_header,
            store: PhantomData,
        })
    }

    /// The routes it forwards by, shared with the server stack.
    pub(crate) fn routes(&self) -> &Routes {
        &self.routes
    }

    async fn forward<B>(
        self,
        request: Request<B>,
    ) -> Result<Response<ResponseBody<Incoming>>, OutcomeUnknown>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (mut parts, body) = request.into_parts();
        let protocol = Protocol::of(&parts.headers);
        let refuse = |problem: Problem| {
            let mut response = problem
                .into_response_for::<Bytes>(protocol)
                .map(ResponseBody::full);
            response.extensions_mut().insert(NothingDone);
            Ok(response)
        };

        // Too little budget left for the way to the upstream: nothing is sent.
        let deadline = parts
            .extensions
            .get::<Deadline>()
            .copied()
            .or_else(Deadline::current);
        if deadline.is_some_and(|deadline| deadline.child(self.margin).is_err()) {
            return refuse(Problem::from_status(
                &Status::new(
                    Code::DeadlineExceeded,
                    "the budget left cannot cover the way to the upstream",
                )
                .with_problem(backstop::status::problem::DEADLINE_EXCEEDED),
            ));
        }

        // A caller never chooses the effect key; a keyed request carries its record's.
        parts.headers.remove(&self.effect_key_header);
        let phases = parts.extensions.get::<Phases<St>>().cloned();
        let keyed = phases.is_some();
        let routes = self.routes.current();
        if let Some(phases) = &phases {
            // Before the request leaves, on a route whose upstream deduplicates by the effect
            // key: the claim and this point become durable in one commit, and a run that
            // takes the key over after a crash forwards again under the same key.
            if routes.resumes(&parts.method, parts.uri.path()) && phases.recovery_point().is_none()
            {
                match phases
                    .commit(FORWARDED, Bytes::new(), St::no_writes())
                    .await
                {
                    Ok(()) => {}
                    Err(StoreError::LeaseLost { .. }) => {
                        return refuse(
                            Problem::new(StatusCode::CONFLICT, "request_in_progress")
                                .detail("another request with this Idempotency-Key took it over")
                                .retry_after(Duration::from_secs(1)),
                        );
                    }
                    Err(error) => {
                        tracing::error!(%error, "cannot record the forward");
                        return refuse(Problem::from_status(
                            &Status::new(Code::Unavailable, "the idempotency store is unavailable")
                                .with_problem("store_unavailable")
                                .with_pushback(Duration::from_secs(1)),
                        ));
                    }
                }
            }
            let value =
                HeaderValue::from_str(&phases.effect_key()).expect("an effect key is hex digits");
            parts.headers.insert(self.effect_key_header.clone(), value);
        }

        let peer = parts
            .extensions
            .get::<ConnectionInfo>()
            .map(ConnectionInfo::peer);
        strip_hop_by_hop(&mut parts.headers);
        forwarded_headers(
            &mut parts.headers,
            peer,
            parts.uri.authority().map(|a| a.as_str()),
        );

        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        parts.uri = path.parse().unwrap_or_else(|_| Uri::from_static("/"));
        let body: UpstreamBody = body.map_err(|e| -> BoxError { e.into() }).boxed_unsync();
        let client = routes
            .client_for(&parts.method, parts.uri.path(), keyed)
            .clone();
        let sent: BoxFuture<'static, Result<Response<Incoming>, ClientError>> =
            Box::pin(client.oneshot(Request::from_parts(parts, body)));
        match sent.await {
            Ok(response) => {
                let (mut head, body) = response.into_parts();
                strip_hop_by_hop(&mut head.headers);
                Ok(Response::from_parts(head, ResponseBody::inner(body)))
            }
            Err(error) if error.is_request_body() => {
                // The caller's own body broke: its 4xx (outcome `rejected`), which no health
                // signal of the upstream's counts.
                tracing::info!(error = %chain(&error), "the caller's request body failed");
                refuse(Problem::from_status(error.status()))
            }
            Err(error) if error.reach() == Reach::NotSent => {
                tracing::warn!(error = %chain(&error), "nothing reached the upstream");
                let status = error.status();
                let status = if error.is_deadline()
                    || status.problem() == backstop::status::problem::CIRCUIT_OPEN
                {
                    status.clone()
                } else {
                    Status::new(Code::Unavailable, "the upstream cannot be reached")
                        .with_problem(UPSTREAM_UNAVAILABLE)
                        .with_pushback(status.pushback().unwrap_or(UNAVAILABLE_RETRY_AFTER))
                };
                refuse(Problem::from_status(&status))
            }
            Err(error) if keyed => {
                tracing::warn!(error = %chain(&error), "keyed request sent, no answer");
                Err(OutcomeUnknown {
                    deadline: error.is_deadline(),
                    source: Box::new(error),
                })
            }
            Err(error) if error.is_deadline() => {
                tracing::debug!(error = %chain(&error), "the deadline passed upstream");
                Ok(Problem::from_status(error.status())
                    .into_response_for::<Bytes>(protocol)
                    .map(ResponseBody::full))
            }
            Err(error) => {
                tracing::warn!(error = %chain(&error), "request sent, no answer");
                Ok(Problem::new(StatusCode::BAD_GATEWAY, UPSTREAM_FAILED)
                    .grpc_code(Code::Unavailable)
                    .detail("the upstream did not answer")
                    .into_response_for::<Bytes>(protocol)
                    .map(ResponseBody::full))
            }
        }
    }
}

impl<St: ProxyStore, B> Service<Request<B>> for Forwarder<St>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<Incoming>>;
    type Error = OutcomeUnknown;
    type Future = BoxFuture<'static, Result<Self::Response, OutcomeUnknown>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The balancers' readiness is awaited per request, bounded by its deadline.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        Box::pin(self.clone().forward(request))
    }
}

/// The answer to a keyed request the upstream got and did not answer: 504
/// `deadline_exceeded` when its deadline ended the wait, else 502 `upstream_outcome_unknown`.
pub(crate) fn outcome_unknown<B: From<Bytes>>(
    error: &OutcomeUnknown,
    protocol: Protocol,
) -> Response<B> {
    const DETAIL: &str = "the request was sent to the upstream and no answer came back: its \
                          effect may have happened. A retry with the same Idempotency-Key is \
                          never forwarded again unless the upstream deduplicates by the effect key";
    let problem = if error.deadline {
        Problem::from_status(
            &Status::new(Code::DeadlineExceeded, DETAIL)
                .with_problem(backstop::status::problem::DEADLINE_EXCEEDED),
        )
    } else {
        Problem::new(StatusCode::BAD_GATEWAY, UPSTREAM_OUTCOME_UNKNOWN)
            .grpc_code(Code::Unknown)
            .detail(DETAIL)
    };
    problem.into_response_for(protocol)
}

/// `error` and its sources on one line.
fn chain(error: &(dyn StdError + 'static)) -> String {
    let mut out = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        out.push_str(": ");
        out.push_str(&e.to_string());
        cause = e.source();
    }
    out
}

/// Headers of one connection, never forwarded (RFC 9110 section 7.6.1), with those the
/// `Connection` header names. `TE: trailers` stays: gRPC needs it.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them: one pass over the names costs less than a hashed
    // lookup per name (twice per request, measured under callgrind).
    let hop_by_hop = |name: &HeaderName| {
        matches!(
            name.as_str(),
            "connection"
                | "transfer-encoding"
                | "upgrade"
                | "proxy-authenticate"
                | "trailer"
                | "keep-alive"
                | "proxy-connection"
                | "te"
        )
    };
    if !headers.keys().any(hop_by_hop) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHENTICATE,
        header::TRAILER,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
    let trailers_only = headers
        .get(header::TE)
        .is_some_and(|te| te.as_bytes().eq_ignore_ascii_case(b"trailers"));
    if !trailers_only {
        headers.remove(header::TE);
    }
}

/// `X-Forwarded-For` (the caller's address appended), `X-Forwarded-Host` (the `Host` the
/// caller asked for, which the upstream's own replaces) and `X-Forwarded-Proto` (`http`,
/// unless the caller's says otherwise).
fn forwarded_headers(headers: &mut HeaderMap, peer: Option<SocketAddr>, authority: Option<&str>) {
    const FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
    const HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
    const PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
    if let Some(peer) = peer {
        let ip = peer.ip().to_string();
        let value = match headers.get(&FOR).and_then(|v| v.to_str().ok()) {
            Some(before) => format!("{before}, {ip}"),
            None => ip,
        };
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(FOR, value);
        }
    }
    let host = headers
        .remove(header::HOST)
        .or_else(|| authority.and_then(|a| HeaderValue::from_str(a).ok()));
    if let Some(host) = host {
        headers.insert(HOST, host);
    }
    // A proxy in front of this one (one that ends TLS) said it first.
    if !headers.contains_key(&PROTO) {
        headers.insert(PROTO, HeaderValue::from_static("http"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_stay_on_their_hop() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "keep-alive, x-secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert(header::TE, "trailers".parse().unwrap());
        h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        strip_hop_by_hop(&mut h);
        let mut names: Vec<_> = h.keys().map(|k| k.as_str().to_owned()).collect();
        names.sort();
        assert_eq!(names, ["content-type", "te"]);
        h.insert(header::TE, "gzip".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert!(!h.contains_key(header::TE));
    }

    #[test]
    fn each_hop_by_hop_header_alone_is_stripped_and_the_rest_kept() {
        for name in [
            "connection",
            "transfer-encoding",
            "upgrade",
            "proxy-authenticate",
            "trailer",
            "keep-alive",
            "proxy-connection",
            "te",
        ] {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
            h.insert(HeaderName::from_static(name), "x".parse().unwrap());
            strip_hop_by_hop(&mut h);
            assert!(!h.contains_key(name), "{name} stays on its hop");
            assert_eq!(h.len(), 1, "{name}: the rest is kept");
        }
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        h.insert("idempotency-key", "k".parse().unwrap());
        let before = h.clone();
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }

    #[test]
    fn forwarded_headers_name_the_caller() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "api.example".parse().unwrap());
        h.insert("x-forwarded-for", "10.0.0.1".parse().unwrap());
        forwarded_headers(&mut h, Some("127.0.0.9:5000".parse().unwrap()), None);
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 127.0.0.9");
        assert_eq!(h["x-forwarded-host"], "api.example");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert!(!h.contains_key(header::HOST));
    }
}
