//! [`ClientStack`]: every client layer, composed in the order that keeps them correct.

use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::breaker::{Breaker, BreakerConfig, CircuitBreaker};
use super::classify::{Classifier, classify_head};
use super::deadline::{AttemptTimeout, SetDeadline};
use super::hedge::Hedge;
use super::idempotency::IdempotencyKeyService;
#[cfg(feature = "sqlite")]
use super::idempotency::IntentJournal;
use super::observer::{AttemptObserver, Observer};
use super::replay::DEFAULT_REPLAY_CAP;
use super::retry::{AttemptLimit, Config as RetryConfig, Retry};
use super::select::{MethodTable, Resolved, SelectMethod};
use super::slots::{CallSlots, Slotted};
use super::transparent::TransparentRetry;
use crate::deadline::Margin;
use crate::hedge::{HedgePolicy, LatencyWindow};
use crate::policy::{Idempotency, InvalidPolicy, MethodPolicies, MethodPolicy};
use crate::retry::{
    AdaptiveThrottle, PolicyError, RetryBudget, RetryPolicy, RetrySpend, RetrySwitch,
    RetryThrottle, StormAlarm, StormConfig,
};

/// What limits a destination's retries and hedges (and transparent re-sends, which the budget
/// pays for): backstop's retry budget, or gRPC's retry throttling.
///
/// Both read a service config's `retryThrottling {maxTokens, tokenRatio}`; they differ in what
/// they bound. The budget bounds the load: at most `ratio` retries per logical request plus a
/// burst, whatever fails, so a destination down for everyone sees at most `1 + ratio` times
/// its traffic. gRPC's bucket bounds by the answers: retries stop once failures have taken
/// half the tokens and resume as successes give them back, so a mostly healthy destination may
/// see a retry for every failure. Pick [`Grpc`](Throttling::Grpc) to send the attempts a gRPC
/// client with the same config would; [`Budget`](Throttling::Budget) is the default.
#[derive(Debug, Clone)]
pub enum Throttling {
    /// backstop's [`RetryBudget`]: one deposit per logical request, one token per retry,
    /// hedge or transparent re-send.
    Budget(RetryBudget),
    /// gRPC's [`RetryThrottle`]: a token per failed attempt, `tokenRatio` back per success,
    /// retries and hedges only above half the tokens. Transparent re-sends are not limited
    /// by it (gRPC does not count them either); the destination's budget is then
    /// [`RetryBudget::unlimited`].
    Grpc(RetryThrottle),
}

/// What every method calling one destination shares: its name, what its extra sends spend
/// from (a [`RetrySpend`]: the retry budget that retries, hedges and transparent retries all
/// spend, the storm alarm that stops retries and hedges while the retry ratio says the
/// destination is down for everyone, the fleet's switch, and the throttles), its margin
/// estimator (whose round trips also set the attempt limit), its circuit breaker and its
/// latency window. Cheap to clone; clones share the state.
#[derive(Debug, Clone)]
pub struct Destination {
    name: Arc<str>,
    spend: RetrySpend,
    slots: Option<CallSlots>,
    margin: Arc<Margin>,
    breaker: Option<CircuitBreaker>,
    latencies: Arc<LatencyWindow>,
    attempt_limit: Option<AttemptLimit>,
}

impl Destination {
    /// The smallest margin kept unless configured.
    pub const DEFAULT_MARGIN_FLOOR: Duration = Duration::from_millis(5);

