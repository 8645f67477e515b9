//! Every behaviour with explicit instants: no clock is read, nothing sleeps.

use super::*;

const MS: Duration = Duration::from_millis(1);
const LONG: Duration = Duration::from_secs(10);

fn config() -> QueueConfig {
    QueueConfig {
        max_waiters: 8,
        max_bytes: 8 << 10,
        min_service: 10 * MS,
        ..QueueConfig::default()
    }
}

fn fifo() -> QueueConfig {
    QueueConfig {
        discipline: Discipline::Fifo,
        ..config()
    }
}

/// A queue in front of 100 slots: gaps between finishing requests far below the 5 ms target.
fn queue(config: QueueConfig) -> AdmissionQueue<u32> {
    let mut q = AdmissionQueue::new(config);
    q.set_slots(100);
    q
}

/// Pops everything poppable at `now`, returning the items served.
fn drain(q: &mut AdmissionQueue<u32>, now: Instant) -> Vec<u32> {
    std::iter::from_fn(|| q.pop(now).map(|w| w.item)).collect()
}

fn reasons(q: &mut AdmissionQueue<u32>) -> Vec<(u32, DropReason)> {
    q.take_dropped()
}

#[test]
fn work_that_cannot_finish_in_time_is_refused_at_enqueue() {
    let mut q = queue(config());
    let t0 = Instant::now();
    let refused = q.push(t0, "a", t0 + 10 * MS, 0, 1).unwrap_err();
    assert_eq!(
        (refused.reason, refused.item),
        (DropReason::Deadline, 1),
        "exactly enough to be served leaves nothing to wait with"
    );
    assert!(q.push(t0, "a", t0 + 11 * MS, 0, 2).is_ok());

    // Served requests now take 100 ms: a 50 ms budget no longer covers one.
    for _ in 0..50 {
        q.on_service(100 * MS);
    }
    assert!(q.expected_service() > 90 * MS, "{:?}", q.expected_service());
    let refused = q.push(t0, "a", t0 + 50 * MS, 0, 3).unwrap_err();
    assert_eq!(refused.reason, DropReason::Deadline);
    assert_eq!(q.len(), 1);
}

#[test]
fn expired_work_never_runs() {
    for cfg in [config(), fifo()] {
        let mut q = queue(cfg.clone());
        let t0 = Instant::now();
        q.push(t0, "a", t0 + 40 * MS, 0, 1).unwrap();
        q.push(t0, "a", t0 + LONG, 0, 2).unwrap();
        // 31 ms later the first has 9 ms left, less than the 10 ms serving takes.
        let now = t0 + 31 * MS;
        assert_eq!(drain(&mut q, now), vec![2], "{:?}", cfg.discipline);
        assert_eq!(reasons(&mut q), vec![(1, DropReason::Deadline)]);
        assert!(q.is_empty() && q.bytes() == 0);
    }
}

#[test]
fn a_waiter_checks_itself_out_at_its_deadline() {
    let mut q = queue(fifo());
    let t0 = Instant::now();
    let ticket = q.push(t0, "a", t0 + 50 * MS, 0, 1).unwrap();
    let at = q.next_check(ticket, t0).unwrap();
    assert_eq!(at, t0 + 40 * MS, "deadline minus the expected service time");
    assert!(q.check(ticket, at - MS).is_none(), "may still wait");
    assert_eq!(q.check(ticket, at), Some((1, DropReason::Deadline)));
    assert!(q.is_empty());
    assert_eq!(q.next_check(ticket, at), None);
}

