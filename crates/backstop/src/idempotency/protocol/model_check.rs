//! Exhaustive check of the claim protocol (stateright, breadth first).
//!
//! Two executors claim one key, run under their lease until their deadline, then complete,
//! fail or release it; either may crash at any step and come back; a sweeper deletes what it
//! may. Each executor reads a wall clock off true time by up to `max_skew`, fixed per run and
//! chosen every possible way; the sweeper's runs ahead by the most. Time moves in ticks up to a horizon. Every decision is made by the
//! rules in the parent module, the ones the stores run, and the checker visits every reachable
//! state, asserting:
//!
//! - at most one executor works under a lease at a time (a takeover never starts while the
//!   previous holder may still be working before its deadline);
//! - a stale executor cannot complete, fail or release after a takeover;
//! - a succeeded record never changes;
//! - the sweeper never deletes a record whose holder is still working;
//! - a key is never held forever: a running record's lease ends within one lease of now.
//!
//! The mutation tests drop the fence on completion and the skew margin on the lease, and the
//! checker must then find a counterexample.

use std::time::Duration;

use stateright::{Checker, Model, Property};

use super::{ClaimRule, Existing, claim, holds, lease_for, sweepable};
use crate::idempotency::RecordStatus;

/// One tick of model time, in milliseconds (the rules work on milliseconds).
const TICK: i64 = 1_000;

