//! Bodies the server layers hand on: [`ResponseBody`] on the way out, [`RequestBody`] on the
//! way in.
//!
//! A layer that refuses a request (503 + `Retry-After`, 429, a gRPC trailers-only answer)
//! writes that answer itself, without calling the service it wraps. Its response type must then
//! hold either the inner service's body or the few bytes of the refusal. Instead of asking the
//! inner body to be buildable from bytes (which tonic's body and hyper's `Incoming` are not),
//! each layer answers with [`ResponseBody<B>`]: the inner body `B` untouched, or a small body
//! held in memory. So a layer works around any service whose body is an
//! [`http_body::Body<Data = Bytes>`]: an axum `Router`, tonic's generated servers and `Routes`
//! under `tonic::transport::Server::builder().layer(..)`, a bare hyper `service_fn`.
//!
//! A keyed answer larger than its method keeps for replay is a third kind: the part of `B`
//! already read, then the rest of `B` as it comes (see
//! [`MethodPolicy::max_replay_body`](crate::policy::MethodPolicy::max_replay_body)).
//!
//! A body in memory cannot fail, so [`ResponseBody<B>`] keeps `B`'s error type. Layers stacked
//! on one another nest the wrapper (`ResponseBody<ResponseBody<B>>`); the error type stays
//! `B::Error` all the way out, and each level costs one `match` per frame.
//!
//! [`RequestBody<B>`] is the request-side counterpart, for the layers that read a request's
//! whole body before the service runs (the idempotency layers, [`UnaryLimit`]): the service
//! gets the bytes that were read, or the untouched body `B` of a request that was not read.
//! Services generic over their request body (axum's `Router`, tonic's `Routes` and generated
//! servers) take it as it is; a service that insists on one body type converts it, e.g. with
//! `tower_http::map_request_body::MapRequestBodyLayer::new(tonic::body::Body::new)` or
//! `axum::body::Body::new`.
//!
//! ```
//! use backstop::server::body::{RequestBody, ResponseBody};
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Empty};
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! // A refusal written by a layer, in front of a service answering with `Empty`.
//! let refusal: ResponseBody<Empty<Bytes>> = ResponseBody::full(Bytes::from_static(b"{}"));
//! assert_eq!(refusal.collect().await.unwrap().to_bytes(), "{}");
//! // The service's own body passes through untouched.
//! let passed = ResponseBody::inner(Empty::<Bytes>::new());
//! assert!(passed.collect().await.unwrap().to_bytes().is_empty());
//! // A request body read by a layer and handed on.
//! let read: RequestBody<Empty<Bytes>> = RequestBody::buffered(Bytes::from_static(b"msg"));
//! assert_eq!(read.collect().await.unwrap().to_bytes(), "msg");
//! # });
//! ```
//!
//! [`UnaryLimit`]: super::grpc::UnaryLimit

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::idempotency::bounded::Tail;

pin_project! {
    /// The inner service's body, or an answer held in memory (a refusal, a stored answer,
    /// a replay) with its trailers: a replayed gRPC answer must end with the `grpc-status`
    /// trailer it was stored with; or a keyed answer too large to keep, passed on as it
    /// comes.
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
        },
        Buffered {
            data: Option<Bytes>,
            trailers: Option<HeaderMap>,
        },
        Streamed {
            tail: Box<Tail<B>>,
        },
    }
}

impl<B> ResponseBody<B> {
    /// The inner service's body, unchanged.
    pub fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    /// A body of `data` alone (a refusal the layer wrote).
    pub fn full(data: Bytes) -> Self {
        Self::buffered(data, None)
    }

    /// A body of `data` followed by `trailers` (if any).
    pub fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: Kind::Buffered {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }

    /// The rest of an answer too large to keep for replay.
    pub(crate) fn streamed(tail: Tail<B>) -> Self {
        Self {
            kind: Kind::Streamed {
                tail: Box::new(tail),
            },
        }
    }

    /// Whether this is the inner service's body (not one a layer wrote).
    pub fn is_inner(&self) -> bool {
        matches!(self.kind, Kind::Inner { .. })
    }