#[test]
fn without_a_standing_queue_waiters_are_served_first_come_first_served_within_the_interval() {
    let mut q = queue(config());
    let t0 = Instant::now();
    let tickets: Vec<_> = (0..3)
        .map(|i| q.push(t0, "a", t0 + LONG, 0, i).unwrap())
        .collect();
    // 50 ms is past the 5 ms target but within the 100 ms interval: nobody is dropped.
    assert!(q.check(tickets[0], t0 + 50 * MS).is_none());
    assert!(!q.is_overloaded());
    assert_eq!(q.pop(t0 + 50 * MS).unwrap().item, 0);
    assert_eq!(q.pop(t0 + 51 * MS).unwrap().item, 1);
    // A waiter may wait no longer than the interval.
    assert_eq!(
        q.check(tickets[2], t0 + 100 * MS),
        Some((2, DropReason::Sojourn))
    );
}

#[test]
fn sojourn_drops_start_when_a_standing_queue_forms_and_stop_when_it_drains() {
    let mut q = queue(config());
    let t0 = Instant::now();
    // Waiters queue up and the ones served have waited 20 ms: beyond the 5 ms target.
    for i in 0..6 {
        q.push(t0, "a", t0 + LONG, 0, i).unwrap();
    }
    assert_eq!(q.pop(t0 + 20 * MS).unwrap().sojourn, 20 * MS);
    assert!(!q.is_overloaded(), "decided once the interval ends");
    let late = q.push(t0 + 99 * MS, "a", t0 + LONG, 0, 10).unwrap();
    // The interval ends: its least delay was 20 ms, above the target.
    q.push(t0 + 101 * MS, "a", t0 + LONG, 0, 11).unwrap();
    assert!(q.is_overloaded());
    // Older than the target: dropped, whether checked or reached.
    assert_eq!(q.check(late, t0 + 103 * MS), None, "4 ms old, not yet");
    assert_eq!(
        q.check(late, t0 + 104 * MS),
        Some((10, DropReason::Sojourn))
    );
    // Served newest first: 11 is 4 ms old and goes; the others are old and are dropped.
    let served = q.pop(t0 + 105 * MS).unwrap();
    assert_eq!((served.item, served.sojourn), (11, 4 * MS));
    assert_eq!(q.pop(t0 + 105 * MS).map(|w| w.item), None);
    let dropped = reasons(&mut q);
    assert_eq!(dropped.len(), 5);
    assert!(dropped.iter().all(|(_, r)| *r == DropReason::Sojourn));
    assert!(
        q.is_overloaded(),
        "dropping stale waiters is no sign of spare capacity"
    );

    // The queue drained and a free slot found nobody waiting: the next interval ends the
    // overload, and a waiter may again wait up to the interval.
    q.admitted_directly(t0 + 150 * MS, "a");
    q.admitted_directly(t0 + 210 * MS, "a");
    assert!(!q.is_overloaded());
    let t = q.push(t0 + 210 * MS, "a", t0 + LONG, 0, 20).unwrap();
    assert_eq!(q.check(t, t0 + 250 * MS), None);
}

#[test]
fn a_stalled_service_is_a_standing_queue_too() {
    let mut q = queue(config());
    let t0 = Instant::now();
    q.push(t0, "a", t0 + LONG, 0, 1).unwrap();
    let young = q.push(t0 + 95 * MS, "a", t0 + LONG, 0, 2).unwrap();
    assert_eq!(q.next_check(young, t0 + 95 * MS), Some(t0 + 100 * MS));
    // A whole interval with waiters throughout and nobody served: overloaded, so 6 ms is too
    // long a wait.
    assert_eq!(
        q.check(young, t0 + 101 * MS),
        Some((2, DropReason::Sojourn))
    );
    assert!(q.is_overloaded());
}

