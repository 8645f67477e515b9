//! Who is calling: the [`Tenant`] request extension, and [`TenantLayer`] which sets it.
//!
//! The rate limiter keys its buckets by tenant and the idempotency layer scopes its records by
//! tenant, so one merchant's key can never replay another merchant's response. A request
//! without a `Tenant` extension belongs to the tenant [`Tenant::DEFAULT`].
//!
//! [`TenantLayer::from_fn`] runs an authentication function on the request head: it returns the
//! tenant, or a [`Status`] (for example `UNAUTHENTICATED`) that is answered as problem+json
//! without calling the inner service. An HTTP `401` (`UNAUTHENTICATED`) also carries
//! `WWW-Authenticate: Bearer`, the challenge RFC 9110 requires on every 401.
//!
//! ```
//! use backstop::server::tenant::{Tenant, TenantLayer};
//! use backstop::status::{Code, Status};
//!
//! let layer = TenantLayer::from_fn(|head: &http::request::Parts| {
//!     match head.headers.get("authorization").and_then(|v| v.to_str().ok()) {
//!         Some("Bearer key-acme") => Ok(Tenant::new("acme")),
//!         _ => Err(Status::new(Code::Unauthenticated, "unknown API key")
//!             .with_problem("unauthenticated")),
//!     }
//! });
//! # let _ = layer;
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderValue, Request, Response, header, request::Parts};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::body::ResponseBody;
use super::problem::{Problem, Protocol};
use super::reject::RejectOr;
use crate::status::{Code, Status};

/// The tenant (merchant, account) a request belongs to; a request extension.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tenant(pub String);

impl Tenant {
    /// The tenant of a request that carries none (the gate's [`DEFAULT_TENANT`]).
    ///
    /// [`DEFAULT_TENANT`]: crate::admission::DEFAULT_TENANT
    pub const DEFAULT: &'static str = crate::admission::DEFAULT_TENANT;

    /// A tenant with the given id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The tenant id.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The tenant id of a request: its `Tenant` extension, or [`Tenant::DEFAULT`].
    pub fn of<B>(request: &Request<B>) -> &str {
        Self::from_extensions(request.extensions())
    }

    /// The tenant id in a set of extensions, or [`Tenant::DEFAULT`].
    pub fn from_extensions(extensions: &http::Extensions) -> &str {
        extensions
            .get::<Tenant>()
            .map_or(Self::DEFAULT, Tenant::as_str)
    }
}

impl Default for Tenant {
    fn default() -> Self {
        Self(Self::DEFAULT.to_owned())
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

type Resolve = dyn Fn(&Parts) -> Result<Tenant, Status> + Send + Sync;

/// Sets the [`Tenant`] extension from the request head, or refuses the request.
///
/// The default layer resolves nothing: it passes every request through unchanged.
#[derive(Clone, Default)]
pub struct TenantLayer {
    resolve: Option<Arc<Resolve>>,
}

impl fmt::Debug for TenantLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantLayer")
            .field("resolve", &self.resolve.as_ref().map(|_| ".."))
            .finish()
    }
}

impl TenantLayer {
    /// A layer that passes requests through unchanged (tenant from an outer layer, or default).
    pub fn none() -> Self {
        Self::default()
    }

    /// A layer that runs `resolve` on each request head: `Ok(tenant)` sets the extension,
    /// `Err(status)` answers with that status as problem+json.
    pub fn from_fn<F>(resolve: F) -> Self
    where
        F: Fn(&Parts) -> Result<Tenant, Status> + Send + Sync + 'static,
    {
        Self {
            resolve: Some(Arc::new(resolve)),
        }
    }
}

impl<S> Layer<S> for TenantLayer {
    type Service = SetTenant<S>;

    fn layer(&self, inner: S) -> Self::Service {
        SetTenant {
            inner,
            resolve: self.resolve.clone(),
        }
    }
}

/// The service made by [`TenantLayer`].
#[derive(Clone)]
pub struct SetTenant<S> {
    inner: S,
    resolve: Option<Arc<Resolve>>,
}

