//! The upstream endpoints, balanced: with several, each behind a circuit breaker of its own
//! that leaves it out of the balancing while it is open.
//!
//! The library's balancer ([`connect::balanced`]) picks the less loaded of two ready
//! endpoints. An endpoint that keeps failing answers fast, so it would look the least loaded
//! and draw the traffic; [`connect::CoolDown`] covers refused connections only. Here each
//! endpoint's own [`CircuitBreaker`] counts what the library's breaker counts (a 5xx or no
//! answer is a failure) and, while open, the endpoint is not ready: the balancer sends
//! everything to the others. When its open period ends it is ready again, the breaker lets one
//! probe through, and a success closes it. With every endpoint open, requests wait for one to
//! probe, bounded by their deadline, and the client stack's breaker for the whole upstream
//! answers `circuit_open` at once.
//!
//! Each endpoint's breaker state is published as `rpc_client_breaker_state` with
//! `service="upstream@HOST:PORT"`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use backstop::client::breaker::{
    Breaker, BreakerConfig, BreakerError, BreakerState, CircuitBreaker,
};
use backstop::client::connect::{self, Endpoint};
use http::{Request, Response, Uri};
use tokio::time::Sleep;
use tower::BoxError;
use tower::Service;

/// `service` label of an endpoint's breaker state.
pub(crate) fn breaker_label(uri: &Uri) -> String {
    format!(
        "{}@{}",
        super::forward::UPSTREAM_DESTINATION,
        uri.authority().map_or("", |a| a.as_str())
    )
}

/// One breaker per upstream endpoint, published; none with a single endpoint (the client
/// stack's breaker is that endpoint's).
pub(crate) fn breakers(
    upstreams: &[Uri],
    config: BreakerConfig,
) -> Result<Vec<Option<CircuitBreaker>>, BreakerError> {
    upstreams
        .iter()
        .map(|uri| {
            if upstreams.len() < 2 {
                return Ok(None);
            }
            let breaker = CircuitBreaker::new(config)?;
            breaker.publish_as(breaker_label(uri));
            Ok(Some(breaker))
        })
        .collect()
}

/// `client` pinned to each of `upstreams`, each behind its breaker, balanced.
pub(crate) fn balanced<C, B, ResB>(
    client: C,
    upstreams: &[Uri],
    breakers: &[Option<CircuitBreaker>],
) -> connect::Balanced<Request<B>, Response<ResB>>
where
    C: Service<Request<B>, Response = Response<ResB>> + Clone + Send + 'static,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
    B: Send + 'static,
    ResB: Send + 'static,
{
    let endpoints = connect::endpoints(client, upstreams.to_vec())
        .expect("upstream URLs are checked when read");
    let gated = endpoints
        .into_iter()
        .zip(breakers)
        .map(|(endpoint, breaker)| Gated::new(endpoint, breaker.clone()))
        .collect();
    connect::balanced(gated, connect::DEFAULT_BUFFER)
}

/// An endpoint behind its breaker, not ready while the breaker is open.
pub(crate) struct Gated<S> {
    inner: Breaker<Endpoint<S>>,
    breaker: Option<CircuitBreaker>,
    /// Set while open: wakes the balancer when the probe may go.
    sleep: Option<Pin<Box<Sleep>>>,
}

impl<S> Gated<S> {
    fn new(endpoint: Endpoint<S>, breaker: Option<CircuitBreaker>) -> Self {
        let inner = match &breaker {
            Some(breaker) => Breaker::new(endpoint, breaker.clone()),
            None => Breaker::disabled(endpoint),
        };
        Self {
            inner,
            breaker,
            sleep: None,
        }
    }
}

impl<S, B, ResB> Service<Request<B>> for Gated<S>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = <Breaker<Endpoint<S>> as Service<Request<B>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        loop {
            if let Some(sleep) = &mut self.sleep {
                ready!(sleep.as_mut().poll(cx));
                self.sleep = None;
            }
            let Some(breaker) = &self.breaker else { break };
            if breaker.state() != BreakerState::Open {
                break;
            }
            // Open: asking for leave says how long until the probe, and changes nothing
            // (a permit it hands out when the period just ended is given back unused).
            match breaker.try_acquire() {
                Err(open) => self.sleep = Some(Box::pin(tokio::time::sleep(open.retry_in))),
                Ok(_) => break,
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tower::ServiceExt;
    use tower::service_fn;

    use super::*;

    fn uris() -> Vec<Uri> {
        vec![
            "http://127.0.0.1:1".parse().unwrap(),
            "http://127.0.0.1:2".parse().unwrap(),
        ]
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_endpoint_is_not_ready_until_its_probe_may_go() {
        let config = BreakerConfig {
            min_requests: 2,
            open_for: Duration::from_secs(1),
            ..BreakerConfig::default()
        };
        let breaker = CircuitBreaker::new(config).unwrap();
        let failing = service_fn(|_: Request<()>| async {
            Ok::<_, BoxError>(Response::builder().status(503).body(()).unwrap())
        });
        let endpoint = Endpoint::new(failing, &uris()[0]).unwrap();
        let mut gated = Gated::new(endpoint, Some(breaker.clone()));
        for _ in 0..2 {
            let answer = gated
                .ready()
                .await
                .unwrap()
                .call(Request::new(()))
                .await
                .unwrap();
            assert_eq!(answer.status(), 503);
        }
        assert_eq!(breaker.state(), BreakerState::Open);
        let waker = futures_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(gated.poll_ready(&mut cx).is_pending(), "open: left out");
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(gated.poll_ready(&mut cx).is_pending());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(gated.poll_ready(&mut cx).is_ready(), "the probe may go");
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
    }

    #[test]
    fn one_endpoint_has_no_breaker_of_its_own_and_several_are_labelled() {
        let config = BreakerConfig::default();
        assert!(breakers(&uris()[..1], config).unwrap()[0].is_none());
        assert!(
            breakers(&uris(), config)
                .unwrap()
                .iter()
                .all(Option::is_some)
        );
        assert_eq!(breaker_label(&uris()[1]), "upstream@127.0.0.1:2");
    }

    fn futures_waker() -> std::task::Waker {
        std::task::Waker::noop().clone()
    }
}