    /// A destination named `name` (the `service` metric label and the `peer` log field: keep
    /// it to a small fixed set) with the default budget (ratio 0.1, burst 20), a storm alarm
    /// with [`StormConfig::default`] (warns above 0.1 retries per request, stops retries and
    /// hedges above 0.2), no adaptive throttle, a margin floor of 5 ms, a breaker with
    /// [`BreakerConfig::default`] and the default [`AttemptLimit`] (half the time left, when
    /// that is more than `max(1 s, 10 x RTT_p99)`).
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        let name: Arc<str> = name.into();
        Self {
            spend: RetrySpend::default().storm_alarm(Some(StormAlarm::new(
                metrics::SharedString::from(Arc::clone(&name)),
                StormConfig::default(),
            ))),
            slots: None,
            name,
            margin: Arc::new(Margin::new(Self::DEFAULT_MARGIN_FLOOR)),
            breaker: CircuitBreaker::new(BreakerConfig::default()).ok(),
            latencies: Arc::new(LatencyWindow::new(
                HedgePolicy::WINDOW,
                HedgePolicy::MIN_SAMPLES,
            )),
            attempt_limit: Some(AttemptLimit::default()),
        }
    }

    /// The retry budget (e.g. one from a service config's `retryThrottling`): the same as
    /// `throttling(Throttling::Budget(budget))`.
    pub fn budget(self, budget: RetryBudget) -> Self {
        self.throttling(Throttling::Budget(budget))
    }

    /// What limits the retries and hedges: backstop's budget (the default, ratio 0.1 and
    /// burst 20) or gRPC's retry throttling (see [`Throttling`]).
    pub fn throttling(mut self, throttling: Throttling) -> Self {
        let (budget, throttle) = match throttling {
            Throttling::Budget(budget) => (budget, None),
            Throttling::Grpc(throttle) => (RetryBudget::unlimited(), Some(throttle)),
        };
        self.spend = self.spend.budget(budget).retry_throttle(throttle);
        self
    }

    /// The storm alarm's thresholds and window, or `None` for no alarm (retries then stop
    /// only on the budget).
    pub fn storm_alarm(mut self, config: Option<StormConfig>) -> Self {
        let alarm = config.map(|config| {
            StormAlarm::new(metrics::SharedString::from(Arc::clone(&self.name)), config)
        });
        self.spend = self.spend.storm_alarm(alarm);
        self
    }

    /// The fleet's retry switch (none unless set), shared by every destination of the
    /// process: while it is off, no retry and no hedge is sent; while it sets a ratio, each
    /// logical request deposits at most that ratio into this destination's budget (see
    /// [`RetrySwitch`]).
    pub fn retry_switch(mut self, switch: Option<RetrySwitch>) -> Self {
        self.spend = self.spend.retry_switch(switch);
        self
    }

    /// Retry at one layer (on unless set `false`): a call made while serving a request that
    /// arrived as a retry or a hedge is sent once, neither retried nor hedged (stop reason
    /// `retried_above`): the layer above retries (see [`inbound`](crate::retry::inbound)).
    pub fn retry_at_one_layer(mut self, on: bool) -> Self {
        self.spend = self.spend.retry_at_one_layer(on);
        self
    }

    /// At most `limit` attempts in flight to the destination at once (none unless set): the
    /// others wait their turn in a queue the metrics show, each wait bounded by its attempt's
    /// deadline (see [`CallSlots`]). Set it at or below the transport's own limit (an HTTP/2
    /// connection's `MAX_CONCURRENT_STREAMS`, a pool's size), whose queue is otherwise hidden.
    pub fn max_in_flight(mut self, limit: Option<std::num::NonZeroUsize>) -> Self {
        self.slots = limit.map(|limit| {
            CallSlots::new(metrics::SharedString::from(Arc::clone(&self.name)), limit)
        });
        self
    }

    /// The call slots, if [`max_in_flight`](Self::max_in_flight) set them.
    pub fn call_slots(&self) -> Option<&CallSlots> {
        self.slots.as_ref()
    }

    /// Client-side adaptive throttling (off unless set): attempts are rejected locally, never
    /// reaching the transport, with a probability that grows as the server refuses load (see
    /// [`AdaptiveThrottle`]); such a call stops with
    /// [`StopReason::Throttled`](crate::retry::StopReason::Throttled).
    pub fn throttle(mut self, throttle: Option<AdaptiveThrottle>) -> Self {
        self.spend = self.spend.throttle(throttle);
        self
    }

    /// The smallest margin kept for the way back, whatever the measured round trips (default
    /// [`DEFAULT_MARGIN_FLOOR`](Self::DEFAULT_MARGIN_FLOOR)).
    pub fn margin_floor(mut self, floor: Duration) -> Self {
        self.margin = Arc::new(Margin::new(floor).with_ceiling(self.margin.ceiling()));
        self
    }

    /// The largest margin kept for the way back, whatever the measured round trips (default
    /// [`Margin::DEFAULT_CEILING`]; never below the floor).
    pub fn margin_ceiling(mut self, ceiling: Duration) -> Self {
        self.margin = Arc::new(Margin::new(self.margin.floor()).with_ceiling(ceiling));
        self
    }

    /// Keeps exactly `margin` for the way back instead of learning it: for a peer whose
    /// answers do not report their processing time (`Server-Timing`, which backstop servers
    /// send), or a link whose round trip is known.
    pub fn fixed_margin(mut self, margin: Duration) -> Self {
        self.margin = Arc::new(Margin::new(margin).with_ceiling(margin));
        self
    }

    /// The circuit breaker, or `None` for none.
    pub fn breaker(mut self, breaker: Option<CircuitBreaker>) -> Self {
        self.breaker = breaker;
        self
    }

    /// How long an attempt that could still be retried may go unanswered before it is
    /// abandoned for the next one (see [`AttemptLimit`]), or `None` to let every attempt run
    /// until the call's deadline.
    pub fn attempt_limit(mut self, limit: Option<AttemptLimit>) -> Self {
        self.attempt_limit = limit;
        self
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the destination's retries, hedges and transparent re-sends spend from, shared
    /// by every method calling it.
    pub fn spend(&self) -> &RetrySpend {
        &self.spend
    }

    /// The margin estimator.
    pub fn margin(&self) -> &Arc<Margin> {
        &self.margin
    }

    /// The circuit breaker, if any.
    pub fn circuit_breaker(&self) -> Option<&CircuitBreaker> {
        self.breaker.as_ref()
    }
}

