//! The payment service on PostgreSQL (127.0.0.1:5432, database `test`, or
//! `BACKSTOP_TEST_POSTGRES`), each test in a schema of its own: the same contract as on SQLite,
//! several instances sharing the tables, and PostgreSQL going away and coming back. Skipped,
//! saying so, when PostgreSQL does not answer.

mod support;
// One TCP proxy for every crate's outage tests: the library's test copy.
#[path = "../../backstop/tests/support/tcp_proxy.rs"]
mod tcp_proxy;
// The per-test PostgreSQL schema and the check that the server answers, shared with the
// library's and the CLI's tests.
#[path = "../../backstop/tests/support/postgres_schema.rs"]
mod postgres_schema;
#[path = "../../backstop/tests/support/services.rs"]
mod services;

use backstop_payment::config::{Config, PspTarget, StoreLocation};
use backstop_payment::server::Server;
use postgres_schema::Schema;
use reqwest::StatusCode;
use support::{Harness, body};
use tcp_proxy::{Mode, TcpProxy};

/// The store for `schema`, reached directly or through 127.0.0.1:`port` (a proxy's).
fn location(schema: &Schema, port: Option<u16>) -> StoreLocation {
    StoreLocation::parse(&schema.store_url(port)).expect("store URL")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payments_on_postgres_charge_once_and_replay() {
    if !services::postgres() {
        return;
    }
    let schema = Schema::create("payment").await;
    let store = location(&schema, None);
    let h = Harness::start_with(move |c| c.store = store).await;

    let first = h.post(Some("key-1"), &body("order-1", 1000), &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.json);
    let again = h.post(Some("key-1"), &body("order-1", 1000), &[]).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.bytes, first.bytes);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));

    let other_key = h.post(Some("key-2"), &body("order-1", 1000), &[]).await;
    assert_eq!(other_key.status, StatusCode::CONFLICT);
    assert_eq!(other_key.code(), "order_conflict");
    let reused = h.post(Some("key-1"), &body("order-1", 5), &[]).await;
    assert_eq!(reused.code(), "idempotency_key_reused");

    // The same new key sent concurrently: one intent, one charge.
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (http, base) = (h.http.clone(), h.base.clone());
            tokio::spawn(async move {
                http.post(format!("{base}/v1/payments"))
                    .header("content-type", "application/json")
                    .header("idempotency-key", "key-3")
                    .body(body("order-3", 300))
                    .send()
                    .await
                    .expect("sent")
                    .status()
            })
        })
        .collect();
    for t in tasks {
        let status = t.await.unwrap();
        assert!(
            status == StatusCode::CREATED || status == StatusCode::CONFLICT,
            "{status}"
        );
    }
    assert_eq!(h.charges("order-3").await.len(), 1);
    assert_eq!(h.intent_count().await, 2);
    assert_eq!(schema.count("payment_intent").await, 2);
    assert_eq!(schema.count("idempotency_key").await, 2);
    let ready = h.get("/readyz", &[]).await;
    assert_eq!(ready.status, StatusCode::OK);
}

