//! Response body of [`Idempotency`](super::Idempotency).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The inner service's body, or an answer held in memory (a refusal, a stored answer,
    /// a replay) with its trailers: a replayed gRPC answer must end with the `grpc-status`
    /// trailer it was stored with.
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
    }
}

impl<B> ResponseBody<B> {
    /// The inner service's body, unchanged.
    pub fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
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
}

impl<B> From<Bytes> for ResponseBody<B> {
    fn from(data: Bytes) -> Self {
        Self::buffered(data, None)
    }
}

impl<B> Default for ResponseBody<B> {
    fn default() -> Self {
        Self::buffered(Bytes::new(), None)
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Buffered { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Empty};

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
}
