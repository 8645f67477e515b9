//! The push-away budget: a share of the open connections per interval, each pushed once, and
//! only under sustained overload.

use std::time::Duration;

use hyper_util::server::conn::auto;

use super::{InvalidPushAway, PushAway, Pushed};
use crate::admission::{Shedding, SheddingConfig};
use crate::server::listen::ListenConfig;
use crate::server::listen::registry::{Metrics, Registered, Registry};
use crate::server::listen::shared::Shared;
use crate::server::listen::streams::Streams;

fn shared(push: PushAway) -> Shared {
    Shared {
        builder: auto::Builder::new(Streams::default()),
        config: ListenConfig {
            push_away: Some(push),
            ..ListenConfig::default()
        },
        open: Registry::default(),
        metrics: Metrics::new("test"),
        pushed: Pushed::new(),
    }
}

/// Shedding that counts as sustained from its first refusal on.
fn at_once() -> Shedding {
    Shedding::new(SheddingConfig {
        sustain: Duration::ZERO,
        min_requests: 1,
        ..SheddingConfig::default()
    })
    .unwrap()
}

/// How many of `conns` a response pushes away now.
fn push_round(shared: &Shared, conns: &[Registered]) -> usize {
    conns
        .iter()
        .filter(|c| shared.push_now(&c.conn, false))
        .count()
}

#[tokio::test(start_paused = true)]
async fn pushes_a_share_of_the_connections_per_interval_each_once() {
    let shedding = at_once();
    let push = PushAway::new(shedding.clone()).with_share(0.1).unwrap();
    let shared = shared(push);
    let conns: Vec<_> = (0..20).map(|_| shared.admit().unwrap()).collect();
    assert_eq!(push_round(&shared, &conns), 0, "no overload, no push");

    shedding.record(false);
    assert_eq!(push_round(&shared, &conns), 2, "a tenth of 20");
    assert_eq!(
        push_round(&shared, &conns),
        0,
        "the interval's share is spent"
    );
    tokio::time::advance(Duration::from_millis(999)).await;
    assert_eq!(push_round(&shared, &conns), 0);
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(push_round(&shared, &conns), 2, "a new interval");
    let pushed = conns
        .iter()
        .filter(|c| c.conn.pushed.load(std::sync::atomic::Ordering::Relaxed))
        .count();
    assert_eq!(pushed, 4, "four different connections");
}

#[tokio::test(start_paused = true)]
async fn a_small_listener_pushes_one_connection_an_interval() {
    let push = PushAway::new(at_once())
        .with_interval(Duration::from_secs(5))
        .unwrap();
    let shared = shared(push);
    shared
        .config
        .push_away
        .as_ref()
        .unwrap()
        .shedding()
        .record(false);
    let conns: Vec<_> = (0..3).map(|_| shared.admit().unwrap()).collect();
    assert_eq!(push_round(&shared, &conns), 1);
    tokio::time::advance(Duration::from_secs(4)).await;
    assert_eq!(push_round(&shared, &conns), 0);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(push_round(&shared, &conns), 1);
}

#[tokio::test(start_paused = true)]
async fn shedding_that_is_not_sustained_yet_pushes_nothing() {
    let shedding = Shedding::new(SheddingConfig {
        sustain: Duration::from_secs(5),
        min_requests: 1,
        ..SheddingConfig::default()
    })
    .unwrap();
    let shared = shared(PushAway::new(shedding.clone()).with_share(1.0).unwrap());
    let conns: Vec<_> = (0..4).map(|_| shared.admit().unwrap()).collect();
    shedding.record(false);
    assert!(shedding.is_shedding());
    assert_eq!(push_round(&shared, &conns), 0);
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(
        push_round(&shared, &conns),
        4,
        "a share of 1: every connection"
    );
}

#[test]
fn settings_out_of_range_are_refused() {
    let push = || PushAway::new(Shedding::new(SheddingConfig::default()).unwrap());
    for share in [0.0, -0.5, 1.01, f64::NAN, f64::INFINITY] {
        assert!(
            matches!(push().with_share(share), Err(InvalidPushAway::Share(_))),
            "{share}"
        );
    }
    assert_eq!(
        push().with_interval(Duration::ZERO).unwrap_err(),
        InvalidPushAway::Interval
    );
    let p = push().with_share(0.25).unwrap();
    assert_eq!(
        (p.share(), p.interval()),
        (0.25, PushAway::DEFAULT_INTERVAL)
    );
    assert!(
        InvalidPushAway::Share(2.0)
            .to_string()
            .contains("at most 1")
    );
}

/// A connection whose tenant the gate said is within its share is never pushed, however much
/// budget is left; one over its share, or never marked, is.
#[tokio::test(start_paused = true)]
async fn connections_of_tenants_within_their_share_are_never_pushed() {
    let shedding = at_once();
    let shared = shared(PushAway::new(shedding.clone()).with_share(1.0).unwrap());
    let conns: Vec<_> = (0..6).map(|_| shared.admit().unwrap()).collect();
    let info = |c: &Registered| super::super::ConnectionInfo {
        peer: "127.0.0.1:1".parse().unwrap(),
        conn: std::sync::Arc::clone(&c.conn),
    };
    for c in &conns[..4] {
        info(c).set_within_share(true);
    }
    info(&conns[4]).set_within_share(false);
    // Said "over" once, then "within": the latest request counts.
    info(&conns[3]).set_within_share(false);
    info(&conns[3]).set_within_share(true);
    shedding.record(false);
    let pushed: Vec<_> = (0..conns.len())
        .filter(|&i| shared.push_now(&conns[i].conn, false))
        .collect();
    assert_eq!(pushed, [4, 5]);
}
