//! Deadlines: one absolute end time per logical request, shrinking hop by hop.
//!
//! A timeout says "how long I am willing to wait"; a deadline says "when this request must be
//! done". Over several hops only the deadline stays correct: a gateway that forwards with a fresh
//! timeout resets the caller's clock, and the server goes on committing effects long after the
//! caller gave up. So a request carries its *remaining* time on the wire (`grpc-timeout`, a
//! relative value immune to clock skew between hosts), and the receiver turns it back into an
//! absolute [`Deadline`] on its own monotonic clock the moment the request arrives.
//!
//! Every retry shares that one deadline, and every outbound call gets a [`Deadline::child`] that
//! leaves a [`Margin`] for the reply to travel back. When nothing would be left, `child` fails at
//! once: a call that cannot finish in time must not be started.
//!
//! # Where it lives
//!
//! This module is the primitive. The client sets one deadline per call and stamps each attempt
//! with what is left ([`client::deadline`](crate::client::deadline): `SetDeadline`,
//! `AttemptTimeout`); the server reads it the moment a request arrives and answers 504 at the
//! deadline ([`server::deadline`](crate::server::deadline)). A method's default timeout is its
//! [`MethodPolicy::timeout`](crate::policy::MethodPolicy::timeout).
//!
//! Time is `tokio::time::Instant`, so tests pause it instead of sleeping.
//!
//! ```
//! use std::time::Duration;
//! use backstop::deadline::{Deadline, decode_grpc_timeout, encode_grpc_timeout};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let deadline = Deadline::from_grpc_timeout("250m").unwrap();
//! assert_eq!(deadline.remaining(), Duration::from_millis(250));
//!
//! // Forward to the next hop with 20 ms kept for the way back.
//! let child = deadline.child(Duration::from_millis(20)).unwrap();
//! assert_eq!(encode_grpc_timeout(child.remaining()), "230000u");
//! assert_eq!(decode_grpc_timeout("230000u").unwrap(), Duration::from_millis(230));
//!
//! // Nothing left after the margin: fail fast instead of calling.
//! assert!(deadline.child(Duration::from_secs(1)).is_err());
//! # }
//! ```

pub mod server_timing;

use crate::sample_window::SampleWindow;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

/// Header (HTTP) and metadata key (gRPC) carrying the time left.
pub const GRPC_TIMEOUT: &str = "grpc-timeout";

/// [`GRPC_TIMEOUT`] as a header name, so setting or reading it allocates nothing.
pub static GRPC_TIMEOUT_HEADER: http::HeaderName = http::HeaderName::from_static(GRPC_TIMEOUT);

/// Largest value a `grpc-timeout` may carry: eight decimal digits.
const MAX_TIMEOUT_VALUE: u64 = 99_999_999;

/// Units of `grpc-timeout`, finest first, with their length in nanoseconds.
const UNITS: [(u8, u64); 6] = [
    (b'n', 1),
    (b'u', 1_000),
    (b'm', 1_000_000),
    (b'S', 1_000_000_000),
    (b'M', 60 * 1_000_000_000),
    (b'H', 3_600 * 1_000_000_000),
];

/// How far in the future a deadline lies when its timeout overflows the clock (about 30 years).
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

tokio::task_local! {
    /// The deadline of the request the current task works for (see [`Deadline::scope`]).
    static CURRENT: Deadline;
}

/// An absolute point on the monotonic clock by which a request must be finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline {
    end: Instant,
}

/// A child deadline could not be made: the margin takes all the time that is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("deadline exceeded: {remaining:?} left, {margin:?} needed for the margin")]
pub struct DeadlineExceeded {
    /// Budget left on the parent deadline when the child was asked for.
    pub remaining: Duration,
    /// Margin the child had to leave.
    pub margin: Duration,
}

impl DeadlineExceeded {
    /// The deadline itself passed while waiting: nothing left, no margin involved.
    pub const PASSED: DeadlineExceeded = DeadlineExceeded {
        remaining: Duration::ZERO,
        margin: Duration::ZERO,
    };
}

