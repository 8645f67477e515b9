use std::collections::VecDeque;
use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use tokio::sync::{mpsc, oneshot};
use tower::{ServiceExt, service_fn};
use tower_layer::Layer;

use super::*;
use crate::clock::ManualClock;
use crate::idempotency::{IdempotencyKey, MemoryStore, RecordStatus};
use crate::policy::{Idempotency, KEY_TTL_SYNC, MethodPolicies, MethodPolicy};
use crate::server::body::{RequestBody, ResponseBody};
use crate::server::idempotency::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyLayer};

/// A body that yields its frames, then ends (or, with `then_pending`, never ends), with an
/// optional exact size hint (a `Content-Length`).
#[derive(Debug, Default)]
struct Script {
    frames: VecDeque<Result<Frame<Bytes>, io::Error>>,
    then_pending: bool,
    exact: Option<u64>,
}

impl Script {
    /// `n` bytes in frames of `frame` bytes.
    fn bytes(n: usize, frame: usize) -> Self {
        let mut frames = VecDeque::new();
        let mut left = n;
        let mut i = 0u8;
        while left > 0 {
            let len = left.min(frame);
            frames.push_back(Ok(Frame::data(Bytes::from(vec![b'a' + i % 26; len]))));
            left -= len;
            i = i.wrapping_add(1);
        }
        Self {
            frames,
            ..Self::default()
        }
    }

    fn then(mut self, frame: Result<Frame<Bytes>, io::Error>) -> Self {
        self.frames.push_back(frame);
        self
    }

    fn then_pending(mut self) -> Self {
        self.then_pending = true;
        self
    }
}

