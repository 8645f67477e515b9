use super::*;
use crate::observe::{
    RPC_CLIENT_ATTEMPTS_TOTAL, RPC_CLIENT_REQUESTS_TOTAL, RPC_CLIENT_RETRIES_TOTAL,
};
use crate::retry::{Backoff, Jitter, RetryBudget, RetrySpend};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::time::sleep;

const MS: Duration = Duration::from_millis(1);

/// The same delay before every retry.
fn fixed(delay: Duration) -> Backoff {
    Backoff::new(delay, delay, Jitter::None, Duration::ZERO).unwrap()
}

fn policy() -> crate::retry::RetryPolicyBuilder {
    RetryPolicy::builder("psp", "Charge")
        .backoff(fixed(50 * MS))
        .spend(RetryBudget::new(0.1, 100).unwrap())
}

fn unavailable() -> Status {
    Status::new(Code::Unavailable, "down")
}

/// The first attempt takes 800 ms of a 1 s budget; the retry gets what is left, not a fresh
/// second, and is cut off exactly at the deadline.
#[tokio::test(start_paused = true)]
async fn retries_share_one_deadline_and_never_pass_it() {
    let start = Instant::now();
    let deadline = Deadline::after(Duration::from_secs(1));
    let policy = policy().build().unwrap();
    let seen = RefCell::new(Vec::new());
    let err = policy
        .execute(deadline, |a| {
            seen.borrow_mut()
                .push((a.number, a.deadline, start.elapsed()));
            async move {
                let work = if a.number == 1 {
                    800 * MS
                } else {
                    Duration::from_secs(10)
                };
                sleep(work).await;
                Err::<(), _>(unavailable())
            }
        })
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!((err.attempts, err.reason), (2, StopReason::Deadline));
    assert_eq!(err.last.code(), Code::DeadlineExceeded);
    assert_eq!(
        seen.into_inner(),
        [(1, deadline, Duration::ZERO), (2, deadline, 850 * MS)]
    );
}

#[test]
fn execute_future_is_send() {
    fn assert_send<T: Send>(_: &T) {}
    let policy = policy().build().unwrap();
    let call = CallInfo::new().key("k");
    let fut = policy.execute_with(&call, Deadline::after(MS), |_| async {
        Ok::<_, Status>(())
    });
    assert_send(&fut);
}

#[tokio::test(start_paused = true)]
async fn first_success_makes_one_attempt() {
    let policy = policy().build().unwrap();
    let mut calls = 0;
    let v = policy
        .execute(Deadline::after(Duration::from_secs(1)), |a| {
            calls += 1;
            async move { Ok::<_, Status>(a.number) }
        })
        .await
        .unwrap();
    assert_eq!((v, calls), (1, 1));
    assert_eq!(policy.spend().retry_budget().available(), 100.0);
}

#[tokio::test(start_paused = true)]
async fn sleep_is_skipped_when_delay_and_min_call_exceed_remaining() {
    // 60 ms spent, 40 ms left: a 50 ms backoff plus a 20 ms minimal call does not fit.
    let start = Instant::now();
    let policy = policy().build().unwrap();
    let err = policy
        .execute(Deadline::after(100 * MS), |_| async {
            sleep(60 * MS).await;
            Err::<(), _>(unavailable())
        })
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::Deadline));
    assert_eq!(err.last.code(), Code::Unavailable);
    assert_eq!(start.elapsed(), 60 * MS, "stopped without sleeping");
    assert_eq!(
        policy.spend().retry_budget().available(),
        100.0,
        "no token spent"
    );
}

#[tokio::test(start_paused = true)]
async fn retry_is_sent_when_delay_and_min_call_just_fit() {
    // 60 ms spent, 70 ms left: exactly 50 ms backoff + 20 ms minimal call.
    let start = Instant::now();
    let policy = policy().build().unwrap();
    let mut starts = Vec::new();
    let v = policy
        .execute(Deadline::after(130 * MS), |a| {
            starts.push(start.elapsed());
            async move {
                if a.number == 1 {
                    sleep(60 * MS).await;
                    Err(unavailable())
                } else {
                    Ok(a.number)
                }
            }
        })
        .await
        .unwrap();
    assert_eq!(v, 2);
    assert_eq!(starts, [Duration::ZERO, 110 * MS]);
}

