//! What the report says about each claim's scenario: what ran, how to read its figures, and
//! where the live run cannot show what `storm sim` shows.

use super::claims::{COLD_KNEE, HEDGE_DELAY, JITTER_BACKOFF};
use super::result::RunResult;
use crate::storm::kind::ScenarioKind;

/// The report's text for a claim's scenario; `None` for the mirrored ones (and those never run
/// live).
pub(super) fn describe(result: &RunResult) -> Option<String> {
    let what = match result.scenario {
        ScenarioKind::Slowdown
        | ScenarioKind::Overload
        | ScenarioKind::Outage
        | ScenarioKind::LittlesLaw
        | ScenarioKind::OutageRecovery
        | ScenarioKind::Hedging
        | ScenarioKind::Amplification => return None,
        ScenarioKind::Jitter => format!(
            "Retry pulses. The PSP holds every charge arriving during 1 s (of 100/s offered), \
             then refuses the whole stalled cohort at the same moment (503 with a pushback of \
             10 s, longer than any deadline, so that the service's own PSP client does not \
             retry them itself); the service answers the cohort's naive clients together, and \
             each retries, ignoring the pushback, after a backoff of \
             {JITTER_BACKOFF} (doubling): without jitter, or with the library's full, equal or \
             decorrelated jitter. The load's series is kept in rows of 100 ms, and \
             `retry_pulse_share` is the share of all the run's retries sent within its busiest \
             300 ms: near 1 when they come in lockstep, about 0.3 / the spread of the backoff \
             when jittered (full: uniform over 1 s; equal: over its second half; \
             decorrelated: over 1 to 3 s). The spread of the cohort's own answers (the service \
             writing each one to SQLite on a shared 2-core machine) widens the lockstep pulse a \
             little; the backoff is long against it so that the modes stay apart. The naive \
             client sends each retry with a fresh key for the same order, which the service \
             refuses (409, the order's first intent holds it): the figure is about when the \
             retries arrive, not what they get."
        ),
        ScenarioKind::Utilization => "The same client policy at two utilizations. Capacity is \
             measured first (16 places, the PSP at 100 ms); then the naive client with full \
             jitter (3 attempts, a fresh 2 s timeout each) is offered 70% and 90% of it, and \
             the PSP slows to 300 ms for 4 s. The server keeps what waits in a FIFO queue, up \
             to each request's deadline. With headroom the backlog of the slowdown drains; \
             near saturation the timeouts it causes bring retries that eat the headroom left. \
             `late_goodput_share` is the goodput over the second half of what follows the \
             slowdown, over the rate offered (1: drained); `retries_per_logical` what the \
             retries added. The library's client at 90% is beside them."
            .to_owned(),
        ScenarioKind::Cold => format!(
            "A cold downstream with and without slow start. The PSP is down (503) for 5 s, \
             then back cold for 10 s: above {COLD_KNEE} charges in flight each one's latency \
             is multiplied by (in flight / {COLD_KNEE})^2, so that past the knee more calls at \
             once serve fewer per second (a cold cache or a pool still growing; 64 at once \
             take 6.4 s and miss every deadline). Without slow start the service releases its \
             whole backlog onto it (64 places); with it, the outage drops its limit to 4 and \
             the ramp doubles it per round trip, falling back when half of a window fails. \
             `goodput_while_cold` is the mean goodput per second while it is cold, \
             `server_inflight_peak_while_cold` the service's own gauge then (sampled once a \
             second)."
        ),
        ScenarioKind::Burst => "Queue sizing under a burst. 100/s, and 1 s of 200/s more on \
             top (a second `backstop load`): lambda_peak = 300/s against mu <= 16 places / \
             100 ms = 160/s, so Q >= (lambda_peak - mu) x T_burst asks for about 140 to 150 \
             waiting places. The service keeps a FIFO queue of 200 in one variant and of 20 in \
             the other; what does not fit is refused at once (`attempts_refused`, counted by \
             the clients; the library's client retries them after the pushback, within its \
             budget, and `not_ok` counts the requests that failed in the end, the burst's \
             included). The queue's peak is the service's gauge, sampled once a second, so it \
             can miss the very top."
            .to_owned(),
        ScenarioKind::HedgeDrift => format!(
            "Hedge drift with load. Capacity is measured first (16 places, the PSP at 100 ms); \
             then the library's client hedges every attempt unanswered after a fixed \
             {HEDGE_DELAY} (just above the unloaded latency) at 30%, 90% and 110% of it, \
             with its retry budget (10% of requests and 20 tokens), and at 110% without it. \
             `hedge_share` is hedges sent per logical request, `hedges_won_share` those that \
             answered first; with the budget, retries and hedges together stay below \
             0.1 x requests + 20. Unlike the simulation (Poisson arrivals, a latency with a \
             tail), `load` spaces its requests evenly and the PSP simulator's latency is \
             constant, so below capacity a request hardly ever waits for a place and the \
             hedge share does not drift with load: only the machine's own hiccups push \
             attempts past the delay. Past capacity the FIFO queue's wait grows through the \
             run and carries nearly every attempt past it. \
             A hedge carries the original's idempotency key, so the service answers it from \
             the key's record (409 `request_in_progress` while the original runs) rather than \
             charging twice: in this service a hedge costs a request's admission and a store \
             lookup, not a second PSP call."
        ),
        ScenarioKind::HiddenQueue => "Client-side hidden queues. 150/s through the library's \
             client to a service with 256 places (the PSP at 100 ms): with no limit of its \
             own, with `Destination::max_in_flight` 20 (a ceiling of about 20 / 105 ms = \
             190/s, enough on average) and 12 (about 115/s, less than offered). Past the limit \
             attempts wait in the client, where no server metric sees them: the service's \
             in-flight gauge stays at the limit and its queue empty while the client's p99 \
             grows and, below what is offered, requests time out. `client_pending_peak` is the \
             peak of the client's `rpc_client_pending_requests` gauge (sampled every 10 ms), \
             `server_inflight_peak` the service's own gauge (sampled once a second)."
            .to_owned(),
    };
    Some(format!(
        "{what}\n\nMeasured on loopback: a real `backstop serve` (SQLite), the PSP simulator and \
         `backstop load`, on one machine. `backstop storm sim --scenario {}` is this claim's \
         deterministic version, at its own parameters; there is no simulated mirror beside \
         these runs.",
        result.scenario.as_str()
    ))
}