/// Two instances starting at once on one schema migrate it once and share its records: a
/// payment made through one is replayed by the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_share_the_tables() {
    if !services::postgres() {
        return;
    }
    let schema = Schema::create("payment").await;
    let h = Harness::start_with({
        let store = location(&schema, None);
        move |c| c.store = store
    })
    .await;
    let config = |store| {
        let mut c = Config::new(store);
        c.http = "127.0.0.1:0".parse().unwrap();
        c.grpc = "127.0.0.1:0".parse().unwrap();
        c.psp = PspTarget::Url(h.psp.url());
        c
    };
    let (a, b) = tokio::join!(
        Server::bind(config(location(&schema, None))),
        Server::bind(config(location(&schema, None)))
    );
    let (a, b) = (a.expect("a starts").spawn(), b.expect("b starts").spawn());
    let migrations = schema.count("backstop_migration").await;
    assert_eq!(
        migrations, 2,
        "idempotency_key and payment_intent, once each"
    );

    let post = |base: String| {
        let http = h.http.clone();
        async move {
            http.post(format!("{base}/v1/payments"))
                .header("content-type", "application/json")
                .header("idempotency-key", "shared-key")
                .body(body("order-shared", 700))
                .send()
                .await
                .expect("sent")
        }
    };
    let first = post(a.url()).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first = first.bytes().await.unwrap();
    let second = post(b.url()).await;
    assert_eq!(second.status(), StatusCode::CREATED);
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(second.bytes().await.unwrap(), first);
    assert_eq!(h.charges("order-shared").await.len(), 1);
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// PostgreSQL down: new requests get 503 + Retry-After, `/readyz` fails, nothing is half
/// written; once it is back the service answers again by itself and the same key goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_down_is_503_and_not_ready_then_recovers() {
    if !services::postgres() {
        return;
    }
    let schema = Schema::create("payment").await;
    let upstream = tokio::net::lookup_host(("127.0.0.1", schema.config().get_ports()[0]))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = TcpProxy::start(upstream).await;
    let store = location(&schema, Some(proxy.port()));
    let h = Harness::start_with(move |c| c.store = store).await;
    let before = h
        .post(Some("before"), &body("order-before", 100), &[])
        .await;
    assert_eq!(before.status, StatusCode::CREATED);

    for (round, mode) in [Mode::Down, Mode::Silent].into_iter().enumerate() {
        proxy.set(mode).await;
        let key = format!("during-{round}");
        let order = format!("order-during-{round}");
        let during = h
            .post(Some(&key), &body(&order, 200), &[("grpc-timeout", "1S")])
            .await;
        match mode {
            Mode::Down => {
                assert_eq!(
                    during.status,
                    StatusCode::SERVICE_UNAVAILABLE,
                    "{:?}",
                    during.json
                );
                assert_eq!(during.code(), "store_unavailable");
                assert!(during.header("retry-after").is_some());
            }
            // A silent database is given up on just before the deadline: 503, or the
            // deadline's 504 if the answer is slower than the margin. Never a 500.
            _ => assert!(
                during.status == StatusCode::SERVICE_UNAVAILABLE
                    || during.status == StatusCode::GATEWAY_TIMEOUT,
                "{:?}",
                during.json
            ),
        }
        let ready = h.get("/readyz", &[]).await;
        assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(h.charges(&order).await.is_empty(), "nothing charged");

        proxy.set(Mode::Forward).await;
        let mut ready = false;
        for _ in 0..100 {
            if h.get("/readyz", &[]).await.status == StatusCode::OK {
                ready = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(ready, "the service must become ready again after {mode:?}");
        // Down: nothing reached the database, so the same key simply runs. (Silent: a
        // statement cut mid-flight has an unknown outcome; a claim it left ends with its lease.)
        if mode == Mode::Down {
            let after = h.post(Some(&key), &body(&order, 200), &[]).await;
            assert_eq!(after.status, StatusCode::CREATED, "{:?}", after.json);
            assert_eq!(h.charges(&order).await.len(), 1);
        }
    }
    let after = h.post(Some("after"), &body("order-after", 300), &[]).await;
    assert_eq!(after.status, StatusCode::CREATED, "{:?}", after.json);
    assert_eq!(schema.count("payment_intent").await, 3);
}

/// Finding one intent by its id reads the primary key, however many intents the merchant has.
/// Every other index of `payment_intent` leads with `merchant_id` (or is partial on `status`);
/// a prepared statement's generic plan, fixed on a near-empty table after its first five runs,
/// picked one of them and read every intent of the merchant on each `get` and `mark`: cost
/// growing with the table. Counted from PostgreSQL's own index statistics, not timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intent_lookups_by_id_read_the_primary_key_not_the_merchants_intents() {
    use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
    use backstop_payment::intents::{Intents, NewIntent};

    if !services::postgres() {
        return;
    }
    const N: i64 = 300;
    let schema = Schema::create("intent_plan").await;
    // One connection: every statement runs in the one session whose plans are cached.
    let options = PostgresOptions {
        max_connections: 1,
        ..PostgresOptions::default()
    };
    let store = PostgresStore::connect(&schema.store_url(None), options)
        .await
        .expect("store");
    let intents = Intents::postgres(store.pool().clone(), store.timeout())
        .await
        .expect("intents");
    for i in 0..N {
        let id = format!("intent-{i:05}");
        let new = NewIntent {
            intent_id: id.clone(),
            merchant_id: "m".into(),
            order_id: format!("order-{i}"),
            amount_cents: 100,
            currency: "USD".into(),
            request_key: format!("key-{i}"),
            fingerprint: "f".into(),
            created_at: 1_700_000_000_000 + i,
        };
        intents.create(new).await.expect("create");
        assert!(
            intents
                .settle("m", &id, Some("ch"))
                .await
                .expect("settle")
                .is_some()
        );
        assert!(intents.get("m", &id).await.expect("get").is_some());
    }
    drop(intents);

    // A backend reports its statistics within seconds of going idle (or on exit): wait until
    // every insert's uniqueness probe of the request-key index shows (bounded), then read the
    // primary key's scans and the tuples read through every other index.
    let admin = postgres_schema::admin().await;
    let query = "SELECT \
        coalesce(sum(idx_scan) FILTER (WHERE indexrelname LIKE '%request_key%'), 0)::bigint, \
        coalesce(sum(idx_scan) FILTER (WHERE indexrelname = 'payment_intent_pkey'), 0)::bigint, \
        coalesce(sum(idx_tup_read) FILTER (WHERE indexrelname <> 'payment_intent_pkey'), 0)::bigint \
        FROM pg_stat_user_indexes WHERE schemaname = $1 AND relname = 'payment_intent'";
    let mut seen = (0i64, 0i64, 0i64);
    for _ in 0..300 {
        let row = admin
            .query_one(query, &[&schema.name()])
            .await
            .expect("index statistics");
        seen = (row.get(0), row.get(1), row.get(2));
        if seen.0 >= N {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let (inserts, by_id, elsewhere) = seen;
    assert!(inserts >= N, "statistics never arrived: {seen:?}");
    assert!(
        by_id >= 2 * N,
        "{by_id} primary key scans for {N} marks and gets"
    );
    // The other indexes are only probed for uniqueness on insert, which reads no tuple; a
    // merchant-wide scan per lookup reads about N*N/2.
    assert!(
        elsewhere < N,
        "{elsewhere} index tuples read outside the primary key for {N} intents"
    );
}
