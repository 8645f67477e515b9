//! Exhaustive check of the claim protocol and of the atomic phases run under it (stateright).
//!
//! Two executors run one keyed request the way the server layer runs it: claim the key, commit
//! phase 1 (the application's "intent" write and a recovery point, one transaction fenced by
//! the lease), call the downstream with the record's effect key (the downstream applies each
//! effect key once), then finish (the application's "settled" write and the stored answer, one
//! transaction, fenced). A run may instead refuse the request before its phase (release), or
//! answer a retryable failure before its phase or when the downstream refuses (fail). Either
//! executor may crash between any two steps (a crash inside a transaction is the step not
//! happening) and come back; a request may be dropped while its claim is in flight; a store
//! write sent before a deadline may land after it; a sweeper deletes what it may, which ends
//! the key's use. A claim that takes over an abandoned run acts by the route's `Takeover`
//! policy: `Refuse` stores `outcome_unknown` and runs nothing, `Resume` goes on from the
//! recovery point (asking the downstream again, by effect key), `Rerun` starts over. Each
//! executor reads a wall clock off true time by up to `max_skew`, fixed per run and chosen
//! every possible way; the sweeper's runs ahead by the most. Time moves in ticks up to a
//! horizon. Every store decision is made by the rules in the parent module, the ones the stores
//! run, and the checker visits every reachable state (up to swapping the executors), asserting:
//!
//! - at most one executor works under a lease at a time (a takeover never starts while the
//!   previous holder may still be working before its deadline);
//! - a stale executor cannot complete, fail or release after a takeover, nor commit a phase;
//! - a succeeded record never changes;
//! - the sweeper never deletes a record whose holder is still working;
//! - a key is never held forever: a running record's lease ends within one lease of now;
//! - the intent exists iff the record holds a recovery point, and the settled write iff a run
//!   completed the record (`outcome_unknown` settles nothing): each phase is one transaction;
//! - the downstream applies at most one effect per use of a key, whatever the policy;
//! - on `Refuse` routes it is called at most once: a run that may have performed its effect is
//!   never run again (on the others it is called again, and deduplicates).
//!
//! `sometimes` checks make sure the interesting states are reached (a takeover resumes from a
//! recovery point, `outcome_unknown` answers a run that called the downstream, ...).
//!
//! The mutation tests drop the fence on completion and on phase commits, the skew margin on
//! the lease, and the atomicity of phase 1, and hold `Rerun` to `Refuse`'s promise; the checker
//! must then find a counterexample.
//!
//! Two of the server layer's rules are modelled as they are and as they were before the model
//! found them wrong (`NothingDone`, `DroppedClaim`): with the earlier rules, the
//! `earlier_rule_*` tests find runs where the downstream applies an effect twice. A store crash that loses a deferred
//! claim is modelled too, and found to let two runs hold one fencing token.

use std::time::Duration;

use super::checking::{assert_properties_but, check, find};
use stateright::{Checker, Model, Property, Representative};

use super::{ClaimRule, Existing, claim, holds, lease_for, sweepable};
use crate::idempotency::RecordStatus;
use crate::policy::Takeover;

/// One tick of model time, in milliseconds (the rules work on milliseconds).
const TICK: i64 = 1_000;

/// Executors running the request (fixed-size arrays keep states cheap to clone and hash).
const EXECUTORS: usize = 2;

/// The sweeper's index among the clocks.
const SWEEPER: usize = EXECUTORS;

const ONE_WORKER: &str = "at most one executor works under a lease";
const STALE_FINISH: &str = "a stale executor cannot write after a takeover";
const STALE_PHASE: &str = "a stale executor cannot commit a phase";
const ATOMIC_PHASE: &str = "the intent exists iff the record holds a recovery point";
const ONE_EFFECT: &str = "the downstream applies at most one effect per use of a key";
const ONE_CALL: &str = "the downstream is called at most once per use of a key";

/// When the layer decides that a run on a `Resume` route did nothing, and so releases its key
/// on a retryable failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NothingDone {
    /// The earlier rule (`!phases.began()`): this run committed no phase. A run that resumed past
    /// the phase of the run before commits none, so when the downstream then refuses, the
    /// record goes, with its recovery point and its effect key, while the intent stays and the
    /// effect may have happened: the next claim starts a new use under a new effect key.
    ThisRun,
    /// As shipped: no run of the key committed a phase, neither this one nor the one it
    /// resumes.
    AnyRun,
}