#[tokio::test(start_paused = true)]
async fn pushback_is_honoured_with_jitter_bounds() {
    let policy = policy().build().unwrap();
    let mut gaps = Vec::new();
    for _ in 0..50 {
        let failed_at = RefCell::new(None);
        let gap = RefCell::new(None);
        policy
            .execute(Deadline::after(Duration::from_secs(10)), |a| {
                if a.number == 2 {
                    *gap.borrow_mut() = failed_at.borrow().map(|t: Instant| t.elapsed());
                }
                let failed_at = &failed_at;
                async move {
                    if a.number == 1 {
                        *failed_at.borrow_mut() = Some(Instant::now());
                        Err(Status::new(Code::ResourceExhausted, "quota")
                            .with_pushback(Duration::from_secs(1)))
                    } else {
                        Ok(())
                    }
                }
            })
            .await
            .unwrap();
        gaps.push(gap.into_inner().expect("a second attempt was made"));
    }
    for gap in &gaps {
        assert!(
            *gap >= 800 * MS && *gap <= 1_200 * MS,
            "waited {gap:?} after a 1 s pushback"
        );
    }
    assert!(gaps.iter().any(|g| *g != gaps[0]), "pushback not jittered");
}

#[tokio::test(start_paused = true)]
async fn zero_pushback_still_waits() {
    let start = Instant::now();
    let policy = policy().build().unwrap();
    let mut starts = Vec::new();
    policy
        .execute(Deadline::after(Duration::from_secs(1)), |a| {
            starts.push(start.elapsed());
            async move {
                if a.number == 1 {
                    Err(Status::overloaded(Duration::ZERO))
                } else {
                    Ok(())
                }
            }
        })
        .await
        .unwrap();
    assert!(
        starts[1] >= policy.backoff().floor() && !starts[1].is_zero(),
        "{starts:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn pushback_past_the_deadline_stops_with_pushback() {
    let start = Instant::now();
    let policy = policy().build().unwrap();
    let err = policy
        .execute(Deadline::after(Duration::from_secs(2)), |_| async {
            Err::<(), _>(Status::overloaded(Duration::from_secs(5)))
        })
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::Pushback));
    assert_eq!(err.last.pushback(), Some(Duration::from_secs(5)));
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(policy.spend().retry_budget().available(), 100.0);
}

#[tokio::test(start_paused = true)]
async fn huge_pushback_does_not_overflow() {
    let policy = policy().build().unwrap();
    let err = policy
        .execute(Deadline::after(Duration::from_secs(2)), |_| async {
            Err::<(), _>(Status::overloaded(Duration::MAX))
        })
        .await
        .unwrap_err();
    assert_eq!(err.reason, StopReason::Pushback);
}

#[tokio::test(start_paused = true)]
async fn budget_exhaustion_stops_with_the_reason() {
    let policy = policy()
        .spend(RetryBudget::new(0.0, 1).unwrap())
        .build()
        .unwrap();
    let always_down = |_| async { Err::<(), _>(unavailable()) };
    let deadline = || Deadline::after(Duration::from_secs(5));

    let err = policy.execute(deadline(), always_down).await.unwrap_err();
    assert_eq!((err.attempts, err.reason), (2, StopReason::BudgetExhausted));
    assert_eq!(err.last.code(), Code::Unavailable);

    let err = policy.execute(deadline(), always_down).await.unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::BudgetExhausted));
}

