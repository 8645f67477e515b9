use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tokio::time::{Instant, advance};
use tower::ServiceExt;
use tower_test::mock;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;
use crate::client::replay::{Replay, ReplayBody};
use crate::retry::{RetryBudget, RetrySpend, StormAlarm};

type Body = ReplayBody<Full<Bytes>>;

const MS: Duration = Duration::from_millis(1);

fn request(allowance: &HedgeAllowance) -> Request<Body> {
    let mut r = Request::new(Replay::new(Bytes::from_static(b"x")).body());
    r.extensions_mut().insert(allowance.clone());
    r
}

/// A policy whose window already says p95 = 100 ms.
fn warmed(spend: impl Into<RetrySpend>) -> HedgePolicy {
    let policy = HedgePolicy::new(spend, "psp", "GetCharge");
    for _ in 0..HedgePolicy::MIN_SAMPLES {
        policy.record_latency(100 * MS);
    }
    policy
}

#[tokio::test(start_paused = true)]
async fn a_slow_attempt_is_hedged_after_the_p95_and_the_loser_is_cancelled() {
    struct Cancelled(Arc<AtomicBool>);
    impl Drop for Cancelled {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let budget = RetryBudget::new(0.1, 5).unwrap();
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let dropped = Arc::new(AtomicBool::new(false));
    let svc = {
        let (calls, dropped) = (calls.clone(), dropped.clone());
        tower::service_fn(move |r: Request<Body>| {
            let mut calls = calls.lock().unwrap();
            calls.push((
                Instant::now(),
                r.headers()
                    .get(&GRPC_PREVIOUS_RPC_ATTEMPTS)
                    .map(|v| v.to_str().unwrap().to_owned()),
                r.extensions().get::<Hedged>().is_some(),
            ));
            let first = calls.len() == 1;
            let guard = Cancelled(dropped.clone());
            async move {
                if first {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    std::mem::forget(guard);
                    Ok::<_, BoxError>(Response::new("slow"))
                } else {
                    std::mem::forget(guard);
                    Ok(Response::new("hedge"))
                }
            }
        })
    };
    let svc = Hedge::new(svc, warmed(budget.clone()));
    let start = Instant::now();
    let response = svc
        .oneshot(request(&HedgeAllowance::default()))
        .await
        .unwrap();
    assert_eq!(*response.body(), "hedge");
    assert_eq!(start.elapsed(), 100 * MS);
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].1, None);
    assert_eq!(calls[1].1.as_deref(), Some("1"));
    // Only the hedge is marked: its header alone would read like a retry's.
    assert_eq!((calls[0].2, calls[1].2), (false, true));
    assert_eq!(calls[1].0 - calls[0].0, 100 * MS);
    // The slow attempt's future was dropped before it finished: cancelled.
    assert!(dropped.load(Ordering::SeqCst));
    assert_eq!(budget.available(), 4.0);
}

#[tokio::test(start_paused = true)]
async fn a_fast_attempt_is_not_hedged() {
    let budget = RetryBudget::new(0.1, 5).unwrap();
    let (svc, mut handle) = mock::pair::<Request<Body>, Response<&'static str>>();
    let svc = Hedge::new(svc, warmed(budget.clone()));
    handle.allow(2);
    let call = tokio::spawn(svc.oneshot(request(&HedgeAllowance::default())));
    let (_, send) = handle.next_request().await.unwrap();
    advance(99 * MS).await;
    send.send_response(Response::new("first"));
    assert_eq!(*call.await.unwrap().unwrap().body(), "first");
    assert_eq!(budget.available(), 5.0);
}

#[tokio::test(start_paused = true)]
async fn one_hedge_per_logical_call_and_none_without_budget() {
    let budget = RetryBudget::new(0.0, 1).unwrap();
    let (svc, mut handle) = mock::pair::<Request<Body>, Response<&'static str>>();
    let svc = Hedge::new(svc, warmed(budget.clone()));
    handle.allow(10);
    let allowance = HedgeAllowance::default();
    assert!(allowance.clone().take());
    // This call's hedge was already used (by an earlier attempt of the same call).
    let call = tokio::spawn(svc.clone().oneshot(request(&allowance)));
    let (_, send) = handle.next_request().await.unwrap();
    advance(500 * MS).await;
    send.send_response(Response::new("only"));
    assert_eq!(*call.await.unwrap().unwrap().body(), "only");

    // The budget's last token pays one hedge; the next call finds none.
    for expected_requests in [2, 1] {
        let call = tokio::spawn(svc.clone().oneshot(request(&HedgeAllowance::default())));
        let mut responders = Vec::new();
        for _ in 0..expected_requests {
            responders.push(handle.next_request().await.unwrap().1);
        }
        advance(500 * MS).await;
        for r in responders {
            r.send_response(Response::new("ok"));
        }
        call.await.unwrap().unwrap();
    }
    assert_eq!(budget.available(), 0.0);
}

