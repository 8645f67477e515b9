//! gRPC's retry throttling: a token bucket that retries stop on while a destination fails.
//!
//! This is what a gRPC service config's `retryThrottling {maxTokens, tokenRatio}` means, kept
//! as gRPC counts it so that the same JSON sends the same attempts from a backstop client as
//! from a gRPC one. The bucket starts full with `maxTokens`; every attempt that fails with a
//! code the method retries takes one token, every successful attempt gives back `tokenRatio`,
//! never above `maxTokens` and never below zero. Retries (and hedges) are sent only while more
//! than half the tokens are left: the failure that brings the count to half or below is not
//! retried. Tokens are counted in thousandths, as gRPC does, so the same sequence of answers
//! gives the same decisions.
//!
//! It differs from backstop's own [`RetryBudget`](super::RetryBudget) in what it measures: the
//! budget bounds retries by the number of logical requests (at most `ratio` retries per
//! request, whatever fails), the bucket by the answers (retries stop once failures outweigh
//! `1 / tokenRatio` times the successes, and resume as successes come back). A
//! [`Destination`](crate::client::Destination) uses one or the other
//! ([`Throttling`](crate::client::Throttling)).
//!
//! ```
//! use backstop::retry::RetryThrottle;
//!
//! // maxTokens 10, tokenRatio 0.1: retries stop once 5 tokens or fewer are left.
//! let throttle = RetryThrottle::new(10, 0.1)?;
//! for _ in 0..4 {
//!     assert!(throttle.record_failure(), "still above half: retry");
//! }
//! assert!(!throttle.record_failure(), "5 tokens left: no retry");
//! assert!(!throttle.allows_retry());
//! throttle.record_success(); // 5.1 tokens
//! assert!(throttle.allows_retry());
//! # Ok::<(), backstop::retry::RetryThrottleError>(())
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// Thousandths of a token per token: gRPC's own resolution.
const MILLI: u32 = 1000;
/// The most tokens gRPC accepts in `maxTokens`.
pub const MAX_TOKENS: u32 = 1000;

/// A retry throttle that cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum RetryThrottleError {
    /// `max_tokens` is not within `1..=1000`.
    #[error("retry throttling maxTokens must be within 1..={MAX_TOKENS}, got {0}")]
    MaxTokens(u32),
    /// `token_ratio` is not within `(0, 1]`, or is finer than a thousandth.
    #[error("retry throttling tokenRatio must be within [0.001, 1], got {0}")]
    TokenRatio(f64),
}

/// gRPC's retry throttling for one destination (see the [module docs](self)). Cheap to clone;
/// clones share the tokens. Lock-free: the count is one atomic updated by compare-and-swap.
#[derive(Debug, Clone)]
pub struct RetryThrottle {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Thousandths of a token left.
    milli_tokens: AtomicU32,
    max_milli_tokens: u32,
    /// Thousandths of a token given back per success.
    milli_ratio: u32,
    token_ratio: f64,
}

impl RetryThrottle {
    /// A full bucket of `max_tokens` (1 to 1000) that gives back `token_ratio` tokens (0.001
    /// to 1, read to the thousandth as gRPC reads it) per successful attempt.
    pub fn new(max_tokens: u32, token_ratio: f64) -> Result<Self, RetryThrottleError> {
        if !(1..=MAX_TOKENS).contains(&max_tokens) {
            return Err(RetryThrottleError::MaxTokens(max_tokens));
        }
        // gRPC keeps three decimals of the ratio and drops the rest; the small epsilon keeps
        // 0.1 (0.1000000000000000055...) from becoming 99 thousandths through a product
        // rounded below 100.
        let milli_ratio = if token_ratio.is_finite() {
            (token_ratio * f64::from(MILLI) + 1e-6).floor()
        } else {
            0.0
        };
        if !(1.0..=f64::from(MILLI)).contains(&milli_ratio) || token_ratio > 1.0 {
            return Err(RetryThrottleError::TokenRatio(token_ratio));
        }
        let max_milli_tokens = max_tokens * MILLI;
        Ok(Self {
            inner: Arc::new(Inner {
                milli_tokens: AtomicU32::new(max_milli_tokens),
                max_milli_tokens,
                milli_ratio: milli_ratio as u32,
                token_ratio,
            }),
        })
    }

    /// At or below this many thousandths, retries stop.
    fn threshold(&self) -> u32 {
        self.inner.max_milli_tokens / 2
    }

