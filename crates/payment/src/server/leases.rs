//! [`OpenLeases`]: the idempotency store, counting the keys it handed out and not yet settled,
//! so that shutdown can wait for the keys of requests cut at the drain bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use backstop::idempotency::{
    Claim, ClaimRequest, Ending, IdempotencyKey, Lease, Record, RecoveryPoint, Store, StoreError,
    StoredResponse,
};
use tokio::sync::Notify;

use crate::intents::PaymentWrites;
use crate::service::{PaymentBackend, PaymentStore};

/// A [`Store`] that counts leases between a successful claim and their `complete`, `fail` or
/// `release` (ended or dropped).
#[derive(Debug, Clone)]
pub(crate) struct OpenLeases<St = PaymentStore> {
    inner: St,
    count: Arc<Count>,
}

#[derive(Debug, Default)]
struct Count {
    open: AtomicUsize,
    settled: Notify,
}

/// Settles one lease when the settling call ends, or is dropped.
struct Settling<'a>(&'a Count);

impl Drop for Settling<'_> {
    fn drop(&mut self) {
        let before = self
            .0
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(1))
            })
            .unwrap_or_default();
        if before <= 1 {
            self.0.settled.notify_waiters();
        }
    }
}

impl<St> OpenLeases<St> {
    pub(crate) fn new(inner: St) -> Self {
        OpenLeases {
            inner,
            count: Arc::default(),
        }
    }

    /// Leases claimed and not yet settled.
    pub(crate) fn open(&self) -> usize {
        self.count.open.load(Ordering::Acquire)
    }

    /// Resolves when no lease is open.
    pub(crate) async fn settled(&self) {
        loop {
            let settled = self.count.settled.notified();
            let mut settled = std::pin::pin!(settled);
            settled.as_mut().enable();
            if self.open() == 0 {
                return;
            }
            settled.await;
        }
    }
}

impl<St: Store> OpenLeases<St> {
    fn count_claim(&self, claim: &Claim) {
        if matches!(claim, Claim::Claimed(_)) {
            self.count.open.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl<St: Store> Store for OpenLeases<St> {
    type Writes<T: Send + 'static> = St::Writes<T>;

    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let claim = self.inner.claim(req).await?;
        self.count_claim(&claim);
        Ok(claim)
    }

    async fn claim_deferred(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let claim = self.inner.claim_deferred(req).await?;
        self.count_claim(&claim);
        Ok(claim)
    }

    async fn commit_phase<T: Send + 'static>(
        &self,
        lease: &Lease,
        point: RecoveryPoint,
        writes: St::Writes<T>,
    ) -> Result<T, StoreError> {
        self.inner.commit_phase(lease, point, writes).await
    }

    async fn finish(
        &self,
        lease: &Lease,
        ending: Ending,
        now_ms: i64,
        writes: St::Writes<()>,
    ) -> Result<(), StoreError> {
        let _settling = Settling(&self.count);
        self.inner.finish(lease, ending, now_ms, writes).await
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: StoredResponse,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let _settling = Settling(&self.count);
        self.inner.complete(lease, response, now_ms).await
    }

    async fn fail(&self, lease: &Lease, now_ms: i64) -> Result<(), StoreError> {
        let _settling = Settling(&self.count);
        self.inner.fail(lease, now_ms).await
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let _settling = Settling(&self.count);
        self.inner.release(lease).await
    }

    async fn get(&self, scope: &str, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(scope, key).await
    }

    async fn sweep(&self, now_ms: i64, limit: usize) -> Result<usize, StoreError> {
        self.inner.sweep(now_ms, limit).await
    }

    async fn expire(&self, now_ms: i64, limit: usize) -> Result<usize, StoreError> {
        self.inner.expire(now_ms, limit).await
    }
}

impl<St: PaymentBackend> PaymentBackend for OpenLeases<St> {
    fn writes<T: Send + 'static>(writes: PaymentWrites<T>) -> St::Writes<T> {
        St::writes(writes)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use backstop::idempotency::{Fingerprint, MemoryStore};

    use super::*;

    fn request(key: &str) -> ClaimRequest {
        ClaimRequest {
            scope: "m".into(),
            key: IdempotencyKey::parse(key).unwrap(),
            fingerprint: Fingerprint::of_bytes("POST", b"{}"),
            lease: Duration::from_secs(5),
            ttl: Duration::from_secs(60),
            now_ms: 1,
        }
    }

    #[tokio::test]
    async fn settled_waits_for_every_claimed_lease() {
        let store = OpenLeases::new(MemoryStore::new());
        let Claim::Claimed(a) = store.claim(request("a")).await.unwrap() else {
            panic!("claimed");
        };
        let Claim::Claimed(b) = store.claim(request("b")).await.unwrap() else {
            panic!("claimed");
        };
        // A replay or a conflict holds nothing.
        assert!(!matches!(
            store.claim(request("a")).await.unwrap(),
            Claim::Claimed(_)
        ));
        assert_eq!(store.open(), 2);
        store.fail(&a, 2).await.unwrap();
        let mut settled = std::pin::pin!(store.settled());
        assert!(futures_util::poll!(settled.as_mut()).is_pending());
        store.release(&b).await.unwrap();
        settled.await;
        assert_eq!(store.open(), 0);
    }
}
