-- Records in time windows: one parent partitioned by (TTL class, window), a partition per
-- window (created ahead of time by the store, see windows.rs), and the claim as one function.
CREATE TABLE idempotency_record (
  scope            TEXT    NOT NULL,  -- tenant / merchant: keys never collide across scopes
  key              TEXT    NOT NULL,
  fingerprint      TEXT    NOT NULL,
  status           TEXT    NOT NULL,  -- 'running', 'succeeded', 'failed' (checked per window)
  lease_until      BIGINT  NOT NULL,  -- unix ms; the fencing token of the current claim
  http_status      INTEGER,
  response_body    BYTEA,             -- bytes kept exactly
  response_headers TEXT,              -- JSON [[name, value], ...]
  created_at       BIGINT  NOT NULL,
  expires_at       BIGINT  NOT NULL,
  phase            TEXT,
  phase_data       BYTEA,
  class_ms         BIGINT  NOT NULL,  -- TTL class; 0: the single-table layout's records
  win              BIGINT  NOT NULL   -- window of the class: placement time / width
) PARTITION BY RANGE (class_ms, win);

-- A database of the single-table layout keeps its table as the window (0, 0): sealed, its
-- records found, moved out on takeover, swept, and the table dropped once all have expired.
-- The CHECK spares ATTACH its validating scan.
DO $$
BEGIN
  IF to_regclass('idempotency_key') IS NOT NULL THEN
    ALTER TABLE idempotency_key
      ADD COLUMN class_ms BIGINT NOT NULL DEFAULT 0,
      ADD COLUMN win BIGINT NOT NULL DEFAULT 0,
      ADD CONSTRAINT idempotency_key_bound CHECK (class_ms = 0 AND win = 0);
    ALTER TABLE idempotency_record
      ATTACH PARTITION idempotency_key FOR VALUES FROM (0, 0) TO (0, 1);
  END IF;
END $$;

-- The claim, in one call: the key's advisory lock first, then (each statement of a volatile
-- function reading a fresh snapshot) the record in whichever window holds it, and the insert
-- into the current window or the takeover that moves the record there. A window missing for
-- the placement time is answered in `need_window`, with nothing written; a taken record's
-- window in `placed_win`.
--
-- The record is looked for in every partition but those named in `p_skip`: sealed windows the
-- caller's summaries rule out (a sealed window's key set only shrinks). Each is read by its own
-- statement, so a claim reads the index of the few windows that may hold its key, not of all.
--
-- The record's row is locked only for a takeover. A claim that finds the key held, done or
-- under another request's parameters answers from what it read: holding the advisory lock
-- while waiting for the row's lock (which a phase or a completion of the holder takes without
-- the advisory lock, in a transaction shared with other requests' units) would wait in the
-- opposite order to a claim of the same key in that shared transaction, a deadlock.
--
-- An insert is placed by the clock read before it; the clock is read again after it, and a
-- claim whose window ended in between fails with SQLSTATE BK001 (nothing written; the caller
-- claims again). So every record of a window was inserted before the window's end, by a
-- transaction that holds the partition's lock from then on: a summary built after the window
-- ended, behind a lock that waits for those transactions, holds every key the window will.
CREATE FUNCTION backstop_idempotency_claim(
  p_scope text, p_key text, p_fingerprint text, p_lease_until bigint, p_now bigint,
  p_expires_at bigint, p_class_ms bigint, p_width_ms bigint, p_clock_offset_ms bigint,
  p_skip text[])
