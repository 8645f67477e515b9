//! Circuit breaker per destination: stop sending to a destination that keeps failing.
//!
//! The retry budget bounds how much *extra* load a failing destination gets; the breaker stops
//! the *first* attempts too once the failure ratio over a sliding window reaches a threshold
//! ([`BreakerConfig`]). While open, an attempt fails at once with [`CircuitOpen`] without
//! being sent, and the retry layer stops with `circuit_open`. After the open period a few
//! probes go through (half-open): a success closes the circuit, a failure opens it again.
//!
//! A failure is a transport error or a response that says the destination is unwell
//! (`UNAVAILABLE`, `DEADLINE_EXCEEDED`, `INTERNAL`, any 5xx). A fatal answer (4xx, `INVALID_ARGUMENT`, ...)
//! or a quota refusal is the destination working as intended and counts as a success. An
//! attempt whose own request body failed ([`RequestBodyError`](super::RequestBodyError): its
//! caller's side) counts as nothing, nor does one dropped unanswered (its caller cancelled, a
//! hedge won, the deadline passed). The whole list of what counts toward a destination's health
//! and what does not is in [`crate::admission`]'s table.
//!
//! One [`CircuitBreaker`] belongs to one destination: clone it into every method's stack that
//! calls it.

pub mod future;
mod layer;
mod state;

pub use self::layer::BreakerLayer;
pub use self::state::{BreakerConfig, BreakerError, BreakerState, CircuitBreaker, Permit};
pub use super::circuit_open::CircuitOpen;

use std::task::{Context, Poll};

use http::{Request, Response};
use tower::BoxError;
use tower_service::Service;

use self::future::ResponseFuture;
use super::body_error::BodyFault;

/// Sends attempts only while the destination's circuit lets them through.
#[derive(Debug, Clone)]
pub struct Breaker<S> {
    inner: S,
    breaker: Option<CircuitBreaker>,
}

impl<S> Breaker<S> {
    /// Wraps `inner` behind `breaker`.
    pub fn new(inner: S, breaker: CircuitBreaker) -> Self {
        Self {
            inner,
            breaker: Some(breaker),
        }
    }

    /// Wraps `inner` without a breaker: every attempt is sent.
    pub fn disabled(inner: S) -> Self {
        Self {
            inner,
            breaker: None,
        }
    }
}

impl<S, B, ResB> Service<Request<B>> for Breaker<S>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        match self.breaker.as_ref().map(CircuitBreaker::try_acquire) {
            None => ResponseFuture::running(self.inner.call(request), None, None),
            Some(Ok(permit)) => {
                // A body that fails marks the request: the failure is then its caller's.
                let fault = request.extensions().get::<BodyFault>().cloned();
                ResponseFuture::running(self.inner.call(request), Some(permit), fault)
            }
            Some(Err(open)) => ResponseFuture::open(open),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tower::ServiceExt;
    use tower_test::mock;

    #[tokio::test(start_paused = true)]
    async fn failures_open_the_circuit_and_attempts_are_not_sent() {
        let breaker = CircuitBreaker::new(BreakerConfig {
            min_requests: 2,
            ..Default::default()
        })
        .unwrap();
        let (svc, mut handle) = mock::pair::<Request<()>, Response<()>>();
        let mut svc = Breaker::new(svc, breaker.clone());
        handle.allow(10);

        for status in [503, 500] {
            let call = svc.ready().await.unwrap().call(Request::new(()));
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(Response::builder().status(status).body(()).unwrap());
            assert_eq!(call.await.unwrap().status(), status);
        }
        assert_eq!(breaker.state(), BreakerState::Open);

        let err = svc
            .ready()
            .await
            .unwrap()
            .call(Request::new(()))
            .await
            .unwrap_err();
        let open = err.downcast_ref::<CircuitOpen>().unwrap();
        assert_eq!(open.retry_in, Duration::from_secs(5));
        // Nothing reached the inner service.
        assert!(futures_util::FutureExt::now_or_never(handle.next_request()).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn fatal_answers_do_not_count_as_failures() {
        let breaker = CircuitBreaker::new(BreakerConfig {
            min_requests: 2,
            ..Default::default()
        })
        .unwrap();
        let (svc, mut handle) = mock::pair::<Request<()>, Response<()>>();
        let mut svc = Breaker::new(svc, breaker.clone());
        handle.allow(10);
        for _ in 0..4 {
            let call = svc.ready().await.unwrap().call(Request::new(()));
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(Response::builder().status(400).body(()).unwrap());
            call.await.unwrap();
        }
        assert_eq!(breaker.state(), BreakerState::Closed);
        // Transport errors do.
        for _ in 0..4 {
            let call = svc.ready().await.unwrap().call(Request::new(()));
            let (_, send) = handle.next_request().await.unwrap();
            send.send_error(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
            call.await.unwrap_err();
        }
        assert_eq!(breaker.state(), BreakerState::Open);
    }
}
