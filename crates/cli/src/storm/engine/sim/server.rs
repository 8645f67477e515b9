//! The server's side of the simulation: admission of arriving attempts, refusals and their
//! pushback, the work on the downstream of the phase, and the next waiter started when a
//! worker frees.

use std::time::Duration;

use backstop::admission::Pushback;
use backstop::status::{Code, Status, problem};
use rand::RngExt;

use super::{Kind, ServerState, Sim};
use crate::storm::engine::admission::{Arrive, WorkOutcome};
use crate::storm::engine::slab::Key;
use crate::storm::engine::{Downstream, NANOS, Phase, RetryAfter, nanos};

impl Sim<'_> {
    pub(super) fn server_arrive(&mut self, akey: Key, deadline: Option<u64>) {
        self.set_in_system(1);
        self.totals.server_arrivals += 1;
        match self.admission.arrive(self.now, akey.pack(), deadline) {
            Arrive::Run => self.start_work(akey),
            Arrive::Queue { expire } => {
                if let Some(at) = expire {
                    self.schedule(at, Kind::Expire, akey.pack());
                }
            }
            Arrive::Refuse => self.refuse(akey),
        }
        self.refuse_dropped();
    }

    /// Answers the waiters admission dropped on someone else's behalf.
    fn refuse_dropped(&mut self) {
        for key in self.admission.take_refused() {
            let akey = Key::unpack(key);
            let Some(att) = self.atts.get(akey) else {
                continue;
            };
            if att.server != ServerState::Waiting {
                continue;
            }
            let sent_at = att.sent_at;
            self.totals.sojourn += (self.now - sent_at) as f64 / NANOS as f64;
            self.refuse(akey);
        }
    }

    fn refuse(&mut self, akey: Key) {
        self.set_in_system(-1);
        let row = self.row();
        self.rows[row].refused += 1;
        self.totals.refused += 1;
        let status = match self.server.retry_after {
            RetryAfter::None => None,
            RetryAfter::Fixed(wait) => Some(Pushback { wait, retry: true }),
            RetryAfter::Computed => {
                let unit = self.pushback_rng.random::<f64>();
                let pushback = self.admission.pushback(self.now, unit);
                Some(pushback.expect("checked by `run`: the fair queue computes pushback"))
            }
        }
        .filter(|_| self.client.honours_pushback)
        .map_or_else(
            || {
                Status::new(Code::Unavailable, "server overloaded, retry later")
                    .with_problem(problem::OVERLOADED)
            },
            // What the gate's refusal becomes (`impl From<Overloaded> for Status`).
            |Pushback { wait, retry }| {
                let status = Status::overloaded(wait);
                if retry {
                    status
                } else {
                    status.with_no_retry()
                }
            },
        );
        self.answered(akey, Err(status), false);
    }

    pub(super) fn expire(&mut self, akey: Key) {
        let Some(att) = self.atts.get(akey) else {
            return;
        };
        if att.server != ServerState::Waiting {
            return;
        }
        let sent_at = att.sent_at;
        if let Some(again) = self.admission.expire(self.now, akey.pack()) {
            self.schedule(again, Kind::Expire, akey.pack());
            return;
        }
        self.totals.sojourn += (self.now - sent_at) as f64 / NANOS as f64;
        self.refuse(akey);
        self.refuse_dropped();
    }

    fn start_work(&mut self, akey: Key) {
        let now = self.now;
        let phase = self.phase(now);
        let (work, mut outcome) = match phase.downstream {
            Downstream::Latency(d) => (d.sample_nanos(&mut self.rng), WorkOutcome::Served),
            Downstream::Failing { after, .. } => (nanos(after), WorkOutcome::Failed),
            Downstream::StalledUntil { at } => (nanos(at).saturating_sub(now), WorkOutcome::Failed),
            Downstream::Cold(cold) => {
                let w = self.warmth(&cold);
                // Admission counted this call among those running already.
                let factor = cold.factor(w, self.admission.inflight());
                let draw = cold.latency.sample_nanos(&mut self.rng) as f64;
                ((draw * factor).min(3.6e12) as u64, WorkOutcome::Served)
            }
        };
        let deadline_aware = self.server.deadline_aware;
        let Some(att) = self.atts.get(akey) else {
            return;
        };
        att.server = ServerState::Running;
        att.started = now;
        let mut end = now + (nanos(self.model.local) + work).max(1);
        if let Some(deadline) = att.deadline.filter(|_| deadline_aware) {
            if end > deadline {
                end = deadline.max(now + 1);
                outcome = WorkOutcome::CutOff;
            }
        }
        att.outcome = outcome;
        self.schedule(end, Kind::Done, akey.pack());
    }

    pub(super) fn done(&mut self, akey: Key) {
        let now = self.now;
        let Some(att) = self.atts.get(akey) else {
            return;
        };
        let (started, outcome, sent_at) = (att.started, att.outcome, att.sent_at);
        self.admission
            .finished(Duration::from_nanos(now - started), outcome);
        self.set_in_system(-1);
        self.totals.sojourn += (now - sent_at) as f64 / NANOS as f64;
        self.totals.served += 1;
        self.service
            .push(u32::try_from((now - started) / 1_000_000).unwrap_or(u32::MAX));
        if outcome == WorkOutcome::Served && self.cold_tau.is_some() {
            self.decay_heat();
            self.heat += 1.0;
        }
        let result = match outcome {
            WorkOutcome::Served => Ok(()),
            WorkOutcome::Failed => {
                let status = Status::new(Code::Unavailable, "downstream unavailable");
                // The pushback of the phase the call started in.
                match self.phase(started).downstream {
                    Downstream::Failing {
                        pushback: Some(wait),
                        ..
                    } if self.client.honours_pushback => Err(status.with_pushback(wait)),
                    _ => Err(status),
                }
            }
            WorkOutcome::CutOff => Err(Status::new(
                Code::DeadlineExceeded,
                "the server gave up at the deadline",
            )),
        };
        self.answered(akey, result, true);
        while let Some(next) = self.admission.next(now) {
            self.start_work(Key::unpack(next));
        }
        self.refuse_dropped();
    }

    fn phase(&self, t: u64) -> &Phase {
        let at = Duration::from_nanos(t);
        self.model
            .phases
            .iter()
            .rev()
            .find(|p| p.from <= at)
            .unwrap_or(&self.model.phases[0])
    }
}