RETURNS TABLE (taken boolean, lease_until bigint, fingerprint text, status text,
  http_status integer, response_body bytea, response_headers text, created_at bigint,
  phase text, phase_data bytea, need_window bigint, placed_win bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
  held idempotency_record%ROWTYPE;
  moved idempotency_record%ROWTYPE;
  current_win bigint;
  existed boolean := false;
  part regclass;
BEGIN
  PERFORM pg_advisory_xact_lock(hashtextextended(p_key, hashtext(p_scope)));
  current_win := ((extract(epoch FROM clock_timestamp()) * 1000)::bigint + p_clock_offset_ms)
    / p_width_ms;
  FOR part IN SELECT c.oid::regclass FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
      WHERE i.inhparent = 'idempotency_record'::regclass
        AND NOT (c.relname = ANY (coalesce(p_skip, '{}')))
  LOOP
    EXECUTE format('SELECT * FROM %s r WHERE r.scope = $1 AND r.key = $2', part)
      INTO held USING p_scope, p_key;
    IF held.key IS NOT NULL THEN
      existed := true;
      EXIT;
    END IF;
  END LOOP;
  IF existed AND held.fingerprint = p_fingerprint AND (held.status = 'failed'
      OR (held.status = 'running' AND held.lease_until <= p_now)) THEN
    -- A takeover: read the record again under its lock (a completion may have landed since).
    SELECT * INTO held FROM idempotency_record r
      WHERE r.scope = p_scope AND r.key = p_key FOR UPDATE;
    existed := FOUND;
  END IF;
  IF existed AND NOT (held.fingerprint = p_fingerprint AND (held.status = 'failed'
      OR (held.status = 'running' AND held.lease_until <= p_now))) THEN
    RETURN QUERY SELECT false, held.lease_until, held.fingerprint, held.status,
      held.http_status, held.response_body, held.response_headers, held.created_at,
      held.phase, held.phase_data, NULL::bigint, NULL::bigint;
    RETURN;
  END IF;
  IF to_regclass(format('idempotency_window_%s_%s', p_class_ms, current_win)) IS NULL THEN
    RETURN QUERY SELECT NULL::boolean, NULL::bigint, NULL::text, NULL::text, NULL::integer,
      NULL::bytea, NULL::text, NULL::bigint, NULL::text, NULL::bytea, current_win,
      NULL::bigint;
    RETURN;
  END IF;
  IF NOT existed THEN
    INSERT INTO idempotency_record AS r (scope, key, fingerprint, status, lease_until,
      created_at, expires_at, class_ms, win)
    VALUES (p_scope, p_key, p_fingerprint, 'running', p_lease_until, p_now, p_expires_at,
      p_class_ms, current_win);
    PERFORM backstop_idempotency_placed_in_time(current_win, p_width_ms, p_clock_offset_ms);
    RETURN QUERY SELECT true, p_lease_until, NULL::text, NULL::text, NULL::integer,
      NULL::bytea, NULL::text, p_now, NULL::text, NULL::bytea, NULL::bigint, current_win;
    RETURN;
  END IF;
  -- Failed, or the lease ended: the new lease_until is the fencing token, so it moves strictly
  -- forward; the record moves into the current window (a sealed window is never renewed).
  UPDATE idempotency_record r SET status = 'running',
    lease_until = GREATEST(p_lease_until, r.lease_until + 1),
    expires_at = GREATEST(r.expires_at, p_expires_at),
    http_status = NULL, response_body = NULL, response_headers = NULL,
    class_ms = p_class_ms, win = current_win
  WHERE r.scope = p_scope AND r.key = p_key
  RETURNING r.* INTO moved;
  PERFORM backstop_idempotency_placed_in_time(current_win, p_width_ms, p_clock_offset_ms);
  RETURN QUERY SELECT true, moved.lease_until, NULL::text, held.status, NULL::integer,
    NULL::bytea, NULL::text, moved.created_at, moved.phase, moved.phase_data, NULL::bigint,
    current_win;
END
$fn$;

-- Fails with SQLSTATE BK001 once the clock has left window `p_win`: a record written there
-- now may have come after the window's summary was read.
CREATE FUNCTION backstop_idempotency_placed_in_time(
  p_win bigint, p_width_ms bigint, p_clock_offset_ms bigint)
RETURNS void LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
  IF ((extract(epoch FROM clock_timestamp()) * 1000)::bigint + p_clock_offset_ms) / p_width_ms
      <> p_win THEN
    RAISE EXCEPTION 'idempotency window % ended during the claim', p_win
      USING ERRCODE = 'BK001';
  END IF;
END
$fn$;
