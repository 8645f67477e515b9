use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, Request, header};
use tower_layer::Layer;

use super::settled::Settled;
use super::{DEFAULT_MAX_BODY, IdempotencyService, IntakeLayer, KeyedRoute};
use crate::clock::{Clock, SystemClock};
use crate::idempotency::Store;
use crate::policy::{DEFAULT_MAX_REPLAY_BODY, MethodPolicies, Takeover};
use crate::server::grpc::DEFAULT_MAX_MESSAGE;
use crate::server::select::{MatchedPathFn, PolicyLookup, TableSource};

/// Applies [`IdempotencyService`] to the keyed methods of a [`MethodPolicies`] table: the one place
/// a service says which of its methods are keyed (see [`IdempotencyLayer::policies`]).
///
/// Clones share the store, the clock and the table.
pub struct IdempotencyLayer<St> {
    shared: Arc<Shared<St>>,
}

pub(super) struct Shared<St> {
    pub(super) store: St,
    pub(super) clock: Arc<dyn Clock>,
    /// The methods' policies (a request whose policy is `Keyed` is a keyed route), and where
    /// the route template the application's router matched is found.
    pub(super) lookup: Option<PolicyLookup>,
    /// Set before the table, kept for it.
    pub(super) matched_path: Option<MatchedPathFn>,
    /// The lease of the keyed methods.
    pub(super) lease: Duration,
    pub(super) max_body: usize,
    pub(super) max_message: usize,
    /// The largest answer body kept for replay, for a keyed method whose policy sets none.
    pub(super) max_replay_body: usize,
    /// Whether an HTTP body that is not JSON is fingerprinted byte for byte (else refused).
    pub(super) any_body: bool,
    pub(super) stored_headers: Vec<HeaderName>,
    /// Wakes this instance's waiters for a key when its attempt settles.
    pub(super) settled: Settled,
    /// Bound on any instance's wall-clock error; leases outlast work by twice this.
    pub(super) max_clock_skew: Duration,
    /// The least time a keyed request must have left to be claimed; unset: the default.
    pub(super) min_time_left: Option<MinTimeLeft>,
}

