use crate::storm::scenario::Knobs;
use crate::storm::{Report, SimError};

pub(super) fn simulate(_knobs: Knobs, _policy: &str) -> Result<Report, SimError> {
    Err(SimError::Unfit("not simulated yet".into()))
}
