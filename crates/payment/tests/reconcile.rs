//! Reconciliation against a real PSP simulator and a real payment service, on SQLite and on
//! PostgreSQL (a schema of its own per test): history with duplicates written around the
//! service is found, refunded once, recorded, and then a unique index on the live order can
//! be built. The PostgreSQL test is skipped, saying so, when PostgreSQL does not answer.

// The per-test PostgreSQL schema and the check that the server answers, shared with the
// library's and the CLI's tests.
#[path = "../../backstop/tests/support/postgres_schema.rs"]
mod postgres_schema;
#[path = "../../backstop/tests/support/services.rs"]
mod services;
mod support;

use backstop_payment::config::{DEFAULT_MERCHANT, StoreLocation};
use backstop_payment::intents::IntentStatus;
use backstop_payment::psp::Charge;
use backstop_payment::psp::store::{ChargeOutcome, NewCharge};
use backstop_payment::reconcile::{
    ActionKind, Fix, Kind, Ledger, OrderRef, Outcome, PspApi, Reconciler, Scope,
};
use postgres_schema::Schema;
use reqwest::StatusCode;
use support::{Harness, body};

/// The unique index the service relies on; the seeded history cannot have it.
const LIVE_ORDER_INDEX: &str = "CREATE UNIQUE INDEX idx_live_order ON payment_intent \
     (merchant_id, order_id) WHERE status <> 'failed'";

/// Where the payment store is, and a way to run SQL on it around the service.
enum Store {
    Sqlite,
    Postgres(Schema),
}

impl Store {
    async fn exec(&self, h: &Harness, sql: &str) -> Result<(), String> {
        match self {
            Store::Sqlite => {
                let sql = sql.to_owned();
                h.server
                    .intents()
                    .db()
                    .expect("SQLite")
                    .write(move |c| c.execute_batch(&sql))
                    .await
                    .map_err(|e| format!("{e:?}"))
            }
            Store::Postgres(schema) => postgres_schema::admin()
                .await
                .batch_execute(&format!("SET search_path TO {}; {sql}", schema.name()))
                .await
                .map_err(|e| format!("{e:?}")),
        }
    }