#[test]
fn newest_first_while_a_standing_queue_exceeds_the_target_oldest_first_once_the_door_holds() {
    // One slot, 10 ms per request: the target is two gaps (20 ms), which two waiters fill.
    let mut q = AdmissionQueue::new(config());
    q.set_slots(1);
    let t0 = Instant::now();
    for (i, at) in [0, 10, 20, 90].into_iter().enumerate() {
        q.push(t0 + at * MS, "a", t0 + LONG, 0, i as u32).unwrap();
    }
    assert_eq!(q.pop(t0 + 30 * MS).unwrap().item, 0, "FIFO");
    // The interval's least delay (30 ms) exceeded the 20 ms target: a standing queue of three,
    // more than the target allows: newest first.
    let served = q.pop(t0 + 101 * MS).unwrap();
    assert!(q.is_overloaded());
    assert_eq!((served.item, served.sojourn), (3, 11 * MS), "LIFO");
    // The rest waited beyond the target: dropped on the way.
    assert_eq!(q.pop(t0 + 101 * MS).map(|w| w.item), None);
    assert_eq!(
        reasons(&mut q),
        vec![(1, DropReason::Sojourn), (2, DropReason::Sojourn)]
    );

    // From now on the door keeps the line within the target: two get in, the third is
    // refused at once.
    let first = q.push(t0 + 102 * MS, "a", t0 + LONG, 0, 4).unwrap();
    let second = q.push(t0 + 103 * MS, "a", t0 + LONG, 0, 5).unwrap();
    let refused = q.push(t0 + 104 * MS, "a", t0 + LONG, 0, 6).unwrap_err();
    assert_eq!((refused.item, refused.reason), (6, DropReason::Sojourn));
    // A line that short is served first come, first served, and those let in are not dropped
    // at the target: a late turn is no reason for a late refusal.
    assert_eq!(q.check(first, t0 + 125 * MS), None);
    assert!(q.next_check(second, t0 + 125 * MS).unwrap() > t0 + 125 * MS);
    assert_eq!(q.pop(t0 + 125 * MS).unwrap().item, 4);
    assert_eq!(q.pop(t0 + 130 * MS).unwrap().item, 5);
    assert!(reasons(&mut q).is_empty());
}

#[test]
fn fifo_never_drops_on_sojourn_nor_serves_newest_first() {
    let mut q = queue(fifo());
    let t0 = Instant::now();
    for i in 0..4 {
        q.push(t0 + i * MS, "a", t0 + LONG, 0, i).unwrap();
    }
    let now = t0 + Duration::from_secs(5);
    assert_eq!(drain(&mut q, now), vec![0, 1, 2, 3]);
    assert!(!q.is_overloaded());
    assert!(reasons(&mut q).is_empty());
}

#[test]
fn tenants_take_turns() {
    let mut q = queue(config());
    let t0 = Instant::now();
    for i in 0..3 {
        q.push(t0, "flood", t0 + LONG, 0, i).unwrap();
    }
    q.push(t0, "other", t0 + LONG, 0, 100).unwrap();
    q.push(t0, "third", t0 + LONG, 0, 200).unwrap();
    assert_eq!(drain(&mut q, t0 + MS), vec![0, 100, 200, 1, 2]);
}

#[test]
fn a_tenant_flood_does_not_starve_another_tenant() {
    let mut q = queue(config());
    let t0 = Instant::now();
    // One tenant alone may fill the queue.
    for i in 0..8 {
        q.push(t0, "flood", t0 + LONG, 0, i).unwrap();
    }
    assert_eq!(q.tenant_len("flood"), 8);
    let refused = q.push(t0, "flood", t0 + LONG, 0, 8).unwrap_err();
    assert_eq!(refused.reason, DropReason::TenantShare);
    // Another tenant pushes out the flood's newest waiters (those that waited least), up to an
    // equal share.
    for i in 0..4 {
        q.push(t0, "quiet", t0 + LONG, 0, 100 + i).unwrap();
    }
    assert_eq!(
        reasons(&mut q),
        (4..8)
            .rev()
            .map(|i| (i, DropReason::TenantShare))
            .collect::<Vec<_>>()
    );
    assert_eq!((q.tenant_len("flood"), q.tenant_len("quiet")), (4, 4));
    let refused = q.push(t0, "quiet", t0 + LONG, 0, 104).unwrap_err();
    assert_eq!(refused.reason, DropReason::TenantShare);
    // And is served every other turn.
    assert_eq!(drain(&mut q, t0 + MS), vec![0, 100, 1, 101, 2, 102, 3, 103]);
}

