//! The idempotency store's SQL, apart from the writer that sends it.
//!
//! Records live in `idempotency_record`, partitioned by TTL class and time window (see
//! `windows.rs`). Each decision is one statement, correct under READ COMMITTED with any number
//! of instances (see the parent module). The `*_MANY_SQL` variants run the same decision for
//! many records at once: a batch sends claims of distinct keys as one statement over arrays
//! (`unnest ... WITH ORDINALITY`), completions as another, and so on.

/// The claim (`backstop_idempotency_claim`, migration v3): under the key's advisory lock, the
/// record wherever it is, then an insert into the current window or a takeover that moves the
/// record there; when neither happened, the record as it stood. `$1..$8`: scope, key,
/// fingerprint, lease_until, now, expires_at, class_ms, width_ms; `$9` the clock offset; `$10`
/// the windows not to read (sealed, and ruled out for the key by this instance's summaries).
///
/// Returns `taken, lease_until, fingerprint, status, http_status, response_body,
/// response_headers, created_at, phase, phase_data, need_window, placed_win`. A taken row's status is the
/// record's before the takeover, read under its row lock (none for an insert).
pub(super) const CLAIM_SQL: &str =
    "SELECT * FROM backstop_idempotency_claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

/// Records a phase's recovery point, if the lease still holds the record.
pub(super) const PHASE_SQL: &str = "\
UPDATE idempotency_record SET phase = $4, phase_data = $5 \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3 \
  AND class_ms = $6 AND win BETWEEN $7 AND $8";

/// Store the response, if the lease (fencing token) still holds the record.
pub(super) const COMPLETE_SQL: &str = "\
UPDATE idempotency_record SET status = 'succeeded', http_status = $4, response_body = $5, \
  response_headers = $6, expires_at = GREATEST(expires_at, $7) \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3 \
  AND class_ms = $8 AND win BETWEEN $9 AND $10";

/// Mark failed, if the lease still holds the record.
pub(super) const FAIL_SQL: &str = "\
UPDATE idempotency_record SET status = 'failed', expires_at = GREATEST(expires_at, $4) \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3 \
  AND class_ms = $5 AND win BETWEEN $6 AND $7";

/// Forget the key, if the lease still holds the record.
pub(super) const RELEASE_SQL: &str = "\
DELETE FROM idempotency_record \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3 \
  AND class_ms = $4 AND win BETWEEN $5 AND $6";

/// Opens a batch's transaction, pinning how its array statements are planned (`SET LOCAL`:
/// for this transaction only, so a pool shared with the application keeps its settings).
///
/// Left to itself the planner joins the input arrays to the table by whatever looks cheapest
/// under the table's statistics. On a new or freshly emptied table (no statistics yet, a few
/// pages) that is a sequential scan, and a connection caches such a plan: every later batch on
/// it then reads the whole table, slower as the table grows. Small batches would otherwise be
/// re-planned on every execution too (their custom plans look cheaper than the generic one).
/// Every statement here looks rows up by primary key, so index lookups are right at any size.
pub(super) const BEGIN_SQL: &str = "BEGIN; \
SET LOCAL enable_seqscan = off; SET LOCAL enable_hashjoin = off; \
SET LOCAL enable_mergejoin = off; SET LOCAL plan_cache_mode = force_generic_plan";

/// [`CLAIM_SQL`] for many distinct keys at once. Returns `scope, key` and the columns of
/// [`CLAIM_SQL`], a row per key.
///
/// The keys are claimed in the order of their advisory locks' hashes, so two batches (on this
/// instance or another) take those locks in one order and cannot deadlock each other on them.
pub(super) const CLAIM_MANY_SQL: &str = "\
SELECT u.scope, u.key, c.* FROM ( \
  SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[], $6::int8[], \
    $7::int8[], $8::int8[], $10::text[]) \
    AS i(scope, key, fingerprint, lease_until, now, expires_at, class_ms, width_ms, skip) \
  ORDER BY hashtextextended(i.key, hashtext(i.scope)), i.scope, i.key OFFSET 0) u \
CROSS JOIN LATERAL backstop_idempotency_claim(u.scope, u.key, u.fingerprint, u.lease_until, \
  u.now, u.expires_at, u.class_ms, u.width_ms, $9, string_to_array(u.skip, ',')) c";

