//! The executor's metric handles, registered once per recorder instead of on every call.
//!
//! `metrics::counter!(name, labels)` builds a key (an allocation for its labels) and looks it up
//! in the recorder every time it runs; the executor records several metrics per attempt. The
//! handles are cached here, for the recorder that registered them, the way the server's route
//! metrics are (see `server::metrics`); under another recorder (a test's local one) the calls
//! take the uncached path, so every recorder still sees every value.

use std::fmt;
use std::sync::OnceLock;

use metrics::{Counter, Histogram, SharedString};

use crate::observe::{
    RPC_CLIENT_ATTEMPT_DURATION_SECONDS, RPC_CLIENT_ATTEMPTS_TOTAL, RPC_CLIENT_REQUESTS_TOTAL,
    RPC_CLIENT_RETRIES_TOTAL, attempt_label, label, recorder_id,
};
use crate::status::Outcome;

/// Attempt-number label values: `0` to `5` and `6+`.
const ATTEMPT_LABELS: usize = 7;

/// Client metric handles of one policy (one service and method).
#[derive(Default)]
pub(super) struct PolicyMetrics {
    cache: OnceLock<Handles>,
}

struct Handles {
    recorder: usize,
    requests: Counter,
    retries: Counter,
    attempts: [[OnceLock<Counter>; Outcome::ALL.len()]; ATTEMPT_LABELS],
    durations: [OnceLock<Histogram>; ATTEMPT_LABELS],
}

impl fmt::Debug for PolicyMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyMetrics")
            .field("cached", &self.cache.get().is_some())
            .finish()
    }
}

fn requests(service: &SharedString, method: &SharedString) -> Counter {
    metrics::counter!(RPC_CLIENT_REQUESTS_TOTAL,
        label::SERVICE => service.clone(), label::METHOD => method.clone())
}

fn retries(service: &SharedString, method: &SharedString) -> Counter {
    metrics::counter!(RPC_CLIENT_RETRIES_TOTAL,
        label::SERVICE => service.clone(), label::METHOD => method.clone())
}

fn attempts(
    service: &SharedString,
    method: &SharedString,
    number: u32,
    outcome: Outcome,
) -> Counter {
    metrics::counter!(RPC_CLIENT_ATTEMPTS_TOTAL,
        label::SERVICE => service.clone(), label::METHOD => method.clone(),
        label::ATTEMPT => attempt_label(number), label::OUTCOME => outcome.as_str())
}

fn duration(service: &SharedString, method: &SharedString, number: u32) -> Histogram {
    metrics::histogram!(RPC_CLIENT_ATTEMPT_DURATION_SECONDS,
        label::SERVICE => service.clone(), label::METHOD => method.clone(),
        label::ATTEMPT => attempt_label(number))
}

impl PolicyMetrics {
    fn handles(&self, service: &SharedString, method: &SharedString) -> Option<&Handles> {
        let recorder = recorder_id()?;
        let handles = self.cache.get_or_init(|| Handles {
            recorder,
            requests: requests(service, method),
            retries: retries(service, method),
            attempts: [const { [const { OnceLock::new() }; Outcome::ALL.len()] }; ATTEMPT_LABELS],
            durations: [const { OnceLock::new() }; ATTEMPT_LABELS],
        });
        (handles.recorder == recorder).then_some(handles)
    }

    /// One logical request: `rpc_client_requests_total`.
    pub(super) fn request(&self, service: &SharedString, method: &SharedString) {
        match self.handles(service, method) {
            Some(h) => h.requests.increment(1),
            None => requests(service, method).increment(1),
        }
    }

    /// One retry: `rpc_client_retries_total`.
    pub(super) fn retry(&self, service: &SharedString, method: &SharedString) {
        match self.handles(service, method) {
            Some(h) => h.retries.increment(1),
            None => retries(service, method).increment(1),
        }
    }

    /// One attempt: `rpc_client_attempts_total` and `rpc_client_attempt_duration_seconds`.
    pub(super) fn attempt(
        &self,
        service: &SharedString,
        method: &SharedString,
        number: u32,
        outcome: Outcome,
        seconds: f64,
    ) {
        match self.handles(service, method) {
            Some(h) => {
                let slot = (number as usize).min(ATTEMPT_LABELS - 1);
                h.attempts[slot][outcome.index()]
                    .get_or_init(|| attempts(service, method, number, outcome))
                    .increment(1);
                h.durations[slot]
                    .get_or_init(|| duration(service, method, number))
                    .record(seconds);
            }
            None => {
                attempts(service, method, number, outcome).increment(1);
                duration(service, method, number).record(seconds);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::testing::Recorded;
    use metrics_util::debugging::DebuggingRecorder;

    fn requests_counted(recorder: &DebuggingRecorder) -> u64 {
        Recorded::of(recorder).counter(RPC_CLIENT_REQUESTS_TOTAL, &[])
    }

    /// Handles are cached for the first recorder; a second one still sees every value.
    #[test]
    fn every_recorder_sees_every_value() {
        let metrics = PolicyMetrics::default();
        let (service, method) = (SharedString::from("psp"), SharedString::from("Charge"));
        let first = DebuggingRecorder::new();
        let second = DebuggingRecorder::new();
        metrics::with_local_recorder(&first, || {
            for _ in 0..3 {
                metrics.request(&service, &method);
                metrics.attempt(&service, &method, 1, Outcome::Ok, 0.01);
            }
        });
        metrics::with_local_recorder(&second, || {
            for _ in 0..2 {
                metrics.request(&service, &method);
            }
        });
        metrics::with_local_recorder(&first, || metrics.request(&service, &method));
        assert_eq!(requests_counted(&first), 4);
        assert_eq!(requests_counted(&second), 2);
    }
}
