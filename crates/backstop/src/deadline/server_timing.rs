//! The server's own processing time on each answer (`Server-Timing: backstop;dur=12.345`), so a
//! client can tell the network's share of an attempt from the server's work.
//!
//! A margin learned from whole attempt durations learns the server's work too: a backend that
//! takes 300 ms would make every later call keep 250 ms for "the way back". The server stack
//! stamps every answer with how long it held the request (from the moment its deadline layer
//! saw it to the moment the answer's head was ready), in the W3C `Server-Timing` header, and
//! the client's margin learns `attempt duration - server time`: the round trip, serialization
//! and queueing outside the server's stack.
//!
//! ```
//! use std::time::Duration;
//! use backstop::deadline::server_timing;
//!
//! let value = server_timing::header_value(Duration::from_micros(300_250));
//! assert_eq!(value, "backstop;dur=300.250");
//! assert_eq!(server_timing::parse(value.as_bytes()), Some(Duration::from_micros(300_250)));
//! // Other servers' metrics are ignored; ours is found among them.
//! assert_eq!(server_timing::parse(b"db;dur=53, backstop;dur=2"), Some(Duration::from_millis(2)));
//! assert_eq!(server_timing::parse(b"cache;desc=\"hit\""), None);
//! ```

use std::time::Duration;

/// The `Server-Timing` header.
pub static SERVER_TIMING: http::HeaderName = http::HeaderName::from_static("server-timing");

/// The metric name backstop's server stack reports its processing time under.
pub const METRIC: &str = "backstop";

/// Longest processing time reported or read: longer values are not time a margin can use.
const MAX: Duration = Duration::from_secs(86_400);

/// `backstop;dur=<milliseconds with three decimals>` for a processing time of `elapsed`.
pub fn header_value(elapsed: Duration) -> http::HeaderValue {
    // Written by hand into a stack buffer: it is set on every answer, and `format!` cost
    // more than the rest of the server's deadline layer.
    let micros = u64::try_from(elapsed.min(MAX).as_micros()).unwrap_or(0);
    let mut buf = [0u8; 40];
    let mut len = 0;
    for part in [METRIC.as_bytes(), b";dur="] {
        buf[len..len + part.len()].copy_from_slice(part);
        len += part.len();
    }
    len += write_digits(&mut buf[len..], micros / 1000, 1);
    buf[len] = b'.';
    len += 1;
    len += write_digits(&mut buf[len..], micros % 1000, 3);
    // ASCII letters, digits, ';', '=' and '.': always a valid header value.
    http::HeaderValue::from_bytes(&buf[..len])
        .unwrap_or_else(|_| http::HeaderValue::from_static(METRIC))
}

/// Writes `n` in decimal with at least `width` digits into `out`; returns how many bytes.
fn write_digits(out: &mut [u8], mut n: u64, width: usize) -> usize {
    let mut digits = [0u8; 20];
    let mut count = 0;
    while n > 0 || count < width {
        digits[count] = b'0' + (n % 10) as u8;
        n /= 10;
        count += 1;
    }
    for (slot, digit) in out.iter_mut().zip(digits[..count].iter().rev()) {
        *slot = *digit;
    }
    count
}

/// The processing time a `Server-Timing` value reports under [`METRIC`], or `None` when it has
/// no such entry or its `dur` is not a plain non-negative number of milliseconds (anything
/// ambiguous is ignored rather than guessed at: the margin then learns nothing from it).
pub fn parse(value: &[u8]) -> Option<Duration> {
    let text = std::str::from_utf8(value).ok()?;
    let mut found = None;
    for entry in text.split(',') {
        let mut params = entry.split(';').map(str::trim);
        if params.next() != Some(METRIC) {
            continue;
        }
        if found.is_some() {
            // Reported twice: which one is meant is a guess.
            return None;
        }
        let dur = params.find_map(|p| p.strip_prefix("dur="))?;
        found = Some(parse_millis(dur)?);
    }
    found
}

/// The processing time an answer's `Server-Timing` headers report under [`METRIC`]: `None`
/// when none does, or when more than one does (which one timed this hop is a guess).
pub fn from_headers(headers: &http::HeaderMap) -> Option<Duration> {
    let mut ours = headers
        .get_all(&SERVER_TIMING)
        .iter()
        .filter(|value| names_ours(value.as_bytes()));
    let only = ours.next()?;
    match ours.next() {
        Some(_) => None,
        None => parse(only.as_bytes()),
    }
}

/// Whether a `Server-Timing` value has an entry named [`METRIC`], well formed or not.
pub(crate) fn names_ours(value: &[u8]) -> bool {
    std::str::from_utf8(value).is_ok_and(|text| {
        text.split(',')
            .any(|entry| entry.split(';').next().map(str::trim) == Some(METRIC))
    })
}

/// `12`, `12.5`, `0.125`: decimal milliseconds, at most microsecond precision kept.
fn parse_millis(text: &str) -> Option<Duration> {
    let digits = |s: &str| !s.is_empty() && s.len() <= 12 && s.bytes().all(|b| b.is_ascii_digit());
    let (whole, fraction) = match text.split_once('.') {
        Some((whole, fraction)) if digits(fraction) => (whole, fraction),
        Some(_) => return None,
        None => (text, ""),
    };
    if !digits(whole) {
        return None;
    }
    let millis: u64 = whole.parse().ok()?;
    let micros_part: u64 = format!("{fraction:0<3}")[..3].parse().ok()?;
    let total = Duration::from_millis(millis).checked_add(Duration::from_micros(micros_part))?;
    (total <= MAX).then_some(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn malformed_or_ambiguous_values_are_ignored() {
        for bad in [
            &b""[..],
            b"backstop",
            b"backstop;dur",
            b"backstop;dur=",
            b"backstop;dur=-1",
            b"backstop;dur=1e3",
            b"backstop;dur=.5",
            b"backstop;dur=5.",
            b"backstop;dur=abc",
            b"backstop;dur=99999999999999",
            b"backstop;dur=1, backstop;dur=2",
            b"backstopx;dur=1",
            b"\xff\xfe",
        ] {
            assert_eq!(parse(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(
            parse(b"backstop;desc=\"x\";dur=7"),
            Some(Duration::from_millis(7))
        );
        assert_eq!(parse(b"backstop;dur=0.0004"), Some(Duration::ZERO));
    }

    proptest! {
        #[test]
        fn what_is_written_reads_back_to_the_microsecond(micros in 0u64..86_400_000_000) {
            let d = Duration::from_micros(micros);
            let value = header_value(d);
            prop_assert_eq!(parse(value.as_bytes()), Some(d));
        }

        #[test]
        fn any_input_is_read_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse(&bytes);
        }
    }
}
