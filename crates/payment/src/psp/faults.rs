//! Fault injection: what the simulated PSP does wrong, and when.
//!
//! Two sources decide the fault for each valid charge request, in this order:
//! 1. the scripted queue ([`FaultControl::script`], or `"next"` on `PUT /admin/faults`): the
//!    next N charge requests get exactly these faults, whatever the rates say;
//! 2. otherwise one draw from a [`StdRng`] (seedable, so a run can be replayed) against the
//!    rates of [`Faults`], taken in the order error, unavailable, commit-then-timeout,
//!    commit-then-drop.
//!
//! Latency is not drawn: it applies to every charge request, as do the two shapes of a sick
//! dependency a schedule can set ([`Faults::hold_until`], [`Faults::slow_above`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// The most faults the scripted queue holds; longer scripts are refused.
pub const MAX_SCRIPTED: usize = 1024;

/// Fault rates and latency of the simulated PSP.
///
/// Each rate is a probability in `[0, 1]` and their sum is at most 1: one draw per charge
/// request picks at most one fault. The default injects nothing.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Faults {
    /// Delay before a charge request is handled. A caller's deadline that falls inside the
    /// delay ends it with `504` and no charge: the PSP does not start work it cannot finish.
    pub latency: Duration,
    /// Probability of `500` without charging.
    pub error_rate: f64,
    /// Probability of `503` + `Retry-After` without charging.
    pub unavailable_rate: f64,
    /// The `Retry-After` of those `503`s, in whole seconds (`None`: 1 s). A pushback longer
    /// than the caller's deadline leaves it nothing to retry within. Set in process only
    /// (`/admin/faults` clears it).
    pub pushback: Option<Duration>,
    /// Probability of charging durably, then answering only after the caller's deadline
    /// (plus one second; 30 s when the caller sent none).
    pub commit_then_timeout_rate: f64,
    /// Probability of charging durably, then closing the connection without an answer.
    pub commit_then_drop_rate: f64,
    /// A stall: charge requests arriving before this instant are held until it (or until the
    /// caller's deadline, if that comes first), then answered as drawn, so that every call of
    /// the stall ends at the same moment. Set in process only (`/admin/faults` clears it).
    pub hold_until: Option<Instant>,
    /// A dependency that is slower the more calls it holds (a cold cache, a pool still
    /// growing, each call contending with the others): with more than this many charge
    /// requests in flight, each one's latency is multiplied by `(in flight / slow_above)^2`,
    /// so that past the knee more calls at once serve fewer per second. 0 turns it off. Set in
    /// process only (`/admin/faults` clears it).
    pub slow_above: u32,
}

impl Faults {
    /// Checks that every rate is in `[0, 1]` and that the rates add up to at most 1.
    pub fn validate(&self) -> Result<(), FaultsError> {
        let rates = [
            ("error_rate", self.error_rate),
            ("unavailable_rate", self.unavailable_rate),
            ("commit_then_timeout_rate", self.commit_then_timeout_rate),
            ("commit_then_drop_rate", self.commit_then_drop_rate),
        ];
        for (name, value) in rates {
            if !(0.0..=1.0).contains(&value) {
                return Err(FaultsError::RateOutOfRange { name, value });
            }
        }
        let sum: f64 = rates.iter().map(|(_, rate)| rate).sum();
        // Tolerate rounding, e.g. 0.7 + 0.2 + 0.1.
        if sum > 1.0 + 1e-9 {
            return Err(FaultsError::RatesExceedOne { sum });
        }
        Ok(())
    }
}

