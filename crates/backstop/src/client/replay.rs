//! Request replay: send a request body more than once without the request being `Clone`.
//!
//! A retry or a hedge re-sends the request, but an `http::Request<B>` is a one-shot value: its
//! body is a stream consumed by the first send. [`buffer`] reads the body once, before the first
//! attempt, into shared [`Bytes`] (up to a byte cap), and every attempt then gets a cheap
//! [`ReplayBody`] over the same bytes ([`try_clone_request`]).
//!
//! The cap bounds what a client holds per logical request. A body that is larger (its
//! `size_hint` says so before anything is read, or it grows past the cap while being read) is
//! not an error: it is sent once, the part already read first and the rest streamed after it,
//! and it is simply not retried. Whether a request may be retried at all (its method contract)
//! is decided by the caller *before* calling [`buffer`], so a request that can never be retried
//! is never buffered.
//!
//! ```
//! use backstop::client::replay::{Buffered, buffer, try_clone_request};
//! use http_body_util::{BodyExt, Full};
//! use bytes::Bytes;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let body = Full::new(Bytes::from_static(b"{\"amount_cents\":100}"));
//! let Buffered::Replayable(replay) = buffer(body, 64 * 1024).await.unwrap() else {
//!     unreachable!("small bodies are kept")
//! };
//! let first = http::Request::post("/v1/charges").body(replay.body::<Full<Bytes>>()).unwrap();
//! let second = try_clone_request(&first).expect("a buffered body replays");
//! let bytes = second.into_body().collect().await.unwrap().to_bytes();
//! assert_eq!(bytes, "{\"amount_cents\":100}");
//! # }
//! ```

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower::BoxError;

use super::body_error::{BodyFault, RequestBodyError};

/// Default byte cap of a replayable body: 64 KiB, far above a unary RPC's usual size.
pub const DEFAULT_REPLAY_CAP: usize = 64 * 1024;

/// A body read in full, shared by every attempt. Cloning shares the bytes.
#[derive(Debug, Clone, Default)]
pub struct Replay {
    data: Bytes,
    // Boxed: request trailers are rare, and every attempt's request (moved from layer to layer
    // and inside the transport) carries a copy of this struct in its body.
    trailers: Option<Box<HeaderMap>>,
    /// Whether the original body did not announce its exact length. Each attempt announces what
    /// the original did, so replaying never changes the request on the wire: a body of unknown
    /// length stays chunked on HTTP/1.1 and gets no `content-length` on HTTP/2 (tonic's
    /// bodies, for one, announce none).
    length_unknown: bool,
}

impl Replay {
    /// A replay of `data` without trailers, announcing its exact length.
    pub fn new(data: Bytes) -> Self {
        Self {
            data,
            trailers: None,
            length_unknown: false,
        }
    }

    /// The body bytes.
    pub fn data(&self) -> &Bytes {
        &self.data
    }

    /// A fresh body for one attempt.
    pub fn body<B>(&self) -> ReplayBody<B> {
        self.body_resent_by(ResendBy::Here)
    }

    /// A fresh body for one attempt, which `by` sends again if it never reached the server.
    pub(crate) fn body_resent_by<B>(&self, by: ResendBy) -> ReplayBody<B> {
        ReplayBody {
            kind: Kind::Buffered {
                replay: self.clone(),
                data_sent: self.data.is_empty(),
                trailers_sent: self.trailers.is_none(),
                resend: by,
            },
        }
    }
}

/// Who sends an attempt with a buffered body again when it provably never reached the server
/// (see the [transparent-retry layer](super::transparent)). Carried by the body rather than in
/// the request's extensions: every attempt has a body already, while an extension costs an
/// allocation per attempt, and another per copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResendBy {
    /// The transparent-retry layer, from its own copy of the attempt.
    Here,
    /// The [retry layer](super::retry) above, which makes attempts from the call's head and
    /// this replay: the layer below keeps no copy and asks for the re-send.
    Above,
    /// No one: this attempt is itself the re-send.
    Nobody,
}