#[tokio::test(start_paused = true)]
async fn a_retryable_failure_waits_for_the_other_attempt() {
    let budget = RetryBudget::new(0.1, 5).unwrap();
    let (svc, mut handle) = mock::pair::<Request<Body>, Response<&'static str>>();
    let svc = Hedge::new(svc, warmed(budget.clone()));
    handle.allow(2);
    let call = tokio::spawn(svc.oneshot(request(&HedgeAllowance::default())));
    let (_, first) = handle.next_request().await.unwrap();
    let (_, second) = handle.next_request().await.unwrap();
    second.send_response(Response::builder().status(503).body("down").unwrap());
    tokio::task::yield_now().await;
    first.send_response(Response::new("up"));
    assert_eq!(*call.await.unwrap().unwrap().body(), "up");
}

#[tokio::test(start_paused = true)]
async fn no_hedge_before_the_window_has_samples() {
    let budget = RetryBudget::default();
    let (svc, mut handle) = mock::pair::<Request<Body>, Response<&'static str>>();
    let svc = Hedge::new(svc, HedgePolicy::new(budget, "psp", "GetCharge"));
    handle.allow(2);
    let call = tokio::spawn(svc.oneshot(request(&HedgeAllowance::default())));
    let (_, send) = handle.next_request().await.unwrap();
    advance(Duration::from_secs(5)).await;
    send.send_response(Response::new("late"));
    assert_eq!(*call.await.unwrap().unwrap().body(), "late");
}

/// Issue 15, item 5: while the destination's storm alarm is tripped a slow attempt is not
/// hedged (and no token is spent); once it clears, hedging resumes.
#[tokio::test(start_paused = true)]
async fn no_hedge_while_the_storm_alarm_is_tripped() {
    use crate::retry::{StormConfig, StormLevel};

    let budget = RetryBudget::new(0.1, 5).unwrap();
    let alarm = StormAlarm::new("psp", StormConfig::default());
    for _ in 0..10 {
        alarm.record_request();
        let _ = alarm.retry_wanted();
    }
    assert_eq!(alarm.level(), StormLevel::Tripped);
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let svc = {
        let sent = sent.clone();
        tower::service_fn(move |_r: Request<Body>| {
            sent.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok::<_, BoxError>(Response::new("slow"))
            }
        })
    };
    let svc = Hedge::new(
        svc,
        warmed(RetrySpend::new(budget.clone()).storm_alarm(Some(alarm.clone()))),
    );
    let response = svc
        .clone()
        .oneshot(request(&HedgeAllowance::default()))
        .await
        .unwrap();
    assert_eq!(*response.body(), "slow");
    assert_eq!(sent.load(Ordering::SeqCst), 1, "not hedged");
    assert_eq!(budget.available(), 5.0);

    // The storm leaves the window and calm traffic follows: hedged again.
    advance(Duration::from_secs(11)).await;
    for _ in 0..20 {
        alarm.record_request();
    }
    assert_eq!(alarm.level(), StormLevel::Calm);
    svc.oneshot(request(&HedgeAllowance::default()))
        .await
        .unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), 3, "hedged");
    assert_eq!(budget.available(), 4.0);
}

/// While the fleet's retry switch is off a slow attempt is not hedged (no token spent); on
/// again, it is.
#[tokio::test(start_paused = true)]
async fn no_hedge_while_the_retry_switch_is_off() {
    use crate::retry::{RetrySetting, RetrySwitch};

    let budget = RetryBudget::new(0.1, 5).unwrap();
    let switch = RetrySwitch::new();
    switch.set(RetrySetting::Off, "test");
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let svc = {
        let sent = sent.clone();
        tower::service_fn(move |_r: Request<Body>| {
            sent.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok::<_, BoxError>(Response::new("slow"))
            }
        })
    };
    let svc = Hedge::new(
        svc,
        warmed(RetrySpend::new(budget.clone()).retry_switch(Some(switch.clone()))),
    );
    svc.clone()
        .oneshot(request(&HedgeAllowance::default()))
        .await
        .unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), 1, "not hedged");
    assert_eq!(budget.available(), 5.0);

    switch.set(RetrySetting::On, "test");
    svc.oneshot(request(&HedgeAllowance::default()))
        .await
        .unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), 3, "hedged");
}

