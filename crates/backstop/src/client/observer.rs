//! [`AttemptObserver`]: what the client stack did with each call, told as it happens.
//!
//! The stack already decides everything a caller may want to record about a call: which
//! attempt a send was, whether it was a retry, a hedge or a transparent re-send, how its answer
//! was classified, and why the attempts stopped. An observer set with
//! [`ClientStackBuilder::observer`](super::ClientStackBuilder::observer) is handed those
//! decisions, from the same places that count them in the client metrics and log them as
//! `rpc_attempt` events, so a load generator, a test harness or an audit trail never has to
//! guess them again from headers and markers.
//!
//! - [`AttemptObserver::on_attempt`], once per physical send: the first attempt, each retry,
//!   each hedge and each transparent re-send, when it ends (answered, failed, cut off at the
//!   deadline, or dropped because the other attempt of a hedge race answered first). An
//!   attempt the stack refused to send (an open circuit, too little time left for the margin,
//!   adaptive throttling) is not a send: the call's end says why it stopped.
//! - [`AttemptObserver::on_call_end`], once per logical call, when the stack returns its
//!   result: the outcome, how many attempts it made, and why they stopped when it did not
//!   succeed.
//!
//! Both are called on the task that polls the call, while it is being polled: keep them short
//! and never block (hand the event to a channel or a lock-free counter for anything slow).
//! Every event carries the call's request [`Extensions`], so an observer shared by all calls
//! can find what its caller put there to tell the calls apart.
//!
//! The stack holds the observer as an `Arc<dyn AttemptObserver>`: one type of stack whatever
//! observes it (the stack's service type does not grow a parameter), and a call reaches the
//! observer through one pointer it already holds. Without an observer nothing is built or
//! called for it.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use backstop::client::observer::{AttemptEvent, AttemptKind, AttemptObserver};
//! use backstop::client::{ClientStack, Destination};
//! use backstop::policy::{Idempotency, MethodPolicy};
//!
//! /// Counts the retries that were sent.
//! #[derive(Debug, Default)]
//! struct Retries(AtomicU32);
//!
//! impl AttemptObserver for Retries {
//!     fn on_attempt(&self, attempt: &AttemptEvent<'_>) {
//!         if attempt.kind == AttemptKind::Retry {
//!             self.0.fetch_add(1, Ordering::Relaxed);
//!         }
//!     }
//! }
//!
//! let retries = Arc::new(Retries::default());
//! let get = MethodPolicy::builder("GetCharge", Idempotency::Safe).build();
//! let stack = ClientStack::builder(&Destination::new("psp"), get)
//!     .observer(retries.clone())
//!     .build()
//!     .unwrap();
//! # let _ = stack;
//! ```

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Extensions;
use tokio::time::Instant;

use super::circuit_open::CircuitOpen;
use crate::deadline::DeadlineExceeded;
use crate::retry::StopReason;
use crate::status::{Code, Outcome};

/// Told by the [client stack](super::ClientStack) what became of each send and each call (see
/// the [module docs](self)). Both methods do nothing unless overridden.
pub trait AttemptObserver: Send + Sync + 'static {
    /// One physical send ended.
    fn on_attempt(&self, attempt: &AttemptEvent<'_>) {
        let _ = attempt;
    }

    /// A logical call ended: the stack is returning its result.
    fn on_call_end(&self, end: &CallEnd<'_>) {
        let _ = end;
    }
}

/// What a send was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AttemptKind {
    /// The first attempt of the call.
    First,
    /// An attempt after a failed one, sent after the backoff or the server's pushback.
    Retry,
    /// A copy of a slow attempt, sent while it was still running.
    Hedge,
    /// The same attempt again, at once: the send before it provably never reached the server.
    Transparent,
}

impl AttemptKind {
    /// `first`, `retry`, `hedge` or `transparent`.
    pub const fn as_str(self) -> &'static str {
        match self {
            AttemptKind::First => "first",
            AttemptKind::Retry => "retry",
            AttemptKind::Hedge => "hedge",
            AttemptKind::Transparent => "transparent",
        }
    }
}

impl fmt::Display for AttemptKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One physical send, as it ended: [`AttemptObserver::on_attempt`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct AttemptEvent<'a> {
    /// The destination's name (the `service` metric label).
    pub destination: &'a str,
    /// The method policy's name (the `method` metric label).
    pub method: &'a str,
    /// 1 for the first attempt, 2 for the first retry, ... A hedge is numbered one above the
    /// attempt it copies (the count its `grpc-previous-rpc-attempts` announces, as gRPC numbers
    /// hedges); a transparent re-send has the number of the attempt it sends again.
    pub number: u32,
    /// What the send was.
    pub kind: AttemptKind,
    /// How it ended, as the retry layer classifies answers: [`Outcome::Timeout`] when the
    /// call's deadline cut it off, [`Outcome::Cancelled`] when it was dropped unanswered because
    /// the other attempt of a hedge race answered first.
    pub outcome: Outcome,
    /// The status code of its answer or failure ([`Code::Ok`] on success); `None` when it was
    /// dropped unanswered.
    pub code: Option<Code>,
    /// When it was sent.
    pub started: Instant,
    /// How long it ran.
    pub duration: Duration,
    /// What was left of the call's deadline when it was sent.
    pub deadline_remaining: Duration,
    /// The call's idempotency key, if it has one.
    pub idempotency_key: Option<&'a str>,
    /// The call's request extensions.
    pub extensions: &'a Extensions,
}

/// How a logical call ended: [`AttemptObserver::on_call_end`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct CallEnd<'a> {
    /// The destination's name (the `service` metric label).
    pub destination: &'a str,
    /// The method policy's name (the `method` metric label).
    pub method: &'a str,
    /// [`Outcome::Ok`], or the outcome of the failure the call ended on.
    pub outcome: Outcome,
    /// The attempts the retry layer made, the first included (a hedge and a transparent re-send
    /// are part of the attempt they copy; an attempt refused before it was sent counts).
    pub attempts: u32,
    /// Why no further attempt was made, when the call did not succeed; `None` on success, or
    /// when it failed before any attempt could be made (its body could not be read).
    pub stop_reason: Option<StopReason>,
    /// The call's idempotency key, if it has one.
    pub idempotency_key: Option<&'a str>,
    /// The call's request extensions.
    pub extensions: &'a Extensions,
}

/// Whether an attempt's `error` says it was refused before it was sent: by an open circuit, or
/// for lack of time to send it within the deadline's margin. Such an attempt is no send.
pub(crate) fn refused_locally(error: &(dyn StdError + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if e.is::<CircuitOpen>() || e.is::<DeadlineExceeded>() {
            return true;
        }
        cause = e.source();
    }
    false
}

/// The stack's observer, as its layers hold it.
#[derive(Clone)]
pub(crate) struct Observer(pub(crate) Arc<dyn AttemptObserver>);

impl fmt::Debug for Observer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AttemptObserver")
    }
}