impl Body for Script {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match self.frames.pop_front() {
            Some(frame) => Poll::Ready(Some(frame)),
            None if self.then_pending => Poll::Pending,
            None => Poll::Ready(None),
        }
    }

    fn size_hint(&self) -> SizeHint {
        self.exact
            .map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

fn trailers(status: &'static str) -> HeaderMap {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static(status));
    trailers
}

fn broken() -> Result<Frame<Bytes>, io::Error> {
    Err(io::Error::new(
        io::ErrorKind::ConnectionReset,
        "upstream gone",
    ))
}

fn len_of(read: &VecDeque<Bytes>) -> usize {
    read.iter().map(Bytes::len).sum()
}

// The bounded read.

#[tokio::test]
async fn a_body_up_to_the_bound_is_read_whole() {
    for n in [0, 1, 999, 1000] {
        match read(Script::bytes(n, 300), 1000).await {
            Read::Whole { data, trailers } => {
                assert_eq!(data.len(), n);
                assert_eq!(trailers, None);
            }
            other => panic!("{n}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_body_over_the_bound_is_handed_on_with_the_bytes_read_and_the_rest_unread() {
    let body = Script::bytes(10_000, 300);
    let Read::Over { read, mut rest } = read(body, 1000).await else {
        panic!("over the bound");
    };
    // The frames up to the one that crossed the bound, and no more.
    assert_eq!(len_of(&read), 1200);
    assert_eq!(rest.frames.len(), (10_000 - 1200) / 300 + 1);
    let rest = rest.as_mut().collect().await.unwrap().to_bytes();
    assert_eq!(len_of(&read) + rest.len(), 10_000);
}

#[tokio::test]
async fn a_body_known_to_be_over_the_bound_is_not_read_at_all() {
    let body = Full::new(Bytes::from(vec![0u8; 1001]));
    let Read::Over { read, rest } = read(body, 1000).await else {
        panic!("over the bound");
    };
    assert!(read.is_empty());
    assert_eq!(rest.size_hint().exact(), Some(1001));
    // Known to fit: read.
    let within = Full::new(Bytes::from(vec![0u8; 1000]));
    assert!(matches!(read_whole(within).await, Some(1000)));
}

async fn read_whole<B: Body<Data = Bytes>>(body: B) -> Option<usize> {
    match read(body, 1000).await {
        Read::Whole { data, .. } => Some(data.len()),
        _ => None,
    }
}

#[tokio::test]
async fn trailers_end_a_body_and_a_failure_is_failed() {
    let body = Script::bytes(10, 4).then(Ok(Frame::trailers(trailers("0"))));
    match read(body, 1000).await {
        Read::Whole { data, trailers: t } => {
            assert_eq!(data.len(), 10);
            assert_eq!(t, Some(trailers("0")));
        }
        other => panic!("{other:?}"),
    }
    let body = Script::bytes(10, 4).then(broken());
    assert!(matches!(read(body, 1000).await, Read::Failed));
}

#[tokio::test(start_paused = true)]
async fn the_read_stops_at_the_bound_without_waiting_for_the_rest() {
    // The rest never comes: a read that waited for it would still be waiting an hour later.
    let body = Script::bytes(1001, 1001).then_pending();
    let read = tokio::time::timeout(Duration::from_secs(3600), read(body, 1000))
        .await
        .expect("the read returns once over the bound");
    assert!(matches!(read, Read::Over { .. }));
}

// The tail.

/// An [`OnEnd`] that reports how the body ended, and holds the record's end until `release`.
struct Recorded {
    ends: mpsc::UnboundedSender<String>,
    release: Option<oneshot::Receiver<()>>,
}

impl OnEnd for Recorded {
    fn ended(self: Box<Self>, end: End) -> BoxFuture {
        Box::pin(async move {
            if let Some(release) = self.release {
                let _ = release.await;
            }
            let what = match end {
                End::Finished(Some(_)) => "finished with trailers",
                End::Finished(None) => "finished",
                End::Failed => "failed",
                End::CallerGone => "caller gone",
            };
            let _ = self.ends.send(what.to_owned());
        })
    }
}

fn tail(
    body: Script,
    read: &[&'static [u8]],
    hold: bool,
) -> (
    ResponseBody<Script>,
    mpsc::UnboundedReceiver<String>,
    Option<oneshot::Sender<()>>,
) {
    let (ends, ended) = mpsc::unbounded_channel();
    let (release, held) = if hold {
        let (tx, rx) = oneshot::channel();
        (Some(tx), Some(rx))
    } else {
        (None, None)
    };
    let read = read.iter().map(|b| Bytes::from_static(b)).collect();
    let on_end = Box::new(Recorded {
        ends,
        release: held,
    });
    let body = ResponseBody::streamed(Tail::new(read, Box::pin(body), on_end));
    (body, ended, release)
}

#[tokio::test]
async fn a_tail_sends_what_was_read_then_the_rest_and_ends_the_record_before_its_own_end() {
    let (mut body, mut ended, release) = tail(Script::bytes(4, 2), &[b"ab", b"c"], true);
    assert_eq!(body.size_hint().lower(), 3);
    let mut got = Vec::new();
    for _ in 0..4 {
        let frame = body.frame().await.unwrap().unwrap();
        got.extend_from_slice(&frame.into_data().unwrap());
    }
    assert_eq!(got, b"abcaabb");
    // The body ended: its end waits for the record's.
    let next = body.frame();
    tokio::pin!(next);
    assert!(futures_util::poll!(next.as_mut()).is_pending());
    assert!(!body_is_end(&ended));
    release.unwrap().send(()).unwrap();
    assert!(next.await.is_none());
    assert_eq!(ended.recv().await.unwrap(), "finished");
}

fn body_is_end(ended: &mpsc::UnboundedReceiver<String>) -> bool {
    !ended.is_empty()
}

#[tokio::test]
async fn trailers_go_on_after_the_record_is_ended() {
    let script = Script::bytes(2, 2).then(Ok(Frame::trailers(trailers("0"))));
    let (body, mut ended, _) = tail(script, &[], false);
    let collected = body.collect().await.unwrap();
    assert_eq!(collected.trailers(), Some(&trailers("0")));
    assert_eq!(ended.recv().await.unwrap(), "finished with trailers");
}

#[tokio::test]
async fn a_failing_tail_passes_the_error_on_and_ends_the_record_as_failed() {
    let (body, mut ended, _) = tail(Script::bytes(2, 2).then(broken()), &[b"x"], false);
    assert!(body.collect().await.is_err());
    assert_eq!(ended.recv().await.unwrap(), "failed");
}

#[tokio::test]
async fn a_tail_dropped_by_its_caller_ends_the_record_on_a_task_of_its_own() {
    let (mut body, mut ended, _) = tail(Script::bytes(10, 2).then_pending(), &[b"x"], false);
    body.frame().await.unwrap().unwrap();
    drop(body);
    assert_eq!(ended.recv().await.unwrap(), "caller gone");
    // Dropped while the record's end was under way: it runs on.
    let (mut body, mut ended, release) = tail(Script::default(), &[], true);
    let next = body.frame();
    tokio::pin!(next);
    assert!(futures_util::poll!(next.as_mut()).is_pending());
    drop(body);
    release.unwrap().send(()).unwrap();
    assert_eq!(ended.recv().await.unwrap(), "finished");
}

// Through the layer.

const BOUND: usize = 1000;
const NOW: i64 = 1_000_000;

fn policies(takeover: Takeover) -> MethodPolicies {
    let export = MethodPolicy::builder("Export", Idempotency::Keyed)
        .key_ttl(KEY_TTL_SYNC)
        .takeover(takeover)
        .max_replay_body(BOUND)
        .build();
    MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build()).route(
        Method::POST,
        "/v1/exports",
        export,
    )
}

/// A keyed export route answering what `answer` makes, counting its runs.
fn service(
    store: &MemoryStore,
    takeover: Takeover,
    calls: &Arc<AtomicUsize>,
    answer: impl Fn() -> Response<Script> + Clone + Send + Sync + 'static,
) -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<ResponseBody<Script>>,
    Error = Infallible,
    Future: Send,
> + Clone {
    let calls = calls.clone();
    IdempotencyLayer::new(store.clone())
        .clock(ManualClock::new(NOW))
        .policies(policies(takeover))
        .any_body(true)
        .layer(service_fn(
            move |_req: Request<RequestBody<Full<Bytes>>>| {
                calls.fetch_add(1, Ordering::SeqCst);
                let answer = answer.clone();
                async move { Ok::<_, Infallible>(answer()) }
            },
        ))
}

fn export(key: &str) -> Request<Full<Bytes>> {
    Request::post("/v1/exports")
        .header(IDEMPOTENCY_KEY, key)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

fn csv(n: usize) -> Response<Script> {
    let mut response = Response::new(Script::bytes(n, 256));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/csv"));
    response
        .headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static("/v1/exports/e1"));
    response
}

async fn record(store: &MemoryStore, key: &str) -> Option<crate::idempotency::Record> {
    store
        .get(
            crate::server::tenant::Tenant::DEFAULT,
            &IdempotencyKey::new(key).unwrap(),
        )
        .await
        .unwrap()
}

/// The record of `key` once it is no longer running (ended on a task of its own).
async fn settled(store: &MemoryStore, key: &str) -> crate::idempotency::Record {
    for _ in 0..1000 {
        if let Some(record) = record(store, key).await {
            if record.status != RecordStatus::Running {
                return record;
            }
        }
        tokio::task::yield_now().await;
    }
    panic!("the record of {key} stayed running");
}

#[tokio::test]
async fn answers_up_to_the_bound_are_replayed_byte_for_byte_and_larger_ones_say_so() {
    for (n, kept) in [(BOUND - 1, true), (BOUND, true), (BOUND + 1, false)] {
        let store = MemoryStore::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let svc = service(&store, Takeover::Refuse, &calls, move || csv(n));
        let first = svc.clone().oneshot(export("k")).await.unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        let first = first.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(first.len(), n, "the caller gets the whole answer");
        let stored = record(&store, "k").await.unwrap().response.unwrap();
        let again = svc.clone().oneshot(export("k")).await.unwrap();
        assert_eq!(again.headers()[IDEMPOTENT_REPLAYED], "true");
        assert_eq!(again.status(), StatusCode::OK, "the original status");
        assert_eq!(again.headers()[header::LOCATION], "/v1/exports/e1");
        let (head, body) = again.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        if kept {
            assert_eq!(stored.body_withheld(), None);
            assert_eq!(body, first, "{n} bytes replayed byte for byte");
            assert_eq!(head.headers[header::CONTENT_TYPE], "text/csv");
        } else {
            assert_eq!(stored.body_withheld(), Some(BOUND as u64));
            assert!(stored.body.is_empty(), "nothing of the body is stored");
            let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(doc["code"], "replay_body_too_large");
            assert_eq!(doc["status"], 200);
            assert_eq!(doc["max_replay_body"], BOUND);
            assert_eq!(
                head.headers[header::CONTENT_TYPE],
                "application/problem+json"
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{n}: run once");
    }
}

#[tokio::test]
async fn a_caller_that_leaves_an_over_bound_answer_midway_still_completes_its_record() {
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = service(&store, Takeover::Refuse, &calls, || {
        // More than the bound, then nothing more for as long as anyone waits.
        csv(BOUND * 2).map(Script::then_pending)
    });
    let response = svc.clone().oneshot(export("k")).await.unwrap();
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    assert_eq!(
        record(&store, "k").await.unwrap().status,
        RecordStatus::Running
    );
    drop(body);
    let record = settled(&store, "k").await;
    assert_eq!(record.status, RecordStatus::Succeeded);
    assert_eq!(record.response.unwrap().body_withheld(), Some(BOUND as u64));
    let again = svc.oneshot(export("k")).await.unwrap();
    assert_eq!(again.headers()[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_over_bound_answer_that_breaks_midway_has_an_unknown_outcome() {
    for (takeover, left) in [
        // Never run twice: the record stays running, and a retry learns `outcome_unknown`.
        (Takeover::Refuse, RecordStatus::Running),
        (Takeover::Rerun, RecordStatus::Failed),
    ] {
        let store = MemoryStore::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let svc = service(&store, takeover, &calls, || {
            csv(BOUND * 2).map(|body| body.then(broken()))
        });
        let response = svc.oneshot(export("k")).await.unwrap();
        assert!(response.into_body().collect().await.is_err());
        let mut status = RecordStatus::Running;
        for _ in 0..100 {
            status = record(&store, "k").await.unwrap().status;
            if status != RecordStatus::Running {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(status, left, "{takeover:?}");
    }
}

#[tokio::test]
async fn a_grpc_answer_over_the_bound_is_ended_by_its_trailers() {
    for (status, ended) in [("0", RecordStatus::Succeeded), ("14", RecordStatus::Failed)] {
        let store = MemoryStore::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let svc = service(&store, Takeover::Rerun, &calls, move || {
            let mut response = Response::new(
                Script::bytes(BOUND * 2, 512).then(Ok(Frame::trailers(trailers(status)))),
            );
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            response
        });
        let mut request = export("k");
        request.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        *request.body_mut() = Full::new(Bytes::from_static(&[0, 0, 0, 0, 1, 8]));
        let response = svc.clone().oneshot(request).await.unwrap();
        let collected = response.into_body().collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["grpc-status"], status);
        assert_eq!(collected.to_bytes().len(), BOUND * 2);
        let record = record(&store, "k").await.unwrap();
        assert_eq!(record.status, ended, "grpc-status {status}");
        if ended == RecordStatus::Succeeded {
            let stored = record.response.unwrap();
            assert_eq!(stored.body_withheld(), Some(BOUND as u64));
            let replay = super::super::replay::<Script>(stored);
            assert_eq!(replay.headers()["grpc-status"], "6", "ALREADY_EXISTS");
            assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
        }
    }
}
