//! Deadlines across the hop: the header a caller's timeout came in, and the same form on the
//! way to the upstream.
//!
//! The library's deadline layer reads `grpc-timeout`. A caller that sends its timeout in
//! another header the proxy is told about (`X-Request-Timeout`, Envoy's
//! `x-envoy-expected-rq-timeout-ms`, both in milliseconds) has it read as if it came in
//! `grpc-timeout`; without either, the route's timeout applies. The upstream gets what
//! is left of it minus the hop's margin, written the way the caller wrote it (`grpc-timeout`
//! when the caller sent none), and every other timeout header is removed, so that the
//! upstream never sees a timeout the caller had before the proxy spent part of it.
//!
//! The value written is truncated, never rounded up: the upstream must give up before the
//! proxy does, so it may get a little less than is left, never more. `grpc-timeout` keeps
//! eight digits of the finest unit they fit (a loss below one part in 10^5); a header of
//! milliseconds loses less than a millisecond. A timeout no value can carry (under a
//! millisecond in a header of milliseconds) is not sent at all.

use std::sync::Arc;
use std::time::Duration;

use backstop::deadline::{GRPC_TIMEOUT, grpc_timeout_header_value};

/// The `grpc-timeout` units, finest first, with their length in nanoseconds.
const GRPC_UNITS: [(char, u128); 6] = [
    ('n', 1),
    ('u', 1_000),
    ('m', 1_000_000),
    ('S', 1_000_000_000),
    ('M', 60_000_000_000),
    ('H', 3_600_000_000_000),
];

/// Largest `grpc-timeout` value: eight digits.
const GRPC_MAX_VALUE: u128 = 99_999_999;

use backstop::server::Problem;
use backstop::server::problem::Protocol;
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};

/// Problem code of a timeout header whose value is not a number of milliseconds.
pub(crate) const INVALID_TIMEOUT_HEADER: &str = "invalid_timeout_header";

/// The headers, besides `grpc-timeout`, a caller may send its timeout in (milliseconds).
pub(crate) const DEFAULT_TIMEOUT_HEADERS: [&str; 2] =
    ["x-request-timeout", "x-envoy-expected-rq-timeout-ms"];

/// Request extension: how the caller wrote its timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TimeoutForm {
    /// `grpc-timeout`.
    GrpcTimeout,
    /// A header of milliseconds.
    Millis(HeaderName),
    /// None: the route's timeout applies.
    Absent,
}

/// The timeout headers the proxy reads and writes, besides `grpc-timeout`.
#[derive(Debug, Clone)]
pub(crate) struct TimeoutHeaders {
    names: Arc<[HeaderName]>,
}

impl TimeoutHeaders {
    /// Reads `names`, each a header of milliseconds.
    pub(crate) fn new(names: Vec<HeaderName>) -> Self {
        Self {
            names: names.into(),
        }
    }

    /// On arrival, before the deadline layer: a timeout given in one of the configured headers
    /// (and no `grpc-timeout`) is written into `grpc-timeout`, which the layer reads. Records
    /// the form in a [`TimeoutForm`] extension. A value that is not a whole number of
    /// milliseconds is refused (400 `invalid_timeout_header`); `0` counts as no timeout.
    pub(crate) fn read<B>(&self, request: &mut Request<B>) -> Result<(), Problem> {
        let headers = request.headers();
        let form = if headers.contains_key(GRPC_TIMEOUT) {
            TimeoutForm::GrpcTimeout
        } else if let Some((name, value)) = self
            .names
            .iter()
            .find_map(|name| headers.get(name).map(|value| (name, value)))
        {
            let millis = value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    Problem::new(StatusCode::BAD_REQUEST, INVALID_TIMEOUT_HEADER)
                        .detail(format!("{name} must be a whole number of milliseconds"))
                })?;
            if millis == 0 {
                TimeoutForm::Absent
            } else {
                let value = grpc_timeout_header_value(Duration::from_millis(millis));
                let name = name.clone();
                request
                    .headers_mut()
                    .insert(HeaderName::from_static(GRPC_TIMEOUT), value);
                TimeoutForm::Millis(name)
            }
        } else {
            TimeoutForm::Absent
        };
        request.extensions_mut().insert(form);
        Ok(())
    }

    /// Removes every timeout header (`grpc-timeout` and the configured ones) of `headers`.
    pub(crate) fn strip(&self, headers: &mut HeaderMap) {
        headers.remove(GRPC_TIMEOUT);
        for name in self.names.iter() {
            headers.remove(name);
        }
    }

    /// On the way out: removes every timeout header of `headers` and writes `remaining` in
    /// `form` (`grpc-timeout` for a caller that sent none), truncated so the upstream never
    /// gets more than `remaining`. `None` when no value of that form can carry `remaining`
    /// (zero, or less than a millisecond in a header of milliseconds): nothing is written
    /// then, and the request must not be sent.
    pub(crate) fn write(
        &self,
        headers: &mut HeaderMap,
        form: &TimeoutForm,
        remaining: Duration,
    ) -> Option<()> {
        self.strip(headers);
        let (name, value) = match form {
            TimeoutForm::Millis(name) => (name.clone(), millis_at_most(remaining)?),
            TimeoutForm::GrpcTimeout | TimeoutForm::Absent => (
                HeaderName::from_static(GRPC_TIMEOUT),
                grpc_timeout_at_most(remaining)?,
            ),
        };
        headers.insert(name, value);
        Some(())
    }
}

