//! The idempotency store's SQL, apart from the writer that sends it.
//!
//! Each decision is one statement on `idempotency_key`, correct under READ COMMITTED with any
//! number of instances (see the parent module). The `*_MANY_SQL` variants run the same
//! decision for many records at once: a batch sends claims of distinct keys as one statement
//! over arrays (`unnest ... WITH ORDINALITY`), completions as another, and so on.

/// `INSERT` a running record, or take over a failed / expired one with the same fingerprint by
/// a conditional `DO UPDATE` (the row lock makes concurrent takeovers see each other: exactly one
/// wins); when neither happened, return the record as it stood.
///
/// A taken record's status before the claim (none for an insert) comes from `prior`, which
/// locks the record first and reads its latest committed version, before the insert is
/// tried. Read in `RETURNING` from the statement's snapshot instead, it was the record as it
/// stood when the statement began: a record released (deleted) or failed by a transaction that
/// committed while the claim waited for its row came out `running`, and the claim looked like
/// the takeover of an abandoned run.
pub(super) const CLAIM_SQL: &str = "\
WITH prior AS ( \
  SELECT status FROM idempotency_key WHERE scope = $1 AND key = $2 FOR UPDATE), \
taken AS ( \
  INSERT INTO idempotency_key AS k \
    (scope, key, fingerprint, status, lease_until, created_at, expires_at) \
  SELECT $1::text, $2::text, $3::text, 'running', $4::int8, $5::int8, $6::int8 \
    WHERE (SELECT count(*) FROM prior) >= 0 \
  ON CONFLICT (scope, key) DO UPDATE SET status = 'running', \
    lease_until = GREATEST(EXCLUDED.lease_until, k.lease_until + 1), \
    expires_at = GREATEST(k.expires_at, EXCLUDED.expires_at), \
    http_status = NULL, response_body = NULL, response_headers = NULL \
  WHERE k.fingerprint = EXCLUDED.fingerprint \
    AND (k.status = 'failed' OR (k.status = 'running' AND k.lease_until <= EXCLUDED.created_at)) \
  RETURNING k.lease_until, k.created_at, k.phase, k.phase_data, \
    (SELECT status FROM prior) AS prior) \
SELECT true, lease_until, NULL::text, prior, NULL::integer, NULL::bytea, NULL::text, \
  created_at, phase, phase_data FROM taken \
UNION ALL \
SELECT false, lease_until, fingerprint, status, http_status, response_body, response_headers, \
  created_at, phase, phase_data \
  FROM idempotency_key \
  WHERE scope = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM taken)";

/// Records a phase's recovery point, if the lease still holds the record.
pub(super) const PHASE_SQL: &str = "\
UPDATE idempotency_key SET phase = $4, phase_data = $5 \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3";

/// Store the response, if the lease (fencing token) still holds the record.
pub(super) const COMPLETE_SQL: &str = "\
UPDATE idempotency_key SET status = 'succeeded', http_status = $4, response_body = $5, \
  response_headers = $6, expires_at = GREATEST(expires_at, $7) \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3";

/// Mark failed, if the lease still holds the record.
pub(super) const FAIL_SQL: &str = "\
UPDATE idempotency_key SET status = 'failed', expires_at = GREATEST(expires_at, $4) \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3";

/// Forget the key, if the lease still holds the record.
pub(super) const RELEASE_SQL: &str = "\
DELETE FROM idempotency_key \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3";

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

/// [`CLAIM_SQL`] for many distinct keys at once. Returns `scope, key, taken, lease_until,
/// fingerprint, status, http_status, response_body, response_headers`: a row per key taken,
/// and a row per key that already had a record as of the statement's snapshot (the
/// record as it stood; a takeover has both). A key with neither vanished in between.
///
/// Answers are matched to callers by key rather than by joining the inputs to what was taken:
/// with hash joins off (see [`BEGIN_SQL`]) that join would compare every pair of rows.
///
/// As in [`CLAIM_SQL`], `prior` locks the existing records (in the batch's key order, as the
/// insert does) and reads their latest committed status before the insert is tried.
pub(super) const CLAIM_MANY_SQL: &str = "\
WITH input AS ( \
  SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[], $6::int8[]) \
    WITH ORDINALITY AS u(scope, key, fingerprint, lease_until, now, expires_at, ord)), \
prior AS ( \
  SELECT k.scope, k.key, k.status FROM input i \
    JOIN idempotency_key k ON k.scope = i.scope AND k.key = i.key \
  ORDER BY i.ord FOR UPDATE OF k), \
taken AS ( \
  INSERT INTO idempotency_key AS k \
    (scope, key, fingerprint, status, lease_until, created_at, expires_at) \
  SELECT scope, key, fingerprint, 'running', lease_until, now, expires_at FROM input \
    WHERE (SELECT count(*) FROM prior) >= 0 ORDER BY ord \
  ON CONFLICT (scope, key) DO UPDATE SET status = 'running', \
    lease_until = GREATEST(EXCLUDED.lease_until, k.lease_until + 1), \
    expires_at = GREATEST(k.expires_at, EXCLUDED.expires_at), \
    http_status = NULL, response_body = NULL, response_headers = NULL \
  WHERE k.fingerprint = EXCLUDED.fingerprint \
    AND (k.status = 'failed' OR (k.status = 'running' AND k.lease_until <= EXCLUDED.created_at)) \
  RETURNING k.scope, k.key, k.lease_until, k.created_at, k.phase, k.phase_data, \
    (SELECT p.status FROM prior p WHERE p.scope = k.scope AND p.key = k.key) AS prior) \
SELECT scope, key, true, lease_until, NULL::text, prior, NULL::integer, NULL::bytea, \
  NULL::text, created_at, phase, phase_data \
FROM taken \
UNION ALL \
SELECT k.scope, k.key, false, k.lease_until, k.fingerprint, k.status, k.http_status, \
  k.response_body, k.response_headers, k.created_at, k.phase, k.phase_data \
FROM input i JOIN idempotency_key k ON k.scope = i.scope AND k.key = i.key";