#[test]
fn try_hedge_at_pays_from_the_budget_and_records_latencies() {
    let budget = RetryBudget::new(0.0, 1).unwrap();
    let policy = HedgePolicy::new(budget, "psp", "GetCharge").quantile(0.5);
    assert_eq!(policy.delay(), None);
    for ms in 1..=HedgePolicy::MIN_SAMPLES as u32 {
        policy.record_latency(ms * MS);
    }
    assert_eq!(policy.delay(), Some(10 * MS), "the p50 of 1..=20 ms");
    let now = Instant::now();
    assert!(policy.try_hedge_at(now));
    assert!(!policy.try_hedge_at(now), "the one token is spent");
}

/// A hedge leaves the lower half of the budget's burst to retries: with 5 tokens, hedges stop
/// once fewer than 2.5 are left.
#[tokio::test(start_paused = true)]
async fn hedges_leave_half_the_burst_to_retries() {
    let budget = RetryBudget::new(0.1, 5).unwrap();
    let policy = warmed(budget.clone());
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let svc = {
        let sent = sent.clone();
        tower::service_fn(move |_r: Request<Body>| {
            sent.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok::<_, BoxError>(Response::new("slow"))
            }
        })
    };
    let svc = Hedge::new(svc, policy);
    for _ in 0..5 {
        svc.clone()
            .oneshot(request(&HedgeAllowance::default()))
            .await
            .unwrap();
    }
    // 5 calls: 3 hedged (5 -> 4 -> 3 -> 2 tokens), then none below 2.5.
    assert_eq!(sent.load(Ordering::SeqCst), 5 + 3);
    assert!(budget.available() >= 2.0, "{}", budget.available());
}