#[derive(Clone, Debug)]
struct ClaimProtocol {
    executors: usize,
    /// How far each clock may be from true time, in ticks.
    max_skew: i64,
    /// Last tick of true time explored.
    horizon: i64,
    /// The route's lease, in ticks.
    lease: i64,
    /// Each request's deadline budget, in ticks.
    budget: i64,
    /// Record TTL, in ticks.
    ttl: i64,
    /// Claims each executor may make (bounds the state space).
    max_attempts: u8,
    /// Mutation switches: the shipped protocol has both on.
    fence_on_finish: bool,
    skew_margin: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Rec {
    status: RecordStatus,
    lease_until: i64,
    expires_at: i64,
    /// Who completed it (the stored response).
    response: Option<usize>,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Exec {
    Idle,
    /// Holds a lease (token) and works until its deadline (true time, from its monotonic
    /// clock).
    Holding {
        token: i64,
        deadline: i64,
    },
    Crashed,
    Done,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    now: i64,
    /// Clock offsets: one per executor, then the sweeper's.
    offsets: Vec<i64>,
    record: Option<Rec>,
    execs: Vec<Exec>,
    attempts: Vec<u8>,
    /// The last lease granted: (executor, token).
    granted: Option<(usize, i64)>,
    /// Set when a write was accepted from a lease other than the last granted.
    stale_write: bool,
    /// Set when a succeeded record was changed in place.
    success_changed: bool,
    /// Set when the sweeper deleted a record whose holder was working.
    swept_live: bool,
    /// Takeovers so far (for the reachability checks).
    takeovers: u8,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Action {
    Tick,
    Claim(usize),
    Complete(usize),
    Fail(usize),
    Release(usize),
    /// The deadline passed: the request is dropped and its guard fails the record.
    Abandon(usize),
    Crash(usize),
    Restart(usize),
    Sweep,
}

impl ClaimProtocol {
    fn shipped() -> Self {
        ClaimProtocol {
            executors: 2,
            max_skew: 1,
            horizon: 8,
            lease: 2,
            budget: 3,
            ttl: 5,
            max_attempts: 2,
            fence_on_finish: true,
            skew_margin: true,
        }
    }

    fn clock(&self, state: &State, process: usize) -> i64 {
        (state.now + state.offsets[process]) * TICK
    }

    /// The lease a claim asks for, by the layer's own formula, in milliseconds.
    fn lease_ms(&self) -> i64 {
        let skew = if self.skew_margin {
            Duration::from_millis((self.max_skew * TICK) as u64)
        } else {
            Duration::ZERO
        };
        let lease = lease_for(
            Duration::from_millis((self.lease * TICK) as u64),
            Some(Duration::from_millis((self.budget * TICK) as u64)),
            skew,
        );
        lease.as_millis() as i64
    }

    fn accepts(&self, rec: &Rec, token: i64) -> bool {
        if self.fence_on_finish {
            holds(rec.status, rec.lease_until, token)
        } else {
            rec.status == RecordStatus::Running
        }
    }

    /// Whether executor `i` holds a lease and may still be working.
    fn working(state: &State, i: usize) -> Option<i64> {
        match state.execs[i] {
            Exec::Holding { token, deadline } if state.now < deadline => Some(token),
            _ => None,
        }
    }

    /// A finishing write by executor `i`: `Some(new record)` applies it.
    fn finish(&self, state: &mut State, i: usize, write: impl FnOnce(&Rec) -> Option<Rec>) {
        let Exec::Holding { token, .. } = state.execs[i] else {
            return;
        };
        let accepted = state
            .record
            .as_ref()
            .is_some_and(|rec| self.accepts(rec, token));
        if accepted {
            if state.granted != Some((i, token)) {
                state.stale_write = true;
            }
            let old = state.record.clone().expect("accepted a present record");
            if old.status == RecordStatus::Succeeded {
                state.success_changed = true;
            }
            state.record = write(&old);
        }
    }
}

impl Model for ClaimProtocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let choices = (2 * self.max_skew + 1) as usize;
        (0..choices.pow(self.executors as u32))
            .map(|mut n| {
                let mut offsets: Vec<i64> = (0..self.executors)
                    .map(|_| {
                        let o = (n % choices) as i64 - self.max_skew;
                        n /= choices;
                        o
                    })
                    .collect();
                // The sweeper's clock runs as far ahead as it may: it then deletes everything a
                // slower clock would, and more.
                offsets.push(self.max_skew);
                State {
                    now: 0,
                    offsets,
                    record: None,
                    execs: vec![Exec::Idle; self.executors],
                    attempts: vec![0; self.executors],
                    granted: None,
                    stale_write: false,
                    success_changed: false,
                    swept_live: false,
                    takeovers: 0,
                }
            })
            .collect()
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.now < self.horizon {
            actions.push(Action::Tick);
        }
        if state.record.is_some() {
            actions.push(Action::Sweep);
        }
        for (i, exec) in state.execs.iter().enumerate() {
            match *exec {
                Exec::Idle if state.attempts[i] < self.max_attempts => {
                    actions.push(Action::Claim(i))
                }
                Exec::Holding { deadline, .. } => {
                    if state.now < deadline {
                        actions.extend([Action::Complete(i), Action::Fail(i), Action::Release(i)]);
                    } else {
                        actions.push(Action::Abandon(i));
                    }
                    actions.push(Action::Crash(i));
                }
                Exec::Crashed => actions.push(Action::Restart(i)),
                Exec::Idle | Exec::Done => {}
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Tick => state.now += 1,
            Action::Claim(i) => {
                state.attempts[i] += 1;
                let now_ms = self.clock(&state, i);
                let existing = state.record.as_ref().map(|rec| Existing {
                    status: rec.status,
                    lease_until_ms: rec.lease_until,
                    // Every executor runs the same request.
                    same_fingerprint: true,
                });
                match claim(existing, now_ms, now_ms + self.lease_ms()) {
                    ClaimRule::Insert { lease_until_ms } => {
                        state.record = Some(Rec {
                            status: RecordStatus::Running,
                            lease_until: lease_until_ms,
                            expires_at: now_ms + self.ttl * TICK,
                            response: None,
                        });
                        state.granted = Some((i, lease_until_ms));
                        state.execs[i] = Exec::Holding {
                            token: lease_until_ms,
                            deadline: state.now + self.budget,
                        };
                    }
                    ClaimRule::TakeOver { lease_until_ms } => {
                        let rec = state.record.as_mut().expect("a takeover has a record");
                        if rec.status == RecordStatus::Succeeded {
                            state.success_changed = true;
                        }
                        rec.status = RecordStatus::Running;
                        rec.lease_until = lease_until_ms;
                        rec.expires_at = rec.expires_at.max(now_ms + self.ttl * TICK);
                        state.granted = Some((i, lease_until_ms));
                        state.takeovers = state.takeovers.saturating_add(1);
                        state.execs[i] = Exec::Holding {
                            token: lease_until_ms,
                            deadline: state.now + self.budget,
                        };
                    }
                    ClaimRule::Replay => state.execs[i] = Exec::Done,
                    ClaimRule::InProgress { .. } | ClaimRule::Conflict => {}
                }
            }
            Action::Complete(i) => {
                let now_ms = self.clock(&state, i);
                let ttl = self.ttl * TICK;
                self.finish(&mut state, i, |rec| {
                    Some(Rec {
                        status: RecordStatus::Succeeded,
                        response: Some(i),
                        expires_at: rec.expires_at.max(now_ms + ttl),
                        ..rec.clone()
                    })
                });
                state.execs[i] = Exec::Done;
            }
            Action::Fail(i) | Action::Abandon(i) => {
                let now_ms = self.clock(&state, i);
                let ttl = self.ttl * TICK;
                self.finish(&mut state, i, |rec| {
                    Some(Rec {
                        status: RecordStatus::Failed,
                        response: None,
                        expires_at: rec.expires_at.max(now_ms + ttl),
                        ..rec.clone()
                    })
                });
                state.execs[i] = Exec::Idle;
            }
            Action::Release(i) => {
                self.finish(&mut state, i, |_| None);
                state.execs[i] = Exec::Idle;
            }
            Action::Crash(i) => state.execs[i] = Exec::Crashed,
            Action::Restart(i) => state.execs[i] = Exec::Idle,
            Action::Sweep => {
                let now_ms = self.clock(&state, self.executors);
                let rec = state.record.as_ref().expect("sweep needs a record");
                if !sweepable(rec.status, rec.lease_until, rec.expires_at, now_ms) {
                    return None;
                }
                let token = rec.lease_until;
                if (0..self.executors).any(|i| Self::working(&state, i) == Some(token)) {
                    state.swept_live = true;
                }
                state.record = None;
            }
        }
        (state != *last).then_some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "at most one executor works under a lease",
                |_, s: &State| {
                    (0..s.execs.len())
                        .filter(|&i| ClaimProtocol::working(s, i).is_some())
                        .count()
                        <= 1
                },
            ),
            Property::always(
                "a stale executor cannot write after a takeover",
                |_, s: &State| !s.stale_write,
            ),
            Property::always("a succeeded record never changes", |_, s: &State| {
                !s.success_changed
            }),
            Property::always(
                "the sweeper never deletes a working holder's record",
                |_, s: &State| !s.swept_live,
            ),
            Property::always(
                "a key is never held forever",
                |m: &ClaimProtocol, s: &State| {
                    s.record.as_ref().is_none_or(|rec| {
                        rec.status != RecordStatus::Running
                            || rec.lease_until <= (s.now + 2 * m.max_skew) * TICK + m.lease_ms()
                    })
                },
            ),
            // The checks above mean something only if these states are reachable.
            Property::sometimes("a crashed holder's key is taken over", |_, s: &State| {
                s.takeovers > 0 && s.execs.contains(&Exec::Crashed)
            }),
            Property::sometimes("a key succeeds after a takeover", |_, s: &State| {
                s.takeovers > 0
                    && s.record
                        .as_ref()
                        .is_some_and(|r| r.status == RecordStatus::Succeeded)
            }),
            Property::sometimes("the sweeper deletes a record", |_, s: &State| {
                s.record.is_none() && s.granted.is_some()
            }),
        ]
    }
}

