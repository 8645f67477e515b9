//! [`Config`]: how one method's calls are retried.
//!
//! Apart from the layer so that the client stack's per-method settings can hold one without
//! depending on the layer that reads them.

use std::sync::Arc;
use std::time::Duration;

use super::attempt_limit::{AttemptLimit, Limiter};
use crate::client::classify::Classifier;
use crate::client::observer::Observer;
use crate::deadline::Margin;
use crate::policy::Idempotency;
use crate::retry::RetryPolicy;

/// How one method's calls are retried; shared by the calls (and, under a
/// [`ClientStack`](super::ClientStack), chosen per call by its method).
#[derive(Debug)]
pub(crate) struct Config {
    pub(super) policy: RetryPolicy,
    pub(super) single: RetryPolicy,
    pub(super) idempotency: Idempotency,
    pub(super) replay_cap: usize,
    pub(super) peer: Option<Arc<str>>,
    pub(super) classifier: Classifier,
    pub(super) hedged: bool,
    pub(super) limiter: Option<Limiter>,
    /// The deadline of a call that arrives without one.
    pub(super) timeout: Duration,
    /// Told of each send and of each call's end, if set.
    pub(super) observer: Option<Observer>,
}

impl Config {
    /// A method's retry configuration: attempts by `policy`, eligibility by `idempotency`,
    /// bodies kept for replay up to `replay_cap`, answers read by `classifier`, `peer` in
    /// the logs, a [`HedgeAllowance`] per call when `hedged`, abandoned attempts by `limit`,
    /// and `timeout` for a call without a deadline.
    #[allow(clippy::too_many_arguments)] // One constructor for the stack and the layer.
    pub(crate) fn new(
        policy: RetryPolicy,
        idempotency: Idempotency,
        replay_cap: usize,
        classifier: Classifier,
        peer: Option<Arc<str>>,
        hedged: bool,
        limit: Option<(AttemptLimit, Arc<Margin>)>,
        timeout: Duration,
    ) -> Self {
        Self {
            single: policy.single_attempt(),
            policy,
            idempotency,
            replay_cap,
            peer,
            classifier,
            hedged,
            limiter: limit.map(|(limit, margin)| Limiter { limit, margin }),
            timeout,
            observer: None,
        }
    }

    /// Tells `observer` of each send and of each call's end.
    pub(crate) fn observer(mut self, observer: Option<Observer>) -> Self {
        self.observer = observer;
        self
    }

    /// The retry policy the calls run by.
    pub(crate) fn policy(&self) -> &RetryPolicy {
        &self.policy
    }
}