    /// The inner service's body, or `None` for a body a layer wrote (or one it read part
    /// of).
    pub fn into_inner(self) -> Option<B> {
        match self.kind {
            Kind::Inner { body } => Some(body),
            Kind::Buffered { .. } | Kind::Streamed { .. } => None,
        }
    }

    /// The bytes of a body a layer wrote and not yet read, or `None` for the inner body.
    pub fn buffered_data(&self) -> Option<&[u8]> {
        match &self.kind {
            Kind::Inner { .. } | Kind::Streamed { .. } => None,
            Kind::Buffered { data, .. } => Some(data.as_deref().unwrap_or_default()),
        }
    }
}

impl<B> From<Bytes> for ResponseBody<B> {
    fn from(data: Bytes) -> Self {
        Self::full(data)
    }
}

impl<B> Default for ResponseBody<B> {
    fn default() -> Self {
        Self::full(Bytes::new())
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.project().kind.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.kind.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.kind.size_hint()
    }
}

/// Both bodies are this: the inner body, or bytes (and, for answers, trailers) in memory.
impl<B: Body<Data = Bytes>> Body for Kind<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Buffered { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
            KindProj::Streamed { tail } => tail.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Streamed { tail } => tail.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Kind::Inner { body } => body.size_hint(),
            Kind::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Streamed { tail } => tail.size_hint(),
        }
    }
}

pin_project! {
    /// The body a request arrived with, or the bytes a layer already read from it.
    ///
    /// Keeps `B`'s error type: bytes in memory cannot fail.
    #[derive(Debug)]
    pub struct RequestBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

impl<B> RequestBody<B> {
    /// The request's own body, unread.
    pub fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    /// The whole body, already read.
    pub fn buffered(data: Bytes) -> Self {
        Self {
            kind: Kind::Buffered {
                data: (!data.is_empty()).then_some(data),
                trailers: None,
            },
        }
    }

    /// Whether the body was read by a layer.
    pub fn is_buffered(&self) -> bool {
        matches!(self.kind, Kind::Buffered { .. })
    }
}

impl<B> From<Bytes> for RequestBody<B> {
    fn from(data: Bytes) -> Self {
        Self::buffered(data)
    }
}

impl<B> Default for RequestBody<B> {
    fn default() -> Self {
        Self::buffered(Bytes::new())
    }
}

impl<B: Body<Data = Bytes>> Body for RequestBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.project().kind.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.kind.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.kind.size_hint()
    }
}

#[cfg(test)]
impl ResponseBody<Bytes> {
    /// The bytes of either kind, for tests whose inner service answers with `Bytes`.
    pub(crate) fn into_bytes(self) -> Bytes {
        match self.kind {
            Kind::Inner { body } => body,
            Kind::Buffered { data, .. } => data.unwrap_or_default(),
            Kind::Streamed { .. } => panic!("a streamed body has no bytes at hand"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Empty, Full};

    #[tokio::test]
    async fn buffered_body_ends_with_its_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let body: ResponseBody<Empty<Bytes>> =
            ResponseBody::buffered(Bytes::from_static(b"msg"), Some(trailers.clone()));
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), "msg");
    }

    #[tokio::test]
    async fn inner_bodies_pass_through_and_nest() {
        let body = ResponseBody::inner(ResponseBody::inner(Full::new(Bytes::from_static(b"x"))));
        assert!(body.is_inner());
        assert_eq!(body.size_hint().exact(), Some(1));
        assert_eq!(body.collect().await.unwrap().to_bytes(), "x");
        let empty: ResponseBody<Full<Bytes>> = ResponseBody::default();
        assert!(empty.is_end_stream());
        assert_eq!(empty.size_hint().exact(), Some(0));
    }

    #[tokio::test]
    async fn request_bodies_are_read_or_passed_on() {
        let read: RequestBody<Empty<Bytes>> = RequestBody::buffered(Bytes::from_static(b"abc"));
        assert!(read.is_buffered());
        assert_eq!(read.size_hint().exact(), Some(3));
        assert_eq!(read.collect().await.unwrap().to_bytes(), "abc");
        let unread = RequestBody::inner(Full::new(Bytes::from_static(b"de")));
        assert!(!unread.is_buffered());
        assert_eq!(unread.collect().await.unwrap().to_bytes(), "de");
    }
}
