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
//! # Why no minimum of concurrent retries
//!
//! Envoy's retry budget allows `budget_percent` (20 %) of the requests *active now* as
//! concurrent retries, and adds `min_retry_concurrency` (3): at low traffic, 20 % of two
//! active requests is no retry at all, so without the minimum a quiet client could never
//! retry. This budget counts requests, not concurrency: a deposit stays until a retry spends
//! it, however long ago the request ran, so a quiet client earns its retries as a busy one
//! does, in proportion to the calls it makes, and starts with the `burst` in hand. The
//! minimum would only add retries where the ratio says there should be none: one request at
//! a time against a dependency that is down would retry every one of them.
//!
//! ```
//! use backstop::retry::RetryBudget;
//!
//! // One request at a time, one in ten failing once: every failure is retried, burst or not.
//! let budget = RetryBudget::new(0.1, 0)?;
//! let mut refused = 0;
//! for request in 1..=1_000 {
//!     budget.deposit();
//!     if request % 10 == 0 && !budget.try_withdraw() {
//!         refused += 1;
//!     }
//! }
//! assert_eq!(refused, 0);
//! # Ok::<(), backstop::retry::BudgetError>(())
//! ```
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use metrics::SharedString;

use crate::observe::{self, label};

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
    /// The tokens gauge, once [published](RetryBudget::publish_as).
    gauge: OnceLock<metrics::Gauge>,
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

    /// A budget that never runs out (ratio 1, `u32::MAX` tokens): for a destination whose
    /// retries something else limits, such as gRPC's retry throttling
    /// ([`RetryThrottle`](super::RetryThrottle)), so that only that limit applies.
    pub fn unlimited() -> RetryBudget {
        RetryBudget::with_units(1.0, u32::MAX)
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
                gauge: OnceLock::new(),
            }),
        }
    }

    /// Publishes the balance as the gauge [`RPC_CLIENT_RETRY_BUDGET_TOKENS`] labelled
    /// `service` (the destination), updated whenever it changes. The first call names it;
    /// later calls change nothing. Call it after installing a `metrics` recorder.
    ///
    /// [`RPC_CLIENT_RETRY_BUDGET_TOKENS`]: crate::observe::RPC_CLIENT_RETRY_BUDGET_TOKENS
    pub fn publish_as(&self, service: impl Into<SharedString>) {
        let service = service.into();
        let gauge = self.inner.gauge.get_or_init(
            || metrics::gauge!(observe::RPC_CLIENT_RETRY_BUDGET_TOKENS, label::SERVICE => service),
        );
        gauge.set(self.available());
    }

    /// Updates the gauge, if published, to `units`.
    fn report(&self, units: u64) {
        if let Some(gauge) = self.inner.gauge.get() {
            gauge.set(units as f64 / SCALE as f64);
        }
    }

    /// Records one logical request: adds `ratio` tokens, up to the maximum.
    ///
    /// Call it once per logical request, never per attempt: depositing per attempt would let
    /// retries pay for more retries.
    pub fn deposit(&self) {
        self.deposit_units(self.inner.per_request);
    }

    /// [`deposit`](Self::deposit), of at most `ratio_cap` tokens when given: a lower ratio
    /// set for the fleet ([`RetrySwitch`](super::RetrySwitch)); the budget's own ratio when
    /// that is lower.
    pub fn deposit_capped(&self, ratio_cap: Option<f64>) {
        let units = match ratio_cap {
            // Rounded down like the budget's own ratio; a cap outside [0, 1] is clamped.
            Some(cap) => ((cap.clamp(0.0, MAX_RATIO) * SCALE as f64).floor() as u64)
                .min(self.inner.per_request),
            None => self.inner.per_request,
        };
        if units > 0 {
            self.deposit_units(units);
        }
    }

    fn deposit_units(&self, units: u64) {
        let inner = &*self.inner;
        // Relaxed is enough: the balance is a single atomic and every update is a
        // read-modify-write, which always acts on the latest value; no other memory is
        // published through it.
        let deposited = inner
            .tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                (t < inner.max).then(|| t.saturating_add(units).min(inner.max))
            });
        // A full budget (the usual case) changes nothing and reports nothing.
        if let Ok(before) = deposited {
            self.report(before.saturating_add(units).min(inner.max));
        }
    }

    /// Takes one token for a retry or a hedge; `false` (and nothing taken) when less than one
    /// token is left, in which case the retry must not be sent.
    pub fn try_withdraw(&self) -> bool {
        let withdrawn = self
            .inner
            .tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                t.checked_sub(SCALE)
            });
        if let Ok(before) = withdrawn {
            self.report(before - SCALE);
        }
        withdrawn.is_ok()
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