#[test]
fn bounded_by_count_and_by_memory() {
    // FIFO: one line, nobody to push out.
    let mut q = queue(fifo());
    let t0 = Instant::now();
    for i in 0..8 {
        q.push(t0, "a", t0 + LONG, 16, i).unwrap();
    }
    let refused = q.push(t0, "b", t0 + LONG, 16, 8).unwrap_err();
    assert_eq!(refused.reason, DropReason::Full);
    assert_eq!(q.len(), 8);

    let mut q = queue(config());
    q.push(t0, "a", t0 + LONG, 4 << 10, 1).unwrap();
    q.push(t0, "a", t0 + LONG, 3 << 10, 2).unwrap();
    assert_eq!(q.bytes(), 7 << 10);
    let refused = q.push(t0, "a", t0 + LONG, 2 << 10, 3).unwrap_err();
    assert_eq!(refused.reason, DropReason::Full, "8 KiB of memory");
    let refused = q.push(t0, "b", t0 + LONG, 9 << 10, 4).unwrap_err();
    assert_eq!(
        refused.reason,
        DropReason::Full,
        "larger than the whole bound"
    );
    assert!(q.push(t0, "a", t0 + LONG, 1 << 10, 5).is_ok());
    assert_eq!(q.bytes(), 8 << 10);
    assert_eq!(drain(&mut q, t0).len(), 3);
    assert_eq!(q.bytes(), 0);
}

#[test]
fn a_removed_waiter_leaves_nothing() {
    let mut q = queue(config());
    let t0 = Instant::now();
    let a = q.push(t0, "a", t0 + LONG, 100, 1).unwrap();
    let b = q.push(t0, "b", t0 + LONG, 100, 2).unwrap();
    q.push(t0, "a", t0 + LONG, 100, 3).unwrap();
    assert_eq!(q.remove(a), Some(1));
    assert_eq!(q.remove(a), None, "once");
    assert_eq!(q.remove(b), Some(2));
    assert_eq!((q.len(), q.bytes(), q.tenant_len("b")), (1, 100, 0));
    assert_eq!(drain(&mut q, t0), vec![3]);
    assert_eq!((q.len(), q.bytes(), q.tenant_len("a")), (0, 0, 0));
    assert!(format!("{q:?}").contains("len: 0"));
}

#[test]
fn pushback_grows_with_the_queue_and_is_jittered_within_bounds() {
    // An interval long enough for the slots to serve every waiter within it.
    let mut q = queue(QueueConfig {
        max_waiters: 1000,
        interval: Duration::from_secs(10),
        ..config()
    });
    let t0 = Instant::now();
    for _ in 0..20 {
        q.on_service(100 * MS);
    }
    let empty = q.pushback(t0, 10, 0.0);
    assert_eq!(
        empty,
        Pushback {
            wait: MIN_PUSHBACK,
            retry: true
        }
    );
    for i in 0..500 {
        q.push(t0, &format!("t{}", i % 7), t0 + LONG, 0, i).unwrap();
    }
    // 501 waiters x 100 ms / 10 slots: about 5 s to drain.
    let full = q.pushback(t0, 10, 0.0);
    assert!(full.wait > Duration::from_secs(4) && full.retry, "{full:?}");
    assert!(
        q.pushback(t0, 1_000, 0.0).wait < full.wait,
        "a larger limit drains faster"
    );
    let waits: Vec<_> = (0..10)
        .map(|i| q.pushback(t0, 10, f64::from(i) / 10.0).wait)
        .collect();
    assert!(waits.windows(2).all(|w| w[0] < w[1]), "{waits:?}");
    assert!(waits.iter().all(|w| *w >= full.wait && *w < full.wait * 2));
    // Nonsense randomness is no panic and no unbounded wait.
    for unit in [f64::NAN, -1.0, 7.0, f64::INFINITY] {
        assert!(q.pushback(t0, 0, unit).wait <= MAX_PUSHBACK * 2);
    }
}