/// A `grpc-timeout` value that does not follow the wire format
/// (`1*8DIGIT unit`, value positive, unit one of `H M S m u n`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GrpcTimeoutError {
    /// The value is empty.
    #[error("grpc-timeout is empty")]
    Empty,
    /// The last character is not one of `H M S m u n`.
    #[error("grpc-timeout unit must be one of H, M, S, m, u, n")]
    UnknownUnit,
    /// A unit without digits before it.
    #[error("grpc-timeout has no digits")]
    MissingValue,
    /// Something other than ASCII digits before the unit (sign, space, dot, ...).
    #[error("grpc-timeout value must be ASCII digits")]
    InvalidDigit,
    /// More than eight digits.
    #[error("grpc-timeout value has more than 8 digits")]
    TooManyDigits,
    /// The value is zero; the wire format asks for a positive integer.
    #[error("grpc-timeout value must be positive")]
    Zero,
}

impl Deadline {
    /// A deadline `timeout` from now. A timeout too large for the clock is clamped to about 30
    /// years.
    pub fn after(timeout: Duration) -> Self {
        Self::after_at(Instant::now(), timeout)
    }

    /// [`after`](Self::after) as of `now`.
    pub fn after_at(now: Instant, timeout: Duration) -> Self {
        let end = now.checked_add(timeout).unwrap_or_else(|| now + FAR_FUTURE);
        Self { end }
    }

    /// A deadline at `end`.
    pub fn at(end: Instant) -> Self {
        Self { end }
    }

    /// Decodes a `grpc-timeout` value and starts the deadline now: call this as soon as a request
    /// arrives, so time spent queueing and decoding counts against it.
    pub fn from_grpc_timeout(value: &str) -> Result<Self, GrpcTimeoutError> {
        decode_grpc_timeout(value).map(Self::after)
    }

    /// The instant the deadline falls on.
    pub fn instant(&self) -> Instant {
        self.end
    }

    /// Budget left; zero once the deadline has passed.
    pub fn remaining(&self) -> Duration {
        self.remaining_at(Instant::now())
    }

    /// Budget left at `now`; zero if the deadline had passed by then. For a caller that reads
    /// the clock once for several uses (e.g. to time an attempt as well).
    pub fn remaining_at(&self, now: Instant) -> Duration {
        self.end.saturating_duration_since(now)
    }

    /// Whether no time is left.
    pub fn expired(&self) -> bool {
        self.end <= Instant::now()
    }

    /// A deadline `margin` earlier than this one, for an outbound call that must leave time for
    /// its reply to come back. Fails when the time left is not larger than `margin`: the
    /// call could not produce a useful answer, so it should not be made.
    pub fn child(&self, margin: Duration) -> Result<Deadline, DeadlineExceeded> {
        self.child_at(Instant::now(), margin)
    }

    /// [`child`](Self::child) as of `now`.
    pub fn child_at(&self, now: Instant, margin: Duration) -> Result<Deadline, DeadlineExceeded> {
        let remaining = self.remaining_at(now);
        if remaining <= margin {
            return Err(DeadlineExceeded { remaining, margin });
        }
        Ok(Deadline {
            end: self.end - margin,
        })
    }

    /// Runs `fut` with this deadline as its [`Deadline::current`], wherever it is polled: code
    /// deep below (a client call, a store waiting for a database connection) bounds its waits by
    /// the request's deadline without every signature carrying it.
    ///
    /// The server stack already does this for every request's handler; call it for work that
    /// starts from a deadline of its own (a job taken from a queue with the deadline it was
    /// sent with). To hand the current deadline to a spawned task, see [`carry`].
    pub fn scope<F: Future>(self, fut: F) -> Scoped<F> {
        Scoped {
            deadline: Some(self),
            previous: None,
            inner: fut,
        }
    }

    /// The deadline of the request the current task works for: the one the server stack read
    /// from the request being handled, or the innermost enclosing [`Deadline::scope`]. `None`
    /// outside any (a background task, or one spawned without [`carry`]).
    pub fn current() -> Option<Deadline> {
        CURRENT.try_with(|d| *d).ok()
    }

