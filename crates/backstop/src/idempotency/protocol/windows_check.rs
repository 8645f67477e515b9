//! Exhaustive check of the windowed idempotency store's design (stateright).
//!
//! The SQLite store puts records in **time windows** and expires whole windows by dropping
//! them, so no key index grows with the number of live records (the PostgreSQL store keeps one
//! table: the README says why). This model is that design, rule by rule (the PostgreSQL
//! variants of a rule are the ones a windowed PostgreSQL store would need):
//!
//! - **One clock for placement.** The store's own clock (the SQLite process; PostgreSQL's
//!   `clock_timestamp()` on the server) chooses the window: window index = floor(t / W).
//! - **Claim.** In ONE transaction, under a per-key lock (PostgreSQL: an advisory lock on the
//!   key's hash, held by the claim's transaction; SQLite: the single writer), the claim looks
//!   for the key in every window that exists (not yet dropped). It inserts a new record into
//!   the window of the store's time *at the insert*, or takes over a failed or expired-lease
//!   record, or finds a live record and claims nothing. The transaction is two steps: the
//!   insert, at which the window is chosen, and the commit, up to D ticks later (a slow
//!   transaction); the per-key lock is held between them, and a completion of the key waits
//!   for it (the claim's transaction holds the rows it read).
//! - **Expiry.** A record with `expires_at < now` (and no live lease) is as if absent: the
//!   claim deletes it, in whatever window it is, and inserts a new record into the current one.
//! - **Sealed windows and summaries.** Window w is *sealed* once store time >= (w+1)·W + G,
//!   where the grace G is at least the longest a claim may take between choosing its window
//!   and committing (G >= D). From then on an instance may build (or, after a crash, load) a
//!   **summary** of it: a Bloom filter in the store, modelled as the exact set of keys the
//!   window held when the summary was built (false positives are harmless, false negatives are
//!   the danger). A claim skips a sealed window whose summary it holds and which does not
//!   contain the key; a window without a summary in that instance is probed.
//! - **Takeover moves the record.** A takeover deletes the record from its old window and
//!   inserts it (new lease, new expiry) into the current window, in the same transaction.
//! - **Completion** (succeeded or failed) updates the record in place in its window, setting
//!   `expires_at = max(expires_at, now + TTL)`, fenced by `lease_until` *and by the lease being
//!   live by the store's clock* (`lease_until > now`), so a completion lands at most one lease
//!   after its claim. (Today's stores fence by the token alone; see
//!   `a_completion_after_its_lease_lands_between_the_check_and_the_detach`.)
//! - **Drop.** A sweeper drops a sealed window when every record in it has
//!   `expires_at < now` and none runs under a live lease. It reads that (the real store reads
//!   max(expires_at) through the expiry index) and detaches the window later (drops the table);
//!   anything may happen in between, and the detach waits
//!   for claim transactions that read the window. The detach is atomic: after it, probes no
//!   longer see the window.
//! - **Crashes.** An instance may crash: its claim transaction in flight aborts (nothing of it
//!   commits, the lock is released), its lease is abandoned, its summaries are lost.
//!
//! The checker visits every reachable state (up to swapping the instances) and asserts:
//!
//! 1. one live record per key: across the existing windows, at most one record of the key
//!    with `expires_at >= now` or running under a live lease;
//! 2. no double claim: two instances never both hold a live lease;
//! 3. a drop loses nothing live: a detached window held no record with
//!    `expires_at >= now` and none running under a live lease;
//! 4. a summary never hides a live record: a window a claim skips by its summary holds no live
//!    record of the key;
//! 5. a sealed window is never renewed: no claim commits a lease into a window other than the
//!    one of its insert's time, so a sealed window's records only age (each is completed at
//!    most once, within its lease) and a window is not kept alive by a key taken over again
//!    and again.
//!
//! `sometimes` checks make sure the interesting states are reached: a claim straddles a window
//! boundary while the other instance waits for the key, a takeover moves a record out of a
//! sealed window, a window holding a record is dropped, a claim skips a window by its summary,
//! an instance crashes mid-claim.
//!
//! Bounds of the shipped configuration: 1 key, 2 instances with 2 claims each, W = 2 ticks,
//! D = 1, G = 1, lease 2 ticks, TTL 2 ticks, time 0..=6 (windows 0 to 3; windows 0 and 1 seal,
//! get summaries and may be dropped). A claim decides by the protocol's own rule
//! ([`claim`](super::claim)) and completions by its fence ([`holds`](super::holds)).
//!
//! The mutation tests each break one rule, and the checker must find a counterexample: grace
//! G = 0 with D = 1, a claim probing only the current window, a takeover renewing in place,
//! a drop not checking expiry, no per-key lock, and a completion fenced by the token alone.
//!
//! The move matters because the sweeper's read and its detach are two steps: a takeover that
//! chose a record before the window sealed may commit after the sweeper found the record
//! expired; moved, it lands in the current window; renewed in place, the detach drops it.
//! And the drop must read the window: a sweeper that drops a window at a fixed time
//! `(w+1)·W + lease + TTL` (`DropRule::ByBound`) loses a live record, because a takeover of a
//! failed record whose lease has not ended moves the token to `old lease_until + 1`, past the
//! requested lease, and repeated takeovers push it further.

