//! A retry budget: retries limited to a fraction of requests.
//!
//! # Why budgets, not max retries
//!
//! "At most 3 attempts" bounds one client, not the system. When a dependency fails for
//! everyone, every caller uses every attempt: 10 000 callers with 3 attempts each send 30 000
//! requests to a service that could not answer 10 000. Stack two layers that each retry three
//! times and the bottom sees 9 times the load. The retries arrive exactly when the dependency
//! is least able to serve them, and they keep it down after the original cause is gone.
//!
//! A budget bounds the *ratio* instead. Every logical request deposits `ratio` tokens, every
//! retry (and every hedge) withdraws one whole token, and a retry without a token is not sent.
//! However many callers fail and however many attempts each one would like, the retries stay
//! below `ratio x requests + burst`: with the default ratio 0.1 a layer adds at most 10 % load
//! (1.1x amplification per layer instead of 3x). The `burst` tokens, available from the start
//! and the most the budget ever holds, let a quiet client retry its first few failures.
//!
//! A budget is shared: clone it (the clones share one balance) into every policy that calls
//! the same destination. It is lock-free: the balance is one atomic fixed-point counter (in
//! billionths of a token, so ratios well below 1 %, e.g. 0.001, are exact) updated by
//! compare-and-swap loops.
//!
//! ```
//! use backstop::retry::RetryBudget;
//!
//! // 1 retry per 100 requests, plus 2 tokens of burst.
//! let budget = RetryBudget::new(0.01, 2)?;
//! let mut retries = 0;
//! for _ in 0..1_000 {
//!     budget.deposit(); // one logical request
//!     // its dependency is down: it asks for a retry every time
//!     if budget.try_withdraw() {
//!         retries += 1;
//!     }
//! }
//! assert!(retries as f64 <= 0.01 * 1_000.0 + 2.0);
//! assert_eq!(retries, 11); // 2 from the burst, then 1 per 100 requests
//! # Ok::<(), backstop::retry::BudgetError>(())
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Fixed-point scale: one token is `SCALE` units, so a ratio resolves to 1e-9.
const SCALE: u64 = 1_000_000_000;

/// The largest accepted ratio: above 1, retries could outnumber the requests they retry.
const MAX_RATIO: f64 = 1.0;

/// A budget that cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum BudgetError {
    /// The ratio is not a number in `[0, 1]`.
    #[error("retry budget ratio must be within [0, 1], got {0}")]
    Ratio(f64),
}

/// Retries as a fraction of logical requests: `ratio` tokens per request, one token per
/// retry or hedge, at most `burst` tokens saved.
///
/// Cloning is cheap and the clones share one balance. Over any interleaving of calls, from any
/// number of threads, the number of successful [`try_withdraw`](RetryBudget::try_withdraw)s
/// never exceeds `ratio x deposits + burst`.
#[derive(Debug, Clone)]
pub struct RetryBudget {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Balance in units of `1 / SCALE` tokens.
    tokens: AtomicU64,
    /// Units deposited per logical request: `floor(ratio x SCALE)`, never more than the ratio.
    per_request: u64,
    /// Most units the balance may hold.
    max: u64,
    ratio: f64,
    burst: u32,
}

impl Default for RetryBudget {
    /// Ratio 0.1, burst 20.
    fn default() -> Self {
        RetryBudget::with_units(0.1, 20)
    }
}

impl RetryBudget {
    /// A budget allowing `ratio` retries per logical request plus `burst` in reserve.
    ///
    /// The budget starts full, with `burst` tokens, and never holds more than `burst` tokens
    /// (or one token when `burst` is 0, so a pure ratio still lets a retry through). Fails
    /// unless `0 <= ratio <= 1`.
    pub fn new(ratio: f64, burst: u32) -> Result<RetryBudget, BudgetError> {
        if !(0.0..=MAX_RATIO).contains(&ratio) {
            return Err(BudgetError::Ratio(ratio));
        }
        Ok(RetryBudget::with_units(ratio, burst))
    }

    fn with_units(ratio: f64, burst: u32) -> RetryBudget {
        // Rounded down, so the deposits never add up to more than the ratio promises.
        let per_request = (ratio * SCALE as f64).floor() as u64;
        let start = u64::from(burst) * SCALE;
        let max = start.max(SCALE);
        RetryBudget {
            inner: Arc::new(Inner {
                tokens: AtomicU64::new(start),
                per_request,
                max,
                ratio,
                burst,
            }),
        }
    }

