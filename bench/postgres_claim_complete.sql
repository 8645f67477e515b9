-- One claim + complete pair: the PostgreSQL store's two statements (crates/backstop/src/
-- idempotency/postgres/batch.rs, CLAIM_SQL and COMPLETE_SQL) with the values the store bench
-- uses, each in autocommit. Run by bench/postgres.sh with pgbench -M prepared.
\set n random(1, 1000000000000)
WITH taken AS (
  INSERT INTO idempotency_key AS k
    (scope, key, fingerprint, status, lease_until, created_at, expires_at)
  VALUES ('bench', :client_id::text || '-' || :n::text,
    'c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00', 'running',
    1700000005000, 1700000000000, 1700086400000)
  ON CONFLICT (scope, key) DO UPDATE SET status = 'running',
    lease_until = GREATEST(EXCLUDED.lease_until, k.lease_until + 1),
    expires_at = GREATEST(k.expires_at, EXCLUDED.expires_at),
    http_status = NULL, response_body = NULL, response_headers = NULL
  WHERE k.fingerprint = EXCLUDED.fingerprint
    AND (k.status = 'failed' OR (k.status = 'running' AND k.lease_until <= EXCLUDED.created_at))
  RETURNING k.lease_until)
SELECT true, lease_until, NULL::text, NULL::text, NULL::integer, NULL::bytea, NULL::text
  FROM taken
UNION ALL
SELECT false, lease_until, fingerprint, status, http_status, response_body, response_headers
  FROM idempotency_key
  WHERE scope = 'bench' AND key = :client_id::text || '-' || :n::text
    AND NOT EXISTS (SELECT 1 FROM taken);
UPDATE idempotency_key SET status = 'succeeded', http_status = 201,
  response_body = convert_to('{"id":"pi_0123456789","status":"succeeded","amount_cents":1000,"currency":"USD"}', 'UTF8'),
  response_headers = '[["content-type","application/json"]]',
  expires_at = GREATEST(expires_at, 1700086400000)
WHERE scope = 'bench' AND key = :client_id::text || '-' || :n::text
  AND status = 'running' AND lease_until = 1700000005000;
