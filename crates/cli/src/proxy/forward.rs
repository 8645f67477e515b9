//! The forwarder: the service at the bottom of the server stack, sending each request to the
//! upstream over pooled connections (HTTP/1.1, or HTTP/2 with prior knowledge for gRPC) and
//! handing back its answer.
//!
//! What it adds to the request: the remaining budget minus the hop's margin, in the caller's
//! header form ([`budget`](super::budget)); on a keyed route the record's effect key
//! ([`Lease::effect_key`]: the same for every run of the key), in the effect key header, which
//! a caller can never set itself; `X-Forwarded-For`, `-Host` and `-Proto`. Hop-by-hop headers
//! are removed both ways.
//!
//! What it answers itself, as problem+json (or gRPC status):
//!
//! - 504 `deadline_exceeded` when the budget left cannot cover the margin: nothing is sent;
//! - 503 `upstream_unavailable` + `Retry-After` when no connection to the upstream could be
//!   made: nothing reached it, and on a keyed route the key stays unused;
//! - 502 `upstream_failed` when a pass-through request was sent and no answer came back;
//! - on a keyed route, a request sent without an answer coming back is an error
//!   ([`OutcomeUnknown`]), not an answer: the idempotency layer then keeps the key's record
//!   running, so no retry forwards it again (a retry learns `outcome_unknown` when the lease
//!   ends), or, on a route whose upstream deduplicates by the effect key, marks it failed so a
//!   retry forwards it again under the same effect key. The caller gets 502
//!   `upstream_outcome_unknown`.
//!
//! When the deadline passes the deadline layer drops this future, and with it the upstream
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

use backstop::client::connect::{self, Balanced};
use backstop::deadline::Deadline;
use backstop::idempotency::postgres::PostgresStore;
use backstop::idempotency::sqlite::SqliteStore;
use backstop::idempotency::{Store, StoreError};
use backstop::policy::{MethodPolicies, Takeover};
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

use super::budget::{BudgetForm, TimeoutHeaders};

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
#[error("the upstream did not answer a keyed request it was sent: {0}")]
pub(crate) struct OutcomeUnknown(#[source] pub(crate) BoxError);

/// Sends requests to the upstream; see the [module docs](self).
pub(crate) struct Forwarder<St> {
    http1: Upstream,
    h2c: Upstream,
    protocol: UpstreamProtocol,
    policies: Arc<MethodPolicies>,
    timeouts: TimeoutHeaders,
    margin: Duration,
    effect_key_header: HeaderName,
    store: PhantomData<fn() -> St>,
}

impl<St> Clone for Forwarder<St> {
    fn clone(&self) -> Self {
        Self {
            http1: self.http1.clone(),
            h2c: self.h2c.clone(),
            protocol: self.protocol,
            policies: self.policies.clone(),
            timeouts: self.timeouts.clone(),
            margin: self.margin,
            effect_key_header: self.effect_key_header.clone(),
            store: PhantomData,
        }
    }
}

impl<St> std::fmt::Debug for Forwarder<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("protocol", &self.protocol)
            .field("margin", &self.margin)
            .finish_non_exhaustive()
    }
}

/// What the forwarder needs besides the upstreams.
#[derive(Debug, Clone)]
pub(crate) struct ForwardSettings {
    pub(crate) protocol: UpstreamProtocol,
    pub(crate) policies: Arc<MethodPolicies>,
    pub(crate) timeouts: TimeoutHeaders,
    pub(crate) margin: Duration,
    pub(crate) effect_key_header: HeaderName,
    /// How long an idle pooled connection to the upstream is kept.
    pub(crate) idle_timeout: Duration,
}

/// A pooled client with the settings of the library's
/// [`connect::pooled`](backstop::client::connect::pooled) (`TCP_NODELAY`, 5 s connect timeout),
/// but idle connections kept only `idle`: shorter than the upstream keeps them, so that a
/// request is never written on a connection the upstream is closing. That race would leave a
/// keyed request's outcome unknown although the upstream never read it.
fn pooled(http2: bool, idle: Duration) -> connect::HttpClient<UpstreamBody> {
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(idle)
        .http2_only(http2)
        .build(connector)
}