/// The least time left of a keyed request, fixed or asked at each request.
pub(super) type MinTimeLeft = Arc<dyn Fn() -> Duration + Send + Sync>;

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
            .field("policies", &self.shared.lookup.as_ref().map(|l| &l.source))
            .field("max_body", &self.shared.max_body)
            .field("max_message", &self.shared.max_message)
            .field("max_replay_body", &self.shared.max_replay_body)
            .field("stored_headers", &self.shared.stored_headers)
            .finish_non_exhaustive()
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer over `store` with no keyed methods yet (see [`policies`](Self::policies)), the system clock, a 1 MiB body cap, a
    /// 4 MiB gRPC message cap and `Content-Type` and `Location` as the stored headers.
    pub fn new(store: St) -> Self {
        Self {
            shared: Arc::new(Shared {
                store,
                clock: Arc::new(SystemClock),
                lookup: None,
                matched_path: None,
                lease: super::DEFAULT_LEASE,
                max_body: DEFAULT_MAX_BODY,
                max_message: DEFAULT_MAX_MESSAGE,
                max_replay_body: DEFAULT_MAX_REPLAY_BODY,
                any_body: false,
                stored_headers: vec![header::CONTENT_TYPE, header::LOCATION],
                settled: Settled::default(),
                max_clock_skew: super::DEFAULT_MAX_CLOCK_SKEW,
                min_time_left: None,
            }),
        }
    }

    /// Takes the keyed methods from `policies`: a request whose policy (see
    /// [`MethodPolicies::for_route`]) is `Keyed` needs an `Idempotency-Key` and is
    /// deduplicated, its records kept for the policy's key TTL under the layer's
    /// [lease](Self::lease). The same table the clients use, so a method is described once.
    /// Give it validated (a keyed policy without a key TTL is kept
    /// [`KEY_TTL_SYNC`](crate::policy::KEY_TTL_SYNC), 24 hours).
    /// A request whose policy says [`buffers_body`](crate::policy::MethodPolicy::buffers_body)
    /// but is not keyed has its whole body read by the [intake](Self::intake) before the gate,
    /// within the same caps (a body or message over them is refused as on a keyed route).
    pub fn policies(self, policies: MethodPolicies) -> Self {
        self.policies_shared(TableSource::from(policies))
    }

    /// [`policies`](Self::policies), sharing a table other layers read too.
    pub(crate) fn policies_shared(self, source: TableSource) -> Self {
        self.edit(|s| s.lookup = Some(PolicyLookup::new(source, s.matched_path)))
    }

    /// The claim lease of the keyed methods of the [policies](Self::policies) (default 5 s).
    pub fn lease(self, lease: Duration) -> Self {
        self.edit(|s| s.lease = lease)
    }

    /// Where the route template the application's router matched is found, so that the
    /// [policies](Self::policies) are looked up by the router's own match rather than by
    /// matching the path again. Without it, or on a request that has none (the layer in front
    /// of the router), the request's method and path are matched against the table.
    pub fn matched_path_from(self, f: MatchedPathFn) -> Self {
        self.edit(|s| {
            s.matched_path = Some(f);
            if let Some(lookup) = &mut s.lookup {
                lookup.matched_path = Some(f);
            }
        })
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

    /// The least time a keyed request must have left before its deadline when it reaches this
    /// layer (default [`DEFAULT_MIN_TIME_LEFT`](super::DEFAULT_MIN_TIME_LEFT), 5 ms; in a
    /// [`ServerStack`](crate::server::ServerStack), the gate's minimal service time unless set
    /// here). With less, it is answered 504 `deadline_exceeded` (gRPC `DEADLINE_EXCEEDED`)
    /// before its claim: no record is written for a request that could not have run, and its
    /// key stays unused (a replay is not looked up either; the caller retries with a later
    /// deadline).
    pub fn min_time_left(self, time: Duration) -> Self {
        self.min_time_left_with(move || time)
    }

    /// [`min_time_left`](Self::min_time_left) asked of `time` at each keyed request, for a
    /// service whose handlers need a time that changes (one that covers a downstream round
    /// trip measured as it goes): the deadline check the handler would make before its first
    /// write, made before the claim instead.
    pub fn min_time_left_with(self, time: impl Fn() -> Duration + Send + Sync + 'static) -> Self {
        let time: MinTimeLeft = Arc::new(time);
        self.edit(|s| s.min_time_left = Some(time))
    }

    /// Whether [`min_time_left`](Self::min_time_left) was set.
    pub(crate) fn has_min_time_left(&self) -> bool {
        self.shared.min_time_left.is_some()
    }

    /// The largest request body a keyed route buffers (default 1 MiB); larger is 413.
    pub fn max_body(self, bytes: usize) -> Self {
        self.edit(|s| s.max_body = bytes)
    }

    /// The largest answer body of a keyed method kept for replay when its policy sets none
    /// (see [`MethodPolicy::max_replay_body`](crate::policy::MethodPolicy::max_replay_body);
    /// default [`DEFAULT_MAX_REPLAY_BODY`], 1 MiB). An answer within it is stored whole and
    /// replayed byte for byte; a larger one is streamed to its caller as it comes, and a
    /// retry with its key gets its status and headers with a `replay_body_too_large` problem
    /// (see the [module docs](super#answers-too-large-to-keep)).
    pub fn max_replay_body(self, bytes: usize) -> Self {
        self.edit(|s| s.max_replay_body = bytes)
    }

    /// The largest gRPC message a keyed gRPC route accepts (default 4 MiB); a larger
    /// length prefix is refused with `RESOURCE_EXHAUSTED` before the message is read.
    pub fn max_message(self, bytes: usize) -> Self {
        self.edit(|s| s.max_message = bytes)
    }

    /// Accepts keyed HTTP requests whose body is not JSON (an empty body, a form, binary),
    /// fingerprinting it byte for byte as sent (default: refused, 400 `invalid_body`). A JSON
    /// body is still compared in its canonical form, so `{"a":1}` and `{ "a": 1 }` stay one
    /// request. For a service, such as a proxy, whose bodies this layer cannot choose.
    pub fn any_body(self, accept: bool) -> Self {
        self.edit(|s| s.any_body = accept)
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

    /// The lease and TTL of the keyed route matching `method` and `path` (a path or a route
    /// template), if any.
    pub fn route_for(&self, method: &Method, path: &str) -> Option<KeyedRoute> {
        self.shared.route_for(method, path)
    }

    /// The lease and TTL of `request`'s keyed route, if it has one: by the route template its
    /// router matched when known (see [`matched_path_from`](Self::matched_path_from)), else by
    /// its method and path.
    pub fn route_of<B>(&self, request: &Request<B>) -> Option<KeyedRoute> {
        self.shared.route_of(request)
    }

    fn edit(mut self, f: impl FnOnce(&mut Shared<St>)) -> Self {
        match Arc::get_mut(&mut self.shared) {
            Some(shared) => f(shared),
            None => {
                let old = &*self.shared;
                let mut shared = Shared {
                    store: old.store.clone(),
                    clock: old.clock.clone(),
                    lookup: old.lookup.clone(),
                    matched_path: old.matched_path,
                    lease: old.lease,
                    max_body: old.max_body,
                    max_message: old.max_message,
                    max_replay_body: old.max_replay_body,
                    any_body: old.any_body,
                    stored_headers: old.stored_headers.clone(),
                    settled: Settled::default(),
                    max_clock_skew: old.max_clock_skew,
                    min_time_left: old.min_time_left.clone(),
                };
                f(&mut shared);
                self.shared = Arc::new(shared);
            }
        }
        self
    }
}

impl<St> Shared<St> {
    /// The least time left a keyed request needs to be claimed.
    pub(super) fn min_time_left(&self) -> Duration {
        self.min_time_left
            .as_ref()
            .map_or(super::DEFAULT_MIN_TIME_LEFT, |time| time())
    }

    /// The one place a request's keyed route is decided.
    pub(super) fn route_of<B>(&self, request: &Request<B>) -> Option<KeyedRoute> {
        let policy = self.lookup.as_ref()?.policy_of(request);
        self.keyed(&policy)
    }

    pub(super) fn route_for(&self, method: &Method, path: &str) -> Option<KeyedRoute> {
        let table = self.lookup.as_ref()?.table();
        self.keyed(table.for_route(method, path))
    }

    fn keyed(&self, policy: &crate::policy::MethodPolicy) -> Option<KeyedRoute> {
        policy.requires_key().then(|| {
            let route = policy
                .key_ttl()
                .map_or_else(KeyedRoute::sync, KeyedRoute::new);
            route
                .lease(self.lease)
                .takeover(policy.takeover())
                .max_replay_body(policy.max_replay_body().unwrap_or(self.max_replay_body))
        })
    }

    /// How the intake treats `request`: keyed (claimed), read whole first (its policy
    /// [buffers its body](crate::policy::MethodPolicy::buffers_body)), or passed on unread.
    pub(super) fn intake_of<B>(&self, request: &Request<B>) -> IntakeKind {
        let Some(lookup) = &self.lookup else {
            return IntakeKind::Unread;
        };
        let policy = lookup.policy_of(request);
        match self.keyed(&policy) {
            Some(route) => IntakeKind::Keyed(route),
            None if policy.buffers_body() => IntakeKind::Buffered,
            None => IntakeKind::Unread,
        }
    }
}

/// What the intake does with a request, decided by its method's policy.
#[derive(Debug, Clone, Copy)]
pub(super) enum IntakeKind {
    /// A keyed method: read, fingerprinted and claimed.
    Keyed(KeyedRoute),
    /// Read whole before the gate, then passed on.
    Buffered,
    /// Passed on unread.
    Unread,
}

impl<S, St> Layer<S> for IdempotencyLayer<St> {
    type Service = IdempotencyService<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.shared.clone())
    }
}

