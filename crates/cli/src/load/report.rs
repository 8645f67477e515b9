//! What a load run measured: counts per logical request and per attempt, latencies per attempt
//! number, stop reasons; rendered as a text summary or JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use backstop::retry::StormAlarm;
use backstop::status::Outcome;
use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::time::Instant;

/// Attempt numbers with their own latency histogram; later attempts share the last one.
pub(crate) const TRACKED_ATTEMPTS: usize = 5;

/// Highest latency a histogram holds (longer attempts are clamped to it): one hour in µs.
const MAX_LATENCY_US: u64 = 3_600_000_000;

/// One attempt (one physical send) as the load driver saw it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttemptRecord {
    /// 1 for the first attempt of a logical request; a later one is 1 + its
    /// `grpc-previous-rpc-attempts`.
    pub(crate) number: u32,
    pub(crate) latency: Duration,
    pub(crate) outcome: AttemptOutcome,
    /// Sent as a hedge rather than a retry.
    pub(crate) hedge: bool,
    /// A transparent re-send of an attempt that never reached the server (same number).
    pub(crate) resend: bool,
    /// When it was sent.
    pub(crate) sent: Instant,
}

/// What an attempt was, for the per-interval series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AttemptKind {
    /// The first attempt of a logical request.
    Original,
    /// A retry after a failed attempt.
    Retry,
    /// A hedged copy sent while an attempt was still running.
    Hedge,
    /// A transparent re-send of an attempt that never reached the server.
    Resend,
}

impl AttemptRecord {
    /// What this attempt was.
    pub(crate) fn kind(&self) -> AttemptKind {
        if self.resend {
            AttemptKind::Resend
        } else if self.hedge {
            AttemptKind::Hedge
        } else if self.number > 1 {
            AttemptKind::Retry
        } else {
            AttemptKind::Original
        }
    }
}

/// How one attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AttemptOutcome {
    /// It got an answer, or failed, with this outcome.
    Done(Outcome),
    /// Dropped unfinished before the deadline: the other attempt of a hedge race answered
    /// first.
    Cancelled,
}

impl AttemptOutcome {
    fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Done(outcome) => outcome.as_str(),
            AttemptOutcome::Cancelled => "cancelled",
        }
    }
}

impl From<Outcome> for AttemptOutcome {
    fn from(outcome: Outcome) -> Self {
        AttemptOutcome::Done(outcome)
    }
}

/// How one logical request ended.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LogicalRecord {
    pub(crate) outcome: Outcome,
    /// Why the client gave up (`None` when it succeeded).
    pub(crate) stop_reason: Option<&'static str>,
}

/// Running totals of a load run. Each task keeps its own and the driver merges them, so
/// recording never contends on a lock.
#[derive(Debug)]
pub(crate) struct Tally {
    logical: u64,
    attempts: u64,
    retries: u64,
    hedges: u64,
    hedge_results: HedgeResults,
    transparent_retries: u64,
    /// Scheduled logical requests not started because `--concurrency` were already in flight.
    skipped: u64,
    /// Logical requests that ended without any attempt sent.
    unsent: u64,
    outcomes: BTreeMap<&'static str, u64>,
    attempt_outcomes: BTreeMap<&'static str, u64>,
    stop_reasons: BTreeMap<&'static str, u64>,
    /// Attempt latency in µs, by attempt number (index 0 = attempt 1).
    latency: Vec<Histogram<u64>>,
    /// When each attempt recorded here was sent, and what it was: read by the per-interval
    /// series for one logical request's tally; not merged.
    sent: Vec<(Instant, AttemptKind)>,
    /// How the last logical request recorded here ended.
    last_outcome: Option<Outcome>,
}

impl Tally {
    pub(crate) fn new() -> Self {
        let latency = (0..TRACKED_ATTEMPTS)
            .map(|_| {
                Histogram::new_with_bounds(1, MAX_LATENCY_US, 3)
                    .expect("constant histogram bounds are valid")
            })
            .collect();
        Self {
            logical: 0,
            attempts: 0,
            retries: 0,
            hedges: 0,
            hedge_results: HedgeResults::default(),
            transparent_retries: 0,
            skipped: 0,
            unsent: 0,
            outcomes: BTreeMap::new(),
            attempt_outcomes: BTreeMap::new(),
            stop_reasons: BTreeMap::new(),
            latency,
            sent: Vec::new(),
            last_outcome: None,
        }
    }