/// The fleet's switch: off stops every retry with `switched_off` (the storm alarm still
/// counting what was asked for), a budget lowers what each request deposits, and on again
/// retries as before.
#[tokio::test(start_paused = true)]
async fn the_retry_switch_stops_or_lowers_retries_and_lets_them_go_again() {
    use crate::retry::{RetrySetting, RetrySwitch, StormAlarm, StormConfig};
    let switch = RetrySwitch::new();
    let alarm = StormAlarm::new("psp", StormConfig::default());
    let budget = RetryBudget::new(0.5, 0).unwrap();
    let policy = policy()
        .spend(
            RetrySpend::new(budget.clone())
                .storm_alarm(Some(alarm.clone()))
                .retry_switch(Some(switch.clone())),
        )
        .max_attempts(2)
        .build()
        .unwrap();
    let fails_then_succeeds = |a: Attempt| async move {
        if a.number == 1 {
            Err(unavailable())
        } else {
            Ok(())
        }
    };
    let deadline = || Deadline::after(Duration::from_secs(5));

    switch.set(RetrySetting::Off, "test");
    let before = budget.available();
    let err = policy
        .execute(deadline(), fails_then_succeeds)
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::SwitchedOff));
    assert_eq!(alarm.ratio(), 1.0, "the retry asked for is counted");
    assert_eq!(budget.available(), before, "off deposits nothing");

    // A budget of 0.1 below the destination's 0.5: each request deposits 0.1.
    switch.set(RetrySetting::Ratio(0.1), "test");
    while budget.try_withdraw() {}
    for _ in 0..5 {
        let _ = policy
            .execute(deadline(), |_| async { Ok::<_, Status>(()) })
            .await;
    }
    assert!(
        (budget.available() - 0.5).abs() < 1e-6,
        "{}",
        budget.available()
    );

    switch.set(RetrySetting::On, "test");
    policy
        .execute(deadline(), |_| async { Ok::<_, Status>(()) })
        .await
        .unwrap();
    assert!(
        (budget.available() - 1.0).abs() < 1e-6,
        "{}",
        budget.available()
    );
    policy
        .execute(deadline(), fails_then_succeeds)
        .await
        .expect("retried once the switch is on");
}

#[tokio::test(start_paused = true)]
async fn codes_outside_the_retryable_list_stop_as_non_retryable() {
    let policy = policy()
        .retryable_codes([Code::Unavailable])
        .build()
        .unwrap();
    let err = policy
        .execute(Deadline::after(Duration::from_secs(5)), |_| async {
            Err::<(), _>(Status::new(Code::Aborted, "busy").with_pushback(MS))
        })
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::NonRetryable));
    let err = policy
        .execute(Deadline::after(Duration::from_secs(5)), |_| async {
            Err::<(), _>(unavailable())
        })
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (3, StopReason::MaxAttempts));
}

#[tokio::test(start_paused = true)]
async fn an_open_circuit_stops_with_circuit_open() {
    let policy = policy().build().unwrap();
    let err = policy
        .execute(Deadline::after(Duration::from_secs(5)), |_| async {
            Err::<(), _>(unavailable().with_problem(problem::CIRCUIT_OPEN))
        })
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::CircuitOpen));
    assert_eq!(policy.spend().retry_budget().available(), 100.0);
}

#[tokio::test(start_paused = true)]
async fn non_retryable_stops_at_once() {
    let start = Instant::now();
    let policy = policy().build().unwrap();
    for code in Code::ALL {
        if code == Code::Ok || code.retry_class() != RetryClass::Fatal {
            continue;
        }
        let mut calls = 0;
        let err = policy
            .execute(Deadline::after(Duration::from_secs(1)), |_| {
                calls += 1;
                async move { Err::<(), _>(Status::new(code, "no")) }
            })
            .await
            .unwrap_err();
        assert_eq!((calls, err.attempts), (1, 1), "{code}");
        assert_eq!(err.reason, StopReason::NonRetryable, "{code}");
        assert_eq!(err.last.code(), code);
    }
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(policy.spend().retry_budget().available(), 100.0);
}