use super::checking::{assert_properties_but, check, find};
use stateright::{Checker, Model, Property, Representative};

use super::{ClaimRule, Existing, claim, holds};
use crate::idempotency::RecordStatus;

/// Instances racing for the key.
const INSTANCES: usize = 2;

/// Windows the arrays hold: `horizon / width` must stay below this.
const WINDOWS: usize = 4;

const ONE_LIVE: &str = "at most one live record per key";
const ONE_LEASE: &str = "two instances never both hold a live lease";
const DROP_LOSES_NOTHING: &str = "a drop loses no live record";
const SUMMARY_HIDES_NOTHING: &str = "a summary never hides a live record";
const NOT_RENEWED: &str = "a sealed window is never renewed";

/// Reachability flags (`State::seen`).
const SKIPPED: u8 = 1;
const MOVED: u8 = 2;
const DROPPED: u8 = 4;
const CRASHED_MID_CLAIM: u8 = 8;

/// Which windows a claim looks in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    /// As designed: every window that exists, but those its summaries rule out.
    Existing,
    /// Mutation: the current window alone.
    CurrentOnly,
}

/// Where a takeover writes the record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    /// As designed: into the current window, deleting it from its old one.
    Move,
    /// Mutation: renewed where it is.
    InPlace,
}

/// When the sweeper may drop a sealed window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DropRule {
    /// As designed: every record expired and none under a live lease.
    Checked,
    /// Mutation: none under a live lease, expiry unread.
    Unchecked,
    /// Without reading the window: once time reaches `(w+1)·W + lease + TTL`.
    ByBound,
}