    pub(crate) fn attempt(&mut self, a: AttemptRecord) {
        self.attempts += 1;
        let kind = a.kind();
        match kind {
            AttemptKind::Resend => self.transparent_retries += 1,
            AttemptKind::Hedge => {
                self.hedges += 1;
                self.hedge_results.count(a.outcome);
            }
            AttemptKind::Retry => self.retries += 1,
            AttemptKind::Original => {}
        }
        self.sent.push((a.sent, kind));
        *self.attempt_outcomes.entry(a.outcome.as_str()).or_default() += 1;
        let index = (a.number.max(1) as usize - 1).min(TRACKED_ATTEMPTS - 1);
        let us = u64::try_from(a.latency.as_micros()).unwrap_or(u64::MAX);
        self.latency[index].saturating_record(us.clamp(1, MAX_LATENCY_US));
    }

    pub(crate) fn logical(&mut self, l: LogicalRecord) {
        self.logical += 1;
        self.last_outcome = Some(l.outcome);
        *self.outcomes.entry(l.outcome.as_str()).or_default() += 1;
        if let Some(reason) = l.stop_reason {
            *self.stop_reasons.entry(reason).or_default() += 1;
        }
    }

    pub(crate) fn skipped(&mut self) {
        self.skipped += 1;
    }

    /// A logical request ended without any attempt being sent (the client refused them all).
    pub(crate) fn unsent(&mut self) {
        self.unsent += 1;
    }

    pub(crate) fn merge(&mut self, other: Tally) {
        self.logical += other.logical;
        self.attempts += other.attempts;
        self.retries += other.retries;
        self.hedges += other.hedges;
        self.hedge_results.add(other.hedge_results);
        self.transparent_retries += other.transparent_retries;
        self.skipped += other.skipped;
        self.unsent += other.unsent;
        for (map, theirs) in [
            (&mut self.outcomes, other.outcomes),
            (&mut self.attempt_outcomes, other.attempt_outcomes),
            (&mut self.stop_reasons, other.stop_reasons),
        ] {
            for (k, v) in theirs {
                *map.entry(k).or_default() += v;
            }
        }
        for (mine, theirs) in self.latency.iter_mut().zip(other.latency) {
            // Same bounds on both sides, so adding cannot fail.
            let _ = mine.add(theirs);
        }
    }

    /// The attempts recorded here (when sent, what they were) and how the last logical request
    /// ended: what the per-interval series needs of one logical request's tally.
    pub(crate) fn last_request(&self) -> (&[(Instant, AttemptKind)], Option<Outcome>) {
        (&self.sent, self.last_outcome)
    }

    pub(crate) fn logical_count(&self) -> u64 {
        self.logical
    }

    /// Retries (attempts after the first, hedges excluded).
    pub(crate) fn retry_count(&self) -> u64 {
        self.retries
    }

    pub(crate) fn ok_count(&self) -> u64 {
        self.outcomes
            .get(Outcome::Ok.as_str())
            .copied()
            .unwrap_or(0)
    }

    /// The summary of a run that lasted `elapsed`.
    pub(crate) fn summary(&self, elapsed: Duration, policy: &str, target: &str) -> Summary {
        let ok = self.ok_count();
        let secs = elapsed.as_secs_f64().max(f64::EPSILON);
        let latency_ms = self
            .latency
            .iter()
            .enumerate()
            .filter(|(_, h)| !h.is_empty())
            .map(|(i, h)| {
                let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
                AttemptLatency {
                    attempt: if i + 1 == TRACKED_ATTEMPTS {
                        format!("{}+", i + 1)
                    } else {
                        (i + 1).to_string()
                    },
                    count: h.len(),
                    p50_ms: ms(0.5),
                    p99_ms: ms(0.99),
                }
            })
            .collect();
        Summary {
            target: target.to_owned(),
            policy: policy.to_owned(),
            elapsed_s: secs,
            logical_requests: self.logical,
            skipped: self.skipped,
            unsent: self.unsent,
            attempts: self.attempts,
            retries: self.retries,
            hedges: self.hedges,
            hedge_results: self.hedge_results,
            transparent_retries: self.transparent_retries,
            // Retries per logical request, never per attempt: what a retry budget bounds.
            retry_ratio: if self.logical == 0 {
                0.0
            } else {
                self.retries as f64 / self.logical as f64
            },
            outcomes: self.outcomes.clone(),
            attempt_outcomes: self.attempt_outcomes.clone(),
            goodput_per_s: ok as f64 / secs,
            latency_ms,
            stop_reasons: self.stop_reasons.clone(),
            storm_alarm: None,
            client_pending_peak: None,
        }
    }
}

/// How the hedges of a run ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct HedgeResults {
    /// The hedge answered with a success first: its answer was the one used.
    won: u64,
    /// The hedge was dropped unanswered: the attempt it raced answered first (or the deadline
    /// passed with neither answered).
    lost: u64,
    /// The hedge ended with an error: the service refused it (the same key still in progress
    /// past the hedge's budget, overload, quota) or failed it, or the transport did.
    refused: u64,
}