impl<S: fmt::Debug> fmt::Debug for SetTenant<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SetTenant")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for SetTenant<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let Some(resolve) = &self.resolve else {
            return ResponseFuture::new(RejectOr::inner(self.inner.call(request)));
        };
        let (mut head, body) = request.into_parts();
        match resolve(&head) {
            Ok(tenant) => {
                head.extensions.insert(tenant);
                let request = Request::from_parts(head, body);
                ResponseFuture::new(RejectOr::inner(self.inner.call(request)))
            }
            Err(status) => ResponseFuture::new(RejectOr::reject(refusal(&status, &head))),
        }
    }
}

/// The answer to a request whose tenant was refused: problem+json (or a gRPC status), with
/// the `Bearer` challenge on an HTTP 401.
fn refusal<B>(status: &Status, head: &Parts) -> Response<ResponseBody<B>> {
    let protocol = Protocol::of(&head.headers);
    let mut response = Problem::from_status(status).into_response_for(protocol);
    if protocol == Protocol::Http && status.code() == Code::Unauthenticated {
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    response
}

pin_project! {
    /// Response future of [`SetTenant`].
    #[derive(Debug)]
    pub struct ResponseFuture<F, B> {
        #[pin]
        inner: RejectOr<F, B>,
    }
}

impl<F, B> ResponseFuture<F, B> {
    fn new(inner: RejectOr<F, B>) -> Self {
        Self { inner }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::testing::flat;
    use bytes::Bytes;
    use std::convert::Infallible;
    use tower::{ServiceExt, service_fn};

    async fn echo_tenant(req: Request<Bytes>) -> Result<Response<Bytes>, Infallible> {
        Ok(Response::new(Bytes::from(Tenant::of(&req).to_owned())))
    }

    fn auth() -> TenantLayer {
        TenantLayer::from_fn(|head: &Parts| {
            match head.headers.get("authorization").map(|v| v.as_bytes()) {
                Some(b"Bearer a") => Ok(Tenant::new("acme")),
                _ => Err(Status::new(Code::Unauthenticated, "unknown key")
                    .with_problem("unauthenticated")),
            }
        })
    }

    #[tokio::test]
    async fn default_tenant_when_none_is_set() {
        let svc = TenantLayer::none().layer(service_fn(echo_tenant));
        let res = flat(svc.oneshot(Request::new(Bytes::new())).await.unwrap());
        assert_eq!(res.body(), "default");
    }

    #[tokio::test]
    async fn resolver_sets_the_extension() {
        let svc = auth().layer(service_fn(echo_tenant));
        let req = Request::builder()
            .header("authorization", "Bearer a")
            .body(Bytes::new())
            .unwrap();
        let res = flat(svc.oneshot(req).await.unwrap());
        assert_eq!(res.body(), "acme");
    }

    #[tokio::test]
    async fn resolver_refusal_is_a_problem_and_skips_the_service() {
        let svc = auth().layer(service_fn(|_req: Request<Bytes>| async {
            panic!("the inner service must not run");
            #[allow(unreachable_code)]
            Ok::<Response<Bytes>, Infallible>(Response::new(Bytes::new()))
        }));
        let res = flat(svc.oneshot(Request::new(Bytes::new())).await.unwrap());
        assert_eq!(res.status(), 401);
        assert_eq!(res.headers()[header::WWW_AUTHENTICATE], "Bearer");
        let doc: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
        assert_eq!(doc["code"], "unauthenticated");
    }

    #[tokio::test]
    async fn grpc_refusal_carries_no_http_challenge() {
        let svc = auth().layer(service_fn(echo_tenant));
        let req = Request::builder()
            .header("content-type", "application/grpc")
            .body(Bytes::new())
            .unwrap();
        let res = flat(svc.oneshot(req).await.unwrap());
        assert_eq!(res.headers()["grpc-status"], "16");
        assert!(!res.headers().contains_key(header::WWW_AUTHENTICATE));
    }
}
