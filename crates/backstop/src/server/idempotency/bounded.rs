//! What a keyed answer's body may cost: it is read up to the bound its method keeps for replay
//! ([`MethodPolicy::max_replay_body`](crate::policy::MethodPolicy::max_replay_body)), and an
//! answer larger than that is handed on as it comes, the part already read first, never held
//! whole. Its record is ended when the body ends, by [`OnEnd`], with the status and headers
//! and a marker instead of the body ([`StoredResponse::withheld`]).
//!
//! The record's end does not wait for the caller to read the body to its end: a caller that
//! goes away drops the body, and the drop ends the record on a task of its own ([`End::CallerGone`]).

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use super::layer::Shared;
use super::{After, Phases, TRAILER_PREFIX, after_code, end};
use crate::idempotency::{Ending, Lease, Store, StoredResponse};
use crate::policy::Takeover;
use crate::server::problem::{Protocol, grpc_status};
use crate::status::Code;

type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What reading an answer's body up to the bound gave.
pub(super) enum Read<B> {
    /// The whole body, within the bound, and its trailers.
    Whole {
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// More than the bound: the frames read so far (at most the bound's worth, and the frame
    /// that crossed it) and the rest of the body, unread.
    Over {
        read: VecDeque<Bytes>,
        rest: Pin<Box<B>>,
    },
    /// The body failed before its end or the bound.
    Failed,
}

impl<B> fmt::Debug for Read<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Read::Whole { data, trailers } => f
                .debug_struct("Whole")
                .field("len", &data.len())
                .field("trailers", trailers)
                .finish(),
            Read::Over { read, .. } => f
                .debug_struct("Over")
                .field("read", &read.iter().map(Bytes::len).sum::<usize>())
                .finish_non_exhaustive(),
            Read::Failed => f.write_str("Failed"),
        }
    }
}

/// Reads `body` until its end or until more than `bound` bytes came, whichever is first. A
/// body whose size is known in advance to be over the bound (its `Content-Length`, as its
/// size hint) is not read at all.
pub(super) async fn read<B: Body<Data = Bytes>>(body: B, bound: usize) -> Read<B> {
    let mut rest = Box::pin(body);
    if rest.size_hint().lower() > bound as u64 {
        return Read::Over {
            read: VecDeque::new(),
            rest,
        };
    }
    let mut read = VecDeque::new();
    let mut len = 0usize;
    loop {
        // The body's error is dropped here, before any await: it need not be `Send`.
        let frame = std::future::poll_fn(|cx| {
            rest.as_mut()
                .poll_frame(cx)
                .map(|frame| frame.map(Result::ok))
        })
        .await;
        match frame {
            None => {
                return Read::Whole {
                    data: concat(read, len),
                    trailers: None,
                };
            }
            Some(None) => return Read::Failed,
            Some(Some(frame)) => match frame.into_data() {
                Ok(data) => {
                    len = len.saturating_add(data.len());
                    read.push_back(data);
                    if len > bound {
                        return Read::Over { read, rest };
                    }
                }
                // Trailers end the body.
                Err(frame) => {
                    return Read::Whole {
                        data: concat(read, len),
                        trailers: frame.into_trailers().ok(),
                    };
                }
            },
        }
    }
}

/// The frames' bytes as one buffer (copied only when there are several).
fn concat(mut read: VecDeque<Bytes>, len: usize) -> Bytes {
    if read.len() <= 1 {
        return read.pop_front().unwrap_or_default();
    }
    let mut out = BytesMut::with_capacity(len);
    for data in read {
        out.extend_from_slice(&data);
    }
    out.freeze()
}

/// How a streamed answer's body ended.
#[derive(Debug)]
pub(crate) enum End {
    /// It was read to its end, with these trailers.
    Finished(Option<HeaderMap>),
    /// It failed before its end: the answer never arrived whole.
    Failed,
    /// Its caller dropped it before its end.
    CallerGone,
}

/// What ends an answer's record once its streamed body ends.
pub(crate) trait OnEnd: Send {
    /// The record's end, run before the end of the body is passed on (or on a task of its
    /// own, when nobody reads the body any more).
    fn ended(self: Box<Self>, end: End) -> BoxFuture;
}

/// The rest of an answer over the bound: the frames already read, then the rest of the body
/// as it comes; [`OnEnd`] is told how it ended.
pub(crate) struct Tail<B> {
    read: VecDeque<Bytes>,
    rest: Option<Pin<Box<B>>>,
    on_end: Option<Box<dyn OnEnd>>,
    /// The record's end, under way.
    ending: Option<BoxFuture>,
    /// The trailers, passed on once the record's end is written.
    trailers: Option<HeaderMap>,
}

impl<B> fmt::Debug for Tail<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tail")
            .field("read", &self.read.iter().map(Bytes::len).sum::<usize>())
            .field("reading", &self.rest.is_some())
            .field("ending", &self.ending.is_some())
            .finish_non_exhaustive()
    }
}

impl<B> Tail<B> {
    pub(super) fn new(read: VecDeque<Bytes>, rest: Pin<Box<B>>, on_end: Box<dyn OnEnd>) -> Self {
        Self {
            read,
            rest: Some(rest),
            on_end: Some(on_end),
            ending: None,
            trailers: None,
        }
    }

    fn end(&mut self, end: End) {
        self.rest = None;
        self.ending = self.on_end.take().map(|on_end| on_end.ended(end));
    }
}