/// What a keyed request's method asks of its claim, resolved from its
/// [`MethodPolicy`](crate::policy::MethodPolicy) and the layer's lease.
impl KeyedRoute {
    /// A keyed route whose records live `ttl`, with the default 5 s lease.
    pub(crate) fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            lease: super::DEFAULT_LEASE,
            takeover: Takeover::Refuse,
            max_replay_body: DEFAULT_MAX_REPLAY_BODY,
        }
    }

    /// The largest answer body kept for replay (default [`DEFAULT_MAX_REPLAY_BODY`]).
    pub(crate) fn max_replay_body(mut self, bytes: usize) -> Self {
        self.max_replay_body = bytes;
        self
    }

    /// The largest answer body kept for replay: a larger one is streamed, and its record
    /// keeps its status and headers only.
    pub fn replay_body_limit(&self) -> usize {
        self.max_replay_body
    }

    /// What a retry does with an abandoned run (default [`Takeover::Refuse`]).
    pub(crate) fn takeover(mut self, takeover: Takeover) -> Self {
        self.takeover = takeover;
        self
    }

    /// What a retry does with an abandoned run of this route.
    pub fn takeover_policy(&self) -> Takeover {
        self.takeover
    }

    /// A keyed method with no key TTL of its own: records kept as long as a synchronous
    /// API's.
    pub(crate) fn sync() -> Self {
        Self::new(crate::policy::KEY_TTL_SYNC)
    }

    /// How long a claim runs before another attempt may take it over (default 5 s).
    pub(crate) fn lease(mut self, lease: Duration) -> Self {
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
