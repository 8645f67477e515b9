//! One protocol per port: a gRPC request on the HTTP port, or a plain HTTP request on the gRPC
//! port, is refused with `415` problem+json, instead of being answered in the other protocol's
//! form (a `200` carrying a `grpc-status` means nothing to an HTTP client).

use std::convert::Infallible;
use std::task::{Context, Poll};

use axum::response::Response;
use backstop::server::problem::{GRPC_CONTENT_TYPE, Problem, Protocol};
use futures_util::future::{Either, Ready, ready};
use http::{Request, StatusCode, Version};
use tower::{Layer, Service};

/// `415`: `Content-Type: application/grpc` on the HTTP port.
pub const GRPC_ON_HTTP_PORT: &str = "grpc_on_http_port";
/// `415`: anything but gRPC (HTTP/2, `Content-Type: application/grpc`) on the gRPC port.
pub const GRPC_REQUIRED: &str = "grpc_required";

fn any_grpc_content_type(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(http::header::CONTENT_TYPE)
        .iter()
        .any(|value| {
            value
                .as_bytes()
                .get(..GRPC_CONTENT_TYPE.len())
                .is_some_and(|prefix| prefix.eq_ignore_ascii_case(GRPC_CONTENT_TYPE.as_bytes()))
        })
}

/// Which protocol a port speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Port {
    Http,
    Grpc,
}

/// Refuses requests of the other protocol (see the [module docs](self)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OneProtocolLayer(pub(crate) Port);

impl<S> Layer<S> for OneProtocolLayer {
    type Service = OneProtocol<S>;

    fn layer(&self, inner: S) -> Self::Service {
        OneProtocol {
            inner,
            port: self.0,
        }
    }
}

/// See [`OneProtocolLayer`].
#[derive(Debug, Clone)]
pub(crate) struct OneProtocol<S> {
    inner: S,
    port: Port,
}

impl<S, B> Service<Request<B>> for OneProtocol<S>
where
    S: Service<Request<B>, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Either<Ready<Result<Response, Infallible>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let grpc = Protocol::of(request.headers()).is_grpc();
        let refusal = match self.port {
            // Any of several Content-Type values: a gRPC client never meant JSON.
            Port::Http if grpc || any_grpc_content_type(request.headers()) => Some((
                GRPC_ON_HTTP_PORT,
                "gRPC is served on the gRPC address, not on the HTTP one",
            )),
            Port::Grpc if !grpc || request.version() != Version::HTTP_2 => Some((
                GRPC_REQUIRED,
                "this address serves gRPC only: HTTP/2 with Content-Type application/grpc",
            )),
            _ => None,
        };
        match refusal {
            Some((code, detail)) => Either::Left(ready(Ok(Problem::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                code,
            )
            .detail(detail)
            .into_http_response()))),
            None => Either::Right(self.inner.call(request)),
        }
    }
}
