//! Wakes the requests of this instance that wait for a key in progress as soon as its attempt
//! settles (completed, failed or released), instead of at their next look at the store.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use tokio::sync::Notify;

use crate::idempotency::IdempotencyKey;

/// Past this many watched keys, watching prunes the keys nobody waits for any more (those whose
/// attempt runs on another instance are never settled here).
const PRUNE_ABOVE: usize = 64;

/// The keys requests wait on, each with the [`Notify`] its waiters share.
#[derive(Debug, Default)]
pub(super) struct Settled {
    watched: Mutex<HashMap<(String, IdempotencyKey), Weak<Notify>>>,
}

impl Settled {
    /// The notification of `key` in `scope` settling; keep it while waiting.
    pub(super) fn watch(&self, scope: &str, key: &IdempotencyKey) -> Arc<Notify> {
        let mut watched = self.watched.lock().unwrap_or_else(PoisonError::into_inner);
        if watched.len() > PRUNE_ABOVE {
            watched.retain(|_, notify| notify.strong_count() > 0);
        }
        let entry = watched.entry((scope.to_owned(), key.clone())).or_default();
        if let Some(notify) = entry.upgrade() {
            return notify;
        }
        let notify = Arc::new(Notify::new());
        *entry = Arc::downgrade(&notify);
        notify
    }

    /// `key` in `scope` settled here: wake its waiters.
    pub(super) fn settle(&self, scope: &str, key: &IdempotencyKey) {
        let mut watched = self.watched.lock().unwrap_or_else(PoisonError::into_inner);
        // Nearly always empty: nobody waits, nothing to look up.
        if watched.is_empty() {
            return;
        }
        if let Some(notify) = watched
            .remove(&(scope.to_owned(), key.clone()))
            .and_then(|notify| notify.upgrade())
        {
            notify.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn settling_wakes_every_waiter_of_the_key_only() {
        let settled = Settled::default();
        let key = IdempotencyKey::new("k").unwrap();
        let other = IdempotencyKey::new("other").unwrap();
        let (a, b) = (settled.watch("s", &key), settled.watch("s", &key));
        assert!(Arc::ptr_eq(&a, &b), "one notification per key");
        let elsewhere = settled.watch("s", &other);
        let (woken_a, woken_b, not_woken) = (a.notified(), b.notified(), elsewhere.notified());
        tokio::pin!(woken_a, woken_b, not_woken);
        for n in [woken_a.as_mut(), woken_b.as_mut(), not_woken.as_mut()] {
            n.enable();
        }
        settled.settle("s", &key);
        woken_a.await;
        woken_b.await;
        assert!(futures_util::poll!(not_woken).is_pending());
    }

    #[test]
    fn keys_nobody_waits_for_are_pruned() {
        let settled = Settled::default();
        for i in 0..=PRUNE_ABOVE * 2 {
            let key = IdempotencyKey::new(format!("k{i}")).unwrap();
            drop(settled.watch("s", &key));
        }
        let watched = settled.watched.lock().unwrap().len();
        assert!(watched <= PRUNE_ABOVE + 1, "{watched}");
    }
}