    /// Records an attempt that failed with a code its method retries (or with no status at
    /// all): one token less. Returns whether a retry may follow, that is whether more than
    /// half the tokens are left after this failure.
    pub fn record_failure(&self) -> bool {
        let before = self
            .inner
            .milli_tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                Some(t.saturating_sub(MILLI))
            })
            .unwrap_or_else(|t| t);
        before.saturating_sub(MILLI) > self.threshold()
    }

    /// Records a successful attempt: `token_ratio` tokens back, up to `max_tokens`.
    pub fn record_success(&self) {
        let inner = &*self.inner;
        // Relaxed is enough: every update is a read-modify-write of the one counter, and no
        // other memory is published through it.
        let _ = inner
            .milli_tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                (t < inner.max_milli_tokens).then(|| {
                    t.saturating_add(inner.milli_ratio)
                        .min(inner.max_milli_tokens)
                })
            });
    }

    /// Whether more than half the tokens are left, so a retry or a hedge may be sent now
    /// (nothing is taken: in gRPC's scheme the failure pays, not the retry).
    pub fn allows_retry(&self) -> bool {
        self.inner.milli_tokens.load(Ordering::Relaxed) > self.threshold()
    }

    /// The tokens left, fractional (for metrics and tests).
    pub fn tokens(&self) -> f64 {
        f64::from(self.inner.milli_tokens.load(Ordering::Relaxed)) / f64::from(MILLI)
    }

    /// The tokens the bucket starts with and never exceeds (`maxTokens`).
    pub fn max_tokens(&self) -> u32 {
        self.inner.max_milli_tokens / MILLI
    }

    /// The tokens a successful attempt gives back (`tokenRatio`), as given.
    pub fn token_ratio(&self) -> f64 {
        self.inner.token_ratio
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn limits_are_checked() {
        for max in [0, 1001, u32::MAX] {
            assert_eq!(
                RetryThrottle::new(max, 0.1).unwrap_err(),
                RetryThrottleError::MaxTokens(max)
            );
        }
        for ratio in [0.0, 0.0009, -0.1, 1.5, f64::NAN, f64::INFINITY] {
            assert!(
                matches!(
                    RetryThrottle::new(10, ratio),
                    Err(RetryThrottleError::TokenRatio(_))
                ),
                "{ratio}"
            );
        }
        let t = RetryThrottle::new(1000, 1.0).unwrap();
        assert_eq!(
            (t.max_tokens(), t.token_ratio(), t.tokens()),
            (1000, 1.0, 1000.0)
        );
    }

    /// The arithmetic of gRPC A6: start at maxTokens, -1 per failure, +ratio per success,
    /// within [0, maxTokens]; a retry only while strictly more than maxTokens / 2 are left.
    #[test]
    fn tokens_follow_grpc_arithmetic() {
        let t = RetryThrottle::new(3, 0.5).unwrap();
        assert!(t.record_failure(), "2 > 1.5");
        assert!(!t.record_failure(), "1 <= 1.5");
        assert!(!t.record_failure(), "0");
        assert!(!t.record_failure(), "never below 0");
        assert_eq!(t.tokens(), 0.0);
        for _ in 0..3 {
            t.record_success();
        }
        assert_eq!(t.tokens(), 1.5);
        assert!(!t.allows_retry(), "exactly half is not above half");
        t.record_success();
        assert!(t.allows_retry());
        for _ in 0..10 {
            t.record_success();
        }
        assert_eq!(t.tokens(), 3.0, "capped at maxTokens");
        // An odd number of thousandths: the threshold is rounded down, as gRPC's is.
        let t = RetryThrottle::new(1, 0.001).unwrap();
        assert!(!t.record_failure());
        for _ in 0..500 {
            t.record_success();
        }
        assert!(!t.allows_retry(), "500 thousandths of 1000 is half");
        t.record_success();
        assert!(t.allows_retry());
    }

    #[test]
    fn the_ratio_is_read_to_the_thousandth() {
        let t = RetryThrottle::new(10, 0.1).unwrap();
        for _ in 0..5 {
            t.record_failure();
        }
        t.record_success();
        assert_eq!(t.tokens(), 5.1);
        let t = RetryThrottle::new(10, 0.12345).unwrap();
        for _ in 0..5 {
            t.record_failure();
        }
        t.record_success();
        assert_eq!(t.tokens(), 5.123);
    }

    proptest! {
        /// Whatever the answers, the count stays within [0, maxTokens] and a retry is allowed
        /// exactly when a shadow count in thousandths is above half.
        #[test]
        fn the_count_matches_a_plain_model(
            max in 1u32..=20,
            ratio_milli in 1u32..=1000,
            answers in proptest::collection::vec(any::<bool>(), 0..200),
        ) {
            let t = RetryThrottle::new(max, f64::from(ratio_milli) / 1000.0).unwrap();
            let mut model = i64::from(max) * 1000;
            for ok in answers {
                if ok {
                    t.record_success();
                    model = (model + i64::from(ratio_milli)).min(i64::from(max) * 1000);
                } else {
                    let allowed = t.record_failure();
                    model = (model - 1000).max(0);
                    prop_assert_eq!(allowed, model > i64::from(max) * 500);
                }
                prop_assert_eq!(t.tokens(), model as f64 / 1000.0);
                prop_assert_eq!(t.allows_retry(), model > i64::from(max) * 500);
            }
        }
    }
}