    /// Runs `f` with this deadline as the current one: for a `poll` that scopes its inner
    /// future without boxing it.
    pub(crate) fn enter<R>(self, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(self, f)
    }

    /// The time left as a `grpc-timeout` value, or an error when nothing is left.
    pub fn to_grpc_timeout(&self) -> Result<String, DeadlineExceeded> {
        let remaining = self.remaining();
        if remaining.is_zero() {
            return Err(DeadlineExceeded {
                remaining,
                margin: Duration::ZERO,
            });
        }
        Ok(encode_grpc_timeout(remaining))
    }
}

/// Makes `fut` run under the current task's [`Deadline`] (if it has one) wherever it is
/// polled: the one line that keeps the deadline when work leaves the request's task.
///
/// A spawned task does not inherit task-locals, so a client call made from it would otherwise
/// start a fresh deadline:
///
/// ```
/// use std::time::Duration;
/// use backstop::deadline::{self, Deadline};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// # let request_deadline = Deadline::after(Duration::from_millis(300));
/// # request_deadline.scope(async {
/// // In a handler, where the server stack set the request's deadline:
/// let background = tokio::spawn(deadline::carry(async {
///     // Calls made here send what is left of the request's time.
///     Deadline::current()
/// }));
/// assert_eq!(background.await.unwrap(), Deadline::current());
///
/// // Through a channel to a worker: send the deadline with the job, scope the work with it.
/// let (jobs, mut queue) = tokio::sync::mpsc::channel::<(u32, Option<Deadline>)>(8);
/// jobs.send((42, Deadline::current())).await.unwrap();
/// let (job, deadline) = queue.recv().await.unwrap();
/// let work = async move { (job, Deadline::current()) };
/// let done = match deadline {
///     Some(deadline) => deadline.scope(work).await,
///     None => work.await,
/// };
/// assert_eq!(done.1, Some(request_deadline));
/// # }).await;
/// # }
/// ```
pub fn carry<F: Future>(fut: F) -> Scoped<F> {
    Scoped {
        deadline: Deadline::current(),
        // And whether the request arrived as a retry (retry at one layer).
        previous: Some(crate::retry::inbound::previous_attempts()),
        inner: fut,
    }
}

pin_project_lite::pin_project! {
    /// A future run under a deadline: from [`Deadline::scope`] or [`carry`].
    #[derive(Debug)]
    #[must_use = "futures do nothing unless polled"]
    pub struct Scoped<F> {
        deadline: Option<Deadline>,
        previous: Option<u32>,
        #[pin]
        inner: F,
    }
}

impl<F: Future> Future for Scoped<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let mut inner = this.inner;
        let mut poll = || match *this.deadline {
            Some(deadline) => deadline.enter(|| inner.as_mut().poll(cx)),
            None => inner.as_mut().poll(cx),
        };
        match *this.previous {
            Some(previous) => crate::retry::inbound::enter(previous, poll),
            None => poll(),
        }
    }
}

/// Encodes `d` as a `grpc-timeout` value: the finest unit whose value fits in eight digits,
/// rounded up so the receiver never gets less than the sender had, and at least one unit
/// (a zero duration becomes `1n`). Durations beyond `99999999H` are capped to it.
pub fn encode_grpc_timeout(d: Duration) -> String {
    let (buf, len) = encode_grpc_timeout_bytes(d);
    // The bytes are ASCII digits and a unit letter.
    String::from_utf8_lossy(&buf[..len]).into_owned()
}

/// [`encode_grpc_timeout`] as a header value, without an intermediate `String`: it is set on
/// every attempt a client sends.
///
/// The value is marked sensitive, which HTTP/2 encodes as a never-indexed literal: a timeout
/// differs on every attempt, so indexing it would only fill the peer's HPACK table with
/// entries nobody reuses, evict the ones that are reused, and make each encode walk a chain of
/// stale `grpc-timeout` entries.
pub fn grpc_timeout_header_value(d: Duration) -> http::HeaderValue {
    let (buf, len) = encode_grpc_timeout_bytes(d);
    let mut value = http::HeaderValue::from_bytes(&buf[..len])
        .unwrap_or_else(|_| http::HeaderValue::from_static("99999999H"));
    value.set_sensitive(true);
    value
}

