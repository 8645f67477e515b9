//! The retry switch: retries and hedges turned off, or held to a lower ratio, for a whole
//! fleet at once.
//!
//! Every other limit on retries is local: a destination's [budget](super::RetryBudget) and
//! [storm alarm](super::StormAlarm) see only the calls of one process. In an outage that is
//! too late and too little: each of a hundred processes spends its own burst and trips its own
//! alarm. Retries are a system setting, and an operator (or an alert) must be able to say, for
//! every client at once, "no more retries" or "at most 2 %".
//!
//! A [`RetrySwitch`] holds that setting in the process. Give the same switch to every
//! [`Destination`](crate::client::Destination) (or [`RetryPolicy`](super::RetryPolicy)
//! and [`HedgePolicy`](crate::hedge::HedgePolicy)) and set it from wherever the fleet's setting
//! lives; with the `redis` feature, [`watch_redis`](RetrySwitch::watch_redis) keeps it equal
//! to one Redis key that `backstop retries off|on|ratio R` sets for every process watching
//! it. What each setting does to a call:
//!
//! - [`RetrySetting::On`] (the default): retries and hedges as the destination's budget and
//!   alarm allow.
//! - [`RetrySetting::Off`]: no retry and no hedge; a call that fails stops with
//!   [`StopReason::SwitchedOff`](super::StopReason::SwitchedOff). Its storm alarm still counts
//!   the retries asked for, so it does not clear itself while the switch holds them back.
//! - [`RetrySetting::Ratio`]: each logical request deposits at most this ratio into the
//!   destination's budget (a lower one of its own stays), so retries and hedges added from now
//!   on stay within `ratio x requests`, plus what the budget already held (at most its burst).
//!   Under gRPC's retry throttling (whose budget is unlimited) only `Off` applies.
//!
//! A change is logged once as an `rpc_retry_switch` event (with the new setting and who set
//! it) and shown by the gauge `rpc_client_retry_switch{setting}`: 1 for the setting in effect
//! (`on`, `off` or `ratio`), 0 for the others.
//!
//! ```
//! use backstop::retry::{RetrySetting, RetrySwitch};
//!
//! let switch = RetrySwitch::new();
//! assert_eq!(switch.setting(), RetrySetting::On);
//! switch.set("off".parse()?, "operator");
//! assert!(!switch.allows_retries());
//! switch.set(RetrySetting::ratio(0.02)?, "alert");
//! assert_eq!(switch.ratio_cap(), Some(0.02));
//! # Ok::<(), backstop::retry::SettingError>(())
//! ```

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::observe::{RPC_CLIENT_RETRY_SWITCH, event};

#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
pub use self::redis::{DEFAULT_KEY, DEFAULT_POLL, SwitchWatch, read_redis, write_redis};

/// What the fleet allows retries and hedges to do now (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RetrySetting {
    /// As each destination's budget and storm alarm allow.
    On,
    /// No retries and no hedges.
    Off,
    /// At most this share of logical requests (in `[0, 1]`) as retries and hedges.
    Ratio(f64),
}

/// A setting that cannot be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingError {
    /// Neither `on`, `off` nor `ratio=R`.
    #[error("{0:?} is not a retry setting: on, off or ratio=R (R between 0 and 1)")]
    Unknown(String),
    /// A ratio outside `[0, 1]`.
    #[error("a retry ratio is a share of requests between 0 and 1, got {0}")]
    Ratio(f64),
}

impl RetrySetting {
    /// [`Ratio`](Self::Ratio)`(ratio)`, checked: `ratio` is within `[0, 1]`.
    pub fn ratio(ratio: f64) -> Result<Self, SettingError> {
        if (0.0..=1.0).contains(&ratio) {
            Ok(RetrySetting::Ratio(ratio))
        } else {
            Err(SettingError::Ratio(ratio))
        }
    }

    /// The label of the gauge: `on`, `off` or `ratio`.
    pub const fn as_str(self) -> &'static str {
        match self {
            RetrySetting::On => "on",
            RetrySetting::Off => "off",
            RetrySetting::Ratio(_) => "ratio",
        }
    }

    /// Packed into one word: the ratio's bits (a ratio in `[0, 1]` never reaches the two
    /// values above it).
    fn to_bits(self) -> u64 {
        match self {
            RetrySetting::On => ON,
            RetrySetting::Off => OFF,
            RetrySetting::Ratio(ratio) => ratio.to_bits(),
        }
    }

    fn from_bits(bits: u64) -> Self {
        match bits {
            ON => RetrySetting::On,
            OFF => RetrySetting::Off,
            ratio => RetrySetting::Ratio(f64::from_bits(ratio)),
        }
    }
}

const ON: u64 = u64::MAX;
const OFF: u64 = u64::MAX - 1;

impl fmt::Display for RetrySetting {
    /// `on`, `off` or `ratio=R`: what [`FromStr`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RetrySetting::Ratio(ratio) => write!(f, "ratio={ratio}"),
            other => f.write_str(other.as_str()),
        }
    }
}