#[derive(Clone, Debug)]
struct WindowedStore {
    /// Window width W, in ticks.
    width: i64,
    /// Grace G after a window's end before it seals, in ticks.
    grace: i64,
    /// Longest a claim transaction takes from its insert to its commit (D), in ticks.
    slowest: i64,
    lease: i64,
    ttl: i64,
    /// Last tick explored.
    horizon: i64,
    /// Claims each instance may make (bounds the state space).
    max_attempts: u8,
    probe: Probe,
    placement: Placement,
    drop: DropRule,
    /// Whether claims of a key are serialised by a per-key lock.
    key_lock: bool,
    /// Whether a completion also needs its lease live by the store's clock.
    time_fence: bool,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Rec {
    status: RecordStatus,
    lease_until: i64,
    expires_at: i64,
}

#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
struct Window {
    /// The key's record in this window (a window holds a key at most once: primary key).
    rec: Option<Rec>,
    dropped: bool,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
enum Inst {
    Idle,
    /// Inside a claim transaction, between its insert and its commit.
    Claiming(Txn),
    /// Holds the lease whose token is `token` on the record in `window`.
    Holding {
        token: i64,
        window: usize,
    },
}

/// A claim transaction's writes, decided at its insert, applied at its commit.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
struct Txn {
    /// Store time at the insert.
    began: i64,
    /// Windows it read (a detach waits for it).
    read: u8,
    /// Windows whose record of the key it deletes (expired, or moved by a takeover).
    delete: u8,
    /// Window it writes the record into.
    window: usize,
    lease_until: i64,
    expires_at: i64,
    /// It takes over a record of a sealed window.
    from_sealed: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    now: i64,
    windows: [Window; WINDOWS],
    insts: [Inst; INSTANCES],
    attempts: [u8; INSTANCES],
    /// Per instance, a bit per window: the summaries it holds, and which of them contain the key.
    summaries: [u8; INSTANCES],
    contains: [u8; INSTANCES],
    /// A window the sweeper found droppable and has not detached yet.
    pending_drop: Option<usize>,
    /// Set when a detach dropped a live record.
    lost: bool,
    /// Set when a claim skipped, by its summary, a window holding a live record.
    hidden: bool,
    /// Set when a claim committed a lease into a window other than its insert's.
    renewed_old: bool,
    /// Reachability flags.
    seen: u8,
}

/// Instances are interchangeable: the checker visits one of two states that swap them.
impl Representative for State {
    fn representative(&self) -> Self {
        let key = |i: usize| {
            (
                self.insts[i],
                self.attempts[i],
                self.summaries[i],
                self.contains[i],
            )
        };
        let mut state = self.clone();
        if key(0) > key(1) {
            state.insts.swap(0, 1);
            state.attempts.swap(0, 1);
            state.summaries.swap(0, 1);
            state.contains.swap(0, 1);
        }
        state
    }
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Action {
    Tick,
    /// A claim's insert: reads the windows, decides, and (if it writes) opens its transaction.
    Claim(usize),
    Commit(usize),
    Complete(usize, RecordStatus),
    Crash(usize),
    /// Instance builds or loads its summary of a sealed window.
    Summarise(usize, usize),
    /// The sweeper finds a window droppable.
    CheckDrop(usize),
    Detach,
}

const fn bit(w: usize) -> u8 {
    1 << w
}

/// Running under a lease that is still live.
fn leased(rec: &Rec, now: i64) -> bool {
    rec.status == RecordStatus::Running && rec.lease_until > now
}

/// Not expired: a claim must not ignore it, a drop must not lose it.
fn live(rec: &Rec, now: i64) -> bool {
    rec.expires_at >= now || leased(rec, now)
}

impl WindowedStore {
    /// The design as above, in the bounds the module docs give.
    fn designed() -> Self {
        WindowedStore {
            width: 2,
            grace: 1,
            slowest: 1,
            lease: 2,
            ttl: 2,
            horizon: 6,
            max_attempts: 2,
            probe: Probe::Existing,
            placement: Placement::Move,
            drop: DropRule::Checked,
            key_lock: true,
            time_fence: true,
        }
    }

    fn window_of(&self, t: i64) -> usize {
        (t / self.width) as usize
    }

    fn sealed(&self, w: usize, now: i64) -> bool {
        now >= (w as i64 + 1) * self.width + self.grace
    }

    /// When every record of window `w` would have expired, were leases never longer than asked.
    fn bound(&self, w: usize) -> i64 {
        (w as i64 + 1) * self.width + self.lease + self.ttl
    }

    fn claiming(state: &State) -> impl Iterator<Item = &Txn> {
        state.insts.iter().filter_map(|inst| match inst {
            Inst::Claiming(txn) => Some(txn),
            _ => None,
        })
    }

