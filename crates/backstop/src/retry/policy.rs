//! The retry policy: how many attempts, which backoff, which budget, and the labels it reports
//! under.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use metrics::SharedString;

use super::metrics::PolicyMetrics;
use super::{AdaptiveThrottle, Backoff, RetryBudget, RetrySwitch, RetryThrottle, StormAlarm};
use crate::policy::{DEFAULT_MAX_ATTEMPTS, Idempotency, MAX_ATTEMPTS_CAP, MethodPolicy};
use crate::status::Code;

/// The shortest time worth starting an attempt with: a retry is sent only if the deadline
/// leaves at least its backoff plus this. A setting of the retry policy alone, so it is
/// defined here rather than among a method policy's defaults.
pub const DEFAULT_MIN_ATTEMPT: Duration = Duration::from_millis(20);

/// A policy that cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// `max_attempts` is 0 or above [`MAX_ATTEMPTS_CAP`].
    #[error("max attempts must be within 1..={MAX_ATTEMPTS_CAP}, got {got}")]
    MaxAttempts {
        /// The rejected value.
        got: u32,
    },
}

/// How one method's calls to one destination are retried.
///
/// Built with [`RetryPolicy::builder`]; run calls with [`RetryPolicy::execute`] or
/// [`RetryPolicy::execute_with`]. Cloning is cheap and the clones share the budget; give every
/// policy that calls the same destination the same [`RetryBudget`].
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub(super) max_attempts: u32,
    pub(super) backoff: Backoff,
    pub(super) budget: RetryBudget,
    pub(super) storm: Option<StormAlarm>,
    pub(super) switch: Option<RetrySwitch>,
    pub(super) one_layer: bool,
    pub(super) throttle: Option<AdaptiveThrottle>,
    pub(super) retry_throttle: Option<RetryThrottle>,
    pub(super) min_attempt: Duration,
    pub(super) keyed: bool,
    pub(super) retryable: Option<Arc<[Code]>>,
    pub(super) service: SharedString,
    pub(super) method: SharedString,
    /// Shared by clones: the same labels, so the same handles.
    pub(super) metrics: Arc<PolicyMetrics>,
}

impl RetryPolicy {
    /// A builder with the defaults: [`DEFAULT_MAX_ATTEMPTS`]
    /// attempts, [`Backoff::default`], a fresh [`RetryBudget::default`],
    /// [`DEFAULT_MIN_ATTEMPT`] minimal attempt, not keyed, every retryable code.
    ///
    /// `service` and `method` label the metrics and logs (`service` names the destination,
    /// `method` the RPC, e.g. `"psp"` and `"Charge"`). They must come from a small fixed set:
    /// never put a key, a user id or anything per-request there.
    pub fn builder(
        service: impl Into<Cow<'static, str>>,
        method: impl Into<Cow<'static, str>>,
    ) -> RetryPolicyBuilder {
        RetryPolicyBuilder {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff: Backoff::default(),
            budget: None,
            storm: None,
            switch: None,
            one_layer: true,
            throttle: None,
            retry_throttle: None,
            min_attempt: DEFAULT_MIN_ATTEMPT,
            keyed: false,
            retryable: None,
            service: label(service.into()),
            method: label(method.into()),
        }
    }

    /// Attempts per logical request, first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Delays between attempts when the server gave no pushback.
    pub fn backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// The shared retry budget.
    pub fn budget(&self) -> &RetryBudget {
        &self.budget
    }

    /// The destination's storm alarm, if any.
    pub fn storm_alarm(&self) -> Option<&StormAlarm> {
        self.storm.as_ref()
    }

    /// The fleet's retry switch, if any.
    pub fn retry_switch(&self) -> Option<&RetrySwitch> {
        self.switch.as_ref()
    }

    /// Whether retries happen at one layer (see
    /// [`RetryPolicyBuilder::retry_at_one_layer`]).
    pub fn retries_at_one_layer(&self) -> bool {
        self.one_layer
    }

    /// The destination's adaptive throttle, if any.
    pub fn throttle(&self) -> Option<&AdaptiveThrottle> {
        self.throttle.as_ref()
    }

