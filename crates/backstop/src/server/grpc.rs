//! gRPC framing for the server layers: the unary request message read under a size cap
//! decided from the frame header, before the message is buffered.
//!
//! A gRPC message is a 5-byte prefix (compressed flag, big-endian `u32` length) and the
//! message bytes. A length above the cap is refused as soon as the prefix has arrived, with
//! `RESOURCE_EXHAUSTED`: a peer that claims 4 GiB costs five bytes of memory, not four
//! gigabytes, and does not even get to wait for its deadline. The message is then read as
//! it arrives, never preallocated from the claimed length.
//!
//! [`UnaryLimitLayer`] applies the cap in front of a gRPC service whose methods are all unary
//! (it buffers the one message, as the service's decoder would); keyed routes need no extra
//! layer, the [`idempotency`](super::idempotency) layer reads their message the same way.
//!
//! The other gRPC pieces live with the mechanism they serve: refusals as trailers-only
//! responses in [`problem`](super::problem) ([`Protocol`]), keyed
//! gRPC calls in [`idempotency`](super::idempotency).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use tower_layer::Layer;
use tower_service::Service;

use super::body::{RequestBody, ResponseBody};
use super::problem::{Problem, Protocol};
use crate::status::{Code, Status, problem};

/// Default cap on one gRPC message: 4 MiB (as gRPC's own default).
pub const DEFAULT_MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// Length of the message prefix: compressed flag and `u32` length.
pub const PREFIX_LEN: usize = 5;

/// Problem code of a gRPC request that is not exactly one well-formed message.
pub const INVALID_FRAME: &str = "invalid_grpc_frame";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A unary request's body: the framed message as received, and where the message starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnaryMessage {
    framed: Bytes,
}

impl UnaryMessage {
    /// The body as received (prefix and message), to hand on to the service.
    pub fn framed(&self) -> &Bytes {
        &self.framed
    }

    /// The message bytes (after the prefix; compressed if the prefix says so).
    pub fn message(&self) -> &[u8] {
        &self.framed[PREFIX_LEN..]
    }

    /// Whether the compressed flag is set.
    pub fn compressed(&self) -> bool {
        self.framed[0] == 1
    }
}

/// Reads exactly one length-prefixed message from `body`, refusing a declared length above
/// `max` as soon as the prefix is in (`RESOURCE_EXHAUSTED`, problem `body_too_large`), and
/// anything but one whole message (`INVALID_ARGUMENT`, problem [`INVALID_FRAME`]).
pub async fn read_unary<B>(body: B, max: usize) -> Result<UnaryMessage, Status>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let invalid = |detail: &'static str| {
        Status::new(Code::InvalidArgument, detail).with_problem(INVALID_FRAME)
    };
    let mut body = std::pin::pin!(body);
    let mut buf = BytesMut::new();
    let mut expected: Option<usize> = None;
    loop {
        if expected.is_none() && buf.len() >= PREFIX_LEN {
            let flag = buf[0];
            if flag > 1 {
                return Err(invalid("the gRPC compressed flag must be 0 or 1"));
            }
            let len = (&buf[1..PREFIX_LEN]).get_u32();
            let len = usize::try_from(len).unwrap_or(usize::MAX);
            if len > max {
                return Err(too_large(len, max));
            }
            expected = Some(PREFIX_LEN + len);
        }
        if let Some(total) = expected {
            if buf.len() > total {
                return Err(invalid("a unary gRPC request carries exactly one message"));
            }
        }
        match body.frame().await {
            None => break,
            Some(Err(_)) => return Err(invalid("the request body could not be read")),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    // Bounded: at most one chunk beyond the announced (capped) length, which
                    // is refused on the next turn of the loop.
                    buf.extend_from_slice(&data);
                }
            }
        }
    }
    match expected {
        Some(total) if buf.len() == total => Ok(UnaryMessage {
            framed: buf.freeze(),
        }),
        Some(_) if buf.len() > PREFIX_LEN => {
            Err(invalid("a unary gRPC request carries exactly one message"))
        }
        _ => Err(invalid("the gRPC message was truncated")),
    }
}

/// The request metadata naming the message's compression.
pub const GRPC_ENCODING: http::HeaderName = http::HeaderName::from_static("grpc-encoding");