/// A client stack that must not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StackError {
    /// A method policy is invalid, or asks for something its class forbids (hedging an
    /// `Unsafe` method).
    #[error("invalid method policy")]
    Policy(#[from] InvalidPolicy),
    /// The retry executor refused a policy.
    #[error("invalid retry policy")]
    Retry(#[from] PolicyError),
}

/// The client stack for the calls to one destination, as a tower [`Layer`]: each call runs by
/// its method's [`MethodPolicy`], looked up in the stack's [`MethodPolicies`] by the call's
/// path (`/payment.v1.Payment/Charge`, or an HTTP route), so one stack serves a whole tonic
/// `Channel` or HTTP client. A stack built from one policy applies it to every call.
///
/// Outermost first, each layer being one mechanism (see [`crate::client`] for why this order):
///
/// 0. [select](super::SelectMethod): the call's method policy, by path (skipped with one);
/// 1. [logical request](super::idempotency): the idempotency key (`Keyed` methods), once;
/// 2. [deadline](super::deadline::SetDeadline): one deadline for the call, the earliest of
///    the caller's, the one its task runs under (the request a handler serves) and the
///    method's timeout;
/// 3. [retry](super::retry): attempts by the policy, with replay, budget and stop reasons, an
///    attempt left unanswered past the destination's [`AttemptLimit`] abandoned for the next;
/// 4. [hedge](super::hedge): an extra attempt after the p95 or the method's fixed hedge
///    delay, one unless the method allows more (`Safe`/`Keyed`, if enabled);
/// 5. [attempt timeout](super::deadline::AttemptTimeout): `grpc-timeout` minus the margin;
/// 6. [circuit breaker](super::breaker);
/// 7. [transparent retry](super::transparent): once, for attempts that never left;
/// 8. [call slots](super::slots): at most so many attempts in flight, if the destination
///    sets it, the wait for a slot measured (a transparent re-send waits for one anew);
///
/// and below it the transport ([connection management](super::connect), or a tonic channel).
#[derive(Debug, Clone)]
pub struct ClientStack {
    destination: Destination,
    table: Arc<MethodTable>,
    #[cfg(feature = "sqlite")]
    journal: Option<IntentJournal>,
}

/// The service [`ClientStack::http`] makes: the whole stack over a pooled hyper-util client,
/// for requests with bodies of type `B`. Cheap to clone (clones share the connection pool and
/// the destination's state); answers `http::Response<hyper::body::Incoming>` or a typed
/// [`Error`](super::Error).
pub type HttpService<B = http_body_util::Full<bytes::Bytes>> =
    ClientService<super::connect::HttpClient<super::replay::ReplayBody<B>>>;

/// The service a [`ClientStack`] makes of a transport `S`.
pub type ClientService<S> = SelectMethod<
    IdempotencyKeyService<
        SetDeadline<Retry<Hedge<AttemptTimeout<Breaker<TransparentRetry<Slotted<S>>>>>>>,
    >,
>;

impl ClientStack {
    /// A builder for calls to `destination`, each by its method's policy in `policies` (a
    /// [`MethodPolicies`] table, or one [`MethodPolicy`] for every call).
    pub fn builder(
        destination: &Destination,
        policies: impl Into<MethodPolicies>,
    ) -> ClientStackBuilder {
        ClientStackBuilder {
            destination: destination.clone(),
            policies: policies.into(),
            replay_cap: DEFAULT_REPLAY_CAP,
            classifier: classify_head,
            observer: None,
            #[cfg(feature = "sqlite")]
            journal: None,
        }
    }

    /// The stack around `transport` (a tonic `Channel`, a hyper-util client, any tower
    /// service of `http::Request`s): the same as its [`Layer`] impl, without naming tower's
    /// trait.
    pub fn layer<S: Clone>(&self, transport: S) -> ClientService<S> {
        <Self as Layer<S>>::layer(self, transport)
    }

    /// The stack over a pooled HTTP/1.1 client ([`connect::pooled`](super::connect::pooled)),
    /// for requests whose body is `B` (`Full<Bytes>`, axum's `Body`, ...): the type to keep in
    /// a server's state is [`HttpService<B>`].
    ///
    /// ```
    /// use backstop::client::{ClientStack, Destination, HttpService};
    /// use backstop::policy::{Idempotency, MethodPolicy};
    ///
    /// #[derive(Clone)]
    /// struct AppState {
    ///     backend: HttpService,
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let policy = MethodPolicy::builder("backend", Idempotency::Safe).build();
    /// let stack = ClientStack::builder(&Destination::new("backend"), policy).build().unwrap();
    /// let state = AppState { backend: stack.http() };
    /// # let _ = state;
    /// # }
    /// ```
    pub fn http<B>(&self) -> HttpService<B>
    where
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<tower::BoxError>,
    {
        self.layer(super::connect::pooled(false))
    }

    /// [`http`](Self::http) over HTTP/2 with prior knowledge, as gRPC peers speak it.
    pub fn http2<B>(&self) -> HttpService<B>
    where
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<tower::BoxError>,
    {
        self.layer(super::connect::pooled(true))
    }

    /// The method policies the stack runs by.
    pub fn policies(&self) -> &MethodPolicies {
        &self.table.policies
    }

    /// The retry policy a gRPC call to `path` (`/payment.v1.Payment/Charge`) runs by.
    pub fn retry_policy(&self, path: &str) -> &RetryPolicy {
        self.resolved(path).retry.policy()
    }

    /// Whether a gRPC call to `path` may be hedged.
    pub fn hedges(&self, path: &str) -> bool {
        self.resolved(path).hedge.is_some()
    }

    fn resolved(&self, path: &str) -> &Resolved {
        let index = self.table.policies.select(&http::Method::POST, path);
        &self.table.resolved[index]
    }
}

impl<S: Clone> Layer<S> for ClientStack {
    type Service = ClientService<S>;

    fn layer(&self, transport: S) -> Self::Service {
        let d = &self.destination;
        // The layers' own settings are the fallback's; a call for another method carries its
        // own, chosen by `SelectMethod`.
        let fallback = &self.table.resolved[0];
        let slotted = Slotted::new(transport, d.slots.clone());
        let transparent = TransparentRetry::new(slotted, Some(d.spend.retry_budget().clone()));
        let breaker = match &d.breaker {
            Some(b) => Breaker::new(transparent, b.clone()),
            None => Breaker::disabled(transparent),
        };
        let attempt = AttemptTimeout::new(breaker, d.margin.clone());
        let hedge = match &fallback.hedge {
            Some(policy) => Hedge::new(attempt, policy.clone()),
            None => Hedge::disabled(attempt),
        };
        let retry = Retry::with_config(hedge, Arc::clone(&fallback.retry));
        // The retry layer cuts each attempt at the deadline and never waits past it.
        let deadline = SetDeadline::untimed(retry, fallback.timeout);
        let keyed = fallback.idempotency == Idempotency::Keyed;
        #[cfg(feature = "sqlite")]
        let keys = match &self.journal {
            Some(journal) => IdempotencyKeyService::journaled(deadline, journal.clone()),
            None => IdempotencyKeyService::new(deadline),
        };
        #[cfg(not(feature = "sqlite"))]
        let keys = IdempotencyKeyService::new(deadline);
        SelectMethod::new(keys.enabled(keyed), Arc::clone(&self.table))
    }
}

/// Builds a [`ClientStack`]; from [`ClientStack::builder`].
#[derive(Debug, Clone)]
#[must_use = "call build() to get the stack"]
pub struct ClientStackBuilder {
    destination: Destination,
    policies: MethodPolicies,
    replay_cap: usize,
    classifier: Classifier,
    observer: Option<Observer>,
    #[cfg(feature = "sqlite")]
    journal: Option<IntentJournal>,
}

impl ClientStackBuilder {
    /// The largest request body kept for replay (default 64 KiB); larger ones are sent once.
    pub fn replay_cap(mut self, bytes: usize) -> Self {
        self.replay_cap = bytes;
        self
    }

    /// How the retry layer reads answers (default
    /// [`classify_head`](super::classify::classify_head), the [`Code`](crate::status::Code) table).
    pub fn classifier(mut self, classifier: Classifier) -> Self {
        self.classifier = classifier;
        self
    }

    /// Tells `observer` what the stack does with each call: every send (first attempt, retry,
    /// hedge, transparent re-send) as it ends, and each call's end, with the outcomes and stop
    /// reasons the stack counts in its metrics (see [`AttemptObserver`]). One observer for
    /// every call of the stack; without one (the default) nothing is built or called for it.
    ///
    /// Taken as an `Arc<dyn AttemptObserver>` rather than a type parameter: the stack's
    /// service type stays the same whatever observes it, and the observer is reached through
    /// one pointer the calls already share.
    pub fn observer(mut self, observer: Arc<dyn AttemptObserver>) -> Self {
        self.observer = Some(Observer(observer));
        self
    }

    /// Journals the keys of calls that name an [`Operation`](super::idempotency::Operation).
    #[cfg(feature = "sqlite")]
    pub fn journal(mut self, journal: IntentJournal) -> Self {
        self.journal = Some(journal);
        self
    }

    /// The stack, or why it must not run: an invalid policy, or hedging an `Unsafe` method.
    pub fn build(self) -> Result<ClientStack, StackError> {
        self.policies.validate()?;
        // The destination's shared state as gauges (the first stack built for it names them).
        let d = &self.destination;
        d.spend.retry_budget().publish_as(d.name.to_string());
        if let Some(breaker) = &d.breaker {
            breaker.publish_as(d.name.to_string());
        }
        let resolved = self
            .policies
            .iter()
            .map(|policy| self.resolve(policy).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ClientStack {
            destination: self.destination,
            table: Arc::new(MethodTable {
                policies: self.policies,
                resolved,
            }),
            #[cfg(feature = "sqlite")]
            journal: self.journal,
        })
    }

    /// How the layers run the calls of `policy` (a valid one) to the destination.
    fn resolve(&self, policy: &MethodPolicy) -> Result<Resolved, StackError> {
        let d = &self.destination;
        let service = d.name.to_string();
        let method = policy.name().to_owned();
        let retry = RetryPolicy::builder(service.clone(), method.clone())
            .method_policy(policy)
            .spend(d.spend.clone())
            .build()?;
        let hedge = policy.hedging().then(|| {
            HedgePolicy::new(d.spend.clone(), service, method)
                .latencies(d.latencies.clone())
                .min_delay(policy.min_hedge_delay())
                .fixed_delay(policy.hedge_delay())
                .hedges(policy.max_hedges())
        });
        // A stranded attempt of a hedged call is first overtaken by its hedges.
        let limit = d.attempt_limit.map(|limit| {
            let limit = match &hedge {
                Some(hedge) => limit.at_least(
                    hedge
                        .min_hedge_delay()
                        .saturating_mul(hedge.max_hedges().saturating_add(1)),
                ),
                None => limit,
            };
            (limit, d.margin.clone())
        });
        let retry = RetryConfig::new(
            retry,
            policy.idempotency(),
            self.replay_cap,
            self.classifier,
            Some(d.name.clone()),
            hedge.is_some(),
            limit,
            policy.timeout(),
        )
        .observer(self.observer.clone());
        Ok(Resolved {
            idempotency: policy.idempotency(),
            timeout: policy.timeout(),
            retry: Arc::new(retry),
            hedge,
        })
    }
}

#[cfg(test)]
mod tests;