/// [`COMPLETE_SQL`] for many records; returns the `ord` of each input that was applied.
pub(super) const COMPLETE_MANY_SQL: &str = "\
UPDATE idempotency_key k SET status = 'succeeded', http_status = u.http_status, \
  response_body = u.body, response_headers = u.headers, \
  expires_at = GREATEST(k.expires_at, u.keep_until) \
FROM unnest($1::text[], $2::text[], $3::int8[], $4::int4[], $5::bytea[], $6::text[], $7::int8[]) \
  WITH ORDINALITY AS u(scope, key, token, http_status, body, headers, keep_until, ord) \
WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'running' AND k.lease_until = u.token \
RETURNING u.ord";

/// [`FAIL_SQL`] for many records.
pub(super) const FAIL_MANY_SQL: &str = "\
UPDATE idempotency_key k SET status = 'failed', expires_at = GREATEST(k.expires_at, u.keep_until) \
FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[]) \
  WITH ORDINALITY AS u(scope, key, token, keep_until, ord) \
WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'running' AND k.lease_until = u.token \
RETURNING u.ord";

/// [`RELEASE_SQL`] for many records.
pub(super) const RELEASE_MANY_SQL: &str = "\
DELETE FROM idempotency_key k \
USING unnest($1::text[], $2::text[], $3::int8[]) WITH ORDINALITY AS u(scope, key, token, ord) \
WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'running' AND k.lease_until = u.token \
RETURNING u.ord";

/// A record, for `get`.
pub(super) const GET_SQL: &str = "SELECT fingerprint, status, lease_until, http_status, response_body, \
     response_headers, created_at, expires_at, phase, phase_data FROM idempotency_key \
     WHERE scope = $1 AND key = $2";

/// Expired records, up to `$2`, never a running one whose lease is live; rows other
/// sweepers hold are skipped rather than waited for.
pub(super) const SWEEP_SQL: &str = "\
DELETE FROM idempotency_key \
WHERE (scope, key) IN ( \
    SELECT scope, key FROM idempotency_key \
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

    /// A new schema holding the store's table, with a record of `k` running under a live
    /// lease (until 10 000). Answers the schema's name.
    async fn schema_with_a_running_record(prefix: &str) -> String {
        let schema = format!("{prefix}_{}_{}", std::process::id(), rand::random::<u32>());
        let client = connect("public").await;
        client
            .batch_execute(&format!(
                "CREATE SCHEMA {schema}; SET search_path = {schema}; {} \
                 INSERT INTO idempotency_key \
                   (scope, key, fingerprint, status, lease_until, created_at, expires_at) \
                 VALUES ('s', 'k', 'f', 'running', 10000, 1000, 999999);",
                super::super::MIGRATION,
            ))
            .await
            .expect("create table");
        schema
    }

    /// Runs a claim of `k` (at 2 000, inside the record's lease) by `claim` while another
    /// transaction holds the record, changed by `change` but not committed: the claim's
    /// statement starts while the record stands as it was, and waits for the row. Then the
    /// change commits, and the claim's rows are answered.
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

    const RELEASE: &str = "DELETE FROM idempotency_key WHERE key = 'k';";
    const FAIL: &str = "UPDATE idempotency_key SET status = 'failed' WHERE key = 'k';";

    fn claim_one(
        client: &tokio_postgres::Client,
    ) -> futures_util::future::BoxFuture<'_, Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>>
    {
        Box::pin(async move {
            let (lease, now, expires) = (7_000_i64, 2_000_i64, 999_999_i64);
            client
                .query(CLAIM_SQL, &[&"s", &"k", &"f", &lease, &now, &expires])
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
                        &vec![7_000_i64, 7_000],
                        &vec![2_000_i64, 2_000],
                        &vec![999_999_i64, 999_999],
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
            .find(|row| row.get::<_, bool>(at))
            .expect("the claim of k was taken");
        (row.get(at), row.get(at + 3))
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
        client
            .batch_execute(&format!(
                "CREATE SCHEMA {schema}; SET search_path = {schema}; {}",
                super::super::MIGRATION,
            ))
            .await
            .expect("create table");
        let (s, k, n) = ("'{s,s,s,s}'", "'{a,b,c,d}'", "'{5,5,5,5}'");
        let statements = [
            (
                CLAIM_MANY_SQL,
                format!("{s}, {k}, '{{f,f,f,f}}', {n}, {n}, {n}"),
            ),
            (
                COMPLETE_MANY_SQL,
                format!("{s}, {k}, {n}, '{{201,201,201,201}}', '{{x,x,x,x}}', '{{h,h,h,h}}', {n}"),
            ),
            (FAIL_MANY_SQL, format!("{s}, {k}, {n}, {n}")),
            (RELEASE_MANY_SQL, format!("{s}, {k}, {n}")),
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
            assert!(plan.contains("idempotency_key_pkey"), "{plan}");
            for whole_table in ["Seq Scan on idempotency_key", "Hash", "Merge"] {
                assert!(!plan.contains(whole_table), "{plan}");
            }
        }
    }
}