/// `d` in whole milliseconds, truncated; `None` under one millisecond.
fn millis_at_most(d: Duration) -> Option<HeaderValue> {
    let millis = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    (millis > 0).then(|| HeaderValue::from(millis))
}

/// `d` as a `grpc-timeout` value that never exceeds it: the finest unit whose truncated value
/// fits in eight digits (`99999999H` beyond). `None` for zero, which no value carries.
///
/// The library's [`grpc_timeout_header_value`] rounds up instead, for a client that sends
/// its own timeout; the proxy passes on a timeout someone else gave it.
pub(crate) fn grpc_timeout_at_most(d: Duration) -> Option<HeaderValue> {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return None;
    }
    let (value, unit) = GRPC_UNITS
        .iter()
        .map(|&(unit, length)| (nanos / length, unit))
        .find(|&(value, _)| value <= GRPC_MAX_VALUE)
        .unwrap_or((GRPC_MAX_VALUE, 'H'));
    let mut value = HeaderValue::from_str(&format!("{value}{unit}"))
        .expect("digits and a unit letter make a header value");
    // As the library's: a timeout differs on every request, so HPACK should not index it.
    value.set_sensitive(true);
    Some(value)
}

/// The refusal of a request with a malformed timeout header, in the caller's protocol.
pub(crate) fn refusal<B: From<bytes::Bytes>>(
    problem: Problem,
    headers: &HeaderMap,
) -> http::Response<B> {
    problem.into_response_for(Protocol::of(headers))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers() -> TimeoutHeaders {
        TimeoutHeaders::new(
            DEFAULT_TIMEOUT_HEADERS
                .iter()
                .map(|n| HeaderName::from_static(n))
                .collect(),
        )
    }

    fn read(pairs: &[(&str, &str)]) -> Result<Request<()>, Problem> {
        let mut builder = Request::post("/x");
        for (name, value) in pairs {
            builder = builder.header(*name, *value);
        }
        let mut request = builder.body(()).unwrap();
        headers().read(&mut request)?;
        Ok(request)
    }

    #[test]
    fn a_millisecond_header_becomes_grpc_timeout() {
        let r = read(&[("x-request-timeout", "1500")]).unwrap();
        assert_eq!(r.headers()[GRPC_TIMEOUT], "1500000u");
        assert_eq!(
            r.extensions().get::<TimeoutForm>(),
            Some(&TimeoutForm::Millis(HeaderName::from_static(
                "x-request-timeout"
            )))
        );
        let r = read(&[("grpc-timeout", "2S"), ("x-request-timeout", "10")]).unwrap();
        assert_eq!(r.headers()[GRPC_TIMEOUT], "2S", "grpc-timeout wins");
        assert_eq!(
            r.extensions().get::<TimeoutForm>(),
            Some(&TimeoutForm::GrpcTimeout)
        );
        let r = read(&[("x-envoy-expected-rq-timeout-ms", "0")]).unwrap();
        assert!(!r.headers().contains_key(GRPC_TIMEOUT));
        assert_eq!(
            r.extensions().get::<TimeoutForm>(),
            Some(&TimeoutForm::Absent)
        );
        for bad in ["1.5", "-1", "soon", ""] {
            let problem = read(&[("x-request-timeout", bad)]).unwrap_err();
            assert_eq!(problem.code(), INVALID_TIMEOUT_HEADER, "{bad:?}");
        }
    }

    #[test]
    fn the_upstream_gets_the_callers_form_and_nothing_else() {
        let h = headers();
        let mut out = HeaderMap::new();
        out.insert("grpc-timeout", "9S".parse().unwrap());
        out.insert("x-request-timeout", "9000".parse().unwrap());
        out.insert("x-envoy-expected-rq-timeout-ms", "9000".parse().unwrap());
        let form = TimeoutForm::Millis(HeaderName::from_static("x-request-timeout"));
        h.write(&mut out, &form, Duration::from_micros(1_234_900))
            .unwrap();
        assert_eq!(out["x-request-timeout"], "1234");
        assert!(!out.contains_key("grpc-timeout"));
        assert!(!out.contains_key("x-envoy-expected-rq-timeout-ms"));
        assert!(
            h.write(&mut out, &form, Duration::from_micros(900))
                .is_none()
        );
        h.write(&mut out, &TimeoutForm::Absent, Duration::from_millis(250))
            .unwrap();
        assert_eq!(out["grpc-timeout"], "250000u");
        assert!(!out.contains_key("x-request-timeout"));
    }

    #[test]
    fn grpc_timeout_keeps_eight_digits_of_the_finest_unit_truncated() {
        let at_most = |d: Duration| grpc_timeout_at_most(d).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(at_most(Duration::ZERO), None);
        assert_eq!(at_most(Duration::from_nanos(1)).as_deref(), Some("1n"));
        assert_eq!(
            at_most(Duration::from_nanos(99_999_999)).as_deref(),
            Some("99999999n")
        );
        // 20 s less 1 ns: 19999999.999 us, written 19999999u, not rounded up to 20 s.
        assert_eq!(
            at_most(Duration::from_secs(20) - Duration::from_nanos(1)).as_deref(),
            Some("19999999u")
        );
        assert_eq!(
            at_most(Duration::from_secs(20)).as_deref(),
            Some("20000000u")
        );
        assert_eq!(
            at_most(Duration::from_millis(100_000_999)).as_deref(),
            Some("100000S")
        );
        assert_eq!(at_most(Duration::MAX).as_deref(), Some("99999999H"));
        assert!(
            grpc_timeout_at_most(Duration::from_secs(1))
                .unwrap()
                .is_sensitive()
        );
    }

    proptest::proptest! {
        /// The upstream never gets more than is left, never nothing while something is left,
        /// and loses less than one part in 10^5 (one nanosecond below 10^8 ns).
        #[test]
        fn grpc_timeout_never_rounds_up(nanos in 1u64..=u64::MAX, secs in 0u64..=400_000_000) {
            for d in [Duration::from_nanos(nanos), Duration::new(secs, (nanos % 1_000_000_000) as u32)] {
                let Some(value) = grpc_timeout_at_most(d) else {
                    proptest::prop_assert_eq!(d, Duration::ZERO);
                    continue;
                };
                let sent = backstop::deadline::decode_grpc_timeout(value.to_str().unwrap()).unwrap();
                proptest::prop_assert!(sent <= d, "{d:?} sent as {value:?}");
                proptest::prop_assert!(sent > Duration::ZERO, "{d:?} sent as {value:?}");
                proptest::prop_assert!(
                    (d - sent).as_nanos() * 100_000 <= d.as_nanos(),
                    "{d:?} sent as {value:?}: {sent:?}"
                );
            }
        }

        /// In a header of milliseconds: truncated, less than a millisecond lost, refused
        /// under one.
        #[test]
        fn millis_never_round_up(nanos in 0u64..=u64::MAX) {
            let d = Duration::from_nanos(nanos);
            match millis_at_most(d) {
                None => proptest::prop_assert!(d < Duration::from_millis(1)),
                Some(value) => {
                    let sent = Duration::from_millis(value.to_str().unwrap().parse().unwrap());
                    proptest::prop_assert!(sent <= d && d - sent < Duration::from_millis(1));
                }
            }
        }
    }
}
