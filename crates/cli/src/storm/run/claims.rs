//! The live counterparts of `storm sim`'s chapter claims: what the PSP does, what is offered
//! and which variants are compared, for `jitter`, `utilization`, `cold`, `burst`,
//! `hedge-drift` and `hidden-queue` (amplification has its own live example,
//! `crates/backstop/examples/amplification.rs`).
//!
//! Each runs on the real service like the other live scenarios; the servers of the claims that
//! do not study slow start run without it (`--no-slow-start`), so that its ramp after start-up
//! does not add to what is measured.

use super::plan::{Burst, MS, NORMAL, Phase, Plan, S, Variant, healthy, variant};

/// The naive client's first backoff delay in `jitter`: long against the time the service
/// takes to answer a whole cohort, so that the spread of the jittered modes shows.
pub(super) const JITTER_BACKOFF: &str = "1s";
/// The fixed hedge delay of `hedge-drift`: just above the unloaded latency of a payment (the
/// PSP's 100 ms and the service's own work).
pub(super) const HEDGE_DELAY: &str = "130ms";
/// `cold`'s knee: above this many charges in flight the cold PSP slows down.
pub(super) const COLD_KNEE: u32 = 8;

/// What the claims' plans share unless they say otherwise: 200/s for 15 s on a PSP answering
/// after 100 ms.
fn base() -> Plan {
    Plan {
        rate: Some(200.0),
        capacity_multiple: 1.0,
        duration: S(15),
        recovery_at: None,
        phases: vec![healthy(S(0), NORMAL)],
        variants: Vec::new(),
        burst: None,
        series_interval: None,
        probe: None,
        probe_rate: 2_000.0,
    }
}

/// The server every claim measuring capacity is probed with (the default fair queue sheds what
/// waits too long, so the probe's goodput is what the server can serve).
fn probe() -> Variant {
    variant(
        "probe",
        vec!["--max-inflight", "16", "--no-slow-start"],
        vec![],
    )
}

/// Twice what 16 places at 100 ms can serve.
const PROBE_RATE: f64 = 320.0;