/// The encoded value in a stack buffer: at most eight digits and the unit.
fn encode_grpc_timeout_bytes(d: Duration) -> ([u8; 9], usize) {
    let nanos = d.as_nanos();
    let (value, unit) = UNITS
        .iter()
        .map(|&(unit, unit_nanos)| (nanos.div_ceil(u128::from(unit_nanos)).max(1), unit))
        .find(|&(value, _)| value <= u128::from(MAX_TIMEOUT_VALUE))
        .map_or((MAX_TIMEOUT_VALUE, b'H'), |(value, unit)| {
            // Fits: checked against the eight-digit maximum just above.
            (u64::try_from(value).unwrap_or(MAX_TIMEOUT_VALUE), unit)
        });
    let mut digits = [0u8; 8];
    let mut n = 0;
    let mut rest = value;
    loop {
        digits[n] = b'0' + (rest % 10) as u8;
        n += 1;
        rest /= 10;
        if rest == 0 || n == digits.len() {
            break;
        }
    }
    let mut buf = [0u8; 9];
    for (i, d) in digits[..n].iter().rev().enumerate() {
        buf[i] = *d;
    }
    buf[n] = unit;
    (buf, n + 1)
}

/// Decodes a `grpc-timeout` value (`1*8DIGIT unit`). Malformed input is an error, never a panic.
pub fn decode_grpc_timeout(value: &str) -> Result<Duration, GrpcTimeoutError> {
    let bytes = value.as_bytes();
    let (&unit, digits) = bytes.split_last().ok_or(GrpcTimeoutError::Empty)?;
    let unit_nanos = UNITS
        .iter()
        .find(|(u, _)| *u == unit)
        .map(|(_, n)| *n)
        .ok_or(GrpcTimeoutError::UnknownUnit)?;
    if digits.is_empty() {
        return Err(GrpcTimeoutError::MissingValue);
    }
    if !digits.iter().all(u8::is_ascii_digit) {
        return Err(GrpcTimeoutError::InvalidDigit);
    }
    if digits.len() > 8 {
        return Err(GrpcTimeoutError::TooManyDigits);
    }
    let n = digits
        .iter()
        .fold(0u64, |acc, d| acc * 10 + u64::from(d - b'0'));
    if n == 0 {
        return Err(GrpcTimeoutError::Zero);
    }
    // At most 99_999_999 * 3.6e12 ns, about 3.6e20: split into seconds and nanoseconds.
    let total = u128::from(n) * u128::from(unit_nanos);
    let secs = (total / 1_000_000_000) as u64;
    let sub = (total % 1_000_000_000) as u32;
    Ok(Duration::new(secs, sub))
}

/// Per-peer margin estimator: `2 x RTT_p99 + 5 ms`, never below a configured floor.
///
/// It keeps a fixed ring of the most recent round-trip samples; `current()` takes the p99 of
/// that window. Memory is fixed at construction.
///
/// The margin never exceeds a ceiling ([`Margin::DEFAULT_CEILING`] unless set): the longest
/// way back worth keeping time for. The samples must be round trips, not whole call durations:
/// the client stack feeds it each attempt's duration minus the processing time the server
/// reports ([`server_timing`]), so a slow server does not grow it.
///
/// ```
/// use std::time::Duration;
/// use backstop::deadline::Margin;
///
/// let margin = Margin::new(Duration::from_millis(1));
/// for _ in 0..100 {
///     margin.observe(Duration::from_millis(40));
/// }
/// assert_eq!(margin.current(), Duration::from_millis(85));
/// ```
#[derive(Debug)]
pub struct Margin {
    floor: Duration,
    ceiling: Duration,
    window: SampleWindow,
    /// Whole attempt durations, server work included: the peer's tail, which says when an
    /// attempt has gone unanswered for too long (not what the way back needs).
    attempts: SampleWindow,
}