/// Fault settings that cannot be applied.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FaultsError {
    /// A rate outside `[0, 1]` (or not a number).
    #[error("{name} must be a number in [0, 1], got {value}")]
    RateOutOfRange {
        /// The offending setting, e.g. `error_rate`.
        name: &'static str,
        /// Its value.
        value: f64,
    },
    /// The rates add up to more than 1.
    #[error("the fault rates add up to {sum}, more than 1")]
    RatesExceedOne {
        /// The sum of the four rates.
        sum: f64,
    },
    /// The scripted queue would hold more than [`MAX_SCRIPTED`] faults.
    #[error("at most {max} scripted faults can be queued")]
    TooManyScripted {
        /// [`MAX_SCRIPTED`].
        max: usize,
    },
}

/// What the PSP does with one charge request. Serialized in snake case (`"commit_then_drop"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// No fault: charge and answer normally.
    None,
    /// `500` without charging.
    Error,
    /// `503` + `Retry-After: 1` without charging.
    Unavailable,
    /// Charge durably, then answer after the caller's deadline has passed.
    CommitThenTimeout,
    /// Charge durably, then close the connection without an answer.
    CommitThenDrop,
}

impl Fault {
    /// The snake-case name used on the wire and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::Error => "error",
            Fault::Unavailable => "unavailable",
            Fault::CommitThenTimeout => "commit_then_timeout",
            Fault::CommitThenDrop => "commit_then_drop",
        }
    }
}

/// Shared, runtime-adjustable fault settings: the rates, the RNG drawn against them, and the
/// scripted queue. Cloning shares the state.
#[derive(Debug, Clone)]
pub struct FaultControl {
    inner: Arc<Mutex<FaultState>>,
    /// Charge requests being handled now, for [`Faults::slow_above`].
    charging: Arc<AtomicUsize>,
}

/// One charge request being handled: counted in flight until dropped.
#[derive(Debug)]
pub struct Charging {
    count: Arc<AtomicUsize>,
    /// Charge requests in flight when this one arrived, itself included.
    pub in_flight: usize,
}

impl Drop for Charging {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Debug)]
struct FaultState {
    faults: Faults,
    rng: StdRng,
    next: VecDeque<Fault>,
    drawn: FaultCounts,
}

/// How many faults [`FaultControl::draw`] has handed out since the start, by kind (scripted
/// ones included), so that a run can show its faults really happened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FaultCounts {
    /// [`Fault::Error`] draws.
    pub error: u64,
    /// [`Fault::Unavailable`] draws.
    pub unavailable: u64,
    /// [`Fault::CommitThenTimeout`] draws.
    pub commit_then_timeout: u64,
    /// [`Fault::CommitThenDrop`] draws.
    pub commit_then_drop: u64,
}

impl FaultCounts {
    fn count(&mut self, fault: Fault) {
        let counter = match fault {
            Fault::None => return,
            Fault::Error => &mut self.error,
            Fault::Unavailable => &mut self.unavailable,
            Fault::CommitThenTimeout => &mut self.commit_then_timeout,
            Fault::CommitThenDrop => &mut self.commit_then_drop,
        };
        *counter = counter.saturating_add(1);
    }
}

