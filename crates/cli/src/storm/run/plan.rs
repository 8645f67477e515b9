//! What a live scenario is made of: the PSP's phases, the offered load and the variants
//! compared. The plans themselves are in `mirrored` (the scenarios with a simulated mirror) and
//! `claims`.

use std::time::Duration;

/// How the PSP behaves from `at` on.
#[derive(Debug, Clone, Copy)]
pub(super) struct Phase {
    pub(super) at: Duration,
    pub(super) latency: Duration,
    /// Every charge answered `503` + `Retry-After` (1 s unless `pushback` says otherwise).
    pub(super) unavailable: bool,
    /// The `Retry-After` of those `503`s.
    pub(super) pushback: Option<Duration>,
    /// Every charge answered `500`.
    pub(super) error: bool,
    /// A stall: charges arriving within this long of the phase's start are held until then,
    /// and all answered together (see `Faults::hold_until`).
    pub(super) hold: Option<Duration>,
    /// Slower the more calls it holds (see `Faults::slow_above`; 0: off).
    pub(super) slow_above: u32,
}

/// A healthy PSP answering after `latency`, from `at` on: what a phase is unless it says
/// otherwise.
pub(super) const fn healthy(at: Duration, latency: Duration) -> Phase {
    Phase {
        at,
        latency,
        unavailable: false,
        pushback: None,
        error: false,
        hold: None,
        slow_above: 0,
    }
}

/// One side of a comparison: the flags its `serve` and `load` get.
#[derive(Debug, Clone)]
pub(super) struct Variant {
    pub(super) name: &'static str,
    pub(super) serve: Vec<&'static str>,
    pub(super) load: Vec<&'static str>,
    /// Its offered rate, as a share of the plan's (or of the measured capacity).
    pub(super) rate_share: f64,
}

/// A variant offered the plan's rate.
pub(super) fn variant(
    name: &'static str,
    serve: Vec<&'static str>,
    load: Vec<&'static str>,
) -> Variant {
    Variant {
        name,
        serve,
        load,
        rate_share: 1.0,
    }
}

/// A second `load`, started `at` and running for `duration` at `rate` on top of the first:
/// a burst.
#[derive(Debug, Clone, Copy)]
pub(super) struct Burst {
    pub(super) at: Duration,
    pub(super) duration: Duration,
    pub(super) rate: f64,
}

/// A scenario made concrete.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    /// Logical requests per second offered (`None`: a multiple of the measured capacity).
    pub(super) rate: Option<f64>,
    pub(super) capacity_multiple: f64,
    pub(super) duration: Duration,
    /// When the load drops back (for the recovery time), if the scenario has such a moment.
    pub(super) recovery_at: Option<Duration>,
    pub(super) phases: Vec<Phase>,
    pub(super) variants: Vec<Variant>,
    /// A burst on top of the load, if the scenario has one.
    pub(super) burst: Option<Burst>,
    /// Width of the load's series rows (`--series-interval`) when a scenario needs them finer
    /// than a second; they are summed into seconds for the summary.
    pub(super) series_interval: Option<Duration>,
    /// The server and client the capacity is measured with (`None`: the first variant's).
    pub(super) probe: Option<Variant>,
    /// The rate offered while measuring the capacity: far above it, but not so far that
    /// refusing the excess takes the cores the service needs.
    pub(super) probe_rate: f64,
}

impl Plan {
    /// The plan with every duration multiplied by `scale` (`--time-scale`).
    pub(super) fn scaled(mut self, scale: f64) -> Plan {
        self.duration = self.duration.mul_f64(scale);
        self.recovery_at = self.recovery_at.map(|d| d.mul_f64(scale));
        for phase in &mut self.phases {
            phase.at = phase.at.mul_f64(scale);
            phase.hold = phase.hold.map(|d| d.mul_f64(scale));
        }
        if let Some(burst) = &mut self.burst {
            burst.at = burst.at.mul_f64(scale);
            burst.duration = burst.duration.mul_f64(scale);
        }
        self
    }
}

/// The PSP's latency when healthy.
pub(super) const NORMAL: Duration = Duration::from_millis(100);

pub(super) const MS: fn(u64) -> Duration = Duration::from_millis;
pub(super) const S: fn(u64) -> Duration = Duration::from_secs;
