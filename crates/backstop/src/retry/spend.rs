//! [`RetrySpend`]: what a destination's extra sends spend from, and whether one may be sent.

use std::sync::Arc;

use tokio::time::Instant;

use super::{AdaptiveThrottle, RetryBudget, RetrySwitch, RetryThrottle, StopReason, StormAlarm};

/// What every retry and hedge to one destination spends from, and the decisions that read it:
/// the [`RetryBudget`]'s tokens, the [`StormAlarm`], the fleet's [`RetrySwitch`], retrying at
/// one layer, gRPC's [`RetryThrottle`] and the [`AdaptiveThrottle`].
///
/// One per destination, given to every [`RetryPolicy`](super::RetryPolicy) and
/// [`HedgePolicy`](crate::hedge::HedgePolicy) that calls it (a
/// [`Destination`](crate::client::Destination) builds it and hands it to each method's). Cheap
/// to clone: clones share the state, and a setter on a shared one changes only the copy it is
/// called on.
#[derive(Debug, Clone, Default)]
pub struct RetrySpend(Arc<Parts>);

#[derive(Debug, Clone)]
struct Parts {
    budget: RetryBudget,
    storm: Option<StormAlarm>,
    switch: Option<RetrySwitch>,
    one_layer: bool,
    throttle: Option<AdaptiveThrottle>,
    retry_throttle: Option<RetryThrottle>,
}

impl Default for Parts {
    fn default() -> Self {
        Self {
            budget: RetryBudget::default(),
            storm: None,
            switch: None,
            one_layer: true,
            throttle: None,
            retry_throttle: None,
        }
    }
}

impl From<RetryBudget> for RetrySpend {
    fn from(budget: RetryBudget) -> Self {
        Self::default().budget(budget)
    }
}

impl RetrySpend {
    /// Spending from `budget` alone: no storm alarm, no switch, no throttle, retries at one
    /// layer. The [`Default`] is a fresh [`RetryBudget::default`].
    pub fn new(budget: RetryBudget) -> Self {
        Self::from(budget)
    }

    fn set(mut self, f: impl FnOnce(&mut Parts)) -> Self {
        f(Arc::make_mut(&mut self.0));
        self
    }

    /// The retry budget: one deposit per logical request, one token per retry, hedge or
    /// transparent re-send.
    pub fn budget(self, budget: RetryBudget) -> Self {
        self.set(|p| p.budget = budget)
    }

    /// The storm alarm (default none): while it is tripped no retry
    /// ([`StopReason::Storm`]) and no hedge is sent.
    pub fn storm_alarm(self, alarm: Option<StormAlarm>) -> Self {
        self.set(|p| p.storm = alarm)
    }

    /// The fleet's retry switch, shared by every destination of the process (default none):
    /// while it is off no retry ([`StopReason::SwitchedOff`]) and no hedge is sent, and while
    /// it sets a ratio each logical request deposits at most that ratio into the budget.
    pub fn retry_switch(self, switch: Option<RetrySwitch>) -> Self {
        self.set(|p| p.switch = switch)
    }

    /// Retry at one layer (default on): a call made while serving a request that arrived as a
    /// retry or a hedge ([`inbound::previous_attempts`](super::inbound::previous_attempts)
    /// above 0) is sent once, neither retried ([`StopReason::RetriedAbove`]) nor hedged: the
    /// layer above retries. `false` retries it anyway.
    pub fn retry_at_one_layer(self, on: bool) -> Self {
        self.set(|p| p.one_layer = on)
    }

    /// Client-side adaptive throttling (default none): attempts it rejects are not sent
    /// ([`StopReason::Throttled`]).
    pub fn throttle(self, throttle: Option<AdaptiveThrottle>) -> Self {
        self.set(|p| p.throttle = throttle)
    }

    /// gRPC's retry throttling (default none): every attempt that fails with a retried code
    /// takes a token, every success gives back a fraction of one, and no retry follows a
    /// failure that leaves half the tokens or fewer ([`StopReason::BudgetExhausted`]); no
    /// hedge is sent then either. It is consulted beside the [budget](Self::budget); to limit
    /// retries by the bucket alone, as gRPC does, give a budget that never runs out (see
    /// [`Throttling`](crate::client::Throttling)).
    pub fn retry_throttle(self, throttle: Option<RetryThrottle>) -> Self {
        self.set(|p| p.retry_throttle = throttle)
    }

    /// The retry budget.
    pub fn retry_budget(&self) -> &RetryBudget {
        &self.0.budget
    }

    /// The storm alarm, if any.
    pub fn storm(&self) -> Option<&StormAlarm> {
        self.0.storm.as_ref()
    }

    /// The fleet's retry switch, if any.
    pub fn switch(&self) -> Option<&RetrySwitch> {
        self.0.switch.as_ref()
    }

    /// Whether retries happen at one layer (see [`retry_at_one_layer`](Self::retry_at_one_layer)).
    pub fn retries_at_one_layer(&self) -> bool {
        self.0.one_layer
    }

    /// The adaptive throttle, if any.
    pub fn adaptive_throttle(&self) -> Option<&AdaptiveThrottle> {
        self.0.throttle.as_ref()
    }

    /// gRPC's retry throttling, if any.
    pub fn grpc_throttle(&self) -> Option<&RetryThrottle> {
        self.0.retry_throttle.as_ref()
    }

