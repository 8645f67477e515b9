//! The discrete-event engine: open-loop clients driven by the library's retry, budget, storm
//! alarm, throttle and hedging types, a server with a concurrency limit and an admission step,
//! and a downstream whose latency changes by phase. Virtual time in nanoseconds; a binary heap
//! of events; one seeded generator. No runtime, no sleeping: the same model and seed give the
//! same run.
//!
//! The parts: `model`, what is simulated (the world, the clients and the server) and what a
//! run returns; `admission`, the server's admission step in front of its workers; `sim`, the
//! event loop and its bookkeeping, with what the client side and the server side do on each
//! event; `slab`, the generational slab the events name their requests by.

mod admission;
mod model;
mod sim;
mod slab;

use std::time::Duration;

pub(crate) use self::model::{
    ClientConfig, Cold, Deadlines, Downstream, LimitKind, Model, Phase, RetryAfter, Run,
    ServerConfig,
};

use self::admission::{Admission, FifoGate, QueueGate};
use self::sim::Sim;

const NANOS: u64 = 1_000_000_000;

/// Runs `model` with clients configured by `client` against a server configured by `server`.
pub(crate) fn run(model: &Model, client: &ClientConfig, server: &ServerConfig) -> Run {
    let queued = server.deadline_aware && server.fair_queue;
    assert!(
        queued || server.retry_after != RetryAfter::Computed,
        "a computed Retry-After needs the gate's fair queue"
    );
    let admission: Box<dyn Admission> = if queued {
        Box::new(QueueGate::new(server))
    } else {
        Box::new(FifoGate::new(server))
    };
    Sim::new(model, client, server, admission).run()
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