impl<St: ProxyStore> Forwarder<St> {
    /// A forwarder balancing over `upstreams` (each `http://HOST:PORT`). Call it inside the
    /// runtime: the balancers' workers are spawned on it.
    pub(crate) fn new(upstreams: &[Uri], settings: ForwardSettings) -> Self {
        let balanced = |http2: bool| -> Upstream {
            let endpoints =
                connect::endpoints(pooled(http2, settings.idle_timeout), upstreams.to_vec())
                    .expect("upstream URLs are checked when read");
            connect::balanced(endpoints, connect::DEFAULT_BUFFER)
        };
        Self {
            http1: balanced(false),
            h2c: balanced(true),
            protocol: settings.protocol,
            policies: settings.policies,
            timeouts: settings.timeouts,
            margin: settings.margin,
            effect_key_header: settings.effect_key_header,
            store: PhantomData,
        }
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

        // The budget the upstream gets: what is left minus the hop's margin.
        let deadline = parts
            .extensions
            .get::<Deadline>()
            .copied()
            .or_else(Deadline::current);
        let form = parts
            .extensions
            .get::<BudgetForm>()
            .cloned()
            .unwrap_or(BudgetForm::Absent);
        if let Some(deadline) = deadline {
            let written = deadline.child(self.margin).ok().and_then(|child| {
                self.timeouts
                    .write(&mut parts.headers, &form, child.remaining())
            });
            if written.is_none() {
                return refuse(Problem::from_status(
                    &Status::new(
                        Code::DeadlineExceeded,
                        "the budget left cannot cover the way to the upstream",
                    )
                    .with_problem(backstop::status::problem::DEADLINE_EXCEEDED),
                ));
            }
        }

        // A caller never chooses the effect key; a keyed request carries its record's.
        parts.headers.remove(&self.effect_key_header);
        let phases = parts.extensions.get::<Phases<St>>().cloned();
        let keyed = phases.is_some();
        if let Some(phases) = &phases {
            let takeover = self
                .policies
                .for_route(&parts.method, parts.uri.path())
                .takeover();
            // Before the request leaves, on a route whose upstream deduplicates by the effect
            // key: the claim and this point become durable in one commit, and a run that
            // takes the key over after a crash forwards again under the same key.
            if takeover != Takeover::Refuse && phases.recovery_point().is_none() {
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

        let http2 = match self.protocol {
            UpstreamProtocol::Auto => protocol.is_grpc(),
            UpstreamProtocol::Http1 => false,
            UpstreamProtocol::H2c => true,
        };
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        let body: UpstreamBody = body.map_err(|e| -> BoxError { e.into() }).boxed_unsync();
        let mut upstream_request = Request::new(body);
        *upstream_request.method_mut() = parts.method;
        *upstream_request.uri_mut() = path.parse().unwrap_or_else(|_| Uri::from_static("/"));
        *upstream_request.version_mut() = if http2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        *upstream_request.headers_mut() = parts.headers;
        let upstream = if http2 { self.h2c } else { self.http1 };

        let sent: BoxFuture<'static, Result<Response<Incoming>, BoxError>> =
            Box::pin(upstream.oneshot(upstream_request));
        match sent.await {
            Ok(response) => {
                let (mut head, body) = response.into_parts();
                strip_hop_by_hop(&mut head.headers);
                Ok(Response::from_parts(head, ResponseBody::inner(body)))
            }
            Err(error) if never_sent(&*error) => {
                tracing::warn!(error = %chain(&*error), "upstream unreachable");
                refuse(Problem::from_status(
                    &Status::new(Code::Unavailable, "the upstream cannot be reached")
                        .with_problem(UPSTREAM_UNAVAILABLE)
                        .with_pushback(UNAVAILABLE_RETRY_AFTER),
                ))
            }
            Err(error) if keyed => {
                tracing::warn!(error = %chain(&*error), "keyed request sent, no answer");
                Err(OutcomeUnknown(error))
            }
            Err(error) => {
                tracing::warn!(error = %chain(&*error), "request sent, no answer");
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

/// The answer to a keyed request the upstream got and did not answer.
pub(crate) fn outcome_unknown<B: From<Bytes>>(protocol: Protocol) -> Response<B> {
    Problem::new(StatusCode::BAD_GATEWAY, UPSTREAM_OUTCOME_UNKNOWN)
        .grpc_code(Code::Unknown)
        .detail(
            "the request was sent to the upstream and no answer came back: its effect may \
             have happened. A retry with the same Idempotency-Key is never forwarded again \
             unless the upstream deduplicates by the effect key",
        )
        .into_response_for(protocol)
}

/// Whether `error` says the request never reached the upstream: no connection could be made.
fn never_sent(error: &(dyn StdError + 'static)) -> bool {
    let mut cause: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(e) = cause {
        if let Some(client) = e.downcast_ref::<hyper_util::client::legacy::Error>() {
            return client.is_connect();
        }
        cause = e.source();
    }
    false
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
