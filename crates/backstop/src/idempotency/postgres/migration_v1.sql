CREATE TABLE idempotency_key (
  scope            TEXT    NOT NULL,  -- tenant / merchant: keys never collide across scopes
  key              TEXT    NOT NULL,
  fingerprint      TEXT    NOT NULL,
  status           TEXT    NOT NULL CHECK (status IN ('running','succeeded','failed')),
  lease_until      BIGINT  NOT NULL,  -- unix ms; the fencing token of the current claim
  http_status      INTEGER,
  response_body    BYTEA,             -- bytes kept exactly
  response_headers TEXT,              -- JSON [[name, value], ...]
  created_at       BIGINT  NOT NULL,
  expires_at       BIGINT  NOT NULL,
  phase            TEXT,              -- recovery point: the last phase committed
  phase_data       BYTEA,             -- and what it recorded
  PRIMARY KEY (scope, key)
);

CREATE INDEX idx_idem_expires ON idempotency_key (expires_at);