    /// A logical request starts: one deposit into the budget, at most the switch's ratio.
    pub fn record_request(&self) {
        let cap = self.0.switch.as_ref().and_then(RetrySwitch::ratio_cap);
        self.0.budget.deposit_capped(cap);
    }

    /// Whether an attempt may be sent at `now`: not while the adaptive throttle rejects it
    /// locally.
    pub fn admit_at(&self, now: Instant) -> bool {
        self.0.throttle.as_ref().is_none_or(|t| t.admit_at(now))
    }

    /// A logical request's first attempt was answered at `now`: the storm alarm counts the
    /// request then, not as it starts, so that a burst of calls still waiting for their first
    /// answer does not dilute the retries the earliest answers ask for.
    pub fn record_first_answer_at(&self, now: Instant) {
        if let Some(storm) = &self.0.storm {
            storm.record_request_at(now);
        }
    }

    /// The server took an attempt at `now` (it answered, and not by refusing load): the
    /// adaptive throttle counts it.
    pub fn record_accepted_at(&self, now: Instant) {
        if let Some(throttle) = &self.0.throttle {
            throttle.record_accept_at(now);
        }
    }

    /// An attempt of a method that may be retried succeeded: gRPC's retry throttling gets a
    /// fraction of a token back.
    pub fn record_retryable_success(&self) {
        if let Some(throttle) = &self.0.retry_throttle {
            throttle.record_success();
        }
    }

    /// An attempt of a method that may be retried failed with a retried code: gRPC's retry
    /// throttling takes a token, and `false` when too few are left for a retry.
    pub fn record_retryable_failure(&self) -> bool {
        self.0
            .retry_throttle
            .as_ref()
            .is_none_or(RetryThrottle::record_failure)
    }

    /// Whether a retry asked for at `now` may be sent, before its token is taken: not while
    /// the storm alarm is tripped (which counts it asked for, sent or not), the fleet's switch
    /// is off, or the call serves a request that arrived as a retry (at one layer).
    pub fn retry_wanted_at(&self, now: Instant) -> Result<(), StopReason> {
        if self
            .0
            .storm
            .as_ref()
            .is_some_and(|storm| !storm.retry_wanted_at(now))
        {
            return Err(StopReason::Storm);
        }
        // After the alarm: it counts the retries asked for while the switch holds them back.
        if self.0.switch.as_ref().is_some_and(|s| !s.allows_retries()) {
            return Err(StopReason::SwitchedOff);
        }
        if self.retried_above() {
            return Err(StopReason::RetriedAbove);
        }
        Ok(())
    }

    /// Takes the budget's token for a retry about to be sent; `false` when none is left.
    pub fn take_retry_token(&self) -> bool {
        self.0.budget.try_withdraw()
    }

    /// Whether the budget holds a token for one more retry (none is taken).
    pub fn has_retry_token(&self) -> bool {
        self.0.budget.available() >= 1.0
    }

    /// Whether a hedge may be sent at `now`, taking its token when it may. A hedge answers a
    /// slow attempt, not a failed one: it is not counted in the storm alarm's retry ratio
    /// (hedging at the p95 would otherwise take half of its margin in calm weather), but none
    /// is sent while the alarm is tripped; and it takes a token from the retry budget only
    /// while the budget holds at least half its burst, leaving the rest to retries; with
    /// gRPC's retry throttling, only while that holds more than half its tokens (and takes
    /// none from it). None while the fleet's switch is off, nor for a request that arrived
    /// as a retry (at one layer).
    pub fn try_hedge_at(&self, now: Instant) -> bool {
        let p = &*self.0;
        let storming = p
            .storm
            .as_ref()
            .is_some_and(|s| s.level_at(now) == super::StormLevel::Tripped);
        let throttled = p.retry_throttle.as_ref().is_some_and(|t| !t.allows_retry());
        let switched_off = p.switch.as_ref().is_some_and(|s| !s.allows_retries());
        !storming
            && !throttled
            && !switched_off
            && !self.retried_above()
            && p.budget.available() >= f64::from(p.budget.burst()) / 2.0
            && p.budget.try_withdraw()
    }

    /// Whether the call serves a request that arrived as a retry or a hedge, and retries
    /// happen at one layer.
    fn retried_above(&self) -> bool {
        self.0.one_layer && super::inbound::previous_attempts() > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_the_budget() {
        let spend = RetrySpend::new(RetryBudget::new(0.0, 1).unwrap());
        let clone = spend.clone();
        assert!(spend.take_retry_token());
        assert!(!clone.take_retry_token());
    }

    #[test]
    fn a_setter_on_a_shared_one_leaves_the_other_alone() {
        let spend = RetrySpend::default();
        let other = spend.clone().retry_at_one_layer(false);
        assert!(spend.retries_at_one_layer());
        assert!(!other.retries_at_one_layer());
    }

    #[tokio::test(start_paused = true)]
    async fn a_hedge_leaves_half_the_burst_to_retries() {
        let spend = RetrySpend::new(RetryBudget::new(0.0, 4).unwrap());
        let now = Instant::now();
        // Hedges while at least 2 of the 4 tokens are left: 4, 3, 2.
        for _ in 0..3 {
            assert!(spend.try_hedge_at(now));
        }
        assert!(!spend.try_hedge_at(now), "the last token is the retries'");
        assert!(spend.take_retry_token());
        assert!(!spend.take_retry_token());
    }
}