#[tokio::test(start_paused = true)]
async fn timeout_is_retried_only_with_a_key() {
    let timed_out_once = |a: Attempt| async move {
        if a.number == 1 {
            Err(Status::new(Code::DeadlineExceeded, "upstream gave up"))
        } else {
            Ok(a.number)
        }
    };
    let unkeyed = policy().build().unwrap();
    let err = unkeyed
        .execute(Deadline::after(Duration::from_secs(1)), timed_out_once)
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::NonRetryable));

    let keyed = policy().keyed(true).build().unwrap();
    let v = keyed
        .execute(Deadline::after(Duration::from_secs(1)), timed_out_once)
        .await
        .unwrap();
    assert_eq!(v, 2);
}

#[tokio::test(start_paused = true)]
async fn max_attempts_stops_after_the_last_attempt() {
    for max in 1..=5 {
        let policy = policy().max_attempts(max).build().unwrap();
        let mut numbers = Vec::new();
        let err = policy
            .execute(Deadline::after(Duration::from_secs(5)), |a| {
                numbers.push(a.number);
                async { Err::<(), _>(unavailable()) }
            })
            .await
            .unwrap_err();
        assert_eq!((err.attempts, err.reason), (max, StopReason::MaxAttempts));
        assert_eq!(numbers, (1..=max).collect::<Vec<_>>());
        let spent = 100.0 - policy.spend().retry_budget().available();
        assert!((spent - f64::from(max - 1)).abs() < 0.2, "{spent} tokens");
    }
}

#[tokio::test(start_paused = true)]
async fn expired_deadline_makes_no_attempt() {
    let deadline = Deadline::after(10 * MS);
    sleep(10 * MS).await;
    let policy = policy().build().unwrap();
    let mut calls = 0;
    let err = policy
        .execute(deadline, |_| {
            calls += 1;
            async { Ok::<_, Status>(()) }
        })
        .await
        .unwrap_err();
    assert_eq!(calls, 0);
    assert_eq!((err.attempts, err.reason), (0, StopReason::Deadline));
    assert_eq!(err.last.code(), Code::DeadlineExceeded);
}

#[tokio::test(start_paused = true)]
async fn backoff_grows_between_attempts() {
    let start = Instant::now();
    let backoff = Backoff::new(
        100 * MS,
        Duration::from_secs(2),
        Jitter::None,
        Duration::ZERO,
    )
    .unwrap();
    let policy = policy().backoff(backoff).max_attempts(4).build().unwrap();
    let mut starts = Vec::new();
    let _ = policy
        .execute(Deadline::after(Duration::from_secs(5)), |_| {
            starts.push(start.elapsed());
            async { Err::<(), _>(unavailable()) }
        })
        .await;
    assert_eq!(starts, [0, 100, 300, 700].map(|ms| ms * MS));
}

/// Retries without a budget: a dependency that fails every request must not see
/// `max_attempts` times its load. With the budget, over N logical requests, retries / N
/// stays within ratio + burst / N; without it every request retries to the maximum.
#[tokio::test(start_paused = true)]
async fn retries_without_a_budget() {
    const N: u32 = 1_000;
    let (ratio, burst) = (0.1, 20);

    async fn run(policy: &RetryPolicy) -> u32 {
        let mut attempts = 0;
        for _ in 0..N {
            let _ = policy
                .execute(Deadline::after(Duration::from_secs(10)), |_| {
                    attempts += 1;
                    async { Err::<(), _>(unavailable()) }
                })
                .await;
        }
        attempts - N
    }

    let budgeted = policy()
        .spend(RetryBudget::new(ratio, burst).unwrap())
        .build()
        .unwrap();
    let retries = run(&budgeted).await;
    let per_request = f64::from(retries) / f64::from(N);
    assert!(
        per_request <= ratio + f64::from(burst) / f64::from(N),
        "{retries} retries for {N} requests"
    );
    assert!(retries >= burst, "the burst is usable: {retries}");

    // The accident: a budget that never runs out multiplies load by max_attempts.
    let unbudgeted = policy()
        .spend(RetryBudget::new(1.0, u32::MAX).unwrap())
        .build()
        .unwrap();
    assert_eq!(run(&unbudgeted).await, 2 * N);
}