/// A [`RetryBudget`] is a tower retry budget, so a [`tower::retry::Policy`] can share a
/// destination's budget with backstop's own retries and hedges.
///
/// Tower's two calls are ours, with the same accounting:
///
/// - [`Budget::deposit`] is [`RetryBudget::deposit`]: `ratio` tokens for one logical request.
///   Call it once per request session, whatever the outcome, as [`RetryPolicy`] does when a
///   request starts, before its first attempt. A tower policy sees a session first when the
///   first attempt's result reaches [`Policy::retry`], so it deposits there, before any
///   withdrawal. Never deposit per retry: retries would pay for more retries. (Tower's own
///   budget example deposits on success only; that stays within the bound too, but earns no
///   tokens while a destination fails every request, so only the burst is ever retried.)
/// - [`Budget::withdraw`] is [`RetryBudget::try_withdraw`]: one whole token per retry (or
///   hedge), the token [`RetryPolicy`] takes once it has decided to retry, before the
///   backoff wait, and the hedge layer before it sends a hedge. `false` takes nothing, and
///   the retry must not be sent.
///
/// So over any mix of tower sessions and backstop requests sharing one budget, retries and
/// hedges stay within `ratio x requests + burst`.
///
/// [`Budget::deposit`]: tower::retry::budget::Budget::deposit
/// [`Budget::withdraw`]: tower::retry::budget::Budget::withdraw
/// [`RetryPolicy`]: super::RetryPolicy
/// [`Policy::retry`]: tower::retry::Policy::retry
///
/// ```
/// use std::future::{Ready, ready};
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use backstop::retry::RetryBudget;
/// use tower::retry::{Policy, Retry, budget::Budget};
/// use tower::{ServiceExt, service_fn};
///
/// /// Retries every error while the budget allows, up to three attempts per request.
/// #[derive(Clone)]
/// struct Budgeted<B> {
///     budget: B,
///     // Per session: tower clones the policy for every request.
///     attempts: u32,
/// }
///
/// impl<B: Budget, Req: Clone, Res, E> Policy<Req, Res, E> for Budgeted<B> {
///     type Future = Ready<()>;
///
///     fn retry(&mut self, _: &mut Req, result: &mut Result<Res, E>) -> Option<Ready<()>> {
///         self.attempts += 1;
///         if self.attempts == 1 {
///             self.budget.deposit(); // one logical request
///         }
///         if result.is_ok() || self.attempts == 3 || !self.budget.withdraw() {
///             return None;
///         }
///         Some(ready(()))
///     }
///
///     fn clone_request(&mut self, request: &Req) -> Option<Req> {
///         Some(request.clone())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // The destination is down: every attempt fails.
/// let sent = Arc::new(AtomicU32::new(0));
/// let down = {
///     let sent = Arc::clone(&sent);
///     service_fn(move |_: &'static str| {
///         sent.fetch_add(1, Ordering::Relaxed);
///         async { Err::<(), _>("unavailable") }
///     })
/// };
/// // 1 retry per 10 requests, plus 2 tokens of burst; clones share the balance.
/// let budget = RetryBudget::new(0.1, 2)?;
/// let client = Retry::new(Budgeted { budget: budget.clone(), attempts: 0 }, down);
/// for _ in 0..100 {
///     assert!(client.clone().oneshot("charge").await.is_err());
/// }
/// // 100 requests and the retries the budget paid for: the 2 burst tokens, then one per
/// // 10 deposits (the first request's deposit found the budget full, so 99 count).
/// let retries = sent.load(Ordering::Relaxed) - 100;
/// assert_eq!(retries, 2 + 9);
/// assert!(budget.available() < 1.0);
/// # Ok(())
/// # }
/// ```
impl tower::retry::budget::Budget for RetryBudget {
    fn deposit(&self) {
        RetryBudget::deposit(self);
    }

