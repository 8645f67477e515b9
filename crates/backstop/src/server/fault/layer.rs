use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;
use tower_layer::Layer;

use super::{Fault, Faults, default_abort};
use crate::status::Status;

/// A fault setting that cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum FaultError {
    /// A percentage outside `0..=100` (or not a number).
    #[error("a fault percentage must be between 0 and 100, got {0}")]
    Percent(f64),
}

/// Applies [`Fault`]: aborts and delays a share of the requests (see the
/// [module docs](super)).
///
/// Clones share the settings and the random generator.
#[derive(Debug, Clone, Default)]
pub struct FaultLayer {
    abort_percent: f64,
    abort: Option<Status>,
    delay_percent: f64,
    delay: Duration,
    seed: Option<u64>,
    /// Built once the settings are known, so that clones share one generator.
    shared: Option<Arc<Faults>>,
}

fn percent(value: f64) -> Result<f64, FaultError> {
    if (0.0..=100.0).contains(&value) {
        Ok(value)
    } else {
        Err(FaultError::Percent(value))
    }
}

impl FaultLayer {
    /// Injects nothing.
    pub fn none() -> Self {
        Self::default()
    }

    /// Aborts `percent` % of the requests (0 to 100) with `UNAVAILABLE` / 503 problem+json
    /// `fault_injected` unless [`FaultLayer::abort_with`] says otherwise.
    pub fn abort_percent(mut self, percent_: f64) -> Result<Self, FaultError> {
        self.abort_percent = percent(percent_)?;
        Ok(self.rebuilt())
    }

    /// The status of an aborted request (its code, problem code, HTTP status and pushback).
    pub fn abort_with(mut self, status: Status) -> Self {
        self.abort = Some(status);
        self.rebuilt()
    }

    /// Delays `percent` % of the requests (0 to 100) by `delay` before they go on.
    pub fn delay(mut self, percent_: f64, delay: Duration) -> Result<Self, FaultError> {
        self.delay_percent = percent(percent_)?;
        self.delay = delay;
        Ok(self.rebuilt())
    }

    /// Draws from a generator seeded with `seed` (reproducible runs), not from OS entropy.
    pub fn seeded(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self.rebuilt()
    }

    /// The percentage of requests aborted.
    pub fn abort_share(&self) -> f64 {
        self.abort_percent
    }

    /// The percentage of requests delayed, and by how long.
    pub fn delay_share(&self) -> (f64, Duration) {
        (self.delay_percent, self.delay)
    }

    /// Whether it injects anything.
    pub fn is_active(&self) -> bool {
        self.shared.is_some()
    }

    fn rebuilt(mut self) -> Self {
        let active =
            self.abort_percent > 0.0 || (self.delay_percent > 0.0 && !self.delay.is_zero());
        self.shared = active.then(|| {
            let rng = match self.seed {
                Some(seed) => StdRng::seed_from_u64(seed),
                None => rand::make_rng(),
            };
            Arc::new(Faults {
                abort_percent: self.abort_percent,
                abort: self.abort.clone().unwrap_or_else(default_abort),
                delay_percent: if self.delay.is_zero() {
                    0.0
                } else {
                    self.delay_percent
                },
                delay: self.delay,
                rng: Mutex::new(rng),
            })
        });
        self
    }
}

impl<S> Layer<S> for FaultLayer {
    type Service = Fault<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Fault {
            inner,
            faults: self.shared.clone(),
        }
    }
}
