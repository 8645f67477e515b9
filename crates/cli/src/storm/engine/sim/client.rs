//! The clients' side of the simulation: arrivals, attempts and hedges sent by the library's
//! retry and hedging policies, timeouts, and the end of each logical request.

use std::time::Duration;

use backstop::deadline::Deadline;
use backstop::hedge::HedgePolicy;
use backstop::retry::RetryError;
use backstop::status::{Code, Status};

use super::{Att, Kind, Logical, ServerState, Sim};
use crate::storm::engine::admission::WorkOutcome;
use crate::storm::engine::slab::Key;
use crate::storm::engine::{Deadlines, NANOS, nanos};

impl Sim<'_> {
    pub(super) fn arrival(&mut self) {
        self.next_arrival();
        let timeout = nanos(self.client.timeout);
        // A fixed per-attempt timeout leaves the logical request as long as all its attempts
        // could take: the per-attempt timeouts are what ends each one.
        let deadline = if self.client.deadlines.per_attempt() {
            self.now + timeout * u64::from(self.client.max_attempts) + NANOS
        } else {
            self.now + timeout
        };
        let attempts = self.policy.attempts(Deadline::at(self.at(deadline)));
        let key = self.logicals.insert(Logical {
            attempts,
            deadline,
            started: self.now,
            open: [None, None],
            first_failed: false,
            hedged: false,
            remaining: Duration::ZERO,
        });
        self.totals.logical += 1;
        self.send(key);
    }

    /// Starts the next attempt of logical request `lkey`, as the retry policy allows.
    pub(super) fn send(&mut self, lkey: Key) {
        let now = self.at(self.now);
        let Some(logical) = self.logicals.get(lkey) else {
            return;
        };
        let started = logical.attempts.start(&self.policy, &self.call, now);
        let (attempt, remaining) = match started {
            Ok(ok) => ok,
            Err(error) => return self.finish(lkey, Err(error)),
        };
        logical.remaining = remaining;
        let deadline = logical.deadline;
        let retry = attempt.is_retry();
        self.send_attempt(lkey, deadline, retry, false);
        if !retry {
            if let Some(delay) = self.hedge.as_ref().and_then(HedgePolicy::delay) {
                self.schedule(self.now + nanos(delay), Kind::Hedge, lkey.pack());
            }
        }
    }

    /// Puts one attempt on the wire to the server.
    fn send_attempt(&mut self, lkey: Key, deadline: u64, retry: bool, hedge: bool) {
        let row = self.row();
        let r = &mut self.rows[row];
        if retry || hedge {
            r.offered_retries += 1;
            self.totals.retries += u64::from(retry);
            self.totals.hedges += u64::from(hedge);
            r.hedges += u64::from(hedge);
        } else {
            r.offered_originals += 1;
        }
        self.totals.attempts += 1;
        let (timeout_at, server_deadline) = match self.client.deadlines {
            Deadlines::Shared => (deadline, Some(deadline)),
            Deadlines::PerAttempt => (self.now + nanos(self.client.timeout), None),
            Deadlines::PerAttemptPropagated => {
                let at = self.now + nanos(self.client.timeout);
                (at, Some(at))
            }
        };
        let akey = self.atts.insert(Att {
            logical: lkey,
            sent_at: self.now,
            row,
            deadline: server_deadline,
            client_open: true,
            server: ServerState::Waiting,
            started: 0,
            outcome: WorkOutcome::Served,
        });
        if let Some(logical) = self.logicals.get(lkey) {
            let slot = logical.open.iter_mut().find(|s| s.is_none());
            *slot.expect("at most an attempt and its hedge are open") = Some(akey);
        }
        self.schedule(timeout_at, Kind::Timeout, akey.pack());
        self.server_arrive(akey, server_deadline);
    }

    pub(super) fn hedge(&mut self, lkey: Key) {
        let now = self.at(self.now);
        let Some(logical) = self.logicals.get(lkey) else {
            return;
        };
        if logical.hedged || logical.outstanding() != 1 {
            return;
        }
        let Some(policy) = &self.hedge else {
            return;
        };
        if !policy.try_hedge_at(now) {
            return;
        }
        logical.hedged = true;
        let deadline = logical.deadline;
        self.send_attempt(lkey, deadline, false, true);
    }

    /// The client stops waiting for attempt `akey` at its timeout.
    pub(super) fn timeout(&mut self, akey: Key) {
        let Some(att) = self.atts.get(akey) else {
            return;
        };
        if !att.client_open {
            return;
        }
        att.client_open = false;
        let (lkey, row, sent_at, server) = (att.logical, att.row, att.sent_at, att.server);
        if server == ServerState::Done {
            self.atts.remove(akey);
        }
        self.rows[row].attempts_failed += 1;
        let now = self.at(self.now);
        let elapsed = Duration::from_nanos(self.now - sent_at);
        let Some(logical) = self.logicals.get(lkey) else {
            return;
        };
        logical.close(akey);
        if logical.outstanding() > 0 {
            return;
        }
        let remaining = logical.remaining;
        if !logical.first_failed {
            logical.first_failed = true;
            self.totals.first_failed += 1;
        }
        let decision = if self.client.deadlines.per_attempt() {
            let status = Status::new(Code::DeadlineExceeded, "attempt timed out");
            logical.attempts.failed_at(
                &self.policy,
                &self.call,
                status,
                remaining,
                elapsed,
                now,
                &mut self.rng,
            )
        } else {
            logical.attempts.cut_off_at(
                &self.policy,
                &self.call,
                remaining,
                elapsed,
                now,
                &mut self.rng,
            )
        };
        self.decided(lkey, decision);
    }

    /// Acts on the retry policy's decision after a failed attempt.
    fn decided(&mut self, lkey: Key, decision: Result<Duration, RetryError>) {
        match decision {
            Ok(wait) => self.schedule(self.now + nanos(wait).max(1), Kind::Send, lkey.pack()),
            Err(error) => self.finish(lkey, Err(error)),
        }
    }

    /// The server answered attempt `akey`.
    pub(super) fn answered(&mut self, akey: Key, result: Result<(), Status>, worked: bool) {
        let now_ns = self.now;
        let row = self.row();
        let Some(att) = self.atts.get(akey) else {
            return;
        };
        att.server = ServerState::Done;
        if !att.client_open {
            self.atts.remove(akey);
            if worked {
                self.rows[row].wasted += 1;
                self.totals.wasted += 1;
            }
            return;
        }
        att.client_open = false;
        let (lkey, arow, sent_at) = (att.logical, att.row, att.sent_at);
        self.atts.remove(akey);
        let now = self.at(now_ns);
        let elapsed = Duration::from_nanos(now_ns - sent_at);
        let Some(logical) = self.logicals.get(lkey) else {
            return;
        };
        logical.close(akey);
        let remaining = logical.remaining;
        match result {
            Ok(()) => {
                self.rows[row].goodput += 1;
                self.totals.goodput += 1;
                logical
                    .attempts
                    .succeeded_at(&self.policy, &self.call, remaining, elapsed, now);
                if let Some(hedge) = &self.hedge {
                    hedge.record_latency(elapsed);
                }
                self.finish(lkey, Ok(()));
            }
            Err(status) => {
                self.rows[arow].attempts_failed += 1;
                if logical.outstanding() > 0 {
                    // Its hedge may still answer.
                    return;
                }
                if !logical.first_failed {
                    logical.first_failed = true;
                    self.totals.first_failed += 1;
                }
                let decision = logical.attempts.failed_at(
                    &self.policy,
                    &self.call,
                    status,
                    remaining,
                    elapsed,
                    now,
                    &mut self.rng,
                );
                self.decided(lkey, decision);
            }
        }
    }

    /// Logical request `lkey` ends: in success, or stopped for the error's reason.
    fn finish(&mut self, lkey: Key, outcome: Result<(), RetryError>) {
        let Some(logical) = self.logicals.remove(lkey) else {
            return;
        };
        let row = self.row();
        let latency_ms = (self.now - logical.started) / 1_000_000;
        self.latencies
            .push(u32::try_from(latency_ms).unwrap_or(u32::MAX));
        match outcome {
            Ok(()) => {
                self.rows[row].logical_ok += 1;
                self.totals.logical_ok += 1;
            }
            Err(error) => {
                self.rows[row].logical_failed += 1;
                *self.totals.stops.entry(error.reason.as_str()).or_default() += 1;
            }
        }
        // Attempts still out (a hedge's sibling) now answer nobody.
        for akey in logical.open.into_iter().flatten() {
            if let Some(att) = self.atts.get(akey) {
                att.client_open = false;
                if att.server == ServerState::Done {
                    self.atts.remove(akey);
                }
            }
        }
    }
}