/// What the layer does with a claim taken after its request was dropped (`ClaimInFlight`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DroppedClaim {
    /// The earlier rule: releases it. Right for a claim that inserted the record; a takeover's
    /// release deletes the run before it (its recovery point, its effect key, and on a
    /// `Refuse` route the fact that its effect may have happened), so the next claim runs the
    /// effect again under a new effect key.
    Release,
    /// As shipped: releases a claim that inserted the record; fails a takeover, but leaves a takeover of
    /// an abandoned run on a `Refuse` route running, as the drop guard would.
    ReleaseInserted,
}

#[derive(Clone, Debug)]
struct ClaimProtocol {
    /// How far each clock may be from true time, in ticks.
    max_skew: i64,
    /// Last tick of true time explored.
    horizon: i64,
    /// The route's lease, in ticks.
    lease: i64,
    /// Each request's timeout, in ticks.
    timeout: i64,
    /// Record TTL, in ticks.
    ttl: i64,
    /// Claims each executor may make (bounds the state space).
    max_attempts: u8,
    /// The route's policy for a takeover of an abandoned run.
    takeover: Takeover,
    nothing_done: NothingDone,
    dropped_claim: DroppedClaim,
    /// Mutation switches: the shipped protocol has all on.
    fence_on_finish: bool,
    fence_on_phase: bool,
    atomic_phase: bool,
    skew_margin: bool,
    /// Whether the store may crash and lose a claim that was not yet durable
    /// (`claim_deferred`, on routes whose claims the first phase makes durable).
    store_crash: bool,
}