#[test]
fn shedding_hard_says_do_not_retry_and_recovery_says_retry() {
    let mut q = queue(config());
    let t0 = Instant::now();
    let mut now = t0;
    let mut advice = Vec::new();
    // Two arrivals per 10 ms and one slot freeing: twice the capacity, for three seconds.
    for step in 0..300 {
        now = t0 + step * 10 * MS;
        for i in 0..2 {
            let _ = q.push(now, "a", now + LONG, 0, step * 2 + i);
        }
        q.pop(now);
        advice.push(q.pushback(now, 4, 0.5));
    }
    assert!(q.is_overloaded());
    assert!(
        advice[..200].iter().all(|p| p.retry),
        "not for the first two seconds"
    );
    let hard = advice.last().unwrap();
    assert!(!hard.retry);
    assert!(hard.wait >= HARD_SHED_PUSHBACK, "{hard:?}");
    // The load stops: the queue drains, and over an interval free slots find nobody.
    while q.pop(now).is_some() {}
    for _ in 0..25 {
        now += 10 * MS;
        q.pop(now);
    }
    assert!(!q.is_overloaded());
    assert!(q.pushback(now, 4, 0.5).retry);
}

#[test]
fn the_target_is_at_least_two_gaps_between_finishing_requests() {
    let mut q = AdmissionQueue::<u32>::new(config());
    q.set_slots(100);
    assert_eq!(q.target(), 5 * MS);
    for _ in 0..100 {
        q.on_service(200 * MS);
    }
    // 200 ms of service over 16 slots: a request finishes every 12.5 ms.
    q.set_slots(16);
    assert_eq!(q.target(), 25 * MS);
    assert_eq!(q.interval(), 100 * MS);
    q.set_slots(0);
    assert_eq!(q.target(), 400 * MS, "at least one slot");
    assert_eq!(q.interval(), 800 * MS, "twice the target");
}

#[test]
fn overload_lasts_while_free_slots_mostly_find_somebody_waiting() {
    let mut q = queue(config());
    let t0 = Instant::now();
    // Three arrivals for two free slots every 10 ms: the third waits too long and goes.
    for step in 0..100 {
        let now = t0 + step * 10 * MS;
        for i in 0..3 {
            let _ = q.push(now, "a", now + LONG, 0, step * 3 + i);
        }
        q.pop(now + MS);
        q.pop(now + 2 * MS);
        if step > 20 {
            assert!(q.is_overloaded(), "step {step}");
        }
    }
    // One arrival for two free slots: one of them finds nobody, and the overload ends.
    for step in 100..130 {
        let now = t0 + step * 10 * MS;
        let _ = q.push(now, "a", now + LONG, 0, step);
        q.pop(now + MS);
        q.pop(now + 2 * MS);
    }
    assert!(!q.is_overloaded());
}

#[test]
fn disciplines_parse_and_print() {
    assert_eq!("fair".parse(), Ok(Discipline::Fair));
    assert_eq!("fifo".parse(), Ok(Discipline::Fifo));
    let err = "lifo".parse::<Discipline>().unwrap_err();
    assert!(err.to_string().contains("`fair` or `fifo`"), "{err}");
    assert_eq!(Discipline::default().to_string(), "fair");
    assert_eq!(DropReason::TenantShare.to_string(), "tenant_share");
    assert_eq!(DropReason::Sojourn.as_str(), "sojourn");
    let q = AdmissionQueue::<()>::new(QueueConfig {
        max_waiters: 0,
        max_bytes: 0,
        ..QueueConfig::default()
    });
    assert_eq!((q.config().max_waiters, q.config().max_bytes), (1, 1));
}