    fn withdraw(&self) -> bool {
        self.try_withdraw()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::testing::Recorded;
    use metrics_util::debugging::DebuggingRecorder;
    use proptest::prelude::*;

    #[test]
    fn the_published_gauge_follows_the_balance() {
        let recorder = DebuggingRecorder::new();
        let tokens = || {
            Recorded::of(&recorder).gauge(
                observe::RPC_CLIENT_RETRY_BUDGET_TOKENS,
                &[(label::SERVICE, "psp")],
            )
        };
        let budget = RetryBudget::new(0.5, 2).unwrap();
        metrics::with_local_recorder(&recorder, || budget.publish_as("psp"));
        assert_eq!(tokens(), 2.0, "full at first");
        assert!(budget.try_withdraw());
        assert_eq!(tokens(), 1.0);
        budget.deposit();
        assert_eq!(tokens(), 1.5);
        assert!(budget.try_withdraw());
        assert!(!budget.try_withdraw(), "half a token is not a retry");
        assert_eq!(tokens(), 0.5);
        for _ in 0..4 {
            budget.deposit();
        }
        assert_eq!(tokens(), 2.0, "capped at the burst");
        // A second name changes nothing: the first call named the gauge.
        metrics::with_local_recorder(&recorder, || budget.publish_as("other"));
        assert_eq!(
            Recorded::of(&recorder).gauge(
                observe::RPC_CLIENT_RETRY_BUDGET_TOKENS,
                &[(label::SERVICE, "other")]
            ),
            0.0
        );
    }

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

    /// The same failing workload through tower's `Retry` with the budget behind tower's
    /// `Budget` trait, and through [`RetryPolicy::execute`](crate::retry::RetryPolicy::execute)
    /// with a budget of the same limits: the same attempts are sent and the same balance is
    /// left, so tower's `deposit` and `withdraw` account exactly as our retry path does.
    #[tokio::test(start_paused = true)]
    async fn tower_policy_spends_the_budget_as_our_retries_do() {
        use std::future::{Ready, ready};
        use std::sync::atomic::AtomicU32;
        use std::time::Duration;

        use tower::retry::budget::Budget;
        use tower::retry::{Policy, Retry};
        use tower::{ServiceExt, service_fn};

        use crate::deadline::Deadline;
        use crate::retry::{Backoff, Jitter, RetryPolicy};
        use crate::status::{Code, Status};

        const REQUESTS: u32 = 200;
        const ATTEMPTS: u32 = 3;

        /// Retries every failure while tower's `Budget` allows, up to `ATTEMPTS`.
        #[derive(Clone)]
        struct Budgeted<B> {
            budget: B,
            attempts: u32,
        }

        impl<B: Budget, Req: Clone, Res, E> Policy<Req, Res, E> for Budgeted<B> {
            type Future = Ready<()>;

            fn retry(&mut self, _: &mut Req, result: &mut Result<Res, E>) -> Option<Ready<()>> {
                self.attempts += 1;
                if self.attempts == 1 {
                    self.budget.deposit();
                }
                if result.is_ok() || self.attempts == ATTEMPTS || !self.budget.withdraw() {
                    return None;
                }
                Some(ready(()))
            }

            fn clone_request(&mut self, request: &Req) -> Option<Req> {
                Some(request.clone())
            }
        }

        fn down() -> Status {
            Status::new(Code::Unavailable, "destination down")
        }

        for (ratio, burst) in [(0.1, 2), (0.37, 1), (0.005, 3), (1.0, 0)] {
            let through_tower = RetryBudget::new(ratio, burst).unwrap();
            let sent = Arc::new(AtomicU32::new(0));
            let transport = {
                let sent = Arc::clone(&sent);
                service_fn(move |()| {
                    sent.fetch_add(1, Ordering::Relaxed);
                    ready(Err::<(), _>(down()))
                })
            };
            let budgeted = Budgeted {
                budget: through_tower.clone(),
                attempts: 0,
            };
            let client = Retry::new(budgeted, transport);
            for _ in 0..REQUESTS {
                client.clone().oneshot(()).await.unwrap_err();
            }
            let tower_sent = sent.load(Ordering::Relaxed);

            let ours = RetryBudget::new(ratio, burst).unwrap();
            let tick = Duration::from_millis(1);
            let policy = RetryPolicy::builder("psp", "Charge")
                .max_attempts(ATTEMPTS)
                .backoff(Backoff::new(tick, tick, Jitter::None, Duration::ZERO).unwrap())
                .spend(ours.clone())
                .build()
                .unwrap();
            let mut our_sent = 0;
            for _ in 0..REQUESTS {
                policy
                    .execute(Deadline::after(Duration::from_secs(10)), |_| {
                        our_sent += 1;
                        ready(Err::<(), _>(down()))
                    })
                    .await
                    .unwrap_err();
            }

            assert!(
                tower_sent > REQUESTS,
                "ratio {ratio} burst {burst}: no retry"
            );
            assert_eq!(tower_sent, our_sent, "ratio {ratio} burst {burst}");
            assert_eq!(
                through_tower.available(),
                ours.available(),
                "ratio {ratio} burst {burst}"
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
