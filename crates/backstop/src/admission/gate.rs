//! A concurrency gate whose wait is bounded by the caller's deadline.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::deadline::Deadline;
use crate::status::Status;

/// Retry-After hint given with [`Overloaded`] unless configured otherwise.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Bounded concurrency with a bounded wait.
///
/// At most `limit` requests hold a [`GatePermit`] at once. A request that finds the gate full
/// waits for a permit at most `deadline.remaining() - min_service`: beyond that it could not be
/// served in time anyway, so it is refused with [`Overloaded`] instead of occupying a queue
/// slot. When that wait is zero or negative it is refused at once. A free permit is always
/// granted: the deadline itself is the deadline layer's business, the gate only bounds waiting.
/// Waiters are served first come, first served. Cloning shares the gate.
///
/// ```
/// use std::time::Duration;
/// use backstop::admission::Gate;
/// use backstop::deadline::Deadline;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let gate = Gate::new(1, Duration::from_millis(20));
/// let deadline = Deadline::after(Duration::from_millis(100));
///
/// let permit = gate.enter(&deadline).await.unwrap();
/// assert_eq!(gate.inflight(), 1);
///
/// // Full: a second request waits at most 100 - 20 = 80 ms, then is refused.
/// let refused = gate.enter(&deadline).await.unwrap_err();
/// assert_eq!(refused.retry_after, Duration::from_secs(1));
///
/// drop(permit);
/// assert_eq!(gate.inflight(), 0);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Gate {
    inner: Arc<Inner>,
}

#[derive(Debug, Clone)]
struct Inner {
    semaphore: Arc<Semaphore>,
    limit: usize,
    min_service: Duration,
    retry_after: Duration,
}

/// Proof of admission through a [`Gate`]; the slot is released when this is dropped.
#[derive(Debug)]
#[must_use = "the gate slot is released as soon as the permit is dropped"]
pub struct GatePermit {
    _permit: OwnedSemaphorePermit,
}

/// The gate is full and no slot freed up within the budget the request could spend waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("over capacity; retry after {retry_after:?}")]
pub struct Overloaded {
    /// How long the caller should wait before trying again.
    pub retry_after: Duration,
}

impl From<Overloaded> for Status {
    fn from(o: Overloaded) -> Self {
        Status::overloaded(o.retry_after)
    }
}

impl Gate {
    /// A gate admitting `limit` requests at once (raised to 1 if zero, capped at tokio's
    /// semaphore maximum), where serving a request takes at least `min_service`.
    pub fn new(limit: usize, min_service: Duration) -> Self {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            inner: Arc::new(Inner {
                semaphore: Arc::new(Semaphore::new(limit)),
                limit,
                min_service,
                retry_after: DEFAULT_RETRY_AFTER,
            }),
        }
    }

    /// Sets the Retry-After hint carried by [`Overloaded`] (default one second).
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        Arc::make_mut(&mut self.inner).retry_after = retry_after;
        self
    }

    /// Enters the gate, waiting at most `deadline.remaining() - min_service` for a slot.
    pub async fn enter(&self, deadline: &Deadline) -> Result<GatePermit, Overloaded> {
        if let Ok(permit) = self.try_enter() {
            return Ok(permit);
        }
        let max_wait = deadline
            .remaining()
            .checked_sub(self.inner.min_service)
            .filter(|w| !w.is_zero())
            .ok_or_else(|| self.overloaded())?;
        let acquire = Arc::clone(&self.inner.semaphore).acquire_owned();
        match tokio::time::timeout(max_wait, acquire).await {
            Ok(Ok(permit)) => Ok(GatePermit { _permit: permit }),
            // Timed out, or the semaphore was closed (never done here).
            Ok(Err(_)) | Err(_) => Err(self.overloaded()),
        }
    }

    /// Enters the gate only if a slot is free now.
    pub fn try_enter(&self) -> Result<GatePermit, Overloaded> {
        Arc::clone(&self.inner.semaphore)
            .try_acquire_owned()
            .map(|permit| GatePermit { _permit: permit })
            .map_err(|_| self.overloaded())
    }

    /// Requests holding a permit now.
    pub fn inflight(&self) -> usize {
        self.inner.limit - self.inner.semaphore.available_permits()
    }

    /// Most requests admitted at once.
    pub fn limit(&self) -> usize {
        self.inner.limit
    }

    /// Least time serving a request takes; waiting may not eat into it.
    pub fn min_service(&self) -> Duration {
        self.inner.min_service
    }

    fn overloaded(&self) -> Overloaded {
        Overloaded {
            retry_after: self.inner.retry_after,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{Code, Outcome};
    use tokio::time::Instant;

    const MS: Duration = Duration::from_millis(1);

    #[tokio::test(start_paused = true)]
    async fn waits_at_most_remaining_minus_min_service() {
        let gate = Gate::new(2, 30 * MS);
        let d = Deadline::after(100 * MS);
        let _a = gate.enter(&d).await.unwrap();
        let _b = gate.enter(&d).await.unwrap();
        assert_eq!(gate.inflight(), 2);
        let start = Instant::now();
        let err = gate.enter(&d).await.unwrap_err();
        assert_eq!(start.elapsed(), 70 * MS);
        assert_eq!(err.retry_after, Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn rejects_at_once_when_no_budget_for_waiting() {
        let gate = Gate::new(1, 50 * MS).with_retry_after(3 * MS);
        let _held = gate
            .enter(&Deadline::after(Duration::from_secs(1)))
            .await
            .unwrap();
        for budget in [Duration::ZERO, 30 * MS, 50 * MS] {
            let start = Instant::now();
            let err = gate.enter(&Deadline::after(budget)).await.unwrap_err();
            assert_eq!(start.elapsed(), Duration::ZERO, "{budget:?}");
            assert_eq!(
                err,
                Overloaded {
                    retry_after: 3 * MS
                }
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_freed_slot_goes_to_the_waiter() {
        let gate = Gate::new(1, 10 * MS);
        let held = gate
            .enter(&Deadline::after(Duration::from_secs(1)))
            .await
            .unwrap();
        let releaser = tokio::spawn(async move {
            tokio::time::sleep(40 * MS).await;
            drop(held);
        });
        let start = Instant::now();
        let permit = gate.enter(&Deadline::after(100 * MS)).await.unwrap();
        assert_eq!(start.elapsed(), 40 * MS);
        assert_eq!(gate.inflight(), 1);
        drop(permit);
        assert_eq!(gate.inflight(), 0);
        releaser.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn free_slot_is_granted_even_with_little_budget() {
        let gate = Gate::new(1, 50 * MS);
        let permit = gate.enter(&Deadline::after(MS)).await;
        assert!(permit.is_ok());
        assert!(gate.try_enter().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_a_waiting_enter_takes_no_slot() {
        let gate = Gate::new(1, MS);
        let held = gate.try_enter().unwrap();
        let waiting = tokio::time::timeout(5 * MS, gate.enter(&Deadline::after(MS * 100))).await;
        assert!(waiting.is_err());
        drop(held);
        assert_eq!(gate.inflight(), 0);
        assert!(gate.try_enter().is_ok());
    }

    #[test]
    fn limits_and_status() {
        assert_eq!(Gate::new(0, MS).limit(), 1);
        assert_eq!(Gate::new(7, MS).min_service(), MS);
        let s: Status = Overloaded {
            retry_after: 2 * MS,
        }
        .into();
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(s.outcome(), Outcome::Rejected);
        assert_eq!(s.pushback(), Some(2 * MS));
    }
}