#[test]
fn a_standing_queue_refuses_at_the_door_what_it_could_not_serve_within_the_target() {
    // One slot, 10 ms per request: the target is two gaps, 20 ms, which two waiters fill.
    let mut q = AdmissionQueue::new(config());
    q.set_slots(1);
    assert_eq!(q.target(), 20 * MS);
    let t0 = Instant::now();
    q.push(t0, "a", t0 + LONG, 0, 1).unwrap();
    q.push(t0 + 95 * MS, "a", t0 + LONG, 0, 2).unwrap();
    // A whole interval with waiters and nobody served: a standing queue.
    let now = t0 + 101 * MS;
    let refused = q.push(now, "a", t0 + LONG, 0, 3).unwrap_err();
    assert!(q.is_overloaded());
    assert_eq!(
        (refused.reason, refused.item),
        (DropReason::Sojourn, 3),
        "refused at once, not after waiting the target"
    );
    // Another tenant still gets in, at the expense of the one holding the whole queue.
    q.push(now, "b", t0 + LONG, 0, 4).unwrap();
    assert_eq!(reasons(&mut q), vec![(2, DropReason::TenantShare)]);
    assert_eq!(q.len(), 2);
    // Without a standing queue the door is open up to the bound.
    let mut calm = AdmissionQueue::new(config());
    calm.set_slots(1);
    for i in 0..8 {
        calm.push(t0, "a", t0 + LONG, 0, i).unwrap();
    }
    assert!(!calm.is_overloaded());
}

/// What [`overload`] saw.
#[derive(Debug, Default)]
struct Run {
    /// Requests served per second.
    goodput: f64,
    /// Refusals, and those that came after a wait of more than 5 ms.
    refused: usize,
    late: usize,
    /// The quiet tenant's requests served, and why those refused were.
    quiet_served: usize,
    quiet_refused: Vec<DropReason>,
}