type Labels = Vec<(String, String)>;

/// Counters by name and labels, for asserting what the executor reports.
#[derive(Debug, Default)]
struct Counters(Mutex<Vec<(String, Labels, Arc<AtomicU64>)>>);

impl Counters {
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let all = self.0.lock().unwrap();
        all.iter()
            .filter(|(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, c)| c.load(Ordering::Relaxed))
            .sum()
    }
}

impl metrics::Recorder for Counters {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let labels: Labels = key
            .labels()
            .map(|l| (l.key().to_string(), l.value().to_string()))
            .collect();
        let mut all = self.0.lock().unwrap();
        let counter = match all.iter().find(|(n, l, _)| n == key.name() && *l == labels) {
            Some((_, _, c)) => Arc::clone(c),
            None => {
                let c = Arc::new(AtomicU64::new(0));
                all.push((key.name().to_string(), labels, Arc::clone(&c)));
                c
            }
        };
        metrics::Counter::from_arc(counter)
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

type Fields = BTreeMap<String, String>;

/// Events with their fields, for asserting what the executor logs.
#[derive(Debug, Clone, Default)]
struct Events(Arc<Mutex<Vec<Fields>>>);

struct Visitor<'a>(&'a mut Fields);

impl tracing::field::Visit for Visitor<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl tracing::Subscriber for Events {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields::new();
        event.record(&mut Visitor(&mut fields));
        self.0.lock().unwrap().push(fields);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[tokio::test(start_paused = true)]
async fn attempts_retries_and_stops_are_counted_and_logged() {
    let counters = Counters::default();
    let _metrics = metrics::set_default_local_recorder(&counters);
    let events = Events::default();
    let _tracing = tracing::subscriber::set_default(events.clone());

    let policy = policy().build().unwrap();
    let call = CallInfo::new()
        .key("pay-o-8812")
        .peer("10.2.7.11:8443")
        .trace_id("d7c1e2");
    let err = policy
        .execute_with(&call, Deadline::after(Duration::from_secs(1)), |_| async {
            Err::<(), _>(unavailable())
        })
        .await
        .unwrap_err();
    assert_eq!(err.reason, StopReason::MaxAttempts);
    policy
        .execute(Deadline::after(Duration::from_secs(1)), |_| async {
            Ok::<_, Status>(())
        })
        .await
        .unwrap();

    let c = |name, labels: &[(&str, &str)]| counters.get(name, labels);
    let who = [("service", "psp"), ("method", "Charge")];
    assert_eq!(c(RPC_CLIENT_REQUESTS_TOTAL, &who), 2);
    for (attempt, outcome, n) in [
        ("1", "retryable", 1),
        ("1", "ok", 1),
        ("2", "retryable", 1),
        ("3", "retryable", 1),
    ] {
        let labels = [who[0], who[1], ("attempt", attempt), ("outcome", outcome)];
        assert_eq!(
            c(RPC_CLIENT_ATTEMPTS_TOTAL, &labels),
            n,
            "{attempt} {outcome}"
        );
    }
    assert_eq!(c(RPC_CLIENT_RETRIES_TOTAL, &who), 2);
    let stop = [who[0], who[1], ("reason", "max_attempts")];
    assert_eq!(c(RPC_CLIENT_RETRY_STOPS_TOTAL, &stop), 1);
    assert_eq!(c(RPC_CLIENT_RETRY_STOPS_TOTAL, &who), 1);
    for (name, labels, _) in counters.0.lock().unwrap().iter() {
        let keys: Vec<&str> = labels.iter().map(|(k, _)| k.as_str()).collect();
        assert!(
            keys.contains(&"service") && keys.contains(&"method"),
            "{name}: {keys:?}"
        );
        assert!(
            labels
                .iter()
                .all(|(_, v)| v != "pay-o-8812" && v != "d7c1e2"),
            "{name} has a per-request label: {labels:?}"
        );
    }

    let events = events.0.lock().unwrap();
    let attempts: Vec<&Fields> = events
        .iter()
        .filter(|e| e.get("event").map(String::as_str) == Some("rpc_attempt"))
        .collect();
    assert_eq!(attempts.len(), 4);
    let first = attempts[0];
    for (field, value) in [
        ("method", "Charge"),
        ("idempotency_key", "pay-o-8812"),
        ("attempt", "1"),
        ("outcome", "retryable"),
        ("deadline_remaining_ms", "1000"),
        ("peer", "10.2.7.11:8443"),
        ("trace_id", "d7c1e2"),
    ] {
        assert_eq!(first.get(field).map(String::as_str), Some(value), "{field}");
    }
    let keys: Vec<_> = attempts[..3]
        .iter()
        .map(|e| e["idempotency_key"].as_str())
        .collect();
    assert_eq!(keys, ["pay-o-8812"; 3], "one key across the attempts");
    assert!(!attempts[3].contains_key("idempotency_key"));
    let stopped: Vec<&Fields> = events
        .iter()
        .filter(|e| e.get("event").map(String::as_str) == Some("rpc_retry_stopped"))
        .collect();
    assert_eq!(stopped.len(), 1);
    assert_eq!(stopped[0]["reason"], "max_attempts");
    assert_eq!(stopped[0]["attempts"], "3");
}

/// Issue 15, item 5: a tripped storm alarm stops the retry with `storm`, in the error, the
/// stops metric and the last `rpc_attempt` event, with one `rpc_storm_alarm` event when it
/// trips; no budget token is spent on the retry not sent.
#[tokio::test(start_paused = true)]
async fn a_tripped_storm_alarm_stops_retries_with_storm() {
    use crate::retry::{StormAlarm, StormConfig, StormLevel};

    let counters = Counters::default();
    let _metrics = metrics::set_default_local_recorder(&counters);
    let events = Events::default();
    let _tracing = tracing::subscriber::set_default(events.clone());

    let alarm = StormAlarm::new("psp", StormConfig::default());
    let budget = RetryBudget::new(0.1, 100).unwrap();
    let policy = policy()
        .spend(RetrySpend::new(budget.clone()).storm_alarm(Some(alarm.clone())))
        .build()
        .unwrap();
    let fail = |_| async { Err::<(), _>(unavailable()) };
    // Four calls each make three attempts (two retries): 8 / 4, but too few to judge.
    for _ in 0..4 {
        let err = policy
            .execute(Deadline::after(Duration::from_secs(1)), fail)
            .await
            .unwrap_err();
        assert_eq!(err.reason, StopReason::MaxAttempts);
    }
    assert_eq!(alarm.level(), StormLevel::Calm);
    // Five more logical requests: the retry the tenth asks for trips the alarm.
    for _ in 0..5 {
        alarm.record_request();
    }
    let tokens = budget.available();
    let err = policy
        .execute(Deadline::after(Duration::from_secs(1)), fail)
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::Storm));
    assert_eq!(alarm.level(), StormLevel::Tripped);
    assert!(
        budget.available() >= tokens,
        "no token spent on a retry not sent"
    );

    let stop = [
        ("service", "psp"),
        ("method", "Charge"),
        ("reason", "storm"),
    ];
    assert_eq!(counters.get(RPC_CLIENT_RETRY_STOPS_TOTAL, &stop), 1);
    let events = events.0.lock().unwrap();
    let last_attempt = events
        .iter()
        .rev()
        .find(|e| e.get("event").map(String::as_str) == Some("rpc_attempt"))
        .unwrap();
    assert_eq!(last_attempt["stop_reason"], "storm");
    let alarms: Vec<&Fields> = events
        .iter()
        .filter(|e| e.get("event").map(String::as_str) == Some("rpc_storm_alarm"))
        .collect();
    assert_eq!(alarms.len(), 1, "{alarms:?}");
    assert_eq!(alarms[0]["level"], "tripped");
}