/// What [`buffer`] made of a body.
#[derive(Debug)]
pub enum Buffered<B> {
    /// The whole body, within the cap: it can be sent any number of times.
    Replayable(Replay),
    /// The body is over the cap: send it once (the part read so far, then the rest).
    TooLarge(ReplayBody<B>),
}

pin_project! {
    /// The body of one attempt: shared buffered bytes, or (for a body sent only once) the
    /// original body behind the part of it already read.
    #[derive(Debug)]
    pub struct ReplayBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Buffered {
            replay: Replay,
            data_sent: bool,
            trailers_sent: bool,
            resend: ResendBy,
        },
        Streaming {
            // The chunks already read, last first (popped from the end): a `Vec` is a word
            // smaller than a `VecDeque`, which leaves room for the mark.
            prefix: Vec<Bytes>,
            // Marked when `rest` fails: the attempt's request carries the same mark.
            fault: Option<BodyFault>,
            #[pin]
            rest: B,
        },
    }
}

impl<B> ReplayBody<B> {
    /// The original body, sent once and never replayed.
    pub fn once(body: B) -> Self {
        Self {
            kind: Kind::Streaming {
                prefix: Vec::new(),
                fault: None,
                rest: body,
            },
        }
    }

    /// The same body, marking `fault` if it fails while being sent.
    pub(crate) fn marking(mut self, mark: &BodyFault) -> Self {
        if let Kind::Streaming { fault, .. } = &mut self.kind {
            *fault = Some(mark.clone());
        }
        self
    }

    /// Whether this body can be sent again ([`try_clone`](Self::try_clone) succeeds).
    pub fn is_replayable(&self) -> bool {
        matches!(self.kind, Kind::Buffered { .. })
    }

    /// A fresh copy from the start, for another attempt; `None` for a body sent only once.
    pub fn try_clone(&self) -> Option<Self> {
        match &self.kind {
            Kind::Buffered { replay, resend, .. } => Some(replay.body_resent_by(*resend)),
            Kind::Streaming { .. } => None,
        }
    }

    /// Who sends this attempt again if it never reached the server; `None` for a body sent
    /// only once, which no one may send again.
    pub(crate) fn resend_by(&self) -> Option<ResendBy> {
        match &self.kind {
            Kind::Buffered { resend, .. } => Some(*resend),
            Kind::Streaming { .. } => None,
        }
    }
}

/// A body that is sent once streams the caller's body: its errors come out as
/// [`RequestBodyError`], the caller's side of the call, whatever the transport makes of them.
impl<B> Body for ReplayBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = RequestBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, RequestBodyError>>> {
        match self.project().kind.project() {
            KindProj::Buffered {
                replay,
                data_sent,
                trailers_sent,
                ..
            } => {
                if !*data_sent {
                    *data_sent = true;
                    return Poll::Ready(Some(Ok(Frame::data(replay.data.clone()))));
                }
                if !*trailers_sent {
                    *trailers_sent = true;
                    if let Some(trailers) = &replay.trailers {
                        return Poll::Ready(Some(Ok(Frame::trailers(HeaderMap::clone(trailers)))));
                    }
                }
                Poll::Ready(None)
            }
            KindProj::Streaming {
                prefix,
                fault,
                rest,
            } => match prefix.pop() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                None => Poll::Ready(match std::task::ready!(watch(rest.poll_frame(cx), fault)) {
                    None => None,
                    Some(Ok(frame)) => Some(Ok(frame)),
                    Some(Err(e)) => {
                        let error = RequestBodyError::new(e);
                        if let Some(fault) = fault {
                            fault.set(error.status());
                        }
                        Some(Err(error))
                    }
                }),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Buffered {
                data_sent,
                trailers_sent,
                ..
            } => *data_sent && *trailers_sent,
            Kind::Streaming { prefix, rest, .. } => prefix.is_empty() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Buffered {
                replay, data_sent, ..
            } => {
                let left = if *data_sent {
                    0
                } else {
                    replay.data.len() as u64
                };
                if replay.length_unknown {
                    let mut hint = SizeHint::new();
                    hint.set_lower(left);
                    hint
                } else {
                    SizeHint::with_exact(left)
                }
            }
            Kind::Streaming { prefix, rest, .. } => {
                let read: u64 = prefix.iter().map(|c| c.len() as u64).sum();
                let hint = rest.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(hint.lower().saturating_add(read));
                if let Some(upper) = hint.upper() {
                    out.set_upper(upper.saturating_add(read));
                }
                out
            }
        }
    }
}

