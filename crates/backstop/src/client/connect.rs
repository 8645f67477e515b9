//! Connection management: pooled connections, load balancing across endpoints, reconnects.
//!
//! Thin glue over hyper-util and tower, which already do this well:
//!
//! - [`pooled`] builds a hyper-util client: connections are pooled per endpoint and kept
//!   alive, a broken connection is dropped from the pool and the next request dials a new one
//!   (that is the reconnect), HTTP/2 multiplexes every call over one connection per endpoint
//!   when `http2_only` is set (gRPC).
//! - [`Endpoint`] pins a client to one address: it rewrites each request's scheme and authority.
//! - [`balanced`] spreads calls over several endpoints with tower's power-of-two-choices
//!   balancer on pending requests (a slow or stuck endpoint collects fewer calls), behind a
//!   `Buffer` so the result is `Clone` and shared by every stack calling the destination. An
//!   endpoint that refuses a connection (a replica restarting) fails fast, so it would look
//!   the least loaded and draw the calls: [`CoolDown`] leaves it out of the choice for
//!   [`COOL_DOWN`] after each refusal.
//!
//! A tonic `Channel` is already pooled and balanced (`Channel::balance_list`); it goes below
//! the stack as it is.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Uri};
use http_body::Body;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower::BoxError;
use tower::balance::p2c::Balance;
use tower::buffer::Buffer;
use tower::discover::ServiceList;
use tower::load::{CompleteOnResponse, PendingRequests};
use tower::util::BoxService;
use tower_service::Service;

use super::reach::{Unsent, unsent};

/// A pooled hyper-util HTTP client.
pub type HttpClient<B> = Client<HttpConnector, B>;

/// Requests queued for the balancer before callers wait.
pub const DEFAULT_BUFFER: usize = 1024;

/// How long [`pooled`] keeps an idle connection.
pub const DEFAULT_POOL_IDLE: Duration = Duration::from_secs(90);

/// A pooled client with `TCP_NODELAY`, a 5 s connect timeout, idle connections kept
/// [`DEFAULT_POOL_IDLE`]; HTTP/2 only when `http2_only` (gRPC), else HTTP/1.1.
pub fn pooled<B>(http2_only: bool) -> HttpClient<B>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    pooled_idle(http2_only, DEFAULT_POOL_IDLE)
}

/// [`pooled`], keeping idle connections `idle`. Keep it shorter than the peer keeps them: a
/// request written on a connection the peer is closing is lost without an answer, and a
/// keyed request's outcome is then unknown although the peer never read it.
pub fn pooled_idle<B>(http2_only: bool, idle: Duration) -> HttpClient<B>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(idle)
        .http2_only(http2_only)
        .build(connector)
}

/// An endpoint URI without a scheme or an authority.
#[derive(Debug, Clone, thiserror::Error)]
#[error("endpoint {uri} needs a scheme and an authority (e.g. http://127.0.0.1:8080)")]
pub struct EndpointError {
    /// The URI given.
    pub uri: Uri,
}

/// Sends every request to one address: the request keeps its path and query, the endpoint sets
/// scheme and authority.
#[derive(Debug, Clone)]
pub struct Endpoint<S> {
    inner: S,
    scheme: Scheme,
    authority: Authority,
}

impl<S> Endpoint<S> {
    /// `inner` pinned to `uri` (its path is ignored).
    pub fn new(inner: S, uri: &Uri) -> Result<Self, EndpointError> {
        match (uri.scheme(), uri.authority()) {
            (Some(scheme), Some(authority)) => Ok(Self {
                inner,
                scheme: scheme.clone(),
                authority: authority.clone(),
            }),
            _ => Err(EndpointError { uri: uri.clone() }),
        }
    }

    /// The address requests go to.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }
}

impl<S, B> Service<Request<B>> for Endpoint<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let path = request
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        parts.path_and_query = Some(path);
        if let Ok(uri) = Uri::from_parts(parts) {
            *request.uri_mut() = uri;
        }
        self.inner.call(request)
    }
}

/// One client pinned to each of `uris`.
pub fn endpoints<S: Clone>(
    client: S,
    uris: impl IntoIterator<Item = Uri>,
) -> Result<Vec<Endpoint<S>>, EndpointError> {
    uris.into_iter()
        .map(|uri| Endpoint::new(client.clone(), &uri))
        .collect()
}

/// How long [`CoolDown`] leaves an endpoint out after it refused a connection.
pub const COOL_DOWN: Duration = Duration::from_millis(250);

/// An endpoint that is not ready for [`COOL_DOWN`] (or the period given) after a call to it
/// failed to connect, so that a balancer sends the calls elsewhere meanwhile instead of to the
/// endpoint that fails them fastest. Only refused or failed connections count: the request
/// never reached that endpoint, and a replica that is restarting refuses them.
#[derive(Debug)]
pub struct CoolDown<S> {
    inner: S,
    state: Arc<CoolState>,
    period: Duration,
    /// Set while cooling down: wakes the balancer when the period ends.
    sleep: Option<Pin<Box<Sleep>>>,
}

#[derive(Debug, Default)]
struct CoolState {
    /// Whether `until` may be in the future: read on every `poll_ready`, so that the lock is
    /// taken only after a refusal.
    cooling: AtomicBool,
    until: Mutex<Option<Instant>>,
}

impl CoolState {
    fn cool_until(&self, until: Instant) {
        *self.until.lock().unwrap_or_else(PoisonError::into_inner) = Some(until);
        self.cooling.store(true, Ordering::Release);
    }

