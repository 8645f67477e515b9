//! Test helpers shared by the server layers' unit tests.

use std::cell::RefCell;
use std::future::Future;
use std::sync::Once;

use bytes::Bytes;
use http::Response;
use http_body_util::BodyExt;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// The metrics recorded while a test ran.
#[derive(Debug)]
pub(crate) struct Recorded(Vec<Sample>);

/// Name, labels and value of one recorded metric.
type Sample = (String, Vec<(String, String)>, DebugValue);

impl Recorded {
    /// What `recorder` holds now.
    pub(crate) fn of(recorder: &DebuggingRecorder) -> Recorded {
        let recorded = recorder
            .snapshotter()
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let key = key.key();
                let labels = key
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                (key.name().to_owned(), labels, value)
            })
            .collect();
        Recorded(recorded)
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a DebugValue> + 'a {
        self.0.iter().filter_map(move |(n, ls, v)| {
            let all = labels
                .iter()
                .all(|(k, val)| ls.iter().any(|(lk, lv)| lk == k && lv == val));
            (n == name && all).then_some(v)
        })
    }

    /// Sum of the counters `name` whose labels include `labels`.
    pub(crate) fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.matching(name, labels)
            .map(|v| match v {
                DebugValue::Counter(c) => *c,
                _ => 0,
            })
            .sum()
    }

    /// Sum of the gauges `name` whose labels include `labels`.
    pub(crate) fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels)
            .map(|v| match v {
                DebugValue::Gauge(g) => g.into_inner(),
                _ => 0.0,
            })
            .sum()
    }

    /// Number of samples in the histograms `name` whose labels include `labels`.
    pub(crate) fn samples(&self, name: &str, labels: &[(&str, &str)]) -> usize {
        self.matching(name, labels)
            .map(|v| match v {
                DebugValue::Histogram(h) => h.len(),
                _ => 0,
            })
            .sum()
    }
}

/// Runs `test` on a paused current-thread runtime with a local metrics recorder.
pub(crate) fn with_metrics<F, Fut>(test: F) -> (Fut::Output, Recorded)
where
    F: FnOnce() -> Fut,
    Fut: Future,
{
    let recorder = DebuggingRecorder::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let output = metrics::with_local_recorder(&recorder, || runtime.block_on(test()));
    (output, Recorded::of(&recorder))
}

thread_local! {
    /// Where this thread's log lines go while [`with_logs`] runs on it.
    static CAPTURE: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
}

/// Writes into the current thread's capture buffer, if any.
struct ThreadWriter;

impl std::io::Write for ThreadWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        CAPTURE.with(|c| {
            if let Some(out) = c.borrow_mut().as_mut() {
                out.extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Log lines written on this thread while `test` ran (JSON, one event per line).
///
/// One global subscriber serves every test thread: a scoped (`with_default`) subscriber can
/// miss events because tracing caches each callsite's interest process-wide, and a test thread
/// without a subscriber may cache "never" first.
pub(crate) fn with_logs<T>(test: impl FnOnce() -> T) -> (T, Vec<serde_json::Value>) {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_max_level(tracing::Level::TRACE)
            .with_writer(|| ThreadWriter)
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other global subscriber in the library's tests");
    });
    CAPTURE.with(|c| *c.borrow_mut() = Some(Vec::new()));
    let output = test();
    let bytes = CAPTURE.with(|c| c.borrow_mut().take()).unwrap_or_default();
    let lines = String::from_utf8(bytes)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (output, lines)
}

/// The whole body of a response.
#[allow(dead_code)] // used by the idempotency tests
pub(crate) async fn body<B>(response: Response<B>) -> Bytes
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    response.into_body().collect().await.unwrap().to_bytes()
}

/// The `code` member of a problem+json body.
pub(crate) fn problem_code(body: &[u8]) -> String {
    let doc: serde_json::Value = serde_json::from_slice(body).unwrap();
    doc["code"].as_str().unwrap_or_default().to_owned()
}

/// A layer's answer with the body flattened back to the inner service's `Bytes`.
pub(crate) fn flat(
    response: Response<crate::server::body::ResponseBody<Bytes>>,
) -> Response<Bytes> {
    response.map(crate::server::body::ResponseBody::into_bytes)
}

/// A table in which `method pattern` (an HTTP route, or a gRPC path as `POST`) is `Keyed`,
/// its keys kept for the payments TTL, and everything else `Unsafe`.
pub(crate) fn keyed(method: http::Method, pattern: &str) -> crate::policy::MethodPolicies {
    use crate::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
    let keyed = MethodPolicy::builder("Keyed", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .build();
    MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(method, pattern, keyed)
}