/// Drives the queue the way the gate does, in virtual time: 16 slots whose requests take
/// 100 ms (+-10 %), random arrivals of tenant `noisy` at `multiple` times their capacity
/// (160/s) for 20 s, each with a 2 s budget; a waiter is looked at when
/// [`AdmissionQueue::next_check`] says. With `quiet`, two clients of tenant `quiet` send one
/// request after another meanwhile, pausing 100 ms after each answer.
fn overload(multiple: f64, quiet: bool) -> Run {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Event {
        Done(u32),
        Arrive(u32),
        Check(u32),
        Quiet,
    }
    const SLOTS: usize = 16;
    const RUN: Duration = Duration::from_secs(20);
    const PAUSE: Duration = Duration::from_millis(100);
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut unit = move || {
        // xorshift64*: deterministic, good enough for arrival gaps.
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        (seed.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    };
    let t0 = Instant::now();
    let rate = multiple * SLOTS as f64 / 0.1;
    let mut q = AdmissionQueue::new(QueueConfig::default());
    q.set_slots(SLOTS);
    let mut events = BinaryHeap::new();
    let mut at = Duration::ZERO;
    let mut tenant = Vec::new();
    while at < RUN {
        events.push(Reverse((at, Event::Arrive(tenant.len() as u32))));
        tenant.push("noisy");
        at += Duration::from_secs_f64(-(1.0 - unit()).ln() / rate);
    }
    if quiet {
        for _ in 0..2 {
            events.push(Reverse((Duration::from_secs(1), Event::Quiet)));
        }
    }
    let mut arrived = vec![Duration::ZERO; tenant.len()];
    let mut tickets = HashMap::new();
    let mut inflight = 0;
    let mut run = Run::default();
    let mut served = 0;
    while let Some(Reverse((at, event))) = events.pop() {
        let now = t0 + at;
        let mut start = |events: &mut BinaryHeap<_>, i: u32| {
            let took = Duration::from_secs_f64(0.1 * (0.9 + 0.2 * unit()));
            events.push(Reverse((at + took, Event::Done(i))));
        };
        // A refused request of `i`'s tenant; a quiet client sends again after its pause.
        let refuse = |run: &mut Run, events: &mut BinaryHeap<_>, why, quiet: bool, waited| {
            run.refused += 1;
            run.late += usize::from(waited > 5 * MS);
            if quiet {
                run.quiet_refused.push(why);
                events.push(Reverse((at + PAUSE, Event::Quiet)));
            }
        };
        match event {
            Event::Quiet if at < RUN => {
                events.push(Reverse((at, Event::Arrive(tenant.len() as u32))));
                tenant.push("quiet");
                arrived.push(at);
            }
            Event::Quiet => {}
            Event::Arrive(i) => {
                arrived[i as usize] = at;
                let who = tenant[i as usize];
                if q.is_empty() && inflight < SLOTS {
                    q.admitted_directly(now, who);
                    inflight += 1;
                    start(&mut events, i);
                } else {
                    match q.push(now, who, now + Duration::from_secs(2), 0, i) {
                        Ok(ticket) => {
                            tickets.insert(i, ticket);
                            let check = q.next_check(ticket, now).unwrap();
                            events.push(Reverse((check - t0, Event::Check(i))));
                        }
                        Err(no) => {
                            let quiet = who == "quiet";
                            refuse(&mut run, &mut events, no.reason, quiet, Duration::ZERO);
                        }
                    }
                }
            }
            Event::Done(i) => {
                inflight -= 1;
                served += 1;
                q.on_service(100 * MS);
                q.release(tenant[i as usize]);
                if tenant[i as usize] == "quiet" {
                    run.quiet_served += 1;
                    events.push(Reverse((at + PAUSE, Event::Quiet)));
                }
                while inflight < SLOTS {
                    let Some(next) = q.pop(now) else { break };
                    assert_eq!(&*next.tenant, tenant[next.item as usize]);
                    tickets.remove(&next.item);
                    inflight += 1;
                    start(&mut events, next.item);
                }
            }
            Event::Check(i) => {
                if let Some(&ticket) = tickets.get(&i) {
                    if let Some((_, why)) = q.check(ticket, now) {
                        tickets.remove(&i);
                        let quiet = tenant[i as usize] == "quiet";
                        refuse(&mut run, &mut events, why, quiet, at - arrived[i as usize])
                    } else if let Some(check) = q.next_check(ticket, now) {
                        events.push(Reverse(((check - t0).max(at), Event::Check(i))));
                    }
                }
            }
        }
        for (i, why) in q.take_dropped() {
            tickets.remove(&i);
            let quiet = tenant[i as usize] == "quiet";
            refuse(&mut run, &mut events, why, quiet, at - arrived[i as usize])
        }
    }
    run.goodput = served as f64 / RUN.as_secs_f64();
    run
}

#[test]
fn overload_is_refused_at_once_and_capacity_stays_in_use() {
    for multiple in [3.0, 5.0] {
        let Run {
            goodput,
            refused,
            late,
            ..
        } = overload(multiple, false);
        assert!(goodput >= 0.9 * 160.0, "{multiple}x: {goodput}/s served");
        assert!(
            refused as f64 >= 0.5 * (multiple - 1.0) / multiple * 160.0 * multiple * 20.0,
            "{multiple}x: only {refused} refused"
        );
        // At most 1 % of the refusals come after a wait: the door turns away what the slots
        // could not serve in time, from the first interval on.
        assert!(
            late * 100 <= refused,
            "{multiple}x: {late} of {refused} refusals waited more than 5 ms"
        );
    }
}

/// A noisy tenant at three and five times the capacity does not get a quiet one refused: its
/// two clients are served every time, and the noisy tenant takes every refusal.
#[test]
fn a_noisy_tenant_does_not_get_a_quiet_one_refused() {
    for multiple in [3.0, 5.0] {
        let run = overload(multiple, true);
        assert!(run.quiet_refused.is_empty(), "{multiple}x: {run:?}");
        // Two clients, a request and a pause of 100 ms each in turn, for 19 s.
        assert!(run.quiet_served >= 150, "{multiple}x: {run:?}");
        assert!(run.refused > 1000 && run.goodput >= 0.9 * 160.0, "{run:?}");
    }
}

/// Within its share of the slots, a tenant gets past the door of a standing queue, taking the
/// place of the newest waiter of the tenant over its share, and its waiters are not dropped on
/// sojourn; past its share, the usual rules hold.
#[test]
fn a_tenant_within_its_share_of_the_slots_is_not_refused_for_another_ones_load() {
    // Four slots, 10 ms per request: the target is two gaps (5 ms); two waiters fill it.
    let mut q = AdmissionQueue::new(config());
    q.set_slots(4);
    q.on_service(10 * MS);
    let t0 = Instant::now();
    for _ in 0..4 {
        q.admitted_directly(t0, "noisy");
    }
    // A whole interval with noisy waiters and nobody served: a standing queue.
    let t1 = t0 + 100 * MS;
    q.push(t1, "noisy", t0 + LONG, 0, 1).unwrap();
    q.push(t1 + 95 * MS, "noisy", t0 + LONG, 0, 2).unwrap();
    let now = t1 + 101 * MS;
    let refused = q.push(now, "noisy", t0 + LONG, 0, 3).unwrap_err();
    assert_eq!(refused.reason, DropReason::Sojourn);
    assert!(q.is_overloaded());
    assert!(!q.within_share("noisy") && q.within_share("quiet"));
    // The quiet tenant takes the places of the newest noisy waiters, up to its share (two of
    // the four slots).
    let quiet = q.push(now, "quiet", t0 + LONG, 0, 10).unwrap();
    q.push(now, "quiet", t0 + LONG, 0, 11).unwrap();
    assert_eq!(
        reasons(&mut q),
        vec![(2, DropReason::TenantShare), (1, DropReason::TenantShare)]
    );
    assert!(!q.within_share("quiet"), "a third would be over its share");
    let refused = q.push(now, "quiet", t0 + LONG, 0, 12).unwrap_err();
    assert_eq!(refused.reason, DropReason::Sojourn);
    // Past the interval, a waiter of a standing queue would be dropped; the quiet one stays.
    let later = now + 150 * MS;
    assert_eq!(q.check(quiet, later), None);
    assert!(q.is_overloaded());
    assert_eq!(q.pop(later).map(|w| w.item), Some(10));
    assert_eq!(q.pop(later).map(|w| w.item), Some(11));
    // Served and released, the quiet tenant's requests no longer count.
    q.release("quiet");
    q.release("quiet");
    assert_eq!(q.tenant_len("quiet"), 0);
    assert!(q.within_share("quiet"));
}

#[test]
fn a_healthy_queue_refuses_at_the_door_what_it_could_not_serve_within_the_interval() {
    // Ten slots, 100 ms per request: a waiter every 10 ms, so ten serve within the 100 ms
    // interval; an eleventh would wait past it only to be dropped.
    let mut q = AdmissionQueue::new(QueueConfig {
        max_waiters: 64,
        ..config()
    });
    q.set_slots(10);
    q.on_service(100 * MS);
    let t0 = Instant::now();
    for i in 0..10 {
        q.push(t0, &format!("t{i}"), t0 + LONG, 0, i).unwrap();
    }
    let refused = q.push(t0, "t10", t0 + LONG, 0, 10).unwrap_err();
    assert_eq!((refused.reason, refused.item), (DropReason::Sojourn, 10));
    assert!(!q.is_overloaded());
    // Faster service makes room at the door.
    for _ in 0..50 {
        q.on_service(10 * MS);
    }
    q.push(t0, "t10", t0 + LONG, 0, 10).unwrap();
}