    /// A claim's insert by instance `i`: the lookup, the rule, and the writes it will commit.
    fn claim(&self, state: &mut State, i: usize) {
        state.attempts[i] += 1;
        let now = state.now;
        let current = self.window_of(now);
        let mut read = 0;
        let mut expired = 0;
        let mut found = None;
        for w in (0..=current).rev() {
            let window = state.windows[w];
            if window.dropped || (self.probe == Probe::CurrentOnly && w != current) {
                continue;
            }
            if state.summaries[i] & bit(w) != 0 && state.contains[i] & bit(w) == 0 {
                state.seen |= SKIPPED;
                if window.rec.is_some_and(|rec| live(&rec, now)) {
                    state.hidden = true;
                }
                continue;
            }
            read |= bit(w);
            match window.rec {
                Some(rec) if !live(&rec, now) => expired |= bit(w),
                // The newest first: there is one unless the design is broken.
                Some(rec) if found.is_none() => found = Some((w, rec)),
                _ => {}
            }
        }
        let existing = found.map(|(_, rec): (usize, Rec)| Existing {
            status: rec.status,
            lease_until_ms: rec.lease_until,
            same_fingerprint: true,
        });
        let txn = match claim(existing, now, now + self.lease) {
            ClaimRule::Insert { lease_until_ms } => Txn {
                began: now,
                read,
                delete: expired,
                window: current,
                lease_until: lease_until_ms,
                expires_at: now + self.ttl,
                from_sealed: false,
            },
            ClaimRule::TakeOver { lease_until_ms } => {
                let Some((old, rec)) = found else {
                    unreachable!("a takeover has a record")
                };
                Txn {
                    began: now,
                    read,
                    delete: expired | bit(old),
                    window: match self.placement {
                        Placement::Move => current,
                        Placement::InPlace => old,
                    },
                    lease_until: lease_until_ms,
                    expires_at: rec.expires_at.max(now + self.ttl),
                    from_sealed: self.sealed(old, now),
                }
            }
            // Replay, in progress: read only, nothing to commit.
            ClaimRule::Replay | ClaimRule::InProgress { .. } | ClaimRule::Conflict => return,
        };
        state.insts[i] = Inst::Claiming(txn);
    }

    fn commit(&self, state: &mut State, i: usize) {
        let Inst::Claiming(txn) = state.insts[i] else {
            unreachable!("only a claim commits")
        };
        let target = state.windows[txn.window];
        // The window's primary key refuses a second record of the key (only without the lock).
        if target.dropped || (target.rec.is_some() && txn.delete & bit(txn.window) == 0) {
            state.insts[i] = Inst::Idle;
            return;
        }
        for (w, window) in state.windows.iter_mut().enumerate() {
            if txn.delete & bit(w) != 0 {
                window.rec = None;
            }
        }
        state.windows[txn.window].rec = Some(Rec {
            status: RecordStatus::Running,
            lease_until: txn.lease_until,
            expires_at: txn.expires_at,
        });
        if txn.from_sealed && txn.delete & bit(txn.window) == 0 {
            state.seen |= MOVED;
        }
        if txn.window != self.window_of(txn.began) {
            state.renewed_old = true;
        }
        state.insts[i] = Inst::Holding {
            token: txn.lease_until,
            window: txn.window,
        };
    }

    fn complete(&self, state: &mut State, i: usize, status: RecordStatus) {
        let Inst::Holding { token, window } = state.insts[i] else {
            unreachable!("only a holder completes")
        };
        let now = state.now;
        if let Some(rec) = state.windows[window].rec.as_mut() {
            if holds(rec.status, rec.lease_until, token) && (!self.time_fence || leased(rec, now)) {
                rec.status = status;
                rec.expires_at = rec.expires_at.max(now + self.ttl);
            }
        }
        // Fenced out or not, the run is over.
        state.insts[i] = Inst::Idle;
    }

