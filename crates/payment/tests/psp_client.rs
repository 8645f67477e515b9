//! The PSP client against the real simulator: effect key, child deadline, trace, retries.

use std::time::Duration;

use backstop::deadline::Deadline;
use backstop::retry::{RetryBudget, StopReason};
use backstop_payment::psp::{self, Fault, PspConfig, PspHandle};
use backstop_payment::psp_client::{ChargeCall, ChargeError, PspClient, psp_reference};
use backstop_payment::service::trace;

const MARGIN: Duration = Duration::from_millis(20);
const MERCHANT: &str = "acme";

async fn setup() -> (PspHandle, PspClient) {
    setup_with(MARGIN).await
}

async fn setup_with(margin: Duration) -> (PspHandle, PspClient) {
    let psp = psp::spawn(PspConfig::default()).await.unwrap();
    let client = PspClient::new(&psp.url(), RetryBudget::new(0.1, 20).unwrap(), margin).unwrap();
    (psp, client)
}

fn call(key: &str, order: &str, budget: Duration) -> ChargeCall {
    ChargeCall {
        effect_key: key.into(),
        merchant_id: MERCHANT.into(),
        order_id: order.into(),
        amount_cents: 250,
        currency: "EUR".into(),
        deadline: Deadline::after(budget),
        trace: trace::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").unwrap(),
    }
}

async fn charges(psp: &PspHandle, order: &str) -> Vec<psp::Charge> {
    psp.store()
        .list(Some(psp_reference(MERCHANT, order)))
        .await
        .unwrap()
}

#[tokio::test]
async fn charge_carries_effect_key_child_budget_and_trace() {
    let (psp, client) = setup().await;
    let charge = client
        .charge(&call("intent-1", "o-1", Duration::from_secs(2)))
        .await
        .unwrap();
    let stored = charges(&psp, "o-1").await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0], charge);
    assert_eq!(charge.effect_key, "intent-1");
    assert_eq!(charge.amount_cents, 250);
    assert_eq!(charge.currency, "EUR");
    let budget = charge.budget_ms.unwrap();
    assert!(
        budget <= 2000 - MARGIN.as_millis() as i64,
        "budget {budget} ms"
    );
    let tp = trace::parse(charge.traceparent.as_deref().unwrap()).unwrap();
    assert_eq!(
        tp.trace_id().to_string(),
        "0af7651916cd43dd8448eb211c80319c"
    );
    assert_ne!(tp.span_id().to_string(), "b7ad6b7169203331");
}

#[tokio::test]
async fn one_effect_key_charges_once() {
    let (psp, client) = setup().await;
    let a = client
        .charge(&call("intent-2", "o-2", Duration::from_secs(2)))
        .await
        .unwrap();
    let b = client
        .charge(&call("intent-2", "o-2", Duration::from_secs(2)))
        .await
        .unwrap();
    assert_eq!(a.charge_id, b.charge_id);
    assert_eq!(charges(&psp, "o-2").await.len(), 1);
}

#[tokio::test]
async fn failures_that_charged_nothing_are_retried() {
    let (psp, client) = setup().await;
    psp.faults().script([Fault::Error]).unwrap();
    client
        .charge(&call("intent-3", "o-3", Duration::from_secs(2)))
        .await
        .unwrap();
    // 503 + Retry-After: 1 is honoured when the deadline leaves room for it.
    psp.faults().script([Fault::Unavailable]).unwrap();
    client
        .charge(&call("intent-4", "o-4", Duration::from_secs(3)))
        .await
        .unwrap();
    assert_eq!(charges(&psp, "o-3").await.len(), 1);
    assert_eq!(charges(&psp, "o-4").await.len(), 1);
}

#[tokio::test]
async fn pushback_beyond_the_deadline_stops_and_says_nothing_was_charged() {
    let (psp, client) = setup().await;
    psp.faults().script([Fault::Unavailable]).unwrap();
    let err = client
        .charge(&call("intent-5", "o-5", Duration::from_millis(500)))
        .await
        .unwrap_err();
    // The PSP's 503 charges nothing: the outcome is known, and when to come back is said.
    assert_eq!(err.retry_after(), Duration::from_secs(1));
    let ChargeError::NotCharged { tried, source } = err else {
        panic!("expected not charged, got {err:?}");
    };
    assert!(tried);
    assert_eq!(source.reason, StopReason::Pushback);
    assert_eq!(source.attempts, 1);
    assert!(charges(&psp, "o-5").await.is_empty());
}

#[tokio::test]
async fn refused_connections_charge_nothing_and_are_not_unknown() {
    // Nothing listens on the port the PSP had.
    let (psp, client) = setup().await;
    psp.shutdown().await;
    let err = client
        .charge(&call("intent-10", "o-10", Duration::from_millis(500)))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ChargeError::NotCharged { tried: true, .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn dropped_connection_after_commit_is_retried_with_the_same_effect_key() {
    let (psp, client) = setup().await;
    psp.faults().script([Fault::CommitThenDrop]).unwrap();
    let charge = client
        .charge(&call("intent-6", "o-6", Duration::from_secs(2)))
        .await
        .unwrap();
    assert_eq!(charges(&psp, "o-6").await, vec![charge]);
}

#[tokio::test]
async fn commit_then_timeout_is_unknown_and_never_waits_past_the_deadline() {
    // A wide margin: the client gives up 300 ms before the request deadline.
    let (psp, client) = setup_with(Duration::from_millis(300)).await;
    psp.faults().script([Fault::CommitThenTimeout]).unwrap();
    let deadline = Deadline::after(Duration::from_millis(700));
    let mut c = call("intent-7", "o-7", Duration::ZERO);
    c.deadline = deadline;
    let err = client.charge(&c).await.unwrap_err();
    assert!(matches!(err, ChargeError::Unknown(_)), "{err:?}");
    assert!(
        !deadline.expired(),
        "the client returned within the request deadline"
    );
    // It did charge: that is why the outcome is "unknown", not "failed".
    assert_eq!(charges(&psp, "o-7").await.len(), 1);
}

#[tokio::test]
async fn no_budget_left_means_no_call() {
    let (psp, client) = setup().await;
    let err = client
        .charge(&call("intent-8", "o-8", Duration::from_millis(10)))
        .await
        .unwrap_err();
    assert!(matches!(err, ChargeError::NoBudget(_)), "{err:?}");
    assert_eq!(psp.store().count().await.unwrap(), 0);
}

#[tokio::test]
async fn find_charge_looks_up_the_effect_key() {
    let (_psp, client) = setup().await;
    let charge = client
        .charge(&call("intent-9", "o-9", Duration::from_secs(2)))
        .await
        .unwrap();
    let found = client
        .find_charge(
            MERCHANT,
            "o-9",
            "intent-9",
            Deadline::after(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    assert_eq!(found, Some(charge));
    let missing = client
        .find_charge(
            MERCHANT,
            "o-9",
            "other",
            Deadline::after(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    assert_eq!(missing, None);
    assert!(client.probe_rtt(Duration::from_secs(1)).await.is_ok());
    assert!(client.margin() >= MARGIN);
}