/// [`COMPLETE_SQL`] for many records; returns the `ord` of each input that was applied.
pub(super) const COMPLETE_MANY_SQL: &str = "\
UPDATE idempotency_record k SET status = 'succeeded', http_status = u.http_status, \
  response_body = u.body, response_headers = u.headers, \
  expires_at = GREATEST(k.expires_at, u.keep_until) \
FROM unnest($1::text[], $2::text[], $3::int8[], $4::int4[], $5::bytea[], $6::text[], $7::int8[], \
    $8::int8[], $9::int8[], $10::int8[]) \
  WITH ORDINALITY AS u(scope, key, token, http_status, body, headers, keep_until, class_ms, lo, \
    hi, ord) \
WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'running' AND k.lease_until = u.token \
  AND k.class_ms = u.class_ms AND k.win BETWEEN u.lo AND u.hi \
RETURNING u.ord";

/// [`FAIL_SQL`] for many records.
pub(super) const FAIL_MANY_SQL: &str = "\
UPDATE idempotency_record k SET status = 'failed', expires_at = GREATEST(k.expires_at, u.keep_until) \
FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[]) \
  WITH ORDINALITY AS u(scope, key, token, keep_until, class_ms, lo, hi, ord) \
WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'running' AND k.lease_until = u.token \
  AND k.class_ms = u.class_ms AND k.win BETWEEN u.lo AND u.hi \
RETURNING u.ord";

/// [`RELEASE_SQL`] for many records.
pub(super) const RELEASE_MANY_SQL: &str = "\
DELETE FROM idempotency_record k \
USING unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[], $6::int8[]) \
  WITH ORDINALITY AS u(scope, key, token, class_ms, lo, hi, ord) \
WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'running' AND k.lease_until = u.token \
  AND k.class_ms = u.class_ms AND k.win BETWEEN u.lo AND u.hi \
RETURNING u.ord";

/// A record, for `get`.
pub(super) const GET_SQL: &str = "SELECT fingerprint, status, lease_until, http_status, response_body, \
     response_headers, created_at, expires_at, phase, phase_data FROM idempotency_record \
     WHERE scope = $1 AND key = $2";

