//! Call slots: the client's own limit on attempts in flight to a destination, with the wait
//! for a slot in plain sight.
//!
//! Every client has a concurrency limit whether or not it chose one: an HTTP/2 connection
//! takes at most the server's `MAX_CONCURRENT_STREAMS` (often 100) streams at once, a pool of
//! N HTTP/1.1 connections N requests. Past it, calls wait inside the transport, where nothing
//! measures them: by Little's law 100 streams at 40 ms serve 2,500 calls/s, and at 400 ms only
//! 250, while the server's metrics show it idle and the caller's p99 grows without a trace of
//! why.
//!
//! [`CallSlots`] puts that queue where it is measured: given to a destination
//! ([`Destination::max_in_flight`](super::Destination::max_in_flight)), at or below the
//! transport's own limit, it admits that many attempts at once and makes the others wait their
//! turn in order, each wait bounded by the attempt's deadline (the attempt timeout above cuts
//! it). The gauge `rpc_client_pending_requests{service}` counts the attempts waiting now and
//! the histogram `rpc_client_pending_seconds{service}` how long each waited; a slot is held
//! until the answer's head arrives.
//!
//! ```
//! use std::num::NonZeroUsize;
//! use backstop::client::slots::CallSlots;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let slots = CallSlots::new("psp", NonZeroUsize::new(100).unwrap());
//! assert_eq!((slots.limit(), slots.waiting()), (100, 0));
//! # }
//! ```

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use metrics::SharedString;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::BoxError;
use tower_service::Service;

use super::future::LayerFuture;
use crate::observe::{RPC_CLIENT_PENDING_REQUESTS, RPC_CLIENT_PENDING_SECONDS, label};

/// A destination's slots for attempts in flight (see the [module docs](self)). Cheap to
/// clone; clones share the slots.
#[derive(Debug, Clone)]
pub struct CallSlots {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    semaphore: Arc<Semaphore>,
    limit: usize,
    waiting: AtomicUsize,
    service: SharedString,
}

impl CallSlots {
    /// `limit` slots for the destination `service` (the metric label); its gauge is set to 0
    /// at once.
    pub fn new(service: impl Into<SharedString>, limit: NonZeroUsize) -> Self {
        let slots = Self {
            inner: Arc::new(Inner {
                semaphore: Arc::new(Semaphore::new(limit.get())),
                limit: limit.get(),
                waiting: AtomicUsize::new(0),
                service: service.into(),
            }),
        };
        slots.publish(0);
        slots
    }

    /// Attempts in flight at most.
    pub fn limit(&self) -> usize {
        self.inner.limit
    }

    /// Attempts waiting for a slot now.
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::Relaxed)
    }

    /// Attempts holding a slot now.
    pub fn in_flight(&self) -> usize {
        self.inner.limit - self.inner.semaphore.available_permits()
    }

    fn publish(&self, waiting: usize) {
        metrics::gauge!(RPC_CLIENT_PENDING_REQUESTS, label::SERVICE => self.inner.service.clone())
            .set(waiting as f64);
    }

    /// A slot, waiting in turn for one (counted while it waits, also when the wait is
    /// cancelled).
    async fn acquire(&self) -> OwnedSemaphorePermit {
        if let Ok(permit) = Arc::clone(&self.inner.semaphore).try_acquire_owned() {
            self.record_wait(std::time::Duration::ZERO);
            return permit;
        }
        let started = Instant::now();
        let _waiting = Waiting::new(self);
        let permit = Arc::clone(&self.inner.semaphore)
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        self.record_wait(started.elapsed());
        permit
    }

    fn record_wait(&self, waited: std::time::Duration) {
        metrics::histogram!(RPC_CLIENT_PENDING_SECONDS, label::SERVICE => self.inner.service.clone())
            .record(waited.as_secs_f64());
    }
}

/// One attempt counted as waiting, until it has a slot or is dropped.
struct Waiting<'a>(&'a CallSlots);

impl<'a> Waiting<'a> {
    fn new(slots: &'a CallSlots) -> Self {
        let waiting = slots.inner.waiting.fetch_add(1, Ordering::Relaxed) + 1;
        slots.publish(waiting);
        Self(slots)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let waiting = self.0.inner.waiting.fetch_sub(1, Ordering::Relaxed) - 1;
        self.0.publish(waiting);
    }
}

/// Holds each attempt to a slot of its destination's [`CallSlots`], or passes it straight on
/// without any.
#[derive(Debug, Clone)]
pub struct Slotted<S> {
    inner: S,
    slots: Option<CallSlots>,
}

impl<S> Slotted<S> {
    /// `inner`, each call holding one of `slots` (none: no limit of its own).
    pub fn new(inner: S, slots: Option<CallSlots>) -> Self {
        Self { inner, slots }
    }
}

impl<S, Req> Service<Req> for Slotted<S>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    Req: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = LayerFuture<S::Future, S::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let Some(slots) = self.slots.clone() else {
            return LayerFuture::direct(self.inner.call(request));
        };
        // The instance polled ready makes the call, once it has its slot.
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        LayerFuture::boxed(Box::pin(async move {
            let _slot = slots.acquire().await;
            ready.call(request).await.map_err(Into::into)
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tower::ServiceExt;

    use super::*;

    fn slow()
    -> impl Service<u32, Response = u32, Error = BoxError, Future: Send> + Clone + Send + 'static
    {
        tower::service_fn(|n: u32| async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok::<_, BoxError>(n)
        })
    }

    #[tokio::test(start_paused = true)]
    async fn calls_past_the_limit_wait_their_turn_in_sight() {
        let slots = CallSlots::new("test", NonZeroUsize::new(2).unwrap());
        let service = Slotted::new(slow(), Some(slots.clone()));
        let started = Instant::now();
        let calls: Vec<_> = (0..5)
            .map(|n| tokio::spawn(service.clone().oneshot(n)))
            .collect();
        tokio::task::yield_now().await;
        assert_eq!((slots.in_flight(), slots.waiting()), (2, 3));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!((slots.in_flight(), slots.waiting()), (2, 1));
        for (n, call) in calls.into_iter().enumerate() {
            assert_eq!(call.await.unwrap().unwrap(), n as u32);
        }
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(3),
            "three turns of two"
        );
        assert_eq!((slots.in_flight(), slots.waiting()), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_cut_by_its_deadline_leaves_nothing_counted() {
        let slots = CallSlots::new("test", NonZeroUsize::MIN);
        let service = Slotted::new(slow(), Some(slots.clone()));
        let holder = tokio::spawn(service.clone().oneshot(1));
        tokio::task::yield_now().await;
        let cut =
            tokio::time::timeout(Duration::from_millis(100), service.clone().oneshot(2)).await;
        assert!(cut.is_err());
        assert_eq!(slots.waiting(), 0);
        assert_eq!(holder.await.unwrap().unwrap(), 1);
        assert_eq!(slots.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn without_slots_a_call_passes_straight_on() {
        let service = Slotted::new(slow(), None);
        let started = Instant::now();
        let calls: Vec<_> = (0..5)
            .map(|n| tokio::spawn(service.clone().oneshot(n)))
            .collect();
        for call in calls {
            call.await.unwrap().unwrap();
        }
        assert_eq!(started.elapsed(), Duration::from_secs(1));
    }
}