impl HedgeResults {
    fn count(&mut self, outcome: AttemptOutcome) {
        match outcome {
            AttemptOutcome::Done(Outcome::Ok) => self.won += 1,
            AttemptOutcome::Cancelled | AttemptOutcome::Done(Outcome::Timeout) => self.lost += 1,
            AttemptOutcome::Done(_) => self.refused += 1,
        }
    }

    fn add(&mut self, other: HedgeResults) {
        self.won += other.won;
        self.lost += other.lost;
        self.refused += other.refused;
    }
}

/// Latency of the attempts with one attempt number.
#[derive(Debug, Serialize)]
pub(crate) struct AttemptLatency {
    /// Attempt number (`"5+"` for the fifth and later).
    attempt: String,
    count: u64,
    p50_ms: f64,
    p99_ms: f64,
}

/// The end-of-run summary (`--json` prints it as one JSON object).
#[derive(Debug, Serialize)]
pub(crate) struct Summary {
    target: String,
    policy: String,
    elapsed_s: f64,
    logical_requests: u64,
    /// Scheduled but not started: `--concurrency` requests were already in flight.
    skipped: u64,
    /// Logical requests the client ended without sending any attempt: the stack refuses an
    /// attempt when its circuit breaker is open or when the deadline leaves no more than the
    /// margin kept for the way back.
    unsent: u64,
    /// Attempts sent (physical sends: retries, hedges and transparent re-sends included).
    attempts: u64,
    /// Attempts the retry layer sent after a failed one.
    retries: u64,
    /// Extra attempts sent while a slow one was still running (at most one per logical
    /// request).
    hedges: u64,
    /// How the hedges ended: won, lost or refused.
    hedge_results: HedgeResults,
    /// Attempts sent again, at once, because they provably never reached the server (refused
    /// connection or stream); not counted in `retries`.
    transparent_retries: u64,
    /// retries / logical requests.
    retry_ratio: f64,
    /// Logical requests by final outcome.
    outcomes: BTreeMap<&'static str, u64>,
    /// Attempts by outcome (`cancelled`: lost a hedge race).
    attempt_outcomes: BTreeMap<&'static str, u64>,
    /// Logical requests that succeeded, per second of the run.
    goodput_per_s: f64,
    latency_ms: Vec<AttemptLatency>,
    /// Why failed logical requests were not retried further.
    stop_reasons: BTreeMap<&'static str, u64>,
    /// The destination's storm alarm at the end of the run, if it had one.
    #[serde(skip_serializing_if = "Option::is_none")]
    storm_alarm: Option<StormAlarmState>,
    /// Most attempts seen waiting for one of the client's own slots (`--max-in-flight`), if
    /// it had a limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    client_pending_peak: Option<u64>,
}

/// The storm alarm as a run left it.
#[derive(Debug, Clone, Serialize)]
struct StormAlarmState {
    /// `calm`, `warning` or `tripped`.
    level: &'static str,
    /// Times it tripped during the run.
    trips: u64,
    /// Retries asked for per logical request over its window at the end.
    ratio: f64,
}

impl Summary {
    /// Adds the storm alarm's state (`None`: the destination had none).
    pub(crate) fn storm_alarm(&mut self, alarm: Option<&StormAlarm>) {
        self.storm_alarm = alarm.map(|alarm| StormAlarmState {
            level: alarm.level().as_str(),
            trips: alarm.trips(),
            ratio: alarm.ratio(),
        });
    }

    /// Adds the peak of the client's pending queue.
    pub(crate) fn client_pending_peak(&mut self, peak: u64) {
        self.client_pending_peak = Some(peak);
    }

    /// Human-readable summary.
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "target {}  policy {}  elapsed {:.2}s",
            self.target, self.policy, self.elapsed_s
        );
        let _ = writeln!(
            out,
            "logical requests {}  skipped {}  unsent {}  attempts {}  retries {}  hedges {}  \
             transparent retries {}  retry ratio {:.3}",
            self.logical_requests,
            self.skipped,
            self.unsent,
            self.attempts,
            self.retries,
            self.hedges,
            self.transparent_retries,
            self.retry_ratio
        );
        let _ = writeln!(
            out,
            "hedges: won={} lost={} refused={}",
            self.hedge_results.won, self.hedge_results.lost, self.hedge_results.refused
        );
        let _ = writeln!(out, "goodput {:.1}/s", self.goodput_per_s);
        let _ = writeln!(out, "outcomes (logical): {}", join(&self.outcomes));
        let _ = writeln!(out, "outcomes (attempts): {}", join(&self.attempt_outcomes));
        let _ = writeln!(out, "stop reasons: {}", join(&self.stop_reasons));
        if let Some(storm) = &self.storm_alarm {
            let _ = writeln!(
                out,
                "storm alarm: {}  trips {}  retry ratio asked {:.3}",
                storm.level, storm.trips, storm.ratio
            );
        }
        if let Some(peak) = self.client_pending_peak {
            let _ = writeln!(out, "client pending peak: {peak}");
        }
        let _ = writeln!(out, "attempt  count       p50 ms     p99 ms");
        for l in &self.latency_ms {
            let _ = writeln!(
                out,
                "{:<8} {:<10} {:>8.2} {:>10.2}",
                l.attempt, l.count, l.p50_ms, l.p99_ms
            );
        }
        out
    }
}