/// A variant offered `share` of the measured capacity.
fn at_share(
    name: &'static str,
    share: f64,
    serve: &[&'static str],
    load: &[&'static str],
) -> Variant {
    Variant {
        rate_share: share,
        ..variant(name, serve.to_vec(), load.to_vec())
    }
}

/// 16 places behind a FIFO queue that keeps what waits (until its deadline).
const QUEUED: [&str; 7] = [
    "--max-inflight",
    "16",
    "--no-slow-start",
    "--queue",
    "fifo",
    "--queue-size",
    "10000",
];

/// The PSP stalls for 1 s and then refuses every stalled charge at once: the cohort's naive
/// clients retry after the same backoff, jittered or not. Rows of 100 ms show the pulse. The
/// refusal's pushback (10 s) outlasts every deadline, so that the service's own PSP client
/// does not retry the cohort itself and passes each refusal on at once (the naive client
/// ignores the pushback).
pub(super) fn jitter() -> Plan {
    let serve = vec!["--max-inflight", "1000", "--no-slow-start"];
    let client = |mode| {
        vec![
            "--policy",
            "naive",
            "--backoff",
            JITTER_BACKOFF,
            "--jitter",
            mode,
        ]
    };
    Plan {
        phases: vec![
            healthy(S(0), NORMAL),
            Phase {
                unavailable: true,
                pushback: Some(S(10)),
                hold: Some(S(1)),
                ..healthy(S(8), NORMAL)
            },
            healthy(S(9), NORMAL),
        ],
        variants: ["none", "full", "equal", "decorrelated"]
            .into_iter()
            .map(|mode| {
                let name = if mode == "none" { "no-jitter" } else { mode };
                variant(name, serve.clone(), client(mode))
            })
            .collect(),
        rate: Some(100.0),
        series_interval: Some(MS(100)),
        ..base()
    }
}

/// The same naive, jittered client and the same 4 s slowdown (100 ms to 300 ms) at 70% and at
/// 90% of the measured capacity, behind a FIFO queue that keeps what waits; the library's
/// client at 90% beside them.
pub(super) fn utilization() -> Plan {
    let naive = ["--policy", "naive", "--jitter", "full"];
    Plan {
        rate: None,
        duration: S(30),
        recovery_at: Some(S(12)),
        phases: vec![
            healthy(S(0), NORMAL),
            healthy(S(8), MS(300)),
            healthy(S(12), NORMAL),
        ],
        variants: vec![
            at_share("naive-70%", 0.7, &QUEUED, &naive),
            at_share("naive-90%", 0.9, &QUEUED, &naive),
            at_share("backstop-90%", 0.9, &QUEUED, &[]),
        ],
        probe: Some(probe()),
        probe_rate: PROBE_RATE,
        ..base()
    }
}

/// Down for 5 s, then back cold for 10 s: slower the more calls it holds (the latency times
/// (in flight / 8)^2 above 8), with and without the server's slow start.
pub(super) fn cold() -> Plan {
    Plan {
        duration: S(30),
        recovery_at: Some(S(10)),
        phases: vec![
            healthy(S(0), NORMAL),
            Phase {
                unavailable: true,
                ..healthy(S(5), NORMAL)
            },
            Phase {
                slow_above: COLD_KNEE,
                ..healthy(S(10), NORMAL)
            },
            healthy(S(20), NORMAL),
        ],
        variants: vec![
            variant("slow-start", vec!["--max-inflight", "64"], vec![]),
            variant(
                "no-slow-start",
                vec!["--max-inflight", "64", "--no-slow-start"],
                vec![],
            ),
        ],
        ..base()
    }
}

/// 100/s, and 1 s of 200/s more on top at 8 s: lambda_peak = 300/s against
/// mu <= 16 / 100 ms = 160/s, an excess of about 140 to 150 requests; a queue of 200 holds it,
/// one of 20 does not.
pub(super) fn burst() -> Plan {
    let serve = |size| {
        vec![
            "--max-inflight",
            "16",
            "--no-slow-start",
            "--queue",
            "fifo",
            "--queue-size",
            size,
        ]
    };
    Plan {
        rate: Some(100.0),
        duration: S(20),
        burst: Some(Burst {
            at: S(8),
            duration: S(1),
            rate: 200.0,
        }),
        variants: vec![
            variant("queue-200", serve("200"), vec![]),
            variant("queue-20", serve("20"), vec![]),
        ],
        ..base()
    }
}

/// A fixed hedge delay at rising load (30%, 90% and 110% of the measured capacity), with the
/// library's retry budget, and at 110% without it. `load` spaces its requests evenly and the
/// PSP's latency is constant, so below capacity the queue hardly waits (no hedge drift to
/// see); past it the FIFO queue's wait grows through the run.
pub(super) fn hedge_drift() -> Plan {
    let hedged = ["--fixed-hedge-delay", HEDGE_DELAY];
    let unbudgeted = ["--fixed-hedge-delay", HEDGE_DELAY, "--no-retry-budget"];
    Plan {
        rate: None,
        variants: vec![
            at_share("load-30%", 0.3, &QUEUED, &hedged),
            at_share("load-90%", 0.9, &QUEUED, &hedged),
            at_share("load-110%", 1.1, &QUEUED, &hedged),
            at_share("load-110%-no-budget", 1.1, &QUEUED, &unbudgeted),
        ],
        probe: Some(probe()),
        probe_rate: PROBE_RATE,
        ..base()
    }
}

/// 150/s through the library's client with no limit of its own, with at most 20 attempts in
/// flight (a ceiling of about 20 / 105 ms = 190/s) and with 12 (about 115/s, below what is
/// offered).
pub(super) fn hidden_queue() -> Plan {
    let serve = vec!["--max-inflight", "256", "--no-slow-start"];
    Plan {
        rate: Some(150.0),
        variants: vec![
            variant("unlimited", serve.clone(), vec![]),
            variant(
                "max-in-flight-20",
                serve.clone(),
                vec!["--max-in-flight", "20"],
            ),
            variant("max-in-flight-12", serve, vec!["--max-in-flight", "12"]),
        ],
        ..base()
    }
}
