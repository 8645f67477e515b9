use super::Claim;
use crate::storm::SimError;
use crate::storm::scenario::Knobs;

pub(super) fn build(_knobs: Knobs) -> Result<Claim, SimError> {
    Err(SimError::Unfit("not simulated yet".into()))
}