/// `polled`, telling `fault` whether the body now waits on its sender.
fn watch<T>(polled: Poll<T>, fault: &Option<BodyFault>) -> Poll<T> {
    if let Some(fault) = fault {
        fault.waiting(polled.is_pending());
    }
    polled
}

/// Reads `body` into a [`Replay`] when it fits in `cap` bytes.
///
/// A body whose `size_hint` already says it is larger is returned untouched, without reading;
/// one that grows past the cap while being read is returned with what was read in front of the
/// rest. Memory held is at most `cap` plus one chunk. An error reading the body is returned as
/// is: nothing was sent.
pub async fn buffer<B>(body: B, cap: usize) -> Result<Buffered<B>, B::Error>
where
    B: Body<Data = Bytes> + Unpin,
{
    Buffering::new(body, cap).await
}

/// [`buffer`] as a nameable future, for a hand-written future that reads the body in place
/// (the [retry layer](super::retry)'s).
#[derive(Debug)]
pub(crate) struct Buffering<B> {
    /// `None` once the body has been handed back in the result.
    body: Option<B>,
    cap: usize,
    /// Whether the size hint has been looked at (on the first poll).
    checked: bool,
    // The first chunk is kept apart: most bodies are one chunk, and then nothing is allocated
    // for the list.
    first: Option<Bytes>,
    more: VecDeque<Bytes>,
    len: usize,
    trailers: Option<HeaderMap>,
    /// Whether the body did not announce its exact length before it was read.
    length_unknown: bool,
}

impl<B> Buffering<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    pub(crate) fn new(body: B, cap: usize) -> Self {
        Self {
            body: Some(body),
            cap,
            checked: false,
            first: None,
            more: VecDeque::new(),
            len: 0,
            trailers: None,
            length_unknown: false,
        }
    }

    pub(crate) fn poll_buffer(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Buffered<B>, B::Error>> {
        let Some(body) = self.body.as_mut() else {
            // Polled again after it finished: there is nothing left to give.
            return Poll::Pending;
        };
        if !self.checked {
            self.checked = true;
            let cap = u64::try_from(self.cap).unwrap_or(u64::MAX);
            let hint = body.size_hint();
            self.length_unknown = hint.exact().is_none();
            if hint.lower() > cap {
                let body = self.body.take().map(ReplayBody::once);
                return Poll::Ready(Ok(Buffered::TooLarge(body.expect("checked above"))));
            }
        }
        loop {
            let frame = match std::task::ready!(Pin::new(&mut *body).poll_frame(cx)) {
                None => break,
                Some(frame) => frame?,
            };
            match frame.into_data() {
                Ok(chunk) => {
                    self.len = self.len.saturating_add(chunk.len());
                    if !chunk.is_empty() {
                        if self.first.is_none() {
                            self.first = Some(chunk);
                        } else {
                            self.more.push_back(chunk);
                        }
                    }
                    if self.len > self.cap {
                        let more = std::mem::take(&mut self.more);
                        let prefix: Vec<Bytes> =
                            more.into_iter().rev().chain(self.first.take()).collect();
                        let rest = self.body.take().expect("read above");
                        return Poll::Ready(Ok(Buffered::TooLarge(ReplayBody {
                            kind: Kind::Streaming {
                                prefix,
                                fault: None,
                                rest,
                            },
                        })));
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        self.trailers = Some(t);
                    }
                }
            }
        }
        self.body = None;
        let more = std::mem::take(&mut self.more);
        let data = match self.first.take() {
            None => Bytes::new(),
            Some(first) if more.is_empty() => first,
            Some(first) => {
                let mut all = BytesMut::with_capacity(self.len);
                all.extend_from_slice(&first);
                for chunk in more {
                    all.extend_from_slice(&chunk);
                }
                all.freeze()
            }
        };
        Poll::Ready(Ok(Buffered::Replayable(Replay {
            data,
            trailers: self.trailers.take().map(Box::new),
            length_unknown: self.length_unknown,
        })))
    }
}

