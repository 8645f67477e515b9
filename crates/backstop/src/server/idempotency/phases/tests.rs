use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use tower::{ServiceExt, service_fn};
use tower_layer::Layer;

use super::*;
use crate::clock::ManualClock;
use crate::idempotency::{IdempotencyKey, MemoryStore, PriorRun, RecordStatus};
use crate::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy, Takeover};
use crate::server::body::RequestBody;
use crate::server::idempotency::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyLayer};
use crate::server::testing::{body, problem_code};

type Body = Full<Bytes>;
type In = RequestBody<Body>;

fn layer(
    store: &MemoryStore,
    clock: &ManualClock,
    takeover: Takeover,
) -> IdempotencyLayer<MemoryStore> {
    let keyed = MethodPolicy::builder("Pay", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .takeover(takeover)
        .build();
    let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(Method::POST, "/v1/payments", keyed);
    IdempotencyLayer::new(store.clone())
        .clock(clock.clone())
        .policies(policies)
}

fn post(key: &str) -> Request<Body> {
    Request::builder()
        .method(Method::POST)
        .uri("/v1/payments")
        .header(IDEMPOTENCY_KEY, key)
        .body(Body::from(r#"{"amount_cents":100}"#))
        .unwrap()
}

async fn record(store: &MemoryStore, key: &str) -> Option<crate::idempotency::Record> {
    store
        .get("default", &IdempotencyKey::new(key).unwrap())
        .await
        .unwrap()
}

/// Counts a write: what a handler's own table would hold.
fn count(into: &Arc<AtomicUsize>) -> crate::idempotency::memory::MemoryWrites<()> {
    let into = into.clone();
    Box::new(move || {
        into.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })
}

#[tokio::test]
async fn a_phase_commits_with_its_recovery_point_and_the_last_writes_with_the_answer() {
    let (store, clock) = (MemoryStore::new(), ManualClock::new(1_000_000));
    let (created, succeeded) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (c, s) = (created.clone(), succeeded.clone());
    let svc = layer(&store, &clock, Takeover::Resume).layer(service_fn(move |req: Request<In>| {
        let phases = req
            .extensions()
            .get::<Phases<MemoryStore>>()
            .cloned()
            .unwrap();
        let (c, s) = (c.clone(), s.clone());
        async move {
            assert!(phases.resume().is_none(), "a fresh claim resumes nothing");
            phases.commit("created", "pi_1", count(&c)).await.unwrap();
            phases.on_finish(count(&s));
            let mut response = Response::new(Body::from("{}"));
            *response.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(response)
        }
    }));
    let response = svc.clone().oneshot(post("k1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let rec = record(&store, "k1").await.unwrap();
    assert_eq!(rec.status, RecordStatus::Succeeded);
    let point = rec.point.unwrap();
    assert_eq!(
        (point.phase.as_str(), &point.data[..]),
        ("created", &b"pi_1"[..])
    );
    assert_eq!(created.load(Ordering::SeqCst), 1);
    assert_eq!(succeeded.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_retry_resumes_an_abandoned_run_from_its_last_phase_with_the_same_effect_key() {
    let (store, clock) = (MemoryStore::new(), ManualClock::new(1_000_000));
    let runs = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (r, seen_by) = (runs.clone(), seen.clone());
    let svc = layer(&store, &clock, Takeover::Resume).layer(service_fn(move |req: Request<In>| {
        let phases = req
            .extensions()
            .get::<Phases<MemoryStore>>()
            .cloned()
            .unwrap();
        let run = r.fetch_add(1, Ordering::SeqCst);
        let seen_by = seen_by.clone();
        async move {
            seen_by.lock().unwrap().push((
                phases.effect_key(),
                phases.resume().map(|r| r.prior),
                phases.recovery_point().map(|p| p.phase.clone()),
            ));
            if phases.recovery_point().is_none() {
                phases
                    .commit("created", "pi_1", Box::new(|| Ok(())))
                    .await
                    .unwrap();
            }
            if run == 0 {
                // The first run dies after its phase: it never answers.
                std::future::pending::<()>().await;
            }
            Ok::<_, Infallible>(Response::new(Body::from("{\"ok\":true}")))
        }
    }));
    let first = tokio::spawn(svc.clone().oneshot(post("k1")));
    while record(&store, "k1").await.and_then(|r| r.point).is_none() {
        tokio::task::yield_now().await;
    }
    // Its lease ends: the holder is gone.
    clock.advance(Duration::from_secs(60));
    let response = svc.clone().oneshot(post("k1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[0].0, seen[1].0,
        "one effect key for every run of the key"
    );
    assert_eq!(seen[1].1, Some(PriorRun::Abandoned));
    assert_eq!(seen[1].2.as_deref(), Some("created"));
    // The dead run's late end changes nothing: its lease was taken over.
    first.abort();
    let _ = first.await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        record(&store, "k1").await.unwrap().status,
        RecordStatus::Succeeded
    );
}

#[tokio::test(start_paused = true)]
async fn by_default_a_retry_of_an_abandoned_run_answers_outcome_unknown_and_runs_nothing() {
    let (store, clock) = (MemoryStore::new(), ManualClock::new(1_000_000));
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let svc =
        layer(&store, &clock, Takeover::Refuse).layer(service_fn(move |_req: Request<In>| {
            r.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<Response<Body>, Infallible>>()
        }));
    let first = tokio::spawn(svc.clone().oneshot(post("k1")));
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    clock.advance(Duration::from_secs(60));
    let response = svc.clone().oneshot(post("k1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(problem_code(&body(response).await), "outcome_unknown");
    // Definite: every later retry gets the same answer, replayed.
    let again = svc.clone().oneshot(post("k1")).await.unwrap();
    assert_eq!(again.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(again.headers()[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler never ran again"
    );
    first.abort();
}

#[tokio::test]
async fn on_a_resume_route_an_answer_before_any_phase_leaves_no_record() {
    let (store, clock) = (MemoryStore::new(), ManualClock::new(1_000_000));
    let svc =
        layer(&store, &clock, Takeover::Resume).layer(service_fn(|_req: Request<In>| async {
            // Refused before any phase: a budget too small for the downstream, say.
            let mut response = Response::new(Body::from("{}"));
            *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
            Ok::<_, Infallible>(response)
        }));
    let response = svc.clone().oneshot(post("k1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    assert!(record(&store, "k1").await.is_none());
    let _ = body(response).await;
}

#[tokio::test]
async fn a_run_that_lost_its_key_writes_nothing_of_its_phases() {
    use crate::idempotency::{Claim, ClaimRequest, Ending, Fingerprint, RecoveryPoint, Store};
    let store = MemoryStore::new();
    let req = ClaimRequest {
        scope: "s".into(),
        key: IdempotencyKey::new("k").unwrap(),
        fingerprint: Fingerprint::of_bytes("POST", b"{}"),
        lease: Duration::from_secs(5),
        ttl: Duration::from_secs(60),
        now_ms: 1_000,
    };
    let Claim::Claimed(old) = store.claim(req.clone()).await.unwrap() else {
        panic!("claimed")
    };
    let Claim::Claimed(new) = store
        .claim(ClaimRequest {
            now_ms: 10_000,
            ..req
        })
        .await
        .unwrap()
    else {
        panic!("taken over")
    };
    let writes = Arc::new(AtomicUsize::new(0));
    let point = RecoveryPoint {
        phase: "p".into(),
        data: Bytes::new(),
    };
    assert!(matches!(
        store
            .commit_phase(&old, point.clone(), count(&writes))
            .await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert!(matches!(
        store
            .finish(&old, Ending::Fail, 10_001, count(&writes))
            .await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert_eq!(writes.load(Ordering::SeqCst), 0);
    // Failing writes leave the record as it was.
    let failing: crate::idempotency::memory::MemoryWrites<()> = Box::new(|| Err("no".into()));
    assert!(matches!(
        store.commit_phase(&new, point, failing).await,
        Err(StoreError::PhaseWrites { .. })
    ));
    let rec = store
        .get("s", &IdempotencyKey::new("k").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.point, None);
    assert_eq!(rec.status, RecordStatus::Running);
}

/// A run that resumed past the phase of the run before it and then answers a retryable
/// failure committed no phase itself, yet the record's recovery point (and the effect key the
/// downstream saw) must outlive it: it is failed, not released, and the next run resumes under
/// the same effect key.
#[tokio::test(start_paused = true)]
async fn a_resumed_run_that_fails_keeps_the_recovery_point() {
    let (store, clock) = (MemoryStore::new(), ManualClock::new(1_000_000));
    let runs = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (r, seen_by) = (runs.clone(), seen.clone());
    let svc = layer(&store, &clock, Takeover::Resume).layer(service_fn(move |req: Request<In>| {
        let phases = req
            .extensions()
            .get::<Phases<MemoryStore>>()
            .cloned()
            .unwrap();
        let run = r.fetch_add(1, Ordering::SeqCst);
        let seen_by = seen_by.clone();
        async move {
            seen_by.lock().unwrap().push(phases.effect_key());
            if phases.recovery_point().is_none() {
                phases
                    .commit("created", "pi_1", Box::new(|| Ok(())))
                    .await
                    .unwrap();
            }
            // The effect, by effect key.
            if run == 0 {
                std::future::pending::<()>().await;
            }
            let mut response = Response::new(Body::from("{}"));
            if run == 1 {
                // The downstream is briefly unavailable.
                *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            }
            Ok::<_, Infallible>(response)
        }
    }));
    let first = tokio::spawn(svc.clone().oneshot(post("k1")));
    while record(&store, "k1").await.and_then(|r| r.point).is_none() {
        tokio::task::yield_now().await;
    }
    clock.advance(Duration::from_secs(60));
    let second = svc.clone().oneshot(post("k1")).await.unwrap();
    assert_eq!(second.status(), StatusCode::SERVICE_UNAVAILABLE);
    let rec = record(&store, "k1").await.expect("the record stays");
    assert_eq!(rec.status, RecordStatus::Failed);
    assert_eq!(rec.point.expect("and its recovery point").phase, "created");
    clock.advance(Duration::from_secs(1));
    let third = svc.clone().oneshot(post("k1")).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3);
    assert!(
        seen.iter().all(|key| *key == seen[0]),
        "one effect key for every run: {seen:?}"
    );
    first.abort();
}