/// Issue 15, item 5: an attempt the adaptive throttle rejects is never made: the call
/// ends with `throttled`, zero attempts and outcome `rejected`; it is counted as a logical
/// request and a stop, never as an attempt (nor logged as one).
#[tokio::test(start_paused = true)]
async fn a_throttled_attempt_is_not_sent() {
    use crate::retry::AdaptiveThrottle;

    let counters = Counters::default();
    let _metrics = metrics::set_default_local_recorder(&counters);
    let events = Events::default();
    let _tracing = tracing::subscriber::set_default(events.clone());
    let throttle = AdaptiveThrottle::default();
    // The server refused 100 attempts: the next is rejected with probability 100/101.
    for _ in 0..100 {
        throttle.record_request();
    }
    let policy = policy()
        .spend(
            RetrySpend::new(RetryBudget::new(0.1, 100).unwrap())
                .throttle(Some(throttle.clone().seeded(1))),
        )
        .build()
        .unwrap();
    let sent = AtomicU64::new(0);
    let err = policy
        .execute(Deadline::after(Duration::from_secs(1)), |_| {
            sent.fetch_add(1, Ordering::Relaxed);
            async { Ok::<_, Status>(()) }
        })
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (0, StopReason::Throttled));
    assert_eq!(err.last.outcome(), Outcome::Rejected);
    assert_eq!(sent.load(Ordering::Relaxed), 0);
    let who = [("service", "psp"), ("method", "Charge")];
    assert_eq!(counters.get(RPC_CLIENT_REQUESTS_TOTAL, &who), 1);
    assert_eq!(counters.get(RPC_CLIENT_ATTEMPTS_TOTAL, &who), 0);
    let stop = [who[0], who[1], ("reason", "throttled")];
    assert_eq!(counters.get(RPC_CLIENT_RETRY_STOPS_TOTAL, &stop), 1);
    let logged: Vec<String> = events
        .0
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| e.get("event").cloned())
        .collect();
    assert_eq!(logged, ["rpc_retry_stopped"]);

    // Accepted answers bring the probability back to zero: every call goes out.
    for _ in 0..100 {
        throttle.record_accept();
    }
    for _ in 0..10 {
        policy
            .execute(Deadline::after(Duration::from_secs(1)), |_| {
                sent.fetch_add(1, Ordering::Relaxed);
                async { Ok::<_, Status>(()) }
            })
            .await
            .unwrap();
    }
    assert_eq!(sent.load(Ordering::Relaxed), 10);
}