impl<B: Body<Data = Bytes>> Tail<B> {
    pub(crate) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        loop {
            if let Some(ending) = &mut self.ending {
                ready!(ending.as_mut().poll(cx));
                self.ending = None;
                return Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))));
            }
            if let Some(data) = self.read.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            let Some(rest) = &mut self.rest else {
                return Poll::Ready(None);
            };
            match ready!(rest.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                    // Trailers end the body: the record's end is written before they go on.
                    Err(frame) => {
                        self.trailers = frame.into_trailers().ok();
                        self.end(End::Finished(self.trailers.clone()));
                    }
                },
                None => self.end(End::Finished(None)),
                Some(Err(error)) => {
                    // The error goes on at once (it cannot wait across the record's end
                    // without being `Send`); the record is ended on a task of its own.
                    self.end(End::Failed);
                    spawn(self.ending.take());
                    return Poll::Ready(Some(Err(error)));
                }
            }
        }
    }

    pub(crate) fn is_end_stream(&self) -> bool {
        self.read.is_empty()
            && self.rest.is_none()
            && self.ending.is_none()
            && self.trailers.is_none()
    }

    pub(crate) fn size_hint(&self) -> SizeHint {
        let read: u64 = self.read.iter().map(|d| d.len() as u64).sum();
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |rest| rest.size_hint());
        let mut hint = SizeHint::new();
        hint.set_lower(read.saturating_add(rest.lower()));
        if let Some(upper) = rest.upper() {
            hint.set_upper(read.saturating_add(upper));
        }
        hint
    }
}

impl<B> Drop for Tail<B> {
    /// The caller went away: the record is ended all the same, on a task of its own.
    fn drop(&mut self) {
        if self.ending.is_none() {
            if let Some(on_end) = self.on_end.take() {
                self.ending = Some(on_end.ended(End::CallerGone));
            }
        }
        spawn(self.ending.take());
    }
}

fn spawn(ending: Option<BoxFuture>) {
    if let (Some(ending), Ok(runtime)) = (ending, tokio::runtime::Handle::try_current()) {
        runtime.spawn(ending);
    }
}

/// Ends the record of an answer whose body was over the bound: completed with its status and
/// headers and the marker, or as a run cut off before it answered.
pub(super) struct Withheld<St: Store> {
    pub(super) shared: Arc<Shared<St>>,
    pub(super) lease: Lease,
    pub(super) phases: Phases<St>,
    pub(super) status: u16,
    /// The stored headers of the answer's head.
    pub(super) headers: Vec<(String, String)>,
    pub(super) protocol: Protocol,
    pub(super) limit: usize,
    pub(super) takeover: Takeover,
    /// The handler (or the service's codec) said it did nothing.
    pub(super) nothing_done: bool,
}

impl<St: Store> Withheld<St> {
    /// How the record ends, or `None` to leave it running (its lease then ends, and a retry
    /// learns `outcome_unknown`).
    fn ending(&self, end: End) -> Option<Ending> {
        // The stored answer: the head's headers, the trailers after them.
        let complete = |trailers: Option<&HeaderMap>| {
            let mut headers = self.headers.clone();
            for (name, value) in trailers.into_iter().flatten() {
                if let Ok(value) = value.to_str() {
                    headers.push((format!("{TRAILER_PREFIX}{name}"), value.to_owned()));
                }
            }
            Ending::Complete(StoredResponse::withheld(self.status, headers, self.limit))
        };
        // As for a run cut off before it answered (see `FailOnDrop`).
        let cut_off = || match self.takeover {
            Takeover::Refuse => None,
            Takeover::Resume if !self.phases.began() && self.phases.recovery_point().is_none() => {
                Some(Ending::Release)
            }
            _ => Some(Ending::Fail),
        };
        match (end, self.protocol) {
            (End::Finished(trailers), Protocol::Http) => Some(complete(trailers.as_ref())),
            // The status of a gRPC answer comes last, in its trailers.
            (End::Finished(trailers), Protocol::Grpc) => {
                let code = trailers
                    .as_ref()
                    .and_then(grpc_status)
                    .unwrap_or(Code::Unknown);
                match after_code(code) {
                    After::Complete => Some(complete(trailers.as_ref())),
                    After::Fail if !self.nothing_done => Some(Ending::Fail),
                    _ => Some(Ending::Release),
                }
            }
            // As for a body that fails before the bound: the effect may have happened.
            (End::Failed, _) if self.takeover == Takeover::Refuse => None,
            (End::Failed, _) => Some(Ending::Fail),
            // An HTTP answer's status said what happened: only its body is lost with the caller.
            (End::CallerGone, Protocol::Http) => Some(complete(None)),
            // A gRPC answer's status never came.
            (End::CallerGone, Protocol::Grpc) => cut_off(),
        }
    }
}

impl<St: Store> OnEnd for Withheld<St> {
    fn ended(self: Box<Self>, how: End) -> BoxFuture {
        Box::pin(async move {
            tracing::debug!(
                target: "backstop::server",
                key = %self.lease.key,
                limit = self.limit,
                end = ?how,
                "keyed answer over the replay bound ended"
            );
            if let Some(ending) = self.ending(how) {
                end(&self.shared, &self.lease, &self.phases, ending).await;
            }
        })
    }
}

#[cfg(test)]
mod tests;
