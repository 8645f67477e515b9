//! The `Retry-After` header: delta-seconds or an HTTP-date (RFC 9110 section 10.2.3).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Longest header value considered; an HTTP-date is 29 bytes.
const MAX_LEN: usize = 64;
/// Delta-seconds beyond this are read as this (RFC 9111's cap for delta-seconds: 2^31).
const MAX_DELTA_SECS: u64 = 1 << 31;
/// Seconds from the unix epoch to 10000-01-01, past the last HTTP-date.
const YEAR_10000_SECS: u64 = 253_402_300_800;

/// How long a client should wait before retrying.
///
/// Parsing accepts both forms and never panics; formatting writes delta-seconds rounded up
/// and never `0`, since `Retry-After: 0` means "now" and only adds to an overload.
///
/// ```
/// use std::time::{Duration, SystemTime, UNIX_EPOCH};
/// use backstop::admission::RetryAfter;
///
/// let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480);
/// let wait = RetryAfter::parse("Wed, 21 Oct 2015 07:28:30 GMT", now).unwrap();
/// assert_eq!(wait.duration(), Duration::from_secs(30));
/// assert_eq!(RetryAfter::parse("120", now).unwrap().duration(), Duration::from_secs(120));
///
/// assert_eq!(RetryAfter::from(Duration::from_millis(1_200)).to_header_value(), "2");
/// assert_eq!(RetryAfter::from(Duration::ZERO).to_header_value(), "1");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct RetryAfter(pub Duration);

/// A `Retry-After` value that is neither delta-seconds nor an HTTP-date.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RetryAfterError {
    /// The value is empty or only whitespace.
    #[error("Retry-After is empty")]
    Empty,
    /// The value is longer than any valid one.
    #[error("Retry-After is too long")]
    TooLong,
    /// Neither delta-seconds nor an HTTP-date.
    #[error("Retry-After is neither delta-seconds nor an HTTP-date")]
    Invalid,
}

impl RetryAfter {
    /// Parses a header value. An HTTP-date is taken relative to `now`; a date in the past
    /// means no wait. Huge delta-seconds are capped at 2^31 seconds.
    pub fn parse(value: &str, now: SystemTime) -> Result<Self, RetryAfterError> {
        if value.len() > MAX_LEN {
            return Err(RetryAfterError::TooLong);
        }
        let value = value.trim_matches([' ', '\t']);
        if value.is_empty() {
            return Err(RetryAfterError::Empty);
        }
        if value.bytes().all(|b| b.is_ascii_digit()) {
            let secs = value.bytes().fold(0u64, |acc, d| {
                (acc * 10 + u64::from(d - b'0')).min(MAX_DELTA_SECS)
            });
            return Ok(Self(Duration::from_secs(secs)));
        }
        let at = httpdate::parse_http_date(value).map_err(|_| RetryAfterError::Invalid)?;
        Ok(Self(at.duration_since(now).unwrap_or(Duration::ZERO)))
    }

    /// Parses a header value as raw bytes (non-UTF-8 is [`RetryAfterError::Invalid`]).
    pub fn parse_bytes(value: &[u8], now: SystemTime) -> Result<Self, RetryAfterError> {
        if value.len() > MAX_LEN {
            return Err(RetryAfterError::TooLong);
        }
        let s = std::str::from_utf8(value).map_err(|_| RetryAfterError::Invalid)?;
        Self::parse(s, now)
    }

    /// The wait.
    pub fn duration(&self) -> Duration {
        self.0
    }

    /// Whole seconds to announce: rounded up, at least one, at most 2^31.
    pub fn seconds(&self) -> u64 {
        let secs = self
            .0
            .as_secs()
            .saturating_add(u64::from(self.0.subsec_nanos() > 0));
        secs.clamp(1, MAX_DELTA_SECS)
    }

    /// The header value as delta-seconds (see [`seconds`](Self::seconds)).
    pub fn to_header_value(&self) -> String {
        self.seconds().to_string()
    }

    /// The header value, ready to insert.
    pub fn header_value(&self) -> http::HeaderValue {
        http::HeaderValue::from(self.seconds())
    }

    /// The header value as an HTTP-date: `now` plus [`seconds`](Self::seconds). `None` when
    /// that instant has no HTTP-date (before 1970 or after 9999).
    pub fn to_http_date(&self, now: SystemTime) -> Option<String> {
        let at = now.checked_add(Duration::from_secs(self.seconds()))?;
        let since_epoch = at.duration_since(UNIX_EPOCH).ok()?;
        (since_epoch.as_secs() < YEAR_10000_SECS).then(|| httpdate::fmt_http_date(at))
    }
}