impl<B> std::future::Future for Buffering<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Output = Result<Buffered<B>, B::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().poll_buffer(cx)
    }
}

/// A copy of `request` for another attempt: method, URI, version, headers, extensions and a
/// body replayed from the start. `None` when the body is sent only once.
pub fn try_clone_request<B>(request: &Request<ReplayBody<B>>) -> Option<Request<ReplayBody<B>>> {
    let body = request.body().try_clone()?;
    let mut copy = Request::new(body);
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    *copy.extensions_mut() = request.extensions().clone();
    Some(copy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::stream;
    use http_body_util::{BodyExt, Full, StreamBody};
    use std::convert::Infallible;

    type Chunked = StreamBody<stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

    fn chunked(chunks: &[&'static str]) -> Chunked {
        let frames: Vec<Result<Frame<Bytes>, Infallible>> = chunks
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c.as_bytes()))))
            .collect();
        StreamBody::new(stream::iter(frames))
    }

    async fn collect<B: Body<Data = Bytes>>(body: B) -> Bytes
    where
        B::Error: std::fmt::Debug,
    {
        body.collect().await.unwrap().to_bytes()
    }

    /// Every attempt's request carries its body through each layer and the transport, moved
    /// (copied) at every step: the body must stay a few words, not a header map.
    #[test]
    fn a_replay_body_stays_small() {
        assert!(
            std::mem::size_of::<ReplayBody<http_body_util::Full<Bytes>>>() <= 64,
            "{} bytes",
            std::mem::size_of::<ReplayBody<http_body_util::Full<Bytes>>>()
        );
    }

    #[tokio::test]
    async fn every_attempt_announces_the_length_the_original_did() {
        // Known length: each attempt says so (HTTP/1.1 content-length).
        let Buffered::Replayable(known) = buffer(Full::new(Bytes::from_static(b"abc")), 64)
            .await
            .unwrap()
        else {
            panic!("3 bytes fit");
        };
        let first: ReplayBody<Full<Bytes>> = known.body();
        assert_eq!(first.size_hint().exact(), Some(3));
        assert_eq!(first.try_clone().unwrap().size_hint().exact(), Some(3));
        // Unknown length (a stream, or tonic's encoder): never invented by the replay, so the
        // attempts go out chunked on HTTP/1.1 and without content-length on HTTP/2, as the
        // original would have.
        let Buffered::Replayable(unknown) = buffer(chunked(&["a", "bc"]), 64).await.unwrap() else {
            panic!("3 bytes fit");
        };
        let first: ReplayBody<Chunked> = unknown.body();
        assert_eq!(first.size_hint().exact(), None);
        let again = first.try_clone().unwrap();
        assert_eq!(again.size_hint().exact(), None);
        assert_eq!(again.size_hint().lower(), 3);
        assert_eq!(collect(again).await, "abc");
    }

    #[tokio::test]
    async fn a_body_within_the_cap_replays_any_number_of_times() {
        let Buffered::Replayable(replay) = buffer(chunked(&["ab", "cd", "ef"]), 6).await.unwrap()
        else {
            panic!("6 bytes fit a 6 byte cap");
        };
        assert_eq!(replay.data(), "abcdef");
        let first: ReplayBody<Chunked> = replay.body();
        assert!(first.is_replayable());
        // A stream of unknown length stays one: each attempt announces what the original did.
        assert_eq!(first.size_hint().exact(), None);
        assert_eq!(first.size_hint().lower(), 6);
        let second = first.try_clone().unwrap();
        assert_eq!(collect(first).await, "abcdef");
        assert_eq!(collect(second).await, "abcdef");
    }

    #[tokio::test]
    async fn a_one_chunk_body_is_kept_without_a_copy() {
        let bytes = Bytes::from_static(b"{\"amount_cents\":100}");
        let Buffered::Replayable(replay) = buffer(Full::new(bytes.clone()), 64).await.unwrap()
        else {
            panic!("fits");
        };
        assert_eq!(replay.data().as_ptr(), bytes.as_ptr());
        assert_eq!(collect(replay.body::<Full<Bytes>>()).await, bytes);
    }

    #[tokio::test]
    async fn a_body_over_the_cap_is_sent_once_in_full() {
        let Buffered::TooLarge(body) = buffer(chunked(&["abc", "def", "gh"]), 4).await.unwrap()
        else {
            panic!("8 bytes exceed a 4 byte cap");
        };
        assert!(!body.is_replayable());
        assert!(body.try_clone().is_none());
        assert_eq!(collect(body).await, "abcdefgh");
    }

    #[tokio::test]
    async fn a_body_known_to_be_too_large_is_not_read() {
        let full = Full::new(Bytes::from_static(b"0123456789"));
        let Buffered::TooLarge(body) = buffer(full, 9).await.unwrap() else {
            panic!("the size hint says 10 bytes");
        };
        // Nothing was read: the whole original body is still behind an empty prefix.
        assert_eq!(body.size_hint().exact(), Some(10));
        assert_eq!(collect(body).await, "0123456789");
    }

    #[tokio::test]
    async fn empty_bodies_and_trailers_replay() {
        let Buffered::Replayable(replay) = buffer(http_body_util::Empty::<Bytes>::new(), 0)
            .await
            .unwrap()
        else {
            panic!("empty fits");
        };
        let body: ReplayBody<Full<Bytes>> = replay.body();
        assert!(body.is_end_stream());

        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let frames: Vec<Result<Frame<Bytes>, Infallible>> = vec![
            Ok(Frame::data(Bytes::from_static(b"x"))),
            Ok(Frame::trailers(trailers.clone())),
        ];
        let Buffered::Replayable(replay) = buffer(StreamBody::new(stream::iter(frames)), 10)
            .await
            .unwrap()
        else {
            panic!("fits");
        };
        for _ in 0..2 {
            let collected = replay.body::<Full<Bytes>>().collect().await.unwrap();
            assert_eq!(collected.trailers(), Some(&trailers));
            assert_eq!(collected.to_bytes(), "x");
        }
    }

    #[test]
    fn cloned_requests_keep_everything_but_share_the_bytes() {
        let replay = Replay::new(Bytes::from_static(b"body"));
        let mut request = Request::post("http://psp/v1/charges")
            .header("idempotency-key", "k-1")
            .body(replay.body::<Full<Bytes>>())
            .unwrap();
        request.extensions_mut().insert(7u32);
        let copy = try_clone_request(&request).unwrap();
        assert_eq!(copy.method(), request.method());
        assert_eq!(copy.uri(), request.uri());
        assert_eq!(copy.headers(), request.headers());
        assert_eq!(copy.extensions().get::<u32>(), Some(&7));

        let once = Request::new(ReplayBody::once(Full::new(Bytes::new())));
        assert!(try_clone_request(&once).is_none());
    }
}