/// Refuses a message whose compressed flag is set when the request names no compression
/// (`grpc-encoding` absent or `identity`): gRPC requires `INTERNAL` for it, and no decoder
/// could read the message. Checked where the message is read, before anything else happens to
/// the request (a keyed request's claim included), rather than left to the service's codec.
pub fn check_compression(message: &UnaryMessage, headers: &http::HeaderMap) -> Result<(), Status> {
    if !message.compressed() {
        return Ok(());
    }
    let named = headers
        .get(GRPC_ENCODING)
        .is_some_and(|encoding| !encoding.as_bytes().eq_ignore_ascii_case(b"identity"));
    if named {
        return Ok(());
    }
    Err(Status::new(
        Code::Internal,
        "the gRPC message is marked compressed but the request names no grpc-encoding",
    )
    .with_problem(INVALID_FRAME))
}

/// The response metadata listing the compressions a gRPC server accepts.
pub const GRPC_ACCEPT_ENCODING: http::HeaderName =
    http::HeaderName::from_static("grpc-accept-encoding");

/// Whether `response` is gRPC's refusal of a message compressed with an encoding the server
/// does not accept: `UNIMPLEMENTED` in the head (a trailers-only answer) with a
/// `grpc-accept-encoding` that leaves out the request's `grpc-encoding` (`request_encoding`;
/// `identity` or none is always accepted). A server's codec answers so before decoding the
/// message, so no handler saw the request.
pub fn encoding_refused(
    request_encoding: Option<&http::HeaderValue>,
    response: &http::HeaderMap,
) -> bool {
    let Some(encoding) =
        request_encoding.filter(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity"))
    else {
        return false;
    };
    if super::problem::grpc_status(response) != Some(Code::Unimplemented) {
        return false;
    }
    let Some(accepted) = response.get(GRPC_ACCEPT_ENCODING) else {
        return false;
    };
    !accepted
        .as_bytes()
        .split(|&b| b == b',')
        .any(|name| name.trim_ascii().eq_ignore_ascii_case(encoding.as_bytes()))
}

/// The refusal of a message over the cap.
pub fn too_large(len: usize, max: usize) -> Status {
    Status::new(
        Code::ResourceExhausted,
        format!("the gRPC message of {len} bytes exceeds the limit of {max} bytes"),
    )
    .with_problem(problem::BODY_TOO_LARGE)
}

/// Caps each gRPC request's one message (see [`read_unary`]) before the inner service runs.
#[derive(Debug, Clone, Copy)]
pub struct UnaryLimitLayer {
    max: usize,
}

impl UnaryLimitLayer {
    /// A layer refusing messages above `max` bytes.
    pub fn new(max: usize) -> Self {
        Self { max }
    }
}

impl Default for UnaryLimitLayer {
    /// The 4 MiB default.
    fn default() -> Self {
        Self::new(DEFAULT_MAX_MESSAGE)
    }
}

impl<S> Layer<S> for UnaryLimitLayer {
    type Service = UnaryLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        UnaryLimit {
            inner,
            max: self.max,
        }
    }
}