/// gRPC's retry throttling drives the retries: each failure with a retried code takes a
/// token, the last attempt's too; once a failure leaves half the tokens or fewer the call
/// stops with `budget_exhausted`; successes give back the ratio and retries resume.
#[tokio::test(start_paused = true)]
async fn a_grpc_retry_throttle_stops_retries_below_half_its_tokens() {
    use crate::retry::RetryThrottle;

    let throttle = RetryThrottle::new(10, 0.5).unwrap();
    let policy = policy()
        .spend(
            RetrySpend::new(RetryBudget::new(1.0, 1_000).unwrap())
                .retry_throttle(Some(throttle.clone())),
        )
        .build()
        .unwrap();
    let down = |_| async { Err::<(), _>(unavailable()) };
    // 10 tokens: three failures (7 left), exhausted at max attempts.
    let err = policy
        .execute(Deadline::after(Duration::from_secs(1)), down)
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (3, StopReason::MaxAttempts));
    assert_eq!(throttle.tokens(), 7.0);
    // 7 -> 6 (retry) -> 5 (half: no retry).
    let err = policy
        .execute(Deadline::after(Duration::from_secs(1)), down)
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (2, StopReason::BudgetExhausted));
    assert_eq!(throttle.tokens(), 5.0);
    // A fatal answer is not a failure the throttle counts.
    let fatal = |_| async { Err::<(), _>(Status::new(Code::InvalidArgument, "bad")) };
    let err = policy
        .execute(Deadline::after(Duration::from_secs(1)), fatal)
        .await
        .unwrap_err();
    assert_eq!(err.reason, StopReason::NonRetryable);
    assert_eq!(throttle.tokens(), 5.0);
    // Two successes: 6 tokens, so the next failure (5.0 left) is not retried, but after
    // one more success it is.
    for _ in 0..2 {
        policy
            .execute(Deadline::after(Duration::from_secs(1)), |_| async {
                Ok::<_, Status>(())
            })
            .await
            .unwrap();
    }
    assert_eq!(throttle.tokens(), 6.0);
    let flaky = |a: Attempt| async move {
        if a.number == 1 {
            Err(unavailable())
        } else {
            Ok(())
        }
    };
    let err = policy
        .execute(Deadline::after(Duration::from_secs(1)), flaky)
        .await
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::BudgetExhausted));
    assert_eq!(throttle.tokens(), 5.0);
    // Three successes (6.5): the failure leaves 5.5, so it is retried, and the retry's
    // success gives back half a token.
    for _ in 0..3 {
        policy
            .execute(Deadline::after(Duration::from_secs(1)), |_| async {
                Ok::<_, Status>(())
            })
            .await
            .unwrap();
    }
    policy
        .execute(Deadline::after(Duration::from_secs(1)), flaky)
        .await
        .unwrap();
    assert_eq!(throttle.tokens(), 6.0);

    // A method sent once says nothing to the throttle, as in gRPC.
    let once = policy.single_attempt();
    once.execute(Deadline::after(Duration::from_secs(1)), down)
        .await
        .unwrap_err();
    once.execute(Deadline::after(Duration::from_secs(1)), |_| async {
        Ok::<_, Status>(())
    })
    .await
    .unwrap();
    assert_eq!(throttle.tokens(), 6.0);
}

