//! A payment is two durable commits on either store: the claim committed with the intent (the
//! claim's own commit waits for no sync; the intent's phase makes both durable), and the
//! intent's outcome committed with the stored answer. Counted at low concurrency (sequential
//! payments): SQLite's writer counts its synced transactions; PostgreSQL counts its WAL
//! flushes (`pg_stat_wal.wal_sync`, the whole cluster, read once this binary's connections are
//! gone). The PostgreSQL test is the only one in this binary that talks to PostgreSQL.

#[path = "../../backstop/tests/support/postgres_schema.rs"]
mod postgres_schema;
#[path = "../../backstop/tests/support/services.rs"]
mod services;
mod support;

use std::time::Duration;

use backstop::db::postgres::tokio_postgres;
use backstop_payment::config::{Config, PspTarget, StoreLocation};
use backstop_payment::server::Server;
use postgres_schema::Schema;
use reqwest::StatusCode;
use support::{Harness, body};

/// Sequential payments per measurement.
const N: u64 = 40;

async fn pay(h: &Harness, round: &str, i: u64) {
    let answer = h
        .post(
            Some(&format!("{round}-key-{i}")),
            &body(&format!("{round}-order-{i}"), 100),
            &[],
        )
        .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_is_two_synced_commits_on_sqlite() {
    let h = Harness::start().await;
    let db = h.server.intents().db().expect("SQLite").clone();
    pay(&h, "warm", 0).await;

    let before = db.stats();
    for i in 0..N {
        pay(&h, "measured", i).await;
    }
    let after = db.stats();
    let synced = after.synced - before.synced;
    let transactions = after.transactions - before.transactions;
    eprintln!("SQLite, {N} payments: {synced} synced commits, {transactions} transactions");
    // The claim, the intent's phase and the completion are three transactions; only the last
    // two wait for a sync (the phase's sync makes the claim durable too). Background work (the
    // sweeper, the resolver) finds nothing to write here.
    assert!(
        synced <= 2 * N,
        "{synced} synced commits for {N} payments (two each at most)"
    );
    assert!(
        synced >= 2 * N,
        "{synced} synced commits for {N} payments: each payment's phase and completion sync"
    );
    assert!(
        transactions <= 3 * N,
        "{transactions} writer transactions for {N} payments"
    );
    assert_eq!(h.intent_count().await, N + 1);
}

/// `pg_stat_wal.wal_sync` once every backend of this binary but `admin`'s own has exited
/// (a backend reports its WAL statistics at the latest when it exits).
async fn wal_syncs(admin: &tokio_postgres::Client) -> i64 {
    let others = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' \
                  AND pid <> pg_backend_pid()";
    for _ in 0..600 {
        let row = admin.query_one(others, &[]).await.expect("activity");
        if row.get::<_, i64>(0) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    admin
        .query_one("SELECT pg_stat_clear_snapshot()", &[])
        .await
        .expect("fresh statistics");
    admin
        .query_one("SELECT wal_sync FROM pg_stat_wal", &[])
        .await
        .expect("pg_stat_wal")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_is_two_wal_flushes_on_postgres() {
    if !services::postgres() {
        return;
    }
    let schema = Schema::create("commits").await;
    let store = StoreLocation::parse(&schema.store_url(None)).expect("store URL");
    let config = {
        let store = store.clone();
        move |c: &mut Config| c.store = store
    };
    // A first server migrates the schema and makes one payment, then goes: what it did is
    // reported before the measurement starts.
    let h = Harness::start_with(config).await;
    pay(&h, "warm", 0).await;
    let Harness {
        psp,
        server,
        http,
        dir,
        ..
    } = h;
    server.shutdown().await.expect("first server stops");
    let admin = postgres_schema::admin().await;
    let before = wal_syncs(&admin).await;

    let mut c = Config::new(store);
    c.http = "127.0.0.1:0".parse().unwrap();
    c.grpc = "127.0.0.1:0".parse().unwrap();
    c.psp = PspTarget::Url(psp.url());
    c.psp_margin_floor = Duration::from_millis(300);
    let server = Server::bind(c).await.expect("starts").spawn();
    let h = Harness {
        base: server.url(),
        psp,
        server,
        http,
        dir,
    };
    for i in 0..N {
        pay(&h, "measured", i).await;
    }
    let Harness { server, .. } = h;
    server.shutdown().await.expect("measured server stops");
    let after = wal_syncs(&admin).await;
    let flushes = after - before;
    eprintln!("PostgreSQL, {N} payments: {flushes} WAL flushes");
    // Two per payment (the phase's commit, the completion's); the claim commits without
    // waiting, and PostgreSQL's own processes (WAL writer, checkpointer, autovacuum) and the
    // server's start may add a few: one more synced commit per payment would add N.
    assert!(
        flushes <= (2 * N + N / 4) as i64,
        "{flushes} WAL flushes for {N} payments"
    );
    assert!(
        flushes >= N as i64,
        "{flushes} WAL flushes for {N} payments: the statistics did not arrive"
    );
}