/// The service made by [`UnaryLimitLayer`]: a gRPC request's message is read under the cap,
/// then handed on in memory ([`RequestBody::buffered`]); other requests pass through with
/// their body unread ([`RequestBody::inner`]). A refusal is a trailers-only answer
/// ([`ResponseBody`]).
#[derive(Debug, Clone)]
pub struct UnaryLimit<S> {
    inner: S,
    max: usize,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for UnaryLimit<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<ResponseBody<ResBody>>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        if !Protocol::of(request.headers()).is_grpc() {
            let fut = self.inner.call(request.map(RequestBody::inner));
            return Box::pin(async move { Ok(fut.await?.map(ResponseBody::inner)) });
        }
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let max = self.max;
        Box::pin(async move {
            let (head, body) = request.into_parts();
            match read_unary(body, max)
                .await
                .and_then(|message| check_compression(&message, &head.headers).map(|()| message))
            {
                Ok(message) => {
                    let body = RequestBody::buffered(message.framed().clone());
                    let response = inner.call(Request::from_parts(head, body)).await?;
                    Ok(response.map(ResponseBody::inner))
                }
                Err(status) => Ok(Problem::from_status(&status).into_grpc_response()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use http_body_util::{Full, StreamBody};
    use std::convert::Infallible;

    fn framed(message: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    async fn read(bytes: Vec<u8>) -> Result<UnaryMessage, Status> {
        read_unary(Full::new(Bytes::from(bytes)), 16).await
    }

    #[tokio::test]
    async fn one_message_is_read() {
        let m = read(framed(b"hello")).await.unwrap();
        assert_eq!(m.message(), b"hello");
        assert!(!m.compressed());
        assert_eq!(m.framed().len(), 10);
        let empty = read(framed(b"")).await.unwrap();
        assert_eq!(empty.message(), b"");
    }

    #[tokio::test]
    async fn oversized_claim_is_refused_from_the_prefix_alone() {
        // The body never ends: only the prefix arrives. The refusal must not wait for more.
        let prefix = Bytes::from_static(&[0, 0xFF, 0xFF, 0xFF, 0xFF]);
        let stream = futures_util::stream::once(async move {
            Ok::<_, Infallible>(http_body::Frame::data(prefix))
        })
        .chain(futures_util::stream::pending());
        let err = read_unary(StreamBody::new(stream), DEFAULT_MAX_MESSAGE)
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert!(err.message().contains("4294967295"), "{}", err.message());
    }

    #[tokio::test]
    async fn the_prefix_may_arrive_split() {
        let bytes = framed(b"abc");
        let chunks: Vec<Result<_, Infallible>> = bytes
            .iter()
            .map(|b| Ok(http_body::Frame::data(Bytes::copy_from_slice(&[*b]))))
            .collect();
        let body = StreamBody::new(futures_util::stream::iter(chunks));
        let m = read_unary(body, 16).await.unwrap();
        assert_eq!(m.message(), b"abc");
    }

    #[tokio::test]
    async fn malformed_bodies_are_invalid_argument() {
        for bytes in [
            vec![],
            vec![0, 0, 0],
            vec![0, 0, 0, 0, 5, b'a'],
            [framed(b"a"), framed(b"b")].concat(),
            vec![2, 0, 0, 0, 0],
        ] {
            let err = read(bytes.clone()).await.unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{bytes:?}");
            assert_eq!(err.problem(), INVALID_FRAME);
        }
        assert_eq!(
            read(framed(&[0; 17])).await.unwrap_err().code(),
            Code::ResourceExhausted
        );
    }

    #[tokio::test]
    async fn a_compressed_message_needs_a_named_encoding() {
        let mut bytes = framed(b"abc");
        bytes[0] = 1;
        let compressed = read(bytes).await.unwrap();
        let plain = read(framed(b"abc")).await.unwrap();
        let headers = |encoding: Option<&'static str>| {
            let mut headers = http::HeaderMap::new();
            if let Some(encoding) = encoding {
                headers.insert(GRPC_ENCODING, http::HeaderValue::from_static(encoding));
            }
            headers
        };
        for encoding in [None, Some("identity"), Some("IDENTITY")] {
            let err = check_compression(&compressed, &headers(encoding)).unwrap_err();
            assert_eq!(err.code(), Code::Internal, "{encoding:?}");
            assert_eq!(err.problem(), INVALID_FRAME);
            assert!(check_compression(&plain, &headers(encoding)).is_ok());
        }
        assert!(check_compression(&compressed, &headers(Some("gzip"))).is_ok());
    }

    #[test]
    fn an_unsupported_encoding_refused_by_the_codec_is_recognized() {
        let response = |status: &'static str, accepted: Option<&'static str>| {
            let mut headers = http::HeaderMap::new();
            headers.insert("grpc-status", http::HeaderValue::from_static(status));
            if let Some(accepted) = accepted {
                headers.insert(
                    GRPC_ACCEPT_ENCODING,
                    http::HeaderValue::from_static(accepted),
                );
            }
            headers
        };
        let gzip = http::HeaderValue::from_static("gzip");
        // UNIMPLEMENTED (12), and gzip is not among the accepted encodings.
        assert!(encoding_refused(
            Some(&gzip),
            &response("12", Some("identity"))
        ));
        assert!(encoding_refused(
            Some(&gzip),
            &response("12", Some("zstd, identity"))
        ));
        // Accepted, so the answer is the handler's own; or no list; or another code.
        assert!(!encoding_refused(
            Some(&gzip),
            &response("12", Some("GZIP,identity"))
        ));
        assert!(!encoding_refused(Some(&gzip), &response("12", None)));
        assert!(!encoding_refused(
            Some(&gzip),
            &response("13", Some("identity"))
        ));
        // An uncompressed request is never refused for its encoding.
        let identity = http::HeaderValue::from_static("identity");
        assert!(!encoding_refused(None, &response("12", Some("identity"))));
        assert!(!encoding_refused(
            Some(&identity),
            &response("12", Some("gzip"))
        ));
    }
}