/// A stored answer.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Answer {
    /// The answer of executor `i`'s run.
    Ran(usize),
    /// `outcome_unknown`, stored by a `Refuse` takeover.
    OutcomeUnknown,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Rec {
    status: RecordStatus,
    lease_until: i64,
    expires_at: i64,
    /// When the key was first claimed: every run of this use sends this effect key.
    created_at: i64,
    /// A phase committed its recovery point.
    point: bool,
    response: Option<Answer>,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
enum Exec {
    Idle,
    /// Holds a lease and works until its deadline.
    Holding(Run),
    /// Finished its request (answered it, or had the stored answer replayed).
    Done,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
struct Run {
    /// The lease's fencing token.
    token: i64,
    /// True time at which the request's deadline passes (its monotonic clock).
    deadline: i64,
    /// The effect key its downstream call carries: the record's, from its lease.
    effect_key: i64,
    step: Step,
    /// The lease carried the recovery point of an earlier run.
    resumed: bool,
    /// This run committed a phase.
    began: bool,
}

/// What a run does next.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    /// Phase 1 is next.
    Claimed,
    /// Only when phase 1 is not atomic: the intent is written, its recovery point is next.
    Intent,
    /// Past phase 1 (this run's, or the one it resumes): the effect is next.
    Committed,
    /// The downstream applied the effect: the finish is next.
    Effected,
    /// Took over an abandoned run on a `Refuse` route: storing `outcome_unknown` is next.
    Refusing,
}

/// The application's rows and the downstream, for the key's current use: its record's sweep
/// ends the use (the key may then be reused for a new request).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
struct World {
    intent: bool,
    settled: bool,
    /// The first effect key the downstream applied (once).
    effect: Option<i64>,
    /// Set when it applied a second one.
    other_effect: bool,
    /// Calls that reached the downstream, before it deduplicates them.
    calls: u8,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    now: i64,
    /// Clock offsets: one per executor, then the sweeper's.
    offsets: [i64; EXECUTORS + 1],
    record: Option<Rec>,
    execs: [Exec; EXECUTORS],
    attempts: [u8; EXECUTORS],
    world: World,
    /// Who was granted the last lease (an executor holds one lease at a time, so its token
    /// need not be kept: that only multiplies the states).
    granted: Option<usize>,
    /// Set when a finishing write was accepted from a lease other than the last granted.
    stale_write: bool,
    /// Set when a phase commit was accepted from a lease other than the last granted.
    stale_phase: bool,
    /// Set when a succeeded record was changed in place.
    success_changed: bool,
    /// Set when the sweeper deleted a record whose holder was working.
    swept_live: bool,
    /// The durable record while a deferred claim has not been made durable since: a store
    /// crash brings it back.
    undo: Option<Option<Rec>>,
    /// Set once a key was taken over, and once an executor crashed (for the reachability
    /// checks: counts would only multiply the states).
    taken_over: bool,
    crashed: bool,
}

/// Executors are interchangeable but for their clocks: a state and the one with two executors
/// swapped behave alike, so the checker visits one of them.
impl Representative for State {
    fn representative(&self) -> Self {
        let key = |i: usize| (self.offsets[i], self.execs[i], self.attempts[i]);
        if key(0) <= key(1) {
            return self.clone();
        }
        let swap = |i: usize| 1 - i;
        let mut state = self.clone();
        state.offsets.swap(0, 1);
        state.execs.swap(0, 1);
        state.attempts.swap(0, 1);
        state.granted = self.granted.map(swap);
        if let Some(rec) = &mut state.record {
            if let Some(Answer::Ran(i)) = rec.response {
                rec.response = Some(Answer::Ran(swap(i)));
            }
        }
        state
    }
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Action {
    Tick,
    Claim(usize),
    /// A claim whose request is dropped while it is in flight: the layer ends it from a
    /// spawned task.
    DroppedClaim(usize),
    /// Phase 1 (both of its writes, or the next one when it is not atomic).
    Commit(usize),
    /// The downstream call, which applies the effect.
    Effect(usize),
    /// The finish: the settled write with the stored answer, or `outcome_unknown`.
    Complete(usize),
    /// A retryable failure answer: before phase 1, or the downstream refused.
    Fail(usize),
    /// The request is refused before it starts (bad input).
    Release(usize),
    /// The deadline passed: the request is dropped, and its guard acts.
    Abandon(usize),
    /// The executor crashes and restarts.
    Crash(usize),
    /// The store crashes and restarts, losing what was not durable.
    StoreCrash,
    Sweep,
}

impl ClaimProtocol {
    /// The protocol as the stores and the layer run it, on a route with the default policy.
    fn shipped() -> Self {
        ClaimProtocol {
            max_skew: 1,
            horizon: 7,
            lease: 2,
            timeout: 3,
            ttl: 5,
            max_attempts: 2,
            takeover: Takeover::Refuse,
            nothing_done: NothingDone::AnyRun,
            dropped_claim: DroppedClaim::ReleaseInserted,
            fence_on_finish: true,
            fence_on_phase: true,
            atomic_phase: true,
            skew_margin: true,
            store_crash: false,
        }
    }

    /// [`shipped`](Self::shipped), on a route with `takeover`.
    fn on(takeover: Takeover) -> Self {
        ClaimProtocol {
            takeover,
            ..Self::shipped()
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
            Some(Duration::from_millis((self.timeout * TICK) as u64)),
            skew,
        );
        lease.as_millis() as i64
    }

    fn accepts(&self, rec: &Rec, token: i64, fenced: bool) -> bool {
        if fenced {
            holds(rec.status, rec.lease_until, token)
        } else {
            rec.status == RecordStatus::Running
        }
    }

    /// Whether executor `i` holds a lease and may still be working.
    fn working(state: &State, i: usize) -> Option<i64> {
        match state.execs[i] {
            Exec::Holding(run) if state.now < run.deadline => Some(run.token),
            _ => None,
        }
    }

    /// A finishing write by executor `i`: `Some(new record)` applies it. Answers whether the
    /// store accepted it.
    fn finish(&self, state: &mut State, i: usize, write: impl FnOnce(&Rec) -> Option<Rec>) -> bool {
        let Exec::Holding(run) = state.execs[i] else {
            return false;
        };
        let accepted = state
            .record
            .as_ref()
            .is_some_and(|rec| self.accepts(rec, run.token, self.fence_on_finish));
        if accepted {
            if state.granted != Some(i) {
                state.stale_write = true;
            }
            let old = state.record.clone().expect("accepted a present record");
            if old.status == RecordStatus::Succeeded {
                state.success_changed = true;
            }
            state.record = write(&old);
            state.undo = None;
        }
        accepted
    }

    /// The recovery point of phase 1, by executor `i`: answers whether the store accepted it.
    fn commit_point(&self, state: &mut State, i: usize, run: Run) -> bool {
        let Some(rec) = state.record.as_mut() else {
            return false;
        };
        if !self.accepts(rec, run.token, self.fence_on_phase) {
            return false;
        }
        if state.granted != Some(i) {
            state.stale_phase = true;
        }
        if rec.status == RecordStatus::Succeeded {
            state.success_changed = true;
        }
        rec.point = true;
        state.undo = None;
        true
    }

    /// A failed record, kept at least a TTL past `now_ms`.
    fn failed(&self, rec: &Rec, now_ms: i64) -> Rec {
        Rec {
            status: RecordStatus::Failed,
            response: None,
            expires_at: rec.expires_at.max(now_ms + self.ttl * TICK),
            ..rec.clone()
        }
    }

    /// What a claim by executor `i` does now.
    fn rule(&self, state: &State, i: usize) -> ClaimRule {
        let now_ms = self.clock(state, i);
        let existing = state.record.as_ref().map(|rec| Existing {
            status: rec.status,
            lease_until_ms: rec.lease_until,
            // Every executor runs the same request.
            same_fingerprint: true,
        });
        claim(existing, now_ms, now_ms + self.lease_ms())
    }

    /// A claim by executor `i`; `dropped`: its request was dropped while it was in flight.
    fn claim(&self, state: &mut State, i: usize, dropped: bool) {
        state.attempts[i] += 1;
        let now_ms = self.clock(state, i);
        let deadline = state.now + self.timeout;
        let rule = self.rule(state, i);
        if matches!(rule, ClaimRule::Insert { .. } | ClaimRule::TakeOver { .. }) {
            // A deferred claim becomes durable with the next durable commit; a dropped one is
            // ended by a durable release or fail.
            if dropped || self.takeover == Takeover::Refuse {
                state.undo = None;
            } else if state.undo.is_none() && self.store_crash {
                state.undo = Some(state.record.clone());
            }
        }
        match rule {
            ClaimRule::Insert { lease_until_ms } => {
                state.granted = Some(i);
                if dropped {
                    // Inserted, then released: the request did nothing.
                    return;
                }
                state.record = Some(Rec {
                    status: RecordStatus::Running,
                    lease_until: lease_until_ms,
                    expires_at: now_ms + self.ttl * TICK,
                    created_at: now_ms,
                    point: false,
                    response: None,
                });
                state.execs[i] = Exec::Holding(Run {
                    token: lease_until_ms,
                    deadline,
                    effect_key: now_ms,
                    step: Step::Claimed,
                    resumed: false,
                    began: false,
                });
            }
            ClaimRule::TakeOver { lease_until_ms } => {
                let rec = state.record.as_mut().expect("a takeover has a record");
                if rec.status == RecordStatus::Succeeded {
                    state.success_changed = true;
                }
                let abandoned = rec.status == RecordStatus::Running;
                let refuse = abandoned && self.takeover == Takeover::Refuse;
                rec.status = RecordStatus::Running;
                rec.lease_until = lease_until_ms;
                rec.response = None;
                rec.expires_at = rec.expires_at.max(now_ms + self.ttl * TICK);
                state.granted = Some(i);
                state.taken_over = true;
                if dropped {
                    match self.dropped_claim {
                        DroppedClaim::Release => state.record = None,
                        DroppedClaim::ReleaseInserted if refuse => {}
                        DroppedClaim::ReleaseInserted => *rec = self.failed(rec, now_ms),
                    }
                    return;
                }
                let step = if refuse {
                    Step::Refusing
                } else if rec.point && self.takeover != Takeover::Rerun {
                    Step::Committed
                } else {
                    Step::Claimed
                };
                state.execs[i] = Exec::Holding(Run {
                    token: lease_until_ms,
                    deadline,
                    effect_key: rec.created_at,
                    step,
                    resumed: rec.point,
                    began: false,
                });
            }
            ClaimRule::Replay if !dropped => state.execs[i] = Exec::Done,
            ClaimRule::Replay | ClaimRule::InProgress { .. } | ClaimRule::Conflict => {}
        }
    }
}

impl Model for ClaimProtocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let choices = (2 * self.max_skew + 1) as usize;
        (0..choices.pow(EXECUTORS as u32))
            .map(|mut n| {
                // The sweeper's clock runs as far ahead as it may: it then deletes everything a
                // slower clock would, and more.
                let mut offsets = [self.max_skew; EXECUTORS + 1];
                for offset in &mut offsets[..EXECUTORS] {
                    *offset = (n % choices) as i64 - self.max_skew;
                    n /= choices;
                }
                State {
                    now: 0,
                    offsets,
                    record: None,
                    execs: [Exec::Idle; EXECUTORS],
                    attempts: [0; EXECUTORS],
                    world: World::default(),
                    granted: None,
                    stale_write: false,
                    stale_phase: false,
                    success_changed: false,
                    swept_live: false,
                    undo: None,
                    taken_over: false,
                    crashed: false,
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
        if state.undo.is_some() {
            actions.push(Action::StoreCrash);
        }
        for (i, exec) in state.execs.iter().enumerate() {
            match *exec {
                Exec::Idle if state.attempts[i] < self.max_attempts => {
                    actions.push(Action::Claim(i));
                    // Dropping any other claim leaves nothing behind.
                    if matches!(self.rule(state, i), ClaimRule::TakeOver { .. }) {
                        actions.push(Action::DroppedClaim(i));
                    }
                }
                Exec::Holding(run) => {
                    // Past its deadline a run is dropped, but a store write it sent before may
                    // still land.
                    let working = state.now < run.deadline;
                    match run.step {
                        Step::Claimed if working => {
                            actions.extend([Action::Commit(i), Action::Fail(i)]);
                            if !run.resumed {
                                actions.push(Action::Release(i));
                            }
                        }
                        Step::Committed if working => {
                            actions.extend([Action::Effect(i), Action::Fail(i)])
                        }
                        Step::Claimed | Step::Intent => actions.push(Action::Commit(i)),
                        Step::Effected | Step::Refusing => actions.push(Action::Complete(i)),
                        Step::Committed => {}
                    }
                    if !working {
                        actions.push(Action::Abandon(i));
                    }
                    actions.push(Action::Crash(i));
                }
                Exec::Idle | Exec::Done => {}
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        let run_of = |state: &State, i: usize| match state.execs[i] {
            Exec::Holding(run) => run,
            _ => unreachable!("only a holder acts on its run"),
        };
        match action {
            Action::Tick => state.now += 1,
            Action::Claim(i) => self.claim(&mut state, i, false),
            Action::DroppedClaim(i) => self.claim(&mut state, i, true),
            Action::Commit(i) => {
                let mut run = run_of(&state, i);
                if !self.atomic_phase && run.step == Step::Claimed {
                    // The application's write in a transaction of its own.
                    state.world.intent = true;
                    run.step = Step::Intent;
                    state.execs[i] = Exec::Holding(run);
                } else if self.commit_point(&mut state, i, run) {
                    state.world.intent = true;
                    run.step = Step::Committed;
                    run.began = true;
                    state.execs[i] = Exec::Holding(run);
                } else {
                    // The lease is lost: the handler stops, and its answer's end is fenced out
                    // like the phase was.
                    state.execs[i] = Exec::Idle;
                }
            }
            Action::Effect(i) => {
                let mut run = run_of(&state, i);
                let world = &mut state.world;
                world.calls = world.calls.saturating_add(1);
                match world.effect {
                    None => world.effect = Some(run.effect_key),
                    Some(key) if key != run.effect_key => world.other_effect = true,
                    Some(_) => {}
                }
                run.step = Step::Effected;
                state.execs[i] = Exec::Holding(run);
            }
            Action::Complete(i) => {
                let answer = match run_of(&state, i).step {
                    Step::Refusing => Answer::OutcomeUnknown,
                    _ => Answer::Ran(i),
                };
                let now_ms = self.clock(&state, i);
                let ttl = self.ttl * TICK;
                let completed = self.finish(&mut state, i, |rec| {
                    Some(Rec {
                        status: RecordStatus::Succeeded,
                        response: Some(answer),
                        expires_at: rec.expires_at.max(now_ms + ttl),
                        ..rec.clone()
                    })
                });
                if completed && answer == Answer::Ran(i) {
                    state.world.settled = true;
                }
                state.execs[i] = Exec::Done;
            }
            Action::Fail(i) => {
                let run = run_of(&state, i);
                let nothing_done = self.takeover == Takeover::Resume
                    && !run.began
                    && match self.nothing_done {
                        NothingDone::ThisRun => true,
                        NothingDone::AnyRun => !run.resumed,
                    };
                let now_ms = self.clock(&state, i);
                if nothing_done {
                    self.finish(&mut state, i, |_| None);
                } else {
                    self.finish(&mut state, i, |rec| Some(self.failed(rec, now_ms)));
                }
                state.execs[i] = Exec::Idle;
            }
            Action::Release(i) => {
                self.finish(&mut state, i, |_| None);
                state.execs[i] = Exec::Idle;
            }
            Action::Abandon(i) => {
                // On a `Refuse` route the guard leaves the record running: the run may have
                // performed its effect, and a retry must learn `outcome_unknown`.
                if self.takeover != Takeover::Refuse {
                    let now_ms = self.clock(&state, i);
                    self.finish(&mut state, i, |rec| Some(self.failed(rec, now_ms)));
                }
                state.execs[i] = Exec::Idle;
            }
            // Back at once: a restarted executor that waits is one that claims later.
            Action::Crash(i) => {
                state.execs[i] = Exec::Idle;
                state.crashed = true;
            }
            Action::StoreCrash => {
                state.record = state.undo.take().expect("a store crash loses a claim");
            }
            Action::Sweep => {
                let now_ms = self.clock(&state, SWEEPER);
                let rec = state.record.as_ref().expect("sweep needs a record");
                if !sweepable(rec.status, rec.lease_until, rec.expires_at, now_ms) {
                    return None;
                }
                let token = rec.lease_until;
                if (0..EXECUTORS).any(|i| Self::working(&state, i) == Some(token)) {
                    state.swept_live = true;
                }
                state.record = None;
                state.undo = None;
                // The key's use is over: a request with it now is a new one.
                state.world = World::default();
            }
        }
        (state != *last).then_some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(ONE_WORKER, |_, s: &State| {
                (0..EXECUTORS)
                    .filter(|&i| ClaimProtocol::working(s, i).is_some())
                    .count()
                    <= 1
            }),
            Property::always(STALE_FINISH, |_, s: &State| !s.stale_write),
            Property::always(STALE_PHASE, |_, s: &State| !s.stale_phase),
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
            // Only a run between the two writes of a non-atomic phase may see them disagree;
            // once it crashes, everyone does.
            Property::always(ATOMIC_PHASE, |_, s: &State| {
                s.world.intent == s.record.as_ref().is_some_and(|r| r.point)
                    || s.execs
                        .iter()
                        .any(|e| matches!(e, Exec::Holding(run) if run.step == Step::Intent))
            }),
            Property::always(
                "the settled write exists iff a run completed the record",
                |_, s: &State| {
                    s.world.settled
                        == s.record
                            .as_ref()
                            .is_some_and(|r| matches!(r.response, Some(Answer::Ran(_))))
                },
            ),
            Property::always(ONE_EFFECT, |_, s: &State| !s.world.other_effect),
            Property::always(ONE_CALL, |_, s: &State| s.world.calls <= 1),
            // The checks above mean something only if these states are reachable.
            Property::sometimes("a crashed holder's key is taken over", |_, s: &State| {
                s.taken_over && s.crashed
            }),
            Property::sometimes("a key succeeds after a takeover", |_, s: &State| {
                s.taken_over
                    && s.record
                        .as_ref()
                        .is_some_and(|r| r.status == RecordStatus::Succeeded)
            }),
            Property::sometimes("the sweeper deletes a record", |_, s: &State| {
                s.record.is_none() && s.granted.is_some()
            }),
            Property::sometimes(
                "a run settles after its phase and its effect",
                |_, s: &State| s.world.settled && s.world.intent,
            ),
        ];
        match self.takeover {
            Takeover::Refuse => properties.push(Property::sometimes(
                "a run that called the downstream is answered outcome_unknown",
                |_, s: &State| {
                    s.world.calls == 1
                        && s.record
                            .as_ref()
                            .is_some_and(|r| r.response == Some(Answer::OutcomeUnknown))
                },
            )),
            Takeover::Resume => properties.extend([
                Property::sometimes("a takeover resumes from a recovery point", |_, s: &State| {
                    s.execs.iter().any(|e| {
                        matches!(e, Exec::Holding(run) if run.resumed && run.step == Step::Committed)
                    })
                }),
                Property::sometimes(
                    "a resumed run asks the downstream again by effect key, and settles",
                    |_, s: &State| s.world.calls > 1 && !s.world.other_effect && s.world.settled,
                ),
            ]),
            Takeover::Rerun => properties.push(Property::sometimes(
                "a takeover runs phase 1 again",
                |_, s: &State| {
                    s.execs.iter().any(|e| {
                        matches!(e, Exec::Holding(run) if run.resumed && run.step == Step::Claimed)
                    })
                },
            )),
        }
        properties
    }
}

#[test]
fn the_claim_protocol_holds_under_crashes_expiry_and_clock_skew() {
    assert_properties_but(&check(ClaimProtocol::on(Takeover::Refuse)), &[]);
}

#[test]
fn a_resume_route_applies_an_effect_once_and_resumes_past_its_phase() {
    // A resumed run calls the downstream again: only its deduplication keeps the effect single.
    assert_properties_but(&check(ClaimProtocol::on(Takeover::Resume)), &[ONE_CALL]);
}

#[test]
fn a_rerun_route_applies_an_effect_once_by_its_effect_key() {
    assert_properties_but(&check(ClaimProtocol::on(Takeover::Rerun)), &[ONE_CALL]);
}

#[test]
fn without_the_fence_a_stale_executor_overwrites_its_successor() {
    let checker = find(
        ClaimProtocol {
            fence_on_finish: false,
            ..ClaimProtocol::on(Takeover::Refuse)
        },
        STALE_FINISH,
    );
    checker.assert_any_discovery(STALE_FINISH);
}

#[test]
fn without_the_fence_a_stale_executor_commits_a_phase() {
    let checker = find(
        ClaimProtocol {
            fence_on_phase: false,
            ..ClaimProtocol::on(Takeover::Resume)
        },
        STALE_PHASE,
    );
    checker.assert_any_discovery(STALE_PHASE);
}

#[test]
fn a_phase_in_two_transactions_leaves_an_intent_without_its_recovery_point() {
    let checker = find(
        ClaimProtocol {
            atomic_phase: false,
            ..ClaimProtocol::on(Takeover::Resume)
        },
        ATOMIC_PHASE,
    );
    checker.assert_any_discovery(ATOMIC_PHASE);
}

#[test]
fn a_rerun_route_calls_the_downstream_again_for_a_possibly_done_effect() {
    let checker = find(ClaimProtocol::on(Takeover::Rerun), ONE_CALL);
    checker.assert_any_discovery(ONE_CALL);
}

#[test]
fn without_the_skew_margin_two_executors_work_at_once() {
    let checker = find(
        ClaimProtocol {
            skew_margin: false,
            ..ClaimProtocol::on(Takeover::Refuse)
        },
        ONE_WORKER,
    );
    checker.assert_any_discovery(ONE_WORKER);
}

#[test]
fn without_skew_the_margin_is_not_needed() {
    // The margin is there for skew alone: with synchronised clocks the bare lease suffices.
    let checker = check(ClaimProtocol {
        skew_margin: false,
        max_skew: 0,
        ..ClaimProtocol::on(Takeover::Refuse)
    });
    checker.assert_no_discovery(ONE_WORKER);
}

#[test]
fn earlier_rule_a_resumed_run_that_fails_releases_a_record_past_its_phase() {
    // A resumes past B's phase and effect, the downstream refuses, the layer releases the key as
    // if nothing had happened; the next claim starts a new use under a new effect key.
    let checker = find(
        ClaimProtocol {
            nothing_done: NothingDone::ThisRun,
            ..ClaimProtocol::on(Takeover::Resume)
        },
        ONE_EFFECT,
    );
    checker.assert_any_discovery(ONE_EFFECT);
}

#[test]
fn earlier_rule_a_dropped_takeover_releases_a_run_that_may_have_applied_its_effect() {
    // On the default policy: the release of a dropped takeover deletes the abandoned run that
    // called the downstream, and the next claim calls it again under a new effect key.
    let checker = find(
        ClaimProtocol {
            dropped_claim: DroppedClaim::Release,
            ..ClaimProtocol::on(Takeover::Refuse)
        },
        ONE_EFFECT,
    );
    checker.assert_any_discovery(ONE_EFFECT);
}

#[test]
fn a_store_crash_can_hand_a_lost_claims_token_to_another_run() {
    // A deferred claim lost in a store crash leaves its holder running. A fresh claim that reads
    // the same time on its clock (with the same lease) gets the same token, and the fence then
    // lets the first run commit its phase into the second run's record.
    let checker = find(
        ClaimProtocol {
            store_crash: true,
            ..ClaimProtocol::on(Takeover::Resume)
        },
        STALE_PHASE,
    );
    checker.assert_any_discovery(STALE_PHASE);
}