fn join(map: &BTreeMap<&'static str, u64>) -> String {
    if map.is_empty() {
        return "-".to_owned();
    }
    map.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(number: u32, ms: u64, outcome: Outcome) -> AttemptRecord {
        AttemptRecord {
            number,
            latency: Duration::from_millis(ms),
            outcome: outcome.into(),
            hedge: false,
            resend: false,
            sent: Instant::now(),
        }
    }

    #[test]
    fn retry_ratio_is_retries_over_logical_requests() {
        let mut t = Tally::new();
        for _ in 0..4 {
            t.attempt(attempt(1, 10, Outcome::Retryable));
            t.attempt(attempt(2, 20, Outcome::Ok));
            t.logical(LogicalRecord {
                outcome: Outcome::Ok,
                stop_reason: None,
            });
        }
        let s = t.summary(Duration::from_secs(2), "backstop", "http://x");
        assert_eq!((s.logical_requests, s.attempts, s.retries), (4, 8, 4));
        assert_eq!(s.retry_ratio, 1.0);
        assert_eq!(s.goodput_per_s, 2.0);
        assert_eq!(s.latency_ms.len(), 2);
        assert_eq!(s.latency_ms[1].attempt, "2");
    }

    #[test]
    fn merging_adds_everything() {
        let mut a = Tally::new();
        let mut b = Tally::new();
        a.attempt(attempt(1, 5, Outcome::Retryable));
        a.logical(LogicalRecord {
            outcome: Outcome::Retryable,
            stop_reason: Some("budget_exhausted"),
        });
        b.attempt(attempt(7, 5, Outcome::Timeout));
        b.attempt(AttemptRecord {
            hedge: true,
            ..attempt(2, 5, Outcome::Ok)
        });
        b.attempt(AttemptRecord {
            outcome: AttemptOutcome::Cancelled,
            ..attempt(1, 9, Outcome::Ok)
        });
        b.attempt(AttemptRecord {
            resend: true,
            ..attempt(3, 1, Outcome::Retryable)
        });
        b.skipped();
        b.unsent();
        a.merge(b);
        let s = a.summary(Duration::from_secs(1), "backstop", "http://x");
        assert_eq!(
            (s.attempts, s.retries, s.hedges, s.transparent_retries),
            (5, 1, 1, 1)
        );
        assert_eq!((s.skipped, s.unsent), (1, 1));
        assert_eq!(s.attempt_outcomes["cancelled"], 1);
        assert_eq!(s.stop_reasons["budget_exhausted"], 1);
        // Attempt 7 lands in the last bucket.
        assert!(s.latency_ms.iter().any(|l| l.attempt == "5+"));
        assert!(
            s.render()
                .contains("transparent retries 1  retry ratio 1.000")
        );
    }

    #[test]
    fn hedges_are_counted_as_won_lost_or_refused() {
        let mut t = Tally::new();
        let hedge = |outcome: AttemptOutcome| AttemptRecord {
            hedge: true,
            outcome,
            ..attempt(2, 5, Outcome::Ok)
        };
        t.attempt(hedge(Outcome::Ok.into()));
        t.attempt(hedge(AttemptOutcome::Cancelled));
        t.attempt(hedge(Outcome::Timeout.into()));
        t.attempt(hedge(Outcome::Retryable.into()));
        t.attempt(hedge(Outcome::Fatal.into()));
        // Not hedges: a retry and a transparent re-send.
        t.attempt(attempt(2, 5, Outcome::Ok));
        t.attempt(AttemptRecord {
            resend: true,
            ..attempt(2, 5, Outcome::Retryable)
        });
        let mut merged = Tally::new();
        merged.merge(t);
        let s = merged.summary(Duration::from_secs(1), "backstop", "http://x");
        assert_eq!(s.hedges, 5);
        assert_eq!(
            s.hedge_results,
            HedgeResults {
                won: 1,
                lost: 2,
                refused: 2
            }
        );
        assert!(s.render().contains("hedges: won=1 lost=2 refused=2"));
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["hedge_results"]["refused"], 2);
    }

    #[test]
    fn an_empty_run_has_a_zero_ratio() {
        let s = Tally::new().summary(Duration::ZERO, "naive", "http://x");
        assert_eq!(s.retry_ratio, 0.0);
        assert!(s.render().contains("stop reasons: -"));
    }
}
