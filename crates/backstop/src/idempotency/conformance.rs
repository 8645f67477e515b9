//! The conformance suite every [`Store`] backend runs (the tower-sessions model: one suite, one
//! macro, every backend).
//!
//! ```ignore
//! backstop::store_conformance!(memory_conformance, async { backstop::idempotency::MemoryStore::new() });
//! ```
//!
//! The expression is evaluated once per test and may yield the store itself or a
//! [`WithGuard`]`(store, guard)` whose guard (e.g. a temporary directory) lives as long as the
//! test. A backend on a server that may be absent names a check to run first:
//! `store_conformance!(name, run_if = server_answers(), make)` skips every case when it is
//! false. The generated tests run on a multi-threaded tokio runtime (the caller needs `tokio` with
//! the `macros` and `rt-multi-thread` features). Cases pass `now_ms` explicitly: no sleeping, no
//! wall clock, nothing timed.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Barrier;

use super::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Lease, RecordStatus, Store, StoreError,
    StoredResponse,
};

/// What the factory expression of [`store_conformance!`](crate::store_conformance) yields.
pub trait Fixture: Send + 'static {
    /// The store under test.
    type Store: Store;
    /// A handle on the store under test.
    fn store(&self) -> Self::Store;
}

impl<S: Store> Fixture for S {
    type Store = S;
    fn store(&self) -> S {
        self.clone()
    }
}

/// A store plus something that must outlive it (a temporary directory, a container...).
#[derive(Debug)]
pub struct WithGuard<S, G>(pub S, pub G);

impl<S: Store, G: Send + 'static> Fixture for WithGuard<S, G> {
    type Store = S;
    fn store(&self) -> S {
        self.0.clone()
    }
}

/// Generates the store conformance tests in a module `$name`, each on a fresh fixture from the
/// async expression `$make` (see [`idempotency::conformance`](crate::idempotency::conformance)).
///
/// `store_conformance!(name, run_if = READY, MAKE)` evaluates the `bool` expression `READY` at
/// the start of every test, which returns at once (and passes) when it is false: for a backend
/// whose server may be absent, `READY` checks that it answers and says so when it does not.
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
#[macro_export]
macro_rules! store_conformance {
    ($name:ident, run_if = $ready:expr, $make:expr $(,)?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $crate::__store_conformance_cases!(
                $ready;
                $make;
                first_claim_is_claimed_and_recorded_running,
                unknown_key_has_no_record,
                replay_returns_status_headers_and_body_byte_for_byte,
                withheld_answer_replays_its_status_headers_and_marker,
                other_fingerprint_conflicts_with_original_prefix,
                live_lease_answers_in_progress_with_time_left,
                failed_record_is_taken_over,
                expired_lease_is_taken_over,
                concurrent_takeovers_of_failed_record_have_one_winner,
                concurrent_takeovers_of_expired_lease_have_one_winner,
                concurrent_first_claims_have_one_winner,
                stale_lease_cannot_complete_fail_or_release_after_takeover,
                takeover_moves_fencing_token_forward,
                succeeded_is_terminal,
                release_leaves_key_unused,
                sweep_removes_expired_but_never_a_live_lease,
                sweep_respects_limit,
                outcome_keeps_record_for_ttl_from_completion,
                scopes_isolate_keys,
                follows_the_protocol_on_random_histories,
            );
        }
    };
    ($name:ident, $make:expr $(,)?) => {
        $crate::store_conformance!($name, run_if = true, $make);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __store_conformance_cases {
    ($ready:expr; $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                if !$ready {
                    return;
                }
                let fixture = $make.await;
                let store = $crate::idempotency::conformance::Fixture::store(&fixture);
                $crate::idempotency::conformance::$case(store).await;
                drop(fixture);
            }
        )*
    };
}

