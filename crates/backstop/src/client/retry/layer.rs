use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::{AttemptLimit, Retry};
use crate::client::classify::{Classifier, classify_head};
use crate::client::replay::DEFAULT_REPLAY_CAP;
use crate::deadline::Margin;
use crate::policy::{DEFAULT_TIMEOUT, Idempotency};
use crate::retry::RetryPolicy;

/// Applies [`Retry`] with one method's policy.
#[derive(Debug, Clone)]
pub struct RetryLayer {
    policy: RetryPolicy,
    idempotency: Idempotency,
    replay_cap: usize,
    classifier: Classifier,
    peer: Option<Arc<str>>,
    attempt_limit: Option<(AttemptLimit, Arc<Margin>)>,
    timeout: Duration,
}

impl RetryLayer {
    /// Retries calls of a method of class `idempotency` by `policy` (whose budget is the
    /// destination's), buffering bodies up to [`DEFAULT_REPLAY_CAP`]; a call that arrives
    /// without a deadline gets [`DEFAULT_TIMEOUT`] (see [`timeout`](Self::timeout)).
    pub fn new(policy: RetryPolicy, idempotency: Idempotency) -> Self {
        Self {
            policy,
            idempotency,
            replay_cap: DEFAULT_REPLAY_CAP,
            classifier: classify_head,
            peer: None,
            attempt_limit: None,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The deadline, from now, of a call that arrives without one: the method's timeout
    /// (see [`Retry::timeout`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The largest body kept for replay; larger bodies are sent once.
    pub fn replay_cap(mut self, bytes: usize) -> Self {
        self.replay_cap = bytes;
        self
    }

    /// How answers are read (default [`classify_head`]).
    pub fn classifier(mut self, classifier: Classifier) -> Self {
        self.classifier = classifier;
        self
    }

    /// The destination's address or name, for the `peer` log field.
    pub fn peer(mut self, peer: impl Into<Arc<str>>) -> Self {
        self.peer = Some(peer.into());
        self
    }

    /// Abandons and retries an attempt left unanswered past `limit`, measured against the
    /// round trips of `margin` (see [`Retry::attempt_limit`]).
    pub fn attempt_limit(mut self, limit: AttemptLimit, margin: Arc<Margin>) -> Self {
        self.attempt_limit = Some((limit, margin));
        self
    }
}

impl<S: Clone> Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let retry = Retry::new(
            inner,
            self.policy.clone(),
            self.idempotency,
            self.replay_cap,
            self.classifier,
            self.peer.clone(),
        )
        .timeout(self.timeout);
        match &self.attempt_limit {
            Some((limit, margin)) => retry.attempt_limit(*limit, margin.clone()),
            None => retry,
        }
    }
}