fn check(model: ClaimProtocol) -> impl Checker<ClaimProtocol> {
    model.checker().spawn_bfs().join()
}

#[test]
fn the_claim_protocol_holds_under_crashes_expiry_and_clock_skew() {
    let checker = check(ClaimProtocol::shipped());
    checker.assert_properties();
    eprintln!("{} states", checker.unique_state_count());
    assert!(
        checker.unique_state_count() > 1_000,
        "the model explored too little"
    );
}

#[test]
fn without_the_fence_a_stale_executor_overwrites_its_successor() {
    let checker = check(ClaimProtocol {
        fence_on_finish: false,
        ..ClaimProtocol::shipped()
    });
    checker.assert_any_discovery("a stale executor cannot write after a takeover");
}

#[test]
fn without_the_skew_margin_two_executors_work_at_once() {
    let checker = check(ClaimProtocol {
        skew_margin: false,
        ..ClaimProtocol::shipped()
    });
    checker.assert_any_discovery("at most one executor works under a lease");
}

#[test]
fn without_skew_the_margin_is_not_needed() {
    // The margin is there for skew alone: with synchronised clocks the bare lease suffices.
    let checker = check(ClaimProtocol {
        skew_margin: false,
        max_skew: 0,
        ..ClaimProtocol::shipped()
    });
    checker.assert_no_discovery("at most one executor works under a lease");
}