impl FromStr for RetrySetting {
    type Err = SettingError;

    /// `on`, `off` or `ratio=R`; nothing else (an unreadable value is refused, not guessed).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "on" => Ok(RetrySetting::On),
            "off" => Ok(RetrySetting::Off),
            _ => {
                let ratio = s
                    .strip_prefix("ratio=")
                    .and_then(|r| r.parse::<f64>().ok())
                    .ok_or_else(|| SettingError::Unknown(s.chars().take(64).collect()))?;
                RetrySetting::ratio(ratio)
            }
        }
    }
}

/// The fleet's retry setting as this process applies it (see the [module docs](self)).
/// Cheap to clone; clones share the setting.
#[derive(Debug, Clone)]
pub struct RetrySwitch {
    setting: Arc<AtomicU64>,
}

impl Default for RetrySwitch {
    fn default() -> Self {
        Self::new()
    }
}

impl RetrySwitch {
    /// A switch at [`RetrySetting::On`]; its gauge is set at once, so dashboards see the series
    /// before the first change.
    pub fn new() -> Self {
        let switch = Self {
            setting: Arc::new(AtomicU64::new(ON)),
        };
        set_gauge(RetrySetting::On);
        switch
    }

    /// The setting in effect.
    pub fn setting(&self) -> RetrySetting {
        RetrySetting::from_bits(self.setting.load(Ordering::Acquire))
    }

    /// Applies `setting`; `source` says who set it (a log field). Logs and updates the gauge
    /// when it changes; `true` then.
    pub fn set(&self, setting: RetrySetting, source: &str) -> bool {
        let previous =
            RetrySetting::from_bits(self.setting.swap(setting.to_bits(), Ordering::AcqRel));
        if previous == setting {
            return false;
        }
        set_gauge(setting);
        let setting_text = setting.to_string();
        let previous_text = previous.to_string();
        if setting == RetrySetting::On {
            tracing::info!(
                name: event::RPC_RETRY_SWITCH,
                event = event::RPC_RETRY_SWITCH,
                setting = %setting_text,
                previous = %previous_text,
                source,
                "retries switched back on"
            );
        } else {
            tracing::warn!(
                name: event::RPC_RETRY_SWITCH,
                event = event::RPC_RETRY_SWITCH,
                setting = %setting_text,
                previous = %previous_text,
                source,
                "retries held back for the fleet"
            );
        }
        true
    }

    /// Whether a retry or a hedge may be sent at all.
    pub fn allows_retries(&self) -> bool {
        self.setting() != RetrySetting::Off
    }

    /// The most a logical request may deposit into a budget, when the setting lowers it.
    pub fn ratio_cap(&self) -> Option<f64> {
        match self.setting() {
            RetrySetting::Ratio(ratio) => Some(ratio),
            RetrySetting::Off => Some(0.0),
            RetrySetting::On => None,
        }
    }
}

fn set_gauge(setting: RetrySetting) {
    for label in ["on", "off", "ratio"] {
        metrics::gauge!(RPC_CLIENT_RETRY_SWITCH, crate::observe::label::SETTING => label)
            .set(if label == setting.as_str() { 1.0 } else { 0.0 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_read_back_as_written_and_nothing_else_is_read() {
        for setting in [
            RetrySetting::On,
            RetrySetting::Off,
            RetrySetting::Ratio(0.0),
            RetrySetting::Ratio(0.025),
            RetrySetting::Ratio(1.0),
        ] {
            assert_eq!(setting.to_string().parse::<RetrySetting>(), Ok(setting));
            assert_eq!(RetrySetting::from_bits(setting.to_bits()), setting);
        }
        for bad in [
            "",
            "ON",
            "of",
            "ratio",
            "ratio=",
            "ratio=1.5",
            "ratio=-0.1",
            "ratio=NaN",
            "ratio=x",
            "budget=0.1",
        ] {
            assert!(bad.parse::<RetrySetting>().is_err(), "{bad:?} was read");
        }
        assert!(matches!(
            "x".repeat(10_000).parse::<RetrySetting>(),
            Err(SettingError::Unknown(s)) if s.len() == 64
        ));
    }

    #[test]
    fn clones_share_the_setting_and_a_change_is_reported_once() {
        let switch = RetrySwitch::new();
        let clone = switch.clone();
        assert!(switch.set(RetrySetting::Off, "test"));
        assert!(
            !switch.set(RetrySetting::Off, "test"),
            "no change, no report"
        );
        assert!(!clone.allows_retries());
        assert_eq!(clone.ratio_cap(), Some(0.0));
        clone.set(RetrySetting::Ratio(0.05), "test");
        assert!(switch.allows_retries());
        assert_eq!(switch.ratio_cap(), Some(0.05));
        switch.set(RetrySetting::On, "test");
        assert_eq!(clone.ratio_cap(), None);
    }
}
