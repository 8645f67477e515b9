use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, header};
use tower_layer::Layer;

use super::settled::Settled;
use super::{DEFAULT_MAX_BODY, Idempotency, IntakeLayer, KeyedRoute};
use crate::clock::{Clock, SystemClock};
use crate::idempotency::Store;
use crate::server::grpc::DEFAULT_MAX_MESSAGE;
use crate::server::route::RoutePattern;

/// Applies [`Idempotency`] to the declared keyed routes.
///
/// Clones share the store, the clock and the route table.
pub struct IdempotencyLayer<St> {
    shared: Arc<Shared<St>>,
}

pub(super) struct Shared<St> {
    pub(super) store: St,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) routes: Vec<(RoutePattern, KeyedRoute)>,
    /// Routes that are not keyed whose bodies the intake reads before the gate.
    pub(super) buffered: Vec<RoutePattern>,
    pub(super) max_body: usize,
    pub(super) max_message: usize,
    pub(super) stored_headers: Vec<HeaderName>,
    /// Wakes this instance's waiters for a key when its attempt settles.
    pub(super) settled: Settled,
    /// Bound on any instance's wall-clock error; leases outlast work by twice this.
    pub(super) max_clock_skew: Duration,
}

impl<St> Clone for IdempotencyLayer<St> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<St> fmt::Debug for IdempotencyLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("routes", &self.shared.routes)
            .field("max_body", &self.shared.max_body)
            .field("max_message", &self.shared.max_message)
            .field("stored_headers", &self.shared.stored_headers)
            .finish_non_exhaustive()
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer over `store` with no keyed routes yet, the system clock, a 1 MiB body cap, a
    /// 4 MiB gRPC message cap and `Content-Type` and `Location` as the stored headers.
    pub fn new(store: St) -> Self {
        Self {
            shared: Arc::new(Shared {
                store,
                clock: Arc::new(SystemClock),
                routes: Vec::new(),
                buffered: Vec::new(),
                max_body: DEFAULT_MAX_BODY,
                max_message: DEFAULT_MAX_MESSAGE,
                stored_headers: vec![header::CONTENT_TYPE, header::LOCATION],
                settled: Settled::default(),
                max_clock_skew: super::DEFAULT_MAX_CLOCK_SKEW,
            }),
        }
    }

    /// Declares a keyed route: requests with `method` whose path matches `pattern` (literal and
    /// `{param}` segments) need an `Idempotency-Key` and are deduplicated.
    pub fn keyed(self, method: Method, pattern: &str, route: KeyedRoute) -> Self {
        self.edit(|s| s.routes.push((RoutePattern::new(method, pattern), route)))
    }

    /// Declares a route that is not keyed whose whole body the [intake](Self::intake) reads
    /// before the gate, within the same caps (a body or message over them is refused as on a
    /// keyed route): a client sending such a body slowly holds no gate permit either. For
    /// unary calls and small bodies only; a streaming route must not be declared.
    pub fn buffered(self, method: Method, pattern: &str) -> Self {
        self.edit(|s| s.buffered.push(RoutePattern::new(method, pattern)))
    }

    /// The wall clock used for leases and TTLs (default: [`SystemClock`]).
    pub fn clock(self, clock: impl Clock) -> Self {
        self.edit(|s| s.clock = Arc::new(clock))
    }

    /// How far any instance's wall clock may be from true time (default 250 ms). Leases
    /// outlast the work they cover by twice this, so an instance whose clock runs ahead can
    /// never take a key over while its holder may still be working.
    pub fn max_clock_skew(self, skew: Duration) -> Self {
        self.edit(|s| s.max_clock_skew = skew)
    }

    /// The largest request body a keyed route buffers (default 1 MiB); larger is 413.
    pub fn max_body(self, bytes: usize) -> Self {
        self.edit(|s| s.max_body = bytes)
    }

    /// The largest gRPC message a keyed gRPC route accepts (default 4 MiB); a larger
    /// length prefix is refused with `RESOURCE_EXHAUSTED` before the message is read.
    pub fn max_message(self, bytes: usize) -> Self {
        self.edit(|s| s.max_message = bytes)
    }

    /// Also stores and replays this response header (beyond `Content-Type` and `Location`).
    pub fn store_header(self, name: HeaderName) -> Self {
        self.edit(|s| {
            if !s.stored_headers.contains(&name) {
                s.stored_headers.push(name)
            }
        })
    }

    /// The layer to put outside the gate, sharing this layer's routes and store: it reads
    /// keyed requests' bodies and waits for running attempts with the same key without holding
    /// a permit (see [`intake`](super::intake)). [`ServerStack`](crate::server::ServerStack)
    /// places it.
    pub fn intake(&self) -> IntakeLayer<St> {
        IntakeLayer::new(self.shared.clone())
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.shared.store
    }

    /// The lease and TTL of the keyed route matching `method` and `path`, if any.
    pub fn route_for(&self, method: &Method, path: &str) -> Option<KeyedRoute> {
        self.shared.route_for(method, path)
    }

    fn edit(mut self, f: impl FnOnce(&mut Shared<St>)) -> Self {
        match Arc::get_mut(&mut self.shared) {
            Some(shared) => f(shared),
            None => {
                let old = &*self.shared;
                let mut shared = Shared {
                    store: old.store.clone(),
                    clock: old.clock.clone(),
                    routes: old.routes.clone(),
                    buffered: old.buffered.clone(),
                    max_body: old.max_body,
                    max_message: old.max_message,
                    stored_headers: old.stored_headers.clone(),
                    settled: Settled::default(),
                    max_clock_skew: old.max_clock_skew,
                };
                f(&mut shared);
                self.shared = Arc::new(shared);
            }
        }
        self
    }
}

impl<St> Shared<St> {
    pub(super) fn route_for(&self, method: &Method, path: &str) -> Option<KeyedRoute> {
        self.routes
            .iter()
            .find(|(p, _)| p.matches(method, path))
            .map(|(_, r)| *r)
    }

    /// Whether `method` and `path` name a route declared with [`IdempotencyLayer::buffered`].
    pub(super) fn is_buffered(&self, method: &Method, path: &str) -> bool {
        self.buffered.iter().any(|p| p.matches(method, path))
    }
}

impl<S, St> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.shared.clone())
    }
}

impl KeyedRoute {
    /// A keyed route whose records live `ttl`, with the default 5 s lease.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            lease: super::DEFAULT_LEASE,
        }
    }

    /// Payments and refunds: records kept 7 days.
    pub fn payments() -> Self {
        Self::new(Duration::from_secs(7 * 24 * 3600))
    }

    /// Synchronous APIs: records kept 24 hours.
    pub fn sync() -> Self {
        Self::new(Duration::from_secs(24 * 3600))
    }

    /// How long a claim runs before another attempt may take it over (default 5 s).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The record TTL.
    pub fn ttl_duration(&self) -> Duration {
        self.ttl
    }

    /// The claim lease.
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }
}