const LEASE: Duration = Duration::from_secs(5);
const TTL: Duration = Duration::from_secs(24 * 3600);
const TTL_MS: i64 = 24 * 3600 * 1000;
const T0: i64 = 1_700_000_000_000;
const SCOPE: &str = "merchant-1";

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).expect("valid test key")
}

fn fp(amount: u32) -> Fingerprint {
    Fingerprint::of_json(
        "POST /v1/payments",
        format!("{{\"amount\":{amount}}}").as_bytes(),
    )
    .expect("valid JSON")
}

fn req(k: &str, fingerprint: Fingerprint, now_ms: i64) -> ClaimRequest {
    ClaimRequest {
        scope: SCOPE.to_owned(),
        key: key(k),
        fingerprint,
        lease: LEASE,
        ttl: TTL,
        now_ms,
    }
}

fn response(n: u8) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("x-dup".into(), "first".into()),
            ("x-dup".into(), "second".into()),
            ("Location".into(), format!("/v1/payments/pi_{n}")),
        ],
        // Not UTF-8 on purpose: bodies are bytes.
        body: Bytes::from(vec![b'{', 0, 0xff, 0xfe, n, b'}', b'\n']),
    }
}

async fn claimed<S: Store>(store: &S, r: ClaimRequest) -> Lease {
    match store.claim(r).await.expect("claim") {
        Claim::Claimed(lease) => lease,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

fn assert_lease_lost(r: Result<(), StoreError>) {
    assert!(
        matches!(r, Err(StoreError::LeaseLost { .. })),
        "expected LeaseLost, got {r:?}"
    );
}

#[doc(hidden)]
pub async fn first_claim_is_claimed_and_recorded_running<S: Store>(store: S) {
    let lease = claimed(&store, req("k1", fp(100), T0)).await;
    assert_eq!(lease.scope, SCOPE);
    assert_eq!(lease.key, key("k1"));
    assert_eq!(lease.lease_until_ms, T0 + 5_000);
    let rec = store.get(SCOPE, &key("k1")).await.unwrap().expect("record");
    assert_eq!(rec.status, RecordStatus::Running);
    assert_eq!(rec.fingerprint, fp(100));
    assert_eq!(rec.lease_until_ms, T0 + 5_000);
    assert_eq!(rec.created_at_ms, T0);
    assert_eq!(rec.expires_at_ms, T0 + TTL_MS);
    assert_eq!(rec.response, None);
}

#[doc(hidden)]
pub async fn unknown_key_has_no_record<S: Store>(store: S) {
    assert_eq!(store.get(SCOPE, &key("nope")).await.unwrap(), None);
}

#[doc(hidden)]
pub async fn replay_returns_status_headers_and_body_byte_for_byte<S: Store>(store: S) {
    let lease = claimed(&store, req("k1", fp(100), T0)).await;
    store.complete(&lease, response(7), T0 + 10).await.unwrap();
    for now in [T0 + 20, T0 + 60_000] {
        let claim = store.claim(req("k1", fp(100), now)).await.unwrap();
        assert_eq!(claim, Claim::Replay(response(7)));
    }
    let rec = store.get(SCOPE, &key("k1")).await.unwrap().expect("record");
    assert_eq!(rec.status, RecordStatus::Succeeded);
    assert_eq!(rec.response, Some(response(7)));
}

/// An answer stored without its body (too large to keep) comes back with its status, its
/// headers and the marker naming the limit.
#[doc(hidden)]
pub async fn withheld_answer_replays_its_status_headers_and_marker<S: Store>(store: S) {
    let withheld = StoredResponse::withheld(200, response(3).headers, 1 << 20);
    let lease = claimed(&store, req("k1", fp(100), T0)).await;
    store
        .complete(&lease, withheld.clone(), T0 + 10)
        .await
        .unwrap();
    let claim = store.claim(req("k1", fp(100), T0 + 20)).await.unwrap();
    let Claim::Replay(stored) = claim else {
        panic!("expected Replay, got {claim:?}");
    };
    assert_eq!(stored, withheld);
    assert_eq!(stored.body_withheld(), Some(1 << 20));
    assert!(stored.body.is_empty());
    let rec = store.get(SCOPE, &key("k1")).await.unwrap().expect("record");
    assert_eq!(rec.response, Some(withheld));
    // An answer stored whole carries no marker.
    assert_eq!(response(3).body_withheld(), None);
}

#[doc(hidden)]
pub async fn other_fingerprint_conflicts_with_original_prefix<S: Store>(store: S) {
    let want = Claim::Conflict {
        fingerprint_prefix: fp(100).prefix8(),
    };
    // While running,
    let lease = claimed(&store, req("k1", fp(100), T0)).await;
    assert_eq!(
        store.claim(req("k1", fp(1000), T0 + 1)).await.unwrap(),
        want
    );
    // once failed (a takeover needs the same parameters),
    store.fail(&lease, T0 + 2).await.unwrap();
    assert_eq!(
        store.claim(req("k1", fp(1000), T0 + 3)).await.unwrap(),
        want
    );
    // and once succeeded.
    let lease = claimed(&store, req("k1", fp(100), T0 + 4)).await;
    store.complete(&lease, response(1), T0 + 5).await.unwrap();
    assert_eq!(
        store.claim(req("k1", fp(1000), T0 + 6)).await.unwrap(),
        want
    );
    // The conflicting request changed nothing.
    let rec = store.get(SCOPE, &key("k1")).await.unwrap().expect("record");
    assert_eq!(rec.fingerprint, fp(100));
    assert_eq!(rec.response, Some(response(1)));
}

#[doc(hidden)]
pub async fn live_lease_answers_in_progress_with_time_left<S: Store>(store: S) {
    claimed(&store, req("k1", fp(100), T0)).await;
    assert_eq!(
        store.claim(req("k1", fp(100), T0 + 2_000)).await.unwrap(),
        Claim::InProgress {
            retry_after: Duration::from_millis(3_000)
        }
    );
    assert_eq!(
        store.claim(req("k1", fp(100), T0 + 4_999)).await.unwrap(),
        Claim::InProgress {
            retry_after: Duration::from_millis(1)
        }
    );
}

#[doc(hidden)]
pub async fn failed_record_is_taken_over<S: Store>(store: S) {
    let first = claimed(&store, req("k1", fp(100), T0)).await;
    store.fail(&first, T0 + 100).await.unwrap();
    let rec = store.get(SCOPE, &key("k1")).await.unwrap().expect("record");
    assert_eq!(rec.status, RecordStatus::Failed);
    // Before the first lease would have ended: failed records are free at once.
    let second = claimed(&store, req("k1", fp(100), T0 + 200)).await;
    assert_eq!(second.lease_until_ms, T0 + 200 + 5_000);
    let rec = store.get(SCOPE, &key("k1")).await.unwrap().expect("record");
    assert_eq!(rec.status, RecordStatus::Running);
    assert_eq!(rec.created_at_ms, T0);
    store
        .complete(&second, response(2), T0 + 300)
        .await
        .unwrap();
    assert_eq!(
        store.claim(req("k1", fp(100), T0 + 400)).await.unwrap(),
        Claim::Replay(response(2))
    );
}

#[doc(hidden)]
pub async fn expired_lease_is_taken_over<S: Store>(store: S) {
    let first = claimed(&store, req("k1", fp(100), T0)).await;
    // lease_until <= now: the runner is presumed dead.
    let second = claimed(&store, req("k1", fp(100), first.lease_until_ms)).await;
    assert_eq!(second.lease_until_ms, first.lease_until_ms + 5_000);
}

async fn race<S: Store>(store: &S, n: usize, r: ClaimRequest) -> Vec<Claim> {
    let barrier = Arc::new(Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let store = store.clone();
            let barrier = Arc::clone(&barrier);
            let r = r.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                store.claim(r).await.expect("claim")
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.expect("claim task"));
    }
    out
}

fn assert_one_winner(claims: &[Claim]) -> Lease {
    let winners: Vec<&Lease> = claims
        .iter()
        .filter_map(|c| match c {
            Claim::Claimed(l) => Some(l),
            _ => None,
        })
        .collect();
    assert_eq!(winners.len(), 1, "exactly one claim must win: {claims:?}");
    for c in claims {
        match c {
            Claim::Claimed(_) => {}
            Claim::InProgress { retry_after } => assert!(*retry_after >= Duration::from_millis(1)),
            other => panic!("a loser must get InProgress, got {other:?}"),
        }
    }
    winners[0].clone()
}

#[doc(hidden)]
pub async fn concurrent_takeovers_of_failed_record_have_one_winner<S: Store>(store: S) {
    for round in 0..4 {
        let k = format!("k-{round}");
        let first = claimed(&store, req(&k, fp(100), T0)).await;
        store.fail(&first, T0 + 1).await.unwrap();
        let claims = race(&store, 32, req(&k, fp(100), T0 + 2)).await;
        let winner = assert_one_winner(&claims);
        store.complete(&winner, response(3), T0 + 3).await.unwrap();
    }
}

#[doc(hidden)]
pub async fn concurrent_takeovers_of_expired_lease_have_one_winner<S: Store>(store: S) {
    for round in 0..4 {
        let k = format!("k-{round}");
        let first = claimed(&store, req(&k, fp(100), T0)).await;
        let claims = race(&store, 32, req(&k, fp(100), first.lease_until_ms + 1)).await;
        let winner = assert_one_winner(&claims);
        assert_lease_lost(store.complete(&first, response(1), T0 + 6_000).await);
        store
            .complete(&winner, response(2), T0 + 6_000)
            .await
            .unwrap();
    }
}

#[doc(hidden)]
pub async fn concurrent_first_claims_have_one_winner<S: Store>(store: S) {
    for round in 0..4 {
        let claims = race(&store, 32, req(&format!("k-{round}"), fp(100), T0)).await;
        assert_one_winner(&claims);
    }
}

#[doc(hidden)]
pub async fn stale_lease_cannot_complete_fail_or_release_after_takeover<S: Store>(store: S) {
    let stale = claimed(&store, req("k1", fp(100), T0)).await;
    let fresh = claimed(&store, req("k1", fp(100), stale.lease_until_ms)).await;
    assert_lease_lost(store.complete(&stale, response(1), T0 + 5_001).await);
    assert_lease_lost(store.fail(&stale, T0 + 5_001).await);
    assert_lease_lost(store.release(&stale).await);
    // The stale holder changed nothing; the fresh one still owns the key.
    let rec = store.get(SCOPE, &key("k1")).await.unwrap().expect("record");
    assert_eq!(rec.status, RecordStatus::Running);
    assert_eq!(rec.lease_until_ms, fresh.lease_until_ms);
    store
        .complete(&fresh, response(2), T0 + 5_002)
        .await
        .unwrap();
    assert_eq!(
        store.claim(req("k1", fp(100), T0 + 5_003)).await.unwrap(),
        Claim::Replay(response(2))
    );
}

#[doc(hidden)]
pub async fn takeover_moves_fencing_token_forward<S: Store>(store: S) {
    // A zero lease at a standing clock would hand out the same lease_until twice.
    let zero = |now| ClaimRequest {
        lease: Duration::ZERO,
        ..req("k1", fp(100), now)
    };
    let first = claimed(&store, zero(T0)).await;
    store.fail(&first, T0).await.unwrap();
    let second = claimed(&store, zero(T0)).await;
    assert!(second.lease_until_ms > first.lease_until_ms);
    store.fail(&second, T0).await.unwrap();
    let third = claimed(&store, zero(T0)).await;
    assert!(third.lease_until_ms > second.lease_until_ms);
    assert_lease_lost(store.complete(&first, response(1), T0).await);
    assert_lease_lost(store.complete(&second, response(1), T0).await);
    // An ended lease taken over at the very instant it ends also moves forward.
    let fourth = claimed(&store, zero(third.lease_until_ms)).await;
    assert!(fourth.lease_until_ms > third.lease_until_ms);
    assert_lease_lost(store.complete(&third, response(1), T0).await);
    store.complete(&fourth, response(3), T0).await.unwrap();
}

#[doc(hidden)]
pub async fn succeeded_is_terminal<S: Store>(store: S) {
    let lease = claimed(&store, req("k1", fp(100), T0)).await;
    store.complete(&lease, response(1), T0 + 1).await.unwrap();
    assert_lease_lost(store.complete(&lease, response(2), T0 + 2).await);
    assert_lease_lost(store.fail(&lease, T0 + 2).await);
    assert_lease_lost(store.release(&lease).await);
    // Long after every lease: still a replay, never a takeover.
    assert_eq!(
        store
            .claim(req("k1", fp(100), T0 + 3_600_000))
            .await
            .unwrap(),
        Claim::Replay(response(1))
    );
}

#[doc(hidden)]
pub async fn release_leaves_key_unused<S: Store>(store: S) {
    let lease = claimed(&store, req("k1", fp(100), T0)).await;
    store.release(&lease).await.unwrap();
    assert_eq!(store.get(SCOPE, &key("k1")).await.unwrap(), None);
    // Unused: even other parameters are accepted now.
    let again = claimed(&store, req("k1", fp(999), T0 + 1)).await;
    let rec = store.get(SCOPE, &key("k1")).await.unwrap().expect("record");
    assert_eq!(rec.fingerprint, fp(999));
    assert_eq!(rec.lease_until_ms, again.lease_until_ms);
}

#[doc(hidden)]
pub async fn sweep_removes_expired_but_never_a_live_lease<S: Store>(store: S) {
    let short = |k: &str, ttl_ms: u64, lease_ms: u64| ClaimRequest {
        ttl: Duration::from_millis(ttl_ms),
        lease: Duration::from_millis(lease_ms),
        ..req(k, fp(100), T0)
    };
    // Expire at T0 + 1_000.
    let done = claimed(&store, short("succeeded", 1_000, 100)).await;
    store.complete(&done, response(1), T0 + 10).await.unwrap();
    let failed = claimed(&store, short("failed", 1_000, 100)).await;
    store.fail(&failed, T0 + 10).await.unwrap();
    claimed(&store, short("running-dead", 1_000, 100)).await;
    // Expired, but its runner's lease is live until T0 + 10_000.
    claimed(&store, short("running-live", 1_000, 10_000)).await;
    // Not expired.
    claimed(&store, short("fresh", 1_000_000, 100)).await;

    assert_eq!(store.sweep(T0 + 999, 100).await.unwrap(), 0);
    assert_eq!(store.sweep(T0 + 2_000, 100).await.unwrap(), 3);
    let mut left = HashSet::new();
    for k in [
        "succeeded",
        "failed",
        "running-dead",
        "running-live",
        "fresh",
    ] {
        if store.get(SCOPE, &key(k)).await.unwrap().is_some() {
            left.insert(k);
        }
    }
    assert_eq!(left, HashSet::from(["running-live", "fresh"]));
    // Once that lease has ended, it goes too.
    assert_eq!(store.sweep(T0 + 10_000, 100).await.unwrap(), 1);
    assert!(
        store
            .get(SCOPE, &key("running-live"))
            .await
            .unwrap()
            .is_none()
    );
    // A swept key is unused again.
    claimed(&store, req("succeeded", fp(5), T0 + 20_000)).await;
}

#[doc(hidden)]
pub async fn sweep_respects_limit<S: Store>(store: S) {
    for i in 0..5 {
        let r = ClaimRequest {
            ttl: Duration::from_millis(10),
            ..req(&format!("k{i}"), fp(100), T0)
        };
        let lease = claimed(&store, r).await;
        store.fail(&lease, T0).await.unwrap();
    }
    let now = T0 + TTL_MS;
    assert_eq!(store.sweep(now, 2).await.unwrap(), 2);
    assert_eq!(store.sweep(now, 2).await.unwrap(), 2);
    assert_eq!(store.sweep(now, 2).await.unwrap(), 1);
    assert_eq!(store.sweep(now, 2).await.unwrap(), 0);
}

#[doc(hidden)]
pub async fn outcome_keeps_record_for_ttl_from_completion<S: Store>(store: S) {
    let lease = claimed(&store, req("k1", fp(100), T0)).await;
    // A slow run: completed one hour after the claim.
    let done = T0 + 3_600_000;
    store.complete(&lease, response(1), done).await.unwrap();
    let rec = store.get(SCOPE, &key("k1")).await.unwrap().expect("record");
    assert!(rec.expires_at_ms >= done + TTL_MS, "{rec:?}");
    assert_eq!(store.sweep(T0 + TTL_MS, 100).await.unwrap(), 0);
    assert_eq!(
        store
            .claim(req("k1", fp(100), T0 + TTL_MS + 1))
            .await
            .unwrap(),
        Claim::Replay(response(1))
    );
}

#[doc(hidden)]
pub async fn scopes_isolate_keys<S: Store>(store: S) {
    let a = claimed(&store, req("shared", fp(100), T0)).await;
    let b = claimed(
        &store,
        ClaimRequest {
            scope: "merchant-2".to_owned(),
            ..req("shared", fp(200), T0)
        },
    )
    .await;
    store.complete(&a, response(1), T0 + 1).await.unwrap();
    let rec_b = store
        .get("merchant-2", &key("shared"))
        .await
        .unwrap()
        .expect("record");
    assert_eq!(rec_b.status, RecordStatus::Running);
    assert_eq!(rec_b.fingerprint, fp(200));
    store.complete(&b, response(2), T0 + 2).await.unwrap();
    assert_eq!(
        store.claim(req("shared", fp(100), T0 + 3)).await.unwrap(),
        Claim::Replay(response(1))
    );
}

/// The record a store should hold after a history, by the protocol's rules.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expected {
    status: RecordStatus,
    lease_until_ms: i64,
    expires_at_ms: i64,
    fingerprint: Fingerprint,
    response: Option<StoredResponse>,
}

