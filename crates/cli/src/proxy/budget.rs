//! Deadlines across the hop: the header a caller's budget came in, and the same form on the
//! way to the upstream.
//!
//! The library's deadline layer reads `grpc-timeout`. A caller that sends its budget in
//! another header the proxy is told about (`X-Request-Timeout`, Envoy's
//! `x-envoy-expected-rq-timeout-ms`, both in milliseconds) has it read as if it came in
//! `grpc-timeout`; without either, the route's timeout is the budget. The upstream gets what
//! is left of it minus the hop's margin, written the way the caller wrote it (`grpc-timeout`
//! when the caller sent none), and every other timeout header is removed, so that the
//! upstream never sees a budget the caller had before the proxy spent part of it.

use std::sync::Arc;
use std::time::Duration;

use backstop::deadline::{GRPC_TIMEOUT, grpc_timeout_header_value};
use backstop::server::Problem;
use backstop::server::problem::Protocol;
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};

/// Problem code of a timeout header whose value is not a number of milliseconds.
pub(crate) const INVALID_TIMEOUT_HEADER: &str = "invalid_timeout_header";

/// The headers, besides `grpc-timeout`, a caller may send its budget in (milliseconds).
pub(crate) const DEFAULT_TIMEOUT_HEADERS: [&str; 2] =
    ["x-request-timeout", "x-envoy-expected-rq-timeout-ms"];

/// Request extension: how the caller wrote its budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BudgetForm {
    /// `grpc-timeout`.
    GrpcTimeout,
    /// A header of milliseconds.
    Millis(HeaderName),
    /// None: the route's timeout is the budget.
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

    /// On arrival, before the deadline layer: a budget given in one of the configured headers
    /// (and no `grpc-timeout`) is written into `grpc-timeout`, which the layer reads. Records
    /// the form in a [`BudgetForm`] extension. A value that is not a whole number of
    /// milliseconds is refused (400 `invalid_timeout_header`); `0` counts as no budget.
    pub(crate) fn read<B>(&self, request: &mut Request<B>) -> Result<(), Problem> {
        let headers = request.headers();
        let form = if headers.contains_key(GRPC_TIMEOUT) {
            BudgetForm::GrpcTimeout
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
                BudgetForm::Absent
            } else {
                let value = grpc_timeout_header_value(Duration::from_millis(millis));
                let name = name.clone();
                request
                    .headers_mut()
                    .insert(HeaderName::from_static(GRPC_TIMEOUT), value);
                BudgetForm::Millis(name)
            }
        } else {
            BudgetForm::Absent
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
    /// `form` (`grpc-timeout` for a caller that sent none). `None` when `remaining` cannot be
    /// written (less than a millisecond in a header of milliseconds).
    pub(crate) fn write(
        &self,
        headers: &mut HeaderMap,
        form: &BudgetForm,
        remaining: Duration,
    ) -> Option<()> {
        self.strip(headers);
        match form {
            BudgetForm::Millis(name) => {
                let millis = remaining.as_millis();
                if millis == 0 {
                    return None;
                }
                headers.insert(name.clone(), HeaderValue::from(millis as u64));
            }
            BudgetForm::GrpcTimeout | BudgetForm::Absent => {
                headers.insert(
                    HeaderName::from_static(GRPC_TIMEOUT),
                    grpc_timeout_header_value(remaining),
                );
            }
        }
        Some(())
    }
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
            r.extensions().get::<BudgetForm>(),
            Some(&BudgetForm::Millis(HeaderName::from_static(
                "x-request-timeout"
            )))
        );
        let r = read(&[("grpc-timeout", "2S"), ("x-request-timeout", "10")]).unwrap();
        assert_eq!(r.headers()[GRPC_TIMEOUT], "2S", "grpc-timeout wins");
        assert_eq!(
            r.extensions().get::<BudgetForm>(),
            Some(&BudgetForm::GrpcTimeout)
        );
        let r = read(&[("x-envoy-expected-rq-timeout-ms", "0")]).unwrap();
        assert!(!r.headers().contains_key(GRPC_TIMEOUT));
        assert_eq!(
            r.extensions().get::<BudgetForm>(),
            Some(&BudgetForm::Absent)
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
        let form = BudgetForm::Millis(HeaderName::from_static("x-request-timeout"));
        h.write(&mut out, &form, Duration::from_micros(1_234_900))
            .unwrap();
        assert_eq!(out["x-request-timeout"], "1234");
        assert!(!out.contains_key("grpc-timeout"));
        assert!(!out.contains_key("x-envoy-expected-rq-timeout-ms"));
        assert!(
            h.write(&mut out, &form, Duration::from_micros(900))
                .is_none()
        );
        h.write(&mut out, &BudgetForm::Absent, Duration::from_millis(250))
            .unwrap();
        assert_eq!(out["grpc-timeout"], "250000u");
        assert!(!out.contains_key("x-request-timeout"));
    }
}