    fn until(&self) -> Option<Instant> {
        *self.until.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<S> CoolDown<S> {
    /// `inner`, left out for `period` after each failed connection.
    pub fn new(inner: S, period: Duration) -> Self {
        Self {
            inner,
            state: Arc::default(),
            period,
            sleep: None,
        }
    }
}

/// Whether `error` says the connection could not be made (refused, or any connect error of
/// the hyper-util client).
fn failed_to_connect(error: &(dyn StdError + 'static)) -> bool {
    unsent(error) == Some(Unsent::Connect)
}

impl<S, Req> Service<Req> for CoolDown<S>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = CoolDownFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.state.cooling.load(Ordering::Acquire) {
            if let Some(until) = self.state.until().filter(|u| *u > Instant::now()) {
                let sleep = self
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
                if sleep.deadline() != until {
                    sleep.as_mut().reset(until);
                }
                ready!(sleep.as_mut().poll(cx));
            }
            self.state.cooling.store(false, Ordering::Release);
            self.sleep = None;
        }
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        CoolDownFuture {
            inner: self.inner.call(request),
            state: Arc::clone(&self.state),
            period: self.period,
        }
    }
}

pin_project! {
    /// The response future of [`CoolDown`].
    #[derive(Debug)]
    pub struct CoolDownFuture<F> {
        #[pin]
        inner: F,
        state: Arc<CoolState>,
        period: Duration,
    }
}

impl<F, T, E> Future for CoolDownFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        Poll::Ready(ready!(this.inner.poll(cx)).map_err(|e| {
            let e = e.into();
            if failed_to_connect(&*e) {
                this.state.cool_until(Instant::now() + *this.period);
            }
            e
        }))
    }
}

/// The balanced, shared service [`balanced`] returns.
pub type Balanced<Req, Rsp> =
    Buffer<Req, Pin<Box<dyn Future<Output = Result<Rsp, BoxError>> + Send + 'static>>>;

/// Balances calls over `services` (power of two choices on pending requests; an endpoint that
/// refused a connection is left out for [`COOL_DOWN`], see [`CoolDown`]), behind a buffer of
/// `capacity` queued requests. Must be called inside a tokio runtime (the buffer's worker is
/// spawned on it).
pub fn balanced<S, Req>(services: Vec<S>, capacity: usize) -> Balanced<Req, S::Response>
where
    S: Service<Req> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    S::Response: Send + 'static,
    Req: Send + 'static,
{
    let loaded: Vec<PendingRequests<CoolDown<S>>> = services
        .into_iter()
        .map(|s| PendingRequests::new(CoolDown::new(s, COOL_DOWN), CompleteOnResponse::default()))
        .collect();
    let balance = Balance::new(ServiceList::new(loaded));
    Buffer::new(BoxService::new(balance), capacity.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Response;
    use std::io;
    use tower::ServiceExt;
    use tower::service_fn;

    #[tokio::test]
    async fn endpoints_rewrite_the_authority_and_keep_the_path() {
        let echo = service_fn(|r: Request<()>| async move {
            Ok::<_, BoxError>(Response::new(r.uri().to_string()))
        });
        let uri: Uri = "http://10.0.0.7:8080".parse().unwrap();
        let endpoint = Endpoint::new(echo, &uri).unwrap();
        let request = Request::get("/v1/charges?x=1").body(()).unwrap();
        let response = endpoint.oneshot(request).await.unwrap();
        assert_eq!(response.body(), "http://10.0.0.7:8080/v1/charges?x=1");
        assert!(Endpoint::new((), &"/relative".parse().unwrap()).is_err());
    }

    #[tokio::test]
    async fn the_balancer_spreads_calls_over_every_endpoint() {
        let hits = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
        let services: Vec<_> = (0..3)
            .map(|i| {
                let hits = hits.clone();
                service_fn(move |_r: Request<()>| {
                    *hits.lock().unwrap().entry(i).or_insert(0) += 1;
                    async move { Ok::<_, BoxError>(Response::new(i)) }
                })
            })
            .collect();
        let svc = balanced(services, 16);
        for _ in 0..60 {
            svc.clone().oneshot(Request::new(())).await.unwrap();
        }
        let hits = hits.lock().unwrap();
        assert_eq!(hits.len(), 3, "{hits:?}");
    }

    /// A replica that refuses connections (restarting) fails fast, so on pending requests it
    /// would look the least loaded and draw the calls (and their retries) of a rolling restart:
    /// after a refusal it is left out of the choice for the cool-down, and the calls go to the
    /// others meanwhile (issue 14, item 3).
    #[tokio::test(start_paused = true)]
    async fn an_endpoint_that_refused_a_connection_is_left_out_while_it_cools_down() {
        let hits = std::sync::Arc::new(std::sync::Mutex::new([0usize; 2]));
        let services: Vec<_> = (0..2)
            .map(|i| {
                let hits = hits.clone();
                service_fn(move |_r: Request<()>| {
                    hits.lock().unwrap()[i] += 1;
                    async move {
                        if i == 0 {
                            Err(io::Error::from(io::ErrorKind::ConnectionRefused))
                        } else {
                            Ok(Response::new(()))
                        }
                    }
                })
            })
            .collect();
        let svc = balanced(services, 16);
        let refused = || async {
            for _ in 0..200 {
                if svc.clone().oneshot(Request::new(())).await.is_err() {
                    return true;
                }
            }
            false
        };
        // The balancer picks at random between two equally loaded endpoints: the restarting
        // one is tried soon enough.
        assert!(refused().await);
        let before = *hits.lock().unwrap();
        for _ in 0..50 {
            svc.clone().oneshot(Request::new(())).await.unwrap();
        }
        let after = *hits.lock().unwrap();
        assert_eq!(
            after[0], before[0],
            "no call to the refusing endpoint: {after:?}"
        );
        assert_eq!(after[1], before[1] + 50);
        // Once cooled down it is back in the choice.
        tokio::time::advance(COOL_DOWN).await;
        assert!(refused().await);
    }
}