impl Margin {
    /// Samples kept by [`Margin::new`].
    pub const DEFAULT_WINDOW: usize = 128;
    /// The constant part of the margin.
    pub const FIXED: Duration = Duration::from_millis(5);
    /// The largest margin kept unless [`with_ceiling`](Self::with_ceiling) says otherwise.
    pub const DEFAULT_CEILING: Duration = Duration::from_millis(250);

    /// An estimator with the default window and `floor` as the smallest margin it returns.
    pub fn new(floor: Duration) -> Self {
        Self::with_window(floor, Self::DEFAULT_WINDOW)
    }

    /// An estimator keeping the last `window` samples (at least one).
    pub fn with_window(floor: Duration, window: usize) -> Self {
        Self {
            floor,
            ceiling: Self::DEFAULT_CEILING.max(floor),
            window: SampleWindow::new(window),
            attempts: SampleWindow::new(window),
        }
    }

    /// The same estimator with `ceiling` as the largest margin it returns (never below the
    /// floor).
    pub fn with_ceiling(mut self, ceiling: Duration) -> Self {
        self.ceiling = ceiling.max(self.floor);
        self
    }

    /// The smallest margin returned.
    pub fn floor(&self) -> Duration {
        self.floor
    }

    /// The largest margin returned.
    pub fn ceiling(&self) -> Duration {
        self.ceiling
    }

    /// Records one round-trip time to the peer.
    pub fn observe(&self, rtt: Duration) {
        self.window.record(rtt);
    }

    /// Nearest-rank p99 of the sampled round trips (zero before any sample); it may lag the
    /// newest few samples (it is recomputed every few observations, not on every read).
    pub fn rtt_p99(&self) -> Duration {
        self.window.quantile(0.99, 1).unwrap_or(Duration::ZERO)
    }

    /// How many round trips the window holds (at most its size).
    pub fn samples(&self) -> usize {
        self.window.len()
    }

    /// Records one answered attempt: `total` from send to answer, of which the peer says it
    /// spent `held` on its own work (`None` when it does not say). The round trip is what the
    /// peer did not spend; an attempt whose share is unknown records no round trip.
    pub fn observe_attempt(&self, total: Duration, held: Option<Duration>) {
        self.attempts.record(total);
        if let Some(held) = held {
            self.observe(total.saturating_sub(held));
        }
    }

    /// Nearest-rank p99 of whole attempt durations (the peer's work included), once `min`
    /// attempts were observed with [`observe_attempt`](Self::observe_attempt).
    pub fn attempt_p99(&self, min: usize) -> Option<Duration> {
        self.attempts.quantile(0.99, min.max(1))
    }

