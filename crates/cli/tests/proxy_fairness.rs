//! `backstop proxy`: a noisy scope does not get a quiet one refused. With 16 places in the
//! gate (`--max-inflight 16`) and an upstream taking 100 ms a request, scope `noisy` (its
//! `X-Api-Key`) runs 60 clients back to back while scope `quiet` sends its charges one after
//! another from two clients, far below its share: every quiet charge is created, on the
//! connection it came on, while the noisy scope is refused.
//!
//! Counted, not timed: the quiet clients start once the noisy scope has been refused (the
//! overload is there) and send a fixed number of charges; the noisy clients stop once the
//! quiet ones are done (a bound on their count keeps a broken build from running for ever).

#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;

#[path = "support/proxy_harness.rs"]
mod proxy_harness;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::Notify;

use self::proxy_harness::{Answer, Rig, charge, send};

const NOISY_CLIENTS: usize = 60;
const QUIET_CLIENTS: usize = 2;
/// Charges each quiet client sends, one after another.
const QUIET_CHARGES: usize = 15;
/// Bound on the noisy charges, so that a test that cannot end still ends.
const NOISY_BOUND: usize = 20_000;

/// One charge as `scope`, taking the upstream 100 ms: its status and whether the answer
/// closes the connection.
async fn pay(http: &reqwest::Client, base: &str, scope: &str, key: &str) -> (u16, bool) {
    let request = charge(http, base, "/v1/charges", key, r#"{"amount":5}"#)
        .header("X-Api-Key", scope)
        .header("X-Upstream-Sleep-Ms", "100");
    let Answer {
        status, headers, ..
    } = send(request).await.expect("the proxy answers");
    let close = headers
        .get(reqwest::header::CONNECTION)
        .is_some_and(|v| v == "close");
    (status, close)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noisy_scope_does_not_get_a_quiet_one_refused() {
    let Some(Rig {
        http: _http,
        proxy,
        upstream: _upstream,
        dir: _dir,
    }) = Rig::start(&["--scope-header", "X-Api-Key", "--max-inflight", "16"]).await
    else {
        return;
    };
    let base = Arc::new(proxy.base.clone());
    let sent = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let overloaded = Arc::new(Notify::new());
    let workers: Vec<_> = (0..NOISY_CLIENTS)
        .map(|w| {
            let (base, sent, refused, stop, overloaded) = (
                Arc::clone(&base),
                Arc::clone(&sent),
                Arc::clone(&refused),
                Arc::clone(&stop),
                Arc::clone(&overloaded),
            );
            tokio::spawn(async move {
                let http = proxy_harness::client();
                let mut i = 0;
                while !stop.load(Ordering::Acquire)
                    && sent.fetch_add(1, Ordering::AcqRel) < NOISY_BOUND
                {
                    let (status, _) = pay(&http, &base, "noisy", &format!("n-{w}-{i}")).await;
                    if status == 503 && refused.fetch_add(1, Ordering::AcqRel) == 0 {
                        overloaded.notify_one();
                    }
                    i += 1;
                }
            })
        })
        .collect();
    let notified = overloaded.notified();
    if refused.load(Ordering::Acquire) == 0 {
        notified.await;
    }
    let quiet: Vec<_> = (0..QUIET_CLIENTS)
        .map(|c| {
            let base = Arc::clone(&base);
            tokio::spawn(async move {
                let http = proxy_harness::client();
                let mut answers = Vec::new();
                for i in 0..QUIET_CHARGES {
                    answers.push(pay(&http, &base, "quiet", &format!("q-{c}-{i}")).await);
                }
                answers
            })
        })
        .collect();
    let mut answers = Vec::new();
    for q in quiet {
        answers.extend(q.await.unwrap());
    }
    stop.store(true, Ordering::Release);
    for w in workers {
        w.await.unwrap();
    }
    assert_eq!(answers.len(), QUIET_CLIENTS * QUIET_CHARGES);
    assert!(
        answers
            .iter()
            .all(|&(status, closed)| status == 201 && !closed),
        "every quiet charge is created on the connection it came on: {answers:?}"
    );
    assert!(refused.load(Ordering::Acquire) > 0);
}
