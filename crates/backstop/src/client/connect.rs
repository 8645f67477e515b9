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
//!   `Buffer` so the result is `Clone` and shared by every stack calling the destination.
//!
//! A tonic `Channel` is already pooled and balanced (`Channel::balance_list`); it goes below
//! the stack as it is.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Uri};
use http_body::Body;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tower::BoxError;
use tower::balance::p2c::Balance;
use tower::buffer::Buffer;
use tower::discover::ServiceList;
use tower::load::{CompleteOnResponse, PendingRequests};
use tower::util::BoxService;
use tower_service::Service;

/// A pooled hyper-util HTTP client.
pub type HttpClient<B> = Client<HttpConnector, B>;

/// Requests queued for the balancer before callers wait.
pub const DEFAULT_BUFFER: usize = 1024;

/// A pooled client with `TCP_NODELAY`, idle connections kept 90 s; HTTP/2 only when
/// `http2_only` (gRPC), else HTTP/1.1.
pub fn pooled<B>(http2_only: bool) -> HttpClient<B>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
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

/// The balanced, shared service [`balanced`] returns.
pub type Balanced<Req, Rsp> =
    Buffer<Req, Pin<Box<dyn Future<Output = Result<Rsp, BoxError>> + Send + 'static>>>;

/// Balances calls over `services` (power of two choices on pending requests), behind a buffer
/// of `capacity` queued requests. Must be called inside a tokio runtime (the buffer's worker
/// is spawned on it).
pub fn balanced<S, Req>(services: Vec<S>, capacity: usize) -> Balanced<Req, S::Response>
where
    S: Service<Req> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    S::Response: Send + 'static,
    Req: Send + 'static,
{
    let loaded: Vec<PendingRequests<S>> = services
        .into_iter()
        .map(|s| PendingRequests::new(s, CompleteOnResponse::default()))
        .collect();
    let balance = Balance::new(ServiceList::new(loaded));
    Buffer::new(BoxService::new(balance), capacity.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Response;
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
}