impl FaultControl {
    /// Validated settings; `seed` makes the draws reproducible (entropy from the OS otherwise).
    pub fn new(faults: Faults, seed: Option<u64>) -> Result<Self, FaultsError> {
        faults.validate()?;
        let rng = match seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => rand::make_rng(),
        };
        Ok(FaultControl {
            inner: Arc::new(Mutex::new(FaultState {
                faults,
                rng,
                next: VecDeque::new(),
                drawn: FaultCounts::default(),
            })),
            charging: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// The current rates and latency.
    pub fn faults(&self) -> Faults {
        self.lock().faults
    }

    /// Replaces the rates and latency (the scripted queue is kept).
    pub fn set(&self, faults: Faults) -> Result<(), FaultsError> {
        faults.validate()?;
        self.lock().faults = faults;
        Ok(())
    }

    /// Restarts the RNG from `seed`.
    pub fn reseed(&self, seed: u64) {
        self.lock().rng = StdRng::seed_from_u64(seed);
    }

    /// Replaces the scripted queue: the next charge requests get these faults, in order.
    pub fn script(&self, next: impl IntoIterator<Item = Fault>) -> Result<(), FaultsError> {
        let next = bounded(next)?;
        self.lock().next = next;
        Ok(())
    }

    /// The faults still queued, next first.
    pub fn scripted(&self) -> Vec<Fault> {
        self.lock().next.iter().copied().collect()
    }

    /// Applies rates, script and seed at once, or nothing if any is invalid.
    pub(crate) fn apply(
        &self,
        faults: Faults,
        next: Vec<Fault>,
        seed: Option<u64>,
    ) -> Result<(), FaultsError> {
        faults.validate()?;
        let next = bounded(next)?;
        let mut state = self.lock();
        state.faults = faults;
        state.next = next;
        if let Some(seed) = seed {
            state.rng = StdRng::seed_from_u64(seed);
        }
        Ok(())
    }

    /// Counts a charge request in flight until the guard is dropped.
    pub fn charging(&self) -> Charging {
        let in_flight = self.charging.fetch_add(1, Ordering::Relaxed) + 1;
        Charging {
            count: self.charging.clone(),
            in_flight,
        }
    }

    /// The faults drawn so far, by kind.
    pub fn drawn(&self) -> FaultCounts {
        self.lock().drawn
    }

    /// The fault for the next charge request: the head of the script, else one draw.
    pub fn draw(&self) -> Fault {
        let mut state = self.lock();
        let fault = state.pick();
        state.drawn.count(fault);
        fault
    }

    fn lock(&self) -> MutexGuard<'_, FaultState> {
        // The state stays consistent whatever panicked while holding the lock.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl FaultState {
    /// The head of the script, else one draw against the rates.
    fn pick(&mut self) -> Fault {
        if let Some(fault) = self.next.pop_front() {
            return fault;
        }
        let f = self.faults;
        let roll: f64 = self.rng.random();
        let mut acc = 0.0;
        for (rate, fault) in [
            (f.error_rate, Fault::Error),
            (f.unavailable_rate, Fault::Unavailable),
            (f.commit_then_timeout_rate, Fault::CommitThenTimeout),
            (f.commit_then_drop_rate, Fault::CommitThenDrop),
        ] {
            acc += rate;
            if roll < acc {
                return fault;
            }
        }
        Fault::None
    }
}

fn bounded(next: impl IntoIterator<Item = Fault>) -> Result<VecDeque<Fault>, FaultsError> {
    let mut queue = VecDeque::new();
    for fault in next {
        if queue.len() == MAX_SCRIPTED {
            return Err(FaultsError::TooManyScripted { max: MAX_SCRIPTED });
        }
        queue.push_back(fault);
    }
    Ok(queue)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(error: f64, unavailable: f64, timeout: f64, drop: f64) -> Faults {
        Faults {
            latency: Duration::ZERO,
            error_rate: error,
            unavailable_rate: unavailable,
            commit_then_timeout_rate: timeout,
            commit_then_drop_rate: drop,
            ..Faults::default()
        }
    }

    #[test]
    fn rates_outside_unit_interval_are_refused() {
        for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                rates(bad, 0.0, 0.0, 0.0).validate(),
                Err(FaultsError::RateOutOfRange {
                    name: "error_rate",
                    ..
                })
            ));
        }
        assert!(matches!(
            rates(0.0, 0.0, 0.0, 2.0).validate(),
            Err(FaultsError::RateOutOfRange {
                name: "commit_then_drop_rate",
                ..
            })
        ));
    }

    #[test]
    fn rates_adding_up_past_one_are_refused() {
        assert!(matches!(
            rates(0.6, 0.6, 0.0, 0.0).validate(),
            Err(FaultsError::RatesExceedOne { .. })
        ));
        assert_eq!(rates(0.7, 0.2, 0.1, 0.0).validate(), Ok(()));
        assert_eq!(Faults::default().validate(), Ok(()));
    }

    #[test]
    fn draws_are_counted_by_kind() {
        let control = FaultControl::new(rates(0.0, 0.0, 0.5, 0.5), Some(3)).unwrap();
        control.script([Fault::Error, Fault::None]).unwrap();
        let draws: Vec<Fault> = (0..100).map(|_| control.draw()).collect();
        let of = |kind| draws.iter().filter(|f| **f == kind).count() as u64;
        let drawn = control.drawn();
        assert_eq!(drawn.error, 1);
        assert_eq!(drawn.unavailable, 0);
        assert_eq!(drawn.commit_then_timeout, of(Fault::CommitThenTimeout));
        assert_eq!(drawn.commit_then_drop, of(Fault::CommitThenDrop));
        assert_eq!(drawn.commit_then_timeout + drawn.commit_then_drop, 98);
    }

    #[test]
    fn script_comes_before_draws_then_rates_apply() {
        let control = FaultControl::new(rates(1.0, 0.0, 0.0, 0.0), Some(1)).unwrap();
        control
            .script([Fault::None, Fault::CommitThenDrop])
            .unwrap();
        assert_eq!(control.scripted(), vec![Fault::None, Fault::CommitThenDrop]);
        assert_eq!(control.draw(), Fault::None);
        assert_eq!(control.draw(), Fault::CommitThenDrop);
        assert_eq!(control.draw(), Fault::Error);
        assert!(control.scripted().is_empty());
    }

    #[test]
    fn same_seed_same_draws() {
        let faults = rates(0.25, 0.25, 0.25, 0.0);
        let a = FaultControl::new(faults, Some(42)).unwrap();
        let b = FaultControl::new(faults, Some(42)).unwrap();
        let draws_a: Vec<Fault> = (0..200).map(|_| a.draw()).collect();
        let draws_b: Vec<Fault> = (0..200).map(|_| b.draw()).collect();
        assert_eq!(draws_a, draws_b);
        for fault in [
            Fault::None,
            Fault::Error,
            Fault::Unavailable,
            Fault::CommitThenTimeout,
        ] {
            assert!(draws_a.contains(&fault), "{fault:?} never drawn");
        }
        assert!(!draws_a.contains(&Fault::CommitThenDrop));
        a.reseed(42);
        let again: Vec<Fault> = (0..200).map(|_| a.draw()).collect();
        assert_eq!(again, draws_a);
    }

    #[test]
    fn overlong_script_is_refused_and_keeps_the_old_one() {
        let control = FaultControl::new(Faults::default(), Some(0)).unwrap();
        control.script([Fault::Error]).unwrap();
        let err = control
            .script(std::iter::repeat_n(Fault::None, MAX_SCRIPTED + 1))
            .unwrap_err();
        assert!(matches!(err, FaultsError::TooManyScripted { .. }));
        assert_eq!(control.scripted(), vec![Fault::Error]);
        control
            .script(std::iter::repeat_n(Fault::None, MAX_SCRIPTED))
            .unwrap();
        assert_eq!(control.scripted().len(), MAX_SCRIPTED);
    }

    #[test]
    fn charges_in_flight_are_counted_until_dropped() {
        let control = FaultControl::new(Faults::default(), Some(0)).unwrap();
        let first = control.charging();
        let second = control.charging();
        assert_eq!((first.in_flight, second.in_flight), (1, 2));
        drop(first);
        drop(second);
        assert_eq!(control.charging().in_flight, 1);
    }

    #[test]
    fn invalid_apply_changes_nothing() {
        let control = FaultControl::new(Faults::default(), Some(0)).unwrap();
        let err = control.apply(rates(2.0, 0.0, 0.0, 0.0), vec![Fault::Error], None);
        assert!(err.is_err());
        assert_eq!(control.faults(), Faults::default());
        assert!(control.scripted().is_empty());
    }
}