    fn droppable(&self, state: &State, w: usize) -> bool {
        let window = state.windows[w];
        let now = state.now;
        if window.dropped || !self.sealed(w, now) {
            return false;
        }
        match self.drop {
            DropRule::Checked => window.rec.is_none_or(|rec| !live(&rec, now)),
            DropRule::Unchecked => window.rec.is_none_or(|rec| !leased(&rec, now)),
            DropRule::ByBound => now >= self.bound(w),
        }
    }
}

impl Model for WindowedStore {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        assert!(self.window_of(self.horizon) < WINDOWS);
        vec![State {
            now: 0,
            windows: [Window::default(); WINDOWS],
            insts: [Inst::Idle; INSTANCES],
            attempts: [0; INSTANCES],
            summaries: [0; INSTANCES],
            contains: [0; INSTANCES],
            pending_drop: None,
            lost: false,
            hidden: false,
            renewed_old: false,
            seen: 0,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        let now = state.now;
        let mut claims = Self::claiming(state);
        // A transaction commits (or aborts) within D ticks of its insert.
        if now < self.horizon && claims.all(|txn| now < txn.began + self.slowest) {
            actions.push(Action::Tick);
        }
        let locked = Self::claiming(state).next().is_some();
        for (i, inst) in state.insts.iter().enumerate() {
            match inst {
                Inst::Idle if state.attempts[i] < self.max_attempts => {
                    if !(self.key_lock && locked) {
                        actions.push(Action::Claim(i));
                    }
                }
                Inst::Idle => {}
                Inst::Claiming(_) => actions.push(Action::Commit(i)),
                // The claim's transaction holds the key's rows: a completion waits for it.
                Inst::Holding { .. } if !(self.key_lock && locked) => actions.extend([
                    Action::Complete(i, RecordStatus::Succeeded),
                    Action::Complete(i, RecordStatus::Failed),
                ]),
                Inst::Holding { .. } => {}
            }
            if *inst != Inst::Idle || state.summaries[i] != 0 {
                actions.push(Action::Crash(i));
            }
            for w in 0..WINDOWS {
                let window = state.windows[w];
                if self.sealed(w, now) && !window.dropped && state.summaries[i] & bit(w) == 0 {
                    actions.push(Action::Summarise(i, w));
                }
            }
        }
        match state.pending_drop {
            None => {
                for w in 0..WINDOWS {
                    if self.droppable(state, w) {
                        actions.push(Action::CheckDrop(w));
                    }
                }
            }
            // The detach waits for transactions that read the window.
            Some(w) => {
                if Self::claiming(state).all(|txn| (txn.read | bit(txn.window)) & bit(w) == 0) {
                    actions.push(Action::Detach);
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Tick => state.now += 1,
            Action::Claim(i) => self.claim(&mut state, i),
            Action::Commit(i) => self.commit(&mut state, i),
            Action::Complete(i, status) => self.complete(&mut state, i, status),
            Action::Crash(i) => {
                if matches!(state.insts[i], Inst::Claiming(_)) {
                    state.seen |= CRASHED_MID_CLAIM;
                }
                state.insts[i] = Inst::Idle;
                state.summaries[i] = 0;
                state.contains[i] = 0;
            }
            Action::Summarise(i, w) => {
                state.summaries[i] |= bit(w);
                if state.windows[w].rec.is_some() {
                    state.contains[i] |= bit(w);
                }
            }
            Action::CheckDrop(w) => state.pending_drop = Some(w),
            Action::Detach => {
                let w = state.pending_drop.take()?;
                let window = &mut state.windows[w];
                if let Some(rec) = window.rec.take() {
                    state.lost |= live(&rec, state.now);
                    state.seen |= DROPPED;
                }
                window.dropped = true;
                for i in 0..INSTANCES {
                    state.summaries[i] &= !bit(w);
                    state.contains[i] &= !bit(w);
                }
            }
        }
        (state != *last).then_some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_LIVE, |_, s: &State| {
                s.windows
                    .iter()
                    .filter(|w| !w.dropped && w.rec.is_some_and(|rec| live(&rec, s.now)))
                    .count()
                    <= 1
            }),
            Property::always(ONE_LEASE, |_, s: &State| {
                s.insts
                    .iter()
                    .filter(|inst| matches!(inst, Inst::Holding { token, .. } if *token > s.now))
                    .count()
                    <= 1
            }),
            Property::always(DROP_LOSES_NOTHING, |_, s: &State| !s.lost),
            Property::always(SUMMARY_HIDES_NOTHING, |_, s: &State| !s.hidden),
            Property::always(NOT_RENEWED, |_, s: &State| !s.renewed_old),
            // The checks above mean something only if these states are reachable.
            Property::sometimes(
                "a claim straddles a window boundary while the other instance waits for the key",
                |m: &WindowedStore, s: &State| {
                    WindowedStore::claiming(s)
                        .any(|txn| m.window_of(txn.began) < m.window_of(s.now))
                        && (0..INSTANCES)
                            .any(|i| s.insts[i] == Inst::Idle && s.attempts[i] < m.max_attempts)
                },
            ),
            Property::sometimes(
                "a takeover moves a record out of a sealed window",
                |_, s: &State| s.seen & MOVED != 0,
            ),
            Property::sometimes("a window holding a record is dropped", |_, s: &State| {
                s.seen & DROPPED != 0
            }),
            Property::sometimes("a claim skips a window by its summary", |_, s: &State| {
                s.seen & SKIPPED != 0
            }),
            Property::sometimes("an instance crashes mid-claim", |_, s: &State| {
                s.seen & CRASHED_MID_CLAIM != 0
            }),
        ]
    }
}

/// Asserts that the checker finds a counterexample to `property`, and shows it.
fn assert_found(model: WindowedStore, property: &'static str) {
    let checker = find(model, property);
    if let Some(path) = checker.discovery(property) {
        eprintln!("{property}: {:?}", path.into_actions());
    }
    checker.assert_any_discovery(property);
}

#[test]
fn the_windowed_design_holds_under_slow_claims_crashes_and_drops() {
    assert_properties_but(&check(WindowedStore::designed()), &[]);
}

#[test]
fn without_grace_a_slow_insert_hides_behind_a_summary() {
    // A claim inserts into window 0 at its last tick and commits a tick later, when window 0
    // has sealed and the other instance has summarised it without the key; that instance's
    // next claim skips window 0 and inserts a second live record.
    assert_found(
        WindowedStore {
            grace: 0,
            ..WindowedStore::designed()
        },
        ONE_LIVE,
    );
}

#[test]
fn a_claim_probing_only_the_current_window_misses_an_older_record() {
    assert_found(
        WindowedStore {
            probe: Probe::CurrentOnly,
            ..WindowedStore::designed()
        },
        ONE_LIVE,
    );
}

#[test]
fn a_takeover_in_place_renews_a_sealed_window() {
    // A record of a sealed window taken over where it is: its window lives on with it.
    assert_found(
        WindowedStore {
            placement: Placement::InPlace,
            ..WindowedStore::designed()
        },
        NOT_RENEWED,
    );
}

#[test]
fn a_takeover_in_place_is_dropped_live() {
    // A takeover inserts at the window's last tick, the sweeper then finds the window sealed
    // and its (old) record expired, the takeover commits the renewed record in place, and the
    // detach drops it: a later claim gets a second live lease.
    assert_found(
        WindowedStore {
            placement: Placement::InPlace,
            ..WindowedStore::designed()
        },
        DROP_LOSES_NOTHING,
    );
}

#[test]
fn a_sweeper_dropping_a_window_at_a_fixed_time_loses_a_live_record() {
    // A failed record taken over before its lease ends gets the token `old + 1`, a lease
    // longer than asked: the window's records outlive any bound set from the lease and TTL.
    assert_found(
        WindowedStore {
            drop: DropRule::ByBound,
            ..WindowedStore::designed()
        },
        DROP_LOSES_NOTHING,
    );
}

#[test]
fn a_drop_that_does_not_check_expiry_loses_a_live_record() {
    assert_found(
        WindowedStore {
            drop: DropRule::Unchecked,
            ..WindowedStore::designed()
        },
        DROP_LOSES_NOTHING,
    );
}

#[test]
fn without_the_key_lock_two_claims_insert_into_two_windows() {
    assert_found(
        WindowedStore {
            key_lock: false,
            ..WindowedStore::designed()
        },
        ONE_LIVE,
    );
}

#[test]
fn a_completion_after_its_lease_lands_between_the_check_and_the_detach() {
    // Fenced by the token alone (today's stores), a holder whose lease has ended completes an
    // abandoned, expired record after the sweeper found its window droppable.
    assert_found(
        WindowedStore {
            time_fence: false,
            ..WindowedStore::designed()
        },
        DROP_LOSES_NOTHING,
    );
}