/// A fixed delay (a gRPC `hedgingDelay`) is the delay: the hedge goes out after exactly that
/// long, from the first call (no latency samples needed) and whatever the p95 says.
#[tokio::test(start_paused = true)]
async fn a_fixed_delay_hedges_after_exactly_that_delay() {
    for policy in [
        HedgePolicy::new(RetryBudget::new(0.1, 5).unwrap(), "psp", "GetCharge"),
        // p95 = 100 ms and a 300 ms floor: both ignored.
        warmed(RetryBudget::new(0.1, 5).unwrap()).min_delay(300 * MS),
    ] {
        let policy = policy.fixed_delay(Some(30 * MS));
        assert_eq!(policy.delay(), Some(30 * MS));
        assert_eq!(policy.min_hedge_delay(), 30 * MS);
        let sent = Arc::new(std::sync::Mutex::new(Vec::new()));
        let svc = {
            let sent = sent.clone();
            tower::service_fn(move |_r: Request<Body>| {
                let first = {
                    let mut sent = sent.lock().unwrap();
                    sent.push(Instant::now());
                    sent.len() == 1
                };
                async move {
                    if first {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    Ok::<_, BoxError>(Response::new("ok"))
                }
            })
        };
        let start = Instant::now();
        Hedge::new(svc, policy)
            .oneshot(request(&HedgeAllowance::default()))
            .await
            .unwrap();
        let sent = sent.lock().unwrap();
        assert_eq!(sent.len(), 2);
        assert_eq!(sent[1] - sent[0], 30 * MS);
        assert_eq!(start.elapsed(), 30 * MS);
    }
}

/// With gRPC's retry throttling, no hedge is sent once failures have taken half its tokens,
/// and a hedge takes none of them.
#[tokio::test(start_paused = true)]
async fn no_hedge_while_the_grpc_throttle_is_at_half() {
    use crate::retry::RetryThrottle;

    let throttle = RetryThrottle::new(4, 0.5).unwrap();
    let spend = RetrySpend::new(RetryBudget::unlimited()).retry_throttle(Some(throttle.clone()));
    let policy = HedgePolicy::new(spend, "psp", "GetCharge").fixed_delay(Some(10 * MS));
    let now = Instant::now();
    assert!(policy.try_hedge_at(now));
    assert_eq!(throttle.tokens(), 4.0, "a hedge takes no token");
    assert!(throttle.record_failure());
    assert!(!throttle.record_failure(), "2 of 4 left");
    assert!(!policy.try_hedge_at(now));
    throttle.record_success();
    assert!(policy.try_hedge_at(now));
}

/// A transport whose every send answers `status` after `after` (the first send after
/// `first`), recording when each was sent and its `grpc-previous-rpc-attempts`.
#[allow(clippy::type_complexity)]
fn timed(
    first: Duration,
    after: Duration,
    status: u16,
) -> (
    impl tower_service::Service<
        Request<Body>,
        Response = Response<&'static str>,
        Error = BoxError,
        Future = impl Send,
    > + Clone
    + Send
    + 'static,
    Arc<std::sync::Mutex<Vec<(Instant, Option<String>)>>>,
) {
    let sent = Arc::new(std::sync::Mutex::new(Vec::new()));
    let svc = {
        let sent = sent.clone();
        tower::service_fn(move |r: Request<Body>| {
            let n = {
                let mut sent = sent.lock().unwrap();
                sent.push((
                    Instant::now(),
                    r.headers()
                        .get(&GRPC_PREVIOUS_RPC_ATTEMPTS)
                        .map(|v| v.to_str().unwrap().to_owned()),
                ));
                sent.len()
            };
            async move {
                tokio::time::sleep(if n == 1 { first } else { after }).await;
                Ok::<_, BoxError>(Response::builder().status(status).body("answer").unwrap())
            }
        })
    };
    (svc, sent)
}

/// Up to `max_hedges` copies, each a delay after the one before, each paid for; the first
/// final answer wins.
#[tokio::test(start_paused = true)]
async fn up_to_max_hedges_go_out_a_delay_apart() {
    let budget = RetryBudget::new(0.1, 10).unwrap();
    let policy = HedgePolicy::new(budget.clone(), "psp", "GetCharge")
        .fixed_delay(Some(10 * MS))
        .hedges(3);
    let (svc, sent) = timed(Duration::from_secs(1), Duration::from_secs(1), 200);
    let start = Instant::now();
    let allowance = HedgeAllowance::default();
    Hedge::new(svc, policy)
        .oneshot(request(&allowance))
        .await
        .unwrap();
    // The first send answers first, at 1 s.
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    let sent = sent.lock().unwrap();
    let at: Vec<Duration> = sent.iter().map(|(t, _)| *t - start).collect();
    assert_eq!(at, [Duration::ZERO, 10 * MS, 20 * MS, 30 * MS]);
    let previous: Vec<Option<&str>> = sent.iter().map(|(_, p)| p.as_deref()).collect();
    assert_eq!(previous, [None, Some("1"), Some("2"), Some("3")]);
    assert_eq!(budget.available(), 7.0, "one token per hedge");
    assert!(!allowance.take_up_to(3), "the call's hedges are spent");
}

/// A failure that leaves the race open sends the next hedge at once, as gRPC does; when every
/// send fails, the last failure is the attempt's answer.
#[tokio::test(start_paused = true)]
async fn a_failed_send_brings_the_next_hedge_forward() {
    let policy = HedgePolicy::new(RetryBudget::new(0.1, 10).unwrap(), "psp", "GetCharge")
        .fixed_delay(Some(100 * MS))
        .hedges(2);
    // Every send fails with 503: the first after 150 ms, the others after 20 ms.
    let (svc, sent) = timed(150 * MS, 20 * MS, 503);
    let start = Instant::now();
    let response = Hedge::new(svc, policy)
        .oneshot(request(&HedgeAllowance::default()))
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    let sent = sent.lock().unwrap();
    let at: Vec<Duration> = sent.iter().map(|(t, _)| *t - start).collect();
    // Hedge 1 at 100 ms fails at 120 ms: hedge 2 goes out then, not at 200 ms.
    assert_eq!(at, [Duration::ZERO, 100 * MS, 120 * MS]);
    // Hedge 2 fails at 140 ms, the primary last, at 150 ms: the race ends with it.
    assert_eq!(start.elapsed(), 150 * MS);
}

#[test]
fn an_allowance_counts_the_hedges_of_a_call() {
    let allowance = HedgeAllowance::default();
    assert!(allowance.take_up_to(2));
    assert!(
        !allowance.clone().take(),
        "one taken: a call allowed one has none left"
    );
    assert!(allowance.take_up_to(2));
    assert!(!allowance.take_up_to(2));
}
