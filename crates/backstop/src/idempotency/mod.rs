//! Idempotency: keys, fingerprints, the dedup store and its backends (seed 2.4).

#[cfg(feature = "sqlite")]
pub mod sqlite;