    /// Records one logical request: adds `ratio` tokens, up to the maximum.
    ///
    /// Call it once per logical request, never per attempt: depositing per attempt would let
    /// retries pay for more retries.
    pub fn deposit(&self) {
        let inner = &*self.inner;
        // Relaxed is enough: the balance is a single atomic and every update is a
        // read-modify-write, which always acts on the latest value; no other memory is
        // published through it.
        let _ = inner
            .tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                (t < inner.max).then(|| t.saturating_add(inner.per_request).min(inner.max))
            });
    }

    /// Takes one token for a retry or a hedge; `false` (and nothing taken) when less than one
    /// token is left, in which case the retry must not be sent.
    pub fn try_withdraw(&self) -> bool {
        self.inner
            .tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                t.checked_sub(SCALE)
            })
            .is_ok()
    }

    /// The tokens currently available, fractional (for metrics and tests).
    pub fn available(&self) -> f64 {
        self.inner.tokens.load(Ordering::Relaxed) as f64 / SCALE as f64
    }

    /// Retries allowed per logical request.
    pub fn ratio(&self) -> f64 {
        self.inner.ratio
    }

    /// Tokens the budget starts with and saves up to.
    pub fn burst(&self) -> u32 {
        self.inner.burst
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The bound every budget promises: `retries <= ratio x requests + burst`.
    fn within_bound(retries: u64, requests: u64, ratio: f64, burst: u32) -> bool {
        retries as f64 <= ratio * requests as f64 + f64::from(burst)
    }

    #[test]
    fn defaults_follow_the_design() {
        let b = RetryBudget::default();
        assert_eq!(b.ratio(), 0.1);
        assert_eq!(b.burst(), 20);
        assert_eq!(b.available(), 20.0);
    }

    #[test]
    fn invalid_ratios_are_rejected() {
        for ratio in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            assert!(RetryBudget::new(ratio, 1).is_err(), "{ratio}");
        }
        assert!(RetryBudget::new(0.0, 0).is_ok());
        assert!(RetryBudget::new(1.0, 0).is_ok());
    }

    #[test]
    fn burst_is_spent_then_ratio_refills() {
        let b = RetryBudget::new(0.1, 2).unwrap();
        assert!(b.try_withdraw());
        assert!(b.try_withdraw());
        assert!(!b.try_withdraw());
        for _ in 0..9 {
            b.deposit();
        }
        assert!(!b.try_withdraw(), "0.9 tokens are not a retry");
        b.deposit();
        assert!(b.try_withdraw());
        assert!(!b.try_withdraw());
    }

    #[test]
    fn balance_never_exceeds_burst() {
        let b = RetryBudget::new(0.5, 3).unwrap();
        for _ in 0..1_000 {
            b.deposit();
        }
        assert_eq!(b.available(), 3.0);
    }

    #[test]
    fn zero_burst_still_allows_the_ratio() {
        let b = RetryBudget::new(0.25, 0).unwrap();
        assert!(!b.try_withdraw());
        for _ in 0..4 {
            b.deposit();
        }
        assert!(b.try_withdraw());
        assert!(!b.try_withdraw());
    }

    #[test]
    fn tiny_ratios_are_exact() {
        let b = RetryBudget::new(0.001, 0).unwrap();
        let mut retries = 0;
        for _ in 0..10_000 {
            b.deposit();
            if b.try_withdraw() {
                retries += 1;
            }
        }
        assert_eq!(retries, 10);
    }

    #[test]
    fn clones_share_one_balance() {
        let a = RetryBudget::new(0.1, 1).unwrap();
        let b = a.clone();
        assert!(a.try_withdraw());
        assert!(!b.try_withdraw());
    }

    #[test]
    fn many_threads_never_exceed_the_bound() {
        const THREADS: u64 = 8;
        const REQUESTS: u64 = 20_000;
        for (ratio, burst) in [(0.1, 20), (0.005, 3), (0.001, 0), (0.37, 1)] {
            let budget = RetryBudget::new(ratio, burst).unwrap();
            let barrier = Arc::new(std::sync::Barrier::new(THREADS as usize));
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let budget = budget.clone();
                    let barrier = Arc::clone(&barrier);
                    std::thread::spawn(move || {
                        barrier.wait();
                        let mut retries = 0u64;
                        for i in 0..REQUESTS {
                            budget.deposit();
                            // Each thread asks for a varying number of retries per request,
                            // so deposits and withdrawals interleave differently per thread.
                            for _ in 0..=((i + t) % 3) {
                                if budget.try_withdraw() {
                                    retries += 1;
                                }
                            }
                        }
                        retries
                    })
                })
                .collect();
            let retries: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
            let requests = THREADS * REQUESTS;
            assert!(
                within_bound(retries, requests, ratio, burst),
                "ratio {ratio} burst {burst}: {retries} retries for {requests} requests"
            );
            // The burst alone is always spent (the rest depends on how deposits race a
            // full balance, which loses them).
            assert!(
                retries >= u64::from(burst),
                "ratio {ratio} burst {burst}: {retries}"
            );
        }
    }

    #[derive(Debug, Clone, Copy)]
    enum Op {
        Deposit,
        Withdraw,
    }

    proptest! {
        #[test]
        fn retries_never_exceed_ratio_times_requests_plus_burst(
            ratio in prop_oneof![0.0..=1.0f64, 0.0..0.01f64, Just(0.001), Just(0.005), Just(0.1)],
            burst in 0u32..50,
            ops in proptest::collection::vec(
                prop_oneof![Just(Op::Deposit), Just(Op::Withdraw)], 0..3_000),
        ) {
            let b = RetryBudget::new(ratio, burst).unwrap();
            let (mut requests, mut retries) = (0u64, 0u64);
            for op in ops {
                match op {
                    Op::Deposit => { b.deposit(); requests += 1; }
                    Op::Withdraw => if b.try_withdraw() { retries += 1; },
                }
                prop_assert!(
                    within_bound(retries, requests, ratio, burst),
                    "{} retries for {} requests at ratio {} burst {}", retries, requests, ratio, burst
                );
            }
        }

        #[test]
        fn a_failing_dependency_gets_at_most_the_ratio(
            ratio in prop_oneof![0.0..=1.0f64, 0.0..0.01f64],
            burst in 0u32..50,
            requests in 0u64..20_000,
            wanted in 1u32..5,
        ) {
            // Every request fails and wants `wanted` retries: the worst case for the budget.
            let b = RetryBudget::new(ratio, burst).unwrap();
            let mut retries = 0u64;
            for _ in 0..requests {
                b.deposit();
                for _ in 0..wanted {
                    if b.try_withdraw() { retries += 1; }
                }
            }
            prop_assert!(within_bound(retries, requests, ratio, burst));
        }
    }
}
