//! [`Reach`]: whether a call's request may have reached the server, read from its attempts.

use std::error::Error as StdError;
use std::io;

use super::observer::refusal;

/// Whether a call that failed may have reached the server: what its caller may assume about
/// the call's effect. Read it with [`Error::reach`](super::Error::reach) (and, for a call that
/// ended on an answer, from its [`RetryStopped`](super::retry::RetryStopped)).
///
/// A status says what the server answered, not whether it ran anything: a call that timed out
/// may have been charged, one refused at connect cannot have been. The difference decides what
/// is safe next. A payment that may have been sent must be reconciled (queried, or retried
/// with the same idempotency key) and never charged again blindly; one that was never sent
/// may be sent again, whatever the method; one the server answered is what the answer says.
///
/// The stack records it per call, from every attempt it made: retries, hedges and transparent
/// re-sends. The call's reach is the least that is known of any of them, in this order:
/// one attempt whose outcome is unknown makes the call's unknown, even if a later attempt was
/// refused at connect or answered `503`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reach {
    /// No attempt can have reached the server: each was refused before it left (an open
    /// circuit, too little of the deadline left, the retry budget or a throttle), could not
    /// connect, or was refused by the server unread (an HTTP/2 `REFUSED_STREAM`). Nothing ran.
    NotSent,
    /// Every attempt that may have reached the server was answered: its answers say what
    /// happened (for most services, an error answer means nothing ran).
    Answered,
    /// An attempt may have reached the server and no answer to it came back: the connection
    /// broke after the request was written, the attempt was cut off at the deadline or
    /// abandoned, a hedge was dropped unanswered. Its effect may or may not have happened.
    Unknown,
}

impl Reach {
    /// The reach of an attempt that failed with `error`, from the error's types alone (never
    /// its message): [`NotSent`](Reach::NotSent) only when the error proves it, else
    /// [`Unknown`](Reach::Unknown).
    pub(crate) fn of_error(error: &(dyn StdError + 'static)) -> Self {
        let proven = refusal(error).is_some()
            || matches!(unsent(error), Some(Unsent::Connect | Unsent::RefusedStream));
        if proven {
            Reach::NotSent
        } else {
            Reach::Unknown
        }
    }

    /// The reach of an attempt that ended with `result`: an answer, or an error
    /// ([`of_error`](Self::of_error)).
    pub(crate) fn of_result<T>(result: &Result<T, tower::BoxError>) -> Self {
        match result {
            Ok(_) => Reach::Answered,
            Err(e) => Self::of_error(&**e),
        }
    }

    /// Stored in an atomic byte (see [`Self::from_u8`]).
    pub(crate) fn as_u8(self) -> u8 {
        self as u8
    }

    /// The reach stored as [`Self::as_u8`].
    pub(crate) fn from_u8(value: u8) -> Self {
        match value {
            0 => Reach::NotSent,
            1 => Reach::Answered,
            _ => Reach::Unknown,
        }
    }
}

/// What a transport error proves about a request that failed with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unsent {
    /// No connection could be made (refused, or any connect error of the hyper-util client).
    Connect,
    /// The HTTP/2 stream was refused (`RST_STREAM` with `REFUSED_STREAM`, RFC 9113 section
    /// 8.7): the server processed nothing of it.
    RefusedStream,
    /// The server sent `GOAWAY`, which h2 reports for the streams above its `last_stream_id`,
    /// but, on a multi-threaded runtime, also for a stream already handed to the connection
    /// when the `GOAWAY` arrives (see [`transparent`](super::transparent)): not a proof.
    GoAway,
}

/// What `error` proves about where its request went, if anything. Walks the `source()` chain,
/// matching types, never messages.
pub(crate) fn unsent(error: &(dyn StdError + 'static)) -> Option<Unsent> {
    let mut cause: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<io::Error>() {
            if io.kind() == io::ErrorKind::ConnectionRefused {
                return Some(Unsent::Connect);
            }
            // An io::Error's source() skips the error it wraps; look at that one too.
            if let Some(found) = io.get_ref().and_then(|inner| unsent(inner)) {
                return Some(found);
            }
        }
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            if h2.reason() == Some(h2::Reason::REFUSED_STREAM) {
                return Some(Unsent::RefusedStream);
            }
            if h2.is_go_away() && h2.is_remote() {
                return Some(Unsent::GoAway);
            }
        }
        if e.downcast_ref::<hyper_util::client::legacy::Error>()
            .is_some_and(hyper_util::client::legacy::Error::is_connect)
        {
            return Some(Unsent::Connect);
        }
        cause = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::breaker::CircuitOpen;
    use crate::deadline::DeadlineExceeded;

    #[test]
    fn only_what_proves_it_is_not_sent() {
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(Reach::of_error(&refused), Reach::NotSent);
        assert_eq!(Reach::of_error(&io::Error::other(refused)), Reach::NotSent);
        let open = CircuitOpen {
            retry_in: std::time::Duration::from_secs(1),
        };
        assert_eq!(Reach::of_error(&open), Reach::NotSent);
        assert_eq!(Reach::of_error(&DeadlineExceeded::PASSED), Reach::NotSent);
        let stream = h2::Error::from(h2::Reason::REFUSED_STREAM);
        assert_eq!(Reach::of_error(&stream), Reach::NotSent);
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        assert_eq!(Reach::of_error(&reset), Reach::Unknown);
        assert_eq!(
            Reach::of_error(&h2::Error::from(h2::Reason::CANCEL)),
            Reach::Unknown
        );
    }

    #[test]
    fn an_unknown_attempt_makes_the_call_unknown() {
        assert_eq!(Reach::NotSent.max(Reach::Answered), Reach::Answered);
        assert_eq!(Reach::Answered.max(Reach::Unknown), Reach::Unknown);
        assert_eq!(Reach::Unknown.max(Reach::NotSent), Reach::Unknown);
        for reach in [Reach::NotSent, Reach::Answered, Reach::Unknown] {
            assert_eq!(Reach::from_u8(reach.as_u8()), reach);
        }
    }
}
