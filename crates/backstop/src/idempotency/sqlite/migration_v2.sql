-- v2: the same table WITHOUT ROWID, clustered on its primary key. Every write then touches one
-- b-tree for the row instead of two (the rowid table plus the primary-key index). Existing rows
-- are copied over, so records written under v1 stay readable.
CREATE TABLE idempotency_key_v2 (
  scope            TEXT    NOT NULL,  -- tenant / merchant: keys never collide across scopes
  key              TEXT    NOT NULL,
  fingerprint      TEXT    NOT NULL,
  status           TEXT    NOT NULL CHECK (status IN ('running','succeeded','failed')),
  lease_until      INTEGER NOT NULL,  -- unix ms; the fencing token of the current claim
  http_status      INTEGER,
  response_body    TEXT,              -- written as a BLOB: bytes kept exactly
  response_headers TEXT,              -- JSON [[name, value], ...]
  created_at       INTEGER NOT NULL,
  expires_at       INTEGER NOT NULL,
  PRIMARY KEY (scope, key)
) WITHOUT ROWID;

INSERT INTO idempotency_key_v2
  (scope, key, fingerprint, status, lease_until, http_status, response_body, response_headers,
   created_at, expires_at)
SELECT scope, key, fingerprint, status, lease_until, http_status, response_body, response_headers,
       created_at, expires_at
FROM idempotency_key;

DROP TABLE idempotency_key;
ALTER TABLE idempotency_key_v2 RENAME TO idempotency_key;
CREATE INDEX idx_idem_expires ON idempotency_key (expires_at);