impl From<Duration> for RetryAfter {
    fn from(d: Duration) -> Self {
        Self(d)
    }
}

impl From<RetryAfter> for Duration {
    fn from(r: RetryAfter) -> Self {
        r.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn now() -> SystemTime {
        // Wed, 21 Oct 2015 07:28:00 GMT
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480)
    }

    #[test]
    fn parses_delta_seconds() {
        let cases = [
            ("0", 0),
            ("3", 3),
            (" 120\t", 120),
            ("0007", 7),
            ("99999999999999999999999", MAX_DELTA_SECS),
        ];
        for (s, secs) in cases {
            assert_eq!(
                RetryAfter::parse(s, now()),
                Ok(RetryAfter(Duration::from_secs(secs))),
                "{s:?}"
            );
        }
    }

    #[test]
    fn parses_http_dates() {
        let later = RetryAfter::parse("Wed, 21 Oct 2015 07:30:00 GMT", now()).unwrap();
        assert_eq!(later.duration(), Duration::from_secs(120));
        let past = RetryAfter::parse("Wed, 21 Oct 2015 07:00:00 GMT", now()).unwrap();
        assert_eq!(past.duration(), Duration::ZERO);
        // Obsolete formats that RFC 9110 still asks recipients to accept.
        let rfc850 = RetryAfter::parse("Wednesday, 21-Oct-15 07:28:10 GMT", now()).unwrap();
        assert_eq!(rfc850.duration(), Duration::from_secs(10));
        let asctime = RetryAfter::parse("Wed Oct 21 07:28:20 2015", now()).unwrap();
        assert_eq!(asctime.duration(), Duration::from_secs(20));
    }

    #[test]
    fn rejects_garbage() {
        use RetryAfterError::*;
        let long = "1".repeat(65);
        let cases = [
            ("", Empty),
            ("  ", Empty),
            ("-1", Invalid),
            ("1.5", Invalid),
            ("+3", Invalid),
            ("3s", Invalid),
            ("tomorrow", Invalid),
            ("Wed, 21 Oct 2015 07:28:00", Invalid),
            ("Wed, 32 Oct 2015 07:28:00 GMT", Invalid),
            ("１", Invalid),
            (long.as_str(), TooLong),
        ];
        for (s, want) in cases {
            assert_eq!(RetryAfter::parse(s, now()), Err(want), "{s:?}");
        }
        assert_eq!(
            RetryAfter::parse_bytes(b"\xff\xfe", now()),
            Err(RetryAfterError::Invalid)
        );
        assert_eq!(
            RetryAfter::parse_bytes(b"5", now()),
            Ok(RetryAfter(Duration::from_secs(5)))
        );
    }

    #[test]
    fn formats_rounded_up_and_never_zero() {
        let cases = [
            (Duration::ZERO, "1"),
            (Duration::from_nanos(1), "1"),
            (Duration::from_secs(1), "1"),
            (Duration::from_millis(1_001), "2"),
            (Duration::from_secs(30), "30"),
            (Duration::MAX, "2147483648"),
        ];
        for (d, want) in cases {
            let r = RetryAfter::from(d);
            assert_eq!(r.to_header_value(), want, "{d:?}");
            assert_eq!(r.header_value(), want);
        }
        assert_eq!(
            RetryAfter(Duration::from_millis(500)).to_http_date(now()),
            Some("Wed, 21 Oct 2015 07:28:01 GMT".to_owned())
        );
        let end = UNIX_EPOCH + Duration::from_secs(YEAR_10000_SECS - 1);
        assert_eq!(RetryAfter(Duration::from_secs(5)).to_http_date(end), None);
        let before = UNIX_EPOCH - Duration::from_secs(10);
        assert_eq!(
            RetryAfter(Duration::from_secs(5)).to_http_date(before),
            None
        );
    }

    proptest! {
        #[test]
        fn parse_never_panics(s in "\\PC*") {
            let _ = RetryAfter::parse(&s, now());
        }

        #[test]
        fn parse_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = RetryAfter::parse_bytes(&b, now());
        }

        #[test]
        fn format_then_parse_is_never_shorter(ms in 0u64..10_000_000_000) {
            let r = RetryAfter(Duration::from_millis(ms));
            let back = RetryAfter::parse(&r.to_header_value(), now()).unwrap();
            prop_assert!(back.duration() >= r.duration());
            prop_assert!(back.duration() >= Duration::from_secs(1));
            prop_assert!(
                back.duration() - r.duration() < Duration::from_secs(1)
                    || r.duration() < Duration::from_secs(1)
            );
            let dated = RetryAfter::parse(&r.to_http_date(now()).unwrap(), now()).unwrap();
            prop_assert_eq!(dated, back);
        }
    }
}