/// Random histories of one key (claims with either of two parameter sets at random times and
/// lease lengths, completions, failures and releases with current and stale leases, sweeps),
/// each step checked against the protocol's rules, the same functions the model check
/// explores: what the store answers, and the record it keeps.
#[doc(hidden)]
pub async fn follows_the_protocol_on_random_histories<S: Store>(store: S) {
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    use super::protocol::{self, ClaimRule, Existing};

    let mut rng = StdRng::seed_from_u64(0x5eed);
    for history in 0..24 {
        let name = format!("history-{history}");
        let mut expected: Option<Expected> = None;
        let mut leases: Vec<Lease> = Vec::new();
        // Far enough apart that one history's records never expire within another's.
        let mut now = T0 + history * 10 * TTL_MS;
        for step in 0..30 {
            now += rng.random_range(0..4_000);
            let context = format!("{name} step {step} at {now}");
            match rng.random_range(0..10) {
                0..=3 => {
                    let fingerprint = fp(if rng.random_bool(0.15) { 2 } else { 1 });
                    let lease = Duration::from_millis(rng.random_range(1_000..6_000));
                    let ttl = Duration::from_millis(rng.random_range(8_000..30_000));
                    let request = ClaimRequest {
                        lease,
                        ttl,
                        ..req(&name, fingerprint, now)
                    };
                    let existing = expected.as_ref().map(|e| Existing {
                        status: e.status,
                        lease_until_ms: e.lease_until_ms,
                        same_fingerprint: e.fingerprint == fingerprint,
                    });
                    let rule = protocol::claim(existing, now, request.lease_until_ms());
                    let got = store.claim(request.clone()).await.expect("claim");
                    match (rule, &got) {
                        (ClaimRule::Insert { lease_until_ms }, Claim::Claimed(lease)) => {
                            assert_eq!(lease.lease_until_ms, lease_until_ms, "{context}");
                            expected = Some(Expected {
                                status: RecordStatus::Running,
                                lease_until_ms,
                                expires_at_ms: request.expires_at_ms(),
                                fingerprint,
                                response: None,
                            });
                            leases.push(lease.clone());
                        }
                        (ClaimRule::TakeOver { lease_until_ms }, Claim::Claimed(lease)) => {
                            assert_eq!(lease.lease_until_ms, lease_until_ms, "{context}");
                            let e = expected.as_mut().expect("a takeover has a record");
                            e.status = RecordStatus::Running;
                            e.lease_until_ms = lease_until_ms;
                            e.expires_at_ms = e.expires_at_ms.max(request.expires_at_ms());
                            e.response = None;
                            leases.push(lease.clone());
                        }
                        (ClaimRule::Replay, Claim::Replay(stored)) => {
                            let e = expected.as_ref().expect("a replay has a record");
                            assert_eq!(Some(stored), e.response.as_ref(), "{context}");
                        }
                        (ClaimRule::Conflict, Claim::Conflict { .. }) => {}
                        (ClaimRule::InProgress { lease_until_ms }, Claim::InProgress { .. }) => {
                            assert_eq!(got, Claim::in_progress(lease_until_ms, now), "{context}");
                        }
                        (rule, got) => {
                            panic!("{context}: the rules say {rule:?}, the store {got:?}")
                        }
                    }
                }
                4..=7 if !leases.is_empty() => {
                    // Mostly the newest lease; sometimes a stale one.
                    let index = if rng.random_bool(0.7) {
                        leases.len() - 1
                    } else {
                        rng.random_range(0..leases.len())
                    };
                    let lease = leases[index].clone();
                    let held = expected.as_ref().is_some_and(|e| {
                        protocol::holds(e.status, e.lease_until_ms, lease.lease_until_ms)
                    });
                    let ttl_ms = super::store::duration_ms(lease.ttl);
                    let (result, next) = match rng.random_range(0..3) {
                        0 => {
                            let stored = response(step);
                            let result = store.complete(&lease, stored.clone(), now).await;
                            let next = expected.clone().map(|e| Expected {
                                status: RecordStatus::Succeeded,
                                expires_at_ms: e.expires_at_ms.max(now + ttl_ms),
                                response: Some(stored),
                                ..e
                            });
                            (result, next)
                        }
                        1 => {
                            let result = store.fail(&lease, now).await;
                            let next = expected.clone().map(|e| Expected {
                                status: RecordStatus::Failed,
                                expires_at_ms: e.expires_at_ms.max(now + ttl_ms),
                                response: None,
                                ..e
                            });
                            (result, next)
                        }
                        _ => (store.release(&lease).await, None),
                    };
                    if held {
                        result.unwrap_or_else(|e| panic!("{context}: a held lease failed: {e}"));
                        expected = next;
                    } else {
                        assert_lease_lost(result);
                    }
                }
                _ => {
                    store.sweep(now, 1_000).await.expect("sweep");
                    if expected.as_ref().is_some_and(|e| {
                        protocol::sweepable(e.status, e.lease_until_ms, e.expires_at_ms, now)
                    }) {
                        expected = None;
                    }
                }
            }
            let record = store.get(SCOPE, &key(&name)).await.expect("get");
            let actual = record.map(|r| Expected {
                status: r.status,
                lease_until_ms: r.lease_until_ms,
                expires_at_ms: r.expires_at_ms,
                fingerprint: r.fingerprint,
                response: r.response,
            });
            assert_eq!(actual, expected, "{context}");
        }
    }
}
