//! The retry policy: how many attempts, which backoff, what the retries spend from, and the
//! labels it reports under.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use metrics::SharedString;

use super::metrics::PolicyMetrics;
use super::{Backoff, RetrySpend};
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
/// [`RetryPolicy::execute_with`]. Cloning is cheap and the clones share what they spend from;
/// give every policy that calls the same destination the same [`RetrySpend`].
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub(super) max_attempts: u32,
    pub(super) backoff: Backoff,
    pub(super) spend: RetrySpend,
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
    /// attempts, [`Backoff::default`], a fresh [`RetrySpend::default`],
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
            spend: RetrySpend::default(),
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

    /// What the retries spend from, shared with the destination's other policies.
    pub fn spend(&self) -> &RetrySpend {
        &self.spend
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

    /// The same policy (labels, spend, backoff) with a single attempt: for calls that may
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
    spend: RetrySpend,
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

    /// What the retries spend from (a [`RetrySpend`], or a [`RetryBudget`](super::RetryBudget)
    /// alone), shared with every other policy calling the same destination.
    pub fn spend(mut self, spend: impl Into<RetrySpend>) -> Self {
        self.spend = spend.into();
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
            spend: self.spend,
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
        assert_eq!(p.spend().retry_budget().ratio(), 0.1);
        assert_eq!(p.spend().retry_budget().burst(), 20);
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
            .spend(super::super::RetryBudget::new(0.0, 1).unwrap())
            .build()
            .unwrap();
        let q = p.clone();
        assert!(p.spend().take_retry_token());
        assert!(!q.spend().take_retry_token());
    }
}