    fn location(&self, h: &Harness) -> StoreLocation {
        match self {
            Store::Sqlite => StoreLocation::Sqlite(h.dir.path().join("pay.db")),
            Store::Postgres(schema) => {
                StoreLocation::parse(&schema.store_url(None)).expect("store URL")
            }
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// An intent written straight into the table, as history from before the constraints (or a
/// bug) would have left it.
fn intent_sql(id: &str, order: &str, status: &str, charge: Option<&str>, at: i64) -> String {
    let charge = charge.map_or("NULL".to_owned(), |c| format!("'{c}'"));
    format!(
        "INSERT INTO payment_intent (intent_id, merchant_id, order_id, amount_cents, \
         request_key, fingerprint, effect_key, status, psp_charge_id, created_at, currency) \
         VALUES ('{id}', '{DEFAULT_MERCHANT}', '{order}', 1000, 'key-{id}', 'f', '{id}', \
         '{status}', {charge}, {at}, 'USD');"
    )
}

/// A charge made at the PSP directly, not through the service.
async fn direct_charge(h: &Harness, effect_key: &str, order: &str) -> Charge {
    let outcome = h
        .psp
        .store()
        .charge(NewCharge {
            effect_key: effect_key.to_owned(),
            reference: format!("{DEFAULT_MERCHANT}:{order}"),
            amount_cents: 1000,
            currency: "USD".to_owned(),
            budget_ms: None,
            traceparent: None,
        })
        .await
        .expect("psp store");
    match outcome {
        ChargeOutcome::Created(charge) => charge,
        other => panic!("direct charge not created: {other:?}"),
    }
}

async fn pay(h: &Harness, key: &str, order: &str) {
    let answer = h.post(Some(key), &body(order, 1000), &[]).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.json);
}

fn window() -> Scope {
    let now = now_ms();
    Scope::Window {
        since_ms: now - 3_600_000,
        until_ms: now + 3_600_000,
    }
}

/// Seeds the history, shows the index cannot be built, reconciles, and shows it can.
async fn duplicates_are_refunded_once_and_the_index_can_be_built(h: Harness, store: Store) {
    // Through the service: three orders paid once each.
    for (key, order) in [
        ("k-ok", "o-ok"),
        ("k-dup", "o-dup"),
        ("k-direct", "o-direct"),
    ] {
        pay(&h, key, order).await;
    }
    // Around it: the table as it was before the live-order index, a second intent for o-dup
    // whose charge went through, a charge for o-direct made at the PSP with another effect
    // key, and an intent left running whose charge went through.
    store
        .exec(&h, "DROP INDEX idx_live_order")
        .await
        .expect("drop index");
    let dup = direct_charge(&h, "dup-intent", "o-dup").await;
    let later = now_ms() + 1;
    store
        .exec(
            &h,
            &intent_sql(
                "dup-intent",
                "o-dup",
                "succeeded",
                Some(&dup.charge_id),
                later,
            ),
        )
        .await
        .expect("second intent for o-dup");
    let direct = direct_charge(&h, "manual-charge-1", "o-direct").await;
    let orphan = direct_charge(&h, "run-intent", "o-orphan").await;
    store
        .exec(
            &h,
            &intent_sql("run-intent", "o-orphan", "running", None, later),
        )
        .await
        .expect("running intent");
    let refused = store.exec(&h, LIVE_ORDER_INDEX).await;
    assert!(refused.is_err(), "the index was built over duplicates");

    let ledger = Ledger::open(&store.location(&h)).await.expect("ledger");
    let reconciler = Reconciler::new(ledger, PspApi::new(&h.psp.url()).expect("psp url"));

    // The scan finds the three, and changes nothing.
    let scan = reconciler.scan(&window(), &|_| {}).await.expect("scan");
    let mut found: Vec<(Kind, Option<String>)> = scan
        .findings
        .iter()
        .map(|f| (f.kind, f.charge_id.clone()))
        .collect();
    found.sort();
    let mut expected = vec![
        (Kind::DuplicateCharge, Some(dup.charge_id.clone())),
        (Kind::DuplicateCharge, Some(direct.charge_id.clone())),
        (Kind::OrphanIntent, Some(orphan.charge_id.clone())),
    ];
    expected.sort();
    assert_eq!(found, expected, "{:#?}", scan.findings);
    assert!(scan.findings.iter().all(|f| f.fix.is_some()));
    assert_eq!(scan.charges, 6);
    assert!(h.charges("o-dup").await.iter().all(Charge::is_live));
    assert!(reconciler.ledger().records().await.unwrap().is_empty());
    // A second operator's plan, made from the same state before anything was applied.
    let concurrent = reconciler.scan(&window(), &|_| {}).await.expect("scan");
    assert_eq!(concurrent.findings, scan.findings);

    // Apply: two refunds, one intent settled, three records.
    let outcomes = reconciler.apply(&scan.findings, "alice", now_ms()).await;
    assert_eq!(outcomes.len(), 3);
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Applied { recorded: true, .. })),
        "{outcomes:#?}"
    );
    let refunded = |charges: Vec<Charge>| {
        let mut v: Vec<(String, bool)> = charges
            .into_iter()
            .map(|c| (c.effect_key.clone(), c.is_live()))
            .collect();
        v.sort();
        v
    };
    let o_dup = h.charges("o-dup").await;
    assert_eq!(o_dup.iter().filter(|c| c.is_live()).count(), 1);
    assert!(
        !o_dup
            .iter()
            .find(|c| c.charge_id == dup.charge_id)
            .unwrap()
            .is_live()
    );
    assert_eq!(
        refunded(h.charges("o-direct").await)
            .into_iter()
            .find(|(key, _)| key == "manual-charge-1"),
        Some(("manual-charge-1".to_owned(), false))
    );
    assert!(h.charges("o-ok").await[0].is_live());
    let intents = reconciler.ledger().intents();
    let released = intents
        .get(DEFAULT_MERCHANT, "dup-intent")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(released.status, IntentStatus::Failed);
    assert_eq!(
        released.psp_charge_id.as_deref(),
        Some(dup.charge_id.as_str())
    );
    let settled = intents
        .get(DEFAULT_MERCHANT, "run-intent")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(settled.status, IntentStatus::Succeeded);
    assert_eq!(
        settled.psp_charge_id.as_deref(),
        Some(orphan.charge_id.as_str())
    );
    let records = reconciler.ledger().records().await.unwrap();
    assert_eq!(records.len(), 3);
    assert!(records.iter().all(|r| r.operator == "alice"));
    let dup_record = records
        .iter()
        .find(|r| r.charge_id == dup.charge_id)
        .unwrap();
    assert_eq!(dup_record.kind, ActionKind::RefundDuplicate);
    assert_eq!(dup_record.intent_id.as_deref(), Some("dup-intent"));
    assert!(dup_record.refund_id.as_deref().unwrap().starts_with("re_"));
    let direct_record = records
        .iter()
        .find(|r| r.charge_id == direct.charge_id)
        .unwrap();
    assert_eq!(direct_record.intent_id, None);

    // A second run finds nothing; the second operator's plan, applied after the first,
    // refunds nothing more (same refund keys: the PSP replays) and records nothing twice.
    let again = reconciler.scan(&window(), &|_| {}).await.unwrap();
    assert!(again.findings.is_empty(), "{:#?}", again.findings);
    assert!(
        reconciler
            .apply(&again.findings, "alice", now_ms())
            .await
            .is_empty()
    );
    let replayed = reconciler
        .apply(&concurrent.findings, "bob", now_ms())
        .await;
    for outcome in &replayed {
        match outcome {
            Outcome::Applied { record, recorded } => {
                assert!(!recorded, "{record:?}");
                if let Some(refund) = &record.refund_id {
                    let first = records.iter().find(|r| r.charge_id == record.charge_id);
                    assert_eq!(first.unwrap().refund_id.as_ref(), Some(refund));
                }
            }
            Outcome::Skipped { .. } => {}
            Outcome::Failed { error, .. } => panic!("{error}"),
        }
    }
    assert_eq!(reconciler.ledger().records().await.unwrap().len(), 3);
    assert_eq!(
        h.charges("o-dup")
            .await
            .iter()
            .map(|c| c.amount_refunded_cents)
            .sum::<i64>(),
        1000
    );

    // The history is clean: the index builds.
    store
        .exec(&h, LIVE_ORDER_INDEX)
        .await
        .expect("the index builds once duplicates are released");

    // The order list finds the same orders clean.
    let orders = ["o-ok", "o-dup", "o-direct", "o-orphan"]
        .map(|o| OrderRef::parse(&format!("{DEFAULT_MERCHANT}:{o}")).unwrap())
        .to_vec();
    let by_order = reconciler
        .scan(&Scope::Orders(orders), &|_| {})
        .await
        .unwrap();
    assert_eq!(by_order.orders, 4);
    assert!(by_order.findings.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_duplicates_are_refunded_once_and_the_index_can_be_built() {
    let h = Harness::start().await;
    duplicates_are_refunded_once_and_the_index_can_be_built(h, Store::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_duplicates_are_refunded_once_and_the_index_can_be_built() {
    if !services::postgres() {
        return;
    }
    let schema = Schema::create("reconcile").await;
    let location = StoreLocation::parse(&schema.store_url(None)).unwrap();
    let h = Harness::start_with(move |c| c.store = location).await;
    duplicates_are_refunded_once_and_the_index_can_be_built(h, Store::Postgres(schema)).await;
}

/// What reconciliation cannot fix safely is reported with no fix, and --apply leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphan_charges_missing_charges_and_mismatches_are_left_to_a_person() {
    let h = Harness::start().await;
    let store = Store::Sqlite;
    let now = now_ms();
    let stray = direct_charge(&h, "nobody", "o-stray").await;
    store
        .exec(
            &h,
            &intent_sql("ghost", "o-ghost", "succeeded", Some("ch_ghost"), now),
        )
        .await
        .unwrap();
    let cheap = h
        .psp
        .store()
        .charge(NewCharge {
            effect_key: "cheap".to_owned(),
            reference: format!("{DEFAULT_MERCHANT}:o-cheap"),
            amount_cents: 999,
            currency: "EUR".to_owned(),
            budget_ms: None,
            traceparent: None,
        })
        .await
        .unwrap();
    let ChargeOutcome::Created(cheap) = cheap else {
        panic!("not charged");
    };
    store
        .exec(
            &h,
            &intent_sql("cheap", "o-cheap", "succeeded", Some(&cheap.charge_id), now),
        )
        .await
        .unwrap();

    let ledger = Ledger::open(&store.location(&h)).await.unwrap();
    let reconciler = Reconciler::new(ledger, PspApi::new(&h.psp.url()).unwrap());
    let scan = reconciler.scan(&window(), &|_| {}).await.unwrap();
    let mut kinds: Vec<Kind> = scan.findings.iter().map(|f| f.kind).collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            Kind::OrphanCharge,
            Kind::MissingCharge,
            Kind::AmountMismatch,
            Kind::CurrencyMismatch
        ]
    );
    assert!(scan.findings.iter().all(|f| f.fix.is_none()));
    assert!(
        reconciler
            .apply(&scan.findings, "alice", now)
            .await
            .is_empty()
    );
    assert!(h.charges("o-stray").await[0].is_live());
    assert_eq!(stray.amount_refunded_cents, 0);
    assert!(
        !scan
            .findings
            .iter()
            .any(|f| matches!(f.fix, Some(Fix::Refund { .. })))
    );
}

#[tokio::test]
async fn a_missing_sqlite_store_is_refused_not_created() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope.db");
    let error = Ledger::open(&StoreLocation::Sqlite(path.clone()))
        .await
        .unwrap_err();
    assert!(error.to_string().contains("no payment store"), "{error}");
    assert!(!path.exists());
}
