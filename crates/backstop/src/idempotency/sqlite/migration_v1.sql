CREATE TABLE idempotency_key (
  scope            TEXT    NOT NULL,
  key              TEXT    NOT NULL,
  fingerprint      TEXT    NOT NULL,
  status           TEXT    NOT NULL CHECK (status IN ('running','succeeded','failed')),
  lease_until      INTEGER NOT NULL,
  http_status      INTEGER,
  response_body    TEXT,
  response_headers TEXT,
  created_at       INTEGER NOT NULL,
  expires_at       INTEGER NOT NULL,
  PRIMARY KEY (scope, key)
);

CREATE INDEX idx_idem_expires ON idempotency_key (expires_at);