/// The bookkeeping steps run on a virtual clock with a seeded generator: no clock is read
/// and the same seed gives the same waits.
#[test]
fn attempts_run_on_a_virtual_clock_and_a_seeded_generator() {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    let policy = policy().backoff(Backoff::default()).build().unwrap();
    let call = CallInfo::new();
    let run = |seed| {
        let origin = Instant::now() + Duration::from_secs(3_600);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut attempts = policy.attempts(Deadline::at(origin + Duration::from_secs(10)));
        let mut now = origin;
        let mut waits = Vec::new();
        loop {
            let (_, remaining) = match attempts.start(&policy, &call, now) {
                Ok(started) => started,
                Err(error) => return (waits, error.reason),
            };
            let status = unavailable();
            match attempts.failed_at(&policy, &call, status, remaining, MS, now, &mut rng) {
                Ok(wait) => {
                    waits.push(wait);
                    now += wait;
                }
                Err(error) => return (waits, error.reason),
            }
        }
    };
    let (waits, reason) = run(1);
    assert_eq!(reason, StopReason::MaxAttempts);
    assert_eq!(waits.len(), 2);
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));

    // Cut off at the deadline: no retry, whatever the budget.
    let origin = Instant::now() + Duration::from_secs(3_600);
    let deadline = origin + Duration::from_secs(1);
    let mut attempts = policy.attempts(Deadline::at(deadline));
    let (_, remaining) = attempts.start(&policy, &call, origin).unwrap();
    let mut rng = StdRng::seed_from_u64(1);
    let err = attempts
        .cut_off_at(
            &policy,
            &call,
            remaining,
            Duration::from_secs(1),
            deadline,
            &mut rng,
        )
        .unwrap_err();
    assert_eq!((err.attempts, err.reason), (1, StopReason::Deadline));
    assert_eq!(attempts.sent(), 1);
}