/// Expired records, up to `$2`, never a running one whose lease is live; rows other
/// sweepers hold are skipped rather than waited for.
pub(super) const SWEEP_SQL: &str = "\
DELETE FROM idempotency_record \
WHERE (scope, key) IN ( \
    SELECT scope, key FROM idempotency_record \
    WHERE expires_at <= $1 AND NOT (status = 'running' AND lease_until > $1) \
    ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED) \
  AND expires_at <= $1 AND NOT (status = 'running' AND lease_until > $1)";

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection to the test database with `schema` first on its search path.
    async fn connect(schema: &str) -> tokio_postgres::Client {
        let url = crate::test_services::postgres_url();
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect to the test database");
        tokio::spawn(connection);
        client
            .batch_execute(&format!("SET search_path = {schema}"))
            .await
            .expect("search path");
        client
    }

    /// A TTL class whose windows are decades wide: the current one stays the same for the
    /// length of any test.
    const CLASS: i64 = 1_000 * 365 * 86_400_000;

    fn width() -> i64 {
        crate::idempotency::window::Window {
            class_ms: CLASS,
            index: 0,
        }
        .width_ms()
    }

    /// A new schema holding the store's tables and the current window of [`CLASS`].
    async fn schema_with_window(client: &tokio_postgres::Client, schema: &str) {
        let now_ms = i64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis(),
        )
        .unwrap();
        let window = crate::idempotency::window::Window {
            class_ms: CLASS,
            index: now_ms / width(),
        };
        client
            .batch_execute(&format!(
                "CREATE SCHEMA {schema}; SET search_path = {schema}; {} BEGIN; {} COMMIT;",
                super::super::MIGRATION_V3,
                super::super::windows::create_sql(window),
            ))
            .await
            .expect("create tables");
    }

    /// A new schema holding the store's tables, with a record of `k` running under a live
    /// lease (until 10 000). Answers the schema's name.
    async fn schema_with_a_running_record(prefix: &str) -> String {
        let schema = format!("{prefix}_{}_{}", std::process::id(), rand::random::<u32>());
        let client = connect("public").await;
        schema_with_window(&client, &schema).await;
        client
            .batch_execute(&format!(
                "INSERT INTO idempotency_record (scope, key, fingerprint, status, lease_until, \
                   created_at, expires_at, class_ms, win) \
                 SELECT 's', 'k', 'f', 'running', 10000, 1000, 999999, {CLASS}, \
                   (extract(epoch FROM clock_timestamp()) * 1000)::int8 / {}",
                width()
            ))
            .await
            .expect("insert the record");
        schema
    }

    /// Runs a claim of `k` (at 12 000, after the record's lease ended: a takeover, the one
    /// claim that locks the row) by `claim` while another transaction holds the record,
    /// changed by `change` but not committed: the claim's statement starts while the record
    /// stands as it was, and waits for the row. Then the change commits, and the claim's rows
    /// are answered.
    async fn claim_behind(
        prefix: &str,
        change: &str,
        claim: impl for<'c> FnOnce(
            &'c tokio_postgres::Client,
        ) -> futures_util::future::BoxFuture<
            'c,
            Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>,
        > + Send
        + 'static,
    ) -> Vec<tokio_postgres::Row> {
        let schema = schema_with_a_running_record(prefix).await;
        let holder = connect(&schema).await;
        holder
            .batch_execute(&format!("BEGIN; {change}"))
            .await
            .expect("change the record");
        let claimer = connect(&schema).await;
        let pid: i32 = claimer
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("pid")
            .get(0);
        let claiming = tokio::spawn(async move { claim(&claimer).await });
        // Until the claim waits for the holder's row lock.
        let watcher = connect(&schema).await;
        loop {
            let waiting: bool = watcher
                .query_one(
                    "SELECT count(*) > 0 FROM pg_stat_activity \
                     WHERE pid = $1 AND wait_event_type = 'Lock'",
                    &[&pid],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            if waiting {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        holder.batch_execute("COMMIT").await.expect("commit");
        let rows = claiming.await.unwrap().expect("claim");
        watcher
            .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
            .expect("drop schema");
        rows
    }

    const RELEASE: &str = "DELETE FROM idempotency_record WHERE key = 'k';";
    const FAIL: &str = "UPDATE idempotency_record SET status = 'failed' WHERE key = 'k';";

    fn claim_one(
        client: &tokio_postgres::Client,
    ) -> futures_util::future::BoxFuture<'_, Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>>
    {
        Box::pin(async move {
            let (lease, now, expires) = (19_000_i64, 12_000_i64, 999_999_i64);
            client
                .query(
                    CLAIM_SQL,
                    &[
                        &"s",
                        &"k",
                        &"f",
                        &lease,
                        &now,
                        &expires,
                        &CLASS,
                        &width(),
                        &0_i64,
                        &Vec::<String>::new(),
                    ],
                )
                .await
        })
    }

    fn claim_many(
        client: &tokio_postgres::Client,
    ) -> futures_util::future::BoxFuture<'_, Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>>
    {
        Box::pin(async move {
            client.batch_execute(BEGIN_SQL).await?;
            let rows = client
                .query(
                    CLAIM_MANY_SQL,
                    &[
                        &vec!["s", "s"],
                        &vec!["j", "k"],
                        &vec!["f", "f"],
                        &vec![19_000_i64, 19_000],
                        &vec![12_000_i64, 12_000],
                        &vec![999_999_i64, 999_999],
                        &vec![CLASS, CLASS],
                        &vec![width(), width()],
                        &0_i64,
                        &vec![String::new(), String::new()],
                    ],
                )
                .await?;
            client.batch_execute("COMMIT").await?;
            Ok(rows)
        })
    }

    /// `(taken, prior status)` of the claim of `k` among `rows`, the status at `at`.
    fn taken_k(
        rows: &[tokio_postgres::Row],
        key_at: Option<usize>,
        at: usize,
    ) -> (bool, Option<String>) {
        let row = rows
            .iter()
            .filter(|row| key_at.is_none_or(|i| row.get::<_, &str>(i) == "k"))
            .find(|row| row.get::<_, Option<bool>>(at) == Some(true))
            .expect("the claim of k was taken");
        (true, row.get(at + 3))
    }

    /// A record released while a claim of its key waits for it: the claim inserts a new record,
    /// and says so (no prior status), though its statement started while the record stood.
    /// It used to read the prior status from the statement's snapshot (`running`): a fresh
    /// claim taken for the takeover of an abandoned run, answered `outcome_unknown` on a
    /// `Refuse` route with nothing run.
    #[tokio::test]
    async fn a_claim_behind_a_release_is_a_fresh_insert() {
        if !crate::test_services::postgres() {
            return;
        }
        let rows = claim_behind("claim_release", RELEASE, claim_one).await;
        assert_eq!(taken_k(&rows, None, 0), (true, None));
        let rows = claim_behind("claim_many_release", RELEASE, claim_many).await;
        assert_eq!(taken_k(&rows, Some(1), 2), (true, None));
    }

    /// A record failed while a claim of its key waits for it: the claim takes it over, and
    /// knows that its run failed (not that it was abandoned).
    #[tokio::test]
    async fn a_claim_behind_a_fail_takes_over_a_failed_run() {
        if !crate::test_services::postgres() {
            return;
        }
        let failed = Some("failed".to_owned());
        let rows = claim_behind("claim_fail", FAIL, claim_one).await;
        assert_eq!(taken_k(&rows, None, 0), (true, failed.clone()));
        let rows = claim_behind("claim_many_fail", FAIL, claim_many).await;
        assert_eq!(taken_k(&rows, Some(1), 2), (true, failed));
    }

    /// On a new, empty table (where the planner, left to itself, reads the whole table: cheap
    /// then, but a connection keeps that plan as the table grows), every array statement,
    /// planned as in a batch, reaches the table by its primary key only: no sequential scan,
    /// no hash or merge join.
    #[tokio::test]
    async fn batch_statements_look_rows_up_by_primary_key_on_a_new_table() {
        if !crate::test_services::postgres() {
            return;
        }
        let url = crate::test_services::postgres_url();
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect to the test database");
        tokio::spawn(connection);
        let schema = format!(
            "batch_plans_{}_{}",
            std::process::id(),
            rand::random::<u32>()
        );
        schema_with_window(&client, &schema).await;
        let (s, k, n) = ("'{s,s,s,s}'", "'{a,b,c,d}'", "'{5,5,5,5}'");
        // Where: the class, and the windows from 0 to the largest.
        let place = format!(
            "'{{{CLASS},{CLASS},{CLASS},{CLASS}}}', '{{0,0,0,0}}', '{{{m},{m},{m},{m}}}'",
            m = i64::MAX
        );
        let statements = [
            (
                COMPLETE_MANY_SQL,
                format!(
                    "{s}, {k}, {n}, '{{201,201,201,201}}', '{{x,x,x,x}}', '{{h,h,h,h}}', {n}, {place}"
                ),
            ),
            (FAIL_MANY_SQL, format!("{s}, {k}, {n}, {n}, {place}")),
            (RELEASE_MANY_SQL, format!("{s}, {k}, {n}, {place}")),
        ];
        let mut plans = Vec::new();
        for (i, (sql, args)) in statements.iter().enumerate() {
            client
                .batch_execute(&format!("PREPARE many{i} AS {sql}"))
                .await
                .expect("prepare");
            client.batch_execute(BEGIN_SQL).await.expect("begin");
            let rows = client
                .simple_query(&format!("EXPLAIN EXECUTE many{i}({args})"))
                .await
                .expect("explain");
            client.batch_execute("ROLLBACK").await.expect("rollback");
            let plan: Vec<String> = rows
                .iter()
                .filter_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                    _ => None,
                })
                .collect();
            plans.push(plan.join("\n"));
        }
        client
            .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
            .expect("drop schema");
        for plan in plans {
            assert!(plan.contains("_pkey"), "{plan}");
            for whole_table in ["Seq Scan on idempotency_window", "Hash", "Merge"] {
                assert!(!plan.contains(whole_table), "{plan}");
            }
        }
    }
}