    /// The destination's gRPC retry throttling, if any.
    pub fn retry_throttle(&self) -> Option<&RetryThrottle> {
        self.retry_throttle.as_ref()
    }

    /// The shortest time worth starting an attempt with: a retry is sent only if the deadline
    /// leaves at least the delay plus this.
    pub fn min_attempt(&self) -> Duration {
        self.min_attempt
    }

    /// Whether the calls carry an idempotency key, so an attempt that timed out
    /// (`DEADLINE_EXCEEDED`) may be sent again.
    pub fn keyed(&self) -> bool {
        self.keyed
    }

    /// The codes retried, when restricted by
    /// [`retryable_codes`](RetryPolicyBuilder::retryable_codes); `None` retries every code
    /// whose retry class allows it.
    pub fn retryable_codes(&self) -> Option<&[Code]> {
        self.retryable.as_deref()
    }

    /// The same policy (labels, budget, backoff) with a single attempt: for calls that may
    /// not be retried, so they are still counted and logged like the others.
    pub fn single_attempt(&self) -> RetryPolicy {
        RetryPolicy {
            max_attempts: 1,
            ..self.clone()
        }
    }

    /// The `service` label.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// The `method` label.
    pub fn method(&self) -> &str {
        &self.method
    }
}

/// Builds a [`RetryPolicy`]; from [`RetryPolicy::builder`].
#[derive(Debug, Clone)]
pub struct RetryPolicyBuilder {
    max_attempts: u32,
    backoff: Backoff,
    budget: Option<RetryBudget>,
    storm: Option<StormAlarm>,
    switch: Option<RetrySwitch>,
    one_layer: bool,
    throttle: Option<AdaptiveThrottle>,
    retry_throttle: Option<RetryThrottle>,
    min_attempt: Duration,
    keyed: bool,
    retryable: Option<Arc<[Code]>>,
    service: SharedString,
    method: SharedString,
}

impl RetryPolicyBuilder {
    /// Attempts per logical request, first included: 1 (no retry) to
    /// [`MAX_ATTEMPTS_CAP`]; [`build`](Self::build) rejects anything else.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// The backoff between attempts.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The retry budget, shared with every other policy calling the same destination.
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// The storm alarm, shared with every other policy calling the same destination (default
    /// none): while it is tripped no retry is sent ([`StopReason::Storm`](super::StopReason)).
    pub fn storm_alarm(mut self, alarm: Option<StormAlarm>) -> Self {
        self.storm = alarm;
        self
    }

    /// The fleet's retry switch, shared with every policy of the process (default none):
    /// while it is off no retry is sent ([`StopReason::SwitchedOff`](super::StopReason)), and
    /// while it sets a budget each logical request deposits at most that ratio.
    pub fn retry_switch(mut self, switch: Option<RetrySwitch>) -> Self {
        self.switch = switch;
        self
    }

    /// Retry at one layer (default on): a call made while serving a request that arrived as a
    /// retry ([`inbound::previous_attempts`](super::inbound::previous_attempts) above 0) is
    /// sent once ([`StopReason::RetriedAbove`](super::StopReason)). `false` retries it anyway.
    pub fn retry_at_one_layer(mut self, on: bool) -> Self {
        self.one_layer = on;
        self
    }

    /// Client-side adaptive throttling, shared with every other policy calling the same
    /// destination (default none): attempts it rejects are not sent
    /// ([`StopReason::Throttled`](super::StopReason)).
    pub fn throttle(mut self, throttle: Option<AdaptiveThrottle>) -> Self {
        self.throttle = throttle;
        self
    }

    /// gRPC's retry throttling, shared with every other policy calling the same destination
    /// (default none): every attempt that fails with a retried code takes a token, every
    /// success gives back a fraction of one, and no retry follows a failure that leaves half
    /// the tokens or fewer ([`StopReason::BudgetExhausted`](super::StopReason)). It is
    /// consulted beside the [budget](Self::budget); to limit retries by the bucket alone, as
    /// gRPC does, give a budget that never runs out (see
    /// [`Throttling`](crate::client::Throttling)).
    pub fn retry_throttle(mut self, throttle: Option<RetryThrottle>) -> Self {
        self.retry_throttle = throttle;
        self
    }