    /// The margin to keep: `2 x RTT_p99 + 5 ms`, within `[floor, ceiling]`.
    pub fn current(&self) -> Duration {
        let m = self.rtt_p99().saturating_mul(2).saturating_add(Self::FIXED);
        m.clamp(self.floor, self.ceiling)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A server that takes 1.2 s per answer must not grow the margin past a 2 s deadline:
    /// the client would stop sending altogether.
    #[test]
    fn a_slow_server_does_not_grow_the_margin_past_the_ceiling() {
        let margin = Margin::new(Duration::from_millis(5));
        for _ in 0..100 {
            margin.observe(Duration::from_millis(1200));
        }
        assert_eq!(margin.current(), Margin::DEFAULT_CEILING);
        let deadline = Deadline::after(Duration::from_secs(2));
        assert!(deadline.child(margin.current()).is_ok());

        let tight = Margin::new(Duration::from_millis(5)).with_ceiling(Duration::from_millis(50));
        tight.observe(Duration::from_millis(1200));
        assert_eq!(tight.current(), Duration::from_millis(50));
        // The floor wins over a lower ceiling.
        let floor = Margin::new(Duration::from_millis(80)).with_ceiling(Duration::from_millis(50));
        assert_eq!(floor.current(), Duration::from_millis(80));
    }

    #[tokio::test(start_paused = true)]
    async fn scope_sets_the_current_deadline() {
        assert_eq!(Deadline::current(), None);
        let d = Deadline::after(Duration::from_secs(3));
        let inner = Deadline::after(Duration::from_secs(1));
        let seen = d
            .scope(async move {
                (
                    Deadline::current(),
                    inner.scope(async { Deadline::current() }).await,
                )
            })
            .await;
        assert_eq!(seen, (Some(d), Some(inner)));
        assert_eq!(Deadline::current(), None);
    }

    #[test]
    fn encode_picks_finest_unit_that_fits() {
        let cases = [
            (Duration::ZERO, "1n"),
            (Duration::from_nanos(1), "1n"),
            (Duration::from_nanos(99_999_999), "99999999n"),
            (Duration::from_nanos(100_000_000), "100000u"),
            (Duration::from_nanos(100_000_001), "100001u"),
            (Duration::from_millis(1), "1000000n"),
            (Duration::from_secs(1), "1000000u"),
            (Duration::from_secs(100), "100000m"),
            (Duration::from_secs(100_000), "100000S"),
            (Duration::from_secs(100_000_000), "1666667M"),
            (Duration::from_secs(6_000_000_000), "1666667H"),
            (Duration::from_secs(99_999_999 * 3_600), "99999999H"),
            (Duration::MAX, "99999999H"),
        ];
        for (d, want) in cases {
            assert_eq!(encode_grpc_timeout(d), want, "{d:?}");
        }
    }

    #[test]
    fn encode_rounds_up() {
        // 100_000_000.4 ms does not fit in ns; in us it is 100000000.4 -> no; in ms 100000.0004 -> 100001.
        let d = Duration::from_millis(100_000) + Duration::from_nanos(400);
        assert_eq!(encode_grpc_timeout(d), "100001m");
    }

    #[test]
    fn decode_valid_values() {
        let cases = [
            ("1n", Duration::from_nanos(1)),
            ("7u", Duration::from_micros(7)),
            ("250m", Duration::from_millis(250)),
            ("1S", Duration::from_secs(1)),
            ("2M", Duration::from_secs(120)),
            ("3H", Duration::from_secs(3 * 3_600)),
            ("00000001S", Duration::from_secs(1)),
            ("99999999m", Duration::from_millis(99_999_999)),
            ("99999999H", Duration::from_secs(99_999_999 * 3_600)),
        ];
        for (s, want) in cases {
            assert_eq!(decode_grpc_timeout(s), Ok(want), "{s}");
        }
    }

    #[test]
    fn decode_rejects_malformed_values() {
        use GrpcTimeoutError::*;
        let cases = [
            ("", Empty),
            ("S", MissingValue),
            ("0m", Zero),
            ("00000000H", Zero),
            ("123456789m", TooManyDigits),
            ("10x", UnknownUnit),
            ("10", UnknownUnit),
            ("10s", UnknownUnit),
            ("-1S", InvalidDigit),
            ("+1S", InvalidDigit),
            (" 1S", InvalidDigit),
            ("1 S", InvalidDigit),
            ("1S ", UnknownUnit),
            ("1.5S", InvalidDigit),
            ("١S", InvalidDigit),
            ("1é", UnknownUnit),
            ("１S", InvalidDigit),
        ];
        for (s, want) in cases {
            assert_eq!(decode_grpc_timeout(s), Err(want), "{s:?}");
        }
    }

    proptest! {
        #[test]
        fn roundtrip_is_never_shorter_and_within_one_unit(nanos in 0u64..=u64::MAX) {
            let d = Duration::from_nanos(nanos);
            let encoded = encode_grpc_timeout(d);
            let decoded = decode_grpc_timeout(&encoded).unwrap();
            let unit = *encoded.as_bytes().last().unwrap();
            let unit_nanos = UNITS.iter().find(|(u, _)| *u == unit).unwrap().1;
            prop_assert!(decoded >= d, "{d:?} -> {encoded} -> {decoded:?}");
            prop_assert!(decoded - d < Duration::from_nanos(unit_nanos), "{d:?} -> {encoded}");
            prop_assert!(encoded.len() <= 9);
        }

        #[test]
        fn roundtrip_of_large_durations(secs in 0u64..(99_999_999 * 3_600), sub in 0u32..1_000_000_000) {
            let d = Duration::new(secs, sub);
            let encoded = encode_grpc_timeout(d);
            let decoded = decode_grpc_timeout(&encoded).unwrap();
            let unit = *encoded.as_bytes().last().unwrap();
            let unit_nanos = UNITS.iter().find(|(u, _)| *u == unit).unwrap().1;
            prop_assert!(decoded >= d);
            prop_assert!(decoded - d < Duration::from_nanos(unit_nanos));
            let value = grpc_timeout_header_value(d);
            prop_assert_eq!(value.as_bytes(), encoded.as_bytes());
        }

        #[test]
        fn decode_never_panics(s in "\\PC*") {
            let _ = decode_grpc_timeout(&s);
        }

        #[test]
        fn decode_never_panics_on_near_misses(s in "[-+ .0-9]{0,12}[HMSmunx ]?") {
            if let Ok(d) = decode_grpc_timeout(&s) {
                prop_assert!(d > Duration::ZERO);
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn remaining_shrinks_and_expires() {
        let d = Deadline::after(Duration::from_millis(100));
        assert_eq!(d.remaining(), Duration::from_millis(100));
        assert!(!d.expired());
        tokio::time::advance(Duration::from_millis(60)).await;
        assert_eq!(d.remaining(), Duration::from_millis(40));
        tokio::time::advance(Duration::from_millis(40)).await;
        assert_eq!(d.remaining(), Duration::ZERO);
        assert!(d.expired());
        tokio::time::advance(Duration::from_millis(40)).await;
        assert_eq!(d.remaining(), Duration::ZERO);
        assert!(d.to_grpc_timeout().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn child_leaves_the_margin_and_fails_fast_when_nothing_is_left() {
        let parent = Deadline::after(Duration::from_millis(100));
        let child = parent.child(Duration::from_millis(30)).unwrap();
        assert_eq!(child.remaining(), Duration::from_millis(70));
        assert!(child < parent);
        assert_eq!(
            parent.child(Duration::from_millis(100)),
            Err(DeadlineExceeded {
                remaining: Duration::from_millis(100),
                margin: Duration::from_millis(100),
            })
        );
        tokio::time::advance(Duration::from_millis(80)).await;
        assert!(parent.child(Duration::from_millis(30)).is_err());
        assert!(parent.child(Duration::from_millis(19)).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn from_grpc_timeout_starts_now() {
        tokio::time::advance(Duration::from_secs(5)).await;
        let d = Deadline::from_grpc_timeout("2S").unwrap();
        assert_eq!(d.instant(), Instant::now() + Duration::from_secs(2));
        assert_eq!(d.to_grpc_timeout().unwrap(), "2000000u");
        assert_eq!(
            Deadline::from_grpc_timeout("0S"),
            Err(GrpcTimeoutError::Zero)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn huge_timeout_does_not_overflow() {
        let d = Deadline::after(Duration::MAX);
        assert!(d.remaining() >= FAR_FUTURE);
        let h = Deadline::from_grpc_timeout("99999999H").unwrap();
        assert!(!h.expired());
    }

    #[test]
    fn margin_is_two_p99_plus_five_ms_with_floor() {
        let m = Margin::new(Duration::from_millis(10));
        assert_eq!(m.current(), Duration::from_millis(10));
        for i in 1..=100u64 {
            m.observe(Duration::from_micros(i * 100));
        }
        // p99 of 0.1..=10 ms by 0.1 ms is 9.9 ms.
        assert_eq!(m.rtt_p99(), Duration::from_micros(9_900));
        assert_eq!(m.current(), Duration::from_micros(2 * 9_900 + 5_000));

        let low = Margin::new(Duration::ZERO);
        low.observe(Duration::from_micros(500));
        assert_eq!(low.current(), Duration::from_millis(6));
    }

    #[test]
    fn margin_window_forgets_old_samples() {
        let m = Margin::with_window(Duration::ZERO, 4);
        m.observe(Duration::from_millis(500));
        for _ in 0..4 {
            m.observe(Duration::from_millis(1));
        }
        assert_eq!(m.rtt_p99(), Duration::from_millis(1));
        assert_eq!(m.current(), Duration::from_millis(7));
    }
}