    /// The shortest time worth starting an attempt with.
    pub fn min_attempt(mut self, min_attempt: Duration) -> Self {
        self.min_attempt = min_attempt;
        self
    }

    /// Declares that every call carries an idempotency key (generated and persisted before
    /// the first attempt, the same on every attempt), or is safe to repeat, so an attempt that
    /// timed out may be sent again. Without it a `DEADLINE_EXCEEDED` stops with
    /// `non_retryable`: the effect is unknown and must converge by querying.
    pub fn keyed(mut self, keyed: bool) -> Self {
        self.keyed = keyed;
        self
    }

    /// Takes the attempts, backoff and retryable codes of `method`'s policy, and whether its
    /// calls may time out and be sent again (`Safe` and `Keyed` methods).
    pub fn method_policy(self, method: &MethodPolicy) -> Self {
        self.max_attempts(method.max_attempts())
            .backoff(*method.backoff())
            .keyed(method.idempotency() != Idempotency::Unsafe)
            .retryable_codes(method.retryable().iter().copied())
    }

    /// Restricts retries to these codes (a method contract's or a gRPC `retryPolicy`'s
    /// `retryableStatusCodes`). A code outside the list stops with `non_retryable`; a listed
    /// code is still retried only as its retry class allows (a fatal code never is).
    pub fn retryable_codes(mut self, codes: impl IntoIterator<Item = Code>) -> Self {
        self.retryable = Some(codes.into_iter().collect());
        self
    }

    /// The policy, or an error when `max_attempts` is out of range.
    pub fn build(self) -> Result<RetryPolicy, PolicyError> {
        if !(1..=MAX_ATTEMPTS_CAP).contains(&self.max_attempts) {
            return Err(PolicyError::MaxAttempts {
                got: self.max_attempts,
            });
        }
        Ok(RetryPolicy {
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            budget: self.budget.unwrap_or_default(),
            storm: self.storm,
            switch: self.switch,
            one_layer: self.one_layer,
            throttle: self.throttle,
            retry_throttle: self.retry_throttle,
            min_attempt: self.min_attempt,
            keyed: self.keyed,
            retryable: self.retryable,
            service: self.service,
            method: self.method,
            metrics: Arc::default(),
        })
    }
}

/// A label value that clones without allocating.
fn label(value: Cow<'static, str>) -> SharedString {
    match value {
        Cow::Borrowed(s) => SharedString::const_str(s),
        Cow::Owned(s) => SharedString::from_shared(Arc::<str>::from(s)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_design() {
        let p = RetryPolicy::builder("psp", "Charge").build().unwrap();
        assert_eq!(p.max_attempts(), 3);
        assert_eq!(p.backoff(), &Backoff::default());
        assert_eq!(p.min_attempt(), Duration::from_millis(20));
        assert!(!p.keyed());
        assert_eq!(p.budget().ratio(), 0.1);
        assert_eq!(p.budget().burst(), 20);
        assert_eq!((p.service(), p.method()), ("psp", "Charge"));
    }

    #[test]
    fn max_attempts_outside_one_to_five_is_rejected() {
        for n in [0, 6, 100, u32::MAX] {
            let err = RetryPolicy::builder("s", "m")
                .max_attempts(n)
                .build()
                .unwrap_err();
            assert_eq!(err, PolicyError::MaxAttempts { got: n });
        }
        for n in 1..=5 {
            let p = RetryPolicy::builder("s", "m".to_string())
                .max_attempts(n)
                .build()
                .unwrap();
            assert_eq!(p.max_attempts(), n);
        }
    }

    #[test]
    fn clones_share_the_budget() {
        let p = RetryPolicy::builder("s", "m")
            .budget(RetryBudget::new(0.0, 1).unwrap())
            .build()
            .unwrap();
        let q = p.clone();
        assert!(p.budget().try_withdraw());
        assert!(!q.budget().try_withdraw());
    }
}
